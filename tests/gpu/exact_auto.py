"""auto_exact on the GPU, per call shape: is what it timed what runs, and is its error an exact kernel's?

    COMFYUI_PATH=... python tests/gpu/exact_auto.py --md exact-auto.md --json exact-auto.json

Per shape (bf16, ComfyUI's ``[B, N, H*D]`` convention):

- auto_exact tunes (no decisions file, every exact kernel installed here: SDPA's ATen kernels, flash-attn 2/3/4,
  xformers) and its report gives each candidate's time; the choice's error against fp32 must be within the exact
  class's bound;
- the call is made through ComfyUI's own ``attention_pytorch`` with the override on its hook (what a patched model
  does; without COMFYUI_PATH the override is called directly) and timed;
- torch.profiler names the device kernel with the most time in one call of: the chosen candidate called alone (what
  was timed), the override (what runs), ComfyUI's function unpatched (what the model ran before: on ComfyUI 0.33 under
  ComfyUI's SDPA priority, FlashAttention-2 first) and plain ``F.scaled_dot_product_attention`` (what ``sdpa`` means).

Pass per shape: the override's kernel is the timed choice's, and the error is in the exact class. One line per shape in
the log; JSON and a markdown table with ``--json``/``--md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (pack loader)
from pack import load  # noqa: E402

P = load()
A = P.attention
patch = P.nodes.patch

DEVICE = "cuda"  # --cpu: a smoke run of this script's own logic on small shapes (no GPU kernels, no timings worth reading)

SHAPES = {  # name: (batch, query tokens, key tokens, heads, head dim)
    "Wan 1.3B 480p self": (1, 32760, 32760, 12, 128),
    "Wan 1.3B 480p cross": (1, 32760, 512, 12, 128),
    "Flux 1024² joint": (1, 4608, 4608, 24, 128),
    "SDXL 1024² self (level 1)": (2, 4096, 4096, 10, 64),
    "SD1.5 512² self": (2, 4096, 4096, 8, 40),
    "SDXL cross": (2, 4096, 77, 10, 64),
}


def comfy_function():
    """ComfyUI's attention_pytorch (through its wrap_attn), or None without COMFYUI_PATH."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    sys.path.insert(0, path)
    from comfy.cli_args import args

    args.cpu = DEVICE != "cuda"
    import comfy.ldm.modules.attention as cattn

    return cattn.attention_pytorch


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def top_kernel(fn) -> str:
    """The device kernel with the most time in one call of ``fn`` (after a warm-up call)."""
    fn()
    sync()
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if cuda else "CPU")]
    if not events:
        return "?"
    best = max(events, key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total)
    return best.key[:80]


def ms(fn) -> float:
    return A.auto.time_call(fn, torch.device(DEVICE), warmup=2, reps=5, rounds=5)


def one_shape(name, shape, func):
    b, n, nk, h, d = shape
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(b, n, h * d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, nk, h * d, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
    sel = A.AutoSelector.exact(retune=True)
    cfg = A.AttentionConfig(backend="auto_exact", exact_selector=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    topts = {"optimized_attention_override": ov}
    ov.lane().active = True  # as inside a model forward (the APPLY_MODEL wrapper sets it): the lean path after 1 call

    def through_override():
        if func is not None:
            return func(q, k, v, h, transformer_options=topts)
        return ov(None, q, k, v, h, transformer_options={})

    t0 = time.perf_counter()
    out = through_override()  # tunes
    tune_s = time.perf_counter() - t0
    [(sig, choice)] = sel.decisions.items()
    report = {c.name: {"ms": c.ms, "cos": c.cos, "rel_l1": c.rel_l1, "error": c.error, "note": c.note}
              for c in sel.reports[sig]}
    cos, rel = A.dispatch.error_vs_reference(out, q, k, v, h)  # against SDPA in the call's dtype (a sanity check)
    ref = A.dispatch.fp32_reference(q, k, v, h)
    cos32, rel32 = A.auto.accuracy(out, ref)
    bound = A.registry.ACCURACY["exact"]
    exact_ok = cos32 >= bound.min_cos and rel32 <= bound.max_rel_l1

    q4, k4, v4, layout, spec, mask4, scale = A.calls.prepare(q, k, v, h)
    backend = A.REGISTRY.get(choice)
    target, _ = A.calls.plan_for(backend, spec)

    def timed_alone():  # the call the selector timed
        return A.calls.run_backend(backend, q4, k4, v4, layout, mask4, spec, target, scale, {})[0]

    row = {"shape": name, "dims": shape, "choice": choice, "tune_s": round(tune_s, 2), "report": report,
           "ms_choice_alone": ms(timed_alone), "ms_override": ms(through_override),
           "cos_fp32": cos32, "rel_l1_fp32": rel32, "cos_vs_sdpa": cos, "rel_l1_vs_sdpa": rel, "exact_ok": exact_ok,
           "kernel_timed": top_kernel(timed_alone), "kernel_run": top_kernel(through_override),
           "calls": dict(ov.stats.calls)}
    qh, kh, vh = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))
    row["kernel_sdpa_default"] = top_kernel(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh))
    if func is not None:
        unpatched = lambda: func(q, k, v, h, transformer_options={})  # noqa: E731
        row["ms_comfyui"] = ms(unpatched)
        row["kernel_comfyui"] = top_kernel(unpatched)
    row["same_kernel"] = row["kernel_timed"] == row["kernel_run"]
    row["ok"] = row["same_kernel"] and exact_ok
    return row


def summary(r) -> str:
    cands = ", ".join(f"{n} {c['ms']:.3f} ms" if c["ms"] is not None else f"{n} ({c['error'] or c['note'] or 'gate'})"
                      for n, c in sorted(r["report"].items(), key=lambda x: (x[1]["ms"] is None, x[1]["ms"] or 0)))
    comfy = f"; ComfyUI's function {r['ms_comfyui']:.3f} ms [{r['kernel_comfyui'][:40]}]" if "ms_comfyui" in r else ""
    return (f"{'ok  ' if r['ok'] else 'FAIL'} {r['shape']}: auto_exact -> {r['choice']} ({cands}); through the "
            f"override {r['ms_override']:.3f} ms, alone {r['ms_choice_alone']:.3f} ms; kernel run == timed: "
            f"{r['same_kernel']} [{r['kernel_run'][:40]}]; rel-L1 vs fp32 {r['rel_l1_fp32']:.4f}{comfy}")


def render(rows, meta) -> str:
    lines = [f"{meta['gpu']} · torch {meta['torch']} · ComfyUI {meta['comfyui']} · bf16, ms per call (median of 5 "
             f"rounds of 5)", "",
             "| shape | auto_exact's choice | candidates (ms, selector's timing) | through the override | choice alone | "
             "ComfyUI's function (unpatched) | kernel run = timed | rel-L1 vs fp32 | kernels: run / ComfyUI's / "
             "F.sdpa default |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | error: {r['error']} | | | | | | | |")
            continue
        cands = ", ".join(f"{n} {c['ms']:.3f}" for n, c in r["report"].items() if c["ms"] is not None)
        lines.append(f"| {r['shape']} | {r['choice']} | {cands} | {r['ms_override']:.3f} | {r['ms_choice_alone']:.3f} | "
                     f"{r.get('ms_comfyui', float('nan')):.3f} | {'yes' if r['same_kernel'] else 'NO'} | "
                     f"{r['rel_l1_fp32']:.4f} | `{r['kernel_run'][:50]}` / `{r.get('kernel_comfyui', '-')[:50]}` / "
                     f"`{r['kernel_sdpa_default'][:50]}` |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="comma-separated names from SHAPES (default: all)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--cpu", action="store_true", help="a smoke run of the script on small CPU shapes")
    a = ap.parse_args(argv)
    global DEVICE
    if a.cpu:
        DEVICE = "cpu"
        SHAPES.clear()
        SHAPES.update({"small self": (1, 256, 256, 2, 64), "small cross": (2, 256, 77, 2, 40)})
    elif not torch.cuda.is_available():
        print("exact_auto: needs a CUDA GPU (--cpu: a smoke run)")
        return 2
    func = comfy_function()
    try:
        from comfyui_version import __version__ as comfy_version
    except ImportError:
        comfy_version = "none (the override called directly)"
    meta = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "comfyui": comfy_version,
            "exact candidates installed": [b.name for b in A.REGISTRY.backends() if b.available and not b.quantized]}
    print(json.dumps(meta))
    wanted = [s.strip() for s in a.shapes.split(",") if s.strip()] or list(SHAPES)
    rows = []
    for name in wanted:
        try:
            r = one_shape(name, SHAPES[name], func)
        except Exception as e:  # one shape's failure is a row, not the end of the run
            r = {"shape": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "ok": False}
            print(f"FAIL {name}: {r['error']}", flush=True)
        else:
            print(summary(r), flush=True)
        rows.append(r)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    md = render(rows, meta)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    print(md)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
