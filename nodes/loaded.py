"""ComfyUI's loaded models whose patcher is gone, dropped before a MultiGPU node can trip on them.

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
"""

from __future__ import annotations

import gc
import logging

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
