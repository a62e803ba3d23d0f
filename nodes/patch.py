"""The attention override a patched model carries, and the function that patches a model.

ComfyUI (v0.3.64+) wraps every attention function with ``wrap_attn``: when a
model's ``transformer_options`` holds ``optimized_attention_override`` it is
called as ``override(func, q, k, v, heads, mask=None, ..., transformer_options=...)``.
:class:`AttentionOverride` is that callable.  It knows nothing of kernels; it
reads the sampling state (current sigma, which attention layer of the forward
this is) and hands the call to ``attention.dispatch``.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from ..attention import REGISTRY, AttentionConfig, AutoSelector, attention, op
from ..attention.auto import DEFAULT_MAX_REL_L1, DEFAULT_MIN_COS, default_cache_path
from ..attention.dispatch import direct_call, error_vs_reference, finite_flag

log = logging.getLogger("patch_attention.nodes")

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "patch_attention"


class HookMissingError(RuntimeError):
    pass


def check_hook() -> None:
    """Raise a clear error on a ComfyUI too old to have the attention override hook."""
    try:
        import comfy.ldm.modules.attention as comfy_attention
    except Exception as e:  # pragma: no cover - only outside ComfyUI
        raise HookMissingError(f"ComfyUI's attention module could not be imported: {e}") from e
    if not hasattr(comfy_attention, "wrap_attn"):
        try:
            from comfyui_version import __version__ as v
        except Exception:
            v = "unknown"
        raise HookMissingError(
            f"This ComfyUI (version {v}) has no attention override hook "
            "(transformer_options['optimized_attention_override'], added in v0.3.64). "
            "Update ComfyUI to use Patch Attention; nothing was patched."
        )


_RANGE = re.compile(r"^\s*(\d+)?\s*(-)?\s*(\d+)?\s*$")


def parse_layers(text: str) -> tuple[tuple[int, int | None], ...]:
    """``"0-3, 7, 40-"`` -> ((0, 3), (7, 7), (40, None)); empty -> (). ValueError names a bad part."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").replace(";", ",").split(","))):
        m = _RANGE.match(part)
        if not m or (m.group(1) is None and m.group(3) is None):
            raise ValueError(f"dense_layers: cannot read {part!r}; use indices and ranges like '0-3, 7, 40-'")
        lo = int(m.group(1)) if m.group(1) is not None else 0
        hi = (int(m.group(3)) if m.group(3) is not None else None) if m.group(2) else lo
        if hi is not None and hi < lo:
            raise ValueError(f"dense_layers: range {part!r} ends before it starts")
        out.append((lo, hi))
    return tuple(out)


def in_ranges(i: int, ranges) -> bool:
    return any(lo <= i and (hi is None or i <= hi) for lo, hi in ranges)


_ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _bind(args, kwargs):
    """ComfyUI's attention signature: (q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
    skip_output_reshape=False, **kwargs)."""
    bound = dict(zip(_ARG_NAMES, args))
    rest = dict(kwargs)
    for n in _ARG_NAMES:
        if n in rest:
            bound[n] = rest.pop(n)
    return bound, rest


# ComfyUI's exact attention functions: where Patch Attention runs dense attention and the model's own function is
# one of these, it calls that function, so a dense call costs what it cost before the patch.
HOST_EXACT = frozenset({"attention_pytorch", "attention_basic", "attention_split", "attention_sub_quad"})
HOST = "comfyui"  # stats name of calls handed to ComfyUI's own attention function


def is_host_exact(func) -> bool:
    return getattr(func, "__name__", None) in HOST_EXACT and getattr(func, "__module__", "") == "comfy.ldm.modules.attention"


def _as_float(sig):
    """A sigma (tensor, number or None) as a float; one device sync for a device tensor."""
    if sig is None or isinstance(sig, float):
        return sig
    try:
        return float(sig.flatten()[0]) if hasattr(sig, "flatten") else float(sig)
    except Exception:
        return None


def _same_heads(q, k) -> bool:
    """ComfyUI's own functions take no grouped-query call (fewer key heads): those stay with the dispatcher."""
    return q.shape[-1] == k.shape[-1] and (q.ndim == 3 or q.shape[1] == k.shape[1])


def wants_full_precision(a, rest) -> bool:
    """The model asked for full-precision attention on this call (newer ComfyUI passes
    ``low_precision_attention=False`` where 8-bit is unsafe; ``attn_precision=torch.float32`` is the older way)."""
    return rest.get("low_precision_attention", True) is False or a.get("attn_precision") is torch.float32


class AttentionOverride:
    """What a patched clone stores in ``transformer_options['optimized_attention_override']``.

    Shared (not copied) when ComfyUI deep-copies model options, so statistics and
    ``auto`` decisions survive ``ModelPatcher.clone()`` and sampling.

    Eager calls run here; under ``torch.compile`` the call becomes the custom op
    ``patch_attention::attention`` (:mod:`attention.op`), whose real implementation comes back to
    :meth:`op_call`, so tuning, statistics and NaN bookkeeping never run in traced code.
    """

    def __init__(self, config: AttentionConfig, *, sigma_range=None, dense_layers=(), layer_options=None,
                 log_stats=False, report_error_every=0, audit=True):
        self.config = config
        self.report_error_every = report_error_every  # SpargeAttn report: error vs dense every N calls of a layer
        self.dense = AttentionConfig(backend="sdpa", stats=config.stats)
        self.sigma_range = sigma_range  # (sigma_start, sigma_end): fast backend while end <= sigma <= start
        self.dense_layers = tuple(dense_layers)
        self.layer_options = layer_options  # callable(layer index, spec-ish dict) -> options or None
        self.log_stats = log_stats
        self.layer = 0  # attention call index within the current model forward
        self._layer_calls = {}
        self._dense_cache = {}  # layer -> in dense_layers
        self.nonfinite_layers = set()  # layers whose kernel returned NaN/inf this run: dense from then on
        # The NaN net (see _ForwardWrapper): per-call flags on the first forward of a run, on a redo, and on every
        # forward of a model whose code turns NaN into numbers (nan_to_num) where the output would no longer show it;
        # otherwise one check of the forward's output.
        self.nan_net = bool(config.check_finite)
        self.first_forward = True
        self.hides_nan = None  # the model's code sanitizes NaN (decided at its first forward)
        self.active = None  # step schedule for the current forward (None: not in a forward, read sigma per call)
        self.check_phase = None  # "mid"/"last": this forward re-checks auto's non-exact choices against dense
        self._checked = set()  # (phase, signature) re-checked this run
        self.check_sigmas = {}  # sigma of the middle and last step of the current run -> "mid"/"last"
        self.audit = audit and config.backend != "auto" and REGISTRY.get(config.backend).quantized
        self._audited = set()  # call kinds whose first call was compared with dense
        self.passthrough = config.backend == "sdpa" and not config.record_time  # `sdpa` is the host's SDPA call
        self.exact = config.backend != "auto" and not REGISTRY.get(config.backend).quantized
        # compiled models subtract K's mean in their graph for a backend that declares it (see attention.op)
        self.smooth_k = config.backend != "auto" and REGISTRY.get(config.backend).smooth_k
        self.handle = op.register(self)
        self._host = ()  # ComfyUI's exact attention function once seen (the hot path compares identity)
        # Lean path: per exact call shape, the resolved call (kernel, or ComfyUI's function for a refused shape), for
        # the common case -- no mask, no precision request, inside a forward on the schedule, nothing per layer.
        self.lean_ok = (not self.passthrough and layer_options is None and not self.dense_layers and not log_stats
                        and not config.record_time)
        self._lean = {}  # call key -> entry(func, args, kwargs, layer), or False: this shape takes the full path

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def start_forward(self) -> None:
        self.layer = 0

    def _active(self, transformer_options) -> bool:
        if self.sigma_range is None:
            return True
        if self.active is not None:
            return self.active
        sig = transformer_options.get("sigmas") if transformer_options else None
        return self.in_range(sig)

    def in_range(self, sig) -> bool:
        if self.sigma_range is None or sig is None:
            return True
        s = _as_float(sig)
        if s is None:
            return True
        hi, lo = self.sigma_range
        return lo <= s <= hi

    def lossy_ran(self) -> bool:
        """A lossy (quantized) kernel has run in this sampling run: only then can the NaN net find anything, and only
        then do auto's re-checks apply. A run on exact kernels (`sdpa`, auto keeping SDPA) pays neither."""
        return any(n in REGISTRY and REGISTRY.get(n).quantized for n in self.config.stats.calls)

    def rechecks_pending(self) -> bool:
        """``auto`` has run a lossy choice in this run, so its middle and last steps re-check those: only then does a
        forward read its sigma for the phase (a device sync per forward)."""
        return bool(self.check_sigmas) and self.lossy_ran()

    def phase_of(self, sigma):
        """"mid"/"last" when ``sigma`` is the middle or last step of the run (auto re-checks then), else None."""
        s = _as_float(sigma) if self.check_sigmas else None
        if s is None:
            return None
        return next((p for x, p in self.check_sigmas.items() if abs(x - s) <= 1e-4 * max(abs(x), 1e-6)), None)

    def _is_dense(self, layer, topts) -> bool:
        if layer in self.nonfinite_layers or not self._active(topts):
            return True
        if not self.dense_layers:
            return False
        hit = self._dense_cache.get(layer)
        if hit is None:
            hit = self._dense_cache[layer] = in_ranges(layer, self.dense_layers)
        return hit

    def __call__(self, func, *args, **kwargs):
        compiling = torch.compiler.is_compiling()  # read once: every branch below depends on it
        if compiling and self.passthrough and not self.dense_layers \
                and getattr(func, "__name__", None) == "attention_pytorch" and is_host_exact(func) \
                and len(args) > 1 and _same_heads(args[0], args[1]):
            # `sdpa` in a compiled model: ComfyUI's own SDPA function traced into the graph, as in the unpatched model
            # (inductor compiles its SDPA call); nothing of the override's state is read or counted in traced code.
            # Only attention_pytorch: ComfyUI's split/sub-quadratic functions query free memory (graph breaks).
            return func(*args, **kwargs)
        if func is self._host and len(args) > 1 and self.passthrough and not self.dense_layers:
            # `sdpa` on ComfyUI's own exact function: hand the call over, a few attribute reads (hot path)
            if _same_heads(args[0], args[1]) and not compiling:
                self.layer += 1
                self.config.stats.calls[HOST] += 1
                return func(*args, **kwargs)
        key = None
        # `compiling` first: dynamo must not read (and guard on) the per-forward state below
        if not compiling and self.lean_ok and self.active is True and not self.nonfinite_layers:
            key = self._lean_key(args, kwargs)
            if key is not None:
                ran, val = self._try_lean(key, func, args, kwargs)
                if ran:
                    return val
                key = val
        a, rest = _bind(args, kwargs)
        if compiling:
            mask, precise = a.get("mask"), wants_full_precision(a, rest)
            return op.traced_call(a["q"], a["k"], a["v"], mask, a["heads"], bool(a.get("skip_reshape", False)),
                                  bool(a.get("skip_output_reshape", False)), self.handle, precise,
                                  self.smooth_k and mask is None and not precise)
        out = self._run(func, args, kwargs, a, rest.get("transformer_options"), wants_full_precision(a, rest))
        if key is not None:
            self._lean[key] = self._make_lean(func, a) or False
        return out

    def _try_lean(self, key, func, args, kwargs):
        """``(True, output)`` when the cached entry for ``key`` ran; else ``(False, k)``, ``k`` the key to cache an
        entry under after the full path has run this call (None: leave it)."""
        entry = self._lean.get(key)
        if entry and self.check_phase is not None and not entry.exact:
            return False, None  # auto re-checks its lossy choices at this step: the full path does that
        if entry:
            layer = self.layer
            self.layer = layer + 1
            try:
                return True, entry(func, args, kwargs, layer)
            except Exception:  # the full path falls back and counts it
                self.layer = layer
                self._lean[key] = False
                return False, None
        return False, None if entry is False else key

    @staticmethod
    def _lean_key(args, kwargs):
        """The exact call shape, or None when this call is not one the lean path takes (a mask, a precision request)."""
        if len(args) < 3 or len(args) > 4 or kwargs.get("mask") is not None or wants_full_precision(kwargs, kwargs):
            return None
        q, k, v = args[0], args[1], args[2]
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        return (q.shape, k.shape, v.shape, q.dtype, q.device, heads, kwargs.get("skip_reshape", False),
                kwargs.get("skip_output_reshape", False))

    def _make_lean(self, func, a, k_smoothed=False):
        """The lean entry for this call shape (after its first call took the full path and was audited), or None."""
        cfg = self.config
        q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
        sr, sor = bool(a.get("skip_reshape", False)), bool(a.get("skip_output_reshape", False))
        name = cfg.backend
        try:
            if cfg.auto is not None:
                from ..attention.auto import signature
                from ..attention.dispatch import prepare

                sig = signature(prepare(q, k, v, heads, None, sr)[4])
                name = cfg.auto.decisions.get(sig)
                if name is None or sig in cfg.auto.demoted:
                    return None
            if name == "sdpa" and is_host_exact(func) and _same_heads(q, k):
                stats = cfg.stats

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
        if refused and cfg.allow_fallback and not cfg.fallbacks and is_host_exact(func) and _same_heads(q, k):
            stats = cfg.stats

            def host(func, args, kwargs, layer):  # what the full path does for this shape: SDPA, as ComfyUI runs it
                stats.count_fallback(name, "sdpa", refused)
                stats.count_call(HOST)
                return func(*args, **kwargs)

            host.exact = True
            return host
        return None

    def op_call(self, q, k, v, mask, heads, skip_reshape, precise, k_smoothed):
        """The custom op's real implementation (compiled models): the same path, without ComfyUI's function; returns
        ``[B, N, H*Dv]`` (the op's caller reshapes in the graph).  ``k_smoothed``: the graph subtracted K's mean."""
        key = None
        if self.lean_ok and mask is None and not precise and self.active is True and not self.nonfinite_layers:
            ran, val = self._try_lean((q.shape, k.shape, v.shape, q.dtype, q.device, heads, skip_reshape, k_smoothed),
                                      None, (q, k, v), None)
            if ran:
                return val
            key = val
        a = {"q": q, "k": k, "v": v, "heads": heads, "mask": mask, "skip_reshape": skip_reshape,
             "skip_output_reshape": False}
        out = self._run(None, None, None, a, None, precise, k_smoothed)
        if key is not None:
            self._lean[key] = self._make_lean(None, a, k_smoothed) or False
        return out

    def _run(self, func, args, kwargs, a, topts, precise, k_smoothed=False):
        layer = self.layer
        self.layer = layer + 1
        dense = self._is_dense(layer, topts)
        if precise and not dense and not self.exact:
            dense = True
            self.config.stats.count_fallback(self.config.backend, "sdpa", "full precision requested by the model")
        if (dense or self.passthrough) and func is not None and is_host_exact(func) and _same_heads(a["q"], a["k"]):
            self._host = func
            self.config.stats.count_call(HOST)
            return func(*args, **kwargs)
        cfg = self.dense if dense else self.config
        options = None
        if not dense and self.layer_options is not None:
            options = self.layer_options(layer, a)
        sparse_report = not dense and self.log_stats and cfg.backend.startswith("sparge")
        if sparse_report:
            options = {**(options or {}), "collect_sparsity": True}
        kw = dict(skip_reshape=bool(a.get("skip_reshape", False)), skip_output_reshape=bool(a.get("skip_output_reshape", False)))
        q, k, v, heads, mask = a["q"], a["k"], a["v"], a["heads"], a.get("mask")
        out = attention(q, k, v, heads, mask, config=cfg, options=options,
                        tag=f"layer{layer}" if sparse_report else None, check_key=layer, k_smoothed=k_smoothed, **kw)
        if dense:
            return out
        if self.audit:
            kind = (q.shape[1:], k.shape[1:], heads, None if mask is None else (mask.shape, mask.dtype))
            if kind not in self._audited:
                self._audited.add(kind)
                self._audit(layer, q, k, v, heads, mask, kw, out)
        elif self.check_phase is not None:
            out = self._recheck(layer, q, k, v, heads, mask, kw, out)
        if sparse_report and self.report_error_every and (self.layer_calls(layer) % self.report_error_every == 0):
            _, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
            cfg.stats.add_metrics(f"{cfg.backend}@layer{layer}", {"rel_l1_vs_dense": rel})
        return out

    def _gate(self):
        auto = self.config.auto
        if auto is not None:
            return auto.min_cos, auto.max_rel_l1
        return DEFAULT_MIN_COS, DEFAULT_MAX_REL_L1

    def _audit(self, layer, q, k, v, heads, mask, kw, out):
        """First call of a kind on an explicitly chosen lossy backend: its error against dense SDPA, logged once if
        beyond the auto gate (one dense call and one sync per call kind, once for the life of the patched model)."""
        cos, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
        name = self.config.backend
        self.config.stats.add_metrics(f"{name}@first-call", {"cos_vs_dense": cos, "rel_l1_vs_dense": rel})
        min_cos, max_rel = self._gate()
        if not (cos >= min_cos and rel <= max_rel):
            log.warning("%s on attention layer %d (q %s, k %s): cos %.5f, rel-L1 %.4f against dense attention, beyond "
                        "auto's gate (cos >= %g, rel-L1 <= %g); choose auto or an exact backend if the image suffers",
                        name, layer, tuple(q.shape), tuple(k.shape), cos, rel, min_cos, max_rel)
            self.config.stats.count_error(name, f"beyond auto's gate on its first call (rel-L1 {rel:.3f})")

    def _recheck(self, layer, q, k, v, heads, mask, kw, out):
        """auto, at the middle and last step: each non-exact choice is compared with dense SDPA once per signature;
        one that fails the gate is replaced by SDPA for the rest of the run (this call's output too)."""
        from ..attention.auto import signature
        from ..attention.dispatch import prepare

        auto = self.config.auto
        if auto is None:
            return out
        spec = prepare(q, k, v, heads, mask, kw["skip_reshape"])[4]
        sig = signature(spec)
        name = auto.decisions.get(sig)
        if name is None or not REGISTRY.get(name).quantized or (self.check_phase, sig) in self._checked:
            return out
        self._checked.add((self.check_phase, sig))
        cos, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
        stats = self.config.stats
        stats.add_metrics(f"{name}@recheck-{self.check_phase}", {"cos_vs_dense": cos, "rel_l1_vs_dense": rel})
        if cos >= auto.min_cos and rel <= auto.max_rel_l1:
            return out
        auto.demote(sig, f"failed the gate at the {self.check_phase} step (cos {cos:.5f}, rel-L1 {rel:.4f})")
        self.config._fast.clear()
        self._lean.clear()
        stats.decisions[sig] = f"sdpa for the rest of this run: {name} failed the gate at the {self.check_phase} step " \
                               f"(cos {cos:.5f}, rel-L1 {rel:.4f})"
        log.warning("auto: %s failed the accuracy gate at the %s step on layer %d (cos %.5f, rel-L1 %.4f); "
                    "SDPA for the rest of this run", name, self.check_phase, layer, cos, rel)
        return attention(q, k, v, heads, mask, config=self.dense, **kw)

    def layer_calls(self, layer: int) -> int:
        self._layer_calls[layer] = self._layer_calls.get(layer, 0) + 1
        return self._layer_calls[layer] - 1

    def start_run(self, sigmas=None) -> None:
        self.check_sigmas = {}
        if self.config.auto is not None and sigmas is not None and len(sigmas) > 2:
            steps = [float(x) for x in sigmas[:-1]]  # one sync per run; the last sigma is the end of the schedule
            self.check_sigmas = {steps[len(steps) // 2]: "mid", steps[-1]: "last"}
        self.config.stats.reset()
        self._layer_calls = {}
        self.nonfinite_layers = set()
        self._checked = set()
        self._lean.clear()
        self.first_forward = True
        if self.config.auto is not None:
            self.config.auto.demoted.clear()
            self.config._fast.clear()

    def end_run(self) -> None:
        if self.log_stats:
            log.info("Patch Attention (%s): %s", self.config.backend, self.config.stats.summary())


class _Wrapper:
    """A ModelPatcher wrapper bound to one override; shared, not copied, when model options are deep-copied."""

    def __init__(self, override):
        self.override = override

    def __deepcopy__(self, memo):
        return self


class _ForwardWrapper(_Wrapper):
    """APPLY_MODEL wrapper around one model forward: the layer counter back to 0, the step schedule and auto's
    re-check phase read once (not per attention call), and the NaN net read with one sync per forward.
    It wraps ComfyUI's torch.compile wrapper from outside, so it runs eagerly in compiled models too.

    The NaN net: on the first forward of a run (and on every forward of a model that sanitizes NaN itself), each
    quantized call leaves a finite flag on the device and the forward reads them all at once; on later forwards only
    the forward's output is checked (one reduction instead of one per attention call: on host-bound models the
    per-call flags cost more than 2 % of a step). A non-finite output is recomputed with per-call flags to find the
    layers; those run dense for the rest of the run and the forward is computed again."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        cfg = ov.config
        sigma = args[1] if len(args) > 1 else kwargs.get("t")
        recheck = ov.rechecks_pending()
        if ov.sigma_range is not None or recheck:
            sigma = _as_float(sigma)  # read once for both uses below: one sync per forward
        ov.active = ov.in_range(sigma) if ov.sigma_range is not None else True
        ov.check_phase = ov.phase_of(sigma) if recheck else None
        ov.start_forward()
        per_call = False
        if ov.nan_net:
            if ov.hides_nan is None:
                ov.hides_nan = model_hides_nan(getattr(executor, "class_obj", None))
            per_call = ov.first_forward or ov.hides_nan
            cfg.check_finite = "deferred" if per_call else False
        cfg.in_forward = True
        try:
            out = executor(*args, **kwargs)
            bad = []
            if per_call:
                bad = cfg.take_nonfinite()
            elif ov.nan_net and ov.lossy_ran():  # the output check reads a device flag: one sync per forward
                flag = output_flag(out)
                if flag is None:  # an output this check cannot read: per-call flags from now on
                    ov.hides_nan = True
                elif not bool(flag.isfinite()):
                    cfg.check_finite = "deferred"  # find the layers: the same forward with per-call flags
                    ov.start_forward()
                    out = executor(*args, **kwargs)
                    bad = cfg.take_nonfinite()
            if bad:
                # A kernel returned NaN/inf somewhere in this forward: those layers run dense for the rest of the
                # sampling run, and the forward is computed again.
                for layer, name in bad:
                    ov.nonfinite_layers.add(layer)
                    cfg.stats.count_fallback(name, "sdpa", "non-finite output (forward redone)")
                    _warn_nonfinite(name, layer)
                ov.start_forward()
                out = executor(*args, **kwargs)
                cfg.take_nonfinite()
            ov.first_forward = False
        finally:
            cfg.in_forward = False
            if ov.nan_net:
                cfg.check_finite = "deferred"  # outside a forward: checked at once
            ov.active = None
            ov.check_phase = None
        return out


def output_flag(out):
    """A 0-d device tensor, finite exactly when the forward's output is (NaN in any attention output reaches it), or
    None for an output that is not one tensor."""
    return finite_flag(out) if isinstance(out, torch.Tensor) and out.is_floating_point() else None


_hides_nan_cache = {}


def model_hides_nan(base_model) -> bool:
    """Whether the diffusion model's code (its package's loaded modules) calls nan_to_num: NaN from an attention
    kernel could then be gone from the forward's output, so that model keeps per-call flags. Unknown: True."""
    import sys

    dm = getattr(base_model, "diffusion_model", None)
    if dm is None:
        return True
    cls = type(dm)
    if cls in _hides_nan_cache:
        return _hides_nan_cache[cls]
    pkg = cls.__module__.rsplit(".", 1)[0] if "." in cls.__module__ else cls.__module__
    hides = False
    try:
        for name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None)
            if path and path.endswith(".py") and (name == pkg or name.startswith(pkg + ".")):
                with open(path, encoding="utf-8", errors="replace") as f:
                    if "nan_to_num" in f.read():
                        hides = True
                        break
    except OSError:
        hides = True
    _hides_nan_cache[cls] = hides
    return hides


_warned_nonfinite = set()


def _warn_nonfinite(name, layer):
    if (name, layer) not in _warned_nonfinite:
        _warned_nonfinite.add((name, layer))
        log.warning("%s returned NaN/inf at attention layer %d (SageAttention does so when all keys are equal, "
                    "e.g. a zeroed prompt); that layer runs on SDPA for the rest of this run", name, layer)


class _SampleWrapper(_Wrapper):
    """OUTER_SAMPLE wrapper: statistics per sampling run, logged at its end when asked; the run's sigmas (for auto's
    re-check at the middle and last step)."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        ov.start_run(sigmas)
        try:
            return executor(*args, **kwargs)
        finally:
            ov.end_run()


def auto_cache_path() -> str:
    try:
        import folder_paths

        return os.path.join(folder_paths.get_user_directory(), "patch_attention", "auto.json")
    except Exception:
        return default_cache_path()


def patch_model(
    model,
    backend: str = "auto",
    *,
    fallback: bool = True,
    start_percent: float = 0.0,
    end_percent: float = 1.0,
    dense_layers: str = "",
    log_stats: bool = False,
    sparge=None,
    auto_retune: bool = False,
    auto_min_cos: float = DEFAULT_MIN_COS,
    auto_max_rel_l1: float = DEFAULT_MAX_REL_L1,
    record_time: bool | None = None,
    check_finite: bool = True,
):
    """Return a clone of ``model`` (a ComfyUI ModelPatcher) whose attention goes to ``backend``.

    ``backend="disabled"`` returns a clone with any earlier override removed.
    """
    check_hook()
    m = model.clone()
    if backend == "disabled":
        return _install(m, None)
    if not 0.0 <= start_percent <= end_percent <= 1.0:
        raise ValueError(f"need 0 <= start_percent <= end_percent <= 1, got {start_percent}, {end_percent}")
    ranges = parse_layers(dense_layers)
    options = {}
    layer_options = None
    if sparge is not None:
        options[sparge.variant] = sparge.options
        layer_options = sparge.layer_options
    auto = None
    if backend == "auto":
        auto = AutoSelector(cache_path=auto_cache_path(), retune=auto_retune, min_cos=auto_min_cos, max_rel_l1=auto_max_rel_l1)
    cfg = AttentionConfig(
        backend=backend,
        allow_fallback=fallback,
        options=options,
        record_time=log_stats if record_time is None else record_time,
        check_finite="deferred" if check_finite else False,
        auto=auto,
    )
    sigma_range = None
    if start_percent > 0.0 or end_percent < 1.0:
        ms = m.get_model_object("model_sampling")
        sigma_range = (float(ms.percent_to_sigma(start_percent)), float(ms.percent_to_sigma(end_percent)))
    ov = AttentionOverride(cfg, sigma_range=sigma_range, dense_layers=ranges, layer_options=layer_options, log_stats=log_stats,
                           report_error_every=getattr(sparge, "report_error_every", 0))
    return _install(m, ov)


def _install(m, ov):
    """Put ``ov`` and its wrappers on the clone ``m`` (replacing an earlier patch); ``None`` removes them."""
    import comfy.patcher_extension as pe

    topts = m.model_options.setdefault("transformer_options", {})
    if ov is None:
        topts.pop(OVERRIDE_KEY, None)
    else:
        topts[OVERRIDE_KEY] = ov
    for kind, wrapper in ((pe.WrappersMP.APPLY_MODEL, _ForwardWrapper), (pe.WrappersMP.OUTER_SAMPLE, _SampleWrapper)):
        m.remove_wrappers_with_key(kind, WRAPPER_KEY)
        if ov is not None:
            m.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper(ov))
    return m


class TuningOverride(AttentionOverride):
    """Tuning run: every call returns dense attention and measures SpargeAttn candidates; the profile is saved at the end."""

    def __init__(self, tuner, path: str, fingerprint: str, model_class: str):
        super().__init__(AttentionConfig(backend="sdpa"))
        self.tuner, self.path, self.fingerprint, self.model_class = tuner, path, fingerprint, model_class
        self.saved = None
        self._bar = None

    def __call__(self, func, *args, **kwargs):
        from ..attention.sparge_tune import tuning_attention

        a, rest = _bind(args, kwargs)
        layer = self.layer
        self.layer += 1
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(desc=f"tuning {self.tuner.variant} per layer", unit="call")
        out = tuning_attention(self.tuner, layer, a["q"], a["k"], a["v"], a["heads"], a.get("mask"),
                               skip_reshape=bool(a.get("skip_reshape", False)),
                               skip_output_reshape=bool(a.get("skip_output_reshape", False)), stats=self.config.stats)
        self._bar.update(1)
        return out

    def end_run(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        prof = self.tuner.profile(self.fingerprint, self.model_class,
                                  notes=f"{self.tuner.evaluations} candidate runs over {len(self.tuner.layers)} layers")
        prof.save(self.path)
        self.saved = prof
        lines = [f"SpargeAttn profile saved to {self.path}: {len(prof.layers)} of {len(self.tuner.layers)} layers tuned "
                 f"(rel-L1 budget {prof.error_budget})"]
        for i, e in sorted(prof.layers.items()):
            lines.append(f"  layer {i:>3}: simthreshd1 {e.get('simthreshd1')} {('topk ' + str(e['topk'])) if 'topk' in e else 'cdfthreshd ' + str(e.get('cdfthreshd'))}"
                         f"  sparsity {e['sparsity']:.3f}  rel-L1 {e['rel_l1']:.4f}")
        untuned = sorted(set(self.tuner.layers) - set(prof.layers))
        if untuned:
            lines.append(f"  layers within no candidate's budget (per-model thresholds apply): {untuned}")
        log.info("\n".join(lines))


def tune_model(model, variant: str, error_budget: float, path: str, pvthreshd_values=(50,)):
    """A clone whose next sampling run tunes SpargeAttn thresholds per layer and writes the profile to ``path``."""
    check_hook()
    from ..attention.sparge_profile import default_grid, fingerprint_state_dict
    from ..attention.sparge_tune import SpargeTuner

    dm = model.model.diffusion_model
    grid = {**default_grid(variant), "pvthreshd": tuple(pvthreshd_values)}
    ov = TuningOverride(SpargeTuner(variant=variant, budget=error_budget, grid=grid), path,
                        fingerprint_state_dict(dm.state_dict()), type(dm).__name__)
    return _install(model.clone(), ov)


def override_of(model) -> AttentionOverride | None:
    ov = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    return ov if isinstance(ov, AttentionOverride) else None
