"""Several GPUs of one machine: context parallelism and MultiGPU CFG Split, against the same backend on one GPU.

    python tests/gpu/multigpu.py --preset wan-1.3b --cfg 1 --steps 3 [--rounds 3] \
        --rows 1:unpatched,1:sage_fp8_sm90,cp:unpatched,cp:sage_fp8_sm90 --json mg.json --md mg.md

A row is ``<mode>:<backend>``: mode ``1`` (one GPU), ``last`` (one GPU, the machine's last: is it as fast as the
first?), ``cp`` (the Context Parallel node over every GPU), ``cfg`` (ComfyUI's
MultiGPU CFG Split), ``cp-cfg`` (Context Parallel with its cfg_split: a group of GPUs per cond), ``cp@N`` (Context Parallel with every exchanged
call's heads sent in N parts, N = 1: no overlap of exchange and kernel; plain ``cp``: the pack's rule), ``cp-flat`` (strided
shares made contiguous before they cross between GPUs instead of 2-D copies: the exchange before), ``cp-a128`` (every
GPU's share of the tokens a multiple of 128, the last one's the rest), ``cp-unstaged`` (Wan's q, k and v sent together
at the attention call, not one by one as the model makes them), ``cp-narrow`` (a GPU's own share of the heads copied
element by element, not as 8-byte words), ``cp-views`` (q, k and v of ComfyUI's skip_reshape calls, Flux's,
exchanged as ``[B, L, H, D]`` views, not heads first: the exchange before), ``cp-unplanned`` (every copy of an
exchange made by itself, not run from its plan of 2-D copies), ``cp-recv`` (an exchanged call's copies land on the
receive stream, with an event the kernel waits for, not on the compute stream: the exchange before), ``cp-simN`` (N ranks simulated on the first GPU,
sharing its model: a split's host work measured on one GPU), ``-gN`` (Context Parallel over the first N GPUs only: 2 of 4 in the run
that has 4), ``-easycacheN`` / ``-lazycacheN`` on any mode
(ComfyUI's EasyCache or LazyCache node after the multi-GPU node, threshold N/100; compared with the one-GPU row with the
same cache, its "skipped n/m steps" in the row), ``-compile`` on any mode (ComfyUI's TorchCompileModel with the node's options, inductor, applied after the
multi-GPU node as a workflow would: the node runs its split forwards uncompiled, one GPU compiles in the warm-up), ``-swN`` on any mode (Python's thread
switch interval set to N microseconds for the row instead of 5,000: how long a thread waiting for the interpreter lock
waits before it asks for it; set in the benchmark's own process, to diagnose host-bound rows); modifiers combine:
``cp-flat-a128@2``), ``-eager`` (split forwards never replayed as CUDA graphs, for the families that offer them:
Flux, Qwen-Image); backend
``unpatched``
or a Patch Attention backend (``auto``, ``auto_exact``, a kernel), applied before the multi-GPU node as a workflow would.
The model is ComfyUI's class at full size with random bf16 weights (bench_e2e's preset), one copy per GPU made from the
first (the same weights; ComfyUI's own deep clones need a loader's file, these weights never were one).
Per row: seconds per step (median between the sampler's step callbacks, after a one-step warm-up run that loads,
tunes ``auto`` and compiles what ``-compile`` compiles), the whole run per step, the ratio to the same backend on one
GPU (for a ``-compile`` row: compiled there too; and, where the table has a ``last:`` row of that backend, to the
slower of the two single GPUs: a split step goes at its pace), the final
latent's relative L1 against the same backend on one GPU and against unpatched on one GPU, peak memory per GPU, and
what Patch Attention counted (every GPU's lanes).

``--diagnose BACKEND``: why a backend's CFG Split latent differs from its one-GPU latent: one step at CFG > 1, once
with both conds in one batch on the first GPU, once split over the GPUs by CFG Split; every attention call's inputs
and output summed per batch element, and the first call whose inputs agree but whose output does not (or the first
whose inputs already differ) reported.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import re
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(1, os.path.dirname(HERE))  # tests/: comfyui_support


def load():
    sys.path.insert(0, os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", ".."))
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = True  # every row on the same resident weights
    sys.path.insert(0, ROOT)
    be = importlib.import_module("bench_e2e")
    pack = be._load_pack()
    return pack, importlib.import_module(pack.__name__ + ".measure.e2e"), \
        importlib.import_module(pack.__name__ + ".nodes.context_parallel")


def copies(e2e, job, preset):
    """The model's copy on every other GPU (same weights), registered as ComfyUI's MultiGPU clones of a clone of it."""
    import comfy.model_patcher
    import comfy.multigpu
    import comfy.supported_models as sm

    presets = importlib.import_module(e2e.__package__ + ".presets")
    cls, unet = presets.MODEL_PRESETS[preset].model_class, presets.MODEL_PRESETS[preset].unet
    base = job.model
    out = []
    for i in range(1, torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        mc = getattr(sm, cls)(presets.model_config(cls, unet))
        mc.set_inference_dtype(torch.bfloat16, None)
        model = mc.get_model({}, device=dev)
        model.diffusion_model.load_state_dict(base.model.diffusion_model.state_dict())
        p = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)
        p.clone_base_uuid = base.clone_base_uuid
        p.is_multigpu_base_clone = True
        out.append(p)
    return out


def with_copies(model, extra):
    import comfy.multigpu

    m = model.clone()
    m.set_additional_models("multigpu", list(extra))
    m.match_multigpu_clones()
    comfy.multigpu.GPUOptionsGroup().register(m)
    return m


MIN_TOKENS = [None]  # --min-tokens (None: the node's own limit)
MODIFIERS = re.compile(r"-sim\d+|-eager|-views|-unplanned|-recv|-flat|-unstaged|-narrow|-compile|-easycache\d+|-lazycache\d+|-a\d+|-sw\d+|-g\d+")  # after the mode
SAME_RUN = re.compile(r"-compile|-easycache\d+|-lazycache\d+")  # what a row's one-GPU baseline has too


def modifiers(row: str) -> list:
    """The settings a row names after its mode (``cp-flat-g2@4:sage`` -> ``-flat``, ``-g2``; the docstring)."""
    return MODIFIERS.findall(row.split(":", 1)[0].split("@")[0])


def compiled(m, node_options: bool = True):
    """A clone of ``m`` under ComfyUI's compile wrapper (inductor), with the TorchCompileModel node's guard filter
    (``node_options``) or the wrapper's defaults."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfyui_support import skip_transformer_options

    m = m.clone()
    options = {"guard_filter_fn": skip_transformer_options} if node_options else None
    set_torch_compile_wrapper(m, backend="inductor", options=options)
    return m


def row_model(pack, cpn, job, extra, row):
    m = _row_model(pack, cpn, job, extra, row)
    for mod in modifiers(row):  # after the nodes, as a workflow puts them: a step cache, TorchCompileModel
        if mod.startswith(("-easycache", "-lazycache")):
            m = step_cache(m, mod)
    return compiled(m) if "-compile" in modifiers(row) else m


class CacheSaid(logging.Handler):
    """What ComfyUI's step caches log of a run ("EasyCache - skipped 3/10 steps ..."), while in a ``with``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith(("EasyCache - skipped", "LazyCache - skipped")):
            self.lines.append(msg)

    def __enter__(self):
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self)
        root.setLevel(min(root.level, logging.INFO) if root.level else logging.INFO)
        return self

    def __exit__(self, *exc):
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self._level)


def step_cache(m, mod: str):
    """``m`` through the step cache a row's modifier names (``-easycache20``: ComfyUI's EasyCache node, threshold 0.20,
    the node's default start and end)."""
    from comfyui_support import step_cache as cache

    name = "EasyCache" if mod.startswith("-easycache") else "LazyCache"
    return cache(m, name, int(mod[len(name) + 1:]) / 100)


def _row_model(pack, cpn, job, extra, row):
    mode, backend = row.split(":", 1)
    gpus = next((int(g[2:]) for g in modifiers(row) if g.startswith("-g")), 0)
    mode = MODIFIERS.sub("", mode.split("@")[0])
    if mode == "last":  # one GPU, the machine's last (its copy of the weights): how fast that GPU is alone
        return extra[-1] if backend == "unpatched" else pack.nodes.patch.patch_model(extra[-1], backend)
    m = job.model if backend == "unpatched" else pack.nodes.patch.patch_model(job.model, backend)
    if mode == "1":
        return m
    sim = next((int(g[4:]) for g in modifiers(row) if g.startswith("-sim")), 0)
    if sim:  # ranks simulated on the first GPU, sharing its model: the host's work of a split, on one GPU
        return cpn.context_parallel(m, simulate=sim, min_tokens=MIN_TOKENS[0])
    m = with_copies(m, extra)
    if mode == "cfg":
        return m
    return cpn.context_parallel(m, gpus=gpus, cfg_split=(mode == "cp-cfg"), min_tokens=MIN_TOKENS[0])


class HostTime:
    """Where the host's time goes in replayed forwards (rows that replay CUDA graphs): per replay, its whole time, the
    time waiting at the exchanges' rendezvous and the time launching the graphs, summed over the ranks' threads."""

    def __init__(self, pack):
        self.graphs = importlib.import_module(pack.__name__ + ".parallel.graphs")
        self.group = importlib.import_module(pack.__name__ + ".parallel.group")
        self.n = 0
        self.total = self.wait = self.launch = self.cpu = 0.0
        # MG_PYPROFILE=1: the first GPU's replays under cProfile (the main thread's), the top functions in the row
        self.prof = None
        if os.environ.get("MG_PYPROFILE"):
            import cProfile

            self.prof = cProfile.Profile()

    def __enter__(self):
        import threading

        pieces, group, me = self.graphs.Pieces, self.group.Group, self
        tls = threading.local()
        self._replay, self._post = pieces.replay, group._post

        def replay(p, *a, _f=pieces.replay, **k):
            graphs = p.graphs
            launch = [0.0]

            class Timed:  # each graph's replay, timed
                def __init__(self, g):
                    self.g = g

                def replay(self):
                    t = time.perf_counter()
                    self.g.replay()
                    launch[0] += time.perf_counter() - t

            p.graphs = [Timed(g) for g in graphs]
            t0, c0 = time.perf_counter(), time.thread_time()
            tls.on = True
            main = me.prof is not None and threading.current_thread() is threading.main_thread()
            if main:
                me.prof.enable()
            try:
                return _f(p, *a, **k)
            finally:
                if main:
                    me.prof.disable()
                tls.on = False
                p.graphs = graphs
                me.total += time.perf_counter() - t0
                me.cpu += time.thread_time() - c0
                me.launch += launch[0]
                me.n += 1

        def post(g, *a, _f=group._post, **k):
            t = time.perf_counter()
            try:
                return _f(g, *a, **k)
            finally:
                if getattr(tls, "on", False):
                    me.wait += time.perf_counter() - t

        pieces.replay, group._post = replay, post
        return self

    def __exit__(self, *exc):
        self.graphs.Pieces.replay, self.group.Group._post = self._replay, self._post

    def summary(self) -> dict:
        n = max(self.n, 1)
        out = {"replays": self.n, "replay_ms": round(1e3 * self.total / n, 2), "cpu_ms": round(1e3 * self.cpu / n, 2),
               "rendezvous_ms": round(1e3 * self.wait / n, 2), "graph_launch_ms": round(1e3 * self.launch / n, 2)}
        if self.prof is not None:
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(45)
            out["pyprofile"] = text.getvalue()[-9000:]
            text = io.StringIO()
            pstats.Stats(self.prof, stream=text).sort_stats("cumulative").print_stats(60)
            out["pyprofile_cumulative"] = text.getvalue()[-12000:]
        return out


def peaks():
    return [round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in range(torch.cuda.device_count())]


def counted(pack, m):
    ov = pack.nodes.patch.override_of(m)
    if ov is None:
        hook = m.model_options.get("transformer_options", {}).get("optimized_attention_override")
        ov = getattr(hook, "inner", None)
        if type(ov).__name__ != "AttentionOverride":
            return None
    return {"merged": dict(ov.stats.calls), "lanes": [{"device": str(ln.device), "calls": dict(ln.config.stats.calls)}
                                                      for ln in ov.lanes()]}


def rel_l1(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum())


def profile_step(e2e, m, job) -> str:
    """The third step of a 4-step run under torch.profiler, both GPUs (the first forward of a run's shapes runs
    eagerly, the second is recorded, the third on replays where the row replays CUDA graphs): the top device operations
    by time (a table), then where each GPU idles (:func:`device_gaps`)."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile, schedule

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=2, warmup=0, active=1, repeat=1)) as prof:
        with torch.inference_mode():
            e2e._sample(m, dataclasses.replace(job, steps=4), 4, callback=lambda *_: prof.step())
        torch.cuda.synchronize()
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60) + "\n"
            + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60) + "\n"
            + device_gaps(prof))


def device_gaps(prof, top: int = 10) -> str:
    """Per GPU: the span of its device work in the profiled step, how long no kernel ran (copies between GPUs run on
    copy engines beside the kernels: left out), the idle time by gap length, and the longest gaps with the kernels
    around them."""
    from torch.autograd import DeviceType

    by_dev = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower() \
                and not e.name.startswith("ProfilerStep"):  # a scheduled profile's step: one span over the whole step
            by_dev.setdefault(e.device_index, []).append((e.time_range.start, e.time_range.end, e.name))
    lines = []
    for dev, evs in sorted(by_dev.items()):
        evs.sort()
        first, end, prev, gaps = evs[0][0], evs[0][0], "", []
        for s, e, name in evs:
            if s > end:
                gaps.append((s - end, end - first, prev, name))
            if e > end:
                end, prev = e, name
        idle = sum(g[0] for g in gaps)
        kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for st, e, name in evs:
            low = name.lower()
            k = "matmul" if ("nvjet" in low or "gemm" in low or "cutlass" in low) else \
                "attention" if ("attn" in low or "sage" in low or "fmha" in low or "flash" in low) else "other"
            kinds[k] += e - st
        bins = {"<10 us": 0.0, "10-100 us": 0.0, "0.1-1 ms": 0.0, ">1 ms": 0.0}
        for g, *_ in gaps:
            k = "<10 us" if g < 10 else "10-100 us" if g < 100 else "0.1-1 ms" if g < 1000 else ">1 ms"
            bins[k] += g
        lines.append(f"GPU {dev}: kernels span {(end - first) / 1e3:.1f} ms, none running {idle / 1e3:.1f} ms in "
                     f"{len(gaps)} gaps; by gap length (ms): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in bins.items())
                     + "; kernel time (ms): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in kinds.items()))
        for g, at, before, after in sorted(gaps, reverse=True)[:top]:
            lines.append(f"  {g / 1e3:.3f} ms at {at / 1e3:.1f} ms, after {before[:60]!r}, before {after[:60]!r}")
    return "\n".join(lines)


def run_rows(pack, e2e, cpn, job, extra, rows, say, profile_rows=(), rounds: int = 1):
    """Every row in turn, ``rounds`` times over (the rows interleaved: a machine's drift falls on every row alike);
    a row's s/step is the median over the rounds, its latent and profile from the first."""
    out, lat = {row: {"row": row, "cfg": job.cfg, "steps": job.steps} for row in rows}, {}
    times = {row: ([], []) for row in rows}
    uly = importlib.import_module(pack.__name__ + ".parallel.ulysses")
    grp = importlib.import_module(pack.__name__ + ".parallel.group")
    exm = importlib.import_module(pack.__name__ + ".parallel.exchange")
    rule, switch, heads_first, direct = uly.PIPELINE_PARTS, sys.getswitchinterval(), uly.HEADS_FIRST, exm.DIRECT
    exchange = {name: getattr(grp, name) for name in ("PITCHED", "ALIGN", "STAGED", "WORDS", "PLANNED")}  # put back
    for rnd, row in ((i, row) for i in range(rounds) for row in rows):
        r = out[row]
        if "error" in r:
            continue
        parts = row.split(":", 1)[0].partition("@")[2]
        uly.PIPELINE_PARTS = int(parts) if parts else rule
        mods = modifiers(row)
        grp.PITCHED = "-flat" not in mods
        grp.PLANNED = exchange["PLANNED"] and "-unplanned" not in mods
        uly.HEADS_FIRST = heads_first and "-views" not in mods
        exm.DIRECT = direct and "-recv" not in mods
        grp.STAGED = "-unstaged" not in mods
        grp.WORDS = "-narrow" not in mods
        cpn.GRAPHS = "-eager" not in mods
        grp.ALIGN = next((int(m[2:]) for m in mods if m.startswith("-a")), exchange["ALIGN"])
        sys.setswitchinterval(next((int(m[3:]) * 1e-6 for m in mods if m.startswith("-sw")), switch))
        try:
            m = row_model(pack, cpn, job, extra, row)
            t0 = time.perf_counter()
            with torch.inference_mode():  # as ComfyUI's executor samples (a run with gradients on replays no graphs)
                e2e._sample(m, job, 1)  # warm-up: loads every GPU's copy, tunes auto, loads kernels
            torch.cuda.synchronize()
            r["warmup_s"] = round(time.perf_counter() - t0, 2)
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
            with CacheSaid() as said, torch.inference_mode(), HostTime(pack) as host:
                latent, dt, whole = e2e._timed_sample(m, job)
            if host.n:
                r["host"] = host.summary()
            if said.lines:
                r["cache_said"] = said.lines[-1]
            if row in profile_rows and rnd == 0:
                r["profile"] = profile_step(e2e, m, job)
                print(f"{row}, one step profiled:\n" + r["profile"].split("\nGPU ", 1)[-1].join(["GPU ", ""]), flush=True)
            times[row][0].append(dt)
            times[row][1].append(whole)
            r.update(s_per_step=round(statistics.median(times[row][0]), 4),
                     s_per_step_whole=round(statistics.median(times[row][1]), 4))
            if rounds > 1:
                r["s_per_step_rounds"] = [round(t, 4) for t in times[row][0]]
            if rnd == 0:
                r.update(peak_gib=peaks(), finite=bool(torch.isfinite(latent).all()), counted=counted(pack, m))
                lat[row] = latent.float().cpu()
            del m
        except Exception as e:  # a row's failure is a row of the table
            import traceback

            r["error"] = f"{type(e).__name__}: {e}"[:400]
            r["trace"] = traceback.format_exc()[-3000:]
        uly.PIPELINE_PARTS, uly.HEADS_FIRST, exm.DIRECT = rule, heads_first, direct
        for name, value in exchange.items():
            setattr(grp, name, value)
        cpn.GRAPHS = True
        sys.setswitchinterval(switch)
        torch.cuda.empty_cache()
        say(json.dumps({k: v for k, v in r.items() if k not in ("trace", "counted", "profile")}))
    out = list(out.values())
    for r in out:
        if "s_per_step" not in r:
            continue
        mode, backend = r["row"].split(":", 1)
        c = "".join(SAME_RUN.findall(r["row"].split(":", 1)[0]))  # compiled against compiled, cached against cached
        one = next((x for x in out if x["row"] == f"1{c}:{backend}" and "s_per_step" in x), None)
        last = next((x for x in out if x["row"] == f"last:{backend}" and "s_per_step" in x), None)
        if one is not None and last is not None:  # a split step goes at the slower GPU's pace
            r["vs_slower_gpu"] = round(max(one["s_per_step"], last["s_per_step"]) / r["s_per_step"], 3)
        if one is not None:
            r["vs_1gpu"] = round(one["s_per_step"] / r["s_per_step"], 3)
            r["whole_vs_1gpu"] = round(one["s_per_step_whole"] / r["s_per_step_whole"], 3)
            r["rel_l1_vs_1gpu"] = rel_l1(lat[r["row"]], lat[one["row"]])
        if "1:unpatched" in lat:
            r["rel_l1_vs_unpatched_1gpu"] = rel_l1(lat[r["row"]], lat["1:unpatched"])
    return out


def diagnose(pack, e2e, job, extra, backend, say):
    """Per attention call of one CFG step: the inputs' and output's sums per cond, one GPU batched vs CFG Split."""
    import dataclasses

    base = pack.nodes.patch.patch_model(job.model, backend)
    ov = pack.nodes.patch.override_of(base)
    record, kept = [], []
    real = type(ov).__call__

    def recording(self, func, *args, **kwargs):
        a, _ = pack.nodes.hook.bind(args, kwargs)
        if keep[0]:
            kept.append((a["q"].clone(), a["k"].clone(), a["v"].clone(), a["heads"]))
        qs, ks, vs = (sums(a[n]) for n in "qkv")
        out = real(self, func, *args, **kwargs)
        record.append((str(a["q"].device), kwargs.get("transformer_options", {}).get("cond_or_uncond"),
                       [x + y for x, y in zip(qs, vs)], ks, sums(out)))
        return out

    def sums(t):
        return [float(x) for x in t.double().flatten(1).sum(1)]

    keep = [True]

    type(ov).__call__ = recording
    try:
        j = dataclasses.replace(job, steps=1)
        record.clear()
        e2e._sample(base, j, 1)
        one = list(record)
        keep[0] = False
        record.clear()
        e2e._sample(with_copies(base, extra), j, 1)
        split = list(record)
    finally:
        type(ov).__call__ = real
    # one GPU: each call holds both conds (batch order = cond_or_uncond); split: each device's calls hold one
    by_dev = {}
    for dev, cu, *sums in split:
        by_dev.setdefault(dev, []).append((cu, sums))
    report = {"backend": backend, "calls_one_gpu": len(one), "calls_split": {d: len(v) for d, v in by_dev.items()}}
    first_out = first_in = None
    for i, (_dev, cu, qs, ks, os_) in enumerate(one):
        for dv, calls in by_dev.items():
            if i >= len(calls):
                continue
            (cu2, (q2, k2, o2)) = calls[i]
            c = cu2[0]
            j = cu.index(c)
            same_in = q2[0] == qs[j] and k2[0] == ks[j]
            same_out = o2[0] == os_[j]
            if not same_in and first_in is None:
                first_in = {"call": i, "device": dv, "cond": c, "q": (qs[j], q2[0]), "k": (ks[j], k2[0])}
            if same_in and not same_out and first_out is None:
                first_out = {"call": i, "device": dv, "cond": c, "out": (os_[j], o2[0])}
    report["first_call_inputs_differ"] = first_in
    report["first_call_same_inputs_other_output"] = first_out
    if first_out is not None and backend in pack.attention.REGISTRY:
        # that call's inputs straight into the kernel through the dispatcher: both conds in one batch, and each cond
        # alone, on the first GPU and on the other: whether the kernel's result depends on the batch or the device
        q, k, v, heads = kept[first_out["call"]]
        cfg = pack.attention.AttentionConfig(backend=backend)
        att = pack.attention.attention
        both = att(q, k, v, heads, config=cfg)
        direct = {}
        for i in range(q.shape[0]):
            alone = att(q[i:i + 1], k[i:i + 1], v[i:i + 1], heads, config=cfg)
            direct[f"cond{i} alone, cuda:0 vs in the batch"] = float((alone[0] - both[i]).abs().max())
            for d in range(1, torch.cuda.device_count()):
                dev = torch.device("cuda", d)
                with torch.cuda.device(dev):
                    other = att(q[i:i + 1].to(dev), k[i:i + 1].to(dev), v[i:i + 1].to(dev), heads, config=cfg).to(q.device)
                direct[f"cond{i} alone, cuda:{d} vs cuda:0"] = float((other[0] - alone[0]).abs().max())
            again = att(q[i:i + 1], k[i:i + 1], v[i:i + 1], heads, config=cfg)
            direct[f"cond{i} alone twice, cuda:0"] = float((again[0] - alone[0]).abs().max())
        again = att(q, k, v, heads, config=cfg)
        direct["the batch twice, cuda:0"] = float((again - both).abs().max())
        report["kernel_max_abs_diff"] = direct
        report["call_shape"] = [list(q.shape), list(k.shape), heads]
    kept.clear()
    say(json.dumps(report))
    return report


def write_results(a, res: dict, md) -> None:
    """``res`` to ``--json`` and ``md()`` (the table) to ``--md``, where given."""
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md())


def render(meta, rows) -> str:
    lines = [f"{meta['gpus']} · torch {meta['torch']} · ComfyUI {meta['comfyui']} · {meta['date']} · {meta['preset']}, "
             f"CFG {meta['cfg']}, {meta['steps']} euler steps after a 1-step warm-up, random bf16 weights", "",
             "| row | s/step | whole run s/step | vs 1 GPU (same backend) | vs the slower GPU alone | latent rel-L1 vs 1 GPU | "
             "vs unpatched 1 GPU | peak GiB per GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(f"| {r['row']} | {r['s_per_step']:.4f} | {r['s_per_step_whole']:.4f} | {r.get('vs_1gpu', '-')} | "
                     f"{r.get('vs_slower_gpu', '-')} | "
                     f"{r.get('rel_l1_vs_1gpu', float('nan')):.2e} | {r.get('rel_l1_vs_unpatched_1gpu', float('nan')):.2e} | "
                     f"{' / '.join(str(p) for p in r['peak_gib'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    if os.environ.get("MG_DEBUG"):  # the pack's debug lines too (a graph's failure with its traceback)
        logging.getLogger("patch_attention").setLevel(logging.DEBUG)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument("--cfg", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default="1:unpatched,cp:unpatched")
    ap.add_argument("--diagnose", default="", help="comma-separated backends to diagnose (CFG > 1)")
    ap.add_argument("--profile", default="", help="comma-separated rows to profile one step of (in --json)")
    ap.add_argument("--rounds", type=int, default=1, help="every row this many times, interleaved; s/step: the median")
    ap.add_argument("--min-tokens", type=int, default=None,
                    help="split forwards of at least this many tokens (default: the node's MIN_SPLIT_TOKENS; 0: all)")
    ap.add_argument("--json"), ap.add_argument("--md")
    a = ap.parse_args(argv)
    MIN_TOKENS[0] = a.min_tokens
    pack, e2e, cpn = load()
    from comfyui_version import __version__ as comfy_version

    def say(s):
        print(s, flush=True)

    t0 = time.perf_counter()
    job = importlib.import_module(pack.__name__ + ".measure.presets").build_preset(a.preset)
    job.cfg, job.steps = a.cfg, a.steps
    extra = copies(e2e, job, a.preset)
    say(f"built {a.preset} on {torch.cuda.device_count()} GPUs in {time.perf_counter() - t0:.0f} s")
    meta = {"gpus": " + ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
            "torch": torch.__version__, "comfyui": comfy_version, "date": datetime.date.today().isoformat(),
            "preset": a.preset, "cfg": a.cfg, "steps": a.steps}
    res = {"meta": meta, "rows": [], "diagnose": []}

    def save():
        write_results(a, res, lambda: render(meta, res["rows"]))

    for b in [x for x in a.diagnose.split(",") if x]:
        res["diagnose"].append(diagnose(pack, e2e, job, extra, b, say))
        save()
    rows = [r for r in a.rows.split(",") if r and r != "none"]
    res["rows"] = run_rows(pack, e2e, cpn, job, extra, rows, say, [x for x in a.profile.split(",") if x], a.rounds)
    save()
    print(render(meta, res["rows"]))


if __name__ == "__main__":
    main()
