"""Context parallelism on the CPU: N = 2, 3 and 4 ranks, each a thread, simulated on the CPU's one device.

First the exchange alone (parallel/ulysses.py) against whole attention in fp64: uneven head splits, more ranks than
heads, grouped-query heads, text tokens held whole before or after the split part; a failing rank stops the others.
Then real ComfyUI models of every family with a unit (tests/zoo's tiny builders, several configurations per family),
sampled through the Context Parallel node, alone and with Patch Attention in either order, against the same model on
one device: the final latent equal within fp32 rounding, and every forward split (attention calls exchanged).
"""

from __future__ import annotations

import functools
import gc
import importlib
import sys
import threading

import pytest
import torch
from comfyui_support import compiled_as_the_node, counting_exchanges
from pack import load

P = load()
G = importlib.import_module(P.__name__ + ".parallel.group")
U = importlib.import_module(P.__name__ + ".parallel.ulysses")
E = importlib.import_module(P.__name__ + ".parallel.exchange")
C = importlib.import_module(P.__name__ + ".parallel.context")
F = torch.nn.functional


def whole(q, k, v, mask=None):
    """Attention over ``[B, L, H, D]`` (fp64 reference; grouped K/V heads repeated), under ``mask`` in ComfyUI's shapes
    (2-D ``[Lq, Lk]``, 3-D ``[B, Lq, Lk]``, 4-D as SDPA takes it; additive or bool, True attends)."""
    hq, hk = q.shape[2], k.shape[2]
    if hq != hk:
        k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    while mask is not None and mask.ndim < 4:
        mask = mask.unsqueeze(0 if mask.ndim == 2 else 1)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask).transpose(1, 2)


def rand_qkv(g, b, L, heads, kv_heads, d, dv=None):
    """fp64 ``q`` ``[b, L, heads, d]``, ``k`` ``[b, L, kv_heads, d]``, ``v`` ``[b, L, kv_heads, dv or d]``, drawn from
    ``g`` in that order."""
    return (torch.randn(b, L, heads, d, generator=g, dtype=torch.float64),
            torch.randn(b, L, kv_heads, d, generator=g, dtype=torch.float64),
            torch.randn(b, L, kv_heads, dv or d, generator=g, dtype=torch.float64))


def rank_rows(t, lay, r, dim=1):
    """Rank ``r``'s rows of a tensor over the whole sequence (along ``dim``): the prefix, its shard, the suffix."""
    full = t.shape[dim]
    s0, sc = lay.shards[r]
    return torch.cat([t.narrow(dim, 0, lay.prefix), t.narrow(dim, lay.prefix + s0, sc),
                      t.narrow(dim, full - lay.suffix, lay.suffix)], dim)


def run_ranks(n, fn):
    """``fn(rank)`` in ``n`` threads; the results by rank (an exception in a rank is re-raised)."""
    out, errs = [None] * n, [None] * n

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errs


def memmove_2d(dst, dpitch, src, spitch, width, height, stream):
    """``cudaMemcpy2DAsync`` over CPU memory (a group's ``copy_2d`` for ranks simulated on the CPU), counted."""
    import ctypes

    assert stream is None
    memmove_2d.calls += 1
    for r in range(height):
        ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    return 0


memmove_2d.calls = 0


def run_plan(dst, src, plan):
    """What ``cudaMemcpy2DAsync`` does with a :func:`pitched_plan` entry, row by row on the CPU."""
    import ctypes

    for doff, dp, soff, sp, w, rows in plan:
        for r in range(rows):
            ctypes.memmove(dst.data_ptr() + doff + r * dp, src.data_ptr() + soff + r * sp, w)


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_share_of_the_heads_crosses_as_2d_copies(b, dtype):
    """The exchange's strided copies (a rank's heads out of ``[B, L, H, D]``, a peer's output into the heads of
    ``[B, L, H, Dv]``) as copy-engine 2-D copies: one block of rows per batch element, each token's row of the heads
    one piece; carried out row by row they give what ``copy_`` gives."""
    g = torch.Generator().manual_seed(b)
    big = torch.randn(b, 50, 12, 16, generator=g).to(dtype)
    src = big[:, 10:35, 4:9]  # a rank's shard of tokens, 5 of 12 heads
    dst = torch.zeros(b, 25, 5, 16, dtype=dtype)
    plan = G.pitched_plan(dst, src)
    es = big.element_size()
    assert plan is not None and len(plan) == b
    assert plan[0] == (0, 5 * 16 * es, 0, 12 * 16 * es, 5 * 16 * es, 25)  # rows: tokens; source pitch: all 12 heads
    run_plan(dst, src, plan)
    assert torch.equal(dst, src)
    # and back: a contiguous output into those heads of the rank's tokens
    out = torch.zeros_like(big)
    back = torch.randn(b, 25, 5, 16, generator=g).to(dtype)
    plan = G.pitched_plan(out[:, 10:35, 4:9], back)
    assert plan is not None and len(plan) == b
    run_plan(out[:, 10:35, 4:9], back, plan)
    want = torch.zeros_like(big)
    want[:, 10:35, 4:9] = back
    assert torch.equal(out, want)


def test_a_heads_first_share_crosses_as_one_2d_copy_a_tensor():
    """A rank's shard of ``[B, H, L, D]`` (ComfyUI's skip_reshape calls: Flux's) into the buffer of its heads over the
    whole sequence, and the tokens held whole from its own copy: one block of rows a tensor, one row per head, where
    the same tensors seen as ``[B, L, H, D]`` leave a row per token and head (no 2-D copy: the other path)."""
    heads, full, prefix, d = 6, 50, 12, 16  # more tokens than MAX_BLOCKS in either part
    local = torch.randn(1, heads, prefix + 20, d, dtype=torch.bfloat16)  # prefix + a rank's 20 tokens, every head
    buf = torch.zeros(1, 3, full, d, dtype=torch.bfloat16)  # this rank's 3 heads, every token
    cut = E.Cut(2, 1)
    for dst_rows, src_rows in ((slice(prefix + 10, prefix + 30), slice(prefix, prefix + 20)),
                               (slice(0, prefix), slice(0, prefix))):
        dst, src = cut.rows(buf, dst_rows), cut.of(local, src_rows, 3, 6)
        plan = G.pitched_plan(dst, src)
        assert plan is not None and len(plan) == 1 and plan[0][5] == 3  # one row of tokens per head
        run_plan(dst, src, plan)
        assert torch.equal(dst, src)
        old = torch.zeros(1, full, 3, d, dtype=torch.bfloat16)  # the same call exchanged as [B, L, H, D] views
        assert G.pitched_plan(E.KV.rows(old, dst_rows), E.KV.of(local.transpose(1, 2), src_rows, 3, 6)) is None


@pytest.mark.parametrize("heads_first", [False, True])
def test_a_plan_makes_one_copy_of_copies_that_continue_one_another(heads_first):
    """The first GPU's own text tokens and its share right after them, in its buffer as in its tensors: one copy a
    tensor in the plan (the next rows, or heads first the next bytes of each head's row); the second GPU's share does
    not continue its text in the buffer: two.  Run, the plan fills the buffers as the copies one by one do."""
    heads, prefix, tokens, d = 6, 5, 20, 8
    lay = E.shard_layout(tokens, 2, prefix)
    group = G.Group(["cpu"] * 2, copy_2d=memmove_2d)
    cut = E.Cut(2, 1) if heads_first else E.KV
    for rank, copies in ((0, 1), (1, 2)):
        ex = E.Exchange(group, rank, lay, heads, heads)
        t = torch.randn(1, prefix + 10, heads, d)
        t = t.transpose(1, 2).contiguous() if heads_first else t
        bufs = ex.buffers((t,), (cut,), 3)
        own = ex._heads_copies(rank, (t,), bufs, (cut,), 0, 3)
        plan = G.planned([own if p == rank else [] for p in range(2)], bufs, [(t,), (t,)])
        assert len(plan[rank]) == copies
        want = torch.zeros_like(bufs[0])
        for _, dst, src in ex._heads_copies(rank, (t,), [want], (cut,), 0, 3):
            dst.copy_(src)
        bufs[0].zero_()
        group.run_plan(rank, [((t,), None, None)] * 2, plan, bufs, None, None)
        assert torch.equal(bufs[0], want)


def test_whole_rows_are_one_block_and_other_copies_are_refused():
    """Every batch element's whole sequence: one block; a strided last dimension, a broadcast source, other dtypes or
    more blocks than MAX_BLOCKS: None (the copy takes the other path)."""
    t = torch.randn(3, 20, 8, 4)
    dst = torch.empty(3, 20, 2, 4)
    plan = G.pitched_plan(dst, t[:, :, 2:4])
    assert plan is not None and len(plan) == 1 and plan[0][5] == 60  # 3 x 20 rows, one pitch
    run_plan(dst, t[:, :, 2:4], plan)
    assert torch.equal(dst, t[:, :, 2:4])
    assert G.pitched_plan(torch.empty(4, 20), t[0, :, 0].transpose(0, 1)) is None  # last dimension strided
    assert G.pitched_plan(torch.empty(20, 4), torch.randn(1, 4).expand(20, 4)) is None  # rows overlap
    assert G.pitched_plan(torch.empty(3, 20, 2, 4, dtype=torch.float64), t[:, :, 2:4]) is None
    many = torch.randn(G.MAX_BLOCKS + 1, 10, 4, 4)
    assert G.pitched_plan(torch.empty(G.MAX_BLOCKS + 1, 5, 2, 4), many[:, 2:7, :2]) is None
    flat = torch.randn(64)
    assert G.pitched_plan(torch.empty(64), flat) == ((0, 256, 0, 256, 256, 1),)


def words(t) -> bool:
    return G._words(tuple(t.shape), t.stride(), t.storage_offset(), t.element_size())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_ranks_own_share_is_copied_as_words_bit_for_bit(dtype):
    """A rank's own share of the heads (strided) is copied as 8-byte words: the same bytes as ``copy_``, NaN and
    infinity payloads included; a last dimension, stride or offset that is not whole words takes ``copy_``."""
    big = torch.randn(2, 50, 12, 16).to(dtype)
    big[0, 3, 5, 7], big[1, 9, 4, 0] = float("nan"), float("-inf")
    src = big[:, 10:35, 4:9]
    assert words(src)
    dst = torch.zeros(2, 25, 5, 16, dtype=dtype)
    G._copy_words(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8))
    back = torch.zeros_like(big)
    G._copy_words(back[:, 10:35, 4:9], dst)
    assert torch.equal(back[:, 10:35, 4:9].contiguous().view(torch.uint8), dst.view(torch.uint8))
    assert not back[:, :10].any() and not back[:, 35:].any() and not back[:, 10:35, :4].any()
    odd = torch.randn(2, 50, 12, 3).to(dtype)  # a row of 3 elements: not whole words
    assert not words(odd[:, :, 4:9])
    d2 = torch.zeros(2, 50, 5, 3, dtype=dtype)
    G._copy_words(d2, odd[:, :, 4:9])
    assert torch.equal(d2, odd[:, :, 4:9])
    assert not words(big[:, :, 4:9, 1:9])  # an offset of one element
    mask = torch.arange(100).to(dtype).as_strided((1, 1, 8), (53, 8, 1), 8)  # an odd stride on a dimension of one
    assert not words(mask)
    m2 = torch.empty(1, 1, 8, dtype=dtype)
    G._copy_words(m2, mask)
    assert torch.equal(m2, mask)
    assert G.Group(["cpu", "cpu"]).puller(0, 0, [((), None, None)] * 2) is G._copy_words
    assert G.Group(["cpu", "cpu"], words=False).puller(0, 0, [((), None, None)] * 2) is G._copy


@pytest.mark.parametrize("total,parts,align,want", [
    (32760, 2, 128, [16384, 16376]), (32760, 3, 128, [10880, 10880, 11000]), (100, 4, 1, [25, 25, 25, 25]),
    (10, 3, 8, [4, 3, 3]), (1000, 2, 256, [512, 488])])
def test_an_aligned_split_keeps_every_share_but_the_last_a_multiple(total, parts, align, want):
    """``split(..., align)``: every share but the last a multiple of ``align`` (within ``align`` of each other),
    covering every item in order; too few items for a block per part: the even split."""
    got = G.split(total, parts, align)
    assert [n for _, n in got] == want
    assert [s for s, _ in got] == [sum(want[:i]) for i in range(parts)]


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("pipeline", [None, 2, 3])
@pytest.mark.parametrize("n,heads,kv_heads,prefix,suffix,tokens", [
    (2, 4, 4, 0, 0, 37), (3, 40, 40, 5, 0, 50), (4, 3, 3, 0, 7, 21), (4, 8, 2, 3, 2, 33), (3, 2, 2, 0, 0, 10),
    (2, 24, 24, 11, 0, 64)])
def test_ulysses_gives_whole_attention_on_every_rank(n, heads, kv_heads, prefix, suffix, tokens, pipeline, heads_first,
                                                     planned):
    """... with the heads sent in ``pipeline`` parts (None: one on the CPU), each part its own kernel call; q, k and v
    ``[B, L, H, D]`` or, ``heads_first``, ``[B, H, L, D]`` (ComfyUI's skip_reshape calls), the kernel's the same way;
    every copy copied by itself or (``planned``) the exchange run from its plan of 2-D copies, made once per geometry."""
    g = torch.Generator().manual_seed(n * 100 + heads)
    b, d = 2, 8
    L = prefix + tokens + suffix
    q, k, v = rand_qkv(g, b, L, heads, kv_heads, d, d + 2)
    ref = whole(q, k, v)
    lay = E.shard_layout(tokens, n, prefix, suffix)
    group = G.Group(["cpu"] * n, pipeline=pipeline, copy_2d=memmove_2d if planned else None)
    memmove_2d.calls = 0
    if planned:  # every copy from the plan
        group.puller = lambda *a: pytest.fail("a copy made by itself")

    def local(t, r):
        t = rank_rows(t, lay, r)
        return t.transpose(1, 2).contiguous() if heads_first else t

    def local_v(r):  # heads first: as Flux's single blocks hand v, a view of the fused q, k, v projection
        t = local(v, r)
        if not heads_first:
            return t
        fused = torch.stack([torch.zeros_like(t), torch.zeros_like(t), t], 0).permute(1, 3, 0, 2, 4).contiguous()
        return fused.permute(2, 0, 3, 1, 4)[2]  # [B, L, 3, H, D] -> [3, B, H, L, D]: tokens 3 * H * D apart

    calls = []

    def kernel(qf, kf, vf):
        if heads_first:
            assert qf.is_contiguous() and kf.is_contiguous() and vf.is_contiguous()
            qf, kf, vf = qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)
        calls.append(qf.shape)
        return whole(qf, kf, vf).contiguous()  # as a kernel's [B, L, h*Dv] seen as [B, L, h, Dv]

    outs, errs = run_ranks(n, lambda r: U.ulysses(group, r, lay, local(q, r), local(k, r), local_v(r), kernel,
                                                  heads_first=heads_first))
    assert errs == [None] * n
    for r in range(n):
        assert outs[r].shape == (b, lay.local_len(r), heads, d + 2)
        assert (outs[r] - rank_rows(ref, lay, r)).abs().max() < 1e-12
    assert (memmove_2d.calls > 0) == planned
    # every rank's kernel saw the whole sequence and its share of the heads (fewer heads than ranks: some see none),
    # in parts when pipelined
    parts = [m for _, c in G.split(kv_heads, n) for _, m in G.split(c, pipeline or 1)]
    assert sorted(s[2] for s in calls) == sorted(m * heads // kv_heads for m in parts if m)
    assert all(s[1] == L for s in calls)


def test_a_failing_rank_stops_the_others_with_its_error():
    n = 3
    group = G.Group(["cpu"] * n)
    lay = E.shard_layout(12, n)
    x = torch.randn(1, 4, 2, 4)

    def rank(r):
        if r == 1:
            group.abort(ValueError("rank 1 failed"))
            raise ValueError("rank 1 failed")
        return U.ulysses(group, r, lay, x, x, x, whole)

    _, errs = run_ranks(n, rank)
    assert isinstance(errs[1], ValueError)
    for r in (0, 2):
        assert isinstance(errs[r], G.GroupAborted) and "rank 1 failed" in str(errs[r])


def test_shard_and_gather_round_trip_with_text_held_whole():
    n, tokens, prefix = 3, 10, 4
    group = G.Group(["cpu"] * n)
    full = torch.randn(2, prefix + tokens, 5)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, others={2}, prefix=prefix)
        part = ctx.shard(full)
        assert part.shape[1] == prefix + ctx.rows()[1]
        return ctx.gather(part)

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n and all(torch.equal(o, full) for o in outs)


def test_a_forward_too_short_to_split_runs_on_the_first_rank_only():
    n = 4
    group = G.Group(["cpu"] * n)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        return ctx.start(32, others={8}), ctx.why  # shards of 8 tokens: as long as the text

    outs, errs = run_ranks(n, rank)
    assert outs[0] == (False, "a GPU's share (8 tokens) is as long as the text or image sequence it attends to, so its "
                              "attention calls could not be told apart")
    assert all(isinstance(e, C.StopRank) for e in errs[1:])


# ---------------------------------------------------------------- real ComfyUI models

# configurations per family unit (with a latent of more tokens where the zoo's is too short for 4 ranks), and the
# rank counts at which a rank's share is as long as the text (8 tokens): those forwards run whole on the first rank
CASES = {
    "WAN21_T2V": dict(latent=(1, 16, 3, 8, 8)),
    "WAN22_T2V": dict(latent=(1, 48, 3, 8, 8)),
    "WAN21_I2V": dict(whole={4}),
    "WAN21_FunControl2V": dict(whole={4}),
}


@pytest.fixture(scope="module")
def zoo():
    from comfyui_support import comfy, load_pack

    comfy()
    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        pytest.skip("context parallelism needs ComfyUI 0.33 or later (its MultiGPU model copies)")
    import zoo as z

    z.load_families()
    mod, mappings = load_pack()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield z, mod, mappings
    torch.set_num_threads(threads)


def _case(z, name):
    import comfy.supported_models as sm

    cls = getattr(sm, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this ComfyUI")
    case = z.BUILDERS[name](cls, False)
    latent = CASES.get(name, {}).get("latent")
    return cls, (z.with_(case, latent=latent) if latent else case)


def rel_l1(a, b) -> float:
    return float((a.double() - b.double()).abs().sum() / b.double().abs().sum())


def work_floor_when_simulated(cpn, monkeypatch) -> None:
    """Simulated ranks take the node's work floor as GPUs do (they split from 0 tokens otherwise)."""
    init = cpn.ContextParallel.__init__
    monkeypatch.setattr(cpn.ContextParallel, "__init__", lambda self, unit, cfg_split=False, simulate=0, min_tokens=0,
                        **k: init(self, unit, cfg_split, simulate, None, **k))


def _split(mod, model, n, **kw):
    return importlib.import_module(mod.__name__ + ".nodes.context_parallel").context_parallel(model, simulate=n, **kw)


def split_under_patch(mod, base, n, order, backend="sdpa_math"):
    """``base`` split over ``n`` ranks with Patch Attention (``backend``, log_stats) applied before the split
    (``order`` "patch-then-split") or after it: the model, and Patch Attention's override, found under the split's
    attention hook, which stays on top in either order."""
    patch = mod.nodes.patch.patch_model
    if order == "patch-then-split":
        m = _split(mod, patch(base, backend, log_stats=True), n)
    else:
        m = patch(_split(mod, base, n), backend, log_stats=True)
    hook = m.model_options["transformer_options"]["optimized_attention_override"]
    assert type(hook).__name__ == "ContextParallelAttention"
    assert type(hook.inner).__name__ == "AttentionOverride"
    return m, hook.inner


def calls_under_patch(zoo, base, case, n, order):
    """``base`` split over ``n`` ranks under Patch Attention (``sdpa_math``, ``order`` as :func:`split_under_patch`),
    sampled: the latent within fp32 rounding of the unsplit model's; returns the split model, Patch Attention's override
    and the kernel calls each lane counted (``{backend: calls}`` per lane)."""
    z, mod, _ = zoo
    ref = z.sample(base, case)
    m, ov = split_under_patch(mod, base, n, order)
    out = z.sample(m, case)
    assert rel_l1(out, ref) < 1e-5
    return m, ov, [dict(ln.config.stats.calls) for ln in ov.lanes()]


def check_split(zoo, name: str, n: int, latent=None, whole=(), case=None, tol: float = 1e-5):
    """Configuration ``name`` of the zoo (``latent``: another latent shape; ``case``: a case of one's own) sampled
    through the Context Parallel node on ``n`` simulated ranks against the same model on one device: the latent equal
    within ``tol``, every self-attention call of every block exchanged on every rank (for ``n`` in ``whole``: none,
    the forward ran whole on the first rank).  Returns the number of exchanged calls."""
    z, mod, mappings = zoo
    if case is None:
        cls, case = _case(z, name)
        if latent is not None:
            case = z.with_(case, latent=latent)
    else:
        import comfy.supported_models as sm

        cls = getattr(sm, name)
    base = z.build(cls, case)
    ref = z.sample(base, case)
    with counting_exchanges(mod) as counts:
        out = z.sample(_split(mod, base, n), case)
    assert torch.isfinite(out).all()
    assert rel_l1(out, ref) < tol, rel_l1(out, ref)
    if n in whole:
        assert counts == []
    else:
        assert sorted(set(counts)) == list(range(n)) and len(counts) % (n * case.steps) == 0
    return len(counts)


def check_planned(zoo, cls, case, n: int, monkeypatch) -> None:
    """A model of ``cls`` sampled split over ``n`` simulated ranks with every exchange run from its plan of 2-D copies,
    as on CUDA GPUs (here over CPU memory): the latent of the exchange copy by copy, bit for bit."""
    z, mod, mappings = zoo
    base = z.build(cls, case)
    one_by_one = z.sample(_split(mod, base, n), case)
    group = mod.parallel.group.Group
    init = group.__init__

    def planned(self, *a, **k):
        init(self, *a, **k)
        self.copy_2d = memmove_2d

    callers, puller = [], group.puller

    def counted(self, *a, **k):
        callers.append(sys._getframe(1).f_code.co_name)
        return puller(self, *a, **k)

    monkeypatch.setattr(group, "__init__", planned)
    monkeypatch.setattr(group, "puller", counted)
    memmove_2d.calls = 0
    out = z.sample(_split(mod, base, n), case)
    assert memmove_2d.calls > 0
    assert set(callers) <= {"exchange"}  # copies made one by one: the gathers of the tokens only
    assert torch.equal(out, one_by_one)


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3, 4])
def test_wan_exchanges_run_from_their_plan_give_the_latent_of_copies_made_one_by_one(zoo, n, monkeypatch):
    """Wan's q, k and v sent one by one as the model makes them, each from its plan."""
    z, _, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    check_planned(zoo, cls, z.with_(case, latent=CASES["WAN21_T2V"]["latent"]), n, monkeypatch)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_split_forward_gives_the_one_device_latent(zoo, name, n):
    z, mod, mappings = zoo
    exchanged = check_split(zoo, name, n, CASES[name].get("latent"), CASES[name].get("whole", ()))
    if n not in CASES[name].get("whole", ()):
        cls, case = _case(z, name)
        # one self-attention call per block per forward (the conds of a step are one batch: a forward per step)
        assert exchanged == n * len(z.build(cls, case).model.diffusion_model.blocks) * case.steps


@pytest.mark.comfyui
@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_a_split_model_is_freed_once_the_graph_drops_it(zoo, order):
    """Nothing of the node or of Patch Attention keeps a model alive after a sampling run: once the graph drops the
    model and ComfyUI unloads it, its weights are freed (each GPU's copy would otherwise stay for the process)."""
    import weakref

    import comfy.model_management as mm

    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    model = weakref.ref(base.model)
    m, _ = split_under_patch(mod, base, 2, order)
    z.sample(m, case)
    del m, base
    mm.unload_all_models()
    mm.cleanup_models()
    gc.collect()
    assert model() is None, [type(o).__name__ for o in gc.get_referrers(model())][:8]


@pytest.mark.comfyui
@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_in_either_order(zoo, order):
    z, mod, mappings = zoo
    cls, case = _case(z, "WAN21_T2V")
    m, ov, calls = calls_under_patch(zoo, z.build(cls, case), case, 2, order)
    assert ov.previous is None
    # every rank ran its share on the chosen kernel, in its own lane: self-attention with the whole sequence and its
    # share of the heads (one of the model's two), cross-attention with its share of the tokens
    assert calls == [{"sdpa_math": 2 * case.steps}] * 2
    # "disabled" takes Patch Attention out from under the split and keeps the split
    off = mod.nodes.patch.patch_model(m, "disabled")
    hook2 = off.model_options["transformer_options"]["optimized_attention_override"]
    assert type(hook2).__name__ == "ContextParallelAttention" and hook2.inner is None


@pytest.mark.comfyui
def test_a_sequence_shorter_than_min_tokens_runs_on_one_gpu_and_says_why_once(zoo, caplog):
    """Below ``min_tokens`` (a token floor given to the node; by default the node's floor is the model's work per block:
    tests/test_cp_floor.py) a forward runs whole on the first GPU: the one-GPU latent, no call exchanged, the reason
    logged once per run; at the limit it splits."""
    z, mod, mappings = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    ref = z.sample(base, case)
    tokens = int(torch.tensor(case.latent[2:]).prod()) // 4  # the (1, 2, 2) patches of the latent: Wan's tokens
    with counting_exchanges(mod) as counts:
        with caplog.at_level("WARNING"):
            out = z.sample(_split(mod, base, 2, min_tokens=tokens + 1), case)
        assert counts == [] and torch.equal(out, ref)
        said = [r.getMessage() for r in caplog.records if "fewer than" in r.getMessage()]
        assert len(said) == 1 and f"{tokens:,} tokens to split, fewer than {tokens + 1:,}" in said[0], said
        out = z.sample(_split(mod, base, 2, min_tokens=tokens), case)
        assert counts and rel_l1(out, ref) < 1e-5
    cpn = importlib.import_module(mod.__name__ + ".nodes.context_parallel")
    assert cpn.MIN_SPLIT_TOKENS is None  # no token floor for every node: the work floor (SPLIT_TFLOP)


@pytest.mark.comfyui
@pytest.mark.parametrize("order", ["compile-after", "compile-before"])
def test_torch_compile_under_the_split(zoo, caplog, order):
    """ComfyUI's TorchCompileModel before or after the node, with its node's guard filter (no guard on anything reached
    through ``transformer_options``), after the model sampled compiled without the node: no compiled code runs in a
    split forward on any rank (code compiled for the unsplit model would run without the split, and the other ranks
    would wait for it), every rank exchanges, the latent is the uncompiled split's, bit for bit, and the node says so
    once per run."""
    import torch._dynamo

    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    eager = z.sample(_split(mod, base, 2), case)
    calls = []

    def backend(gm, inputs, **_):  # a backend that runs the graph as traced, counting the runs of compiled code
        def run(*a):
            calls.append(gm)
            return gm.forward(*a)
        return run

    torch._dynamo.reset()
    try:
        z.sample(compiled_as_the_node(base, backend), case)
        assert calls, "the unsplit model did not run compiled"
        calls.clear()
        with counting_exchanges(mod) as counts, caplog.at_level("WARNING"):
            m = compiled_as_the_node(_split(mod, base, 2), backend) if order == "compile-after" else \
                _split(mod, compiled_as_the_node(base, backend), 2)
            out = z.sample(m, case)
    finally:
        torch._dynamo.reset()
    assert calls == [] and sorted(set(counts)) == [0, 1] and rel_l1(out, eager) == 0
    said = [r.getMessage() for r in caplog.records if "torch.compile is on" in r.getMessage()]
    assert len(said) == 1 and "split over GPUs run uncompiled" in said[0]  # once per run
    fw = importlib.import_module(mod.__name__ + ".nodes.context_parallel").SplitForwardWrapper
    assert "ControlNet" in fw.why_not(object()) and fw.why_not(None) == ""


@pytest.mark.comfyui
def test_a_model_without_a_unit_samples_on_one_gpu_and_says_so_once(zoo):
    """An SD 1.5 UNet has no unit: the node leaves it on one GPU, and sampling says so once, naming the model."""
    from comfyui_support import sample, tiny_sd
    from conftest import capture

    z, mod, mappings = zoo
    base = tiny_sd()
    assert mod.parallel.families.unit_for(base.model.diffusion_model) is None
    m = _split(mod, base, 2)
    with capture("patch_attention") as recs:
        out = sample(m, kind="sd", steps=2)
    said = [r.getMessage() for r in recs if "Context Parallel" in r.getMessage()]
    assert len(said) == 1 and "UNetModel" in said[0] and "samples on one GPU" in said[0]
    assert torch.equal(out, sample(base, kind="sd", steps=2))


@pytest.mark.comfyui
def test_the_runs_gpu_groups_from_comfyuis_multigpu_copies(zoo):
    """With ComfyUI's MultiGPU copies in the run's model options: one group of every GPU, the conds batched on the first
    (its cond scheduler no longer sees the copies); with cfg_split and CFG above 1, half of the GPUs per cond (the
    scheduler sees the halves' first GPUs; on 2 GPUs, ComfyUI's CFG Split itself); at CFG 1 cfg_split changes nothing;
    the options come back as they were after the run."""
    z, mod, mappings = zoo
    cpn = importlib.import_module(mod.__name__ + ".nodes.context_parallel")

    class Copy:
        def __init__(self, i):
            self.model = f"model{i}"

    devs = [torch.device("cuda", i) for i in range(4)]
    clones = {d: Copy(i) for i, d in enumerate(devs)}
    opts = {"multigpu_clones": dict(clones)}
    for cfg_split, cfg in ((False, 5.0), (True, 1.0)):
        groups, restore = cpn.RunWrapper.groups(cpn.ContextParallel(None, cfg_split=cfg_split), opts, None, cfg)
        assert groups == [[(d, f"model{i}") for i, d in enumerate(devs)]] and "multigpu_clones" not in opts
        restore()
        assert opts["multigpu_clones"] == clones
    groups, restore = cpn.RunWrapper.groups(cpn.ContextParallel(None, cfg_split=True), opts, None, 5.0)
    assert groups == [[(devs[0], "model0"), (devs[1], "model1")], [(devs[2], "model2"), (devs[3], "model3")]]
    assert list(opts["multigpu_clones"]) == [devs[0], devs[2]]
    restore()
    assert opts["multigpu_clones"] == clones
    # two GPUs, CFG 5: a GPU per cond (CFG Split); three: two GPUs for the first cond, one for the second
    for n, sizes in ((2, [1, 1]), (3, [2, 1])):
        some = {"multigpu_clones": {d: clones[d] for d in devs[:n]}}
        groups, restore = cpn.RunWrapper.groups(cpn.ContextParallel(None, cfg_split=True), some, None, 5.0)
        assert [len(g) for g in groups] == sizes
        restore()


# ---------------------------------------------------------------- loaders without a reload function

class QuantTensor(torch.Tensor):
    """A weight as ComfyUI-GGUF's GGMLTensor keeps it: a tensor subclass with its quantization type, its logical shape
    and the LoRA patches its patcher puts on it (outside the weights)."""

    def __init__(self, *args, tensor_type, tensor_shape, patches=(), **kwargs):
        super().__init__()
        self.tensor_type, self.tensor_shape, self.patches = tensor_type, tensor_shape, list(patches)

    def __new__(cls, *args, tensor_type, tensor_shape, patches=(), **kwargs):
        return super().__new__(cls, *args, **kwargs)

    def clone(self, *args, **kwargs):
        return self

    def detach(self, *args, **kwargs):
        return self

    def new_empty(self, size, *args, **kwargs):
        return QuantTensor(super().new_empty(size, *args, **kwargs), tensor_type=self.tensor_type, tensor_shape=size,
                           patches=self.patches)


@pytest.fixture
def two_devices(zoo, monkeypatch):
    """ComfyUI sees two devices, the CPU and a second one (``cpu:1``: never used to compute here), so that the node
    asks ComfyUI for a MultiGPU copy of the model (``deepclone_multigpu``), which calls the model's reload function."""
    import comfy.model_management as mm

    devs = [torch.device("cpu"), torch.device("cpu", 1)]
    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(devs))
    yield zoo
    mm.unload_all_models()


def _cpn(mod):
    return importlib.import_module(mod.__name__ + ".nodes.context_parallel")


def _copies(m):
    return m.get_additional_models_with_key("multigpu")


def test_a_model_without_a_reload_function_gets_copies_of_its_unpatched_weights(two_devices):
    """A model whose loader registers no reload function (ComfyUI-GGUF's), with a LoRA-like patch and loaded (its
    weights patched in place) before the node: the node's clone alone gets a reload function, ComfyUI's copy for the
    other GPU is a copy of the model's own weights (unpatched) with the patch kept on the copy's patcher, and the
    node says once how the copies were made."""
    import comfy.model_management as mm
    from comfyui_support import tiny_flux
    from conftest import capture

    z, mod, _ = two_devices
    base = tiny_flux()
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    w0 = base.model.state_dict()[key].clone()
    lora = base.clone()
    lora.add_patches({key: (torch.full_like(w0, 0.5),)}, 1.0)
    mm.load_models_gpu([lora])
    assert torch.equal(base.model.state_dict()[key], w0 + 0.5)  # loaded: the patch is in the weights
    assert base.cached_patcher_init is None
    with capture("patch_attention.parallel") as recs:
        m = _cpn(mod).context_parallel(lora, gpus=0)
    said = [r.getMessage() for r in recs]
    assert len(said) == 1 and "copies of the loaded model" in said[0] and "no reload function" in said[0], said
    (copy,) = _copies(m)
    assert copy.load_device == torch.device("cpu", 1) and copy.model is not base.model
    assert torch.equal(copy.model.state_dict()[key], w0)  # the model's own weights, not the patched ones
    assert key in copy.patches
    copy.patch_model()  # ComfyUI puts the patch on the copy as on the model
    assert torch.equal(copy.model.state_dict()[key], w0 + 0.5)
    copy.unpatch_model()
    # only the node's clone has the reload function: the user's model objects see nothing of it
    assert base.cached_patcher_init is None and lora.cached_patcher_init is None
    assert m.cached_patcher_init is not None


def test_a_tensor_subclass_with_attributes_survives_the_copy(two_devices):
    """A quantized weight kept as a tensor subclass with attributes (ComfyUI-GGUF's GGMLTensor) is copied as one: its
    class, data and attributes, in memory of its own."""
    from comfyui_support import tiny_flux

    z, mod, _ = two_devices
    base = tiny_flux()
    layer = base.model.diffusion_model.double_blocks[0].img_attn.qkv
    w = layer.weight.detach()
    layer.weight = torch.nn.Parameter(QuantTensor(w.clone(), tensor_type="Q8_0", tensor_shape=w.shape),
                                      requires_grad=False)
    (copy,) = _copies(_cpn(mod).context_parallel(base, gpus=0))
    cw = copy.model.diffusion_model.double_blocks[0].img_attn.qkv.weight
    assert type(cw) is QuantTensor and torch.equal(cw.as_subclass(torch.Tensor), w)
    assert (cw.tensor_type, cw.tensor_shape, cw.patches) == ("Q8_0", w.shape, [])
    assert cw.data_ptr() != layer.weight.data_ptr()


@pytest.mark.parametrize("why", ["uncopyable", "still patched"])
def test_a_model_that_cannot_be_copied_samples_on_one_gpu_and_says_why(two_devices, monkeypatch, why):
    """No reload function and no copy: a model holding something that cannot be copied (a lock here), or one whose
    weights are still patched when ComfyUI asks for the copy (loaded on a device its unload does not reach): the node
    returns a one-GPU clone that says why, raises nothing, and samples as the model does."""
    import comfy.model_management as mm
    from comfyui_support import sample, tiny_flux
    from conftest import capture

    z, mod, _ = two_devices
    base = tiny_flux()
    ref = sample(base, steps=2)
    if why == "uncopyable":
        base.model.lock = threading.Lock()
        want = "cannot be copied for the other GPUs (TypeError"
    else:
        lora = base.clone()
        key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
        lora.add_patches({key: (torch.zeros_like(base.model.state_dict()[key]),)}, 1.0)
        mm.load_models_gpu([lora])
        monkeypatch.setattr(mm, "unload_model_and_clones", lambda *a, **k: None)
        want = "weights are still patched on another device"
    with capture("patch_attention.parallel") as recs:
        m = _cpn(mod).context_parallel(base, gpus=0)
    said = [r.getMessage() for r in recs]
    assert len(said) == 1 and want in said[0] and said[0].endswith(": one GPU"), said
    assert not _copies(m) and m.cached_patcher_init is None and base.cached_patcher_init is None
    with capture("patch_attention.parallel") as recs:
        out = sample(m, steps=2)
    assert [r.getMessage() for r in recs] == said
    assert torch.equal(out, ref)


def test_a_leaked_model_among_the_loaded_ones_gets_fresh_copies(two_devices, monkeypatch):
    """ComfyUI 0.33 reports a model whose patcher is gone while its weights stay loaded as leaked, and its MultiGPU
    reuse then reads ``None.model`` (AttributeError).  The node makes the copies afresh instead, and says so."""
    import comfy.model_management as mm
    from comfyui_support import tiny_flux
    from conftest import capture

    z, mod, _ = two_devices
    base = tiny_flux()
    loaded = mm.loaded_models
    monkeypatch.setattr(mm, "loaded_models", lambda *a, **k: [None, *loaded(*a, **k)])
    with capture("patch_attention.parallel") as recs:
        m = _cpn(mod).context_parallel(base, gpus=0)
    said = [r.getMessage() for r in recs]
    assert any("leaked model" in s and "made afresh" in s for s in said), said
    (copy,) = _copies(m)
    assert copy.load_device == torch.device("cpu", 1) and copy.model is not base.model


def test_no_copy_of_a_loaded_model_under_dynamic_vram(two_devices, monkeypatch):
    """With ComfyUI's dynamic VRAM on, a model whose loader registers no reload function is not copied (a copy of a
    GGUF model shared comfy-aimdo's buffers, and the process aborted when both were freed): one GPU, and why."""
    import comfy.memory_management
    from comfyui_support import tiny_flux
    from conftest import capture

    z, mod, _ = two_devices
    base = tiny_flux()
    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True, raising=False)
    with capture("patch_attention.parallel") as recs:
        m = _cpn(mod).context_parallel(base, gpus=0)
    said = [r.getMessage() for r in recs]
    assert len(said) == 1 and "cannot be copied for the other GPUs under dynamic VRAM: one GPU" in said[0], said
    assert not _copies(m) and m.cached_patcher_init is None and base.cached_patcher_init is None


def test_shares_aligned_to_a_block_of_tokens_give_the_one_device_latent(zoo, monkeypatch):
    """With every GPU's share a multiple of 5 tokens (Group.align; uneven shares), Wan split over 3 ranks gives the
    one-device latent, and every share but the last is a multiple of 5."""
    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    ref = z.sample(base, case)
    monkeypatch.setattr(mod.parallel.group, "ALIGN", 5)
    seen = []
    real = mod.parallel.context.RankContext.staged

    def spy(self, *a, **k):
        seen.append(self.layout.shards)
        return real(self, *a, **k)

    monkeypatch.setattr(mod.parallel.context.RankContext, "staged", spy)
    out = z.sample(_split(mod, base, 3), case)
    assert seen and all(all(n % 5 == 0 for _, n in shards[:-1]) for shards in seen)
    assert len({n for _, n in seen[0]}) > 1  # uneven: the alignment, not an even split that happened to fit
    assert rel_l1(out, ref) < 1e-5


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3, 4])
def test_wan_sends_q_k_and_v_as_it_makes_them(zoo, n, monkeypatch):
    """Split, Wan's self-attention sends q, k and v one by one as it makes them (each crossing while the next is
    computed): every block's self-attention call on every rank goes that way, the latent is bit for bit the one with all
    three sent at the attention call (Group.staged off), and after the run the model's modules are as they were."""
    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    dm = base.model.diffusion_model
    ref = z.sample(base, case)
    staged = []
    ctx = mod.parallel.context.RankContext
    real = ctx.staged

    def spy(self, *a, **k):
        staged.append(self.rank)
        return real(self, *a, **k)

    monkeypatch.setattr(ctx, "staged", spy)
    with counting_exchanges(mod) as counts:
        out = z.sample(_split(mod, base, n), case)
    assert len(staged) == len(counts) == n * len(dm.blocks) * case.steps
    assert not [m for m in dm.modules() if "forward" in m.__dict__]
    attn = dm.blocks[0].self_attn  # and nothing keeps a bound forward of it (which would keep the model alive)
    assert not [p for t in gc.get_referrers(attn) if isinstance(t, tuple) for p in gc.get_referrers(t)
                if isinstance(p, functools.partial)]
    monkeypatch.setattr(mod.parallel.group, "STAGED", False)
    with counting_exchanges(mod) as counts:
        at_the_call = z.sample(_split(mod, base, n), case)
    assert len(counts) == len(staged) == n * len(dm.blocks) * case.steps  # none staged this time
    assert torch.equal(out, at_the_call) and rel_l1(out, ref) < 1e-5


def test_a_staged_call_gives_what_the_call_at_once_gives():
    """ulysses.Staged (q, k and v sent one by one) against ulysses() on 3 ranks, grouped heads: the same output, bit for
    bit, on every rank; a rank with no heads runs no kernel; finishing before all three are sent is an error."""
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, L = 3, 4, 2, 23
    q, k, v = rand_qkv(g, 2, L, heads, kv_heads, 8)
    lay = E.shard_layout(L, n)
    group = G.Group(["cpu"] * n)
    calls = []

    def local(qf, kf, vf):
        calls.append(qf.shape[2])
        return whole(qf, kf, vf)

    def both(r):
        shares = [rank_rows(t, lay, r) for t in (q, k, v)]
        at_once = U.ulysses(group, r, lay, *shares, local)
        call = U.Staged(group, r, lay, heads, kv_heads)
        for t in shares:
            call.send(t)
        return at_once, call.finish(local)

    outs, errs = run_ranks(n, both)
    assert errs == [None] * n, errs
    want = whole(q, k, v)
    for r, (at_once, staged) in enumerate(outs):
        assert torch.equal(staged, at_once)
        assert torch.allclose(staged, rank_rows(want, lay, r), atol=1e-5)
    assert 0 not in calls  # the third rank holds no key/value head: no kernel call for it
    with pytest.raises(RuntimeError, match="finished after 1 of q, k and v were sent"):
        call = U.Staged(G.Group(["cpu"]), 0, E.shard_layout(L, 1), heads, kv_heads)
        call.send(q)
        call.finish(local)


@pytest.mark.comfyui
def test_wan_self_attention_replaced_by_another_node_is_left_to_it(zoo, monkeypatch):
    """Where something else replaced ComfyUI's WanSelfAttention.forward (another custom node), the split leaves it in
    charge: its forward runs on every call, q, k and v go at the attention call, and the latent is the one-device one."""
    import comfy.ldm.wan.model as wan

    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    ref = z.sample(base, case)
    original, ran = wan.WanSelfAttention.forward, []

    def theirs(self, *a, **k):
        ran.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(wan.WanSelfAttention, "forward", theirs)
    staged, real = [], mod.parallel.context.RankContext.staged
    monkeypatch.setattr(mod.parallel.context.RankContext, "staged",
                        lambda self, *a, **k: staged.append(1) or real(self, *a, **k))
    with counting_exchanges(mod) as counts:
        out = z.sample(_split(mod, base, 2), case)
    assert staged == [] and counts and len(ran) >= len(counts)
    assert rel_l1(out, ref) < 1e-5


# ---------------------------------------------------------------- what the node says on the canvas

@pytest.fixture
def node_on(monkeypatch):
    """``node_on(model, devices=None, gpus=0)``: the Context Parallel node run as ComfyUI registered it, on a machine where
    ComfyUI sees ``devices`` (None: the test machine, as ComfyUI sees it): (the model, the text it shows on the canvas),
    the classic node's text the same."""
    from comfyui_support import load_pack

    mod, mappings = load_pack()
    import comfy.model_management as mm

    def run(model, devices=None, gpus=0):
        if devices is not None:
            monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(devices), raising=False)
        cls, inputs = mappings["ContextParallel"], dict(model=model, gpus=gpus, cfg_split=True)
        if hasattr(cls, "execute"):  # V3
            out = cls.execute(**inputs)
            result, ui = out.result, out.ui.as_dict()
        else:
            out = cls().run(**inputs)
            result, ui = out["result"], out["ui"]
        classic = mod.nodes.v1.NODE_CLASS_MAPPINGS["ContextParallel"]().run(**inputs)
        assert len(result) == 1 and classic["ui"] == ui
        return result[0], ui["text"][0]

    yield run
    monkeypatch.undo()  # the test's CUDA stand-ins too, before ComfyUI frees what it loaded
    mm.unload_all_models()


@pytest.mark.comfyui
def test_the_node_says_on_the_canvas_why_it_does_not_split_here(node_on, monkeypatch):
    """No CUDA GPU, one GPU, one GPU asked for, a model family without a unit: the node's box on the canvas says which,
    and the model samples as it is; with two devices a model with a unit is split (ComfyUI 0.33+) and the box says how."""
    from comfyui_support import tiny_flux, tiny_sd

    flux, cpu, cpu1 = tiny_flux(), torch.device("cpu"), torch.device("cpu", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m, text = node_on(flux)  # the machine as ComfyUI sees it in the tests: the CPU alone
    assert text == "No CUDA GPU here: Context Parallel needs two or more."
    assert m.model is flux.model and m is not flux
    assert node_on(flux, [cpu])[1] == text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert node_on(flux, [cpu])[1] == ("ComfyUI runs on cpu here, not on CUDA: Context Parallel needs two or more CUDA "
                                       "GPUs.")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    assert node_on(flux, [torch.device("cuda", 0)])[1] == ("One GPU here (NVIDIA Test GPU): Context Parallel needs two or "
                                                           "more.")
    assert node_on(flux, [cpu, cpu1], gpus=1)[1] == ("The gpus input is 1, of the 2 GPUs here: nothing to split over (0: "
                                                     "all of them).")
    text = node_on(tiny_sd(), [cpu, cpu1])[1]
    assert text.startswith("SD15 (UNetModel) has no Context Parallel unit, so it samples on one GPU. Models with one: ")
    assert "Flux.1/Flux.2" in text and "Wan 2.1/2.2" in text
    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        want = "Splitting a model over GPUs needs ComfyUI 0.33 or later (its MultiGPU model copies): one GPU."
    else:  # the work floor, in the tiny model's tokens (one floor where ComfyUI's attention is not its PyTorch one)
        from comfyui_support import load_pack

        mod, _ = load_pack()
        cpn, dm = _cpn(mod), flux.model.diffusion_model
        work = importlib.import_module(mod.__name__ + ".parallel.families").unit_for(dm).work(dm)
        unit = importlib.import_module(mod.__name__ + ".parallel.families").unit_for(dm)
        a, b = (work.tokens_for(cpn.graphs_floor(unit, k)) for k in ("comfyui", "pack"))
        c = work.tokens_for(cpn.SPLIT_TFLOP["pack"])
        # Flux replays its split forwards as CUDA graphs: their floors, and the highest where the weights move
        moved = f"{c:,} or more where ComfyUI offloads part of the weights"
        steps = (f"each step of {a:,} tokens or more split over 2 GPUs ({b:,} or more with Patch Attention's kernels; "
                 f"{moved})" if cpn._host_attention()[0] == "comfyui"
                 else f"each step of {b:,} tokens or more split over 2 GPUs ({moved})")
        want = f"Flux.1/Flux.2: {steps}; above CFG 1, each prompt on half of them."
    assert node_on(flux, [cpu, cpu1])[1] == want


def test_the_canvas_script_knows_the_nodes_with_a_note():
    import json
    import os
    import re

    from comfyui_support import ROOT

    js = open(os.path.join(ROOT, "web", "patch_attention.js"), encoding="utf-8").read()
    listed = json.loads(re.search(r"const NOTE_NODES = (\[[^\]]*\]);", js).group(1))
    assert listed == [n.node_id for n in P.nodes.definitions.NODES if n.note] == ["ContextParallel"]


@pytest.mark.comfyui
def test_a_run_too_short_to_split_says_so_on_the_node_once(zoo, monkeypatch):
    """In a prompt, a sampling run whose forwards are below ``min_tokens`` adds the reason (token count and floor) under
    the node's own text in its box on the canvas, once per run, through ComfyUI's server to the prompt's client; outside
    a prompt it goes to the log alone."""
    import sys
    import types

    from comfy_execution.utils import CurrentNodeContext

    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    tokens = int(torch.tensor(case.latent[2:]).prod()) // 4  # the (1, 2, 2) patches of the latent: Wan's tokens
    sent = []
    server = types.SimpleNamespace(client_id="client", send_sync=lambda event, data, sid=None: sent.append((event, data, sid)))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=server)))
    with CurrentNodeContext("prompt-1", "7"):  # the node runs
        m, note = _cpn(mod).split_model(base, simulate=2, min_tokens=tokens + 1)
    assert note == (f"Wan 2.1/2.2: each step of {tokens + 1:,} tokens or more split over 2 GPUs; above CFG 1, each prompt "
                    "on half of them.")
    with CurrentNodeContext("prompt-1", "9"):  # the sampler runs
        z.sample(m, case)
    assert len(sent) == 1, sent
    event, data, sid = sent[0]
    assert (event, data["node"], data["display_node"], data["prompt_id"], sid) == ("executed", "7", "7", "prompt-1", "client")
    (text,) = data["output"]["text"]
    mine, why = text.split("\n")
    assert mine == note
    assert why.startswith(f"A forward of Wan 2.1/2.2 ran on one GPU: {tokens:,} tokens to split, fewer than {tokens + 1:,}")
    sent.clear()
    z.sample(m, case)
    assert sent == []


def test_a_family_unit_is_registered_by_naming_its_model_classes():
    """Every Unit subclass of parallel/families/ that names its own diffusion-model classes is registered, once, with
    no list to keep; a base shared by several (naming none of its own) is not a unit; no model class has two units."""
    fam = importlib.import_module(P.__name__ + ".parallel.families")
    names = [type(u).__name__ for u in fam.UNITS]
    assert len(names) == len(set(names)) and {"FluxUnit", "WanUnit", "VaceUnit", "MageFlowUnit"} <= set(names)
    assert "WanVariantUnit" not in names
    claimed = [c for _, classes in fam.supported() for c in classes]
    assert len(claimed) == len(set(claimed))
    for unit in fam.UNITS:
        for c in unit.classes:
            assert fam.unit_for(type(c, (), {})()) is unit
