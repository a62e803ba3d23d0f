"""Zoo builders: image DiTs (Flux and its descendants, Chroma, HiDream, Qwen-Image, Lumina 2 / Z-Image, OmniGen 2, ...).

Each builder reads the release it runs on only where ComfyUI's code differs (a dataclass field or keyword added, a
latent format that packs channels); the sizes are ComfyUI's own config keys, shrunk. CPU sizes: width 64, 2 heads (head
dim 32), a few dozen tokens; width 256 (head dim 128) where the family's code needs it (Z-Image's adaLN, JoyImage's
forced rope). GPU sizes: each family's real head dim (128 for most; Lumina 2 96, OmniGen 2 / Boogu 120, PixelDiT 64
and 72, Lens 64, Ideogram 4 256), at least 128 image tokens and 128 text tokens where the family takes them. Norm
weights start near 1, as in a checkpoint (see :func:`_unit_norms`).
"""

from __future__ import annotations

import dataclasses

import torch

from .core import Case, family, unbuilt, variant  # noqa: F401


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fields(params_cls, cfg: dict) -> dict:
    """``cfg`` without the keys the release's params dataclass lacks (fields a newer ComfyUI added)."""
    names = {f.name for f in dataclasses.fields(params_cls)}
    return {k: v for k, v in cfg.items() if k in names or k == "image_model"}


def _kw(fn, cfg: dict) -> dict:
    """``cfg`` without the keywords ``fn`` (a model's ``__init__``) does not take on this release."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(cfg)
    return {k: v for k, v in cfg.items() if k in params}


def _unit_norms(dm, g: torch.Generator) -> None:
    """Norm weights as a checkpoint has them, near 1: drawn N(0, init_std) like the rest they would shrink every q and
    k behind a qk-norm to nothing, every attention would be uniform and no kernel error would show in the latent."""
    for m in dm.modules():
        if "Norm" in type(m).__name__:
            for name, p in m.named_parameters(recurse=False):
                if p.ndim == 1 and name in ("weight", "scale"):
                    p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))


def _case(**kw) -> Case:
    kw.setdefault("init", _unit_norms)
    return Case(**kw)


def _text_mask(n: int, valid: int) -> torch.Tensor:
    """A text encoder's attention mask for one prompt: ``valid`` real tokens, then padding."""
    m = torch.zeros(1, n, dtype=torch.long)
    m[:, :valid] = 1
    return m


# ---------------------------------------------------------------- Flux.1 and its variants

def _flux(gpu: bool, **over) -> dict:
    from comfy.ldm.flux.model import FluxParams

    cfg = dict(in_channels=16, out_channels=16, vec_in_dim=64 if gpu else 32, context_in_dim=64 if gpu else 32,
               hidden_size=256 if gpu else 64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
               axes_dim=[16, 56, 56] if gpu else [8, 12, 12], theta=10000, patch_size=2, qkv_bias=True,
               guidance_embed=True, txt_ids_dims=[])
    cfg.update(over)
    return _fields(FluxParams, cfg)


def _flux_text(gpu: bool, dim: int, seed: int = 0, n=None):
    n = n or (128 if gpu else 8)
    g = _g(seed)
    return torch.randn(1, n, dim, generator=g), g


@family("Flux")
def flux_kontext(cls, gpu):
    """Flux.1 dev as FLUX.1 Kontext runs it: a reference latent beside the image tokens ("offset"), guidance."""
    cfg = _flux(gpu)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    hw = 32 if gpu else 8
    ref = torch.randn(1, 16, hw, hw, generator=g)
    pos = [[ctx, {"pooled_output": torch.randn(1, cfg["vec_in_dim"], generator=g), "guidance": 2.5,
                  "reference_latents": [ref]}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="Kontext-style edit: reference latent (offset method), guidance 2.5")


@family("FluxSchnell")
def flux_schnell_redux(cls, gpu):
    """Flux.1 schnell with a Redux image prompt applied by ComfyUI's own Apply Style Model node in ``attn_bias`` mode:
    the extra tokens and a float attention-bias mask over text + image tokens."""
    import nodes as comfy_nodes

    cfg = _flux(gpu, guidance_embed=False)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    redux = torch.randn(1, 16 if gpu else 4, cfg["context_in_dim"], generator=g)

    class _Style:  # what StyleModelApply reads from a style model: the tokens for an image
        def get_cond(self, clip_vision_output):
            return redux

    cond = [[ctx, {"pooled_output": torch.randn(1, cfg["vec_in_dim"], generator=g)}]]
    pos = comfy_nodes.StyleModelApply().apply_stylemodel(cond, _Style(), None, 0.5, "attn_bias")[0]
    hw = 32 if gpu else 8
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="Redux attn_bias 0.5: a float mask [B, Ntxt+Nimg, Ntxt+Nimg] through every joint attention")


@family("FluxInpaint")
def flux_fill(cls, gpu):
    """Flux.1 Fill: the masked image and the pixel mask concatenated to the latent (InpaintModelConditioning)."""
    cfg = _flux(gpu, in_channels=96)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    hw = 32 if gpu else 8
    mask = torch.zeros(1, 1, hw * 8, hw * 8)
    mask[..., hw * 2:hw * 6, hw * 2:hw * 6] = 1.0
    pos = [[ctx, {"pooled_output": torch.randn(1, cfg["vec_in_dim"], generator=g), "guidance": 30.0,
                  "concat_latent_image": torch.randn(1, 16, hw, hw, generator=g), "concat_mask": mask}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="inpaint: concat latent + 8x8-packed pixel mask (96 input channels), guidance 30")


CONTROLNET_OUTSIDE = ("some: comfy/controlnet.py ControlNet.get_control calls the control model without "
                      "transformer_options, and comfy/ldm/flux/controlnet.py ControlNetFlux.forward_orig calls its blocks "
                      "without them: the ControlNet's own attention runs ComfyUI's attention")


@variant("Flux+ControlNet", "Flux")
def flux_controlnet(cls, gpu):
    """Flux.1 dev text-to-image with an XLabs-style Flux ControlNet (comfy.ldm.flux.controlnet.ControlNetFlux: double
    blocks and the pixel hint encoder, built as comfy.controlnet.load_controlnet_flux_xlabs_mistoline builds it),
    random weights, applied to both conditionings by the Apply ControlNet (Advanced) node at strength 0.8."""
    import comfy.controlnet
    import comfy.ldm.flux.controlnet
    import comfy.ops

    import nodes as comfy_nodes

    cfg = _flux(gpu)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    hw = 32 if gpu else 8
    pos = [[ctx, {"pooled_output": torch.randn(1, cfg["vec_in_dim"], generator=g), "guidance": 3.5}]]
    neg = [[torch.zeros_like(ctx), {"pooled_output": torch.zeros(1, cfg["vec_in_dim"]), "guidance": 3.5}]]
    hint = torch.rand(1, hw * 8, hw * 8, 3, generator=_g(12))  # an IMAGE (B, H, W, C): a preprocessed edge map
    std = 0.06 if gpu else 0.1
    # the ControlNet lives where the GPU zoo samples (ComfyUI's ControlNet object moves only its inputs)
    device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def controlnet(dtype=dtype, device=device):
        cm = comfy.ldm.flux.controlnet.ControlNetFlux(mistoline=False, operations=comfy.ops.disable_weight_init,
                                                      device=device, dtype=dtype, **dict(cfg, depth_single_blocks=0))
        gc = _g(11)
        with torch.no_grad():
            for p in cm.parameters():
                p.copy_((torch.randn(p.shape, generator=gc) * std).to(p.dtype))
            _unit_norms(cm, gc)
        return comfy.controlnet.ControlNet(cm, load_device=torch.device(device), manual_cast_dtype=None,
                                           extra_conds=["y", "guidance"])

    def apply(positive, negative, dtype=dtype, device=device):
        """The ControlNet in ``dtype`` on ``device`` applied to the conditionings (replacing one applied before)."""
        def plain(cond):
            return [[c, {k: v for k, v in d.items() if k not in ("control", "control_apply_to_uncond")}] for c, d in cond]

        return comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(plain(positive), plain(negative),
                                                                      controlnet(dtype, device), hint, 0.8, 0.0, 1.0)

    pos, neg = apply(pos, neg)
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, negative=neg, init_std=std,
                 outside_hook=CONTROLNET_OUTSIDE,
                 notes="XLabs-style ControlNet (1 double block), strength 0.8")


@family("LongCatImage")
def longcat(cls, gpu):
    """LongCat-Image: Flux layout, Qwen2.5-VL text (3584 wide, the key ComfyUI matches on), text positions on two rope
    axes, no pooled vector, no guidance."""
    cfg = _flux(gpu, guidance_embed=False, vec_in_dim=None, context_in_dim=3584, txt_ids_dims=[1, 2])
    ctx, g = _flux_text(gpu, 3584)
    hw = 32 if gpu else 8
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=[[ctx, {}]], init_std=0.06 if gpu else 0.1)


def _flux2(gpu: bool) -> dict:
    from comfy.ldm.flux.model import FluxParams

    cfg = dict(in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=96 if gpu else 48,
               hidden_size=256 if gpu else 64, mlp_ratio=3.0, num_heads=2, depth=1, depth_single_blocks=1,
               axes_dim=[32, 32, 32, 32] if gpu else [8, 8, 8, 8], theta=2000, patch_size=1, qkv_bias=False,
               guidance_embed=True, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True, ops_bias=False,
               default_ref_method="index", ref_index_scale=10.0)
    return _fields(FluxParams, cfg)


@family("Flux2")
def flux2_edit(cls, gpu):
    """FLUX.2 with two reference images (its multi-reference edit: ``index`` method, each on its own rope index); the
    model pads the text to 512 tokens, so every joint call has >= 512 text keys."""
    cfg = _flux2(gpu)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"], n=64 if gpu else 12)
    hw = 16 if gpu else 4
    refs = [torch.randn(1, 128, hw, hw, generator=g), torch.randn(1, 128, hw // 2, hw, generator=g)]
    pos = [[ctx, {"guidance": 4.0, "reference_latents": refs}]]
    return _case(unet_config=cfg, latent=(1, 128, hw, hw), positive=pos, init_std=0.1 if gpu else 0.2,
                 notes="two reference latents (index method); text padded to 512 by model_base.Flux2")


def _chroma(gpu: bool, **over) -> dict:
    h = 256 if gpu else 64
    cfg = dict(in_channels=64, out_channels=64, context_in_dim=64 if gpu else 32, hidden_size=h, mlp_ratio=2.0,
               num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56] if gpu else [8, 12, 12], theta=10000,
               patch_size=2, qkv_bias=True, in_dim=64, out_dim=h, hidden_dim=64 if gpu else 32, n_layers=1,
               txt_ids_dims=[], vec_in_dim=None)
    cfg.update(over)
    return cfg


@family("Chroma")
def chroma(cls, gpu):
    """Chroma: Flux's blocks modulated by a distilled guidance approximator, T5 text only."""
    from comfy.ldm.chroma.model import ChromaParams

    cfg = _fields(ChromaParams, _chroma(gpu))
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    hw = 32 if gpu else 8
    # CLIPTextEncode always sets pooled_output (None for T5 alone); 0.3.64's model_base reads the key
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=[[ctx, {"pooled_output": None}]],
                 init_std=0.1 if gpu else 0.15)


@family("ChromaRadiance")
def chroma_radiance(cls, gpu):
    """Chroma Radiance: pixel space, 16x16 patches into the Chroma trunk, a small per-pixel NeRF head after it."""
    from comfy.ldm.chroma_radiance.model import ChromaRadianceParams

    cfg = _chroma(gpu, in_channels=3, out_channels=3, patch_size=16, nerf_hidden_size=32 if gpu else 16,
                  nerf_mlp_ratio=2, nerf_depth=1, nerf_max_freqs=4, nerf_tile_size=0, nerf_final_head_type="conv",
                  nerf_embedder_dtype=None, use_x0=False, use_sequential_txt_ids=True)
    cfg = _fields(ChromaRadianceParams, cfg)
    ctx, g = _flux_text(gpu, cfg["context_in_dim"])
    px = 256 if gpu else 64  # 16 x 16 = 256 image tokens on the GPU, 16 on the CPU
    return _case(unet_config=cfg, latent=(1, 3, px, px), positive=[[ctx, {"pooled_output": None}]], init_std=0.2)


# ---------------------------------------------------------------- HiDream

@family("HiDream")
def hidream(cls, gpu):
    """HiDream I1/E1: T5 tokens + one Llama-3 layer per block (``conditioning_llama3``: [B, layers, N, C]), pooled
    CLIP-L+G, MoE feed-forwards; as E1 runs it, with the source image concatenated along the width."""
    d, c = (128, 64) if gpu else (32, 32)
    layers = 2
    cfg = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=d,
               num_attention_heads=2, caption_channels=[c, c], text_emb_dim=32, num_routed_experts=2,
               num_activated_experts=1, axes_dims_rope=[64, 32, 32] if gpu else [16, 8, 8], max_resolution=[128, 128],
               llama_layers=list(range(layers)))
    g = _g()
    n = 128 if gpu else 6
    hw = 32 if gpu else 8
    pos = [[torch.randn(1, n, c, generator=g), {
        "pooled_output": torch.randn(1, 32, generator=g),
        "conditioning_llama3": torch.randn(1, layers, n, c, generator=g),
        "concat_latent_image": torch.randn(1, 16, hw, hw, generator=g)}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="E1-style edit: source latent concatenated along the width (image tokens doubled)")


@family("HiDreamO1")
def hidream_o1(cls, gpu):
    """HiDream-O1: a Qwen3-VL decoder over prompt tokens + 32x32 RGB patches (GQA), as its edit workflow runs it: one
    reference image through the Qwen3-VL ViT (tokens spliced into the prompt) and as patches beside the target."""
    from comfy.text_encoders import hidream_o1 as te

    d = 128 if gpu else 32
    text = dict(hidden_size=2 * d, intermediate_size=4 * d, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=d, rope_dims=[24, 20, 20] if gpu else [6, 5, 5])
    vision = dict(hidden_size=64 if gpu else 32, num_heads=2, intermediate_size=128 if gpu else 64, depth=1,
                  deepstack_visual_indexes=())
    g = _g()
    words = torch.randint(1000, 150000, (24 if gpu else 6,), generator=g).tolist()

    def prompt(words):  # HiDreamO1Tokenizer's chat template around the prompt's tokens
        return torch.tensor([[te.IM_START_ID, te.USER_ID, te.NEWLINE_ID] + words
                             + [te.IM_END_ID, te.NEWLINE_ID, te.IM_START_ID, te.ASSISTANT_ID, te.NEWLINE_ID,
                                te.BOI_TOKEN_ID, te.TMS_TOKEN_ID]], dtype=torch.long)

    px = 384 if gpu else 64  # 32x32 patches: 144 target tokens on the GPU, 4 on the CPU
    ref = torch.rand(1, px, px, 3, generator=g)  # an IMAGE, as HiDream-O1 Reference Images attaches it
    # the node attaches the references to both; the empty negative prompt is shorter: its own batch and cache entry
    pos, neg = prompt(words), prompt([])
    pos = [[pos.unsqueeze(-1).float(), {"text_input_ids": pos, "reference_latents": [ref]}]]
    neg = [[neg.unsqueeze(-1).float(), {"text_input_ids": neg, "reference_latents": [ref]}]]
    outside = ("some: comfy/ldm/hidream_o1/attention.py make_two_pass_attention runs the causal prompt prefix "
               "(first step; cached after) with comfy.ops.scaled_dot_product_attention directly, and the Qwen3-VL ViT "
               "(comfy/text_encoders/qwen35.py, reference images) calls optimized_attention_for_device without "
               "transformer_options")
    return _case(unet_config={"text_config_overrides": text, "vision_config_overrides": vision}, latent=(1, 3, px, px),
                 positive=pos, negative=neg, outside_hook=outside, init_std=0.2,
                 notes="edit: one reference image (ViT tokens + patches); GQA 2:1 through skip_reshape calls; from the "
                      "second step the prompt's K/V come from the model's cache, so q is shorter than k")


# ---------------------------------------------------------------- Qwen-Image and its relatives

def _qwen(gpu: bool, model_cls, **over) -> dict:
    cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=128 if gpu else 32,
               num_attention_heads=2, joint_attention_dim=64 if gpu else 32, pooled_projection_dim=32,
               axes_dims_rope=[16, 56, 56] if gpu else [8, 12, 12])
    cfg.update(over)
    return _kw(model_cls.__init__, cfg)


@family("QwenImage")
def qwen_image_edit(cls, gpu):
    """Qwen-Image-Edit 2511 as TextEncodeQwenImageEditPlus feeds it: two reference latents (``index_timestep_zero``:
    the references get their own zero timestep), the text's padding mask (0.33 reads it; 0.3.64 ignores it)."""
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    cfg = _qwen(gpu, QwenImageTransformer2DModel, default_ref_method="index_timestep_zero")
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    refs = [torch.randn(1, 16, 1, hw, hw, generator=g), torch.randn(1, 16, 1, hw // 2, hw, generator=g)]
    pos = [[torch.randn(1, n, cfg["joint_attention_dim"], generator=g),
            {"attention_mask": _text_mask(n, n - 3), "reference_latents": refs}]]
    return _case(unet_config=cfg, latent=(1, 16, 1, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="edit 2511: 2 references, index_timestep_zero where the release has it; text padding mask")


@family("MageFlow")
def mage_flow(cls, gpu):
    """Mage-Flow (Qwen-Image blocks on 128-channel Flux.2 latents, 1x1 patches) as its edit node feeds it: a reference
    latent at the output size, the text's padding mask."""
    from comfy.ldm.mage_flow.model import MageFlowTransformer2DModel

    cfg = _qwen(gpu, MageFlowTransformer2DModel, in_channels=128, out_channels=128)
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4  # 1x1 patches: 256 / 16 image tokens
    pos = [[torch.randn(1, n, cfg["joint_attention_dim"], generator=g),
            {"attention_mask": _text_mask(n, n - 3), "reference_latents": [torch.randn(1, 128, hw, hw, generator=g)]}]]
    return _case(unet_config=cfg, latent=(1, 128, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="edit: one reference latent (its own rope frame index); text padding mask")


@family("JoyImage")
def joyimage_edit(cls, gpu):
    """JoyImage Edit: MMDiT on Wan 2.1 latents ([1, 2, 2] patches), Qwen3-VL text, one reference latent as
    TextEncodeJoyImageEdit attaches it. The configuration forces rope [16, 56, 56]: head dim 128 on the CPU too."""
    cfg = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=256, num_attention_heads=2, text_dim=64 if gpu else 32,
               mlp_width_ratio=2.0, num_layers=1)
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    pos = [[torch.randn(1, n, cfg["text_dim"], generator=g),
            {"reference_latents": [torch.randn(1, 16, 1, hw, hw, generator=g)]}]]
    return _case(unet_config=cfg, latent=(1, 16, 1, hw, hw), positive=pos, init_std=0.06,
                 notes="edit: one reference latent; comfy-kitchen's fused rms_rope on the image stream")


# ---------------------------------------------------------------- Lumina 2 and Z-Image (NextDiT)

def _nextdit(gpu: bool, model_cls, *, head: int, **over) -> dict:
    cfg = dict(patch_size=2, in_channels=16, dim=2 * head, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
               multiple_of=32, ffn_dim_multiplier=2.0, qk_norm=True, cap_feat_dim=64 if gpu else 32)
    cfg.update(over)
    return _kw(model_cls.__init__, cfg)


@family("Lumina2")
def lumina2(cls, gpu):
    """Lumina Image 2.0: Gemma-2 text through a context refiner, GQA (heads repeated before the call), its real head
    dim 96 on the GPU (2304 / 24 heads)."""
    from comfy.ldm.lumina.model import NextDiT

    head = 96 if gpu else 32
    cfg = _nextdit(gpu, NextDiT, head=head, n_kv_heads=1, axes_dims=[32, 32, 32] if gpu else [8, 12, 12],
                   axes_lens=[300, 512, 512], rope_theta=10000.0)
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    # Gemma's mask is all ones (no padding): model_base turns it into num_tokens (0.3.64 needs it)
    pos = [[torch.randn(1, n, cfg["cap_feat_dim"], generator=g), {"attention_mask": _text_mask(n, n)}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.15)


@family("ZImage")
def zimage_omni(cls, gpu):
    """Z-Image (Omni) as TextEncodeZImageOmni feeds it: a reference latent, its SigLIP features and the template's
    extra text, each refined and joined before the main layers; the references on timestep zero. Tokens padded to
    multiples of 32. Z-Image's modulation needs a width >= 256 (its adaLN is 256 wide): head dim 128 on the CPU too
    (the configuration's ``dim`` 3840 is replaced by 256)."""
    import types

    from comfy.ldm.lumina.model import NextDiT

    sig = 64 if gpu else 32
    cfg = _nextdit(gpu, NextDiT, head=128, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
                   ffn_dim_multiplier=1.0, z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32,
                   siglip_feat_dim=sig)
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    px = 16 * (16 if gpu else 4)  # SigLIP: 16-pixel patches
    vision = types.SimpleNamespace(image_sizes=[(1, px, px)],
                                   last_hidden_state=torch.randn(1, (px // 16) ** 2, sig, generator=g))
    extra_text = [torch.randn(1, 4, cfg["cap_feat_dim"], generator=g) for _ in range(2)]
    ctx = torch.randn(1, n, cfg["cap_feat_dim"], generator=g)
    pos = [[ctx, {"reference_latents": [torch.randn(1, 16, hw, hw, generator=g)], "clip_vision_outputs": [vision],
                  "reference_latents_text_embeds": extra_text}]]
    # the negative prompt is encoded without the images (ComfyUI's own model code cannot batch the two: the extra
    # text embeds are laid out for batch 1)
    neg = [[torch.zeros_like(ctx), {}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, negative=neg, init_std=0.06 if gpu else 0.1,
                 notes="omni edit: reference latent + SigLIP tokens + template text; pad_tokens_multiple 32")


@family("ZImagePixelSpace")
def zimage_pixel(cls, gpu):
    """Z-Image in pixel space: 16x16 RGB patches into the NextDiT trunk, a per-patch MLP decoder after it (width 256,
    head dim 128, as for Z-Image)."""
    from comfy.ldm.lumina.model import NextDiTPixelSpace

    cfg = dict(patch_size=16, in_channels=3, dim=256, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
               multiple_of=32, ffn_dim_multiplier=1.0, qk_norm=True, cap_feat_dim=64 if gpu else 32,
               axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
               z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32, decoder_hidden_size=64 if gpu else 32,
               decoder_num_res_blocks=1, decoder_max_freqs=4)
    del NextDiTPixelSpace  # its __init__ forwards **kwargs to NextDiT: every key above is NextDiT's or the decoder's
    g = _g()
    n = 128 if gpu else 8
    px = 16 * (16 if gpu else 4)
    pos = [[torch.randn(1, n, cfg["cap_feat_dim"], generator=g), {}]]
    return _case(unet_config=cfg, latent=(1, 3, px, px), positive=pos, init_std=0.2)


# ---------------------------------------------------------------- PixelDiT and PiD (pixel space)

def _pixeldit(gpu: bool) -> dict:
    # real: 24 groups of 64 on the patch stream, 16 heads of 72 on the compressed pixel stream
    return dict(in_channels=3, num_groups=2, hidden_size=128 if gpu else 64, pixel_hidden_size=8,
                pixel_attn_hidden_size=144 if gpu else 64, pixel_num_groups=2, patch_depth=1, pixel_depth=1,
                patch_size=16, txt_embed_dim=64 if gpu else 32, txt_max_length=300 if gpu else 16)


@family("PixelDiTT2I")
def pixeldit(cls, gpu):
    """PixelDiT: joint text + patch attention (head dim 64), then attention over each patch's compressed pixels (head
    dim 72 on the GPU); 16-pixel patches."""
    cfg = _pixeldit(gpu)
    g = _g()
    n = 128 if gpu else 8
    px = 16 * (16 if gpu else 4)
    pos = [[torch.randn(1, n, cfg["txt_embed_dim"], generator=g), {"attention_mask": _text_mask(n, n - 2)}]]
    return _case(unet_config=cfg, latent=(1, 3, px, px), positive=pos, init_std=0.1,
                 notes="the text mask reaches model_base and is dropped by the model (its blocks pass mask=None)")


@family("PiD")
def pid(cls, gpu):
    """PiD: PixelDiT decoding / upscaling a Flux-format latent (PiDConditioning: ``lq_latent`` + ``degrade_sigma``),
    sigma-gated injections before the blocks."""
    cfg = dict(_pixeldit(gpu), lq_latent_channels=16, lq_hidden_dim=32, lq_num_res_blocks=1, lq_interval=1,
               sr_scale=4, latent_spatial_down_factor=8)
    g = _g()
    n = 128 if gpu else 8
    grid = 16 if gpu else 4  # patch grid; the LQ latent is at 1/32 of the pixels: grid / 2
    pos = [[torch.randn(1, n, cfg["txt_embed_dim"], generator=g),
            {"lq_latent": torch.randn(1, 16, grid // 2, grid // 2, generator=g), "degrade_sigma": torch.tensor([0.1])}]]
    return _case(unet_config=cfg, latent=(1, 3, 16 * grid, 16 * grid), positive=pos, init_std=0.1,
                 notes="4x upscale of a 16-channel latent")


# ---------------------------------------------------------------- OmniGen 2 and Boogu

def _omnigen(gpu: bool, model_cls, heads: int, **over) -> dict:
    # real: head dim 120 (OmniGen 2: 21 heads over 7 kv heads; Boogu: 28 over 7); GQA through enable_gqa on 0.33
    head = 120 if gpu else 32
    cfg = dict(patch_size=2, in_channels=16, hidden_size=heads * head, num_layers=1, num_refiner_layers=1,
               num_attention_heads=heads, num_kv_heads=1, multiple_of=32, norm_eps=1e-5,
               axes_dim_rope=[40, 40, 40] if gpu else [8, 12, 12], axes_lens=[1024, 1664, 1664], timestep_scale=1000.0)
    cfg.update(over)
    return _kw(model_cls.__init__, cfg)


def _omnigen_case(cfg, feat: str, gpu: bool, **kw):
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    # the text encoder's mask is all ones (no padding): model_base turns it into ``num_tokens`` only
    pos = [[torch.randn(1, n, cfg[feat], generator=g), {"attention_mask": _text_mask(n, n),
                                                        "reference_latents": [torch.randn(1, 16, hw, hw, generator=g)]}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, **kw)


@family("Omnigen2")
def omnigen2_edit(cls, gpu):
    """OmniGen 2 editing (a ReferenceLatent): text and image refiners, then joint layers; GQA 3:1 on the GPU (2:1 on
    the CPU). Its Qwen2.5-VL text is never padded: model_base reads the all-ones mask as a token count only."""
    from comfy.ldm.omnigen.omnigen2 import OmniGen2Transformer2DModel

    cfg = _omnigen(gpu, OmniGen2Transformer2DModel, 3 if gpu else 2, text_feat_dim=64 if gpu else 32)
    return _omnigen_case(cfg, "text_feat_dim", gpu, init_std=0.06 if gpu else 0.1, notes="edit: one reference latent")


@family("Boogu")
def boogu_edit(cls, gpu):
    """Boogu-Image (OmniGen 2 with a dual-stream instruction stage before the joint layers), editing one reference."""
    from comfy.ldm.boogu.model import BooguTransformer2DModel

    cfg = _omnigen(gpu, BooguTransformer2DModel, 4 if gpu else 2, num_double_stream_layers=1,
                   axes_lens=[2048, 1664, 1664], instruction_feat_dim=64 if gpu else 32)
    return _omnigen_case(cfg, "instruction_feat_dim", gpu, init_std=0.06 if gpu else 0.1,
                         notes="edit: one reference latent; GQA 4:1 on the GPU")


@family("Krea2")
def krea2(cls, gpu):
    """Krea 2: a single-stream DiT over [text; image]; its text is a stack of Qwen3-VL layers fused by attention per
    layer (batch x layers sequences), then across; GQA repeated before the calls (real: 48 heads over 12)."""
    if gpu:
        cfg = dict(features=256, heads=2, kvheads=1, txtdim=256, txtheads=2, txtkvheads=1, txtlayers=3)
    else:
        cfg = dict(features=64, heads=2, kvheads=1, txtdim=32, txtheads=2, txtkvheads=1, txtlayers=3)
    cfg.update(tdim=64, multiplier=2, layers=1, patch=2, channels=16)
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    pos = [[torch.randn(1, n, cfg["txtlayers"] * cfg["txtdim"], generator=g), {}]]
    return _case(unet_config=cfg, latent=(1, 16, 1, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1)


@family("Lens")
def lens(cls, gpu):
    """Microsoft Lens: dual-stream MMDiT on 128-channel Flux.2 latents, GPT-OSS text from several layers (concatenated
    per token), an additive joint mask built from the text mask on every call (float32 min: -inf once cast to bf16)."""
    L = 4 if gpu else 2
    cfg = dict(patch_size=2, in_channels=128, out_channels=32, num_layers=1, attention_head_dim=64 if gpu else 32,
               num_attention_heads=2, enc_hidden_dim=64 if gpu else 32, axes_dims_rope=[8, 28, 28] if gpu else [8, 12, 12],
               multi_layer_encoder_feature=True, selected_layer_index=tuple(range(L)))
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4  # 1 token per latent pixel: 256 / 16 image tokens
    pos = [[torch.randn(1, n, L * cfg["enc_hidden_dim"], generator=g), {"attention_mask": _text_mask(n, n - 3)}]]
    return _case(unet_config=cfg, latent=(1, 128, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="text padding mask -> additive joint mask [B, 1, 1, Nimg+Ntxt]")


@family("Kandinsky5Image")
def kandinsky5_image(cls, gpu):
    """Kandinsky 5 Image Lite: text self-attention blocks, then visual blocks with self-attention over all patches and
    cross-attention to the text; CLIP pooled vector (required). The text mask reaches model_base and the model ignores
    it. The configuration's ``model_dim`` 2560 is replaced by the tiny width (head dim 128 on the GPU, as real)."""
    cfg = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=64 if gpu else 32, in_text_dim2=32, time_dim=64,
               model_dim=256 if gpu else 64, ff_dim=256 if gpu else 128, visual_embed_dim=64, patch_size=(1, 2, 2),
               num_text_blocks=1, num_visual_blocks=1, axes_dims=(32, 48, 48) if gpu else (8, 12, 12),
               rope_scale_factor=(1.0, 1.0, 1.0))
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    pos = [[torch.randn(1, n, cfg["in_text_dim"], generator=g),
            {"pooled_output": torch.randn(1, 32, generator=g), "attention_mask": _text_mask(n, n - 2)}]]
    return _case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1)


@family("Anima")
def anima(cls, gpu):
    """Anima: a Cosmos Predict2 DiT whose text is Qwen3-0.6B hidden states turned into T5-like embeddings by an LLM
    adapter over the prompt's T5 ids (a fixed 1024-wide, 6-block transformer ComfyUI builds whatever the tiny sizes),
    padded to 512 cross-attention tokens."""
    cfg = dict(max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16, patch_spatial=2,
               patch_temporal=1, concat_padding_mask=True, model_channels=256 if gpu else 64, num_blocks=1, num_heads=2,
               mlp_ratio=2.0, crossattn_emb_channels=1024, pos_emb_cls="rope3d", pos_emb_learnable=True,
               pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=32,
               rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
               extra_per_block_abs_pos_emb=False, rope_enable_fps_modulation=False)
    g = _g()
    n = 128 if gpu else 8
    hw = 32 if gpu else 8
    t5 = 24 if gpu else 11  # the prompt's T5 tokens: the adapter's queries (its output is padded to 512)
    ids = torch.randint(0, 32128, (t5,), generator=g)
    pos = [[torch.randn(1, n, 1024, generator=g), {"t5xxl_ids": ids, "t5xxl_weights": torch.ones(t5)}]]
    outside = ("some: the LLM adapter (comfy/ldm/anima/model.py Attention.forward) calls "
               "torch.nn.functional.scaled_dot_product_attention directly")
    return _case(unet_config=cfg, latent=(1, 16, 1, hw, hw), positive=pos, outside_hook=outside,
                 init_std=0.06 if gpu else 0.1, notes="cross-attention keys: 512 (the adapter's output, padded)")


@family("ErnieImage")
def ernie_image(cls, gpu):
    """ERNIE-Image: one stream over [image; text] on 128-channel Flux.2 latents (head dim 128 real)."""
    cfg = dict(hidden_size=256 if gpu else 64, num_attention_heads=2, num_layers=1, ffn_hidden_size=256 if gpu else 128,
               in_channels=128, out_channels=128, patch_size=1, text_in_dim=64 if gpu else 32,
               rope_axes_dim=(32, 48, 48) if gpu else (8, 12, 12))
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4
    pos = [[torch.randn(1, n, cfg["text_in_dim"], generator=g), {}]]
    outside = ("all: comfy/ldm/ernie/model.py ErnieImageAttention.forward calls optimized_attention without "
               "transformer_options")
    return _case(unet_config=cfg, latent=(1, 128, hw, hw), positive=pos, outside_hook=outside,
                 init_std=0.06 if gpu else 0.1)


# ---------------------------------------------------------------- HunyuanImage 2.1 (HunyuanVideo's model, 2-D)

def _hy(gpu: bool, **over) -> dict:
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    cfg = dict(in_channels=64, out_channels=64, vec_in_dim=None, context_in_dim=64 if gpu else 32,
               hidden_size=256 if gpu else 64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
               axes_dim=[64, 64] if gpu else [16, 16], theta=256, patch_size=[1, 1], qkv_bias=True,
               guidance_embed=True, byt5=True, meanflow=True, use_cond_type_embedding=False, vision_in_dim=None,
               meanflow_sum=False)
    cfg.update(over)
    return _fields(HunyuanVideoParams, cfg)


@family("HunyuanImage21")
def hunyuan_image21(cls, gpu):
    """HunyuanImage 2.1 (distilled: meanflow time_r, guidance): a token refiner over the Qwen2.5-VL text, ByT5 glyph
    tokens (a quoted text in the prompt) after it. No text mask: the encoder drops an all-ones mask, and ComfyUI's
    model code cannot take a padding mask together with ByT5 tokens (the mask covers the Qwen tokens only)."""
    cfg = _hy(gpu)
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4  # 32x-compressed latent, 1x1 patches
    pos = [[torch.randn(1, n, cfg["context_in_dim"], generator=g),
            {"conditioning_byt5small": torch.randn(1, 6, 1472, generator=g), "guidance": 3.5}]]
    return _case(unet_config=cfg, latent=(1, 64, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="ByT5 glyph tokens, meanflow")


@family("HunyuanImage21Refiner")
def hunyuan_image21_refiner(cls, gpu):
    """HunyuanImage 2.1's refiner as Hunyuan Latent Refiner feeds it: the base image's latent as
    ``concat_latent_image``, concatenated to the 64-channel latent; 1x1x1 patches, time_r disabled by model_base."""
    import comfy.latent_formats

    cfg = _hy(gpu, in_channels=128, patch_size=[1, 1, 1], axes_dim=[16, 56, 56] if gpu else [8, 12, 12], byt5=False,
              meanflow=False)
    # 0.33's refiner latent format packs the 32-channel VAE latent (two frames' channels into one); 0.3.64 takes a
    # 64-channel latent as it is
    packs = "process_in" in vars(comfy.latent_formats.HunyuanImage21Refiner)
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4
    pos = [[torch.randn(1, n, cfg["context_in_dim"], generator=g),
            # noise augmentation draws from the sampler's seed, which ComfyUI's cond encoding lets a cond key replace
            {"concat_latent_image": torch.randn(1, 32 if packs else 64, 1, hw, hw, generator=g), "noise_augmentation": 0.1,
             "seed": 10,
             "guidance": 3.5}]]
    return _case(unet_config=cfg, latent=(1, 64, 1, hw, hw), positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="refining a base latent (concat_latent_image, noise augmentation 0.1)")


@family("Ideogram4")
def ideogram4(cls, gpu):
    """Ideogram 4: one stream over [text; image] with Qwen3-VL interleaved MRoPE; the text's padding becomes a
    block-diagonal boolean segment mask turned additive (-max) for every layer. The configuration forces its real sizes
    (18 heads of 256, a 53248-wide text input) through unet_extra_config: replaced here (head dim 256 on the GPU)."""
    if gpu:
        extra = dict(num_attention_heads=2, attention_head_dim=256, intermediate_size=512, adaln_dim=64,
                     llm_features_dim=128, mrope_section=[24, 20, 20])
    else:
        extra = dict(num_attention_heads=2, attention_head_dim=32, intermediate_size=128, adaln_dim=32,
                     llm_features_dim=32, mrope_section=[6, 5, 5])
    g = _g()
    n = 128 if gpu else 8
    hw = 16 if gpu else 4  # 128-channel Flux.2 latent: one token per latent pixel
    pos = [[torch.randn(1, n, extra["llm_features_dim"], generator=g), {"attention_mask": _text_mask(n, n - 3)}]]
    return _case(unet_config={"in_channels": 128, "num_layers": 1}, unet_extra_config=extra, latent=(1, 128, hw, hw),
                 positive=pos, init_std=0.06 if gpu else 0.1,
                 notes="text padding -> block-diagonal segment mask [B, 1, L, L] (additive -finfo.max)")
