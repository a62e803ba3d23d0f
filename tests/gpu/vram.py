"""Peak VRAM of one sampling step with and without ComfyUI 0.33's attention tensor containers.

    python tests/gpu/vram.py --preset wan-14b-720p --rows unpatched,sage_fp8_sm90 --md vram.md --json vram.json

ComfyUI 0.33 passes q/k/v as single-owner ``AttentionTensorContainer`` objects where a model's code does so; 0.38's Wan
does (its self- and cross-attention wrap q/k/v before ``optimized_attention``), 0.33's Wan does not.  "containers"
runs Wan's attention modules as 0.38 writes them (the same computation, q/k/v handed over in containers), "plain" as
0.33 writes them.  Per row and mode: torch.cuda.max_memory_allocated over one Euler step (CFG batch), and the step's
time.  The model is ComfyUI's Wan class at full size with random bf16 weights (bench_e2e's preset).
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


def main():
    ap = argparse.ArgumentParser()
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
    e2e = importlib.import_module("pa_pack.nodes.e2e")
    job = e2e.build_preset(a.preset)
    job.steps = 1
    originals = {key: getattr(*key) for key in container_forwards()}
    results = []
    for mode in ("plain", "containers"):
        for key, fn in container_forwards().items():
            setattr(key[0], key[1], fn if mode == "containers" else originals[key])
        for row in [r.strip() for r in a.rows.split(",") if r.strip()]:
            m = e2e.make_row_model(job.model, row)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            lat = e2e._sample(m, job, 1)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated()
            r = {"row": row, "mode": mode, "peak_gib": round(peak / 2**30, 3), "resident_gib": round(base / 2**30, 3),
                 "step_s": round(dt, 2), "finite": bool(torch.isfinite(lat).all()),
                 "kernels": e2e.kernels_that_ran(m) or "ComfyUI attention"}
            results.append(r)
            print(r, flush=True)
            del m, lat
    for key, fn in originals.items():
        setattr(key[0], key[1], fn)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": a.preset,
            "description": e2e.PRESETS[a.preset][6]}
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
