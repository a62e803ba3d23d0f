"""The hot path: after the first call of an exact call shape (which takes the full path and its checks), the
override caches the resolved call per shape in its lane and later calls of that shape run it with nothing else.

An entry is the kernel with a view to its layout, the NaN flag, a count and the reshape back
(``dispatch.direct_call``): the explicit backend's, ``auto``'s or ``auto_exact``'s choice for the shape (``sdpa`` is
PyTorch's SDPA as ``auto`` timed it, never ComfyUI's function), or, for a shape the kernel refuses and for the calls of a
forward Patch Attention runs dense (outside ``start/end_percent``, an explicit sparse kernel before
``sparse_start_percent``), what the full path does: the fastest exact kernel measured for the shape (the lane's exact
selector), or the override Patch Attention was applied over.  Calls with a mask, a precision request, ``scale`` or
``enable_gqa``, per-layer options, ``dense_layers``, ``log_stats`` and layers the NaN net marked keep the full path; so
do ``auto``'s lossy choices at its check steps (:mod:`.recheck`).
"""

from __future__ import annotations

from ..attention import AUTO, AUTO_EXACT, AUTO_FAST, REGISTRY
from ..attention.calls import prepare
from ..attention.dispatch import direct_call
from .hook import HOST, PREVIOUS, is_host_exact, same_heads, wants_full_precision


def key(args, kwargs, phase=True):
    """The exact call shape (and the forward's phase: whether sparse kernels may run, auto's choice differs; None for a
    forward Patch Attention runs dense), or None when this call is not one the lean path takes."""
    if len(args) < 3 or len(args) > 4 or wants_full_precision(kwargs, kwargs) or kwargs.get("mask") is not None \
            or kwargs.get("scale") is not None or kwargs.get("enable_gqa"):
        return None
    q, k, v = args[0], args[1], args[2]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    return (q.shape, k.shape, v.shape, q.dtype, q.device, heads, kwargs.get("skip_reshape", False),
            kwargs.get("skip_output_reshape", False), phase)


def attempt(ov, ln, key, func, args, kwargs):
    """``(True, output)`` when the cached entry for ``key`` ran; else ``(False, k)``, ``k`` the key to cache an entry
    under after the full path has run this call (None: leave it)."""
    entry = ln.lean.get(key)
    if entry and ln.check_phase is not None and not entry.exact:
        return False, None  # auto re-checks its lossy choices at this step: the full path does that
    if entry:
        layer = ln.layer
        ln.layer = layer + 1
        try:
            return True, entry(func, args, kwargs, layer)
        except Exception:  # the full path falls back and counts it
            ln.layer = layer
            ln.lean[key] = False
            return False, None
    return False, None if entry is False else key


def make(ov, ln, func, a, k_smoothed=False, dense=False):
    """The lean entry for this call shape (after its first call took the full path and was checked), or None.
    ``dense``: a call of a forward Patch Attention runs dense."""
    cfg = ln.config
    q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
    sr, sor = bool(a.get("skip_reshape", False)), bool(a.get("skip_output_reshape", False))
    name = cfg.backend
    try:
        if dense:
            return _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed, None, None)
        sel = cfg.auto if name in (AUTO, AUTO_FAST) else cfg.exact if name == AUTO_EXACT else None
        if sel is not None:
            sig = sel.key(prepare(q, k, v, heads, None, sr)[4], cfg.sparse_ok)
            name = sel.decisions.get(sig)
            if name is None or sig in sel.demoted or name in sel.refused.get(sig, ()):
                return None
        call, refused = direct_call(cfg, name, q, k, v, heads, sr, sor, k_smoothed)
    except Exception:
        return None
    if call is not None:
        def kernel(func, args, kwargs, layer):
            return call(args[0], args[1], args[2], layer)

        kernel.exact = not REGISTRY.get(name).quantized  # a lossy choice of auto is re-checked on the full path
        return kernel
    if refused and cfg.allow_fallback and not cfg.fallbacks:
        try:
            return _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed, name, refused)
        except Exception:
            return None
    return None


def _declined(ov, ln, func, q, k, v, heads, sr, sor, k_smoothed, name, refused):
    """What the full path does with a call Patch Attention leaves dense (a dense forward) or that the kernel ``name``
    refuses (``refused``, counted as a fallback): the override applied under ours, else the fastest exact kernel for
    the shape (the lane's exact selector), else (an explicit ``sdpa``) ComfyUI's function."""
    stats = ln.config.stats
    previous = ov.previous
    if previous is not None and func is not None:
        def to_previous(func, args, kwargs, layer):  # the override applied under ours
            if refused:
                stats.count_fallback(name, PREVIOUS, refused)
            stats.count_call(PREVIOUS)
            return previous(func, *args, **kwargs)

        to_previous.exact = True
        return to_previous
    dense = ln.dense
    if dense.exact is not None:
        sel = dense.exact
        ex = sel.decisions.get(sel.key(prepare(q, k, v, heads, None, sr)[4]))
        if ex is None:
            return None
        call, _ = direct_call(dense, ex, q, k, v, heads, sr, sor, k_smoothed)
        if call is None:
            return None
        if refused:
            def to_exact(func, args, kwargs, layer):  # the fastest exact kernel for this shape
                stats.count_fallback(name, ex, refused)
                return call(args[0], args[1], args[2], layer)
        else:
            def to_exact(func, args, kwargs, layer):
                return call(args[0], args[1], args[2], layer)

        to_exact.exact = True
        return to_exact
    if is_host_exact(func) and same_heads(q, k):
        def host(func, args, kwargs, layer):  # an explicit `sdpa`: SDPA as ComfyUI runs it
            if refused:
                stats.count_fallback(name, "sdpa", refused)
            stats.count_call(HOST)
            return func(*args, **kwargs)

        host.exact = True
        return host
    return None
