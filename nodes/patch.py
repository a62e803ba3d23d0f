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

from ..attention import AttentionConfig, AutoSelector, attention
from ..attention.auto import DEFAULT_MAX_REL_L1, DEFAULT_MIN_COS, default_cache_path

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


def _bind(args, kwargs):
    """ComfyUI's attention signature: (q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
    skip_output_reshape=False, **kwargs)."""
    names = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
    bound = dict(zip(names, args))
    rest = dict(kwargs)
    for n in names:
        if n in rest:
            bound[n] = rest.pop(n)
    return bound, rest


class AttentionOverride:
    """What a patched clone stores in ``transformer_options['optimized_attention_override']``.

    Shared (not copied) when ComfyUI deep-copies model options, so statistics and
    ``auto`` decisions survive ``ModelPatcher.clone()`` and sampling.
    """

    def __init__(self, config: AttentionConfig, *, sigma_range=None, dense_layers=(), layer_options=None,
                 log_stats=False, report_error_every=0):
        self.config = config
        self.report_error_every = report_error_every  # SpargeAttn report: error vs dense every N calls of a layer
        self.dense = AttentionConfig(backend="sdpa", stats=config.stats)
        self.sigma_range = sigma_range  # (sigma_start, sigma_end): fast backend while end <= sigma <= start
        self.dense_layers = tuple(dense_layers)
        self.layer_options = layer_options  # callable(layer index, spec-ish dict) -> options or None
        self.log_stats = log_stats
        self.layer = 0  # attention call index within the current model forward
        self._layer_calls = {}
        self.nonfinite_layers = set()  # layers whose kernel returned NaN/inf this run: dense from then on

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def start_forward(self) -> None:
        self.layer = 0

    def _active(self, transformer_options) -> bool:
        if self.sigma_range is None or not transformer_options:
            return True
        sig = transformer_options.get("sigmas")
        if sig is None:
            return True
        try:
            s = float(sig.flatten()[0]) if hasattr(sig, "flatten") else float(sig)
        except Exception:
            return True
        hi, lo = self.sigma_range
        return lo <= s <= hi

    def __call__(self, func, *args, **kwargs):
        a, rest = _bind(args, kwargs)
        topts = rest.get("transformer_options") or {}
        layer = self.layer
        self.layer += 1
        dense = (self.dense_layers and in_ranges(layer, self.dense_layers)) or layer in self.nonfinite_layers \
            or not self._active(topts)
        cfg = self.dense if dense else self.config
        options = None
        if not dense and self.layer_options is not None:
            options = self.layer_options(layer, a)
        sparse_report = not dense and self.log_stats and cfg.backend.startswith("sparge")
        if sparse_report:
            options = {**(options or {}), "collect_sparsity": True}
        kw = dict(skip_reshape=bool(a.get("skip_reshape", False)), skip_output_reshape=bool(a.get("skip_output_reshape", False)))
        out = attention(a["q"], a["k"], a["v"], a["heads"], a.get("mask"), config=cfg, options=options,
                        tag=f"layer{layer}" if sparse_report else None, check_key=layer, **kw)
        if sparse_report and self.report_error_every and (self.layer_calls(layer) % self.report_error_every == 0):
            ref = attention(a["q"], a["k"], a["v"], a["heads"], a.get("mask"), config=AttentionConfig(backend="sdpa"), **kw)
            rel = ((out.float() - ref.float()).abs().sum() / ref.float().abs().sum().clamp_min(1e-12)).item()
            cfg.stats.add_metrics(f"{cfg.backend}@layer{layer}", {"rel_l1_vs_dense": rel})
        return out

    def layer_calls(self, layer: int) -> int:
        self._layer_calls[layer] = self._layer_calls.get(layer, 0) + 1
        return self._layer_calls[layer] - 1

    def start_run(self) -> None:
        self.config.stats.reset()
        self._layer_calls = {}
        self.nonfinite_layers = set()

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
    """APPLY_MODEL wrapper: one model forward begins (layer counter back to 0)."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        ov.start_forward()
        out = executor(*args, **kwargs)
        bad = ov.config.take_nonfinite() if ov.config.check_finite == "deferred" else []
        if bad:
            # A kernel returned NaN/inf somewhere in this forward (read with one sync per forward): those layers
            # run dense for the rest of the sampling run, and the forward is computed again.
            for layer, name in bad:
                ov.nonfinite_layers.add(layer)
                ov.config.stats.count_fallback(name, "sdpa", "non-finite output (forward redone)")
                _warn_nonfinite(name, layer)
            ov.start_forward()
            out = executor(*args, **kwargs)
            ov.config.take_nonfinite()
        return out


_warned_nonfinite = set()


def _warn_nonfinite(name, layer):
    if (name, layer) not in _warned_nonfinite:
        _warned_nonfinite.add((name, layer))
        log.warning("%s returned NaN/inf at attention layer %d (SageAttention does so when all keys are equal, "
                    "e.g. a zeroed prompt); that layer runs on SDPA for the rest of this run", name, layer)


class _SampleWrapper(_Wrapper):
    """OUTER_SAMPLE wrapper: statistics per sampling run, logged at its end when asked."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        ov.start_run()
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
