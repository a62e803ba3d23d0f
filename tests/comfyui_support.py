"""Find and import a real ComfyUI for the integration tiers; build tiny models from its own classes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import pytest
import torch
from absent import stand_in_if_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def counting_exchanges(mod):
    """The rank of every attention call exchanged over ranks while inside (a list growing as they come), both ways:
    made at the attention call (``RankContext.attention``) and sent as the model makes q, k and v
    (``RankContext.staged``)."""
    cls = mod.parallel.context.RankContext
    counts, real = [], (cls.attention, cls.staged)

    def counted(method):
        def call(self, *a, **k):
            counts.append(self.rank)
            return method(self, *a, **k)
        return call

    cls.attention, cls.staged = (counted(m) for m in real)
    try:
        yield counts
    finally:
        cls.attention, cls.staged = real


def skip_transformer_options(guard_entries):
    """The TorchCompileModel node's guard filter (comfy_extras/nodes_torch_compile.py ``skip_torch_compile_dict``, whose
    module needs ComfyUI's API packages): no guard on anything reached through ``transformer_options``."""
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def compiled_as_the_node(model, backend="inductor"):
    """A clone of ``model`` under ComfyUI's compile wrapper with the TorchCompileModel node's options (its guard filter,
    :func:`skip_transformer_options`).  ``backend``: inductor, or a callable backend."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    m = model.clone()
    set_torch_compile_wrapper(m, backend=backend, options={"guard_filter_fn": skip_transformer_options})
    return m


def step_cache(model, node: str, threshold: float):
    """``model`` through ComfyUI's own EasyCache or LazyCache node (``node``), with ``threshold`` and the nodes' default
    start and end (0.15, 0.95)."""
    stand_in_if_missing("av")  # its module imports ComfyUI's video types (PyAV), unused here
    import comfy_extras.nodes_easycache as ec

    out = getattr(ec, f"{node}Node").execute(model, threshold, 0.15, 0.95, False)
    return out.result[0] if hasattr(out, "result") else out[0]


def find_comfyui() -> str | None:
    """COMFYUI_PATH, else the ComfyUI this pack is cloned into (``ComfyUI/custom_nodes/<pack>``)."""
    env = os.environ.get("COMFYUI_PATH")
    if env:
        return env if os.path.exists(os.path.join(env, "comfy")) else None
    parent = os.path.dirname(ROOT)
    if os.path.basename(parent) == "custom_nodes":
        base = os.path.dirname(parent)
        if os.path.exists(os.path.join(base, "comfy")) and os.path.exists(os.path.join(base, "main.py")):
            return base
    return None


_state = {}


def comfy():
    """Import ComfyUI (CPU mode) once, or skip the test with the reason."""
    if "error" in _state:
        pytest.skip(_state["error"])
    if "path" in _state:
        return _state["path"]
    path = find_comfyui()
    if path is None:
        _state["error"] = ("no ComfyUI found: set COMFYUI_PATH to a ComfyUI checkout (v0.3.64+) whose requirements are "
                           "installed in this Python, or clone this pack into ComfyUI/custom_nodes")
        pytest.skip(_state["error"])
    # ComfyUI's top-level modules (nodes, comfy, folder_paths) must win over this pack's own `nodes/` package.
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    if "nodes" in sys.modules and not getattr(sys.modules["nodes"], "__file__", "").startswith(path):
        del sys.modules["nodes"]
    try:
        from comfy.cli_args import args

        args.cpu = True
        # ComfyUI's `nodes` puts comfy/ first on sys.path, where comfy/utils.py would then shadow ComfyUI's top-level
        # `utils` package; main.py imports that package before `nodes`, so do the same.
        import comfy.model_management  # noqa: F401
        import comfy.sample  # noqa: F401
        import utils.install_util  # noqa: F401

        import nodes  # noqa: F401
    except ImportError as e:
        _state["error"] = f"ComfyUI at {path} does not import in this Python ({e}); pip install -r {path}/requirements.txt"
        pytest.skip(_state["error"])
    _state["path"] = path
    return path


def load_pack():
    """Load this pack through ComfyUI's own loader; returns (module, node class mappings)."""
    comfy()
    import nodes

    if "pack" not in _state:
        ok = asyncio.run(nodes.load_custom_node(ROOT))
        assert ok, "ComfyUI's load_custom_node refused the pack"
        _state["pack"] = sys.modules[ROOT.replace(".", "_x_")]
    return _state["pack"], nodes.NODE_CLASS_MAPPINGS


def _init(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def patcher(model):
    import comfy.model_patcher

    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


FLUX_CFG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64,
                mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
                qkv_bias=True, guidance_embed=False)

SD_CFG = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
          "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
          "transformer_depth_output": [1, 1, 1, 1], "channel_mult": [1, 2], "transformer_depth_middle": 1,
          "use_linear_in_transformer": False, "context_dim": 32, "num_heads": 8, "num_head_channels": -1,
          "use_temporal_attention": False, "use_temporal_resblock": False}


def flux_config(cfg=None) -> dict:
    """A Flux.1 config for the ComfyUI in use: 0.33 made ``txt_ids_dims`` a required field ([] for Flux.1)."""
    import dataclasses

    from comfy.ldm.flux.model import FluxParams

    cfg = dict(FLUX_CFG if cfg is None else cfg)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
        cfg.setdefault("txt_ids_dims", [])
    return cfg


def release() -> str:
    """The version of the ComfyUI the tests run on (its comfyui_version.py)."""
    try:
        from comfyui_version import __version__

        return __version__
    except ImportError:
        return "unknown"


def tiny_flux(dtype=torch.float32):
    """A 2-layer Flux built from ComfyUI's own classes (head dim 32), random weights."""
    import comfy.supported_models as sm

    mc = sm.Flux(flux_config())
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, device="cpu")
    _init(model)
    return patcher(model)


def tiny_sd(dtype=torch.float32):
    """An SD1.5-style UNet from ComfyUI's classes with head dims 40 and 80 (as SD1.5 has), random weights."""
    import comfy.supported_models as sm

    mc = sm.SD15(dict(SD_CFG))
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, device="cpu")
    _init(model, 1)
    return patcher(model)


def tiny_vae_state_dict(latent_channels=16, seed=0) -> dict:
    """A TAESD (ComfyUI's own tiny autoencoder classes) for ``latent_channels``-channel latents, random weights: what
    ``comfy.sd.VAE`` and the VAELoader node read (x8 upscale, RGB in [0, 1])."""
    import comfy.taesd.taesd as taesd

    m = taesd.TAESD(latent_channels=latent_channels)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():  # ComfyUI's layers skip initialisation: fill every parameter
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            else:
                p.fill_(1.0 if name == "vae_scale" else 0.0)
    return {k: v.contiguous() for k, v in m.state_dict().items()}


def tiny_vae(latent_channels=16, seed=0):
    """:func:`tiny_vae_state_dict` as a ComfyUI VAE object (``vae.decode(latent)`` -> ``[B, H, W, 3]``)."""
    import comfy.sd

    return comfy.sd.VAE(sd=tiny_vae_state_dict(latent_channels, seed))


def flux_conds(seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, 8, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    neg = [[torch.zeros(1, 8, 32), {"pooled_output": torch.zeros(1, 32)}]]
    return pos, neg


def sd_conds(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 77, 32, generator=g), {}]], [[torch.zeros(1, 77, 32), {}]]


def sample(model, kind="flux", steps=4, cfg=1.0, seed=1):
    import comfy.sample

    ch = 16 if kind == "flux" else 4
    latent = torch.zeros(1, ch, 16, 16)
    noise = torch.randn(1, ch, 16, 16, generator=torch.Generator().manual_seed(seed))
    pos, neg = flux_conds() if kind == "flux" else sd_conds()
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, latent, disable_pbar=True)
