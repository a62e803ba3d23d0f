"""Zoo builders: video."""

from .core import Case, family, unbuilt  # noqa: F401
