"""Context parallelism for Qwen-Image and Mage-Flow (parallel/families/qwen_image.py) on 2, 3 and 4 CPU ranks.

First the key-mask exchange the unit needs (a text padding mask over a joint text+image sequence): parallel/ulysses.py
against whole masked attention in fp64, and a mask that differs by query refused with its shape.  Then tiny ComfyUI
models of every Qwen-Image configuration the zoo builds (text to image, Qwen-Image-Edit's reference methods, 2511's
zero timestep for the references, Layered's frames) and Mage-Flow, sampled through the Context Parallel node against
the same model on one device: the final latent within fp32 rounding, every block's joint attention exchanged on every
rank.  Three blocks, so that the blocks between the first and the last carry shards.
"""

from __future__ import annotations

import importlib

import pytest
import test_context_parallel
import torch
from test_context_parallel import (
    C,
    E,
    G,
    U,
    _case,
    calls_under_patch,
    check_planned,
    check_split,
    rand_qkv,
    rank_rows,
    rel_l1,
    run_ranks,
)
from test_context_parallel import whole as whole_masked

F = torch.nn.functional
zoo = test_context_parallel.zoo  # the fixture: ComfyUI, the zoo and the pack


# ---------------------------------------------------------------- the key mask through the exchange


@pytest.mark.parametrize("n,heads,kv_heads,prefix,suffix,tokens,shape", [
    (2, 4, 4, 6, 0, 21, "b1l"), (3, 5, 5, 4, 0, 17, "1l"), (4, 8, 2, 3, 2, 33, "bh1l"), (4, 3, 3, 0, 5, 14, "b11l"),
    (3, 2, 2, 7, 0, 12, "bh1l"), (2, 6, 3, 5, 0, 9, "b1l")])
def test_a_key_mask_goes_with_the_keys(n, heads, kv_heads, prefix, suffix, tokens, shape):
    g = torch.Generator().manual_seed(n * 10 + heads)
    b, d = 2, 8
    L = prefix + tokens + suffix
    q, k, v = rand_qkv(g, b, L, heads, kv_heads, d)
    dims = {"b1l": (b, 1, L), "1l": (1, L), "bh1l": (b, heads, 1, L), "b11l": (b, 1, 1, L)}[shape]
    # padding keys masked out (a large negative number, as Qwen-Image's text mask), and a small bias on every key, so
    # a column out of place shows
    mask = torch.randn(dims, generator=g, dtype=torch.float64) * 0.5
    mask[..., 1::3] = -torch.finfo(torch.float64).max
    ref = whole_masked(q, k, v, mask)
    lay = E.shard_layout(tokens, n, prefix, suffix)
    group = G.Group(["cpu"] * n)

    def local(t, r, dim=1):
        return rank_rows(t, lay, r, dim)

    seen = []

    def kernel(qf, kf, vf, mask=None):
        mf = mask
        seen.append((qf.shape[2], tuple(mf.shape)))
        return whole_masked(qf, kf, vf, mf)

    outs, errs = run_ranks(n, lambda r: U.ulysses(group, r, lay, local(q, r), local(k, r), local(v, r), kernel,
                                                  local(mask, r, mask.ndim - 1)))
    assert errs == [None] * n
    for r in range(n):
        assert (outs[r] - local(ref, r)).abs().max() < 1e-12
    # each kernel got the mask over the whole sequence, with its own heads where the mask has a head dimension
    for h_local, mshape in seen:
        assert mshape[-1] == L and mshape[-2] == 1
        if shape == "bh1l":
            assert mshape[1] == h_local


def test_a_mask_that_differs_by_query_is_refused_with_its_shape():
    """A rank holding 8 of 16 tokens: a mask with a row per query of its own share is neither a key mask nor the
    model's mask over the whole sequence."""
    assert U.mask_problem(torch.zeros(1, 8, 8), 8, 16, 2) == (
        "a mask of shape (1, 8, 8) in an attention call over a split sequence (8 keys on this GPU, 16 in all, 2 heads): "
        "only a key mask [..., 1, 8] or a mask over the whole sequence [..., 16 or 1, 16] can be split")
    assert U.mask_problem(torch.zeros(1, 1, 8), 8, 16, 2) is None
    assert U.mask_problem(torch.zeros(1, 16, 16), 8, 16, 2) is None
    assert U.mask_problem(torch.zeros(1, 3, 1, 8), 8, 16, 2) is not None  # 3 heads of a mask for 2


def test_the_hook_passes_a_key_mask_on_and_refuses_one_over_other_keys():
    """Through the Context Parallel attention hook (one rank, its shard the whole sequence): a ``[B, 1, L]`` key mask
    reaches the kernel as ComfyUI's function would get it; a mask over other keys is refused with its shape."""
    cp = importlib.import_module(test_context_parallel.P.__name__ + ".nodes.context_parallel")
    ctx = C.RankContext(G.Group(["cpu"]), 0, None)
    assert ctx.start(6, prefix=2)
    topts = {C.CP_KEY: ctx}
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2 * 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(1, 1, 8, dtype=torch.float64)
    mask[..., :2] = -torch.finfo(torch.float64).max  # the first two keys (text padding) masked out
    got = []

    def func(q, k, v, heads, mask=None, **kw):
        got.append(mask)
        return whole_masked(*(t.view(1, 8, heads, -1) for t in (q, k, v)), mask).reshape(1, 8, -1)

    hook = cp.ContextParallelAttention()
    out = hook(func, q, k, v, 2, mask=mask, transformer_options=topts)
    assert ctx.exchanged == 1 and got[0].shape == (1, 1, 8)
    assert torch.allclose(out, whole_masked(*(t.view(1, 8, 2, 4) for t in (q, k, v)), mask).reshape(1, 8, -1))
    with pytest.raises(ValueError, match=r"^Context Parallel: a mask of shape \(1, 8, 5\) in an attention call over "
                                         r"a split sequence \(8 keys on this GPU, 8 in all, 2 heads\): only a key mask"):
        hook(func, q, k, v, 2, mask=torch.zeros(1, 8, 5), transformer_options=topts)


# ---------------------------------------------------------------- Qwen-Image and Mage-Flow models

def _text_mask(n: int, valid: int) -> torch.Tensor:
    m = torch.zeros(1, n, dtype=torch.long)
    m[:, :valid] = 1
    return m


def _qwen_case(z, config: str):
    """A configuration of Qwen-Image (or Mage-Flow) with three blocks; 8 text tokens, the last 3 padding."""
    name = "MageFlow" if config == "mage-flow" else "QwenImage"
    _, case = _case(z, name)
    cfg = dict(case.unet_config, num_layers=3)
    ctx, extras = case.positive[0]
    g = torch.Generator().manual_seed(5)
    if config == "mage-flow":  # 6x6 latent pixels (1x1 patches) and the zoo's 4x4 reference: 52 image tokens
        return name, z.with_(case, unet_config=cfg, latent=(1, 128, 6, 6))
    if config == "edit-2511":  # 16 latent tokens + 16 + 8 of two references on timestep zero
        return name, z.with_(case, unet_config=cfg)
    cfg.pop("default_ref_method", None)
    if config == "t2i":  # 36 image tokens, no reference
        return name, z.with_(case, unet_config=cfg, latent=(1, 16, 1, 12, 12),
                             positive=[[ctx, {"attention_mask": extras["attention_mask"]}]])
    if config == "layered":  # Qwen-Image-Layered: 3 frames of 16 tokens, one reference at a negative index
        cfg.update(use_additional_t_cond=True, default_ref_method="negative_index")
        ref = torch.randn(1, 16, 1, 8, 8, generator=g)
        return name, z.with_(case, unet_config=cfg, latent=(1, 16, 3, 8, 8),
                             positive=[[ctx, {"attention_mask": extras["attention_mask"], "reference_latents": [ref]}]])
    # Qwen-Image-Edit (and 2509) as its reference methods place the references: 16 latent tokens + 16 + 8
    method = config.split("-", 1)[1]
    return name, z.with_(case, unet_config=cfg, positive=[[ctx, {**extras, "reference_latents_method": method}]])


CONFIGS = ["t2i", "edit-index", "edit-offset", "edit-2511", "layered", "mage-flow"]


@pytest.mark.comfyui
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_split_forward_gives_the_one_device_latent(zoo, config, n):
    z, mod, _ = zoo
    name, case = _qwen_case(z, config)
    exchanged = check_split(zoo, name, n, case=case)
    # one joint attention call per block per forward (the conds of a step are one batch: one forward per step)
    assert exchanged == n * 3 * case.steps


@pytest.mark.comfyui
@pytest.mark.parametrize("config", ["t2i", "edit-2511"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_exchanges_run_from_their_plan_give_the_latent_of_copies_made_one_by_one(zoo, config, n, monkeypatch):
    """Qwen-Image's joint attention heads first, its text mask travelling with the keys, each exchange from its plan."""
    import comfy.supported_models as sm

    z, _, _ = zoo
    name, case = _qwen_case(z, config)
    check_planned(zoo, getattr(sm, name), case, n, monkeypatch)


@pytest.mark.comfyui
def test_the_text_mask_and_the_references_zero_timestep_change_the_latent(zoo):
    """What the split must carry shows in the latent: without the text mask, or with every reference token on the
    latent's timestep, the one-device latent is not the same (so a split that dropped either would fail above)."""
    z, _, _ = zoo
    name, case = _qwen_case(z, "edit-2511")
    import comfy.supported_models as sm

    cls = getattr(sm, name)
    ref = z.sample(z.build(cls, case), case)
    ctx, extras = case.positive[0]
    unmasked = z.with_(case, positive=[[ctx, {k: v for k, v in extras.items() if k != "attention_mask"}]])
    one_timestep = z.with_(case, positive=[[ctx, {**extras, "reference_latents_method": "index"}]])
    for other in (unmasked, one_timestep):
        assert rel_l1(z.sample(z.build(cls, other), other), ref) > 1e-3


@pytest.mark.comfyui
@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_in_either_order(zoo, order):
    z, mod, _ = zoo
    name, case = _qwen_case(z, "edit-2511")
    import comfy.supported_models as sm

    _, _, lanes = calls_under_patch(zoo, z.build(getattr(sm, name), case), case, 3, order)
    # every rank ran its share of the heads (2 heads on 3 ranks: one rank has none) on the chosen kernel, with the
    # whole sequence's text mask: 3 blocks x 2 steps each
    calls = sorted(c.get("sdpa_math", 0) for c in lanes)
    assert calls[-2:] == [3 * case.steps, 3 * case.steps] and sum(calls) == 2 * 3 * case.steps


def _double_block_patch(args):
    """A model patch after every block that needs the whole image sequence (as DiffSynth's ControlNet patch adds its
    hint to the image tokens): here, the tokens scaled by their position."""
    img = args["img"]
    ramp = torch.linspace(0.95, 1.05, img.shape[1], dtype=img.dtype, device=img.device)
    return {"img": img * ramp[None, :, None], "txt": args["txt"]}


def _pass_through_block(args, extra):
    """Another node's block-replace patch that runs the block unchanged."""
    return extra["original_block"](args)


def _said(recs, text: str) -> list:
    return [r.getMessage() for r in recs if text in r.getMessage()]


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 4])
def test_a_model_patch_over_the_whole_sequence_runs_on_one_gpu_and_says_why_once(zoo, n):
    from conftest import capture

    z, _, _ = zoo
    name, case = _qwen_case(z, "edit-2511")

    def add_patch(m):
        m = m.clone()
        m.set_model_double_block_patch(_double_block_patch)
        return m

    with capture("patch_attention") as recs:
        check_split(zoo, name, n, case=z.with_(case, patch=add_patch), whole={n})
    said = _said(recs, "a model patch (double_block) that needs the whole sequence")
    assert len(said) == 1 and "a forward of Qwen-Image ran on one GPU" in said[0]


@pytest.mark.comfyui
@pytest.mark.parametrize("config,splits", [("edit-2511", False), ("edit-index", True)])
def test_another_block_patch_under_the_split(zoo, config, splits):
    """Another node's block-replace patch runs under the unit's, on each rank's share; with the references on their own
    timestep the unit cannot reach the block's boundary through it: that forward runs on one GPU, said once."""
    from conftest import capture

    z, _, _ = zoo
    name, case = _qwen_case(z, config)

    def add_patch(m):
        m = m.clone()
        for i in range(3):
            m.set_model_patch_replace(_pass_through_block, "dit", "double_block", i)
        return m

    with capture("patch_attention") as recs:
        check_split(zoo, name, 3, case=z.with_(case, patch=add_patch), whole=() if splits else {3})
    said = _said(recs, "index_timestep_zero")
    assert len(said) == (0 if splits else 1)


@pytest.mark.comfyui
def test_both_units_are_found_by_their_classes(zoo):
    _, mod, _ = zoo
    families = importlib.import_module(mod.__name__ + ".parallel.families")
    assert ("Qwen-Image", ("QwenImageTransformer2DModel",)) in families.supported()
    assert ("Mage-Flow", ("MageFlowTransformer2DModel",)) in families.supported()
