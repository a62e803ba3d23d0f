"""Context Parallel against one GPU when the model's weights do not fit the card: ComfyUI's loader keeps part of them
on the CPU and copies them to the GPU at every forward.

    python tests/gpu/offload.py --preset wan-14b-720p --card-gib 24 --loader estimate --steps 2 \
        --rows 1:sage_fp8_sm90,cp:sage_fp8_sm90,1:unpatched,cp:unpatched --profile 1:sage_fp8_sm90,cp:sage_fp8_sm90 \
        --limit 480 --json offload.json --md offload.md

The card: ``--card-gib`` (0: the GPUs as they are) emulated on every GPU, twice: a hard cap on PyTorch's allocator
(``torch.cuda.set_per_process_memory_fraction(card / total)``) and ComfyUI told that much of the GPU is not its own,
as ``--reserve-vram (total - card)`` tells it (``comfy.model_management.EXTRA_RESERVED_VRAM``; the arithmetic:
:func:`emulated_card`). ComfyUI's free memory comes from the driver, so the reserve is what makes it budget for the card;
the cap makes an allocation beyond the card fail as on the card (PyTorch's own CUDA context stays outside the cap).

The loader (one per process):

- ``estimate`` (ComfyUI's ``--disable-dynamic-vram``, checked: comfy-aimdo off, plain model patchers):
  ``load_models_gpu`` gives every GPU's model a weight budget (its free memory less the reserve and the sampler's
  activation estimate) and ``ModelPatcher.load`` puts the largest modules that fit on the GPU; the others stay on the
  CPU, their weights pinned, and ``comfy.ops.cast_bias_weight`` copies them in at every forward on an offload stream.
  The model: the preset's class with random bf16 weights, built on the first GPU, then moved to the CPU; every other
  GPU gets a separate CPU copy of the same weights (as ComfyUI's MultiGPU deep clones are separate), each model's
  patcher with ``load_device=cuda:i, offload_device=cpu``.
- ``dynamic`` (ComfyUI 0.33's dynamic VRAM, comfy-aimdo, as its main.py switches it on, with ``--reserve-vram`` as
  aimdo's headroom): the same weights saved to a file in /tmp and loaded by ``comfy.sd.load_diffusion_model``; the
  Context Parallel node makes the other GPUs' copies as in a workflow (ComfyUI reloads the file). aimdo's weights live
  outside PyTorch's allocator: for them the card is the headroom, not the cap.

A row is ``<mode>:<backend>``: mode ``1`` (the first GPU) or ``cp`` (the Context Parallel node over every GPU;
``cp-gN``: over the first N), backend ``unpatched`` or a Patch Attention backend. Per row: seconds per step (the
sampler's last step, after a one-step warm-up that loads), the ratio to the same backend on one GPU and the final
latent's relative L1 against it; per GPU what the loader did (the weight budget it gave, bytes of weights on the GPU
and on the CPU, how much of the CPU's is pinned, ComfyUI's own counters), peak memory (allocated and reserved by
PyTorch; the device's use after the run). ``--profile ROWS``: one step of those rows under torch.profiler, per GPU:
host-to-device copies (pinned and pageable: count, GiB, time, and the time no kernel ran meanwhile), peer copies,
kernel time, time with no kernel running, the host's time in the CUDA copy and sync calls, and in
``cast_bias_weight`` (a timer around ComfyUI's function for that step). ``--limit`` seconds: a row that would not fit
what is left is listed as not run; the json and md are written as each row finishes.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """tests/gpu/<name>.py as a module, without putting tests/gpu first on the path (its zoo.py would hide tests/zoo)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


MG = _sibling("multigpu")

GIB = 2**30
ROW = re.compile(r"(1|cp(?:-g(\d+))?)(-nopin)?:([^,:\s]+)$")


def parse_rows(text: str) -> list[dict]:
    """``1:sage,cp:sage,cp-g2:sage,cp-nopin:sage`` -> ``[{"row", "mode" ("1"/"cp"), "gpus" (0: all), "pins" (False:
    ``-nopin``, the nodes' pin keeper taken off), "backend"}]``."""
    out = []
    for row in (x.strip() for x in text.split(",")):
        if not row:
            continue
        m = ROW.match(row)
        if m is None:
            raise ValueError(f"row {row!r}: expected 1:<backend>, cp:<backend> or cp-gN:<backend> (-nopin after the mode)")
        gpus = int(m.group(2) or 0)
        if m.group(2) is not None and gpus < 2:
            raise ValueError(f"row {row!r}: cp-gN splits over N >= 2 GPUs")
        if any(r["row"] == row for r in out):
            raise ValueError(f"row {row!r} is named twice")
        out.append({"row": row, "mode": "1" if m.group(1) == "1" else "cp", "gpus": gpus, "pins": not m.group(3),
                    "backend": m.group(4)})
    if not out:
        raise ValueError("no rows")
    return out


def emulated_card(totals: list[int], card_gib: float) -> dict | None:
    """The card of ``card_gib`` GiB on GPUs of ``totals`` bytes (None: ``card_gib`` 0, no emulation): each GPU's
    allocator fraction, and the reserve ComfyUI is given: ``--reserve-vram`` in GiB, which ComfyUI turns into
    ``EXTRA_RESERVED_VRAM = reserve_vram * 1024**3`` bytes. One reserve for every GPU (ComfyUI has one): the largest
    ``total - card``, so that no GPU is budgeted more than the card."""
    if card_gib <= 0:
        return None
    card = int(card_gib * GIB)
    for i, total in enumerate(totals):
        if card >= total:
            raise ValueError(f"a {card_gib:g} GiB card is not smaller than GPU {i} ({total / GIB:.1f} GiB)")
    reserve = max(total - card for total in totals)
    return {"card_bytes": card, "fractions": [card / total for total in totals], "reserve_bytes": reserve,
            "reserve_vram_gib": reserve / GIB}


def start_aimdo(card: dict | None) -> None:
    """The dynamic loader, first step: comfy-aimdo's library with the card's headroom, as ComfyUI's main.py does
    (``simple_vram_headroom`` from ``--reserve-vram``, NVML pressure on), before any ComfyUI module is imported
    (``comfy_aimdo.host_buffer`` binds the library when imported). Called again after dynamic VRAM is switched on,
    whose own call resets the NVML setting."""
    import comfy_aimdo.control

    headroom = card["reserve_bytes"] if card else None
    try:
        ok = comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=True)
    except TypeError:  # comfy-aimdo 0.4.10's protocol, as main.py falls back
        ok = comfy_aimdo.control.init(simple_vram_headroom=headroom)
    if ok is False:
        raise RuntimeError("comfy-aimdo's library did not load: the dynamic loader needs it")


def load(card: dict | None, loader: str):
    """The pack and ComfyUI (:func:`multigpu.load`), with ComfyUI's reserve set for the card before any model loads
    and its smart memory on (ComfyUI's default: what it loaded stays loaded between runs); the loader checked."""
    pack, e2e, cpn = MG.load()
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = mm.DISABLE_SMART_MEMORY = False  # multigpu.load turns it off
    if card is not None:  # what --reserve-vram does (model_management.py, at its import)
        comfy_args.reserve_vram = card["reserve_vram_gib"]
        mm.EXTRA_RESERVED_VRAM = comfy_args.reserve_vram * 1024 * 1024 * 1024
        if mm.extra_reserved_memory() != card["reserve_bytes"]:
            raise RuntimeError(f"ComfyUI reserves {mm.extra_reserved_memory()} bytes, not {card['reserve_bytes']}")
    if loader == "estimate":
        comfy_args.disable_dynamic_vram = True  # as --disable-dynamic-vram (only main.py reads it)
        core = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
        if comfy.memory_management.aimdo_enabled or core is not comfy.model_patcher.ModelPatcher:
            raise RuntimeError("ComfyUI's dynamic VRAM is on: the estimate loader needs it off")
        print("loader: estimate (ModelPatcher partial load); dynamic VRAM off: "
              "comfy.memory_management.aimdo_enabled=False, CoreModelPatcher=ModelPatcher", flush=True)
    return pack, e2e, cpn


def cap_gpus(card: dict | None) -> None:
    """PyTorch's allocator capped at the card on every GPU (after the model is built: it is built whole on a GPU)."""
    if card is None:
        return
    for i, fraction in enumerate(card["fractions"]):
        torch.cuda.set_per_process_memory_fraction(fraction, device=i)


def estimate_job(presets, name: str):
    """The preset with random weights built on the first GPU (fast), then moved to the CPU under a patcher that loads
    it onto that GPU."""
    import comfy.model_patcher

    job = presets.build_preset(name, device="cuda")
    dev, model = job.model.load_device, job.model.model
    job.model = None
    model.to("cpu")
    model.device = torch.device("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    job.model = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=torch.device("cpu"))
    return job


def cpu_copies(presets, job, name: str) -> list:
    """A separate CPU copy of the model's weights for every other GPU (no second randn: the first's weights copied),
    registered as ComfyUI's MultiGPU clones of it (:func:`multigpu.with_copies`)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    preset, base = presets.MODEL_PRESETS[name], job.model
    sd = base.model.diffusion_model.state_dict()
    out = []
    for i in range(1, torch.cuda.device_count()):
        mc = getattr(sm, preset.model_class)(presets.model_config(preset.model_class, preset.unet))
        mc.set_inference_dtype(torch.bfloat16, None)
        model = mc.get_model({}, device=torch.device("cpu"))
        model.diffusion_model.load_state_dict(sd)
        p = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cuda", i),
                                             offload_device=torch.device("cpu"))
        p.clone_base_uuid = base.clone_base_uuid
        p.is_multigpu_base_clone = True
        out.append(p)
    return out


def dynamic_job(presets, name: str, folder: str):
    """The preset's random weights saved to a file, dynamic VRAM switched on, the file loaded as UNETLoader loads it
    (ComfyUI can reload it for the other GPUs' copies)."""
    import comfy.memory_management
    import comfy.sd
    import comfy.utils

    job = presets.build_preset(name, device="cuda")
    sd = {k: t.detach().to("cpu") for k, t in job.model.model.diffusion_model.state_dict().items()}
    job.model = None
    gc.collect()
    torch.cuda.empty_cache()
    path = os.path.join(folder, f"{name}.safetensors")
    comfy.utils.save_torch_file(sd, path)
    del sd
    presets.enable_dynamic_vram()
    job.model = comfy.sd.load_diffusion_model(path)
    if not (comfy.memory_management.aimdo_enabled and job.model.is_dynamic()):
        raise RuntimeError("dynamic VRAM did not switch on: the model's patcher is not ComfyUI's dynamic one")
    print(f"loader: dynamic (comfy-aimdo), {type(job.model).__name__} from {path} "
          f"({os.path.getsize(path) / GIB:.1f} GiB)", flush=True)
    return job


def row_model(pack, cpn, job, extra: list, spec: dict):
    """The row's model (``-nopin``: without the nodes' pin keeper, nodes/loaded.py)."""
    m = _row_model(pack, cpn, job, extra, spec)
    if not spec.get("pins", True):
        importlib.import_module(pack.__name__ + ".nodes.loaded").keep_pins_on(m, False)
    return m


def _row_model(pack, cpn, job, extra: list, spec: dict):
    """The row's model: with ``extra`` (the estimate loader's CPU copies) as :func:`multigpu.row_model` makes it;
    without, the node makes the copies (ComfyUI's deep clones, reloaded from the model's file)."""
    if spec["mode"] == "1" or extra:
        mode = "1" if spec["mode"] == "1" else f"cp-g{spec['gpus']}" if spec["gpus"] else "cp"
        return MG.row_model(pack, cpn, job, extra, f"{mode}:{spec['backend']}")
    m = job.model if spec["backend"] == "unpatched" else pack.nodes.patch.patch_model(job.model, spec["backend"])
    return cpn.context_parallel(m, gpus=spec["gpus"], cfg_split=False, min_tokens=MG.MIN_TOKENS[0])


LOADS = []  # (device, bytes handed to model_load, bytes loaded before) of every ComfyUI model load since cleared


def record_loads(mm) -> None:
    """Every weight budget ``load_models_gpu`` hands a model appended to :data:`LOADS`: ``LoadedModel.model_load``'s
    ``lowvram_model_memory`` (0: a full load; else the budget less what is already loaded, 0.1 for none) and the
    bytes already loaded."""
    real = mm.LoadedModel.model_load
    if getattr(real, "offload_bench", False):
        return

    def model_load(self, *args, **kwargs):
        extra = float(args[0] if args else kwargs.get("lowvram_model_memory", 0))
        LOADS.append((str(self.device), extra, float(self.model_loaded_memory())))
        return real(self, *args, **kwargs)

    model_load.offload_bench = True
    mm.LoadedModel.model_load = model_load


PINS = collections.Counter()  # ComfyUI's pin_memory / unpin_memory calls since cleared: outcomes and callers


def record_pins(mm) -> None:
    """Count ``comfy.model_management.pin_memory``'s calls by outcome (pinned, refused: already pinned, not
    contiguous, not on the CPU, other) and ``unpin_memory``'s by the ModelPatcher method that called it."""
    real_pin, real_unpin = mm.pin_memory, mm.unpin_memory
    if getattr(real_pin, "offload_bench", False):
        return

    def pin_memory(tensor):
        why = ("already pinned" if tensor.is_pinned() else "not contiguous" if not tensor.is_contiguous()
               else "not on the CPU" if tensor.device.type != "cpu" else None)
        ok = real_pin(tensor)
        PINS["pin: " + ("pinned" if ok else f"refused, {why or 'other'}")] += 1
        return ok

    def unpin_memory(tensor):
        callers = [f.name for f in traceback.extract_stack(limit=6)[:-1]]
        PINS["unpin from " + " < ".join(reversed(callers[-3:]))] += 1
        return real_unpin(tensor)

    pin_memory.offload_bench = True
    mm.pin_memory, mm.unpin_memory = pin_memory, unpin_memory


def budgets(loads) -> dict:
    """The last weight budget per device, in GiB: what was loaded plus what ComfyUI let the load add ("full": no
    limit, it loads the whole model)."""
    out = {}
    for dev, extra, loaded in loads:
        out[dev] = "full" if extra == 0 else round(max(loaded + extra, 0.0) / GIB, 2)
    return out


def patchers(m) -> list:
    """The row's model on each GPU: its own patcher and its MultiGPU copies'."""
    return [m, *m.get_additional_models_with_key("multigpu")]


def gpu_weights(p) -> dict:
    """What the loader did with one GPU's model: ComfyUI's counters and, for a plain patcher, where its tensors are
    (GPU, CPU, CPU pinned: the weights ``cast_bias_weight`` copies in per forward)."""
    model = p.model
    r = {"device": str(p.load_device), "patcher": type(p).__name__, "dynamic": bool(p.is_dynamic()),
         "model_gib": round(p.model_size() / GIB, 3), "loaded_gib": round(p.loaded_size() / GIB, 3),
         "lowvram": bool(getattr(model, "model_lowvram", False)),
         "lowvram_patches": int(getattr(model, "lowvram_patch_counter", 0)),
         "offload_buffer_gib": round(getattr(model, "model_offload_buffer_memory", 0) / GIB, 3),
         "pinned_ram_gib": round(p.pinned_memory_size() / GIB, 3), "ram_gib": round(p.loaded_ram_size() / GIB, 3)}
    if p.is_dynamic():  # comfy-aimdo's weights are not the modules' tensors: its counts only
        r.update(on_gpu_gib=r["loaded_gib"], on_cpu_gib=round(r["model_gib"] - r["loaded_gib"], 3),
                 cpu_pinned_gib=r["pinned_ram_gib"])
        return r
    gpu = cpu = pinned = 0
    for t in [*model.parameters(), *model.buffers()]:
        n = t.numel() * t.element_size()
        if t.device.type == "cuda":
            gpu += n
        else:
            cpu += n
            pinned += n if t.is_pinned() else 0
    r.update(on_gpu_gib=round(gpu / GIB, 3), on_cpu_gib=round(cpu / GIB, 3), cpu_pinned_gib=round(pinned / GIB, 3),
             cast_modules=sum(1 for x in model.modules() if getattr(x, "comfy_cast_weights", False)),
             pinned_tensors=len(p.pinned))
    return r


class CastClock:
    """Host time in ``comfy.ops.cast_bias_weight`` per device while :attr:`on` (:func:`clocked_casts`)."""

    def __init__(self):
        self.on = False
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.lock = threading.Lock()

    def wrap(self, real):
        def cast_bias_weight(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                dev = kwargs.get("device") or (args[3] if len(args) > 3 else None)
                if dev is None:
                    dev = getattr(kwargs.get("input", args[1] if len(args) > 1 else None), "device", "?")
                with self.lock:
                    self.seconds[str(dev)] += dt
                    self.calls[str(dev)] += 1

        return cast_bias_weight

    def result(self) -> dict:
        return {d: {"ms": round(s * 1e3, 1), "calls": self.calls[d]} for d, s in sorted(self.seconds.items())}


@contextlib.contextmanager
def clocked_casts():
    import comfy.ops

    clock, real = CastClock(), comfy.ops.cast_bias_weight
    comfy.ops.cast_bias_weight = clock.wrap(real)  # CastBiasWeightContext looks it up at each call
    try:
        yield clock
    finally:
        comfy.ops.cast_bias_weight = real


def profile_offload(e2e, m, job) -> dict:
    """The second step of a two-step run under torch.profiler (the first loads the model and is left out): per GPU
    :func:`trace_summary`, the host's time in ``cast_bias_weight``, and :func:`multigpu.device_gaps`."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    wall, state = [], []

    with clocked_casts() as clock:
        def cb(i, *_):  # after the first step: start; after the second: stop
            if i in (0, 1):
                torch.cuda.synchronize()
                wall.append(time.perf_counter())
                clock.on = i == 0
                if i == 0:
                    prof.start()
                else:
                    prof.stop()
                state.append(i)

        try:
            e2e._sample(m, job, 2, cb)
        finally:
            if state == [0]:  # the run failed inside the profiled step
                prof.stop()
    if state != [0, 1]:
        raise RuntimeError("the profiled step did not complete")
    with tempfile.TemporaryDirectory(prefix="pa-offload-") as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return {"step_ms": round((wall[1] - wall[0]) * 1e3, 1), "gpus": trace_summary(events), "cast": clock.result(),
            "gaps": MG.device_gaps(prof)}


def copy_kind(name: str) -> str:
    """A profiler memcpy's kind from its name (``Memcpy HtoD (Pinned -> Device)``, ...)."""
    n = name.lower()
    if "htod" in n:
        return "htod_pinned" if "pinned" in n else "htod_pageable" if "pageable" in n else "htod"
    for kind in ("dtoh", "ptop", "dtod"):
        if kind in n:
            return kind
    return "other"


def _merged(intervals) -> list:
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _covered(s: float, e: float, merged: list, starts: list) -> float:
    """How much of [s, e] the merged intervals cover."""
    i, total = max(bisect.bisect_right(starts, s) - 1, 0), 0.0
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(merged[i][1], e) - max(merged[i][0], s))
        i += 1
    return total


def _device_of(ev: dict, args: dict):
    dev = args.get("device", ev.get("pid"))
    return dev if isinstance(dev, int) else int(dev) if isinstance(dev, str) and dev.isdigit() else None


def trace_summary(events: list) -> dict:
    """Per GPU (``cuda:i``), from a torch.profiler chrome trace's events (times in µs): the span of its device work,
    kernel time (the union of kernels), time with no kernel running, every kind of copy (count, GiB, ms), the
    host-to-device copy time with no kernel running, and the host's time in CUDA copy, sync and launch calls (each
    host thread counted for the GPU most of its calls went to)."""
    gpu, corr, runtime = {}, {}, []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, args = str(ev.get("cat", "")).lower(), ev.get("args") or {}
        s = float(ev["ts"])
        e = s + float(ev["dur"])
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            dev = _device_of(ev, args)
            if dev is None:
                continue
            g = gpu.setdefault(dev, {"kernels": [], "copies": [], "all": []})
            g["all"].append((s, e))
            if "correlation" in args:
                corr[args["correlation"]] = dev
            if cat == "kernel":
                g["kernels"].append((s, e))
            elif cat == "gpu_memcpy":
                g["copies"].append((copy_kind(ev.get("name", "")), s, e, int(args.get("bytes", 0))))
        elif cat in ("cuda_runtime", "cuda_driver"):  # driver calls: Triton's launches
            runtime.append(((ev.get("pid"), ev.get("tid")), ev.get("name", ""), e - s, args.get("correlation")))
    out = {f"cuda:{dev}": _gpu_summary(g) for dev, g in sorted(gpu.items())}
    for dev, host in _host_by_device(runtime, corr).items():
        out.setdefault(f"cuda:{dev}", {})["host"] = host
    return out


def _gpu_summary(g: dict) -> dict:
    merged = _merged(g["kernels"])
    starts = [a for a, _ in merged]
    busy = sum(b - a for a, b in merged)
    span = max(e for _, e in g["all"]) - min(s for s, _ in g["all"])
    copies, exposed = {}, 0.0
    for kind, s, e, nbytes in g["copies"]:
        c = copies.setdefault(kind, {"n": 0, "ms": 0.0, "gib": 0.0})
        c["n"] += 1
        c["ms"] += (e - s) / 1e3
        c["gib"] += nbytes / GIB
        if kind.startswith("htod"):
            exposed += (e - s) - _covered(s, e, merged, starts)
    for c in copies.values():
        c["ms"], c["gib"] = round(c["ms"], 1), round(c["gib"], 3)
    return {"span_ms": round(span / 1e3, 1), "kernels": len(g["kernels"]), "kernel_busy_ms": round(busy / 1e3, 1),
            "no_kernel_ms": round((span - busy) / 1e3, 1), "copies": copies,
            "htod_no_kernel_ms": round(exposed / 1e3, 1)}


def _host_by_device(runtime: list, corr: dict) -> dict:
    by_thread = collections.defaultdict(collections.Counter)
    for thread, _, _, c in runtime:
        if c in corr:
            by_thread[thread][corr[c]] += 1
    out = {}
    for thread, name, dur, _ in runtime:
        if not by_thread[thread]:
            continue
        dev = by_thread[thread].most_common(1)[0][0]
        h = out.setdefault(dev, {"threads": set(), "memcpy_ms": 0.0, "sync_ms": 0.0, "launch_ms": 0.0})
        h["threads"].add(thread)
        key = "memcpy_ms" if "Memcpy" in name else "sync_ms" if "Synchronize" in name else \
            "launch_ms" if "Launch" in name else None
        if key:
            h[key] += dur / 1e3
    return {dev: {"threads": len(h["threads"]), **{k: round(v, 1) for k, v in h.items() if k != "threads"}}
            for dev, h in out.items()}


def peaks() -> dict:
    """Per GPU: PyTorch's peak allocated and reserved memory, and the device's use now (comfy-aimdo's weights too)."""
    n = torch.cuda.device_count()
    used = []
    for i in range(n):
        free, total = torch.cuda.mem_get_info(i)
        used.append(round((total - free) / GIB, 2))
    return {"peak_gib": [round(torch.cuda.max_memory_allocated(i) / GIB, 2) for i in range(n)],
            "peak_reserved_gib": [round(torch.cuda.max_memory_reserved(i) / GIB, 2) for i in range(n)],
            "device_used_gib": used}


def run_row(pack, e2e, cpn, job, extra, spec: dict, profiled: bool):
    """One row: (its result, its final latent on the CPU or None)."""
    r, lat, t0 = {"row": spec["row"]}, None, time.perf_counter()
    try:
        PINS.clear()
        m = row_model(pack, cpn, job, extra, spec)
        e2e._sample(m, job, 1)  # warm-up: loads every GPU's model, tunes, loads kernels
        torch.cuda.synchronize()
        r["warmup_s"] = round(time.perf_counter() - t0, 2)
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
        LOADS.clear()
        latent, dt, whole = e2e._timed_sample(m, job)
        r.update(s_per_step=round(dt, 4), s_per_step_whole=round(whole, 4), **peaks(),
                 finite=bool(torch.isfinite(latent).all()), budget_gib=budgets(LOADS),
                 gpus=[gpu_weights(p) for p in patchers(m)], pins=dict(PINS))
        lat = latent.float().cpu()
        if profiled:
            try:
                r["profile"] = profile_offload(e2e, m, job)
            except Exception as e:  # the row's timing stands; the profile says why it is missing
                r["profile_error"] = f"{type(e).__name__}: {e}"[:400]
                r["profile_trace"] = traceback.format_exc()[-3000:]
        del m
    except Exception as e:  # a row's failure is a row of the table
        r["error"] = f"{type(e).__name__}: {e}"[:400]
        r["trace"] = traceback.format_exc()[-3000:]
    r["seconds"] = round(time.perf_counter() - t0, 1)
    gc.collect()
    torch.cuda.empty_cache()
    return r, lat


def compare(rows: list, latents: dict) -> None:
    """Each split row against the same backend on one GPU (s/step ratio, latent rel-L1; a ``-nopin`` row against the
    ``1-nopin`` row where there is one), every row against unpatched on one GPU."""
    by = {r["row"]: r for r in rows if "s_per_step" in r}
    for r in by.values():
        mode, backend = r["row"].split(":", 1)
        one = by.get(f"1-nopin:{backend}") if mode.endswith("-nopin") else None
        one = one or by.get(f"1:{backend}")
        if one is not None and one is not r:
            r["vs_1gpu"] = round(one["s_per_step"] / r["s_per_step"], 3)
            r["whole_vs_1gpu"] = round(one["s_per_step_whole"] / r["s_per_step_whole"], 3)
            if r["row"] in latents and one["row"] in latents:
                r["rel_l1_vs_1gpu"] = MG.rel_l1(latents[r["row"]], latents[one["row"]])
        if r["row"] != "1:unpatched" and "1:unpatched" in latents and r["row"] in latents:
            r["rel_l1_vs_unpatched_1gpu"] = MG.rel_l1(latents[r["row"]], latents["1:unpatched"])


def predict(done: list, profiled: bool) -> float:
    """Seconds the next row is expected to take: the longest row so far (0 before the first), and for a profiled row
    three of the slowest steps and half a minute for the trace."""
    secs = [r["seconds"] for r in done if "seconds" in r]
    if not secs:
        return 0.0
    steps = [r["s_per_step"] for r in done if "s_per_step" in r]
    return max(secs) + ((3 * max(steps, default=0.0) + 30.0) if profiled else 0.0)


def _gib(x, digits: int = 1) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.{digits}f}"


def _per_gpu(r: dict, key: str, digits: int = 1) -> str:
    return " / ".join(_gib(g.get(key), digits) for g in r.get("gpus", [])) or "-"


def render(meta: dict, rows: list) -> str:
    """The md: the rows' table, the profiled steps per GPU, and the rows not run."""
    card = f"a {meta['card_gib']:g} GiB card emulated (ComfyUI reserve {meta['reserve_gib']:.1f} GiB)" \
        if meta.get("card_gib") else "the GPUs as they are"
    lines = [f"{meta['gpus']} · torch {meta['torch']} · ComfyUI {meta['comfyui']} · {meta['date']} · {meta['preset']}, "
             f"CFG {meta['cfg']}, {meta['steps']} steps after a 1-step warm-up, random bf16 weights · loader "
             f"{meta['loader']}, {card}", "",
             "| row | s/step | whole run s/step | vs 1 GPU (same backend) | latent rel-L1 vs 1 GPU | weight budget GiB | "
             "weights on GPU GiB | on CPU GiB | CPU pinned GiB | peak GiB (allocated) | peak GiB (reserved) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r or "error" in r:
            what = f"not run: {r['not_run']}" if "not_run" in r else f"error: {r['error'][:160]}"
            lines.append(f"| {r['row']} | {what} |" + " |" * 9)
            continue
        l1 = r.get("rel_l1_vs_1gpu")
        lines.append(f"| {r['row']} | {r['s_per_step']:.3f} | {r['s_per_step_whole']:.3f} | "
                     f"{'x%.2f' % r['vs_1gpu'] if 'vs_1gpu' in r else '-'} | {'-' if l1 is None else f'{l1:.2e}'} | "
                     f"{' / '.join(_gib(v, 2) for v in r.get('budget_gib', {}).values()) or '-'} | "
                     f"{_per_gpu(r, 'on_gpu_gib')} | {_per_gpu(r, 'on_cpu_gib')} | {_per_gpu(r, 'cpu_pinned_gib')} | "
                     f"{' / '.join(map(str, r.get('peak_gib', []))) or '-'} | "
                     f"{' / '.join(map(str, r.get('peak_reserved_gib', []))) or '-'} |")
    lines += _render_profiles(rows)
    return "\n".join(lines) + "\n"


def _render_profiles(rows: list) -> list:
    failed = [f"- the profile of {r['row']} failed: {r['profile_error']}" for r in rows if "profile_error" in r]
    prof = [r for r in rows if "profile" in r]
    if not prof:
        return ["", *failed] if failed else []
    lines = ["", "One step under torch.profiler, per GPU (ms; HtoD: count, GiB, ms):", "",
             "| row | GPU | step | kernels busy | no kernel | HtoD pinned | HtoD pageable | HtoD with no kernel | "
             "peer copies GiB | host in copy / sync calls | host in cast_bias_weight (calls) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def copies(c):
        return "-" if c is None else f"{c['n']}, {c['gib']:.2f}, {c['ms']:.0f}"

    for r in prof:
        p = r["profile"]
        for dev, g in sorted(p["gpus"].items()):
            c, h, cast = g.get("copies", {}), g.get("host", {}), p.get("cast", {}).get(dev)
            lines.append(f"| {r['row']} | {dev} | {p['step_ms']:.0f} | {g.get('kernel_busy_ms', 0):.0f} | "
                         f"{g.get('no_kernel_ms', 0):.0f} | {copies(c.get('htod_pinned'))} | "
                         f"{copies(c.get('htod_pageable'))} | {g.get('htod_no_kernel_ms', 0):.0f} | "
                         f"{c.get('ptop', {}).get('gib', 0):.2f} | "
                         f"{h.get('memcpy_ms', 0):.0f} / {h.get('sync_ms', 0):.0f} | "
                         f"{'-' if cast is None else '%.0f (%d)' % (cast['ms'], cast['calls'])} |")
    return lines + ([""] + failed if failed else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="wan-14b-720p")
    ap.add_argument("--cfg", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=2, help="at least 2: the step timed is past the loading")
    ap.add_argument("--rows", default="1:sage_fp8_sm90,cp:sage_fp8_sm90,1:unpatched,cp:unpatched")
    ap.add_argument("--profile", default="", help="comma-separated rows to profile one step of")
    ap.add_argument("--card-gib", type=float, default=24.0, help="the card emulated on every GPU (0: none)")
    ap.add_argument("--loader", choices=("estimate", "dynamic"), default="estimate")
    ap.add_argument("--limit", type=float, default=0.0, help="seconds for the whole run (0: none)")
    ap.add_argument("--json"), ap.add_argument("--md")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("patch_attention").setLevel(logging.INFO)  # what the nodes say (the pin keeper's pins)
    try:
        specs = parse_rows(a.rows)
    except ValueError as e:
        ap.error(str(e))
    profiled = {x for x in a.profile.split(",") if x}
    if profiled - {s["row"] for s in specs}:
        ap.error(f"--profile names rows not in --rows: {', '.join(sorted(profiled - {s['row'] for s in specs}))}")
    if a.steps < 2:
        ap.error("--steps must be at least 2")
    n = torch.cuda.device_count()
    if n < max(2 if s["mode"] == "cp" else 1 for s in specs) or any(s["gpus"] > n for s in specs):
        ap.error(f"the rows need more GPUs than the {n} here")
    card = emulated_card([torch.cuda.get_device_properties(i).total_memory for i in range(n)], a.card_gib)
    if a.loader == "dynamic":
        start_aimdo(card)
    pack, e2e, cpn = load(card, a.loader)
    folder = tempfile.mkdtemp(prefix="pa-offload-")
    try:
        return measure(a, specs, profiled, card, pack, e2e, cpn, folder, t_start)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the dynamic loader's file


def measure(a, specs, profiled, card, pack, e2e, cpn, folder, t_start) -> int:
    import comfy.memory_management
    import comfy.model_management as mm
    from comfyui_version import __version__ as comfy_version

    presets = importlib.import_module(pack.__name__ + ".measure.presets")
    record_loads(mm)
    record_pins(mm)
    t0 = time.perf_counter()
    if a.loader == "estimate":
        job = estimate_job(presets, a.preset)
        extra = cpu_copies(presets, job, a.preset) if any(s["mode"] == "cp" for s in specs) else []
    else:
        job, extra = dynamic_job(presets, a.preset, folder), []
        start_aimdo(card)  # dynamic VRAM's own init call reset the NVML setting
    job.cfg, job.steps = a.cfg, a.steps
    cap_gpus(card)
    est = job.model.model.memory_required(list(job.latent.shape))
    meta = {"gpus": " + ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
            "torch": torch.__version__, "comfyui": comfy_version, "date": datetime.date.today().isoformat(),
            "preset": a.preset, "cfg": a.cfg, "steps": a.steps, "loader": a.loader, "card_gib": a.card_gib,
            "reserve_gib": mm.extra_reserved_memory() / GIB, "fractions": card["fractions"] if card else None,
            "dynamic_vram": bool(comfy.memory_management.aimdo_enabled), "smart_memory": not mm.DISABLE_SMART_MEMORY,
            "offload_streams": mm.NUM_STREAMS, "max_pinned_gib": round(mm.MAX_PINNED_MEMORY / GIB, 1),
            "comfy_estimate_gib": round(est / GIB, 2), "minimum_inference_gib": round(mm.minimum_inference_memory() / GIB, 2),
            "build_s": round(time.perf_counter() - t0, 1)}
    print(f"built {a.preset} ({a.loader} loader) in {meta['build_s']:.0f} s; " + json.dumps(meta), flush=True)
    res, latents = {"meta": meta, "rows": []}, {}

    def save():
        MG.write_results(a, res, lambda: render(meta, res["rows"]))

    save()
    for spec in specs:
        left = a.limit - (time.perf_counter() - t_start)
        need = predict(res["rows"], spec["row"] in profiled)
        if a.limit > 0 and need > left:
            r = {"row": spec["row"], "not_run": f"expected {need:.0f} s, {max(left, 0):.0f} s left of --limit {a.limit:g}"}
        else:
            r, lat = run_row(pack, e2e, cpn, job, extra, spec, spec["row"] in profiled)
            if lat is not None:
                latents[spec["row"]] = lat
        res["rows"].append(r)
        compare(res["rows"], latents)
        save()
        print(json.dumps({k: v for k, v in r.items() if k not in ("trace", "profile", "profile_trace", "gpus")}), flush=True)
        if "gpus" in r:
            print("  weights GiB (GPU / CPU / CPU pinned): " + ", ".join(
                f"{g['device']} {g['on_gpu_gib']:.2f} / {g['on_cpu_gib']:.2f} / {g['cpu_pinned_gib']:.2f}"
                for g in r["gpus"]), flush=True)
        for key in ("trace", "profile_trace"):
            if key in r:
                print(r[key][-800:], flush=True)
        if "profile" in r:
            print(f"{r['row']}, one step profiled: " + json.dumps(r["profile"]["gpus"]) + "\n" + r["profile"]["gaps"],
                  flush=True)
    print(render(meta, res["rows"]))
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
