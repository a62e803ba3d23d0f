"""Relating ``auto``'s per-call accuracy gate to the quality of the finished run, and proposing defaults from it.

``auto`` judges a lossy kernel on the first call of each call signature: cosine and relative L1 of its output against
dense attention, gated at ``DEFAULT_MIN_COS`` / ``DEFAULT_MAX_REL_L1``.  What users see is the end of the run.  A
calibration sweep samples one model (the stand-in: ``tools/standin.py``) once per kernel setting and records, per
setting, the per-call numbers the gate would see (the audit of its first call), the final output's PSNR against the
fp32 run of the same seed and its time per step.  The *exact floor* is the PSNR of the exact kernels' runs (half
precision rounding only): no kernel can be asked to do better.

The rule: **the fastest setting whose final PSNR stays within 1 dB of the exact floor.**  From it:

- :func:`fastest_within` picks that setting;
- :func:`propose_gate` proposes the gate that lets ``auto`` reach it: of the gates that admit *no* setting below
  the floor's tolerance (so whichever admitted kernel ``auto`` times fastest on another GPU, the run stays within it),
  the one whose fastest admitted setting is fastest; its thresholds are put halfway (in ``log(1 - cos)`` and
  ``log(rel-L1)``) between the worst admitted setting and the nearest excluded one, and the points that no gate can
  separate (a setting below tolerance with better per-call numbers than one within it) are named;
- :func:`check_gate` says what a given gate (the current defaults) lets through and what ``auto`` would then pick;
- :func:`propose_budget` picks the Tune Sparse Attention error budget by the same rule over profiles tuned at
  several budgets.

The numbers are the H100 run's; tests pin the rule, not the numbers.  No ComfyUI here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

TOLERANCE_DB = 1.0


@dataclass
class Point:
    """One kernel setting, measured on one model: time per step, final PSNR against the reference, and (for a lossy
    setting) the per-call numbers ``auto``'s gate would judge it by."""

    name: str
    s_per_step: float
    psnr: float
    exact: bool = False
    cos: float | None = None
    rel_l1: float | None = None
    setting: dict = field(default_factory=dict)

    @property
    def gated(self) -> bool:
        return not self.exact and self.cos is not None and self.rel_l1 is not None


def exact_floor(points) -> float | None:
    """The exact kernels' worst PSNR (the floor every other setting is judged against); None without exact points."""
    ex = [p.psnr for p in points if p.exact and not math.isnan(p.psnr)]
    return min(ex) if ex else None


def acceptable(p: Point, floor: float, tolerance_db: float = TOLERANCE_DB) -> bool:
    return p.psnr >= floor - tolerance_db


def fastest_within(points, floor: float, tolerance_db: float = TOLERANCE_DB) -> Point | None:
    """The rule: the fastest setting whose final PSNR is at most ``tolerance_db`` below ``floor``."""
    ok = [p for p in points if acceptable(p, floor, tolerance_db) and math.isfinite(p.s_per_step)]
    return min(ok, key=lambda p: p.s_per_step) if ok else None


def admits(p: Point, min_cos: float, max_rel_l1: float) -> bool:
    return p.gated and p.cos >= min_cos and p.rel_l1 <= max_rel_l1


@dataclass
class GateCheck:
    min_cos: float
    max_rel_l1: float
    admitted: list  # names of the lossy settings the gate lets through
    bad_admitted: list  # of them, those below the floor's tolerance
    pick: str | None  # what auto would run: the fastest of the exact settings and the admitted ones
    pick_psnr: float | None
    pick_s_per_step: float | None
    valid: bool  # admits nothing below tolerance


def check_gate(points, floor: float, min_cos: float, max_rel_l1: float, tolerance_db: float = TOLERANCE_DB) -> GateCheck:
    """What the gate (``min_cos``, ``max_rel_l1``) lets through, and which setting ``auto`` would then run (the
    fastest of the exact settings and the admitted lossy ones, as it picks by measured time)."""
    adm = [p for p in points if admits(p, min_cos, max_rel_l1)]
    bad = [p.name for p in adm if not acceptable(p, floor, tolerance_db)]
    pool = [p for p in points if p.exact] + adm
    pick = min(pool, key=lambda p: p.s_per_step) if pool else None
    return GateCheck(min_cos, max_rel_l1, [p.name for p in adm], bad, pick.name if pick else None,
                     pick.psnr if pick else None, pick.s_per_step if pick else None, not bad)


def _mid_cos(a: float, b: float) -> float:
    """Halfway between two cosines in log(1 - cos)."""
    ea, eb = max(1 - a, 1e-12), max(1 - b, 1e-12)
    return 1 - math.sqrt(ea * eb)


def _mid_rel(a: float, b: float) -> float:
    return math.sqrt(max(a, 1e-12) * max(b, 1e-12))


def propose_gate(points, floor: float, tolerance_db: float = TOLERANCE_DB, current=None) -> dict:
    """The gate by the rule (see the module docstring): ``{"min_cos", "max_rel_l1", "pick", "admitted", "conflicts",
    "current": check of ``current`` (min_cos, max_rel_l1) if given, "target": the rule's setting}``."""
    gated = [p for p in points if p.gated]
    target = fastest_within(points, floor, tolerance_db)
    coss = sorted({p.cos for p in gated} | {1.0 + 1e-9})
    rels = sorted({p.rel_l1 for p in gated} | {0.0})
    best = None
    for c in coss:
        for r in rels:
            g = check_gate(points, floor, c, r, tolerance_db)
            if not g.valid or g.pick is None:
                continue
            key = (g.pick_s_per_step, -len(g.admitted))  # fastest pick; then the gate that admits the most settings
            if best is None or key < best[0]:
                best = (key, g)
    good = [p for p in gated if acceptable(p, floor, tolerance_db)]
    bad = [p for p in gated if not acceptable(p, floor, tolerance_db)]
    conflicts = sorted({f"{b.name} (PSNR {b.psnr:.2f}) has per-call numbers no worse than {g.name} (PSNR {g.psnr:.2f})"
                        for g in good for b in bad if b.cos >= g.cos and b.rel_l1 <= g.rel_l1})
    out = {"floor_psnr": floor, "tolerance_db": tolerance_db, "target": target.name if target else None,
           "target_psnr": target.psnr if target else None, "conflicts": conflicts}
    if best is None:
        out.update(min_cos=None, max_rel_l1=None, pick=None, admitted=[])
    elif not best[1].admitted:  # no lossy setting within tolerance: a gate that keeps every measured one out
        g = best[1]
        top = max((p.cos for p in gated), default=None)
        out.update(min_cos=None if top is None else _mid_cos(top, 1.0), max_rel_l1=None, pick=g.pick,
                   pick_psnr=g.pick_psnr, pick_s_per_step=g.pick_s_per_step, admitted=[],
                   note="no lossy setting is within tolerance: the gate must keep them all out")
    else:
        g = best[1]
        adm = [p for p in gated if p.name in g.admitted]
        if adm:  # thresholds halfway to the nearest excluded setting below tolerance (or at the admitted worst)
            worst_cos = min(p.cos for p in adm)
            worst_rel = max(p.rel_l1 for p in adm)
            below = [b.cos for b in bad if b.cos < worst_cos]
            above = [b.rel_l1 for b in bad if b.rel_l1 > worst_rel]
            min_cos = _mid_cos(worst_cos, max(below)) if below else worst_cos
            max_rel = _mid_rel(worst_rel, min(above)) if above else worst_rel
            # the halfway point must not admit a setting the tighter gate kept out
            if not check_gate(points, floor, min_cos, max_rel, tolerance_db).valid:
                min_cos, max_rel = worst_cos, worst_rel
        else:
            min_cos, max_rel = g.min_cos, g.max_rel_l1
        out.update(min_cos=min_cos, max_rel_l1=max_rel, pick=g.pick, pick_psnr=g.pick_psnr,
                   pick_s_per_step=g.pick_s_per_step, admitted=g.admitted)
    if current is not None:
        out["current"] = asdict(check_gate(points, floor, current[0], current[1], tolerance_db))
    return out


def by_tolerance(points, floor: float, tolerances=(1.0, 3.0, 6.0, 10.0)) -> list[dict]:
    """The rule at several tolerances below the floor: per tolerance, the fastest setting within it and the gate that
    reaches it (the curve a documented choice is read from, where 1 dB admits no lossy setting)."""
    out = []
    for tol in tolerances:
        g = propose_gate(points, floor, tol)
        out.append({"tolerance_db": tol, "target": g["target"], "target_psnr": g.get("target_psnr"),
                    "min_cos": g.get("min_cos"), "max_rel_l1": g.get("max_rel_l1"), "pick": g.get("pick"),
                    "pick_s_per_step": g.get("pick_s_per_step")})
    return out


def propose_budget(points, floor: float, tolerance_db: float = TOLERANCE_DB) -> dict:
    """Tune Sparse Attention's error budget by the rule: of profiles tuned at several budgets (``setting["budget"]``)
    and sampled, the fastest within tolerance; ``{"budget", "pick", "psnr", "s_per_step"}`` (None when none is)."""
    tuned = [p for p in points if "budget" in p.setting]
    best = fastest_within(tuned, floor, tolerance_db)
    if best is None:
        return {"budget": None, "pick": None, "psnr": None, "s_per_step": None, "floor_psnr": floor}
    return {"budget": best.setting["budget"], "pick": best.name, "psnr": best.psnr, "s_per_step": best.s_per_step,
            "floor_psnr": floor}


def render_markdown(points, gate: dict, budgets: dict | None = None, curve: list | None = None) -> str:
    """The sweep as a table, then the proposals."""
    floor = gate.get("floor_psnr")
    lines = ["| setting | s/step | PSNR | within 1 dB of the floor | per-call cos | per-call rel-L1 |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: p.s_per_step):
        ok = "exact" if p.exact else ("yes" if floor is not None and acceptable(p, floor, gate.get("tolerance_db", 1.0))
                                      else "no")
        lines.append(f"| {p.name} | {p.s_per_step:.4f} | {p.psnr:.2f} | {ok} | "
                     f"{'' if p.cos is None else f'{p.cos:.5f}'} | {'' if p.rel_l1 is None else f'{p.rel_l1:.4f}'} |")
    lines.append("")
    if gate.get("note"):
        lines.append(f"Proposed gate: {gate['note']} (cos >= {gate['min_cos']:.5f} does); auto would run "
                     f"{gate['pick']} (PSNR {gate['pick_psnr']:.2f}, floor {floor:.2f}).")
    elif gate.get("max_rel_l1") is not None:
        lines.append(f"Proposed gate: cos >= {gate['min_cos']:.5f}, rel-L1 <= {gate['max_rel_l1']:.4f} (auto would run "
                     f"{gate['pick']}, PSNR {gate['pick_psnr']:.2f} against the floor {floor:.2f}); the rule's setting: "
                     f"{gate['target']}.")
    else:
        lines.append("No gate: no setting was measured with per-call numbers.")
    cur = gate.get("current")
    if cur:
        lines.append(f"Current defaults (cos >= {cur['min_cos']}, rel-L1 <= {cur['max_rel_l1']}): admit "
                     f"{', '.join(cur['admitted']) or 'no lossy setting'}; auto would run {cur['pick']} "
                     f"(PSNR {cur['pick_psnr']:.2f}); " + ("nothing below tolerance admitted." if cur["valid"] else
                                                           f"below tolerance but admitted: {', '.join(cur['bad_admitted'])}."))
    for c in gate.get("conflicts", []):
        lines.append(f"- not separable by a per-call gate: {c}")
    if curve:
        lines += ["", "| tolerance below the floor | fastest setting within it | its PSNR | gate that reaches it |",
                  "|---|---|---|---|"]
        for c in curve:
            gate_txt = ("exact kernels only" if c["max_rel_l1"] is None else
                        f"cos >= {c['min_cos']:.5f}, rel-L1 <= {c['max_rel_l1']:.4f}")
            psnr = "" if c["target_psnr"] is None else f"{c['target_psnr']:.2f}"
            lines.append(f"| {c['tolerance_db']:g} dB | {c['target']} | {psnr} | {gate_txt} |")
    if budgets and budgets.get("budget") is not None:
        lines.append(f"Tuning budget by the same rule: rel-L1 {budgets['budget']} ({budgets['pick']}, PSNR "
                     f"{budgets['psnr']:.2f}).")
    return "\n".join(lines)
