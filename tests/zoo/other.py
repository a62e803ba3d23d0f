"""Zoo builders: audio (Stable Audio, ACE-Step, MiniMax Music), 3D (Hunyuan3D, TripoSplat, TRELLIS.2), SeedVR2, and the
non-diffusion configurations ComfyUI lists beside them (RT-DETR, SAM 3, Depth Anything 3).

Sizes: ``gpu=False`` a few tokens, 1-3 layers, 2 heads where the family allows (fp32 CPU); ``gpu=True`` the family's
real head dims and >= 128 query and key tokens. Conditioning is what the family's nodes send (see each builder's
docstring). Weights: norm scales near 1 (``norm_init``) and ``init_std`` chosen per family and size so that attention
shapes the result: doubling q moves the final latent by 10-85 %, zeroing v by 10-110 % (fp32, both sizes), so a kernel
that gets a call wrong cannot hide under the zoo's tolerance.
"""

from __future__ import annotations

import torch

from .core import Case, family, unbuilt


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


# ---------------------------------------------------------------- Stable Audio (comfy/ldm/audio/dit.py)

def _rotary_sd(dim_heads: int) -> dict:
    """The rotary frequencies a Stable Audio checkpoint carries (dit.py RotaryEmbedding leaves the buffer empty)."""
    dim = max(dim_heads // 2, 32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return {"model.diffusion_model.transformer.rotary_pos_emb.inv_freq": inv_freq}


def _number_conditioner_sd(prefix: str, max_val: int, features_type: str = "learned") -> dict:
    """The weights StableAudio's get_model loads for a seconds embedder (random; the zoo redraws every parameter)."""
    from comfy.ldm.audio.embedders import NumberConditioner

    kw = {} if features_type == "learned" else {"fourier_features_type": features_type}
    sd = NumberConditioner(768, min_val=0, max_val=max_val, **kw).state_dict()
    return {f"{prefix}{k}": v for k, v in sd.items()}


@family("StableAudio")
def stable_audio(cls, gpu):
    """Stable Audio Open 1.0: prepend global conditioning, T5 text (768) + seconds_start/seconds_total embeddings as
    cross-attention context (ConditioningStableAudio's extras). As in the real model the context is not projected
    (``project_cond_tokens`` off), so at a 1536-wide model the cross-attention has half as many KV heads as query
    heads (GQA, ``enable_gqa``): GPU 24 heads of 64 (the real ones) over 12 KV heads, CPU 48 heads of 32 over 24.
    One layer, its feed-forward at width x1 (not x4) to keep the sample cheap."""
    heads = 24 if gpu else 48
    tokens, text = (128, 128) if gpu else (16, 8)
    cfg = dict(embed_dim=1536, num_heads=heads, depth=1, project_cond_tokens=False, io_channels=64, cond_token_dim=768,
               global_cond_dim=1536, input_concat_dim=0, ff_kwargs={"mult": 1})
    sd = {**_number_conditioner_sd("conditioner.conditioners.seconds_start.", 512),
          **_number_conditioner_sd("conditioner.conditioners.seconds_total.", 512), **_rotary_sd(1536 // heads)}
    positive = [[_randn(1, text, 768, seed=1), {"seconds_start": 0.0, "seconds_total": 10.0}]]
    return Case(unet_config=cfg, latent=(1, 64, tokens), positive=positive, state_dict=sd, init_std=0.03, norm_init=0.1,
                cfg=4.0)


@family("StableAudio3")
def stable_audio3(cls, gpu):
    """Stable Audio 3: adaLN with the shared global-conditioning embedder, RMS norms, RMS q/k norms, differential
    attention (two attention calls per layer sharing V), memory tokens, the inpainting mask + latent as local additive
    conditioning, T5Gemma text (768) padded to 256 tokens with the learned padding embedding + the seconds_total token
    as context. GPU: 24 heads of 64 over a 768-wide context: 12 KV heads (GQA), the feed-forward at x1; CPU: 2 heads
    of 32, the context projected to the model width."""
    if gpu:
        cfg = dict(embed_dim=1536, num_heads=24, depth=1, project_cond_tokens=False, ff_kwargs={"mult": 1})
        tokens, text = 128, 128
    else:
        cfg = dict(embed_dim=64, num_heads=2, depth=1, project_cond_tokens=True)
        tokens, text = 16, 8
    channels = 256
    cfg.update(io_channels=channels, cond_token_dim=768, global_cond_dim=768, input_concat_dim=0,
               global_cond_shared_embed=True, global_cond_type="adaLN", timestep_features_type="expo",
               norm_type="rms_norm", attn_kwargs={"qk_norm": "rms", "differential": True},
               local_add_cond_dim=channels + 1, num_memory_tokens=2)
    sd = {**_number_conditioner_sd("conditioner.conditioners.seconds_total.", 384, "expo"),
          **_rotary_sd(cfg["embed_dim"] // cfg["num_heads"])}
    sd["conditioner.conditioners.prompt.padding_embedding"] = torch.zeros(768)
    positive = [[_randn(1, text, 768, seed=1), {"seconds_total": 10.0}]]
    return Case(unet_config=cfg, latent=(1, channels, tokens), positive=positive, state_dict=sd,
                init_std=0.03 if gpu else 0.1, norm_init=0.1, cfg=4.0)


# ---------------------------------------------------------------- ACE-Step (comfy/ldm/ace/)

@family("ACEStep")
def ace_step(cls, gpu):
    """ACE-Step 1.0: UMT5 text (768) and lyric token ids (TextEncodeAceStepAudio's ``conditioning_lyrics``); the model
    prepends a speaker token and the lyric encoder's output to the text, the DiT cross-attends to all of it. The lyric
    encoder (a 6-block, 1024-wide Conformer with its own attention, not ComfyUI's) has fixed sizes. GPU: heads of 128
    (the real head dim), 128 latent frames, 128 text tokens."""
    heads, head_dim = (2, 128) if gpu else (2, 32)
    frames, text, lyrics = (128, 128, 16) if gpu else (16, 8, 6)
    cfg = dict(in_channels=8, out_channels=8, num_layers=1, num_attention_heads=heads, attention_head_dim=head_dim,
               mlp_ratio=2.5, patch_size=[16, 1], max_height=16, max_width=32768, max_position=32768,
               rope_theta=1000000.0, speaker_embedding_dim=512, text_embedding_dim=768, lyric_hidden_size=1024,
               ssl_encoder_depths=[1, 1], ssl_latent_dims=[32, 32])
    lyric_ids = torch.randint(3, 6000, (1, lyrics), generator=_g(2))
    positive = [[_randn(1, text, 768, seed=1), {"conditioning_lyrics": lyric_ids}]]
    return Case(unet_config=cfg, latent=(1, 8, 16, frames), positive=positive, init_std=0.06 if gpu else 0.1,
                norm_init=0.1, cfg=5.0)


@family("ACEStep15")
def ace_step15(cls, gpu):
    """ACE-Step 1.5: Qwen3 text embeddings (1024) and lyric embeddings (``conditioning_lyrics``, 1024) and the LM's
    audio codes (TextEncodeAceStepAudio1.5's defaults generate them); reference audio: the built-in silence latent.
    GQA throughout (2 query heads per KV head), sliding-window self-attention on even layers (an additive bias).
    Every attention call (comfy/ldm/ace/ace_step15.py AceStepAttention.forward) is made without transformer_options."""
    if gpu:
        size = dict(hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, encoder_hidden_size=256,
                    encoder_num_heads=2, intermediate_size=512, encoder_intermediate_size=512, sliding_window=64)
        frames, text, lyrics = 260, 64, 64
    else:
        size = dict(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, encoder_hidden_size=64,
                    encoder_num_heads=2, intermediate_size=128, encoder_intermediate_size=128, sliding_window=4)
        frames, text, lyrics = 20, 8, 6
    cfg = dict(size, in_channels=192, text_hidden_dim=1024, timbre_hidden_dim=64, audio_acoustic_hidden_dim=64,
               num_dit_layers=2, num_lyric_layers=1, num_timbre_layers=1, num_tokenizer_layers=1, patch_size=2,
               pool_window_size=5, fsq_dim=size["encoder_hidden_size"])
    codes = torch.randint(0, 64000, (frames // 5,), generator=_g(3)).tolist()
    extras = {"conditioning_lyrics": _randn(1, lyrics, 1024, seed=2), "audio_codes": [codes]}
    return Case(unet_config=cfg, latent=(1, 64, frames), positive=[[_randn(1, text, 1024, seed=1), extras]],
                outside_hook="all: comfy/ldm/ace/ace_step15.py AceStepAttention.forward calls optimized_attention "
                             "without transformer_options (AceStepConditionGenerationModel.forward drops them)",
                init_std=0.1, norm_init=0.1, cfg=2.0)


unbuilt("MiniMaxMusic3", "comfy/ldm/minimax_music/dit.py fixes its DiT's sizes in code (36 layers, 2048 wide, "
                         "~2.4B parameters) whatever the config says: no small instance can be built in a test. Its "
                         "attention (dit.py Attention.forward: optimized_attention_for_device(), no "
                         "transformer_options) would not reach the hook anyway.")


# ---------------------------------------------------------------- Hunyuan3D (comfy/ldm/hunyuan3d, hunyuan3dv2_1)

def _hunyuan3d_case(cfg, gpu, init_std, outside="", extra=None):
    """Hunyuan3DConditioning: DINOv2 image tokens as context (1370 x 1536 from a 518 px image; 2.1: 1024 wide), the
    negative zeroed; a latent of (1, 64, points)."""
    tokens, ctx_tokens = (256, 257) if gpu else (16, 10)
    ctx_dim = cfg.get("context_in_dim", cfg.get("context_dim"))
    positive = [[_randn(1, ctx_tokens, ctx_dim, seed=1), {}]]
    return Case(unet_config=cfg, latent=(1, 64, tokens), positive=positive, outside_hook=outside, init_std=init_std,
                norm_init=0.1, cfg=5.0, extra=extra or {})


def _hunyuan3d_v2_case(gpu, guidance_embed):
    hidden = 128 if gpu else 64
    cfg = dict(in_channels=64, context_in_dim=1536, hidden_size=hidden, mlp_ratio=4.0, num_heads=2, depth=1,
               depth_single_blocks=1, qkv_bias=True, guidance_embed=guidance_embed)
    return _hunyuan3d_case(cfg, gpu, 0.1 if gpu else 0.12)


@family("Hunyuan3Dv2")
def hunyuan3d_v2(cls, gpu):
    """Hunyuan3D 2.0: Flux double/single-stream blocks without RoPE. GPU: heads of 64 (the real head dim)."""
    return _hunyuan3d_v2_case(gpu, guidance_embed=False)


@family("Hunyuan3Dv2mini")
def hunyuan3d_v2_mini(cls, gpu):
    """Hunyuan3D 2 mini (Turbo): as 2.0, with the guidance embedder the distilled checkpoints carry."""
    return _hunyuan3d_v2_case(gpu, guidance_embed=True)


@family("Hunyuan3Dv2_1")
def hunyuan3d_v2_1(cls, gpu):
    """Hunyuan3D 2.1: U-shaped DiT (skip connections in the second half), MoE in the last layer, RMS q/k norms.
    GPU: heads of 128 (the real head dim)."""
    hidden = 256 if gpu else 64
    cfg = dict(in_channels=64, context_dim=1024, hidden_size=hidden, mlp_ratio=4.0, num_heads=2, depth=3,
               num_moe_layers=1, num_experts=4, moe_top_k=2, qkv_bias=False, guidance_cond_proj_dim=None)
    return _hunyuan3d_case(cfg, gpu, 0.1, outside=(
        "all: comfy/ldm/hunyuan3dv2_1/hunyuandit.py Attention.forward and CrossAttention.forward call "
        "optimized_attention without transformer_options (HunYuanDiTPlain.forward does not pass them to its blocks)"),
        # 0.3.64's forward splits its context into cond and uncond halves: it runs only with CFG's two-row batch
        extra={"needs_uncond": True})


# ---------------------------------------------------------------- TripoSplat (comfy/ldm/triposplat/model.py)

@family("TripoSplat")
def triposplat(cls, gpu):
    """TripoSplat: a nested latent (shape tokens (B, N, 16) + a camera token (B, 1, 5)); DINOv3 tokens as context
    (1 class + 4 register + patch tokens, 1280 wide) and the image's Flux.2 VAE latent as ``reference_latents`` (added
    to the context's patch tokens). The negative is both zeroed, as TripoSplatConditioning makes it. GPU: heads of
    64 (the real head dim)."""
    if gpu:
        cfg = dict(q_token_length=256, model_channels=128, num_head_channels=64, num_blocks=1, num_refiner_blocks=1)
        grid = 16
    else:
        cfg = dict(q_token_length=16, model_channels=64, num_head_channels=32, num_blocks=1, num_refiner_blocks=1)
        grid = 4
    cfg.update(in_channels=16, out_channels=16, cond_channels=1280, cam_channels=5, cond2_channels=128)
    ctx = _randn(1, 5 + grid * grid, 1280, seed=1)
    ref = _randn(1, 128, grid, grid, seed=2)
    positive = [[ctx, {"reference_latents": [ref]}]]
    negative = [[torch.zeros_like(ctx), {"reference_latents": [torch.zeros_like(ref)]}]]
    return Case(unet_config=cfg, latent=((1, cfg["q_token_length"], 16), (1, 1, 5)), positive=positive,
                negative=negative, init_std=0.1 if gpu else 0.15, norm_init=0.1, cfg=3.0)


# ---------------------------------------------------------------- SeedVR2 (comfy/ldm/seedvr/)

@family("SeedVR2")
def seedvr2(cls, gpu):
    """SeedVR2 (3B layout): SeedVR2Conditioning's conditioning: the model's positive (58 tokens) and negative (64
    tokens) text embeddings, 5120 wide, so cond and uncond run as separate batches, each with the low-res video's
    latent + a ones mask as ``condition``. Window attention over video + text tokens (varlen, one call per window).
    Every attention call (comfy/ldm/seedvr/attention.py var_attention_optimized_split) is made without
    transformer_options."""
    if gpu:
        cfg = dict(vid_dim=256, heads=2, head_dim=128, rope_dim=128)
        latent = (1, 16, 2, 32, 32)
    else:
        cfg = dict(vid_dim=64, heads=2, head_dim=32, rope_dim=32)
        latent = (1, 16, 1, 8, 8)
    cfg.update(num_layers=2, mm_layers=1, norm_eps=1e-5, mlp_type="swiglu", vid_out_norm=True, txt_in_dim=5120,
               rope_type="mmrope3d")
    b, _, t, h, w = latent
    condition = torch.cat([_randn(b, 16, t, h, w, seed=3), torch.ones(b, 1, t, h, w)], dim=1)
    positive = [[_randn(1, 58, 5120, seed=1), {"condition": condition}]]
    negative = [[_randn(1, 64, 5120, seed=2), {"condition": condition}]]
    return Case(unet_config=cfg, latent=latent, positive=positive, negative=negative, init_std=0.1, norm_init=0.1,
                cfg=2.0,
                outside_hook="all: comfy/ldm/seedvr/attention.py var_attention_optimized_split calls "
                             "optimized_attention without transformer_options (NaSwinAttention.forward has none)")


# ---------------------------------------------------------------- TRELLIS.2 (comfy/ldm/trellis2/model.py)

@family("Trellis2")
def trellis2(cls, gpu):
    """TRELLIS.2, the first shape stage (Trellis2ShapeStage on a 32^3 structure voxel: ``shape_generation_512``):
    a sparse latent of two objects with different voxel counts (padded to the longer; the attention gets a key
    padding mask), DINOv3 tokens (1024 wide) as context, ``embeds`` beside them. The configuration fixes 12 heads:
    GPU width 1536 (heads of 128, the real model; the feed-forward at x1 to keep it cheap), CPU 192 (heads of 16)."""
    width = 1536 if gpu else 192
    counts = [176, 128] if gpu else [12, 6]
    ctx_tokens = 128 if gpu else 8
    cfg = dict(resolution=64, in_channels=32, out_channels=32, model_channels=width, cond_channels=1024, num_blocks=1,
               mlp_ratio=1.0 if gpu else 4.0, share_mod=True, qk_rms_norm=True, qk_rms_norm_cross=True,
               init_txt_model=False)
    g = _g(4)
    coords = []
    for i, n in enumerate(counts):
        flat = torch.randperm(32 ** 3, generator=g)[:n].sort().values
        xyz = torch.stack([flat // 1024, (flat // 32) % 32, flat % 32], dim=1)
        coords.append(torch.cat([torch.full((n, 1), i), xyz], dim=1))
    coords = torch.cat(coords).int()
    extras = {"embeds": _randn(2, ctx_tokens, 1024, seed=2), "trellis2_generation_mode": "shape_generation_512",
              "trellis2_coords": coords, "trellis2_coord_counts": torch.tensor(counts)}
    positive = [[_randn(2, ctx_tokens, 1024, seed=1), extras]]
    return Case(unet_config=cfg, latent=(2, 32, max(counts), 1), positive=positive, init_std=0.03, norm_init=0.1, cfg=3.0)


# ---------------------------------------------------------------- not diffusion models

unbuilt("RT_DETR_v4", "object detector, not sampled: nodes_rtdetr.py calls model.model.diffusion_model(image, size) "
                      "directly. Its decoder's attention (comfy/ldm/rt_detr/rtdetr_v4.py) is ComfyUI's "
                      "optimized_attention_for_device(small_input=True), called without transformer_options.")
unbuilt("DepthAnything3", "depth/pose estimator, not sampled: nodes_depth_anything_3.py calls the model's forward "
                          "directly. Its DINOv2 backbone (comfy/image_encoders/dino2.py) and camera encoder "
                          "(comfy/ldm/depth_anything_3/camera.py) use ComfyUI's optimized_attention_for_device("
                          "small_input=True), without transformer_options.")
_SAM3 = ("segmenter/tracker, not sampled: nodes_sam3.py calls model.model.diffusion_model's detector and tracker "
         "directly. Their attention (comfy/ldm/sam3/detector.py, sam.py, tracker.py) is ComfyUI's optimized_attention, "
         "called without transformer_options.")
unbuilt("SAM3", _SAM3)
unbuilt("SAM31", _SAM3)
