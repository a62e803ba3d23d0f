"""LTX-Video and LTX-2 (Lightricks): the video tokens split over GPUs between the first and last block.

ComfyUI's ``LTXVModel`` patchifies the latent (1x1x1: one token per latent pixel, guide frames of LTXVAddGuide /
LTXVImgToVideo appended after the video's) into ``x`` ``[B, L, C]``, then runs each block through the block-replace
patch with ``img`` = ``x``, ``txt`` = the projected text, ``attention_mask`` = the text's padding as an additive key
mask ``[B, 1, 1, T]``, ``vec`` = the modulation (``[B, 1, 6C]``, or per token ``[B, L, 6C]`` where a denoise mask
gives conditioning frames their own timestep; 9C with cross-attention AdaLN), ``pe`` = (RoPE rotation matrices
``[B, L, H, D/2, 2, 2]``, split flag), ``self_attention_mask`` = the guide frames' attention attenuation
(``GuideAttentionMask``: below strength 1, additive masks between the video's rows and the guide's) and
``prompt_timestep`` (one per sample).  In a block, self-attention runs over ``x``'s tokens (exchanged) and
cross-attention from them to the text (keys every GPU keeps whole: the text mask masks keys only, so it stays as it
is); everything else is per token.

What a GPU gets: its share of ``x`` (at the first block), of the RoPE matrices and of per-token modulation; the guide
mask is taken out of the block's arguments and applied on the far side of the exchange, where each GPU holds every
token for its heads (:class:`~..ulysses.RowMasks`: the same row ranges and masks as ComfyUI's own partitioned call).
The last block gathers ``x`` back, so the head and unpatchify see the whole sequence.

LTX-2 (:class:`LTX2Unit`) splits its video the same way and keeps its audio whole on every GPU.
"""

from __future__ import annotations

import torch

from ..ulysses import RowMasks
from . import Unit


def _shard_rows(t, ctx, dim: int = 1):
    """``t``'s rows of this rank along ``dim`` when ``t`` runs over the whole sequence there; else ``t`` (one row
    broadcast to every token)."""
    if isinstance(t, torch.Tensor) and t.ndim > (dim if dim >= 0 else -dim - 1):
        if t.shape[dim] == ctx.layout.full_len > 1:
            return ctx.shard(t, dim % t.ndim)
    return t


def _shard_pe(pe, ctx):
    """RoPE as LTX passes it, (rotation matrices over the tokens, split flag): the matrices' rows of this rank."""
    if isinstance(pe, (tuple, list)):
        return type(pe)(_shard_rows(p, ctx) for p in pe)
    return _shard_rows(pe, ctx)


class NotSplit(ValueError):
    """A self-attention mask this unit cannot take apart."""


def _shard_timestep(ts, ctx):
    """Per-token modulation of the split tokens, a tensor ``[B, L or 1, F]`` or LTX-2's ``CompressedTimestep`` (one row
    per latent frame, ``patches_per_frame`` tokens each): this rank's rows, compressed still where its share starts and
    ends on frame boundaries."""
    if isinstance(ts, torch.Tensor) or ts is None:
        return _shard_rows(ts, ctx)
    ppf, frames = ts.patches_per_frame, ts.num_frames
    if ppf * frames != ctx.layout.full_len:  # one row for every token
        return ts
    s0, sc = ctx.rows()
    if s0 % ppf == 0 and sc % ppf == 0:
        return type(ts)(ts.data[:, s0 // ppf:(s0 + sc) // ppf], ppf, per_frame=True)
    f0, f1 = s0 // ppf, -(-(s0 + sc) // ppf)
    b, _, width = ts.data.shape
    rows = ts.data[:, f0:f1].unsqueeze(2).expand(b, f1 - f0, ppf, width).reshape(b, -1, width)
    return type(ts)(rows[:, s0 - f0 * ppf:s0 - f0 * ppf + sc], None)


def _timestep_rows(ts) -> int:
    if ts is None:
        return 1
    if isinstance(ts, torch.Tensor):
        return ts.shape[1] if ts.ndim > 1 else 1
    return ts.patches_per_frame * ts.num_frames


def self_attention_masks(mask, tokens: int):
    """The block's self-attention mask as :class:`RowMasks` over ``tokens`` (None: no mask); :class:`NotSplit` where
    this unit cannot take it apart."""
    if mask is None:
        return None
    if all(hasattr(mask, a) for a in ("guide_start", "tracked_count", "noisy_mask", "tracked_mask")):
        # ComfyUI's GuideAttentionMask: the video's rows see the tracked guide tokens through noisy_mask, the tracked
        # guide rows see the video through tracked_mask, rows after them (none today) unmasked
        start, end = mask.guide_start, mask.guide_start + mask.tracked_count
        parts = ((0, start, mask.noisy_mask), (start, end, mask.tracked_mask), (end, tokens, None))
        return RowMasks(tuple(p for p in parts if p[1] > p[0]))
    if (isinstance(mask, torch.Tensor) and mask.ndim >= 2 and mask.shape[-1] == tokens and mask.shape[-2] in (1, tokens)
            and (mask.ndim < 3 or mask.shape[-3] == 1)):  # one mask for every head
        return RowMasks(((0, tokens, mask),))
    raise NotSplit(f"a self-attention mask ({type(mask).__name__}) that this model's split cannot take apart")


class LTXVideoUnit(Unit):
    name = "LTX-Video"
    classes = ("LTXVModel",)
    shared_linears = ("attn2.to_k", "attn2.to_v")  # cross-attention's keys and values over the text

    def block_keys(self, dm) -> list:
        return [("double_block", i) for i in range(len(dm.transformer_blocks))]

    def block(self, key, args, inner, ctx):
        i = key[1]
        x = args["img"]
        if i == 0:
            try:
                masks, why = self_attention_masks(args.get("self_attention_mask"), x.shape[1]), ""
            except NotSplit as e:
                masks, why = None, str(e)
            if ctx.start(x.shape[1], others={args["txt"].shape[1]}, why_not=why):
                ctx.set_masks(masks)
        if not ctx.split:
            return inner(args)
        a = dict(args)
        if i == 0:
            a["img"] = ctx.shard(x)
        a["pe"] = _shard_pe(args["pe"], ctx)
        a["vec"] = _shard_rows(args["vec"], ctx)
        a["attention_mask"] = _shard_rows(args["attention_mask"], ctx, -2)  # a text mask with a row per token
        a["self_attention_mask"] = None  # applied by the exchange (ctx.set_masks)
        out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"])}
        return out


class LTX2Unit(Unit):
    """LTX-2 (``LTXAVModel``): video and audio in one model, each block with video self-attention, text
    cross-attention for each, audio self-attention and audio<->video cross-attention.  The video tokens split as
    LTX-Video's do; the audio (about 25 tokens a second) stays whole on every GPU, each computing the same audio
    stream.  Video-to-audio attention (audio queries, video keys) gets the video's keys and values from every GPU
    (:meth:`~..context.RankContext.gathers`); audio-to-video attention (video queries, audio keys) needs nothing."""

    name = "LTX-2"
    classes = ("LTXAVModel",)
    # the text's keys and values (attn2, audio_attn2), the audio stream every GPU holds whole (its attention and
    # feed-forward; audio-to-video's audio keys and values, video-to-audio's audio queries and output)
    shared_linears = ("attn2.to_k", "attn2.to_v", "audio_attn1", "audio_attn2", "audio_ff", "audio_to_video_attn.to_k",
                      "audio_to_video_attn.to_v", "video_to_audio_attn.to_q", "video_to_audio_attn.to_out",
                      "video_to_audio_attn.to_gate")

    VIDEO = ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")

    def block_keys(self, dm) -> list:
        return [("double_block", i) for i in range(len(dm.transformer_blocks))]

    def block(self, key, args, inner, ctx):
        i = key[1]
        vx, ax = args["img"]
        if i == 0:
            tokens = vx.shape[1]
            try:
                masks, why = self_attention_masks(args.get("self_attention_mask"), tokens), ""
            except NotSplit as e:
                masks, why = None, str(e)
            if not why and any(_timestep_rows(args.get(k)) not in (1, tokens) for k in self.VIDEO):
                why = "per-token modulation that does not match the video's tokens"
            audio = ax.shape[1]
            others = {args["v_context"].shape[1], args["a_context"].shape[1], audio}
            if ctx.start(tokens, others=others, whole_queries={audio} if audio else (), why_not=why):
                ctx.set_masks(masks)
        if not ctx.split:
            return inner(args)
        a = dict(args)
        if i == 0:
            a["img"] = (ctx.shard(vx), ax)
        a["v_pe"] = _shard_pe(args["v_pe"], ctx)
        a["v_cross_pe"] = _shard_pe(args["v_cross_pe"], ctx)
        for k in self.VIDEO:
            a[k] = _shard_timestep(args.get(k), ctx)
        a["self_attention_mask"] = None  # applied by the exchange (ctx.set_masks)
        out = inner(a)
        if key == ctx.last_key:
            vx, ax = out["img"]
            out = {**out, "img": (ctx.gather(vx), ax)}
        return out
