"""Accuracy checks during sampling: the audit of an explicitly chosen lossy kernel, and ``auto``'s judgement of its
lossy choices over the run.

- **Audit.** The first call of each kind (shapes, mask) on an explicitly chosen lossy backend is compared with dense
  SDPA once; beyond ``auto``'s gate it is logged once and counted (the user chose it: it keeps running).
- **auto: judged where it runs.** ``auto`` times its candidates on the first call of a signature; a lossy kernel's
  error is not the same on every call (it grows with some layers and sigmas), so at the run's *check steps* -- the
  first forward it serves (after ``start_percent``), the first of the sparse phase (``sparse_start_percent``), the
  middle and the last step --
  every call ``auto`` serves with a lossy kernel (every layer, every signature in the phase it runs in) is compared
  with dense attention in the call's dtype on 512 of its query rows, spread over the call (``dispatch.error_sums``:
  about 1/64 of a dense call at 32,760 tokens, on the fastest exact kernel measured for the call's shape).
  :func:`probe` leaves the comparison's five sums on the device; the forward's end
  reads them in the one device read it makes anyway (the NaN net's flag, :mod:`.nan_net`), and :func:`judge` applies
  the gate.  A choice beyond it on any call is refused for its signature from then on, in every lane
  (``AutoSelector.refuse``), and the forward is computed again without it.  No call waits for the device, and the
  check steps' calls take the full path (the lean path keeps only exact choices there).  A reading that is not finite
  is the NaN net's to handle, not the gate's.
- **auto_fast: spot checks.** At the middle and the last step of each run its lossy choices are compared with dense
  SDPA once per signature (one device sync each); one that fails the gate is replaced by the fastest exact kernel for
  the rest of the run (this call's output too) and is chosen again in the next run.  Exact choices are never checked.

The checks of a call run in the calling sampling thread's lane.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import torch

from ..attention import REGISTRY, attention
from ..attention.auto import DEFAULT_MAX_REL_L1, DEFAULT_MIN_COS
from ..attention.calls import prepare
from ..attention.dispatch import error_sums, error_vs_reference
from ..attention.reference import from_sums
from .hook import as_float

log = logging.getLogger("patch_attention.nodes")


class Rechecks:
    """When an override's forwards check auto's lossy choices, and what a refusal does to the lanes' cached calls."""

    def __init__(self):
        self.check_sigmas = {}  # sigma of the middle and last step of the current run -> "mid"/"last"
        self.gate_version = 0  # +1 whenever a lane refuses one of auto's choices: every lane drops its cached calls
        self._lock = threading.Lock()

    def start_run(self, config, sigmas) -> None:
        self.check_sigmas = {}
        if config.auto is not None and sigmas is not None and len(sigmas) > 2:
            steps = [float(x) for x in sigmas[:-1]]  # one sync per run; the last sigma is the end of the schedule
            self.check_sigmas = {steps[len(steps) // 2]: "mid", steps[-1]: "last"}

    @staticmethod
    def lossy_ran(ln) -> bool:
        """A lossy (quantized) kernel has run in this lane in this run: only then can the NaN net find anything, and
        only then do auto's re-checks apply. A run on exact kernels (`sdpa`, auto keeping SDPA) pays neither."""
        return any(n in REGISTRY and REGISTRY.get(n).quantized for n in ln.calls)

    def pending(self, ln) -> bool:
        """``auto`` has run a lossy choice in this run, so its middle and last steps check those: only then does a
        forward read its sigma for the phase (a device sync per forward)."""
        return bool(self.check_sigmas) and self.lossy_ran(ln)

    @staticmethod
    def check_phase(ln, phase):
        """This forward's accuracy checks of auto's lossy choices (None: none): ``phase`` ("mid"/"last", from the
        sigma); for ``auto`` also the first forward of the run whose calls it serves ("first": after
        ``start_percent``) and the first of the sparse phase ("sparse-start"): where each phase's choices first run
        in the run."""
        cfg = ln.config
        if cfg.auto is None or not ln.active or cfg.sparse_ok in ln.phases_run:
            return phase
        ln.phases_run.add(cfg.sparse_ok)
        if phase is not None or not cfg.auto.over_run:
            return phase
        return "first" if len(ln.phases_run) == 1 else "sparse-start"

    def phase_of(self, sigma):
        """"mid"/"last" when ``sigma`` is the middle or last step of the run (auto re-checks then), else None."""
        s = as_float(sigma) if self.check_sigmas else None
        if s is None:
            return None
        return next((p for x, p in self.check_sigmas.items() if abs(x - s) <= 1e-4 * max(abs(x), 1e-6)), None)

    def refuse(self, ln, failed) -> None:
        """auto's lossy choices that left the gate in a forward of ``ln`` (:class:`Failed`): refused for their
        signature from now on, in every lane (the lanes' selectors share what is refused; each lane drops its cached
        calls at its next forward, this one now)."""
        auto, stats = ln.config.auto, ln.config.stats
        with self._lock:
            for f in failed:
                why = (f"left the gate at the {f.phase} step on layer {f.layer} (cos {f.cos:.5f}, rel-L1 {f.rel_l1:.4f}; "
                       f"gate cos >= {auto.min_cos:g}, rel-L1 <= {auto.max_rel_l1:g})")
                new = auto.refuse(f.sig, f.name, why)
                stats.decisions[f.sig] = f"{new or 'tuned again'} from then on: {f.name} {why}"
                log.warning("%s: %s %s; not used again for these calls (%s instead), this step computed again",
                            auto.label, f.name, why, new or "the fastest of the others, measured again")
            self.gate_version += 1
        self.refresh(ln)

    def refresh(self, ln) -> None:
        """Drop ``ln``'s cached calls if a lane refused one of auto's choices since they were made (one comparison
        per forward): its next calls ask the selector again."""
        if ln.gate_seen != self.gate_version:
            ln.gate_seen = self.gate_version
            ln.lean.clear()
            ln.config._fast.clear()


def gate(cfg):
    auto = cfg.auto
    if auto is not None:
        return auto.min_cos, auto.max_rel_l1
    return DEFAULT_MIN_COS, DEFAULT_MAX_REL_L1


@dataclass
class Probe:
    """One call's comparison with dense attention, its sums still on the device."""

    sig: str
    name: str
    layer: int
    sums: torch.Tensor


@dataclass
class Failed:
    sig: str
    name: str
    layer: int
    cos: float
    rel_l1: float
    phase: str


def audit(ln, layer, q, k, v, heads, mask, kw, out):
    """First call of a kind on an explicitly chosen lossy backend: its error against dense SDPA, logged once if
    beyond the auto gate."""
    cfg = ln.config
    kind = (q.shape[1:], k.shape[1:], heads, None if mask is None else (mask.shape, mask.dtype))
    if kind in ln.audited:
        return
    ln.audited.add(kind)
    cos, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
    name = cfg.backend
    cfg.stats.add_metrics(f"{name}@first-call", {"cos_vs_dense": cos, "rel_l1_vs_dense": rel})
    min_cos, max_rel = gate(cfg)
    if not (cos >= min_cos and rel <= max_rel):
        log.warning("%s on attention layer %d (q %s, k %s): cos %.5f, rel-L1 %.4f against dense attention, beyond "
                    "auto's gate (cos >= %g, rel-L1 <= %g); choose auto or an exact backend if the image suffers",
                    name, layer, tuple(q.shape), tuple(k.shape), cos, rel, min_cos, max_rel)
        cfg.stats.count_error(name, f"beyond auto's gate on its first call (rel-L1 {rel:.3f})")


def probe(ln, layer, q, k, v, heads, mask, kw, out) -> None:
    """auto, at a check step: this call's error against dense attention, left on the device for the forward's end
    (:func:`judge`), when ``auto`` serves it with a lossy kernel."""
    cfg = ln.config
    auto = cfg.auto
    spec = prepare(q, k, v, heads, mask, kw["skip_reshape"], kw.get("scale"), kw.get("enable_gqa", False))[4]
    sig = auto.key(spec, cfg.sparse_ok)
    name = auto.decisions.get(sig)
    if name is None or not REGISTRY.get(name).quantized:
        return
    ex = ln.dense.exact_selector  # the reference on the fastest exact kernel for the call's shape, where one was measured
    ref = ex.decisions.get(ex.key(spec)) if ex is not None else None
    ln.probes.append(Probe(sig, name, layer, error_sums(out, q, k, v, heads, mask, offset=ln.check_round,
                                                       reference=ref, **kw)))


def judge(ln, readings) -> list[Failed]:
    """The gate on this forward's probes, given their sums as read back (``readings``, in order): each call's error is
    recorded (``<backend>@gate-<step>``); returns the worst call beyond the gate of each (signature, backend)."""
    probes, ln.probes = ln.probes, []
    auto = ln.config.auto
    if not probes or auto is None:
        return []
    stats, phase = ln.config.stats, ln.check_phase
    worst = {}
    for p, sums in zip(probes, readings, strict=True):
        cos, rel = from_sums(sums)
        if not (math.isfinite(cos) and math.isfinite(rel)):
            continue  # NaN/inf: the NaN net's, which sends the layer dense
        stats.add_metrics(f"{p.name}@gate-{phase}", {"cos_vs_dense": cos, "rel_l1_vs_dense": rel})
        if cos >= auto.min_cos and rel <= auto.max_rel_l1:
            continue
        f = worst.get((p.sig, p.name))
        if f is None or beyond(auto, cos, rel) > beyond(auto, f.cos, f.rel_l1):
            worst[(p.sig, p.name)] = Failed(p.sig, p.name, p.layer, cos, rel, phase)
    return list(worst.values())


def beyond(auto, cos: float, rel: float) -> float:
    """How far (cos, rel-L1) is from the gate, as a multiple of its allowance (1: at the gate)."""
    return max(rel / max(auto.max_rel_l1, 1e-12), (1 - cos) / max(1 - auto.min_cos, 1e-12))


def spot_check(ln, layer, q, k, v, heads, mask, kw, out):
    """auto_fast, at the middle and last step: each lossy choice compared with dense SDPA once per signature; returns
    the output to use (dense attention when the choice failed the gate)."""
    cfg = ln.config
    auto = cfg.auto
    if auto is None:
        return out
    spec = prepare(q, k, v, heads, mask, kw["skip_reshape"], kw.get("scale"), kw.get("enable_gqa", False))[4]
    sig = auto.key(spec, cfg.sparse_ok)
    name = auto.decisions.get(sig)
    if name is None or not REGISTRY.get(name).quantized or (ln.check_phase, sig) in ln.checked:
        return out
    ln.checked.add((ln.check_phase, sig))
    cos, rel = error_vs_reference(out, q, k, v, heads, mask, **kw)
    stats = cfg.stats
    stats.add_metrics(f"{name}@recheck-{ln.check_phase}", {"cos_vs_dense": cos, "rel_l1_vs_dense": rel})
    if cos >= auto.min_cos and rel <= auto.max_rel_l1:
        return out
    auto.demote(sig, f"failed the gate at the {ln.check_phase} step (cos {cos:.5f}, rel-L1 {rel:.4f})")
    cfg._fast.clear()
    ln.lean.clear()
    stats.decisions[sig] = f"sdpa for the rest of this run: {name} failed the gate at the {ln.check_phase} step " \
                           f"(cos {cos:.5f}, rel-L1 {rel:.4f})"
    log.warning("%s: %s failed the accuracy gate at the %s step on layer %d (cos %.5f, rel-L1 %.4f); "
                "SDPA for the rest of this run", auto.label, name, ln.check_phase, layer, cos, rel)
    return attention(q, k, v, heads, mask, config=ln.dense, **kw)
