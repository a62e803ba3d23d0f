"""The one entry point: ComfyUI's attention calling convention in, any backend out.

``attention(q, k, v, heads, mask, skip_reshape=..., skip_output_reshape=..., config=...)``
takes q/k/v as ``[B, N, H*D]`` (or ``[B, H, N, D]`` with ``skip_reshape``) and
returns exactly what ComfyUI's own attention returns: ``[B, N, H*D]``, or
``[B, H, N, D]`` with ``skip_output_reshape``.

Layout handling lives here once: kernels are handed a *view* in a layout they
declare (``NHD`` is a free view of ComfyUI's ``[B, N, H*D]``, ``HND`` a free
transpose), head dims a kernel lacks are zero-padded, fp32 is computed in a
half dtype and cast back, and a call a backend cannot take (by its declared
constraints) or that raises goes to the next backend in the chain, ending at
SDPA: counted in :class:`Stats` and logged once per (backend, reason).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import backends as _backends  # noqa: F401  (registers every backend)
from .constraints import CallSpec
from .registry import REGISTRY, Backend
from .stats import Stats, cuda_event

log = logging.getLogger("patch_attention.dispatch")

REFERENCE = "sdpa"
AUTO = "auto"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("patch_attention_forced", default=None)


class NonFiniteOutput(RuntimeError):
    """A quantized kernel returned NaN/inf; the call is redone on the next backend."""


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot take a call and fallback is off."""


@dataclass
class AttentionConfig:
    """How calls are dispatched.

    backend: a registry name or ``"auto"``.
    fallbacks: names tried, in order, when ``backend`` cannot take a call; SDPA ends every chain.
    allow_fallback: ``False`` raises :class:`BackendUnavailableError` instead of falling back.
    options: per-backend options, e.g. ``{"sparge": {"cdfthreshd": 0.97}}``.
    record_time: time each call per backend (CUDA events, read lazily).
    check_finite: check the output of quantized backends for NaN/inf and redo a non-finite call on the next
        backend (SageAttention returns NaN when all keys are equal, as a zeroed prompt gives).  ``True``: at once,
        one device sync per call.  ``"deferred"``: while ``in_forward`` is set, record the check on the device (one
        fp32 sum of the output, a single reduction kernel: finite exactly when every element is) and let the caller
        read all of a model forward's checks with one sync (:meth:`take_nonfinite`) and redo that forward; the node
        layer does this.  Outside a forward a deferred config checks at once, since nobody would read the record.
    """

    backend: str = REFERENCE
    fallbacks: tuple[str, ...] = ()
    allow_fallback: bool = True
    options: dict = field(default_factory=dict)
    record_time: bool = False
    check_finite: bool | str = True
    stats: Stats = field(default_factory=Stats)
    auto: object = None  # an attention.auto.AutoSelector; created on first "auto" call
    in_forward: bool = False  # set by the caller around a model forward whose deferred checks it reads
    _fast: dict = field(default_factory=dict, repr=False)  # exact call shape -> resolved plan (skips validation and planning)
    _pending: list = field(default_factory=list, repr=False)  # deferred finite checks: (check_key, backend, device bool)

    def take_nonfinite(self) -> list:
        """Deferred checks since the last call: [(check_key, backend)] whose output was not finite (one sync)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        try:
            flags = torch.stack([f for _, _, f in pending]).isfinite().tolist()
        except RuntimeError:  # flags on several devices
            flags = [bool(f.isfinite()) for _, _, f in pending]
        return [(key, name) for (key, name, _), ok in zip(pending, flags) if not ok]

    def __post_init__(self):
        for name in (self.backend, *self.fallbacks):
            if name != AUTO:
                REGISTRY.get(name)  # KeyError naming the known backends

    def chain(self, first: str) -> tuple[str, ...]:
        seen: list[str] = []
        for n in (first, *self.fallbacks, REFERENCE):
            if n not in seen and n != AUTO:
                seen.append(n)
        return tuple(seen)


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``name`` for every call in this block (overrides the config's backend)."""
    REGISTRY.get(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


# ---------------------------------------------------------------- validation

def _validate(q, k, v, heads, mask, skip_reshape):
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise ValueError("q, k and v must be tensors")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    want = 4 if skip_reshape else 3
    layout = "[B, H, N, D]" if skip_reshape else "[B, N, H*D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != want:
            raise ValueError(f"{name} must be {layout} ({want}-D) with skip_reshape={skip_reshape}, got shape {tuple(t.shape)}")
    if not isinstance(heads, int) or heads <= 0:
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
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[-1] % heads:
                raise ValueError(f"{name} width {t.shape[-1]} is not divisible by heads={heads}")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q width {q.shape[-1]} != k width {k.shape[-1]}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"key length {k.shape[1]} != value length {v.shape[1]}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"mask must be a tensor or None, got {type(mask).__name__}")
        if mask.ndim not in (2, 3, 4):
            raise ValueError(f"mask must be 2-D, 3-D or 4-D, got shape {tuple(mask.shape)}")
        if mask.device != q.device:
            raise ValueError(f"mask on {mask.device}, q on {q.device}")


def _mask_4d(mask):
    """ComfyUI's rule: a 2-D mask gets a batch dim, a 3-D one a heads dim."""
    if mask is not None and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


def _qkv_4d(q, k, v, heads, skip_reshape):
    """ComfyUI's q/k/v as 4-D views and their layout: ``[B, H, N, D]`` as is, ``[B, N, H*D]`` as ``[B, N, H, D]``."""
    if skip_reshape:
        return q, k, v, "HND"
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (heads, -1)), v.unflatten(-1, (heads, -1)), "NHD"


def _norm_mask(mask, b, h, nq, nk):
    """The 4-D mask, checked to broadcast to [B, H, Nq, Nk]."""
    mask = _mask_4d(mask)
    if mask is None:
        return None
    try:
        torch.broadcast_shapes(mask.shape, (b, h, nq, nk))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Nq, Nk] = {[b, h, nq, nk]}") from None
    return mask


# ---------------------------------------------------------------- helpers

_cc_cache: dict = {}


def _cc(device: torch.device):
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _cc_cache:
        _cc_cache[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _cc_cache[idx]


def make_spec(q4, k4, v4, layout, mask) -> CallSpec:
    """Spec of a call whose q/k/v are 4-D in ``layout``."""
    if layout == "HND":
        b, h, nq, d = q4.shape
        hk, nk = k4.shape[1], k4.shape[2]
    else:
        b, nq, h, d = q4.shape
        nk, hk = k4.shape[1], k4.shape[2]
    mk = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return CallSpec(q4.device.type, _cc(q4.device), q4.dtype, b, h, hk, nq, nk, d, v4.shape[-1], mk)


def _to(t, src, dst):
    return t if src == dst else t.transpose(1, 2)


_warned: set = set()


def _warn_once(key, msg, *args):
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def reset_warnings() -> None:
    _warned.clear()


_plan_cache: dict = {}


def plan_for(backend: Backend, spec: CallSpec):
    key = (backend.name, spec)
    hit = _plan_cache.get(key)
    if hit is None:
        hit = backend.plan(spec)
        _plan_cache[key] = hit
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
    q, k, v = (_to(t, layout, bl) for t in (q4, k4, v4))
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
    return _to(out, bl, layout), extras


# ---------------------------------------------------------------- entry point

def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    mask: torch.Tensor | None = None,
    *,
    skip_reshape: bool = False,
    skip_output_reshape: bool = False,
    config: AttentionConfig | None = None,
    options: dict | None = None,
    scale: float | None = None,
    tag: str | None = None,
    check_key=None,
    k_smoothed: bool = False,
) -> torch.Tensor:
    """Attention with ComfyUI's calling convention, dispatched per ``config``.

    ``options`` (per call) override ``config.options[backend]`` for this call only,
    e.g. per-layer SpargeAttn thresholds; ``tag`` (e.g. ``"layer7"``) files the call's
    metrics (sparsity) under ``backend@tag`` in the stats.  ``check_key`` names the call in deferred
    finite checks.  ``k_smoothed``: K's mean over the sequence was already subtracted (a compiled graph does it for a
    ``smooth_k`` backend): such backends are told not to do it again; every other backend computes the same attention.
    """
    cfg = config if config is not None else AttentionConfig()
    key = None
    if options is None and tag is None and scale is None and not cfg.record_time and _forced.get() is None:
        # k_smoothed is in the key: the cached options then carry the smooth_k=False it implies
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, heads, skip_reshape,
               None if mask is None else (mask.shape, mask.dtype, mask.device), k_smoothed)
        hit = cfg._fast.get(key)
        if hit is not None:
            out = _fast_call(cfg, hit, q, k, v, heads, mask, skip_reshape, check_key, skip_output_reshape)
            if out is not None:
                return finish(out, hit[3], hit[2], skip_output_reshape)
            cfg._fast.pop(key, None)  # it raised: the full path below handles and counts it
    q4, k4, v4, layout, spec, mask4, scale = prepare(q, k, v, heads, mask, skip_reshape, scale)

    first = _forced.get() or cfg.backend
    if first == AUTO:
        from .auto import select

        first = select(cfg, q4, k4, v4, layout, mask4, spec, scale)

    out = None
    prev, prev_reason = None, None
    raised = False
    stats = cfg.stats
    for name in cfg.chain(first):
        backend = REGISTRY.get(name)
        target, reason = plan_for(backend, spec)
        if reason is None:
            if prev is not None:
                stats.count_fallback(prev, name, prev_reason)
                _warn_once((prev, prev_reason), "%s cannot take %s: %s; using %s (counted in stats)",
                           prev, spec.short(), prev_reason, name)
            opts = cfg.options.get(name) or {}
            if options:
                opts = {**opts, **options}
            if k_smoothed and backend.smooth_k:
                opts = {**opts, "smooth_k": False}
            try:
                if cfg.record_time:
                    if q.is_cuda:
                        t0, t1 = cuda_event(), cuda_event()
                        t0.record()
                    else:
                        t0 = time.perf_counter()
                out, extras = run_backend(backend, q4, k4, v4, layout, mask4, spec, target, scale, opts, skip_output_reshape)
                _check(cfg, backend, out, spec, check_key)
                if cfg.record_time:
                    if q.is_cuda:
                        t1.record()
                    else:
                        t1 = time.perf_counter()
                    stats.add_time(name, t0, t1)
            except Exception as e:
                if name == REFERENCE or not cfg.allow_fallback:
                    raise
                err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                stats.count_error(name, err)
                raised = True
                prev, prev_reason = name, ("non-finite output" if isinstance(e, NonFiniteOutput) else f"raised {err}")
                continue
            stats.count_call(name)
            if extras:
                stats.add_metrics(f"{name}@{tag}" if tag else name, extras)
            elif key is not None and not raised:  # a backend that raised is tried again on the next call
                if len(cfg._fast) > 4096:
                    cfg._fast.clear()
                cfg._fast[key] = (backend, target, spec, layout, (prev, prev_reason) if prev else None, opts)
            break
        if not cfg.allow_fallback and name == first:
            raise BackendUnavailableError(f"attention backend {name!r} cannot take {spec.short()}: {reason} (fallback is off)")
        if prev is None:
            prev, prev_reason = name, reason
    if out is None:  # pragma: no cover - SDPA takes every valid call
        raise RuntimeError(f"no attention backend could take {spec.short()}")

    return finish(out, layout, spec, skip_output_reshape)


def finite_flag(out: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 device tensor that is finite exactly when every element of ``out`` is: its sum, one reduction
    kernel (attention outputs are convex combinations of V, so the sum stays far inside fp32's range)."""
    return torch.sum(out, dtype=torch.float32)


def _check(cfg, backend, out, spec, check_key):
    if not cfg.check_finite or not backend.quantized:
        return
    if cfg.check_finite == "deferred" and cfg.in_forward:
        if len(cfg._pending) >= 4096:  # nobody is reading them: settle these now rather than grow
            for key, name in cfg.take_nonfinite():
                cfg.stats.count_error(name, "non-finite output (deferred check not read in time)")
                _warn_once((name, "deferred"), "%s returned NaN/inf (call %s); deferred checks were not read in time",
                           name, key)
        cfg._pending.append((check_key, backend.name, finite_flag(out)))
    elif not bool(finite_flag(out).isfinite()):
        raise NonFiniteOutput(f"{backend.name} returned non-finite values (NaN/inf) for {spec.short()}")


def _fast_call(cfg, hit, q, k, v, heads, mask, skip_reshape, check_key, skip_output_reshape):
    """A call shaped exactly like an earlier one: same plan, no validation or planning.  None if it raised."""
    backend, target, spec, layout, fallback, opts = hit
    q4, k4, v4, _ = _qkv_4d(q, k, v, heads, skip_reshape)
    try:
        out, _ = run_backend(backend, q4, k4, v4, layout, _mask_4d(mask), spec, target, spec.head_dim ** -0.5, opts,
                             skip_output_reshape)
        _check(cfg, backend, out, spec, check_key)
    except Exception:
        return None
    if fallback is not None:
        cfg.stats.count_fallback(fallback[0], backend.name, fallback[1])
    cfg.stats.count_call(backend.name)
    return out


def direct_call(cfg: AttentionConfig, name: str, q, k, v, heads, skip_reshape=False, skip_output_reshape=False,
                k_smoothed=False):
    """``(call, None)``: a function for calls shaped exactly like this one (no mask) that runs backend ``name`` with
    nothing else -- the view to the kernel's layout, the kernel, the deferred NaN flag, the count, the reshape back
    -- for hosts that cache it per call shape (the node layer does). ``(None, why)`` when ``name`` refuses such a
    call (the caller falls back), ``(None, None)`` when the call needs more than that (a cast, a padded head dim, a
    head dim that is not contiguous): the full path takes those. ``call(q, k, v, check_key)`` raises whatever the kernel
    raises. ``k_smoothed`` as in :func:`attention`."""
    backend = REGISTRY.get(name)
    q4, k4, v4, layout, spec, _, scale = prepare(q, k, v, heads, None, skip_reshape)
    target, reason = plan_for(backend, spec)
    if reason is not None:
        return None, reason
    bl = kernel_layout(backend, layout, skip_output_reshape)
    if target != spec or any(t.stride(-1) != 1 for t in (q4, k4, v4)):
        return None, None
    fn, opts, calls = backend.fn, cfg.options.get(name) or {}, cfg.stats.calls
    if k_smoothed and backend.smooth_k:
        opts = {**opts, "smooth_k": False}
    check = backend.quantized  # and cfg.check_finite, read per call: the node turns it off and on per forward
    shapes = None if skip_reshape else (tuple(q4.shape), tuple(k4.shape), tuple(v4.shape))
    swap = bl != layout

    def call(q, k, v, check_key):
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("head dim not contiguous")  # same shape, other strides: the full path copies
        if shapes is not None:
            q, k, v = q.view(shapes[0]), k.view(shapes[1]), v.view(shapes[2])
        if swap:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = fn(q, k, v, layout=bl, mask=None, scale=scale, opts=opts)
        if type(out) is tuple:
            out = out[0]
        if check and cfg.check_finite:
            _check(cfg, backend, out, spec, check_key)
        calls[name] += 1
        return finish(out, bl, spec, skip_output_reshape)

    return call, None


def prepare(q, k, v, heads, mask=None, skip_reshape=False, scale=None):
    """Validate a ComfyUI-convention call; returns 4-D q/k/v views, their layout, the spec, the 4-D mask, the scale."""
    _validate(q, k, v, heads, mask, skip_reshape)
    q4, k4, v4, layout = _qkv_4d(q, k, v, heads, skip_reshape)
    spec = make_spec(q4, k4, v4, layout, mask)
    mask4 = _norm_mask(mask, spec.batch, spec.heads, spec.q_len, spec.kv_len)
    return q4, k4, v4, layout, spec, mask4, (spec.head_dim ** -0.5 if scale is None else scale)


def finish(out, layout, spec, skip_output_reshape):
    """A backend's 4-D output in ``layout`` -> what ComfyUI's attention returns."""
    if skip_output_reshape:
        return _to(out, layout, "HND")
    b, n = spec.batch, spec.q_len
    if layout == "NHD":
        return out.reshape(b, n, -1)
    return out.transpose(1, 2).reshape(b, n, -1)


def fp32_reference(q, k, v, heads, mask=None, *, skip_reshape=False, skip_output_reshape=False):
    """fp32 attention of a ComfyUI-convention call, in the layout :func:`attention` returns, computed in query chunks
    that fit in memory at video sizes (the contract matrix's reference)."""
    from .reference import reference_attention

    q4, k4, v4, layout, spec, mask4, scale = prepare(q, k, v, heads, mask, skip_reshape)
    ref = reference_attention(*(_to(t, layout, "HND") for t in (q4, k4, v4)), mask4, scale)
    return finish(_to(ref, "HND", layout), layout, spec, skip_output_reshape)


def error_vs_reference(out, q, k, v, heads, mask=None, *, skip_reshape=False, skip_output_reshape=False):
    """(cosine, relative L1) of ``out`` (what :func:`attention` returned for this call) against dense SDPA in the
    call's dtype on the same inputs (the run-time checks: a few ms at video sizes).  One device sync."""
    from .auto import accuracy

    ref = attention(q, k, v, heads, mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                    config=_DENSE)
    return accuracy(out, ref)


_DENSE = AttentionConfig(backend=REFERENCE)
