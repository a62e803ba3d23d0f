"""Patch Attention beside everything else that writes ComfyUI's attention hook.

One key, ``transformer_options['optimized_attention_override']``, holds one override; ComfyUI's Model Attention
Backend, Model Sparse Attention (core, Nov 2026) and other node packs write it too.  The rules (README, "Patch
Attention and ComfyUI's own attention nodes"):

- **Patch Attention applied over another override** keeps it: that override serves the calls Patch Attention leaves
  dense by choice (outside its step schedule, ``dense_layers``, shapes its kernel does not take) -- core's stacking
  protocol, as Model Sparse Attention does.  Calls that must stay exact (a full-precision request, a layer whose kernel
  gave NaN) go to the fastest exact kernel for their shape instead (never to that override: its kernel may be lossy).
  Without a previous override, the calls left dense by choice go there too.  Over an earlier Patch Attention, the new
  one replaces it.
- **An override applied over Patch Attention** that hands its declined calls to the previous one (core's protocol:
  ``previous(func, q, k, v, heads, ...)``) reaches Patch Attention's dispatcher, which counts those calls.
- **An override applied over Patch Attention that does not** replaces it.  Patch Attention checks the hook when each
  sampling run starts: if its override is not there and not reachable from what is, it logs once which override
  replaced it and the node order that keeps both.  It does not put itself back on top: the later node wins, said once.
"""

from __future__ import annotations

import logging

from .hook import OVERRIDE_KEY, BoundWrapper, describe, reaches
from .loaded import keep_pins_on

log = logging.getLogger("patch_attention.nodes")

WRAPPER_KEY = "patch_attention"


def previous_override(model):
    """The override on ``model``'s hook that a new Patch Attention goes over (None: none, or an earlier Patch
    Attention, which the new one replaces).  Under an override that keeps itself on top (Context Parallel's), the one
    it wraps."""
    from .override import AttentionOverride

    current = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    if getattr(current, "keeps_on_top", False):
        current = current.inner
    return None if current is None or isinstance(current, AttentionOverride) else current


def _put(topts, ov) -> None:
    """``ov`` (None: nothing) where Patch Attention goes on the hook: under an override that keeps itself on top."""
    current = topts.get(OVERRIDE_KEY)
    if getattr(current, "keeps_on_top", False):
        topts[OVERRIDE_KEY] = current.with_inner(ov)
    elif ov is None:
        topts.pop(OVERRIDE_KEY, None)
    else:
        topts[OVERRIDE_KEY] = ov


class SampleWrapper(BoundWrapper):
    """OUTER_SAMPLE wrapper: statistics per sampling run, logged at its end when asked; the run's sigmas (for auto's
    re-check at the middle and last step); whether the override is still on the hook."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        check_on_hook(ov, getattr(executor, "class_obj", None))
        ov.start_run(sigmas)
        try:
            return executor(*args, **kwargs)
        finally:
            ov.end_run()


def check_on_hook(ov, guider) -> None:
    """Log once when ``ov`` is not what the sampler will call: another override replaced it after Patch Attention."""
    options = getattr(guider, "model_options", None)
    if not isinstance(options, dict):
        return
    current = options.get("transformer_options", {}).get(OVERRIDE_KEY)
    if current is None or reaches(current, ov):
        ov.replaced_by = None
        return
    name = describe(current)
    if ov.replaced_by != name:
        ov.replaced_by = name
        log.warning("Patch Attention (%s) is not on this model's attention hook: %s replaced it (a node applied after "
                    "Patch Attention). Its attention runs, not Patch Attention's. To keep both, apply that node first "
                    "and Patch Attention after it: Patch Attention then hands the calls it leaves dense to it.",
                    ov.config.backend, name)


def install(m, ov):
    """Put ``ov`` and its wrappers on the clone ``m`` (replacing an earlier Patch Attention); ``None`` removes them."""
    import comfy.patcher_extension as pe

    from .nan_net import ForwardWrapper

    topts = m.model_options.setdefault("transformer_options", {})
    if ov is None:  # "disabled": an earlier Patch Attention goes, and the override it went over comes back
        from .override import AttentionOverride

        current = topts.get(OVERRIDE_KEY)
        mine = current.inner if getattr(current, "keeps_on_top", False) else current
        if isinstance(mine, AttentionOverride):
            _put(topts, mine.previous)
    else:
        if ov.previous is not None:
            log.info("Patch Attention (%s) goes over %s: that override serves the calls Patch Attention leaves dense",
                     ov.config.backend, describe(ov.previous))
        _put(topts, ov)
    for kind, wrapper in ((pe.WrappersMP.APPLY_MODEL, ForwardWrapper), (pe.WrappersMP.OUTER_SAMPLE, SampleWrapper)):
        m.remove_wrappers_with_key(kind, WRAPPER_KEY)
        if ov is not None:
            m.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper(ov))
    keep_pins_on(m, ov is not None)  # offloaded weights a freed clone unpinned are pinned again (nodes/loaded.py)
    return m
