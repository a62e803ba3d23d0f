"""Per-layer sparse-attention thresholds: the profile file a tuning run writes and Patch Attention reads.

For SpargeAttn (``sparge*``: simthreshd1/cdfthreshd/pvthreshd or topk) and comfy-kitchen's Sol-Attn
(``kitchen_sol``: tau; ``kitchen_sol_topk``: keep_ratio; both with extra_tokens).  A *layer* is the i-th attention
call within one forward of the diffusion model (Flux: 19 double + 38 single blocks = layers 0-56; an SD UNet counts
self- and cross-attention in execution order).  A layer without an entry uses the per-model thresholds.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

from .backends.kitchen import SOL_DEFAULTS, SOL_TOPK_DEFAULTS, check_sol_options
from .backends.sparge import BOUNDS, DEFAULTS, TOPK_DEFAULTS, check_options
from .registry import REGISTRY

FORMAT = "patch_attention.sparge_profile/1"
SPARGE_VARIANTS = tuple(REGISTRY.names(family="sparge"))  # sparge, sparge_topk, sparge_sage1
SOL_VARIANTS = tuple(REGISTRY.names(family="kitchen_sol"))  # kitchen_sol, kitchen_sol_topk
VARIANTS = SPARGE_VARIANTS + SOL_VARIANTS
THRESHOLDS = ("simthreshd1", "cdfthreshd", "pvthreshd", "topk", "tau", "keep_ratio", "extra_tokens")
DEFAULT_BUDGET = 0.07  # a tuning run's rel-L1 budget per layer: SpargeAttn's autotune default (l1=0.07)


def check_thresholds(variant: str, opts: dict) -> dict:
    """Per-layer or per-model options of ``variant``, checked by its backend family's rules."""
    return check_sol_options(opts) if variant in SOL_VARIANTS else check_options(opts)


class ProfileMismatchError(ValueError):
    pass


def fingerprint_state_dict(sd) -> str:
    """Architecture + weights, cheaply: every key, shape and dtype, and a strided sample of every tensor's values."""
    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k]
        h.update(f"{k}:{tuple(getattr(t, 'shape', ()))}:{getattr(t, 'dtype', '')};".encode())
        try:
            flat = t.detach().flatten()
            step = max(1, flat.numel() // 16)
            vals = flat[::step][:16].float().cpu().tolist()
            h.update(json.dumps([round(v, 5) for v in vals]).encode())
        except Exception:
            continue
    return h.hexdigest()[:16]


@dataclass
class SpargeProfile:
    variant: str = "sparge"
    model_fingerprint: str = ""
    model_class: str = ""
    error_metric: str = "rel_l1"
    error_budget: float = 0.05
    layers: dict = field(default_factory=dict)  # int -> {"simthreshd1":..., ..., "sparsity":..., "rel_l1":...}
    notes: str = ""

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown sparse-attention variant {self.variant!r}; known: {', '.join(VARIANTS)}")
        self.layers = {int(k): dict(v) for k, v in self.layers.items()}
        for i, entry in self.layers.items():
            check_thresholds(self.variant, {k: v for k, v in entry.items() if k in THRESHOLDS})
            if i < 0:
                raise ValueError(f"layer index {i} < 0")

    def thresholds(self, layer: int) -> dict | None:
        e = self.layers.get(layer)
        if e is None:
            return None
        return {k: v for k, v in e.items() if k in THRESHOLDS}

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "variant": self.variant,
            "model": {"fingerprint": self.model_fingerprint, "class": self.model_class},
            "error_budget": {"metric": self.error_metric, "max": self.error_budget},
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
            "notes": self.notes,
        }

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, d: dict) -> SpargeProfile:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a sparse-attention profile (format {d.get('format')!r}, expected {FORMAT!r})")
        return cls(
            variant=d.get("variant", "sparge"),
            model_fingerprint=d.get("model", {}).get("fingerprint", ""),
            model_class=d.get("model", {}).get("class", ""),
            error_metric=d.get("error_budget", {}).get("metric", "rel_l1"),
            error_budget=float(d.get("error_budget", {}).get("max", 0.05)),
            layers=d.get("layers", {}),
            notes=d.get("notes", ""),
        )

    @classmethod
    def load(cls, path: str) -> SpargeProfile:
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except FileNotFoundError:
            raise FileNotFoundError(f"sparse-attention profile not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"sparse-attention profile {path} is not valid JSON: {e}") from None

    def check_model(self, fingerprint: str, model_class: str = "") -> None:
        if self.model_fingerprint and fingerprint and self.model_fingerprint != fingerprint:
            raise ProfileMismatchError(
                f"this {self.variant} profile was tuned for another model ({self.model_class or '?'} "
                f"{self.model_fingerprint}); this model is {model_class or '?'} {fingerprint}. "
                "Tune a profile for this model or leave the profile input empty."
            )


def default_options(variant: str) -> dict:
    return dict({"sparge_topk": TOPK_DEFAULTS, "kitchen_sol": SOL_DEFAULTS,
                 "kitchen_sol_topk": SOL_TOPK_DEFAULTS}.get(variant, DEFAULTS))


# ---------------------------------------------------------------- threshold search

def search_layer(error_fn, budget: float, variant: str = "sparge", grid=None):
    """Pick the thresholds with the highest sparsity whose error stays within ``budget``.

    ``error_fn(thresholds) -> (error, sparsity)`` runs the layer's real attention
    against dense attention.  The search walks ``cdfthreshd`` (or ``topk``) from
    conservative to aggressive for each ``simthreshd1`` and stops a walk at the
    first candidate over budget (sparsity only grows along it); returns
    ``(thresholds, error, sparsity, tried)`` or ``None`` when even the most
    conservative candidate misses the budget.
    """
    if grid is None:
        grid = default_grid(variant)
    best = None
    tried = 0
    pvs = grid["pvthreshd"] if isinstance(grid["pvthreshd"], (tuple, list)) else (grid["pvthreshd"],)
    for sim, pv in ((s, p) for s in grid["simthreshd1"] for p in pvs):
        for val in grid["walk"]:
            th = {"simthreshd1": sim, grid["walk_key"]: val, "pvthreshd": pv}
            err, sp = error_fn(th)
            tried += 1
            if not math.isfinite(err) or err > budget:
                break
            if best is None or sp > best[2] or (sp == best[2] and err < best[1]):
                best = (th, err, sp)
    return None if best is None else (*best, tried)


def default_grid(variant: str) -> dict:
    """The candidates a tuning run tries per layer: walks from conservative to aggressive (``walk_key`` over ``walk``),
    one per combination of the other options (SpargeAttn: simthreshd1 x pvthreshd; Sol-Attn: ``outer``)."""
    if variant == "kitchen_sol":  # tau in sigmas of the proxy row: 1.0 keeps ~16 % of key blocks exact, 2.0 ~2.7 %
        return {"outer": ({"extra_tokens": 256},), "walk_key": "tau", "walk": (0.8, 1.0, 1.3, 1.6, 2.0, 2.5, 3.0)}
    if variant == "kitchen_sol_topk":
        return {"outer": ({"extra_tokens": 256},), "walk_key": "keep_ratio", "walk": (0.5, 0.3, 0.2, 0.15, 0.1, 0.05)}
    if variant == "sparge_topk":
        return {"simthreshd1": (-0.1, 0.3, 0.6), "walk_key": "topk", "walk": (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3), "pvthreshd": 50}
    return {"simthreshd1": (0.3, 0.5, 0.6, 0.7), "walk_key": "cdfthreshd", "walk": (0.999, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9),
            "pvthreshd": 50}


__all__ = ["SpargeProfile", "ProfileMismatchError", "fingerprint_state_dict", "search_layer", "BOUNDS"]
