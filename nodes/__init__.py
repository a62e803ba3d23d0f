"""ComfyUI adapter: V3 schema nodes where ComfyUI has ``comfy_api``, classic nodes otherwise."""

from . import files
from .v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

files.register()  # models/sparge_profiles, with folder_paths (extra_model_paths.yaml may add more)

try:
    from .v3 import comfy_entrypoint
except ImportError:  # ComfyUI without comfy_api.latest: the classic mappings serve
    comfy_entrypoint = None

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
