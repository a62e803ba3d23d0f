"""Family units: what splitting one model family's forward over GPUs needs to know, one small module per family.

A unit splits the tokens through ComfyUI's own per-model extension point, the block-replace patches
(``transformer_options['patches_replace']['dit'][(kind, index)]``): at the first block it decides whether this forward
splits (:meth:`~..context.RankContext.start`), hands each block its rank's shard of the carried tokens and of every
per-token input (RoPE frequencies, per-token modulation), and at the last block gathers the tokens back, so the model's
embedding before the blocks and its head after them run as on one GPU.  The attention calls in between are exchanged by
the attention override (:mod:`..ulysses`), whatever kernel serves them.

Interface (:class:`Unit`):

- ``name``: what the user reads ("Wan 2.1/2.2"); ``classes``: the diffusion-model class names it splits (exactly:
  a subclass that changes the forward needs its own entry);
- ``block_keys(dm)``: the block-replace keys of one forward, in order;
- ``block(key, args, inner, ctx)``: one block under a split forward: ``args`` as ComfyUI passes them to the patch,
  ``inner(args)`` runs the block (or the patch that was there before), ``ctx`` the rank's
  :class:`~..context.RankContext`; returns what ``inner`` returns;
- ``patch_run(dm)`` (optional): changes to the diffusion model's modules for one sampling run, on every GPU's copy
  (e.g. Wan's self-attention sending q and k while it computes v); returns the function that undoes them;
- ``graphs`` (optional, default False): its split forwards may replay as CUDA graphs (:mod:`..graphs`): everything
  the model computes between its attention calls and the unit's exchanges depends on the forward's tensors and shapes
  alone, never on a per-step Python value; ``calls_per_block`` (default 1): its blocks' attention calls, each of which a
  replay still runs on the host (the floor for graphs is per call; a call that exchanges nothing may count less);
  ``floors`` (optional): the family's own floors where measured apart from the node's (nodes/context_parallel.py
  ``SPLIT_TFLOP``, same keys; ``graphs-pack-dynamic``: with its weights in ComfyUI's dynamic VRAM);
- ``shared_linears`` (optional, default ``("mod",)``): substrings of the qualified names of the block lists'
  ``Linear`` modules that do not run once per token of the split sequence (modulation from the timestep, the text
  stream, cross-attention's keys and values over the text): left out of the model's work;
- ``work(dm)`` (optional): the model's :class:`~..work.Work` (its work per block, what the node's floor is measured
  in), by default read off ``dm``'s block lists without the ``shared_linears`` (:func:`~..work.work_of`); computed once
  per model;
- ``most_tokens(dm, shape, conds)`` (optional): at most how many tokens a forward of a latent of ``shape`` splits, and
  holds whole beside them, told from the latent's and the conds' shapes before sampling (``conds``: the run's
  conditioning as the sampler has it before its first step); None (the default) where that cannot be told.  Where a
  whole run is told too short to pay, the node runs it on the first GPU without loading the other GPUs' copies.
  :func:`by_shapes` is the common case.

A model without a unit samples on one GPU (the node says why on the canvas, naming the model and the families that have
one).  Adding a family is one module here with a :class:`Unit` subclass that names its diffusion-model ``classes``:
every such class of this folder's modules is registered (:func:`_units`), and the node's description and messages list
it.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..work import Work, work_of


class Unit:
    name = ""
    classes: tuple = ()
    shared_linears: tuple = ("mod",)
    graphs = False  # its split forwards may replay as CUDA graphs (parallel/graphs.py)
    calls_per_block = 1.0  # attention calls in a block: what a replayed forward's host work grows with
    floors: dict = {}  # the family's own split floors (TFLOP), over the node's SPLIT_TFLOP

    def block_keys(self, dm) -> list:
        raise NotImplementedError

    def most_tokens(self, dm, shape, conds: dict) -> tuple[int, int] | None:
        return None

    def block(self, key, args: dict, inner, ctx):
        raise NotImplementedError

    def patch_run(self, dm):
        return lambda: None

    def work(self, dm) -> Work:
        return work_of(dm, self.shared_linears, len(self.block_keys(dm)))


# the keys of a cond (ComfyUI's conditioning, converted for the sampler) that add no tokens to a forward's sequence
PLAIN_CONDS = frozenset({"cross_attn", "model_conds", "uuid", "pooled_output", "guidance", "attention_mask",
                         "start_percent", "end_percent", "strength"})


def by_shapes(dm, shape, conds: dict, text: bool, plain: frozenset = PLAIN_CONDS) -> tuple[int, int] | None:
    """:meth:`Unit.most_tokens` of a model that cuts its latent ``shape`` (``[B, C, ...]``) into ``dm.patch_size``
    patches (an int: the last two dimensions; a tuple: the last ones, padded up as ComfyUI pads the latent) and, with
    ``text``, holds the longest text of ``conds`` whole beside them.  None where a cond has a key not in ``plain`` (a
    reference latent or another input that may add tokens), or the model has no patch size."""
    patch = getattr(dm, "patch_size", None)
    if patch is None or len(shape) < 4:
        return None
    patch = (patch, patch) if isinstance(patch, int) else tuple(int(p) for p in patch)
    spatial = list(shape[2:])
    sizes = [1] * (len(spatial) - len(patch)) + list(patch[-len(spatial):])
    tokens = 1
    for n, p in zip(spatial, sizes):
        tokens *= -(-int(n) // p)
    longest = 0
    for c in (c for group in conds.values() for c in group):
        if not set(c) <= plain or not set(c.get("model_conds", {})) <= {"c_crossattn"}:
            return None
        t = c.get("cross_attn")
        if t is not None:
            longest = max(longest, int(t.shape[1]))
    return tokens, longest if text else 0


def _units() -> list[Unit]:
    """One of every unit of this package's modules (modules in name order, each module's in the order it defines them):
    a :class:`Unit` subclass that names its own ``classes`` (a base it shares with others, naming none of its own, is
    not one)."""
    out = []
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{m.name}")
        out += [c() for c in vars(module).values() if isinstance(c, type) and issubclass(c, Unit)
                and c.__module__ == module.__name__ and vars(c).get("classes")]
    return out


UNITS = _units()
BY_CLASS = {c: u for u in UNITS for c in u.classes}


def unit_for(diffusion_model) -> Unit | None:
    """The unit that splits this diffusion model's forward, by its exact class name (None: none)."""
    return BY_CLASS.get(type(diffusion_model).__name__)


def supported() -> list[tuple[str, tuple]]:
    """(family, class names) of every unit, for the node's description and the docs."""
    return [(u.name, u.classes) for u in UNITS]
