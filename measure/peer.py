"""The ``peer:<kernel>`` row: an override that calls one kernel straight from ComfyUI's hook with nothing else, as
other node packs patch attention; the yardstick for Patch Attention's dispatch cost (:mod:`.rows`)."""

from __future__ import annotations

from ..attention import REGISTRY
from ..attention.calls import plan_call


def peer_override(backend_name: str):
    """An override that calls one kernel straight from ComfyUI's hook, as other packs patch: the bare KernelCall (a view
    to the kernel's layout, the call, a reshape back; no NaN check, no count); ComfyUI's own function for a call shape
    the kernel refused once."""
    b = REGISTRY.get(backend_name)
    refused = set()
    planned = {}  # call shape -> the bare KernelCall's run

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        key = (q.shape, k.shape, heads, skip_reshape, skip_output_reshape)
        if mask is None and key not in refused:
            try:
                return _call(key, q, k, v, heads, skip_reshape, skip_output_reshape)
            except Exception:
                refused.add(key)
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)

    def _call(key, q, k, v, heads, skip_reshape, skip_output_reshape):
        run = planned.get(key)
        if run is None:  # planned once per call shape; a shape the kernel refuses raises here (refused above)
            run = planned[key] = plan_call(b, q, k, v, heads, skip_reshape, skip_output_reshape, opts=b.options)[0].run
        return run(q, k, v)

    return override
