"""Ulysses attention: the sequence split over ranks becomes a head split for the attention kernel, and back.

Each rank holds its share of the tokens for every head.  Before the kernel, an all-to-all gives each rank every token
for its share of the heads; the kernel (any backend: the dispatcher, ``auto``, ComfyUI's own function) runs unchanged
on ``[B, all tokens, its heads, D]``; an all-to-all gives each rank its tokens back, for every head.  Every head's
attention is computed on one device over the whole sequence, as on one GPU.

- **Heads that do not divide by the ranks** are split unevenly (40 heads on 3 GPUs: 14, 13, 13): still exact, at most
  one head of imbalance; with more ranks than heads some ranks hold none.  Grouped-query calls (fewer K/V heads) are
  split by K/V head, each rank taking the query heads of its K/V heads.
- **Tokens every rank holds whole** (a joint text+image sequence where the text is not split: Flux puts it first, the
  *prefix*, HunyuanVideo last, the *suffix*) take part in the attention once, from the receiving rank's own copy; their
  output rows are gathered over heads.
- **A mask** made by the model for the whole sequence (Flux's Redux attention bias) applies as it is: each rank's kernel
  sees the whole sequence in its one-GPU order; a mask per head is cut to the rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .group import Group, split


@dataclass(frozen=True)
class Layout:
    """One forward's attention sequence on each rank: ``prefix`` tokens held whole, the rank's shard, ``suffix`` tokens
    held whole.  ``shards``: (start, count) of every rank's shard within the split part."""

    prefix: int
    shards: tuple
    suffix: int = 0

    def local_len(self, rank: int) -> int:
        return self.prefix + self.shards[rank][1] + self.suffix

    @property
    def full_len(self) -> int:
        return self.prefix + sum(c for _, c in self.shards) + self.suffix

    def with_ends(self, prefix: int, suffix: int = 0) -> Layout:
        return Layout(prefix, self.shards, suffix)


def shard_layout(tokens: int, ranks: int, prefix: int = 0, suffix: int = 0) -> Layout:
    return Layout(prefix, tuple(split(tokens, ranks)), suffix)


def ulysses(group: Group, rank: int, layout: Layout, q, k, v, local, mask=None):
    """Attention of this rank's tokens over every rank's tokens.

    ``q``: ``[B, L_r, H, D]``, ``k``/``v``: ``[B, L_r, Hk, D]``/``[B, L_r, Hk, Dv]`` (any strides; ``L_r`` =
    ``layout.local_len(rank)``).  ``local(q, k, v)`` is the kernel: it gets ``[B, L, h, D]`` tensors (contiguous, ``L``
    the whole sequence, ``h`` this rank's heads) and returns ``[B, L, h, Dv]`` (any strides).  Returns ``[B, L_r, H, Dv]``.
    ``mask``: None, or a mask over the whole sequence (see :func:`rank_mask`); the kernel is then called
    ``local(q, k, v, mask)`` with this rank's part of it.
    """
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    if h % hk:
        raise ValueError(f"{h} query heads do not group over {hk} key/value heads")
    g = h // hk
    kv_heads = split(hk, group.size)
    full, p, sfx = layout.full_len, layout.prefix, layout.suffix
    a, c = kv_heads[rank]
    if mask is not None:  # checked on every rank before the exchange
        mask = rank_mask(mask, full, h, g * a, g * c)
    dev = q.device
    bufs = [torch.empty(b, full, g * c, d, dtype=q.dtype, device=dev), torch.empty(b, full, c, d, dtype=k.dtype, device=dev),
            torch.empty(b, full, c, dv, dtype=v.dtype, device=dev)]

    def fill_in(peer, tensors, copy):
        if c == 0:
            return
        qf, kf, vf = bufs
        qp, kp, vp = tensors
        s0, sc = layout.shards[peer]
        if sc:
            rows = slice(p + s0, p + s0 + sc)
            src = slice(p, p + sc)
            copy(qf[:, rows], qp[:, src, g * a:g * (a + c)])
            copy(kf[:, rows], kp[:, src, a:a + c])
            copy(vf[:, rows], vp[:, src, a:a + c])
        if peer == rank:  # the tokens every rank holds whole: from this rank's own copy
            for dst_rows, src_rows in _ends(p, sfx, full, q.shape[1]):
                copy(qf[:, dst_rows], q[:, src_rows, g * a:g * (a + c)])
                copy(kf[:, dst_rows], k[:, src_rows, a:a + c])
                copy(vf[:, dst_rows], v[:, src_rows, a:a + c])

    group.exchange(rank, (q, k, v), fill_in)
    if c:
        of = local(*bufs) if mask is None else local(*bufs, mask)
    else:
        of = torch.empty(b, full, 0, dv, dtype=v.dtype, device=dev)
    bufs.clear()  # the kernel's inputs go before the output is exchanged
    s0, sc = layout.shards[rank]
    out = torch.empty(b, q.shape[1], h, dv, dtype=of.dtype, device=dev)

    def fill_out(peer, tensors, copy):
        (op,) = tensors
        pa, pc = kv_heads[peer]
        if pc == 0:
            return
        heads = slice(g * pa, g * (pa + pc))
        if sc:
            copy(out[:, p:p + sc, heads], op[:, p + s0:p + s0 + sc])
        for src_rows, dst_rows in _ends(p, sfx, full, q.shape[1]):
            copy(out[:, dst_rows, heads], op[:, src_rows])

    group.exchange(rank, (of,), fill_out)
    return out


def rank_mask(mask, full: int, heads: int, start: int, count: int):
    """The part of ``mask`` for the kernel of the rank holding query heads ``start`` to ``start + count``.

    ``mask`` is what the model made for the whole sequence of ``full`` tokens, in ComfyUI's shapes (``[Lq, Lk]``,
    ``[B, Lq, Lk]``, ``[B, 1 or H, Lq, Lk]``; keys: the whole sequence; queries: the whole sequence, or 1 to broadcast):
    every rank's kernel runs over the whole sequence in its one-GPU order, so the mask applies as it is, a mask per head
    cut to the rank's heads.  Anything else (a mask made for one rank's share) raises."""
    shape = list(mask.shape)
    if not 2 <= mask.ndim <= 4 or shape[-1] != full or shape[-2] not in (1, full):
        raise ValueError(f"an attention mask of shape {shape} in a call over a split sequence of {full} tokens: a mask "
                         f"must cover the whole sequence ({full} keys; {full} or 1 queries)")
    if mask.ndim == 4 and shape[1] != 1:
        if shape[1] != heads:
            raise ValueError(f"an attention mask of shape {shape} for {heads} heads")
        return mask.narrow(1, start, count)
    return mask


def _ends(prefix: int, suffix: int, full: int, local: int):
    """(rows in the whole sequence, rows in a rank's sequence) of the prefix and suffix tokens."""
    out = []
    if prefix:
        out.append((slice(0, prefix), slice(0, prefix)))
    if suffix:
        out.append((slice(full - suffix, full), slice(local - suffix, local)))
    return out
