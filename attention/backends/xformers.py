"""xformers ``memory_efficient_attention`` (layout ``[B, N, H, D]``)."""

from __future__ import annotations

import torch

from ..constraints import DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, SameHeadDimV
from ..registry import REGISTRY, Availability, Backend, import_probe


def _probe():
    av = import_probe("xformers.ops", attr="memory_efficient_attention")()
    if not av.ok:
        return av
    import xformers

    if not getattr(xformers, "_has_cpp_library", True):
        from xformers import _cpp_lib

        exc = _cpp_lib._cpp_library_load_exception
        info = getattr(exc, "build_info", None)
        built = f" (built for torch {info.torch_version}, this is torch {torch.__version__})" if info else ""
        return Availability(False, f"xformers {av.version} cannot load its CUDA kernels{built}")
    return av


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """xformers wants a float bias of shape [B, H, Nq, Nk] whose rows are 8-aligned in memory."""
    b, nq, h, _ = q.shape
    nk = k.shape[1]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    pad = (-nk) % 8
    full = torch.empty((b, h, nq, nk + pad), dtype=q.dtype, device=q.device)
    full[..., :nk] = mask.to(q.dtype)
    return full[..., :nk]


def _xformers(q, k, v, *, layout, mask, scale, opts):
    import xformers.ops as xops

    bias = None if mask is None else _bias(mask, q, k)
    return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)


REGISTRY.register(
    Backend(
        name="xformers",
        family="xformers",
        fn=_xformers,
        constraints=(
            DeviceTypes(("cuda",)),
            DTypes((torch.float32, torch.float16, torch.bfloat16)),
            HeadDims(max=256, multiple_of=8),
            Masks(("bool", "float")),
            GroupedQuery(False),
            SameHeadDimV(),
        ),
        layouts=("NHD",),
        probe=_probe,
        description="xformers memory_efficient_attention",
    )
)
