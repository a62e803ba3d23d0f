"""Ulysses attention: the sequence split over ranks becomes a head split for the attention kernel, and back.

Each rank holds its share of the tokens for every head.  Before the kernel, an all-to-all gives each rank every token
for its share of the heads; the kernel (any backend: the dispatcher, ``auto``, ComfyUI's own function) runs unchanged
on ``[B, all tokens, its heads, D]``; an all-to-all gives each rank its tokens back, for every head.  Every head's
attention is computed on one device over the whole sequence, as on one GPU.

- **Heads that do not divide by the ranks** are split unevenly (40 heads on 3 GPUs: 14, 13, 13): still exact, at most
  one head of imbalance; with more ranks than heads some ranks hold none.  Grouped-query calls (fewer K/V heads) are
  split by K/V head, each rank taking the query heads of its K/V heads.
- **Tokens every rank holds whole** (a joint text+image sequence where the text is not split: Flux puts it first, the
  *prefix*, as do HunyuanVideo and Qwen-Image; a model may put it last, the *suffix*) take part in the attention
  once, from the receiving rank's own copy; their
  output rows are gathered over heads.
- **A key mask** (one row for every query, e.g. a text padding mask over a joint sequence: ``[..., 1, keys]``) is
  exchanged with the keys: each rank's kernel gets the mask's columns for the whole sequence (and its share of the
  mask's heads, where it has a head dimension).  A mask that differs by query cannot be split this way.
- **A mask the model made for the whole sequence** (Flux's Redux attention bias: ``[..., L or 1, L]``) applies as it
  is: each rank's kernel sees the whole sequence in its one-GPU order; a mask per head is cut to the rank's heads.
- **The exchange can overlap the kernel**: this rank's heads go in parts (:data:`PIPELINE_PARTS`; one by default: over
  NVLink it did not pay); the parts arrive on a receive stream one after the other while the kernel runs on the part
  before, and each part's output goes back while the kernel runs on the next (calls with a mask: one part).
- **Masks over ranges of query rows** (:class:`RowMasks`: LTX-Video's attenuated guide frames) is applied on the far
  side of the exchange, where each rank holds every token: the kernel runs once per range of query rows, each with
  that range's mask, so no ``[L, L]`` mask is ever made.
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


@dataclass(frozen=True)
class RowMasks:
    """An additive attention mask over the whole attention sequence of a split forward (prefix, split part, suffix;
    queries and keys the same sequence), by ranges of query rows: ``parts`` = ``((start, stop, mask or None), ...)``,
    covering rows ``0..L`` in order; each mask broadcasts to ``[B, 1, stop - start, L]`` (one for every head)."""

    parts: tuple

    def check(self, full: int) -> None:
        """A clear error where the parts do not describe a mask over ``full`` tokens."""
        row = 0
        for start, stop, mask in self.parts:
            if start != row or stop < start:
                raise ValueError(f"mask rows {start}..{stop} do not follow rows 0..{row} (a mask over {full} tokens)")
            row = stop
            if mask is None:
                continue
            m = mask.shape
            heads = m[-3] if len(m) >= 3 else 1
            if len(m) < 2 or m[-1] != full or m[-2] not in (1, stop - start) or heads != 1:
                raise ValueError(f"a mask of shape {tuple(m)} for rows {start}..{stop} of {full} tokens (expected "
                                 f"[B, 1, {stop - start} or 1, {full}])")
        if row != full:
            raise ValueError(f"mask rows 0..{row} of {full} tokens")

    def around(self, local):
        """The kernel ``local(q, k, v, mask=None)`` over the whole sequence, each range of query rows with its mask."""

        def masked(q, k, v):
            outs = [local(q[:, a:b], k, v, mask=m) for a, b, m in self.parts if b > a]
            return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

        return masked


def shard_layout(tokens: int, ranks: int, prefix: int = 0, suffix: int = 0) -> Layout:
    return Layout(prefix, tuple(split(tokens, ranks)), suffix)


@torch.compiler.disable  # under torch.compile: a graph break; the exchange and the kernel run as they are
def ulysses(group: Group, rank: int, layout: Layout, q, k, v, local, mask=None, masks: RowMasks | None = None):
    """Attention of this rank's tokens over every rank's tokens.

    ``q``: ``[B, L_r, H, D]``, ``k``/``v``: ``[B, L_r, Hk, D]``/``[B, L_r, Hk, Dv]`` (any strides; ``L_r`` =
    ``layout.local_len(rank)``).  ``local(q, k, v)`` is the kernel: it gets ``[B, L, h, D]`` tensors (contiguous, ``L``
    the whole sequence, ``h`` this rank's heads) and returns ``[B, L, h, Dv]`` (any strides).  Returns ``[B, L_r, H, Dv]``.

    ``mask``: a key mask over this rank's keys, the same for every query: ``[1, L_r]``, ``[B, 1, L_r]`` or
    ``[B, H or 1, 1, L_r]`` (ComfyUI's mask shapes with one query row).  The kernel is then called as
    ``local(q, k, v, mask=...)`` with the mask over the whole sequence (``[..., 1, L]``; with a head dimension of ``H``, this
    rank's heads).

    A ``mask`` whose keys are the whole sequence instead (``[..., L or 1, L]``, :func:`rank_mask`) is not exchanged: the
    kernel gets it as it is (its heads cut to this rank's).

    ``masks`` (:class:`RowMasks`): the kernel is called as ``local(q, k, v, mask=...)`` once per range of query rows
    (``q`` those rows only, a view).  A key mask and row masks together are refused.
    """
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    if h % hk:
        raise ValueError(f"{h} query heads do not group over {hk} key/value heads")
    if mask is not None and masks is not None:
        raise ValueError("a key mask and masks over query rows in one call: not supported by the exchange")
    why = mask_problem(mask, k.shape[1], layout.full_len, h) if mask is not None else None
    if why:
        raise ValueError(why)
    g = h // hk
    kv_heads = split(hk, group.size)
    full, p, sfx = layout.full_len, layout.prefix, layout.suffix
    a, c = kv_heads[rank]
    whole_mask = None
    if mask is not None and mask.shape[-1] == full and (full != k.shape[1] or mask.shape[-2] != 1):
        # made for the whole sequence (with one query row and one rank the two kinds are the same)
        whole_mask, mask = rank_mask(mask, full, h, g * a, g * c), None
    dev = q.device
    # the heads in parts, each exchanged while the kernel runs on the one before (no mask: one part with a mask)
    parts = split(c, group.pipeline or PIPELINE_PARTS) if mask is None and whole_mask is None and masks is None \
        else [(0, c)]
    recv = group.receiving(rank)
    bufs = [[torch.empty(b, full, g * n, d, dtype=q.dtype, device=dev), torch.empty(b, full, n, d, dtype=k.dtype, device=dev),
             torch.empty(b, full, n, dv, dtype=v.dtype, device=dev)] for _, n in parts]
    posted, mask_heads = (q, k, v), False
    if mask is not None:
        mask_heads = mask.ndim == 4 and mask.shape[1] > 1  # a head dimension: this rank's query heads
        mshape = (*mask.shape[:-3], g * c if mask_heads else mask.shape[-3], 1, full) if mask.ndim > 2 else (1, full)
        bufs[0].append(torch.empty(mshape, dtype=mask.dtype, device=dev))
        posted += (mask,)
    compute = torch.cuda.current_stream(dev) if recv is not None else None
    if recv is not None:
        recv.wait_stream(compute)  # the buffers were made on the compute stream

    def mask_cols(m, cols):  # a rank's mask columns ``cols``, its heads only
        return m[:, g * a:g * (a + c), :, cols] if mask_heads else m[..., cols]

    def fill_in(peer, tensors, copy, part, pbufs):
        qf, kf, vf = pbufs[:3]
        qp, kp, vp = tensors[:3]
        lo, hi = a + part[0], a + part[0] + part[1]
        s0, sc = layout.shards[peer]
        if sc:
            rows = slice(p + s0, p + s0 + sc)
            src = slice(p, p + sc)
            copy(qf[:, rows], qp[:, src, g * lo:g * hi])
            copy(kf[:, rows], kp[:, src, lo:hi])
            copy(vf[:, rows], vp[:, src, lo:hi])
            if mask is not None:
                copy(pbufs[3][..., rows], mask_cols(tensors[3], src))
        if peer == rank:  # the tokens every rank holds whole: from this rank's own copy
            for dst_rows, src_rows in _ends(p, sfx, full, q.shape[1]):
                copy(qf[:, dst_rows], q[:, src_rows, g * lo:g * hi])
                copy(kf[:, dst_rows], k[:, src_rows, lo:hi])
                copy(vf[:, dst_rows], v[:, src_rows, lo:hi])
                if mask is not None:
                    copy(pbufs[3][..., dst_rows], mask_cols(mask, src_rows))

    got = group.post(rank, posted)
    arrived = []
    for part, pbufs in zip(parts, bufs):
        if part[1]:
            for peer in range(group.size):
                fill_in(peer, got[peer][0], group.puller(rank, peer, got, recv), part, pbufs)
        arrived.append(recv.record_event() if recv is not None else None)
    del got
    out = None
    for i, (part, event) in enumerate(zip(parts, arrived)):
        if event is not None:
            compute.wait_event(event)
        if not part[1]:
            of = torch.empty(b, full, 0, dv, dtype=v.dtype, device=dev)
        elif mask is not None:
            of = local(*bufs[i][:3], mask=bufs[i][3])
        elif whole_mask is not None:
            of = local(*bufs[i], mask=whole_mask)
        else:
            of = (masks.around(local) if masks is not None else local)(*bufs[i])
        bufs[i] = None  # the kernel's inputs go before the output is exchanged
        if out is None:
            out = torch.empty(b, q.shape[1], h, dv, dtype=of.dtype, device=dev)
            if recv is not None:
                recv.wait_stream(compute)  # ``out`` was made on the compute stream
        _back(group, rank, layout, kv_heads, g, of, out, recv, i, len(parts))
        del of
    if recv is not None:
        compute.wait_stream(recv)
    return out


def _back(group: Group, rank: int, layout: Layout, kv_heads: list, g: int, of, out, recv, part: int = 0,
          parts: int = 1) -> None:
    """The kernel's output ``of`` (``[B, L, h, Dv]``: every token, this rank's heads, or part ``part`` of ``parts`` of
    them) to every rank, and every rank's into this rank's ``out`` (``[B, L_r, H, Dv]``: its tokens, every head)."""
    p, sfx, full = layout.prefix, layout.suffix, layout.full_len
    s0, sc = layout.shards[rank]
    back = group.post(rank, (of,))
    for peer in range(group.size):
        (op,) = back[peer][0]
        pa, pc = kv_heads[peer]
        pl, pn = split(pc, parts)[part]
        if pn == 0:
            continue
        heads = slice(g * (pa + pl), g * (pa + pl + pn))
        copy = group.puller(rank, peer, back, recv)
        if sc:
            copy(out[:, p:p + sc, heads], op[:, p + s0:p + s0 + sc])
        for src_rows, dst_rows in _ends(p, sfx, full, out.shape[1]):
            copy(out[:, dst_rows, heads], op[:, src_rows])


class Staged:
    """One exchanged call whose q, k and v are sent one at a time, as the model makes them: each crosses to the other
    ranks while the model computes the next, so only the last one's exchange is waited for (:func:`ulysses` sends all
    three once the call is made).  For calls :func:`ulysses` would serve in one part with no mask and no tokens held
    whole (:meth:`fits`); the kernel and the way back are :func:`ulysses`'s, and so is the result, bit for bit.

    ``send(q)``, ``send(k)``, ``send(v)`` in that order (``[B, L_r, heads, D]``, any strides), then ``finish(local)``
    returns ``[B, L_r, H, Dv]`` (``local`` as for :func:`ulysses`).  Every rank makes the same calls in the same order:
    each send is a rendezvous."""

    def __init__(self, group: Group, rank: int, layout: Layout, heads: int, kv_heads: int):
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
        self.group, self.rank, self.layout = group, rank, layout
        self.g, self.kv = heads // kv_heads, split(kv_heads, group.size)
        self.recv = group.receiving(rank)
        self.bufs = []

    @staticmethod
    def fits(group: Group, layout: Layout | None, masks=None) -> bool:
        """Whether an exchanged call over ``layout`` can be staged."""
        return (layout is not None and not layout.prefix and not layout.suffix and masks is None
                and (group.pipeline or PIPELINE_PARTS) == 1)

    def send(self, t) -> None:
        """The next of q, k, v: posted, and every rank's tokens of this rank's heads pulled into a buffer."""
        g = self.g if not self.bufs else 1  # q: the query heads of this rank's key/value heads
        a, c = self.kv[self.rank]
        lay = self.layout
        buf = torch.empty(t.shape[0], lay.full_len, g * c, t.shape[3], dtype=t.dtype, device=t.device)
        if self.recv is not None:
            self.recv.wait_stream(torch.cuda.current_stream(t.device))  # ``buf`` was made on the compute stream
        got = self.group.post(self.rank, (t,))
        for peer, (s0, sc) in enumerate(lay.shards):
            if sc:
                copy = self.group.puller(self.rank, peer, got, self.recv)
                copy(buf[:, s0:s0 + sc], got[peer][0][0][:, :sc, g * a:g * (a + c)])
        self.bufs.append(buf)

    def finish(self, local):
        """The kernel on every token of this rank's heads, and every rank's tokens back: ``[B, L_r, H, Dv]``."""
        if len(self.bufs) != 3:
            raise RuntimeError(f"a staged attention call finished after {len(self.bufs)} of q, k and v were sent")
        q = self.bufs[0]
        dev = q.device
        compute = torch.cuda.current_stream(dev) if self.recv is not None else None
        if compute is not None:
            compute.wait_stream(self.recv)
        # a rank with no heads (more ranks than heads) runs no kernel
        of = local(*self.bufs) if q.shape[2] else self.bufs[2][:, :, :0]
        self.bufs = []
        b, h = q.shape[0], self.g * sum(c for _, c in self.kv)
        out = torch.empty(b, self.layout.local_len(self.rank), h, of.shape[3], dtype=of.dtype, device=dev)
        if self.recv is not None:
            self.recv.wait_stream(compute)  # ``out`` was made on the compute stream
        _back(self.group, self.rank, self.layout, self.kv, self.g, of, out, self.recv)
        del of
        if compute is not None:
            compute.wait_stream(self.recv)
        return out


# In how many parts an exchanged call sends its heads (Group(pipeline=N) overrides), each part's exchange overlapping
# the kernel on the part before. Measured on 2x H100 (NVLink), Wan 2.1 14B, sage_fp8_sm90: one part x1.897 (720p) /
# x1.829 (480p), two x1.883 / x1.827, four x1.867 / x1.804: over NVLink the exchange is too small a share (2-3 %) for the
# overlap to pay for smaller kernels and a rendezvous per part. Kept for links where it is not (PCIe).
PIPELINE_PARTS = 1


def mask_problem(mask, local_keys: int, full: int, heads: int) -> str | None:
    """Why ``mask`` cannot go through the exchange (None: it can): a key mask over this rank's keys
    (``[..., 1, local_keys]``) or a mask the model made for the whole sequence (``[..., full or 1, full]``), each with no
    head dimension or one per query head."""
    shape = tuple(mask.shape)
    keys_ok = shape[-1:] == (local_keys,) and shape[-2:-1] == (1,)
    whole_ok = shape[-1:] == (full,) and shape[-2:-1] in ((1,), (full,))
    if 2 <= mask.ndim <= 4 and (keys_ok or whole_ok) and (mask.ndim < 4 or shape[1] in (1, heads)):
        return None
    return (f"a mask of shape {shape} in an attention call over a split sequence ({local_keys} keys on this GPU, {full} "
            f"in all, {heads} heads): only a key mask [..., 1, {local_keys}] or a mask over the whole sequence "
            f"[..., {full} or 1, {full}] can be split")


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
