"""fp32 attention reference that fits in memory at video sizes.

Full-size fp32 SDPA can fall back to the math kernel, which materialises the
[H, Nq, Nk] score matrix (171 GB for Wan-480p).  This computes the same thing
in query chunks sized to a memory budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mask_part(mask, b: int, heads: slice, rows: slice):
    """The part of ``mask`` (broadcastable to [B, H, Nq, Nk], right-aligned as torch broadcasts) for batch ``b``,
    query heads ``heads`` and query rows ``rows``: a view, as 4-D."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return m[slice(b, b + 1) if m.shape[0] > 1 else slice(None), heads if m.shape[1] > 1 else slice(None),
             rows if m.shape[2] > 1 else slice(None)]


def reference_attention(q, k, v, mask=None, scale=None, budget_bytes: float = 2e9) -> torch.Tensor:
    """fp32 attention of ``[B, H, N, D]`` q/k/v (mask broadcastable to [B, H, Nq, Nk]); returns fp32 HND.

    Beyond the fp32 output, memory stays within about ``budget_bytes``: q/k/v are converted to fp32 a part at a time
    (one batch element, a block of heads, a chunk of query rows), never whole (at Wan 14B 720p whole fp32 copies of
    q/k/v took 8.7 GB on top of the sampling run).  On CUDA the parts go to PyTorch's memory-efficient kernel, which
    keeps no score matrix, so a part takes all query rows at once; elsewhere (or where that kernel refuses the call)
    SDPA runs on row chunks small enough for a materialised score matrix."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    if q.is_cuda:
        try:
            return _reference(q, k, v, mask, scale, budget_bytes, streaming=True)
        except RuntimeError as e:
            if "out of memory" in str(e):
                raise
    return _reference(q, k, v, mask, scale, budget_bytes, streaming=False)


def _reference(q, k, v, mask, scale, budget_bytes, streaming):
    b, h, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = h // hk  # query heads per key/value head (grouped-query attention)
    if streaming:
        from .backends.sdpa import _efficient  # the ATen op with SDPA's front-end work (mask, bias alignment)
    kv_head_bytes = nk * (d + dv) * 4 * (group if streaming else 1)  # streaming: k/v repeated per query head
    kv_heads = max(1, min(hk, int(budget_bytes // 2 // max(kv_head_bytes, 1))))
    out = torch.empty(b, h, nq, dv, dtype=torch.float32, device=q.device)
    for i in range(b):
        for j in range(0, hk, kv_heads):
            kh = slice(j, min(j + kv_heads, hk))
            qh = slice(kh.start * group, kh.stop * group)
            kf, vf = k[i : i + 1, kh].float(), v[i : i + 1, kh].float()
            if streaming and group > 1:  # the memory-efficient kernel has no grouped-query heads
                kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
            nh = qh.stop - qh.start
            per_row = nh * (d + dv) * 4 if streaming else nh * (3 * nk + d) * 4  # fp32 q and out rows (+ scores)
            chunk = max(16, int(budget_bytes // 2 // max(per_row, 1)))
            for s in range(0, nq, chunk):
                rows = slice(s, min(s + chunk, nq))
                m = None if mask is None else _mask_part(mask, i, qh, rows)
                qf = q[i : i + 1, qh, rows].float()
                if streaming:
                    o = _efficient(qf, kf, vf, layout="HND", mask=m, scale=scale, opts=None)
                else:
                    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m, scale=scale,
                                                       **({"enable_gqa": True} if group > 1 else {}))
                out[i : i + 1, qh, rows] = o
    return out


def _pieces(t: torch.Tensor, n: int):
    """Views that cover ``t`` in order, each of at most about ``n`` elements, by slicing its leading dimensions: the
    same pieces for any two tensors of one shape, whatever their strides."""
    if t.numel() <= n or t.dim() <= 1:
        yield from t.split(n) if t.dim() == 1 else (t,)
        return
    inner = t[0].numel()
    if inner > n:
        for x in t.unbind(0):
            yield from _pieces(x, n)
    else:
        yield from t.split(max(1, n // inner))


def accuracy_sums(out: torch.Tensor, ref: torch.Tensor, piece: int = 1 << 24) -> torch.Tensor:
    """The five sums :func:`accuracy` is made of (out.ref, out.out, ref.ref, |out - ref|, |ref|), as an fp64 device
    tensor: nothing is read back (a caller folds them into a device read it makes anyway; :func:`from_sums`)."""
    if out.shape != ref.shape:
        out, ref = out.reshape(-1), ref.reshape(-1)
    f64 = torch.float64
    sums = torch.zeros(5, dtype=f64, device=ref.device)
    if out.is_contiguous() and ref.is_contiguous():
        out, ref = out.view(-1), ref.view(-1)
    for po, pr in zip(_pieces(out, piece), _pieces(ref, piece), strict=True):
        o, r = po.float().reshape(-1), pr.float().reshape(-1)
        sums += torch.stack([(o * r).sum(dtype=f64), o.square().sum(dtype=f64), r.square().sum(dtype=f64),
                             (o - r).abs_().sum(dtype=f64), r.abs().sum(dtype=f64)])
    return sums


def from_sums(sums) -> tuple[float, float]:
    """(cosine similarity, relative L1) from :func:`accuracy_sums`' five numbers (read back)."""
    dot, oo, rr, l1, r1 = sums
    return dot / max((oo * rr) ** 0.5, 1e-30), l1 / max(r1, 1e-12)


def accuracy(out: torch.Tensor, ref: torch.Tensor, piece: int = 1 << 24) -> tuple[float, float]:
    """(cosine similarity, relative L1) of ``out`` against ``ref``; fp32 elementwise, sums in fp64 (an fp32
    ``cosine_similarity`` over millions of elements drifts by 1e-4 and more, enough to fail a gate on its own).
    Computed ``piece`` elements at a time (a few hundred MB at most, whatever the size), one device sync."""
    return from_sums(accuracy_sums(out, ref, piece).tolist())
