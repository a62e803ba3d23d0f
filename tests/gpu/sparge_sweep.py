"""SpargeAttn on video-like inputs: sparsity, speed and error at several thresholds (GPU).

    python tests/gpu/sparge_sweep.py --md out.md --json out.json

Inputs come from measure.inputs.structured_qkv(kind="video"): spatio-temporal locality and K channel
bias, so the sparsity is the kind SpargeAttn finds in real video DiTs (not i.i.d. noise, where it finds none).
"""

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (pack loader)
from pack import load  # noqa: E402

P = load()
AttentionConfig, attention = P.attention.AttentionConfig, P.attention.attention
accuracy, time_call = P.attention.auto.accuracy, P.attention.auto.time_call
reference_attention = P.attention.reference.reference_attention
structured_qkv = importlib.import_module(P.__name__ + ".measure.inputs").structured_qkv


def timed(fn, reps=10, rounds=3):
    return time_call(fn, torch.device("cuda"), warmup=1, reps=reps, rounds=rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", required=True)
    ap.add_argument("--json")
    ap.add_argument("--grid", default="13,30,52")
    ap.add_argument("--heads", type=int, default=24)
    a = ap.parse_args()
    grid = tuple(int(x) for x in a.grid.split(","))
    n = grid[0] * grid[1] * grid[2]
    h, d = a.heads, 128
    q, k, v = structured_qkv(1, h, n, n, d, device="cuda", dtype=torch.bfloat16, seed=5, kind="video", grid=grid)
    qc, kc, vc = (t.transpose(1, 2).reshape(1, n, h * d) for t in (q, k, v))
    ref = reference_attention(q, k, v).transpose(1, 2).reshape(1, n, h * d)
    rows = []
    base_cfg = AttentionConfig(backend="sdpa")
    sdpa_ms = timed(lambda: attention(qc, kc, vc, h, config=base_cfg))
    for name in ("sage_fp8_sm90", "sage"):
        cfg = AttentionConfig(backend=name, allow_fallback=False)
        try:
            out = attention(qc, kc, vc, h, config=cfg)
            cos, rel = accuracy(out, ref)
            rows.append({"backend": name, "ms": timed(lambda cfg=cfg: attention(qc, kc, vc, h, config=cfg)), "rel_l1": rel, "cos": cos,
                         "sparsity": 0.0})
            break
        except Exception:
            continue
    sweep = [("sparge", {"simthreshd1": s, "cdfthreshd": c, "pvthreshd": 50}) for s in (0.3, 0.5, 0.6, 0.7)
             for c in (0.999, 0.99, 0.98, 0.97, 0.95, 0.9)]
    sweep += [("sparge_topk", {"simthreshd1": -0.1, "topk": t, "pvthreshd": 50}) for t in (0.9, 0.7, 0.5, 0.3)]
    for name, opts in sweep:
        cfg = AttentionConfig(backend=name, allow_fallback=False, options={name: {**opts, "collect_sparsity": True}})
        try:
            out = attention(qc, kc, vc, h, config=cfg)
            cos, rel = accuracy(out, ref)
            sp = cfg.stats.as_dict()["metrics"].get(f"{name}.sparsity", {}).get("mean", float("nan"))
            cfg2 = AttentionConfig(backend=name, allow_fallback=False, options={name: opts})
            ms = timed(lambda cfg2=cfg2: attention(qc, kc, vc, h, config=cfg2))
            rows.append({"backend": name, **opts, "ms": ms, "rel_l1": rel, "cos": cos, "sparsity": sp})
        except Exception as e:
            rows.append({"backend": name, **opts, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        print(rows[-1], flush=True)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; video-like q/k/v {grid} = {n} tokens, {h} heads, D={d}, "
             f"bf16; SDPA {sdpa_ms:.2f} ms. Error vs fp32 SDPA.", "",
             "| backend | simthreshd1 | cdfthreshd / topk | sparsity | ms | speed-up vs SDPA | rel-L1 | cos |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r.get('simthreshd1', '')} | {r.get('cdfthreshd', r.get('topk', ''))} | error: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['backend']} | {r.get('simthreshd1', '-')} | {r.get('cdfthreshd', r.get('topk', '-'))} | {r['sparsity']:.3f} | "
                     f"{r['ms']:.2f} | {sdpa_ms / r['ms']:.2f} | {r['rel_l1']:.4f} | {r['cos']:.5f} |")
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    if a.json:
        json.dump({"sdpa_ms": sdpa_ms, "rows": rows, "grid": grid, "heads": h}, open(a.json, "w"), indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
