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
``procs`` (every process, each forward split). Rows run in turn, ``--rounds`` times over; a row's s/step is the median
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


class SplitInProcess:
    """APPLY_MODEL wrapper: this process's share of every forward (its rank of ``pg``), as the node's
    SplitForwardWrapper gives each GPU's thread."""

    def __init__(self, pack, unit, keys, pg, objects, device):
        self.cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
        self.dist = importlib.import_module(pack.__name__ + ".parallel.dist")
        self.unit, self.keys, self.pg, self.objects, self.device = unit, keys, pg, objects, device
        self.split = self.whole = 0

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
        cpn = self.cpn
        group = self.dist.ProcessGroupRanks(self.pg, self.device, self.objects)
        ctx = cpn.RankContext(group, group.rank, self.unit)
        ctx.last_key = self.keys[-1]
        topts = cpn.SplitForwardWrapper.rank_options(transformer_options or {}, ctx, self.keys, None)
        try:
            out = executor(x, t, c_concat, c_crossattn, control, topts, **kw)
        except cpn.StopRank:  # not split (every rank decides the same): this rank computes it whole too
            self.whole += 1
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        self.split += bool(ctx.split)
        self.whole += not ctx.split
        return out


def split_clone(pack, m, pg, objects, device):
    """A clone of ``m`` whose forwards this process runs its share of (the node's hook and per-run patches)."""
    import comfy.patcher_extension as pe

    cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
    m = m.clone()
    dm = m.model.diffusion_model
    unit = cpn.unit_for(dm)
    topts = m.model_options.setdefault("transformer_options", {})
    topts[cpn.OVERRIDE_KEY] = cpn.ContextParallelAttention(topts.get(cpn.OVERRIDE_KEY))
    wrapper = SplitInProcess(pack, unit, unit.block_keys(dm), pg, objects, device)
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


def _rank(rank, n, a, store, out_dir):
    cpu = a.cpu_check
    if not cpu:
        torch.cuda.set_device(rank)
    pack, e2e = _load(cpu)
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dist.init_process_group("gloo" if cpu else "nccl", store=dist.FileStore(store, n), rank=rank, world_size=n,
                            **({} if cpu else {"device_id": device}))
    objects = dist.new_group(backend="gloo")
    try:
        job = _job(pack, a.preset, "cpu" if cpu else "cuda")
        job.steps = a.steps
        if a.cfg is not None:
            job.cfg = a.cfg
        results = {}
        for rnd in range(a.rounds):
            for row in a.rows.split(","):
                mode, backend = row.split(":", 1)
                m = job.model if backend == "unpatched" else pack.nodes.patch.patch_model(job.model, backend)
                wrapper = None
                if mode == "procs":
                    m, wrapper = split_clone(pack, m, dist.group.WORLD, objects, device)
                runs = mode == "procs" or rank == 0
                if runs:
                    e2e._sample(m, job, 1)  # warm-up: loads, tunes auto, loads kernels
                    latent, dt, whole = e2e._timed_sample(m, job)
                    r = results.setdefault(row, {"row": row, "s_per_step_rounds": [], "whole_rounds": []})
                    r["s_per_step_rounds"].append(round(dt, 4))
                    r["whole_rounds"].append(round(whole, 4))
                    if rnd == 0 and rank == 0:
                        torch.save(latent.float().cpu(), os.path.join(out_dir, f"latent-{row.replace(':', '-')}.pt"))
                        if wrapper is not None:
                            r.update(forwards_split=wrapper.split, forwards_whole=wrapper.whole)
                        if not cpu:
                            r["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    if rank == 0:
                        print(json.dumps(r), flush=True)
                dist.barrier(group=objects)  # the next row starts together
                del m
                if not cpu:
                    torch.cuda.empty_cache()
        if rank == 0:
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(list(results.values()), f)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flux-dev")
    ap.add_argument("--rows", default="1:unpatched,procs:unpatched")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cfg", type=float, help="the guidance scale (default the preset's)")
    ap.add_argument("--gpus", type=int, default=0, help="processes (0: every GPU)")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--json"), ap.add_argument("--md")
    a = ap.parse_args()
    if a.cpu_check:
        a.preset, a.steps = "tiny-wan", min(a.steps, 3)
    n = 2 if a.cpu_check else (a.gpus or torch.cuda.device_count())
    out_dir = tempfile.mkdtemp(prefix="pa-procs-")
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.start_processes(_rank, args=(n, a, os.path.join(out_dir, "store"), out_dir), nprocs=n, start_method="spawn")
    with open(os.path.join(out_dir, "results.json")) as f:
        rows = json.load(f)
    lat = {r["row"]: torch.load(os.path.join(out_dir, f"latent-{r['row'].replace(':', '-')}.pt")) for r in rows}
    for r in rows:
        r["s_per_step"] = round(statistics.median(r["s_per_step_rounds"]), 4)
        r["s_per_step_whole"] = round(statistics.median(r["whole_rounds"]), 4)
    for r in rows:
        backend = r["row"].split(":", 1)[1]
        one = next((x for x in rows if x["row"] == f"1:{backend}"), None)
        if one is not None:
            r["vs_1gpu"] = round(one["s_per_step"] / r["s_per_step"], 3)
            r["whole_vs_1gpu"] = round(one["s_per_step_whole"] / r["s_per_step_whole"], 3)
            a_, b_ = lat[r["row"]].double(), lat[one["row"]].double()
            r["rel_l1_vs_1gpu"] = float((a_ - b_).abs().sum() / b_.abs().sum())
    meta = {"gpu": "cpu" if a.cpu_check else torch.cuda.get_device_name(0), "processes": n, "preset": a.preset,
            "steps": a.steps, "rounds": a.rounds, "cfg": a.cfg, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "seconds": round(time.perf_counter() - t0, 1)}
    md = [f"{n} processes, one per GPU ({meta['gpu']}), {a.preset}, {a.steps} steps, {a.rounds} round(s), {meta['date']}",
          "", "| row | s/step (rounds) | whole run s/step | vs 1 GPU | whole vs 1 GPU | latent rel-L1 vs 1 GPU | forwards split / whole |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['row']} | {r['s_per_step']} ({', '.join(map(str, r['s_per_step_rounds']))}) | "
                  f"{r['s_per_step_whole']} | x{r.get('vs_1gpu', '-')} | x{r.get('whole_vs_1gpu', '-')} | "
                  f"{r.get('rel_l1_vs_1gpu', float('nan')):.3g} | {r.get('forwards_split', '-')} / {r.get('forwards_whole', '-')} |")
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


if __name__ == "__main__":
    main()
