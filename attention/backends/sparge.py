"""SpargeAttn (``spas_sage_attn``): sparse + SageAttention quantized attention.

Options (per model, or per layer through a tuned profile): ``simthreshd1``,
``cdfthreshd``, ``pvthreshd`` (the library's defaults below), ``topk`` for
the top-k variants.  With ``collect_sparsity`` the call also reports the
fraction of blocks skipped.
"""

from __future__ import annotations

import importlib

import torch

from ..constraints import (
    DeviceTypes,
    DTypes,
    GroupedQuery,
    HeadDims,
    Masks,
    MinSeqLen,
    SameHeadDimV,
)
from ..registry import REGISTRY, Backend, check_bounded_options, import_probe

# The library's own defaults (spas_sage2_attn_meansim_cuda signature).
DEFAULTS = {"simthreshd1": 0.6, "cdfthreshd": 0.98, "pvthreshd": 50}
TOPK_DEFAULTS = {"simthreshd1": -0.1, "topk": 0.5, "pvthreshd": 50}
BOUNDS = {"simthreshd1": (-1.0, 1.0), "cdfthreshd": (0.0, 1.0), "pvthreshd": (0.0, 1e6), "topk": (0.0, 1.0)}

KNOWN_OPTS = {"simthreshd1", "cdfthreshd", "pvthreshd", "topk", "collect_sparsity", "smooth_k"}


def check_options(opts: dict) -> dict:
    """Validate threshold options; unknown names and values out of bounds are a ValueError."""
    return check_bounded_options(opts, BOUNDS, "SpargeAttn", KNOWN_OPTS)


def _call(fn_name: str, defaults: dict):
    def fn(q, k, v, *, layout, mask, scale, opts):
        kw = dict(defaults)
        kw.update(opts or {})
        collect = bool(kw.pop("collect_sparsity", False))
        lib = importlib.import_module("spas_sage_attn")
        res = getattr(lib, fn_name)(
            q, k, v, scale=scale, is_causal=False, tensor_layout=layout,
            output_dtype=q.dtype, return_sparsity=collect, **kw,
        )
        if collect:
            out, sparsity = res
            return out, {"sparsity": float(sparsity)}
        return res

    return fn


COMMON = (
    DeviceTypes(("cuda",)),
    DTypes((torch.float16, torch.bfloat16)),
    HeadDims(dims=(64, 128)),
    Masks(()),
    MinSeqLen(q=128, kv=128),
    GroupedQuery(False),
    SameHeadDimV(),
)


def _entry(name, fn_name, defaults, description, accuracy="sparse"):
    REGISTRY.register(
        Backend(
            name=name,
            family="sparge",
            fn=_call(fn_name, defaults),
            constraints=COMMON,
            layouts=("HND", "NHD"),
            probe=import_probe("spas_sage_attn", attr=fn_name),
            description=description,
            accuracy=accuracy,
            options=dict(defaults),
        )
    )


_entry("sparge", "spas_sage2_attn_meansim_cuda", DEFAULTS, "SpargeAttn on SageAttention2 (sparse, thresholds)")
_entry("sparge_topk", "spas_sage2_attn_meansim_topk_cuda", TOPK_DEFAULTS, "SpargeAttn on SageAttention2, top-k blocks",
       accuracy="topk")
_entry("sparge_sage1", "spas_sage_attn_meansim_cuda", DEFAULTS, "SpargeAttn on SageAttention1 (fp16 PV)")
