"""Peak VRAM of one sampling step with and without ComfyUI 0.33's attention tensor containers.

    python tests/gpu/vram.py --preset wan-14b-720p --rows unpatched,sage_fp8_sm90 --md vram.md --json vram.json

ComfyUI 0.33 passes q/k/v as single-owner ``AttentionTensorContainer`` objects where a model's code does so; 0.38's Wan
does (its self- and cross-attention wrap q/k/v before ``optimized_attention``), 0.33's Wan does not.  "containers"
runs Wan's attention modules as 0.38 writes them (the same computation, q/k/v handed over in containers), "plain" as
0.33 writes them.  Per row and mode: torch.cuda.max_memory_allocated over one Euler step (CFG batch), and the step's
time.  The model is ComfyUI's Wan class at full size with random bf16 weights (bench_e2e's preset).

    python tests/gpu/vram.py --calls --md vram-calls.md --json vram-calls.json

``--calls``: one self-attention call at the preset's size (Wan 14B 720p: B=2, 75,600 tokens, 40 heads of 128), the
memory it allocates beyond its inputs (peak over q/k/v, the output included): ComfyUI's own function, each backend
through Patch Attention's override as the node configures it, and the libraries' own functions called directly, so
that what the pack adds shows beside what a kernel needs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def container_forwards():
    """Wan's self- and cross-attention forwards as ComfyUI 0.38 writes them: q/k/v in containers."""
    import comfy.ldm.wan.model as wan
    from comfy.ldm.flux.math import apply_rope1
    from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention

    def self_attn(self, x, freqs, transformer_options={}):  # noqa: B006  (ComfyUI's signature)
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim

        def qkv_fn_q(x):
            return apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs)

        def qkv_fn_k(x):
            return apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs)

        q = AttentionTensorContainer(qkv_fn_q(x).view(b, s, n * d))
        k = AttentionTensorContainer(qkv_fn_k(x).view(b, s, n * d))
        v = AttentionTensorContainer(self.v(x).view(b, s, n * d))
        x = optimized_attention(q, k, v, heads=self.num_heads, transformer_options=transformer_options)
        return self.o(x)

    def cross_attn(self, x, context, transformer_options={}, **kwargs):  # noqa: B006
        q = AttentionTensorContainer(self.norm_q(self.q(x)))
        k = AttentionTensorContainer(self.norm_k(self.k(context)))
        v = AttentionTensorContainer(self.v(context))
        return self.o(optimized_attention(q, k, v, heads=self.num_heads, transformer_options=transformer_options))

    return {(wan.WanSelfAttention, "forward"): self_attn, (wan.WanT2VCrossAttention, "forward"): cross_attn}


CALL_SHAPES = {"wan-14b-720p": (2, 75600, 40, 128), "wan-1.3b-720p": (2, 75600, 12, 128), "wan-14b": (2, 32760, 40, 128)}


def call_rows(pack, a):
    """Extra memory of one attention call per row (GiB and in units of one q tensor)."""
    A, patch = pack.attention, pack.nodes.patch
    sys.path.insert(0, os.environ.get("COMFYUI_PATH", ""))
    import comfy.ldm.modules.attention as cattn

    b, n, h, d = CALL_SHAPES[a.preset]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    unit = q.numel() * q.element_size()
    fns = {"ComfyUI attention_pytorch": (lambda: cattn.attention_pytorch(q, k, v, h), None)}
    for name in [r for r in a.rows.split(",") if r and r != "unpatched"]:
        if name not in A.REGISTRY or not A.REGISTRY.get(name).available:
            continue
        cfg = A.AttentionConfig(backend=name, check_finite="deferred")
        ov = patch.AttentionOverride(cfg, audit=False)
        ov.lane().active = True  # as inside a model forward
        fns[f"{name} (Patch Attention)"] = (lambda ov=ov, cfg=cfg: ov(cattn.attention_pytorch, q, k, v, h,
                                                                      transformer_options={}), cfg)
    q4, k4, v4 = (t.view(b, n, h, d) for t in (q, k, v))
    try:
        import sageattention as sa

        fns["sageattn_qk_int8_pv_fp8_cuda_sm90 (library, NHD)"] = (lambda: sa.sageattn_qk_int8_pv_fp8_cuda_sm90(
            q4, k4, v4, tensor_layout="NHD", pv_accum_dtype="fp32+fp32"), None)
        fns["sageattn (library, NHD)"] = (lambda: sa.sageattn(q4, k4, v4, tensor_layout="NHD"), None)
    except ImportError:
        pass
    qh, kh, vh = (t.transpose(1, 2) for t in (q4, k4, v4))
    for name in ("sdpa_cudnn", "sdpa_flash"):  # the kernel's own ATen op, as the backend calls it, without the override
        fn = A.REGISTRY.get(name).fn
        fns[f"{name} (its ATen op alone, HND views)"] = (
            lambda fn=fn: fn(qh, kh, vh, layout="HND", mask=None, scale=None, opts=None), None)
    rows = []
    for label, (fn, cfg) in fns.items():
        try:
            fn()  # first call: compiles, tunes, loads
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            del out
            r = {"row": label, "extra_gib": round(extra / 2**30, 3), "in_q": round(extra / unit, 2)}
            if cfg is not None:
                r["ran"] = dict(cfg.stats.calls)
        except Exception as e:  # a row that cannot run here is reported, not fatal
            r = {"row": label, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(r)
        print(r, flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": a.preset,
            "shape": [b, n, h, d], "q_gib": round(unit / 2**30, 3)}
    lines = [f"{meta['gpu']}, torch {meta['torch']}: one self-attention call, B={b}, {n} tokens, {h} heads of {d} "
             f"(bf16; one q tensor = {meta['q_gib']} GiB); memory allocated beyond q/k/v during the call "
             "(torch.cuda.max_memory_allocated), the output included", "",
             "| call | extra GiB | in q tensors |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r.get('extra_gib', r.get('error'))} | {r.get('in_q', '-')} |")
    return meta, rows, "\n".join(lines) + "\n"


def peak_breakdown(fn, top=14):
    """Run ``fn`` with the allocator's history on; the allocations alive at the peak (relative to the start), grouped
    by the innermost frames outside torch that made them."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400000)
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    cur = peak = peak_at = 0
    live = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            cur -= live.pop(e["addr"])
    alive = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            alive.pop(e["addr"], None)

    def where(e):
        frames = [f for f in e.get("frames", []) if "/torch/" not in f["filename"] and f["filename"] != "??"]
        return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:3]) or "?"

    groups = {}
    for e in alive.values():
        k = where(e)
        n, size = groups.get(k, (0, 0))
        groups[k] = (n + 1, size + e["size"])
    worst = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return {"peak_gib": round(peak / 2**30, 3), "events": len(trace),
            "at_peak": [{"where": k, "n": n, "gib": round(sz / 2**30, 3)} for k, (n, sz) in worst]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", action="store_true",
                    help="plain mode only; per row, the allocations alive at the step's peak and where they were made")
    ap.add_argument("--modes", default="plain,containers", help="q/k/v as 0.33's Wan passes them, in containers")
    ap.add_argument("--calls", action="store_true", help="one attention call's extra memory per row (see above)")
    ap.add_argument("--preset", default="wan-14b-720p")
    ap.add_argument("--rows", default="unpatched,sage_fp8_sm90")
    ap.add_argument("--md"), ap.add_argument("--json")
    a = ap.parse_args()
    sys.path.insert(0, os.environ.get("COMFYUI_PATH", ""))
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = True
    sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_file_location("pa_pack", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["pa_pack"] = pack
    spec.loader.exec_module(pack)
    if a.calls:
        meta, results, md = call_rows(pack, a)
        print(md)
        if a.md:
            open(a.md, "w").write(md)
        if a.json:
            json.dump({"meta": meta, "rows": results}, open(a.json, "w"), indent=1)
        return
    e2e = importlib.import_module("pa_pack.measure.e2e")
    presets = importlib.import_module("pa_pack.measure.presets")
    grammar = importlib.import_module("pa_pack.measure.rows")
    job = presets.build_preset(a.preset)
    job.steps = 1
    originals = {key: getattr(*key) for key in container_forwards()}
    results = []
    for mode in ("plain",) if a.trace else a.modes.split(","):
        for key, fn in container_forwards().items():
            setattr(key[0], key[1], fn if mode == "containers" else originals[key])
        for row in [r.strip() for r in a.rows.split(",") if r.strip()]:
            m = grammar.make_row_model(job.model, row)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            if a.trace:  # the patched model's first run (the one `vram` measures), then a second one
                got = {}
                breakdown = peak_breakdown(lambda m=m, got=got: got.setdefault("lat", e2e._sample(m, job, 1)))
                first_peak = torch.cuda.max_memory_allocated()
                print(json.dumps(breakdown, indent=1), flush=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                lat = e2e._sample(m, job, 1)
            else:
                lat = e2e._sample(m, job, 1)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated()
            r = {"row": row, "mode": mode, "peak_gib": round(peak / 2**30, 3), "resident_gib": round(base / 2**30, 3),
                 "step_s": round(dt, 2), "finite": bool(torch.isfinite(lat).all()),
                 "kernels": e2e.kernels_that_ran(m) or "ComfyUI attention"}
            if a.trace:
                r.update(first_run_peak_gib=round(first_peak / 2**30, 3), breakdown=breakdown)
            results.append(r)
            print(r, flush=True)
            del m, lat
    for key, fn in originals.items():
        setattr(key[0], key[1], fn)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": a.preset,
            "description": presets.MODEL_PRESETS[a.preset].description}
    lines = [f"{meta['gpu']}, torch {meta['torch']}: {meta['description']}; one Euler step (CFG batch); peak = "
             "torch.cuda.max_memory_allocated during the step (weights included)", "",
             "| row | q/k/v | peak GiB | step s | kernels |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['row']} | {r['mode']} | {r['peak_gib']:.2f} | {r['step_s']:.1f} | {r['kernels']} |")
    by = {(r["row"], r["mode"]): r["peak_gib"] for r in results}
    for row in dict.fromkeys(r["row"] for r in results):
        if (row, "plain") in by and (row, "containers") in by:
            lines.append(f"\n- {row}: containers {by[(row, 'containers')] - by[(row, 'plain')]:+.2f} GiB")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.md:
        open(a.md, "w").write(md)
    if a.json:
        json.dump({"meta": meta, "rows": results}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
