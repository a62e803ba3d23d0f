"""The attention override a patched model carries: what ComfyUI calls for every attention call of the model.

It knows nothing of kernels: it reads the sampling state (the step schedule, which attention layer of the forward
this is) and hands the call to ``attention.dispatch``.  Where Patch Attention runs a call dense by its own choice
(outside ``start/end_percent`` or before ``sparse_start_percent``, ``dense_layers``, a shape the chosen kernel refuses, a
full-precision request, a layer the NaN net found) the call goes to the fastest exact kernel measured for its shape
(``auto_exact``'s selector, per lane) -- unless the override Patch Attention was applied over serves it (see
:mod:`.compose`).  Only an explicit ``sdpa`` hands its calls to ComfyUI's own function.  The parts, each in its
module:

- choosing: which calls run dense and where they go (the dense-call rule): :mod:`.choose`;
- calling: the per-shape cached calls, the hot path: :mod:`.lean`;
- counting: the lanes (one per sampling thread and device: everything a call changes) and their statistics, merged
  for the report: :mod:`.lane`;
- rechecking: the audit, ``auto``'s accuracy checks over the run and ``auto_fast``'s spot checks: :mod:`.recheck`;
- the NaN net and the per-forward bookkeeping: :mod:`.nan_net`;
- the hook's calling convention and ComfyUI's functions: :mod:`.hook`; composition with other overrides on the same
  hook: :mod:`.compose`.

What lanes share is read-only during a run, or changed under a lock (the layers the NaN net sent to dense, which then
run dense on every device, as they would in one batch on one GPU; auto's refused choices).
"""

from __future__ import annotations

import logging
import threading

import torch

from ..attention import AUTOS, REGISTRY, AttentionConfig, AutoSelector, attention, op
from ..attention.calls import call_key
from ..attention.dispatch import error_vs_reference
from ..attention.stats import Stats
from . import lean, recheck
from .choose import DenseChoice
from .hook import (
    COMFYUI_OWN,
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
from .lane import Lane, Lanes
from .lean import MISS

log = logging.getLogger("patch_attention.nodes")


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
        self.choice = DenseChoice(config, sigma_range=sigma_range, dense_layers=dense_layers, sparse_sigma=sparse_sigma,
                                  previous=previous)
        self.rechecks = recheck.Rechecks()
        self.lane_set = Lanes(config)
        self._tls = self.lane_set.tls  # .lane: this thread's lane, one attribute read on the hot path
        self.report_error_every = report_error_every  # SpargeAttn report: error vs dense every N calls of a layer
        self.layer_options = layer_options  # callable(layer index, spec-ish dict) -> options or None
        self.log_stats = log_stats
        chosen = None if config.backend in AUTOS else REGISTRY.get(config.backend)  # an explicit backend
        self.audit = audit and chosen is not None and chosen.quantized
        self.nan_net = bool(config.check_finite)
        self.hides_nan = None  # the model's code sanitizes NaN (decided at its first forward)
        # dense calls on the fastest exact kernel per shape (`sdpa` chosen keeps ComfyUI's own function)
        if config.exact_selector is None and config.backend != COMFYUI_OWN:
            config.exact_selector = AutoSelector.exact()
        # compiled models subtract K's mean in their graph for a backend that declares it (see attention.op)
        self.smooth_k = chosen is not None and chosen.smooth_k
        self.op_handle = op.handle_tensor(op.register(self))  # what a compiled graph reads at every call (attention.op)
        # `sdpa` chosen and no dense layers to count: every call straight to ComfyUI's function (the hot path's test)
        self.comfyui_direct = self.choice.comfyui_own and not self.choice.dense_layers
        self.lean_ok = (not self.choice.comfyui_own and layer_options is None and not self.choice.dense_layers
                        and not log_stats and not config.record_time)
        self.replaced_by = None  # the override found on the hook instead of this one at the start of a run
        # `sdpa` in a compiled model runs ComfyUI's function inside the graph, where no call is counted: set where
        # that branch is traced, so a forward with no counted call is not taken for a model the hook cannot reach
        self.traced_host = False
        self.unreached_said = False  # the model's attention bypasses the hook: said in this run
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    @property
    def previous(self):
        """The override this one was applied over (None: none): it serves the calls left dense by choice."""
        return self.choice.previous

    @property
    def nonfinite_layers(self) -> set:
        """The layers whose kernel returned NaN/inf in this run (dense from then on)."""
        return self.choice.nonfinite_layers

    # ------------------------------------------------------------------ lanes

    def lane(self, device=None) -> Lane:
        """This thread's lane (on ``device``, when given: a thread that moves to another device gets that device's)."""
        return self.lane_set.lane(device)

    def start_forward(self, device=None) -> Lane:
        """A model forward starts in this thread: its lane's layer counter back to 0."""
        ln = self.lane(device)
        ln.layer = 0
        return ln

    def lanes(self) -> list[Lane]:
        return self.lane_set.all()

    @property
    def stats(self) -> Stats:
        """The statistics of every lane (every device of a MultiGPU split), merged."""
        return self.lane_set.stats

    # ------------------------------------------------------------------ the run

    def start_run(self, sigmas=None) -> None:
        self.rechecks.start_run(self.config, sigmas)
        self.choice.start_run()
        with self._lock:
            self.unreached_said = False
        self.lane_set.start_run()

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

    # ------------------------------------------------------------------ the calls

    def __call__(self, func, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self._traced(func, args, kwargs)
        ln = getattr(self._tls, "lane", None) or self.lane()  # this thread's lane: one attribute read (hot path)
        if func is ln.host and len(args) > 1 and self.comfyui_direct:
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
        if self.lean_ok and ln.active is not None and not self.choice.nonfinite_layers:
            # per forward: the kernel's calls (by sparse phase), or a forward Patch Attention runs dense (None)
            key = lean.key(args, kwargs, ln.config.sparse_ok if ln.active else None)
            if key is not None:
                out = lean.attempt(ln, key, func, args, kwargs)
                if out is not MISS:
                    return out
                if key in ln.lean:
                    key = None  # an entry the full path takes at this step or from now on: leave it
        a, rest = bind(args, kwargs)
        out = self._run(ln, func, args, kwargs, a, rest, wants_full_precision(a, rest))
        if key is not None:
            ln.lean[key] = lean.make(self, ln, func, a, dense=not ln.active) or False
        return out

    def _traced(self, func, args, kwargs):
        """A call while torch.compile traces the model."""
        if self.comfyui_direct and getattr(func, "__name__", None) == "attention_pytorch" and is_host_exact(func) \
                and len(args) > 1 and same_heads(args[0], args[1]):
            # `sdpa` in a compiled model: ComfyUI's own SDPA function traced into the graph, as in the unpatched model
            # (inductor compiles its SDPA call); nothing of the override's state is read or counted in traced code,
            # one flag is set: these calls reach the hook uncounted (the model does not bypass it).
            # Only attention_pytorch: ComfyUI's split/sub-quadratic functions query free memory (graph breaks).
            self.traced_host = True
            return func(*args, **kwargs)
        a, rest = bind(args, kwargs)
        mask, precise = a.get("mask"), wants_full_precision(a, rest)
        return op.traced_call(a["q"], a["k"], a["v"], mask, a["heads"], bool(a.get("skip_reshape", False)),
                              bool(a.get("skip_output_reshape", False)), self.op_handle, precise,
                              self.smooth_k and mask is None and not precise, rest.get("scale"),
                              bool(rest.get("enable_gqa", False)))

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
                and not self.choice.nonfinite_layers:
            key = call_key(q, k, v, heads, skip_reshape, False, None, False, k_smoothed,
                           ln.config.sparse_ok if ln.active else None, False)
            out = lean.attempt(ln, key, None, (q, k, v), None)
            if out is not MISS:
                return out
            if key in ln.lean:
                key = None
        a = {"q": q, "k": k, "v": v, "heads": heads, "mask": mask, "skip_reshape": skip_reshape,
             "skip_output_reshape": False}
        rest = {"scale": scale, "enable_gqa": enable_gqa} if (scale is not None or enable_gqa) else {}
        out = self._run(ln, None, None, None, a, rest, precise, k_smoothed)
        if key is not None:
            ln.lean[key] = lean.make(self, ln, None, a, k_smoothed, dense=not ln.active) or False
        return out

    def _dense_call(self, ln, func, args, kwargs, a, rest, why):
        """A call Patch Attention leaves dense for ``why``, where the dense-call rule sends it
        (:meth:`.choose.DenseChoice.route`)."""
        route = self.choice.route(ln, func, a["q"], a["k"], why)
        if route == PREVIOUS:
            ln.calls[PREVIOUS] += 1
            return self.choice.previous(func, *args, **kwargs)
        if route == HOST:
            ln.host = func
            ln.calls[HOST] += 1
            return call_function(func, args, kwargs)
        return attention(a["q"], a["k"], a["v"], a["heads"], a.get("mask"), config=ln.dense, **_call_kw(a, rest))

    def _run(self, ln, func, args, kwargs, a, rest, precise, k_smoothed=False):
        """The full path of one call: dense (:meth:`.choose.DenseChoice.why`) or the dispatcher, then the checks."""
        layer = ln.layer
        ln.layer = layer + 1
        cfg = ln.config
        why = self.choice.why(ln, layer, func, a, rest, precise)
        if why is not None:
            return self._dense_call(ln, func, args, kwargs, a, rest, why)
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
        if sparse_report and self.report_error_every and (ln.count_layer(layer) % self.report_error_every == 0):
            _, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
            cfg.stats.add_metrics(f"{cfg.backend}@layer{layer}", {"rel_l1_vs_dense": rel})
        return out


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
