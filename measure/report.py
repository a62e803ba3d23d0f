"""The end-to-end benchmark's report: its markdown table, and the promises read from one run's rows.

- :func:`render_markdown`: one line per row (s/step, ratios, paired intervals, latent error, PSNR/SSIM against the
  reference and the exact floor, peak VRAM, the kernels that ran);
- :func:`targets`: the pack against ComfyUI's own attention nodes and its own best rows, per step;
- :func:`quality_targets`: the same at a quality (PSNR against the reference run), over whole runs.
"""

from __future__ import annotations

import math

from ..attention import AUTO_EXACT
from .core_nodes import CORE_NODES
from .quality import AT_FLOOR
from .rows import AUTO_ROWS, COMPILED, KERNEL, UNPATCHED, is_sparse_row, parse, parse_row


def targets(rows: list[dict], tolerance: float = 0.02) -> list[dict]:
    """The pack's promises against ComfyUI's own attention nodes, read from one run's rows (s/step and the final
    latent's rel-L1 against unpatched): ``auto`` at least as fast as every core row whose error it does not exceed;
    ``auto`` within ``tolerance`` of the fastest row at (or under) its error; ``auto_exact`` within ``tolerance`` of
    the fastest explicit exact kernel row and of unpatched; a core node's twin (``kitchen_sol`` for core:sol-attn: the
    same kernel, the same defaults) within ``tolerance`` of it."""
    ok = {r["row"].replace(COMPILED, ""): r for r in rows if "s_per_step" in r}
    out = []
    auto = ok.get("auto")
    if auto is not None:
        for core in CORE_NODES:
            c = ok.get(core)
            if c is None:
                continue
            applies = auto["rel_l1"] <= c["rel_l1"] + 1e-9
            ratio = c["s_per_step"] / auto["s_per_step"]
            out.append({"target": f"auto >= {core} (where auto's error <= its error)", "ratio": round(ratio, 3),
                        "applies": applies, "met": (ratio >= 1.0) if applies else None,
                        "detail": f"auto rel-L1 {auto['rel_l1']:.4f} vs {c['rel_l1']:.4f}"})
        peers = [r for name, r in ok.items() if name != "auto" and r["rel_l1"] <= auto["rel_l1"] + 1e-9]
        if peers:
            best = min(peers, key=lambda r: r["s_per_step"])
            out.append(_within(f"auto within {tolerance:.0%} of the best row at its error ({best['row']})", auto, best,
                               tolerance, f"{len(peers)} rows with rel-L1 <= {auto['rel_l1']:.4f}"))
    ax = ok.get(AUTO_EXACT)
    if ax is not None:
        exact = [r for name, r in ok.items() if parse(name).role == KERNEL and parse(name).exact]
        for label, ref in (("the best exact row", min(exact, key=lambda r: r["s_per_step"]) if exact else None),
                           ("unpatched", ok.get(UNPATCHED))):
            if ref is not None:
                out.append(_within(f"auto_exact within {tolerance:.0%} of {label} ({ref['row']})", ax, ref, tolerance,
                                   f"auto_exact rel-L1 {ax['rel_l1']:.4f} vs {ref['rel_l1']:.4f}"))
    for node in CORE_NODES.values():  # Patch Attention's row of the same kernel and settings as a core node's
        mine, core = ok.get(node.twin), ok.get(node.row)
        if mine is not None and core is not None:
            out.append(_within(f"{node.twin} within {tolerance:.0%} of {node.row}", mine, core, tolerance,
                               f"rel-L1 {mine['rel_l1']:.4f} vs {core['rel_l1']:.4f}"))
    return out


def _within(target: str, row: dict, ref: dict, tolerance: float, detail: str) -> dict:
    """The target "``row`` at most ``tolerance`` slower per step than ``ref``"."""
    ratio = ref["s_per_step"] / row["s_per_step"]
    return {"target": target, "ratio": round(ratio, 3), "applies": True, "met": ratio >= 1 - tolerance, "detail": detail}


def _ci(p) -> str:
    return f"×{p[0]:.3f} [{p[1]:.3f}, {p[2]:.3f}]"


def _db(x: float) -> str:
    return "∞" if x == math.inf else f"{x:.2f}"


def render_markdown(rows: list[dict], header: str = "") -> str:
    paired = any("paired" in r for r in rows)
    quality = any("psnr" in r for r in rows)
    ref = next((r["reference"] for r in rows if "reference" in r), UNPATCHED)
    lines = [header, ""] if header else []
    extra = " paired per round, vs unpatched [95 % interval] | vs peer / auto vs the best row [95 % interval] |" if paired else ""
    qcols = f" PSNR dB / SSIM vs {ref} | vs the exact floor |" if quality else ""
    lines += ["| preset | row | s/step | speed vs unpatched | whole run: s/step, vs unpatched |" + extra +
              " cos / rel-L1 vs unpatched |" + qcols + " peak VRAM GiB | kernels that ran |",
              "|---|---|---|---|---|" + ("---|---|" if paired else "") + "---|" + ("---|---|" if quality else "") + "---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['row']} | error: {r['error']} | | |" + (" | |" if paired else "") + " |"
                         + (" | |" if quality else "") + " | |")
            continue
        kern = r.get("kernels", "") + "".join(f" ({n}: {r[n]})" for n in ("auto", AUTO_EXACT) if r.get(n))
        cols = ""
        if paired:
            p = r.get("paired", {})
            other = ""
            if "vs_peer" in p:
                other = "vs peer " + _ci(p["vs_peer"])
            elif "vs_best" in p:
                other = f"vs {r['best_row']} (best) " + _ci(p["vs_best"])
            cols = f" {_ci(p['vs_unpatched']) if 'vs_unpatched' in p else ''} | {other} |"
        whole = f" {r['s_per_step_whole']:.4f}, ×{r['whole_vs_unpatched']:.3f} |" if "whole_vs_unpatched" in r else " |"
        q = ""
        if quality:
            q = (f" {_db(r['psnr'])} / {r['ssim']:.4f} | {r.get('quality', '')} |" if "psnr" in r else " | |")
        lines.append(f"| {r['preset']} | {r['row']} | {r['s_per_step']:.4f} | ×{r.get('vs_unpatched', 0):.3f} |{whole}{cols} "
                     f"{r['cos']:.5f} / {r['rel_l1']:.4f}{'' if r['finite'] else ' NaN'} |{q} {r.get('peak_gib', '')} | {kern} |")
    floor = next((r["floor_psnr"] for r in rows if r.get("floor_psnr") is not None), None)
    if quality and floor is None:
        lines += ["", f"No exact floor: no exact row besides {ref} (add one, e.g. sdpa_cudnn)."]
    elif quality:
        what = ("the worst exact row: what half-precision rounding alone costs" if ref != UNPATCHED else
                "the other exact rows against the unpatched one: two exact kernels' difference")
        lines += ["", f"Exact floor: PSNR {_db(floor)} dB against {ref} ({what}). Rows '{AT_FLOOR}' are as close to "
                      "the reference as an exact kernel is."]
        pairs = [r for r in rows if r.get("exact") and "psnr_vs_unpatched" in r and not r["row"].startswith(UNPATCHED)]
        if ref != UNPATCHED and pairs:
            lines.append("Exact kernels against the unpatched one (PSNR): " +
                         ", ".join(f"{r['row']} {_db(r['psnr_vs_unpatched'])} dB" for r in pairs) + ".")
    return "\n".join(lines)


def quality_targets(rows: list[dict], tolerance: float = 0.02, band_db: float = 3.0,
                    sparse_target: float | None = None) -> list[dict]:
    """The promises stated at a quality (PSNR against the reference run), from one run's rows, over whole runs:

    - ``auto``'s final output within ``band_db`` of the exact floor;
    - ``auto`` at least ``1 - tolerance`` as fast as the fastest row within that band (``auto_fast``, the faster and
      lossier choice a user picks by name, is stated below, not compared);
    - the fastest sparse setting within the band, over unpatched (met when at least ``sparse_target``; no target:
      stated);
    - ``auto_fast``: its speed over unpatched and its distance to the floor (stated);
    - a tuned profile (``<kernel>[profile=...]``) faster per step than the same kernel's defaults at equal or better
      PSNR."""
    ok = {r["row"].replace(COMPILED, ""): r for r in rows if "s_per_step" in r and "psnr" in r}
    out = []
    floor = next((r.get("floor_psnr") for r in ok.values() if r.get("floor_psnr") is not None), None)
    speed = lambda r: r.get("whole_vs_unpatched", math.nan)  # noqa: E731
    if floor is not None:
        band = {n: r for n, r in ok.items() if r["psnr"] >= floor - band_db}
        auto = ok.get("auto")
        if auto is not None:
            below = floor - auto["psnr"]
            out.append({"target": f"auto within {band_db:g} dB of the exact floor", "ratio": round(-below, 2),
                        "applies": True, "met": below <= band_db,
                        "detail": f"PSNR {_db(auto['psnr'])} vs floor {_db(floor)}"})
            rivals = [r for n, r in band.items() if n not in AUTO_ROWS]
            if rivals:
                best = min(rivals, key=lambda r: r["s_per_step_whole"])
                ratio = best["s_per_step_whole"] / auto["s_per_step_whole"]
                out.append({"target": f"auto whole run >= x{1 - tolerance:g} of the fastest row within {band_db:g} dB "
                                      f"({best['row']})", "ratio": round(ratio, 3), "applies": True,
                            "met": ratio >= 1 - tolerance,
                            "detail": f"{len(rivals)} rows within {band_db:g} dB; auto x{speed(auto):.3f}, "
                                      f"{best['row']} x{speed(best):.3f} over unpatched"})
        sparse = [r for n, r in band.items() if is_sparse_row(n)]
        if sparse:
            best = min(sparse, key=lambda r: r["s_per_step_whole"])
            goal = f" >= x{sparse_target:g}" if sparse_target else ""
            out.append({"target": f"the fastest sparse setting within {band_db:g} dB ({best['row']}) whole run{goal}",
                        "ratio": speed(best), "applies": sparse_target is not None,
                        "met": bool(sparse_target and speed(best) >= sparse_target),
                        "detail": f"PSNR {_db(best['psnr'])} vs floor {_db(floor)}"})
        fast = ok.get("auto_fast")
        if fast is not None:
            out.append({"target": "auto_fast (the faster, lossier choice): whole run over unpatched",
                        "ratio": speed(fast), "applies": False, "met": False,
                        "detail": f"{floor - fast['psnr']:.1f} dB below the floor"})
    for name, r in ok.items():
        base, opts = parse_row(name)
        if "profile" not in opts or base not in ok:
            continue
        d = ok[base]
        ratio = d["s_per_step"] / r["s_per_step"]
        out.append({"target": f"tuned {base} profile faster than its defaults at equal or better PSNR",
                    "ratio": round(ratio, 3), "applies": True, "met": ratio > 1.0 and r["psnr"] >= d["psnr"],
                    "detail": f"PSNR {_db(r['psnr'])} vs defaults {_db(d['psnr'])}"})
    return out

