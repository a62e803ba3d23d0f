"""The ``peer:<kernel>`` row: an override that calls one kernel straight from ComfyUI's hook with nothing else, as
other node packs patch attention; the yardstick for Patch Attention's dispatch cost (:mod:`.rows`)."""

from __future__ import annotations

from ..attention import REGISTRY


def peer_override(backend_name: str):
    """An override that calls one kernel straight from ComfyUI's hook, as other packs patch: a view to the kernel's
    layout, the call, a reshape back; ComfyUI's own function for a call shape the kernel refused once."""
    b = REGISTRY.get(backend_name)
    refused = set()

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        key = (q.shape, k.shape)
        if mask is None and key not in refused:
            try:
                return _call(q, k, v, heads, skip_reshape, skip_output_reshape)
            except Exception:
                refused.add(key)
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)

    def _call(q, k, v, heads, skip_reshape, skip_output_reshape):
        bsz = q.shape[0]
        if skip_reshape:
            layout, d = "HND", q.shape[-1]
        else:
            d = q.shape[-1] // heads
            q, k, v = (t.view(bsz, -1, heads, d) for t in (q, k, v))
            layout = "NHD"
        kl = layout if layout in b.layouts else b.layouts[0]
        if kl != layout:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = b.fn(q, k, v, layout=kl, mask=None, scale=d ** -0.5, opts=b.options)
        if isinstance(out, tuple):
            out = out[0]
        if kl == "NHD":
            return out.transpose(1, 2) if skip_output_reshape else out.reshape(bsz, -1, heads * out.shape[-1])
        return out if skip_output_reshape else out.transpose(1, 2).reshape(bsz, -1, heads * out.shape[-1])

    return override
