"""Where a split forward starts on the other GPUs: inside the first GPU's diffusion-model wrappers.

A step cache decides whether a forward runs at all or reuses an earlier output: ComfyUI's EasyCache in a
DIFFUSION_MODEL wrapper (around the diffusion model's forward, on the whole latent, before any block), LazyCache in a
PREDICT_NOISE wrapper (around the whole step).  A forward split over GPUs must take that decision once, for every GPU:
a GPU that skips while another computes leaves the other waiting at its first exchange, and a cache's state updated
once per GPU is not the state it keeps on one GPU.  LazyCache decides before any forward; for the DIFFUSION_MODEL
level, in a split forward:

- the first GPU runs every DIFFUSION_MODEL wrapper as on one GPU; the innermost (:meth:`Handoff.lead`) hands the call
  it got (the diffusion model's inputs, as the wrappers before it left them) to the other GPUs;
- the other GPUs run none of them: their one DIFFUSION_MODEL wrapper (:meth:`Handoff.follow`) waits for that call and
  runs their diffusion model on it (their own ``transformer_options``, the tensors on their device).  Where the first
  GPU's forward ended without reaching it (a cache reused an output), they stop (:class:`~..parallel.context.StopRank`):
  no GPU computes, none waits.

APPLY_MODEL wrappers run on every GPU as before (Patch Attention's lanes, the NaN net's joint decisions).  A model whose
forward calls no DIFFUSION_MODEL wrapper runs neither, and every GPU its own call.
"""

from __future__ import annotations

import threading

from ..parallel.context import CP_KEY, StopRank

KEY = "patch_attention_context_parallel_handoff"
DIFFUSION_MODEL = "diffusion_model"  # comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL


class Handoff:
    """One split forward's diffusion-model call, from the first GPU to the others.  ``move(obj, device)``: ``obj``'s
    tensors on ``device`` (nested lists, tuples and dicts; anything else as it is)."""

    def __init__(self, move):
        self.move = move
        self.call = None  # (args, kwargs) of the first GPU's diffusion-model call, once it is made
        self._ready = threading.Event()

    def leading(self, topts: dict) -> dict:
        """The first GPU's ``transformer_options`` with :meth:`lead` as its innermost DIFFUSION_MODEL wrapper."""
        return _with_wrappers(topts, {**topts.get("wrappers", {}).get(DIFFUSION_MODEL, {}), KEY: [self.lead]})

    def following(self, topts: dict) -> dict:
        """Another GPU's ``transformer_options``: :meth:`follow` in place of every DIFFUSION_MODEL wrapper."""
        return _with_wrappers(topts, {KEY: [self.follow]})

    def lead(self, executor, *args, **kwargs):
        """DIFFUSION_MODEL wrapper of the first GPU: the call goes to the other GPUs, then runs here.  A forward computed
        again (the NaN net) hands nothing more: the other GPUs compute it again from the same call."""
        if self.call is None:
            self.call = (args, kwargs)
            self._ready.set()
        return executor(*args, **kwargs)

    def end(self) -> None:
        """The first GPU's forward returned or failed: GPUs still waiting for a call get none."""
        self._ready.set()

    def close(self) -> None:
        """Every GPU's forward returned: the call goes (it holds the first GPU's ``transformer_options``, which hold
        :meth:`lead`, and so this handoff: a reference cycle until Python's cycle collector ran)."""
        self.call = None

    def follow(self, executor, *args, **kwargs):
        """DIFFUSION_MODEL wrapper of another GPU: its diffusion model on the first GPU's call."""
        self._ready.wait()
        if self.call is None:
            raise StopRank("the first GPU's forward ended before its diffusion model ran (a step cache reused an output)")
        own = next(t for t in (*args, *kwargs.values()) if isinstance(t, dict) and CP_KEY in t)
        device = own[CP_KEY].group.devices[own[CP_KEY].rank]
        a, kw = self.call
        return executor(*(self._mine(v, own, device) for v in a), **{k: self._mine(v, own, device) for k, v in kw.items()})

    def _mine(self, value, own: dict, device):
        """One argument of the first GPU's call for this GPU: its ``transformer_options`` this GPU's own."""
        if isinstance(value, dict) and CP_KEY in value:
            return own
        return self.move(value, device)


def _with_wrappers(topts: dict, diffusion_model: dict) -> dict:
    wrappers = dict(topts.get("wrappers", {}))
    wrappers[DIFFUSION_MODEL] = diffusion_model
    return {**topts, "wrappers": wrappers}
