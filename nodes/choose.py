"""Which calls Patch Attention leaves dense, and where a call it leaves dense goes.

A call runs on the chosen kernel unless one of these says otherwise, checked in this order (:meth:`DenseChoice.why`):

- the step schedule (``start/end_percent``: a forward outside it runs dense), an explicit sparse kernel before
  ``sparse_start_percent``, ``dense_layers``, and the layers whose kernel returned NaN/inf in this run;
- a full-precision request, unless every kernel the patch can choose is exact;
- ``sdpa`` chosen by the user: every call is ComfyUI's own function's;
- over another override, a call shape the explicit kernel refuses (found once per shape and lane).

**The dense-call rule** (:meth:`DenseChoice.route`), one for the full path and the cached calls (:mod:`.lean`): a call
left dense by choice (the schedule, ``dense_layers``, a refused shape) goes to the override Patch Attention was
applied over, where there is one (:mod:`.compose`); otherwise -- and always for a call that must stay exact (a
full-precision request, a layer whose kernel gave NaN) -- to the fastest exact kernel measured for its shape (the
lane's exact selector); with no exact selector (``sdpa`` chosen), to ComfyUI's own exact function where the model
calls one, else PyTorch's SDPA.
"""

from __future__ import annotations

import threading

from ..attention import AUTO_EXACT, AUTOS, REGISTRY, calls
from ..attention.calls import call_key
from . import nan_net
from .hook import COMFYUI_OWN, HOST, PREVIOUS, as_float, is_host_exact, same_heads
from .lane import Lane

EXACT = "exact kernel"  # a dense call's route: the lane's dense config (the fastest exact kernel for the shape)

# why a call runs dense (the route depends on it: only what Patch Attention declines by choice may go to a previous
# override)
NONFINITE, PRECISE, DECLINED, OWN = "nonfinite", "precise", "declined", "sdpa"


def in_ranges(i: int, ranges) -> bool:
    return any(lo <= i and (hi is None or i <= hi) for lo, hi in ranges)


class DenseChoice:
    """The rules above for one override; what they learn in a run (the NaN-marked layers) is shared by its lanes."""

    def __init__(self, config, *, sigma_range=None, dense_layers=(), sparse_sigma=None, previous=None):
        chosen = None if config.backend in AUTOS else REGISTRY.get(config.backend)  # an explicit backend
        self.sigma_range = sigma_range  # (sigma_start, sigma_end): the chosen kernel while end <= sigma <= start
        self.dense_layers = tuple(dense_layers)
        self.previous = previous  # the override this one was applied over: it serves the calls left dense by choice
        # Sparse kernels (SpargeAttn, Sol-Attn) wait for the sparse schedule: from the step whose sigma is at most this
        # (None: from the first step). An explicit sparse backend runs dense before it; auto chooses among the others.
        self.sparse_sigma = sparse_sigma
        self.sparse_backend = chosen is not None and chosen.sparse
        # a sparse kernel can run in this run: the forwards read their sigma for the sparse schedule (one sync each)
        self.sparse_seen = self.sparse_backend
        # every kernel the patch can choose is exact: full-precision requests run on them too
        self.precise_ok = config.backend == AUTO_EXACT or (chosen is not None and not chosen.quantized)
        # `sdpa` chosen: every call is ComfyUI's own function's (PyTorch's SDPA where the model calls none)
        self.comfyui_own = config.backend == COMFYUI_OWN and not config.record_time
        self.nonfinite_layers = set()  # layers whose kernel returned NaN/inf this run: dense from then on
        self._lock = threading.Lock()

    def start_run(self) -> None:
        with self._lock:
            self.nonfinite_layers = set()

    # ------------------------------------------------------------------ which calls run dense

    def why(self, ln: Lane, layer: int, func, a, rest, precise: bool) -> str | None:
        """Why this call (``layer`` of the forward) runs dense, counting the fallback where one is counted; None: it
        runs on the chosen kernel."""
        cfg = ln.config
        if self.is_dense(ln, layer, rest.get("transformer_options")):
            # a call that must stay exact never goes to the override applied under ours (its kernel may be lossy)
            return NONFINITE if layer in self.nonfinite_layers else PRECISE if precise else DECLINED
        if precise and not self.precise_ok:
            cfg.stats.count_fallback(cfg.backend, ln.dense.backend, "full precision requested by the model")
            return PRECISE
        if self.comfyui_own:
            return OWN
        if self.previous is not None and func is not None and cfg.backend not in AUTOS and cfg.allow_fallback:
            why = self.refused(ln, a, rest)
            if why is not None:  # a shape the kernel does not take: the override applied under ours serves it
                cfg.stats.count_fallback(cfg.backend, PREVIOUS, why)
                return DECLINED
        return None

    def is_dense(self, ln: Lane, layer: int, topts) -> bool:
        if layer in self.nonfinite_layers or not self.active(ln, topts):
            return True
        if not self.dense_layers:
            return False
        hit = ln.dense_cache.get(layer)
        if hit is None:
            hit = ln.dense_cache[layer] = in_ranges(layer, self.dense_layers)
        return hit

    def active(self, ln: Lane, transformer_options) -> bool:
        if ln.active is not None:  # set per forward: the step schedule and the sparse schedule
            return ln.active
        if self.sigma_range is None:
            return True
        sig = transformer_options.get("sigmas") if transformer_options else None
        return self.in_range(sig)

    def in_range(self, sig) -> bool:
        if self.sigma_range is None or sig is None:
            return True
        s = as_float(sig)
        if s is None:
            return True
        hi, lo = self.sigma_range
        return lo <= s <= hi

    def refused(self, ln: Lane, a, rest) -> str | None:
        """Why the explicit backend cannot take this call (None: it can), once per call shape in the lane: the
        dispatcher validates the call again when it runs it, so the refusal must not cost a second validation on
        every call."""
        q, k, v, mask = a["q"], a["k"], a["v"], a.get("mask")
        skip, gqa = bool(a.get("skip_reshape", False)), bool(rest.get("enable_gqa", False))
        key = call_key(q, k, v, a["heads"], skip, mask=mask, enable_gqa=gqa, phase=None)
        try:
            return ln.refused[key]
        except KeyError:
            pass
        spec = calls.prepare(q, k, v, a["heads"], mask, skip, rest.get("scale"), gqa)[4]
        why = ln.refused[key] = calls.plan_for(REGISTRY.get(ln.config.backend), spec)[1]
        return why

    # ------------------------------------------------------------------ the dense-call rule

    def route(self, ln: Lane, func, q, k, why: str) -> str:
        """Where a call left dense for ``why`` goes: :data:`PREVIOUS`, :data:`HOST` (ComfyUI's function ``func``)
        or :data:`EXACT` (``ln.dense``); see the module's docstring."""
        if self.previous is not None and why == DECLINED and func is not None:
            return PREVIOUS
        if ln.dense.backend != AUTO_EXACT and func is not None and is_host_exact(func) and same_heads(q, k):
            return HOST
        return EXACT

    # ------------------------------------------------------------------ what a run learns

    def mark_nonfinite(self, bad, ln: Lane) -> None:
        """Layers whose kernel returned NaN/inf in a forward of ``ln``: dense for the rest of the run, on every lane."""
        with self._lock:
            self.nonfinite_layers = self.nonfinite_layers | {layer for layer, _ in bad}
        for layer, name in bad:
            ln.config.stats.count_fallback(name, ln.dense.backend, "non-finite output (forward redone)")
            nan_net.warn_nonfinite(name, layer)

    def sparse_phase(self, ln: Lane, sigma) -> None:
        """Whether sparse kernels may run in this forward of ``ln`` (``sigma`` already a float, or a tensor): read
        only where it can matter -- an explicit sparse backend, or auto once it chose a sparse kernel or before its
        first choices of the run."""
        cfg = ln.config
        if self.sparse_sigma is None:
            cfg.sparse_ok = True
        elif self.reads_sparse_phase(ln):
            s = as_float(sigma)
            cfg.sparse_ok = s is None or s <= self.sparse_sigma  # core's rule: dense while sigma > the start's sigma
        if self.sparse_backend and not cfg.sparse_ok:
            ln.active = False  # an explicit sparse backend before its schedule: this forward runs dense

    def reads_sparse_phase(self, ln: Lane) -> bool:
        """This forward needs its sigma for the sparse schedule: a sparse kernel can run, or the run is still before the
        schedule (sigmas only fall, so once past it with no sparse choice, nothing depends on it any more)."""
        return self.sparse_sigma is not None and (self.sparse_seen or ln.first_forward or not ln.config.sparse_ok)

    def note_choices(self, ln: Lane) -> None:
        """After a forward: whether auto chose a sparse kernel anywhere (then later forwards read their sigma)."""
        if not self.sparse_seen and ln.config.auto is not None:
            self.sparse_seen = any(n in REGISTRY and REGISTRY.get(n).sparse for n in ln.config.auto.decisions.values())
