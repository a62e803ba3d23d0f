"""How concentrated a video model's self-attention is, measured on one call's q and k.

What decides whether a sparse kernel (SpargeAttn, Sol-Attn, a sliding window) is fast *and* close to dense is where each
query's attention mass lies.  Per head of one self-attention call over a ``T x H x W`` token grid (frame-major, as Wan
flattens its patches), with 128-token blocks as the sparse kernels use:

- ``block_share_90``: the share of key blocks that holds 90 % of each query block's mass (the mass of a query block is
  its queries' attention summed per key block; blocks taken largest first), averaged over query blocks.  Sol-Attn's
  ``tau`` 1.0 / 1.5 / 2.0 keep about 16 / 7 / 2.7 % of key blocks exact.
- ``window_mass``: the mass inside a 3-D window around each query covering a given share of the tokens (15.5 %: the
  figure Sliding Tile Attention reports for HunyuanVideo, where such a window holds about 70 % of the mass), the window
  shifted inside the grid at its borders so that every query's window has the same size.
- ``spatial_mass`` / ``temporal_mass``: the mass on the query's own frame, and on a column of ``(2r+1)^2`` positions
  around the query's position in every other frame, ``r`` chosen so that the column holds about as many tokens as a
  frame.  A head is *spatial* when the first is larger, else *temporal* (Sparse VideoGen's classes: 29 % spatial and
  67 % temporal heads in HunyuanVideo).

Computed blockwise: a chunk of queries against all keys at a time (exact softmax rows, fp32), never the full
``N x N`` matrix of a head.  No ComfyUI here: q/k tensors and a grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

BLOCK = 128
STA_SHARE = 0.155  # Sliding Tile Attention's window share on HunyuanVideo


def window_dims(grid, share: float = STA_SHARE) -> tuple[int, int, int]:
    """A 3-D window (wt, wh, ww) over ``grid`` (T, H, W) whose token share is closest to ``share``: the same fraction
    of each axis, then the integer sizes around it that come closest."""
    t, h, w = grid
    f = share ** (1 / 3)
    best = None
    for wt in {max(1, min(t, x)) for x in (math.floor(f * t), math.ceil(f * t))}:
        for wh in {max(1, min(h, x)) for x in (math.floor(f * h), math.ceil(f * h))}:
            for ww in range(1, w + 1):
                err = abs(wt * wh * ww / (t * h * w) - share)
                if best is None or err < best[0]:
                    best = (err, (wt, wh, ww))
    return best[1]


def column_radius(grid) -> int:
    """``r`` such that a (2r+1) x (2r+1) column over all frames holds about as many tokens as one frame."""
    t, h, w = grid
    return max(0, round((math.sqrt(h * w / max(t, 1)) - 1) / 2))


def _window_starts(pos, size, extent):
    """Start index of a window of ``size`` centred on ``pos`` and shifted inside ``[0, extent)``."""
    return (pos - size // 2).clamp(0, extent - size)


@dataclass
class HeadStats:
    block_share_90: float
    window_mass: float
    spatial_mass: float
    temporal_mass: float

    @property
    def kind(self) -> str:
        return "spatial" if self.spatial_mass >= self.temporal_mass else "temporal"


@dataclass
class CallStats:
    """Concentration of one self-attention call, per head."""

    grid: tuple
    window: tuple
    window_share: float
    radius: int
    heads: list = field(default_factory=list)  # HeadStats per head
    query_blocks: int = 0  # query blocks measured per head

    def summary(self, target_share: float = 0.25) -> dict:
        hs = self.heads
        n = max(len(hs), 1)
        shares = sorted(h.block_share_90 for h in hs)
        return {
            "heads": len(hs),
            "block_share_90_mean": sum(shares) / n,
            "block_share_90_median": shares[len(shares) // 2] if shares else float("nan"),
            "heads_within_target": sum(s <= target_share for s in shares) / n,
            "window_mass_mean": sum(h.window_mass for h in hs) / n,
            "spatial_heads": sum(h.kind == "spatial" for h in hs) / n,
            "temporal_heads": sum(h.kind == "temporal" for h in hs) / n,
        }


def call_stats(q: torch.Tensor, k: torch.Tensor, grid, *, scale: float | None = None, chunk: int = 1024,
               query_stride: int = 1, share: float = STA_SHARE, batch_index: int = 0) -> CallStats:
    """Concentration of one self-attention call: ``q``/``k`` as ``[B, H, N, D]`` (after RoPE: what the kernel gets),
    ``grid`` = (T, H, W) with ``T*H*W == N`` in frame-major order.  ``query_stride`` > 1 measures every n-th query block
    only (a faster estimate).  One batch element (``batch_index``: 0 is the positive prompt in ComfyUI's CFG batch)."""
    t, gh, gw = (int(x) for x in grid)
    n = q.shape[2]
    if t * gh * gw != n or k.shape[2] != n:
        raise ValueError(f"concentration: grid {tuple(grid)} has {t * gh * gw} tokens, q has {n}, k has {k.shape[2]}")
    if chunk % BLOCK:
        raise ValueError(f"concentration: chunk {chunk} is not a multiple of {BLOCK}")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    dev = q.device
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    win = window_dims((t, gh, gw), share)
    r = column_radius((t, gh, gw))
    idx = torch.arange(n, device=dev)
    pos_t, pos_h, pos_w = idx // (gh * gw), (idx // gw) % gh, idx % gw
    ar_t, ar_h, ar_w = (torch.arange(x, device=dev) for x in (t, gh, gw))
    heads = []
    measured_blocks = 0
    for head in range(q.shape[1]):
        qf = q[batch_index, head].float()
        kf = k[batch_index, head].float()
        share_sum = win_sum = sp_sum = tm_sum = 0.0
        nq = 0
        nqb = 0
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            blocks = list(range(s // BLOCK, -(-e // BLOCK)))
            if query_stride > 1:
                blocks = [b for b in blocks if b % query_stride == 0]
                if not blocks:
                    continue
            rows = torch.cat([torch.arange(b * BLOCK, min((b + 1) * BLOCK, n), device=dev) for b in blocks])
            p = torch.softmax((qf[rows] @ kf.T) * scale, dim=-1)  # [c, n], exact rows
            # mass per key block, summed over each query block
            pk = torch.nn.functional.pad(p, (0, pad)).view(len(rows), nb, BLOCK).sum(-1)  # [c, nb]
            qb = torch.div(rows, BLOCK, rounding_mode="floor")
            _, inv = torch.unique_consecutive(qb, return_inverse=True)
            mass = torch.zeros(int(inv.max()) + 1, nb, device=dev).index_add_(0, inv, pk)
            mass = mass / mass.sum(-1, keepdim=True)
            srt = mass.sort(dim=-1, descending=True).values.cumsum(-1)
            k90 = (srt < 0.9).sum(-1) + 1
            share_sum += float((k90.float() / nb).sum())
            nqb += mass.shape[0]
            # 3-D window, frame and column masses
            p4 = p.view(len(rows), t, gh, gw)
            rt, rh, rw = pos_t[rows], pos_h[rows], pos_w[rows]
            st = _window_starts(rt, win[0], t)
            sh = _window_starts(rh, win[1], gh)
            sw = _window_starts(rw, win[2], gw)
            mt = ((ar_t[None] >= st[:, None]) & (ar_t[None] < (st + win[0])[:, None])).float()
            mh = ((ar_h[None] >= sh[:, None]) & (ar_h[None] < (sh + win[1])[:, None])).float()
            mw = ((ar_w[None] >= sw[:, None]) & (ar_w[None] < (sw + win[2])[:, None])).float()
            in_win = torch.einsum("cthw,ct->chw", p4, mt)
            in_win = torch.einsum("chw,ch->cw", in_win, mh)
            win_sum += float((in_win * mw).sum())
            per_frame = p4.sum((2, 3))  # [c, t]
            own = per_frame.gather(1, rt[:, None]).squeeze(1)
            ch = ((ar_h[None] - rh[:, None]).abs() <= r).float()
            cw = ((ar_w[None] - rw[:, None]).abs() <= r).float()
            col = torch.einsum("cthw,ch->ctw", p4, ch)
            col = torch.einsum("ctw,cw->ct", col, cw)
            col_other = col.sum(-1) - col.gather(1, rt[:, None]).squeeze(1)
            sp_sum += float(own.sum())
            tm_sum += float(col_other.sum())
            nq += len(rows)
        heads.append(HeadStats(share_sum / max(nqb, 1), win_sum / max(nq, 1), sp_sum / max(nq, 1), tm_sum / max(nq, 1)))
        measured_blocks = nqb
    return CallStats(grid=(t, gh, gw), window=win, window_share=math.prod(win) / n, radius=r, heads=heads,
                     query_blocks=measured_blocks)


def to_hnd(q: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    """A ComfyUI attention input (``[B, N, H*D]``, or ``[B, H, N, D]`` with ``skip_reshape``) as ``[B, H, N, D]``."""
    if skip_reshape:
        return q
    b, n, hd = q.shape
    return q.view(b, n, heads, hd // heads).transpose(1, 2)


def summarize_calls(calls: list[CallStats], target_share: float = 0.25) -> dict:
    """Over several calls (layers, steps): per-head figures pooled, the same keys as :meth:`CallStats.summary`."""
    pooled = CallStats(grid=calls[0].grid, window=calls[0].window, window_share=calls[0].window_share,
                       radius=calls[0].radius, heads=[h for c in calls for h in c.heads]) if calls else None
    return pooled.summary(target_share) if pooled else {}
