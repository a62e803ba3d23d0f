"""The ranks of one split forward in processes of their own, one per GPU, over ``torch.distributed``.

:class:`ProcessGroupRanks` is :class:`~.group.Group` for the one rank this process runs: the same exchanges
(:class:`~.exchange.Exchange`, :meth:`~.context.RankContext.whole`), with the tensors a rank posts sent to every other
rank by ``torch.distributed``'s point-to-point operations (NCCL between GPUs, gloo on the CPU) in one batch per post,
where the ranks of a :class:`~.group.Group` read each other's tensors in one process.  Each process runs its own copy
of the sampling loop and of the model (every rank computes the same steps on the same inputs, as xDiT's and
ParaAttention's ranks do), so no interpreter lock is shared between GPUs.

A post moves every posted tensor whole to every rank (what a rank needs of it is known to the receiver only): an
attention call's q, k and v cross in full where an all-to-all would move each rank's share of the heads; measured as
it is (docs/multi-gpu.md).  ``like(peer, i)`` (given by the exchange) is the shape of a peer's i-th tensor: the
receiving buffers are made from it.  Plain Python values (:meth:`gather_objects`) go over ``objects``, a gloo group
(no device sync).  A rank that fails cannot stop the others' waits: they end at the process group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import ALIGN, _copy, _copy_words


class ProcessGroupRanks:
    """One rank of a forward split over processes: ``pg`` (its ranks in rank order), ``objects`` (a gloo group of the
    same ranks, for plain values; None: ``pg``), ``device`` (this process's)."""

    pitched = False  # no device-to-device copies here: every copy is on this rank's device
    staged = False  # q, k and v cross in one batch per call (one send each would be three batches)
    words = True
    pipeline = 1

    def __init__(self, pg, device, objects=None, min_tokens: int = 0, align: int | None = None):
        self.pg = pg
        self.objects = objects if objects is not None else pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.ranks = [dist.get_global_rank(pg, r) for r in range(self.size)]
        self.devices = [torch.device(device)] * self.size  # a rank sees its own device only
        self.min_tokens = min_tokens
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

    def post(self, rank: int, tensors: tuple, like=None) -> list:
        """``tensors`` sent to every other rank and theirs received (shapes from ``like``; None: this rank's): every
        rank's tensors, by rank, on this rank's device, once this rank's current stream reaches them."""
        self._mine(rank)
        tensors = tuple(tensors)
        if self.size == 1:
            return [(tensors, None, None)]
        sends = [t.contiguous() for t in tensors]  # on the current stream, which waits for the transfers (below)
        ops, posted = [], []
        for peer in range(self.size):
            if peer == rank:
                posted.append((tensors, None, None))
                continue
            bufs = tuple(torch.empty(like(peer, i) if like is not None else t.shape, dtype=t.dtype, device=t.device)
                         for i, t in enumerate(tensors))
            posted.append((bufs, None, None))
            g = self.ranks[peer]
            ops += [dist.P2POp(dist.isend, t, g, self.pg) for t in sends]
            ops += [dist.P2POp(dist.irecv, b, g, self.pg) for b in bufs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # NCCL: this rank's current stream waits for the transfers (the host does not)
        return posted

    def puller(self, rank: int, peer: int, posted: list, stream=None):
        return _copy_words if self.words else _copy

    def receiving(self, rank: int):
        return None

    def exchange(self, rank: int, tensors: tuple, fill, like=None) -> None:
        posted = self.post(rank, tensors, like)
        for peer in range(self.size):
            fill(peer, posted[peer][0], self.puller(rank, peer, posted))
