"""PyTorch scaled_dot_product_attention, and each of its kernels called directly.

Nothing here touches PyTorch's process-wide SDPA switches (``sdpa_kernel``, ``enable_*_sdp``, the priority order).
ComfyUI samples conds on several GPUs in threads (MultiGPU CFG Split), and such a switch made by one thread is seen by
every other SDPA call in the process while it lasts -- or for good, when two threads leave their contexts in the
wrong order.  ``sdpa`` lets PyTorch choose its kernel as it does for the unpatched model; each forced entry calls the
ATen op of one kernel, which needs no switch.  Those ops skip SDPA's front end, so what the front end would do for
them is done here: a boolean mask becomes an additive one, and the memory-efficient kernel gets its bias aligned and
expanded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..constraints import ComputeCapability, DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, MinSeqLen
from ..registry import REGISTRY, Availability, Backend

HALF = (torch.float16, torch.bfloat16)
ALL = (torch.float32, torch.float16, torch.bfloat16)
aten = torch.ops.aten


def sdpa(q, k, v, *, layout, mask, scale, opts):
    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def additive(mask, dtype):
    """A boolean mask (True: attend) as the additive float mask the kernels' ops take; a float mask as is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _flash(q, k, v, *, layout, mask, scale, opts):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[0]


def _cudnn(q, k, v, *, layout, mask, scale, opts):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, False, False, scale=scale)[0]


def _efficient(q, k, v, *, layout, mask, scale, opts):
    bias = additive(mask, q.dtype)
    if bias is not None:
        # SDPA's front end: the kernel reads the bias in rows aligned to 8 elements, expanded to [B, H, Nq, Nk]
        nk = bias.shape[-1]
        if nk % 8:
            bias = F.pad(bias, (0, 8 - nk % 8))[..., :nk]
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.0, False, scale=scale)[0]


def _math(q, k, v, *, layout, mask, scale, opts):
    return aten._scaled_dot_product_attention_math(q, k, v, additive(mask, q.dtype), 0.0, False, None, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])[0]


def _probe(op: str):
    def probe():
        if not hasattr(aten, op):
            return Availability(False, f"torch {torch.__version__} has no aten.{op}")
        return Availability(True, version=torch.__version__)

    return probe


def _torch_probe():
    return Availability(True, version=torch.__version__)


REGISTRY.register(
    Backend(
        name="sdpa",
        family="sdpa",
        fn=sdpa,
        constraints=(DTypes(ALL), Masks(("bool", "float")), GroupedQuery(True)),
        layouts=("HND",),
        probe=_torch_probe,
        description="PyTorch SDPA, its own kernel choice (as for the unpatched model): the reference and last fallback",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_flash",
        family="sdpa",
        fn=_flash,
        constraints=(
            DeviceTypes(("cuda",)),
            ComputeCapability(min=(8, 0)),
            DTypes(HALF),
            HeadDims(max=256, multiple_of=8),
            Masks(()),
            GroupedQuery(True),
        ),
        probe=_probe("_scaled_dot_product_flash_attention"),
        description="SDPA's FlashAttention-2 kernel (its ATen op)",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_cudnn",
        family="sdpa",
        fn=_cudnn,
        constraints=(
            DeviceTypes(("cuda",)),
            ComputeCapability(min=(8, 0)),
            DTypes(HALF),
            HeadDims(max=128, multiple_of=8),
            Masks(()),
            GroupedQuery(False),
            MinSeqLen(kv=2),  # H100, torch 2.11: "No available kernel" for a single key
        ),
        probe=_probe("_scaled_dot_product_cudnn_attention"),
        description="SDPA's cuDNN kernel (its ATen op)",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_efficient",
        family="sdpa",
        fn=_efficient,
        constraints=(
            DeviceTypes(("cuda",)),
            DTypes(ALL),
            HeadDims(multiple_of=8),
            Masks(("bool", "float")),
            GroupedQuery(False),  # H100, torch 2.11: "No available kernel" with enable_gqa (contract matrix)
        ),
        probe=_probe("_scaled_dot_product_efficient_attention"),
        description="SDPA's memory-efficient (xformers-style) kernel (its ATen op)",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_math",
        family="sdpa",
        fn=_math,
        constraints=(DTypes(ALL), Masks(("bool", "float")), GroupedQuery(True)),
        probe=_probe("_scaled_dot_product_attention_math"),
        description="SDPA's unfused math kernel (slow, exact; its ATen op)",
        timed=False,  # never faster than the fused kernels; auto's reference computes in fp32 SDPA anyway
    )
)
