"""Patch Attention for ComfyUI: swap a model's attention kernel per model.

ComfyUI imports this folder under whatever name it was cloned as; every import
inside the pack is relative.
"""

from .nodes import NODE_CLASS_MAPPINGS as _V1_MAPPINGS
from .nodes import NODE_DISPLAY_NAME_MAPPINGS as _V1_NAMES
from .nodes import comfy_entrypoint as _v3_entrypoint

WEB_DIRECTORY = "./web"  # web/patch_attention.js: the report nodes show their report on the canvas

if _v3_entrypoint is not None:
    # ComfyUI reads NODE_CLASS_MAPPINGS first; export only the V3 entry point where it exists.
    comfy_entrypoint = _v3_entrypoint
    __all__ = ["comfy_entrypoint"]
else:
    NODE_CLASS_MAPPINGS = _V1_MAPPINGS
    NODE_DISPLAY_NAME_MAPPINGS = _V1_NAMES
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
