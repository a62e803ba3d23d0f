"""The attention override a patched model carries: what ComfyUI calls for every attention call of the model.

It knows nothing of kernels: it reads the sampling state (the step schedule, which attention layer of the forward
this is) and hands the call to ``attention.dispatch``.  Where Patch Attention runs a call dense by its own choice
(outside ``start/end_percent`` or before ``sparse_start_percent``, ``dense_layers``, a shape the chosen kernel refuses, a
full-precision request, a layer the NaN net found) the call goes to the fastest exact kernel measured for its shape
(``auto_exact``'s selector, per lane) -- unless the override Patch Attention was applied over serves it (see
:mod:`.compose`).  Only an explicit ``sdpa`` hands its calls to ComfyUI's own function.  Where each concern lives:

- the hook's calling convention and ComfyUI's functions: :mod:`.hook`;
- the per-shape hot path: :mod:`.lean`;
- the NaN net and the per-forward bookkeeping: :mod:`.nan_net`;
- the audit, ``auto``'s accuracy checks over the run and ``auto_fast``'s spot checks: :mod:`.recheck`;
- composition with other overrides on the same hook: :mod:`.compose`.

**Lanes.** ComfyUI samples a model's conds on several GPUs at once, one thread per GPU (MultiGPU CFG Split), all
through this one object (model options are deep-copied, the override is shared).  Everything a call changes lives in
its sampling thread's *lane*, one per (device, thread): the layer counter and the forward's state, the dispatcher's
config (statistics, per-shape plans, deferred NaN flags), ``auto``'s choices and the lean entries.  A lane whose
thread has ended is taken over by the next thread on its device (ComfyUI starts new worker threads for each run).
What lanes share is read-only during a run, or changed under the override's lock (the layers the NaN net sent to
dense, which then run dense on every device, as they would in one batch on one GPU).  Statistics are merged over the
lanes for the report.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from ..attention import AUTO_EXACT, AUTOS, REGISTRY, AttentionConfig, AutoSelector, attention, op
from ..attention.dispatch import error_vs_reference
from ..attention.stats import Stats
from . import lean, nan_net, recheck
from .hook import (
    HOST,
    PREVIOUS,
    bind,
    call_function,
    explain_failure,
    host_function,
    is_host_exact,
    same_heads,
    take,
    wants_full_precision,
)

log = logging.getLogger("patch_attention.nodes")


def in_ranges(i: int, ranges) -> bool:
    return any(lo <= i and (hi is None or i <= hi) for lo, hi in ranges)


class Lane:
    """What the calls of one sampling thread on one device change (see the module's docstring)."""

    def __init__(self, config: AttentionConfig, device, thread: int):
        self.config = config
        # the calls Patch Attention leaves dense: the fastest exact kernel for their shape (this lane's exact selector,
        # shared with the config's fallbacks); SDPA where there is none (an explicit `sdpa`)
        self.dense = AttentionConfig(backend=AUTO_EXACT if config.exact is not None else "sdpa", exact=config.exact,
                                     stats=config.stats, check_finite=False)
        self.calls = config.stats.calls  # the Counter itself (reset clears it in place): one lookup on the hot path
        self.device = device
        self.thread = thread
        self.layer = 0  # attention call index within the current model forward
        self.active = None  # step schedule for the current forward (None: not in a forward, read sigma per call)
        # this forward checks auto's lossy choices against dense attention: "first"/"sparse-start"/"mid"/"last"
        self.check_phase = None
        self.check_round = 0  # check forwards so far (each compares other query rows)
        self.phases_run = set()  # the phases (sparse_ok) auto's calls have run in this run
        self.probes = []  # this forward's accuracy checks, their sums on the device (recheck.probe)
        self.gate_seen = 0  # the override's gate_version this lane's cached calls were made under
        self.first_forward = True
        self.lean = {}  # call key -> entry(func, args, kwargs, layer), or False: this shape takes the full path
        self.host = ()  # ComfyUI's exact attention function once seen (the hot path compares identity)
        self.audited = set()  # call kinds whose first call was compared with dense
        self.checked = set()  # (phase, signature) re-checked this run
        self.layer_calls = {}
        self.dense_cache = {}  # layer -> in dense_layers
        self.refused = {}  # call shape -> why the explicit backend cannot take it (None: it can), over a previous override

    def start_run(self) -> None:
        cfg = self.config
        cfg.stats.reset()
        cfg.take_nonfinite()
        self.layer_calls = {}
        self.checked = set()
        self.probes = []
        self.phases_run = set()
        self.lean.clear()
        self.first_forward = True
        cfg.sparse_ok = True
        if cfg.auto is not None:
            cfg.auto.demoted.clear()
            cfg._fast.clear()


class AttentionOverride:
    """What a patched clone stores in ``transformer_options['optimized_attention_override']``.

    Shared (not copied) when ComfyUI deep-copies model options, so statistics and ``auto`` decisions survive
    ``ModelPatcher.clone()``, sampling and the per-GPU clones of a MultiGPU split.

    Eager calls run here; under ``torch.compile`` the call becomes the custom op ``patch_attention::attention``
    (:mod:`attention.op`), whose real implementation comes back to :meth:`op_call`, so tuning, statistics and NaN
    bookkeeping never run in traced code.
    """

    def __init__(self, config: AttentionConfig, *, sigma_range=None, dense_layers=(), layer_options=None,
                 log_stats=False, report_error_every=0, audit=True, previous=None, sparse_sigma=None):
        self.config = config  # the first lane's config, and the template of the others
        self.report_error_every = report_error_every  # SpargeAttn report: error vs dense every N calls of a layer
        self.sigma_range = sigma_range  # (sigma_start, sigma_end): fast backend while end <= sigma <= start
        self.dense_layers = tuple(dense_layers)
        self.layer_options = layer_options  # callable(layer index, spec-ish dict) -> options or None
        self.log_stats = log_stats
        self.previous = previous  # the override this one was applied over: it serves the calls left dense
        # Sparse kernels (SpargeAttn, Sol-Attn) wait for the sparse schedule: from the step whose sigma is at most this
        # (None: from the first step). An explicit sparse backend runs dense before it; auto chooses among the others.
        self.sparse_sigma = sparse_sigma
        chosen = None if config.backend in AUTOS else REGISTRY.get(config.backend)  # an explicit backend
        self.sparse_backend = chosen is not None and chosen.sparse
        # a sparse kernel can run in this run: the forwards read their sigma for the sparse schedule (one sync each)
        self.sparse_seen = self.sparse_backend
        self.nan_net = bool(config.check_finite)
        self._check_finite = config.check_finite  # what each lane's config starts with (the net toggles it per forward)
        self.hides_nan = None  # the model's code sanitizes NaN (decided at its first forward)
        self.nonfinite_layers = set()  # layers whose kernel returned NaN/inf this run: dense from then on
        self.check_sigmas = {}  # sigma of the middle and last step of the current run -> "mid"/"last"
        self.gate_version = 0  # +1 whenever a lane refuses one of auto's choices: every lane drops its cached calls
        self.audit = audit and chosen is not None and chosen.quantized
        self.passthrough = config.backend == "sdpa" and not config.record_time  # `sdpa` is the host's SDPA call
        # every call may run on the chosen kernel(s), full-precision requests too
        self.exact = config.backend == AUTO_EXACT or (chosen is not None and not chosen.quantized)
        # dense calls on the fastest exact kernel per shape (an explicit `sdpa` stays ComfyUI's own function)
        if config.exact is None and config.backend != "sdpa":
            config.exact = AutoSelector.exact()
        # compiled models subtract K's mean in their graph for a backend that declares it (see attention.op)
        self.smooth_k = chosen is not None and chosen.smooth_k
        self.handle = op.register(self)
        self.op_handle = op.handle_tensor(self.handle)  # what a compiled graph reads at every call (see attention.op)
        self.lean_ok = (not self.passthrough and layer_options is None and not self.dense_layers and not log_stats
                        and not config.record_time)
        self.replaced_by = None  # the override found on the hook instead of this one at the start of a run
        # `sdpa` in a compiled model runs ComfyUI's function inside the graph, where no call is counted: set where
        # that branch is traced, so a forward with no counted call is not taken for a model the hook cannot reach
        self.traced_host = False
        self.unreached_said = False  # the model's attention bypasses the hook: said in this run
        self._lanes: list[Lane] = []
        self._lock = threading.Lock()
        self._tls = threading.local()

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    # ------------------------------------------------------------------ lanes

    def lane(self, device=None) -> Lane:
        """This thread's lane (on ``device``, when given: a thread that moves to another device gets that device's)."""
        ln = getattr(self._tls, "lane", None)
        if ln is not None and (device is None or ln.device == device):
            return ln
        return self._enter(device if device is not None else (ln.device if ln is not None else None))

    def start_forward(self, device=None) -> Lane:
        """A model forward starts in this thread: its lane's layer counter back to 0."""
        ln = self.lane(device)
        ln.layer = 0
        return ln

    def _enter(self, device) -> Lane:
        me = threading.get_ident()
        with self._lock:
            ln = next((x for x in self._lanes if x.device == device and x.thread == me), None)
            if ln is None:
                alive = {t.ident for t in threading.enumerate()}
                ln = next((x for x in self._lanes if x.device == device and x.thread not in alive), None)
                if ln is not None:
                    ln.thread = me  # a new worker thread for this device (ComfyUI starts them per run)
            if ln is None:
                ln = Lane(self.config if not self._lanes else self._lane_config(), device, me)
                self._lanes.append(ln)
        self._tls.lane = ln
        return ln

    def _lane_config(self) -> AttentionConfig:
        """A config like the first lane's, with statistics, plans, NaN flags and ``auto``'s choices of its own."""
        base = self.config

        def own(sel):  # what auto refused stays shared by the lanes (``refused``: the same dict)
            return sel and dataclasses.replace(sel, decisions={}, reports={}, demoted={}, tune_ms=0.0, _loaded=False)

        return dataclasses.replace(base, stats=Stats(), auto=own(base.auto), exact=own(base.exact), in_forward=False,
                                   check_finite=self._check_finite)

    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes)

    @property
    def stats(self) -> Stats:
        """The statistics of every lane (every device of a MultiGPU split), merged."""
        lanes = self.lanes()
        if len(lanes) <= 1:
            return self.config.stats
        return Stats.merged([ln.config.stats for ln in lanes])

    # ------------------------------------------------------------------ the run

    def start_run(self, sigmas=None) -> None:
        self.check_sigmas = {}
        if self.config.auto is not None and sigmas is not None and len(sigmas) > 2:
            steps = [float(x) for x in sigmas[:-1]]  # one sync per run; the last sigma is the end of the schedule
            self.check_sigmas = {steps[len(steps) // 2]: "mid", steps[-1]: "last"}
        with self._lock:
            self.nonfinite_layers = set()
            self.unreached_said = False
            lanes = list(self._lanes)
        for ln in lanes:
            ln.start_run()
        if not lanes:
            self.config.stats.reset()

    def end_run(self) -> None:
        if self.log_stats:
            log.info("Patch Attention (%s): %s", self.config.backend, self.stats.summary())

    def unreached(self, ln: Lane, base_model, compiled: bool = False) -> None:
        """The first forward of a run in ``ln`` made no attention call that reached this override: counted in the
        lane's statistics (``log_stats`` reports it), and said once per run (``compiled``: under torch.compile)."""
        name, why = unreached_reason(base_model, compiled)
        ln.config.stats.count_unreached(name, why)
        with self._lock:
            said, self.unreached_said = self.unreached_said, True
        if not said:
            log.warning("%s cannot reach the attention of %s: %s; this model runs ComfyUI's own attention, unpatched "
                        "(counted in stats)", self.label(), name, why)

    def label(self) -> str:
        """What the user applied, for messages."""
        return f"Patch Attention ({self.config.backend})"

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
            s = nan_net.as_float(sigma)
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

    def lossy_ran(self, ln: Lane) -> bool:
        """A lossy (quantized) kernel has run in this lane in this run: only then can the NaN net find anything, and
        only then do auto's re-checks apply. A run on exact kernels (`sdpa`, auto keeping SDPA) pays neither."""
        return any(n in REGISTRY and REGISTRY.get(n).quantized for n in ln.calls)

    def rechecks_pending(self, ln: Lane) -> bool:
        """``auto`` has run a lossy choice in this run, so its middle and last steps check those: only then does a
        forward read its sigma for the phase (a device sync per forward)."""
        return bool(self.check_sigmas) and self.lossy_ran(ln)

    def check_phase(self, ln: Lane, phase):
        """This forward's accuracy checks of auto's lossy choices (None: none): ``phase`` ("mid"/"last", from the
        sigma); for ``auto`` also the first forward of the run whose calls it serves ("first": after
        ``start_percent``) and the first of the sparse phase ("sparse-start"): where each phase's choices first run
        in the run (see :mod:`.recheck`)."""
        cfg = ln.config
        if cfg.auto is None or not ln.active or cfg.sparse_ok in ln.phases_run:
            return phase
        ln.phases_run.add(cfg.sparse_ok)
        if phase is not None or not cfg.auto.over_run:
            return phase
        return "first" if len(ln.phases_run) == 1 else "sparse-start"

    def refuse(self, ln: Lane, failed) -> None:
        """auto's lossy choices that left the gate in a forward of ``ln`` (``recheck.Failed``): refused for their
        signature from now on, in every lane (the lanes' selectors share what is refused; each lane drops its cached
        calls at its next forward, this one now)."""
        auto, stats = ln.config.auto, ln.config.stats
        with self._lock:
            for f in failed:
                why = (f"left the gate at the {f.phase} step on layer {f.layer} (cos {f.cos:.5f}, rel-L1 {f.rel_l1:.4f}; "
                       f"gate cos >= {auto.min_cos:g}, rel-L1 <= {auto.max_rel_l1:g})")
                new = auto.refuse(f.sig, f.name, why)
                stats.decisions[f.sig] = f"{new or 'tuned again'} from then on: {f.name} {why}"
                log.warning("%s: %s %s; not used again for these calls (%s instead), this step computed again",
                            auto.label, f.name, why, new or "the fastest of the others, measured again")
            self.gate_version += 1
        self.refresh(ln)

    def refresh(self, ln: Lane) -> None:
        """Drop ``ln``'s cached calls if a lane refused one of auto's choices since they were made (one comparison
        per forward): its next calls ask the selector again."""
        if ln.gate_seen != self.gate_version:
            ln.gate_seen = self.gate_version
            ln.lean.clear()
            ln.config._fast.clear()

    def phase_of(self, sigma):
        """"mid"/"last" when ``sigma`` is the middle or last step of the run (auto re-checks then), else None."""
        s = nan_net.as_float(sigma) if self.check_sigmas else None
        if s is None:
            return None
        return next((p for x, p in self.check_sigmas.items() if abs(x - s) <= 1e-4 * max(abs(x), 1e-6)), None)

    def in_range(self, sig) -> bool:
        if self.sigma_range is None or sig is None:
            return True
        s = nan_net.as_float(sig)
        if s is None:
            return True
        hi, lo = self.sigma_range
        return lo <= s <= hi

    def _active(self, ln, transformer_options) -> bool:
        if ln.active is not None:  # set per forward: the step schedule and the sparse schedule
            return ln.active
        if self.sigma_range is None:
            return True
        sig = transformer_options.get("sigmas") if transformer_options else None
        return self.in_range(sig)

    def _is_dense(self, ln, layer, topts) -> bool:
        if layer in self.nonfinite_layers or not self._active(ln, topts):
            return True
        if not self.dense_layers:
            return False
        hit = ln.dense_cache.get(layer)
        if hit is None:
            hit = ln.dense_cache[layer] = in_ranges(layer, self.dense_layers)
        return hit

    # ------------------------------------------------------------------ the calls

    def __call__(self, func, *args, **kwargs):
        compiling = torch.compiler.is_compiling()  # read once: every branch below depends on it
        if compiling and self.passthrough and not self.dense_layers \
                and getattr(func, "__name__", None) == "attention_pytorch" and is_host_exact(func) \
                and len(args) > 1 and same_heads(args[0], args[1]):
            # `sdpa` in a compiled model: ComfyUI's own SDPA function traced into the graph, as in the unpatched model
            # (inductor compiles its SDPA call); nothing of the override's state is read or counted in traced code,
            # one flag is set: these calls reach the hook uncounted (the model does not bypass it).
            # Only attention_pytorch: ComfyUI's split/sub-quadratic functions query free memory (graph breaks).
            self.traced_host = True
            return func(*args, **kwargs)
        if compiling:
            a, rest = bind(args, kwargs)
            mask, precise = a.get("mask"), wants_full_precision(a, rest)
            return op.traced_call(a["q"], a["k"], a["v"], mask, a["heads"], bool(a.get("skip_reshape", False)),
                                  bool(a.get("skip_output_reshape", False)), self.op_handle, precise,
                                  self.smooth_k and mask is None and not precise, rest.get("scale"),
                                  bool(rest.get("enable_gqa", False)))
        ln = getattr(self._tls, "lane", None) or self.lane()  # this thread's lane: one attribute read (hot path)
        if func is ln.host and len(args) > 1 and self.passthrough and not self.dense_layers:
            # `sdpa` on ComfyUI's own exact function: hand the call over, a few attribute reads (hot path)
            if same_heads(args[0], args[1]):
                ln.layer += 1
                ln.calls[HOST] += 1
                try:  # inline rather than call_function: no extra frame on the hottest path
                    return func(*args, **kwargs)
                except (RuntimeError, TypeError, IndexError):
                    explain_failure(args, kwargs)  # a clear ValueError if the call itself is invalid
                    raise
        key = None
        if self.lean_ok and ln.active is not None and not self.nonfinite_layers:
            # per forward: the kernel's calls (by sparse phase), or a forward Patch Attention runs dense (None)
            key = lean.key(args, kwargs, ln.config.sparse_ok if ln.active else None)
            if key is not None:
                ran, val = lean.attempt(self, ln, key, func, args, kwargs)
                if ran:
                    return val
                key = val
        a, rest = bind(args, kwargs)
        out = self._run(ln, func, args, kwargs, a, rest, wants_full_precision(a, rest))
        if key is not None:
            ln.lean[key] = lean.make(self, ln, func, a, dense=not ln.active) or False
        return out

    def container_function(self, *args, **kwargs):
        """ComfyUI 0.33+: q/k/v in single-owner containers. The tensors are taken out here, so once this call returns
        nothing of the model holds them (without containers the model's frame keeps q/k/v alive until its attention
        block ends); dense calls go to ComfyUI's own attention function."""
        return self(host_function(), *take(args), **kwargs)

    def op_call(self, q, k, v, mask, heads, skip_reshape, precise, k_smoothed, scale=None, enable_gqa=False):
        """The custom op's real implementation (compiled models): the same path, without ComfyUI's function; returns
        ``[B, N, H*Dv]`` (the op's caller reshapes in the graph).  ``k_smoothed``: the graph subtracted K's mean."""
        ln = self.lane(q.device)
        key = None
        if self.lean_ok and mask is None and not precise and scale is None and not enable_gqa and ln.active is not None \
                and not self.nonfinite_layers:
            ran, val = lean.attempt(self, ln, (q.shape, k.shape, v.shape, q.dtype, q.device, heads, skip_reshape,
                                               k_smoothed, ln.config.sparse_ok if ln.active else None), None, (q, k, v),
                                    None)
            if ran:
                return val
            key = val
        a = {"q": q, "k": k, "v": v, "heads": heads, "mask": mask, "skip_reshape": skip_reshape,
             "skip_output_reshape": False}
        rest = {"scale": scale, "enable_gqa": enable_gqa} if (scale is not None or enable_gqa) else {}
        out = self._run(ln, None, None, None, a, rest, precise, k_smoothed)
        if key is not None:
            ln.lean[key] = lean.make(self, ln, None, a, k_smoothed, dense=not ln.active) or False
        return out

    def _dense_call(self, ln, func, args, kwargs, a, rest, precise, why):
        """A call Patch Attention leaves dense: the override it was applied over (for what it declines by choice --
        schedule, dense_layers), else the fastest exact kernel for its shape (``ln.dense``: auto_exact's selector);
        an explicit ``sdpa`` hands it to ComfyUI's own exact function."""
        if self.previous is not None and why == "declined" and func is not None:
            ln.calls[PREVIOUS] += 1
            return self.previous(func, *args, **kwargs)
        if ln.dense.backend != AUTO_EXACT and func is not None and is_host_exact(func) and same_heads(a["q"], a["k"]):
            ln.host = func
            ln.calls[HOST] += 1
            return call_function(func, args, kwargs)
        return attention(a["q"], a["k"], a["v"], a["heads"], a.get("mask"), config=ln.dense, **_call_kw(a, rest))

    def _run(self, ln, func, args, kwargs, a, rest, precise, k_smoothed=False):
        layer = ln.layer
        ln.layer = layer + 1
        cfg = ln.config
        if self._is_dense(ln, layer, rest.get("transformer_options")):
            # a call that must stay exact never goes to the override applied under ours (its kernel may be lossy)
            why = "nonfinite" if layer in self.nonfinite_layers else "precise" if precise else "declined"
            return self._dense_call(ln, func, args, kwargs, a, rest, precise, why)
        if precise and not self.exact:
            cfg.stats.count_fallback(cfg.backend, ln.dense.backend, "full precision requested by the model")
            return self._dense_call(ln, func, args, kwargs, a, rest, precise, "precise")
        if self.passthrough:
            return self._dense_call(ln, func, args, kwargs, a, rest, precise, "sdpa")
        if self.previous is not None and func is not None and cfg.backend not in AUTOS and cfg.allow_fallback:
            why = self._refused(ln, cfg, a, rest)
            if why is not None:  # a shape the kernel does not take: the override applied under ours serves it
                cfg.stats.count_fallback(cfg.backend, PREVIOUS, why)
                return self._dense_call(ln, func, args, kwargs, a, rest, precise, "declined")
        options = None
        if self.layer_options is not None:
            options = self.layer_options(layer, a)
        sparse_report = self.log_stats and cfg.backend.startswith("sparge")
        if sparse_report:
            options = {**(options or {}), "collect_sparsity": True}
        kw = _call_kw(a, rest)
        q, k, v, heads, mask = a["q"], a["k"], a["v"], a["heads"], a.get("mask")
        out = attention(q, k, v, heads, mask, config=cfg, options=options,
                        tag=f"layer{layer}" if sparse_report else None, check_key=layer, k_smoothed=k_smoothed, **kw)
        if self.audit:
            recheck.audit(ln, layer, q, k, v, heads, mask, kw, out)
        elif ln.check_phase is not None:
            if cfg.auto.over_run:
                recheck.probe(ln, layer, q, k, v, heads, mask, kw, out)  # read at the forward's end, no sync here
            else:
                out = recheck.spot_check(ln, layer, q, k, v, heads, mask, kw, out)
        if sparse_report and self.report_error_every and (self.layer_calls(ln, layer) % self.report_error_every == 0):
            _, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
            cfg.stats.add_metrics(f"{cfg.backend}@layer{layer}", {"rel_l1_vs_dense": rel})
        return out

    @staticmethod
    def _refused(ln, cfg, a, rest):
        """Why the explicit backend cannot take this call (None: it can), once per call shape in the lane: the
        dispatcher validates the call again when it runs it, so the refusal must not cost a second validation on
        every call."""
        from ..attention.calls import plan_for, prepare

        q, k, v, mask = a["q"], a["k"], a["v"], a.get("mask")
        skip, gqa = bool(a.get("skip_reshape", False)), bool(rest.get("enable_gqa", False))
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, a["heads"], skip, gqa,
               None if mask is None else (mask.shape, mask.dtype))
        try:
            return ln.refused[key]
        except KeyError:
            pass
        spec = prepare(q, k, v, a["heads"], mask, skip, rest.get("scale"), gqa)[4]
        why = ln.refused[key] = plan_for(REGISTRY.get(cfg.backend), spec)[1]
        return why

    @staticmethod
    def layer_calls(ln, layer: int) -> int:
        ln.layer_calls[layer] = ln.layer_calls.get(layer, 0) + 1
        return ln.layer_calls[layer] - 1


UNREACHED_WHY = ("its attention calls do not pass transformer_options, so no attention override can reach them")
# under torch.compile: ComfyUI's TorchCompileModel keeps no guard on transformer_options, where the patch lives
UNREACHED_COMPILED = ("torch.compile is on and may be running code compiled for this model before the patch was added "
                      "(ComfyUI's TorchCompileModel does not compile again when only the attention patch changes; "
                      "restarting ComfyUI clears it), or its attention calls do not pass transformer_options")


def unreached_reason(base_model, compiled: bool = False) -> tuple[str, str]:
    """(the model's name, why no attention call of it reached the override) for the warning and the statistics;
    ``compiled``: the forward ran under a torch.compile wrapper."""
    dm = getattr(base_model, "diffusion_model", None)
    name = type(base_model).__name__ if base_model is not None else "this model"
    if dm is not None:
        name = f"{name} ({type(dm).__module__}.{type(dm).__name__})"
    return name, UNREACHED_COMPILED if compiled else UNREACHED_WHY


def _call_kw(a, rest) -> dict:
    kw = dict(skip_reshape=bool(a.get("skip_reshape", False)), skip_output_reshape=bool(a.get("skip_output_reshape", False)))
    if rest.get("scale") is not None:
        kw["scale"] = rest["scale"]
    if rest.get("enable_gqa"):
        kw["enable_gqa"] = True
    return kw
