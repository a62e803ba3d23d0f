"""Qwen-Image (text to image, Qwen-Image-Edit and its 2509/2511 releases, Qwen-Image-Layered) and Mage-Flow, which
runs Qwen-Image's blocks: the image tokens split over GPUs between the first and last block, the text whole on every
GPU.

ComfyUI's ``QwenImageTransformer2DModel._forward`` packs the latent into ``img`` ``[B, L, C]`` and joins the reference
latents' tokens after it (Qwen-Image-Edit: one more block of image tokens per reference), keeps the text in ``txt``
``[B, T, C]``, computes the RoPE frequencies ``pe`` for the text's then the image's positions (``[B, 1, T + L, ...]``,
dim 2) and the timestep embedding ``vec`` (``[B, C]``; ``[2B, C]`` where the references get their own zero timestep,
Qwen-Image-Edit 2511's ``index_timestep_zero``), then runs each block as ``block(img, txt, vec, pe)`` (the
block-replace key ``("double_block", i)``).  A block's one attention call is joint, text first: the text is the prefix
every GPU keeps whole, and the rest of the block is per token, or per stream.

- **The text's padding mask** (``[B, T]``, from the text encoder) comes to the blocks from the forward itself, and each
  block turns it into a key mask over ``[text, image]`` ``[B, 1, T + L]``; split, a GPU's call carries its own share
  of it, which the exchange joins into the whole sequence's mask for the kernel.
- **The references' zero timestep**: the block modulates its first ``num_embeds`` image tokens (the latent's) with the
  timestep and the rest (the references') with timestep zero, ``num_embeds`` coming from the forward too; split, each
  GPU's block is run with where that boundary falls in its own share.  ComfyUI gives a block-replace patch no way to
  pass that number, so the unit sets it in the forward's ``block_wrap`` for the block's call (the value of that
  forward on that GPU only) and puts it back afterwards.  Where another node's block patch stands between the unit
  and the block, that forward runs on one GPU.
- Mage-Flow has no zero timestep and no rotary text positions; it is otherwise the same forward.
"""

from __future__ import annotations

from . import Unit, by_shapes

TZI = "timestep_zero_index"  # the forward's variable the block reads the latent/reference boundary from


class QwenImageUnit(Unit):
    name = "Qwen-Image"
    classes = ("QwenImageTransformer2DModel",)
    graphs = True  # measured: docs/multi-gpu.md, "CUDA graphs in the node"
    # the modulation (img_mod, txt_mod) and the text stream (txt_mlp; the attention's add_q/k/v_proj and to_add_out)
    shared_linears = ("_mod", "txt_", "add_", "to_add_out")

    def most_tokens(self, dm, shape, conds: dict):
        return by_shapes(dm, shape, conds, text=True)

    def block_keys(self, dm) -> list:
        return [("double_block", i) for i in range(len(dm.transformer_blocks))]

    def block(self, key, args, inner, ctx):
        i = key[1]
        img, txt = args["img"], args["txt"]
        zero_timestep = args["vec"].shape[0] != img.shape[0]  # [2B, C]: the references on their own timestep
        if i == 0:
            ctx.start(img.shape[1], prefix=txt.shape[1], why_not=self.why_not(args["transformer_options"], inner,
                                                                              zero_timestep))
        if not ctx.split:
            return inner(args)
        a = dict(args)
        if i == 0:
            a["img"] = ctx.shard(img, 1, ends=False)
        a["pe"] = ctx.shard(args["pe"], 2)
        if zero_timestep:
            out = self._with_boundary(inner, a, ctx)
        else:
            out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"], 1, ends=False)}
        return out

    @staticmethod
    def _with_boundary(inner, args, ctx):
        """``inner(args)`` with the latent/reference boundary of this GPU's share of the image tokens."""
        cell = _cell(inner, TZI)
        whole = cell.cell_contents
        s0, sc = ctx.rows()
        cell.cell_contents = min(max(whole - s0, 0), sc)
        try:
            return inner(args)
        finally:
            cell.cell_contents = whole

    @staticmethod
    def why_not(topts, inner, zero_timestep: bool) -> str:
        """Extensions that see the whole token sequence inside the loop (they would get one GPU's share), and a zero
        timestep the unit cannot hand the block."""
        patches = topts.get("patches", {})
        for name in ("double_block", "attn1_patch"):
            if patches.get(name):
                return f"a model patch ({name}) that needs the whole sequence"
        if zero_timestep and _cell(inner, TZI) is None:
            return ("the reference images' own timestep (index_timestep_zero) under another node's block patch, which "
                    "the image tokens' split cannot pass on")
        return ""


class MageFlowUnit(QwenImageUnit):
    name = "Mage-Flow"
    classes = ("MageFlowTransformer2DModel",)
    graphs = False  # not measured


def _cell(fn, name: str):
    """The closure cell of ``fn``'s free variable ``name`` (None: ``fn`` has none by that name)."""
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or not fn.__closure__:
        return None
    return fn.__closure__[code.co_freevars.index(name)]
