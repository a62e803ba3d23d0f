"""Whole prompts through ComfyUI's server, one GPU against several: seconds per prompt, from POST /prompt to its
entry in /history, for what a user runs.

    python tests/gpu/prompts.py --out DIR [--rows wan22-a14b,wan21-14b,flux-dev] [--rounds 2] [--limit 540]
                                [--models /root/pa-models] [--steps wan21-14b=4] [--order grouped|alternate]
    python tests/gpu/prompts.py --out DIR --pair 2 --rows wan21-14b --rounds 1   # on 3 GPUs or more: both at once
    python tests/gpu/prompts.py --out DIR --cpu --devices 2 --rounds 1     # the same path on a machine without GPUs

Rows (this repository's API workflows, workflows/api, used as they are: only the model files' names, the sizes, the
steps, the CFG and the seeds changed):

  wan22-a14b  Wan 2.2 A14B t2v, 1280x720, 81 frames, 4 steps (2 high-noise + 2 low-noise: the template's two
              KSamplerAdvanced, their boundary kept at half the steps), CFG 1.  Several GPUs: "Wan 2.2 A14B video on
              several GPUs.json"; one GPU: the same without its several-GPU nodes (Context Parallel bypassed, VAE
              Decode (several GPUs) as ComfyUI's VAE Decode: the repository has no one-GPU A14B workflow).  The
              template has no Patch Attention node: ComfyUI's own attention.
  wan21-14b   Wan 2.1 14B t2v, 1280x720, 81 frames, 20 steps, CFG 5.  One GPU: "Wan 2.1 video 480p 81 frames.json",
              several GPUs: "Wan 2.1 video on several GPUs.json" (both with the 14B file in place of the 1.3B one;
              both with Patch Attention's auto, as the templates have it, and so has Flux's).
  flux-dev    Flux.1 dev, 1024x1024, 20 steps, guidance 3.5, CFG 1.  One GPU: "Flux.1 dev image 1024px.json"; several
              GPUs: the same with the Context Parallel node (its defaults) before the sampler.  At 1024² (4,096 image
              tokens) the node keeps each forward on one GPU (shorter than its MIN_SPLIT_TOKENS): the honest number
              is one GPU's, plus whatever the node costs.
The report says where the one-GPU and several-GPU workflows differ beyond those nodes (expected: nowhere).

Model files: random bf16 weights in ComfyUI's own layouts, full size (tests/gpu/model_files.py: keys and shapes from
ComfyUI's classes, so its detection finds them), cached under --models and linked into the server's model folders.
On disk: wan22-a14b ~69 GB (two 14B experts, umT5-XXL, the VAE), wan21-14b ~40 GB (with wan22-a14b's umT5 and VAE:
~29 GB more), flux-dev ~34 GB: ~132 GB together, more than a 128 GiB disk leaves; one row per call, the other rows'
files removed when the disk is short (--no-evict keeps them and skips the row).  The templates name fp8 files for Wan 2.2 and
umT5: these are bf16 (ComfyUI loads them as it would its bf16 releases).

The server: tests/gpu/soak.py's (its ComfyUI main.py in a temporary base directory, this pack and its test nodes as
custom nodes, soak.py's state route: host RSS and per-GPU memory after each prompt), with this file as a custom node
too (each node's start as ComfyUI announces it, "executing", and the samplers' "progress", timed in the server).
One server process sees every GPU and runs both workflows (--order grouped, the default: every one-GPU prompt
first, as a user runs one workflow again and again; alternate: one GPU, several GPUs, in turn, where ComfyUI drops the
outputs of the nodes the other workflow lacks, so each several-GPU prompt runs its multi-GPU nodes again and makes the
other GPUs' copies again): what a user with two GPUs compares.  The one-GPU workflow runs on the first
GPU, ComfyUI's device, while the others idle (they may still hold the several-GPU prompts' copies, as they would for
that user); ComfyUI's default cache (--cache-lru N: its LRU cache).  After a warm-up prompt per workflow (loading,
the multi-GPU nodes' copies, tuning; --warmup-steps: fewer steps for it, at least one per sampler), --rounds timed
prompts per workflow, each with a new seed: the text encoders' outputs stay cached between prompts as they do for a
user who changes the seed.

Per prompt: seconds from ComfyUI's history entry (its execution_start and execution_success timestamps; the wall
clock from POST to the entry where they are missing), where they went (text encode, sampling with s/step from the
progress messages, VAE decode, save, the rest: loaders, Patch Attention, Context Parallel), the server's memory after.
Per row: the median of the timed prompts per workflow, the ratio one GPU / several GPUs (above 1: several faster), the
same per phase; with --steps below the row's, also the prompt at the row's steps, extrapolated with the measured
s/step.  Results: DIR/prompts.json and DIR/prompts.md (rewritten after every prompt), ComfyUI's log in
DIR/prompts-server.log.  Exit status 1 when a prompt failed (not one the limit interrupted).

--pair N: two servers at once, each seeing its own GPUs (CUDA_VISIBLE_DEVICES): the one-GPU workflow's the first GPU,
the several-GPU one's the next N; each runs its workflow's warm-up and timed prompts while the other runs its own.  For
a row whose two workflows do not fit one after the other in a 10-minute call (Wan 2.1 14B 720p at CFG 5, 20 steps:
~6 minutes a prompt on one GPU): the ratio is still of one run on one host, the one-GPU prompts with their GPU to
themselves (the host's cores, memory and disk shared with the other server).  It needs 1 + N GPUs.

--limit (seconds, the whole run): a row whose warm-ups and one round are not expected to fit what is left (rough
figures for one H100: Wan 14B 720p ~10 s/step at CFG 1, 20 at CFG 5, its VAE decode and save ~10 s (4.6 and 5.2
measured with Wan 2.2 A14B); Flux ~0.18 s/step; files written at ~1 GB/s) is listed as not run, with why; within a
row, a prompt not expected to fit (the last timed prompt of its workflow, or its warm-up without the loaders and text encoders) ends the row's rounds; a
prompt still running at the limit is interrupted.

--cpu --devices N: ComfyUI in CPU mode seeing N devices (soak.py's), tiny model configurations (model_files.py --tiny;
ComfyUI's text encoder classes built tiny by this file in the server), 2 steps, 128x128 (5 frames): the same client,
server, workflows and nodes, Context Parallel split from 0 tokens and VAE Decode (several GPUs) spread over N threads
on the CPU (the pack's simulated devices; on the CPU it otherwise decodes on one).  What only GPUs check: the times.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.realpath(__file__))  # this file, also where ComfyUI loads it through a link
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKFLOWS = os.path.join(ROOT, "workflows", "api")
CLIENT = "pa-prompts"
MODES = ("one", "several")
TIMELINE = ("executing", "progress", "execution_start", "execution_success", "execution_error",
            "execution_interrupted")
PHASES = {"CLIPTextEncode": "text", "KSampler": "sampling", "KSamplerAdvanced": "sampling", "VAEDecode": "decode",
          "VAEDecodeMultiGPU": "decode", "SaveImage": "save", "SaveAnimatedWEBP": "save", "CreateVideo": "save",
          "SaveVideo": "save"}
PHASE_ORDER = ("text", "sampling", "decode", "save", "other")
CPU_STEPS = 2
CPU_SIZE = {3: (128, 128, 5), 2: (128, 128)}
WRITE_GBPS = 1.0  # the --limit estimate's disk
WAN_TEXT = {"umt5_xxl_fp8_e4m3fn_scaled.safetensors": "umt5-xxl", "wan_2.1_vae.safetensors": "wan-vae"}


@dataclass(frozen=True)
class Row:
    title: str
    one: str | None  # the one-GPU API workflow (None: the several-GPU one without its several-GPU nodes)
    several: str | None  # the several-GPU API workflow (None: the one-GPU one with Context Parallel before the sampler)
    files: dict  # the workflow's model file -> model_files.py's name
    steps: int
    cfg: float
    size: tuple  # width, height[, frames]
    needs: tuple  # Python packages ComfyUI's tokenizers need beyond its start-up
    est_step: float  # one H100, s/step at this CFG (the --limit estimate)
    est_rest: float  # one H100, s/prompt beside sampling (decode, save)
    est_load: float  # one H100, s more for a workflow's first prompt (loading, copies)
    est_split: float  # sampling's expected speed-up over the GPUs


@dataclass
class Server:
    """One ComfyUI server: its process, address, base directory, log and the devices it sees."""
    proc: object
    url: str
    base: str
    log: ServerLog
    devices: str  # CUDA_VISIBLE_DEVICES, or "cpu xN"


ROWS = {
    "wan22-a14b": Row("Wan 2.2 A14B t2v 720p (1280x720), 81 frames, 4 steps (2 high-noise + 2 low-noise), CFG 1",
                      None, "Wan 2.2 A14B video on several GPUs.json",
                      {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "wan22-high",
                       "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "wan22-low", **WAN_TEXT},
                      4, 1.0, (1280, 720, 81), ("sentencepiece",), 10.0, 15.0, 45.0, 1.8),
    "wan21-14b": Row("Wan 2.1 14B t2v 720p (1280x720), 81 frames, 20 steps, CFG 5", "Wan 2.1 video 480p 81 frames.json",
                     "Wan 2.1 video on several GPUs.json", {"wan2.1_t2v_1.3B_fp16.safetensors": "wan21-14b", **WAN_TEXT},
                     20, 5.0, (1280, 720, 81), ("sentencepiece",), 20.0, 15.0, 45.0, 1.8),
    "flux-dev": Row("Flux.1 dev 1024x1024, 20 steps, guidance 3.5, CFG 1", "Flux.1 dev image 1024px.json", None,
                    {"flux1-dev.safetensors": "flux-dev", "clip_l.safetensors": "clip-l",
                     "t5xxl_fp16.safetensors": "t5xxl", "ae.safetensors": "flux-ae"},
                    20, 1.0, (1024, 1024), (), 0.18, 2.0, 30.0, 1.0),
}


# ---------------------------------------------------------------- inside the server (loaded as a custom node)

def _install_server_side() -> None:
    """The timeline route (each prompt's node starts and sampler progress, timed here), the CPU check's setup route
    and, in the CPU check (PA_PROMPTS_TINY), ComfyUI's text encoder classes built tiny."""
    from aiohttp import web
    from server import PromptServer

    srv = PromptServer.instance
    events: dict = {}
    send = srv.send_sync

    def send_sync(event, data, sid=None):
        if event in TIMELINE and isinstance(data, dict) and data.get("prompt_id"):
            events.setdefault(data["prompt_id"], []).append(
                [time.time(), event, data.get("node"), data.get("value"), data.get("max")])
        return send(event, data, sid)

    srv.send_sync = send_sync

    @srv.routes.get("/pa_prompts/timeline/{pid}")
    async def timeline(request):
        return web.json_response(events.pop(request.match_info["pid"], []))

    @srv.routes.post("/pa_prompts/setup")
    async def setup(request):
        out = _simulated_vae_devices() if os.environ.get("PA_PROMPTS_TINY") == "1" else {}
        return web.json_response({**out, **_split_floors()})

    if os.environ.get("PA_PROMPTS_PROFILE"):
        _profile_samplers(os.environ["PA_PROMPTS_PROFILE"])

    if os.environ.get("PA_PROMPTS_TINY") == "1":  # in ComfyUI's server, a process of its own: its path is its own
        sys.path.insert(0, HERE)
        import comfy.sd1_clip as sc
        import model_files

        init = sc.SDClipModel.__init__

        def tiny_init(self, *args, model_options=None, **kwargs):
            init(self, *args, model_options=model_files.tiny_te_options(model_options), **kwargs)

        sc.SDClipModel.__init__ = tiny_init


def _profile_samplers(out: str) -> None:
    """Each run of ComfyUI's sampler (CFGGuider.sample: loading the models, every step) under cProfile, in the thread
    that runs it; its 40 costliest functions by own time and by time within them to ``out``/profile-<n>.txt."""
    import cProfile
    import io
    import itertools
    import pstats

    import comfy.samplers

    sample, count = comfy.samplers.CFGGuider.sample, itertools.count()

    def profiled(self, *args, **kwargs):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        try:
            return prof.runcall(sample, self, *args, **kwargs)
        finally:
            text = io.StringIO()
            text.write(f"CFGGuider.sample: {time.perf_counter() - t0:.3f} s under cProfile\n")
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
            with open(os.path.join(out, f"profile-{next(count)}.txt"), "w") as f:
                f.write(text.getvalue())

    comfy.samplers.CFGGuider.sample = profiled


def _pack():
    """The pack's module in ComfyUI's server (loaded there as a custom node under a name of ComfyUI's choosing)."""
    init = os.path.join(ROOT, "__init__.py")
    return next(m for m in list(sys.modules.values()) if os.path.realpath(getattr(m, "__file__", None) or "") == init)


def _split_floors() -> dict:
    """--split-tflop: the Context Parallel node's floors (nodes/context_parallel.py SPLIT_TFLOP) set in the server for
    this run, to measure whole prompts on sizes the node keeps on one GPU; the floors in force, or nothing."""
    spec = os.environ.get("PA_PROMPTS_SPLIT_TFLOP", "")
    if not spec:
        return {}
    cp = importlib.import_module(_pack().__name__ + ".nodes.context_parallel")
    for item in spec.split(","):
        kind, value = item.split("=")
        if kind not in cp.SPLIT_TFLOP:
            raise ValueError(f"--split-tflop: no floor {kind!r} (there are {', '.join(cp.SPLIT_TFLOP)})")
        cp.SPLIT_TFLOP[kind] = float(value)
    return {"split_tflop": dict(cp.SPLIT_TFLOP)}


def _simulated_vae_devices() -> dict:
    """VAE Decode (several GPUs) on the CPU: its tiles over PA_SOAK_DEVICES threads (the pack's simulated devices,
    as its CPU tests run it), where it would otherwise decode on the one CPU."""
    import torch

    n = int(os.environ.get("PA_SOAK_DEVICES", "0"))
    vae = importlib.import_module(_pack().__name__ + ".nodes.vae")
    if n > 1 and not getattr(vae.devices_for, "simulated", False):
        devices_for = vae.devices_for

        def simulated(v, gpus, simulate=0):
            if not simulate and torch.device(v.device).type == "cpu":
                simulate = min(gpus, n) if gpus > 0 else n
            return devices_for(v, gpus, simulate)

        simulated.simulated = True
        vae.devices_for = simulated
    return {"vae_devices": n}


if __name__ != "__main__" and os.environ.get("PA_PROMPTS") == "1":
    _install_server_side()
NODE_CLASS_MAPPINGS: dict = {}


# ---------------------------------------------------------------- the workflows

def load_workflow(name: str) -> dict:
    with open(os.path.join(WORKFLOWS, name)) as f:
        return json.load(f)


def without_multigpu(wf: dict) -> dict:
    """``wf`` without its several-GPU nodes: each Context Parallel bypassed (its model goes straight on), VAE Decode
    (several GPUs) as ComfyUI's VAE Decode."""
    wf = copy.deepcopy(wf)
    for nid in [n for n, v in wf.items() if v["class_type"] == "ContextParallel"]:
        src = wf.pop(nid)["inputs"]["model"]
        for v in wf.values():
            for k, x in v["inputs"].items():
                if x == [nid, 0]:
                    v["inputs"][k] = src
    for v in wf.values():
        if v["class_type"] == "VAEDecodeMultiGPU":
            v["class_type"] = "VAEDecode"
            v["inputs"] = {k: v["inputs"][k] for k in ("samples", "vae")}
            v["_meta"] = {"title": "VAEDecode"}
    return wf


def with_context_parallel(wf: dict, defaults: dict) -> dict:
    """``wf`` with the Context Parallel node (``defaults``: its widgets) between each sampler and its model."""
    wf = copy.deepcopy(wf)
    nid = max(int(k) for k in wf) + 1
    for v in [v for v in wf.values() if v["class_type"] in ("KSampler", "KSamplerAdvanced")]:
        wf[str(nid)] = {"class_type": "ContextParallel", "inputs": {**defaults, "model": v["inputs"]["model"]},
                        "_meta": {"title": "ContextParallel"}}
        v["inputs"]["model"] = [str(nid), 0]
        nid += 1
    return wf


def differences(one: dict, several: dict) -> list[str]:
    """Where the two workflows differ beyond the several-GPU nodes (node ids and inputs)."""
    a, b = ({k: (v["class_type"], v["inputs"]) for k, v in w.items()} for w in (one, without_multigpu(several)))
    return [f"node {k}: {a.get(k)} / {b.get(k)}" for k in sorted(set(a) | set(b), key=int) if a.get(k) != b.get(k)]


def with_inputs(wf: dict, inputs: dict) -> dict:
    """``wf`` with ``inputs`` ({(node class, input): value}) set on every node of that class it has; a clear error
    where such a node lacks the input (the template changed)."""
    wf = copy.deepcopy(wf)
    for (cls, name), value in inputs.items():
        for v in (v for v in wf.values() if v["class_type"] == cls):
            if name not in v["inputs"]:
                raise ValueError(f"--inputs: the workflow's {cls} node has no input {name!r}")
            v["inputs"][name] = value
    return wf


def workflows(row: Row, cp_defaults: dict, inputs: dict | None = None) -> tuple[dict, list]:
    """({"one": workflow, "several": workflow}, their differences beyond the several-GPU nodes); ``inputs`` (see
    :func:`with_inputs`) set in both."""
    several = load_workflow(row.several) if row.several else None
    one = load_workflow(row.one) if row.one else without_multigpu(several)
    several = several or with_context_parallel(one, cp_defaults)
    if inputs:
        one, several = with_inputs(one, inputs), with_inputs(several, inputs)
    return {"one": one, "several": several}, differences(one, several)


def at_step(at: int, steps: int, new: int) -> int:
    """A KSamplerAdvanced start/end step for ``new`` steps in place of ``steps`` (its share kept; 10000: the end)."""
    return at if at >= steps else round(at * new / steps)


def adapt(wf: dict, row: Row, names: dict, seed: int, steps: int, size: tuple) -> dict:
    """``wf`` with the generated files (``names``: the workflow's file -> ours), ``size``, ``steps``, the row's CFG and
    ``seed``; nothing else changed."""
    wf, used = copy.deepcopy(wf), set()
    for v in wf.values():
        inp, ct = v["inputs"], v["class_type"]
        for k, x in list(inp.items()):
            if isinstance(x, str) and x in names:
                inp[k] = names[x]
                used.add(x)
        if ct == "EmptyHunyuanLatentVideo":
            inp.update(width=size[0], height=size[1], length=size[2])
        elif ct in ("EmptySD3LatentImage", "EmptyLatentImage"):
            inp.update(width=size[0], height=size[1])
        elif ct == "KSampler":
            inp.update(seed=seed, steps=steps, cfg=row.cfg)
        elif ct == "KSamplerAdvanced":
            n = inp["steps"]
            inp.update(noise_seed=seed, steps=steps, cfg=row.cfg, start_at_step=at_step(inp["start_at_step"], n, steps),
                       end_at_step=at_step(inp["end_at_step"], n, steps))
    if used != set(names):
        raise ValueError(f"the workflow names none of {', '.join(sorted(set(names) - used))}: the template changed")
    return wf


# ---------------------------------------------------------------- one prompt

def node_times(events: list, prompt: dict) -> tuple[list, dict, list]:
    """(each executed node's seconds, seconds per phase, each sampler's steps) from the server's timeline: a node runs
    from its "executing" to the next one's (the last to the prompt's end)."""
    starts = [(t, n) for t, ev, n, *_ in events if ev == "executing" and n is not None]
    ends = [t for t, ev, *_ in events if ev in TIMELINE[3:]]
    end = ends[0] if ends else (events[-1][0] if events else 0.0)
    nodes = [{"node": n, "class": prompt.get(n, {}).get("class_type", "?"),
              "start": t, "seconds": (starts[i + 1][0] if i + 1 < len(starts) else end) - t}
             for i, (t, n) in enumerate(starts)]
    phases = {p: 0.0 for p in PHASE_ORDER}
    for x in nodes:
        phases[PHASES.get(x["class"], "other")] += x["seconds"]
    samplers = []
    for x in (x for x in nodes if PHASES.get(x["class"]) == "sampling"):
        prog = [(t, v) for t, ev, n, v, _ in events if ev == "progress" and n == x["node"] and x["start"] <= t]
        per_step = None
        if len(prog) >= 2 and prog[-1][1] > prog[0][1]:
            per_step = (prog[-1][0] - prog[0][0]) / (prog[-1][1] - prog[0][1])
        samplers.append({"node": x["node"], "seconds": x["seconds"], "steps": prog[-1][1] if prog else None,
                         "s_per_step": per_step, "to_first_progress": prog[0][0] - x["start"] if prog else None})
    return nodes, phases, samplers


def timing(entry: dict | None, events: list, prompt: dict, wall: float) -> dict:
    """Seconds (ComfyUI's history timestamps, else the wall clock) and where they went."""
    msgs = {m[0]: m[1] for m in (entry or {}).get("status", {}).get("messages", [])}
    start, done = msgs.get("execution_start", {}), msgs.get("execution_success", {})
    if "timestamp" in start and "timestamp" in done:
        seconds, source = (done["timestamp"] - start["timestamp"]) / 1000.0, "history"
    else:
        seconds, source = wall, "wall clock"
    nodes, phases, samplers = node_times(events, prompt)
    steps = [s["s_per_step"] for s in samplers if s["s_per_step"] is not None]
    return {"seconds": seconds, "source": source, "cached": msgs.get("execution_cached", {}).get("nodes", []),
            "phases": phases if nodes else {}, "s_per_step": statistics.mean(steps) if steps else None,
            "samplers": samplers, "nodes": [{k: x[k] for k in ("node", "class", "seconds")} for x in nodes]}


def run_prompt(soak, url: str, p: dict, timeout: float, log: ServerLog) -> dict:
    """``p`` queued and waited for (interrupted at ``timeout``); its outcome, timing, what the nodes showed (their
    canvas texts), what the multi-GPU nodes and ComfyUI's copies logged, and the server's state after."""
    ok, err, wall, entry = soak.run_entry(url, p, timeout, CLIENT)
    if not ok and entry is None and err.startswith("not finished"):
        post(url + "/interrupt", {})
        idle(soak, url, 120)
    events = soak.call(f"{url}/pa_prompts/timeline/{entry['prompt_id']}") if entry else []
    try:
        state = soak.call(url + "/pa_soak/state")
    except Exception:  # the server is gone
        state = None
    shown = {k: " ".join(map(str, v["text"]))[:300] for k, v in (entry or {}).get("outputs", {}).items() if "text" in v}
    return {"ok": ok, "error": err, "wall": wall, **timing(entry, events, p, wall), "shown": shown,
            "log": log.new(), "state": state}


class ServerLog:
    """The server's log since the last call: the lines of the multi-GPU nodes and of ComfyUI's per-GPU copies."""

    KEEP = ("Context Parallel", "VAE Decode (several GPUs)", "deepclone", "memory leak")

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def new(self) -> list[str]:
        import re

        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        lines = (re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines())
        return [line for line in lines if any(k in line for k in self.KEEP)]


def post(url: str, data: dict):
    """A POST: its answer's JSON, or None where it has none (ComfyUI's /interrupt and /free)."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:  # no body, or not JSON
        return None


def idle(soak, url: str, seconds: float) -> None:
    """Waits until ComfyUI's queue is empty."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        q = soak.call(url + "/queue")
        if not q.get("queue_running") and not q.get("queue_pending"):
            return
        time.sleep(0.5)


def free(soak, url: str) -> None:
    """ComfyUI's models unloaded and its caches cleared (/free), as between rows: room for the next row's models."""
    post(url + "/free", {"unload_models": True, "free_memory": True})
    deadline = time.time() + 60
    while time.time() < deadline and soak.call(url + "/pa_soak/state")["loaded"]:
        time.sleep(0.5)


# ---------------------------------------------------------------- a row

def sequence(order: str, rounds: int) -> list[tuple[str, bool]]:
    """(workflow, warm-up) of every prompt of a row."""
    if order == "alternate":
        return [(m, True) for m in MODES] + [(m, False) for _ in range(rounds) for m in MODES]
    return [(m, w) for m in MODES for w in [True] + [False] * rounds]


def estimate(a, row: Row, steps: int, missing: list) -> float:
    """Seconds the row's files still to write, its warm-ups and one round are expected to take on one H100 (0 in the
    CPU check: no figures for it); with --pair the longer of the two workflows (they run at once)."""
    if a.cpu:
        return 0.0
    mf = model_files()

    def prompt(n, mode):
        split = row.est_split if mode == "several" else 1.0
        return n * row.est_step / split + row.est_rest / min(split, 1.5)

    warm = a.warmup_steps or steps
    each = [row.est_load + prompt(warm, m) + prompt(steps, m) for m in MODES]
    return sum(mf.SPECS[n].gb for n in missing) / WRITE_GBPS + (max(each) if a.pair else sum(each))


def generate(a, names: list, comfyui: str, t_end: float) -> str:
    """model_files.py for ``names``, in a process of its own (the GPU's memory is back when it ends); "" or why not."""
    report = os.path.join(a.out, "model-files.json")
    cmd = [sys.executable, os.path.join(HERE, "model_files.py"), "--models", a.models, "--only", ",".join(names),
           "--report", report] + (["--tiny"] if a.cpu else []) + (["--evict"] if a.evict else [])
    try:
        r = subprocess.run(cmd, env={**os.environ, "COMFYUI_PATH": comfyui}, timeout=max(10.0, t_end - time.time()))
    except subprocess.TimeoutExpired:
        return "the model files were not written within the limit"
    if r.returncode:
        try:
            with open(report) as f:
                return json.load(f)["error"]
        except (OSError, ValueError, KeyError):
            return f"model_files.py exit status {r.returncode}"
    return ""


def prepare(a, soak, servers: list, row: Row, steps: int, comfyui: str, t_end: float) -> str:
    """The row's packages, time and files checked, its files made where missing and linked into the servers' model
    folders; "" or why the row is not run."""
    mf = model_files()
    lacking = [m for m in row.needs if importlib.util.find_spec(m) is None]
    if lacking:
        return f"{', '.join(lacking)} missing (ComfyUI's tokenizer for these files needs it: carry its wheel)"
    names = sorted(set(row.files.values()))
    missing = [n for n in names if not mf.cached(a.models, n, a.cpu)]
    need, left = estimate(a, row, steps, missing), t_end - time.time()
    if left < 15:
        return f"the limit: {max(left, 0):.0f} s left"
    if need > left:
        return (f"expected ~{need:.0f} s for its files, warm-ups and one round at {steps} steps, {left:.0f} s left "
                "(--limit; --steps ROW=N times fewer steps)")
    if missing:
        for s in servers:  # the previous row's models out of the way of the generator and of the eviction
            free(soak, s.url)
        why = generate(a, missing, comfyui, t_end)
        if why:
            return why
    for n, s in ((n, s) for n in names for s in servers):
        spec = mf.SPECS[n]
        dst = os.path.join(s.base, "models", spec.folder, spec.file)
        if not os.path.lexists(dst):
            os.symlink(os.path.join(os.path.abspath(a.models), spec.folder, spec.file), dst)
    return ""


def run_row(a, soak, servers: dict, name: str, t_end: float, ctx: dict) -> dict:
    """One row: its prompts in :func:`sequence`'s order (with --pair: each workflow's on its own server, both at
    once), the summary."""
    row = ROWS[name]
    steps = CPU_STEPS if a.cpu else a.steps.get(name, row.steps)
    res = {"row": name, "title": row.title, "steps": steps, "row_steps": row.steps, "cfg": row.cfg,
           "status": "not run", "reason": "", "prompts": []}
    ctx["rows"].append(res)
    distinct = list({id(s): s for s in servers.values()}.values())
    res["reason"] = prepare(a, soak, distinct, row, steps, ctx["comfyui"], t_end)
    if res["reason"]:
        print(f"prompts {name}: not run: {res['reason']}", flush=True)
        return res
    if ctx["rows"][:-1]:
        for s in distinct:
            free(soak, s.url)
    wfs, res["differences"] = workflows(row, ctx["cp_defaults"], a.inputs)
    res["workflows"] = {"one": row.one or f"{row.several} without its several-GPU nodes",
                        "several": row.several or f"{row.one} with Context Parallel before the sampler"}
    names = {tpl: model_files().SPECS[n].file for tpl, n in row.files.items()}
    size = CPU_SIZE[len(row.size)] if a.cpu else row.size
    res["size"] = "x".join(map(str, size))
    res["status"] = "running"
    if len(distinct) == 1:
        res["reason"] = run_prompts(a, soak, servers, row, wfs, names, steps, size, t_end, res, ctx, MODES)
    else:  # --pair: the two workflows at once, each on its server's GPUs
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(len(MODES)) as pool:
            why = list(pool.map(lambda m: run_prompts(a, soak, servers, row, wfs, names, steps, size, t_end, res, ctx,
                                                      (m,)), MODES))
        res["reason"] = "; ".join(f"{m}: {w}" for m, w in zip(MODES, why) if w)
    res["status"] = "partial" if res["reason"] else "done"
    res["summary"] = summarize(res["prompts"], steps, steps if a.cpu else row.steps)
    save(a, ctx)
    return res


def run_prompts(a, soak, servers, row, wfs, names, steps, size, t_end, res, ctx, modes) -> str:
    """The row's prompts of ``modes``' workflows, each recorded as it ends; "" or why they stopped early."""
    last = {}
    for mode, warm in (x for x in sequence(a.order, a.rounds) if x[0] in modes):
        server = servers[mode]
        samplers = sum(v["class_type"] == "KSamplerAdvanced" for v in wfs[mode].values())
        n = max(a.warmup_steps, samplers) if warm and a.warmup_steps else steps
        left = t_end - time.time()
        if not warm and mode in last and last[mode] * 1.05 + 5 > left:
            return f"the limit: the next {mode}-GPU prompt (~{last[mode]:.0f} s) would not fit the {left:.0f} s left"
        with ctx["lock"]:
            ctx["seed"] += 1
            seed = ctx["seed"]
        p = adapt(wfs[mode], row, names, seed, n, size)
        t0 = time.time()
        r = run_prompt(soak, server.url, p, min(a.timeout, max(left, 1.0)), server.log)
        cut = not r["ok"] and r["error"].startswith("not finished") and left < a.timeout
        with ctx["lock"]:
            rec = {"i": len(res["prompts"]), "mode": mode, "warmup": warm, "seed": seed, "steps": n, **r,
                   "cut_by_limit": cut, "span": [t0, time.time()]}
            res["prompts"].append(rec)
            save(a, ctx)
        spent = " ".join(f"{k} {v:.1f}" for k, v in r["phases"].items() if v >= 0.05)
        outcome = "ok" if r["ok"] else "interrupted at the limit" if cut else "FAILED " + r["error"][:200]
        print(f"prompts {res['row']} {rec['i']:2d} {mode:7s} {'warm-up' if warm else 'timed  '} {outcome} "
              f"{r['seconds']:.1f} s ({r['source']}; {spent})", flush=True)
        if cut:
            return "the limit: a prompt still running was interrupted"
        if not r["ok"]:
            return "a prompt failed" if r["state"] is not None else "the server is gone"
        once = r["phases"].get("text", 0.0) + r["phases"].get("other", 0.0) if warm else 0.0  # loaders, encoders
        last[mode] = r["seconds"] - once
    return ""


def summarize(prompts: list, steps: int, row_steps: int) -> dict:
    """Per workflow the timed prompts' medians (seconds, phases, s/step), its warm-up; the ratios one / several."""
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = {}
    for mode in MODES:
        timed = [p for p in prompts if p["mode"] == mode and not p["warmup"] and p["ok"]]
        warm = [p["seconds"] for p in prompts if p["mode"] == mode and p["warmup"] and p["ok"]]
        s = {"n": len(timed), "seconds": med([p["seconds"] for p in timed]), "times": [p["seconds"] for p in timed],
             "phases": {ph: med([p["phases"].get(ph) for p in timed if p["phases"]]) for ph in PHASE_ORDER},
             "s_per_step": med([p["s_per_step"] for p in timed]), "warmup_seconds": warm[0] if warm else None}
        if steps != row_steps and s["seconds"] is not None and s["s_per_step"]:
            s["at_row_steps"] = s["seconds"] + (row_steps - steps) * s["s_per_step"]
        out[mode] = s
    one, sev = out["one"], out["several"]
    if one["seconds"] and sev["seconds"]:
        out["ratio"] = one["seconds"] / sev["seconds"]
        out["ratio_phases"] = {ph: one["phases"][ph] / sev["phases"][ph] for ph in PHASE_ORDER
                               if one["phases"][ph] and sev["phases"][ph]}
        if "at_row_steps" in one and "at_row_steps" in sev:
            out["ratio_at_row_steps"] = one["at_row_steps"] / sev["at_row_steps"]
    return out


# ---------------------------------------------------------------- the report

def save(a, ctx: dict) -> None:
    with open(os.path.join(a.out, "prompts.json"), "w") as f:
        json.dump({"meta": ctx["meta"], "rows": ctx["rows"]}, f, indent=1)
    with open(os.path.join(a.out, "prompts.md"), "w") as f:
        f.write(render(ctx["meta"], ctx["rows"]))


def fmt(x, nd=1) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def render(meta: dict, rows: list) -> str:
    lines = ["# Whole prompts through ComfyUI's server: one GPU against several", "",
             f"{meta['device']}, ComfyUI {meta['comfyui']}, torch {meta['torch']}, {meta['date']}; per workflow the "
             f"median of up to {meta['rounds']} prompts after a warm-up prompt, a new seed each, workflows "
             f"{meta['order']}{'; ComfyUI started with ' + meta['server_args'] if meta.get('server_args') else ''}"
             f"{_pair_words(meta.get('pair'))}"
             f"{'; Context Parallel floors set to ' + json.dumps(meta['split_tflop']) if meta.get('split_tflop') else ''}"
             f"{'; the workflows with ' + json.dumps(meta['inputs']) if meta.get('inputs') else ''}"
             "; seconds from ComfyUI's history (execution start to success); phases from the nodes' "
             "starts as ComfyUI announced them (sampling includes loading the model to the GPU).", "",
             "| row | workflow | prompts | s/prompt | text | sampling | s/step | VAE decode | save | other | "
             "one GPU / several |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sm = r.get("summary")
        if not sm:
            continue
        for mode in MODES:
            s, ph = sm[mode], sm[mode]["phases"]
            ratio = f"x{sm['ratio']:.2f}" if mode == "several" and "ratio" in sm else ""
            lines.append(f"| {r['title'] if mode == 'one' else ''} | {'one GPU' if mode == 'one' else 'several GPUs'}: "
                         f"{r['workflows'][mode]} | {s['n']} | {fmt(s['seconds'])} | {fmt(ph['text'])} | "
                         f"{fmt(ph['sampling'])} | {fmt(s['s_per_step'], 2)} | {fmt(ph['decode'])} | {fmt(ph['save'])} "
                         f"| {fmt(ph['other'])} | {ratio} |")
    lines += [""] + [line for r in rows for line in row_notes(r, meta["cpu"])]
    lines += ["", "## Every prompt", "", "| row | # | workflow | warm-up | steps | seed | ok | s | source | sampling | "
              "VAE decode | GPU memory used after (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in r["prompts"]:
            gpus = " / ".join(f"{g['used'] / 2**20:.0f}" for g in (p["state"] or {}).get("gpus", []))
            lines.append(f"| {r['row']} | {p['i']} | {p['mode']} | {'yes' if p['warmup'] else ''} | {p['steps']} | "
                         f"{p['seed']} | {'yes' if p['ok'] else 'NO: ' + p['error'][:120]} | {p['seconds']:.1f} | "
                         f"{p['source']} | {fmt(p['phases'].get('sampling'))} | {fmt(p['phases'].get('decode'))} | "
                         f"{gpus} |")
    return "\n".join(lines) + "\n"


def _pair_words(pair: dict | None) -> str:
    if not pair:
        return ""
    return (f"; two servers at once (--pair), the one-GPU workflow's seeing {pair['one']} and the several-GPU one's "
            f"{pair['several']} (CUDA_VISIBLE_DEVICES)")


def row_notes(r: dict, meta_cpu: bool) -> list[str]:
    """What the table does not say of a row: not run or cut short (and why), other steps, workflow differences."""
    if r["status"] == "not run":
        return [f"- {r['title']}: not run: {r['reason']}"]
    out = [f"- {r['title']}: {r['size']}, {r['steps']} steps"
           + (f" (the row's {r['row_steps']}{' at full size; this is the CPU check' if meta_cpu else ''})" if r["steps"] != r["row_steps"] else "")
           + (f"; cut short: {r['reason']}" if r["reason"] else "")]
    sm = r.get("summary", {})
    if "ratio_at_row_steps" in sm:
        out.append(f"  - at {r['row_steps']} steps, extrapolated with the measured s/step: one GPU "
                   f"{sm['one']['at_row_steps']:.0f} s, several GPUs {sm['several']['at_row_steps']:.0f} s, "
                   f"x{sm['ratio_at_row_steps']:.2f}")
    if sm.get("ratio_phases"):
        out.append("  - one GPU / several per phase: " + ", ".join(f"{k} x{v:.2f}" for k, v in sm["ratio_phases"].items()))
    warm = [f"{m} {sm[m]['warmup_seconds']:.0f} s" for m in MODES if sm.get(m, {}).get("warmup_seconds") is not None]
    if warm:
        out.append("  - warm-up prompts (loading, copies): " + ", ".join(warm))
    if r.get("differences"):
        out.append("  - the workflows differ beyond the several-GPU nodes: " + "; ".join(r["differences"]))
    return out


# ---------------------------------------------------------------- main

_SIBLINGS = threading.Lock()


def _sibling(name: str):
    """tests/gpu/<name>.py as a module, without putting tests/gpu first on the path (its zoo.py would hide tests/zoo);
    loaded once, whole, whichever thread asks first (--pair's servers start in two)."""
    with _SIBLINGS:
        return _load_sibling(name)


def _load_sibling(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def model_files():
    return _sibling("model_files")


def load_soak():
    return _sibling("soak")


def arguments(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=2, help="timed prompts per workflow after the warm-up")
    ap.add_argument("--limit", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--models", help="the model files' cache (default /root/pa-models; --cpu: /root/pa-models/tiny)")
    ap.add_argument("--steps", default="", help="ROW=N,...: fewer steps than the row's (the row's extrapolated)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="steps of the warm-up prompts (0: the timed ones')")
    ap.add_argument("--order", choices=("grouped", "alternate"), default="grouped")
    ap.add_argument("--evict", action=argparse.BooleanOptionalAction, default=True,
                    help="remove the other rows' cached files when the disk is short")
    ap.add_argument("--cache-lru", type=int, default=0, help="ComfyUI's LRU cache of N outputs (0: its default)")
    ap.add_argument("--server-args", default="", help="more arguments for ComfyUI's main.py (e.g. --disable-dynamic-vram)")
    ap.add_argument("--split-tflop", default="",
                    help="KIND=TFLOP,...: the Context Parallel node's floors in the server (e.g. graphs-pack=1.2: "
                         "Flux 1024² split with Patch Attention's kernels), to measure what the node keeps whole")
    ap.add_argument("--inputs", default="",
                    help="CLASS.INPUT=JSON,...: an input set on every node of that class in both workflows (e.g. "
                         "PatchAttention.log_stats=false)")
    ap.add_argument("--pair", type=int, default=0,
                    help="N: two servers at once, the one-GPU workflow's on the first GPU and the several-GPU one's on "
                         "the next N, both workflows' prompts run at the same time (a row too long to run one after "
                         "the other in a 10-minute call; ratios still from one run)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a prompt may take")
    ap.add_argument("--profile", action="store_true",
                    help="every sampler's run in the server under cProfile (its thread), the top functions in "
                         "OUT/profile-<n>.txt: a diagnosis, its times are not the benchmark's")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI in CPU mode, tiny models (the check without GPUs)")
    ap.add_argument("--devices", type=int, default=2, help="with --cpu: the devices ComfyUI sees")
    a = ap.parse_args(argv)
    a.rows = [r for r in a.rows.split(",") if r]
    a.steps = {k: int(v) for k, v in (x.split("=") for x in a.steps.split(",") if x)}
    a.inputs = {tuple(k.split(".", 1)): json.loads(v) for k, v in (x.split("=", 1) for x in a.inputs.split(",") if x)}
    unknown = [r for r in a.rows + list(a.steps) if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows: {', '.join(unknown)}")
    a.models = a.models or ("/root/pa-models/tiny" if a.cpu else "/root/pa-models")
    return a


def describe(a, comfyui: str) -> dict:
    return {**load_soak().machine(a, comfyui), "date": datetime.date.today().isoformat(),
            "rounds": a.rounds, "order": a.order, "limit": a.limit, "models": a.models, "cpu": a.cpu,
            "server_args": a.server_args, "inputs": {".".join(k): v for k, v in a.inputs.items()},
            "warmup_steps": a.warmup_steps, "cache": f"LRU {a.cache_lru}" if a.cache_lru else "ComfyUI's default"}


def bench(a, soak, servers: dict, comfyui: str, t_end: float) -> dict:
    ctx = {"meta": describe(a, comfyui), "rows": [], "seed": 0, "comfyui": comfyui, "lock": threading.Lock()}
    states = {m: soak.call(s.url + "/pa_soak/state") for m, s in servers.items()}  # on the CPU: splits from 0 tokens
    ctx["meta"]["state_at_start"] = states if a.pair else states["one"]
    if a.pair:
        ctx["meta"]["pair"] = {m: s.devices for m, s in servers.items()}
    for s in {id(s): s for s in servers.values()}.values():
        ctx["meta"].update(post(s.url + "/pa_prompts/setup", {}) or {})
    ctx["cp_defaults"] = soak.node_inputs(servers["several"].url, "ContextParallel")
    if a.cpu:  # every row's tiny files at once: one ComfyUI import
        mf = model_files()
        names = sorted({n for r in a.rows for n in ROWS[r].files.values() if not mf.cached(a.models, n, True)})
        why = generate(a, names, comfyui, t_end) if names else ""
        if why:
            raise SystemExit(f"prompts: {why}")
    for name in a.rows:
        run_row(a, soak, servers, name, t_end, ctx)
        save(a, ctx)
    return ctx


def pair_devices(a) -> dict:
    """--pair N: the devices each workflow's server sees: the one-GPU workflow the first GPU, the several-GPU one the
    next N (CUDA_VISIBLE_DEVICES; on the CPU, ComfyUI's CPU mode seeing 1 and N devices)."""
    if a.cpu:
        return {"one": 1, "several": a.pair}
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is None:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout
        seen = ",".join(x.strip() for x in out.split("\n") if x.strip())
    gpus = [g for g in seen.split(",") if g]
    if len(gpus) < 1 + a.pair:
        raise SystemExit(f"prompts: --pair {a.pair} needs {1 + a.pair} GPUs, {len(gpus)} seen")
    return {"one": gpus[0], "several": ",".join(gpus[1:1 + a.pair])}


def launch(a, soak, comfyui: str, name: str, env: dict, devices=None) -> Server:
    """A server of its own in a new base directory, its log OUT/prompts-server[-NAME].log; ``devices``: what it
    sees (--pair)."""
    base = tempfile.mkdtemp(prefix="pa-prompts-")
    for folder in {s.folder for s in model_files().SPECS.values()}:
        os.makedirs(os.path.join(base, "models", folder))
    log = os.path.join(a.out, f"prompts-server{'-' + name if name else ''}.log")
    sa, seen = a, "cpu" if a.cpu else os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    if devices is not None and a.cpu:
        sa, seen = argparse.Namespace(**{**vars(a), "devices": devices}), f"cpu x{devices}"
    elif devices is not None:
        env, seen = {**env, "CUDA_VISIBLE_DEVICES": devices}, devices
    try:
        proc, url = soak.launch(sa, base, comfyui, log,
                                (["--cache-lru", str(a.cache_lru)] if a.cache_lru else []) + a.server_args.split(),
                                {"pa_prompts.py": __file__}, env)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    return Server(proc, url, base, ServerLog(log), seen)


def main(argv=None) -> int:
    a = arguments(argv)
    t_end = time.time() + a.limit if a.limit else float("inf")
    soak = load_soak()
    comfyui = os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", "..")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.models, exist_ok=True)
    env = {"PA_PROMPTS": "1", "PA_PROMPTS_TINY": "1" if a.cpu else "0", "PYTHONUNBUFFERED": "1",
           **({"PA_PROMPTS_PROFILE": os.path.abspath(a.out)} if a.profile else {}),
           **({"PA_PROMPTS_SPLIT_TFLOP": a.split_tflop} if a.split_tflop else {})}
    started = []
    try:
        if a.pair:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once
                futures = {m: pool.submit(launch, a, soak, comfyui, m, env, d) for m, d in pair_devices(a).items()}
            started += [f.result() for f in futures.values() if f.exception() is None]  # stopped below, either way
            servers = {m: f.result() for m, f in futures.items()}
        else:
            started.append(launch(a, soak, comfyui, "", env))
            servers = {m: started[0] for m in MODES}
        ctx = bench(a, soak, servers, comfyui, t_end)
    finally:
        for s in started:
            soak.stop(s.proc, s.base)
    print(render(ctx["meta"], ctx["rows"]).split("\n## Every prompt")[0], flush=True)
    return 1 if any(not p["ok"] and not p["cut_by_limit"] for r in ctx["rows"] for p in r["prompts"]) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a runner's timeout: main's finally stops the server
    sys.exit(main())
