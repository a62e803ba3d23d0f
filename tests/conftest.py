import contextlib
import logging
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from attention import REGISTRY, Backend  # noqa: E402
from attention import dispatch as _dispatch  # noqa: E402


def pytest_report_header(config):
    """Which ComfyUI the real-ComfyUI tiers run on (CI runs them once per release in ../shared/comfyui)."""
    from comfyui_support import find_comfyui

    path = find_comfyui()
    if path is None:
        return "ComfyUI: none found (COMFYUI_PATH unset): the real-ComfyUI tiers are skipped"
    version = "unknown"
    try:
        with open(os.path.join(path, "comfyui_version.py")) as f:
            version = f.read().split("__version__ = ")[1].split()[0].strip("\"'")
    except (OSError, IndexError):
        pass
    return f"ComfyUI {version} at {path}: the real-ComfyUI tiers (loader, sampling, compile, server, browser) run on it"


def sdpa_ref(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False):
    """fp32 SDPA on ComfyUI's layouts: the reference every backend is compared to."""
    if skip_reshape:
        qh, kh, vh = q.float(), k.float(), v.float()
    else:
        b = q.shape[0]
        qh, kh, vh = (t.float().view(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0 if mask.ndim == 2 else 1)
        if mask.dtype != torch.bool:
            mask = mask.float()
    kw = {"enable_gqa": True} if kh.shape[1] != qh.shape[1] else {}
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, **kw)
    if skip_output_reshape:
        return o
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def smoothing_kernel(seen):
    """SageAttention's smooth_k in miniature (a CPU stand-in kernel): subtracts K's mean over the sequence unless told
    ``smooth_k=False``; records the options it got and the largest mean of the K it got."""
    def fn(q, k, v, *, layout, mask, scale, opts):
        seq = 2 if layout == "HND" else 1
        seen.append({"opts": dict(opts), "k_mean": float(k.float().mean(dim=seq).abs().max())})
        if opts.get("smooth_k", True):
            k = k - k.mean(dim=seq, keepdim=True)
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return o if layout == "HND" else o.transpose(1, 2)

    return fn


def cos_rel(a, b):
    from attention.auto import accuracy

    return accuracy(a, b)


@pytest.fixture
def temp_backend():
    """Register CPU test backends for one test; removed afterwards with every cache."""
    added = []

    def add(backend: Backend):
        REGISTRY.register(backend)
        added.append(backend.name)
        _dispatch.clear_plan_cache()
        return backend

    yield add
    for n in added:
        REGISTRY.unregister(n)
    _dispatch.clear_plan_cache()
    _dispatch.reset_warnings()


@pytest.fixture
def pack_backend():
    """Register test backends in the pack as ComfyUI loads it (tests/pack.py) for one test; removed afterwards."""
    from pack import load

    A = load().attention
    added = []

    def add(backend):
        A.REGISTRY.register(backend)
        added.append(backend.name)
        A.dispatch.clear_plan_cache()
        return backend

    yield add
    for n in added:
        A.REGISTRY.unregister(n)
    A.dispatch.clear_plan_cache()
    A.dispatch.reset_warnings()


@pytest.fixture(autouse=True)
def _fresh_warnings():
    _dispatch.reset_warnings()
    yield


@contextlib.contextmanager
def capture(logger="patch_attention"):
    records = []

    class H(logging.Handler):
        def emit(self, r):
            records.append(r)

    h = H(level=logging.DEBUG)
    lg = logging.getLogger(logger)
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
