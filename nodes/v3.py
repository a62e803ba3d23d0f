"""The same nodes through ComfyUI's V3 schema (``comfy_api.latest``), where it exists."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import ComfyExtension, io, ui

from .definitions import NODES, Node

# ComfyUI 0.33's schema carries search aliases for the node search; 0.3.64's has no such field.
SCHEMA_FIELDS = {f.name for f in dataclasses.fields(io.Schema)}


def _input(i):
    common = {"optional": i.optional, "tooltip": i.tooltip or None}
    if i.kind == "MODEL":
        return io.Model.Input(i.name, **common)
    if i.kind == "CONDITIONING":
        return io.Conditioning.Input(i.name, **common)
    if i.kind == "LATENT":
        return io.Latent.Input(i.name, **common)
    if i.kind == "VAE":
        return io.Vae.Input(i.name, **common)
    if i.kind == "COMBO":
        return io.Combo.Input(i.name, options=i.choices(), default=i.default, **common)
    if i.kind == "BOOLEAN":
        return io.Boolean.Input(i.name, default=i.default, **common)
    if i.kind == "FLOAT":
        return io.Float.Input(i.name, default=i.default, min=i.min, max=i.max, step=i.step, **common)
    if i.kind == "INT":
        return io.Int.Input(i.name, default=i.default, min=i.min, max=i.max, step=i.step, **common)
    if i.kind == "STRING":
        return io.String.Input(i.name, default=i.default, multiline=i.multiline, **common)
    return io.Custom(i.kind).Input(i.name, **common)


def _output(kind, name):
    if kind == "MODEL":
        return io.Model.Output(display_name=name)
    if kind == "STRING":
        return io.String.Output(display_name=name)
    if kind == "IMAGE":
        return io.Image.Output(display_name=name)
    return io.Custom(kind).Output(display_name=name)


def make_class(node: Node):
    def define_schema(cls):
        extra = {"search_aliases": list(node.search_aliases)} if "search_aliases" in SCHEMA_FIELDS else {}
        return io.Schema(
            node_id=node.node_id,
            display_name=node.display_name,
            category=node.category,
            description=node.description,
            inputs=[_input(i) for i in node.inputs],
            outputs=[_output(k, n) for k, n in node.outputs],
            is_output_node=node.output_node,
            **extra,
        )

    def execute(cls, **kwargs):
        result, text = node.shown(node.run(**kwargs))
        if text is not None:  # drawn on the node by web/patch_attention.js
            return io.NodeOutput(*result, ui=ui.PreviewText(text))
        return io.NodeOutput(*result)

    attrs = {"define_schema": classmethod(define_schema), "execute": classmethod(execute)}
    if node.validate is not None:
        attrs["validate_inputs"] = classmethod(node.validate)
    return type(node.node_id, (io.ComfyNode,), attrs)


NODE_LIST = [make_class(n) for n in NODES]


class PatchAttentionExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODE_LIST)


async def comfy_entrypoint() -> ComfyExtension:
    return PatchAttentionExtension()
