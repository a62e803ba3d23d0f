"""The supported-models page (docs/models.md) from the model zoo's results.

    python tests/tools/zoo_table.py                                   # CPU results in .build/artifacts/zoo-<release>.json
    python tests/tools/zoo_table.py --gpu OUT/zoo-gpu-1of2.json OUT/zoo-gpu-2of2.json --out docs/models.md

CPU results: one JSON per ComfyUI release, written by the zoo tier (tests/test_zoo.py). GPU results: the ``zoo`` stage
of tests/gpu/run.sh (tests/gpu/zoo.py), any number of parts. Per configuration: whether Patch Attention reaches its
attention (and why not), the releases it ran on, the CPU verdict (every run equal to unpatched) and, from the GPU run,
which kernels ran its calls, which fell back to what and why, and the cases that failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = {"image_unet": "UNets, SD3, AuraFlow, PixArt, HunyuanDiT", "image_dit": "image DiTs",
            "video": "video", "other": "audio, 3D, restoration and other"}
HOST = "comfyui"  # the pack's name for calls handed to ComfyUI's own attention function


def version_key(v: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.\-]", v)]


def load(paths):
    out = []
    for p in paths:
        with open(p) as f:
            out.append(json.load(f))
    return out


def short(reason: str, n: int = 90) -> str:
    reason = reason.replace("|", "/").replace("\n", " ")
    return reason if len(reason) <= n else reason[: n - 1] + "…"


def reach(entry) -> str:
    """How much of the configuration's attention reaches Patch Attention: measured in the CPU runs (the calls that
    reached the hook, and those that did not), with the reason its builder states."""
    oh = entry.get("outside_hook", "")
    kind, _, why = oh.partition(":")
    m = entry.get("measured_outside_hook")
    if m is None:
        return f"{'none' if kind == 'all' else 'partly'}: {why.strip()}" if oh else "all"
    missed = m.get("outside", 0) + m.get("direct", 0)
    if m.get("reached", 0) == 0:
        return f"none: {why.strip() or 'no call reached the hook (measured)'}"
    if missed:
        return f"partly: {why.strip() or f'{missed} calls per run did not reach the hook (measured)'}"
    return "all"


def cpu_cell(entries: dict) -> str:
    """Every release's CPU verdict: equal to unpatched in every run (the largest rel-L1), or what failed."""
    parts = []
    for rel, e in sorted(entries.items(), key=lambda x: version_key(x[0])):
        if e.get("failures"):
            parts.append(f"{rel}: FAIL {short('; '.join(e['failures']), 120)}")
            continue
        worst = max((r.get("rel_l1", 0.0) for r in e.get("runs", {}).values()), default=0.0)
        parts.append(f"{rel}: equal (rel-L1 ≤ {worst:.0e})")
    return "<br>".join(parts)


def cpu_fallbacks(entries: dict) -> list[str]:
    """Fallbacks seen on the CPU other than a kernel that is not installed there (those say nothing of the model)."""
    seen = set()
    for e in entries.values():
        for run in e.get("runs", {}).values():
            for f in run.get("fallbacks", []):
                if not f["reason"].startswith("not installed"):
                    seen.add(f"{f['from']}→{f['to']}: {short(f['reason'], 60)}")
    return sorted(seen)


def gpu_cells(g: dict | None) -> tuple[str, str]:
    """(the kernels that ran its calls on the GPU and the failures, the fallbacks and why)."""
    if g is None:
        return "not run", ""
    if "crash" in g:
        return f"CRASH before the runs: {short(g['crash'])}", ""
    ran, fails, falls = Counter(), [], Counter()
    for backend, run in g.get("runs", {}).items():
        if "crash" in run:
            fails.append(f"{backend} CRASH ({short(run['crash'], 60)})")
            continue
        for name, n in run.get("calls", {}).items():
            ran[name if name != HOST else "ComfyUI's SDPA"] += n
        if not run.get("ok"):
            what = "non-finite" if not run.get("finite") else f"rel-L1 {run.get('rel_l1', 0):.3f} > {run['bound_rel_l1']:g}"
            fails.append(f"{backend} {what}")
        for f in run.get("fallbacks", []):
            falls[(f["from"], f["to"], short(f["reason"], 70))] += f["count"]
    kernels = ", ".join(sorted(ran)) or "none reached"
    if g.get("runs") and not ran:
        kernels = "none (its attention does not reach the hook)"
    cell = kernels + (f"<br>**failed:** {'; '.join(fails)}" if fails else "")
    fb = "<br>".join(f"{a}→{b}: {r}" for (a, b, r) in sorted(falls)) if falls else "none"
    return cell, fb


def merge_gpu(gpu: list[dict]):
    """Several GPU runs (parts, or runs of other backends on the same machine) as one: per configuration the runs of
    every backend. A run made before the bound included the model's bf16 rounding floor is held to its class plus the
    floor another run measured for that configuration."""
    res, meta, not_reached, unbuilt = {}, [], set(), {}
    for d in gpu:
        meta.append(d.get("meta", {}))
        not_reached.update(d.get("not_reached", []))
        unbuilt.update(d.get("unbuilt", {}))
        for name, r in d.get("results", {}).items():
            have = res.get(name)
            if have is None or "crash" in have:
                res[name] = json.loads(json.dumps(r))
            elif "crash" not in r:
                for key in ("rounding_floor", "dtype", "model"):
                    if key in r:
                        have.setdefault(key, r[key])
                for b, run in r.get("runs", {}).items():
                    have.setdefault("runs", {})[b] = dict(run, floor_applied="rounding_floor" in r)
    for r in res.values():
        floor = r.get("rounding_floor")
        for run in r.get("runs", {}).values():
            if floor and run.pop("floor_applied", True) is False and "rel_l1" in run:
                run["bound_rel_l1"] += floor
                run["ok"] = bool(run.get("finite")) and run["rel_l1"] <= run["bound_rel_l1"]
    not_reached -= {n for n, r in res.items() if r.get("runs")}
    return res, meta, not_reached, unbuilt


def render(cpu: list[dict], gpu: list[dict]) -> str:
    releases = sorted({d["release"] for d in cpu}, key=version_key)
    by_name: dict[str, dict] = defaultdict(dict)  # name -> release -> entry
    listed: dict[str, set] = defaultdict(set)
    unbuilt: dict[str, dict] = defaultdict(dict)
    for d in cpu:
        for name in d.get("listed", d["configurations"]):
            listed[name].add(d["release"])
        for name, e in d["configurations"].items():
            by_name[name][d["release"]] = e
        for name, why in d.get("unbuilt", {}).items():
            unbuilt[name][d["release"]] = why
    gpu_res, gpu_meta, not_reached, gpu_unbuilt = merge_gpu(gpu)
    order = []
    for d in sorted(cpu, key=lambda d: version_key(d["release"]), reverse=True):
        for n in d.get("listed", list(d["configurations"])):
            if n not in order and n != "(no ComfyUI)":
                order.append(n)

    n_built = len(by_name)
    n_none = sum(1 for n in by_name if reach(next(iter(by_name[n].values()))).startswith("none"))
    n_some = sum(1 for n in by_name if reach(next(iter(by_name[n].values()))).startswith("partly"))
    lines = ["# Supported models", "",
             "Generated by `tests/tools/zoo_table.py` from the model zoo (`tests/zoo`, `tests/test_zoo.py`): every model "
             "configuration ComfyUI ships (`comfy.supported_models.models`), built tiny through ComfyUI's own classes with "
             "the conditioning its family gets in a real workflow, sampled unpatched and through Patch Attention.", "",
             f"- **CPU** (fp32, ComfyUI {', '.join(releases)}): `auto`, `sdpa` (with `log_stats`), `sdpa_math` and `sage` "
             "(not installed there: its fallback to SDPA, counted). Every run must give the unpatched latent (rel-L1 "
             "≤ 1e-4, tighter where a wrong kernel would move the latent less), count exactly the calls that reached "
             "the hook, and say so when none did.",
             ]
    if gpu_meta:
        m = gpu_meta[0]
        backends = list(dict.fromkeys(b for mm in gpu_meta for b in mm.get("backends", [])))
        dates = sorted({mm.get("date", "?")[:10] for mm in gpu_meta})
        lines.append(f"- **GPU** ({m.get('gpu', '?')}, {m.get('dtype', 'bf16 or the first supported dtype')}, ComfyUI "
                     f"{m.get('comfyui', '?')}, torch {m.get('torch', '?')}, {', '.join(dates)}"
                     f"{f', {len(gpu_meta)} runs' if len(gpu_meta) > 1 else ''}): every installed backend "
                     f"({', '.join(backends)}) against unpatched, 2 steps; each final latent within its backend's "
                     "accuracy class plus the model's bf16 rounding floor (its unpatched bf16 latent against the same "
                     "weights in fp32: on random weights a few steps amplify rounding).")
    else:
        lines.append("- **GPU**: not run yet for this page (`bash tests/gpu/run.sh env zoo`, then this tool with `--gpu`).")
    lines += ["",
              f"{n_built} configurations and workflow variants built; Patch Attention reaches all of the attention of "
              f"{n_built - n_none - n_some}, part of it in {n_some}, none of it in {n_none}; {len(unbuilt)} not built "
              "(listed below with the reason).", "",
              "## Not accelerated, or in part", "",
              "These make attention calls without `transformer_options` (or straight to PyTorch), so no attention "
              "override (Patch Attention, ComfyUI's own Model Attention Backend, any node pack's) can reach those "
              "calls; they run ComfyUI's own attention. Where none of a model's calls is reached, Patch Attention says "
              "so once per sampling run (a warning naming the model) and counts it in the `log_stats` report.", ""]
    for n in order:
        if n in by_name:
            r = reach(next(iter(by_name[n].values())))
            if r != "all":
                rels = ", ".join(sorted(by_name[n], key=version_key))
                lines.append(f"- **{n}** ({rels}): {r}")
    lines += [""]
    groups = defaultdict(list)
    for n in order:
        if n in by_name:
            groups[next(iter(by_name[n].values())).get("family_module", "?")].append(n)
    for fam in [*FAMILIES, *sorted(set(groups) - set(FAMILIES))]:
        if fam not in groups:
            continue
        head = "| configuration | model | releases | attention reached | CPU |"
        lines += [f"## {FAMILIES.get(fam, fam)}", "", head + (" GPU: calls ran on | GPU: fell back (why) |" if gpu else ""),
                  "|---|---|---|---|---|" + ("---|---|" if gpu else "")]
        for n in groups[fam]:
            entries = by_name[n]
            e = next(iter(entries.values()))
            cpu = cpu_cell(entries)
            extra = cpu_fallbacks(entries)
            if extra:
                cpu += "<br>fallbacks: " + "; ".join(extra)
            g_cell, g_fb = gpu_cells(gpu_res.get(n)) if gpu else ("", "")
            if gpu and n in not_reached:
                g_cell = "not reached in the time budget"
            lines.append(f"| {n} | {e.get('model', '?')} | {', '.join(sorted(entries, key=version_key))} | "
                         f"{short(reach(e), 70)} | {cpu} |" + (f" {g_cell} | {g_fb} |" if gpu else ""))
        lines.append("")
    if unbuilt:
        lines += ["## Not built", "", "| configuration | releases | why |", "|---|---|---|"]
        for n in order:
            if n in unbuilt:
                whys = set(unbuilt[n].values())
                lines.append(f"| {n} | {', '.join(sorted(unbuilt[n], key=version_key))} | {short(' / '.join(whys), 300)} |")
        lines.append("")
    missing = [n for n in order if n not in by_name and n not in unbuilt]
    if missing:
        lines += ["## Not run", "", "Listed by ComfyUI but without a result here (a failing build, or no builder yet): "
                  + ", ".join(missing), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", nargs="*", help="CPU results (default: .build/artifacts/zoo-<release>.json)")
    ap.add_argument("--gpu", nargs="*", default=[], help="GPU results (zoo-gpu-*.json), or folders holding them")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "models.md"))
    ap.add_argument("--note", action="append", default=[], help="a line for the page's notes (repeatable)")
    a = ap.parse_args(argv)
    cpu_paths = a.cpu if a.cpu else sorted(p for p in glob.glob(os.path.join(ROOT, ".build", "artifacts", "zoo-*.json"))
                                           if not os.path.basename(p).startswith("zoo-gpu"))
    if not cpu_paths:
        raise SystemExit("zoo_table: no CPU results: run the zoo tier (python tests/run.py -- tests/test_zoo.py)")
    gpu_paths = []
    for p in a.gpu:
        gpu_paths += sorted(glob.glob(os.path.join(p, "zoo-gpu*.json"))) if os.path.isdir(p) else [p]
    text = render(load(cpu_paths), load(gpu_paths))
    if a.note:
        text += "\n## Notes\n\n" + "".join(f"- {n}\n" for n in a.note)
    with open(a.out, "w") as f:
        f.write(text)
    print(f"zoo_table: {a.out} from {len(cpu_paths)} CPU and {len(gpu_paths)} GPU result files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
