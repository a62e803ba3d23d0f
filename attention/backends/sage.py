"""SageAttention: 1.0.6 (Triton), every 2.x entry point, and SageAttention3 (Blackwell)."""

from __future__ import annotations

import importlib

import torch

from ..constraints import ComputeCapability, DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, MinSeqLen, SameHeadDimV
from ..registry import REGISTRY, Availability, Backend, import_probe, version_of

HALF = (torch.float16, torch.bfloat16)
# Sage 1.0.6 asserts head dim in {64, 96, 128}: the dispatcher pads to those. 2.x pads to 64 or 128 itself and
# refuses more than 128: padding first would copy twice (SD1.5's 80 to 96 here, then 96 to 128 in the library) and
# keep such calls off the lean path.
SAGE1_DIMS = HeadDims(dims=(64, 96, 128))
SAGE2_DIMS = HeadDims(max=128)
COMMON = (DeviceTypes(("cuda",)), DTypes(HALF), GroupedQuery(True), SameHeadDimV())


def _installed_dims():
    """sageattn() is 1.0.6's or 2.x's, whichever is installed."""
    try:
        return SAGE2_DIMS if int(version_of("sageattention").split(".")[0]) >= 2 else SAGE1_DIMS
    except Exception:  # not installed: the backend is unavailable anyway
        return SAGE1_DIMS


def _sage():
    return importlib.import_module("sageattention")


def _sage_v2_probe(flag: str | None = None, fn: str | None = None):
    """Available when sageattention 2.x is installed (and its compiled module ``flag`` loaded)."""

    def probe():
        try:
            core = importlib.import_module("sageattention.core")
        except Exception as e:
            return Availability(False, f"import sageattention failed: {type(e).__name__}: {e}")
        ver = version_of("sageattention")
        if fn and not hasattr(core, fn):
            return Availability(False, f"sageattention {ver} has no {fn} (needs SageAttention 2.x)")
        if flag and not getattr(core, flag, False):
            mod = {"SM80_ENABLED": "_qattn_sm80", "SM89_ENABLED": "_qattn_sm89", "SM90_ENABLED": "_qattn_sm90"}[flag]
            return Availability(False, f"sageattention {ver} was built without its {mod} CUDA module")
        return Availability(True, version=ver)

    return probe


def _sage1_probe():
    try:
        ver = version_of("sageattention")
    except Exception as e:
        return Availability(False, f"import sageattention failed: {type(e).__name__}: {e}")
    if not ver.startswith("1."):
        return Availability(False, f"sageattention {ver} installed, this entry is the 1.0.x Triton build")
    return import_probe("sageattention", attr="sageattn")()


def _call(fn_name: str, **fixed):
    kernel = []  # the library function, resolved on first use (an import per call costs on host-bound models)

    def fn(q, k, v, *, layout, mask, scale, opts):
        if not kernel:
            kernel.append(getattr(_sage(), fn_name))
        kw = {**fixed, **opts} if opts else fixed
        if mask is not None:
            kw = {**kw, "attn_mask": mask}
        out = kernel[0](q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, **kw)
        return out[0] if isinstance(out, tuple) else out

    return fn


def _sage3(q, k, v, *, layout, mask, scale, opts):
    from sageattn3 import sageattn3_blackwell

    # SageAttention3 takes HND and computes with the scale of q's head dim.
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        q = q * (scale * q.shape[-1] ** 0.5)
    return sageattn3_blackwell(q, k, v, is_causal=False)


def _entry(name, fn, probe, extra, description, layouts=("HND", "NHD"), accuracy="8bit", smooth_k=False,
           dims=SAGE2_DIMS):
    # Every 2.x entry point (and 1.0.6) allocates its output in the tensor_layout it is given and quantizes through
    # strides: layout_by_output. smooth_k: the entry points that take it subtract K's mean in Python (the per-thread
    # quantizers `k = k - km`); sageattn() does not pass it on.
    REGISTRY.register(
        Backend(
            name=name,
            family="sage",
            fn=fn,
            constraints=COMMON + (dims,) + extra,
            layouts=layouts,
            probe=probe,
            description=description,
            accuracy=accuracy,
            layout_by_output=len(layouts) > 1,
            smooth_k=smooth_k,
        )
    )


_entry(
    "sage",
    _call("sageattn"),
    import_probe("sageattention", attr="sageattn"),
    (Masks(()),),
    "sageattn(): the library's own per-GPU pick (what other node packs call)",
    dims=_installed_dims(),
)
_entry(
    "sage1_triton",
    _call("sageattn"),
    _sage1_probe,
    (Masks(()),),
    "SageAttention 1.0.6 (PyPI, Triton)",
    dims=SAGE1_DIMS,
)
_entry(
    "sage_triton",
    _call("sageattn_qk_int8_pv_fp16_triton"),
    _sage_v2_probe(fn="sageattn_qk_int8_pv_fp16_triton"),
    # It accepts an attn_mask, but on the H100 every additive-mask call tried gave rel-L1 0.34-0.57 against SDPA
    # (head dims 40-128, 77-key cross-attention, bf16 and fp32, both layouts): masked calls go to the next backend.
    (Masks(()),),
    "SageAttention 2: INT8 QK, FP16 PV, Triton",
    smooth_k=True,
)
_entry(
    "sage_fp16_cuda",
    _call("sageattn_qk_int8_pv_fp16_cuda", pv_accum_dtype="fp32"),
    _sage_v2_probe("SM80_ENABLED", "sageattn_qk_int8_pv_fp16_cuda"),
    # NaN for every single-key call on the H100 (contract matrix): such calls go to the next backend
    (Masks(()), MinSeqLen(kv=2)),
    "SageAttention 2: INT8 QK, FP16 PV (fp32 accumulation), CUDA",
    smooth_k=True,
)
_entry(
    "sage_fp8_cuda",
    _call("sageattn_qk_int8_pv_fp8_cuda", pv_accum_dtype="fp32+fp32"),
    _sage_v2_probe("SM89_ENABLED", "sageattn_qk_int8_pv_fp8_cuda"),
    (ComputeCapability(min=(8, 9)), Masks(())),
    "SageAttention 2: INT8 QK, FP8 PV (fp32+fp32 accumulation), CUDA sm89 kernel",
    smooth_k=True,
)
_entry(
    "sage_fp8_cuda_fp16acc",
    _call("sageattn_qk_int8_pv_fp8_cuda", pv_accum_dtype="fp32+fp16"),
    _sage_v2_probe("SM89_ENABLED", "sageattn_qk_int8_pv_fp8_cuda"),
    (ComputeCapability(min=(8, 9)), Masks(())),
    "SageAttention 2: INT8 QK, FP8 PV (fp32+fp16 accumulation), CUDA sm89 kernel",
    smooth_k=True,
)
_entry(
    "sage_fp8_sm90",
    _call("sageattn_qk_int8_pv_fp8_cuda_sm90", pv_accum_dtype="fp32+fp32"),
    _sage_v2_probe("SM90_ENABLED", "sageattn_qk_int8_pv_fp8_cuda_sm90"),
    (ComputeCapability(exact=((9, 0),)), Masks(())),
    "SageAttention 2: INT8 QK, FP8 PV, Hopper (sm90) kernel",
    smooth_k=True,
)
_entry(
    "sage3",
    _sage3,
    import_probe("sageattn3", attr="sageattn3_blackwell"),
    (Masks(()),),
    "SageAttention3 FP4 (Blackwell)",
    layouts=("HND",),
    accuracy="4bit",
    dims=SAGE1_DIMS,
)
