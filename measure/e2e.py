"""End-to-end benchmark: real ComfyUI sampling, unpatched against every backend, ``auto`` and peer patches.

One row per way of running attention, all in one process on one model (the rows' grammar: :mod:`.rows`): the
unpatched model (ComfyUI's own attention); Patch Attention with each backend; ``auto``; ``auto_exact``;
``peer:<kernel>``, an override that calls the kernel straight from ComfyUI's hook with nothing else (what other node
packs do), the yardstick for our dispatch cost; and ComfyUI's own attention nodes (:mod:`.core_nodes`).
Columns: seconds per step (a warm-up run first: compile, tuning and kernel loading stay out), ratio to unpatched,
cosine and relative L1 of the final latent against the unpatched one, PSNR and SSIM of the final latent against the
reference run of the same seed (an fp32 run where the job has one, else the unpatched row) beside the exact-kernel
floor (:mod:`.quality`, :func:`.stats.add_floor`), peak VRAM, and which kernels ran (the table: :mod:`.report`).

Used by the Attention Benchmark (end to end) node on the user's model and by ``bench_e2e.py`` on ComfyUI's model
classes at full size with random weights (:mod:`.presets`).
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..attention import AUTO_EXACT
from ..attention.auto import EXACT_SUFFIX, accuracy
from ..nodes.patch import override_of
from .core_nodes import RowUnavailable
from .quality import compare, psnr
from .rows import COMPILED, CORE, UNPATCHED, build_row, parse
from .stats import add_floor, add_paired

log = logging.getLogger("patch_attention.e2e")


@dataclass
class Job:
    """What to sample: the model and its inputs (ComfyUI's conditioning lists, latent tensor)."""

    model: object
    positive: list
    negative: list
    latent: torch.Tensor
    steps: int = 4
    cfg: float = 1.0
    sampler: str = "euler"
    scheduler: str = "simple"
    seed: int = 0
    label: str = ""
    extra: dict = field(default_factory=dict)
    # a model whose run of the same seed is the quality reference (an fp32 copy); None: the unpatched row is
    reference: object = None
    reference_label: str = "fp32"
    # reads a row's profile=NAME option: profiles(NAME, variant) -> SpargeProfile (None: NAME is a path, read_profile)
    profiles: object = None


def _sample(model, job: Job, steps: int, callback=None):
    import comfy.sample

    noise = torch.randn(job.latent.shape, generator=torch.Generator().manual_seed(job.seed), dtype=torch.float32)
    return comfy.sample.sample(model, noise, steps, job.cfg, job.sampler, job.scheduler, job.positive, job.negative,
                               job.latent, disable_pbar=True, seed=job.seed, callback=callback)


TIMER_KEY = "patch_attention_e2e_timer"


def _timed_sample(model, job: Job):
    """(latent, seconds per step, seconds per step over the whole run).

    The first: the median interval between the sampler's step callbacks (device synced at each), so model loading,
    conditioning setup and the first step are not counted (in a run of 2-3 steps, every step counted is past a sparse
    schedule's 20 % start).
    The second: from the sampler's start (a ``SAMPLER_SAMPLE`` wrapper, after loading and setup) to its last step,
    over the number of steps: the dense steps before a sparse schedule's start included."""
    import comfy.patcher_extension as pe

    marks, start = [], []

    def cb(*_):
        _sync()
        marks.append(time.perf_counter())

    def begin(executor, *args, **kwargs):
        _sync()
        start.append(time.perf_counter())
        return executor(*args, **kwargs)

    model.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, TIMER_KEY, begin)
    try:
        _sync()
        marks.append(time.perf_counter())
        lat = _sample(model, job, job.steps, cb)
    finally:
        model.remove_wrappers_with_key(pe.WrappersMP.SAMPLER_SAMPLE, TIMER_KEY)
    steps = [b - a for a, b in zip(marks[1:], marks[2:])] or [b - a for a, b in zip(marks, marks[1:])]
    return lat, statistics.median(steps), (marks[-1] - start[0]) / job.steps



def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernels_that_ran(model) -> str:
    ov = override_of(model)
    if ov is None:
        return ""
    calls = ov.stats.calls
    total = sum(calls.values()) or 1
    return ", ".join(f"{n} {100 * c / total:.0f}%" for n, c in calls.most_common(3))


def profile_one_step(model, job: Job, top: int = 14, step: int | None = None) -> dict:
    """One step of a ``job.steps``-step run under torch.profiler: by default the last (the step the timing measures
    once past the sparse schedule's start), or ``step`` (>= 1).  ``{"step": i, "wall_ms": its time between the
    synced callbacks, "device_ms": total, "attention_ms": attention's kernels, "top": [(name, ms, calls)]}``, the
    ``top`` device kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    last = job.steps - 1 if step is None else min(max(int(step), 1), job.steps - 1)
    wall = []

    def cb(i, *_):
        if i == last - 1:
            _sync()
            wall.append(time.perf_counter())
            prof.start()
        elif i == last:
            _sync()
            wall.append(time.perf_counter())
            prof.stop()

    if last <= 0:
        prof.start()
        _sample(model, job, 1)
        _sync()
        prof.stop()
    else:
        _sample(model, job, job.steps, cb)
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    # kernels only: the ops above them would count their time twice; "Command Buffer Full" is the launch queue's
    # stall (the host waiting on the device), not device work
    kernels = [e for e in rows if e.device_type.name == "CUDA" and e.key != "Command Buffer Full"]
    ms = lambda es: round(sum(e.self_device_time_total for e in es) / 1000, 1)  # noqa: E731
    return {"step": max(last, 0), "wall_ms": round((wall[1] - wall[0]) * 1000, 1) if len(wall) == 2 else None,
            "device_ms": ms(kernels), "attention_ms": ms(e for e in kernels if ATTENTION_KERNEL.search(e.key)),
            "top": [(e.key[:90], round(e.self_device_time_total / 1000, 3), e.count) for e in rows[:top]]}


# device kernels that belong to an attention call, by name: the kernels of SDPA (flash, cuDNN, efficient), Sage and
# SpargeAttn (their quantization, mean, pooling and layout kernels too), comfy-kitchen's int8 and Sol-Attn
ATTENTION_KERNEL = re.compile(r"attn|attention|flash|fmha|sdpa|sol_|quant|pool_sim|sub_mean|mean_scale|transpose_pad",
                              re.IGNORECASE)

def measure(job: Job, rows: list[str], *, compile: bool = False, warmup_steps: int = 2, progress=None,
            profile: bool = False, profile_step: int | None = None, rounds: int = 1, stat: str = "median",
            final_latents: dict | None = None) -> list[dict]:
    """Sample ``job`` with each row, unpatched first; returns one dict per row.

    Every row's model is built and warmed up first (loading, compiling, tuning ``auto``, the first call of each kernel:
    two steps, so that the warm-up reaches past the sparse schedule's start too); then ``rounds`` rounds
    each time every row once, in turn, so slow drift of the machine (clocks, other tenants) spreads over all rows
    instead of landing on a few.  s/step is the median over rounds of each run's median step, or with ``stat="min"``
    their minimum (on a shared host, contention only adds time: with enough rounds the minimum is the stable
    estimate of a host-bound row).  ``profile``: also one profiled step per row (the run's last, or ``profile_step``;
    top device kernels, in ``row["profile"]``).  ``final_latents``: a dict that receives each row's final latent (float32,
    on the CPU, by the row's name) for :mod:`.pictures`."""
    if rows[0] != UNPATCHED:
        rows = [UNPATCHED, *[r for r in rows if r != UNPATCHED]]
    out_rows, models, notes = _warm_rows(job, rows, compile, warmup_steps, rounds)
    runs = _timed_rounds(job, models, rounds)
    ref = runs.latents.get(UNPATCHED)
    quality_ref, quality_label = reference_latent(job, ref)
    pick = {"median": statistics.median, "min": min}[stat]
    for r, row in zip(out_rows, rows):
        if row not in models:
            continue
        m, lat = models[row], runs.latents[row].float()
        if final_latents is not None:
            final_latents[r["row"]] = lat.detach().cpu()
        _timings(r, runs, row, pick, stat)
        _errors(r, job, row, lat, ref, quality_ref, quality_label)
        if profile:
            r["profile"] = profile_one_step(m, job, step=profile_step)
        r["kernels"] = kernels_that_ran(m) or notes.get(row) or ""
        r.update(selector_choices(m))
        if progress is not None:
            progress(r)
    models.clear()
    _ratios(out_rows)
    if rounds >= 3:
        add_paired(out_rows, rows, runs.times)
    add_floor(out_rows)
    return out_rows


def _warm_rows(job: Job, rows: list[str], compile: bool, warmup_steps: int, rounds: int):
    """Each row's model built and warmed up: (result dicts, {row: model} of those that ran, {row: note})."""
    out_rows, models, notes = [], {}, {}
    for row in rows:
        r = {"row": row + (COMPILED if compile else ""), "preset": job.label, "steps": job.steps, "compile": compile,
             "rounds": rounds}
        try:
            m, notes[row] = build_row(job.model, row, job.profiles)
            if parse(row).role == CORE:
                r["note"] = notes[row]
            if compile:
                from comfy_api.torch_helpers import set_torch_compile_wrapper

                set_torch_compile_wrapper(m, backend="inductor")
            t0 = time.perf_counter()
            _sample(m, job, warmup_steps)  # loads, compiles, tunes auto, loads kernels
            _sync()
            r["warmup_s"] = round(time.perf_counter() - t0, 3)
            models[row] = m
        except RowUnavailable as e:  # not on this ComfyUI or machine: said in the row
            r["error"] = str(e)
            log.info("e2e %s %s: %s", job.label, row, e)
        except Exception as e:  # one row's failure is a row in the table, not the end of the benchmark
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("e2e %s %s: %s", job.label, row, r["error"], exc_info=True)
        out_rows.append(r)
    return out_rows, models, notes


@dataclass
class Runs:
    """What the timed rounds measured, per row: s/step and whole-run s/step of each round, the last final latent, the
    peak memory (GiB, CUDA only)."""

    times: dict
    wholes: dict
    latents: dict = field(default_factory=dict)
    peaks: dict = field(default_factory=dict)


def _timed_rounds(job: Job, models: dict, rounds: int) -> Runs:
    runs = Runs({row: [] for row in models}, {row: [] for row in models})
    order = list(models.items())
    for rnd in range(rounds):
        for row, m in (order if rnd % 2 == 0 else order[::-1]):  # every other round reversed: no row always first
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            runs.latents[row], dt, whole = _timed_sample(m, job)
            runs.times[row].append(dt)
            runs.wholes[row].append(whole)
            if torch.cuda.is_available():
                runs.peaks[row] = max(runs.peaks.get(row, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    return runs


def _timings(r: dict, runs: Runs, row: str, pick, stat: str) -> None:
    r["s_per_step"] = pick(runs.times[row])
    r["stat"] = stat
    r["s_per_step_runs"] = [round(t, 5) for t in runs.times[row]]
    r["s_per_step_whole"] = round(pick(runs.wholes[row]), 5)
    r["s_per_step_whole_runs"] = [round(t, 5) for t in runs.wholes[row]]
    if row in runs.peaks:
        r["peak_gib"] = round(runs.peaks[row], 2)


def _errors(r: dict, job: Job, row: str, lat, ref, quality_ref, quality_label) -> None:
    """The final latent against the unpatched one (cos, rel-L1, PSNR) and against the quality reference (PSNR, SSIM;
    of the decoded frames too where the job has a decoder)."""
    r["finite"] = bool(torch.isfinite(lat).all())
    r["cos"], r["rel_l1"] = accuracy(lat, ref if ref is not None else lat)
    r["exact"] = parse(row).exact
    if ref is not None:  # two exact kernels' outputs against each other
        r["psnr_vs_unpatched"] = psnr(lat, ref.float())
    if quality_ref is not None:
        r.update(compare(lat, quality_ref))
        r["reference"] = quality_label
        decode = job.extra.get("decode")
        if decode is not None:  # the model's own decoder (the stand-in's codec): PSNR/SSIM of the frames too
            fr = compare(decode(lat), decode(quality_ref))
            r["psnr_frames"], r["ssim_frames"] = fr["psnr"], fr["ssim"]


def selector_choices(model) -> dict:
    """What each selector of ``model``'s override chose, ``{"auto": ..., "auto_exact": ...}`` (an exact one: its dense
    calls); empty for a model without Patch Attention."""
    ov = override_of(model)
    decisions = ov.stats.decisions if ov is not None else {}
    out = {}
    for name, exact in (("auto", False), (AUTO_EXACT, True)):
        chosen = {str(v).split(" [")[0] for sig, v in decisions.items() if sig.endswith(EXACT_SUFFIX) == exact}
        if chosen:
            out[name] = "; ".join(sorted(chosen))
    return out


def _ratios(out_rows) -> None:
    unp = next((x for x in out_rows if x["row"].startswith(UNPATCHED) and "s_per_step" in x), None)
    for x in out_rows:
        if unp and "s_per_step" in x:
            x["vs_unpatched"] = round(unp["s_per_step"] / x["s_per_step"], 3)
            x["whole_vs_unpatched"] = round(unp["s_per_step_whole"] / x["s_per_step_whole"], 3)


def reference_latent(job: Job, unpatched):
    """(latent, label) the rows' PSNR/SSIM are taken against: the run of ``job.reference`` (an fp32 copy of the model)
    with the same seed and steps where the job has one, else the unpatched row's."""
    if job.reference is None:
        return unpatched, UNPATCHED
    try:
        lat = _sample(job.reference, job, job.steps)
        _sync()
    except Exception as e:  # the rows keep a reference: the unpatched one, and the table's header says which
        log.warning("e2e %s: the %s reference run failed (%s: %s); PSNR/SSIM against the unpatched row instead",
                    job.label, job.reference_label, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return unpatched, UNPATCHED
    return lat.float(), job.reference_label

