"""The attention call as a ``torch.library`` custom op, for models run under ``torch.compile``.

Dynamo cannot trace the dispatcher (it reads clocks while ``auto`` tunes, keeps statistics and deferred NaN
checks in Python lists, and branches on every call's shapes), and it should not: the kernels are opaque to it
anyway.  A compiled model's attention call therefore becomes one node of the graph,
``torch.ops.patch_attention.attention``, whose fake implementation gives the output's shape and whose real one
runs the dispatcher eagerly.  No graph break per layer, and the op's shapes are symbolic, so a new call shape is no
new compile.

The op cannot take Python objects, so the caller registers its handler (``register``) and passes the returned
integer; the handler gets ``(q, k, v, mask, heads, skip_reshape, skip_output_reshape, precise)``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_handlers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def register(handler_owner) -> int:
    """Register ``handler_owner`` (an object with ``op_call(...)``); returns its handle for :func:`attention_op`."""
    h = next(_ids)
    _handlers[h] = handler_owner
    return h


@torch.library.custom_op("patch_attention::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, heads: int,
                 skip_reshape: bool, skip_output_reshape: bool, handle: int, precise: bool) -> torch.Tensor:
    owner = _handlers.get(handle)
    if owner is None:
        raise RuntimeError(f"patch_attention::attention: handle {handle} belongs to no live patched model")
    out = owner.op_call(q, k, v, mask, heads, skip_reshape, skip_output_reshape, precise)
    # the fake implementation promises a fresh contiguous tensor; a kernel's strided output is made so here
    return out.contiguous()


@attention_op.register_fake
def _(q, k, v, mask, heads, skip_reshape, skip_output_reshape, handle, precise):
    if skip_reshape:  # [B, H, N, D]
        b, h, n = q.shape[0], q.shape[1], q.shape[2]
        dv = v.shape[-1]
    else:  # [B, N, H*D]
        b, n = q.shape[0], q.shape[1]
        h = heads
        dv = v.shape[-1] // heads
    shape = (b, h, n, dv) if skip_output_reshape else (b, n, h * dv)
    return q.new_empty(shape)
