"""Wan 2.1/2.2 variants beside the plain ``WanModel`` (:mod:`.wan`): VACE, camera control, SCAIL, S2V, WanDancer,
Animate, HuMo.  Each runs its blocks as ``WanModel`` does (``block(x, e=e0, freqs=freqs, context=context, ...)``
through the block-replace patches; self-attention exchanged, cross-attention to text and CLIP tokens whole on every
GPU), so the video tokens are split as in :class:`~.wan.WanUnit`: ``x``, the RoPE frequencies ``freqs`` (dim 1) and the
modulation ``e0`` sharded at each block (``e0`` per token, per frame or per segment as each GPU's tokens get it:
:func:`modulation_shard`).  What differs is what each variant does around its blocks:

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
- **HuMo** (``HumoWanModel``): each block's audio cross-attention works frame by frame, so a GPU takes the same rows
  of every latent frame instead of one run of the sequence (:class:`HuMoUnit`).
- **VACE** (``VaceWanModel``): after each of its VACE-mapped blocks the model runs its VACE blocks (Wan blocks over the
  control tokens ``c`` and the embedded latent ``x_orig``, whole, called directly with the whole ``freqs``) and adds
  their hints to ``x``: ``x += c_skip * strength``.  Those VACE blocks are reached by no patch, so every GPU runs them
  on the whole sequence, the same on every GPU; their attention calls (queries and keys over the whole sequence) are
  shared out by heads instead of every GPU computing all of them (:meth:`~..context.RankContext.pause`).  The rest of
  a VACE block (projections, feed-forward) and its activations are not divided: a VACE forward gains less from more
  GPUs than a plain Wan one.

What S2V, WanDancer, Animate and VACE do to ``x`` between blocks works token by token (an addition, a layer norm, the
queries of an attention over other tokens), over the whole sequence.  So each block hands back the whole length: the
rows of the block's input with this GPU's rows replaced by its block output (no exchange).  The model's work between
blocks is then right on this GPU's rows (the only ones the next block takes), and the last block gathers the rows of
every GPU as the plain unit does.

Not split (they sample on one GPU): Animate 2 (``WanAnimate2Model``: the pose branch's keys enter the generation's
self-attention frame by frame, inside the block), causal Wan (``CausalWanModel``: its blocks are called without
``transformer_options``, no patch reaches them).
"""

from __future__ import annotations

import torch

from . import Unit
from .wan import WanUnit, modulation_shard


class WanVariantUnit(WanUnit):
    graphs = False  # not measured
    """A Wan variant split as :class:`~.wan.WanUnit`, with the model's own work between blocks.

    ``whole_between``: the model works on ``x`` between blocks (token by token, over the whole length): each block
    takes its rows of a whole-length ``x`` and hands one back.  ``shared_between``: what the model runs between blocks
    is the same on every GPU (VACE's blocks): its attention calls over the whole sequence are shared out by heads."""

    most_tokens = Unit.most_tokens  # extra inputs (references, audio, poses) may add tokens: told at the first block
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
    shared_linears = (*WanUnit.shared_linears, "music_encoder")  # a block list over the music features
    whole_between = True


class AnimateUnit(WanVariantUnit):
    name = "Wan 2.2 Animate"
    classes = ("AnimateWanModel",)
    whole_between = True


class VaceUnit(WanVariantUnit):
    name = "Wan 2.1 VACE"
    classes = ("VaceWanModel",)
    shared_linears = (*WanUnit.shared_linears, "vace_blocks")  # every GPU runs the VACE blocks whole (not split)
    whole_between = True
    shared_between = True


class HuMoUnit(WanVariantUnit):
    """HuMo: each block attends each latent frame's tokens to that frame's 16 audio tokens (``WanAttentionBlockAudio``:
    the queries cut into one chunk per frame, in order).  So a GPU takes the same rows of every frame (frame after
    frame), not one run of the sequence: the video frames and the reference frame after them, ``hw`` tokens each, give
    ``hw / N`` tokens of each frame to each GPU.  Self-attention does not care in which order its tokens come (each
    carries its RoPE frequencies), the exchange runs over this order, and the last block puts the tokens back in theirs.
    The frame size is read from the RoPE frequencies (:meth:`frame`); a forward whose frames cannot be told apart that
    way (a reference of another size, RoPE shifts on the video and not on the reference), or whose frame does not
    divide over the GPUs, runs whole."""

    name = "Wan 2.1 HuMo"
    classes = ("HumoWanModel",)
    audio_tokens = 16  # WanT2VCrossAttentionGather: the audio keys of one frame

    def block(self, key, args, inner, ctx):
        i = key[1]
        x = args["img"]
        if i == 0 and ctx.split is None:
            frame, why = self.frame(args["pe"], ctx.size)
            why = self.why_not(args["transformer_options"]) or why
            if ctx.start(x.shape[1], others=self.others(args), why_not=why):
                ctx.state["tokens"], ctx.state["order"] = self.tokens(x.shape[1], frame, ctx, x.device)
        elif i == 0:
            ctx.start(x.shape[1])  # the same forward again (redone after a NaN): the same decision
        if not ctx.split:
            return inner(args)
        tokens = ctx.state["tokens"]
        a = dict(args)
        if i == 0:
            a["img"] = x.index_select(1, tokens)
        a["pe"] = args["pe"].index_select(1, tokens)
        a["vec"] = modulation_shard(args["vec"], ctx, tokens)
        out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"]).index_select(1, ctx.state["order"])}
        return out

    def others(self, args) -> set:
        return super().others(args) | {self.audio_tokens}

    @staticmethod
    def frame(pe: torch.Tensor, gpus: int) -> tuple[int, str]:
        """(tokens per latent frame, why the forward cannot split: "" where it can) from Wan's RoPE frequencies
        ``[1, L, 1, D/2, 2, 2]`` (the time axis's rotations first, then the height's and the width's, ``D // 6`` each):
        a frame is a run of tokens at one time whose places (height, width) repeat in every frame."""
        total, half = pe.shape[1], pe.shape[3]
        rot = pe[0, :, 0].reshape(total, half, -1)
        time, place = rot[:, 0], rot[:, half - 2 * (2 * half // 6):]
        again = (place[1:] == place[0]).flatten(1).all(1).nonzero()
        frame = int(again[0]) + 1 if len(again) else total
        alike = total % frame == 0
        if alike:
            frames = total // frame
            alike = bool((place.reshape(frames, frame, -1) == place[:frame].reshape(1, frame, -1)).all()) and \
                bool((time.reshape(frames, frame, -1) == time[::frame].reshape(frames, 1, -1)).all())
        if not alike:
            return 0, "its latent frames could not be told apart (HuMo's audio attention works frame by frame)"
        if frame % gpus:
            return 0, (f"a latent frame's {frame} tokens do not divide over {gpus} GPUs (HuMo's audio attention works "
                       "frame by frame)")
        return frame, ""

    @staticmethod
    def tokens(total: int, frame: int, ctx, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this GPU's tokens: the same rows of every frame, the order that puts the gathered tokens back)."""
        per = frame // ctx.size
        starts = torch.arange(0, total, frame, device=device)[:, None]

        def rows(r):
            return (starts + r * per + torch.arange(per, device=device)).flatten()

        order = torch.cat([rows(r) for r in range(ctx.size)])
        return rows(ctx.rank), torch.argsort(order)
