"""The one entry point: ComfyUI's attention calling convention in, any backend out.

``attention(q, k, v, heads, mask, skip_reshape=..., skip_output_reshape=..., config=...)``
takes q/k/v as ``[B, N, H*D]`` (or ``[B, H, N, D]`` with ``skip_reshape``) and
returns exactly what ComfyUI's own attention returns: ``[B, N, H*D]``, or
``[B, H, N, D]`` with ``skip_output_reshape``.

A call a backend cannot take (by its declared constraints) or that raises goes to
the next backend in the chain -- the config's fallbacks, then, where the config has an exact selector, the fastest
exact kernel for the call's shape, then SDPA: counted in :class:`Stats` and logged
once per (backend, reason).  The call itself (layouts, padding, casts) is a :class:`~.calls.KernelCall`, planned once
per backend and call shape; ``auto``'s and ``auto_exact``'s choices are :mod:`auto`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from .auto import select, select_exact
from .calls import (  # noqa: F401  (re-exported: the pieces of one call)
    KernelCall,
    call_key,
    call_options,
    clear_plan_cache,
    comfy_views,
    finish,
    finite_flag,
    kernel_layout,
    make_spec,
    mask_4d,
    plan_call,
    plan_for,
    prepare,
    qkv_4d,
    run_backend,
    to_layout,
)
from .names import AUTO, AUTO_EXACT, AUTO_FAST, AUTOS, REFERENCE  # noqa: F401  (re-exported)
from .reference import accuracy, accuracy_sums
from .registry import REGISTRY
from .stats import Stats, cuda_event

log = logging.getLogger("patch_attention.dispatch")

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("patch_attention_forced", default=None)


class NonFiniteOutput(RuntimeError):
    """A quantized kernel returned NaN/inf; the call is redone on the next backend."""


class BackendUnavailableError(RuntimeError):
    """The chosen backend cannot take a call and fallback is off."""


@dataclass
class AttentionConfig:
    """How calls are dispatched.

    backend: a registry name, ``"auto"``, ``"auto_fast"`` or ``"auto_exact"``.
    fallbacks: names tried, in order, when ``backend`` cannot take a call; then the fastest exact kernel for the call
        (with an exact selector, ``exact_selector``); SDPA ends every chain.
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
    # an AutoSelector.exact(): auto_exact's choices; with one, a call that falls back goes to the fastest exact kernel
    # for its shape before SDPA (created on the first "auto_exact" call; the node layer gives every patch one)
    exact_selector: object = None
    in_forward: bool = False  # set by the caller around a model forward whose deferred checks it reads
    sparse_ok: bool = True  # auto may choose sparse kernels (the caller clears it before its sparse schedule starts)
    # per config, never copied by dataclasses.replace (a config made from another starts with its own):
    _fast: dict = field(default_factory=dict, repr=False, init=False)  # exact call shape -> resolved plan
    _pending: list = field(default_factory=list, repr=False, init=False)  # deferred checks: (check_key, backend, flag)

    def take_nonfinite(self) -> list:
        """Deferred checks since the last call: [(check_key, backend)] whose output was not finite (one sync)."""
        return self.take_checks()[0]

    def take_checks(self, also=()) -> tuple[list, list]:
        """The deferred checks since the last call and the device tensors ``also`` (a forward's output flag, the
        accuracy gate's sums), read back together with one sync: ``([(check_key, backend)] whose output was not
        finite, [the values of each tensor of also, as a list of floats]])``. Nothing to read: no sync."""
        pending, self._pending = self._pending, []
        tensors = [f for _, _, f in pending] + [t for t in also]
        if not tensors:
            return [], []
        values = read_back(tensors)
        bad = [(key, name) for (key, name, _), v in zip(pending, values) if not math.isfinite(v[0])]
        return bad, values[len(pending):]

    def check_output(self, out, name: str, spec, check_key) -> None:
        """The NaN check of a quantized kernel's output (``check_finite`` on): recorded on the device while a
        ``"deferred"`` config is in a forward, else at once (a :class:`NonFiniteOutput` for a non-finite output)."""
        if self.check_finite == "deferred" and self.in_forward:
            if len(self._pending) >= 4096:  # nobody is reading them: settle these now rather than grow
                for key, bad in self.take_nonfinite():
                    self.stats.count_error(bad, "non-finite output (deferred check not read in time)")
                    _warn_once((bad, "deferred"), "%s returned NaN/inf (call %s); deferred checks were not read in "
                               "time", bad, key)
            self._pending.append((check_key, name, finite_flag(out)))
        elif not bool(finite_flag(out).isfinite()):
            raise NonFiniteOutput(f"{name} returned non-finite values (NaN/inf) for {spec.short()}")

    def __post_init__(self):
        for name in (self.backend, *self.fallbacks):
            if name not in AUTOS:
                REGISTRY.get(name)  # KeyError naming the known backends

    def chain(self, first: str) -> tuple[str, ...]:
        seen: list[str] = []
        for n in (first, *self.fallbacks, REFERENCE):
            if n not in seen and n not in AUTOS:
                seen.append(n)
        return tuple(seen)

    def tries(self, first: str, pick_exact):
        """The backends a call tries in turn: :meth:`chain`, with the exact selector's choice for the call
        (``pick_exact()``, asked only once ``first`` and the fallbacks could not take it) before SDPA."""
        seen = set()
        for n in self.chain(first):
            if n == REFERENCE and n != first and self.exact_selector is not None:
                x = pick_exact()
                if x not in seen:
                    seen.add(x)
                    yield x
            if n not in seen:
                seen.add(n)
                yield n


def read_back(tensors) -> list[list[float]]:
    """The values of device ``tensors`` (any shapes and float dtypes), read back with one sync (one per device where
    they lie on several)."""
    try:
        flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist()
    except RuntimeError:  # on several devices
        return [t.detach().reshape(-1).double().tolist() for t in tensors]
    out, i = [], 0
    for t in tensors:
        out.append(flat[i : i + t.numel()])
        i += t.numel()
    return out


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``name`` for every call in this block (overrides the config's backend)."""
    REGISTRY.get(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


_warned: set = set()


def _warn_once(key, msg, *args):
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def reset_warnings() -> None:
    _warned.clear()


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
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention with ComfyUI's calling convention, dispatched per ``config``.

    ``options`` (per call) override ``config.options[backend]`` for this call only,
    e.g. per-layer SpargeAttn thresholds; ``tag`` (e.g. ``"layer7"``) files the call's
    metrics (sparsity) under ``backend@tag`` in the stats.  ``check_key`` names the call in deferred
    finite checks.  ``k_smoothed``: K's mean over the sequence was already subtracted (a compiled graph does it for a
    ``smooth_k`` backend): such backends are told not to do it again; every other backend computes the same attention.
    ``scale``: the softmax scale (default ``head_dim ** -0.5``). ``enable_gqa``: K/V ``[B, N, Hk*D]`` with fewer heads
    than Q (ComfyUI's keyword; with ``skip_reshape`` the head counts say it).

    A call shaped exactly like an earlier one (and without per-call options, tag, scale or timing) runs the
    :class:`~.calls.KernelCall` the earlier one planned, with no validation or planning; if it raises, the call takes
    the full path, which falls back and counts it.
    """
    cfg = config if config is not None else AttentionConfig()
    key = None
    if options is None and tag is None and scale is None and not cfg.record_time and _forced.get() is None:
        # k_smoothed is in the key: the cached options then carry the smooth_k=False it implies
        key = call_key(q, k, v, heads, skip_reshape, skip_output_reshape, mask, enable_gqa, k_smoothed, cfg.sparse_ok)
        hit = cfg._fast.get(key)
        if hit is not None:
            try:
                return hit(q, k, v, check_key, mask)
            except Exception:
                cfg._fast.pop(key, None)  # the full path below handles and counts it
    call = Call(q, k, v, heads, mask, skip_reshape, skip_output_reshape, options, scale, tag, check_key, k_smoothed,
                enable_gqa)
    return _full_path(cfg, call, key)


@dataclass
class Call:
    """One call's arguments, as :func:`attention` got them (the full path's)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: torch.Tensor | None
    skip_reshape: bool
    skip_output_reshape: bool
    options: dict | None
    scale: float | None
    tag: str | None
    check_key: object
    k_smoothed: bool
    enable_gqa: bool


def _full_path(cfg: AttentionConfig, c: Call, key):
    """Validate and plan the call, then its backends in turn until one returns; the one that did is cached under
    ``key`` (None: not cached) for the next call of the shape."""
    q4, k4, v4, layout, spec, mask4, scale = prepare(c.q, c.k, c.v, c.heads, c.mask, c.skip_reshape, c.scale,
                                                     c.enable_gqa)
    first = _forced.get() or cfg.backend
    if first == AUTO or first == AUTO_FAST:
        first = select(cfg, q4, k4, v4, layout, mask4, spec, scale)
    elif first == AUTO_EXACT:
        first = select_exact(cfg, q4, k4, v4, layout, mask4, spec, scale)
    views = comfy_views(c.q, c.k, c.v, q4, k4, v4, c.skip_reshape)
    prev, prev_reason = None, None
    raised = False
    stats = cfg.stats
    for name in cfg.tries(first, lambda: select_exact(cfg, q4, k4, v4, layout, mask4, spec, scale)):
        backend = REGISTRY.get(name)
        target, reason = plan_for(backend, spec)
        if reason is None:
            opts = cfg.options.get(name) or {}
            if c.options:
                opts = {**opts, **c.options}
            if backend.declines is not None:
                reason = backend.refuses(spec, opts)
        if reason is not None:
            if not cfg.allow_fallback and name == first:
                raise BackendUnavailableError(f"attention backend {name!r} cannot take {spec.short()}: {reason} "
                                              "(fallback is off)")
            if prev is None:
                prev, prev_reason = name, reason
            continue
        if prev is not None:
            stats.count_fallback(prev, name, prev_reason)
            _warn_once((prev, prev_reason), "%s cannot take %s: %s; using %s (counted in stats)",
                       prev, spec.short(), prev_reason, name)
        opts = call_options(backend, opts, c.k_smoothed)
        plan = (backend, spec, target, layout, scale, opts, c.skip_output_reshape)
        extras = []
        try:
            out = _timed(cfg, name, KernelCall(*plan, views=views, watch=cfg, calls=stats.calls, report=extras.append), c)
        except Exception as e:
            if name == REFERENCE or not cfg.allow_fallback:
                raise
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            stats.count_error(name, err)
            raised = True
            prev, prev_reason = name, ("non-finite output" if isinstance(e, NonFiniteOutput) else f"raised {err}")
            continue
        if extras and extras[0]:
            stats.add_metrics(f"{name}@{c.tag}" if c.tag else name, extras[0])
        elif key is not None and not raised:  # a backend that raised is tried again on the next call
            if len(cfg._fast) > 4096:
                cfg._fast.clear()
            cfg._fast[key] = KernelCall(*plan, views=views, watch=cfg, calls=stats.calls, fallbacks=stats.fallbacks,
                                        fallback=(prev, prev_reason) if prev else None).run
        return out
    raise RuntimeError(f"no attention backend could take {spec.short()}")  # pragma: no cover - SDPA takes every call


def _timed(cfg: AttentionConfig, name: str, kc: KernelCall, c: Call):
    """``kc`` run on the call, timed per backend when the config records time (CUDA events: no sync)."""
    if not cfg.record_time:
        return kc.run(c.q, c.k, c.v, c.check_key, c.mask)
    cuda = c.q.is_cuda
    if cuda:
        t0, t1 = cuda_event(), cuda_event()
        t0.record()
    else:
        t0 = time.perf_counter()
    out = kc.run(c.q, c.k, c.v, c.check_key, c.mask)
    if cuda:
        t1.record()
    else:
        t1 = time.perf_counter()
    cfg.stats.add_time(name, t0, t1)
    return out


def direct_call(cfg: AttentionConfig, name: str, q, k, v, heads, skip_reshape=False, skip_output_reshape=False,
                k_smoothed=False, scale=None, enable_gqa=False, fallback=None):
    """``(call, None)``: the :class:`~.calls.KernelCall` ``run`` of backend ``name`` for calls shaped exactly like this
    one (no mask), with the config's options, NaN check and count, for hosts that cache it per call shape (the node
    layer does); ``fallback`` = (from, why): each call is also counted as that fallback to ``name``.  ``(None, why)``
    when ``name`` refuses such a call (the caller falls back). ``call(q, k, v, check_key)`` raises whatever the kernel
    raises. ``k_smoothed``, ``scale`` and ``enable_gqa`` as in :func:`attention`."""
    kc, why = plan_call(REGISTRY.get(name), q, k, v, heads, skip_reshape, skip_output_reshape,
                        opts=cfg.options.get(name), scale=scale, enable_gqa=enable_gqa, k_smoothed=k_smoothed,
                        watch=cfg, calls=cfg.stats.calls, fallbacks=cfg.stats.fallbacks, fallback=fallback)
    return (None, why) if kc is None else (kc.run, None)


def fp32_reference(q, k, v, heads, mask=None, *, skip_reshape=False, skip_output_reshape=False, scale=None,
                   enable_gqa=False):
    """fp32 attention of a ComfyUI-convention call, in the layout :func:`attention` returns, computed in query chunks
    that fit in memory at video sizes (the contract matrix's reference)."""
    from .reference import reference_attention

    q4, k4, v4, layout, spec, mask4, scale = prepare(q, k, v, heads, mask, skip_reshape, scale, enable_gqa)
    ref = reference_attention(*(to_layout(t, layout, "HND") for t in (q4, k4, v4)), mask4, scale)
    return finish(to_layout(ref, "HND", layout), layout, spec, skip_output_reshape)


def error_vs_reference(out, q, k, v, heads, mask=None, *, skip_reshape=False, skip_output_reshape=False, scale=None,
                       enable_gqa=False):
    """(cosine, relative L1) of ``out`` (what :func:`attention` returned for this call) against dense SDPA in the
    call's dtype on the same inputs (the run-time checks: a few ms at video sizes).  One device sync.  A config of
    its own per check: checks run from several sampling threads."""
    ref = attention(q, k, v, heads, mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                    config=AttentionConfig(backend=REFERENCE, check_finite=False), scale=scale, enable_gqa=enable_gqa)
    return accuracy(out, ref)


CHECK_ROWS = 512  # query rows an accuracy check recomputes (spread evenly over the call; all rows of a shorter call)


def error_sums(out, q, k, v, heads, mask=None, *, rows: int = CHECK_ROWS, offset: int = 0, skip_reshape=False,
               skip_output_reshape=False, scale=None, enable_gqa=False, reference: str | None = None) -> torch.Tensor:
    """The accuracy sums (:func:`reference.accuracy_sums`, a [5] fp64 device tensor: nothing is read back) of ``out``
    (what :func:`attention` returned for this call) against SDPA in the call's dtype, on ``rows`` query rows spread
    evenly over the call from ``offset`` (modulo the spacing; every row where the call has fewer). Attention is per
    query row, so those rows' reference needs only them and every key: 1/64 of a dense call at 32,760 tokens.
    ``reference``: an exact backend to compute it with where it takes the rows' call (no mask; the fastest exact kernel
    for the call's shape, which PyTorch's own SDPA choice may not be: its flash kernel took 1.6x cuDNN's time on
    Wan's self-attention on an H200), else PyTorch's SDPA."""
    q4, k4, v4, layout, spec, mask4, scale = prepare(q, k, v, heads, mask, skip_reshape, scale, enable_gqa)
    q4, k4, v4 = (to_layout(t, layout, "HND") for t in (q4, k4, v4))
    n = spec.q_len
    step = -(-n // rows)
    idx = torch.arange(offset % step, n, step, device=q4.device)[:rows]
    qs = q4.index_select(2, idx)
    m = mask4
    if m is not None:
        if m.dim() >= 2 and m.shape[-2] > 1:
            m = m.index_select(-2, idx)
        if m.dtype != torch.bool:
            m = m.to(qs.dtype)
    ref = None
    if reference is not None and m is None and reference in REGISTRY:
        call = plan_call(REGISTRY.get(reference), qs, k4, v4, spec.heads, skip_reshape=True, skip_output_reshape=True,
                         scale=scale)[0]
        if call is not None and not call.backend.quantized:
            ref = call(qs, k4, v4)
    if ref is None:
        kw = {"enable_gqa": True} if spec.kv_heads != spec.heads else {}
        ref = torch.nn.functional.scaled_dot_product_attention(qs, k4, v4, attn_mask=m, scale=scale, **kw)
    if skip_output_reshape:  # [B, H, N, Dv]
        got = out.index_select(2, idx)
    else:  # [B, N, H*Dv]
        got = out.index_select(1, idx).unflatten(-1, (spec.heads, -1)).transpose(1, 2)
    return accuracy_sums(got, ref)
