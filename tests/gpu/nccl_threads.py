"""Can the GPUs' threads of one process exchange through NCCL inside CUDA graphs, and what would it give?

The node's ranks are threads of ComfyUI's process; their exchange is a thread barrier and copies, run by Python at
every attention call, between the pieces of each forward's CUDA graphs (parallel/graphs.py).  Here each thread holds a
rank of an NCCL process group of its own (``torch.distributed.ProcessGroupNCCL`` over a store in this process), so an
exchange is an all-to-all that a CUDA graph can hold: a rank's whole forward one graph, no Python per block.

Stages of this script (each in a fresh set of threads, a timeout each):
  eager   all-to-all between the threads, values checked against what each rank sent
  graph   a piece (matmul, all-to-all, matmul) captured on every rank and replayed with new inputs, checked
  blocks  a Flux.1-dev-sized stack of transformer blocks (3072 wide, 24 heads, MLP x4, 4,608 tokens), Ulysses attention
          with the all-to-alls inside: one GPU (one graph, no exchange) against N GPUs (one graph per rank), s/forward
          and each thread's CPU time per forward; the outputs of both compared

    python tests/gpu/nccl_threads.py [--gpus N] [--blocks 57] [--tokens 4608] [--md FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time

import torch
import torch.distributed as dist


def groups(n: int):
    """One ProcessGroupNCCL per rank over a store of this process."""
    store = dist.HashStore()
    out = [None] * n

    def make(r):
        torch.cuda.set_device(r)
        opts = dist.ProcessGroupNCCL.Options()
        out[r] = dist.ProcessGroupNCCL(dist.PrefixStore("pa", store), r, n, opts)

    run_ranks(n, make)
    return out


def run_ranks(n, fn, timeout=90):
    errors, results = [None] * n, [None] * n

    def body(r):
        try:
            torch.cuda.set_device(r)
            results[r] = fn(r)
        except BaseException:  # noqa: BLE001 - reported
            import traceback
            errors[r] = traceback.format_exc()

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    end = time.monotonic() + timeout
    for t in ts:
        t.join(max(end - time.monotonic(), 0))
    if any(t.is_alive() for t in ts):
        import faulthandler
        faulthandler.dump_traceback(all_threads=True)
        done = [f"rank {r}: {errors[r] or 'finished'}" for r, t in enumerate(ts) if not t.is_alive()]
        raise TimeoutError(f"a rank did not finish (deadlock?); {'; '.join(done) or 'none finished'}")
    bad = [e for e in errors if e]
    if bad:
        raise RuntimeError(bad[0])
    return results


def a2a(pg, out, inp):
    pg.alltoall_base(out, inp, [], [], dist.AllToAllOptions()).wait()


def stage_eager(pgs, n):
    def fn(r):
        x = torch.arange(n * 4, device=f"cuda:{r}", dtype=torch.float32) + 1000 * r
        y = torch.empty_like(x)
        a2a(pgs[r], y, x)
        torch.cuda.synchronize(r)
        want = torch.cat([torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) + 1000 * p for p in range(n)])
        return bool(torch.equal(y.cpu(), want))

    return run_ranks(n, fn)


def stage_graph(pgs, n, sequential=False):
    turn = threading.Condition()
    state = {"next": 0}

    def fn(r):
        dev = f"cuda:{r}"
        g = torch.Generator(device=dev).manual_seed(1)
        w = torch.randn(256, 256, device=dev, generator=g)
        x = torch.zeros(n * 8, 256, device=dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up outside the capture
            h = x @ w
            y = torch.empty_like(h)
            a2a(pgs[r], y, h)
            out = y @ w
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        if sequential:  # rank 0 captures, then rank 1, ...
            with turn:
                turn.wait_for(lambda: state["next"] == r, timeout=60)
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                h = x @ w
                a2a(pgs[r], y, h)
                out = y @ w
        finally:
            if sequential:
                with turn:
                    state["next"] += 1
                    turn.notify_all()
        print(f"rank {r} captured", flush=True)
        ok = True
        for i in range(5):
            xi = torch.randn(n * 8, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(100 * i + r))
            x.copy_(xi)
            graph.replay()
            torch.cuda.synchronize(dev)
            # what every rank's x was: each rank's rows 8*r..8*r+8 of every rank's product go to rank r
            hs = [torch.randn(n * 8, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(100 * i + p))
                  @ w for p in range(n)]
            want = torch.cat([hp[8 * r:8 * r + 8] for hp in hs]) @ w
            ok = ok and torch.allclose(out, want, rtol=1e-4, atol=1e-3)
        return ok

    return run_ranks(n, fn)


class Block:
    """A Flux.1-dev single block's work: fused projection to q, k, v and the MLP, attention, projection back."""

    def __init__(self, dev, width=3072, heads=24, mlp=4, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.heads, self.d = heads, width // heads
        self.w1 = torch.randn(width, 3 * width + mlp * width, device=dev, generator=g, dtype=torch.bfloat16) * width ** -0.5
        self.w2 = torch.randn(width + mlp * width, width, device=dev, generator=g, dtype=torch.bfloat16) * (
            (1 + mlp) * width) ** -0.5
        self.width = width

    def __call__(self, x, n, pg=None, bufs=None):
        L, W, H, D = x.shape[0], self.width, self.heads, self.d
        h = x @ self.w1
        qkv, mlp = h[:, :3 * W], h[:, 3 * W:]
        if n == 1:
            q, k, v = qkv.view(L, 3, H, D).permute(1, 2, 0, 3).unbind(0)
            o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [H, L, D]
            o = o.permute(1, 0, 2).reshape(L, W)
        else:
            hn = H // n
            send = qkv.view(L, 3, n, hn, D).permute(2, 1, 3, 0, 4).contiguous()  # [n, 3, hn, L, D]
            recv = torch.empty_like(send)
            a2a(pg, recv, send)
            q, k, v = recv.permute(1, 2, 0, 3, 4).reshape(3, hn, n * L, D).unbind(0)
            o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [hn, nL, D]
            back = o.view(hn, n, L, D).permute(1, 0, 2, 3).contiguous()  # [n, hn, L, D]
            got = torch.empty_like(back)
            a2a(pg, got, back)
            o = got.permute(2, 0, 1, 3).reshape(L, W)  # [L, n*hn*D]
        return x + torch.cat([o, torch.nn.functional.gelu(mlp, approximate="tanh")], 1) @ self.w2


def stage_blocks(pgs, n, blocks, tokens, reps=20):
    """One GPU's forward against N ranks' (threads, one graph each): s/forward and each thread's CPU time."""

    def forward_fn(r, size, pg):
        dev = f"cuda:{r}"
        stack = [Block(dev, seed=i) for i in range(blocks)]
        L = tokens // size
        x_all = torch.randn(tokens, 3072, device=dev, dtype=torch.bfloat16,
                            generator=torch.Generator(device=dev).manual_seed(7))
        x = x_all[r * L:(r + 1) * L].clone() if size > 1 else x_all.clone()

        def fwd(x):
            for b in stack:
                x = b(x, size, pg)
            return x

        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                eager = fwd(x)
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fwd(x)
        torch.cuda.synchronize(dev)
        graph.replay()
        torch.cuda.synchronize(dev)
        same = float((out.float() - eager.float()).abs().max())
        return graph, out, same, x

    results = {}
    for size in (1, n):
        if size == 1:
            def one(r):
                torch.cuda.set_device(0)
                return forward_fn(0, 1, None)
            graph, out, same, _ = one(0)
            torch.cuda.synchronize(0)
            t0 = time.perf_counter()
            c0 = time.thread_time()
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize(0)
            results[1] = dict(s=(time.perf_counter() - t0) / reps, cpu_ms=(time.thread_time() - c0) / reps * 1e3,
                              graph_vs_eager=same)
            whole = out.float().cpu()
            del graph, out
        else:
            made = run_ranks(n, lambda r: forward_fn(r, n, pgs[r]))
            bar = threading.Barrier(n)
            times = [None] * n

            def rep(r, made=made, bar=bar, times=times):
                graph = made[r][0]
                torch.cuda.synchronize(r)
                bar.wait()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(reps):
                    graph.replay()
                torch.cuda.synchronize(r)
                times[r] = ((time.perf_counter() - t0) / reps, (time.thread_time() - c0) / reps * 1e3)

            run_ranks(n, rep)
            split_out = torch.cat([m[1].float().cpu() for m in made])
            results[n] = dict(s=max(t[0] for t in times), cpu_ms=[round(t[1], 3) for t in times],
                              graph_vs_eager=[m[2] for m in made],
                              vs_one_gpu_max_abs=float((split_out - whole).abs().max()),
                              vs_one_gpu_rel_l1=float((split_out - whole).abs().sum() / whole.abs().sum()))
    results["ratio"] = results[1]["s"] / results[n]["s"]
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--blocks", type=int, default=57)
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--stages", default="eager,graph,blocks", help="eager, graph, graph-seq, blocks")
    ap.add_argument("--md")
    ap.add_argument("--json")
    ap.add_argument("--hang", type=float, default=0, help="seconds after which every thread's stack is dumped and "
                    "the process exits (a rank stuck in a call that holds the interpreter lock)")
    a = ap.parse_args()
    n = a.gpus
    if a.hang:
        import faulthandler
        faulthandler.dump_traceback_later(a.hang, exit=True)
    out = {"gpus": n, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "date": datetime.date.today().isoformat(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    t0 = time.perf_counter()
    try:
        pgs = groups(n)
        out["groups"] = "made"
        stages = a.stages.split(",")
        out["eager"] = stage_eager(pgs, n)
        print("eager", out["eager"], flush=True)
        for name in ("graph", "graph-seq"):
            if name in stages:
                out[name] = stage_graph(pgs, n, sequential=name == "graph-seq")
                print(name, out[name], flush=True)
        for tokens in sorted({a.tokens, 4096 * 2 + 512}) if "blocks" in stages else ():
            out[f"blocks_{tokens}"] = stage_blocks(pgs, n, a.blocks, tokens)
            print(f"blocks {tokens}", json.dumps(out[f"blocks_{tokens}"]), flush=True)
    except BaseException as e:  # noqa: BLE001 - the result says where it stopped
        out["error"] = f"{type(e).__name__}: {e}"
        print("ERROR", out["error"], flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        open(a.json, "w").write(text)
    if a.md:
        open(a.md, "w").write("```\n" + text + "\n```\n")
    sys.stdout.flush()
    import os
    os._exit(0)  # the process groups' threads are not shut down one by one


if __name__ == "__main__":
    main()
