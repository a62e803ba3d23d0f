"""The model zoo's core: a tiny instance of a diffusion-model configuration ComfyUI ships, built through ComfyUI's own
config -> ``model_base`` -> ``comfy.ldm`` path, and sampled with the conditioning its family gets in a real workflow.

A family module registers one builder per group of configurations::

    @family("WAN21_T2V", "WAN22_T2V")
    def wan_t2v(cls, gpu):
        return Case(unet_config={...tiny sizes...}, latent=(1, 16, 2, 8, 8), positive=[[ctx, {}]])

``cls`` is the configuration class (``comfy.supported_models.<name>``), ``gpu`` asks for the GPU zoo's sizes (bf16 on
the kernels: at least 128 query and key tokens where the family allows, its real head dims). A configuration the zoo
cannot build is declared with :func:`unbuilt` and the reason: the zoo lists it, it never skips one in silence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Case:
    """One configuration's tiny model and what a workflow samples it with."""

    unet_config: dict  # tiny sizes; merged over the configuration's own ``unet_config`` (the keys it matches on)
    latent: tuple  # shape of the latent (and of the noise); a tuple of shapes: a nested latent (TripoSplat's latent + camera)
    positive: list  # ComfyUI conditioning: [[cross-attention tensor, {extras: pooled_output, attention_mask, ...}], ...]
    negative: list | None = None  # None: the positive's shapes, zeroed (what an empty negative prompt gives)
    cfg: float = 2.0
    steps: int = 2
    sampler: str = "euler"
    scheduler: str = "simple"
    # Attention calls that ComfyUI's model code makes without ``transformer_options`` never reach the attention hook:
    # "" (none), "some: <why>" (e.g. a text refiner), "all: <why>" (the model's attention never reaches it).
    outside_hook: str = ""
    patch: Callable | None = None  # (ModelPatcher) -> ModelPatcher before sampling: a ControlNet, a LoRA, ...
    init_std: float = 0.05  # random weights ~ N(0, init_std)
    # Norm layers' scales (weight/gamma/scale of a module whose class name says Norm, q/k norms included) ~ 1 + N(0, this)
    # instead: at N(0, init_std) they shrink q and k so far that attention is uniform and a wrong kernel goes unseen.
    norm_init: float | None = None
    seed: int = 0
    notes: str = ""
    extra: dict = field(default_factory=dict)
    # A checkpoint's other entries: what the configuration's ``get_model`` loads besides the diffusion model (Stable
    # Audio's seconds embedders; only keys and shapes matter, every parameter is drawn afterwards), and under
    # "model.diffusion_model." what is loaded into the diffusion model after the draw (buffers it leaves empty).
    state_dict: dict = field(default_factory=dict)


BUILDERS: dict[str, Callable[[type, bool], Case]] = {}
UNBUILT: dict[str, str] = {}  # configuration name -> why the zoo cannot build it yet


def family(*names: str):
    """Register a builder ``(cls, gpu) -> Case`` for the configurations ``names``."""

    def deco(fn):
        for n in names:
            if n in BUILDERS:
                raise ValueError(f"zoo: {n} has two builders ({BUILDERS[n].__name__}, {fn.__name__})")
            BUILDERS[n] = fn
        return fn

    return deco


def unbuilt(name: str, why: str) -> None:
    """A configuration the zoo does not build, and why (listed in the zoo's report)."""
    UNBUILT[name] = why


def configurations() -> list[type]:
    """Every model configuration of the ComfyUI under test (``comfy.supported_models.models``), in its order."""
    import comfy.supported_models as sm

    return list(sm.models)


UNET = "model.diffusion_model."


def build(cls: type, case: Case, dtype=torch.float32, device="cpu"):
    """A ModelPatcher over ``cls``'s model with ``case``'s tiny config and seeded random weights."""
    import comfy.model_patcher

    cfg = {**getattr(cls, "unet_config", {}), **case.unet_config}
    mc = cls(cfg)
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model(dict(case.state_dict), device=device)
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * case.init_std).to(p.dtype))
        if case.norm_init is not None:
            for mod in model.modules():
                if "norm" not in type(mod).__name__.lower():
                    continue
                for name, p in mod.named_parameters(recurse=False):
                    if name in ("weight", "gamma", "scale"):
                        p.copy_((1 + torch.randn(p.shape, generator=g) * case.norm_init).to(p.dtype))
        unet = {k[len(UNET):]: v for k, v in case.state_dict.items() if k.startswith(UNET)}
        if unet:  # what a checkpoint carries besides weights (buffers the model leaves empty, e.g. rotary frequencies)
            missing, unexpected = model.diffusion_model.load_state_dict(unet, strict=False)
            assert not unexpected, f"zoo: {cls.__name__}: no such diffusion-model keys: {unexpected}"
    dev = torch.device(device)
    off = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=off)


def zeroed(cond: list) -> list:
    """The conditioning an empty negative prompt gives: every tensor zeroed, masks and flags kept."""
    out = []
    for c, extras in cond:
        ex = {}
        for k, v in extras.items():
            ex[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) and v.is_floating_point() and "mask" not in k else v
        out.append([torch.zeros_like(c), ex])
    return out


def nested(latent) -> bool:
    """A tuple of shapes: a nested latent (several streams sampled together)."""
    return len(latent) > 0 and isinstance(latent[0], (tuple, list))


def sample(patcher, case: Case, seed: int = 1):
    """Sample ``patcher`` (already patched or not) with ``case``'s conditioning; returns the final latent (CPU, fp32).

    A nested latent comes back packed as ComfyUI's sampler packs it: ``[B, 1, all streams' elements]``. Torch's global
    generator is seeded too: ComfyUI 0.3.64 leaves diffusion models in training mode, so a model with dropout (ACE-Step's
    lyric encoder) draws from it on every step."""
    import comfy.sample

    if case.patch is not None:
        patcher = case.patch(patcher)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if nested(case.latent):
        import comfy.nested_tensor

        latent = comfy.nested_tensor.NestedTensor([torch.zeros(s) for s in case.latent])
        noise = comfy.nested_tensor.NestedTensor([torch.randn(s, generator=g) for s in case.latent])
    else:
        latent = torch.zeros(case.latent)
        noise = torch.randn(case.latent, generator=g)
    neg = case.negative if case.negative is not None else zeroed(case.positive)
    out = comfy.sample.sample(patcher, noise, case.steps, case.cfg, case.sampler, case.scheduler, case.positive, neg,
                              latent, disable_pbar=True)
    if getattr(out, "is_nested", False):
        import comfy.utils

        out = comfy.utils.pack_latents(out.unbind())[0]
    return out.float().cpu()


def with_(case: Case, **kw) -> Case:
    return dataclasses.replace(case, **kw)
