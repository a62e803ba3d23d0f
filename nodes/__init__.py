"""ComfyUI adapter: V3 schema nodes where ComfyUI has ``comfy_api``, classic nodes otherwise."""

from .v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

try:
    from .v3 import comfy_entrypoint
except ImportError:  # ComfyUI without comfy_api.latest: the classic mappings serve
    comfy_entrypoint = None

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
