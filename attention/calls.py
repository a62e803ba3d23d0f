"""One kernel call: ComfyUI's calling convention checked and turned into 4-D views, a backend planned and run.

The pieces :mod:`dispatch` (the entry point, fallback and statistics) and :mod:`auto` (timing candidates) both call;
neither imports the other for them.  Layout handling lives here once: kernels are handed a *view* in a layout they
declare (``NHD`` is a free view of ComfyUI's ``[B, N, H*D]``, ``HND`` a free transpose), head dims a kernel lacks are
zero-padded, fp32 is computed in a half dtype and cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backends as _backends  # noqa: F401  (registers every backend)
from .constraints import CallSpec
from .registry import Backend

REFERENCE = "sdpa"


# ---------------------------------------------------------------- ComfyUI's convention

def validate(q, k, v, heads, mask, skip_reshape, enable_gqa=False):
    """A clear ValueError for a call no attention function can take (a tensor, shape or device that does not fit).

    With ``skip_reshape=False`` q is ``[B, N, H*D]``; K and V may also have more dims (SD3's MMDiT hands a
    ``[B, N, H, D]`` V beside 3-D q and k): ComfyUI's functions read them as ``reshape(B, -1, heads, D)``, and so does
    the pack (:func:`comfy_kv`)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise ValueError("q, k and v must be tensors")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if skip_reshape:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.ndim != 4:
                raise ValueError(f"{name} must be [B, H, N, D] (4-D) with skip_reshape=True, got shape {tuple(t.shape)}")
    else:
        if q.ndim != 3:
            raise ValueError(f"q must be [B, N, H*D] (3-D) with skip_reshape=False, got shape {tuple(q.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.ndim < 3:
                raise ValueError(f"{name} must be [B, N, H*D] (3-D) or [B, N, H, D] with skip_reshape=False, "
                                 f"got shape {tuple(t.shape)}")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if skip_reshape:
        if q.shape[1] != heads:
            raise ValueError(f"q has {q.shape[1]} heads but heads={heads}")
        if k.shape[1] != v.shape[1] or heads % k.shape[1]:
            raise ValueError(f"key/value heads ({k.shape[1]}, {v.shape[1]}) must be equal and divide {heads}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"key length {k.shape[2]} != value length {v.shape[2]}")
        if q.shape[3] != k.shape[3]:
            raise ValueError(f"query head dim {q.shape[3]} != key head dim {k.shape[3]}")
    else:
        if q.shape[-1] % heads:
            raise ValueError(f"q width {q.shape[-1]} is not divisible by heads={heads}")
        d = q.shape[-1] // heads
        if k.ndim != 3 or v.ndim != 3:
            for name, t in (("k", k), ("v", v)):
                if t.ndim == 3:
                    continue
                if enable_gqa and t.shape[-1] % d:
                    raise ValueError(f"{name} of shape {tuple(t.shape)}: with enable_gqa its last dim must be a "
                                     f"multiple of q's head dim {d}")
                if t.numel() % (t.shape[0] * kv_width(t, q.shape[-1], enable_gqa)):
                    raise ValueError(f"{name} of shape {tuple(t.shape)} does not reshape to [B, -1, heads, {d}] "
                                     f"(heads={heads})")
            k, v = comfy_kv(q, k, v, heads, enable_gqa)
        if q.shape[-1] != k.shape[-1]:
            if not enable_gqa:
                raise ValueError(f"q width {q.shape[-1]} != k width {k.shape[-1]} (pass enable_gqa=True for fewer key heads)")
            if k.shape[-1] % d or heads % (k.shape[-1] // d):
                raise ValueError(f"k width {k.shape[-1]} is not a number of key heads of q's head dim {d} that divides "
                                 f"heads={heads}")
        kv_heads = k.shape[-1] // d
        if v.shape[-1] % kv_heads:
            raise ValueError(f"v width {v.shape[-1]} is not divisible by the {kv_heads} key heads")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"key length {k.shape[1]} != value length {v.shape[1]}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"mask must be a tensor or None, got {type(mask).__name__}")
        if mask.ndim not in (2, 3, 4):
            raise ValueError(f"mask must be 2-D, 3-D or 4-D, got shape {tuple(mask.shape)}")
        if mask.device != q.device:
            raise ValueError(f"mask on {mask.device}, q on {q.device}")


def kv_width(t, q_width, enable_gqa):
    """The width ComfyUI's functions give K or V of a ``[B, N, H*D]`` call: q's (``heads * dim_head``), or under
    ``enable_gqa`` its own last dim (``key_heads = t.shape[-1] // dim_head`` of ``dim_head``)."""
    return t.shape[-1] if enable_gqa else q_width


def comfy_kv(q, k, v, heads, enable_gqa=False):
    """K and V of a ``[B, N, H*D]`` call as ``[B, N, W]``: 3-D ones as they are; others read as ComfyUI's own
    functions read every K and V, ``t.reshape(B, -1, heads, dim_head)`` (SD3's ``[B, N, H, D]`` V: a free view)."""
    if k.ndim == 3 and v.ndim == 3:
        return k, v
    b, w = q.shape[0], q.shape[-1]
    if k.ndim != 3:
        k = k.reshape(b, -1, kv_width(k, w, enable_gqa))
    if v.ndim != 3:
        v = v.reshape(b, -1, kv_width(v, w, enable_gqa))
    return k, v


def mask_4d(mask):
    """ComfyUI's rule: a 2-D mask gets a batch dim, a 3-D one a heads dim."""
    if mask is not None and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


def qkv_4d(q, k, v, heads, skip_reshape, enable_gqa=False):
    """ComfyUI's q/k/v as 4-D views and their layout: ``[B, H, N, D]`` as is, ``[B, N, H*D]`` as ``[B, N, H, D]``
    (K and V with ``k width / D`` heads: fewer than Q's under ``enable_gqa``; K or V of more dims read as ComfyUI
    reads them, :func:`comfy_kv`)."""
    if skip_reshape:
        return q, k, v, "HND"
    if k.ndim != 3 or v.ndim != 3:
        k, v = comfy_kv(q, k, v, heads, enable_gqa)
    d = q.shape[-1] // heads
    kh = k.shape[-1] // d
    return q.unflatten(-1, (heads, d)), k.unflatten(-1, (kh, d)), v.unflatten(-1, (kh, -1)), "NHD"


def norm_mask(mask, b, h, nq, nk):
    """The 4-D mask, checked to broadcast to [B, H, Nq, Nk]."""
    mask = mask_4d(mask)
    if mask is None:
        return None
    try:
        torch.broadcast_shapes(mask.shape, (b, h, nq, nk))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Nq, Nk] = {[b, h, nq, nk]}") from None
    return mask


_cc_cache: dict = {}


def compute_capability(device: torch.device):
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _cc_cache.get(idx)
    if hit is None:
        hit = _cc_cache[idx] = tuple(torch.cuda.get_device_capability(idx))
    return hit


def make_spec(q4, k4, v4, layout, mask) -> CallSpec:
    """Spec of a call whose q/k/v are 4-D in ``layout``."""
    if layout == "HND":
        b, h, nq, d = q4.shape
        hk, nk = k4.shape[1], k4.shape[2]
    else:
        b, nq, h, d = q4.shape
        nk, hk = k4.shape[1], k4.shape[2]
    mk = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return CallSpec(q4.device.type, compute_capability(q4.device), q4.dtype, b, h, hk, nq, nk, d, v4.shape[-1], mk)


def prepare(q, k, v, heads, mask=None, skip_reshape=False, scale=None, enable_gqa=False):
    """Validate a ComfyUI-convention call; returns 4-D q/k/v views, their layout, the spec, the 4-D mask, the scale."""
    validate(q, k, v, heads, mask, skip_reshape, enable_gqa)
    q4, k4, v4, layout = qkv_4d(q, k, v, heads, skip_reshape, enable_gqa)
    spec = make_spec(q4, k4, v4, layout, mask)
    mask4 = norm_mask(mask, spec.batch, spec.heads, spec.q_len, spec.kv_len)
    return q4, k4, v4, layout, spec, mask4, (spec.head_dim ** -0.5 if scale is None else scale)


def to_layout(t, src, dst):
    return t if src == dst else t.transpose(1, 2)


def finish(out, layout, spec, skip_output_reshape):
    """A backend's 4-D output in ``layout`` -> what ComfyUI's attention returns."""
    if skip_output_reshape:
        return to_layout(out, layout, "HND")
    b, n = spec.batch, spec.q_len
    if layout == "NHD":
        return out.reshape(b, n, -1)
    return out.transpose(1, 2).reshape(b, n, -1)


# ---------------------------------------------------------------- planning and running one backend

_plan_cache: dict = {}


def plan_for(backend: Backend, spec: CallSpec):
    """(the spec ``backend`` would compute, why it cannot or None), cached per (backend, spec)."""
    key = (backend.name, spec)
    hit = _plan_cache.get(key)
    if hit is None:
        hit = _plan_cache[key] = backend.plan(spec)
    return hit


def clear_plan_cache() -> None:
    _plan_cache.clear()


def kernel_layout(backend: Backend, layout: str, skip_output_reshape: bool = False) -> str:
    """The layout to hand ``backend`` for a call in ``layout``: for a ``layout_by_output`` kernel, the one whose output
    is already what the caller returns (NHD for ``[B, N, H*D]``, HND for ``[B, H, N, D]``: no copy after the kernel);
    otherwise the call's own layout when the kernel takes it, else its first."""
    if backend.layout_by_output:
        want = "HND" if skip_output_reshape else "NHD"
        if want in backend.layouts:
            return want
    return layout if layout in backend.layouts else backend.layouts[0]


def run_backend(backend: Backend, q4, k4, v4, layout, mask, spec: CallSpec, target: CallSpec, scale, opts,
                skip_output_reshape=False):
    """Call ``backend`` on 4-D q/k/v in ``layout``; returns (out in ``layout`` at spec's dtype/dim, extras). The output
    may be a view of the kernel's own layout (see :func:`kernel_layout`)."""
    bl = kernel_layout(backend, layout, skip_output_reshape)
    q, k, v = (to_layout(t, layout, bl) for t in (q4, k4, v4))
    if target.dtype != spec.dtype:
        q, k, v = (t.to(target.dtype) for t in (q, k, v))
    pad = target.head_dim - spec.head_dim
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    # kernels need the head dim contiguous; SDPA's fused kernels too (else it drops to the O(N^2)-memory math path)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    m = mask
    if m is not None and m.dtype != torch.bool and m.dtype != target.dtype:
        m = m.to(target.dtype)
    out = backend.fn(q, k, v, layout=bl, mask=m, scale=scale, opts=opts)
    extras = None
    if isinstance(out, tuple):
        out, extras = out
    if pad:
        out = out[..., : spec.head_dim]
    if out.dtype != spec.dtype:
        out = out.to(spec.dtype)
    return to_layout(out, bl, layout), extras


def finite_flag(out: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 device tensor that is finite exactly when every element of ``out`` is: its sum, one reduction
    kernel (attention outputs are convex combinations of V, so the sum stays far inside fp32's range)."""
    return torch.sum(out, dtype=torch.float32)
