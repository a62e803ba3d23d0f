"""The all-to-all of Ulysses attention: one call's tensors from ``[B, tokens/N, every head, D]`` on each rank to
``[B, every token, heads/N, D]``, and the kernel's output back (yunchang's ``SeqAllToAll4D``, as device-to-device
copies: :mod:`.group`).

A rank's tokens are laid out as a :class:`Layout`: tokens every rank holds whole (a *prefix* before and a *suffix* after
the split part: a joint sequence's text) and its shard of the split part.  The tokens held whole come from the rank's
own copy; the shards from every rank.  Heads are split by key/value head (:func:`~.group.split`: uneven where they do not
divide, none for some ranks where there are more ranks than heads); a query takes the query heads of its key/value heads.
Each tensor of a call says where its tokens and heads are (:class:`Cut`), so the same exchange carries q, k, v and a key
mask over the tokens.  On CUDA the copies run on the rank's receive stream, the kernel on its compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .group import Group, finish, planned, split


@dataclass(frozen=True)
class Layout:
    """One forward's attention sequence on each rank: ``prefix`` tokens held whole, the rank's shard, ``suffix`` tokens
    held whole.  ``shards``: (start, count) of every rank's shard within the split part."""

    prefix: int
    shards: tuple
    suffix: int = 0

    def local_len(self, rank: int) -> int:
        return self.prefix + self.shards[rank][1] + self.suffix

    @cached_property  # read several times per exchanged call (a frozen dataclass keeps it in its __dict__)
    def full_len(self) -> int:
        return self.prefix + sum(c for _, c in self.shards) + self.suffix

    def with_ends(self, prefix: int, suffix: int = 0) -> Layout:
        return Layout(prefix, self.shards, suffix)


def shard_layout(tokens: int, ranks: int, prefix: int = 0, suffix: int = 0) -> Layout:
    return Layout(prefix, tuple(split(tokens, ranks)), suffix)


@dataclass(frozen=True)
class Cut:
    """Where an exchanged tensor has its tokens (dimension ``tokens``) and heads (dimension ``heads``, ``per`` of them for
    each key/value head: a query's group; None: no head dimension, every rank gets it whole)."""

    tokens: int
    heads: int | None = None
    per: int = 1

    def rows(self, t, rows: slice):
        """``t``'s tokens ``rows``, every head: a view."""
        if self.tokens == 1:  # q, k, v and masks over keys as the kernel gets them (several views per exchanged call)
            return t[:, rows]
        if self.tokens == 2:  # q, k, v heads first
            return t[:, :, rows]
        idx = [slice(None)] * t.ndim
        idx[self.tokens] = rows
        return t[tuple(idx)]

    def of(self, t, rows: slice, lo: int, hi: int):
        """``t``'s tokens ``rows`` of key/value heads ``lo`` to ``hi``: a view."""
        if self.tokens == 1 and self.heads == 2:  # [B, L, H, D], the common case: no index list built
            return t[:, rows, self.per * lo:self.per * hi]
        if self.tokens == 2 and self.heads == 1:  # [B, H, L, D]
            return t[:, self.per * lo:self.per * hi, rows]
        idx = [slice(None)] * t.ndim
        idx[self.tokens] = rows
        if self.heads is not None:
            idx[self.heads] = slice(self.per * lo, self.per * hi)
        return t[tuple(idx)]

    def buffer(self, t, tokens: int, kv_heads: int):
        """An empty tensor like ``t`` for ``tokens`` tokens of ``kv_heads`` key/value heads."""
        shape = list(t.shape)
        shape[self.tokens] = tokens
        if self.heads is not None:
            shape[self.heads] = self.per * kv_heads
        return torch.empty(shape, dtype=t.dtype, device=t.device)


KV = Cut(1, 2)  # keys and values as the kernel gets them: [B, L, H, D]
KV_HEADS_FIRST = Cut(2, 1)  # keys and values of ComfyUI's skip_reshape calls: [B, H, L, D]


class Exchange:
    """The exchange of one attention call between the ranks of ``group`` over ``layout``: ``heads`` query heads over
    ``kv_heads`` key/value heads, split by key/value head.

    :meth:`to_heads` posts this rank's tensors and pulls, part by part of its heads, every rank's tokens of them;
    :meth:`receive` gives a part once it is there; :meth:`to_tokens` sends the kernel's output on those heads back and
    pulls every rank's heads of this rank's tokens; :meth:`done` ends the call.  Every rank makes the same calls in the
    same order: each post is a rendezvous."""

    def __init__(self, group: Group, rank: int, layout: Layout, heads: int, kv_heads: int):
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
        self.group, self.rank, self.layout, self.heads = group, rank, layout, heads
        self.g = heads // kv_heads  # query heads per key/value head
        self.kv = tuple(split(kv_heads, group.size))  # (start, count) of every rank's key/value heads
        self.recv = group.receiving(rank)  # None off CUDA
        self.compute = None  # the rank's compute stream, once known (CUDA)
        self.direct = False  # the output's copies land on the compute stream (one part), not on the receive stream

    @property
    def mine(self) -> tuple[int, int]:
        """(start, count) of this rank's key/value heads."""
        return self.kv[self.rank]

    def query(self) -> Cut:
        """Where a query has its tokens and heads (``g`` query heads per key/value head)."""
        return Cut(1, 2, self.g)

    # ------------------------------------------------------------------ every token of this rank's heads

    def buffers(self, tensors: tuple, cuts: tuple, kv_heads: int) -> list:
        """Empty tensors for every token of ``kv_heads`` of this rank's key/value heads, one per tensor of ``tensors``."""
        return [cut.buffer(t, self.layout.full_len, kv_heads) for t, cut in zip(tensors, cuts)]

    def send(self, tensors: tuple, direct: bool = False) -> list:
        """Post ``tensors`` (this rank's tokens, every head); once every rank has: every rank's posting.  ``direct``:
        what is pulled next lands in order on the compute stream, not on the receive stream."""
        if self.recv is not None:
            self.compute = torch.cuda.current_stream(tensors[0].device)
            if not direct:
                self.group.after(self.rank, self.recv, self.compute)  # the buffers were made on the compute stream
        return self.group.post(self.rank, tensors)

    def pull(self, posted: list, bufs: list, cuts: tuple, lo: int, n: int, direct: bool = False) -> None:
        """Every rank's tokens of this rank's key/value heads ``lo`` to ``lo + n`` (from its first) into ``bufs``, the
        tokens held whole from this rank's own copy; ordered before the receive stream's later work (``direct``: the
        compute stream's)."""
        stream = self.compute if direct else self.recv
        plan = self._plan(("heads", cuts, lo, n), posted, bufs,
                          lambda peer, tensors: self._heads_copies(peer, tensors, bufs, cuts, lo, n))
        if plan is not None:
            self.group.run_plan(self.rank, posted, plan, bufs, stream, self.compute)
            return
        for peer in range(self.group.size):
            self.pull_from(peer, posted[peer][0], self.group.puller(self.rank, peer, posted, stream), bufs, cuts,
                           lo, n)

    def pull_from(self, peer: int, tensors: tuple, copy, bufs: list, cuts: tuple, lo: int, n: int) -> None:
        """:meth:`pull` from one rank's posted ``tensors`` (this rank's own: with the tokens held whole)."""
        for _, dst, src in self._heads_copies(peer, tensors, bufs, cuts, lo, n):
            copy(dst, src)
        finish(copy)

    def _heads_copies(self, peer: int, tensors: tuple, bufs: list, cuts: tuple, lo: int, n: int) -> list:
        """The copies of :meth:`pull_from`: (the buffer's and the tensor's index, destination view, source view)."""
        lay, out = self.layout, []
        a = self.mine[0] + lo
        s0, sc = lay.shards[peer]
        if sc:
            rows, src = slice(lay.prefix + s0, lay.prefix + s0 + sc), slice(lay.prefix, lay.prefix + sc)
            out += [(i, cut.rows(buf, rows), cut.of(t, src, a, a + n))
                    for i, (buf, t, cut) in enumerate(zip(bufs, tensors, cuts))]
        if peer == self.rank:
            for dst, src in _ends(lay.prefix, lay.suffix, lay.full_len, lay.local_len(peer)):
                out += [(i, cut.rows(buf, dst), cut.of(t, src, a, a + n))
                        for i, (buf, t, cut) in enumerate(zip(bufs, tensors, cuts))]
        return out

    def _plan(self, what: tuple, posted: list, dsts: list, copies):
        """Every copy of an exchange into ``dsts`` from the ranks' ``posted`` tensors as 2-D copies, by rank
        (:func:`~.group.planned`), made once per geometry: the copies' places relative to each tensor's first element
        depend on the shapes and strides alone, the same for every block of a forward and every forward of its shapes.
        ``copies(peer, tensors)``: (index of the destination and of the source, destination view, source view) of one
        rank's.
        None where the group copies otherwise or a copy is not a 2-D copy."""
        if getattr(self.group, "copy_2d", None) is None:
            return None
        key = (what, self.rank, self.layout, self.kv, self.g, _geometry(dsts),
               tuple(_geometry(tensors) for tensors, _, _ in posted))
        plan = _PLANS.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = planned([copies(peer, tensors) for peer, (tensors, _, _) in enumerate(posted)],
                           dsts, [tensors for tensors, _, _ in posted])
            if len(_PLANS) >= 4096:
                _PLANS.clear()
            _PLANS[key] = plan
        return plan

    def to_heads(self, tensors: tuple, cuts: tuple, parts: list) -> list:
        """``tensors`` exchanged (one rendezvous) in ``parts`` of this rank's key/value heads ((start, count) within
        them): per part, its buffers (:meth:`buffers`, filled on the receive stream) and the event of their arrival
        (None off CUDA)."""
        # one part: its copies land on the compute stream, whose next work (the kernel) waits for them anyway (several:
        # on the receive stream, each part's arrival an event, so the kernel runs on one while the next arrives)
        direct = DIRECT and len(parts) == 1
        bufs = [self.buffers(tensors, cuts, n) for _, n in parts]
        posted = self.send(tensors, direct)
        arrived = []
        for (lo, n), pbufs in zip(parts, bufs):
            if n:
                self.pull(posted, pbufs, cuts, lo, n, direct)
            arrived.append(self.group.mark(self.rank, ("arrived", len(arrived)), self.recv)
                           if self.recv is not None and not direct else None)
        return list(zip(bufs, arrived))

    def receive(self, received: list, i: int) -> list:
        """Part ``i`` of :meth:`to_heads`'s ``received``, once it is there (the compute stream waits for it); the list
        keeps no reference to it."""
        bufs, event = received[i]
        received[i] = None
        if event is not None:
            self.compute.wait_event(event)
        return bufs

    def received_all(self) -> None:
        """The compute stream waits for every copy on the receive stream so far (CUDA)."""
        if self.recv is not None:
            self.group.after(self.rank, self.compute, self.recv)

    # ------------------------------------------------------------------ this rank's tokens of every head

    def to_tokens(self, of, out=None, part: int = 0, parts: int = 1):
        """The kernel's output ``of`` (``[B, L, h, Dv]``: every token, this rank's heads, or part ``part`` of ``parts``
        of them) to every rank, and every rank's into ``out`` (``[B, L_r, H, Dv]``: this rank's tokens, every head; None:
        made here, on the first part); returns ``out``."""
        # one part: the copies land on the compute stream (several: on the receive stream, which :meth:`done` waits for)
        self.direct = DIRECT and parts == 1
        stream = self.compute if self.direct else self.recv
        if out is None:
            out = torch.empty(of.shape[0], self.layout.local_len(self.rank), self.heads, of.shape[3], dtype=of.dtype,
                              device=of.device)
            if self.recv is not None and not self.direct:
                self.group.after(self.rank, self.recv, self.compute)  # ``out`` was made on the compute stream
        back = self.group.post(self.rank, (of,))
        plan = self._plan(("tokens", part, parts), back, [out],
                          lambda peer, tensors: self._tokens_copies(peer, tensors[0], out, part, parts))
        if plan is not None:
            self.group.run_plan(self.rank, back, plan, [out], stream, self.compute)
            return out
        for peer in range(self.group.size):
            copies = self._tokens_copies(peer, back[peer][0][0], out, part, parts)
            if copies:
                copy = self.group.puller(self.rank, peer, back, stream)
                for _, dst, src in copies:
                    copy(dst, src)
                finish(copy)
        return out

    def _tokens_copies(self, peer: int, op, out, part: int, parts: int) -> list:
        """The copies of :meth:`to_tokens` from ``peer``'s output ``op``: (0, destination view, source view)."""
        lay, g = self.layout, self.g
        p, sfx, full = lay.prefix, lay.suffix, lay.full_len
        s0, sc = lay.shards[self.rank]
        pa, pc = self.kv[peer]
        pl, pn = split(pc, parts)[part]
        if pn == 0:
            return []
        heads = slice(g * (pa + pl), g * (pa + pl + pn))
        out_rows = [(out[:, p:p + sc, heads], op[:, p + s0:p + s0 + sc])] if sc else []
        out_rows += [(out[:, dst_rows, heads], op[:, src_rows]) for src_rows, dst_rows in _ends(p, sfx, full, out.shape[1])]
        return [(0, dst, src) for dst, src in out_rows]

    def done(self, out):
        """``out``, once the copies into it are done (the compute stream waits for them)."""
        if self.recv is not None and not self.direct:
            self.group.after(self.rank, self.compute, self.recv)
        return out


# An exchanged call sent in one part has its copies land in order on the compute stream, which its kernel runs on next
# (False: on the receive stream, with an event for the kernel to wait for: the exchange before, kept to measure
# against; several parts always arrive on the receive stream).
DIRECT = True

_PLANS: dict = {}  # an exchange's geometry -> its 2-D copies by rank (Exchange._plan)
_UNPLANNED = object()


def _geometry(tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype) for t in tensors)


def _ends(prefix: int, suffix: int, full: int, local: int):
    """(rows in the whole sequence, rows in a rank's sequence) of the prefix and suffix tokens."""
    out = []
    if prefix:
        out.append((slice(0, prefix), slice(0, prefix)))
    if suffix:
        out.append((slice(full - suffix, full), slice(local - suffix, local)))
    return out
