"""Tune SpargeAttn thresholds per layer during a real sampling run.

While tuning, every attention call of the model computes dense attention
(returned, so the run samples exactly as dense) and, for each candidate
threshold set, SpargeAttn's output, its relative L1 error against dense (the
library's own tuning criterion) and its sparsity.  Per layer, the winner is
the candidate with the highest mean sparsity whose worst error over all calls
stays within the budget.  Sparsity only grows along each ``cdfthreshd`` (or
``topk``) walk, so a walk stops at its first candidate over budget.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..attention.sparge_profile import DEFAULT_BUDGET, SpargeProfile, default_grid


def candidates(variant: str, grid=None) -> list[list[dict]]:
    """Walks of threshold dicts, one per (simthreshd1, pvthreshd) -- or per ``outer`` entry (Sol-Attn) -- each ordered
    from conservative to aggressive."""
    g = grid or default_grid(variant)
    if "outer" in g:
        return [[{**o, g["walk_key"]: w} for w in g["walk"]] for o in g["outer"]]
    pvs = g["pvthreshd"] if isinstance(g["pvthreshd"], (tuple, list)) else (g["pvthreshd"],)
    return [[{"simthreshd1": s, g["walk_key"]: w, "pvthreshd": pv} for w in g["walk"]] for s in g["simthreshd1"] for pv in pvs]


def _key(th: dict) -> tuple:
    return tuple(sorted(th.items()))


@dataclass
class LayerRecord:
    calls: int = 0
    worst: dict = field(default_factory=lambda: defaultdict(float))  # candidate -> worst error
    sparsity: dict = field(default_factory=lambda: defaultdict(list))  # candidate -> sparsities
    skipped: set = field(default_factory=set)  # candidates over budget at some call


@dataclass
class SpargeTuner:
    """Accumulates per-layer measurements; ``evaluate(layer, run)`` is called once per attention call.

    ``run(thresholds) -> (error, sparsity)`` runs SpargeAttn on the call's tensors against dense.
    """

    variant: str = "sparge"
    budget: float = DEFAULT_BUDGET
    grid: dict | None = None  # default_grid(variant); "pvthreshd" may be a tuple of values to search
    layers: dict = field(default_factory=lambda: defaultdict(LayerRecord))
    evaluations: int = 0

    def evaluate(self, layer: int, run) -> None:
        rec = self.layers[layer]
        rec.calls += 1
        for walk in candidates(self.variant, self.grid):
            for th in walk:
                k = _key(th)
                if k in rec.skipped:
                    break  # over budget at an earlier call: so is the rest of this walk
                err, sp = run(th)
                self.evaluations += 1
                if not math.isfinite(err) or err > self.budget:
                    rec.skipped.add(k)
                    break
                rec.worst[k] = max(rec.worst[k], err)
                rec.sparsity[k].append(sp)

    def best(self, layer: int):
        rec = self.layers.get(layer)
        if rec is None:
            return None
        best = None
        for k, sps in rec.sparsity.items():
            if k in rec.skipped or len(sps) < rec.calls:
                continue
            mean_sp = sum(sps) / len(sps)
            cand = (mean_sp, -rec.worst[k], k)
            if best is None or cand > best:
                best = cand
        if best is None:
            return None
        sp, neg_err, k = best
        return dict(k), -neg_err, sp

    def profile(self, fingerprint: str = "", model_class: str = "", notes: str = "") -> SpargeProfile:
        layers = {}
        for i in sorted(self.layers):
            b = self.best(i)
            if b is None:
                continue  # no candidate met the budget: the layer keeps the per-model thresholds
            th, err, sp = b
            layers[i] = {**th, "sparsity": round(sp, 4), "rel_l1": round(err, 5), "calls": self.layers[i].calls}
        return SpargeProfile(variant=self.variant, model_fingerprint=fingerprint, model_class=model_class,
                             error_metric="rel_l1", error_budget=self.budget, layers=layers, notes=notes)


def aggressiveness(variant: str, th: dict, extras) -> float:
    """What a tuning run maximizes within the error budget: SpargeAttn's measured sparsity; for Sol-Attn (which reports
    none) how sparse its setting is, monotone along each walk (tau / 4, or 1 - keep_ratio)."""
    if variant == "kitchen_sol":
        return float(th["tau"]) / 4.0
    if variant == "kitchen_sol_topk":
        return 1.0 - float(th["keep_ratio"])
    return (extras or {}).get("sparsity", 0.0)


def tuning_attention(tuner: SpargeTuner, layer: int, q, k, v, heads, mask=None, *, skip_reshape=False,
                     skip_output_reshape=False, stats=None):
    """One attention call of a tuning run: returns dense attention; measures the candidates when SpargeAttn can take it."""
    from ..attention.calls import finish, plan_for, prepare, run_backend
    from ..attention.reference import accuracy
    from ..attention.registry import REGISTRY

    q4, k4, v4, layout, spec, mask4, scale = prepare(q, k, v, heads, mask, skip_reshape)
    sdpa = REGISTRY.get("sdpa")
    dense, _ = run_backend(sdpa, q4, k4, v4, layout, mask4, spec, plan_for(sdpa, spec)[0], scale, {})
    backend = REGISTRY.get(tuner.variant)
    target, reason = plan_for(backend, spec)
    if reason is None:
        reason = backend.refuses(spec, None)
    if reason is None:
        sol = tuner.variant.startswith("kitchen_sol")

        def run(th):
            opts = dict(th) if sol else {**th, "collect_sparsity": True}
            out, extras = run_backend(backend, q4, k4, v4, layout, None, spec, target, scale, opts)
            _, rel = accuracy(out, dense)
            return rel, aggressiveness(tuner.variant, th, extras)

        tuner.evaluate(layer, run)
    elif stats is not None:
        stats.count_fallback(tuner.variant, "sdpa", f"not tuned: {reason}")
    if stats is not None:
        stats.count_call("sdpa")
    return finish(dense, layout, spec, skip_output_reshape)
