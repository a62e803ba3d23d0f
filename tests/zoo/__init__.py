"""The model zoo: every diffusion-model configuration of the ComfyUI under test, built tiny through ComfyUI's own
classes and sampled with the conditioning its family gets in a real workflow (:mod:`.core`).

Family modules (every other module of this package) register builders with :func:`family`, or declare with
:func:`unbuilt` why a configuration is not built. Import ComfyUI first (``comfyui_support.comfy()``), then::

    from zoo import BUILDERS, build, load_families, sample
    load_families()
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from .core import BUILDERS, UNBUILT, Case, build, configurations, family, sample, unbuilt, with_, zeroed

__all__ = ["BUILDERS", "UNBUILT", "Case", "build", "configurations", "family", "family_modules", "load_families",
           "sample", "unbuilt", "with_", "zeroed"]


def family_modules() -> list[str]:
    """The family modules of this package (every module but the core), sorted."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(m.name for m in pkgutil.iter_modules([here]) if m.name != "core" and not m.name.startswith("_"))


def load_families() -> dict[str, str]:
    """Import every family module (their builders register themselves); returns configuration name -> module for
    every builder. ComfyUI must be importable (the modules may read its classes)."""
    for name in family_modules():
        importlib.import_module(f"{__name__}.{name}")
    return {n: fn.__module__.rsplit(".", 1)[-1] for n, fn in BUILDERS.items()}
