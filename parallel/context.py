"""What one rank of a split forward knows: its group, its rank, and how its attention sequence is laid out.

A :class:`RankContext` travels in the forward's ``transformer_options`` under :data:`CP_KEY` (each rank gets its own
copy of that dict), so the family unit's block patches and the attention override of the same forward find it.  It is
made per forward: nothing of it outlives the forward or is seen by another model.

The family unit decides, at the first block it sees, whether this forward splits (:meth:`RankContext.start`): every rank
decides the same, from shapes alone.  From then on its blocks carry the rank's shard of the tokens, the attention
override exchanges the calls whose sequence is the sharded one (:meth:`exchanges`), and the last block gathers the
tokens back (:meth:`gather`), so the model's head and output see the whole sequence as on one GPU.
"""

from __future__ import annotations

import torch

from .exchange import Layout
from .group import Group, split
from .ulysses import RowMasks, Staged, ulysses

CP_KEY = "patch_attention_context_parallel"


class StopRank(Exception):
    """Raised on every rank but the first when a forward does not split: the first runs it alone."""


class RankContext:
    def __init__(self, group: Group, rank: int, unit):
        self.group = group
        self.rank = rank
        self.unit = unit  # the family unit that splits this model's forward
        self.layout: Layout | None = None  # set while the blocks carry shards
        self.others = frozenset()  # key lengths of the forward's other attention calls (text, image): never exchanged
        self.whole_queries = frozenset()  # query lengths of calls from a sequence held whole to the split one
        self.masks: RowMasks | None = None  # the mask of the exchanged calls, over the whole sequence (set_masks)
        self.split = None  # None: undecided; True: this forward is split; False: it runs whole on every rank
        self.why = ""  # why it runs whole
        self.by_shapes = False  # it runs whole for its shapes alone (tokens, floors): every forward of them will
        self.exchanged = 0  # attention calls exchanged in this forward (for the report)
        self.last_key = None  # the block-replace key of the forward's last block (set by the node's forward wrapper)
        self.state = {}  # the family unit's own values for this forward (e.g. which tokens are this rank's)
        self.graph = None  # the graphs.Pieces recording this forward (None: it runs eagerly, or replays)
        self.tflop = None  # the forward's work per block, where the group knows the model's work (set by start)
        self._layout = None

    @property
    def size(self) -> int:
        return self.group.size

    # ------------------------------------------------------------------ the decision, at the first block

    def start(self, tokens: int, others=(), prefix: int = 0, suffix: int = 0, why_not: str = "",
              whole_queries=()) -> bool:
        """Decide whether this forward splits ``tokens`` (beside ``prefix``/``suffix`` tokens every rank keeps whole).
        ``others``: the key lengths of the forward's attention calls that are not over the split sequence
        (cross-attention to text, to image tokens): a call is exchanged when its queries and keys both have a rank's
        length, so no rank's length may be one of them.  ``whole_queries``: the query lengths of calls from a sequence
        every rank holds whole to the split one (LTX-2's audio attending to the video): their keys and values are
        gathered from every rank (:meth:`gathers`), and no rank's length may be one of them either.  Below the group's
        floors it runs whole: fewer tokens to split than ``min_tokens``, or less work per block over the whole sequence
        than ``min_tflop`` for the model's ``work``.  Every rank decides the same.  True: split; False on the first
        rank (it runs the forward alone), :class:`StopRank` on the others."""
        if self.split is not None:  # the same forward again (computed again after a NaN): the same split
            self.layout = self._layout
            return self.split
        layout = self._split(tokens, prefix, suffix)
        clash = sorted({layout.local_len(r) for r in range(self.size)} & (set(others) | set(whole_queries)))
        if why_not:
            self.why = why_not
        elif tokens < self.size:
            self.why = f"{tokens} tokens, fewer than {self.size} GPUs"
        elif tokens < self.group.min_tokens:
            self.why = (f"{tokens:,} tokens to split, fewer than {self.group.min_tokens:,}: a step this short is faster on "
                        "one GPU (each GPU's share of the host's work runs under one Python lock)")
        elif self._too_little_work(prefix + tokens + suffix):
            self.why = self._work_floor(tokens, prefix, suffix)
        elif clash:
            self.why = (f"a GPU's share ({clash[0]} tokens) is as long as the text or image sequence it attends to, "
                        "so its attention calls could not be told apart")
        self.split = not self.why
        self.by_shapes = not self.split and not why_not
        g = self.group
        self.tflop = g.work.tflop_per_block(prefix + tokens + suffix) if g.work is not None else None
        if not self.split:
            if self.rank != 0:
                raise StopRank(self.why)
            return False
        self.layout = self._layout = layout
        self.others = frozenset(others)
        self.whole_queries = frozenset(whole_queries)
        return True

    def _too_little_work(self, total: int) -> bool:
        """A forward over ``total`` tokens (all of its sequence) does less work per block than the group's floor (a
        few multiplications: the model's :class:`~.work.Work` is made once per model)."""
        g = self.group
        return g.work is not None and g.work.tflop_per_block(total) < g.min_tflop

    def _work_floor(self, tokens: int, prefix: int, suffix: int) -> str:
        """Why a forward below the group's work floor runs on one GPU: the tokens to split that would reach it."""
        g = self.group
        need = max(g.work.tokens_for(g.min_tflop) - prefix - suffix, 0)
        with_ = f" with {g.attention}" if g.attention else ""
        return (f"{tokens:,} tokens to split, fewer than the {need:,} that make a split pay for this model{with_}: a step "
                "this short is faster on one GPU (each GPU's share of the host's work runs under one Python lock)")

    # ------------------------------------------------------------------ tensors

    def rows(self, rank: int | None = None) -> tuple[int, int]:
        """(start, count) of ``rank``'s shard (this rank's by default) within the split part."""
        return self.layout.shards[self.rank if rank is None else rank]

    def pause(self, whole: int = 0) -> None:
        """Leave the split part for a while: the model runs something of its own on whole tensors between blocks, the
        same on every rank; :meth:`resume` comes back.  ``whole``: meanwhile, attention calls whose queries and keys
        both have that many tokens are shared out by heads (each rank computes its heads over the whole sequence and
        every rank gets every head), which is exact only where every rank holds the same q, k and v."""
        self.layout = Layout(whole, tuple((0, 0) for _ in range(self.size))) if whole else None

    def resume(self) -> None:
        """The layout :meth:`start` decided, again (after :meth:`pause` or :meth:`gather`)."""
        self.layout = self._layout

    def resplit(self, tokens: int, prefix: int = 0, suffix: int = 0) -> None:
        """From here on the blocks carry another sequence: an even split of ``tokens`` beside ``prefix``/``suffix``
        tokens held whole (a model that joins its streams between stages, e.g. Flux's text and image tokens: the unit
        gathers the first stage's tokens, then splits the joined ones).  In a forward that splits; the ``others`` given
        to :meth:`start` must hold for this layout too."""
        if not self.split:
            raise RuntimeError("resplit in a forward that does not split")
        layout = self._split(tokens, prefix, suffix)
        clash = sorted({layout.local_len(r) for r in range(self.size)} & self.others)
        if clash:
            raise ValueError(f"a GPU's share ({clash[0]} tokens) after the resplit is as long as another attention "
                             "sequence of the forward")
        self.layout = layout

    def _split(self, tokens: int, prefix: int, suffix: int) -> Layout:
        """``tokens`` over the ranks (the group's alignment) beside ``prefix``/``suffix`` tokens held whole."""
        return Layout(prefix, tuple(split(tokens, self.size, self.group.align)), suffix)

    def set_ends(self, prefix: int, suffix: int = 0) -> None:
        """The tokens every rank keeps whole around the split part of the attention sequence, from here on (a model
        whose stages join text and image differently)."""
        self.layout = self.layout.with_ends(prefix, suffix)

    def shard(self, t: torch.Tensor, dim: int = 1, ends: bool = True) -> torch.Tensor:
        """This rank's rows of ``t`` along ``dim``: ``t`` runs over the whole attention sequence (prefix, split part,
        suffix), or over the split part alone with ``ends=False``."""
        p, sfx = (self.layout.prefix, self.layout.suffix) if ends else (0, 0)
        s0, sc = self.rows()
        full = t.shape[dim]
        if p == 0 and sfx == 0:
            return t.narrow(dim, s0, sc)
        parts = [t.narrow(dim, 0, p)] if p else []
        parts.append(t.narrow(dim, p + s0, sc))
        if sfx:
            parts.append(t.narrow(dim, full - sfx, sfx))
        return torch.cat(parts, dim)

    def gather(self, t: torch.Tensor, dim: int = 1, ends: bool = True) -> torch.Tensor:
        """The whole sequence from every rank's shard ``t`` (prefix and suffix from this rank's own copy; ``ends=False``:
        ``t`` is the split part alone), on every rank; the layout ends (blocks after this see whole tensors)."""
        out = self.whole(t, dim, ends)
        self.layout = None
        return out

    def island(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``: in a forward recorded as CUDA graphs, run between two of its pieces, eagerly, at
        every replay too (:mod:`.graphs`: an exchange, an attention call); otherwise simply called.  ``fn`` takes this
        context among its arguments, not bound to it (a replay hands it the replayed forward's)."""
        g = self.graph
        if g is None or g.inside:
            return fn(*args, **kwargs)
        return g.island(fn, *args, **kwargs)

    def whole(self, t: torch.Tensor, dim: int = 1, ends: bool = True) -> torch.Tensor:
        """As :meth:`gather`, but the layout stays (one tensor of a block made whole, the blocks still split)."""
        return self.island(RankContext._whole, self, t, dim, ends)

    def _whole(self, t: torch.Tensor, dim: int = 1, ends: bool = True) -> torch.Tensor:
        lay = self.layout
        p, sfx = (lay.prefix, lay.suffix) if ends else (0, 0)
        shape = list(t.shape)
        shape[dim] = p + sum(c for _, c in lay.shards) + sfx
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        local = t.shape[dim]

        def fill(peer, tensors, copy):
            (tp,) = tensors
            s0, sc = lay.shards[peer]
            if sc:
                copy(out.narrow(dim, p + s0, sc), tp.narrow(dim, p, sc))
            if peer == self.rank:
                if p:
                    copy(out.narrow(dim, 0, p), t.narrow(dim, 0, p))
                if sfx:
                    copy(out.narrow(dim, shape[dim] - sfx, sfx), t.narrow(dim, local - sfx, sfx))

        def like(peer, i=0):  # a peer's shard: its tokens (and the ends)
            peer_shape = list(t.shape)
            peer_shape[dim] = p + lay.shards[peer][1] + sfx
            return peer_shape

        self.group.exchange(self.rank, (t,), fill, like)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (a decision every rank must take the same way)."""
        return any(self.group.gather_objects(self.rank, bool(flag)))

    def union(self, items) -> list:
        """Every rank's ``items`` together, in rank order, without repeats."""
        out = []
        for part in self.group.gather_objects(self.rank, list(items)):
            for x in part:
                if x not in out:
                    out.append(x)
        return out

    # ------------------------------------------------------------------ attention

    def set_masks(self, masks: RowMasks | None) -> None:
        """The additive mask of the exchanged calls from here on (None: none), over the whole attention sequence: each
        rank's kernel applies it where it holds every token (:class:`~.ulysses.RowMasks`).  A clear error where it does
        not fit the sequence."""
        if masks is not None:
            masks.check(self.layout.full_len)
        self.masks = masks

    def exchanges(self, q_len: int, k_len: int) -> bool:
        """An attention call over the split sequence (both sides): it must be exchanged."""
        lay = self.layout
        return lay is not None and q_len == k_len == lay.local_len(self.rank)

    def gathers(self, q_len: int, k_len: int) -> bool:
        """A call from a sequence every rank holds whole (a length in ``whole_queries``) to the split one: its keys and
        values must be gathered from every rank."""
        lay = self.layout
        return lay is not None and q_len in self.whole_queries and k_len == lay.local_len(self.rank)

    def keys(self, k: torch.Tensor, v: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A gathered call's keys and values (:meth:`gathers`) over the whole split sequence, on every rank."""
        return self.whole(k, dim), self.whole(v, dim)

    def attention(self, q, k, v, local, mask=None, heads_first: bool = False):
        """:func:`ulysses` over this forward's group (``[B, L, H, D]`` tensors, ``[B, H, L, D]`` with ``heads_first``;
        ``local`` the kernel, ``mask`` a key mask or None), with the forward's masks over query rows
        (:meth:`set_masks`)."""
        self.exchanged += 1
        return ulysses(self.group, self.rank, self.layout, q, k, v, local, mask, self.masks, heads_first)

    def staged(self, heads: int, kv_heads: int) -> Staged:
        """An exchanged call whose q, k and v the model sends one by one (:class:`~.ulysses.Staged`)."""
        self.exchanged += 1
        return Staged(self.group, self.rank, self.layout, heads, kv_heads)
