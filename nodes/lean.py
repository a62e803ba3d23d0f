"""The hot path: after the first call of an exact call shape (which takes the full path and its checks), the
override caches the resolved call per shape in its lane and later calls of that shape run it with nothing else.

An entry is the kernel with a view to its layout, the NaN flag, a count and the reshape back
(``dispatch.direct_call``), or ComfyUI's own function (``sdpa`` chosen by ``auto``), or what the full path does for a
shape the kernel refuses (ComfyUI's function, or the override Patch Attention was applied over).  Calls with a mask,
a precision request, ``scale`` or ``enable_gqa``, per-layer options, ``dense_layers``, ``log_stats`` and layers the NaN
net marked keep the full path; so do ``auto``'s lossy choices at its re-check steps.
"""

from __future__ import annotations

from ..attention import REGISTRY
from ..attention.auto import phase_signature
from ..attention.calls import prepare
from ..attention.dispatch import direct_call
from .hook import HOST, PREVIOUS, is_host_exact, same_heads, wants_full_precision


def key(args, kwargs, sparse_ok=True):
    """The exact call shape (and whether sparse kernels may run in this forward: auto's choice differs), or None when
    this call is not one the lean path takes."""
    if len(args) < 3 or len(args) > 4 or wants_full_precision(kwargs, kwargs) or kwargs.get("mask") is not None \
            or kwargs.get("scale") is not None or kwargs.get("enable_gqa"):
        return None
    q, k, v = args[0], args[1], args[2]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    return (q.shape, k.shape, v.shape, q.dtype, q.device, heads, kwargs.get("skip_reshape", False),
            kwargs.get("skip_output_reshape", False), sparse_ok)


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


def make(ov, ln, func, a, k_smoothed=False):
    """The lean entry for this call shape (after its first call took the full path and was checked), or None."""
    cfg = ln.config
    q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
    sr, sor = bool(a.get("skip_reshape", False)), bool(a.get("skip_output_reshape", False))
    name = cfg.backend
    stats = cfg.stats
    try:
        if cfg.auto is not None:
            sig = phase_signature(prepare(q, k, v, heads, None, sr)[4], cfg.sparse_ok)
            name = cfg.auto.decisions.get(sig)
            if name is None or sig in cfg.auto.demoted:
                return None
        if name == "sdpa" and is_host_exact(func) and same_heads(q, k):
            def host_sdpa(func, args, kwargs, layer):  # auto chose SDPA: what the unpatched model runs
                stats.count_call(HOST)
                return func(*args, **kwargs)

            host_sdpa.exact = True
            return host_sdpa
        call, refused = direct_call(cfg, name, q, k, v, heads, sr, sor, k_smoothed)
    except Exception:
        return None
    if call is not None:
        def kernel(func, args, kwargs, layer):
            return call(args[0], args[1], args[2], layer)

        kernel.exact = not REGISTRY.get(name).quantized  # a lossy choice of auto is re-checked on the full path
        return kernel
    if refused and cfg.allow_fallback and not cfg.fallbacks:
        previous = ov.previous
        if previous is not None:
            def to_previous(func, args, kwargs, layer):  # what the full path does: the override applied under ours
                stats.count_fallback(name, PREVIOUS, refused)
                stats.count_call(PREVIOUS)
                return previous(func, *args, **kwargs)

            to_previous.exact = True
            return to_previous
        if is_host_exact(func) and same_heads(q, k):
            def host(func, args, kwargs, layer):  # what the full path does for this shape: SDPA, as ComfyUI runs it
                stats.count_fallback(name, "sdpa", refused)
                stats.count_call(HOST)
                return func(*args, **kwargs)

            host.exact = True
            return host
    return None
