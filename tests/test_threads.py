"""No process-global state: ComfyUI samples conds on several GPUs in threads (MultiGPU CFG Split), and whatever one
sampling thread switches on or off is seen by every other attention call in the process (CPU)."""

import threading

import pytest
import torch
import torch.nn.functional as F
from pack import load

P = load()
A = P.attention
SDPA_FAMILY = [b.name for b in A.REGISTRY.backends() if b.family == "sdpa"]
SETTERS = [n for n in dir(torch._C) if n.startswith("_set_sdp_")]


def _flags():
    return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())


def _call(name, q, k, v):
    """A backend's kernel function as the dispatcher calls it (CUDA-only kernels raise on the CPU: that is fine
    here, what matters is what they switch on the way)."""
    try:
        return A.REGISTRY.get(name).fn(q, k, v, layout="HND", mask=None, scale=None, opts={})
    except (RuntimeError, NotImplementedError):
        return None


def test_no_sdpa_backend_touches_pytorchs_global_sdpa_switches(monkeypatch):
    """Deterministic: every setter of PyTorch's process-wide SDPA state is recorded while every SDPA-family backend
    runs, from two threads at once. A `with sdpa_kernel(...)` around a call sets them on entry and exit."""
    assert SETTERS and {"sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"} <= set(SDPA_FAMILY)
    calls = []
    for name in SETTERS:
        real = getattr(torch._C, name)
        monkeypatch.setattr(torch._C, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    def work():
        for name in SDPA_FAMILY:
            _call(name, q, k, v)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == []


def test_forced_kernels_in_two_threads_leave_a_third_threads_calls_working():
    """Two sampling threads run forced SDPA kernels while a third runs plain fp32 SDPA (what the unpatched model and
    auto's reference do). The third never meets a kernel switched off under it, and afterwards the switches are as
    they were. Before: `sdpa_kernel([EFFICIENT])` in one thread left the CPU without a kernel for the third
    ("No available kernel"), and contexts left in the wrong order kept a flash-only state for the rest of the process."""
    before = _flags()
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    errors, seen_flags, stop = [], set(), threading.Event()

    def forced(names):
        for _ in range(150):
            for name in names:
                _call(name, q, k, v)
        stop.set()

    def third():
        while not stop.is_set():
            try:
                F.scaled_dot_product_attention(q, k, v)
            except RuntimeError as e:
                errors.append(str(e).splitlines()[0])
            seen_flags.add(_flags())

    ts = [threading.Thread(target=forced, args=(["sdpa_efficient", "sdpa_flash"],)),
          threading.Thread(target=forced, args=(["sdpa_cudnn", "sdpa_math", "sdpa"],)),
          threading.Thread(target=third)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert seen_flags == {before} and _flags() == before


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_sdpa_math_is_sdpa_on_the_cpu(mask_kind):
    """The ATen math op (called without SDPA's front end) computes what SDPA computes, masks included."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g) for _ in range(3))
    mask = {None: None, "bool": torch.rand(2, 1, 33, 33, generator=g) > 0.3,
            "float": torch.randn(1, 1, 33, 33, generator=g)}[mask_kind]
    out = A.REGISTRY.get("sdpa_math").fn(q, k, v, layout="HND", mask=mask, scale=0.3, opts={})
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    kh, vh = k[:, :2], v[:, :2]  # grouped-query: 4 query heads on 2 key heads
    out = A.REGISTRY.get("sdpa_math").fn(q, kh, vh, layout="HND", mask=None, scale=None, opts={})
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, kh, vh, enable_gqa=True), rtol=1e-5, atol=1e-5)
