"""Zoo builders: the UNet families (SD1.x/2.x, SDXL and its distillations, Stable Cascade, SVD/SV3D, the upscaler,
Zero123, Lotus) and the first DiTs (SD3/SD3.5, AuraFlow, PixArt, HunyuanDiT); plus workflow variants on SDXL: a
ControlNet applied as the Apply ControlNet node applies it, and a LoRA loaded as the LoRA loader loads it.

CPU sizes: two levels of a tiny UNet (attention at the inner level, as SDXL has none at the outer one), or one or two
DiT blocks, a handful of text tokens. GPU sizes: each family's real head dims (SD1.5 40/80, SD2/SDXL/SVD 64, SD3 64,
AuraFlow 256, PixArt 72, HunyuanDiT 88, Stable Cascade 64) and at least 128 query and key tokens where the family
has that many (text contexts of 154-300 tokens; Zero123's and SVD's image-embedding contexts are one token).
"""

from __future__ import annotations

import types

import torch

from .core import Case, family, variant

TOKENS_GPU = 154  # two 77-token CLIP chunks: a long prompt (cross-attention over >= 128 keys)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=_g(seed)) * scale


def unet(ch, mult, depth, *, ctx, in_ch=4, out_ch=4, adm=None, res=1, depth_mid=1, **extra):
    """A UNetModel config as ComfyUI's detection writes it: ``depth[level]`` transformer blocks after each res block
    of that level (0: none), ``res`` res blocks per level."""
    cfg = {"image_size": 32, "use_spatial_transformer": True, "legacy": False, "use_checkpoint": False,
           "model_channels": ch, "channel_mult": list(mult), "num_res_blocks": [res] * len(mult),
           "transformer_depth": [d for d in depth for _ in range(res)],
           "transformer_depth_output": [d for d in depth for _ in range(res + 1)],
           "transformer_depth_middle": depth_mid, "in_channels": in_ch, "out_channels": out_ch, "context_dim": ctx,
           "adm_in_channels": adm, "use_temporal_resblock": False, "use_temporal_attention": False}
    if adm is not None:
        cfg["num_classes"] = "sequential"
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------- SD 1.x (8 heads: head dims 40 and 80 at 320 channels)

def _sd1(gpu, in_ch=4, ctx_tokens=77):
    ch, ctx = (320, 768) if gpu else (64, 32)
    hw = 32 if gpu else 8
    cfg = unet(ch, (1, 2), (1, 1), ctx=ctx, in_ch=in_ch)
    text = _randn(1, TOKENS_GPU if gpu and ctx_tokens == 77 else ctx_tokens, ctx, seed=1)
    return cfg, hw, ctx, text


@family("SD15")
def sd15(cls, gpu):
    cfg, hw, _, text = _sd1(gpu)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {}]])


@family("SD15_instructpix2pix")
def sd15_ip2p(cls, gpu):
    cfg, hw, _, text = _sd1(gpu, in_ch=8)
    image = _randn(1, 4, hw, hw, seed=2)  # the InstructPixToPixConditioning node's encoded input image
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {"concat_latent_image": image}]],
                negative=[[torch.zeros_like(text), {"concat_latent_image": image}]])


@family("Stable_Zero123")
def zero123(cls, gpu):
    cfg, hw, ctx, _ = _sd1(gpu, in_ch=8)
    # StableZero123_Conditioning: one token, the CLIP vision embedding (768) and 4 camera values, projected to the
    # context width by the model's cc_projection (read from the checkpoint in get_model)
    cam = _randn(1, 1, 768 + 4, seed=3)
    image = _randn(1, 4, hw, hw, seed=2)
    sd = {"cc_projection.weight": torch.zeros(ctx, 768 + 4), "cc_projection.bias": torch.zeros(ctx)}
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), state_dict=sd,
                positive=[[cam, {"concat_latent_image": image}]],
                negative=[[torch.zeros_like(cam), {"concat_latent_image": torch.zeros_like(image)}]])


# ---------------------------------------------------------------- SD 2.x (64-wide heads, attention in fp32)

def _sd2(gpu, in_ch=4, adm=None, **extra):
    ch, ctx = (320, 1024) if gpu else (64, 32)
    hw = 32 if gpu else 8
    cfg = unet(ch, (1, 2), (1, 1), ctx=ctx, in_ch=in_ch, adm=adm, use_linear_in_transformer=True, **extra)
    return cfg, hw, _randn(1, TOKENS_GPU if gpu else 77, ctx, seed=1)


@family("SD20")
def sd20(cls, gpu):
    cfg, hw, text = _sd2(gpu)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {}]])


@family("SD21UnclipL", "SD21UnclipH")
def sd21_unclip(cls, gpu):
    adm = cls.unet_config["adm_in_channels"]  # 2 x the noise augmentor's width (fixed by the configuration)
    cfg, hw, text = _sd2(gpu, adm=adm)
    embeds = types.SimpleNamespace(image_embeds=_randn(1, adm // 2, seed=4))  # a CLIPVisionEncode output
    unclip = [{"clip_vision_output": embeds, "strength": 1.0, "noise_augmentation": 0.1}]
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {"unclip_conditioning": unclip}]],
                negative=[[torch.zeros_like(text), {}]])


@family("LotusD")
def lotus(cls, gpu):
    cfg, hw, text = _sd2(gpu, adm=4)  # a 4-wide task embedding
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {}]], cfg=1.0, sampler="euler",
                notes="image-to-image (depth/normal) model: sampled from noise here")


@family("SD_X4Upscaler")
def x4_upscaler(cls, gpu):
    # four levels (its configuration disables self-attention on the first three: they cross-attend to the text),
    # attention on the inner two, 8 heads; the low-resolution image is concatenated to the latent
    ch, ctx = (256, 1024) if gpu else (64, 32)
    hw = 64 if gpu else 16
    cfg = unet(ch, (1, 1, 2, 2), (0, 0, 1, 1), ctx=ctx, in_ch=7, use_linear_in_transformer=True)
    text = _randn(1, TOKENS_GPU if gpu else 77, ctx, seed=1)
    image = _randn(1, 3, hw, hw, seed=2, scale=0.5)
    extras = {"concat_image": image, "noise_augmentation": 0.2}
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, extras]],
                negative=[[torch.zeros_like(text), extras]])


# ---------------------------------------------------------------- SDXL and its distillations

def _sdxl(cls, gpu, in_ch=4, refiner=False):
    ch, ctx, pooled = (320, 2048, 1280) if gpu else (64, 32, 32)
    hw = 32 if gpu else 8
    adm = pooled + (5 if refiner else 6) * 256  # the pooled text embedding and 256-wide size/crop embeddings
    cfg = unet(ch, (1, 2), (0, 1), ctx=ctx, in_ch=in_ch, adm=adm, use_linear_in_transformer=True)
    text = _randn(1, TOKENS_GPU if gpu else 77, ctx, seed=1)
    extras = {"pooled_output": _randn(1, pooled, seed=5), "width": hw * 8, "height": hw * 8}
    return cfg, hw, text, extras


@family("SDXL", "SSD1B", "Segmind_Vega", "KOALA_700M", "KOALA_1B")
def sdxl(cls, gpu):
    cfg, hw, text, extras = _sdxl(cls, gpu)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, extras]],
                notes="" if cls.__name__ == "SDXL" else "SDXL's UNet with its own transformer depths: the same at "
                                                         "this size")


@family("SDXLRefiner")
def sdxl_refiner(cls, gpu):
    cfg, hw, text, extras = _sdxl(cls, gpu, refiner=True)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {**extras, "aesthetic_score": 6.0}]],
                negative=[[torch.zeros_like(text), {**extras, "aesthetic_score": 2.5, "prompt_type": "negative"}]])


@family("SDXL_instructpix2pix")
def sdxl_ip2p(cls, gpu):
    cfg, hw, text, extras = _sdxl(cls, gpu, in_ch=8)
    image = _randn(1, 4, hw, hw, seed=2)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {**extras, "concat_latent_image": image}]],
                negative=[[torch.zeros_like(text), {**extras, "concat_latent_image": image}]])


# ---------------------------------------------------------------- SVD / SV3D (video UNet: temporal attention too)

@family("SVD_img2vid", "SV3D_u", "SV3D_p")
def svd(cls, gpu):
    ch, ctx = (320, 1024) if gpu else (64, 32)
    hw, frames = (16, 8) if gpu else (8, 3)
    cfg = unet(ch, (1, 2), (1, 1), ctx=ctx, in_ch=8, adm=cls.unet_config["adm_in_channels"],
               use_linear_in_transformer=True, use_temporal_resblock=True, use_temporal_attention=True,
               extra_ff_mix_layer=True, use_spatial_context=True, merge_strategy="learned_with_images",
               merge_factor=0.0, video_kernel_size=[3, 1, 1], disable_temporal_crossattention=False)
    cfg.pop("num_classes")  # SVD's adm goes through label_emb as "sequential" too
    cfg["num_classes"] = "sequential"
    # SVD_img2vid_Conditioning / SV3D_Conditioning: one token (the CLIP vision embedding), the encoded first frame
    # concatenated, motion/fps/augmentation (SV3D: elevation and azimuth) as the adm vector
    emb = _randn(1, 1, ctx, seed=6)
    image = _randn(1, 4, hw, hw, seed=2)
    extras = {"concat_latent_image": image, "motion_bucket_id": 127, "fps": 6, "augmentation_level": 0.0,
              "elevation": 10.0, "azimuth": 30.0}
    return Case(unet_config=cfg, latent=(frames, 4, hw, hw), positive=[[emb, extras]],
                negative=[[torch.zeros_like(emb), {**extras, "concat_latent_image": torch.zeros_like(image)}]],
                cfg=2.5, init_std=0.03)


# ---------------------------------------------------------------- Stable Cascade

@family("Stable_Cascade_C")
def cascade_c(cls, gpu):
    c, heads, txt = (128, 2, 1280) if gpu else (64, 2, 32)
    cfg = {"stable_cascade_stage": "c", "c_cond": c, "c_hidden": [c, c], "nhead": [heads, heads],
           "blocks": [[1, 1], [1, 1]], "block_repeat": [[1, 1], [1, 1]], "c_clip_text": txt,
           "c_clip_text_pooled": txt}
    hw = 24 if gpu else 8
    text = _randn(1, TOKENS_GPU if gpu else 8, txt, seed=1)
    return Case(unet_config=cfg, latent=(1, 16, hw, hw), positive=[[text, {"pooled_output": _randn(1, 1, txt, seed=5)}]],
                cfg=4.0)


@family("Stable_Cascade_B")
def cascade_b(cls, gpu):
    c, heads, clip = (128, 2, 1280) if gpu else (64, 2, 32)
    cfg = {"stable_cascade_stage": "b", "c_cond": c, "c_hidden": [32, 32, c, c], "nhead": [-1, -1, heads, heads],
           "blocks": [[1, 1, 1, 1], [1, 1, 1, 1]], "block_repeat": [[1, 1, 1, 1], [1, 1, 1, 1]], "c_clip": clip}
    hw = 128 if gpu else 32
    # StableCascade_StageB_Conditioning: stage C's output as the effnet prior
    extras = {"pooled_output": _randn(1, 1, clip, seed=5), "stable_cascade_prior": _randn(1, 16, hw // 8, hw // 8, seed=7)}
    text = _randn(1, 8, clip, seed=1)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, extras]], cfg=1.1)


# ---------------------------------------------------------------- SD3 / SD3.5 (MMDiT: 64-wide heads)

def _fill_pos_embed(dm, g):
    dm.pos_embed.copy_(torch.randn(dm.pos_embed.shape, generator=g).to(dm.pos_embed) * 0.02)


@family("SD3")
def sd3(cls, gpu):
    # SD3.5's features: RMS q/k norm and the dual self-attention block (x_block_self_attn) on the first layer; its
    # MMDiT hands ComfyUI a [B, N, H, D] V beside 3-D q and k
    ctx_in, pooled = (4096, 2048) if gpu else (32, 32)
    grid = 32 if gpu else 8
    cfg = {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
           "adm_in_channels": pooled, "num_patches": grid * grid, "pos_embed_max_size": grid, "qk_norm": "rms",
           "x_block_self_attn_layers": [0], "pos_embed_scaling_factor": None,
           "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": ctx_in,
                                                                               "out_features": 64 * 2}}}
    hw = 32 if gpu else 8
    text = _randn(1, TOKENS_GPU if gpu else 12, ctx_in, seed=1)
    return Case(unet_config=cfg, latent=(1, 16, hw, hw), positive=[[text, {"pooled_output": _randn(1, pooled, seed=5)}]],
                init=_fill_pos_embed, cfg=4.0)


@family("AuraFlow")
def auraflow(cls, gpu):
    dim, heads, seq = (512, 2, 2048) if gpu else (64, 2, 32)  # head dim 256 on the GPU, as AuraFlow's
    hw = 32 if gpu else 8
    cfg = {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": dim, "n_heads": heads, "n_layers": 2,
           "n_double_layers": 1, "global_conddim": dim, "cond_seq_dim": seq, "max_seq": (hw // 2) ** 2}
    text = _randn(1, 256 if gpu else 8, seq, seed=1)
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, {}]], cfg=3.5, init_std=0.03)


# ---------------------------------------------------------------- PixArt, HunyuanDiT: attention outside the hook

PIXART_OUTSIDE = ("all: comfy/ldm/pixart/blocks.py: AttentionKVCompress.forward and MultiHeadCrossAttention.forward "
                  "call optimized_attention without transformer_options")
HYDIT_OUTSIDE = ("all: comfy/ldm/hydit/attn_layers.py: Attention.forward and CrossAttention.forward call "
                 "optimized_attention without transformer_options")


@family("PixArtAlpha", "PixArtSigma")
def pixart(cls, gpu):
    alpha = cls.__name__ == "PixArtAlpha"
    hidden, heads, cap = (144, 2, 4096) if gpu else (96, 2, 32)  # head dim 72 on the GPU, as PixArt's (a multiple of 3)
    tokens = (120 if alpha else 300) if gpu else 8  # T5 tokens: 120 (Alpha), 300 (Sigma)
    hw = 64 if gpu else 36  # its positional embedding needs at least a 264-pixel image ((H + W) / 2 > 32 latents)
    cfg = {"patch_size": 2, "in_channels": 4, "hidden_size": hidden, "depth": 2, "num_heads": heads,
           "caption_channels": cap, "model_max_length": tokens, "micro_condition": alpha}
    text = _randn(1, tokens, cap, seed=1)
    extras = {"width": hw * 8, "height": hw * 8} if alpha else {}
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[text, extras]], cfg=4.5,
                outside_hook=PIXART_OUTSIDE)


@family("HunyuanDiT", "HunyuanDiT1")
def hunyuan_dit(cls, gpu):
    hidden, heads = (176, 2) if gpu else (64, 2)  # head dim 88 on the GPU, as HunyuanDiT's
    clip_len, t5_len = (77, 256) if gpu else (8, 8)
    clip_w, t5_w = (1024, 2048) if gpu else (32, 32)
    hw = 32 if gpu else 8
    cfg = {"hidden_size": hidden, "depth": 2, "num_heads": heads, "text_states_dim": clip_w,
           "text_states_dim_t5": t5_w, "text_len": clip_len, "text_len_t5": t5_len}
    if cls.__name__ == "HunyuanDiT1":
        cfg.update(size_cond=True, use_style_cond=True)
    # the prompt's tokens, the rest masked out (the text attention masks of both encoders)
    mask = torch.zeros(1, clip_len, dtype=torch.long)
    mask[:, : clip_len // 2] = 1
    mask_t5 = torch.zeros(1, t5_len, dtype=torch.long)
    mask_t5[:, : t5_len // 2 + 1] = 1
    extras = {"attention_mask": mask, "conditioning_mt5xl": _randn(1, t5_len, t5_w, seed=8),
              "attention_mask_mt5xl": mask_t5, "width": hw * 8, "height": hw * 8}
    return Case(unet_config=cfg, latent=(1, 4, hw, hw), positive=[[_randn(1, clip_len, clip_w, seed=1), extras]],
                cfg=5.0, outside_hook=HYDIT_OUTSIDE)


# ---------------------------------------------------------------- workflow variants on SDXL

CONTROLNET_OUTSIDE = ("some: comfy/controlnet.py: ControlNet.get_control calls its control model without "
                      "transformer_options, so the ControlNet's own attention runs ComfyUI's attention")


@variant("SDXL+ControlNet", "SDXL")
def sdxl_controlnet(cls, gpu):
    """A ControlNet built as comfy.controlnet.load_controlnet_state_dict builds an SDXL one (its own UNet encoder,
    the hint block), random weights, applied to both conditionings as the Apply ControlNet (Advanced) node does."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.model_management
    import comfy.ops
    import nodes

    case = sdxl(cls, gpu)
    cfg = {k: v for k, v in case.unet_config.items() if k not in ("out_channels", "transformer_depth_output")}
    dtype = torch.float32

    def controlnet(dtype=dtype, device="cpu"):
        cm = comfy.cldm.cldm.ControlNet(**cfg, hint_channels=3, dtype=dtype, device=device,
                                        operations=comfy.ops.disable_weight_init)
        g = _g(11)
        with torch.no_grad():
            for p in cm.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        return comfy.controlnet.ControlNet(cm, load_device=torch.device(device), manual_cast_dtype=None)

    hw = case.latent[-1]
    hint = torch.rand(1, hw * 8, hw * 8, 3, generator=_g(12))  # an IMAGE (B, H, W, C): a preprocessed edge map
    neg = [[torch.zeros_like(c), dict(ex)] for c, ex in case.positive]

    def apply(positive, negative, dtype=dtype, device="cpu"):
        return nodes.ControlNetApplyAdvanced().apply_controlnet(positive, negative, controlnet(dtype, device), hint,
                                                                0.8, 0.0, 1.0)

    pos, neg = apply(case.positive, neg)
    return Case(unet_config=case.unet_config, latent=case.latent, positive=pos, negative=neg,
                outside_hook=CONTROLNET_OUTSIDE, extra={"reapply": apply}, notes="ControlNet strength 0.8")


def lora_for(model, rank=4, seed=13, scale=0.05):
    """A LoRA state dict (the generic ``diffusion_model.<module>.lora_up/lora_down/alpha`` format) over every
    attention projection of ``model``'s diffusion model, random."""
    sd = {}
    g = _g(seed)
    for name, mod in model.model.diffusion_model.named_modules():
        if name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v") or name.endswith("to_out.0"):
            w = mod.weight
            key = f"diffusion_model.{name}"
            sd[f"{key}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * scale
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * scale
            sd[f"{key}.alpha"] = torch.tensor(float(rank))
    return sd


@variant("SDXL+LoRA", "SDXL")
def sdxl_lora(cls, gpu):
    """A LoRA on every attention projection, loaded as the LoraLoaderModelOnly node loads one
    (comfy.sd.load_lora_for_models: ModelPatcher.add_patches on a clone)."""
    import comfy.sd

    def patch(model):
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora_for(model), 1.0, 0.0)
        return patched

    case = sdxl(cls, gpu)
    case.patch = patch
    case.notes = "rank-4 LoRA on every attention projection"
    return case
