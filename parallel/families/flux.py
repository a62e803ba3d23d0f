"""Flux.1 (dev, schnell, Kontext, Fill, Redux) and Flux.2, with LongCat-Image (the same model class): the image tokens
split over GPUs in the double-stream blocks, the joined text and image tokens in the single-stream blocks.

ComfyUI's ``Flux.forward_orig`` (comfy/ldm/flux/model.py) embeds the latent into ``img`` ``[B, L, C]`` (reference
latents, Kontext's or Flux.2's, appended to its tokens) and the text into ``txt`` ``[B, T, C]``, and computes the RoPE
frequencies ``pe`` ``[B, 1, T + L, ...]`` over the text's then the image's positions.

- **Double-stream blocks** (``("double_block", i)``; the patch sees ``img``, ``txt``, ``vec``, ``pe``, ``attn_mask``):
  text and image have their own weights and attend together over ``cat(txt, img)``.  Every GPU keeps the text whole (the
  attention's prefix) and its share of the image tokens, reference tokens included (they cost what image tokens cost):
  ``img`` and the image part of ``pe`` are sharded.
- **Single-stream blocks** (``("single_block", i)``; ``img`` is the joined ``cat(txt, img)``, on each GPU the text and
  its image tokens): the first gathers the image tokens and splits the joined sequence evenly, text included, so no GPU
  repeats the text's work in these blocks; ``img`` and ``pe`` sharded.  The last block gathers, and the model's head and
  unpatchify see the whole sequence.

``vec`` (the modulation) is one vector per sample, Flux.2's global modulation too, and passes whole.  An attention mask
(Redux's attention bias) covers the joined sequence in its one-GPU order, the order every GPU's kernel sees under the
exchange: it passes whole.  A forward runs whole on one GPU with a model patch inside the blocks (``attn1_patch``,
``attn1_output_patch``: it sees the whole sequence), with reference latents on the ``index_timestep_zero`` method
(modulation by token ranges of the whole sequence) or with a mask that is not over the joined sequence.
"""

from __future__ import annotations

from . import Unit, by_shapes


class FluxUnit(Unit):
    name = "Flux.1/Flux.2"
    classes = ("Flux",)
    graphs = True  # measured: docs/multi-gpu.md, "CUDA graphs in the node"
    # Patch Attention's kernels, graphs replayed: Flux.1 dev 1024² (1.3 TFLOP a block) split gained x1.39-1.57 a step
    # and x1.43 a whole 20-step prompt through ComfyUI's server with the graphs kept from prompt to prompt (2x H200,
    # ComfyUI 0.33.0, --disable-cuda-malloc --disable-dynamic-vram); under dynamic VRAM the same prompt ran x0.90 (the
    # weights reloaded at each prompt, the first GPU's graphs recorded again): the node's floor there
    floors = {"graphs-pack": 1.2, "graphs-pack-dynamic": 2.0}
    # the modulation (double blocks' img_mod/txt_mod, single blocks' modulation) and the double blocks' text stream
    shared_linears = ("_mod", "modulation", "txt_")

    def most_tokens(self, dm, shape, conds: dict):
        return by_shapes(dm, shape, conds, text=True)

    def block_keys(self, dm) -> list:
        return ([("double_block", i) for i in range(len(dm.double_blocks))]
                + [("single_block", i) for i in range(len(dm.single_blocks))])

    def block(self, key, args, inner, ctx):
        kind, i = key
        img, pe = args["img"], args["pe"]
        a = dict(args)
        if kind == "double_block":
            if i == 0:
                txt_len = args["txt"].shape[1]
                ctx.start(img.shape[1], prefix=txt_len, why_not=self.why_not(args, txt_len + img.shape[1]))
            if not ctx.split:
                return inner(args)
            if i == 0:
                a["img"] = ctx.shard(img, 1, ends=False).contiguous()
            if pe is not None:
                a["pe"] = ctx.shard(pe, 2)
            out = inner(a)
            if key == ctx.last_key:  # no single blocks
                out = {**out, "img": ctx.gather(out["img"], 1, ends=False)}
            return out
        if i == 0:
            if ctx.split is None:  # no double blocks: the decision is taken here
                ctx.start(img.shape[1], why_not=self.why_not(args, img.shape[1]))
            if not ctx.split:
                return inner(args)
            lay = ctx.layout
            if lay is not None and img.shape[1] == lay.local_len(ctx.rank):
                img = ctx.gather(img)  # the text (whole) and this GPU's image tokens: all image tokens
            ctx.resplit(img.shape[1])
            a["img"] = ctx.shard(img, 1).contiguous()
        elif not ctx.split:
            return inner(args)
        if pe is not None:
            a["pe"] = ctx.shard(pe, 2).contiguous()
        out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"])}
        return out

    @staticmethod
    def why_not(args, joint: int) -> str:
        """What in this forward needs the whole sequence inside the blocks (``joint``: text and image tokens)."""
        patches = args["transformer_options"].get("patches", {})
        for name in ("attn1_patch", "attn1_output_patch"):
            if patches.get(name):
                return f"a model patch ({name}) that needs the whole sequence"
        if not per_sample(args["vec"], args["img"].shape[0]):
            return ("reference latents on the index_timestep_zero method (their tokens are modulated apart, by ranges of "
                    "the whole sequence)")
        mask = args.get("attn_mask")
        if mask is not None and (mask.shape[-1] != joint or mask.shape[-2] not in (1, joint)):
            return f"an attention mask over {mask.shape[-1]} tokens where the model attends over {joint}"
        return ""


def per_sample(vec, batch: int) -> bool:
    """Whether the blocks' modulation is one vector per sample (Flux.2's global modulation: ``ModulationOut`` values in
    nested tuples, ``[B, 1, C]``; otherwise ``[B, C]``), not rows applied to token ranges."""
    while isinstance(vec, (tuple, list)):
        vec = vec[0]
    t = getattr(vec, "shift", vec)
    return t.shape[1] == 1 if t.ndim == 3 else t.shape[0] == batch
