"""The exchange's masks and gathered keys (parallel/ulysses.py RowMasks, parallel/context.py set_masks, gathers, keys),
on 2, 3 and 4 CPU ranks against whole attention in fp64: a mask over the whole sequence applied past the exchange by
ranges of query rows, with text held whole before or after the split part; calls from a sequence every rank holds
whole to the split one, their keys gathered from every rank; bad masks refused with a clear error."""

from __future__ import annotations

import importlib

import pytest
import torch
from pack import load
from test_context_parallel import rank_rows as _local
from test_context_parallel import run_ranks
from test_context_parallel import whole as masked

P = load()
G = importlib.import_module(P.__name__ + ".parallel.group")
U = importlib.import_module(P.__name__ + ".parallel.ulysses")
E = importlib.import_module(P.__name__ + ".parallel.exchange")
C = importlib.import_module(P.__name__ + ".parallel.context")
F = torch.nn.functional




@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("prefix,suffix,cuts", [(0, 0, (30,)), (5, 0, (11, 37)), (0, 4, ()), (3, 2, (0, 20, 41))])
def test_row_masks_give_whole_masked_attention_on_every_rank(n, prefix, suffix, cuts):
    g = torch.Generator().manual_seed(n * 10 + prefix)
    b, h, d, tokens = 2, 5, 8, 37
    L = prefix + tokens + suffix
    q, k = (torch.randn(b, L, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, L, h, d + 2, generator=g, dtype=torch.float64)
    # ranges of query rows at ``cuts``, each with its own mask: one row broadcast, a row per query, none
    bounds = [0, *cuts, L]
    parts, dense = [], torch.zeros(b, 1, L, L, dtype=torch.float64)
    for i, (a, e) in enumerate(zip(bounds, bounds[1:])):
        kind = i % 3
        m = None if kind == 2 else -4 * torch.rand(b if kind else 1, 1, 1 if kind == 0 else e - a, L, generator=g,
                                                   dtype=torch.float64)
        if m is not None:
            dense[:, :, a:e] = m
        parts.append((a, e, m))
    masks = U.RowMasks(tuple(parts))
    ref = masked(q, k, v, dense)
    group = G.Group(["cpu"] * n)
    calls = []

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, others={3}, prefix=prefix, suffix=suffix)
        ctx.set_masks(masks)

        def kernel(qf, kf, vf, mask=None):
            calls.append((r, qf.shape[1], kf.shape[1], None if mask is None else tuple(mask.shape)))
            return masked(qf, kf, vf, mask)

        return ctx.attention(_local(q, ctx.layout, r), _local(k, ctx.layout, r), _local(v, ctx.layout, r), kernel)

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    lay = E.shard_layout(tokens, n, prefix, suffix)
    for r in range(n):
        assert (outs[r] - _local(ref, lay, r)).abs().max() < 1e-12
    # every rank with heads ran the kernel once per non-empty range, over every key, with that range's mask
    with_heads = [r for r, (_, c) in enumerate(G.split(h, n)) if c]
    expected = [(e - a, L, None if m is None else tuple(m.shape)) for a, e, m in parts if e > a]
    for r in with_heads:
        assert [c[1:] for c in calls if c[0] == r] == expected


def test_without_masks_the_kernel_is_called_as_before():
    n, tokens = 2, 10
    group = G.Group(["cpu"] * n)
    x = torch.randn(1, tokens, 2, 4, dtype=torch.float64)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        ctx.start(tokens)
        part = ctx.shard(x)
        return ctx.attention(part, part, part, lambda qf, kf, vf: masked(qf, kf, vf))  # no mask= keyword

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    assert torch.allclose(torch.cat(outs, 1), masked(x, x, x))


@pytest.mark.parametrize("parts,message", [
    (((0, 5, None), (6, 10, None)), "mask rows 6..10 do not follow rows 0..5"),
    (((0, 8, None),), "mask rows 0..8 of 10 tokens"),
    (((0, 10, torch.zeros(1, 1, 1, 9)),), r"a mask of shape \(1, 1, 1, 9\) for rows 0..10 of 10 tokens"),
    (((0, 4, torch.zeros(1, 1, 3, 10)), (4, 10, None)), r"expected \[B, 1, 4 or 1, 10\]"),
    (((0, 10, torch.zeros(1, 2, 10, 10)),), r"a mask of shape \(1, 2, 10, 10\)"),
])
def test_a_mask_that_does_not_fit_the_sequence_is_refused(parts, message):
    ctx = C.RankContext(G.Group(["cpu"]), 0, None)
    ctx.start(10)
    with pytest.raises(ValueError, match=message):
        ctx.set_masks(U.RowMasks(parts))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_call_from_a_whole_sequence_gets_every_ranks_keys(n):
    """Queries every rank holds whole (audio, 6 tokens) over the split sequence's keys (21 tokens, text held whole
    after them): gathered from every rank, each rank the same output, the layout kept for the next calls."""
    g = torch.Generator().manual_seed(n)
    tokens, suffix, la = 21, 2, 6
    k = torch.randn(2, tokens + suffix, 4, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, tokens + suffix, 4, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, la, 4, 8, generator=g, dtype=torch.float64)
    ref = masked(q, k, v)
    group = G.Group(["cpu"] * n)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, others={la, 3}, suffix=suffix, whole_queries={la})
        kl, vl = _local(k, ctx.layout, r), _local(v, ctx.layout, r)
        assert ctx.gathers(la, kl.shape[1]) and not ctx.exchanges(la, kl.shape[1])
        assert not ctx.gathers(3, kl.shape[1])  # text queries: not listed as whole
        kw, vw = ctx.keys(kl, vl)
        assert ctx.layout is not None
        return masked(q, kw, vw)

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    assert all((o - ref).abs().max() < 1e-12 for o in outs)


def test_a_share_as_long_as_the_whole_queries_is_not_split():
    n = 2
    group = G.Group(["cpu"] * n)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        return ctx.start(20, others={3}, whole_queries={10}), ctx.why

    outs, errs = run_ranks(n, rank)
    assert outs[0] == (False, "a GPU's share (10 tokens) is as long as the text or image sequence it attends to, so "
                              "its attention calls could not be told apart")
    assert isinstance(errs[1], C.StopRank)
