"""flash-attn 2, FlashAttention-3 (``flash_attn_interface``) and flash-attn-4 (CuTe)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

from ..constraints import (
    DeviceTypes,
    DTypes,
    GroupedQuery,
    HeadDims,
    Masks,
    PerArch,
    SameHeadDimV,
)
from ..registry import REGISTRY, Availability, Backend, import_probe

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


@functools.cache
def _fa4_func():
    return importlib.import_module("flash_attn.cute").flash_attn_func


def _fa4(q, k, v, *, layout, mask, scale, opts):
    # The first call of each compile key (dtype, head dims, GQA ratio, tile config: FA4's own in-memory cache, one per
    # process) JIT-compiles its kernel: 1.2-1.9 s on the H100. auto makes that call untimed (its accuracy check).
    return _first(_fa4_func()(q, k, v, softmax_scale=scale, causal=False))


FA4_DIST = "flash-attn-4"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cute_dsl_folder() -> str | None:
    """nvidia-cutlass-dsl's ``dsl_packages`` folder (where ``cutlass`` lives) when installed, else None."""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        folder = os.path.join(loc, "dsl_packages")
        if os.path.isdir(os.path.join(folder, "cutlass")):
            return folder
    return None


def _fa4_probe() -> Availability:
    """Imports ``flash_attn.cute``; a failure says what to do. The pack never edits ``sys.path`` for it: the CuTe DSL's
    folder reaches the path through nvidia-cutlass-dsl's ``.pth`` file, which ``pip install --target`` and embedded
    Pythons do not process -- the reason then names the folder to add."""
    if sys.platform.startswith("win"):
        return Availability(False, "FlashAttention-4 runs on Linux only (it imports fcntl, which Windows lacks)")
    try:
        mod = importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing in ("flash_attn", "flash_attn.cute") and _dist_version(FA4_DIST) is None:
            return Availability(False, "flash-attn-4 is not installed (install.py installs it on Linux with a Hopper or "
                                       "Blackwell GPU)")
        if missing.split(".")[0] == "cutlass":
            folder = _cute_dsl_folder()
            if folder is not None and folder not in sys.path:
                return Availability(False, f"flash-attn-4 cannot import cutlass: the CuTe DSL folder {folder} is not on "
                                           "the import path (nvidia-cutlass-dsl's .pth file was not processed, as after "
                                           "pip install --target or in an embedded Python); add that folder to "
                                           "PYTHONPATH or to a .pth file in site-packages")
            if folder is None:
                return Availability(False, "flash-attn-4 is installed without nvidia-cutlass-dsl and its libraries "
                                           "(run install.py to add the pinned set)")
            if missing != "cutlass":
                return Availability(False, f"the CuTe DSL is incomplete (no module {missing}): it needs "
                                           "nvidia-cutlass-dsl-libs-base and the -libs-cu12 or -libs-cu13 of torch's "
                                           "CUDA (run install.py to add the pinned set)")
        return Availability(False, f"import flash_attn.cute failed: ModuleNotFoundError: {e}")
    except Exception as e:  # a probe never takes the pack down
        first = str(e).splitlines()[0] if str(e) else ""
        return Availability(False, f"import flash_attn.cute failed: {type(e).__name__}: {first}")
    if not hasattr(mod, "flash_attn_func"):
        return Availability(False, f"flash_attn.cute has no flash_attn_func (flash-attn-4 {_dist_version(FA4_DIST)})")
    return Availability(True, version=_dist_version(FA4_DIST) or "?")


COMMON = (DeviceTypes(("cuda",)), DTypes(HALF), Masks(()), GroupedQuery(True), SameHeadDimV())

REGISTRY.register(
    Backend(
        name="flash_attn2",
        family="flash",
        fn=_fa2,
        constraints=COMMON + (HeadDims(max=256, multiple_of=8),),
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
        constraints=COMMON + (HeadDims(max=256, multiple_of=8),),
        layouts=("NHD",),
        probe=import_probe("flash_attn_interface", attr="flash_attn_func"),
        description="FlashAttention-3 for Hopper (flash_attn_interface)",
    )
)

# What flash-attn-4 4.0.0b36's forward takes, from its interface's checks (flash_attn/cute/interface.py:
# _flash_attn_fwd, _validate_head_dims; alignment = 16 bytes / element size = 8 for fp16/bf16): fp16/bf16 (fp8 only on
# sm 10.x, not a dtype ComfyUI hands attention); K/V heads dividing Q's heads (GQA, packed in the kernel); no causal or
# window here. Head dims per arch: sm 9.x any q/k and v head dims in 8..256, multiples of 8; sm 10.x/11.x both in
# 8..128 (multiples of 8), or the (192, 128) and (256, 256) kernels (its MLA shapes with a 512 value dim need its qv
# path: not offered). Masks: it has mask_mod/score_mod, not a mask tensor; ComfyUI's bool/additive masks stay declined
# (tests/gpu/fa4.py measures what a mask_mod/score_mod version would cost).
FA4_HEAD_DIMS = PerArch((
    ((9,), (HeadDims(max=256, multiple_of=8),)),
    ((10, 11), (HeadDims(max=128, multiple_of=8, pairs=((192, 128), (256, 256))),)),
))

REGISTRY.register(
    Backend(
        name="flash_attn4",
        family="flash",
        fn=_fa4,
        constraints=(DeviceTypes(("cuda",)), DTypes(HALF), Masks(()), GroupedQuery(True), FA4_HEAD_DIMS),
        layouts=("NHD",),
        probe=_fa4_probe,
        description="flash-attn-4 (CuTe DSL) for Hopper/Blackwell; first call per head dim compiles (1-2 s)",
    )
)
