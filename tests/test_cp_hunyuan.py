"""Context parallelism for HunyuanVideo 1.0/1.5 (and HunyuanImage 2.1, the same model class) on the CPU: 2, 3 and 4
ranks simulated as threads, the final latent against the model on one device.

The text is the prefix of HunyuanVideo's joint attention, held whole by every rank; a padded prompt masks its padding
with a key mask over the joint sequence, which the exchange carries with the keys.  First the key mask in the exchange
alone (parallel/ulysses.py, the attention override's mask shapes) against whole attention; then every configuration
the zoo builds for the family, the image-to-video guidance variants ("v2 (replace)", "custom"), HunyuanVideo 1.5 text to
video with a padded prompt, Patch Attention as the local kernel, and a forward that must run whole.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from pack import load
from test_context_parallel import _case, check_split, rand_qkv, rel_l1, run_ranks, split_under_patch
from test_context_parallel import rank_rows as _local
from test_context_parallel import whole as masked_whole

P = load()
G = importlib.import_module(P.__name__ + ".parallel.group")
U = importlib.import_module(P.__name__ + ".parallel.ulysses")
E = importlib.import_module(P.__name__ + ".parallel.exchange")
C = importlib.import_module(P.__name__ + ".parallel.context")
CPN = importlib.import_module(P.__name__ + ".nodes.context_parallel")
HY = importlib.import_module(P.__name__ + ".parallel.families.hunyuan_video")
F = torch.nn.functional
zoo = importlib.import_module("test_context_parallel").zoo  # the fixture: ComfyUI 0.33+, the zoo and the pack




# ---------------------------------------------------------------- the key mask in the exchange

@pytest.mark.parametrize("n,heads,kv_heads,prefix,suffix,tokens,per_head,boolean", [
    (2, 4, 4, 8, 0, 37, False, False), (3, 5, 5, 6, 0, 50, True, False), (4, 3, 3, 0, 7, 21, False, True),
    (4, 8, 2, 3, 2, 33, True, False), (3, 2, 2, 5, 0, 10, False, False), (4, 2, 2, 9, 0, 22, True, True)])
def test_ulysses_carries_a_key_mask(n, heads, kv_heads, prefix, suffix, tokens, per_head, boolean):
    g = torch.Generator().manual_seed(n * 100 + heads)
    b, d = 2, 8
    L = prefix + tokens + suffix
    q, k, v = rand_qkv(g, b, L, heads, kv_heads, d)
    keep = torch.rand(b, heads if per_head else 1, 1, L, generator=g) > 0.3
    keep[..., 0] = True  # every row keeps a key
    mask = keep if boolean else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -torch.finfo(torch.float64).max)
    ref = masked_whole(q, k, v, mask)
    assert (ref - masked_whole(q, k, v)).abs().max() > 1e-3  # the mask matters
    lay = E.shard_layout(tokens, n, prefix, suffix)
    group = G.Group(["cpu"] * n)
    seen = []

    def kernel(qf, kf, vf, mask=None):
        seen.append((qf.shape, None if mask is None else mask.shape))
        return masked_whole(qf, kf, vf, mask)

    outs, errs = run_ranks(n, lambda r: U.ulysses(group, r, lay, _local(q, lay, r), _local(k, lay, r),
                                                   _local(v, lay, r), kernel, mask=_local(mask, lay, r, 3)))
    assert errs == [None] * n
    for r in range(n):
        assert (outs[r] - _local(ref, lay, r)).abs().max() < 1e-12
    # every kernel call got the whole sequence's mask: its own heads' rows of a per-head mask
    assert all(ms == (b, qs[2] if per_head else 1, 1, L) for qs, ms in seen)


def test_ulysses_refuses_a_mask_that_is_not_a_key_mask():
    """One rank of two (6 of 12 tokens): a mask with a row per query of its own share cannot be split."""
    group = G.Group(["cpu", "cpu"])
    lay = E.shard_layout(12, 2)
    x = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="key mask"):
        U.ulysses(group, 0, lay, x, x, x, masked_whole, mask=torch.zeros(1, 1, 6, 6))


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kw):
    """ComfyUI's attention_pytorch, reduced: ``[B, L, H*D]`` (or ``[B, H, L, D]`` with skip_reshape) and its mask
    rules (2-D: ``[Lq, Lk]``, 3-D: ``[B, Lq, Lk]``, 4-D as SDPA takes it)."""
    if skip_reshape:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:
        b, lq, _ = q.shape
        q, k, v = (t.view(b, t.shape[1], heads, -1) for t in (q, k, v))
    comfy_attention.masks.append(None if mask is None else tuple(mask.shape))
    if mask is not None:
        mask = mask.unsqueeze(0) if mask.ndim == 2 else mask
        mask = mask.unsqueeze(1) if mask.ndim == 3 else mask
    o = masked_whole(q, k, v, mask)
    if skip_output_reshape:
        return o.transpose(1, 2)
    return o.reshape(o.shape[0], o.shape[1], -1)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("shape", ["2d", "3d", "4d-heads"])
def test_the_attention_override_hands_the_kernel_the_whole_key_mask_as_the_model_shaped_it(n, shape):
    g = torch.Generator().manual_seed(n)
    b, heads, d, text, tokens = 1, 3, 8, 7, 26
    L = text + tokens
    q, k, v = (torch.randn(b, L, heads * d, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(L, dtype=torch.float64)
    pad[text - 3:text] = -torch.finfo(torch.float64).max  # a padded prompt: its last 3 tokens masked
    mask = {"2d": pad.view(1, L), "3d": pad.view(1, 1, L),
            "4d-heads": pad.view(1, 1, 1, L).repeat(1, heads, 1, 1) + torch.randn(1, heads, 1, L, generator=g)}[shape]
    comfy_attention.masks = []
    ref = comfy_attention(q, k, v, heads, mask=mask)
    lay = E.shard_layout(tokens, n, text)
    group = G.Group(["cpu"] * n)
    hook = CPN.ContextParallelAttention()
    dim = mask.ndim - 1

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, prefix=text)
        return hook(comfy_attention, _local(q, lay, r), _local(k, lay, r), _local(v, lay, r), heads,
                    mask=_local(mask, lay, r, dim), transformer_options={C.CP_KEY: ctx})

    comfy_attention.masks = []
    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    for r in range(n):
        assert (outs[r] - _local(ref, lay, r)).abs().max() < 1e-12
    heads_of = [c for _, c in G.split(heads, n) if c]
    want = {"2d": [(1, L)] * len(heads_of), "3d": [(1, 1, L)] * len(heads_of),
            "4d-heads": [(1, c, 1, L) for c in heads_of]}[shape]
    assert sorted(comfy_attention.masks) == sorted(want)


def test_a_mask_over_the_queries_of_the_split_sequence_is_refused():
    group = G.Group(["cpu"] * 2)
    ctx = C.RankContext(group, 0, None)
    assert ctx.start(10, prefix=4)
    x = torch.randn(1, 9, 8)
    with pytest.raises(ValueError, match=r"^Context Parallel: a mask of shape .* in an attention call over a split sequence"):
        CPN.ContextParallelAttention()(comfy_attention, x, x, x, 2, mask=torch.zeros(1, 9, 9),
                                        transformer_options={C.CP_KEY: ctx})


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("ends", [True, False])
def test_modulation_ranges_on_a_shard_cover_the_same_tokens(n, ends):
    text, tokens = 9, 30
    full = text + tokens if ends else tokens
    dims = [(0, 16, 0), (16, None, 1)]  # "v2 (replace)": the first frame's tokens, then the rest
    labels = torch.full((full,), -1)
    for s, e, i in dims:
        labels[s:e] = i
    group = G.Group(["cpu"] * n)
    got = []
    for r in range(n):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, prefix=text)
        mine = torch.full((ctx.layout.local_len(r) if ends else ctx.rows()[1],), -1)
        for s, e, i in HY.HunyuanVideoUnit.local_ranges(dims, ctx, ends):
            mine[s:e] = i
        got.append(mine)
        assert torch.equal(mine, ctx.shard(labels, 0, ends=ends))
    if not ends:
        assert torch.equal(torch.cat(got), labels)


# ---------------------------------------------------------------- the family's configurations

# the zoo's configurations (HunyuanVideo with a latent of 3x3x5 tokens: uneven shares on 2 and 4 ranks); the text is
# held whole and attended to inside the joint sequence, never as a sequence of its own, so no share is too short
CASES = {
    "HunyuanVideo": dict(latent=(1, 16, 3, 6, 10)),  # padded prompt: a key mask on the positive's forwards
    "HunyuanVideoI2V": {},
    "HunyuanVideoSkyreelsI2V": {},
    "HunyuanVideo15": {},  # ByT5 glyph and SigLIP image tokens before the text
    "HunyuanVideo15_SR_Distilled": {},
    "HunyuanImage21": dict(forwards=1),  # 2-D, ByT5 after the text; the conds batched in one forward
    "HunyuanImage21Refiner": dict(forwards=1),
}


def _blocks(z, cls, case):
    dm = z.build(cls, case).model.diffusion_model
    return len(dm.double_blocks) + len(dm.single_blocks)


def _masked_calls(mod):
    """Count the exchanged calls that carried a key mask (patched onto RankContext for the test)."""
    seen = []
    real = mod.parallel.context.RankContext.attention

    def counting(self, q, k, v, local, mask=None, **kw):
        if mask is not None:
            seen.append((self.rank, tuple(mask.shape)))
        return real(self, q, k, v, local, mask, **kw)

    return seen, real, counting


@pytest.mark.comfyui
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_split_forward_gives_the_one_device_latent(zoo, name, n):
    z, mod, mappings = zoo
    cls, case = _case(z, name)
    latent = CASES[name].get("latent")
    if latent is not None:
        case = z.with_(case, latent=latent)
    seen, real, counting = _masked_calls(mod)
    mod.parallel.context.RankContext.attention = counting
    try:
        exchanged = check_split(zoo, name, n, case=case)
    finally:
        mod.parallel.context.RankContext.attention = real
    # every block's joint attention once per rank per forward; the positive and the negative run as two forwards
    # where their conds differ in keys (a mask, glyph tokens), else as one batch
    assert exchanged == n * _blocks(z, cls, case) * CASES[name].get("forwards", 2) * case.steps
    masked = any("attention_mask" in ex for _, ex in case.positive)
    assert sorted({r for r, _ in seen}) == (list(range(n)) if masked else [])
    assert len(seen) == (exchanged // 2 if masked else 0)


def _hunyuan_case(z, gpu, **positive_extras):
    """The zoo's HunyuanVideo text-to-video case with ``positive_extras`` on the positive prompt only (what
    HunyuanImageToVideo's "v2 (replace)" and "custom" guidance set)."""
    import comfy.supported_models as sm

    case = z.BUILDERS["HunyuanVideo"](sm.HunyuanVideo, gpu)
    (ctx, ex), = case.positive
    return sm.HunyuanVideo, z.with_(case, positive=[[ctx, {**ex, **positive_extras}]])


def _v2_replace(z, gpu=False):
    """"v2 (replace)": the guiding frame's timestep modulates the first latent frame's tokens (modulation ranges over
    the image in double blocks, over text + image in single blocks)."""
    return _hunyuan_case(z, gpu, guiding_frame_index=0)


def _custom(z, gpu=False):
    """"custom": the start image's latent as ``ref_latent``, one latent frame's tokens before the video's."""
    g = torch.Generator().manual_seed(3)
    hw = 16 if gpu else 8
    return _hunyuan_case(z, gpu, ref_latent=torch.randn(1, 16, 1, hw, hw, generator=g))


def _v15_t2v(z, gpu=False):
    """HunyuanVideo 1.5 text to video with a padded prompt and no glyph or image tokens: model_base passes the mask."""
    import comfy.supported_models as sm
    from zoo.core import Case
    from zoo.video import _hunyuan15, _text_mask

    cls = sm.HunyuanVideo15
    g = torch.Generator().manual_seed(4)
    n = 128 if gpu else 8
    pos = [[torch.randn(1, n, 32, generator=g), {"pooled_output": None, "attention_mask": _text_mask(n, 3)}]]
    neg = [[torch.zeros(1, n, 32), {"pooled_output": None}]]
    latent = (1, 32, 3, 8, 8) if gpu else (1, 32, 3, 4, 3)
    return cls, Case(unet_config=_hunyuan15(gpu, cls), latent=latent, positive=pos, negative=neg,
                     init_std=0.05 if gpu else 0.1)


VARIANTS = {"v2 (replace)": _v2_replace, "custom": _custom, "1.5 text to video": _v15_t2v}


@pytest.mark.comfyui
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_guidance_variants_split_to_the_one_device_latent(zoo, variant, n):
    z, mod, mappings = zoo
    cls, case = VARIANTS[variant](z)
    seen, real, counting = _masked_calls(mod)
    mod.parallel.context.RankContext.attention = counting
    try:
        exchanged = check_split(zoo, cls.__name__, n, case=case)
    finally:
        mod.parallel.context.RankContext.attention = real
    assert exchanged == n * _blocks(z, cls, case) * 2 * case.steps
    assert len(seen) == exchanged // 2  # the positive's forwards carry the padded prompt's mask


@pytest.mark.comfyui
@pytest.mark.parametrize("depths", [(0, 2), (2, 0)], ids=["single-blocks-only", "double-blocks-only"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_model_with_one_kind_of_block_splits_and_gathers_at_its_own_ends(zoo, depths, n):
    """The split starts at the first block and gathers at the last whatever their kind: single blocks alone (the text
    and image already one sequence at the start) or double blocks alone (the image gathered without the text)."""
    z, mod, mappings = zoo
    cls, case = _case(z, "HunyuanVideo")
    case = z.with_(case, unet_config={**case.unet_config, "depth": depths[0], "depth_single_blocks": depths[1]})
    assert _blocks(z, cls, case) == 2
    assert check_split(zoo, "HunyuanVideo", n, case=case) == n * 2 * 2 * case.steps


@pytest.mark.comfyui
def test_the_padded_prompt_mask_matters(zoo):
    """The split's check means something: the same sampling with the positive's mask dropped moves the latent far
    beyond the tolerance the split is held to."""
    z, mod, mappings = zoo
    cls, case = _case(z, "HunyuanVideo")
    (ctx, ex), = case.positive
    base = z.build(cls, case)
    unmasked = z.with_(case, positive=[[ctx, {k: v for k, v in ex.items() if k != "attention_mask"}]])
    assert rel_l1(z.sample(base, unmasked), z.sample(base, case)) > 1e-3


@pytest.mark.comfyui
@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_in_either_order(zoo, order):
    z, mod, mappings = zoo
    cls, case = _case(z, "HunyuanVideo")
    base = z.build(cls, case)
    ref = z.sample(base, case)
    n = 3
    m, ov = split_under_patch(mod, base, n, order)
    assert ov.previous is None
    seen, real, counting = _masked_calls(mod)
    mod.parallel.context.RankContext.attention = counting
    try:
        out = z.sample(m, case)
    finally:
        mod.parallel.context.RankContext.attention = real
    assert rel_l1(out, ref) < 1e-5
    assert sorted({r for r, _ in seen}) == list(range(n))
    # every rank ran on the chosen kernel in its own lane: the text refiner's 2 calls whole, and its share of the heads
    # of the 2 blocks' joint attention (2 heads on 3 ranks: the third rank holds none and calls no kernel there)
    lanes = ov.lanes()
    assert len(lanes) == n
    calls = sorted(sum(ln.config.stats.calls.values()) for ln in lanes)
    per_forward_refiner, per_forward_blocks, forwards = 2, 2, 2 * case.steps
    assert calls == sorted([forwards * per_forward_refiner] + [forwards * (per_forward_refiner + per_forward_blocks)] * 2)
    assert all(set(ln.config.stats.calls) == {"sdpa_math"} for ln in lanes)


@pytest.mark.comfyui
def test_a_model_patch_on_the_joint_attention_keeps_the_forward_on_one_gpu_and_says_so_once(zoo):
    from conftest import capture

    z, mod, mappings = zoo
    cls, case = _case(z, "HunyuanVideo")
    seen = []

    def attn1_patch(q, k, v, pe=None, attn_mask=None, extra_options=None):  # sees the joint sequence: must see it all
        seen.append(q.shape[2])
        return {}

    with capture("patch_attention") as recs:
        check_split(zoo, "HunyuanVideo", 2, whole={2}, case=z.with_(case, patch=lambda m: _with_patch(m, attn1_patch)))
    said = [r.getMessage() for r in recs if "ran on one GPU" in r.getMessage()]
    assert said == ["Context Parallel: a forward of HunyuanVideo 1.0/1.5 ran on one GPU: a model patch (attn1_patch) "
                    "that needs the whole sequence"]
    assert seen and set(seen) == {8 + 32}  # the text and the latent's 2x4x4 tokens, in every call


def _with_patch(m, fn):
    m = m.clone()
    m.set_model_attn1_patch(fn)
    return m


@pytest.mark.comfyui
def test_a_model_with_a_unit_finds_this_one(zoo):
    z, mod, mappings = zoo
    for name in CASES:
        cls, case = _case(z, name)
        unit = mod.parallel.families.unit_for(z.build(cls, case).model.diffusion_model)
        assert unit is not None and unit.name == "HunyuanVideo 1.0/1.5", name
