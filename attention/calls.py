"""One kernel call: ComfyUI's calling convention checked and turned into 4-D views, a backend planned and run.

The one way from q/k/v to an attention output is a :class:`KernelCall`, planned once per backend x exact call shape x
options (:func:`plan_call`) and run by everything that calls a kernel: :mod:`dispatch` (the entry point, fallback and
statistics: its full path and its per-shape cache), the node's per-shape cached calls, :mod:`auto`'s timing of its
candidates and the benchmarks' bare kernel call.  :func:`call_key` is the key of every per-shape cache.  Layout
handling lives here once: kernels are handed a *view* in a layout they declare (``NHD`` is a free view of ComfyUI's
``[B, N, H*D]``, ``HND`` a free transpose), head dims a kernel lacks are zero-padded, fp32 is computed in a half dtype
and cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backends as _backends  # noqa: F401  (registers every backend)
from .constraints import CallSpec
from .names import REFERENCE  # noqa: F401  (re-exported)
from .registry import Backend

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


def call_key(q, k, v, heads, skip_reshape, skip_output_reshape=False, mask=None, enable_gqa=False, k_smoothed=False,
             phase=True, whole=True):
    """The key of what is cached per exact call shape (the dispatcher's plans, the node's lean calls, its refusals):
    everything a call's plan depends on. The shapes, dtype and device, ``heads`` and both reshape flags (they set the
    views and the kernel's layout); the mask's shape, dtype and device (its kind decides who takes the call, its dims
    how it is expanded); ``enable_gqa`` (how K and V are read); ``k_smoothed`` (a ``smooth_k`` kernel is told not to
    subtract K's mean again); ``phase``, what else decides the choice: whether sparse kernels may run in this forward,
    or None for a forward Patch Attention runs dense.  ``whole``: K's and V's own dtypes and devices too, for a cache
    whose calls are not validated again (the dispatcher's: a call that mixes them misses it and is refused with the
    reason); the node's lean calls leave them out (ComfyUI's models never mix them, and each field costs time on every
    call)."""
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, heads, skip_reshape, skip_output_reshape,
           None if mask is None else (mask.shape, mask.dtype, mask.device), enable_gqa, k_smoothed, phase)
    return key + (k.dtype, v.dtype, k.device, v.device) if whole else key


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
    """Call ``backend`` once on 4-D q/k/v in ``layout``; returns (out in ``layout`` at spec's dtype/dim, the kernel's
    extras or None). A :class:`KernelCall` planned for this one call (``as_4d``): callers that call a shape again keep
    the :class:`KernelCall` instead."""
    extras = []
    kc = KernelCall(backend, spec, target, layout, scale, opts, skip_output_reshape, as_4d=True, report=extras.append)
    out = kc.run(q4, k4, v4, None, mask)
    return out, (extras[0] if extras else None)


class KernelCall:
    """One backend planned for one exact call shape and options: built once, then run for every call of that shape.

    What was planned: the 4-D views of ComfyUI's q/k/v (``views``: their shapes; K and V of more than 3 dims read as
    ComfyUI reads them, :func:`comfy_kv`), the layout handed to the kernel (``kernel_layout``, a transpose away from
    the call's), a cast to the dtype the kernel computes in and a zero-padded head dim (``target``: what
    :func:`plan_for` adapted), the kernel with its options and scale, and the way back: what ComfyUI's attention
    returns for ``skip_output_reshape`` (or, ``as_4d``, the output in the call's own 4-D ``layout``).

    ``run(q, k, v, check_key=None, mask=None)`` runs it: q/k/v as ComfyUI hands them (already 4-D in ``layout`` when
    ``views`` is None), the head dim made contiguous where it is not (kernels need it; SDPA's fused kernels too, else it
    drops to its O(N^2)-memory math path), ``mask`` as ComfyUI hands it. Besides the kernel, per call and only where
    asked: the NaN check of a quantized kernel's output (``watch``: an object with ``check_finite``, read per call, and
    ``check_output(out, name, spec, check_key)``), the count (``calls``: a Counter) and with it the fallback it stands
    for (``fallbacks``: a Counter, ``fallback``: (from, why)), the kernel's extras (``report(extras)``). Without those
    it is the bare call, the kernel as a pack that calls it straight from the hook runs it.
    """

    __slots__ = ("backend", "spec", "target", "layout", "kernel_layout", "scale", "opts", "views", "run")

    def __init__(self, backend: Backend, spec: CallSpec, target: CallSpec, layout: str, scale, opts,
                 skip_output_reshape=False, *, views=None, as_4d=False, watch=None, calls=None, fallbacks=None,
                 fallback=None, report=None):
        self.backend, self.spec, self.target, self.layout, self.scale, self.opts = (backend, spec, target, layout,
                                                                                     scale, opts)
        self.kernel_layout = kernel_layout(backend, layout, skip_output_reshape)
        self.views = views
        out = layout if as_4d else "HND" if skip_output_reshape else "flat"
        self.run = self._compile(out, watch if backend.quantized else None, calls,
                                 None if fallback is None else (fallbacks, (fallback[0], backend.name, fallback[1])),
                                 report)

    def __call__(self, q, k, v, check_key=None, mask=None):
        return self.run(q, k, v, check_key, mask)

    def _compile(self, out_as, watch, calls, fallback, report):
        """The call as one function of the plan's constants (closure cells: no attribute read per call)."""
        fn, kl, scale, opts, spec, name = (self.backend.fn, self.kernel_layout, self.scale, self.opts, self.spec,
                                           self.backend.name)
        views = self.views
        vq = vk = vv = rk = rv = None
        if views is not None:
            vq, vk, vv, rk, rv = views
        swap = kl != self.layout
        dt, cast = spec.dtype, (self.target.dtype if self.target.dtype != spec.dtype else None)
        pad, d = self.target.head_dim - spec.head_dim, spec.head_dim
        adapt, mask_dt = cast is not None or pad > 0, cast or dt
        back = kl != ("NHD" if out_as == "flat" else out_as)
        flat, b, n = out_as == "flat", spec.batch, spec.q_len
        fallbacks, fb = fallback if fallback is not None else (None, None)

        def run(q, k, v, check_key=None, mask=None):
            if views is not None:
                q, k, v = q.view(vq), rk(k, vk), rv(v, vv)
            if swap:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if adapt:  # the dtype the kernel computes in, the head dim it has
                if cast is not None:
                    q, k, v = q.to(cast), k.to(cast), v.to(cast)
                if pad:
                    q, k, v = F.pad(q, (0, pad)), F.pad(k, (0, pad)), F.pad(v, (0, pad))
            if q.stride(-1) != 1:
                q = q.contiguous()
            if k.stride(-1) != 1:
                k = k.contiguous()
            if v.stride(-1) != 1:
                v = v.contiguous()
            if mask is not None:
                mask = mask_4d(mask)
                if mask.dtype != torch.bool and mask.dtype != mask_dt:
                    mask = mask.to(mask_dt)
            out = fn(q, k, v, layout=kl, mask=mask, scale=scale, opts=opts)
            if type(out) is tuple:
                out, extras = out
                if report is not None:
                    report(extras)
            if adapt:  # back to the call's head dim and dtype (a kernel computes in the dtype it is handed)
                if pad:
                    out = out[..., :d]
                if out.dtype is not dt:
                    out = out.to(dt)
            if watch is not None and watch.check_finite:
                watch.check_output(out, name, spec, check_key)
            if calls is not None:
                calls[name] += 1
                if fb is not None:
                    fallbacks[fb] += 1
            if back:
                out = out.transpose(1, 2)
            return out.reshape(b, n, -1) if flat else out

        return run


def call_options(backend: Backend, opts, k_smoothed=False) -> dict:
    """The options ``backend`` is called with: ``opts`` (the config's for it, and a call's own), and ``smooth_k=False``
    where a compiled graph already subtracted K's mean (``k_smoothed``) for a ``smooth_k`` kernel."""
    opts = opts or {}
    if k_smoothed and backend.smooth_k:
        opts = {**opts, "smooth_k": False}
    return opts


def plan_call(backend: Backend, q, k, v, heads, skip_reshape=False, skip_output_reshape=False, *, opts=None,
              scale=None, enable_gqa=False, k_smoothed=False, **run):
    """``(KernelCall, None)`` for calls shaped exactly like this one (no mask) on ``backend`` with ``opts``, or
    ``(None, why)`` when it refuses such a call. ``run``: what the call does besides the kernel (``watch``,
    ``calls``, ``fallbacks``, ``fallback``: see :class:`KernelCall`); without it, the bare call. Raises ValueError for
    a call no attention function can take."""
    q4, k4, v4, layout, spec, _, scale = prepare(q, k, v, heads, None, skip_reshape, scale, enable_gqa)
    target, reason = plan_for(backend, spec)
    if reason is None:
        reason = backend.refuses(spec, opts)
    if reason is not None:
        return None, reason
    return KernelCall(backend, spec, target, layout, scale, call_options(backend, opts, k_smoothed), skip_output_reshape,
                      views=comfy_views(q, k, v, q4, k4, v4, skip_reshape), **run), None


def comfy_views(q, k, v, q4, k4, v4, skip_reshape):
    """How a :class:`KernelCall` turns calls shaped like ``q, k, v`` into the 4-D ``q4, k4, v4`` :func:`qkv_4d` made
    of them: None for ``[B, H, N, D]`` calls (already 4-D); else the three shapes and, for K and V, the method that
    gets there (a view of ``[B, N, H*D]``; ComfyUI's reshape for a K or V of more dims, :func:`comfy_kv`)."""
    if skip_reshape:
        return None
    view, reshape = torch.Tensor.view, torch.Tensor.reshape
    return (tuple(q4.shape), tuple(k4.shape), tuple(v4.shape), view if k.ndim == 3 else reshape,
            view if v.ndim == 3 else reshape)


def finite_flag(out: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 device tensor that is finite exactly when every element of ``out`` is: its sum, one reduction
    kernel (attention outputs are convex combinations of V, so the sum stays far inside fp32's range)."""
    return torch.sum(out, dtype=torch.float32)
