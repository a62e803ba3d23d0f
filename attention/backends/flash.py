"""flash-attn 2, FlashAttention-3 (``flash_attn_interface``) and flash-attn-4 (CuTe)."""

from __future__ import annotations

import importlib

import torch

from ..constraints import ComputeCapability, DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, SameHeadDimV
from ..registry import REGISTRY, Backend, import_probe

HALF = (torch.float16, torch.bfloat16)


def _first(out):
    # FA3 (some versions) and FA4 return (out, lse)
    return out[0] if isinstance(out, tuple) else out


def _fa2(q, k, v, *, layout, mask, scale, opts):
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False)


def _fa3(q, k, v, *, layout, mask, scale, opts):
    from flash_attn_interface import flash_attn_func

    return _first(flash_attn_func(q, k, v, softmax_scale=scale, causal=False))


def _fa4(q, k, v, *, layout, mask, scale, opts):
    fn = importlib.import_module("flash_attn.cute").flash_attn_func
    return _first(fn(q, k, v, softmax_scale=scale, causal=False))


COMMON = (DeviceTypes(("cuda",)), DTypes(HALF), Masks(()), GroupedQuery(True), SameHeadDimV())

REGISTRY.register(
    Backend(
        name="flash_attn2",
        family="flash",
        fn=_fa2,
        constraints=COMMON + (ComputeCapability.of_kernel("flash_attn"), HeadDims(max=256, multiple_of=8)),
        layouts=("NHD",),
        probe=import_probe("flash_attn", attr="flash_attn_func"),
        description="flash-attn 2 (flash_attn_func)",
    )
)

REGISTRY.register(
    Backend(
        name="flash_attn3",
        family="flash",
        fn=_fa3,
        constraints=COMMON + (ComputeCapability.of_kernel("flash_attn3"), HeadDims(max=256, multiple_of=8)),
        layouts=("NHD",),
        probe=import_probe("flash_attn_interface", attr="flash_attn_func"),
        description="FlashAttention-3 for Hopper (flash_attn_interface)",
    )
)

REGISTRY.register(
    Backend(
        name="flash_attn4",
        family="flash",
        fn=_fa4,
        constraints=COMMON + (ComputeCapability.of_kernel("flash_attn4"), HeadDims(dims=(64, 96, 128))),
        layouts=("NHD",),
        probe=import_probe("flash_attn.cute", attr="flash_attn_func"),
        description="flash-attn-4 (CuTe DSL) for Hopper/Blackwell",
    )
)
