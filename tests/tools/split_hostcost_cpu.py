"""Host time of one Flux forward split over 2 ranks, on the CPU: unsplit, ranks in threads (the node), ranks in processes
(torch.distributed, gloo), and where each split forward's host time goes (cProfile).

    COMFYUI_PATH=.../ComfyUI PYTHONPATH=<ComfyUI's site-packages> \
        python tests/tools/split_hostcost_cpu.py [--rounds 20] [--per 5] [--profile 5] [--wall] [--side 8] [--text 8]

The model is ComfyUI's Flux class (``comfy.supported_models.Flux``, measure/presets.py's FLUX_DEV through
``build_preset``: random fp32 weights) at Flux.1-dev's depth and heads (19 double and 38 single blocks, 24 heads: 57
attention calls a forward, each exchanged when split), shrunk until arithmetic is a small part of a forward: head dim 6
(RoPE axes 2, 2, 2), MLP ratio 1, a 1x16x8x8 latent (16 image tokens) and 8 text tokens, one torch thread per process.
ComfyUI's attention is ``attention_pytorch`` (its GPU default).  A forward is ``BaseModel.apply_model`` under
``torch.inference_mode`` with the transformer_options the sampler's ``_calc_cond_batch`` passes.  Rows:

- ``1 rank``: the model unsplit, nothing on the hook;
- ``threads``: the Context Parallel node's clone (``context_parallel(simulate=2, min_tokens=0)``) inside its
  SAMPLER_SAMPLE ``RunWrapper``: SplitForwardWrapper, a worker thread for rank 1, Group, RankContext, BlockPatch;
- ``procs``: tests/gpu/multigpu_procs.py's ``split_clone`` in each of two spawned processes (ProcessGroupRanks over
  gloo); rank 0 timed while rank 1 runs the same forwards.

Both processes run throughout, the rows interleaved round by round (rank 1 waits at a gloo barrier while rank 0 runs
the first two).  Per row, median (min) over rounds of ms per forward: wall; rank 0's thread CPU (its host work: Python,
dispatch, syscalls; not its waits); the process's CPU (threads: both ranks; procs: rank 0 and gloo's threads); and the
split rows' extra over ``1 rank`` per exchanged call.  Procs' wall here is gloo's TCP round trips on 2 cores (NCCL's
host side does not wait for the transfer): read its CPU columns.  Then ``--profile`` forwards of each split row under
cProfile on rank 0's thread CPU clock (``--wall``: the wall clock, so a thread rank's waits for the interpreter lock and
the barrier show), the top functions by own time, each marked pack (parallel/, nodes/, the harness's SplitInProcess),
comfy, torch, torch.dist or python, and the pack's functions per exchanged call.  A CPU op here (5-60 µs)
costs more than a CUDA launch; the pack's own Python costs what it costs anywhere.  Needs 2 cores.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import statistics
import sys
import tempfile
import time
import types
import uuid

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
import multigpu_procs as mgp  # noqa: E402 - the process design's harness: split_clone, SplitInProcess

HEADS = 24  # Flux.1's


def build(pack, a):
    """(ComfyUI's patcher of the tiny Flux, its apply_model inputs): the same weights in every process (one seed)."""
    presets = importlib.import_module(pack.__name__ + ".measure.presets")
    unet = {**presets.FLUX_DEV, "hidden_size": HEADS * a.head_dim, "num_heads": HEADS, "mlp_ratio": a.mlp_ratio,
            "axes_dim": [2, 2, a.head_dim - 4], "context_in_dim": 64, "vec_in_dim": 32}  # RoPE's 3 axes: even, >= 2
    latent = (1, 16, a.side, a.side)
    presets.MODEL_PRESETS["tiny-flux"] = presets.ModelPreset("Flux", unet, latent, (1, a.text, 64), 32, 1.0, "tiny Flux")
    job = presets.build_preset("tiny-flux", device="cpu", dtype=torch.float32)
    context, extra = job.positive[0]
    g = torch.Generator().manual_seed(7)
    inputs = dict(x=torch.randn(latent, generator=g), t=torch.tensor([0.7]), c_crossattn=context,
                  y=extra["pooled_output"], guidance=torch.tensor([3.5]))
    return job.model, inputs


def forward(patcher, inputs):
    """One sampler forward of ``patcher``'s model, as ``_calc_cond_batch`` makes it."""
    import comfy.patcher_extension as pe

    model, ident = patcher.model, uuid.uuid4()
    i = dict(inputs)
    x, t = i.pop("x"), i.pop("t")

    def run():
        topts = pe.merge_nested_dicts({}, patcher.model_options.get("transformer_options", {}), copy_dict1=False)
        topts.update(cond_or_uncond=[0], uuids=[ident], sigmas=t)
        return model.apply_model(x, t, control=None, transformer_options=topts, **i)

    return run


def timed(fn, per):
    """(wall, this thread's CPU, the process's CPU) ms per forward over ``per`` forwards."""
    w0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    for _ in range(per):
        fn()
    w, c, p = time.perf_counter_ns() - w0, time.thread_time_ns() - c0, time.process_time_ns() - p0
    return w / per / 1e6, c / per / 1e6, p / per / 1e6


def origin(filename: str, name: str) -> str:
    f = os.path.abspath(filename) if filename not in ("~", "") else ""
    if f.startswith(os.path.join(ROOT, "parallel")) or f.startswith(os.path.join(ROOT, "nodes")) or f == mgp.__file__:
        return "pack"
    if f.startswith(os.path.abspath(os.environ.get("COMFYUI_PATH", "//"))):
        return "comfy"
    if f"{os.sep}distributed{os.sep}" in f or "c10d" in name:
        return "torch.dist"
    if f"{os.sep}torch{os.sep}" in f or (not f and "torch" in name):
        return "torch"
    return "python"


def label(filename: str, line: int, name: str) -> str:
    if filename in ("~", ""):
        return name
    f = os.path.abspath(filename)
    for base in (ROOT, os.environ.get("COMFYUI_PATH", "//")):
        if f.startswith(os.path.abspath(base) + os.sep):
            return f"{os.path.relpath(f, base)}:{line} {name}"
    parts = f.split(os.sep)
    key = "torch" if "torch" in parts else parts[-2]
    return f"{os.sep.join(parts[parts.index(key):]) if key in parts else parts[-1]}:{line} {name}"


def profiled(fn, n, wall=False):
    """cProfile's table of ``n`` forwards of ``fn`` on this thread's CPU clock (``wall``: the wall clock, waits
    included): {(file, line, name): (calls, own s, cumulative s)}."""
    prof = cProfile.Profile(time.perf_counter if wall else time.thread_time)
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    prof.create_stats()
    return {k: (nc, tt, ct) for k, (_, nc, tt, ct, _) in prof.stats.items()}


def report(name, stats, n, top):
    """The top functions by own time of one design's profile, per forward; the pack's by cumulative time per
    exchanged call; returns the exchanged calls per forward."""
    calls = next((nc for (f, _, fn), (nc, *_) in stats.items()
                  if fn == "attention" and f.endswith(os.path.join("parallel", "context.py"))), 0) / n
    total = sum(tt for _, tt, _ in stats.values()) / n * 1e3
    by = {}
    for (f, _, fn), (_, tt, _) in stats.items():
        by[origin(f, fn)] = by.get(origin(f, fn), 0) + tt / n * 1e3
    print(f"\n### {name}: {n} forwards under cProfile, rank 0; {calls:.0f} exchanged calls a forward, "
          f"{total:.1f} ms own time a forward: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda x: -x[1])))
    print("\n| function | origin | calls/fwd | own ms/fwd | cum ms/fwd |\n|---|---|---|---|---|")
    for (f, line, fn), (nc, tt, ct) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{label(f, line, fn)}` | {origin(f, fn)} | {nc / n:.0f} | {tt / n * 1e3:.2f} | {ct / n * 1e3:.2f} |")
    print(f"\nthe pack's functions by cumulative time, µs per exchanged call ({calls:.0f} a forward):\n\n"
          "| function | calls/fwd | own µs/call | cum µs/call |\n|---|---|---|---|")
    pack = [(k, v) for k, v in stats.items() if origin(k[0], k[2]) == "pack"]
    for (f, line, fn), (nc, tt, ct) in sorted(pack, key=lambda kv: -kv[1][2])[:top]:
        print(f"| `{label(f, line, fn)}` | {nc / n:.0f} | {tt / n / calls * 1e6:.1f} | {ct / n / calls * 1e6:.1f} |")
    return calls


def _rank(rank, n, a, store):
    torch.set_num_threads(1)
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    from comfy.cli_args import args

    args.use_pytorch_cross_attention = True  # ComfyUI's attention on a GPU (attention_split is its CPU default)
    pack, _ = mgp._load(cpu=True)
    cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on this machine (as tests/test_cp_processes.py)
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n)
    objects = dist.new_group(backend="gloo")
    try:
        with torch.inference_mode():
            patcher, inputs = build(pack, a)
            procs, _ = mgp.split_clone(pack, patcher, dist.group.WORLD, objects, torch.device("cpu"))
            rows = {"procs": forward(procs, inputs)}
            if rank == 0:
                threads = cpn.context_parallel(patcher, simulate=2, min_tokens=0)
                rows = {"1 rank": forward(patcher, inputs), "threads": forward(threads, inputs), **rows}
                cp = threads.model_options["transformer_options"]["wrappers"]["apply_model"][cpn.WRAPPER_KEY][0].cp
                guider = types.SimpleNamespace(model_patcher=patcher, cfg=1.0)
                # the node's sampling run (its RunWrapper: rank 1's worker thread) open while rank 0 measures
                return cpn.RunWrapper(cp)(lambda *_: _measure(rows, a, objects), guider, None,
                                          {"model_options": threads.model_options})
            return _measure(rows, a, objects)
    finally:
        dist.destroy_process_group()


def _measure(rows, a, objects):
    rank = dist.get_rank()
    for fn in rows.values():
        if fn is not rows["procs"]:
            fn()  # warm-up: lazy ComfyUI state, the plan caches
    dist.barrier(group=objects)
    rows["procs"]()
    times = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            if name == "procs":
                dist.barrier(group=objects)  # rank 1 waits here while rank 0 runs the other rows
            times[name].append(timed(fn, a.per))
    dist.barrier(group=objects)
    stats = {"threads": profiled(rows["threads"], a.profile, a.wall)} if rank == 0 else {}
    dist.barrier(group=objects)
    stats["procs"] = profiled(rows["procs"], a.profile, a.wall)
    if rank == 0:
        calls = {name: report(name, s, a.profile, a.top) for name, s in stats.items()}
        _table(times, calls, a)


def _table(times, calls, a):
    med = {name: [statistics.median(c) for c in zip(*ts)] for name, ts in times.items()}
    low = {name: [min(c) for c in zip(*ts)] for name, ts in times.items()}
    print(f"\n## Host ms per forward: tiny Flux (19+38 blocks, {HEADS} heads of {a.head_dim}, MLP x{a.mlp_ratio}, "
          f"{(a.side // 2) ** 2} image + {a.text} text tokens), 2 ranks, {a.rounds} rounds of {a.per} forwards, "
          f"torch {torch.__version__}, CPU\n")
    print("| row | wall ms | rank-0 CPU ms | process CPU ms | exchanged calls | wall extra µs/call | "
          "rank-0 CPU extra µs/call |\n|---|---|---|---|---|---|---|")
    for name in times:
        m, lo, n = med[name], low[name], calls.get(name, 0)
        extra = [f"{(m[i] - med['1 rank'][i]) / n * 1e3:.0f} ({(lo[i] - low['1 rank'][i]) / n * 1e3:.0f})" if n else "-"
                 for i in (0, 1)]
        print(f"| {name} | {m[0]:.2f} ({lo[0]:.2f}) | {m[1]:.2f} ({lo[1]:.2f}) | {m[2]:.2f} ({lo[2]:.2f}) | "
              f"{n:.0f} | {extra[0]} | {extra[1]} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per", type=int, default=5, help="forwards per row and round")
    ap.add_argument("--profile", type=int, default=5, help="forwards under cProfile per split row")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--wall", action="store_true", help="profile on the wall clock (default: rank 0's thread CPU)")
    ap.add_argument("--side", type=int, default=8, help="the latent's side (patches of 2x2: side**2/4 image tokens)")
    ap.add_argument("--text", type=int, default=8, help="text tokens")
    ap.add_argument("--head-dim", type=int, default=6, help="even, 6 or more (RoPE's axes 2, 2, head_dim - 4)")
    ap.add_argument("--mlp-ratio", type=float, default=1.0, help="Flux's is 4 (more arithmetic, the same ops)")
    a = ap.parse_args()
    if not os.environ.get("COMFYUI_PATH"):
        raise SystemExit("set COMFYUI_PATH (and PYTHONPATH to ComfyUI's site-packages)")
    import torch.multiprocessing as mp

    store = os.path.join(tempfile.mkdtemp(prefix="pa-split-hostcost-"), "store")
    mp.start_processes(_rank, args=(2, a, store), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
