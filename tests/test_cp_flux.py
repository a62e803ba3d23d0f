"""Context parallelism for Flux.1 and Flux.2 (parallel/families/flux.py) on the CPU: N = 2, 3 and 4 ranks simulated as
threads, against the same model on one device.

First the shared pieces this family added: a mask over the whole sequence through the exchange (Redux's attention
bias), and a second split of another sequence in the same forward (Flux's single-stream blocks). Then the zoo's Flux
configurations sampled through the Context Parallel node: Kontext's reference latent, Redux's attention-bias mask, Fill's
concatenated inputs, LongCat-Image's text positions, Flux.2's global modulation, padded text and two reference latents;
Patch Attention as the local kernel; the forwards that run whole on one GPU and say why once.
"""

from __future__ import annotations

import importlib

import pytest
import test_context_parallel
import torch
from pack import load
from test_context_parallel import _case, calls_under_patch, check_planned, check_split, rand_qkv, rank_rows, run_ranks
from test_context_parallel import whole as masked_whole

zoo = test_context_parallel.zoo  # the fixture (an import of it would be an unused name that the tests redefine)

P = load()
G = importlib.import_module(P.__name__ + ".parallel.group")
U = importlib.import_module(P.__name__ + ".parallel.ulysses")
E = importlib.import_module(P.__name__ + ".parallel.exchange")
C = importlib.import_module(P.__name__ + ".parallel.context")
F = torch.nn.functional


# ---------------------------------------------------------------- a mask through the exchange


def _mask(kind, b, h, L, g):
    if kind == "bias [L, L]":
        return torch.randn(L, L, generator=g, dtype=torch.float64)
    if kind == "bias [B, L, L]":
        return torch.randn(b, L, L, generator=g, dtype=torch.float64)
    if kind == "bool [B, 1, L, L]":
        m = torch.rand(b, 1, L, L, generator=g) > 0.3
        return m | torch.eye(L, dtype=torch.bool)  # every query attends somewhere
    if kind == "per head [B, H, L, L]":
        return torch.randn(b, h, L, L, generator=g, dtype=torch.float64)
    if kind == "keys [B, 1, 1, L]":
        m = torch.zeros(b, 1, 1, L, dtype=torch.float64)
        m[..., ::3] = float("-inf")
        return m
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["bias [L, L]", "bias [B, L, L]", "bool [B, 1, L, L]", "per head [B, H, L, L]",
                                  "keys [B, 1, 1, L]"])
@pytest.mark.parametrize("n,heads,kv_heads,prefix,suffix,tokens", [
    (2, 4, 4, 6, 0, 19), (3, 5, 5, 0, 3, 20), (4, 8, 2, 3, 2, 33), (4, 3, 3, 7, 0, 21)])
def test_a_mask_over_the_whole_sequence_gives_whole_attention(kind, n, heads, kv_heads, prefix, suffix, tokens):
    g = torch.Generator().manual_seed(n * 10 + heads)
    b, d = 2, 8
    L = prefix + tokens + suffix
    q, k, v = rand_qkv(g, b, L, heads, kv_heads, d)
    mask = _mask(kind, b, heads, L, g)
    ref = masked_whole(q, k, v, mask)
    lay = E.shard_layout(tokens, n, prefix, suffix)
    group = G.Group(["cpu"] * n)

    def local(t, r):
        return rank_rows(t, lay, r)

    seen = []

    def kernel(qf, kf, vf, mask=None):
        m = mask
        seen.append((qf.shape[2], tuple(m.shape)))
        return masked_whole(qf, kf, vf, m)

    outs, errs = run_ranks(n, lambda r: U.ulysses(group, r, lay, local(q, r), local(k, r), local(v, r), kernel, mask))
    assert errs == [None] * n
    for r in range(n):
        assert (outs[r] - local(ref, r)).abs().max() < 1e-12
    # a mask per head reached each kernel cut to its heads; any other mask whole
    for h, shape in seen:
        assert shape == ((b, h, L, L) if kind.startswith("per head") else tuple(mask.shape))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_mask_made_for_one_share_is_refused_on_every_rank(n):
    tokens, prefix = 17, 4
    lay = E.shard_layout(tokens, n, prefix)
    group = G.Group(["cpu"] * n)

    def rank(r):
        x = torch.randn(1, lay.local_len(r), 2, 4)
        m = torch.zeros(1, lay.local_len(r), lay.local_len(r))
        return U.ulysses(group, r, lay, x, x, x, lambda *a: pytest.fail("the kernel ran"), m)

    _, errs = run_ranks(n, rank)
    for r, e in enumerate(errs):
        assert isinstance(e, ValueError)
        n_r, full = lay.local_len(r), prefix + tokens
        assert str(e) == (f"a mask of shape (1, {n_r}, {n_r}) in an attention call over a split sequence ({n_r} keys on "
                          f"this GPU, {full} in all, 2 heads): only a key mask [..., 1, {n_r}] or a mask over the whole "
                          f"sequence [..., {full} or 1, {full}] can be split")


# ---------------------------------------------------------------- a second split in one forward

@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_forward_splits_its_text_and_image_then_the_joined_sequence(n):
    txt, img = 5, 13
    group = G.Group(["cpu"] * n)
    g = torch.Generator().manual_seed(n)
    text, image = torch.randn(2, txt, 3, generator=g), torch.randn(2, img, 3, generator=g)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(img, prefix=txt)
        part = ctx.shard(image, ends=False)
        assert part.shape[1] == ctx.rows()[1] and ctx.layout.local_len(r) == txt + part.shape[1]
        joined = torch.cat([text, ctx.gather(part, ends=False)], 1)
        assert ctx.layout is None
        ctx.resplit(txt + img)
        s0, sc = ctx.rows()
        assert ctx.layout.local_len(r) == sc and (s0, sc) == G.split(txt + img, n)[r]
        return ctx.gather(ctx.shard(joined))

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    assert all(torch.equal(o, torch.cat([text, image], 1)) for o in outs)


def test_a_resplit_that_a_share_could_not_be_told_apart_in_raises():
    group = G.Group(["cpu"] * 2)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(12, others={5})  # shares of 6
        ctx.resplit(10)  # shares of 5: as long as the other sequence

    _, errs = run_ranks(2, rank)
    assert all(isinstance(e, ValueError) and "(5 tokens)" in str(e) for e in errs)


def test_a_resplit_needs_a_split_forward():
    ctx = C.RankContext(G.Group(["cpu"]), 0, None)
    with pytest.raises(RuntimeError, match="resplit in a forward that does not split"):
        ctx.resplit(10)


# ---------------------------------------------------------------- the zoo's Flux models

# Flux has no attention call besides the joint one (no cross-attention), so a rank's share may be as short as it comes:
# no configuration here falls back for its length.
CASES = {
    # Kontext: 9x12 latent (padded to 10x12): 30 image tokens + 16 reference tokens, 8 text; shares uneven for 3 and 4
    "Flux": dict(latent=(1, 16, 9, 12)),
    # schnell + Redux in attn_bias mode: 12 text tokens (8 + 4 Redux), 16 image tokens, a float mask over all 28
    "FluxSchnell": {},
    # Fill: the masked image and the packed pixel mask concatenated (96 input channels)
    "FluxInpaint": {},
    # LongCat-Image: text positions on two rope axes, no pooled vector
    "LongCatImage": dict(latent=(1, 16, 10, 14)),
    # Flux.2: global modulation, text padded to 512 tokens, 16 image + 24 reference tokens (two references)
    "Flux2": {},
}


def _blocks(z, name):
    cls, case = _case(z, name)
    dm = z.build(cls, case).model.diffusion_model
    return len(dm.double_blocks) + len(dm.single_blocks)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_split_flux_forward_gives_the_one_device_latent(zoo, name, n):
    z, mod, mappings = zoo
    exchanged = check_split(zoo, name, n, CASES[name].get("latent"))
    _, case = _case(z, name)
    # one joint attention call per block per forward on every rank (the conds of a step are one batch)
    assert exchanged == n * _blocks(z, name) * case.steps


@pytest.mark.comfyui
@pytest.mark.parametrize("name", ["Flux", "FluxSchnell", "Flux2"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_an_exchange_run_from_its_plan_gives_the_latent_of_copies_made_one_by_one(zoo, name, n, monkeypatch):
    """Every exchange of a split Flux forward (joint attention heads first, Redux's mask, the gathers) run from its
    plan of 2-D copies, as on CUDA GPUs (here over CPU memory): the latent of the exchange copy by copy, bit for bit."""
    z, mod, mappings = zoo
    cls, case = _case(z, name)
    if CASES[name].get("latent") is not None:
        case = z.with_(case, latent=CASES[name]["latent"])
    check_planned(zoo, cls, case, n, monkeypatch)


@pytest.mark.comfyui
@pytest.mark.parametrize("depth,single", [(0, 2), (2, 0), (2, 3)])
def test_a_split_flux_with_either_stage_alone_or_several_blocks_of_each(zoo, depth, single):
    """The decision taken at the first single block when there is no double block; the gather at the last double block
    when there is no single block; blocks between the first and the last."""
    z, mod, mappings = zoo
    _, case = _case(z, "Flux")
    case = z.with_(case, unet_config={**case.unet_config, "depth": depth, "depth_single_blocks": single})
    assert check_split(zoo, "Flux", 3, case=case) == 3 * (depth + single) * case.steps


@pytest.mark.comfyui
@pytest.mark.parametrize("name", ["Flux", "FluxSchnell"])
@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_of_a_split_flux(zoo, order, name):
    z, mod, mappings = zoo
    cls, case = _case(z, name)
    _, _, calls = calls_under_patch(zoo, z.build(cls, case), case, 3, order)
    # every rank ran every block's joint attention (text and all image tokens, its share of the heads: 2 heads over 3
    # GPUs, so one rank holds none and calls no kernel) on the chosen kernel, in its own lane
    assert [c for c in calls if c] == [{"sdpa_math": _blocks(z, name) * case.steps}] * 2


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_flux_forward_with_a_controlnet_runs_on_one_gpu(zoo, n):
    import comfy.supported_models as sm

    z, mod, mappings = zoo
    config, builder = z.VARIANTS["Flux+ControlNet"]
    assert check_split(zoo, config, n, case=builder(getattr(sm, config), False), whole={n}) == 0


@pytest.mark.comfyui
@pytest.mark.parametrize("why", ["index_timestep_zero", "attn1_output_patch"])
def test_a_flux_forward_that_cannot_split_runs_whole_and_says_why_once(zoo, why):
    from conftest import capture

    z, mod, mappings = zoo
    if why == "index_timestep_zero":  # Flux.2 (as Klein: no guidance input) with its references at timestep zero
        name = "Flux2"
        _, case = _case(z, name)
        pos = [[c, {**extras, "reference_latents_method": why}] for c, extras in case.positive]
        case = z.with_(case, positive=pos, unet_config={**case.unet_config, "guidance_embed": False})
        reason = "reference latents on the index_timestep_zero method"
    else:  # a patch inside the blocks, here one that changes nothing
        name = "Flux"
        _, case = _case(z, name)

        def patched(m):
            m = m.clone()
            m.set_model_attn1_output_patch(lambda attn, extra: attn)
            return m

        case = z.with_(case, patch=patched)
        reason = "a model patch (attn1_output_patch) that needs the whole sequence"
    with capture("patch_attention") as recs:
        assert check_split(zoo, name, 2, case=case, whole={2}) == 0
    said = [r.getMessage() for r in recs if reason in r.getMessage()]
    assert said == [f"Context Parallel: a forward of Flux.1/Flux.2 ran on one GPU: {reason}" + said[0].split(reason)[1]]
