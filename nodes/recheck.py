"""Accuracy checks during sampling: the audit of an explicitly chosen lossy kernel, and ``auto``'s judgement of its
lossy choices over the run.

- **Audit.** The first call of each kind (shapes, mask) on an explicitly chosen lossy backend is compared with dense
  SDPA once; beyond ``auto``'s gate it is logged once and counted (the user chose it: it keeps running).
- **auto: judged where it runs.** ``auto`` times its candidates on the first call of a signature; a lossy kernel's
  error is not the same on every call (it grows with some layers and sigmas), so at the run's *check steps* -- the
  first forward it serves (after ``start_percent``), the first of the sparse phase (``sparse_start_percent``), the
  middle and the last step --
  every call ``auto`` serves with a lossy kernel (every layer, every signature in the phase it runs in) is compared
  with SDPA in the call's dtype on 1,024 of its query rows, spread over the call (``dispatch.error_sums``: about 1/32
  of a dense call at 32,760 tokens).  :func:`probe` leaves the comparison's five sums on the device; the forward's end
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
from dataclasses import dataclass

import torch

from ..attention import REGISTRY, attention
from ..attention.auto import DEFAULT_MAX_REL_L1, DEFAULT_MIN_COS
from ..attention.calls import prepare
from ..attention.dispatch import error_sums, error_vs_reference
from ..attention.reference import from_sums

log = logging.getLogger("patch_attention.nodes")


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
    ln.probes.append(Probe(sig, name, layer, error_sums(out, q, k, v, heads, mask, offset=ln.check_round, **kw)))


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
