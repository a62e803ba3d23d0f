"""Accuracy checks during sampling: the audit of an explicitly chosen lossy kernel, and ``auto``'s re-check.

- **Audit.** The first call of each kind (shapes, mask) on an explicitly chosen lossy backend is compared with dense
  SDPA once; beyond ``auto``'s gate it is logged once and counted (the user chose it: it keeps running).
- **Re-check.** ``auto`` judges its candidates on the first call of a signature.  At the middle and the last step of
  each run its lossy choices are compared with dense SDPA once per signature; one that fails the gate is replaced by
  SDPA for the rest of the run (this call's output too).  Exact choices are never re-checked.

Each check costs one dense call and one device sync; both run in the calling sampling thread's lane.
"""

from __future__ import annotations

import logging

from ..attention import REGISTRY, attention
from ..attention.auto import DEFAULT_MAX_REL_L1, DEFAULT_MIN_COS, phase_signature
from ..attention.calls import prepare
from ..attention.dispatch import error_vs_reference

log = logging.getLogger("patch_attention.nodes")


def gate(cfg):
    auto = cfg.auto
    if auto is not None:
        return auto.min_cos, auto.max_rel_l1
    return DEFAULT_MIN_COS, DEFAULT_MAX_REL_L1


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


def recheck(ln, layer, q, k, v, heads, mask, kw, out):
    """auto, at the middle and last step: each lossy choice compared with dense SDPA once per signature; returns the
    output to use (dense attention when the choice failed the gate)."""
    cfg = ln.config
    auto = cfg.auto
    if auto is None:
        return out
    spec = prepare(q, k, v, heads, mask, kw["skip_reshape"], kw.get("scale"), kw.get("enable_gqa", False))[4]
    sig = phase_signature(spec, cfg.sparse_ok)
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
    log.warning("auto: %s failed the accuracy gate at the %s step on layer %d (cos %.5f, rel-L1 %.4f); "
                "SDPA for the rest of this run", name, ln.check_phase, layer, cos, rel)
    return attention(q, k, v, heads, mask, config=ln.dense, **kw)
