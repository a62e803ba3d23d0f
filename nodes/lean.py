"""The calls: after the first call of an exact call shape (which takes the full path and its checks), the override
caches the resolved call per shape in its lane, and later calls of that shape run it with nothing else.

An entry is called with the call's q, k, v and its layer, or, where it ``hands_over`` the call, with what the hook got
(``func, args, kwargs``) and the layer; ``exact``: it runs an exact kernel (no re-check at auto's check steps). One of:

- the chosen kernel's :class:`~..attention.calls.KernelCall` (``dispatch.direct_call``: the view to the kernel's
  layout, the kernel, the NaN flag, the count, the reshape back): the explicit backend's, or ``auto``'s or
  ``auto_exact``'s choice for the shape (``sdpa`` there is PyTorch's SDPA as ``auto`` timed it, never ComfyUI's
  function);
- for a shape the kernel refuses, and for the calls of a forward Patch Attention runs dense (outside
  ``start/end_percent``, an explicit sparse kernel before ``sparse_start_percent``), what the full path does, by the
  dense-call rule (:meth:`.choose.DenseChoice.route`): the override Patch Attention was applied over, or the fastest
  exact kernel measured for the shape (the lane's exact selector; counted as the fallback it is).

Calls with a mask, a precision request, ``scale`` or ``enable_gqa``, per-layer options, ``dense_layers``,
``log_stats`` and layers the NaN net marked keep the full path; so do ``auto``'s lossy choices at its check steps
(:mod:`.recheck`).
"""

from __future__ import annotations

from ..attention import AUTO, AUTO_EXACT, AUTO_FAST, REGISTRY, calls
from ..attention.calls import call_key
from ..attention.dispatch import direct_call
from .choose import DECLINED, EXACT
from .hook import PREVIOUS, wants_full_precision

MISS = object()  # what attempt returns when no entry ran


def key(args, kwargs, phase=True):
    """The exact call shape of a call through ComfyUI's hook (and the forward's phase: whether sparse kernels may
    run, auto's choice differs; None for a forward Patch Attention runs dense), or None when this call is not one the
    lean path takes."""
    if len(args) < 3 or len(args) > 4 or wants_full_precision(kwargs, kwargs) or kwargs.get("mask") is not None \
            or kwargs.get("scale") is not None or kwargs.get("enable_gqa"):
        return None
    return call_key(args[0], args[1], args[2], args[3] if len(args) > 3 else kwargs.get("heads"),
                    kwargs.get("skip_reshape", False), kwargs.get("skip_output_reshape", False), None, False, False,
                    phase, False)


def attempt(ln, key, func, args, kwargs):
    """The output of the entry cached for ``key``, or :data:`MISS`: none yet (``key`` not in ``ln.lean``), one the
    full path takes (False), a lossy choice of auto at a step that re-checks it, or an entry that raised (dropped: the
    full path takes this call, and the shape from now on)."""
    entry = ln.lean.get(key)
    if not entry or (ln.check_phase is not None and not entry.exact):
        return MISS
    layer = ln.layer
    ln.layer = layer + 1
    try:
        if entry.hands_over:
            return entry(func, args, kwargs, layer)
        return entry(args[0], args[1], args[2], layer)
    except Exception:  # the full path falls back and counts it
        ln.layer = layer
        ln.lean[key] = False
        return MISS


def make(ov, ln, func, a, k_smoothed=False, dense=False):
    """The lean entry for this call shape (after its first call took the full path and was checked), or None.
    ``dense``: a call of a forward Patch Attention runs dense."""
    cfg = ln.config
    q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
    sr, sor = bool(a.get("skip_reshape", False)), bool(a.get("skip_output_reshape", False))
    try:
        if dense:
            return _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed)
        name = _chosen(cfg, q, k, v, heads, sr)
        if name is None:
            return None
        call, refused = direct_call(cfg, name, q, k, v, heads, sr, sor, k_smoothed)
        if call is not None:
            return _kernel(call, exact=not REGISTRY.get(name).quantized)  # auto's lossy choices: re-checked
        if cfg.allow_fallback and not cfg.fallbacks:
            return _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed, name, refused)
    except Exception:
        return None
    return None


def _chosen(cfg, q, k, v, heads, sr):
    """The backend the full path chose for this shape: the explicit one, or auto's (auto_exact's) decision while it
    stands (None: none, or one the selector no longer uses)."""
    name = cfg.backend
    sel = cfg.auto if name in (AUTO, AUTO_FAST) else cfg.exact_selector if name == AUTO_EXACT else None
    if sel is None:
        return name
    sig = sel.key(calls.prepare(q, k, v, heads, None, sr)[4], cfg.sparse_ok)
    name = sel.decisions.get(sig)
    if name is None or sig in sel.demoted or name in sel.refused.get(sig, ()):
        return None
    return name


def _kernel(call, exact):
    """A KernelCall's ``run`` as an entry: called with the call's q, k, v and its layer (the NaN check's key)."""
    call.exact, call.hands_over = exact, False
    return call


def _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed, name=None, refused=None):
    """The dense-call rule's entry for a call of a dense forward, or one the kernel ``name`` refuses (``refused``:
    why, counted as a fallback): the override applied under ours, or the fastest exact kernel for the shape (the
    lane's exact selector); None where the full path takes it (no decision for the shape yet, ComfyUI's function)."""
    route = ov.choice.route(ln, func, q, k, DECLINED)
    if route == PREVIOUS:
        return _to_previous(ln.config.stats, ov.choice.previous, name, refused)
    sel = ln.dense.exact_selector
    if route != EXACT or sel is None:
        return None
    ex = sel.decisions.get(sel.key(calls.prepare(q, k, v, heads, None, sr)[4]))
    if ex is None:
        return None
    call, _ = direct_call(ln.dense, ex, q, k, v, heads, sr, sor, k_smoothed,
                          fallback=(name, refused) if refused else None)
    return None if call is None else _kernel(call, exact=True)


def _to_previous(stats, previous, name, refused):
    def to_previous(func, args, kwargs, layer):  # the override applied under ours
        if refused:
            stats.count_fallback(name, PREVIOUS, refused)
        stats.count_call(PREVIOUS)
        return previous(func, *args, **kwargs)

    to_previous.exact, to_previous.hands_over = True, True
    return to_previous
