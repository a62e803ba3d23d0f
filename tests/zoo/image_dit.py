"""Zoo builders: image_dit."""

from .core import Case, family, unbuilt  # noqa: F401
