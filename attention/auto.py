"""``auto``, ``auto_fast`` and ``auto_exact``: measure, on the call's own tensors, which capable backend is fastest.

On the first call with a new signature (device, dtype, head dim, heads, mask
kind, bucketed sequence lengths) every capable installed backend is timed on
that call's q/k/v and checked against an fp32 SDPA reference (cosine and
relative L1 gates).  The fastest that passes wins; later calls with that
signature go straight to it.  Decisions persist in a JSON file keyed by GPU,
torch and kernel versions, so a second session does not tune again.

**The gate, and where a lossy kernel is judged.**

- ``auto`` gates at cos >= 0.999 and rel-L1 <= 0.039 (:data:`DEFAULT_MIN_COS`, :data:`DEFAULT_MAX_REL_L1`): on the
  stand-in with trained attention (docs/quality.md, H100) this is the gate :mod:`.calibrate` proposes for a final
  output within 3 dB of the exact kernels' (it proposes cos >= 0.99894, rel-L1 <= 0.0389: the same settings pass).
  A lossy choice is judged where it runs, not only on the call it was timed on: the node layer
  (``nodes.recheck``) compares every call it serves (every layer, on 512 query rows each) with dense attention at
  the run's check steps -- the first forward it serves in each run, the first of the sparse phase, the middle and the
  last step; nothing is compared between them -- and reads those errors back with the one device read each forward
  makes anyway (the NaN net's).  A choice beyond the gate on
  any of them is *refused* for its signature: never chosen again for it by this selector nor by those of the other
  sampling lanes (they share :attr:`AutoSelector.refused`), the forward is computed again without it, and the
  signature's decision becomes the fastest passing candidate left (tuned again, without it, where this lane timed
  none).  Decisions are keyed per phase (before the sparse schedule starts, ``/dense-early``), so a kernel chosen in
  one phase is judged on that phase's calls.
- ``auto_fast`` (:meth:`AutoSelector.fast`) is the earlier ``auto``: cos >= 0.995 and rel-L1 <= 0.08, judged on the
  call it times, then once per signature at the middle and the last step; a choice that fails there runs on the
  fastest exact kernel for the rest of that run only (:attr:`AutoSelector.demoted`).  Faster on models whose
  attention suits sparse kernels, and further from exact: on the stand-in 12.6 dB below the exact floor at 480p.
- A gate set by hand (the node's ``auto_min_cos`` / ``auto_max_rel_l1``) replaces the choice's own thresholds and
  keeps its way of judging; its decisions are keyed apart (``/gate<cos>,<rel-L1>``), as ``auto_fast``'s (``/fast``).

``auto_exact`` (an :class:`AutoSelector` with ``exact_only``) measures only backends of the accuracy class "exact"
(every SDPA kernel through its ATen op, FlashAttention 2/3/4, xformers) and gates them on that class's bound: no lossy
kernel is ever timed or chosen, and its decisions are stored under keys of their own (``.../exact``), so a decision of
``auto`` can never be read as one of ``auto_exact``.  It is also what a patched model runs where it leaves a call
dense (see ``nodes.override``).  ``auto``'s tuning hands what it measured of the exact kernels to the config's exact
selector, so those are not timed twice.

What a decision names is what was timed: ``sdpa`` is PyTorch's SDPA with PyTorch's own kernel choice, called by the
dispatcher (no priority context around it), and that is what runs when ``sdpa`` wins; each forced ``sdpa_*`` entry
is one kernel's ATen op, timed and run as such.
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

from .calls import KernelCall, finite_flag, plan_for
from .names import AUTO, AUTO_EXACT, AUTO_FAST, REFERENCE
from .reference import accuracy, reference_attention  # noqa: F401  (accuracy: re-exported)
from .registry import ACCURACY, REGISTRY

log = logging.getLogger("patch_attention.auto")

# auto's gate: the calibration's at 3 dB below the exact floor on the stand-in (docs/quality.md, H100): it admits
# the 8-bit kernels and SpargeAttn at its defaults (worst captured call: cos 0.99967, rel-L1 0.0243) and keeps out
# Sol-Attn, SpargeAttn top-k and the tuned SpargeAttn profile (cos 0.99665 / rel-L1 0.0622 and worse).
DEFAULT_MIN_COS = 0.999
DEFAULT_MAX_REL_L1 = 0.039
# auto_fast's: the earlier default (quantized kernels reach cos >= 0.998 and rel-L1 <= 0.06 on realistic inputs,
# docs/gpu-correctness.md; a broken or mis-configured kernel lands far below)
FAST_MIN_COS = 0.995
FAST_MAX_REL_L1 = 0.08
EXCLUDED = REGISTRY.untimed()  # never faster (declared on the backend: Backend.timed)


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


EXACT_SUFFIX = "/exact"  # auto_exact's keys (in memory and in the decisions file): never one of auto's
FAST_SUFFIX = "/fast"  # auto_fast's keys


def exact_signature(spec) -> str:
    """The key of auto_exact's choice for a call (no phase: no exact kernel waits for the sparse schedule)."""
    return signature(spec) + EXACT_SUFFIX


# 2: a candidate must beat sdpa by AutoSelector.margin; 3: auto's gate is cos 0.999 / rel-L1 0.039 (its decisions by
# the earlier gate are tuned again), auto_fast's decisions keyed apart. Decisions made by an earlier rule are re-tuned.
RULE_VERSION = 3


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


LAUNCH_COVER_CYCLES = 20_000_000  # about 10-15 ms of GPU clock: the launches of one timed round fit behind it


def time_call(fn: Callable[[], object], device: torch.device, warmup: int = 2, reps: int = 5, rounds: int = 3,
              long_ms: float | None = None) -> float:
    """Per-call ms: median over ``rounds`` of ``reps`` back-to-back calls (CUDA events on GPU, perf_counter elsewhere).
    ``long_ms``: when the first warm-up call takes longer (video-size attention), the rest of the warm-up is skipped
    and each round is one call: one call's noise is then far below the margins decisions use, and 17 calls of half a
    second per kernel made measuring a 14B model at 720p take minutes."""
    cuda = device.type == "cuda"

    def elapsed(n: int) -> float:  # ms per call of n back-to-back calls
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # the GPU busy while the calls are launched: the events then time the kernels, not the host (another
            # sampling thread holding the GIL, under CFG Split or Context Parallel, would otherwise count)
            torch.cuda._sleep(LAUNCH_COVER_CYCLES)
            s.record()
            for _ in range(n):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / n
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) * 1000 / n

    if cuda:
        torch.cuda.synchronize(device)
    if warmup > 0 and long_ms is not None:
        if elapsed(1) > long_ms:
            warmup, reps = 0, 1
        else:
            warmup -= 1
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(elapsed(reps) for _ in range(rounds))


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
    long_call_ms: float = 25.0  # calls longer than this are timed one at a time (see time_call)
    timer: Callable | None = None  # (name, fn, device) -> ms
    margin: float = 0.05  # a candidate replaces sdpa only when this much faster per call
    # per signature: candidates not reached after this much timing are skipped (SDPA is always timed). Each candidate's
    # first call -- its accuracy check, where a JIT kernel (FlashAttention-4) compiles -- is neither timed nor counted.
    max_tune_s: float = 60.0
    exclude: set = field(default_factory=lambda: set(EXCLUDED))
    exact_only: bool = False  # auto_exact: only backends of the accuracy class "exact" are candidates
    # True (auto): a lossy choice is judged on every call it serves at the run's check steps and refused for good when
    # it leaves the gate; False (auto_fast): judged on the call it times, spot-checked at the middle and last step
    over_run: bool = True
    decisions: dict = field(default_factory=dict)  # signature -> backend name
    reports: dict = field(default_factory=dict)  # signature -> list[Candidate]
    demoted: dict = field(default_factory=dict)  # signature -> why SDPA replaces the decision until cleared (a run)
    # signature -> {backend: why}: lossy choices that left the gate during a run, never chosen for that signature
    # again (one dict shared by the selectors of an override's lanes)
    refused: dict = field(default_factory=dict)
    tune_ms: float = 0.0
    _loaded: bool = False

    @classmethod
    def exact(cls, **kw) -> AutoSelector:
        """auto_exact's selector: exact kernels only, gated on the exact class's bound (cos, rel-L1 vs fp32)."""
        bound = ACCURACY["exact"]
        return cls(exact_only=True, min_cos=bound.min_cos, max_rel_l1=bound.max_rel_l1, **kw)

    @classmethod
    def fast(cls, **kw) -> AutoSelector:
        """auto_fast's selector: the earlier gate (cos 0.995, rel-L1 0.08 unless given), judged on the call it times
        and spot-checked at the middle and last step (see the module's docstring)."""
        kw.setdefault("min_cos", FAST_MIN_COS)
        kw.setdefault("max_rel_l1", FAST_MAX_REL_L1)
        return cls(over_run=False, **kw)

    @property
    def suffix(self) -> str:
        """What this selector's keys end with: ``/exact``; ``/fast``; ``/gate<cos>,<rel-L1>`` before it for a gate
        other than the choice's own; nothing for auto at its own gate."""
        if self.exact_only:
            return EXACT_SUFFIX
        own = (DEFAULT_MIN_COS, DEFAULT_MAX_REL_L1) if self.over_run else (FAST_MIN_COS, FAST_MAX_REL_L1)
        gate = "" if (self.min_cos, self.max_rel_l1) == own else f"/gate{self.min_cos:g},{self.max_rel_l1:g}"
        return gate + ("" if self.over_run else FAST_SUFFIX)

    def key(self, spec, sparse_ok: bool = True) -> str:
        """The key of this selector's decision for a call of ``spec``."""
        return exact_signature(spec) if self.exact_only else phase_signature(spec, sparse_ok) + self.suffix

    def owns(self, sig: str) -> bool:
        """``sig`` is a key of this selector's kind (auto, auto_fast, auto_exact, and of its gate)."""
        suffix = self.suffix
        if suffix:
            if not sig.endswith(suffix):
                return False
            sig = sig[: -len(suffix)]
        return sig.endswith("/dense-early") or sig.rsplit("/", 1)[-1].startswith("mask=")

    def admits(self, sig: str, name: str) -> bool:
        """A remembered decision this selector may use: its own kind of key, a backend installed here, and for
        auto_exact an exact one (a decisions file is no authority on what is exact)."""
        if not self.owns(sig) or name not in REGISTRY:
            return False
        b = REGISTRY.get(name)
        return b.available and not (self.exact_only and b.quantized)

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
            if self.admits(sig, name):
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
            data.setdefault(fingerprint(), {}).update(
                {s: n for s, n in self.decisions.items() if n not in self.refused.get(s, ())})
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
        ``sparse_ok``; for auto_exact exact kernels that compute in the call's own dtype), SDPA first (the baseline is
        always measured)."""
        names = []
        for b in REGISTRY.backends():
            if b.name in self.exclude or (b.sparse and not sparse_ok) or (self.exact_only and b.quantized):
                continue
            target, why = plan_for(b, spec)
            if self.exact_only and target.dtype != spec.dtype:
                continue  # auto_exact never lowers a call's precision (fp32 computed in a half dtype)
            if why is None and b.refuses(spec, (options or {}).get(b.name)) is None:
                names.append(b.name)
        return sorted(names, key=lambda n: n != REFERENCE)

    def choose(self, cfg, q4, k4, v4, layout, mask4, spec, scale) -> str:
        if not self._loaded:
            self._load()
        sig = self.key(spec, cfg.sparse_ok)
        if sig in self.demoted:  # a lossy choice that failed its re-check: the fastest exact kernel for the run
            exact = getattr(cfg, "exact_selector", None)
            if exact is not None and exact is not self:
                return exact.choose(cfg, q4, k4, v4, layout, mask4, spec, scale)
            return REFERENCE
        hit = self.decisions.get(sig)
        if hit is not None and hit in self.refused.get(sig, ()):  # refused in another lane
            hit = self.repick(sig)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        name, report = self.tune(cfg, q4, k4, v4, layout, mask4, spec, scale, skip=self.refused.get(sig, ()))
        took = (time.perf_counter() - t0) * 1000
        self.tune_ms += took
        self.decisions[sig] = name
        self.reports[sig] = report
        cfg.stats.decisions[sig] = describe(name, report, took)
        log.info("%s %s -> %s (tuned in %.0f ms)", self.label, sig, name, took)
        self._save()
        exact = getattr(cfg, "exact_selector", None)
        if exact is not None and exact is not self:
            exact.learn(spec, report)
        return name

    def learn(self, spec, report: list[Candidate]) -> None:
        """auto_exact's decision for ``spec`` from what ``auto`` measured on the same call (its exact candidates,
        timed the same way), unless this selector has one already: no kernel is timed twice for one call shape."""
        if not self.exact_only:
            return
        if not self._loaded:
            self._load()
        sig = exact_signature(spec)
        if sig in self.decisions:
            return
        allowed = set(self.candidates(spec))
        mine = []
        for c in report:
            if c.name in allowed:
                ok = c.ms is not None and c.cos is not None and c.cos >= self.min_cos and c.rel_l1 <= self.max_rel_l1
                mine.append(Candidate(c.name, c.ms, c.cos, c.rel_l1, ok, c.error))
        if not any(c.name == REFERENCE for c in mine):
            return  # nothing to decide against
        self.decisions[sig] = self.pick(mine)
        self.reports[sig] = mine
        self._save()

    @property
    def label(self) -> str:
        return AUTO_EXACT if self.exact_only else AUTO if self.over_run else AUTO_FAST

    def demote(self, sig: str, why: str) -> None:
        """Use the fastest exact kernel (SDPA without an exact selector) for ``sig`` until :attr:`demoted` is cleared
        (the node clears it at the start of each run): auto_fast's spot check."""
        self.demoted[sig] = why

    def refuse(self, sig: str, name: str, why: str) -> str | None:
        """``name`` left the gate on calls of ``sig``: it is never chosen for ``sig`` again (here and in the lanes
        sharing :attr:`refused`); returns the decision that replaces it (:meth:`repick`)."""
        self.refused.setdefault(sig, {})[name] = why
        return self.repick(sig)

    def repick(self, sig: str) -> str | None:
        """The fastest passing candidate for ``sig`` that is not refused, of those this selector timed for it (saved
        as its decision); None where it timed none (the next call of ``sig`` tunes, without the refused ones)."""
        report = self.reports.get(sig)
        if not report:
            self.decisions.pop(sig, None)
            return None
        out = self.refused.get(sig, {})
        name = self.decisions[sig] = self.pick([c for c in report if c.name not in out])
        self._save()
        return name

    def tune(self, cfg, q4, k4, v4, layout, mask4, spec, scale, skip=()):
        names = [n for n in self.candidates(spec, cfg.options, cfg.sparse_ok) if n not in skip]
        if self.exact_only and len(names) == 1:  # nothing to compare (SDPA alone, e.g. on the CPU): no timing
            return names[0], [Candidate(names[0], passed=True, note="the only exact candidate")]
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
                kc = KernelCall(b, spec, target, layout, scale, opts, as_4d=True)

                def call(kc=kc, check=check):
                    out = kc.run(q4, k4, v4, None, mask4)
                    if check:  # the dispatcher's NaN check is part of this backend's cost
                        flag = finite_flag(out)
                        if cfg.check_finite is True:
                            bool(flag.isfinite())  # immediate mode syncs per call
                    return out

                try:
                    t_first = time.perf_counter()
                    out = call()
                    c.cos, c.rel_l1 = accuracy(out, ref)  # reads the result back: the first call has finished
                    del out  # not kept through the timing: one output less at the first step's peak
                    first_calls_s += time.perf_counter() - t_first
                    c.passed = c.cos >= self.min_cos and c.rel_l1 <= self.max_rel_l1
                    if not c.passed:
                        continue
                    if self.timer is not None:
                        c.ms = self.timer(name, call, q4.device)
                    else:
                        c.ms = time_call(call, q4.device, self.warmup, self.reps, long_ms=self.long_call_ms)
                except Exception as e:
                    c.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    c.passed = False
        return self.pick(report), report

    def pick(self, report: list[Candidate]) -> str:
        """The fastest passing candidate, if it beats SDPA by :attr:`margin`; else SDPA."""
        passing = [c for c in report if c.passed and c.ms is not None]
        if not passing:
            return REFERENCE
        best = min(passing, key=lambda c: c.ms)
        base = next((c for c in passing if c.name == REFERENCE), None)
        if base is not None and best is not base and best.ms > base.ms * (1 - self.margin):
            # Not faster by the margin: keep SDPA (PyTorch's own kernel choice, as timed). A kernel-level win this
            # small does not survive end to end (SDXL on an H100: sdpa_efficient/flash picks were 6 % slower).
            best.note = f"within {self.margin:.0%} of sdpa: sdpa kept"
            return REFERENCE
        return best.name


def describe(name: str, report: list[Candidate], took_ms: float) -> str:
    parts = []
    for c in sorted(report, key=lambda c: (c.ms is None, c.ms or 0)):
        if c.error:
            parts.append(f"{c.name}: {c.error}" if c.error.startswith("not measured") else f"{c.name}: error {c.error}")
        elif not c.passed:
            parts.append(f"{c.name}: failed gate (cos {c.cos:.5f}, rel-L1 {c.rel_l1:.4f})")
        elif c.ms is None:
            parts.append(c.name + (f" ({c.note})" if c.note else ""))
        else:
            parts.append(f"{c.name} {c.ms:.3f} ms" + (f" ({c.note})" if c.note else ""))
    return f"{name} [" + "; ".join(parts) + f"] tuned in {took_ms:.0f} ms"


def select(cfg, q4, k4, v4, layout, mask4, spec, scale) -> str:
    """auto's (or auto_fast's) choice for the call."""
    if cfg.auto is None:
        cfg.auto = AutoSelector.fast() if cfg.backend == AUTO_FAST else AutoSelector()
    return cfg.auto.choose(cfg, q4, k4, v4, layout, mask4, spec, scale)


def select_exact(cfg, q4, k4, v4, layout, mask4, spec, scale) -> str:
    """auto_exact's choice for the call: the fastest exact kernel for its signature (tuned on the first such call)."""
    if cfg.exact_selector is None:
        cfg.exact_selector = AutoSelector.exact()
    return cfg.exact_selector.choose(cfg, q4, k4, v4, layout, mask4, spec, scale)
