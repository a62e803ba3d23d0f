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

from .group import Group, split
from .ulysses import Layout, ulysses

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
        self.split = None  # None: undecided; True: this forward is split; False: it runs whole on every rank
        self.why = ""  # why it runs whole
        self.exchanged = 0  # attention calls exchanged in this forward (for the report)
        self.last_key = None  # the block-replace key of the forward's last block (set by the node's forward wrapper)
        self._layout = None

    @property
    def size(self) -> int:
        return self.group.size

    # ------------------------------------------------------------------ the decision, at the first block

    def start(self, tokens: int, others=(), prefix: int = 0, suffix: int = 0, why_not: str = "") -> bool:
        """Decide whether this forward splits ``tokens`` (beside ``prefix``/``suffix`` tokens every rank keeps whole).
        ``others``: the key lengths of the forward's attention calls that are not over the split sequence
        (cross-attention to text, to image tokens): a call is exchanged when its queries and keys both have a rank's
        length, so no rank's length may be one of them.  Every rank decides the same.  True: split; False on the first
        rank (it runs the forward alone), :class:`StopRank` on the others."""
        if self.split is not None:  # the same forward again (computed again after a NaN): the same split
            self.layout = self._layout
            return self.split
        layout = Layout(prefix, tuple(split(tokens, self.size)), suffix)
        clash = sorted({layout.local_len(r) for r in range(self.size)} & set(others))
        if why_not:
            self.why = why_not
        elif tokens < self.size:
            self.why = f"{tokens} tokens, fewer than {self.size} GPUs"
        elif clash:
            self.why = (f"a GPU's share ({clash[0]} tokens) is as long as the text or image sequence it attends to, "
                        "so its attention calls could not be told apart")
        self.split = not self.why
        if not self.split:
            if self.rank != 0:
                raise StopRank(self.why)
            return False
        self.layout = self._layout = layout
        self.others = frozenset(others)
        return True

    # ------------------------------------------------------------------ tensors

    def rows(self, rank: int | None = None) -> tuple[int, int]:
        """(start, count) of ``rank``'s shard (this rank's by default) within the split part."""
        return self.layout.shards[self.rank if rank is None else rank]

    def resplit(self, tokens: int, prefix: int = 0, suffix: int = 0) -> None:
        """From here on the blocks carry another sequence: an even split of ``tokens`` beside ``prefix``/``suffix``
        tokens held whole (a model that joins its streams between stages, e.g. Flux's text and image tokens: the unit
        gathers the first stage's tokens, then splits the joined ones).  In a forward that splits; the ``others`` given
        to :meth:`start` must hold for this layout too."""
        if not self.split:
            raise RuntimeError("resplit in a forward that does not split")
        layout = Layout(prefix, tuple(split(tokens, self.size)), suffix)
        clash = sorted({layout.local_len(r) for r in range(self.size)} & self.others)
        if clash:
            raise ValueError(f"a GPU's share ({clash[0]} tokens) after the resplit is as long as another attention "
                             "sequence of the forward")
        self.layout = layout

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

        self.group.exchange(self.rank, (t,), fill)
        self.layout = None
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (a decision every rank must take the same way)."""
        return any(self.group.gather_objects(self.rank, bool(flag)))

    def union(self, items) -> list:
        """Every rank's ``items`` together, in rank order, without repeats."""
        out = []
        for part in self.group.gather_objects(self.rank, list(items)):
            out += [x for x in part if x not in out]
        return out

    # ------------------------------------------------------------------ attention

    def exchanges(self, q_len: int, k_len: int) -> bool:
        """An attention call over the split sequence (both sides): it must be exchanged."""
        lay = self.layout
        return lay is not None and q_len == k_len == lay.local_len(self.rank)

    def attention(self, q, k, v, local, mask=None):
        """:func:`ulysses` over this forward's group (``[B, L, H, D]`` tensors, ``local`` the kernel, ``mask`` None or
        over the whole sequence)."""
        self.exchanged += 1
        return ulysses(self.group, self.rank, self.layout, q, k, v, local, mask)
