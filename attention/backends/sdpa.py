"""PyTorch scaled_dot_product_attention, and each of its sub-backends forced."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constraints import ComputeCapability, DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, MinSeqLen
from ..registry import REGISTRY, Availability, Backend

HALF = (torch.float16, torch.bfloat16)
ALL = (torch.float32, torch.float16, torch.bfloat16)


def _run(q, k, v, *, mask, scale, gqa):
    kw = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale, **kw)


# ComfyUI's own attention (comfy.ops.scaled_dot_product_attention) pins this kernel priority on CUDA; PyTorch's
# default order puts FlashAttention-2 first.  `sdpa` follows the host, so it runs what an unpatched model runs.
HOST_PRIORITY = [getattr(SDPBackend, n) for n in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
                 if hasattr(SDPBackend, n)]
_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters  # torch >= 2.6


def sdpa(q, k, v, *, layout, mask, scale, opts):
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda and _SET_PRIORITY:
        with sdpa_kernel(HOST_PRIORITY, set_priority=True):
            return _run(q, k, v, mask=mask, scale=scale, gqa=gqa)
    return _run(q, k, v, mask=mask, scale=scale, gqa=gqa)


def _forced(kernel: SDPBackend):
    def fn(q, k, v, *, layout, mask, scale, opts):
        with sdpa_kernel([kernel]):
            return _run(q, k, v, mask=mask, scale=scale, gqa=q.shape[1] != k.shape[1])

    return fn


def _probe(kernel_name: str):
    def probe():
        if not hasattr(SDPBackend, kernel_name):
            return Availability(False, f"torch {torch.__version__} has no SDPBackend.{kernel_name}")
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
        description="PyTorch SDPA with ComfyUI's kernel priority (cuDNN, flash, efficient, math): the reference and last fallback",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_flash",
        family="sdpa",
        fn=_forced(SDPBackend.FLASH_ATTENTION),
        constraints=(
            DeviceTypes(("cuda",)),
            ComputeCapability(min=(8, 0)),
            DTypes(HALF),
            HeadDims(max=256, multiple_of=8),
            Masks(()),
            GroupedQuery(True),
        ),
        probe=_probe("FLASH_ATTENTION"),
        description="SDPA forced to its FlashAttention-2 kernel",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_cudnn",
        family="sdpa",
        fn=_forced(getattr(SDPBackend, "CUDNN_ATTENTION", SDPBackend.MATH)),
        constraints=(
            DeviceTypes(("cuda",)),
            ComputeCapability(min=(8, 0)),
            DTypes(HALF),
            HeadDims(max=128, multiple_of=8),
            Masks(()),
            GroupedQuery(False),
            MinSeqLen(kv=2),  # H100, torch 2.11: "No available kernel" for a single key
        ),
        probe=_probe("CUDNN_ATTENTION"),
        description="SDPA forced to its cuDNN kernel",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_efficient",
        family="sdpa",
        fn=_forced(SDPBackend.EFFICIENT_ATTENTION),
        constraints=(
            DeviceTypes(("cuda",)),
            DTypes(ALL),
            HeadDims(multiple_of=8),
            Masks(("bool", "float")),
            GroupedQuery(False),  # H100, torch 2.11: "No available kernel" with enable_gqa (contract matrix)
        ),
        probe=_probe("EFFICIENT_ATTENTION"),
        description="SDPA forced to its memory-efficient (xformers-style) kernel",
    )
)

REGISTRY.register(
    Backend(
        name="sdpa_math",
        family="sdpa",
        fn=_forced(SDPBackend.MATH),
        constraints=(DTypes(ALL), Masks(("bool", "float")), GroupedQuery(True)),
        probe=_probe("MATH"),
        description="SDPA forced to its unfused math kernel (slow, exact)",
    )
)
