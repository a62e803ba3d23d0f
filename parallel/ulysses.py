"""Ulysses attention: the sequence split over ranks becomes a head split for the attention kernel, and back.

Each rank holds its share of the tokens for every head.  Before the kernel, an all-to-all gives each rank every token
for its share of the heads; the kernel (any backend: the dispatcher, ``auto``, ComfyUI's own function) runs unchanged
on ``[B, all tokens, its heads, D]``; an all-to-all gives each rank its tokens back, for every head.  Every head's
attention is computed on one device over the whole sequence, as on one GPU.  The all-to-all itself, both ways, is
:mod:`.exchange`; this module is the layer that reads "exchange, local kernel, exchange back" around it, with what
differs by call: which mask travels how, in how many parts, and q, k and v sent one by one (:class:`Staged`).

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

from .exchange import KV, KV_HEADS_FIRST, Cut, Exchange, Layout
from .group import Group, split


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

    def around(self, local, tokens: int = 1):
        """The kernel ``local(q, k, v, mask=None)`` over the whole sequence, each range of query rows with its mask
        (``tokens``: the queries' token dimension; the kernel's output has its tokens in dimension 1)."""

        def masked(q, k, v):
            outs = [local(q.narrow(tokens, a, b - a), k, v, mask=m) for a, b, m in self.parts if b > a]
            return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

        return masked


@torch.compiler.disable  # under torch.compile: a graph break; the exchange and the kernel run as they are
def ulysses(group: Group, rank: int, layout: Layout, q, k, v, local, mask=None, masks: RowMasks | None = None,
            heads_first: bool = False):
    """Attention of this rank's tokens over every rank's tokens.

    ``q``: ``[B, L_r, H, D]``, ``k``/``v``: ``[B, L_r, Hk, D]``/``[B, L_r, Hk, Dv]`` (any strides; ``L_r`` =
    ``layout.local_len(rank)``).  ``local(q, k, v)`` is the kernel: it gets ``[B, L, h, D]`` tensors (contiguous, ``L``
    the whole sequence, ``h`` this rank's heads) and returns ``[B, L, h, Dv]`` (any strides).  Returns ``[B, L_r, H, Dv]``.

    ``heads_first``: q, k, v are ``[B, H, L_r, D]`` (ComfyUI's ``skip_reshape`` calls: Flux's, HunyuanVideo's), and so
    are the kernel's inputs (``[B, h, L, D]``, contiguous; its output as above).  Each head's tokens then cross between
    GPUs as one block of memory, a 2-D copy for a whole tensor, where ``[B, L_r, H, D]`` views of them would cross a
    head's row at a time.

    ``mask``: a key mask over this rank's keys, the same for every query: ``[1, L_r]``, ``[B, 1, L_r]`` or
    ``[B, H or 1, 1, L_r]`` (ComfyUI's mask shapes with one query row).  The kernel is then called as
    ``local(q, k, v, mask=...)`` with the mask over the whole sequence (``[..., 1, L]``; with a head dimension of ``H``, this
    rank's heads).

    A ``mask`` whose keys are the whole sequence instead (``[..., L or 1, L]``, :func:`rank_mask`) is not exchanged: the
    kernel gets it as it is (its heads cut to this rank's).

    ``masks`` (:class:`RowMasks`): the kernel is called as ``local(q, k, v, mask=...)`` once per range of query rows
    (``q`` those rows only, a view).  A key mask and row masks together are refused.
    """
    td, hd = (2, 1) if heads_first else (1, 2)  # the tokens' and the heads' dimensions
    if heads_first:  # each head's tokens one block (Flux's single blocks hand v as a view of their fused projection)
        q, k, v = (t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous() for t in (q, k, v))
    ex = getattr(group, "exchange_type", Exchange)(group, rank, layout, q.shape[hd], k.shape[hd])
    key_mask, whole_mask = _masks(mask, masks, layout, k.shape[td], q.shape[hd])
    a, c = ex.mine
    if whole_mask is not None:
        whole_mask = rank_mask(whole_mask, layout.full_len, q.shape[hd], ex.g * a, ex.g * c)
    cuts = (Cut(2, 1, ex.g), KV_HEADS_FIRST, KV_HEADS_FIRST) if heads_first else (ex.query(), KV, KV)
    tensors = (q, k, v)
    if key_mask is not None:  # its columns travel with the keys (with a head dimension: this rank's query heads)
        tensors, cuts = tensors + (key_mask,), cuts + (_key_mask_cut(key_mask, ex.g),)
    # the heads in parts, each exchanged while the kernel runs on the one before (a call with a mask: one part)
    plain = key_mask is None and whole_mask is None and masks is None
    parts = split(c, group.pipeline or PIPELINE_PARTS) if plain else [(0, c)]
    kernel = _kernel(local, key_mask is not None, whole_mask, masks, td)

    received = ex.to_heads(tensors, cuts, parts)
    out = None
    for i, (_, n) in enumerate(parts):
        bufs = ex.receive(received, i)
        # a part of no heads (more ranks than heads): no kernel, an empty output
        of = kernel(bufs) if n else bufs[2].transpose(1, 2) if heads_first else bufs[2]
        del bufs  # the kernel's inputs go before the output is exchanged
        out = ex.to_tokens(of, out, i, len(parts))
        del of
    return ex.done(out)


def _masks(mask, masks: RowMasks | None, layout: Layout, local_keys: int, heads: int):
    """The call's ``mask`` as (a key mask to exchange with the keys, a mask made for the whole sequence), at most one of
    them; a clear error where it cannot go through the exchange."""
    if mask is None:
        return None, None
    if masks is not None:
        raise ValueError("a key mask and masks over query rows in one call: not supported by the exchange")
    full = layout.full_len
    why = mask_problem(mask, local_keys, full, heads)
    if why:
        raise ValueError(why)
    # made for the whole sequence (with one query row and one rank the two kinds are the same)
    if mask.shape[-1] == full and (full != local_keys or mask.shape[-2] != 1):
        return None, mask
    return mask, None


def _key_mask_cut(mask, g: int) -> Cut:
    """Where a key mask has its keys and, with a head dimension (``[B, H, 1, L_r]``), its query heads."""
    return Cut(-1, 1, g) if mask.ndim == 4 and mask.shape[1] > 1 else Cut(-1)


def _kernel(local, key_mask: bool, whole_mask, masks: RowMasks | None, tokens: int = 1):
    """The local kernel on one part's buffers (q, k, v and, with ``key_mask``, the exchanged mask; ``tokens``: the
    queries' token dimension)."""
    if key_mask:
        return lambda bufs: local(*bufs[:3], mask=bufs[3])
    if whole_mask is not None:
        return lambda bufs: local(*bufs, mask=whole_mask)
    if masks is not None:
        return lambda bufs, masked=masks.around(local, tokens): masked(*bufs)
    return lambda bufs: local(*bufs)


class Staged:
    """One exchanged call whose q, k and v are sent one at a time, as the model makes them: each crosses to the other
    ranks while the model computes the next, so only the last one's exchange is waited for (:func:`ulysses` sends all
    three once the call is made).  For calls :func:`ulysses` would serve in one part with no mask and no tokens held
    whole (:meth:`fits`); the kernel and the way back are :func:`ulysses`'s, and so is the result, bit for bit.

    ``send(q)``, ``send(k)``, ``send(v)`` in that order (``[B, L_r, heads, D]``, any strides), then ``finish(local)``
    returns ``[B, L_r, H, Dv]`` (``local`` as for :func:`ulysses`).  Every rank makes the same calls in the same order:
    each send is a rendezvous."""

    def __init__(self, group: Group, rank: int, layout: Layout, heads: int, kv_heads: int):
        self.ex = getattr(group, "exchange_type", Exchange)(group, rank, layout, heads, kv_heads)
        self.bufs = []

    @staticmethod
    def fits(group: Group, layout: Layout | None, masks=None) -> bool:
        """Whether an exchanged call over ``layout`` can be staged."""
        return (layout is not None and not layout.prefix and not layout.suffix and masks is None
                and (group.pipeline or PIPELINE_PARTS) == 1)

    def send(self, t) -> None:
        """The next of q, k, v: posted, and every rank's tokens of this rank's heads pulled into a buffer."""
        ex, c = self.ex, self.ex.mine[1]
        cuts = (ex.query() if not self.bufs else KV,)  # q: the query heads of this rank's key/value heads
        (buf,) = ex.buffers((t,), cuts, c)
        ex.pull(ex.send((t,)), [buf], cuts, 0, c)
        self.bufs.append(buf)

    def finish(self, local):
        """The kernel on every token of this rank's heads, and every rank's tokens back: ``[B, L_r, H, Dv]``."""
        if len(self.bufs) != 3:
            raise RuntimeError(f"a staged attention call finished after {len(self.bufs)} of q, k and v were sent")
        self.ex.received_all()
        # a rank with no heads (more ranks than heads) runs no kernel
        of = local(*self.bufs) if self.ex.mine[1] else self.bufs[2]
        self.bufs = []
        out = self.ex.to_tokens(of)
        del of
        return self.ex.done(out)


# In how many parts an exchanged call sends its heads (Group(pipeline=N) overrides), each part's exchange overlapping
# the kernel on the part before. Measured on 2x H100 (NVLink), Wan 2.1 14B, sage_fp8_sm90: one part x1.897 (720p) /
# x1.829 (480p), two x1.883 / x1.827, four x1.867 / x1.804: over NVLink the exchange is too small a share (2-3 %) for the
# overlap to pay for smaller kernels and a rendezvous per part. Kept for links where it is not (PCIe).
PIPELINE_PARTS = 1


# ComfyUI's skip_reshape calls (q, k, v as [B, H, L, D]: Flux's, HunyuanVideo's) are exchanged as they are, each head's
# tokens one block of memory (False: as [B, L, H, D] views, a row per token and head, which cannot cross between GPUs
# as a 2-D copy: made contiguous first, the exchange before; kept to measure against).
HEADS_FIRST = True


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


