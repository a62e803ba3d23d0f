"""The attention call as a ``torch.library`` custom op, for models run under ``torch.compile``.

Dynamo cannot trace the dispatcher (it reads clocks while ``auto`` tunes, keeps statistics and deferred NaN
checks in Python lists, and branches on every call's shapes), and it should not: the kernels are opaque to it
anyway.  A compiled model's attention call therefore becomes one node of the graph,
``torch.ops.patch_attention.attention``, whose fake implementation gives the output's shape and whose real one
runs the dispatcher eagerly.  No graph break per layer, and the op's shapes are symbolic, so a new call shape is no
new compile.

What the graph can do better than the op stays in the graph (:func:`traced_call`): the output's final reshape (the op
returns ``[B, N, H, Dv]``, which every kernel that computes in NHD writes as is and which inductor turns into what
the model wants, fused with whatever reads it), and a backend's declared input work (``Backend.smooth_k``: K's mean
over the sequence subtracted in the graph, fused with the ops that produce K, instead of eagerly inside the op).

The op cannot take Python objects, so the caller registers its handler (``register``) and passes the returned
handle as a one-element CPU tensor (:func:`handle_tensor`), a graph input that compiled code reads from the caller at
every call: ComfyUI's TorchCompileModel keeps no guard on what a model carries in ``transformer_options``, so a graph
compiled for one patched model runs again for the next patch of the same model, and an integer would name the first
one's handler (dead by then, or with the old settings).  The handler gets ``(q, k, v, mask, heads, skip_reshape,
precise, k_smoothed, scale, enable_gqa)`` and returns what ComfyUI's attention returns for
``skip_output_reshape=False``: ``[B, N, H*Dv]``.
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref

import torch

from .calls import comfy_kv

# The op and its handles are one per process, whichever copy of this module registered the op first: a pack can be
# imported twice in one process (ComfyUI's loader and a test suite's), and the op's implementation must find the
# handlers every copy registers, without two copies handing out the same handle.
_SHARED = "_patch_attention_op_handles"
if _SHARED not in sys.modules:
    _shared = types.ModuleType(_SHARED)
    _shared.handlers, _shared.ids = weakref.WeakValueDictionary(), itertools.count(1)
    sys.modules[_SHARED] = _shared
_handlers = sys.modules[_SHARED].handlers
_ids = sys.modules[_SHARED].ids


def register(handler_owner) -> int:
    """Register ``handler_owner`` (an object with ``op_call(...)``); returns its handle for :func:`attention_op`."""
    h = next(_ids)
    _handlers[h] = handler_owner
    return h


def handle_tensor(handle: int) -> torch.Tensor:
    """``handle`` as the op takes it: a one-element int64 tensor on the CPU (read without a device sync)."""
    return torch.tensor(handle, dtype=torch.int64)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, heads: int,
               skip_reshape: bool, handle: torch.Tensor, precise: bool, k_smoothed: bool, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    h = int(handle)
    owner = _handlers.get(h)
    if owner is None:
        raise RuntimeError(f"patch_attention::attention: handle {h} belongs to no live patched model")
    out = owner.op_call(q, k, v, mask, heads, skip_reshape, precise, k_smoothed, scale, enable_gqa)  # [B, N, H*Dv]
    # the fake implementation promises a contiguous [B, N, H, Dv]: a free view for every kernel that wrote NHD
    return out.unflatten(-1, (q.shape[1] if skip_reshape else heads, -1)).contiguous()


def _fake(q, k, v, mask, heads, skip_reshape, handle, precise, k_smoothed, scale=None, enable_gqa=False):
    if skip_reshape:  # [B, H, N, D]
        b, h, n = q.shape[0], q.shape[1], q.shape[2]
        dv = v.shape[-1]
    else:  # [B, N, H*D]; K/V with k width / D heads (fewer than Q's under enable_gqa)
        b, n = q.shape[0], q.shape[1]
        h = heads
        dv = v.shape[-1] // (k.shape[-1] // (q.shape[-1] // heads))
    return q.new_empty((b, n, h, dv))


def _registered():
    try:
        return torch.ops.patch_attention.attention
    except (AttributeError, RuntimeError):
        return None


attention_op = _registered()
if attention_op is None:
    attention_op = torch.library.custom_op("patch_attention::attention", mutates_args=())(_attention)
    attention_op.register_fake(_fake)


def traced_call(q, k, v, mask, heads, skip_reshape, skip_output_reshape, handle, precise, smooth_k, scale=None,
                enable_gqa=False):
    """The attention call in a compiled graph: ``smooth_k`` (a ``Backend.smooth_k`` backend, no mask, no precision
    request) subtracts K's mean over the sequence here, then the op, then the reshape ComfyUI's convention asks for.
    A K or V of more than 3 dims beside a ``[B, N, H*D]`` q (SD3's ``[B, N, H, D]`` V) is read as ComfyUI reads it, a
    reshape in the graph, so the op only ever sees ``[B, N, W]``."""
    if not skip_reshape and (k.ndim != 3 or v.ndim != 3):
        k, v = comfy_kv(q, k, v, heads, enable_gqa)
    if smooth_k:
        k = k - k.mean(dim=2 if skip_reshape else 1, keepdim=True)
    out = attention_op(q, k, v, mask, heads, skip_reshape, handle, precise, smooth_k, scale, enable_gqa)
    return out.transpose(1, 2) if skip_output_reshape else out.flatten(2)
