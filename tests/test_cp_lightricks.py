"""Context parallelism for LTX-Video and LTX-2 on the CPU (2, 3 and 4 simulated ranks against the one-device latent).

LTX-Video: image to video through a guide frame at strength 0.8 (its attention attenuated through ComfyUI's guide
mask, per-token timesteps from the denoise mask), text to video, a sequence that does not divide evenly by the ranks
(the guide frame's rows start inside a rank's share), cross-attention AdaLN with split RoPE and a guide at strength 1,
and a dense self-attention mask; LTX-2: text to audio + video, and a guide frame with per-frame (compressed)
timesteps.  Every configuration has 2 blocks, so split tokens go from block to block.
"""

from __future__ import annotations

import pytest
import test_context_parallel
import torch
from test_context_parallel import _case, _split, calls_under_patch, check_split, rel_l1

zoo = test_context_parallel.zoo  # the fixture: ComfyUI 0.33+, the zoo and the pack

pytestmark = pytest.mark.comfyui

NS = [2, 3, 4]


def _text(g, n=8, width=64):
    from zoo.video import _rand, _text_mask

    return _rand(g, 1, n, width), {"attention_mask": _text_mask(n, 3), "frame_rate": 25}


def _ltxv_config(**over):
    cfg = dict(in_channels=128, attention_head_dim=32, num_attention_heads=2, cross_attention_dim=64,
               caption_channels=64, num_layers=2)
    return {**cfg, **over}


def ltxv_case(z, t=2, h=4, w=4, strength=0.8, **over):
    """LTX-Video with a guide frame (``strength`` None: text to video, no guide)."""
    from zoo.video import _ltxv_guide

    g = torch.Generator().manual_seed(0)
    ctx, ex = _text(g)
    frames = t
    if strength is not None:
        ex.update(_ltxv_guide(t, h, w, strength))
        frames = t + 1
    return z.Case(unet_config=_ltxv_config(**over), latent=(1, 128, frames, h, w), positive=[[ctx, ex]],
                  negative=[[torch.zeros_like(ctx), dict(ex)]], init_std=0.1)


def ltxav_case(z, t=3, h=4, w=4, ta=10, strength=None):
    """LTX-2: audio + video (as the zoo's LTXAV builder), with a guide frame when ``strength`` is given (its denoise
    mask packed as the sampler packs a nested latent's)."""
    from zoo.video import _ltxv_guide, _packed, _rand

    g = torch.Generator().manual_seed(0)
    cfg = dict(in_channels=128, audio_in_channels=128, attention_head_dim=32, num_attention_heads=2,
               cross_attention_dim=64, audio_attention_head_dim=32, audio_num_attention_heads=2,
               audio_cross_attention_dim=64, caption_channels=64, num_layers=2, connector_attention_head_dim=32,
               connector_num_attention_heads=2, connector_num_layers=1)
    ex = {"unprocessed_ltxav_embeds": True, "frame_rate": 25}
    frames = t
    if strength is not None:
        guide = _ltxv_guide(t, h, w, strength)
        frames = t + 1
        video_mask = guide.pop("concat_mask").expand(1, 128, frames, h, w)
        audio_mask = torch.ones(1, 8, ta, 16)
        guide["concat_mask"] = torch.cat([video_mask.reshape(1, 1, -1), audio_mask.reshape(1, 1, -1)], -1)
        ex.update(guide)
    latent, patch = _packed((1, 128, frames, h, w), (1, 8, ta, 16))
    ctx = _rand(g, 1, 8, 64)
    return z.Case(unet_config=cfg, latent=latent, positive=[[ctx, ex]], negative=[[torch.zeros_like(ctx), dict(ex)]],
                  patch=patch, init_std=0.1)


# name: (configuration, case maker, ranks whose forwards run whole)
CASES = {
    "guide": ("LTXV", lambda z: ltxv_case(z), ()),
    "text-to-video": ("LTXV", lambda z: ltxv_case(z, t=3, strength=None), ()),
    "uneven": ("LTXV", lambda z: ltxv_case(z, h=5, w=3), ()),  # 45 tokens: 23/22, 15 each, 12/11/11/11
    "adaln-split-rope": ("LTXV", lambda z: ltxv_case(z, strength=1.0, cross_attention_adaln=True, rope_type="split",
                                                     use_keyframes_abs_pos_embedding=True), ()),
    "zoo": ("LTXV", None, ()),
    "av": ("LTXAV", lambda z: ltxav_case(z), ()),
    "av-guide": ("LTXAV", lambda z: ltxav_case(z, t=2, h=5, w=3, strength=0.8), ()),  # per-frame timesteps: 15 a frame
    "av-zoo": ("LTXAV", None, {4}),  # 32 video tokens: 8 a rank on 4, as long as the text
}


def _build(zoo, key):
    z, mod, mappings = zoo
    name, make, whole = CASES[key]
    return name, (make(z) if make is not None else _case(z, name)[1]), whole


@pytest.mark.parametrize("key", list(CASES))
@pytest.mark.parametrize("n", NS)
def test_a_split_forward_gives_the_one_device_latent(zoo, key, n):
    z, mod, mappings = zoo
    name, case, whole = _build(zoo, key)
    exchanged = check_split(zoo, name, n, whole=whole, case=case)
    if n not in whole:  # one self-attention per block per forward (the conds of a step are one batch)
        import comfy.supported_models as sm

        blocks = len(z.build(getattr(sm, name), case).model.diffusion_model.transformer_blocks)
        assert exchanged == n * blocks * case.steps


def test_the_guide_mask_reaches_the_exchange_and_matters(zoo, monkeypatch):
    """The guide mask is set on every rank as ComfyUI partitions it (the video's rows, then the guide's), and the
    split without it would not give the one-device latent."""
    z, mod, mappings = zoo
    C = mod.parallel.context.RankContext
    seen = []
    real = C.set_masks

    def record(self, masks):
        seen.append(masks)
        real(self, masks)

    monkeypatch.setattr(C, "set_masks", record)
    check_split(zoo, "LTXV", 2, case=ltxv_case(z))
    parts = [[(a, b, tuple(m.shape)) for a, b, m in ms.parts] for ms in seen]
    assert parts and all(p == [(0, 32, (1, 1, 1, 48)), (32, 48, (1, 1, 16, 48))] for p in parts)

    monkeypatch.setattr(C, "set_masks", lambda self, masks: real(self, None))
    with pytest.raises(AssertionError, match="rel_l1"):
        check_split(zoo, "LTXV", 2, case=ltxv_case(z))


def test_the_guide_rows_reach_the_kernel_as_comfyui_makes_them(zoo):
    """Under the split, the override below it gets the guide's two masked calls per self-attention as ComfyUI's own
    partition makes them on one GPU (the video's rows and the guide's, full precision asked for, over every key), on
    a share of the heads."""
    z, mod, mappings = zoo
    import comfy.supported_models as sm

    case = ltxv_case(z)
    calls = []

    def recorder(func, *args, **kwargs):
        q, k, heads = args[0], args[1], args[3]
        mask = kwargs.get("mask")
        calls.append((q.shape[1], k.shape[1], heads, None if mask is None else tuple(mask.shape),
                      kwargs.get("low_precision_attention", True)))
        return func(*args, **kwargs)

    base = z.build(sm.LTXV, case)
    whole = base.clone()
    whole.model_options["transformer_options"]["optimized_attention_override"] = recorder
    z.sample(whole, case)
    one_gpu = set(calls)
    calls.clear()
    z.sample(_split(mod, whole, 2), case)
    split = set(calls)
    guide = {(32, 48, 2, (1, 1, 1, 48), False), (16, 48, 2, (1, 1, 16, 48), False)}
    assert guide <= one_gpu
    # on the ranks: the same two calls with one head each, and no other masked call but the text's (8 keys)
    assert {c for c in split if c[3] is not None and c[1] != 8} == {(a, b, 1, m, lp) for a, b, _, m, lp in guide}


def _with_self_mask(z, mask):
    """LTX-Video with ``mask`` (a function of the token count, the same mask on every call) as the blocks'
    self-attention mask in place of the guide's, as a model patch of the diffusion model would pass it."""
    case = ltxv_case(z, strength=None, t=3)
    plain = z.build

    def build(cls, c):
        base = plain(cls, c)
        dm = base.model.diffusion_model
        dm._build_guide_self_attention_mask = lambda x, topts, args: mask(x.shape[1]).to(x.dtype)
        return base

    return case, build


@pytest.mark.parametrize("n", NS)
def test_a_dense_self_attention_mask_is_split_with_the_forward(zoo, n, monkeypatch):
    z, mod, mappings = zoo
    case, build = _with_self_mask(z, lambda L: -3.0 * torch.rand(1, 1, L, L, generator=torch.Generator().manual_seed(5)))
    monkeypatch.setattr(z, "build", build)
    check_split(zoo, "LTXV", n, case=case)


def test_a_mask_it_cannot_take_apart_runs_whole_and_says_why_once(zoo, monkeypatch):
    """A per-head self-attention mask: the forward runs on the first GPU, the latent as on one GPU, the reason said
    once for the run."""
    from conftest import capture

    z, mod, mappings = zoo
    case, build = _with_self_mask(z, lambda L: -3.0 * torch.rand(1, 2, L, L, generator=torch.Generator().manual_seed(6)))
    monkeypatch.setattr(z, "build", build)
    with capture("patch_attention") as recs:
        check_split(zoo, "LTXV", 3, case=case, whole={3})
    said = [r.getMessage() for r in recs if "ran on one GPU" in r.getMessage()]
    assert len(said) == 1, said
    assert "LTX-Video" in said[0] and "self-attention mask (Tensor)" in said[0]


@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_in_either_order(zoo, order):
    """Patch Attention under the split serves every rank's share, the guide's masked rows included."""
    z, mod, mappings = zoo
    import comfy.supported_models as sm

    case = ltxv_case(z)
    _, _, calls = calls_under_patch(zoo, z.build(sm.LTXV, case), case, 2, order)
    # per rank and block: self-attention in two calls (the video's rows and the guide's, each with its mask) over
    # the whole sequence and the rank's head, and cross-attention to the text
    assert calls == [{"sdpa_math": 3 * 2 * case.steps}] * 2


@pytest.mark.parametrize("n", NS)
def test_ltx2_audio_gets_every_gpus_video(zoo, n, monkeypatch):
    """LTX-2: the video-to-audio attention's keys and values come from every rank (one gathered call per block per
    forward on every rank), and the audio stream comes out as on one device, as the video does."""
    z, mod, mappings = zoo
    import comfy.supported_models as sm

    case = ltxav_case(z, t=2, h=5, w=3, strength=0.8)
    base = z.build(sm.LTXAV, case)
    ref = z.sample(base, case)
    C = mod.parallel.context.RankContext
    gathered = []
    real = C.keys

    def count(self, k, v, dim=1):
        gathered.append(self.rank)
        return real(self, k, v, dim)

    monkeypatch.setattr(C, "keys", count)
    out = z.sample(_split(mod, base, n), case)
    video = 128 * 3 * 5 * 3
    for part in (slice(0, video), slice(video, None)):  # the packed latent: video, then audio
        assert rel_l1(out[..., part], ref[..., part]) < 1e-5
    blocks = len(base.model.diffusion_model.transformer_blocks)
    assert sorted(gathered) == sorted(list(range(n)) * blocks * case.steps)


def test_ltx2_per_frame_timesteps_are_split_by_frame_where_they_can(zoo):
    """A rank whose share starts and ends on frame boundaries keeps the per-frame timesteps compressed; another gets
    its tokens' rows."""
    z, mod, mappings = zoo
    from comfy.ldm.lightricks.av_model import CompressedTimestep

    fam = mod.parallel.families.lightricks
    G = mod.parallel.group
    data = torch.randn(2, 4, 6)  # 4 frames of 5 tokens
    ts = CompressedTimestep(data, 5, per_frame=True)
    full = ts.expand()
    for n, compressed in ((2, {0, 1}), (3, set())):  # 10/10 tokens; 7/7/6
        group = G.Group(["cpu"] * n)
        for r in range(n):
            ctx = mod.parallel.context.RankContext(group, r, None)
            ctx.layout = mod.parallel.exchange.shard_layout(20, n)
            part = fam._shard_timestep(ts, ctx)
            s0, sc = ctx.rows()
            assert torch.equal(part.expand(), full[:, s0:s0 + sc])
            assert (part.patches_per_frame == 5) == (r in compressed)
    one = CompressedTimestep(torch.randn(2, 1, 6), 5)  # one timestep for every token: kept as it is
    assert fam._shard_timestep(one, ctx) is one
