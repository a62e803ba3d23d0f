"""Test-only ComfyUI nodes for the server tier: a tiny Flux loader and random conditioning.

Loaded by tests/test_comfyui_server.py from a temporary custom_nodes folder; never installed for users.
"""

import json

import torch


class PATestTinyFluxLoader:
    """Loads a tiny random-weight Flux (config in the safetensors metadata) with ComfyUI's own classes."""

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        return {"required": {"unet_name": (folder_paths.get_filename_list("diffusion_models"),)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "_for_testing"

    def load(self, unet_name):
        import comfy.model_management as mm
        import comfy.model_patcher
        import comfy.supported_models as sm
        import comfy.utils
        import folder_paths
        from safetensors import safe_open

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        with safe_open(path, "pt") as f:
            cfg = json.loads(f.metadata()["flux_config"])
        sd = comfy.utils.load_torch_file(path)
        import dataclasses

        from comfy.ldm.flux.model import FluxParams

        if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:  # ComfyUI 0.33: required ([] for Flux.1)
            cfg.setdefault("txt_ids_dims", [])
        mc = sm.Flux(cfg)
        mc.set_inference_dtype(torch.float32, None)
        model = mc.get_model({}, device="cpu")
        model.diffusion_model.load_state_dict(sd)
        dev = mm.get_torch_device()
        return (comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=mm.unet_offload_device()),)


class PATestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31}), "tokens": ("INT", {"default": 8, "min": 1}),
                             "context_dim": ("INT", {"default": 32, "min": 1}), "pooled_dim": ("INT", {"default": 32, "min": 1})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "_for_testing"

    def make(self, seed, tokens, context_dim, pooled_dim):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, context_dim, generator=g), {"pooled_output": torch.randn(1, pooled_dim, generator=g)}]],)


NODE_CLASS_MAPPINGS = {"PATestTinyFluxLoader": PATestTinyFluxLoader, "PATestConditioning": PATestConditioning}
