"""What is installed and what can run here, and why not: for the Info node and the CLI."""

from __future__ import annotations

import platform

import torch

from .capabilities import arch_name
from .constraints import plan
from .registry import REGISTRY


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            env["gpus"].append(
                {"index": i, "name": torch.cuda.get_device_name(i), "cc": f"{cc[0]}.{cc[1]}", "arch": arch_name(cc)}
            )
    return env


def report_rows(device: torch.device | None = None) -> list[dict]:
    """One row per backend: installed?, version, can run on ``device`` (default: GPU 0 or CPU), why not."""
    from .calls import make_spec

    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    # A typical DiT self-attention call: [B, N, H, D] = [1, 4096, 24, 128].
    q = torch.empty((1, 4096, 24, 128), dtype=dtype, device="meta")
    spec = make_spec(q, q, q, "NHD", None).replace(device_type=device.type)
    if device.type == "cuda":
        spec = spec.replace(cc=tuple(torch.cuda.get_device_capability(device)))
    return [row(b, spec.replace(dtype=torch.float16)) for b in REGISTRY.backends()]


def row(b, spec) -> dict:
    """One backend's row for a typical call ``spec``. A backend that is not installed also says when this GPU could
    not run it anyway (what install.py would not install here either)."""
    av = b.availability()
    if av.ok:
        why = b.plan(spec)[1] or ""
    else:
        anyway = plan(b.constraints, spec)[1] if spec.device_type == "cuda" else None
        why = av.reason + (f"; this GPU could not run it anyway: {anyway}" if anyway else "")
    return {
        "backend": b.name,
        "family": b.family,
        "installed": av.ok,
        "version": av.version,
        "usable": av.ok and not why,
        "why_not": why,
        "supports": b.describe(),
        "description": b.description,
    }
