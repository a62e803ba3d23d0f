"""How much work one forward of a model does per block, from its weights' shapes: what decides whether splitting a
forward over GPUs pays (the Context Parallel node's floor).

A split pays when each GPU's share of a block's work outlasts the host's work for that block (its Python, its kernel
launches: once per GPU, under one interpreter lock when the GPUs are threads of one process).  A block's work grows with
the tokens (its matrix multiplies) and with their square (its self-attention), so a token count alone cannot say where
that is: Wan 2.1 14B at 7,800 tokens does more work per block than Wan 2.1 1.3B at 20,280.

:class:`Work` holds what a model's work per block depends on; :func:`work_of` reads it off a diffusion model's block
lists, once per model (never per forward).  No ComfyUI here: any ``torch.nn.Module`` whose blocks are in
``nn.ModuleList`` children.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Work:
    """One forward's work, by its shapes.  ``params``: the weights each token of the split sequence is multiplied by,
    summed over all blocks; ``width``: the attention's width (heads x head dim); ``blocks``: how many blocks (each one
    self-attention over the whole sequence)."""

    params: int
    width: int
    blocks: int

    def tflop_per_block(self, tokens: int) -> float:
        """TFLOP of one block's work over a sequence of ``tokens`` (prefix and suffix included): the matrix multiplies
        (``2 T params``) and self-attention's two products (``4 T^2 width`` per block), averaged over the blocks."""
        blocks = max(self.blocks, 1)
        return (2 * tokens * self.params + 4 * tokens * tokens * self.width * blocks) / blocks / 1e12

    def tokens_for(self, tflop: float) -> int:
        """The smallest sequence length whose :meth:`tflop_per_block` is at least ``tflop`` (0 where ``tflop`` <= 0).
        ValueError for a Work of no work at all (no weights, no width)."""
        if tflop <= 0:
            return 0
        blocks = max(self.blocks, 1)
        a, b, c = 4 * self.width * blocks, 2 * self.params, tflop * 1e12 * blocks  # a T^2 + b T >= c
        if a == 0 and b == 0:
            raise ValueError("a model with no weights in its blocks does no work to measure a floor by")
        t = c / b if a == 0 else (math.sqrt(b * b + 4 * a * c) - b) / (2 * a)
        n = max(math.ceil(t), 0)
        while self.tflop_per_block(n) < tflop:  # the root in floating point: put right by one token either way
            n += 1
        while n > 0 and self.tflop_per_block(n - 1) >= tflop:
            n -= 1
        return n


def work_of(dm: torch.nn.Module, skip: tuple[str, ...] = (), blocks: int = 1) -> Work:
    """``dm``'s :class:`Work`: the ``torch.nn.Linear`` modules inside its block lists (its direct children that are an
    ``nn.ModuleList``: Wan's ``blocks``, Flux's ``double_blocks`` and ``single_blocks``, ...) whose qualified name
    contains none of ``skip`` (the unit's ``shared_linears``: weights that do not run once per token of the split
    sequence), ``blocks`` the forward's blocks.  ``params``: the sum of their ``in_features * out_features``;
    ``width``: their most common ``in_features``."""
    params, widths = 0, Counter()
    for name, child in dm.named_children():
        if not isinstance(child, torch.nn.ModuleList):
            continue
        for qualified, m in child.named_modules(prefix=name):
            if isinstance(m, torch.nn.Linear) and not any(s in qualified for s in skip):
                n_in, n_out = _features(m)
                params += n_in * n_out
                widths[n_in] += 1
    width = widths.most_common(1)[0][0] if widths else 0
    return Work(params, width, blocks)


def _features(linear: torch.nn.Linear) -> tuple[int, int]:
    """(in_features, out_features) of a Linear: its attributes (its weight may be quantized, GGUF's or fp8's, of
    another shape), else its weight's logical shape (``[out, in]``; GGUF's tensors keep theirs in ``tensor_shape``)."""
    n_in, n_out = getattr(linear, "in_features", None), getattr(linear, "out_features", None)
    if isinstance(n_in, int) and isinstance(n_out, int):
        return n_in, n_out
    w = linear.weight
    shape = getattr(w, "tensor_shape", None) or w.shape
    return int(shape[1]), int(shape[0])
