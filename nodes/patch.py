"""Patching a model: the function the Patch Attention node calls, and the sparse-attention tuning run.

``patch_model`` returns a clone whose ``transformer_options['optimized_attention_override']`` is an
:class:`~.override.AttentionOverride` (see there for what it does per call), with an APPLY_MODEL wrapper (the NaN net
and the per-forward bookkeeping, :mod:`.nan_net`) and an OUTER_SAMPLE wrapper (per-run state, :mod:`.compose`).
Nothing else is touched: no module globals, no process-wide switches; other models in the same graph keep their own
attention.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from ..attention import AUTO, AUTO_EXACT, AUTO_FAST, REGISTRY, AttentionConfig, AutoSelector
from ..attention.auto import FAST_MAX_REL_L1, FAST_MIN_COS, default_cache_path
from ..attention.sparge_profile import SpargeProfile
from .choose import in_ranges
from .compose import SampleWrapper, install, previous_override
from .hook import OVERRIDE_KEY, HookMissingError, bind, check_hook
from .loaded import drop_released
from .nan_net import ForwardWrapper, as_float, model_hides_nan, output_flag
from .override import AttentionOverride

__all__ = ["OVERRIDE_KEY", "AttentionOverride", "ForwardWrapper", "HookMissingError", "SampleWrapper", "SparseSettings",
           "as_float", "check_hook", "in_ranges", "model_hides_nan", "output_flag", "override_of", "parse_layers",
           "patch_model", "tune_model"]

log = logging.getLogger("patch_attention.nodes")

SPARSE_START = 0.2  # the node's default: sparse kernels from 20 % of the schedule on, as ComfyUI's Model Sparse Attention

# auto_min_cos / auto_max_rel_l1: 0 means the chosen auto's own gate (auto: 0.999 / 0.039, auto_fast: 0.995 / 0.08).
# Before auto_fast existed the inputs' defaults were 0.995 / 0.08, saved in workflows as values: those were no choice
# of the user's (they were what "auto" meant), so they mean the chosen auto's own gate too. Any other value replaces
# that threshold, for auto (judged over the run) and for auto_fast (judged on the calls it times) alike.
GATE_OWN = 0.0
EARLIER_GATE = (FAST_MIN_COS, FAST_MAX_REL_L1)


def gate_input(value, earlier: float, name: str) -> float | None:
    """A gate input as the selector takes it: None (the choice's own threshold) for 0, None and ``earlier`` (the
    input's default before auto_fast); else the value, checked."""
    if value is None or value == GATE_OWN or abs(value - earlier) < 1e-9:
        return None
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1] (0: the chosen auto's own gate), got {value}")
    return value

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


@dataclass
class SparseSettings:
    """What a SpargeAttn Settings or Sol-Attn Settings node hands to :func:`patch_model` (``sparse``): the sparse kernel,
    its per-model options, and an optional per-layer profile."""

    variant: str
    options: dict
    profile: SpargeProfile | None = None
    report_error_every: int = 0

    def layer_options(self, layer, call):
        if self.profile is None:
            return None
        return self.profile.thresholds(layer)

    def __deepcopy__(self, memo):
        return self


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
    sparse: SparseSettings | None = None,
    auto_retune: bool = False,
    auto_min_cos: float | None = None,
    auto_max_rel_l1: float | None = None,
    record_time: bool | None = None,
    check_finite: bool = True,
    sparse_start_percent: float = 0.0,
):
    """Return a clone of ``model`` (a ComfyUI ModelPatcher) whose attention goes to ``backend``: a registry name,
    ``auto``, ``auto_fast`` (auto's earlier, looser gate) or ``auto_exact`` (the fastest exact kernel per call shape;
    also what every backend but ``sdpa`` runs the calls it leaves dense on).

    ``auto_min_cos`` / ``auto_max_rel_l1``: None or 0 (or 0.995 / 0.08, the inputs' earlier defaults) keep the chosen
    auto's own gate; another value replaces that threshold (see ``GATE_OWN``).

    ``backend="disabled"`` returns a clone with an earlier Patch Attention removed (and the override it was applied
    over, if any, back on the hook).  Over another override (Model Attention Backend, another pack's), that one serves
    the calls Patch Attention leaves dense (:mod:`.compose`).
    """
    check_hook()
    drop_released()  # before a MultiGPU node after this one reuses ComfyUI's loaded copies (nodes/loaded.py)
    m = model.clone()
    if backend == "disabled":
        return install(m, None)
    if not 0.0 <= start_percent <= end_percent <= 1.0:
        raise ValueError(f"need 0 <= start_percent <= end_percent <= 1, got {start_percent}, {end_percent}")
    ranges = parse_layers(dense_layers)
    options = {}
    layer_options = None
    if sparse is not None:
        options[sparse.variant] = sparse.options
        layer_options = sparse.layer_options
    auto = exact = None
    if backend in (AUTO, AUTO_FAST):
        gate = {k: v for k, v in (("min_cos", gate_input(auto_min_cos, EARLIER_GATE[0], "auto_min_cos")),
                                  ("max_rel_l1", gate_input(auto_max_rel_l1, EARLIER_GATE[1], "auto_max_rel_l1")))
                if v is not None}
        make = AutoSelector.fast if backend == AUTO_FAST else AutoSelector
        auto = make(cache_path=auto_cache_path(), retune=auto_retune, **gate)
    if backend != "sdpa":  # `sdpa` leaves every call to ComfyUI's own function
        exact = AutoSelector.exact(cache_path=auto_cache_path(), retune=auto_retune)
    cfg = AttentionConfig(
        backend=backend,
        allow_fallback=fallback,
        options=options,
        record_time=log_stats if record_time is None else record_time,
        check_finite="deferred" if check_finite else False,
        auto=auto,
        exact_selector=exact,
    )
    sigma_range = None
    if start_percent > 0.0 or end_percent < 1.0:
        ms = m.get_model_object("model_sampling")
        sigma_range = (float(ms.percent_to_sigma(start_percent)), float(ms.percent_to_sigma(end_percent)))
    sparse_sigma = None
    if not 0.0 <= sparse_start_percent <= 1.0:
        raise ValueError(f"need 0 <= sparse_start_percent <= 1, got {sparse_start_percent}")
    if sparse_start_percent > 0.0 and backend != AUTO_EXACT and (backend in (AUTO, AUTO_FAST) or REGISTRY.get(backend).sparse):
        sparse_sigma = float(m.get_model_object("model_sampling").percent_to_sigma(sparse_start_percent))
    ov = AttentionOverride(cfg, sigma_range=sigma_range, dense_layers=ranges, layer_options=layer_options, log_stats=log_stats,
                           report_error_every=getattr(sparse, "report_error_every", 0), previous=previous_override(m),
                           sparse_sigma=sparse_sigma)
    return install(m, ov)


class TuningOverride(AttentionOverride):
    """Tuning run: every call returns dense attention and measures sparse-kernel candidates (SpargeAttn's or
    Sol-Attn's); the profile is saved at the end. The search is measurement code (:mod:`..measure.sparge_tune`),
    imported when a tuning run is built, never by patching.  The run's progress (its steps) shows on the Tune Sparse
    Attention node (``node_id``), which ComfyUI executed before the sampler that runs the tuning; the terminal's bar
    counts the tuned calls."""

    def __init__(self, tuner, name: str, fingerprint: str, model_class: str, write=None, node_id: str | None = None):
        super().__init__(AttentionConfig(backend="sdpa"))
        self.tuner, self.name, self.fingerprint, self.model_class = tuner, name, fingerprint, model_class
        self.write = write or _write_profile  # (file name, JSON data) -> the path written
        self.path = None
        self.node_id = node_id
        self.saved = None
        self._bar = None
        self._ui = None  # ComfyUI's bar on the node, over the run's steps
        self._sigmas = ()

    def start_run(self, sigmas=None) -> None:
        super().start_run(sigmas)
        self._sigmas = tuple(float(s) for s in sigmas) if sigmas is not None else ()  # one sync per run
        self._ui = None
        if self.node_id is not None and len(self._sigmas) > 1:
            from .progress import progress_bar

            self._ui = progress_bar(len(self._sigmas) - 1, node_id=self.node_id)

    def _step_done(self, transformer_options) -> None:
        """At a forward's first call: the steps before this forward's sigma are done."""
        sig = as_float((transformer_options or {}).get("sigmas"))
        if sig is not None:
            self._ui.update_absolute(sum(1 for s in self._sigmas[:-1] if s > sig * (1 + 1e-6)))

    def __call__(self, func, *args, **kwargs):
        from ..measure.sparge_tune import tuning_attention

        a, rest = bind(args, kwargs)
        ln = self.lane()
        layer = ln.layer
        ln.layer += 1
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(desc=f"tuning {self.tuner.variant} per layer", unit="call")
        if layer == 0 and self._ui is not None:
            self._step_done(rest.get("transformer_options"))
        out = tuning_attention(self.tuner, layer, a["q"], a["k"], a["v"], a["heads"], a.get("mask"),
                               skip_reshape=bool(a.get("skip_reshape", False)),
                               skip_output_reshape=bool(a.get("skip_output_reshape", False)), stats=ln.config.stats)
        self._bar.update(1)
        return out

    def label(self) -> str:
        return f"Tune Sparse Attention ({self.tuner.variant})"

    def end_run(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._ui is not None:
            self._ui.update_absolute(self._ui.total)
            self._ui = None
        prof = self.tuner.profile(self.fingerprint, self.model_class,
                                  notes=f"{self.tuner.evaluations} candidate runs over {len(self.tuner.layers)} layers")
        self.path = self.write(self.name, prof.to_json())
        self.saved = prof
        lines = [f"{self.tuner.variant} profile saved to {self.path}: {len(prof.layers)} of {len(self.tuner.layers)} layers tuned "
                 f"(rel-L1 budget {prof.error_budget})"]
        from ..attention.sparge_profile import THRESHOLDS

        for i, e in sorted(prof.layers.items()):
            th = "  ".join(f"{k} {e[k]}" for k in THRESHOLDS if k in e)
            lines.append(f"  layer {i:>3}: {th}  sparsity {e['sparsity']:.3f}  rel-L1 {e['rel_l1']:.4f}")
        untuned = sorted(set(self.tuner.layers) - set(prof.layers))
        if untuned:
            lines.append(f"  layers within no candidate's budget (per-model thresholds apply): {untuned}")
        log.info("\n".join(lines))


def _write_profile(name: str, data: dict) -> str:
    from .files import write_json

    return write_json(name, data, "Tune Sparse Attention")


def tune_model(model, variant: str, error_budget: float, name: str, pvthreshd_values=(50,), write=None):
    """A clone whose next sampling run tunes sparse-attention settings per layer and writes the profile as ``name``
    in models/sparge_profiles (``write(name, data)``: elsewhere, for the benchmarks' own runs)."""
    check_hook()
    from ..attention.sparge_profile import default_grid, fingerprint_state_dict
    from ..measure.sparge_tune import SpargeTuner

    dm = model.model.diffusion_model
    grid = {**default_grid(variant), "pvthreshd": tuple(pvthreshd_values)}
    from .progress import executing_node

    ov = TuningOverride(SpargeTuner(variant=variant, budget=error_budget, grid=grid), name,
                        fingerprint_state_dict(dm.state_dict()), type(dm).__name__, write, node_id=executing_node())
    return install(model.clone(), ov)


def override_of(model) -> AttentionOverride | None:
    ov = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    return ov if isinstance(ov, AttentionOverride) else None
