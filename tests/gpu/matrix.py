"""Correctness matrix of every installed backend against fp32 SDPA (run on a GPU).

    python tests/gpu/matrix.py --out results.json [--md results.md]

Head dims 40..256, bf16/fp16/fp32, no mask / bool / additive float masks,
self- and cross-attention (77/256/512 keys), both ComfyUI layouts.  Each case
is called with fallback off, so a number is the backend's own; a refusal by
its declared constraints is counted as such, and an error inside a call that
its constraints accepted is a finding.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attention import REGISTRY, AttentionConfig, BackendUnavailableError, attention  # noqa: E402
from attention.auto import accuracy  # noqa: E402
from attention.inputs import structured_qkv  # noqa: E402
from attention.reference import reference_attention  # noqa: E402

HEAD_DIMS = (40, 64, 72, 80, 96, 128, 160, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MASKS = (None, "bool", "float")
KV = ("self", 77, 256, 512)
LAYOUTS = (False, True)  # skip_reshape


def make_mask(kind, b, nq, nk, device, dtype):
    if kind is None:
        return None
    g = torch.Generator(device="cpu").manual_seed(nk)
    keep = torch.rand(b, 1, nq, nk, generator=g) > 0.2
    keep[..., 0] = True  # no fully masked row
    keep = keep.to(device)
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, device=device, dtype=dtype).masked_fill(~keep, -10000.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--md")
    ap.add_argument("--nq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--backends", default="")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    names = [n for n in (a.backends.split(",") if a.backends else REGISTRY.names()) if REGISTRY.get(n).available]
    cases = list(itertools.product(HEAD_DIMS, DTYPES, MASKS, KV, LAYOUTS))
    results = defaultdict(lambda: {"ok": 0, "refused": 0, "errors": [], "worst_cos": 1.0, "worst_rel_l1": 0.0,
                                   "worst_case": "", "by_dim": {}, "bad": []})
    t0 = time.time()
    b, h, nq = 2, a.heads, a.nq
    for d, dtype, mk, kv, skip in cases:
        nk = nq if kv == "self" else kv
        q, k, v = structured_qkv(b, h, nq, nk, d, device=dev, dtype=dtype, seed=d * 7 + nk)
        mask = make_mask(mk, b, nq, nk, dev, dtype)
        ref = reference_attention(q, k, v, mask)
        if skip:
            args = (q, k, v)
        else:
            args = tuple(t.transpose(1, 2).reshape(b, t.shape[2], h * d) for t in (q, k, v))
            ref = ref.transpose(1, 2).reshape(b, nq, h * d)
        case = f"D{d} {str(dtype)[6:]} mask={mk} Nk={nk} {'HND' if skip else 'BNC'}"
        for name in names:
            r = results[name]
            cfg = AttentionConfig(backend=name, allow_fallback=False)
            try:
                out = attention(*args, h, mask, skip_reshape=skip, skip_output_reshape=skip, config=cfg)
                sync()
            except BackendUnavailableError:
                r["refused"] += 1
                continue
            except Exception as e:  # accepted by its constraints but raised: a finding
                r["errors"].append(f"{case}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                continue
            if out.shape != ref.shape or out.dtype != q.dtype:
                r["errors"].append(f"{case}: shape/dtype {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {q.dtype}")
                continue
            cos, rel = accuracy(out, ref)
            r["ok"] += 1
            bd = r["by_dim"].setdefault(str(d), [1.0, 0.0])
            bd[0], bd[1] = min(bd[0], cos), max(bd[1], rel)
            if cos < r["worst_cos"]:
                r["worst_cos"], r["worst_case"] = cos, case
            r["worst_rel_l1"] = max(r["worst_rel_l1"], rel)
            if cos < 0.99 or rel != rel:
                r["bad"].append(f"{case}: cos {cos:.4f} rel-L1 {rel:.4f}")
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "versions": {n: REGISTRY.get(n).availability().version for n in names},
        "cases": len(cases),
        "seconds": round(time.time() - t0, 1),
        "shape": f"B={b} H={h} Nq={nq}",
    }
    data = {"meta": meta, "results": results}
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
    md = render(meta, results)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)


def render(meta, results):
    lines = [
        f"GPU {meta['gpu']}, torch {meta['torch']}, {meta['date']}; {meta['cases']} cases per backend ({meta['shape']}), "
        f"inputs from attention.inputs.structured_qkv; reference fp32 SDPA.",
        "",
        "| backend | version | ran | refused | errors | worst cos | worst rel-L1 | worst case | "
        + " | ".join(f"D{d} cos/relL1" for d in HEAD_DIMS) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(HEAD_DIMS),
    ]
    for name, r in results.items():
        dims = " | ".join(
            f"{r['by_dim'][str(d)][0]:.4f}/{r['by_dim'][str(d)][1]:.3f}" if str(d) in r["by_dim"] else "-" for d in HEAD_DIMS
        )
        lines.append(
            f"| {name} | {meta['versions'].get(name, '')} | {r['ok']} | {r['refused']} | {len(r['errors'])} | "
            f"{r['worst_cos']:.5f} | {r['worst_rel_l1']:.4f} | {r['worst_case']} | {dims} |"
        )
    for name, r in results.items():
        for e in r["errors"][:8]:
            lines.append(f"- {name} error: {e}")
        if len(r["errors"]) > 8:
            lines.append(f"- {name}: {len(r['errors']) - 8} more errors")
        for e in r["bad"][:5]:
            lines.append(f"- {name} low accuracy: {e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
