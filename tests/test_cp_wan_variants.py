"""Context parallelism for the Wan 2.1/2.2 variants (parallel/families/wan_variants.py) on the CPU: N = 2, 3 and 4 ranks
against the same model on one device, within fp32 rounding.

The zoo's Wan variants, with more blocks where the model works on the tokens between blocks (VACE's hints after its
mapped blocks, S2V's and WanDancer's audio injection, Animate's face adapter), so that the work between blocks happens
on split forwards and not only after the last block; and latents with more frames where a GPU's share would otherwise be
as long as the text.  Also: a VACE forward's VACE blocks share out their attention by heads (the exchange every GPU
takes part in), Patch Attention as the local kernel, the modulation of S2V and Wan 2.2 (per segment, per frame) split
as each block spreads it, a model patch that keeps the forward whole, and the variants without a unit.
"""

from __future__ import annotations

import importlib

import pytest
import test_context_parallel
import torch
from test_context_parallel import _split, calls_under_patch, check_split, counting_exchanges, rel_l1, run_ranks, whole

zoo = test_context_parallel.zoo  # the fixture: ComfyUI with the zoo's families and the pack loaded

pytestmark = pytest.mark.comfyui


def _face_motion(dm, g):
    """Animate's motion encoder is a 512x512 conv stack (10 s a frame on a CPU); it runs before the blocks, the same
    on every GPU: here a fixed projection of the face frames' pooled pixels gives its 512 motion features."""
    proj = torch.randn(3 * 4 * 4, 512, generator=g) * 0.1

    def get_motion(img):
        return torch.nn.functional.adaptive_avg_pool2d(img, 4).flatten(1) @ proj.to(img.dtype)

    dm.motion_encoder.get_motion = get_motion


# name -> (zoo configuration, latent frames h w text tokens for the builder (None: the zoo's), changes to the tiny
# config, extra conditioning, whole: rank counts whose share equals the text, so forwards run whole)
CASES = {
    "vace": ("WAN21_Vace", None, dict(num_layers=4, vace_layers=2), {}, ()),
    "vace-two-streams": ("WAN21_Vace", None, dict(num_layers=3, vace_layers=3), "two", ()),
    "camera": ("WAN21_Camera", (3, 8, 8, 8), {}, {}, ()),
    "camera-2.2": ("WAN22_Camera", (3, 8, 8, 8), {}, {}, ()),
    "scail": ("WAN21_SCAIL", None, {}, {}, ()),
    "scail2": ("WAN21_SCAIL2", None, {}, {}, ()),
    "s2v": ("WAN22_S2V", None, dict(num_layers=3, audio_inject_layers=[0, 1]), {}, ()),
    "wandancer": ("WAN22_WanDancer", (3, 8, 8, 8), dict(num_layers=3, audio_inject_layers=[0, 1]), {}, ()),
    "animate-face": ("WAN22_Animate", None, dict(num_layers=5), "face", ()),
    "humo": ("WAN21_HuMo", (2, 6, 8, 8), dict(num_layers=2), {}, ()),
    # 16 tokens a frame: not over 3 GPUs (a GPU takes the same rows of every frame)
    "humo-16": ("WAN21_HuMo", None, {}, {}, (3,)),
}


def variant_case(zoo, key, monkeypatch):
    """(configuration name, Case) of ``CASES[key]``."""
    z, _, _ = zoo
    import comfy.supported_models as sm
    from zoo import video

    name, sizes, config, extras, _ = CASES[key]
    if sizes is not None:
        monkeypatch.setattr(video, "_wan_sizes", lambda gpu: sizes)
    case = z.BUILDERS[name](getattr(sm, name), False)
    case = z.with_(case, unet_config={**case.unet_config, **config})
    cond, ex = case.positive[0]
    ex = dict(ex)
    if extras == "two":  # two VACE control streams, the second at half strength
        ex.update(vace_frames=ex["vace_frames"] * 2, vace_mask=ex["vace_mask"] * 2, vace_strength=[1.0, 0.5])
    elif extras == "face":  # a face video: the face adapter runs after block 0
        t = case.latent[2]
        g = torch.Generator().manual_seed(1)
        ex["face_video_pixels"] = torch.rand(1, 3, 4 * (t - 1), 16, 16, generator=g) * 2 - 1
        case = z.with_(case, init=_face_motion)
    case = z.with_(case, positive=[[cond, ex]])
    return name, case


@pytest.mark.parametrize("key", list(CASES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_split_variant_gives_the_one_device_latent(zoo, key, n, monkeypatch):
    z, mod, _ = zoo
    import comfy.supported_models as sm

    name, case = variant_case(zoo, key, monkeypatch)
    dm = z.build(getattr(sm, name), case).model.diffusion_model
    unit = mod.parallel.families.unit_for(dm)
    assert unit is not None and unit.__module__.endswith("wan_variants"), type(dm).__name__
    exchanged = check_split(zoo, name, n, case=case, whole=CASES[key][4])
    if n in CASES[key][4]:
        return
    blocks = len(dm.blocks)
    if key.startswith("vace"):
        # every block's self-attention, and every VACE block's for each control stream (shared out by heads)
        streams = len(case.positive[0][1]["vace_frames"])
        blocks += streams * len(dm.vace_blocks)
    assert exchanged == n * blocks * case.steps


# ---------------------------------------------------------------- what the units rely on


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_paused_forward_shares_whole_attention_out_by_heads(n):
    """Between blocks (RankContext.pause), an attention call over the whole sequence that every rank holds alike is
    computed once over the ranks, each its heads, and every rank gets all of it; resume() brings the split back."""
    from pack import load

    P = load()
    G = importlib.import_module(P.__name__ + ".parallel.group")
    C = importlib.import_module(P.__name__ + ".parallel.context")
    g = torch.Generator().manual_seed(n)
    b, tokens, heads, d = 2, 23, 5, 8
    q, k, v = (torch.randn(b, tokens, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    ref = whole(q, k, v)
    group = G.Group(["cpu"] * n)
    kernel_heads = []

    def kernel(qf, kf, vf):
        kernel_heads.append(qf.shape[2])
        assert qf.shape[1] == tokens
        return whole(qf, kf, vf)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        assert ctx.start(tokens, others={3})
        local = ctx.rows()[1]
        ctx.pause(tokens)
        assert ctx.exchanges(tokens, tokens) and not ctx.exchanges(local, local)
        out = ctx.attention(q, k, v, kernel)
        ctx.resume()
        assert ctx.exchanges(local, local) and not ctx.exchanges(tokens, tokens)
        ctx.pause()
        assert ctx.layout is None
        return out

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n
    for o in outs:
        assert (o - ref).abs().max() < 1e-12
    assert sorted(kernel_heads) == sorted(c for _, c in G.split(heads, n) if c)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("values", [1, 5, 6, 7, 12, 16, 30, 31])
def test_each_rank_gets_the_modulation_its_tokens_get_in_the_block(zoo, n, values):
    """[B, n, 6, C] modulation (per token, per frame, per S2V segment) as WanAttentionBlock spreads it over the tokens
    (repeat_e): each rank's share equals the rows of the whole spread for its tokens."""
    _, mod, _ = zoo
    from comfy.ldm.wan.model import repeat_e

    W = importlib.import_module(mod.__name__ + ".parallel.families.wan_variants")
    G = importlib.import_module(mod.__name__ + ".parallel.group")
    C = importlib.import_module(mod.__name__ + ".parallel.context")
    tokens = 30
    vec = torch.randn(2, values, 6, 4, generator=torch.Generator().manual_seed(values))
    spread = repeat_e(vec, torch.zeros(2, tokens, 4))
    group = G.Group(["cpu"] * n)

    def rank(r):
        ctx = C.RankContext(group, r, None)
        ctx.start(tokens)
        s0, sc = ctx.rows()
        part = W.modulation_shard(vec, ctx)
        if spread.shape[1] != tokens:  # repeat_e left it whole (it cannot be spread): the block refuses it either way
            return part is vec
        return torch.equal(repeat_e(part, torch.zeros(2, sc, 4)), spread[:, s0:s0 + sc])

    outs, errs = run_ranks(n, rank)
    assert errs == [None] * n and all(outs)


def test_humo_reads_its_frames_from_the_rope_frequencies(zoo, monkeypatch):
    """HuMo's unit gives each GPU the same rows of every latent frame: the frame size comes from the RoPE frequencies
    (the video's frames, then the reference's at the next time); frames it cannot tell apart keep the forward whole."""
    z, mod, _ = zoo
    import comfy.supported_models as sm

    W = importlib.import_module(mod.__name__ + ".parallel.families.wan_variants")
    name, case = variant_case(zoo, "humo", monkeypatch)
    dm = z.build(getattr(sm, name), case).model.diffusion_model

    def freqs(t, h, w, ref=(6, 8), **rope):
        video = dm.rope_encode(t, h, w, transformer_options={"rope_options": rope} if rope else {})
        return torch.cat([video, dm.rope_encode(1, *ref, t_start=t)], 1)

    assert W.HuMoUnit.frame(freqs(3, 6, 8), 2) == (12, "")
    assert W.HuMoUnit.frame(freqs(3, 6, 8), 4) == (12, "")
    assert W.HuMoUnit.frame(freqs(3, 6, 8, scale_t=0.0), 3) == (12, "")  # frames at one time: told apart by place
    assert W.HuMoUnit.frame(freqs(1, 6, 8), 2) == (12, "")
    assert W.HuMoUnit.frame(freqs(3, 6, 8), 5) == (0, "a latent frame's 12 tokens do not divide over 5 GPUs (HuMo's "
                                                       "audio attention works frame by frame)")
    apart = "its latent frames could not be told apart (HuMo's audio attention works frame by frame)"
    assert W.HuMoUnit.frame(freqs(3, 6, 8, ref=(6, 16)), 2) == (0, apart)  # a reference of another size
    assert W.HuMoUnit.frame(freqs(3, 6, 8, shift_x=1.0), 2) == (0, apart)  # shifted video, unshifted reference


# ---------------------------------------------------------------- with Patch Attention, and forwards kept whole


@pytest.mark.parametrize("order", ["patch-then-split", "split-then-patch"])
def test_patch_attention_is_the_local_kernel_of_a_vace_split(zoo, order, monkeypatch):
    z, mod, _ = zoo
    import comfy.supported_models as sm

    name, case = variant_case(zoo, "vace", monkeypatch)
    _, _, calls = calls_under_patch(zoo, z.build(getattr(sm, name), case), case, 2, order)
    # every rank ran its share of every call on the chosen kernel: per forward, 4 blocks and 2 VACE blocks, each a
    # self-attention (its heads over the whole sequence) and a text cross-attention (its tokens, or in a VACE block
    # all of them)
    assert calls == [{"sdpa_math": 2 * 6 * case.steps}] * 2


def test_a_model_patch_keeps_vace_forwards_on_one_gpu_and_says_why_once(zoo, monkeypatch):
    from conftest import capture

    z, mod, _ = zoo
    import comfy.supported_models as sm

    name, case = variant_case(zoo, "vace", monkeypatch)
    base = z.build(getattr(sm, name), case)
    ref = z.sample(base, case)
    seen = []

    def attn2(args):  # an attention-output patch: it sees every block's tokens (the VACE blocks' too)
        seen.append(args["x"].shape[1])
        return args["x"]

    patched = base.clone()
    patched.set_model_attn2_patch(attn2)
    ref_patched = z.sample(patched, case)
    assert torch.equal(ref_patched, ref)
    seen.clear()
    with counting_exchanges(mod) as counts, capture("patch_attention") as recs:
        out = z.sample(_split(mod, patched, 2), case)
    assert rel_l1(out, ref) < 1e-5
    assert counts == [] and set(seen) == {case.latent[2] * 16}  # the patch saw whole sequences only
    said = [r.getMessage() for r in recs if "ran on one GPU" in r.getMessage()]
    assert said == ["Context Parallel: a forward of Wan 2.1 VACE ran on one GPU: a model patch (attn2_patch) that "
                    "needs the whole sequence"]


@pytest.mark.parametrize("name", ["WAN_Animate2", "WAN21_CausalAR_T2V"])
def test_variants_without_a_unit_sample_on_one_gpu_and_say_so(zoo, name):
    from conftest import capture

    z, mod, _ = zoo
    import comfy.supported_models as sm

    cls = getattr(sm, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this ComfyUI")
    case = z.BUILDERS[name](cls, False)
    base = z.build(cls, case)
    if mod.parallel.families.unit_for(base.model.diffusion_model) is not None:
        pytest.skip(f"{name} has a unit")
    ref = z.sample(base, case)
    m = _split(mod, base, 2)
    with capture("patch_attention") as recs:
        out = z.sample(m, case)
    assert torch.equal(out, ref)
    said = [r.getMessage() for r in recs if "Context Parallel" in r.getMessage()]
    assert len(said) == 1 and type(base.model.diffusion_model).__name__ in said[0] and "one GPU" in said[0]
