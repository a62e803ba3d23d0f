"""ComfyUI's own attention nodes as rows of the end-to-end benchmark (``core:<name>``).

A core row applies core's node through its class, as a graph with the node's default widget values would (the
inputs below are what such a graph passes), and times the model it returns. Where the running ComfyUI has no such
node, or its kernel cannot run here, the row is reported as not available, with the reason; nothing of core is
copied here. Adding a core row is one :class:`CoreNode` entry in :data:`CORE_NODES`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..attention import REGISTRY


class RowUnavailable(RuntimeError):
    """A row that cannot run with this ComfyUI or on this machine; the message says why."""


def comfyui_release() -> str:
    """The running ComfyUI's version (its comfyui_version.py), or "unknown"."""
    try:
        from comfyui_version import __version__
    except ImportError:
        return "unknown"
    return __version__


def _int8_missing() -> str | None:
    try:
        import comfy.ldm.modules.attention as ca
    except ImportError:
        return "ComfyUI is not importable"
    if not getattr(ca, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
        return "comfy-kitchen's int8 attention is not available here (ComfyUI >= 0.33 and its CUDA kernel)"
    return None


def _sol_missing() -> str | None:
    av = REGISTRY.get("kitchen_sol").availability()
    return None if av.ok else f"comfy-kitchen's Sol-Attn kernel is not available here: {av.reason}"


@dataclass(frozen=True)
class CoreNode:
    """One of core's attention nodes, as a benchmark row uses it."""

    row: str  # the row's name
    title: str  # the node's display name
    module: str  # the node's module in ComfyUI
    class_name: str
    inputs: dict  # what a graph with the node's default widgets passes besides ``model``
    kernel_missing: Callable[[], str | None]  # why the node's kernel cannot run here (None: it can)
    sparse: bool = False  # the kernel skips attention mass
    twin: str | None = None  # Patch Attention's row that runs the same kernel with the same settings


# Model Sparse Attention (comfy_extras/nodes_sparse_attention.py) with its widgets at their defaults: method sol-attn,
# tau 1.3, start_percent 0.2, end_percent 1.0, min_tokens 12288, extra_tokens 256, no dense blocks
SOL_DEFAULTS = {"selection": {"selection": "sol-attn", "tau": 1.3}, "start_percent": 0.2, "end_percent": 1.0,
                "dense_blocks": "", "min_tokens": 12288, "extra_tokens": 256, "sink_conditioning": "exact_kv_and_rows",
                "verbose": False}

CORE_NODES = {n.row: n for n in (
    CoreNode("core:kitchen-int8", "Model Attention Backend", "comfy_extras.nodes_model_advanced", "ModelAttentionBackend",
             {"attention": "comfy kitchen attention"}, _int8_missing),
    CoreNode("core:sol-attn", "Model Sparse Attention", "comfy_extras.nodes_sparse_attention", "BlockSparseAttention",
             SOL_DEFAULTS, _sol_missing, sparse=True, twin="kitchen_sol"),
)}


def node_class(node: CoreNode):
    """The node's class in the running ComfyUI; :class:`RowUnavailable` where it has none or its module fails."""
    where = f"ComfyUI {comfyui_release()}"
    try:
        mod = importlib.import_module(node.module)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name in (node.module, node.module.split(".")[0]):
            raise RowUnavailable(f"{node.title} is not available on {where} (no {node.module})") from None
        raise RowUnavailable(f"{node.title} is not available on {where}: its module does not import "
                             f"({type(e).__name__}: {e})") from None
    cls = getattr(mod, node.class_name, None)
    if cls is None:
        raise RowUnavailable(f"{node.title} is not available on {where} (no {node.class_name} in {node.module})")
    return cls


def missing(row: str) -> str | None:
    """Why core row ``row`` cannot run here, or None."""
    node = CORE_NODES[row]
    try:
        node_class(node)
    except RowUnavailable as e:
        return str(e)
    return node.kernel_missing()


def run_node(cls, **inputs):
    """A node's outputs for ``inputs``, called as ComfyUI's executor calls it: a V3 node's ``execute``, a classic
    node's ``FUNCTION``."""
    if hasattr(cls, "define_schema"):
        out = cls.execute(**inputs)
    else:
        out = getattr(cls(), cls.FUNCTION)(**inputs)
    if inspect.isawaitable(out):
        out.close()
        raise RowUnavailable(f"{cls.__name__}'s execute is asynchronous: the benchmark applies synchronous nodes only")
    return out


def apply(model, row: str):
    """``(clone, note)``: ``model`` as core row ``row``'s node leaves it; :class:`RowUnavailable` where it cannot
    run here."""
    node = CORE_NODES[row]
    cls = node_class(node)
    why = node.kernel_missing()
    if why is not None:
        raise RowUnavailable(why)
    return run_node(cls, model=model, **node.inputs)[0], f"{node.title} node"
