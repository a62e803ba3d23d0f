"""ComfyUI's attention hook: what it hands an override, and ComfyUI's own attention functions.

ComfyUI (v0.3.64+) wraps every attention function with ``wrap_attn``: when a model's ``transformer_options`` holds
``optimized_attention_override`` it is called as ``override(func, q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)``.  Since 0.33 the keywords may include ``enable_gqa``
(K/V with fewer heads), ``scale`` and ``low_precision_attention=False`` (the call must stay exact), and q/k/v may
arrive as ``AttentionTensorContainer`` objects: an override with a ``container_function`` attribute gets them as
they are (``container_function(q, k, v, heads, ...)``, without ``func``) and takes the tensors out itself, so the
model holds no reference to them once the kernel has them.  Newer ComfyUI (0.38) also passes a checkpoint's own
attention choice as ``preferred_attention``; an override on the hook takes precedence over it.
"""

from __future__ import annotations

import torch

from ..attention.calls import validate

OVERRIDE_KEY = "optimized_attention_override"
COMPILE_KEY = "torch.compile"  # the APPLY_MODEL wrapper key of ComfyUI's TorchCompileModel (comfy_api.torch_helpers)
ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")

# ComfyUI's exact attention functions: where Patch Attention runs dense attention and the model's own function is
# one of these, it calls that function, so a dense call costs what it cost before the patch.
HOST_EXACT = frozenset({"attention_pytorch", "attention_basic", "attention_split", "attention_sub_quad"})
HOST = "comfyui"  # stats name of calls handed to ComfyUI's own attention function
# The backend a user picks to keep ComfyUI's own attention function (its name in saved workflows); the registry's
# backend of the same name is PyTorch's SDPA, the reference (attention.names.REFERENCE)
COMFYUI_OWN = "sdpa"
PREVIOUS = "previous override"  # stats name of calls handed to the override Patch Attention was applied over


class HookMissingError(RuntimeError):
    pass


def check_hook() -> None:
    """Raise a clear error on a ComfyUI too old to have the attention override hook."""
    try:
        import comfy.ldm.modules.attention as comfy_attention
    except Exception as e:  # pragma: no cover - only outside ComfyUI
        raise HookMissingError(f"ComfyUI's attention module could not be imported: {e}") from e
    if not hasattr(comfy_attention, "wrap_attn"):
        try:
            from comfyui_version import __version__ as v
        except Exception:
            v = "unknown"
        raise HookMissingError(
            f"This ComfyUI (version {v}) has no attention override hook "
            "(transformer_options['optimized_attention_override'], added in v0.3.64). "
            "Update ComfyUI to use Patch Attention; nothing was patched."
        )


def bind(args, kwargs):
    """ComfyUI's attention signature as (named arguments, the other keywords)."""
    bound = dict(zip(ARG_NAMES, args))
    rest = dict(kwargs)
    for n in ARG_NAMES:
        if n in rest:
            bound[n] = rest.pop(n)
    return bound, rest


def wants_full_precision(a, rest) -> bool:
    """The model asked for full-precision attention on this call (newer ComfyUI passes
    ``low_precision_attention=False`` where 8-bit is unsafe; ``attn_precision=torch.float32`` is the older way)."""
    return rest.get("low_precision_attention", True) is False or a.get("attn_precision") is torch.float32


def as_float(sig):
    """A sigma (tensor, number or None) as a float; one device sync for a device tensor."""
    if sig is None or isinstance(sig, float):
        return sig
    try:
        return float(sig.flatten()[0]) if hasattr(sig, "flatten") else float(sig)
    except Exception:
        return None


def is_host_exact(func) -> bool:
    return getattr(func, "__name__", None) in HOST_EXACT and getattr(func, "__module__", "") == "comfy.ldm.modules.attention"


def same_heads(q, k) -> bool:
    """A call with as many key heads as query heads (grouped-query calls stay with the dispatcher: ComfyUI's functions
    before 0.33 take none). A ``[B, N, H, D]`` K beside a ``[B, N, H*D]`` q has as many (ComfyUI reshapes it)."""
    if q.ndim == 3 and k.ndim == 4:
        return q.shape[-1] == k.shape[-2] * k.shape[-1]
    return q.shape[-1] == k.shape[-1] and (q.ndim == 3 or q.shape[1] == k.shape[1])


def explain_failure(args, kwargs) -> None:
    """After an attention function raised on a call: a ValueError naming what is wrong with the call itself (a width
    that is not a multiple of ``heads``, mismatched shapes, ...), chained to the original error; nothing when the
    call is valid (the caller re-raises)."""
    a, rest = bind(args, kwargs)
    if not all(n in a for n in ("q", "k", "v", "heads")):
        return
    validate(a["q"], a["k"], a["v"], a["heads"], a.get("mask"), bool(a.get("skip_reshape", False)),
             bool(rest.get("enable_gqa", False)))


def call_function(func, args, kwargs):
    """``func(*args, **kwargs)`` (an attention function or override), with a clear ValueError if the call is invalid."""
    try:
        return func(*args, **kwargs)
    except (RuntimeError, TypeError, IndexError):
        explain_failure(args, kwargs)
        raise


def host_function():
    """ComfyUI's own attention function for calls that arrive as tensor containers (the hook gives no ``func``
    then): the unwrapped ``optimized_attention`` the model would have run (None outside ComfyUI).  ComfyUI picks it
    once at start-up, so it is looked up once."""
    if not _host:
        try:
            import comfy.ldm.modules.attention as comfy_attention

            f = comfy_attention.optimized_attention
            _host.append(getattr(f, "__wrapped__", f))
        except ImportError:
            return None
    return _host[0]


_host: list = []


def take(args):
    """q/k/v taken out of ComfyUI's single-owner tensor containers (the containers are empty afterwards)."""
    return (args[0].take(), args[1].take(), args[2].take(), *args[3:])


class SharedWrapper:
    """A ModelPatcher wrapper shared, not copied, when ComfyUI deep-copies model options (every clone, and every GPU's
    clone of a MultiGPU split, runs the same one)."""

    def __deepcopy__(self, memo):
        return self


class BoundWrapper(SharedWrapper):
    """A wrapper of Patch Attention's, bound to its attention override."""

    def __init__(self, override):
        self.override = override


def describe(override) -> str:
    """A readable name for an override found on the hook (ComfyUI's Model Attention Backend, Model Sparse Attention,
    another pack's function)."""
    if override is None:
        return "none"
    mod = getattr(override, "__module__", "") or type(override).__module__
    name = getattr(override, "__qualname__", None) or type(override).__qualname__
    if mod == "comfy.model_patcher" and name.endswith("optimized_attention_override"):
        inner = _closure_values(override)
        fn = next((getattr(c, "__name__", None) for c in inner if callable(c)), None)
        return f"Model Attention Backend ({fn or 'a registered attention function'})"
    if mod.endswith("nodes_sparse_attention"):
        return "Model Sparse Attention (comfy-kitchen sol_attn)"
    return f"{mod}.{name}"


def _closure_values(fn):
    return [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def reaches(override, target, depth: int = 4) -> bool:
    """``override`` is ``target`` or hands calls to it: core's stacking protocol keeps the override that was on the
    hook before it (in its closure, or as ``previous``) and calls it for the calls it declines."""
    if override is target:
        return True
    if depth == 0 or override is None:
        return False
    inner = _closure_values(override) + [getattr(override, a, None) for a in ("previous", "inner", "__wrapped__", "func")]
    return any(x is target or (callable(x) and reaches(x, target, depth - 1)) for x in inner if x is not None)
