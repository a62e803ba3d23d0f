"""HunyuanVideo 1.0 / 1.5 (text to video, image to video "v1 (concat)", "v2 (replace)" and "custom", SkyReels, 1.5's
image to video and super-resolution; HunyuanImage 2.1 and its refiner run the same model): the image tokens split over
GPUs from the first double block to the last single block, the text held whole by every GPU.

ComfyUI 0.33's ``HunyuanVideo.forward_orig`` embeds the latent into ``img`` ``[B, L, C]`` (a ``ref_latent``'s tokens
first), refines the prompt into ``txt`` ``[B, T, C]`` (1.5: ByT5 glyph and SigLIP image tokens before it), computes the
RoPE frequencies ``pe`` over ``cat(txt, img)`` (``[B, 1, T + L, ...]``, dim 2) and, for a padded prompt, the mask
``attention_mask`` ``[1, 1, T + L]``: the prompt's padding at -max, 0 for the image, the same for every query.  Double
blocks take ``img`` and ``txt`` apart and attend over ``cat(txt, img)``; single blocks take ``cat(txt, img)`` as one
sequence.  So the text is the prefix of every joint attention call, and a GPU's sequence is the text followed by its
shard of the image.

Per block this unit shards the image (at the first block), ``pe`` and the mask (the text part kept whole: the mask is
then a key mask over the GPU's sequence, which the exchange carries along with the keys).  "v2 (replace)" image to video
(``guiding_frame_index``) modulates token ranges (``modulation_dims``: the first frame's tokens with the guiding frame's
embedding; over the image in double blocks, over ``cat(txt, img)`` in single blocks): they are translated to the GPU's
tokens.  The last block gathers the image (and the text with it after single blocks), so the final layer and the
unpatchify see the whole sequence.
"""

from __future__ import annotations

from . import Unit


class HunyuanVideoUnit(Unit):
    name = "HunyuanVideo 1.0/1.5"
    classes = ("HunyuanVideo",)
    # Flux's blocks: the modulation (img_mod, txt_mod, the single blocks' modulation) and the double blocks' text stream
    shared_linears = ("_mod", "modulation", "txt_")

    def block_keys(self, dm) -> list:
        return ([("double_block", i) for i in range(len(dm.double_blocks))]
                + [("single_block", i) for i in range(len(dm.single_blocks))])

    def block(self, key, args, inner, ctx):
        kind, i = key
        double = kind == "double_block"
        x = args["img"]
        # the first block of the forward: double block 0, or single block 0 of a model without double blocks (a
        # single block 0 after split double blocks finds the layout set)
        first = i == 0 and (double or ctx.layout is None)
        if first:
            text = args["txt"].shape[1] if double else args["transformer_options"]["img_slice"][0]
            tokens = x.shape[1] if double else x.shape[1] - text
            ctx.start(tokens, prefix=text, why_not=self.why_not(args, text + tokens))
        if not ctx.split:
            return inner(args)
        a = dict(args)
        if first:
            a["img"] = ctx.shard(x, 1, ends=not double)
        a["pe"] = ctx.shard(args["pe"], 2)
        mask = args["attention_mask"]
        if mask is not None:
            a["attention_mask"] = ctx.shard(mask, mask.ndim - 1)
        dims = "modulation_dims_img" if double else "modulation_dims"
        if args.get(dims) is not None:
            a[dims] = self.local_ranges(args[dims], ctx, ends=not double)
        out = inner(a)
        if key == ctx.last_key:
            out = {**out, "img": ctx.gather(out["img"], 1, ends=not double)}
        return out

    @staticmethod
    def local_ranges(dims, ctx, ends: bool) -> list:
        """ComfyUI's ``modulation_dims`` (``(start, end or None, index)`` token ranges over the whole sequence: the
        prefix, split part and suffix, or the split part alone with ``ends=False``) as ranges over this GPU's tokens."""
        lay = ctx.layout
        s0, sc = ctx.rows()
        split_len = sum(c for _, c in lay.shards)
        if ends:
            p, sfx = lay.prefix, lay.suffix
            full = lay.full_len
            pieces = [(0, 0, p), (p + s0, p, sc), (full - sfx, p + sc, sfx)]  # (whole-sequence start, local start, count)
        else:
            full = split_len
            pieces = [(s0, 0, sc)]
        out = []
        for start, end, index in dims:
            lo, hi, _ = slice(start, end).indices(full)
            for g0, l0, n in pieces:
                a, b = max(lo, g0), min(hi, g0 + n)
                if a < b:
                    out.append((a - g0 + l0, b - g0 + l0, index))
        return out

    @staticmethod
    def why_not(args, full: int) -> str:
        """What keeps this forward on one GPU: a model patch that sees the joint attention's whole sequence, or a mask
        that is not one row for every query over the whole sequence."""
        patches = args["transformer_options"].get("patches", {})
        for name in ("attn1_patch", "attn1_output_patch"):
            if patches.get(name):
                return f"a model patch ({name}) that needs the whole sequence"
        mask = args["attention_mask"]
        if mask is not None and (mask.ndim not in (2, 3, 4) or mask.shape[-1] != full or mask.shape[-2] != 1):
            return f"an attention mask of shape {list(mask.shape)} (not one row over the {full} tokens)"
        return ""
