"""Zoo builders: video. Wan 2.1/2.2 and their variants, HunyuanVideo 1.0/1.5, LTX-Video and LTX-2, Mochi, Cosmos 1 and
Predict2, Kandinsky 5, CogVideoX, MiniMax H3.

Each builder gives the configuration's tiny sizes and the conditioning its ComfyUI node sends (named in the builder's
docstring). CPU sizes: 1 block (5 where a branch needs them), width 64, 2 heads of 32, 2-3 latent frames of 4x4-8x8.
GPU sizes: the family's real head dim (128 for Wan, HunyuanVideo, Mochi, Cosmos, Kandinsky 5 Pro, MiniMax H3 and LTX-2's
video; 64 for LTX-Video, LTX-2's audio and CogVideoX) and at least 128 query and key tokens (text too) where the
family allows.
"""

from __future__ import annotations

import torch

from .core import Case, family


def _rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _std(gpu, cpu=0.1):
    """Weights ~ N(0, std): large enough that attention moves the final latent (scaling every attention output by 0.9
    moves it by more than 1e-3 rel-L1, so the zoo's 1e-4 equality means something), small enough to stay unsaturated.
    The GPU sizes are 4x wider, so half the std."""
    return cpu / 2 if gpu else cpu


def _case(gpu, **kw):
    """A Case with this module's weight scale unless the builder names one."""
    kw.setdefault("init_std", _std(gpu))
    return Case(**kw)


def _text_mask(tokens, pad):
    """A padded prompt's mask as ComfyUI's text encoders return it (int64, 1 = token), ``pad`` tokens off at the end."""
    m = torch.ones(1, tokens, dtype=torch.long)
    m[:, tokens - pad:] = 0
    return m


def _clip_vision(g, tokens=257, width=1280):
    """A CLIP-vision output as CLIPVisionEncode gives it (Wan reads ``penultimate_hidden_states``, HunyuanVideo 1.5
    ``last_hidden_state``)."""
    import comfy.clip_vision

    out = comfy.clip_vision.Output()
    out.penultimate_hidden_states = _rand(g, 1, tokens, width)
    out.last_hidden_state = _rand(g, 1, tokens, width)
    out.image_embeds = _rand(g, 1, width)
    return out


def _i2v_extras(g, t, h, w, channels=16, mask=True):
    """WanImageToVideo and its kin: the start image's latent over every frame and a mask that keeps the first frame."""
    ex = {"concat_latent_image": _rand(g, 1, channels, t, h, w)}
    if mask:
        m = torch.ones(1, 1, t, h, w)
        m[:, :, :1] = 0.0
        ex["concat_mask"] = m
    return ex


# --- sampling as the workflow samples ------------------------------------------------------------------------------

def _outer_sample(patcher, key, **args):
    """A clone whose sampling runs with ``args`` (``seed``, ``latent_shapes``) in place of CFGGuider.outer_sample's."""
    import comfy.patcher_extension as pe

    def wrapper(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
                seed=None, **kwargs):
        seed = args.get("seed", seed)
        kwargs.update({k: v for k, v in args.items() if k != "seed"})
        return executor(noise, latent_image, sampler, sigmas, denoise_mask, callback, disable_pbar, seed, **kwargs)

    m = patcher.clone()
    pe.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, key, wrapper, m.model_options, is_model_options=True)
    return m


def _seeded(patcher):
    """The seed a KSampler hands ComfyUI (the zoo's sampling passes none): the AR sampler re-noises from it, MiniMax H3
    and HunyuanVideo 1.5 SR seed their condition noise from it."""
    return _outer_sample(patcher, "zoo_seed", seed=0)


def _packed(*shapes):
    """Audio + video models sample a NestedTensor latent (one stream each): CFGGuider.sample packs the streams flat
    (comfy.utils.pack_latents) and hands the sampler their shapes, from which extra_conds and the model unpack them.
    The zoo's sampling takes one latent shape: this gives the packed shape and a patch whose outer-sample wrapper hands
    ComfyUI the stream shapes, as CFGGuider.sample does for a nested latent (and a seed, as a KSampler does)."""
    import math

    shapes = [torch.Size(s) for s in shapes]
    packed = (shapes[0][0], 1, sum(math.prod(s[1:]) for s in shapes))

    def patch(patcher):
        return _outer_sample(_seeded(patcher), "zoo_av_latent", latent_shapes=shapes)

    return packed, patch


def _ar_video(patcher):
    """What SamplerARVideo hands SamplerCustom: the ``ar_video`` sampler (one latent frame per block, KV cache). It is
    no KSampler name, so a sampler-sample wrapper on the clone runs it in place of the case's KSampler sampler."""
    import comfy.patcher_extension as pe
    import comfy.samplers

    ar = comfy.samplers.ksampler("ar_video", {"num_frame_per_block": 1})

    def run_ar_video(executor, *args, **kwargs):
        return ar.sample(*args, **kwargs)

    m = _seeded(patcher)
    pe.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, "zoo_ar_video", run_ar_video, m.model_options,
                            is_model_options=True)
    return m


# --- Wan 2.1 / 2.2 -------------------------------------------------------------------------------------------------

def _wan(gpu, layers=1, **extra):
    dim = 2 * (128 if gpu else 32)
    cfg = dict(dim=dim, ffn_dim=2 * dim, freq_dim=64, text_dim=64, num_heads=2, num_layers=layers, patch_size=(1, 2, 2))
    cfg.update(extra)
    return cfg


def _wan_sizes(gpu):
    """(latent frames, h, w, text tokens): 2x4x4 = 32 video tokens on the CPU, 2x8x8 = 128 on the GPU (patch 1x2x2)."""
    return (2, 16, 16, 128) if gpu else (2, 8, 8, 8)


def _wan_text(g, tokens):
    """umT5-XXL hidden states (narrowed: the text embedding's input width is not what the kernels see)."""
    return _rand(g, 1, tokens, 64)


def _wan_case(gpu, g, latent, extras, unet_config=None, context=None, **kw):
    """A Wan case: the prompt (``context``, else umT5 states) with ``extras``, the tiny config unless given one."""
    context = _wan_text(g, _wan_sizes(gpu)[3]) if context is None else context
    return _case(gpu, unet_config=unet_config or _wan(gpu), latent=latent, positive=[[context, extras]], **kw)


@family("WAN21_T2V", "WAN21_FlowRVS")
def wan_t2v(cls, gpu):
    """Text to video (EmptyHunyuanLatentVideo, umT5 text); FlowRVS is the same model under IMG_TO_IMG_FLOW."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    return _wan_case(gpu, g, (1, 16, t, h, w), {})


@family("WAN22_T2V")
def wan22_t2v(cls, gpu):
    """Wan 2.2 TI2V 5B: 48-channel latents (Wan22ImageToVideoLatent without a start image)."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    return _wan_case(gpu, g, (1, 48, t, h, w), {}, unet_config=_wan(gpu, in_dim=48))


@family("WAN21_CausalAR_T2V")
def wan_causal_ar(cls, gpu):
    """Causal Forcing, sampled as its workflow does: SamplerARVideo's ``ar_video`` sampler, frame by frame with a KV
    cache, without CFG (distilled; its KV cache holds one batch, CFG's two crash it)."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    return _wan_case(gpu, g, (1, 16, t, h, w), {}, patch=_ar_video, cfg=1.0,
                     outside_hook=("all: comfy/ldm/wan/ar_model.py CausalWanModel.forward_block (the ar_video "
                                   "sampler's path) calls its blocks without transformer_options"))


@family("WAN21_I2V")
def wan_i2v(cls, gpu):
    """WanImageToVideo with a start image and its CLIP-vision output (257 image tokens beside the text)."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {**_i2v_extras(g, t, h, w), "clip_vision_output": _clip_vision(g)}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex)


@family("WAN21_FunControl2V")
def wan_fun_control(cls, gpu):
    """WanFunControlToVideo: control video latent + start image latent (32 channels) and CLIP vision."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {"concat_latent_image": _rand(g, 1, 32, t, h, w), "clip_vision_output": _clip_vision(g)}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex)


@family("WAN21_Vace")
def wan_vace(cls, gpu):
    """WanVaceToVideo with a reference image: 32-channel control frames (inactive | reactive) and the 64-channel mask,
    one latent frame longer for the reference."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    t += 1  # the reference image's frame
    mask = torch.ones(1, 64, t, h, w)
    mask[:, :, :1] = 0.0
    ex = {"vace_frames": [_rand(g, 1, 32, t, h, w)], "vace_mask": [mask], "vace_strength": [1.0]}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, vace_layers=1, vace_in_dim=96))


@family("WAN21_Camera", "WAN22_Camera")
def wan_camera(cls, gpu):
    """WanCameraImageToVideo: start image latent + mask, CLIP vision and the camera embedding (WanCameraEmbedding's
    Plücker rays at pixel resolution, 4 frames x 6 channels per latent frame); 2.1 is i2v, 2.2 the Fun t2v layout."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {**_i2v_extras(g, t, h, w), "camera_conditions": _rand(g, 1, 24, t, h * 8, w * 8, scale=0.5),
          "clip_vision_output": _clip_vision(g)}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex)


@family("WAN22_S2V")
def wan_s2v(cls, gpu):
    """WanSoundImageToVideo: wav2vec2 features of all 25 layers (4 audio frames per latent frame), a reference image,
    19 latent frames of reference motion and the (empty) control video."""
    import inspect

    from comfy.ldm.wan.model import WanModel_S2V

    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    audio_dim = 1024 if gpu else 128
    ex = {"audio_embed": _rand(g, 1, 25, audio_dim, t * 4), "reference_latents": [_rand(g, 1, 16, 1, h, w)],
          "reference_motion": _rand(g, 1, 16, 19, h, w), "control_video": torch.zeros(1, 16, t, h, w)}
    # 0.3.64's forward_orig calls its blocks without transformer_options; later releases pass them
    if "transformer_options=transformer_options" in inspect.getsource(WanModel_S2V.forward_orig):
        why = ("some: comfy/ldm/wan/model.py AudioInjector_WAN.forward (the audio injection after each injected "
               "block) calls its cross-attention without transformer_options")
    else:
        why = ("all: comfy/ldm/wan/model.py WanModel_S2V.forward_orig calls its blocks, and AudioInjector_WAN.forward "
               "its cross-attention, without transformer_options")
    cfg = _wan(gpu, audio_dim=audio_dim, num_audio_token=4, audio_inject_layers=[0])
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=cfg, outside_hook=why)


@family("WAN21_HuMo")
def wan_humo(cls, gpu):
    """WanHuMoImageToVideo (the 17B layout, 36 input channels): whisper features per latent frame (8-frame window x 5
    blocks x 1280), a reference image latent, and the audio cross-attention (16 audio tokens per frame)."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {"audio_embed": _rand(g, 1, t, 8, 5, 1280, scale=0.1), "reference_latents": [_rand(g, 1, 16, 1, h, w)]}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, in_dim=36))


@family("WAN22_Animate")
def wan_animate(cls, gpu):
    """WanAnimateToVideo: the reference image as the first latent frame, pose latents and CLIP vision. Without face
    video: its motion encoder (a 512-channel conv stack over 512x512 frames) takes 10 s and more per frame on a CPU,
    beyond the zoo's budget at either size. The face adapter's attention (comfy/ldm/wan/model_animate.py
    FaceBlock.forward, after every 5th block) is called without transformer_options, so it would not reach the hook."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    t += 1  # the reference image's frame
    ex = {"concat_latent_image": _rand(g, 1, 16, t, h, w), "concat_mask": torch.zeros(1, 4, t, h, w),
          "clip_vision_output": _clip_vision(g), "pose_video_latent": _rand(g, 1, 16, t - 1, h, w)}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, in_dim=36),
                     notes="face video left out (its motion encoder is too slow on a CPU); the face adapter's "
                           "attention (FaceBlock.forward) is called without transformer_options")


@family("WAN_Animate2")
def wan_animate2(cls, gpu):
    """WanAnimate2ToVideo: reference latent + video in the concat image, pose latents one frame shorter than the
    latent (the pose branch feeds K/V to the generation branch frame by frame), prompt and CLIP vision for the pose
    branch."""
    g = torch.Generator().manual_seed(0)
    t, h, w, n = _wan_sizes(gpu)
    t += 1  # the reference image's frame
    ctx = _wan_text(g, n)
    mask = torch.ones(1, 1, t, h, w)
    mask[:, :, :1] = 0.0
    cv = _clip_vision(g)
    ex = {"concat_latent_image": _rand(g, 1, 16, t, h, w), "concat_mask": mask, "clip_vision_output": cv,
          "pose_video_latent": _rand(g, 1, 16, t - 1, h, w), "clip_vision_output_pose": cv, "cross_attn_pose": ctx}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, in_dim=36), context=ctx)


@family("WAN21_SCAIL")
def wan_scail(cls, gpu):
    """WanSCAILToVideo: a reference image (its frame before the video), pose latents at half resolution, CLIP vision."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {"reference_latents": [_rand(g, 1, 16, 1, h, w)], "pose_video_latent": _rand(g, 1, 16, t, h // 2, w // 2),
          "clip_vision_output": _clip_vision(g)}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, in_dim=20))


@family("WAN21_SCAIL2")
def wan_scail2(cls, gpu):
    """WanSCAILToVideo for SCAIL-2: as SCAIL plus the 28-channel identity masks of the pose video and of the
    reference, in replacement mode (ref_mask_flag False: reference and pose placed by RoPE shifts)."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    drive = (torch.rand(1, t, 28, h // 2, w // 2, generator=g) > 0.7).float()
    ref_mask = torch.zeros(1, 1 + t, 28, h, w)
    ref_mask[:, 0, 0] = 1.0
    ex = {"reference_latents": [_rand(g, 1, 16, 1, h, w)], "pose_video_latent": _rand(g, 1, 16, t, h // 2, w // 2),
          "clip_vision_output": _clip_vision(g), "driving_mask_28ch": drive, "ref_mask_28ch": ref_mask,
          "ref_mask_flag": False}
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=_wan(gpu, in_dim=20))


@family("WAN22_WanDancer")
def wan_dancer(cls, gpu):
    """WanDancerImageToVideo: start image + mask, CLIP vision of the first frame and of the reference, and the music
    features (35 per audio frame) with their fps."""
    g = torch.Generator().manual_seed(0)
    t, h, w, _ = _wan_sizes(gpu)
    ex = {**_i2v_extras(g, t, h, w), "clip_vision_output": _clip_vision(g), "clip_vision_output_ref": _clip_vision(g),
          "audio_embed": _rand(g, 1, 4 * t * 8, 35), "fps": 30.0, "audio_inject_scale": 1.0}
    music = 256 if gpu else 64  # 4 heads: head dim 64 on the GPU, as the real music encoder
    cfg = _wan(gpu, audio_inject_layers=[0], music_dim=music, music_latent_dim=music)
    return _wan_case(gpu, g, (1, 16, t, h, w), ex, unet_config=cfg,
                     outside_hook=("some: comfy/ldm/wan/model_wandancer.py MusicSelfAttention.forward (the music "
                                   "encoder) and comfy/ldm/wan/model.py AudioInjector_WAN.forward (the music "
                                   "injection) call attention without transformer_options"))


# --- HunyuanVideo 1.0 / 1.5 -----------------------------------------------------------------------------------------

def _hunyuan(gpu, cls, **extra):
    """HunyuanVideo's DiT config (comfy/model_detection.py's keys): only the fields this release's params class has,
    less those the configuration itself fixes (its in_channels, vision_in_dim)."""
    import dataclasses

    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    cfg = dict(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=256 if gpu else 64,
               mlp_ratio=4.0 if gpu else 2.0, num_heads=2, depth=1, depth_single_blocks=1,
               axes_dim=[16, 56, 56] if gpu else [8, 12, 12], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
               guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
               meanflow_sum=False)
    cfg.update(extra)
    names = {f.name for f in dataclasses.fields(HunyuanVideoParams)} - set(cls.unet_config)
    return {k: v for k, v in cfg.items() if k in names}


def _hunyuan_cond(g, gpu, extras=None):
    """TextEncodeHunyuanVideo: llava-llama3 hidden states with their padding mask and CLIP-L's pooled output; the
    empty negative prompt is not padded, so it carries no mask (the text encoder drops an all-ones mask)."""
    n = 128 if gpu else 8
    ex = {"pooled_output": _rand(g, 1, 32), "attention_mask": _text_mask(n, 3), **(extras or {})}
    neg = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) and k != "concat_mask" else v)
           for k, v in ex.items() if k != "attention_mask"}
    return dict(positive=[[_rand(g, 1, n, 32), ex]], negative=[[torch.zeros(1, n, 32), neg]])


@family("HunyuanVideo")
def hunyuan_video(cls, gpu):
    """HunyuanVideo 1.0 text to video: masked llama text (the token refiner and every block take the mask), guidance
    6 (the default of model_base.HunyuanVideo)."""
    g = torch.Generator().manual_seed(0)
    t, h, w = (2, 16, 16) if gpu else (2, 8, 8)
    return _case(gpu, unet_config=_hunyuan(gpu, cls), latent=(1, 16, t, h, w), **_hunyuan_cond(g, gpu))


@family("HunyuanVideoI2V")
def hunyuan_video_i2v(cls, gpu):
    """HunyuanImageToVideo, guidance "v1 (concat)": the start image latent and the mask ride in 33 input channels."""
    g = torch.Generator().manual_seed(0)
    t, h, w = (2, 16, 16) if gpu else (2, 8, 8)
    cond = _hunyuan_cond(g, gpu, _i2v_extras(g, t, h, w))
    return _case(gpu, unet_config=_hunyuan(gpu, cls), latent=(1, 16, t, h, w), **cond)


@family("HunyuanVideoSkyreelsI2V")
def hunyuan_video_skyreels(cls, gpu):
    """SkyReels I2V: the start image latent concatenated (32 input channels), no mask channel."""
    g = torch.Generator().manual_seed(0)
    t, h, w = (2, 16, 16) if gpu else (2, 8, 8)
    cond = _hunyuan_cond(g, gpu, _i2v_extras(g, t, h, w, mask=False))
    return _case(gpu, unet_config=_hunyuan(gpu, cls), latent=(1, 16, t, h, w), **cond)


def _hunyuan15(gpu, cls, **extra):
    return _hunyuan(gpu, cls, in_channels=65, out_channels=32, vec_in_dim=None, patch_size=[1, 1, 1],
                    guidance_embed=False, byt5=True, use_cond_type_embedding=True, **extra)


def _hunyuan15_cond(g, gpu, concat):
    """Qwen2.5-VL text (no pooled output), ByT5 glyph tokens (a quoted word in the prompt), SigLIP vision tokens of the
    start image, the concat latent. No text mask: model_base.HunyuanVideo15 passes one only when it masks something,
    and with ByT5 or vision tokens prepended the model cannot take one (its mask is sized for the text alone)."""
    n = 128 if gpu else 8
    cv = _clip_vision(g, tokens=729 if gpu else 16, width=1152)
    ex = {"pooled_output": None, "conditioning_byt5small": _rand(g, 1, 4, 1472), "clip_vision_output": cv, **concat}
    neg = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) and "mask" not in k else v)
           for k, v in ex.items() if k != "conditioning_byt5small"}
    return dict(positive=[[_rand(g, 1, n, 32), ex]], negative=[[torch.zeros(1, n, 32), neg]])


@family("HunyuanVideo15")
def hunyuan_video15(cls, gpu):
    """HunyuanVideo15ImageToVideo: 32-channel latents, the start image latent and mask (65 input channels), ByT5
    glyph tokens and SigLIP vision tokens before the text, patch 1x1x1."""
    g = torch.Generator().manual_seed(0)
    t, h, w = (2, 8, 8) if gpu else (2, 4, 4)
    concat = {"concat_latent_image": _rand(g, 1, 32, t, h, w), "concat_mask": _i2v_extras(g, t, h, w)["concat_mask"]}
    return _case(gpu, unet_config=_hunyuan15(gpu, cls), latent=(1, 32, t, h, w), **_hunyuan15_cond(g, gpu, concat))


@family("HunyuanVideo15_SR_Distilled")
def hunyuan_video15_sr(cls, gpu):
    """HunyuanVideo15SuperResolution on the distilled SR model: the low-resolution latent in the 66-channel condition
    (98 input channels) with the node's noise augmentation (0.7, seeded from the sampler's seed), meanflow (the next
    sigma's embedding)."""
    g = torch.Generator().manual_seed(0)
    t, h, w = (2, 8, 8) if gpu else (2, 4, 4)
    cond = torch.zeros(1, 66, t, h, w)
    cond[:, 33:65] = _rand(g, 1, 32, t, h, w)
    cond[:, 65] = 1
    concat = {"concat_latent_image": cond, "noise_augmentation": 0.7}
    return _case(gpu, unet_config=_hunyuan15(gpu, cls, meanflow=True), latent=(1, 32, t, h, w), patch=_seeded,
                 **_hunyuan15_cond(g, gpu, concat))


# --- LTX-Video, LTX-2 -----------------------------------------------------------------------------------------------

def _ltxv_guide(t, h, w, strength):
    """LTXVAddGuide with an image at frame 0: one guide latent frame appended after the ``t`` video frames, its
    tokens' pixel coordinates (keyframe_idxs), the denoise mask that holds it at 1 - strength, and the guide's
    attention entry (below strength 1 the model attenuates attention to it through a mask, in two calls per
    self-attention: the video queries and the guide's)."""
    import inspect

    from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, latent_to_pixel_coords

    start_end = "start_end" in inspect.signature(SymmetricPatchifier.__init__).parameters  # 0.33: [start, end] spans
    patchifier = SymmetricPatchifier(1, start_end=True) if start_end else SymmetricPatchifier(1)
    _, coords = patchifier.patchify(torch.zeros(1, 128, 1, h, w))
    keyframe_idxs = latent_to_pixel_coords(coords, (8, 32, 32), causal_fix=True)
    mask = torch.ones(1, 1, t + 1, h, w)
    mask[:, :, t:] = 1.0 - strength
    entry = {"pre_filter_count": h * w, "strength": strength, "pixel_mask": None, "latent_shape": [1, h, w]}
    return {"keyframe_idxs": keyframe_idxs, "concat_mask": mask, "guide_attention_entries": [entry]}


@family("LTXV")
def ltxv(cls, gpu):
    """LTX-Video image to video through LTXVAddGuide (the start image as a guide frame at strength 0.8, appended to
    the latent), T5 text with its padding mask (the blocks' cross-attention takes it), frame rate 25; 128-channel
    latents patchified 1x1x1."""
    g = torch.Generator().manual_seed(0)
    hd = 64 if gpu else 32
    t, h, w, n = (2, 8, 8, 128) if gpu else (2, 4, 4, 8)
    cfg = dict(in_channels=128, attention_head_dim=hd, num_attention_heads=2, cross_attention_dim=2 * hd,
               caption_channels=64, num_layers=1)
    ex = {"attention_mask": _text_mask(n, 3), "frame_rate": 25, **_ltxv_guide(t, h, w, 0.8)}
    # the negative carries the same guide (the node sets it on both); zeroed() would zero its coordinates
    return _case(gpu, unet_config=cfg, latent=(1, 128, t + 1, h, w), positive=[[_rand(g, 1, n, 64), ex]],
                 negative=[[torch.zeros(1, n, 64), dict(ex)]])


@family("LTXAV")
def ltxav(cls, gpu):
    """LTX-2 text to audio + video (the video and audio latents concatenated, as LTXVConcatAVLatent does): a
    128-channel video latent and an 8x16 audio latent sampled as one; Gemma text projected per modality by the model's
    own text connectors (``unprocessed_ltxav_embeds``, as LTX-2's text encoder hands it over); video and audio
    self-attention, text cross-attention and audio<->video cross-attention in every block."""
    g = torch.Generator().manual_seed(0)
    vh, ah = (128, 64) if gpu else (32, 32)
    t, h, w, ta, n = (2, 8, 8, 128, 128) if gpu else (2, 4, 4, 8, 8)
    caption = 64  # the connectors' width: 2 heads x 32
    cfg = dict(in_channels=128, audio_in_channels=128, attention_head_dim=vh, num_attention_heads=2,
               cross_attention_dim=2 * vh, audio_attention_head_dim=ah, audio_num_attention_heads=2,
               audio_cross_attention_dim=2 * ah, caption_channels=caption, num_layers=1,
               connector_attention_head_dim=32, connector_num_attention_heads=2, connector_num_layers=1)
    packed, patch = _packed((1, 128, t, h, w), (1, 8, ta, 16))
    ex = {"unprocessed_ltxav_embeds": True, "frame_rate": 25}
    return _case(gpu, unet_config=cfg, latent=packed, positive=[[_rand(g, 1, n, caption), ex]], patch=patch,
                 outside_hook=("some: comfy/ldm/lightricks/embeddings_connector.py (the text connectors, run once "
                               "per sampling by LTXAVModel.preprocess_text_embeds from model_base.LTXAV.extra_conds) "
                               "calls attention without transformer_options"))


# --- Mochi ----------------------------------------------------------------------------------------------------------

@family("GenmoMochi")
def mochi(cls, gpu):
    """Mochi preview: 12-channel latents, patch 2, T5 text with its padding mask (its token count crops the text in
    the joint attention; the mask pools the text for the timestep embedding)."""
    g = torch.Generator().manual_seed(0)
    hx = 256 if gpu else 64
    # AsymmetricJointBlock asserts the real model's visual MLP width (1536 * 8)
    cfg = dict(depth=1, patch_size=2, num_heads=2, hidden_size_x=hx, hidden_size_y=hx // 2,
               mlp_ratio_x=1536 * 8 / hx, mlp_ratio_y=2.0, learn_sigma=False, in_channels=12, qk_norm=True,
               qkv_bias=False, out_bias=True, attn_drop=0.0, patch_embed_bias=True, posenc_preserve_area=True,
               timestep_mlp_bias=True, attend_to_padding=False, timestep_scale=1000.0, use_t5=True, t5_feat_dim=64,
               t5_token_length=256, rope_theta=10000.0)
    t, h, w, n = (2, 16, 16, 136) if gpu else (2, 8, 8, 8)
    ex = {"attention_mask": _text_mask(n, 3)}
    return _case(gpu, unet_config=cfg, latent=(1, 12, t, h, w), positive=[[_rand(g, 1, n, 64), ex]],
                 outside_hook="some: its text pooling (comfy/ldm/genmo/joint_model/utils.py AttentionPool) calls "
                              "torch's scaled_dot_product_attention itself, not ComfyUI's attention: no override can "
                              "reach it")


# --- Cosmos 1 and Cosmos Predict2 -----------------------------------------------------------------------------------

def _cosmos_text(g, gpu):
    """Cosmos' T5 with its mask (the DiT reads the mask only with use_cross_attn_mask), frame rate 24."""
    n = 128 if gpu else 8
    return [[_rand(g, 1, n, 32), {"attention_mask": _text_mask(n, 3), "frame_rate": 24}]]


@family("CosmosT2V", "CosmosI2V")
def cosmos1(cls, gpu):
    """Cosmos 1 (GeneralDIT, the 7B layout): 3-D RoPE, learnable per-block positions, adaLN-LoRA, a padding-mask
    channel. I2V (17 channels) adds the inverted mask channel (zeros: the zoo samples without a noise mask)."""
    g = torch.Generator().manual_seed(0)
    cfg = dict(max_img_h=240, max_img_w=240, max_frames=128, out_channels=16, patch_spatial=2, patch_temporal=1,
               model_channels=256 if gpu else 64, block_config="FA-CA-MLP", concat_padding_mask=True,
               pos_emb_cls="rope3d", pos_emb_learnable=False, pos_emb_interpolation="crop", block_x_format="THWBD",
               affline_emb_norm=True, use_adaln_lora=True, adaln_lora_dim=32, num_blocks=1, num_heads=2,
               extra_per_block_abs_pos_emb=True, rope_h_extrapolation_ratio=1.0, rope_w_extrapolation_ratio=1.0,
               rope_t_extrapolation_ratio=2.0, extra_per_block_abs_pos_emb_type="learnable", crossattn_emb_channels=32)
    t, h, w = (2, 16, 16) if gpu else (2, 8, 8)
    return _case(gpu, unet_config=cfg, latent=(1, 16, t, h, w), positive=_cosmos_text(g, gpu))


@family("CosmosT2IPredict2", "CosmosI2VPredict2")
def cosmos_predict2(cls, gpu):
    """Cosmos Predict2 (MiniTrainDIT, the 2B layout): text to image (one latent frame) and image to video (17
    channels: the inverted mask channel)."""
    g = torch.Generator().manual_seed(0)
    video = cls.unet_config.get("in_channels") == 17
    rope = 3.0 if video else 4.0
    cfg = dict(max_img_h=240, max_img_w=240, max_frames=128, out_channels=16, patch_spatial=2, patch_temporal=1,
               model_channels=256 if gpu else 64, concat_padding_mask=True, crossattn_emb_channels=32,
               pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
               use_adaln_lora=True, adaln_lora_dim=32, num_blocks=1, num_heads=2, extra_per_block_abs_pos_emb=False,
               rope_h_extrapolation_ratio=rope, rope_w_extrapolation_ratio=rope, rope_t_extrapolation_ratio=1.0,
               extra_h_extrapolation_ratio=1.0, extra_w_extrapolation_ratio=1.0, extra_t_extrapolation_ratio=1.0)
    if video:
        t, h, w = (2, 16, 16) if gpu else (2, 8, 8)
    else:
        t, h, w = (1, 24, 24) if gpu else (1, 8, 8)
    return _case(gpu, unet_config=cfg, latent=(1, 16, t, h, w), positive=_cosmos_text(g, gpu))


# --- Kandinsky 5 ----------------------------------------------------------------------------------------------------

@family("Kandinsky5")
def kandinsky5(cls, gpu):
    """Kandinsky 5 video: Qwen2.5-VL text (refined by the model's own text blocks, 1-D RoPE), CLIP-L pooled into the
    time embedding, the (zero) image and mask concatenated (33 channels, patch 1x2x2), 3-D RoPE."""
    g = torch.Generator().manual_seed(0)
    axes = (32, 48, 48) if gpu else (8, 12, 12)  # head dim 128 (Pro) on the GPU
    md = 2 * sum(axes)
    cfg = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=32, in_text_dim2=32, time_dim=64, model_dim=md,
               ff_dim=2 * md, visual_embed_dim=33 * 4, patch_size=(1, 2, 2), num_text_blocks=1, num_visual_blocks=1,
               axes_dims=axes)
    t, h, w, n = (2, 16, 16, 128) if gpu else (2, 8, 8, 8)
    ex = {"pooled_output": _rand(g, 1, 32), "attention_mask": _text_mask(n, 3)}
    return _case(gpu, unet_config=cfg, latent=(1, 16, t, h, w), positive=[[_rand(g, 1, n, 32), ex]])


# --- CogVideoX ------------------------------------------------------------------------------------------------------

@family("CogVideoX_T2V", "CogVideoX_I2V", "CogVideoX_Inpaint")
def cogvideox(cls, gpu):
    """CogVideoX: joint text + video self-attention (226 T5 tokens in front), 3-D RoPE. T2V in the 5B 1.0 layout
    (2x2 patches); I2V in the 1.5 layout (2x2x2 patches, the OFS embedding, the start image latent in 16 more
    channels); Fun inpaint 48 channels (image and mask latents)."""
    g = torch.Generator().manual_seed(0)
    in_ch = cls.unet_config.get("in_channels", 16)
    cfg = dict(num_attention_heads=2, attention_head_dim=64 if gpu else 32, time_embed_dim=64, num_layers=1,
               text_embed_dim=32, patch_size=2, use_rotary_positional_embeddings=True,
               use_learned_positional_embeddings=False)
    if in_ch != 16:  # the OFS embedding adds to the time embedding: same width
        cfg.update(patch_size_t=2, ofs_embed_dim=64 if in_ch == 32 else None)
    n = 226 if gpu else 8
    t, h, w = (4 if in_ch != 16 else 2, 16, 16) if gpu else (2, 8, 8)
    ex = {"concat_latent_image": _rand(g, 1, in_ch - 16, t, h, w)} if in_ch != 16 else {}
    # its attention output is gated by the time embedding: with smaller weights it leaves no trace in the latent
    return _case(gpu, unet_config=cfg, latent=(1, 16, t, h, w), positive=[[_rand(g, 1, n, 32), ex]], init_std=0.2)


# --- MiniMax H3 -----------------------------------------------------------------------------------------------------

@family("MiniMaxH3")
def minimax_h3(cls, gpu):
    """MiniMax H3 text to audio + video (EmptyMiniMaxH3LatentAV): a 24-channel video latent (patch 1x2x2) and a
    32-channel stereo audio latent sampled as one; text, audio and video packed into one sequence with 3-D RoPE
    (comfy-kitchen's fused RMSNorm + split-half RoPE), one batch per forward."""
    g = torch.Generator().manual_seed(0)
    hidden, hd, rope = (256, 128, 16) if gpu else (64, 32, 4)
    cfg = dict(hidden_size=hidden, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2,
               attention_head_dim=hd, ffn_hidden_size=2 * hidden, latents_dim=24, audio_latents_dim=32,
               patch_size=(1, 2, 2), text_dim=32, timestep_input_dim=256, time_embed_hidden_size=hidden,
               time_embed_dim=hidden // 2, rope_inv_freq_len=rope)
    t, h, w, ta, n = (2, 16, 16, 64, 128) if gpu else (2, 4, 4, 4, 8)
    packed, av = _packed((1, 24, t, h, w), (1, 32, 2, ta))

    def patch(patcher):
        # the RoPE frequencies are a checkpoint buffer (torch.empty until loaded), not a parameter the zoo randomizes
        inv = patcher.model.diffusion_model.rope.inv_freq
        inv.copy_(1.0 / (10000.0 ** (torch.arange(inv.shape[0], dtype=torch.float32) / inv.shape[0])))
        return av(patcher)

    return _case(gpu, unet_config=cfg, latent=packed, positive=[[_rand(g, 1, n, 32), {}]], patch=patch,
                 init_std=_std(gpu, 0.2),
                 outside_hook=("some: comfy/ldm/minimax/model.py MiniMaxH3Model.preprocess_text_embeds (the token "
                               "refiner, run once per sampling from model_base.MiniMaxH3.extra_conds) calls attention "
                               "without transformer_options"))
