"""Classic ComfyUI nodes (``NODE_CLASS_MAPPINGS``) for ComfyUI builds without ``comfy_api``."""

from __future__ import annotations

from .definitions import NODES, Node


def _input(i):
    opts = {}
    if i.default is not None:
        opts["default"] = i.default
    if i.tooltip:
        opts["tooltip"] = i.tooltip
    for key in ("min", "max", "step"):
        if getattr(i, key) is not None:
            opts[key] = getattr(i, key)
    if i.kind == "STRING":
        opts["multiline"] = i.multiline
    if i.kind == "COMBO":
        return (i.choices(), opts)
    return (i.kind, opts) if opts else (i.kind,)


def make_class(node: Node):
    def INPUT_TYPES(cls):
        req = {i.name: _input(i) for i in node.inputs if not i.optional}
        opt = {i.name: _input(i) for i in node.inputs if i.optional}
        return {"required": req, "optional": opt} if opt else {"required": req}

    def run(self, **kwargs):
        result, text = node.shown(node.run(**kwargs))
        if text is not None:  # drawn on the node by web/patch_attention.js
            return {"ui": {"text": (text,)}, "result": result}
        return result

    attrs = {
        "INPUT_TYPES": classmethod(INPUT_TYPES),
        "RETURN_TYPES": tuple(k for k, _ in node.outputs),
        "RETURN_NAMES": tuple(n for _, n in node.outputs),
        "FUNCTION": "run",
        "CATEGORY": node.category,
        "DESCRIPTION": node.description,
        "OUTPUT_NODE": node.output_node,
        "SEARCH_ALIASES": list(node.search_aliases),
        "run": run,
    }
    if node.validate is not None:
        attrs["VALIDATE_INPUTS"] = classmethod(node.validate)
    return type(node.node_id, (), attrs)


NODE_CLASS_MAPPINGS = {n.node_id: make_class(n) for n in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {n.node_id: n.display_name for n in NODES}
