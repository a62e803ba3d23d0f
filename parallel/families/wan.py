"""Wan 2.1 / 2.2 (text and image to video, FLF, Fun): the video tokens split over GPUs between the first and last
block.

ComfyUI's ``WanModel.forward_orig`` embeds the latent into ``x`` ``[B, L, C]`` (reference and in-context latents joined
along the tokens), computes the RoPE frequencies ``freqs`` for those ``L`` tokens (dim 1) and the modulation ``e0``
(``[B, 1, 6, C]``, or per token or per frame ``[B, n, 6, C]`` for Wan 2.2's per-frame timesteps), then runs each block as
``block(x, e=e0, freqs=freqs, context=context, ...)`` (the patch sees ``img``, ``vec``, ``pe``, ``txt``).  In a block,
self-attention runs over ``x``'s tokens (exchanged) and cross-attention over the text (and CLIP image) tokens, which
every GPU keeps whole.  Everything else in a block is per token.
"""

from __future__ import annotations

import functools
import sys

import torch

from ..context import CP_KEY
from ..ulysses import Staged
from . import PLAIN_CONDS, Unit, by_shapes

WAN_CONDS = PLAIN_CONDS | {"clip_vision_output", "concat_latent_image", "concat_mask"}


class WanUnit(Unit):
    name = "Wan 2.1/2.2"
    classes = ("WanModel",)
    graphs = True  # measured: docs/multi-gpu.md, "CUDA graphs in the node"
    # self-attention and cross-attention; the second exchanges nothing, so it costs the host less: counted as half
    calls_per_block = 1.5
    # cross-attention's keys and values: over the text, and the CLIP image tokens (k_img, v_img; HuMo's audio
    # cross-attention's too: audio_cross_attn.k/v); the modulation is a Parameter of each block, not a Linear
    shared_linears = ("cross_attn.k", "cross_attn.v")

    def most_tokens(self, dm, shape, conds: dict):  # an image to start from joins the channels, CLIP's the text
        return by_shapes(dm, shape, conds, text=False, plain=WAN_CONDS)

    def block_keys(self, dm) -> list:
        return [("double_block", i) for i in range(len(dm.blocks))]

    def block(self, key, args, inner, ctx):
        i = key[1]
        x = args["img"]
        if i == 0:
            topts = args["transformer_options"]
            ctx.start(x.shape[1], others=self.context_lengths(args["txt"].shape[1]), why_not=self.why_not(topts))
        if not ctx.split:
            return inner(args)
        a = dict(args)
        if i == 0:
            a["img"] = ctx.shard(x)
        a["pe"] = ctx.shard(args["pe"], 1)
        a["vec"] = modulation_shard(args["vec"], ctx)
        out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"])}
        return out

    def patch_run(self, dm):
        """Each of ``dm``'s self-attention modules (ComfyUI's ``WanSelfAttention``, its forward not replaced) sends its
        q and k to the other GPUs as soon as it makes them, while it makes the next (:func:`staged_forward`), for one
        sampling run; the function returned puts them back."""
        cls = getattr(sys.modules.get("comfy.ldm.wan.model"), "WanSelfAttention", None)
        if cls is not None and cls.forward.__module__ != "comfy.ldm.wan.model":
            cls = None  # its forward replaced by someone else (another custom node): leave it to that
        patched = []
        for m in dm.modules() if cls is not None else ():
            if type(m).forward is cls.forward and "forward" not in m.__dict__:
                m.forward = functools.partial(staged_forward, m)
                patched.append((m, m.forward))

        def restore():
            for m, fwd in patched:
                if m.__dict__.get("forward") is fwd:
                    del m.forward
        return restore

    @staticmethod
    def context_lengths(total: int) -> set:
        """The key lengths of cross-attention: the whole context, or (image to video) its CLIP image tokens (257 per
        image, one or two images) and the text after them, in two calls."""
        out = {total}
        for clip in (257, 514):
            if clip < total:
                out |= {clip, total - clip}
        return out

    @staticmethod
    def why_not(topts) -> str:
        """Extensions that see the whole token sequence inside the loop (they would get one GPU's share)."""
        patches = topts.get("patches", {})
        for name in ("double_block", "attn1_patch", "attn2_patch"):
            if patches.get(name):
                return f"a model patch ({name}) that needs the whole sequence"
        return ""


def staged_forward(attn, x, freqs, transformer_options={}):  # noqa: B006 - ComfyUI's signature
    """``WanSelfAttention.forward`` (ComfyUI's, computed by its own modules and functions in the same order), with q, k
    and v each sent to the other GPUs as it is made (:class:`~..ulysses.Staged`): q crosses while k is computed, k
    while v is.  Bit for bit what the forward gives with the exchange made at the attention call; any call it cannot
    stage (not a split self-attention call, a mask, tokens held whole, an ``attn1_patch``, under torch.compile) runs
    ComfyUI's forward as it is."""
    ctx = transformer_options.get(CP_KEY)
    s = x.shape[1]
    if (ctx is None or not ctx.group.staged or not ctx.exchanges(s, s) or not Staged.fits(ctx.group, ctx.layout, ctx.masks)
            or transformer_options.get("patches", {}).get("attn1_patch") or torch.compiler.is_compiling()):
        return type(attn).forward(attn, x, freqs, transformer_options=transformer_options)
    model = sys.modules[type(attn).__module__]  # ComfyUI's Wan module: its rope and attention functions
    b, n, d = x.shape[0], attn.num_heads, attn.head_dim
    call = ctx.staged(n, n)
    call.send(model.apply_rope1(attn.norm_q(attn.q(x)).view(b, s, n, d), freqs))
    call.send(model.apply_rope1(attn.norm_k(attn.k(x)).view(b, s, n, d), freqs))
    call.send(attn.v(x).view(b, s, n, d))
    full = ctx.layout.full_len

    def local(qf, kf, vf):  # every token, this GPU's heads: not a split call, so it goes to the kernel as it is
        h = qf.shape[2]
        out = model.optimized_attention(qf.view(b, full, h * d), kf.view(b, full, h * d), vf.view(b, full, h * d),
                                        heads=h, transformer_options=transformer_options)
        return out.view(b, full, h, -1)

    return attn.o(call.finish(local).view(b, s, -1))


def modulation_shard(vec: torch.Tensor, ctx, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """This GPU's share of a block's modulation ``e0``: ``[B, 6, C]`` and ``[B, 1, 6, C]`` (the same for every token)
    as they are; ``[B, n, 6, C]`` (per token, per frame or per segment: ``repeat_e`` spreads the ``n`` values over the
    ``L`` tokens, each repeated ``L // n`` times, or one more and cut at ``L``) as one row per token of this GPU
    (``tokens``: their indices in the sequence, where they are not the rank's rows of :meth:`RankContext.rows`)."""
    if vec.ndim < 4 or vec.shape[1] == 1:
        return vec
    full, n = ctx.layout.full_len, vec.shape[1]
    s0, sc = ctx.rows()
    if n == full:
        return vec.narrow(1, s0, sc) if tokens is None else vec.index_select(1, tokens)
    r = full // n
    if r == 1:  # repeat_e leaves it as it is, and the block refuses it: let it say so
        return vec
    if r * n != full:
        r += 1
    if tokens is None:
        tokens = torch.arange(s0, s0 + sc, device=vec.device)
    return vec.index_select(1, tokens // r)
