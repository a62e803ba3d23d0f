"""Speed, peak memory and accuracy of every installed backend on diffusion-model shapes.

    python bench_kernels.py                        # all presets, all usable backends
    python bench_kernels.py --preset flux --preset wan-480p --json out.json --png out.png
    python bench_kernels.py --shape 2,10,4096,64 --shape 1,24,4608,128,512

Run it from the pack's folder with ComfyUI's Python.  Rows: backends usable
here, ``auto``, and what other packs do (``peer:comfy_default``: ComfyUI's
default attention call; ``peer:sageattn``: a raw ``sageattn()`` call).  Every
row is called once (its accuracy, and ``auto``'s choice), warmed up the same
way, then timed in interleaved rounds (each round times every row in turn, the
first row rotating), so that what the machine is doing lands on all rows
alike; a row's time is its median per-call ms over the rounds, beside the range
the rounds spread over.  GPU times are CUDA-event timings; ratios are against
SDPA measured in the same rounds.  Accuracy is cosine / relative L1 against
fp32 SDPA on inputs with DiT-like structure (:mod:`measure.inputs`).  Without a
CUDA GPU the node (not this command line) times what runs on the CPU,
PyTorch's SDPA and its math kernel, with the wall clock, on the presets scaled
down to the CPU (:func:`sized_for`); :class:`Plan` says beforehand how much it
will run and about how long it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import sys
import time
from typing import NamedTuple

import torch

from ..attention.auto import AutoSelector, accuracy, time_call
from ..attention.calls import compute_capability, make_spec, plan_call, plan_for
from ..attention.constraints import CallSpec
from ..attention.dispatch import AttentionConfig, attention
from ..attention.reference import reference_attention
from ..attention.registry import REGISTRY
from .inputs import structured_qkv
from .stats import Spread, spread

log = logging.getLogger("patch_attention.bench")


class AttentionShape(NamedTuple):
    """One attention call's shape: ``batch, heads, q_tokens, head_dim``, ``kv_tokens`` (None: self-attention), the
    token grid of the inputs' structure (None: a sequence), and what it is."""

    batch: int
    heads: int
    q_tokens: int
    head_dim: int
    kv_tokens: int | None
    grid: tuple | None
    description: str


SHAPE_PRESETS = {
    "sd15": AttentionShape(2, 8, 4096, 40, None, (64, 64), "SD1.5 512px, first UNet level (cond+uncond)"),
    "sd15-cross": AttentionShape(2, 8, 4096, 40, 77, (64, 64), "SD1.5 512px cross-attention to 77 tokens"),
    "sdxl": AttentionShape(2, 10, 4096, 64, None, (64, 64), "SDXL 1024px, first transformer level"),
    "sd3": AttentionShape(2, 24, 4250, 64, None, None, "SD3 medium 1024px (4096 image + 154 text tokens)"),
    "flux": AttentionShape(1, 24, 4608, 128, None, None, "Flux 1024px (4096 image + 512 text tokens)"),
    "wan-480p": AttentionShape(1, 40, 32760, 128, None, (21, 30, 52), "Wan 2.1 14B 480p, 81 frames"),
    "hunyuan-480p": AttentionShape(1, 24, 25696, 128, None, None, "HunyuanVideo 480p, 61 frames (+256 text)"),
}
SKIP_BY_DEFAULT = REGISTRY.untimed()  # never faster (Backend.timed)
ROUNDS = 15  # timed rounds per shape, every row once per round
# Work caps (floating-point operations; a call is 4 B H Nq Nk D): a preset's call on the CPU (its tokens are scaled
# down to fit), and one row's share of a round (fewer back-to-back calls than ``reps`` where one call is long).
CPU_CALL_FLOPS = 2.5e8
ROUND_FLOPS = {"cpu": 2.5e8, "cuda": 1e13}
PROBES = {"cpu": AttentionShape(1, 8, 384, 64, None, None, "probe"),
          "cuda": AttentionShape(1, 24, 4096, 128, None, None, "probe")}


def call_flops(shape: AttentionShape) -> float:
    return 4.0 * shape.batch * shape.heads * shape.q_tokens * (shape.kv_tokens or shape.q_tokens) * shape.head_dim


def sized_for(shape: AttentionShape, device) -> AttentionShape:
    """``shape`` as run on ``device``: on a CPU a preset's token counts scaled down (multiples of 64, cross-attention's
    keys kept) until a call is at most :data:`CPU_CALL_FLOPS`; unchanged on a GPU."""
    if device is None or device.type == "cuda" or call_flops(shape) <= CPU_CALL_FLOPS:
        return shape
    n = shape.q_tokens
    while n > 64 and call_flops(shape._replace(q_tokens=n, kv_tokens=shape.kv_tokens and min(shape.kv_tokens, n),
                                               grid=None)) > CPU_CALL_FLOPS:
        n -= 64
    kv = shape.kv_tokens and min(shape.kv_tokens, n)
    return shape._replace(q_tokens=n, kv_tokens=kv, grid=None,
                          description=f"{shape.description}; on the CPU {n} of its {shape.q_tokens} query tokens")


class Entry(NamedTuple):
    """One thing the rounds time: a row's own call (``part`` "call"), or beside a kernel's row the kernel called
    directly ("direct") or dispatched with its NaN check off ("unchecked")."""

    row: str
    part: str = "call"

    @property
    def key(self) -> str:
        return self.row if self.part == "call" else f"{self.row}#{self.part}"


@dataclasses.dataclass
class ShapePlan:
    """One shape's part of a run: what it times, how often."""

    label: str
    shape: AttentionShape
    spec: CallSpec
    entries: list  # Entry, in the order a round starts from
    refused: dict  # backend -> why it cannot take this shape
    reps: int  # back-to-back calls per entry per round
    warmup: int = 3  # calls per entry after its first (accuracy) call, before the rounds
    rounds: int = ROUNDS

    @property
    def calls(self) -> int:
        return len(self.entries) * (1 + self.warmup + self.rounds * self.reps)


@dataclasses.dataclass
class Plan:
    """What a run will do, known before it starts: per shape the entries timed, the calls, the progress ticks."""

    device: torch.device
    dtype: torch.dtype
    names: list  # the backends' rows
    shapes: list  # ShapePlan

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.shapes)

    @property
    def flops(self) -> float:
        return sum(s.calls * call_flops(s.shape) for s in self.shapes)

    @property
    def ticks(self) -> int:
        """Progress updates: per shape, one per entry once it is warmed up, then one per entry per round."""
        return sum(len(s.entries) * (1 + s.rounds) for s in self.shapes)

    def estimate_s(self, rates: dict) -> float:
        """Seconds the calls take at ``rates`` (:func:`probe`: per backend, or "sdpa" for every row not probed, a
        per-call overhead in ms and FLOP per ms); the first calls' compiles and auto's tuning come on top."""
        total = 0.0
        for s in self.shapes:
            per_entry = s.calls / max(1, len(s.entries))
            for e in s.entries:
                r = rates.get(e.row, rates["sdpa"])
                total += per_entry * max(r[0], call_flops(s.shape) / r[1])
        return total / 1000

    def describe(self, seconds: float | None = None) -> str:
        rows = sorted({len(s.entries) for s in self.shapes})
        text = (f"{len(self.shapes)} shape(s), {'-'.join(map(str, rows))} timed rows each, "
                f"{self.shapes[0].rounds if self.shapes else 0} interleaved rounds: {self.calls:,} calls")
        where = "GPU" if self.device.type == "cuda" else self.device.type.upper()
        return text + (f", about {seconds:.0f} s on this {where}" if seconds is not None else "")


def shape_spec(shape: AttentionShape, device, dtype) -> CallSpec:
    """The spec of a benchmark call of ``shape`` (q/k/v ``[B, H, N, D]``, no mask) on ``device``."""
    b, h, nq, d = shape[:4]
    nk = shape.kv_tokens or nq
    return CallSpec(device.type, compute_capability(device), dtype, b, h, h, nq, nk, d, d, None)


def _rows(include, exclude, device=None):
    """The backends to time: usable here; on a CPU, those that run on it (SDPA, its math kernel)."""
    if device is not None and device.type != "cuda":
        q = torch.empty((1, 64, 1, 64), device="meta")
        spec = make_spec(q, q, q, "NHD", None).replace(device_type=device.type, dtype=torch.float32)
        return [n for n in REGISTRY.names() if REGISTRY.get(n).available and not REGISTRY.get(n).plan(spec)[1]
                and (not include or n in include)]
    names = [n for n in REGISTRY.names() if REGISTRY.get(n).available and n not in exclude]
    if include:
        names = [n for n in names if n in include]
    return names


def _shape_plan(label, shape, names, device, dtype, reps, warmup, rounds) -> ShapePlan:
    spec = shape_spec(shape, device, dtype)
    entries, refused = [], {}
    for name in names:
        backend = REGISTRY.get(name)
        target, reason = plan_for(backend, spec)
        if reason is not None:
            refused[name] = reason
            continue
        entries.append(Entry(name))
        if backend.quantized:  # the NaN check's cost
            entries.append(Entry(name, "unchecked"))
        # the dispatcher's overhead over a direct kernel call: a GPU number (on the CPU the wall clock's noise is
        # larger than it)
        if target == spec and device.type == "cuda":
            entries.append(Entry(name, "direct"))
    entries.append(Entry("auto"))
    entries.append(Entry("peer:comfy_default"))
    if device.type == "cuda" and REGISTRY.get("sage").available:
        entries.append(Entry("peer:sageattn"))
    cap = ROUND_FLOPS.get(device.type, ROUND_FLOPS["cpu"])
    shape_reps = max(1, min(reps, int(cap // call_flops(shape))))
    return ShapePlan(label, shape, spec, entries, refused, shape_reps, warmup, rounds)


def make_plan(shapes: dict, *, device=None, dtype="bf16", backends=(), reps=10, warmup=3, rounds=ROUNDS) -> Plan:
    """The :class:`Plan` for ``shapes`` ({label: AttentionShape}) on ``device`` (default: this GPU)."""
    device = device or torch.device("cuda")
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    names = _rows(set(backends), SKIP_BY_DEFAULT, device)
    return Plan(device, tdtype, names,
                [_shape_plan(label, s, names, device, tdtype, reps, warmup, rounds) for label, s in shapes.items()])


def tick_count(shapes: dict, device=None, backends=(), reps=10) -> int:
    """How many progress updates :func:`run` makes for ``shapes`` (a progress bar's length)."""
    return make_plan(shapes, device=device, backends=backends, reps=reps).ticks


def probe(plan: Plan) -> dict:
    """{backend: (per-call overhead ms, FLOP per ms)} for :meth:`Plan.estimate_s`, from a tiny call and a call of
    :data:`PROBES`' size through the dispatcher: SDPA on a GPU (the kernels there are within a small factor of it,
    and some compile on their first call), every backend of the plan on a CPU (its math kernel is many times
    slower)."""
    names = dict.fromkeys(["sdpa", *(plan.names if plan.device.type != "cuda" else ())])
    out = {}
    for name in names:
        cfg = AttentionConfig(backend=name, allow_fallback=False, check_finite=False)
        ms = []
        for shape in (AttentionShape(1, 1, 64, 64, None, None, ""), PROBES.get(plan.device.type, PROBES["cpu"])):
            q = torch.randn((shape.batch, shape.q_tokens, shape.heads * shape.head_dim), device=plan.device,
                            dtype=plan.dtype)
            ms.append(time_call(lambda q=q, h=shape.heads, cfg=cfg: attention(q, q, q, h, config=cfg), plan.device, warmup=1,
                                reps=2, rounds=1))
        out[name] = (ms[0], call_flops(shape) / max(ms[1], 1e-6))
    return out


# ---------------------------------------------------------------- measuring one shape


def _peak(fn, device=None):
    if device is not None and device.type != "cuda":
        return None  # no allocator statistics on the CPU
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _direct_call(backend, qc, kc, vc, b, h, d):
    """``backend``'s bare call on ComfyUI's ``[B, N, H*D]`` tensors (the KernelCall the dispatcher runs, without its NaN
    check or count): a row's time over this one's is the dispatcher's overhead."""
    run = plan_call(backend, qc, kc, vc, h, opts=dict(backend.options))[0].run
    return lambda: run(qc, kc, vc)


def _comfy_default(qc, kc, vc, b, h, d):
    """ComfyUI's default attention call (what other packs leave in place)."""
    def call():
        qq, kk, vv = (t.view(b, -1, h, d).transpose(1, 2) for t in (qc, kc, vc))
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=None, dropout_p=0.0, is_causal=False)
        return o.transpose(1, 2).reshape(b, -1, h * d)

    return call


def _raw_sage(qc, kc, vc, b, h, d):
    """A raw ``sageattn()`` call on ComfyUI's tensors (what sage-patching packs do)."""
    import sageattention

    def call():
        o = sageattention.sageattn(qc.view(b, -1, h, d), kc.view(b, -1, h, d), vc.view(b, -1, h, d), tensor_layout="NHD",
                                   is_causal=False)
        return o.reshape(b, -1, h * d)

    return call


PEER_CALLS = {"peer:comfy_default": _comfy_default, "peer:sageattn": _raw_sage}


def _callables(sp: ShapePlan, qc, kc, vc, auto_cfg) -> dict:
    """{Entry: a function making its call}: a backend's row as Patch Attention runs it (no fallback, deferred NaN
    check), ``auto`` through the same dispatcher with its own config, the peers' calls, the direct and unchecked
    calls beside a kernel's row."""
    b, h, _, d = sp.shape[:4]

    def dispatched(cfg):
        return lambda: attention(qc, kc, vc, h, config=cfg)

    parts = {
        "call": lambda name: dispatched(AttentionConfig(backend=name, allow_fallback=False, check_finite="deferred")),
        "unchecked": lambda name: dispatched(AttentionConfig(backend=name, allow_fallback=False, check_finite=False)),
        "direct": lambda name: _direct_call(REGISTRY.get(name), qc, kc, vc, b, h, d),
    }
    fns = {}
    for e in sp.entries:
        if e.row == "auto":
            fns[e] = dispatched(auto_cfg)
        elif e.row in PEER_CALLS:
            fns[e] = PEER_CALLS[e.row](qc, kc, vc, b, h, d)
        else:
            fns[e] = parts[e.part](e.row)
    return fns


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


class Timing:
    """One shape's timed rounds: per entry, its per-call ms of each round; entries that failed, and why."""

    def __init__(self, sp: ShapePlan, fns: dict, device, tick):
        self.sp, self.fns, self.device, self.tick = sp, fns, device, tick or (lambda: None)
        self.ms = {e: [] for e in fns}
        self.failed = {}  # Entry -> error

    def first_calls(self, ref) -> dict:
        """Each entry's first call (a row's accuracy against ``ref``; ``auto`` chooses here), then its warm-up calls:
        {row: (cos, rel-L1)}. An entry that raises is not timed."""
        acc = {}
        for e, fn in self.fns.items():
            try:
                out = fn()
                if e.part == "call":
                    acc[e.row] = accuracy(out, ref)
                del out
                for _ in range(self.sp.warmup):
                    fn()
            except Exception as err:
                self.failed[e] = _error(err)
            self.tick()
        return acc

    def rounds(self) -> None:
        """Interleaved rounds: each round times every entry once (``reps`` back-to-back calls), the first entry
        rotating from round to round, so that a change in the machine's load lands on every row alike. A failed
        entry is skipped (its ticks still come: the bar's length was planned)."""
        order = list(self.fns)
        for rnd in range(self.sp.rounds):
            k = rnd % max(1, len(order))
            for e in order[k:] + order[:k]:
                if e not in self.failed:
                    try:
                        self.ms[e].append(time_call(self.fns[e], self.device, warmup=0, reps=self.sp.reps, rounds=1))
                    except Exception as err:
                        self.failed[e] = _error(err)
                self.tick()

    def spread(self, e: Entry) -> Spread | None:
        return spread(self.ms[e]) if self.ms.get(e) and e not in self.failed else None


def bench_shape(sp: ShapePlan, plan: Plan, *, tick=None, auto_cache=None) -> list[dict]:
    """One shape's rows: every entry's first call and warm-up, then the interleaved rounds (:class:`Timing`)."""
    b, h, nq, d = sp.shape[:4]
    nk, grid = sp.shape.kv_tokens or nq, sp.shape.grid
    dev = plan.device
    q, k, v = structured_qkv(b, h, nq, nk, d, device=dev, dtype=plan.dtype, seed=nq + d,
                             kind="video" if grid and len(grid) == 3 else "image", grid=grid if grid and nq == nk else None)
    # ComfyUI hands most models' attention [B, N, H*D]
    qc, kc, vc = (t.transpose(1, 2).reshape(b, t.shape[2], h * d) for t in (q, k, v))
    ref = reference_attention(q, k, v).transpose(1, 2).reshape(b, nq, h * d)
    auto_cfg = AttentionConfig(backend="auto", auto=AutoSelector(cache_path=auto_cache), check_finite="deferred")
    timing = Timing(sp, _callables(sp, qc, kc, vc, auto_cfg), dev, tick)
    acc = timing.first_calls(ref)
    timing.rounds()
    return _shape_rows(sp, plan, timing, acc, auto_cfg)


def _shape_rows(sp: ShapePlan, plan: Plan, timing: Timing, acc: dict, auto_cfg) -> list[dict]:
    """The result rows of one shape, in the order of the plan's backends, then auto and the peers."""
    rows = [{"backend": n, "shape": sp.label, "refused": why} for n, why in sp.refused.items()]
    for e in (e for e in timing.fns if e.part == "call"):
        r = {"backend": e.row, "shape": sp.label}
        t = timing.spread(e)
        if t is None:
            r["error"] = timing.failed.get(e, "not timed")
        else:
            r["cos"], r["rel_l1"] = acc[e.row]
            r.update(ms=t.median, ms_low=t.low, ms_high=t.high, rounds=t.rounds, reps=sp.reps)
            _beside(r, timing, e.row)
            peak = _peak(timing.fns[e], plan.device)
            if peak is not None:
                r["peak_mib"] = round(peak, 1)
        rows.append(r)
    order = {n: i for i, n in enumerate([*plan.names, "auto", *PEER_CALLS])}
    rows.sort(key=lambda r: order.get(r["backend"], len(order)))
    auto = next((r for r in rows if r["backend"] == "auto"), None)
    if auto is not None:
        auto["auto_choice"] = next(iter(auto_cfg.auto.decisions.values()), None) if auto_cfg.auto else None
        auto["auto_tune_ms"] = round(auto_cfg.auto.tune_ms, 1) if auto_cfg.auto else 0.0
        auto["auto_report"] = next(iter(auto_cfg.stats.decisions.values()), "")
        check_auto(auto, {r["backend"]: r for r in rows})
    sdpa_ms = next((x["ms"] for x in rows if x["backend"] == "sdpa" and "ms" in x), None)
    for x in rows:
        if sdpa_ms and "ms" in x:
            x["speedup_vs_sdpa"] = round(sdpa_ms / x["ms"], 3)
    return rows


def _beside(r: dict, timing: Timing, name: str) -> None:
    """A kernel row's direct call and its call with the NaN check off, timed in the same rounds."""
    unchecked, direct = timing.spread(Entry(name, "unchecked")), timing.spread(Entry(name, "direct"))
    if unchecked is not None:
        r["unchecked_ms"] = unchecked.median
    if direct is not None:
        r["direct_ms"] = direct.median
        r["wrapper_pct"] = 100.0 * (r.get("unchecked_ms", r["ms"]) - direct.median) / direct.median


def check_auto(auto: dict, by_backend: dict) -> None:
    """``auto`` runs the kernel it chose through the same dispatcher path as that kernel's row, plus a lookup: it is
    never faster. Where its median is below the fastest round of that row anyway, the machine's load changed while
    the rounds ran; ``auto_check`` says so (the report shows it as such, not as a speed-up)."""
    kern = by_backend.get(auto.get("auto_choice"))
    if "ms" not in auto or kern is None or "ms" not in kern:
        return
    if auto["ms"] < kern["ms_low"]:
        auto["auto_check"] = (f"measured faster than {kern['backend']}, the kernel it runs, beyond that row's spread "
                              f"({auto['ms']:.3f} ms against {kern['ms_low']:.3f}-{kern['ms_high']:.3f} ms): the "
                              "machine's load changed during the rounds; this is no speed-up")


def run(shapes: dict, *, backends=(), dtype="bf16", warmup=3, reps=10, json_path=None, progress=True, device=None,
        rounds=ROUNDS, announce=None):
    """Benchmark ``shapes`` on ``device`` (default: this GPU); returns (meta, rows).  Used by the CLI and the Attention
    Benchmark node.  ``progress``: True for a terminal bar, or a callable called once per tick
    (:attr:`Plan.ticks`: per timed row and round).  ``announce(text)``: told the plan and its estimate before anything
    is timed (the node's progress text); the log says it too."""
    plan = make_plan(shapes, device=device, dtype=dtype, backends=backends, reps=reps, warmup=warmup, rounds=rounds)
    estimate = plan.estimate_s(probe(plan))
    text = plan.describe(estimate)
    log.info("Attention Benchmark: %s", text)
    if announce is not None:
        announce(text)
    tick, bar = _ticker(progress, plan)
    meta = _meta(plan, dtype, reps, text)
    rows, t0 = [], time.perf_counter()
    for sp in plan.shapes:
        try:
            rows += bench_shape(sp, plan, tick=tick)
        except torch.OutOfMemoryError as e:
            rows.append({"backend": "sdpa", "shape": sp.label, "error": f"out of memory: {str(e).splitlines()[0][:120]}"})
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        if json_path:  # after every shape, so a long run keeps what it measured
            with open(json_path, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if bar:
        bar.close()
    return meta, rows


def _ticker(progress, plan: Plan):
    if callable(progress):
        return progress, None
    if progress:
        try:
            from tqdm import tqdm
        except ImportError:
            return None, None
        bar = tqdm(total=plan.ticks, desc="benchmark", unit="round")
        return (lambda: bar.update(1)), bar
    return None, None


def _meta(plan: Plan, dtype: str, reps: int, text: str) -> dict:
    device = plan.device
    return {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "dtype": dtype,
        "date": datetime.date.today().isoformat(),
        "reps": reps,
        "rounds": plan.shapes[0].rounds if plan.shapes else ROUNDS,
        "reps_by_shape": {s.label: s.reps for s in plan.shapes},
        "shapes": {s.label: s.shape.description for s in plan.shapes},
        "scaled": [s.label for s in plan.shapes if s.shape != SHAPE_PRESETS.get(s.label, s.shape)],
        "plan": text,
        "versions": {n: REGISTRY.get(n).availability().version for n in plan.names},
    }


# ---------------------------------------------------------------- report


def _cell(r: dict) -> str:
    if "refused" in r:
        return "n/a"
    if "error" in r:
        return "error"
    c = f"{r['ms']:.3f} ms ×{r.get('speedup_vs_sdpa', 0):.2f}"
    if "ms_low" in r:
        c += f" ({r['ms_low']:.3f}–{r['ms_high']:.3f})"
    if r["backend"] == "auto" and r.get("auto_choice"):
        c += f" → {r['auto_choice']}"
    return c


def _accuracy_cell(r: dict | None) -> str:
    if r is None or "cos" not in r:
        return "" if r is None else ("n/a" if "refused" in r else "error")
    mem = f" · {r['peak_mib']:.0f}" if "peak_mib" in r else ""
    return f"{r['cos']:.4f} / {r['rel_l1']:.3f}{mem}"


def _header(meta: dict) -> list[str]:
    cpu = meta.get("device", "cuda") != "cuda"
    clock = "wall clock" if cpu else "CUDA events"
    if "rounds" in meta:
        how = (f"per-call ms = median over {meta['rounds']} interleaved rounds (each times every row in turn, the first "
               f"row rotating) of {meta['reps']} back-to-back call(s), fewer where one call is long ({clock}), then the "
               "fastest and the slowest round")
    else:
        how = f"per-call ms = median over 5 rounds of {meta['reps']} back-to-back calls ({clock})"
    out = [f"{meta['gpu']} · torch {meta['torch']} · {meta['dtype']} · {meta['date']} · {how}; speed-up = SDPA ms / "
           "backend ms, same run; accuracy vs fp32 SDPA.", ""]
    if cpu:
        out += ["No CUDA GPU: these are PyTorch's SDPA kernels on the CPU, which is all that runs here; the GPU kernels "
                "need an NVIDIA GPU." + (" Presets run with fewer tokens on the CPU (see Shapes)." if meta.get("scaled")
                                         else ""), ""]
    return out


def _table(title_cells: list[str], names: list, shapes: list, cell) -> list[str]:
    out = ["| " + " | ".join(title_cells + shapes) + " |", "|---|" + "---|" * len(shapes)]
    for n in names:
        out.append(f"| {n} | " + " | ".join(cell(n, s) for s in shapes) + " |")
    return out


def render_markdown(meta, rows, presets):
    """The run's report: speed (median and spread), accuracy and memory per backend and shape, what was not run, what
    ``auto`` measured while choosing and how its row compares with the kernel it runs. ``presets``: the shape
    presets, for shapes the run's meta does not describe (results of earlier versions)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["backend"], r["shape"]): r for r in rows}
    described = meta.get("shapes", {})

    def what(s):
        return described.get(s) or (presets[s].description if s in presets else s)

    out = _header(meta) + ["Shapes: " + "; ".join(f"`{s}` = {what(s)}" for s in shapes), ""]
    out += _table(["backend"], names, shapes, lambda n, s: "" if by.get((n, s)) is None else _cell(by[(n, s)]))
    cpu = meta.get("device", "cuda") != "cuda"
    out += ["", "Accuracy (cos / rel-L1)" + ("" if cpu else " and peak extra memory (MiB)") + ":", ""]
    out += _table(["backend"], names, shapes, lambda n, s: _accuracy_cell(by.get((n, s))))
    out += _notes(rows)
    if meta.get("plan"):
        out += ["", f"Run: {meta['plan']}" + (f"; took {meta['wall_s']:.0f} s." if "wall_s" in meta else ".")]
    return "\n".join(out) + "\n"


def _notes(rows) -> list[str]:
    out = []
    wr = [r for r in rows if "wrapper_pct" in r]
    if wr:
        out += ["", "Wrapper overhead (dispatch from ComfyUI's `[B, N, H*D]`, NaN check off, vs calling the kernel on the same "
                "view; and the NaN check's own cost for quantized kernels):", ""]
        for r in wr:
            line = f"- {r['backend']} @ {r['shape']}: kernel {r['direct_ms']:.3f} ms, dispatched {r.get('unchecked_ms', r['ms']):.3f} ms " \
                   f"({r['wrapper_pct']:+.1f} %)"
            if "unchecked_ms" in r:
                line += f"; with the deferred NaN check {r['ms']:.3f} ms ({100.0 * (r['ms'] - r['unchecked_ms']) / r['unchecked_ms']:+.1f} %)"
            out.append(line)
    notes = [r for r in rows if "error" in r or "refused" in r]
    if notes:
        out += ["", "Not run:", ""] + [f"- {r['backend']} @ {r['shape']}: {r.get('error') or r.get('refused')}" for r in notes]
    autos = [r for r in rows if r["backend"] == "auto" and r.get("auto_report")]
    if autos:
        out += ["", "What `auto` measured while choosing (its own timing, before the rounds):", ""]
        out += [f"- {r['shape']}: {r['auto_report']}" for r in autos]
    checks = [r for r in rows if r.get("auto_check")]
    if checks:
        out += ["", "auto against the kernel it runs:", ""] + [f"- {r['shape']}: {r['auto_check']}" for r in checks]
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = [n for n in dict.fromkeys(r["backend"] for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ys = []
        for s in shapes:
            r = next((x for x in rows if x["backend"] == n and x["shape"] == s), {})
            ys.append(r.get("speedup_vs_sdpa", 0.0))
        ax.bar([j + i * w for j in range(len(shapes))], ys, w, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("speed-up vs SDPA (same run)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_shapes(presets, user_shapes, device=None) -> dict:
    """Preset names (all when empty) and ``B,H,N,D[,Nk]`` strings -> {label: AttentionShape}; the presets sized for
    ``device`` (:func:`sized_for`; None: as they are), a user's shapes as given."""
    shapes = {p: sized_for(SHAPE_PRESETS[p], device) for p in (presets or SHAPE_PRESETS)}
    for s in user_shapes:
        try:
            parts = [int(x) for x in s.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (4, 5) or min(parts) <= 0:
            raise ValueError(f"a shape is B,H,N,D or B,H,N,D,Nk with positive integers, got {s!r}")
        b, h, n, d = parts[:4]
        shapes[s] = AttentionShape(b, h, n, d, parts[4] if len(parts) == 5 else None, None, f"user shape {s}")
    return shapes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python bench_kernels.py", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(SHAPE_PRESETS), help="default: all")
    ap.add_argument("--shape", action="append", default=[], help="B,H,N,D[,Nk] (repeatable)")
    ap.add_argument("--backends", default="", help="comma-separated subset")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timed rounds per shape")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--md", help="write a markdown table here")
    ap.add_argument("--png", help="write a speed-up plot here (needs matplotlib)")
    ap.add_argument("--from-json", help="render --md/--png from an earlier --json, run nothing")
    a = ap.parse_args(argv)

    if a.from_json:
        data = json.load(open(a.from_json))
        meta, rows = data["meta"], data["rows"]
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU: nothing to benchmark (PyTorch SDPA is what runs here)", file=sys.stderr)
            return 2
        try:
            shapes = parse_shapes(a.preset, a.shape)
        except ValueError as e:
            ap.error(str(e))
        meta, rows = run(shapes, backends=set(filter(None, a.backends.split(","))), dtype=a.dtype, warmup=a.warmup,
                         reps=a.reps, json_path=a.json, rounds=a.rounds)
    md = render_markdown(meta, rows, SHAPE_PRESETS)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if a.png:
        try:
            plot(rows, a.png)
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
