"""End-to-end benchmark on ComfyUI's own model classes at full size (random bf16 weights), on a CUDA GPU.

    cd ComfyUI/custom_nodes/ComfyUI-PatchAttention
    python bench_e2e.py --preset wan-1.3b --preset flux-dev --steps 4 --md e2e.md --json e2e.json --png e2e.png
    python bench_e2e.py --preset sdxl --rows unpatched,sdpa,sage_fp8_sm90,peer:sage_fp8_sm90,auto --compile

With --json X.json it also writes X-chart.png beside it: every row's whole-run speed against its PSNR, the exact floor
and the band 3 dB below it (the picture the node returns); for the stand-in (which has a decoder), X-frames-<preset>.png
too: each row's decoded frames beside their difference to the unpatched row's.  The random-weight presets have no
decoder: no frames.

Rows: unpatched (ComfyUI's own attention), every usable backend, auto, auto_exact, and peer:<kernel> (the kernel called straight
from ComfyUI's hook, as other packs do); a sparse backend with options or a tuned profile, e.g. kitchen_sol[tau=2.0].
Finds ComfyUI through COMFYUI_PATH or as the ComfyUI this pack sits in.  On your own model, with real weights, use
the "Attention Benchmark (end to end)" node instead.

Random weights measure speed at real model sizes; they cannot measure quality (attention is flat, and every kernel's
output sits on the same noise floor).  For quality, the stand-in (docs/quality.md, tools/standin.py): a Wan-class
model with learned attention, compared per row by PSNR/SSIM with its fp32 run of the same seed:

    python tools/standin.py train --out standin.safetensors
    python bench_e2e.py --standin standin.safetensors --preset standin-480p --steps 10 --md q.md --png q.png
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))


def _comfyui() -> str:
    path = os.environ.get("COMFYUI_PATH") or os.path.dirname(os.path.dirname(HERE))
    if not os.path.exists(os.path.join(path, "comfy", "model_base.py")):
        sys.exit("bench_e2e: no ComfyUI found: set COMFYUI_PATH, or run this from ComfyUI/custom_nodes/<this pack>")
    return path


def _load_pack():
    name = "patch_attention_pack"
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "__init__.py"), submodule_search_locations=[HERE])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="sd15, sdxl, flux-dev, wan-1.3b, wan-14b, wan-1.3b-720p, "
                                                      "wan-14b-720p, wan-1.3b-33f (repeatable; default all); "
                                                      "standin-480p, standin-720p (with --standin)")
    ap.add_argument("--standin", default=os.environ.get("STANDIN_WEIGHTS"),
                    help="the stand-in's weights (tools/standin.py train), for the standin-* presets; default "
                         "$STANDIN_WEIGHTS")
    ap.add_argument("--rows", default="", help="comma-separated rows (default: every usable backend, auto and peers)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="time every row this many times, in turn")
    ap.add_argument("--cfg", type=float, help="the guidance scale (default the preset's; 1: one prompt per step, no "
                    "CFG batch)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="s/step over the rounds: median, or min (host-bound presets on a shared machine)")
    ap.add_argument("--compile", action="store_true", help="also run every row under torch.compile (inductor)")
    ap.add_argument("--compile-only", action="store_true", help="only the rows under torch.compile")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also profile one step per row (top device kernels, in --json)")
    ap.add_argument("--profile-step", type=int, help="the step to profile (>= 1; default the last)")
    ap.add_argument("--dynamic-vram", action="store_true",
                    help="ComfyUI >= 0.33: the model on a dynamic (comfy-aimdo) model patcher, as 0.33's default")
    ap.add_argument("--md"), ap.add_argument("--json"), ap.add_argument("--png")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON",
                    help="no benchmark: plot the rows of these --json results (in order) into --png")
    return ap


def _plot_from(paths, png):
    """--plot-from: the plots of earlier --json results, no benchmark."""
    rows, metas = [], []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        rows += d["rows"]
        metas.append(d["meta"])
    m = {**metas[0], "date": " / ".join(sorted({m["date"] for m in metas}))}
    grammar = _measure(_load_pack(), "rows")
    plot(rows, png, m, grammar)
    if any("psnr" in r for r in rows):
        plot_frontier(rows, png.replace(".png", "-frontier.png"), m, grammar)


def _header(meta: dict, a, standin_only: bool) -> str:
    weights = ("the stand-in's trained weights (bf16; PSNR/SSIM against its fp32 run of the same seed)"
               if standin_only else "random bf16 weights")
    return (f"{meta['gpu']} · torch {meta['torch']} · {meta['date']} · ComfyUI model classes at full size, {weights} "
            f"· euler, {a.steps} steps after a 2-step warm-up run, every row timed {a.rounds}x in turn; s/step "
            f"is the {a.stat} over rounds of each run's median time between the sampler's step callbacks (device "
            f"synced), so loading, setup and the first step are not in it; "
            f"'whole run' is from the sampler's start to its last step over the number of steps, the first included · "
            f"ratios within this run\n\n" + "\n".join(f"- `{p}`: {d}" for p, d in meta["presets"].items()))


def main(argv=None):
    ap = _arguments()
    a = ap.parse_args(argv)
    if a.plot_from:
        if not a.png:
            ap.error("--plot-from needs --png")
        return _plot_from(a.plot_from, a.png)

    sys.path.insert(0, _comfyui())
    _let_core_nodes_import()
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = True  # every row on the same resident weights
    if a.dynamic_vram:  # before any comfy module: comfy_aimdo.host_buffer binds the native library when imported
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import torch
    from tqdm import tqdm

    pack = _load_pack()
    e2e, presets_, report = (_measure(pack, m) for m in ("e2e", "presets", "report"))
    pictures = _measure(pack, "pictures")
    if not torch.cuda.is_available():
        sys.exit("bench_e2e: needs a CUDA GPU")
    if a.dynamic_vram and len(a.preset or []) != 1:
        ap.error("--dynamic-vram takes one --preset (its model is built before dynamic VRAM is switched on)")
    presets = a.preset or list(presets_.MODEL_PRESETS)
    unknown = [p for p in presets if p not in presets_.MODEL_PRESETS and p not in STANDIN_PRESETS]
    if unknown:
        ap.error(f"unknown preset(s) {', '.join(unknown)}")
    if any(p in STANDIN_PRESETS for p in presets) and not a.standin:
        ap.error("the standin-* presets need --standin PATH (python tools/standin.py train --out PATH makes it)")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()] or _measure(pack, "rows").default_rows(peers=not a.no_peers)
    modes = [True] if a.compile_only else [False, True] if a.compile else [False]
    results = []
    descs = {p: _with_cfg((STANDIN_PRESETS.get(p) or presets_.MODEL_PRESETS[p]).description, a.cfg) for p in presets}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "steps": a.steps, "rounds": a.rounds, "stat": a.stat, "presets": descs}
    header = _header(meta, a, all(p in STANDIN_PRESETS for p in presets))
    bar = tqdm(total=len(presets) * len(rows) * len(modes), unit="row", desc="end-to-end")
    for preset in presets:
        if preset in STANDIN_PRESETS:
            job = standin_job(e2e, a.standin, preset)
        else:
            job = presets_.build_preset(preset, dynamic=a.dynamic_vram)
        job.steps = a.steps
        if a.cfg is not None:
            job.cfg = a.cfg
            meta["cfg"] = a.cfg
        decode = job.extra.get("vae_decode")
        finals = {} if decode is not None and a.json else None  # each row's final latent, for the frames picture
        for compile in modes:
            results += e2e.measure(job, rows, compile=compile, profile=a.profile, profile_step=a.profile_step, rounds=a.rounds, stat=a.stat,
                                   progress=lambda r, p=preset: (bar.set_postfix_str(f"{p} {r['row']}"), bar.update(1)),
                                   final_latents=finals)
            save(a, meta, header, results, report, final=False)  # a run cut short keeps what it measured
        if finals:
            mine = [r for r in results if r["preset"] == preset]
            pictures.frames(mine, finals, decode).image.save(f"{os.path.splitext(a.json)[0]}-frames-{preset}.png")
        del job, finals
        torch.cuda.empty_cache()
    bar.close()
    save(a, meta, header, results, report, final=True)


def _let_core_nodes_import():
    """ComfyUI's own attention nodes (the core rows) live in modules that import its nodes.py, which imports PyAV for
    its video types. Where PyAV is missing (the GPU runner's machine), an empty stand-in lets them import, as the test
    tiers do (tests/comfyui_support.py); nothing the benchmark runs decodes video. A ComfyUI install has PyAV."""
    if importlib.util.find_spec("av") is not None:
        return
    tests = os.path.join(HERE, "tests")
    sys.path.append(tests)
    try:
        from comfyui_support import AbsentPackage
    except ImportError:  # without the test tiers' packages the core rows say their module does not import
        return
    finally:
        sys.path.remove(tests)
    sys.meta_path.insert(0, AbsentPackage("av"))


def _with_cfg(description: str, cfg: float | None) -> str:
    """A preset's description with the guidance scale ``cfg`` given on the command line (None: the preset's own)."""
    if cfg is None:
        return description
    if cfg == 1:
        return description.replace(", CFG batch", "") + ", CFG 1 (one prompt per step)"
    return f"{description}, CFG {cfg:g}"


def _measure(pack, name: str):
    """The pack's ``measure.<name>`` module."""
    return importlib.import_module(f"{pack.__name__}.measure.{name}")


class StandinPreset(NamedTuple):
    """A preset of the stand-in (tools/standin.py): its latent grid (a key of its LATENT_GRIDS) and what it is."""

    grid: str
    description: str


STANDIN_PRESETS = {
    "standin-480p": StandinPreset("480p", "the Wan-class stand-in (tools/standin.py), 480p (832x480), 81 frames, CFG 5"),
    "standin-720p": StandinPreset("720p", "the Wan-class stand-in (tools/standin.py), 720p (1280x720), 81 frames, CFG 5"),
}


def standin_module():
    """tools/standin.py (loaded by path: it is a script beside the pack, not part of it)."""
    name = "patch_attention_standin"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "tools", "standin.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def standin_job(e2e, path, preset, device="cuda", grid=None):
    """The stand-in through ComfyUI's loader, in bf16, with its fp32 copy as the quality reference and its codec to
    decode frames; ``grid``: another latent (T, H, W) than the preset's."""
    import torch

    sd = standin_module()
    meta = sd.read_meta(path)
    model = sd.load(path, torch.bfloat16, device)
    grid = grid or sd.LATENT_GRIDS[STANDIN_PRESETS[preset].grid]
    pos, neg = sd.conditioning(meta)
    return e2e.Job(model, pos, neg, torch.zeros(1, sd.LATENT_CHANNELS, *grid), cfg=5.0, label=preset,
                   extra={"description": STANDIN_PRESETS[preset].description, "decode": lambda lat: sd.decode(model, lat, meta),
                          # the same frames in ComfyUI's image layout ([B, T, H, W, 3], what a VAE's decode returns)
                          "vae_decode": lambda lat: sd.decode(model, lat, meta).permute(0, 2, 3, 4, 1)},
                   reference=sd.load(path, torch.float32, device), reference_label="fp32")


def save(a, meta, header, results, report, final):
    """The results so far as markdown (--md, and printed when ``final``), JSON (--json, with the chart beside it) and
    plots (--png); ``report`` is the pack's measure.report module."""
    md = report.render_markdown(results, header)
    tlines = []
    for p in dict.fromkeys(r["preset"] for r in results):
        mine = [r for r in results if r["preset"] == p and not r.get("compile")]
        for t in report.targets(mine) + report.quality_targets(mine):
            verdict = "n/a (auto's error is higher)" if not t["applies"] else ("met" if t["met"] else "MISSED")
            tlines.append(f"| {p} | {t['target']} | x{t['ratio']:.3f} | {verdict} | {t['detail']} |")
            t["preset"] = p
            meta.setdefault("targets", []).append(t) if final else None
    if tlines:
        md += "\n\nTargets (s/step ratios from this run; > 1: the first row is faster):\n\n| preset | target | ratio | | |\n" \
              "|---|---|---|---|---|\n" + "\n".join(tlines)
    if a.profile:
        md += "\n\nTop device kernels of the last step of one profiled run per row (ms, calls):\n"
        for r in results:
            if r.get("profile"):
                pr = r["profile"]
                md += (f"\n- {r['preset']} {r['row']} (step {pr['step']}: {pr.get('wall_ms')} ms wall, {pr['device_ms']} ms of device kernels, "
                       f"{pr['attention_ms']} ms of them attention's): "
                       + "; ".join(f"{n} {ms} ms x{c}" for n, ms, c in pr["top"]))
    if final:
        print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
        if final:
            pictures = importlib.import_module(report.__package__ + ".pictures")
            title = f"{meta['gpu']} · torch {meta['torch']} · {meta['date']} · {meta['steps']} steps"
            pictures.chart(results, title).image.save(os.path.splitext(a.json)[0] + "-chart.png")
    if a.png and final:
        grammar = importlib.import_module(report.__package__ + ".rows")
        plot(results, a.png, meta, grammar)
        if any("psnr" in r for r in results):
            plot_frontier(results, a.png.replace(".png", "-frontier.png"), meta, grammar)


def plot(rows, path, meta, grammar):
    """One panel per run of a preset: each row's speed against unpatched, coloured by its role (``grammar``: the
    pack's measure.rows module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys((r["preset"], r.get("steps")) for r in rows))  # one panel per run of a preset
    fig, axes = plt.subplots(len(presets), 1, figsize=(9, 0.32 * len(rows) + 1.5 * len(presets)), squeeze=False)
    for ax, (p, steps) in zip(axes[:, 0], presets):
        rs = [r for r in rows if r["preset"] == p and r.get("steps") == steps and "vs_unpatched" in r]
        paired = all("paired" in r for r in rs)
        # with rounds: the paired per-round median and its 95 % interval; else the ratio of the s/step statistic
        vals = [r["paired"]["vs_unpatched"][0] if paired else r["vs_unpatched"] for r in rs]
        err = [[v - r["paired"]["vs_unpatched"][1] for v, r in zip(vals, rs)],
               [r["paired"]["vs_unpatched"][2] - v for v, r in zip(vals, rs)]] if paired else None
        ax.barh([r["row"] for r in rs], vals, xerr=err, capsize=3, label="per step (the first not counted)",
                color=[{grammar.BASELINE: "#888", grammar.PEER_ROLE: "#c66"}.get(grammar.role_of(r["row"]), "#369")
                       for r in rs])
        whole = [(i, r["whole_vs_unpatched"]) for i, r in enumerate(rs) if "whole_vs_unpatched" in r]
        if whole and (steps or 0) >= 6:  # runs long enough to hold a sparse schedule's dense steps
            ax.plot([w for _, w in whole], [i for i, _ in whole], "kD", ms=4, label="whole run (first steps included)")
            ax.legend(fontsize=7, loc="lower right")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_title(f"{p}, {steps} steps: speed vs unpatched (higher is faster)" +
                     (", paired per round, median and 95 % interval" if paired else ""), fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{meta['gpu']} · torch {meta['torch']} · {meta['date']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / fig.get_figheight()))
    fig.savefig(path, dpi=110)


def frontier(points):
    """The points no other point beats on both speed and PSNR (higher is better on both), fastest first."""
    out = []
    for p in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not out or p[1] > out[-1][1]:
            out.append(p)
    return out


def plot_frontier(rows, path, meta, grammar):
    """Speed (whole run against unpatched) against PSNR (against the reference run), one panel per preset; the exact
    floor and its 1 dB band; the frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows if "psnr" in r))
    fig, axes = plt.subplots(1, len(presets), figsize=(7 * len(presets), 5.5), squeeze=False)
    for ax, p in zip(axes[0], presets):
        rs = [r for r in rows if r["preset"] == p and "psnr" in r and "whole_vs_unpatched" in r]
        cap = max([r["psnr"] for r in rs if r["psnr"] != float("inf")] or [0.0]) + 3
        pts = [(r["whole_vs_unpatched"], min(r["psnr"], cap), r["row"]) for r in rs]
        for x, y, name in pts:
            exact = next((r.get("exact") for r in rs if r["row"] == name), False)
            selector = grammar.role_of(name) == grammar.SELECTOR
            ax.plot(x, y, "o", color="#888" if exact else "#c33" if selector else "#369")
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        fr = frontier(pts)
        ax.plot([x for x, _, _ in fr], [y for _, y, _ in fr], "k--", lw=0.8, label="frontier")
        floor = next((r.get("floor_psnr") for r in rs if r.get("floor_psnr") is not None), None)
        if floor is not None and floor != float("inf"):
            ax.axhline(floor, color="g", lw=0.8, label="exact floor")
            ax.axhspan(floor - 1, floor, color="g", alpha=0.1, label="within 1 dB")
        ax.set_xlabel("whole run: speed vs unpatched (x)")
        ax.set_ylabel(f"PSNR dB vs {rs[0].get('reference', 'reference') if rs else ''}")
        ax.set_title(p, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['gpu']} · torch {meta['torch']} · {meta['date']}: speed against quality", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
