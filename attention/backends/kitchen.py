"""comfy-kitchen's INT8 attention (``comfy_kitchen.int8_attention``)."""

from __future__ import annotations

import torch

from ..constraints import ComputeCapability, DeviceTypes, DTypes, GroupedQuery, HeadDims, Masks, SameHeadDimV
from ..registry import REGISTRY, Availability, Backend, import_probe


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


REGISTRY.register(
    Backend(
        name="kitchen_int8",
        family="kitchen",
        fn=_kitchen,
        constraints=(
            DeviceTypes(("cuda",)),
            ComputeCapability.of_kernel("comfy_kitchen"),
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
