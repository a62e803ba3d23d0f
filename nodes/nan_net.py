"""The NaN net and the per-forward bookkeeping, in the APPLY_MODEL wrapper around each model forward.

Quantized kernels can return NaN where dense attention does not (SageAttention does when every key is equal, as a
zeroed negative prompt gives).  The net: on the first forward of a run (and on every forward of a model whose code
turns NaN into numbers, where the output would no longer show it), each quantized call leaves a finite flag on the
device and the forward reads them all with one sync; on later forwards only the forward's output is checked (one
reduction instead of one per attention call: on host-bound models per-call flags cost more than 2 % of a step).  A
non-finite output is recomputed with per-call flags to find the layers; those run dense for the rest of the run (on
every device: a layer found on one GPU is dense on the others from their next forward) and the forward is computed
again.  A run on exact kernels only is never checked: nothing there can put NaN where the unpatched model had none.

The same read takes ``auto``'s accuracy checks of a check step (:mod:`.recheck`): their sums, left on the device by
the forward's calls, are read back with the NaN flags in one device read, never with a sync of their own.  A lossy
choice found beyond the gate is refused and the forward computed again without it, with the same checks (the kernel
that replaces it is judged on this step too); a forward computed again to find or avoid NaN makes no accuracy checks.

The wrapper also starts each forward of its sampling thread's lane: the layer counter back to 0, the step schedule and
``auto``'s check step read once per forward rather than per attention call. After the run's first forward, the
layer counter says how many attention calls reached the override: none means the model's attention bypasses the hook
(it calls ComfyUI's attention without ``transformer_options``), which is counted and said once per run
(:meth:`~.override.AttentionOverride.unreached`).  It wraps ComfyUI's torch.compile
wrapper from outside, so it runs eagerly in compiled models too.
"""

from __future__ import annotations

import logging
import math
import sys

import torch

from ..attention.calls import finite_flag
from ..parallel.context import CP_KEY
from . import recheck
from .hook import COMPILE_KEY, BoundWrapper, as_float

log = logging.getLogger("patch_attention.nodes")


def output_flag(out):
    """A 0-d device tensor, finite exactly when the forward's output is (NaN in any attention output reaches it), or
    None for an output that is not one tensor."""
    return finite_flag(out) if isinstance(out, torch.Tensor) and out.is_floating_point() else None


CONTROL_ARG = 4  # apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
TOPTS_ARG = 5


def whole_control(args, kwargs):
    """The forward's arguments with its ControlNet residuals' lists copied (the dict and its lists only, not the
    tensors): UNet-style models pop each residual as they add it (``openaimodel.apply_control``, HunyuanDiT's blocks),
    so a forward computed again needs lists of its own, or it runs without the ControlNet."""
    if len(args) > CONTROL_ARG:
        control = args[CONTROL_ARG]
        if isinstance(control, dict):
            args = (*args[:CONTROL_ARG], _copy_lists(control), *args[CONTROL_ARG + 1:])
    elif isinstance(kwargs.get("control"), dict):
        kwargs = {**kwargs, "control": _copy_lists(kwargs["control"])}
    return args, kwargs


def _copy_lists(control: dict) -> dict:
    return {k: list(v) if isinstance(v, list) else v for k, v in control.items()}


class ForwardWrapper(BoundWrapper):
    """APPLY_MODEL wrapper (each device's clone of a MultiGPU split runs the same one, each in its own lane)."""

    def __call__(self, executor, *args, **kwargs):
        ov = self.override
        if ov.nan_net:  # a forward the net may compute again: each attempt gets the ControlNet residuals whole

            def forward():
                a, kw = whole_control(args, kwargs)
                return executor(*a, **kw)
        else:

            def forward():
                return executor(*args, **kwargs)

        x = args[0] if args else kwargs.get("x")
        ln = ov.lane(x.device if isinstance(x, torch.Tensor) else None)
        cfg = ln.config
        sigma = args[1] if len(args) > 1 else kwargs.get("t")
        spot = ov.rechecks.pending(ln)  # checks at the middle and last step are due: the sigma says which forward
        if ov.choice.sigma_range is not None or spot or ov.choice.reads_sparse_phase(ln):
            sigma = as_float(sigma)  # read once for every use below: one sync per forward
        ln.active = ov.choice.in_range(sigma) if ov.choice.sigma_range is not None else True
        ov.choice.sparse_phase(ln, sigma)
        ln.check_phase = ov.rechecks.check_phase(ln, ov.rechecks.phase_of(sigma) if spot else None)
        ln.check_round += ln.check_phase is not None
        ov.rechecks.refresh(ln)  # another lane refused one of auto's choices: this lane's cached calls go
        ln.layer = 0
        ln.probes = []
        per_call = False
        if ov.nan_net:
            if ov.hides_nan is None:
                ov.hides_nan = model_hides_nan(getattr(executor, "class_obj", None))
            per_call = ln.first_forward or ov.hides_nan
            cfg.check_finite = "deferred" if per_call else False
        cfg.in_forward = True
        try:
            out = self.checked(ov, ln, forward, per_call, args, kwargs)
            if ln.first_forward and ln.layer == 0 and not ov.traced_host and ov.replaced_by is None:
                # no attention call of the run's first forward reached the override, though it is on the hook (only
                # the first: a cache node, e.g. EasyCache, may skip a later forward's blocks altogether)
                topts = args[TOPTS_ARG] if len(args) > TOPTS_ARG else kwargs.get("transformer_options")
                wrappers = (topts or {}).get("wrappers", {}).get("apply_model", {})
                ov.unreached(ln, getattr(executor, "class_obj", None), compiled=COMPILE_KEY in wrappers)
            ov.choice.note_choices(ln)
            ln.first_forward = False
        finally:
            cfg.in_forward = False
            if ov.nan_net:
                cfg.check_finite = "deferred"  # outside a forward: checked at once
            ln.active = None
            ln.check_phase = None
            ln.probes = []
        return out

    @staticmethod
    def checked(ov, ln, forward, per_call, args, kwargs):
        """The forward, its NaN flags and auto's accuracy checks read back in one device read, and computed again
        where they found something: layers with NaN go dense (:meth:`~.choose.DenseChoice.mark_nonfinite`),
        lossy choices beyond the gate are refused (:meth:`~.recheck.Rechecks.refuse`)."""
        cfg = ln.config
        judged = cfg.auto is not None and cfg.auto.over_run
        while True:
            out = forward()
            split = split_context(args, kwargs)  # a forward split over GPUs: every GPU decides as one (see below)
            # the output check (after the first forward, where the model keeps NaN visible): its device flag
            flag = output_flag(out) if ov.nan_net and not per_call and ov.rechecks.lossy_ran(ln) else None
            bad, values = cfg.take_checks(([flag] if flag is not None else []) + [p.sums for p in ln.probes])
            nonfinite = flag is not None and not math.isfinite(values.pop(0)[0])
            failed = recheck.judge(ln, values)
            if failed:
                ov.rechecks.refuse(ln, failed)  # before the GPUs of a split compare: theirs see the refusal in the selectors
            refused = split.any(bool(failed)) if split is not None and judged else bool(failed)
            if refused:
                ov.rechecks.refresh(ln)
            redone = False
            if per_call:
                if split is not None:
                    bad = split.union(bad)
                if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
                    ov.hides_nan = True  # an output the later per-forward check could not read: per-call flags always
            elif ov.nan_net:
                redo = nonfinite
                if split is not None:
                    redo = split.any(redo)
                if redo:
                    cfg.check_finite = "deferred"  # find the layers: the same forward with per-call flags
                    ln.check_phase = None
                    ln.layer = 0
                    out = forward()
                    redone = True
                    bad = cfg.take_nonfinite()
                    if split is not None:
                        bad = split.union(bad)
            if bad:
                # A kernel returned NaN/inf somewhere in this forward: those layers run dense for the rest of the
                # sampling run, and the forward is computed again.
                ov.choice.mark_nonfinite(bad, ln)
                ln.check_phase = None
                ln.layer = 0
                out = forward()
                redone = True
                cfg.take_nonfinite()
            if not refused or redone:
                return out
            # a choice was refused: this forward again without it, checked as before (what replaces it too), until
            # nothing is refused -- each refusal takes a candidate away for good, so this ends
            ln.layer = 0


def split_context(args, kwargs):
    """The forward's context-parallel rank, when the forward was split over GPUs (None otherwise): its GPUs then take
    each NaN decision together (a layer found on one GPU is redone on all, as their exchanges must stay in step)."""
    topts = args[5] if len(args) > 5 else kwargs.get("transformer_options")
    ctx = topts.get(CP_KEY) if isinstance(topts, dict) else None
    return ctx if ctx is not None and ctx.split else None


_hides_nan_cache = {}


def model_hides_nan(base_model) -> bool:
    """Whether the diffusion model's code (its package's loaded modules) calls nan_to_num: NaN from an attention
    kernel could then be gone from the forward's output, so that model keeps per-call flags. Unknown: True."""
    dm = getattr(base_model, "diffusion_model", None)
    if dm is None:
        return True
    cls = type(dm)
    if cls in _hides_nan_cache:
        return _hides_nan_cache[cls]
    pkg = cls.__module__.rsplit(".", 1)[0] if "." in cls.__module__ else cls.__module__
    hides = False
    try:
        for name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None)
            if path and path.endswith(".py") and (name == pkg or name.startswith(pkg + ".")):
                with open(path, encoding="utf-8", errors="replace") as f:
                    if "nan_to_num" in f.read():
                        hides = True
                        break
    except OSError:
        hides = True
    _hides_nan_cache[cls] = hides
    return hides


_warned_nonfinite = set()


def warn_nonfinite(name, layer):
    if (name, layer) not in _warned_nonfinite:
        _warned_nonfinite.add((name, layer))
        log.warning("%s returned NaN/inf at attention layer %d (SageAttention does so when all keys are equal, "
                    "e.g. a zeroed prompt); that layer runs on SDPA for the rest of this run", name, layer)
