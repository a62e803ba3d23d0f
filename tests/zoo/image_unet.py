"""Zoo builders: image_unet."""

from .core import Case, family, unbuilt  # noqa: F401
