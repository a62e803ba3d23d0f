"""fp32 attention reference that fits in memory at video sizes.

Full-size fp32 SDPA can fall back to the math kernel, which materialises the
[H, Nq, Nk] score matrix (171 GB for Wan-480p).  This computes the same thing
in query chunks sized to a memory budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_attention(q, k, v, mask=None, scale=None, budget_bytes: float = 2e9) -> torch.Tensor:
    """fp32 attention of ``[B, H, N, D]`` q/k/v (mask broadcastable to [B, H, Nq, Nk]); returns fp32 HND."""
    q, k, v = q.float(), k.float(), v.float()
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    gqa = {"enable_gqa": True} if k.shape[1] != h else {}
    per_row = 3 * b * h * nk * 4  # scores, softmax and a temporary, fp32
    chunk = max(16, int(budget_bytes // max(per_row, 1)))
    if chunk >= nq:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)
    out = torch.empty(b, h, nq, v.shape[-1], dtype=torch.float32, device=q.device)
    for s in range(0, nq, chunk):
        m = None
        if mask is not None:
            m = mask if mask.shape[-2] == 1 else mask[..., s : s + chunk, :]
        out[:, :, s : s + chunk] = F.scaled_dot_product_attention(q[:, :, s : s + chunk], k, v, attn_mask=m, scale=scale, **gqa)
    return out


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L1) of ``out`` against ``ref``; fp32 elementwise, sums in fp64 (an fp32
    ``cosine_similarity`` over millions of elements drifts by 1e-4 and more, enough to fail a gate on its own)."""
    o, r = out.float().flatten(), ref.float().flatten()
    f64 = torch.float64
    dot = (o * r).sum(dtype=f64)
    norms = (o.square().sum(dtype=f64) * r.square().sum(dtype=f64)).sqrt().clamp_min(1e-30)
    cos = (dot / norms).item()
    rel = ((o - r).abs().sum(dtype=f64) / r.abs().sum(dtype=f64).clamp_min(1e-12)).item()
    return cos, rel
