"""Wan 2.1/2.2 variants beside the plain ``WanModel`` (:mod:`.wan`): VACE, camera control, SCAIL, S2V, WanDancer,
Animate.  Each runs its blocks as ``WanModel`` does (``block(x, e=e0, freqs=freqs, context=context, ...)`` through the
block-replace patches; self-attention exchanged, cross-attention to text and CLIP tokens whole on every GPU), so the
video tokens are split as in :class:`~.wan.WanUnit`: ``x``, the RoPE frequencies ``freqs`` (dim 1) and the modulation
``e0`` sharded at each block.  What differs is what each variant does around its blocks:

- **Camera** (``CameraWanModel``): the camera embedding is added to the tokens before the blocks; nothing else.
- **SCAIL, SCAIL-2** (``SCAILWanModel``, ``SCAIL2WanModel``): the pose tokens join the video tokens (and their RoPE
  frequencies) before the blocks, as one sequence; nothing else.
- **S2V** (``WanModel_S2V``): the modulation comes per segment (video frames, reference, motion frames: ``[B, n, 6,
  C]``, which each block spreads over the tokens with ``repeat_e``): each GPU gets the values of its own tokens, one
  row per token.  After some blocks the audio injector adds to each frame's tokens an attention of them over that
  frame's audio tokens (``AudioInjector_WAN``, outside the block patch).
- **WanDancer** (``WanDancerModel``): as S2V, with the music features.
- **Animate** (``AnimateWanModel``): after every 5th block the face adapter adds to each frame's tokens an attention
  of them over that frame's motion features (``FaceBlock``, outside the block patch).
- **VACE** (``VaceWanModel``): after each of its VACE-mapped blocks the model runs its VACE blocks (Wan blocks over the
  control tokens ``c`` and the embedded latent ``x_orig``, whole, called directly with the whole ``freqs``) and adds
  their hints to ``x``: ``x += c_skip * strength``.  Those VACE blocks are reached by no patch, so every GPU runs them
  on the whole sequence, the same on every GPU; their attention calls (queries and keys over the whole sequence) are
  shared out by heads instead of every GPU computing all of them (:meth:`~..context.RankContext.pause`).

What S2V, WanDancer, Animate and VACE do to ``x`` between blocks works token by token (an addition, a layer norm, the
queries of an attention over other tokens), over the whole sequence.  So each block hands back the whole length: the
rows of the block's input with this GPU's rows replaced by its block output (no exchange).  The model's work between
blocks is then right on this GPU's rows (the only ones the next block takes), and the last block gathers the rows of
every GPU as the plain unit does.

Not split (they sample on one GPU): Animate 2 (``WanAnimate2Model``: the pose branch's keys enter the generation's
self-attention frame by frame, inside the block), causal Wan (``CausalWanModel``: its blocks are called without
``transformer_options``, no patch reaches them), HuMo (``HumoWanModel``, unless split below).
"""

from __future__ import annotations

import torch

from .wan import WanUnit


class WanVariantUnit(WanUnit):
    """A Wan variant split as :class:`~.wan.WanUnit`, with the model's own work between blocks.

    ``whole_between``: the model works on ``x`` between blocks (token by token, over the whole length): each block
    takes its rows of a whole-length ``x`` and hands one back.  ``shared_between``: what the model runs between blocks
    is the same on every GPU (VACE's blocks): its attention calls over the whole sequence are shared out by heads."""

    whole_between = False
    shared_between = False

    def block(self, key, args, inner, ctx):
        i = key[1]
        x = args["img"]
        if i == 0:
            topts = args["transformer_options"]
            ctx.start(x.shape[1], others=self.others(args), why_not=self.why_not(topts))
        if not ctx.split:
            return inner(args)
        ctx.resume()
        a = dict(args)
        if i == 0 or self.whole_between:
            a["img"] = ctx.shard(x)
        a["pe"] = ctx.shard(args["pe"], 1)
        a["vec"] = modulation_shard(args["vec"], ctx)
        out = inner(a)
        if key == ctx.last_key:
            img = ctx.gather(out["img"])
        elif self.whole_between:
            img = put_back(x, out["img"], ctx)
        else:
            return out
        if self.whole_between:
            ctx.pause(x.shape[1] if self.shared_between else 0)
        return {**out, "img": img}

    def others(self, args) -> set:
        """Key lengths of the attention calls that are not over the split sequence (through the hook)."""
        return self.context_lengths(args["txt"].shape[1])


def modulation_shard(vec: torch.Tensor, ctx) -> torch.Tensor:
    """This GPU's share of a block's modulation ``e0``: ``[B, 6, C]`` and ``[B, 1, 6, C]`` (the same for every token)
    as they are; ``[B, n, 6, C]`` (per token, per frame or per segment: ``repeat_e`` spreads the ``n`` values over the
    ``L`` tokens, each repeated ``L // n`` times, or one more and cut at ``L``) as one row per token of this GPU."""
    if vec.ndim < 4 or vec.shape[1] == 1:
        return vec
    full, n = ctx.layout.full_len, vec.shape[1]
    s0, sc = ctx.rows()
    if n == full:
        return vec.narrow(1, s0, sc)
    r = full // n
    if r == 1:  # repeat_e leaves it as it is, and the block refuses it: let it say so
        return vec
    if r * n != full:
        r += 1
    return vec.index_select(1, torch.arange(s0, s0 + sc, device=vec.device) // r)


def put_back(whole: torch.Tensor, part: torch.Tensor, ctx) -> torch.Tensor:
    """``whole`` (``[B, L, C]``) with this GPU's rows replaced by ``part``, as a new tensor."""
    s0, sc = ctx.rows()
    return torch.cat([whole[:, :s0], part, whole[:, s0 + sc:]], 1)


class CameraUnit(WanVariantUnit):
    name = "Wan 2.1/2.2 Camera"
    classes = ("CameraWanModel",)


class SCAILUnit(WanVariantUnit):
    name = "Wan 2.1 SCAIL"
    classes = ("SCAILWanModel", "SCAIL2WanModel")


class S2VUnit(WanVariantUnit):
    name = "Wan 2.2 S2V"
    classes = ("WanModel_S2V",)
    whole_between = True


class DancerUnit(WanVariantUnit):
    name = "Wan 2.2 WanDancer"
    classes = ("WanDancerModel",)
    whole_between = True


class AnimateUnit(WanVariantUnit):
    name = "Wan 2.2 Animate"
    classes = ("AnimateWanModel",)
    whole_between = True


class VaceUnit(WanVariantUnit):
    name = "Wan 2.1 VACE"
    classes = ("VaceWanModel",)
    whole_between = True
    shared_between = True


UNITS = [VaceUnit(), CameraUnit(), SCAILUnit(), S2VUnit(), DancerUnit(), AnimateUnit()]
