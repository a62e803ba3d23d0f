"""Where a model's attention calls go, measured (test-only): the zoo checks each configuration's ``outside_hook``
declaration and the pack's call counts against this, not against the pack's own statistics.

Inside :func:`probe`:

- every ComfyUI attention function (each ``wrap_attn`` wrapper of ``comfy.ldm.modules.attention``) runs through a
  counter in place of the function it wraps: a call that arrives there without an override on its
  ``transformer_options`` never reached the hook (``outside``); an override handing a call back to ComfyUI's function
  carries the override there, and is not counted. The counter has the wrapped function's name and module, so the pack
  still recognises ComfyUI's exact functions;
- every call into the pack's override class is counted (``reached``);
- ``torch.nn.functional.scaled_dot_product_attention`` called by model code outside both (attention that bypasses
  ComfyUI's functions altogether) is counted (``direct``).

Everything is restored on exit. Not thread-safe across concurrent probes (the zoo samples one model at a time).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field

OVERRIDE_KEY = "optimized_attention_override"


@dataclass
class Counts:
    reached: int = 0  # calls into the override
    outside: int = 0  # ComfyUI attention function calls that never reached the override
    direct: int = 0  # torch SDPA calls from model code outside ComfyUI's functions and the override
    _tls: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def bypassing(self) -> int:
        """Attention calls the override could not see."""
        return self.outside + self.direct

    def as_dict(self) -> dict:
        return {"reached": self.reached, "outside": self.outside, "direct": self.direct}

    def _depth(self) -> int:
        return getattr(self._tls, "depth", 0)

    def _enter(self):
        self._tls.depth = self._depth() + 1

    def _exit(self):
        self._tls.depth = self._depth() - 1


def comfy_wrappers() -> list:
    """ComfyUI's attention functions as the models call them: the ``wrap_attn`` wrappers of its attention module."""
    import comfy.ldm.modules.attention as ca

    seen, out = set(), []
    for obj in vars(ca).values():
        code = getattr(obj, "__code__", None)
        if (callable(obj) and hasattr(obj, "__wrapped__") and code is not None and code.co_name == "wrapper"
                and "func" in code.co_freevars and getattr(obj, "__module__", "") == ca.__name__
                and id(obj) not in seen):
            seen.add(id(obj))
            out.append(obj)
    return out


@contextlib.contextmanager
def probe(override_cls):
    """Count where attention calls go while the block runs (see the module's docstring); yields :class:`Counts`."""
    import torch

    counts = Counts()
    cells = []
    for w in comfy_wrappers():
        cell = w.__closure__[w.__code__.co_freevars.index("func")]
        orig = cell.cell_contents

        def counted(*args, _orig=orig, **kwargs):
            topts = kwargs.get("transformer_options")
            if not (isinstance(topts, dict) and topts.get(OVERRIDE_KEY) is not None):
                counts.outside += 1
            counts._enter()
            try:
                return _orig(*args, **kwargs)
            finally:
                counts._exit()

        functools.update_wrapper(counted, orig)
        cells.append((cell, orig))
        cell.cell_contents = counted

    orig_call = override_cls.__call__

    def call(self, *args, **kwargs):
        counts.reached += 1
        counts._enter()
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            counts._exit()

    F = torch.nn.functional
    orig_sdpa = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        if counts._depth() == 0:
            counts.direct += 1
        return orig_sdpa(*args, **kwargs)

    override_cls.__call__ = call
    F.scaled_dot_product_attention = sdpa
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = orig_sdpa
        override_cls.__call__ = orig_call
        for cell, orig in cells:
            cell.cell_contents = orig
