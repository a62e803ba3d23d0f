"""``auto``: measure, on the call's own tensors, which capable backend is fastest.

On the first call with a new signature (device, dtype, head dim, heads, mask
kind, bucketed sequence lengths) every capable installed backend is timed on
that call's q/k/v and checked against an fp32 SDPA reference (cosine and
relative L1 gates).  The fastest that passes wins; later calls with that
signature go straight to it.  Decisions persist in a JSON file keyed by GPU,
torch and kernel versions, so a second session does not tune again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .calls import REFERENCE, finite_flag, plan_for, run_backend
from .reference import accuracy, reference_attention  # noqa: F401  (accuracy: re-exported)
from .registry import REGISTRY

log = logging.getLogger("patch_attention.auto")

# Gates: measured on the H100 (docs/gpu-correctness.md): quantized kernels
# (Sage, kitchen int8) reach cos >= 0.998 and rel-L1 <= 0.06 on realistic
# inputs; a broken or mis-configured kernel lands far below.
DEFAULT_MIN_COS = 0.995
DEFAULT_MAX_REL_L1 = 0.08
EXCLUDED = {"sdpa_math"}  # never faster; the reference computes in fp32 SDPA anyway


def bucket(n: int) -> int:
    """Round a sequence length up to one of 4 buckets per octave."""
    if n <= 64:
        return 64
    e = 2 ** (int(math.log2(n)) - 2)
    return -(-n // e) * e


def signature(spec) -> str:
    cc = f"sm{spec.cc[0]}{spec.cc[1]}" if spec.cc else spec.device_type
    return (
        f"{cc}/{str(spec.dtype).replace('torch.', '')}/B{spec.batch}/H{spec.heads}/Hk{spec.kv_heads}"
        f"/D{spec.head_dim}/Dv{spec.v_head_dim}/Nq{bucket(spec.q_len)}/Nk{bucket(spec.kv_len)}/mask={spec.mask}"
    )


_FILE_LOCK = threading.Lock()  # the decisions file is read, merged and written by every sampling thread's selector


def phase_signature(spec, sparse_ok: bool = True) -> str:
    """The key of auto's choice for a call: its signature, and whether sparse kernels may run in this forward (before
    the sparse step schedule starts they may not, so that phase has a choice of its own)."""
    return signature(spec) if sparse_ok else signature(spec) + "/dense-early"


RULE_VERSION = 2  # 2: a candidate must beat sdpa by AutoSelector.margin (decisions made by rule 1 are re-tuned)


def fingerprint() -> str:
    """GPU + torch + installed kernel versions + the selection rule's version: decisions are valid only for this."""
    parts = [f"torch{torch.__version__}", f"rule{RULE_VERSION}"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name().replace(" ", "_"))
    for b in REGISTRY.backends():
        av = b.availability()
        if av.ok and b.family != "sdpa":
            parts.append(f"{b.family}={av.version}")
    return ";".join(sorted(set(parts)))


def default_cache_path() -> str:
    env = os.environ.get("PATCH_ATTENTION_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "patch_attention", "auto.json")


def time_call(fn: Callable[[], object], device: torch.device, warmup: int = 2, reps: int = 5, rounds: int = 3) -> float:
    """Per-call ms: median over ``rounds`` of ``reps`` back-to-back calls (CUDA events on GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(rounds):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / reps)
    else:
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) * 1000 / reps)
    return statistics.median(times)


@dataclass
class Candidate:
    name: str
    ms: float | None = None
    cos: float | None = None
    rel_l1: float | None = None
    passed: bool = False
    error: str = ""
    note: str = ""


@dataclass
class AutoSelector:
    """Keeps the decisions of one config; ``timer`` and ``checker`` can be injected (tests)."""

    min_cos: float = DEFAULT_MIN_COS
    max_rel_l1: float = DEFAULT_MAX_REL_L1
    cache_path: str | None = None  # None: no persistence
    retune: bool = False
    warmup: int = 2
    reps: int = 5
    timer: Callable | None = None  # (name, fn, device) -> ms
    margin: float = 0.05  # a candidate replaces sdpa only when this much faster per call
    # per signature: candidates not reached after this much timing are skipped (SDPA is always timed). Each candidate's
    # first call -- its accuracy check, where a JIT kernel (FlashAttention-4) compiles -- is neither timed nor counted.
    max_tune_s: float = 60.0
    exclude: set = field(default_factory=lambda: set(EXCLUDED))
    decisions: dict = field(default_factory=dict)  # signature -> backend name
    reports: dict = field(default_factory=dict)  # signature -> list[Candidate]
    demoted: dict = field(default_factory=dict)  # signature -> why SDPA replaces the decision until cleared (a run)
    tune_ms: float = 0.0
    _loaded: bool = False

    # ---- persistence
    def _load(self):
        self._loaded = True
        if self.retune or not self.cache_path or not os.path.exists(self.cache_path):
            return
        try:
            with open(self.cache_path) as f:
                data = json.load(f)
            saved = data.get(fingerprint(), {})
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable auto cache %s: %s", self.cache_path, e)
            return
        for sig, name in saved.items():
            if name in REGISTRY and REGISTRY.get(name).available:
                self.decisions.setdefault(sig, name)

    def _save(self):
        if not self.cache_path:
            return
        with _FILE_LOCK:
            self._save_locked()

    def _save_locked(self):
        try:
            data = {}
            if os.path.exists(self.cache_path):
                with open(self.cache_path) as f:
                    data = json.load(f)
            data.setdefault(fingerprint(), {}).update(self.decisions)
            os.makedirs(os.path.dirname(self.cache_path) or ".", exist_ok=True)
            tmp = self.cache_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.cache_path)
        except (OSError, ValueError) as e:
            log.warning("could not save auto decisions to %s: %s", self.cache_path, e)

    # ---- selection
    def candidates(self, spec, options=None, sparse_ok=True) -> list[str]:
        """Backends that can take ``spec`` (with the per-backend ``options`` of the config; sparse kernels only when
        ``sparse_ok``), SDPA first (the baseline is always measured)."""
        names = []
        for b in REGISTRY.backends():
            if b.name in self.exclude or (b.sparse and not sparse_ok):
                continue
            if plan_for(b, spec)[1] is None and b.refuses(spec, (options or {}).get(b.name)) is None:
                names.append(b.name)
        return sorted(names, key=lambda n: n != REFERENCE)

    def choose(self, cfg, q4, k4, v4, layout, mask4, spec, scale) -> str:
        if not self._loaded:
            self._load()
        sig = phase_signature(spec, cfg.sparse_ok)
        if sig in self.demoted:
            return "sdpa"
        hit = self.decisions.get(sig)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        name, report = self.tune(cfg, q4, k4, v4, layout, mask4, spec, scale)
        took = (time.perf_counter() - t0) * 1000
        self.tune_ms += took
        self.decisions[sig] = name
        self.reports[sig] = report
        cfg.stats.decisions[sig] = describe(name, report, took)
        log.info("auto %s -> %s (tuned in %.0f ms)", sig, name, took)
        self._save()
        return name

    def demote(self, sig: str, why: str) -> None:
        """Use SDPA for ``sig`` until :attr:`demoted` is cleared (the node clears it at the start of each run)."""
        self.demoted[sig] = why

    def tune(self, cfg, q4, k4, v4, layout, mask4, spec, scale):
        names = self.candidates(spec, cfg.options, cfg.sparse_ok)
        t_start = time.perf_counter()
        first_calls_s = 0.0  # the untimed first calls (compiles), left out of the budget
        with torch.no_grad():
            to_hnd = (lambda t: t) if layout == "HND" else (lambda t: t.transpose(1, 2))
            ref = to_hnd(reference_attention(to_hnd(q4), to_hnd(k4), to_hnd(v4), mask4, scale))
            report = []
            for name in names:
                b = REGISTRY.get(name)
                target, _ = plan_for(b, spec)
                opts = cfg.options.get(name) or {}
                c = Candidate(name)
                report.append(c)
                if report[0] is not c and time.perf_counter() - t_start - first_calls_s > self.max_tune_s:
                    c.error = f"not measured: tuning budget of {self.max_tune_s:g} s spent"
                    continue

                check = cfg.check_finite and b.quantized

                def call(b=b, target=target, opts=opts, check=check):
                    out = run_backend(b, q4, k4, v4, layout, mask4, spec, target, scale, opts)[0]
                    if check:  # the dispatcher's NaN check is part of this backend's cost
                        flag = finite_flag(out)
                        if cfg.check_finite is True:
                            bool(flag.isfinite())  # immediate mode syncs per call
                    return out

                try:
                    t_first = time.perf_counter()
                    out = call()
                    c.cos, c.rel_l1 = accuracy(out, ref)  # reads the result back: the first call has finished
                    first_calls_s += time.perf_counter() - t_first
                    c.passed = c.cos >= self.min_cos and c.rel_l1 <= self.max_rel_l1
                    if not c.passed:
                        continue
                    if self.timer is not None:
                        c.ms = self.timer(name, call, q4.device)
                    else:
                        c.ms = time_call(call, q4.device, self.warmup, self.reps)
                except Exception as e:
                    c.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    c.passed = False
        passing = [c for c in report if c.passed and c.ms is not None]
        if not passing:
            return "sdpa", report
        best = min(passing, key=lambda c: c.ms)
        base = next((c for c in passing if c.name == "sdpa"), None)
        if base is not None and best is not base and best.ms > base.ms * (1 - self.margin):
            # Not faster by the margin: keep SDPA. It is what the model ran before (the node hands it to ComfyUI's own
            # function, which costs less host time per call than any other candidate's path), and a kernel-level
            # win this small does not survive end to end (SDXL on an H100: sdpa_efficient/flash picks were 6 % slower).
            best.note = f"within {self.margin:.0%} of sdpa: sdpa kept"
            return "sdpa", report
        return best.name, report


def describe(name: str, report: list[Candidate], took_ms: float) -> str:
    parts = []
    for c in sorted(report, key=lambda c: (c.ms is None, c.ms or 0)):
        if c.error:
            parts.append(f"{c.name}: {c.error}" if c.error.startswith("not measured") else f"{c.name}: error {c.error}")
        elif not c.passed:
            parts.append(f"{c.name}: failed gate (cos {c.cos:.5f}, rel-L1 {c.rel_l1:.4f})")
        else:
            parts.append(f"{c.name} {c.ms:.3f} ms" + (f" ({c.note})" if c.note else ""))
    return f"{name} [" + "; ".join(parts) + f"] tuned in {took_ms:.0f} ms"


def select(cfg, q4, k4, v4, layout, mask4, spec, scale) -> str:
    if cfg.auto is None:
        cfg.auto = AutoSelector()
    return cfg.auto.choose(cfg, q4, k4, v4, layout, mask4, spec, scale)
