"""Zoo builders: other."""

from .core import Case, family, unbuilt  # noqa: F401
