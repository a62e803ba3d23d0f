"""The Ulysses exchange alone on every GPU of the machine: one self-attention call of Wan 2.1 14B (480p/81f by default)
split over the GPUs, a thread per GPU as the Context Parallel node runs them.

    python tests/gpu/cp_exchange.py [--tokens 32760] [--heads 40] [--rounds 20] [--json cp-exchange.json]

Then a GPU's own share of the heads copied within the GPU (element by element, as 8-byte words, as a 2-D copy), and
the block's matrix multiplies on the first GPU for the whole sequence and for every GPU's share, the shares a
multiple of 1 to 512 tokens: whether a share's row count costs more per token (cuBLAS picks its kernel by it).

Rows: the strided shares crossing as 2-D copies (``pitched``, the default; also with a GPU's own share copied element by
element, ``own share narrow``) and made contiguous first (``flat``), each
with the kernel (SDPA, PyTorch's choice) and with no kernel (``exchange``: the kernel's output is its ``v``: the
exchange and its layout copies alone).  Per row: milliseconds per call on the first GPU (median of ``rounds`` calls,
CUDA events, every GPU calling at once), and whether every GPU's output is bit-identical to the same attention on one
GPU over the whole sequence (SDPA computes each head alone: the split must not change a bit).  Exit status 1 when an
output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def call(G, U, group, lay, shares, local, rounds):
    """``rounds`` (+2 warm-up) exchanged calls on every GPU at once, a thread each: the last outputs by rank, the first
    GPU's milliseconds per call, the first error (None)."""
    n = group.size
    outs, errs, times = [None] * n, [None] * n, []

    def rank(r):
        try:
            with G.on_device(group.devices[r]):
                for i in range(rounds + 2):
                    if r == 0:
                        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        t0.record()
                    o = U.ulysses(group, r, lay, *shares[r], local)
                    if r == 0:
                        t1.record()
                        t1.synchronize()
                        if i >= 2:
                            times.append(t0.elapsed_time(t1))
                torch.cuda.synchronize(group.devices[r])
                outs[r] = o
        except BaseException as e:  # noqa: BLE001 - returned
            errs[r] = e
            group.abort(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, times, next((e for e in errs if e is not None), None)


def gemm_rows(G, tokens: int, n: int, dim: int, rounds: int, aligns=(1, 8, 16, 32, 64, 128, 256, 512)) -> list:
    """The block's matrix multiplies (Wan 2.1 14B: q/k/v/o ``dim x dim``, the MLP ``dim x 13824`` and back, each with a
    bias) on the first GPU for the whole sequence and for every GPU's share with shares a multiple of each of
    ``aligns`` tokens: milliseconds per block, and the slowest share against the whole per token (cuBLAS picks its
    kernel by the row count; the step waits for the slowest GPU)."""
    ffn = 13824 if dim == 5120 else 4 * dim
    shapes = [(dim, dim)] * 4 + [(dim, ffn), (ffn, dim)]
    ws = [torch.randn(o, i, device="cuda:0", dtype=torch.bfloat16) / i ** 0.5 for i, o in shapes]
    bs = [torch.randn(o, device="cuda:0", dtype=torch.bfloat16) for _, o in shapes]  # with a bias, as the model's
    xs = {i: torch.randn(1, tokens, i, device="cuda:0", dtype=torch.bfloat16) for i, _ in shapes}
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = {}

    def block_ms(m):
        if m not in ms:
            times = []
            for r in range(rounds + 2):
                t0.record()
                for (i, _), w, b in zip(shapes, ws, bs):
                    torch.nn.functional.linear(xs[i][:, :m], w, b)
                t1.record()
                t1.synchronize()
                if r >= 2:
                    times.append(t0.elapsed_time(t1))
            ms[m] = statistics.median(times)
        return ms[m]

    whole = block_ms(tokens)
    out = [{"align": "whole", "tokens": [tokens], "ms_per_block": round(whole, 3)}]
    for align in aligns:
        shares = [c for _, c in G.split(tokens, n, align)]
        slow = max(block_ms(m) for m in shares)
        out.append({"align": align, "tokens": shares, "ms_per_block": [round(block_ms(m), 3) for m in shares],
                    "slowest_vs_whole_per_token": round(slow / (whole / n), 3)})
    for row in out:
        print("cp-exchange gemm " + json.dumps(row), flush=True)
    return out


def own_share_rows(G, tokens: int, n: int, heads: int, dim: int, rounds: int) -> list:
    """A GPU's own share of the heads copied within the first GPU (``[1, tokens / n, heads, dim]`` bf16, its first
    ``heads / n`` heads, into a contiguous buffer, and an output of that shape back into those heads): PyTorch's
    ``copy_`` (element by element), as 8-byte words (the exchange's way, ``_copy_words``) and as a 2-D copy of the copy
    engine on the same device; milliseconds per copy (median) and GB/s read and written."""
    rows_n, h = tokens // n, heads // n
    big = torch.randn(1, rows_n, heads, dim, device="cuda:0", dtype=torch.bfloat16)
    share = torch.empty(1, rows_n, h, dim, device="cuda:0", dtype=torch.bfloat16)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn = G._memcpy_2d()
    stream = torch.cuda.current_stream(0)
    ways = {"copy_": lambda d, s: d.copy_(s), "words": G._copy_words,
            "memcpy2d": (lambda d, s: G._copy_2d(fn, d, s, G.pitched_plan(d, s), stream)) if fn else None}
    out = []
    for way, f in ways.items():
        if f is None:
            continue
        for direction, (dst, src) in (("out", (share, big[:, :, :h])), ("back", (big[:, :, :h], share))):
            times = []
            for r in range(rounds + 2):
                t0.record()
                f(dst, src)
                t1.record()
                t1.synchronize()
                if r >= 2:
                    times.append(t0.elapsed_time(t1))
            assert torch.equal(big[:, :, :h], share)
            ms = statistics.median(times)
            row = {"way": way, "direction": direction, "ms": round(ms, 4),
                   "gb_per_s": round(2 * share.numel() * 2 / ms / 1e6, 1)}
            out.append(row)
            print("cp-exchange own-share " + json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from pack import load

    P = load()
    import importlib

    G = importlib.import_module(P.__name__ + ".parallel.group")
    U = importlib.import_module(P.__name__ + ".parallel.ulysses")
    E = importlib.import_module(P.__name__ + ".parallel.exchange")
    n = torch.cuda.device_count()
    devs = [torch.device("cuda", i) for i in range(n)]
    g = torch.Generator(device="cuda:0").manual_seed(0)
    q, k, v = (torch.randn(1, a.tokens, a.heads, a.dim, device="cuda:0", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def kernel(qf, kf, vf):
        return sdpa(qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)).transpose(1, 2)

    def nothing(qf, kf, vf):
        return vf

    want = {"kernel": kernel(q, k, v), "exchange": v}
    lay = E.shard_layout(a.tokens, n)
    shares = [[t[:, s0:s0 + c].to(devs[r]) for t in (q, k, v)] for r, (s0, c) in enumerate(lay.shards)]
    rows, bad = [], 0
    print(f"cp-exchange: {n} GPUs ({torch.cuda.get_device_name(0)}), q/k/v [1, {a.tokens}, {a.heads}, {a.dim}] bf16, "
          f"2-D copies available: {G._memcpy_2d() is not None}", flush=True)
    for pitched, words in ((True, True), (True, False), (False, True)):
        for name, local in (("kernel", kernel), ("exchange", nothing)):
            row = {"copies": ("pitched" if pitched else "flat") + ("" if words else ", own share narrow"), "row": name}
            outs, times, err = call(G, U, G.Group(devs, pitched=pitched, words=words), lay, shares, local, a.rounds)
            if err is not None:
                row["error"] = repr(err)[:300]
                bad += 1
            else:
                full = torch.cat([o.to("cuda:0") for o in outs], 1)
                row["bit_identical_to_one_gpu"] = bool(torch.equal(full, want[name]))
                row["ms_per_call"] = round(statistics.median(times), 3)
                bad += not row["bit_identical_to_one_gpu"]
            rows.append(row)
            print("cp-exchange " + json.dumps(row), flush=True)
    one = kernel(q, k, v)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(a.rounds):
        t0.record()
        kernel(q, k, v)
        t1.record()
        t1.synchronize()
        ms.append(t0.elapsed_time(t1))
    del one
    print(f"cp-exchange one GPU, the kernel alone: {statistics.median(ms):.3f} ms", flush=True)
    own = own_share_rows(G, a.tokens, n, a.heads, a.dim, a.rounds)
    gemm = gemm_rows(G, a.tokens, n, a.heads * a.dim, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpus": [torch.cuda.get_device_name(i) for i in range(n)], "tokens": a.tokens,
                       "heads": a.heads, "one_gpu_ms": round(statistics.median(ms), 3), "rows": rows,
                       "own_share": own, "gemm": gemm}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
