"""Ulysses attention: the sequence split over ranks becomes a head split for the attention kernel, and back.

Each rank holds its share of the tokens for every head.  Before the kernel, an all-to-all gives each rank every token
for its share of the heads; the kernel (any backend: the dispatcher, ``auto``, ComfyUI's own function) runs unchanged
on ``[B, all tokens, its heads, D]``; an all-to-all gives each rank its tokens back, for every head.  Every head's
attention is computed on one device over the whole sequence, as on one GPU.

- **Heads that do not divide by the ranks** are split unevenly (40 heads on 3 GPUs: 14, 13, 13): still exact, at most
  one head of imbalance; with more ranks than heads some ranks hold none.  Grouped-query calls (fewer K/V heads) are
  split by K/V head, each rank taking the query heads of its K/V heads.
- **Tokens every rank holds whole** (a joint text+image sequence where the text is not split: Flux and HunyuanVideo put
  it first, the *prefix*; text after the image is the *suffix*) take part in the attention once, from the receiving
  rank's own copy; their output rows are gathered over heads.
- **A key mask** (one row for every query: a padded prompt's text keys masked out) travels with the keys: the kernel
  gets the whole sequence's mask.  A mask that differs between queries cannot be split this way.
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
    ``mask``: a key mask ``[Bm, Hm, 1, L_r]`` (``Bm`` 1 or B, ``Hm`` 1 or H; any dtype), or None; with one, the kernel
    is called as ``local(q, k, v, mask=[Bm, 1 or h, 1, L])``.
    """
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    if h % hk:
        raise ValueError(f"{h} query heads do not group over {hk} key/value heads")
    g = h // hk
    kv_heads = split(hk, group.size)
    full, p, sfx = layout.full_len, layout.prefix, layout.suffix
    a, c = kv_heads[rank]
    dev = q.device
    bufs = [torch.empty(b, full, g * c, d, dtype=q.dtype, device=dev), torch.empty(b, full, c, d, dtype=k.dtype, device=dev),
            torch.empty(b, full, c, dv, dtype=v.dtype, device=dev)]
    posted = (q, k, v)
    if mask is not None:
        if mask.ndim != 4 or mask.shape[2] != 1 or mask.shape[3] != q.shape[1] or mask.shape[1] not in (1, h):
            raise ValueError(f"a key mask over {q.shape[1]} tokens and {h} heads is [B, 1 or {h}, 1, {q.shape[1]}], "
                             f"not {list(mask.shape)}")
        mh = slice(g * a, g * (a + c)) if mask.shape[1] > 1 else slice(None)
        mf = torch.empty(mask.shape[0], g * c if mask.shape[1] > 1 else 1, 1, full, dtype=mask.dtype, device=dev)
        posted += (mask,)

    def fill_in(peer, tensors, copy):
        if c == 0:
            return
        qf, kf, vf = bufs
        qp, kp, vp = tensors[:3]
        s0, sc = layout.shards[peer]
        if sc:
            rows = slice(p + s0, p + s0 + sc)
            src = slice(p, p + sc)
            copy(qf[:, rows], qp[:, src, g * a:g * (a + c)])
            copy(kf[:, rows], kp[:, src, a:a + c])
            copy(vf[:, rows], vp[:, src, a:a + c])
            if mask is not None:
                copy(mf[..., rows], tensors[3][:, mh, :, src])
        if peer == rank:  # the tokens every rank holds whole: from this rank's own copy
            for dst_rows, src_rows in _ends(p, sfx, full, q.shape[1]):
                copy(qf[:, dst_rows], q[:, src_rows, g * a:g * (a + c)])
                copy(kf[:, dst_rows], k[:, src_rows, a:a + c])
                copy(vf[:, dst_rows], v[:, src_rows, a:a + c])
                if mask is not None:
                    copy(mf[..., dst_rows], mask[:, mh, :, src_rows])

    group.exchange(rank, posted, fill_in)
    if c:
        of = local(*bufs) if mask is None else local(*bufs, mask=mf)
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


def _ends(prefix: int, suffix: int, full: int, local: int):
    """(rows in the whole sequence, rows in a rank's sequence) of the prefix and suffix tokens."""
    out = []
    if prefix:
        out.append((slice(0, prefix), slice(0, prefix)))
    if suffix:
        out.append((slice(full - suffix, full), slice(local - suffix, local)))
    return out
