"""Context Parallel with one process per GPU (parallel/dist.py) against one GPU: is the interpreter lock what keeps
short sequences from splitting?

    python tests/gpu/multigpu_procs.py --preset flux-dev --steps 4 --rounds 2 \
        --rows 1:unpatched,procs:unpatched,1:sage_fp8_sm90,procs:sage_fp8_sm90 --json p.json --md p.md

Every GPU gets a process of its own (``torch.multiprocessing``, spawned), its own ComfyUI and its own copy of the model
(bench_e2e's preset: ComfyUI's class at full size, random bf16 weights from one seed, so every copy is the same), and
runs the whole sampling loop, as xDiT's and ParaAttention's ranks do: each forward is split by the pack's family unit
and attention exchange (the Context Parallel node's, with every forward split whatever its length), the ranks
exchanging over NCCL (:class:`ProcessGroupRanks`), so no GPU's host work waits for another's under one interpreter lock.
A row is ``<mode>:<backend>``: ``1`` (the first process samples alone, the same model and loop: the baseline),
``procs`` (every process, each forward split); modifiers: ``-a2a`` (the ranks' transfers as one ``all_to_all_single``
each instead of a batch of point-to-point operations), ``-g`` (each diffusion-model forward replayed from a CUDA graph,
:class:`GraphedForward`: captured on its third forward of one input shape, the exchange's NCCL transfers inside it;
every later forward copies its inputs in and replays it, with none of the model's Python), e.g. ``procs-a2a-g``. Rows run in turn, ``--rounds`` times over; a row's s/step is the median
of its rounds' medians between the sampler's step callbacks (after a one-step warm-up run), its whole run from the
sampler's start; its final latent is compared with the same backend's ``1`` row (relative L1; 0: bit-identical).

The thread design the node runs today is measured by tests/gpu/multigpu.py (``cp`` rows, ``--min-tokens 0``) in the
same call (GPU stage ``multigpu-procs``).

``--cpu-check``: the same on the CPU (gloo) with a tiny Wan model, 2 processes: the harness's own check.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINY_WAN = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
            "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "out_dim": 16, "dim": 64,
            "ffn_dim": 128, "num_heads": 4, "num_layers": 2, "text_dim": 4096}


def _load(cpu: bool = False):
    sys.path.insert(0, os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", ".."))
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = True
    comfy_args.cpu = cpu
    sys.path.insert(0, ROOT)
    be = importlib.import_module("bench_e2e")
    pack = be._load_pack()
    return pack, importlib.import_module(pack.__name__ + ".measure.e2e")


def _job(pack, preset: str, device: str):
    presets = importlib.import_module(pack.__name__ + ".measure.presets")
    if preset == "tiny-wan":
        presets.MODEL_PRESETS[preset] = presets.ModelPreset("WAN21_T2V", TINY_WAN, (1, 16, 3, 8, 8), (1, 16, 4096),
                                                            None, 1.0, "a tiny Wan 2.1 (harness check)")
    return presets.build_preset(preset, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)


class GraphedForward:
    """DIFFUSION_MODEL wrapper: a forward's tensors copied into the inputs of a CUDA graph captured for their shapes
    and the graph replayed (its output cloned), after ``warmup`` eager forwards of those shapes (they load kernels, plan
    cuDNN, tune, and open NCCL's connections, none of which a capture allows).  A forward with an argument other than
    a tensor, None or a plain value (ControlNet's dict, reference latents' list) runs eagerly.  Host decisions taken
    inside the forward (the split, the attention kernel) are those of the captured forward; whatever reads
    ``transformer_options`` per step (a step cache, the NaN net's per-call flags) sees the capture's: a benchmark's
    wrapper, not the node's."""

    def __init__(self, warmup: int = 2):
        self.warmup, self.graphs, self.seen, self.signatures = warmup, {}, {}, {}
        self.captured = self.replayed = self.eager = 0
        self.pool = None

    def _items(self, executor, args, kwargs) -> list:
        """(name, value) of every argument of the forward but ``transformer_options`` (positional in ComfyUI's calls),
        in the order of the forward's signature, ``**kwargs`` sorted by name."""
        fn = executor.original
        sig = self.signatures.get(fn.__func__)
        if sig is None:
            sig = self.signatures[fn.__func__] = inspect.signature(fn)
        out = []
        for name, v in sig.bind(*args, **kwargs).arguments.items():
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                out += sorted(v.items())
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                out += [(f"{name}{i}", x) for i, x in enumerate(v)]
            elif name != "transformer_options":
                out.append((name, v))
        return out

    def _key(self, executor, args, kwargs):
        key = []
        for name, v in self._items(executor, args, kwargs):
            if isinstance(v, torch.Tensor):
                key.append((name, tuple(v.shape), v.dtype, v.device))
            elif v is None or isinstance(v, (bool, int, float, str)):
                key.append((name, v))
            else:
                return None
        return tuple(key)

    def _tensors(self, executor, args, kwargs) -> list:
        return [v for _, v in self._items(executor, args, kwargs) if isinstance(v, torch.Tensor)]

    def __call__(self, executor, *args, **kwargs):
        key = self._key(executor, args, kwargs)
        if key is None or self.seen.get(key, 0) < self.warmup:
            if key is not None:
                self.seen[key] = self.seen.get(key, 0) + 1
            self.eager += 1
            return executor(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(executor, args, kwargs)
            self.captured += 1
        graph, static, out = entry
        for dst, src in zip(static, self._tensors(executor, args, kwargs)):
            dst.copy_(src)
        graph.replay()
        self.replayed += 1
        return out.clone()

    def _capture(self, executor, args, kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        static = self._tensors(executor, args, kwargs)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # thread_local: ProcessGroupNCCL's watchdog thread queries events while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = executor(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a graphed forward returned {type(out).__name__}, not a tensor")
        self.pool = graph.pool()
        return graph, static, out


class SplitInProcess:
    """APPLY_MODEL wrapper: this process's share of every forward (its rank of ``pg``), as the node's
    SplitForwardWrapper gives each GPU's thread."""

    def __init__(self, pack, unit, keys, pg, objects, device, collective=False):
        self.cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
        self.dist = importlib.import_module(pack.__name__ + ".parallel.dist")
        self.unit, self.keys, self.pg, self.objects, self.device = unit, keys, pg, objects, device
        self.collective = collective
        self.split = self.whole = 0

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
        cpn = self.cpn
        group = self.dist.ProcessGroupRanks(self.pg, self.device, self.objects, collective=self.collective)
        ctx = cpn.RankContext(group, group.rank, self.unit)
        ctx.last_key = self.keys[-1]
        topts = cpn.SplitForwardWrapper.rank_options(transformer_options or {}, ctx, self.keys, None)
        try:
            out = executor(x, t, c_concat, c_crossattn, control, topts, **kw)
        except cpn.StopRank:  # not split (every rank decides the same): this rank computes it whole too
            self.whole += 1
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        self.split += bool(ctx.split)
        self.whole += ctx.split is not None and not ctx.split  # None: no block ran (a graph replayed)
        return out


def split_clone(pack, m, pg, objects, device, collective=False):
    """A clone of ``m`` whose forwards this process runs its share of (the node's hook and per-run patches)."""
    import comfy.patcher_extension as pe

    cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
    m = m.clone()
    dm = m.model.diffusion_model
    unit = cpn.unit_for(dm)
    topts = m.model_options.setdefault("transformer_options", {})
    topts[cpn.OVERRIDE_KEY] = cpn.ContextParallelAttention(topts.get(cpn.OVERRIDE_KEY))
    wrapper = SplitInProcess(pack, unit, unit.block_keys(dm), pg, objects, device, collective)
    wrappers = topts.setdefault("wrappers", {})
    wrappers[pe.WrappersMP.APPLY_MODEL] = {"patch_attention_procs": [wrapper], **wrappers.get(pe.WrappersMP.APPLY_MODEL, {})}

    def per_run(executor, *args, **kwargs):
        undo = unit.patch_run(dm)
        try:
            return executor(*args, **kwargs)
        finally:
            undo()

    m.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, "patch_attention_procs", per_run)
    return m, wrapper


def capturable_wan() -> None:
    """ComfyUI's Wan makes its timestep embedding's frequencies on the CPU in every forward (``torch.arange(half)``,
    then copied to the GPU: a copy a capture refuses); here the same integers are made on the GPU (the same numbers)."""
    import comfy.ldm.wan.model as wan

    def sinusoidal_embedding_1d(dim, position):
        assert dim % 2 == 0
        half = dim // 2
        position = position.type(torch.float32)
        sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half, device=position.device).to(position).div(half)))
        return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)

    wan.sinusoidal_embedding_1d = sinusoidal_embedding_1d


def graphed(m):
    """A clone of ``m`` whose diffusion-model forwards replay CUDA graphs (:class:`GraphedForward`)."""
    import comfy.patcher_extension as pe

    m = m.clone()
    g = GraphedForward()
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "patch_attention_graphs", g)
    return m, g


def _rank(rank, n, a, store, out_dir):
    cpu = a.cpu_check
    if not cpu:
        torch.cuda.set_device(rank)
    pack, e2e = _load(cpu)
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dist.init_process_group("gloo" if cpu else "nccl", store=dist.FileStore(store, n), rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=a.timeout), **({} if cpu else {"device_id": device}))
    objects = dist.new_group(backend="gloo")
    if any("-g" in row.split(":")[0] for row in a.rows.split(",")):
        capturable_wan()  # every row of this process: eager and graphed rows run the same code
    try:
        job = _job(pack, a.preset, "cpu" if cpu else "cuda")
        job.steps = a.steps
        if a.cfg is not None:
            job.cfg = a.cfg
        results = {}
        for rnd in range(a.rounds):
            for row in a.rows.split(","):
                mode, backend = row.split(":", 1)
                mode, *mods = mode.split("-")
                graphs = "g" in mods
                m = job.model if backend == "unpatched" else pack.nodes.patch.patch_model(job.model, backend)
                wrapper = graph = None
                if mode == "procs":
                    m, wrapper = split_clone(pack, m, dist.group.WORLD, objects, device, collective="a2a" in mods)
                if graphs:
                    m, graph = graphed(m)
                runs = mode == "procs" or rank == 0
                if runs:
                    # warm-up: loads, tunes auto, loads kernels; a graph row's third forward is captured
                    e2e._sample(m, job, 3 if graphs else 1)
                    latent, dt, whole = e2e._timed_sample(m, job)
                    r = results.setdefault(row, {"row": row, "s_per_step_rounds": [], "whole_rounds": []})
                    r["s_per_step_rounds"].append(round(dt, 4))
                    r["whole_rounds"].append(round(whole, 4))
                    if rnd == 0 and rank == 0:
                        torch.save(latent.float().cpu(), os.path.join(out_dir, f"latent-{row.replace(':', '-')}.pt"))
                        if wrapper is not None:
                            r.update(forwards_split=wrapper.split, forwards_whole=wrapper.whole)
                        if graph is not None:
                            r.update(graphs_captured=graph.captured, forwards_replayed=graph.replayed,
                                     forwards_eager=graph.eager)
                        if not cpu:
                            r["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    if rank == 0:
                        print(json.dumps(r), flush=True)
                        with open(os.path.join(out_dir, "results.json"), "w") as f:  # as it goes: a failed row keeps the rest
                            json.dump(list(results.values()), f)
                dist.barrier(group=objects)  # the next row starts together
                del m, graph
                if not cpu:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def compare(rows, lat) -> None:
    """Each row against the same backend's ``1`` row (one GPU, eager) and a graph row against its ``1-g`` row too."""
    by = {r["row"]: r for r in rows}
    for r in rows:
        mode, backend = r["row"].split(":", 1)
        for base, key in (("1", "vs_1gpu"), ("1-g", "vs_1gpu_graphs")):
            one = by.get(f"{base}:{backend}")
            if one is None or (key == "vs_1gpu_graphs" and not mode.endswith("-g")):
                continue
            r[key] = round(one["s_per_step"] / r["s_per_step"], 3)
            r["whole_" + key] = round(one["s_per_step_whole"] / r["s_per_step_whole"], 3)
            if base == "1":
                a_, b_ = lat[r["row"]].double(), lat[one["row"]].double()
                r["rel_l1_vs_1gpu"] = float((a_ - b_).abs().sum() / b_.abs().sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flux-dev")
    ap.add_argument("--rows", default="1:unpatched,procs:unpatched")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cfg", type=float, help="the guidance scale (default the preset's)")
    ap.add_argument("--gpus", type=int, default=0, help="processes (0: every GPU)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a rank waits for another before it fails")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--json"), ap.add_argument("--md")
    a = ap.parse_args()
    if a.cpu_check:
        a.preset, a.steps = "tiny-wan", min(a.steps, 3)
    n = 2 if a.cpu_check else (a.gpus or torch.cuda.device_count())
    out_dir = tempfile.mkdtemp(prefix="pa-procs-")
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    try:
        mp.start_processes(_rank, args=(n, a, os.path.join(out_dir, "store"), out_dir), nprocs=n, start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # the rows before it still count
        print(f"a rank failed: {e}", flush=True)
        failed = True
    else:
        failed = False
    if not os.path.exists(os.path.join(out_dir, "results.json")):
        sys.exit("no row finished")
    with open(os.path.join(out_dir, "results.json")) as f:
        rows = json.load(f)
    lat = {r["row"]: torch.load(os.path.join(out_dir, f"latent-{r['row'].replace(':', '-')}.pt")) for r in rows}
    for r in rows:
        r["s_per_step"] = round(statistics.median(r["s_per_step_rounds"]), 4)
        r["s_per_step_whole"] = round(statistics.median(r["whole_rounds"]), 4)
    compare(rows, lat)
    meta = {"gpu": "cpu" if a.cpu_check else torch.cuda.get_device_name(0), "processes": n, "preset": a.preset,
            "steps": a.steps, "rounds": a.rounds, "cfg": a.cfg, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "seconds": round(time.perf_counter() - t0, 1)}
    md = [f"{n} processes, one per GPU ({meta['gpu']}), {a.preset}, {a.steps} steps, {a.rounds} round(s), {meta['date']}",
          "", "| row | s/step (rounds) | whole run s/step | vs 1 GPU | whole vs 1 GPU | vs 1 GPU with graphs (whole) "
          "| latent rel-L1 vs 1 GPU | forwards split / whole | graph forwards replayed / eager |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['row']} | {r['s_per_step']} ({', '.join(map(str, r['s_per_step_rounds']))}) | "
                  f"{r['s_per_step_whole']} | x{r.get('vs_1gpu', '-')} | x{r.get('whole_vs_1gpu', '-')} | "
                  f"x{r.get('vs_1gpu_graphs', '-')} (x{r.get('whole_vs_1gpu_graphs', '-')}) | "
                  f"{r.get('rel_l1_vs_1gpu', float('nan')):.3g} | {r.get('forwards_split', '-')} / {r.get('forwards_whole', '-')} | "
                  f"{r.get('forwards_replayed', '-')} / {r.get('forwards_eager', '-')} |")
    print("\n".join(md))
    if a.md:
        with open(a.md, "w") as f:
            f.write("\n".join(md) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if a.cpu_check:
        split = next(r for r in rows if r["row"].startswith("procs"))
        assert split["forwards_split"] > 0 and split["forwards_whole"] == 0, split
        assert split["rel_l1_vs_1gpu"] < 1e-5, split
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
