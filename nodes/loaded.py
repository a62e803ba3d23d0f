"""ComfyUI's loaded MultiGPU copies: entries whose patcher is gone, dropped before a MultiGPU node can trip on them, and
the copies' pinned weights kept pinned from one sampling run to the next.

ComfyUI tracks each loaded model by a weak reference to the patcher that loaded it, moving to that patcher's parent
when it is freed.  MultiGPU copies (ComfyUI 0.33's ``create_multigpu_deepclones``: the MultiGPU CFG Split node, the
Context Parallel node) refer to the model they were made for, which holds them: a reference cycle, freed by the
garbage collector alone, all at once, parents included.  The loaded entries they leave have no patcher while their
weights live on (the model's loader keeps them): ComfyUI logs "memory leak with model ...", and no later load replaces
such an entry.  ComfyUI 0.33's MultiGPU CFG Split node reuses loaded copies (``reuse_loaded=True``) by reading every
loaded entry's patcher, and fails on those (``AttributeError``, the prompt stops).

Patch Attention runs before such a node in a workflow, and runs again whenever its backend changes (which also makes
the MultiGPU node run again): :func:`drop_released` collects what is unreachable where MultiGPU copies are loaded, and
drops the entries left without a patcher, as ComfyUI drops those whose model is freed.  Nothing of a model that is in
use changes: such an entry can no longer be unloaded or reused by ComfyUI either.

Pinned weights (:class:`KeepPins`).  Where a model does not fit a GPU, ComfyUI 0.33's estimate-based loader leaves part
of it on the CPU, pins it (page-locked: copied to the GPU at full speed beside the kernels) and copies it in at every
forward.  Which weights a model has pinned is one set, shared by every patcher of that model, and a patcher that is
freed unpins the whole set (``ModelPatcher.__del__``) though other patchers of the model still use it; a module already
offloaded is not pinned again when the model is loaded next, so every later forward copies it from pageable memory.
Patchers of the GPUs' copies are made and freed in every sampling run (a clone of the model clones its MultiGPU copies;
``match_multigpu_clones`` replaces them), so under Context Parallel or MultiGPU CFG Split the copies lose their pins at
each run's start.  Measured (2x H100, ComfyUI 0.33, Wan 2.1 14B bf16 720p/81f on emulated 24 GB cards,
``sage_fp8_sm90``): the second GPU's 18 GB of offloaded weights copied from pageable memory, 2.1-2.3 s of each 6.3-s
step with no kernel running.  One GPU meets it too, once a clone of its model is freed (a Patch Attention clone whose
backend was changed).  :class:`KeepPins`, a PREPARE_SAMPLING wrapper, pins again what the run's loaded models have
offloaded and unpinned, through the model's patcher (ComfyUI's own accounting and limit), after ComfyUI loads them.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("patch_attention.nodes")


def drop_released() -> int:
    """Drop ComfyUI's loaded-model entries whose patcher is gone; how many were dropped (0 outside ComfyUI 0.33+'s
    MultiGPU copies, where there is nothing to collect: no garbage collection then)."""
    try:
        import comfy.model_management as mm
    except ImportError:  # pragma: no cover - outside ComfyUI
        return 0
    entries = list(getattr(mm, "current_loaded_models", ()))
    if not any(e.model is None or getattr(e.model, "is_multigpu_base_clone", False) for e in entries):
        return 0
    gc.collect()  # the cycles of copies no graph holds any more: their entries lose their patcher now, not later
    dead = [e for e in mm.current_loaded_models if e.model is None]
    for e in dead:
        mm.current_loaded_models.remove(e)
        if e.model_finalizer is not None:
            e.model_finalizer.detach()
    if dead:
        log.info("Patch Attention: dropped %d of ComfyUI's loaded-model entries whose patcher is gone (ComfyUI's "
                 "MultiGPU CFG Split would fail on them)", len(dead))
    return len(dead)


class KeepPins:
    """PREPARE_SAMPLING wrapper: once ComfyUI has loaded the run's models, their offloaded weights are pinned."""

    def __call__(self, executor, model, *args, **kwargs):
        out = executor(model, *args, **kwargs)
        for p in (model, *model.get_additional_models_with_key("multigpu")):
            t0 = time.perf_counter()
            try:
                n = repin(p)
            except Exception as e:  # pinning is a speed-up: a model it fails on samples as ComfyUI loaded it
                log.warning("Patch Attention: could not pin the offloaded weights of %s on %s again (%s: %s)",
                            type(p.model).__name__, p.load_device, type(e).__name__, e)
                continue
            if n:
                log.info("Patch Attention: pinned %d offloaded weights of %s on %s again (%.2f s): a freed patcher of "
                         "the model had unpinned them", n, type(p.model).__name__, p.load_device,
                         time.perf_counter() - t0)
        return out


def repin(patcher) -> int:
    """Pin again, through ``patcher``, the weights of its model's offloaded modules (ComfyUI's partial load) that are
    on the CPU unpinned; how many (0 for a model loaded whole)."""
    model = getattr(patcher, "model", None)
    if not getattr(model, "model_lowvram", False) or not hasattr(patcher, "pin_weight_to_device") \
            or getattr(patcher, "is_dynamic", lambda: False)():
        return 0  # loaded whole, a ComfyUI that pins nothing, or dynamic VRAM's patcher (it pins as it streams)
    n = 0
    for name, module in model.named_modules():
        if not hasattr(module, "prev_comfy_cast_weights"):  # not offloaded by ComfyUI's partial load
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.device.type == "cpu" and not param.is_pinned():
                patcher.pin_weight_to_device(f"{name}.{pname}" if name else pname)
                n += param.is_pinned()
    return n


def keep_pins_on(m, on: bool = True) -> None:
    """:class:`KeepPins` on the clone ``m`` (``on`` False: taken off; ComfyUI without PREPARE_SAMPLING wrappers:
    nothing)."""
    import comfy.patcher_extension as pe

    kind = getattr(pe.WrappersMP, "PREPARE_SAMPLING", None)
    if kind is not None:
        m.remove_wrappers_with_key(kind, KEY)
        if on:
            m.add_wrapper_with_key(kind, KEY, KeepPins())


KEY = "patch_attention_keep_pins"
