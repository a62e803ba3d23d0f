"""The end-to-end benchmark's model presets: ComfyUI's own model classes at full size with random weights.

:data:`MODEL_PRESETS` (bench_e2e.py's ``--preset``, the GPU runner's stages) names one :class:`ModelPreset` each;
:func:`build_preset` makes a :class:`.e2e.Job` of it, on ComfyUI's plain model patcher or, as ComfyUI 0.33 loads a
model file, on its dynamic-VRAM one (:func:`enable_dynamic_vram`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from .e2e import Job

SD15 = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
        "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
        "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
        "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
        "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "use_temporal_attention": False,
        "use_temporal_resblock": False}
SDXL = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
        "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 320,
        "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
        "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048, "num_head_channels": 64,
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "use_temporal_attention": False,
        "use_temporal_resblock": False}
FLUX_DEV = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
            "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
            "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
WAN = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
       "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "out_dim": 16}
WAN_1_3B = {**WAN, "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30}
WAN_14B = {**WAN, "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40}
QWEN_IMAGE = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}  # 20B: 24 heads of 128, text 3,584 wide


@dataclass(frozen=True)
class ModelPreset:
    """One model at one size, as the benchmark samples it."""

    model_class: str  # the class in comfy.supported_models
    unet: dict  # its model config
    latent: tuple  # the latent's shape
    context: tuple  # the text conditioning's shape
    pooled: int | None  # the pooled conditioning's width (None: the model takes none)
    cfg: float
    description: str
    extra: dict = field(default_factory=dict)  # further conditioning keys (SDXL's size conditioning)


SDXL_SIZE = {"width": 1024, "height": 1024, "target_width": 1024, "target_height": 1024}

MODEL_PRESETS = {
    "sd15": ModelPreset("SD15", SD15, (1, 4, 64, 64), (1, 77, 768), None, 7.0, "SD1.5, 512x512, CFG batch"),
    "sdxl": ModelPreset("SDXL", SDXL, (1, 4, 128, 128), (1, 77, 2048), 1280, 7.0, "SDXL, 1024x1024, CFG batch",
                        SDXL_SIZE),
    "flux-dev": ModelPreset("Flux", FLUX_DEV, (1, 16, 128, 128), (1, 512, 4096), 768, 1.0,
                            "Flux-dev, 1024x1024, guidance 3.5"),
    "wan-1.3b": ModelPreset("WAN21_T2V", WAN_1_3B, (1, 16, 21, 60, 104), (1, 512, 4096), None, 5.0,
                            "Wan 2.1 1.3B t2v, 480p (832x480), 81 frames, CFG batch"),
    "wan-14b": ModelPreset("WAN21_T2V", WAN_14B, (1, 16, 21, 60, 104), (1, 512, 4096), None, 5.0,
                           "Wan 2.1 14B t2v, 480p (832x480), 81 frames, CFG batch"),
    "wan-1.3b-720p": ModelPreset("WAN21_T2V", WAN_1_3B, (1, 16, 21, 90, 160), (1, 512, 4096), None, 5.0,
                                 "Wan 2.1 1.3B t2v, 720p (1280x720), 81 frames, CFG batch"),
    "wan-14b-720p": ModelPreset("WAN21_T2V", WAN_14B, (1, 16, 21, 90, 160), (1, 512, 4096), None, 5.0,
                                "Wan 2.1 14B t2v, 720p (1280x720), 81 frames, CFG batch"),
    "wan-1.3b-33f": ModelPreset("WAN21_T2V", WAN_1_3B, (1, 16, 9, 60, 104), (1, 512, 4096), None, 5.0,
                                "Wan 2.1 1.3B t2v, 480p, 33 frames, CFG batch"),
    "wan-14b-33f": ModelPreset("WAN21_T2V", WAN_14B, (1, 16, 9, 60, 104), (1, 512, 4096), None, 5.0,
                               "Wan 2.1 14B t2v, 480p, 33 frames, CFG batch"),
    "qwen-image": ModelPreset("QwenImage", QWEN_IMAGE, (1, 16, 1, 166, 166), (1, 256, 3584), None, 1.0,
                              "Qwen-Image, 1328x1328, CFG 1"),
    # sizes between what splits and what does not (the Context Parallel node's floor)
    "wan-1.3b-49f": ModelPreset("WAN21_T2V", WAN_1_3B, (1, 16, 13, 60, 104), (1, 512, 4096), None, 5.0,
                                "Wan 2.1 1.3B t2v, 480p, 49 frames, CFG batch"),
    "wan-1.3b-65f": ModelPreset("WAN21_T2V", WAN_1_3B, (1, 16, 17, 60, 104), (1, 512, 4096), None, 5.0,
                                "Wan 2.1 1.3B t2v, 480p, 65 frames, CFG batch"),
    "wan-14b-17f": ModelPreset("WAN21_T2V", WAN_14B, (1, 16, 5, 60, 104), (1, 512, 4096), None, 5.0,
                               "Wan 2.1 14B t2v, 480p, 17 frames, CFG batch"),
    "wan-14b-9f": ModelPreset("WAN21_T2V", WAN_14B, (1, 16, 3, 60, 104), (1, 512, 4096), None, 5.0,
                              "Wan 2.1 14B t2v, 480p, 9 frames, CFG batch"),
    "flux-dev-768": ModelPreset("Flux", FLUX_DEV, (1, 16, 96, 96), (1, 512, 4096), 768, 1.0,
                                "Flux-dev, 768x768, guidance 3.5"),
    "flux-dev-1536": ModelPreset("Flux", FLUX_DEV, (1, 16, 192, 192), (1, 512, 4096), 768, 1.0,
                                 "Flux-dev, 1536x1536, guidance 3.5"),
    "qwen-image-1664": ModelPreset("QwenImage", QWEN_IMAGE, (1, 16, 1, 208, 208), (1, 256, 3584), None, 1.0,
                                   "Qwen-Image, 1664x1664, CFG 1"),
}

def model_config(cls, unet: dict) -> dict:
    """``unet`` for the installed ComfyUI: 0.33 made Flux's ``txt_ids_dims`` a required field ([] for Flux.1)."""
    if cls == "Flux":
        import dataclasses

        from comfy.ldm.flux.model import FluxParams

        if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
            return {"txt_ids_dims": [], **unet}
    return dict(unet)


def enable_dynamic_vram() -> None:
    """What ComfyUI 0.33's main.py does where comfy-aimdo works: dynamic (aimdo) model patchers from now on."""
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control

    if comfy.memory_management.aimdo_enabled:
        return
    comfy_aimdo.control.init()
    hb = sys.modules.get("comfy_aimdo.host_buffer")
    if hb is not None and hb.lib is None:  # imported (by comfy.model_patcher) before the library was loaded
        raise RuntimeError("comfy-aimdo's library was loaded after ComfyUI's modules were imported: call "
                           "comfy_aimdo.control.init() first, as ComfyUI's main.py does")
    if not comfy_aimdo.control.init_devices(d.index for d in mm.get_all_torch_devices()):
        raise RuntimeError("comfy-aimdo did not initialise on this machine")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def build_preset(name: str, device="cuda", dtype=torch.bfloat16, seed=0, dynamic=False) -> Job:
    """ComfyUI's model class for preset ``name`` at full size with random weights (fan-in scaled, norms at one), on
    ``device`` (``dynamic``: on ComfyUI 0.33's dynamic model patcher, see :func:`enable_dynamic_vram`)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    preset = MODEL_PRESETS[name]
    if dynamic:
        import comfy.memory_management

        if comfy.memory_management.aimdo_enabled:  # its layers would have no weights to fill (they load lazily)
            raise RuntimeError("a dynamic-VRAM preset is built before dynamic VRAM is switched on: one per process")

    def config():
        mc = getattr(sm, preset.model_class)(model_config(preset.model_class, preset.unet))
        mc.set_inference_dtype(dtype, None)
        return mc

    model = config().get_model({}, device=device)
    _fill_random(model, device, seed)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # ComfyUI's load devices name their index (comfy-aimdo needs it)
        dev = torch.device("cuda", torch.cuda.current_device())
    if dynamic:
        patcher = _dynamic_patcher(model, config, dev, name)
    else:
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)
    pos, neg = _conditioning(preset, seed)
    return Job(patcher, pos, neg, torch.zeros(preset.latent), cfg=preset.cfg, label=name,
               extra={"description": preset.description})


def _fill_random(model, device, seed: int) -> None:
    """Random weights, fan-in scaled; norms' weights and scales at one, biases at zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(fan_in ** -0.5))
            elif pname.endswith("weight") or pname.endswith("scale"):
                p.fill_(1.0)
            else:
                p.zero_()


def _dynamic_patcher(model, config, dev, name: str):
    """As ComfyUI loads a model file: its weights memory-mapped by comfy-aimdo, streamed to the GPU."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils

    sd = {k: t.to("cpu") for k, t in model.diffusion_model.state_dict().items()}
    del model
    path = os.path.join(tempfile.mkdtemp(prefix="pa-e2e-"), f"{name}.safetensors")
    comfy.utils.save_torch_file(sd, path)
    del sd
    enable_dynamic_vram()
    sd = comfy.utils.load_torch_file(path)  # what comfy.sd.load_diffusion_model_state_dict does, without detection
    model = config().get_model(sd, "")
    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=dev, offload_device=mm.unet_offload_device())
    model.load_model_weights(sd, "", assign=True)
    return patcher


def _conditioning(preset: ModelPreset, seed: int):
    """(positive, negative): random text conditioning, the pooled output and the preset's further keys."""
    gc = torch.Generator().manual_seed(seed + 1)
    extra = {}
    if preset.pooled:
        extra["pooled_output"] = torch.randn(1, preset.pooled, generator=gc)
    extra.update(preset.extra)
    # a text negative prompt, as these models' workflows use (a zeroed one makes SageAttention return NaN: the
    # redo that Patch Attention then runs is a correctness path, measured in the contract matrix, not here)
    pos = [[torch.randn(preset.context, generator=gc), dict(extra)]]
    neg = [[torch.randn(preset.context, generator=gc),
            {k: (torch.randn_like(v) if torch.is_tensor(v) else v) for k, v in extra.items()}]]
    return pos, neg
