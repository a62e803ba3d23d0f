"""comfy-kitchen's attention kernels: INT8 attention (``int8_attention``) and Sol-Attn sparse attention (``sol_attn``).

``kitchen_int8`` is the kernel ComfyUI's Model Attention Backend node installs ("comfy kitchen attention").
``kitchen_sol`` and ``kitchen_sol_topk`` are the kernel of ComfyUI's Model Sparse Attention node (Nov 2026): each
64-token query block attends a routed subset of key blocks exactly and the rest through one pooled term per block.
``kitchen_sol`` routes by a training-free threshold ``tau`` (in sigmas of the block's proxy row; higher: sparser);
``kitchen_sol_topk`` keeps a fixed share ``keep_ratio`` of key blocks per query block (SLA, what SLA-distilled LoRAs
expect).  ``extra_tokens`` (0 or a multiple of 64 up to 256) routes that many more top-scoring tokens per query block
exactly.  The defaults are the node's: tau 1.3, keep 10 %, 256 extra tokens, and no sparse attention below 12288
tokens (``min_tokens``: dense attention is faster there).  ``sol_attn`` is in comfy-kitchen 0.2.40 and later;
ComfyUI 0.33 pins 0.2.31, which has none (install.py never changes the version ComfyUI pins).
"""

from __future__ import annotations

import torch

from ..constraints import (
    DeviceTypes,
    DTypes,
    GroupedQuery,
    HeadDims,
    Masks,
    MinSeqLen,
    SameHeadDimV,
    SameSeqLen,
)
from ..registry import REGISTRY, Availability, Backend, check_bounded_options, import_probe

SOL_DEFAULTS = {"tau": 1.3, "extra_tokens": 256, "min_tokens": 12288}
SOL_TOPK_DEFAULTS = {"keep_ratio": 0.1, "extra_tokens": 256, "min_tokens": 12288}
SOL_BOUNDS = {"tau": (0.0, 4.0), "keep_ratio": (0.005, 0.95), "extra_tokens": (0, 256), "min_tokens": (0, 1 << 20)}
SOL_MIN_VERSION = "0.2.40"


def _kitchen(q, k, v, *, layout, mask, scale, opts):
    import comfy_kitchen

    return comfy_kitchen.int8_attention(q, k, v, scale=scale, attn_mask=mask)


def _probe():
    av = import_probe("comfy_kitchen", attr="int8_attention")()
    if not av.ok:
        return av
    import comfy_kitchen

    if torch.cuda.is_available() and not comfy_kitchen.int8_attention_is_available():
        return Availability(False, f"comfy-kitchen {av.version}: its CUDA int8 attention extension did not load")
    return av


def check_sol_options(opts: dict) -> dict:
    """Sol-Attn options checked: unknown names and values out of range are a ValueError."""
    out = check_bounded_options(opts, SOL_BOUNDS, "Sol-Attn")
    if "extra_tokens" in out and int(out["extra_tokens"]) % 64:
        raise ValueError(f"Sol-Attn extra_tokens={out['extra_tokens']}: use 0 or a multiple of 64 up to 256")
    return out


def _sol(defaults: dict, topk: bool):
    def fn(q, k, v, *, layout, mask, scale, opts):
        import comfy_kitchen

        o = {**defaults, **opts} if opts else defaults
        # q/k/v are (B, T, H, 128) views (Flux's [B, H, N, D] calls come transposed: the kernel reads through strides)
        return comfy_kitchen.sol_attn(q, k, v, tau=float(o.get("tau", 1.3)), scale=scale,
                                      topk_ratio=float(o["keep_ratio"]) if topk else 0.0,
                                      token_aug=int(o["extra_tokens"]))

    return fn


def _min_tokens(spec, opts):
    n = int(opts.get("min_tokens", SOL_DEFAULTS["min_tokens"]))
    return f"{spec.q_len} tokens < min_tokens {n} (dense attention is faster there)" if spec.q_len < n else None


def _sol_probe():
    av = import_probe("comfy_kitchen")()
    if not av.ok:
        return av
    import comfy_kitchen

    if not hasattr(comfy_kitchen, "sol_attn"):
        return Availability(False, f"comfy-kitchen {av.version} has no Sol-Attn (it needs {SOL_MIN_VERSION} or later; "
                                   "ComfyUI 0.33 comes with 0.2.31). To add it: python -m pip install "
                                   f"comfy-kitchen=={SOL_MIN_VERSION}; README, 'Sol-Attn on ComfyUI 0.33', says what "
                                   "that changes and how to undo it")
    if torch.cuda.is_available() and not comfy_kitchen.sol_attn_is_available():
        return Availability(False, f"comfy-kitchen {av.version}: no compiled sol_attn kernel for this GPU")
    return av


REGISTRY.register(
    Backend(
        name="kitchen_int8",
        family="kitchen",
        fn=_kitchen,
        constraints=(
            DeviceTypes(("cuda",)),
            DTypes((torch.float32, torch.float16, torch.bfloat16)),
            HeadDims(max=256),
            Masks(("bool", "float")),
            GroupedQuery(True),
            SameHeadDimV(),
        ),
        layouts=("HND",),
        probe=_probe,
        description="comfy-kitchen INT8 attention (any head dim <= 256, masks)",
        accuracy="8bit",
    )
)

SOL_CONSTRAINTS = (
    DeviceTypes(("cuda",)),
    DTypes((torch.bfloat16, torch.float16)),  # fp32 computed in bf16 and cast back, as core's node does
    HeadDims(dims=(128,), pad=False),
    Masks(()),
    SameSeqLen(),  # q/k/v of one shape: self-attention
    GroupedQuery(False),
    SameHeadDimV(),
    MinSeqLen(q=128, kv=128),  # two 64-token blocks; the per-model min_tokens (declines) is the speed threshold
)


def _sol_entry(name, defaults, topk, accuracy, description):
    REGISTRY.register(
        Backend(
            name=name,
            family="kitchen_sol",
            fn=_sol(defaults, topk=topk),
            constraints=SOL_CONSTRAINTS,
            layouts=("NHD",),
            probe=_sol_probe,
            description=description,
            options=dict(defaults),
            accuracy=accuracy,
            declines=_min_tokens,
        )
    )


_sol_entry("kitchen_sol", SOL_DEFAULTS, False, "routed",
           "comfy-kitchen Sol-Attn: routed key blocks exact, the rest pooled; threshold tau (Model Sparse Attention's "
           "kernel)")
_sol_entry("kitchen_sol_topk", SOL_TOPK_DEFAULTS, True, "topk",
           "comfy-kitchen Sol-Attn with SLA top-k routing: a fixed share keep_ratio of key blocks per query block (for "
           "SLA-distilled weights)")
