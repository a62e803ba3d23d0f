"""Speed, peak memory and accuracy of every installed backend on diffusion-model shapes.

    python bench_kernels.py                        # all presets, all usable backends
    python bench_kernels.py --preset flux --preset wan-480p --json out.json --png out.png
    python bench_kernels.py --shape 2,10,4096,64 --shape 1,24,4608,128,512

Run it from the pack's folder with ComfyUI's Python.  Rows: backends usable
here, ``auto``, and what other packs do (``peer:comfy_default``: ComfyUI's
default attention call; ``peer:sageattn``: a raw ``sageattn()`` call).  Times
are medians of CUDA-event timings; ratios are against SDPA measured in the
same run.  Accuracy is cosine / relative L1 against fp32 SDPA on inputs with
DiT-like structure (:mod:`measure.inputs`).  Without a CUDA GPU the node
(not this command line) times what runs on the CPU, PyTorch's SDPA and its
math kernel, with the wall clock.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from ..attention.auto import AutoSelector, accuracy, time_call
from ..attention.dispatch import AttentionConfig, attention
from ..attention.reference import reference_attention
from ..attention.registry import REGISTRY
from .inputs import structured_qkv

# name: (B, H, Nq, D, Nk or None, token grid or None, description)
PRESETS = {
    "sd15": (2, 8, 4096, 40, None, (64, 64), "SD1.5 512px, first UNet level (cond+uncond)"),
    "sd15-cross": (2, 8, 4096, 40, 77, (64, 64), "SD1.5 512px cross-attention to 77 tokens"),
    "sdxl": (2, 10, 4096, 64, None, (64, 64), "SDXL 1024px, first transformer level"),
    "sd3": (2, 24, 4250, 64, None, None, "SD3 medium 1024px (4096 image + 154 text tokens)"),
    "flux": (1, 24, 4608, 128, None, None, "Flux 1024px (4096 image + 512 text tokens)"),
    "wan-480p": (1, 40, 32760, 128, None, (21, 30, 52), "Wan 2.1 14B 480p, 81 frames"),
    "hunyuan-480p": (1, 24, 25696, 128, None, None, "HunyuanVideo 480p, 61 frames (+256 text)"),
}
SKIP_BY_DEFAULT = {"sdpa_math"}


def _time(fn, warmup, reps, rounds=5, device=None):
    """Median per-call ms over ``rounds`` of ``reps`` back-to-back calls (pipelined, as inside a model forward)."""
    return time_call(fn, device or torch.device("cuda"), warmup=warmup, reps=reps, rounds=rounds)


def _peak(fn, device=None):
    if device is not None and device.type != "cuda":
        return None  # no allocator statistics on the CPU
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _rows(include, exclude, device=None):
    """The backends to time: usable here; on a CPU, those that run on it (SDPA, its math kernel)."""
    if device is not None and device.type != "cuda":
        from ..attention.calls import make_spec

        q = torch.empty((1, 64, 1, 64), device="meta")
        spec = make_spec(q, q, q, "NHD", None).replace(device_type=device.type, dtype=torch.float32)
        return [n for n in REGISTRY.names() if REGISTRY.get(n).available and not REGISTRY.get(n).plan(spec)[1]
                and (not include or n in include)]
    names = [n for n in REGISTRY.names() if REGISTRY.get(n).available and n not in exclude]
    if include:
        names = [n for n in names if n in include]
    return names


def row_count(shapes: dict, device=None, backends=()) -> int:
    """How many rows :func:`run` times for ``shapes`` (a progress bar's length)."""
    device = device or torch.device("cuda")
    peers = 1 + (device.type == "cuda" and REGISTRY.get("sage").available)
    return len(shapes) * (len(_rows(set(backends), SKIP_BY_DEFAULT, device)) + 1 + peers)


def bench_shape(label, shape, names, *, dtype, warmup, reps, progress=None, auto_cache=None, device=None):
    b, h, nq, d, nk, grid, _ = shape
    nk = nk or nq
    dev = device or torch.device("cuda")
    q, k, v = structured_qkv(b, h, nq, nk, d, device=dev, dtype=dtype, seed=nq + d, kind="video" if grid and len(grid) == 3 else "image", grid=grid if grid and nq == nk else None)
    # ComfyUI hands most models' attention [B, N, H*D]
    qc, kc, vc = (t.transpose(1, 2).reshape(b, t.shape[2], h * d) for t in (q, k, v))
    ref = reference_attention(q, k, v).transpose(1, 2).reshape(b, nq, h * d)
    out_rows = []

    def row(name, fn, direct=None, unchecked=None):
        r = {"backend": name, "shape": label}
        try:
            out = fn()
            r["cos"], r["rel_l1"] = accuracy(out, ref)
            r["ms"] = _time(fn, warmup, reps, device=dev)
            peak = _peak(fn, dev)
            if peak is not None:
                r["peak_mib"] = round(peak, 1)
            if unchecked is not None:  # quantized backends: the NaN check's cost
                r["unchecked_ms"] = _time(unchecked, warmup, reps, device=dev)
            if direct is not None:
                r["direct_ms"] = _time(direct, warmup, reps, device=dev)
                base = r.get("unchecked_ms", r["ms"])
                r["wrapper_pct"] = 100.0 * (base - r["direct_ms"]) / r["direct_ms"]
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        out_rows.append(r)
        if progress:
            progress()
        return r

    for name in names:
        backend = REGISTRY.get(name)
        cfg = AttentionConfig(backend=name, allow_fallback=False, check_finite="deferred")  # as Patch Attention runs it
        direct = None
        spec_ok = True
        try:
            from ..attention.calls import make_spec, plan_call, plan_for

            spec = make_spec(q, k, v, "HND", None)
            target, reason = plan_for(backend, spec)
            spec_ok = reason is None
            # the dispatcher's overhead over the bare kernel call (the KernelCall it runs, without NaN check or
            # count): a GPU number (on the CPU the wall clock's noise is larger than it)
            if spec_ok and target == spec and dev.type == "cuda":
                bare, _ = plan_call(backend, qc, kc, vc, h, opts=dict(backend.options))
                if bare is not None:
                    def direct(run=bare.run):
                        return run(qc, kc, vc)
        except Exception:
            direct = None
        if not spec_ok:
            out_rows.append({"backend": name, "shape": label, "refused": reason})
            if progress:
                progress()
            continue
        unchecked = None
        if backend.quantized:
            cfg_u = AttentionConfig(backend=name, allow_fallback=False, check_finite=False)

            def unchecked(cfg_u=cfg_u):
                return attention(qc, kc, vc, h, config=cfg_u)

        row(name, lambda cfg=cfg: attention(qc, kc, vc, h, config=cfg), direct, unchecked)

    auto_cfg = AttentionConfig(backend="auto", auto=AutoSelector(cache_path=auto_cache), check_finite="deferred")
    r = row("auto", lambda: attention(qc, kc, vc, h, config=auto_cfg))
    r["auto_choice"] = next(iter(auto_cfg.auto.decisions.values()), None)
    r["auto_tune_ms"] = round(auto_cfg.auto.tune_ms, 1)
    r["auto_report"] = next(iter(auto_cfg.stats.decisions.values()), "")

    # what peers do: ComfyUI's default call, and a raw sageattn() call
    def comfy_default():
        qq, kk, vv = (t.view(b, -1, h, d).transpose(1, 2) for t in (qc, kc, vc))
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=None, dropout_p=0.0, is_causal=False)
        return o.transpose(1, 2).reshape(b, -1, h * d)

    row("peer:comfy_default", comfy_default)
    if dev.type == "cuda" and REGISTRY.get("sage").available:
        import sageattention

        def raw_sage():
            o = sageattention.sageattn(qc.view(b, -1, h, d), kc.view(b, -1, h, d), vc.view(b, -1, h, d), tensor_layout="NHD", is_causal=False)
            return o.reshape(b, -1, h * d)

        row("peer:sageattn", raw_sage)
    sdpa_ms = next((x["ms"] for x in out_rows if x["backend"] == "sdpa" and "ms" in x), None)
    for x in out_rows:
        if sdpa_ms and "ms" in x:
            x["speedup_vs_sdpa"] = round(sdpa_ms / x["ms"], 3)
    return out_rows


def render_markdown(meta, rows, presets):
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["backend"], r["shape"]): r for r in rows}
    cpu = meta.get("device", "cuda") != "cuda"
    out = [
        f"{meta['gpu']} · torch {meta['torch']} · {meta['dtype']} · {meta['date']} · per-call ms = median over 5 rounds of "
        f"{meta['reps']} back-to-back calls ({'wall clock' if cpu else 'CUDA events'}); speed-up = SDPA ms / backend ms, "
        "same run; accuracy vs fp32 SDPA.",
        "",
        *(["No CUDA GPU: these are PyTorch's SDPA kernels on the CPU, which is all that runs here; the GPU kernels "
           "need an NVIDIA GPU.", ""] if cpu else []),
        "Shapes: " + "; ".join(f"`{s}` = {presets[s][6] if s in presets else s}" for s in shapes),
        "",
        "| backend | " + " | ".join(shapes) + " |",
        "|---|" + "---|" * len(shapes),
    ]
    for n in names:
        cells = []
        for s in shapes:
            r = by.get((n, s))
            if r is None:
                cells.append("")
            elif "refused" in r:
                cells.append("n/a")
            elif "error" in r:
                cells.append("error")
            else:
                c = f"{r['ms']:.3f} ms ×{r.get('speedup_vs_sdpa', 0):.2f}"
                if n == "auto" and r.get("auto_choice"):
                    c += f" → {r['auto_choice']}"
                cells.append(c)
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "Accuracy (cos / rel-L1)" + ("" if cpu else " and peak extra memory (MiB)") + ":", "",
            "| backend | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    for n in names:
        cells = []
        for s in shapes:
            r = by.get((n, s))
            if r is None or "cos" not in r:
                cells.append("" if r is None else ("n/a" if "refused" in r else "error"))
            else:
                mem = f" · {r['peak_mib']:.0f}" if "peak_mib" in r else ""
                cells.append(f"{r['cos']:.4f} / {r['rel_l1']:.3f}{mem}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    wr = [r for r in rows if "wrapper_pct" in r]
    if wr:
        out += ["", "Wrapper overhead (dispatch from ComfyUI's `[B, N, H*D]`, NaN check off, vs calling the kernel on the same "
                "view; and the NaN check's own cost for quantized kernels):", ""]
        for r in wr:
            line = f"- {r['backend']} @ {r['shape']}: kernel {r['direct_ms']:.3f} ms, dispatched {r.get('unchecked_ms', r['ms']):.3f} ms " \
                   f"({r['wrapper_pct']:+.1f} %)"
            if "unchecked_ms" in r:
                line += f"; with the deferred NaN check {r['ms']:.3f} ms ({100.0 * (r['ms'] - r['unchecked_ms']) / r['unchecked_ms']:+.1f} %)"
            out.append(line)
    notes = [r for r in rows if "error" in r or "refused" in r]
    if notes:
        out += ["", "Not run:", ""] + [f"- {r['backend']} @ {r['shape']}: {r.get('error') or r.get('refused')}" for r in notes]
    autos = [r for r in rows if r["backend"] == "auto" and r.get("auto_report")]
    if autos:
        out += ["", "What `auto` measured:", ""] + [f"- {r['shape']}: {r['auto_report']}" for r in autos]
    return "\n".join(out) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = [n for n in dict.fromkeys(r["backend"] for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ys = []
        for s in shapes:
            r = next((x for x in rows if x["backend"] == n and x["shape"] == s), {})
            ys.append(r.get("speedup_vs_sdpa", 0.0))
        ax.bar([j + i * w for j in range(len(shapes))], ys, w, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("speed-up vs SDPA (same run)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_shapes(presets, user_shapes) -> dict:
    """Preset names (all when empty) and ``B,H,N,D[,Nk]`` strings -> {label: shape}."""
    shapes = {p: PRESETS[p] for p in (presets or PRESETS)}
    for s in user_shapes:
        try:
            parts = [int(x) for x in s.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (4, 5) or min(parts) <= 0:
            raise ValueError(f"a shape is B,H,N,D or B,H,N,D,Nk with positive integers, got {s!r}")
        b, h, n, d = parts[:4]
        shapes[s] = (b, h, n, d, parts[4] if len(parts) == 5 else None, None, f"user shape {s}")
    return shapes


def run(shapes: dict, *, backends=(), dtype="bf16", warmup=3, reps=10, json_path=None, progress=True, device=None):
    """Benchmark ``shapes`` on ``device`` (default: this GPU); returns (meta, rows).  Used by the CLI and the Attention
    Benchmark node.  ``progress``: True for a terminal bar, or a callable called once per row."""
    device = device or torch.device("cuda")
    names = _rows(set(backends), SKIP_BY_DEFAULT, device)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    bar = tick = None
    if callable(progress):
        tick = progress
    elif progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=row_count(shapes, device, backends), desc="benchmark", unit="run")
            tick = lambda: bar.update(1)  # noqa: E731
        except ImportError:
            bar = None
    meta = {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "dtype": dtype,
        "date": datetime.date.today().isoformat(),
        "reps": reps,
        "versions": {n: REGISTRY.get(n).availability().version for n in names},
    }
    rows = []
    for label, shape in shapes.items():
        try:
            rows += bench_shape(label, shape, names, dtype=tdtype, warmup=warmup, reps=reps, progress=tick,
                                device=device)
        except torch.OutOfMemoryError as e:
            rows.append({"backend": "sdpa", "shape": label, "error": f"out of memory: {str(e).splitlines()[0][:120]}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if json_path:  # after every shape, so a long run keeps what it measured
            with open(json_path, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if bar:
        bar.close()
    return meta, rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python bench_kernels.py", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: all")
    ap.add_argument("--shape", action="append", default=[], help="B,H,N,D[,Nk] (repeatable)")
    ap.add_argument("--backends", default="", help="comma-separated subset")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--md", help="write a markdown table here")
    ap.add_argument("--png", help="write a speed-up plot here (needs matplotlib)")
    ap.add_argument("--from-json", help="render --md/--png from an earlier --json, run nothing")
    a = ap.parse_args(argv)

    if a.from_json:
        data = json.load(open(a.from_json))
        meta, rows = data["meta"], data["rows"]
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU: nothing to benchmark (PyTorch SDPA is what runs here)", file=sys.stderr)
            return 2
        try:
            shapes = parse_shapes(a.preset, a.shape)
        except ValueError as e:
            ap.error(str(e))
        meta, rows = run(shapes, backends=set(filter(None, a.backends.split(","))), dtype=a.dtype, warmup=a.warmup,
                         reps=a.reps, json_path=a.json)
    md = render_markdown(meta, rows, PRESETS)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if a.png:
        try:
            plot(rows, a.png)
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
