"""End-to-end benchmark: real ComfyUI sampling, unpatched against every backend, ``auto`` and peer patches.

One row per way of running attention, all in one process on one model: the unpatched model (ComfyUI's own
attention); Patch Attention with each backend; ``auto``; ``auto_exact``; and ``peer:<kernel>``, an override that calls the kernel
straight from ComfyUI's hook with nothing else (what other node packs do), the yardstick for our dispatch cost.
Columns: seconds per step (a warm-up run first: compile, tuning and kernel loading stay out), ratio to unpatched,
cosine and relative L1 of the final latent against the unpatched one, PSNR and SSIM of the final latent against the
reference run of the same seed (an fp32 run where the job has one, else the unpatched row) beside the exact-kernel
floor (:mod:`.quality`), peak VRAM, and which kernels ran.  A row may carry a sparse kernel's options or a
tuned profile: ``kitchen_sol[tau=2.0]``, ``sparge[cdfthreshd=0.95 simthreshd1=0.5]``, ``sparge[profile=PATH]`` (the node: a file name in
models/sparge_profiles, read through its confined loader).

Used by the Attention Benchmark (end to end) node on the user's model and by ``bench_e2e.py`` on ComfyUI's model
classes at full size with random weights (``PRESETS``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from ..attention import AUTO_EXACT, REGISTRY
from ..attention.auto import EXACT_SUFFIX, accuracy
from ..nodes.patch import SPARSE_START, SparseSettings, override_of, patch_model
from .quality import AT_FLOOR, compare, psnr, verdict

log = logging.getLogger("patch_attention.e2e")

UNPATCHED = "unpatched"
PEER = "peer:"


# ---------------------------------------------------------------- rows

def peer_override(backend_name: str):
    """An override that calls one kernel straight from ComfyUI's hook, as other packs patch: a view to the kernel's
    layout, the call, a reshape back; ComfyUI's own function for a call shape the kernel refused once."""
    b = REGISTRY.get(backend_name)
    refused = set()

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        key = (q.shape, k.shape)
        if mask is None and key not in refused:
            try:
                return _call(q, k, v, heads, skip_reshape, skip_output_reshape)
            except Exception:
                refused.add(key)
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)

    def _call(q, k, v, heads, skip_reshape, skip_output_reshape):
        bsz = q.shape[0]
        if skip_reshape:
            layout, d = "HND", q.shape[-1]
        else:
            d = q.shape[-1] // heads
            q, k, v = (t.view(bsz, -1, heads, d) for t in (q, k, v))
            layout = "NHD"
        kl = layout if layout in b.layouts else b.layouts[0]
        if kl != layout:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = b.fn(q, k, v, layout=kl, mask=None, scale=d ** -0.5, opts=b.options)
        if isinstance(out, tuple):
            out = out[0]
        if kl == "NHD":
            return out.transpose(1, 2) if skip_output_reshape else out.reshape(bsz, -1, heads * out.shape[-1])
        return out if skip_output_reshape else out.transpose(1, 2).reshape(bsz, -1, heads * out.shape[-1])

    return override


NO_NAN_NET = "/no-nan-net"  # row suffix: the backend with its NaN net off, to measure what the net costs
CORE_INT8 = "core:kitchen-int8"  # ComfyUI's Model Attention Backend node, "comfy kitchen attention"
CORE_SOL = "core:sol-attn"  # ComfyUI's Model Sparse Attention node (Nov 2026), its defaults
CORE_ROWS = (CORE_INT8, CORE_SOL)
# Model Sparse Attention's defaults (comfy_extras/nodes_sparse_attention.py): method sol-attn, tau 1.3,
# start_percent 0.2, end_percent 1.0, min_tokens 12288, extra_tokens 256, no dense blocks
CORE_SOL_DEFAULTS = {"tau": 1.3, "start_percent": 0.2, "end_percent": 1.0, "min_tokens": 12288, "extra_tokens": 256}


def core_row_model(model, row: str):
    """``model`` as ComfyUI's own attention nodes leave it: ``(clone, label)``. The node itself where this ComfyUI has
    it; otherwise the same kernel call with the node's defaults, and the label says so."""
    if row == CORE_INT8:
        import comfy.ldm.modules.attention as ca

        if not getattr(ca, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
            raise RuntimeError("comfy-kitchen's int8 attention is not available here (ComfyUI >= 0.33 and its CUDA kernel)")
        try:
            from comfy_extras.nodes_model_advanced import ModelAttentionBackend
        except ImportError:  # the node module imports ComfyUI's whole node API (video nodes: PyAV)
            m = model.clone()  # the node's own body
            m.set_model_optimized_attention(ca.get_attention_function("comfy_kitchen_int8"))
            return m, "Model Attention Backend's call (its node module is not importable here)"
        return ModelAttentionBackend().patch(model, "comfy kitchen attention")[0], "Model Attention Backend node"
    try:
        from comfy_extras.nodes_sparse_attention import apply_block_sparse_attention
    except ImportError:
        apply_block_sparse_attention = None
    d = CORE_SOL_DEFAULTS
    if apply_block_sparse_attention is not None:
        m = apply_block_sparse_attention(model, tau=d["tau"], topk_ratio=0.0, vsa=False, start_percent=d["start_percent"],
                                         end_percent=d["end_percent"], min_tokens=d["min_tokens"], dense_blocks=set(),
                                         sink_conditioning="exact_kv_and_rows", extra_tokens=d["extra_tokens"],
                                         verbose=False)
        return m, "Model Sparse Attention node"
    m = model.clone()
    ms = m.get_model_object("model_sampling")
    window = (float(ms.percent_to_sigma(d["start_percent"])), float(ms.percent_to_sigma(d["end_percent"])))
    topts = m.model_options.setdefault("transformer_options", {})
    topts["optimized_attention_override"] = core_sol_override(topts.get("optimized_attention_override"), window)
    return m, "Model Sparse Attention's call with its defaults (this ComfyUI has no such node)"


def core_sol_override(previous, window):
    """Model Sparse Attention's override for generic models, as its node builds it with the defaults (its
    ``make_attention_override``): dense outside the sigma window, below min_tokens, for masks and calls the kernel
    cannot take (to ``previous`` or ComfyUI's function); else ``comfy_kitchen.sol_attn`` on (B, T, H, 128) views."""
    import comfy_kitchen as ck

    d = CORE_SOL_DEFAULTS
    start, end = window

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        transformer_options = kwargs.get("transformer_options") or {}

        def dense():
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)

        if mask is not None:
            return dense()
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0])  # the node reads the sigma on every call
            if sigma > start or sigma < end:
                return dense()
        if tokens < d["min_tokens"]:
            return dense()
        if skip_reshape:
            b, _, _, dim_head = q.shape
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:
            b, _, dim_head = q.shape
            dim_head //= heads
            qs, ks, vs = (t.view(b, -1, heads, dim_head) for t in (q, k, v))
        if (q.device.type != "cuda" or not ck.sol_attn_is_available(q.device) or dim_head != 128
                or qs.shape != ks.shape or qs.shape != vs.shape or q.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
            return dense()
        if q.dtype == torch.float32:
            qs, ks, vs = (t.to(torch.bfloat16) for t in (qs, ks, vs))
        out = ck.sol_attn(qs, ks, vs, tau=d["tau"], scale=kwargs.get("scale"), sink_blocks=[0, 0], sink_q=[0, 0],
                          topk_ratio=0.0, token_aug=d["extra_tokens"]).to(q.dtype)
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(b, -1, heads * dim_head)

    return override


ROW_OPTIONS = re.compile(r"^([A-Za-z0-9_]+)\[([^\[\]]*)\]$")


def parse_row(row: str) -> tuple[str, dict]:
    """``"kitchen_sol[tau=2.0 extra_tokens=128]"`` -> ("kitchen_sol", {"tau": 2.0, "extra_tokens": 128}); a row without
    brackets -> (row, {}).  ``profile=NAME`` names a tuned per-layer profile (Tune Sparse Attention's file in
    models/sparge_profiles)."""
    m = ROW_OPTIONS.match(row.strip())
    if m is None:
        return row, {}
    opts = {}
    for part in m.group(2).split():
        key, eq, val = part.partition("=")
        if not eq or not key or not val:
            raise ValueError(f"row {row!r}: cannot read {part!r}; use name[key=value key=value]")
        if key == "profile":
            opts[key] = val
            continue
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"row {row!r}: {key}={val!r} is not a number") from None
        opts[key] = int(num) if num.is_integer() and key in ("extra_tokens", "min_tokens", "pvthreshd") else num
    return m.group(1), opts


def read_profile(path: str, variant: str):
    """A row's ``profile=PATH``: the per-layer profile Tune Sparse Attention wrote at PATH, which must be ``variant``'s
    (None for an empty PATH)."""
    from ..attention.sparge_profile import SpargeProfile

    if not path:
        return None
    prof = SpargeProfile.load(path)
    if prof.variant != variant:
        raise ValueError(f"profile {path} was tuned for {prof.variant}, the row selects {variant}")
    return prof


def row_settings(backend: str, opts: dict, profiles=None):
    """The sparse-attention settings a row's options make (what a SpargeAttn / Sol-Attn Settings node would give).
    ``profiles(name, variant)`` reads a ``profile=`` option (default :func:`read_profile`: the name is a path)."""
    from ..attention.sparge_profile import VARIANTS, check_thresholds, default_options

    if backend not in VARIANTS:
        raise ValueError(f"row options are for the sparse backends ({', '.join(VARIANTS)}), not {backend}")
    rest = {k: v for k, v in opts.items() if k != "profile"}
    options = check_thresholds(backend, {**default_options(backend), **rest})
    return SparseSettings(backend, options, (profiles or read_profile)(opts.get("profile", ""), backend))


def make_row_model(model, row: str, profiles=None):
    """A clone of ``model`` for ``row``: unpatched, a backend, auto or auto_exact (Patch Attention, with the node's defaults),
    ``<backend>[options]`` (a sparse backend with its options or a tuned profile, read by ``profiles``, see
    :func:`row_settings`), ``<backend>/no-nan-net``, peer:<kernel>, or a core row (ComfyUI's own attention nodes)."""
    base, opts = parse_row(row)
    if opts:
        return patch_model(model, base, auto_retune=True, sparse=row_settings(base, opts, profiles),
                           sparse_start_percent=SPARSE_START)
    if row == UNPATCHED:
        return model.clone()
    if row in CORE_ROWS:
        return core_row_model(model, row)[0]
    if row.startswith(PEER):
        m = model.clone()
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = peer_override(row[len(PEER):])
        return m
    if row.endswith(NO_NAN_NET):
        return patch_model(model, row[: -len(NO_NAN_NET)], auto_retune=True, check_finite=False,
                           sparse_start_percent=SPARSE_START)
    return patch_model(model, row, auto_retune=True, sparse_start_percent=SPARSE_START)


def core_rows_here() -> list[str]:
    """The core rows this ComfyUI and comfy-kitchen can run."""
    rows = []
    try:
        import comfy.ldm.modules.attention as ca

        if getattr(ca, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
            rows.append(CORE_INT8)
    except ImportError:
        pass
    if REGISTRY.get("kitchen_sol").available:
        rows.append(CORE_SOL)
    return rows


def rows_from_text(text: str, peers: bool = True) -> list[str]:
    """The rows a comma-separated list names (the node's ``rows`` input), checked; ``all`` or nothing: :func:`default_rows`."""
    chosen = [r.strip() for r in text.replace(";", ",").split(",") if r.strip() and r.strip() != "all"]
    if chosen:
        known = set(default_rows(peers=True)) | {*REGISTRY.names(), *CORE_ROWS}
        unknown = [r for r in chosen if parse_row(r)[0] not in known
                   and not (r.startswith(PEER) and r[len(PEER):] in REGISTRY)]
        if unknown:
            raise ValueError(f"unknown row(s) {', '.join(unknown)}; use unpatched, auto, auto_exact, a backend name, "
                             f"peer:<backend>, {CORE_INT8} or {CORE_SOL}")
    return chosen or default_rows(peers=peers)


def default_rows(peers=True) -> list[str]:
    """Every backend usable here (but the slow math reference), auto, auto_exact, a peer row per non-SDPA kernel, and
    the rows of ComfyUI's own attention nodes."""
    usable = [b.name for b in REGISTRY.backends() if b.available and b.timed]
    rows = [UNPATCHED, *usable, "auto", AUTO_EXACT, *core_rows_here()]
    if peers:
        rows += [PEER + n for n in usable if REGISTRY.get(n).family != "sdpa"]
    return rows


# ---------------------------------------------------------------- measuring

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


def median_ci(xs, conf: float = 0.95):
    """(median, low, high): the median of ``xs`` and a distribution-free interval for it (order statistics whose ranks
    the binomial(n, 1/2) distribution puts around the middle with at least ``conf`` coverage; the whole range when n
    is too small for that)."""
    xs = sorted(xs)
    n = len(xs)
    med = statistics.median(xs)
    lo, tail = 0, 0.0  # largest lo with P(Binom(n, 1/2) < lo + 1) <= (1 - conf) / 2, counting ranks from 0
    for j in range(n // 2):
        tail += math.comb(n, j) / 2**n
        if tail > (1 - conf) / 2:
            break
        lo = j + 1
    lo = min(lo, (n - 1) // 2)
    return (med, xs[lo - 1], xs[n - lo]) if lo else (med, xs[0], xs[-1])


def paired_ratio(ref_times, row_times, conf: float = 0.95):
    """Speed of a row against a reference row (>1: faster) from the rounds they shared, each ratio taken within one
    round (rows run in turn, so drift of a shared machine cancels): (median, low, high) of ``ref / row``."""
    return median_ci([a / b for a, b in zip(ref_times, row_times)], conf)


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
    pick = {"median": statistics.median, "min": min}[stat]
    if rows[0] != UNPATCHED:
        rows = [UNPATCHED, *[r for r in rows if r != UNPATCHED]]
    out_rows, models = [], {}
    for row in rows:
        r = {"row": row + (" +compile" if compile else ""), "preset": job.label, "steps": job.steps, "compile": compile,
             "rounds": rounds}
        try:
            if row in CORE_ROWS:
                m, r["note"] = core_row_model(job.model, row)
            else:
                m = make_row_model(job.model, row, job.profiles)
            if compile:
                from comfy_api.torch_helpers import set_torch_compile_wrapper

                set_torch_compile_wrapper(m, backend="inductor")
            t0 = time.perf_counter()
            _sample(m, job, warmup_steps)  # loads, compiles, tunes auto, loads kernels
            _sync()
            r["warmup_s"] = round(time.perf_counter() - t0, 3)
            models[row] = m
        except Exception as e:  # one row's failure is a row in the table, not the end of the benchmark
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("e2e %s %s: %s", job.label, row, r["error"], exc_info=True)
        out_rows.append(r)
    times = {row: [] for row in models}
    wholes = {row: [] for row in models}
    latents, peaks = {}, {}
    order = list(models.items())
    for rnd in range(rounds):
        for row, m in (order if rnd % 2 == 0 else order[::-1]):  # every other round reversed: no row always first
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            latents[row], dt, whole = _timed_sample(m, job)
            times[row].append(dt)
            wholes[row].append(whole)
            if torch.cuda.is_available():
                peaks[row] = max(peaks.get(row, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    ref = latents.get(UNPATCHED)
    quality_ref, quality_label = reference_latent(job, ref)
    for r, row in zip(out_rows, rows):
        if row not in models:
            continue
        m, lat = models[row], latents[row].float()
        if final_latents is not None:
            final_latents[r["row"]] = lat.detach().cpu()
        r["s_per_step"] = pick(times[row])
        r["stat"] = stat
        r["s_per_step_runs"] = [round(t, 5) for t in times[row]]
        r["s_per_step_whole"] = round(pick(wholes[row]), 5)
        r["s_per_step_whole_runs"] = [round(t, 5) for t in wholes[row]]
        if row in peaks:
            r["peak_gib"] = round(peaks[row], 2)
        r["finite"] = bool(torch.isfinite(lat).all())
        r["cos"], r["rel_l1"] = accuracy(lat, ref if ref is not None else lat)
        r["exact"] = is_exact_row(row)
        if ref is not None:  # two exact kernels' outputs against each other
            r["psnr_vs_unpatched"] = psnr(lat, ref.float())
        if quality_ref is not None:
            r.update(compare(lat, quality_ref))
            r["reference"] = quality_label
            decode = job.extra.get("decode")
            if decode is not None:  # the model's own decoder (the stand-in's codec): PSNR/SSIM of the frames too
                fr = compare(decode(lat), decode(quality_ref))
                r["psnr_frames"], r["ssim_frames"] = fr["psnr"], fr["ssim"]
        if profile:
            r["profile"] = profile_one_step(m, job, step=profile_step)
        r["kernels"] = kernels_that_ran(m) or r.get("note") or ("ComfyUI attention" if row == UNPATCHED else row[len(PEER):])
        ov = override_of(m)
        decisions = ov.stats.decisions if ov is not None else {}
        for name, exact in (("auto", False), (AUTO_EXACT, True)):  # what each selector chose (an exact one: dense calls)
            chosen = {str(v).split(" [")[0] for sig, v in decisions.items() if sig.endswith(EXACT_SUFFIX) == exact}
            if chosen:
                r[name] = "; ".join(sorted(chosen))
        if progress is not None:
            progress(r)
    models.clear()
    unp = next((x for x in out_rows if x["row"].startswith(UNPATCHED) and "s_per_step" in x), None)
    for x in out_rows:
        if unp and "s_per_step" in x:
            x["vs_unpatched"] = round(unp["s_per_step"] / x["s_per_step"], 3)
            x["whole_vs_unpatched"] = round(unp["s_per_step_whole"] / x["s_per_step_whole"], 3)
    if rounds >= 3:
        add_paired(out_rows, rows, times)
    add_floor(out_rows)
    return out_rows


def _row_kernel(row: str) -> str:
    """The kernel a row runs: its name without " +compile", the NaN net's suffix or the peer prefix."""
    base = row.replace(" +compile", "")
    if base.endswith(NO_NAN_NET):
        base = base[: -len(NO_NAN_NET)]
    if base.startswith(PEER):
        base = base[len(PEER):]
    return base


def is_exact_row(row: str) -> bool:
    """A row whose attention is exact (half-precision rounding only): unpatched, an exact backend, its peer."""
    base = _row_kernel(row)
    if base == UNPATCHED:
        return True
    return base in REGISTRY and not REGISTRY.get(base).quantized


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


def add_floor(out_rows) -> None:
    """The exact-kernel floor beside every row's PSNR: against an fp32 reference, the worst PSNR of the exact rows
    (what half-precision rounding alone costs); against the unpatched row, the PSNR of the other exact rows (two exact
    kernels' difference).  Each row gets ``floor_psnr`` and ``quality`` (:func:`.quality.verdict`)."""
    measured = [r for r in out_rows if "psnr" in r]
    if not measured:
        return
    ref_is_row = measured[0].get("reference") == UNPATCHED
    exact = [r for r in measured if r.get("exact") and not (ref_is_row and r["row"].startswith(UNPATCHED))]
    floor = min((r["psnr"] for r in exact), default=None)
    for r in measured:
        r["floor_psnr"] = floor
        r["quality"] = verdict(r["psnr"], floor) if floor is not None else "no exact row besides the reference: no floor"


def add_paired(out_rows, rows, times) -> None:
    """Per-round paired ratios with 95 % intervals (``paired``): every row against unpatched; a Patch Attention kernel
    row against its peer; ``auto`` against the fastest of unpatched and the explicit kernel rows, ``auto_exact`` against
    the fastest of unpatched and the explicit exact kernel rows (``best_row``)."""
    explicit = [r for r in times if r not in (UNPATCHED, "auto", AUTO_EXACT) and not r.startswith(PEER)
                and not r.endswith(NO_NAN_NET) and r not in CORE_ROWS]
    exact = [r for r in explicit if r in REGISTRY and not REGISTRY.get(r).quantized]
    for x, row in zip(out_rows, rows):
        if row not in times or UNPATCHED not in times:
            continue
        p = {"vs_unpatched": paired_ratio(times[UNPATCHED], times[row])}
        if PEER + row in times:
            p["vs_peer"] = paired_ratio(times[PEER + row], times[row])
        if row in ("auto", AUTO_EXACT):  # the row with the best median (a per-round minimum would favour many rows)
            best = min([UNPATCHED, *(explicit if row == "auto" else exact)], key=lambda r: statistics.median(times[r]))
            p["vs_best"] = paired_ratio(times[best], times[row])
            x["best_row"] = best
        x["paired"] = {k: [round(v, 4) for v in val] for k, val in p.items()}


def targets(rows: list[dict], tolerance: float = 0.02) -> list[dict]:
    """The pack's promises against ComfyUI's own attention nodes, read from one run's rows (s/step and the final
    latent's rel-L1 against unpatched): ``auto`` at least as fast as every core row whose error it does not exceed;
    ``auto`` within ``tolerance`` of the fastest row at (or under) its error; ``auto_exact`` within ``tolerance`` of
    the fastest explicit exact kernel row and of unpatched; ``kitchen_sol`` within ``tolerance`` of core:sol-attn (the
    same kernel, the same defaults)."""
    ok = {r["row"].replace(" +compile", ""): r for r in rows if "s_per_step" in r}
    out = []
    auto = ok.get("auto")
    if auto is not None:
        for core in CORE_ROWS:
            c = ok.get(core)
            if c is None:
                continue
            applies = auto["rel_l1"] <= c["rel_l1"] + 1e-9
            ratio = c["s_per_step"] / auto["s_per_step"]
            out.append({"target": f"auto >= {core} (where auto's error <= its error)", "ratio": round(ratio, 3),
                        "applies": applies, "met": (ratio >= 1.0) if applies else None,
                        "detail": f"auto rel-L1 {auto['rel_l1']:.4f} vs {c['rel_l1']:.4f}"})
        peers = [r for name, r in ok.items() if name != "auto" and r["rel_l1"] <= auto["rel_l1"] + 1e-9]
        if peers:
            best = min(peers, key=lambda r: r["s_per_step"])
            out.append(_within(f"auto within {tolerance:.0%} of the best row at its error ({best['row']})", auto, best,
                               tolerance, f"{len(peers)} rows with rel-L1 <= {auto['rel_l1']:.4f}"))
    ax = ok.get(AUTO_EXACT)
    if ax is not None:
        exact = [r for name, r in ok.items() if name in REGISTRY and not REGISTRY.get(name).quantized]
        for label, ref in (("the best exact row", min(exact, key=lambda r: r["s_per_step"]) if exact else None),
                           ("unpatched", ok.get(UNPATCHED))):
            if ref is not None:
                out.append(_within(f"auto_exact within {tolerance:.0%} of {label} ({ref['row']})", ax, ref, tolerance,
                                   f"auto_exact rel-L1 {ax['rel_l1']:.4f} vs {ref['rel_l1']:.4f}"))
    sol, core = ok.get("kitchen_sol"), ok.get(CORE_SOL)
    if sol is not None and core is not None:
        out.append(_within(f"kitchen_sol within {tolerance:.0%} of {CORE_SOL}", sol, core, tolerance,
                           f"rel-L1 {sol['rel_l1']:.4f} vs {core['rel_l1']:.4f}"))
    return out


def _within(target: str, row: dict, ref: dict, tolerance: float, detail: str) -> dict:
    """The target "``row`` at most ``tolerance`` slower per step than ``ref``"."""
    ratio = ref["s_per_step"] / row["s_per_step"]
    return {"target": target, "ratio": round(ratio, 3), "applies": True, "met": ratio >= 1 - tolerance, "detail": detail}


def _ci(p) -> str:
    return f"×{p[0]:.3f} [{p[1]:.3f}, {p[2]:.3f}]"


def _db(x: float) -> str:
    return "∞" if x == math.inf else f"{x:.2f}"


def render_markdown(rows: list[dict], header: str = "") -> str:
    paired = any("paired" in r for r in rows)
    quality = any("psnr" in r for r in rows)
    ref = next((r["reference"] for r in rows if "reference" in r), UNPATCHED)
    lines = [header, ""] if header else []
    extra = " paired per round, vs unpatched [95 % interval] | vs peer / auto vs the best row [95 % interval] |" if paired else ""
    qcols = f" PSNR dB / SSIM vs {ref} | vs the exact floor |" if quality else ""
    lines += ["| preset | row | s/step | speed vs unpatched | whole run: s/step, vs unpatched |" + extra +
              " cos / rel-L1 vs unpatched |" + qcols + " peak VRAM GiB | kernels that ran |",
              "|---|---|---|---|---|" + ("---|---|" if paired else "") + "---|" + ("---|---|" if quality else "") + "---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['row']} | error: {r['error']} | | |" + (" | |" if paired else "") + " |"
                         + (" | |" if quality else "") + " | |")
            continue
        kern = r.get("kernels", "") + "".join(f" ({n}: {r[n]})" for n in ("auto", AUTO_EXACT) if r.get(n))
        cols = ""
        if paired:
            p = r.get("paired", {})
            other = ""
            if "vs_peer" in p:
                other = "vs peer " + _ci(p["vs_peer"])
            elif "vs_best" in p:
                other = f"vs {r['best_row']} (best) " + _ci(p["vs_best"])
            cols = f" {_ci(p['vs_unpatched']) if 'vs_unpatched' in p else ''} | {other} |"
        whole = f" {r['s_per_step_whole']:.4f}, ×{r['whole_vs_unpatched']:.3f} |" if "whole_vs_unpatched" in r else " |"
        q = ""
        if quality:
            q = (f" {_db(r['psnr'])} / {r['ssim']:.4f} | {r.get('quality', '')} |" if "psnr" in r else " | |")
        lines.append(f"| {r['preset']} | {r['row']} | {r['s_per_step']:.4f} | ×{r.get('vs_unpatched', 0):.3f} |{whole}{cols} "
                     f"{r['cos']:.5f} / {r['rel_l1']:.4f}{'' if r['finite'] else ' NaN'} |{q} {r.get('peak_gib', '')} | {kern} |")
    floor = next((r["floor_psnr"] for r in rows if r.get("floor_psnr") is not None), None)
    if quality and floor is None:
        lines += ["", f"No exact floor: no exact row besides {ref} (add one, e.g. sdpa_cudnn)."]
    elif quality:
        what = ("the worst exact row: what half-precision rounding alone costs" if ref != UNPATCHED else
                "the other exact rows against the unpatched one: two exact kernels' difference")
        lines += ["", f"Exact floor: PSNR {_db(floor)} dB against {ref} ({what}). Rows '{AT_FLOOR}' are as close to "
                      "the reference as an exact kernel is."]
        pairs = [r for r in rows if r.get("exact") and "psnr_vs_unpatched" in r and not r["row"].startswith(UNPATCHED)]
        if ref != UNPATCHED and pairs:
            lines.append("Exact kernels against the unpatched one (PSNR): " +
                         ", ".join(f"{r['row']} {_db(r['psnr_vs_unpatched'])} dB" for r in pairs) + ".")
    return "\n".join(lines)


def quality_targets(rows: list[dict], tolerance: float = 0.02, band_db: float = 3.0,
                    sparse_target: float | None = None) -> list[dict]:
    """The promises stated at a quality (PSNR against the reference run), from one run's rows, over whole runs:

    - ``auto``'s final output within ``band_db`` of the exact floor;
    - ``auto`` at least ``1 - tolerance`` as fast as the fastest row within that band (``auto_fast``, the faster and
      lossier choice a user picks by name, is stated below, not compared);
    - the fastest sparse setting within the band, over unpatched (met when at least ``sparse_target``; no target:
      stated);
    - ``auto_fast``: its speed over unpatched and its distance to the floor (stated);
    - a tuned profile (``<kernel>[profile=...]``) faster per step than the same kernel's defaults at equal or better
      PSNR."""
    ok = {r["row"].replace(" +compile", ""): r for r in rows if "s_per_step" in r and "psnr" in r}
    out = []
    floor = next((r.get("floor_psnr") for r in ok.values() if r.get("floor_psnr") is not None), None)
    speed = lambda r: r.get("whole_vs_unpatched", math.nan)  # noqa: E731
    if floor is not None:
        band = {n: r for n, r in ok.items() if r["psnr"] >= floor - band_db}
        auto = ok.get("auto")
        if auto is not None:
            below = floor - auto["psnr"]
            out.append({"target": f"auto within {band_db:g} dB of the exact floor", "ratio": round(-below, 2),
                        "applies": True, "met": below <= band_db,
                        "detail": f"PSNR {_db(auto['psnr'])} vs floor {_db(floor)}"})
            rivals = [r for n, r in band.items() if n not in AUTO_ROWS]
            if rivals:
                best = min(rivals, key=lambda r: r["s_per_step_whole"])
                ratio = best["s_per_step_whole"] / auto["s_per_step_whole"]
                out.append({"target": f"auto whole run >= x{1 - tolerance:g} of the fastest row within {band_db:g} dB "
                                      f"({best['row']})", "ratio": round(ratio, 3), "applies": True,
                            "met": ratio >= 1 - tolerance,
                            "detail": f"{len(rivals)} rows within {band_db:g} dB; auto x{speed(auto):.3f}, "
                                      f"{best['row']} x{speed(best):.3f} over unpatched"})
        sparse = [r for n, r in band.items() if _sparse_row(n)]
        if sparse:
            best = min(sparse, key=lambda r: r["s_per_step_whole"])
            goal = f" >= x{sparse_target:g}" if sparse_target else ""
            out.append({"target": f"the fastest sparse setting within {band_db:g} dB ({best['row']}) whole run{goal}",
                        "ratio": speed(best), "applies": sparse_target is not None,
                        "met": bool(sparse_target and speed(best) >= sparse_target),
                        "detail": f"PSNR {_db(best['psnr'])} vs floor {_db(floor)}"})
        fast = ok.get("auto_fast")
        if fast is not None:
            out.append({"target": "auto_fast (the faster, lossier choice): whole run over unpatched",
                        "ratio": speed(fast), "applies": False, "met": False,
                        "detail": f"{floor - fast['psnr']:.1f} dB below the floor"})
    for name, r in ok.items():
        base, opts = parse_row(name)
        if "profile" not in opts or base not in ok:
            continue
        d = ok[base]
        ratio = d["s_per_step"] / r["s_per_step"]
        out.append({"target": f"tuned {base} profile faster than its defaults at equal or better PSNR",
                    "ratio": round(ratio, 3), "applies": True, "met": ratio > 1.0 and r["psnr"] >= d["psnr"],
                    "detail": f"PSNR {_db(r['psnr'])} vs defaults {_db(d['psnr'])}"})
    return out


AUTO_ROWS = ("auto", "auto_fast")


def _sparse_row(row: str) -> bool:
    """A row whose kernel skips attention mass (SpargeAttn, Sol-Attn, top-k; core's Model Sparse Attention)."""
    base = parse_row(_row_kernel(row))[0]
    return base == CORE_SOL or (base in REGISTRY and REGISTRY.get(base).sparse)


# ---------------------------------------------------------------- presets: ComfyUI's classes at full size

SD15 = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
        "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
        "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
        "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
        "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "use_temporal_attention": False,
        "use_temporal_resblock": False}
SDXL = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
        "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 320,
        "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
        "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048, "num_head_channels": 64,
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "use_temporal_attention": False,
        "use_temporal_resblock": False}
FLUX_DEV = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
            "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
            "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
WAN = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
       "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "out_dim": 16}
WAN_1_3B = {**WAN, "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30}
WAN_14B = {**WAN, "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40}

# name: (supported_models class, unet config, latent shape, context shape, pooled width or None, cfg, description)
PRESETS = {
    "sd15": ("SD15", SD15, (1, 4, 64, 64), (1, 77, 768), None, 7.0, "SD1.5, 512x512, CFG batch"),
    "sdxl": ("SDXL", SDXL, (1, 4, 128, 128), (1, 77, 2048), 1280, 7.0, "SDXL, 1024x1024, CFG batch"),
    "flux-dev": ("Flux", FLUX_DEV, (1, 16, 128, 128), (1, 512, 4096), 768, 1.0, "Flux-dev, 1024x1024, guidance 3.5"),
    "wan-1.3b": ("WAN21_T2V", WAN_1_3B, (1, 16, 21, 60, 104), (1, 512, 4096), None, 5.0,
                 "Wan 2.1 1.3B t2v, 480p (832x480), 81 frames, CFG batch"),
    "wan-14b": ("WAN21_T2V", WAN_14B, (1, 16, 21, 60, 104), (1, 512, 4096), None, 5.0,
                "Wan 2.1 14B t2v, 480p (832x480), 81 frames, CFG batch"),
    "wan-1.3b-720p": ("WAN21_T2V", WAN_1_3B, (1, 16, 21, 90, 160), (1, 512, 4096), None, 5.0,
                      "Wan 2.1 1.3B t2v, 720p (1280x720), 81 frames, CFG batch"),
    "wan-14b-720p": ("WAN21_T2V", WAN_14B, (1, 16, 21, 90, 160), (1, 512, 4096), None, 5.0,
                     "Wan 2.1 14B t2v, 720p (1280x720), 81 frames, CFG batch"),
    "wan-1.3b-33f": ("WAN21_T2V", WAN_1_3B, (1, 16, 9, 60, 104), (1, 512, 4096), None, 5.0,
                     "Wan 2.1 1.3B t2v, 480p, 33 frames, CFG batch"),
}


def model_config(cls, unet: dict) -> dict:
    """``unet`` for the installed ComfyUI: 0.33 made Flux's ``txt_ids_dims`` a required field ([] for Flux.1)."""
    if cls == "Flux":
        import dataclasses

        from comfy.ldm.flux.model import FluxParams

        if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
            return {"txt_ids_dims": [], **unet}
    return dict(unet)


def enable_dynamic_vram() -> None:
    """What ComfyUI 0.33's main.py does where comfy-aimdo works: dynamic (aimdo) model patchers from now on."""
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control

    if comfy.memory_management.aimdo_enabled:
        return
    comfy_aimdo.control.init()
    hb = sys.modules.get("comfy_aimdo.host_buffer")
    if hb is not None and hb.lib is None:  # imported (by comfy.model_patcher) before the library was loaded
        raise RuntimeError("comfy-aimdo's library was loaded after ComfyUI's modules were imported: call "
                           "comfy_aimdo.control.init() first, as ComfyUI's main.py does")
    if not comfy_aimdo.control.init_devices(d.index for d in mm.get_all_torch_devices()):
        raise RuntimeError("comfy-aimdo did not initialise on this machine")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def build_preset(name: str, device="cuda", dtype=torch.bfloat16, seed=0, dynamic=False) -> Job:
    """ComfyUI's model class for ``name`` at full size with random weights (fan-in scaled, norms at one), on ``device``
    (``dynamic``: on ComfyUI 0.33's dynamic model patcher, see :func:`enable_dynamic_vram`)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    cls, unet, latent, ctx, pooled, cfg, desc = PRESETS[name]
    if dynamic:
        import comfy.memory_management

        if comfy.memory_management.aimdo_enabled:  # its layers would have no weights to fill (they load lazily)
            raise RuntimeError("a dynamic-VRAM preset is built before dynamic VRAM is switched on: one per process")

    def config():
        mc = getattr(sm, cls)(model_config(cls, unet))
        mc.set_inference_dtype(dtype, None)
        return mc

    model = config().get_model({}, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(fan_in ** -0.5))
            elif pname.endswith("weight") or pname.endswith("scale"):
                p.fill_(1.0)
            else:
                p.zero_()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # ComfyUI's load devices name their index (comfy-aimdo needs it)
        dev = torch.device("cuda", torch.cuda.current_device())
    if dynamic:  # as ComfyUI loads a model file: its weights memory-mapped by comfy-aimdo, streamed to the GPU
        import comfy.model_management as mm
        import comfy.utils

        sd = {k: t.to("cpu") for k, t in model.diffusion_model.state_dict().items()}
        del model
        path = os.path.join(tempfile.mkdtemp(prefix="pa-e2e-"), f"{name}.safetensors")
        comfy.utils.save_torch_file(sd, path)
        del sd
        enable_dynamic_vram()
        sd = comfy.utils.load_torch_file(path)  # what comfy.sd.load_diffusion_model_state_dict does, without detection
        model = config().get_model(sd, "")
        patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=dev, offload_device=mm.unet_offload_device())
        model.load_model_weights(sd, "", assign=True)
    else:
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)
    gc = torch.Generator().manual_seed(seed + 1)
    extra = {}
    if pooled:
        extra["pooled_output"] = torch.randn(1, pooled, generator=gc)
    if name == "sdxl":
        extra.update(width=1024, height=1024, target_width=1024, target_height=1024)
    # a text negative prompt, as these models' workflows use (a zeroed one makes SageAttention return NaN: the
    # redo that Patch Attention then runs is a correctness path, measured in the contract matrix, not here)
    pos = [[torch.randn(ctx, generator=gc), dict(extra)]]
    neg = [[torch.randn(ctx, generator=gc), {k: (torch.randn_like(v) if torch.is_tensor(v) else v) for k, v in extra.items()}]]
    return Job(patcher, pos, neg, torch.zeros(latent), cfg=cfg, label=name, extra={"description": desc})
