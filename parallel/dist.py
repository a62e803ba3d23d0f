"""The ranks of one split forward in processes of their own, one per GPU, over ``torch.distributed``.

:class:`ProcessGroupRanks` is :class:`~.group.Group` for the one rank this process runs: the same exchanges
(:class:`~.exchange.Exchange`, :meth:`~.context.RankContext.whole`), with the tensors a rank posts sent to every other
rank by ``torch.distributed``'s point-to-point operations (NCCL between GPUs, gloo on the CPU) in one batch per post,
where the ranks of a :class:`~.group.Group` read each other's tensors in one process.  Each process runs its own copy
of the sampling loop and of the model (every rank computes the same steps on the same inputs, as xDiT's and
ParaAttention's ranks do), so no interpreter lock is shared between GPUs.

An attention call's exchange (:class:`SentExchange`) is an all-to-all: each rank sends every other rank only that
rank's share (its heads of this rank's tokens; the output back: its tokens of this rank's heads).  Other posts
(:meth:`~.context.RankContext.whole`, a shard made whole) move the posted tensor whole; ``like(peer, i)`` (given by the
caller) is the shape of a peer's i-th tensor: the receiving buffers are made from it.  A swap goes as one batch of
point-to-point operations, or (``collective=True``) as one ``all_to_all_single`` of a flat buffer, every tensor for a
peer written into it once (what NCCL lets a CUDA graph capture: torch's point-to-point operations are not captured).
Plain Python values (:meth:`gather_objects`) go over ``objects``, a gloo group (no device sync).  A rank that fails
cannot stop the others' waits: they end at the process group's timeout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .exchange import Exchange
from .group import ALIGN, _copy, _copy_words, split


class SentExchange(Exchange):
    """:class:`~.exchange.Exchange` between ranks that cannot read each other's tensors: the sender cuts what each
    rank needs (an all-to-all), where the threads' ranks pull it."""

    def to_heads(self, tensors: tuple, cuts: tuple, parts: list) -> list:
        lay, rank, size = self.layout, self.rank, self.group.size
        bufs = [self.buffers(tensors, cuts, n) for _, n in parts]
        mine = slice(lay.prefix, lay.prefix + lay.shards[rank][1])  # this rank's shard of its own tokens
        c = self.mine[1]
        outgoing = [None if p == rank else tuple(cut.of(t, mine, self.kv[p][0], self.kv[p][0] + self.kv[p][1])
                                                  for t, cut in zip(tensors, cuts)) for p in range(size)]
        shapes = [None if p == rank else [_cut_shape(t, cut, lay.shards[p][1], c) for t, cut in zip(tensors, cuts)]
                  for p in range(size)]
        got = self.group.swap(rank, outgoing, shapes, tensors)
        copy = self.group.puller(rank, rank, None)
        for (lo, n), pbufs in zip(parts, bufs):
            if not n:
                continue
            for peer in range(size):
                s0, sc = lay.shards[peer]
                if sc and peer != rank:  # what the peer sent: its shard, this rank's heads (from the first)
                    rows = slice(lay.prefix + s0, lay.prefix + s0 + sc)
                    for buf, t, cut in zip(pbufs, got[peer], cuts):
                        copy(cut.rows(buf, rows), cut.of(t, slice(0, sc), lo, lo + n))
            self.pull_from(rank, tensors, copy, pbufs, cuts, lo, n)
        return [(b, None) for b in bufs]

    def to_tokens(self, of, out=None, part: int = 0, parts: int = 1):
        lay, rank, size, g = self.layout, self.rank, self.group.size, self.g
        p, sfx, full = lay.prefix, lay.suffix, lay.full_len
        if out is None:
            out = torch.empty(of.shape[0], lay.local_len(rank), self.heads, of.shape[3], dtype=of.dtype, device=of.device)

        def rows_of(q):  # rank q's tokens of this rank's output: its prefix, its shard, its suffix
            s0, sc = lay.shards[q]
            pieces = [of[:, :p]] if p else []
            pieces.append(of[:, p + s0:p + s0 + sc])
            if sfx:
                pieces.append(of[:, full - sfx:])
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)

        def heads_of(q):  # rank q's heads in this part: (first query head, count)
            qa, qc = self.kv[q]
            ql, qn = split(qc, parts)[part]
            return g * (qa + ql), g * qn

        outgoing = [None if q == rank else (rows_of(q),) for q in range(size)]
        shapes = [None if q == rank else [(of.shape[0], lay.local_len(rank), heads_of(q)[1], of.shape[3])]
                  for q in range(size)]
        got = self.group.swap(rank, outgoing, shapes, (of,))
        copy = self.group.puller(rank, rank, None)
        for q in range(size):
            first, n = heads_of(q)
            if n:
                copy(out[:, :, first:first + n], rows_of(q) if q == rank else got[q][0])
        return out

    def done(self, out):
        return out


class ProcessGroupRanks:
    """One rank of a forward split over processes: ``pg`` (its ranks in rank order), ``objects`` (a gloo group of the
    same ranks, for plain values; None: ``pg``), ``device`` (this process's)."""

    pitched = False  # no device-to-device copies here: every copy is on this rank's device
    staged = False  # q, k and v cross in one batch per call (one send each would be three batches)
    words = True
    pipeline = 1
    exchange_type = SentExchange  # what ulysses() exchanges an attention call with over these ranks

    def __init__(self, pg, device, objects=None, min_tokens: int = 0, align: int | None = None,
                 collective: bool = False, work=None, min_tflop: float = 0.0, attention: str = ""):
        self.pg = pg
        self.collective = collective
        self.objects = objects if objects is not None else pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.ranks = [dist.get_global_rank(pg, r) for r in range(self.size)]
        self.devices = [torch.device(device)] * self.size  # a rank sees its own device only
        self.min_tokens = min_tokens
        self.work, self.min_tflop, self.attention = work, min_tflop, attention  # as Group's
        self.align = ALIGN if align is None else align
        self.error: BaseException | None = None

    def _mine(self, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"rank {rank} posted in the process of rank {self.rank}")

    def abort(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def gather_objects(self, rank: int, obj) -> list:
        self._mine(rank)
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.objects)
        return out

    def swap(self, rank: int, outgoing: list, shapes: list, like) -> list:
        """``outgoing[peer]`` (tensors, any strides) sent to each other rank, and from each a tuple of tensors of
        ``shapes[peer]`` received (dtype and device of ``like``'s): the received, by rank (None for this one), once this
        rank's current stream reaches them."""
        self._mine(rank)
        if self.collective and self.size > 1 and len({t.dtype for t in like}) == 1:
            return self._swap_flat(rank, outgoing, shapes, like[0])
        ops, got = [], [None] * self.size
        for peer in range(self.size):
            if peer == rank:
                continue
            g = self.ranks[peer]
            got[peer] = tuple(torch.empty(sh, dtype=t.dtype, device=t.device) for sh, t in zip(shapes[peer], like))
            # sent contiguous, made on the current stream, which waits for the transfers
            ops += [dist.P2POp(dist.isend, t.contiguous(), g, self.pg) for t in outgoing[peer]]
            ops += [dist.P2POp(dist.irecv, b, g, self.pg) for b in got[peer]]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got

    def _swap_flat(self, rank: int, outgoing: list, shapes: list, like) -> list:
        """:meth:`swap` as one ``all_to_all_single``: each peer's tensors written once into a flat send buffer, the
        received ones views of a flat receive buffer."""
        sent = [0 if p == rank else sum(t.numel() for t in outgoing[p]) for p in range(self.size)]
        wanted = [[math.prod(sh) for sh in shapes[p]] if p != rank else [] for p in range(self.size)]
        send = torch.empty(sum(sent), dtype=like.dtype, device=like.device)
        recv = torch.empty(sum(map(sum, wanted)), dtype=like.dtype, device=like.device)
        at = 0
        for p in range(self.size):
            for t in outgoing[p] if p != rank else ():
                send[at:at + t.numel()].view(t.shape).copy_(t)
                at += t.numel()
        dist.all_to_all_single(recv, send, [sum(w) for w in wanted], sent, group=self.pg)
        got, at = [None] * self.size, 0
        for p in range(self.size):
            if p != rank:
                views = []
                for sh, n in zip(shapes[p], wanted[p]):
                    views.append(recv[at:at + n].view(sh))
                    at += n
                got[p] = tuple(views)
        return got

    def post(self, rank: int, tensors: tuple, like=None) -> list:
        """``tensors`` sent whole to every other rank and theirs received (shapes from ``like``; None: this rank's):
        every rank's tensors, by rank, on this rank's device, once this rank's current stream reaches them."""
        tensors = tuple(tensors)
        shapes = [[like(peer, i) if like is not None else t.shape for i, t in enumerate(tensors)]
                  for peer in range(self.size)]
        sends = tuple(t.contiguous() for t in tensors)  # once for every peer (swap's own is then a no-op)
        got = self.swap(rank, [sends] * self.size, shapes, tensors)
        return [(tensors if peer == rank else got[peer], None, None) for peer in range(self.size)]

    def puller(self, rank: int, peer: int, posted: list, stream=None):
        return _copy_words if self.words else _copy

    def receiving(self, rank: int):
        return None

    def exchange(self, rank: int, tensors: tuple, fill, like=None) -> None:
        posted = self.post(rank, tensors, like)
        for peer in range(self.size):
            fill(peer, posted[peer][0], self.puller(rank, peer, posted))


def _cut_shape(t, cut, tokens: int, kv_heads: int) -> list:
    """The shape of ``t`` cut to ``tokens`` tokens of ``kv_heads`` key/value heads (where ``cut`` has heads)."""
    shape = list(t.shape)
    shape[cut.tokens] = tokens
    if cut.heads is not None:
        shape[cut.heads] = cut.per * kv_heads
    return shape
