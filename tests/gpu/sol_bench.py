"""Kernel level: comfy-kitchen's Sol-Attn against SDPA and the pack's other kernels on one video self-attention call.

    python tests/gpu/sol_bench.py --md sol.md --json sol.json [--shape 1,40,32760,128] [--grid 21,30,52]

Q/K/V from ``measure.inputs.structured_qkv`` (video grid, sharpness 1.5), bf16.  Each row: the kernel called as the
pack calls it (the backend function on (B, T, H, D) views), and for Sol-Attn also straight through
``comfy_kitchen.sol_attn`` (what core's Model Sparse Attention node calls): ms (median of 5 rounds of back-to-back
calls, CUDA events), speed against SDPA from the same run, and cos / rel-L1 against dense SDPA (cuDNN/flash, as
PyTorch picks) on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pack import load  # noqa: E402

P = load()
A = P.attention
inputs = __import__("importlib").import_module(P.__name__ + ".measure.inputs")


def timed(fn):
    return A.auto.time_call(fn, torch.device("cuda"), warmup=3, reps=10, rounds=5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,40,32760,128")
    ap.add_argument("--grid", default="21,30,52")
    ap.add_argument("--md"), ap.add_argument("--json")
    a = ap.parse_args()
    b, h, n, d = (int(x) for x in a.shape.split(","))
    grid = tuple(int(x) for x in a.grid.split(","))
    q, k, v = inputs.structured_qkv(b, h, n, n, d, device="cuda", dtype=torch.bfloat16, kind="video", grid=grid,
                                      sharpness=1.5)
    qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D) views, as Wan's [B, N, H*D] calls give
    import torch.nn.functional as F

    ref = F.scaled_dot_product_attention(q, k, v)
    rows = []

    def add(label, fn, hnd_out):
        try:
            out = fn()
            ms = timed(fn)
        except Exception as e:
            rows.append({"kernel": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
            return
        o = out if hnd_out else out.transpose(1, 2)
        cos, rel = A.auto.accuracy(o, ref)
        rows.append({"kernel": label, "ms": round(ms, 3), "cos": round(cos, 6), "rel_l1": round(rel, 5)})

    add("SDPA (PyTorch's choice)", lambda: F.scaled_dot_product_attention(q, k, v), True)
    for name in ("sdpa_cudnn", "sdpa_flash"):
        fn = A.REGISTRY.get(name).fn
        add(f"{name} (ATen op)", lambda fn=fn: fn(q, k, v, layout="HND", mask=None, scale=None, opts={}), True)

    def pack(name, **opts):
        be = A.REGISTRY.get(name)
        if not be.available:
            rows.append({"kernel": name, "error": be.availability().reason})
            return
        lay = "NHD" if "NHD" in be.layouts else "HND"
        args = (qn, kn, vn) if lay == "NHD" else (q, k, v)
        label = name + (" " + " ".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
        add(f"pack {label}", lambda: be.fn(*args, layout=lay, mask=None, scale=d ** -0.5, opts=opts), lay == "HND")

    try:
        import comfy_kitchen as ck

        if hasattr(ck, "sol_attn"):
            for tau, extra in ((1.3, 256), (1.3, 0), (1.5, 0)):
                add(f"core sol_attn tau={tau} extra_tokens={extra}"
                    + (" (Model Sparse Attention's defaults)" if (tau, extra) == (1.3, 256) else ""),
                    lambda tau=tau, extra=extra: ck.sol_attn(qn, kn, vn, tau=tau, token_aug=extra), False)
        add("core comfy-kitchen int8_attention", lambda: ck.int8_attention(q, k, v), True)
    except ImportError as e:
        rows.append({"kernel": "comfy-kitchen", "error": str(e)})
    pack("kitchen_sol", tau=1.3, extra_tokens=256, min_tokens=0)
    pack("kitchen_sol", tau=1.3, extra_tokens=0, min_tokens=0)
    pack("kitchen_sol", tau=1.5, extra_tokens=0, min_tokens=0)
    pack("kitchen_sol_topk", keep_ratio=0.1, extra_tokens=256, min_tokens=0)
    pack("kitchen_int8")
    pack("sage_fp8_sm90")
    pack("sparge")
    pack("sparge_topk")
    base = rows[0].get("ms")
    for r in rows:
        if base and r.get("ms"):
            r["x_sdpa"] = round(base / r["ms"], 3)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [b, h, n, d], "grid": grid,
            "kitchen": A.REGISTRY.get("kitchen_int8").availability().version}
    lines = [f"{meta['gpu']}, torch {meta['torch']}, comfy-kitchen {meta['kitchen']}; one self-attention call "
             f"{b}x{h}x{n}x{d} bf16, structured video Q/K/V (grid {grid}, sharpness 1.5); error vs dense SDPA", "",
             "| kernel | ms | x SDPA | cos | rel-L1 |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | error: {r['error']} | | | |")
        else:
            lines.append(f"| {r['kernel']} | {r['ms']:.2f} | {r.get('x_sdpa', 0):.2f} | {r['cos']:.5f} | {r['rel_l1']:.4f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.md:
        open(a.md, "w").write(md)
    if a.json:
        json.dump({"meta": meta, "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
