"""Attention backends for diffusion models, independent of ComfyUI.

>>> from attention import attention, AttentionConfig
>>> out = attention(q, k, v, heads, config=AttentionConfig(backend="sage"))
"""

from .auto import AutoSelector
from .constraints import CallSpec
from .dispatch import (
    AttentionConfig,
    BackendUnavailableError,
    NonFiniteOutput,
    attention,
    make_spec,
    use_backend,
)
from .names import AUTO, AUTO_EXACT, AUTO_FAST, AUTOS, REFERENCE
from .registry import REGISTRY, Availability, Backend
from .report import environment, report_rows
from .stats import Stats

__all__ = [
    "AUTO",
    "AUTOS",
    "AUTO_EXACT",
    "AUTO_FAST",
    "REFERENCE",
    "REGISTRY",
    "AttentionConfig",
    "AutoSelector",
    "Availability",
    "Backend",
    "BackendUnavailableError",
    "CallSpec",
    "NonFiniteOutput",
    "Stats",
    "attention",
    "environment",
    "make_spec",
    "report_rows",
    "use_backend",
]
