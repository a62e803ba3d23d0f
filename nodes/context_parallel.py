"""Context parallelism in ComfyUI: one sampling run's tokens split over the GPUs of the machine.

What the Context Parallel node puts on its clone of the model (nothing else changes, no other model sees any of it):

- **The GPUs' copies of the model**: ComfyUI's own MultiGPU deep clones (``comfy.multigpu.create_multigpu_deepclones``,
  ComfyUI 0.33+), which ComfyUI loads on each GPU at sampling start and keeps in step with the model's patches (LoRA,
  ...).  ComfyUI would use them to run the conds of a step on different GPUs (MultiGPU CFG Split); here the conds stay
  batched on the first GPU and every forward is split by tokens over all GPUs; with ``cfg_split`` and CFG above 1, each
  cond gets half of the GPUs (ComfyUI's cond scheduler over the halves' first GPUs; on 2 GPUs that is CFG Split itself,
  which measured faster than splitting tokens at CFG 5: docs/multi-gpu.md).  ComfyUI makes them with the loader's
  reload function; for a model whose loader registers none (ComfyUI-GGUF's), the clone gets one that copies the loaded
  model (unpatched, as ComfyUI leaves it before a copy), or, where it cannot be copied, samples on one GPU and says why.
- **A SAMPLER_SAMPLE wrapper** (:class:`RunWrapper`): per sampling run, the GPUs' models and one worker thread per extra
  GPU; the run's messages (why a forward ran on one GPU) are said once, in the log and in the node's box on the canvas.
- **An APPLY_MODEL wrapper** (:class:`SplitForwardWrapper`), outermost: each forward of the first GPU hands the same
  inputs, copied to each other GPU, to that GPU's model in its worker thread, with a
  :class:`~..parallel.context.RankContext` in the forward's ``transformer_options`` and the family unit's block patches;
  it returns the first GPU's output.  Their diffusion models run the first GPU's diffusion-model call: its
  DIFFUSION_MODEL wrappers (a step cache's decision among them) run there only, once for every GPU (:mod:`.handoff`).
- **torch.compile**: a forward it splits runs every GPU's model uncompiled (ComfyUI's TorchCompileModel wrapper left out
  of that forward's wrappers; the first GPU's too, through its model's ``apply_model`` as on the others).  TorchCompileModel
  keeps no guard on ``transformer_options``, so code it compiled for the model unsplit (an earlier run) would run again
  in a split forward without the split, and the other GPUs would wait for it.  Forwards it does not split keep it.
- **The attention hook** (:class:`ContextParallelAttention`): calls over the split sequence are exchanged
  (:mod:`..parallel.ulysses`) around whatever was on the hook: Patch Attention (any backend, ``auto``), another
  override, or ComfyUI's own attention; calls from a sequence every GPU holds whole to the split one get the split
  sequence's keys and values from every GPU.  It stays on top whichever node is applied first.

Where it cannot split (no CUDA GPU, one GPU, a model family without a unit, ComfyUI before 0.33, a model that cannot be
copied) the clone samples as the model does, and the node says why on the canvas and in the log (:func:`split_model`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import sys
import threading
import weakref

import torch

from ..parallel import ulysses as ulysses_mod
from ..parallel.context import CP_KEY, RankContext, StopRank
from ..parallel.families import supported, unit_for
from ..parallel.graphs import NotResident, Pieces, Residency, Same, options_key, signature
from ..parallel.group import Group, GroupAborted, on_device, split
from ..parallel.ulysses import mask_problem
from ..parallel.work import Work
from .handoff import Handoff
from .hook import COMPILE_KEY, OVERRIDE_KEY, SharedWrapper, bind, host_function, take
from .loaded import keep_pins_on
from .progress import executing_node

log = logging.getLogger("patch_attention.parallel")

WRAPPER_KEY = "patch_attention_context_parallel"
NODE = "Context Parallel"


# ---------------------------------------------------------------- the attention hook

class ContextParallelAttention:
    """The override on the hook of a context-parallel model: exchanges the calls over the split sequence and hands
    every call to ``inner`` (the override it went over, None: ComfyUI's function) on this GPU's share."""

    keeps_on_top = True  # Patch Attention applied later goes under it (nodes/compose.py)

    def __init__(self, inner=None):
        self.inner = inner

    def with_inner(self, inner) -> ContextParallelAttention:
        return ContextParallelAttention(inner)

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def _call_inner(self, func, *args, **kwargs):
        if self.inner is not None:
            return self.inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        topts = kwargs.get("transformer_options")
        ctx = topts.get(CP_KEY) if topts else None
        if ctx is not None and ctx.graph is not None and not ctx.graph.inside:
            # a forward recorded as CUDA graphs: every attention call runs between two pieces (parallel/graphs.py)
            return ctx.graph.island(ContextParallelAttention._route, self, ctx, func, args, kwargs)
        return self._route(ctx, func, args, kwargs)

    def _route(self, ctx, func, args, kwargs):
        if ctx is not None and ctx.layout is not None:
            a, rest = bind(args, kwargs)
            q_len, k_len = _seq_len(a["q"], a), _seq_len(a["k"], a)
            if ctx.exchanges(q_len, k_len):
                return self._exchanged(ctx, func, a, rest)
            if ctx.gathers(q_len, k_len):
                return self._gathered(ctx, func, a, rest)
        return self._call_inner(func, *args, **kwargs)

    def container_function(self, *args, **kwargs):
        """ComfyUI 0.33+: q/k/v in single-owner containers (see nodes/hook.py)."""
        topts = kwargs.get("transformer_options")
        ctx = topts.get(CP_KEY) if topts else None
        if (ctx is None or (ctx.layout is None and ctx.graph is None)) and hasattr(self.inner, "container_function"):
            return self.inner.container_function(*args, **kwargs)
        return self(host_function(), *take(args), **kwargs)

    def _exchanged(self, ctx, func, a, rest):
        q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
        mask = own_mask = a.get("mask")
        if mask is not None:
            why = mask_problem(mask, _seq_len(k, a), ctx.layout.full_len, heads)
            if why:
                raise ValueError(f"{NODE}: {why} (this model's unit must keep such forwards on one GPU)")
        skip, skip_out = bool(a.get("skip_reshape", False)), bool(a.get("skip_output_reshape", False))
        b = q.shape[0]
        first = skip and ulysses_mod.HEADS_FIRST
        if first:  # [B, H, L, D]: exchanged as they are, each head's tokens one block
            qn, kn, vn = q, k, v
        elif skip:
            qn, kn, vn = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:  # [B, L, H*D]
            d = q.shape[-1] // heads
            qn = q.view(b, q.shape[1], heads, d)
            kn = k.view(b, k.shape[1], k.shape[-1] // d, d)
            vn = v.view(b, v.shape[1], kn.shape[2], v.shape[-1] // kn.shape[2])
        extra = rest  # bind() made it: the call's other keywords, this call's own dict
        precision = a.get("attn_precision")

        def local(qf, kf, vf, mask=None):  # [B, L, h, D] handed on as [B, L, h*D] (a view: no copy); skip: [B, h, L, D]
            # a mask over query rows comes from the unit (the model's call had none): exact, as ComfyUI's own masked calls
            # of those models; the call's own key mask keeps the call's own flags
            more = extra if mask is None or own_mask is not None else {**extra, "low_precision_attention": False}
            if first:
                bl, h, lq, _ = qf.shape
                args = qf, kf, vf
            else:
                bl, lq, h, dq = qf.shape
                lk = kf.shape[1]
                args = qf.view(bl, lq, h * dq), kf.view(bl, lk, -1), vf.view(bl, lk, -1)
            out = self._call_inner(func, *args, h, mask=mask, attn_precision=precision, skip_reshape=first,
                                   skip_output_reshape=False, **more)
            return out.reshape(bl, lq, h, -1)

        o = ctx.attention(qn, kn, vn, local, mask, heads_first=first)  # [B, L_r, H, Dv]
        if skip_out:
            return o.transpose(1, 2)
        return o.reshape(b, o.shape[1], -1)

    def _gathered(self, ctx, func, a, rest):
        """A call from a sequence every GPU holds whole to the split one: the split sequence's keys and values from
        every GPU, the call as on one GPU (each GPU computes the same output)."""
        if a.get("mask") is not None:
            raise ValueError(f"{NODE}: a masked attention call to the split sequence (this model's unit must keep such "
                             "forwards on one GPU)")
        k, v = ctx.keys(a["k"], a["v"], 2 if a.get("skip_reshape", False) else 1)
        named = {n: x for n, x in a.items() if n not in ("q", "k", "v", "heads")}
        return self._call_inner(func, a["q"], k, v, a["heads"], **named, **rest)


def _seq_len(t, a) -> int:
    return t.shape[2] if a.get("skip_reshape", False) else t.shape[1]


# ---------------------------------------------------------------- the run and its forwards

class ContextParallel:
    """One Context Parallel node's choice, shared by the clones of its model (and their GPUs' copies)."""

    def __init__(self, unit, cfg_split: bool = False, simulate: int = 0, min_tokens: int | None = 0, note: str = "",
                 node: str | None = None, graphs: bool | None = None, graph_type=None):
        self.unit = unit
        # split forwards of a family that offers it replay as CUDA graphs (None: GRAPHS); ``graph_type``: tests, a
        # stand-in for torch.cuda.CUDAGraph that runs on the CPU
        self.graphs = GRAPHS if graphs is None else graphs
        self.graph_type = graph_type
        self.cfg_split = cfg_split
        self.simulate = simulate  # tests: this many ranks on the model's own device, sharing its model
        # shorter sequences to split run on one GPU (0: none); None: forwards with less work per block than SPLIT_TFLOP
        self.min_tokens = min_tokens
        self.note = note  # what the node shows on the canvas (split_model)
        self.node = node  # the node's id in ComfyUI's prompt (None outside ComfyUI's executor)
        self._lock = threading.Lock()
        self._work = weakref.WeakKeyDictionary()  # diffusion model -> its Work, made once per model
        self.run = None  # the current sampling run (read by forwards in any thread)
        self.kept = None  # the last run's CUDA graphs, for the next run of the same models and options (Kept)
        _CHOICES.add(self)

    def __deepcopy__(self, memo):
        return self

    def release(self, patcher=None, unpatch_all: bool = True) -> None:
        """The kept graphs let go (their memory with them), where ComfyUI unloads ``patcher``, a patcher of a model they
        were recorded with (its ON_DETACH callback; ``unpatch_all`` False: the weights stay where they are, as at every
        sampling start, when ComfyUI takes a model out of its loaded list and loads it again), or always without one."""
        if unpatch_all:
            self.let_go(None if patcher is None else {Same(getattr(patcher, "model", None))})

    def let_go(self, models=None) -> bool:
        """The kept graphs let go (their memory with them) where they were recorded over any of ``models``
        (:class:`~..parallel.graphs.Same`; None: whatever they were recorded over); whether there were such."""
        with self._lock:
            kept = self.kept
            if kept is None or (models is not None and not any(m in models for m in kept.models)):
                return False
            self.kept = None
        kept.pieces.clear()
        return True

    def work(self, dm) -> Work | None:
        """``dm``'s work per block (:meth:`~..parallel.families.Unit.work`), made once (for the node's note, or at the
        first forward) and kept while the model lives; the GPUs' copies have the same shapes, so a forward asks for the
        first GPU's.  None for a model with no weights in its blocks (no work floor then)."""
        w = self._work.get(dm)
        if w is None:
            with self._lock:
                w = self._work.get(dm)
                if w is None:
                    w = self._work[dm] = self.unit.work(dm)
        return w if w.params else None

    def over(self, dm, n: int) -> str:
        """Over how many of ``n`` GPUs ``dm``'s steps split, for the node's note (:func:`gpus_for`): "4 GPUs", or "2 of
        the 4 GPUs, more from 30,000 tokens and all 4 from 40,000" (the whole sequence's tokens)."""
        work = self.work(dm) if n > 2 and self.min_tokens is None else None
        if work is None:
            return f"{n} GPUs"
        more, every = work.tokens_for(MORE_GPUS_TFLOP * 3), work.tokens_for(MORE_GPUS_TFLOP * n)
        if n == 3:
            return f"2 of the 3 GPUs, all 3 from {every:,} tokens"
        return f"2 of the {n} GPUs, more from {more:,} tokens and all {n} from {every:,}"

    def least_work(self, dm, x, c_crossattn) -> float | None:
        """The least work per block (TFLOP) a forward of latent ``x`` and text ``c_crossattn`` does, before its first
        block: its latent's patches and its text as the unit counts them (inputs that add tokens only add work); None
        where the unit cannot tell."""
        conds = {"text": [{"cross_attn": c_crossattn}]} if isinstance(c_crossattn, torch.Tensor) else {}
        return self.work_of_shapes(dm, tuple(x.shape), conds)

    def work_of_shapes(self, dm, shape, conds: dict) -> float | None:
        """The work per block (TFLOP) of the most tokens a forward of a latent of ``shape`` with ``conds`` has (the
        unit's :meth:`~..parallel.families.Unit.most_tokens`); None where the unit cannot tell or ``dm`` has no work."""
        work = self.work(dm)
        most = self.unit.most_tokens(dm, shape, conds) if work is not None else None
        return None if most is None else work.tflop_per_block(sum(most))

    def floor(self, dm, topts: dict, graphs: bool = False, dynamic: bool = False) -> dict:
        """The floor of a forward of ``dm`` whose ``transformer_options`` are ``topts``, as :class:`Group` arguments:
        the token floor where one is set, else ``dm``'s work floor for the attention the forward runs
        (:func:`attention_of`), or, where its run replays split forwards as CUDA graphs (``graphs``), the floor for
        graphs (``dynamic``: the model's weights in ComfyUI's dynamic VRAM, :func:`graphs_floor`)."""
        if self.min_tokens is not None:
            return {"min_tokens": self.min_tokens}
        work = self.work(dm)
        if work is None:
            return {}
        kind, name = attention_of(topts)
        if graphs:  # per attention call: what a replay's host work grows with
            return {"work": work, "min_tflop": graphs_floor(self.unit, kind, dynamic) * self.unit.calls_per_block,
                    "attention": name}
        return {"work": work, "min_tflop": SPLIT_TFLOP[kind], "attention": name}

    def graphs_possible(self, patcher) -> bool:
        """Whether a run of ``patcher``'s model may replay its split forwards as CUDA graphs, told before the run (its
        weights' place is known once it is loaded: :func:`graphs_off`, and under ComfyUI's dynamic VRAM at each
        forward: :class:`GraphWrapper`)."""
        device = getattr(patcher, "load_device", None)
        return (self.graphs and self.unit.graphs and getattr(device, "type", None) == "cuda"
                and not (self.graph_type is None and _async_allocator()))

    def steps(self, dm, dynamic: bool = False) -> tuple[str, str]:
        """Which steps of ``dm`` split, for the node's note: (which steps, what changes that), e.g. ("each step of
        13,000 tokens or more", " (20,000 or more with Patch Attention's kernels)"); the tokens of the whole sequence
        (text tokens held whole by every GPU counted with the split ones).  ``dynamic``: the model's weights are in
        ComfyUI's dynamic VRAM."""
        if self.min_tokens is not None:
            return (f"each step of {self.min_tokens:,} tokens or more" if self.min_tokens else "each step"), ""
        work = self.work(dm)
        if work is None:
            return "each step", ""
        pack = work.tokens_for(SPLIT_TFLOP["pack"])
        graphs_on = self.graphs and self.unit.graphs
        no_graphs_here = graphs_on and self.graph_type is None and _async_allocator()
        if graphs_on and not no_graphs_here:  # replayed as CUDA graphs where the weights stay put
            calls = self.unit.calls_per_block
            graphs = work.tokens_for(graphs_floor(self.unit, "pack", dynamic) * calls)
            comfy = work.tokens_for(graphs_floor(self.unit, "comfyui", dynamic) * calls)
            static = work.tokens_for(graphs_floor(self.unit, "pack") * calls)
            loader = f", {static:,} with ComfyUI started with --disable-dynamic-vram" if static < graphs else ""
            if _host_attention()[0] != "comfyui":
                return f"each step of {graphs:,} tokens or more", f" ({loader[2:]}; {pack:,} or more{MOVED})" \
                    if loader else f" ({pack:,} or more{MOVED})"
            return (f"each step of {comfy:,} tokens or more",
                    f" ({graphs:,} or more with Patch Attention's kernels{loader}; {pack:,} or more{MOVED})")
        if no_graphs_here:  # what ComfyUI's allocator keeps from them
            kind = "graphs-comfyui" if _host_attention()[0] == "comfyui" else "graphs-pack"
            graphs = work.tokens_for(SPLIT_TFLOP[kind] * self.unit.calls_per_block)
            more = f"; from {graphs:,} with ComfyUI started with --disable-cuda-malloc, its steps replayed as CUDA graphs"
        else:
            more = ""
        if _host_attention()[0] != "comfyui":  # ComfyUI started with sage, flash, ...: the higher floor either way
            return f"each step of {pack:,} tokens or more", f" ({more[2:]})" if more else ""
        return (f"each step of {work.tokens_for(SPLIT_TFLOP['comfyui']):,} tokens or more",
                f" ({pack:,} or more with Patch Attention's kernels{more})")

    def whole_run(self, patcher, shape, conds: dict, topts: dict, cfg: float = 1.0) -> str:
        """Why every forward of a run of a latent of ``shape`` stays on one GPU, told before the run from the shapes
        alone (the unit's :meth:`~..parallel.families.Unit.most_tokens`, at most the tokens a forward will have, against
        the floor a forward would meet); "" where a forward may split, where that cannot be told, or where the GPUs
        take a cond each (``cfg_split`` above CFG 1)."""
        if self.simulate or (self.cfg_split and cfg != 1.0):
            return ""
        dm = patcher.model.diffusion_model
        most = self.unit.most_tokens(dm, shape, conds)
        if most is None:
            return ""
        group = Group(["cpu"] * (1 + len(patcher.get_additional_models_with_key("multigpu"))),
                      **self.floor(dm, topts, self.graphs_possible(patcher), _dynamic(patcher)))
        ctx = RankContext(group, 0, self.unit)
        return "" if ctx.start(most[0], prefix=most[1]) else ctx.why

    def run_gpus(self, patcher, shape, conds: dict, cfg: float = 1.0) -> int | None:
        """Over how many GPUs at most a run of a latent of ``shape`` splits its steps (:func:`gpus_for` of the most
        work a forward will have, from the shapes alone as :meth:`whole_run` tells it); None where that cannot be told
        or is not the node's to choose (a token floor, ``cfg_split`` above CFG 1, simulated ranks)."""
        if self.simulate or self.min_tokens is not None or (self.cfg_split and cfg != 1.0):
            return None
        tflop = self.work_of_shapes(patcher.model.diffusion_model, shape, conds)
        return None if tflop is None else \
            gpus_for(tflop, 1 + len(patcher.get_additional_models_with_key("multigpu")))

    def say(self, key: str, msg: str, show: bool = False) -> None:
        """``msg`` in the log once per sampling run (``key``: which message); with ``show``, also under the node's own
        text in its box on the canvas."""
        run = self.run
        lines = None
        if run is not None:
            with self._lock:
                if key in run.said:
                    return
                run.said.add(key)
                if show:
                    run.shown.append(msg[:1].upper() + msg[1:] + ".")
                    lines = [self.note, *run.shown]
        log.warning("%s: %s", NODE, msg)
        if lines:
            show_on_node(self.node, "\n".join(lines))


def attention_of(topts: dict) -> tuple[str, str]:
    """The attention a forward runs (its ``transformer_options``): which work floor it takes (a key of
    :data:`SPLIT_TFLOP`) and its name for the messages.  "comfyui": ComfyUI's own PyTorch attention, no override under
    the split's (Patch Attention "disabled" takes its own out); "pack" for anything else: a Patch Attention backend,
    another node's override, ComfyUI started with another attention (--use-sage-attention, ...)."""
    inner = topts.get(OVERRIDE_KEY)
    if isinstance(inner, ContextParallelAttention):
        inner = inner.inner
    if inner is None:
        return _host_attention()
    backend = getattr(getattr(inner, "config", None), "backend", None)
    if isinstance(backend, str):
        return "pack", f"Patch Attention's {backend}"
    return "pack", f"another node's attention ({type(inner).__name__})"


def _host_attention() -> tuple[str, str]:
    """:func:`attention_of` for ComfyUI's own attention function (picked at its start, by its flags)."""
    name = getattr(host_function(), "__name__", "")
    if name == "attention_pytorch":
        return "comfyui", "ComfyUI's PyTorch attention"
    return "pack", f"ComfyUI's {name}" if name else "ComfyUI's attention"


def show_on_node(node: str | None, text: str) -> None:
    """``text`` in node ``node``'s box on the canvas (web/patch_attention.js) while ComfyUI runs a prompt: the message
    ComfyUI's executor sends for a node's page output, sent by its server to the prompt's client.  Nothing outside a
    prompt (no executing node) or without ComfyUI's server."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return
    running = get_executing_context()
    server = getattr(sys.modules.get("server"), "PromptServer", None)
    server = getattr(server, "instance", None)
    if node is None or running is None or server is None:
        return
    server.send_sync("executed", {"node": node, "display_node": node, "output": {"text": [text]},
                                  "prompt_id": running.prompt_id}, server.client_id)


# Every node choice (ContextParallel) alive, by weak reference: a run that records lets go of the graphs its node's
# earlier outputs keep (:func:`_supersede`).
_CHOICES = weakref.WeakSet()


def _supersede(cp: ContextParallel, models) -> None:
    """Before ``cp``'s run records CUDA graphs over ``models``: the graphs kept by earlier outputs of the same node over
    any of those models go (a forward's activations on every GPU, which ComfyUI's memory management does not count).
    ComfyUI's output cache keeps a node's earlier outputs (its default while the host has RAM to spare, the LRU cache
    up to its size), and its MultiGPU copies and the clone they were made for refer to each other, so an output let go
    of lives until Python's cycle collector runs: graphs kept with each output the user made (a backend, a LoRA changed
    above the node) piled up on the GPUs (a soak through the server, 2x H200: PyTorch's reserved memory 1,216 MiB a
    GPU at its 100th prompt, 578 MiB with this).  One output of a node keeps graphs of a model; another node over the
    same model (a workflow that samples it twice) keeps its own.  Outside ComfyUI's executor (no node id) every choice
    counts as one node."""
    freed = False
    for other in list(_CHOICES):
        if other is not cp and other.node == cp.node:
            freed = other.let_go(models) or freed
    if freed and torch.cuda.is_available():
        torch.cuda.empty_cache()  # a graph's memory pool, let go, stays cached where no other tensor can use it


class Kept:
    """A sampling run's CUDA graphs kept for the next run (ComfyUI keeps a model loaded from one prompt to the next):
    that run replays them from its first forward where its models, their patches and its forwards' options are the
    same (:func:`run_key`, :func:`~..parallel.graphs.options_key`) and the weights where they were, instead of running
    its first forward eagerly and recording its second.  ``pieces`` and ``split_shapes`` are the run's."""

    __slots__ = ("key", "pieces", "split_shapes")

    def __init__(self, key, pieces, split_shapes):
        self.key, self.pieces, self.split_shapes = key, pieces, split_shapes

    @property
    def models(self) -> tuple:
        """(:class:`~..parallel.graphs.Same`) the models of the run's patchers, whose unloading lets the graphs go."""
        return tuple(m for m, _, _ in self.key[0])


def run_key(patchers: list, groups: list, inference: bool):
    """What the graphs of a run on ``groups`` (sampled through ``patchers``: the sampled model and its GPUs' copies)
    are recorded with beyond each forward's options: each patcher's model, weight patches (a LoRA changed) and object
    patches, the GPUs' models.  Not the patchers themselves: ComfyUI makes the GPUs' copies' patchers anew at each
    run, over the same models.  None where a run's graphs are not kept: hooks that change the weights during a run."""
    if any(getattr(p, "hook_patches", None) or getattr(p, "forced_hooks", None) for p in patchers):
        return None
    return (tuple((Same(p.model), getattr(p, "patches_uuid", None), options_key(getattr(p, "object_patches", None)))
                  for p in patchers),
            tuple((d, Same(m)) for g in groups for d, m in g), inference)


class Run:
    """One sampling run: the GPUs' models by group, a worker per extra GPU, what was said."""

    def __init__(self, groups: list, grad: bool, inference: bool):
        self.groups = groups  # [[(device, BaseModel), ...] per group]; each group's first is where its forwards start
        self.by_leader = {g[0][0]: g for g in groups}
        self.workers = {}
        for g in groups:
            for i, (dev, _) in enumerate(g[1:], 1):
                self.workers[(g[0][0], i)] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"context-parallel-{dev}", initializer=_set_device, initargs=(dev,))
        self.grad, self.inference = grad, inference
        self.said = set()
        self.shown = []  # what the run said on the canvas, in order
        self.forwards = self.split_forwards = self.reused = self.graphed = 0
        self.whole = set()  # the shapes of the forwards that ran on one GPU for their shapes (too short to pay)
        self.graphs = False  # split forwards may replay as CUDA graphs in this run (graphs_off)
        self.split_shapes = {}  # the shapes of the forwards that split -> their work per block (the next may replay)
        self.split_over = collections.Counter()  # split forwards by how many GPUs they split over (gpus_for)
        self.no_graphs = set()  # the shapes (and GPUs) whose graphs failed: they run without them
        self.pieces = {}  # (shapes, rank, the diffusion model's arguments) -> its parallel.graphs.Pieces
        self.recorded = 0  # forwards recorded as CUDA graphs
        self.key = None  # run_key: the run's graphs are kept for the next run (None: not)
        self.inherited = False  # the pieces are the last run's (Kept), none recorded in this run yet
        self.dynamic = False  # the model's weights are in ComfyUI's dynamic VRAM (graphs_floor)
        self.residency = {}  # id(diffusion model) -> its weights in dynamic VRAM (parallel.graphs.Residency), or None

    def patch_models(self, unit, undo: list) -> None:
        """The unit's changes to every GPU's model for this run, each one's undoing appended to ``undo`` as it is
        made."""
        for m in {id(m): m for g in self.groups for _, m in g}.values():
            undo.append(unit.patch_run(m.diffusion_model))

    def take(self, cp) -> None:
        """The last run's graphs, where they were recorded as this run's would be; otherwise they go (their memory
        before this run records its own), and so do those of the node's earlier outputs (:func:`_supersede`)."""
        with cp._lock:
            kept, cp.kept = cp.kept, None
        if kept is not None and self.graphs and self.key is not None and kept.key == self.key:
            self.pieces, self.split_shapes, self.inherited = kept.pieces, dict(kept.split_shapes), True
            return
        if kept is not None:
            kept.pieces.clear()
        if self.graphs:
            _supersede(cp, {Same(m) for g in self.groups for _, m in g})

    def close(self, cp) -> None:
        """Workers stopped; the run's graphs kept for the next run where they may serve it, or let go."""
        for w in self.workers.values():
            w.shutdown(wait=True)
        if self.graphs and self.key is not None and self.pieces:
            with cp._lock:
                cp.kept = Kept(self.key, self.pieces, self.split_shapes)
        else:
            self.pieces.clear()  # the graphs' memory goes with the run


def _shapes(values) -> tuple:
    """The shapes of a forward's inputs (tensors, lists of tensors such as reference latents, keyword items), what a
    family unit counts its tokens from."""
    out = []
    for v in values:
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):  # a keyword argument
            out.append(v[0])
            v = v[1]
        if isinstance(v, torch.Tensor):
            out.append(tuple(v.shape))
        elif isinstance(v, (list, tuple)):
            out.append(tuple(tuple(e.shape) if isinstance(e, torch.Tensor) else None for e in v))
        else:
            out.append(None)
    return tuple(out)


def _set_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


class _Wrapper(SharedWrapper):
    """A wrapper of the node's, bound to its :class:`ContextParallel`."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp


class RunWrapper(_Wrapper):
    """SAMPLER_SAMPLE wrapper: the run's GPUs and workers (see the module's docstring)."""

    def __call__(self, executor, *args, **kwargs):
        cp = self.cp
        # sampler.sample(guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)
        guider = args[0] if args else kwargs.get("model_wrap")
        extra = args[2] if len(args) > 2 else kwargs.get("extra_args")
        options = extra.get("model_options", {}) if isinstance(extra, dict) else {}
        base = getattr(getattr(guider, "model_patcher", None), "model", None)
        clones = options.get("multigpu_clones") or {}
        groups, restore = self.groups(cp, options, base, getattr(guider, "cfg", 1.0))
        run = Run(groups, torch.is_grad_enabled(), torch.is_inference_mode_enabled()) if groups else None
        if run is not None:
            why = graphs_off(cp, groups, run.grad)
            run.graphs = not why
            if why and cp.unit.graphs and cp.graphs:
                log.info("%s: no CUDA graphs in this run: %s", NODE, why)
            patchers = [p for p in (getattr(guider, "model_patcher", None), *clones.values()) if p is not None]
            run.key = run_key(patchers, groups, run.inference) if run.graphs else None
            run.dynamic = any(_dynamic(p) for p in patchers)
            run.take(cp)
        prev, cp.run = cp.run, run
        undo = []
        try:
            if run is not None:
                run.patch_models(cp.unit, undo)
            return executor(*args, **kwargs)
        finally:
            cp.run = prev
            for u in undo:
                u()
            if run is not None:
                run.close(cp)
                if run.forwards:
                    log.info("%s: %d of %d forwards split over %s%s%s", NODE, run.split_forwards, run.forwards,
                             _over(run.split_over, max(len(g) for g in run.groups)),
                             f", {run.graphed} of them replayed as CUDA graphs ({run.recorded} recorded)"
                             if run.graphed else "",
                             f" ({run.reused} reused a step cache's output)" if run.reused else "")
            restore()

    @staticmethod
    def groups(cp, options: dict, base, cfg: float = 1.0):
        """The run's groups of (device, model) and how to put the model options back afterwards."""
        if cp.simulate:
            dev = next(base.diffusion_model.parameters()).device
            return [[(dev, base)] * cp.simulate], lambda: None
        clones = options.get("multigpu_clones")
        if not clones or len(clones) < 2:
            return [], lambda: None
        devices = list(clones)
        n_groups = 2 if cp.cfg_split and cfg != 1.0 else 1  # CFG 1: one cond, every GPU on it
        groups = [[(d, clones[d].model) for d in devices[a:a + n]] for a, n in split(len(devices), n_groups)]
        leaders = {g[0][0]: clones[g[0][0]] for g in groups}
        # the conds stay batched on the first GPU (one group), or go one group each (MultiGPU CFG Split over the
        # groups' first GPUs): ComfyUI's cond scheduler sees only the groups' first GPUs
        if n_groups == 1:
            options.pop("multigpu_clones")

            def restore():
                options["multigpu_clones"] = clones
        else:
            options["multigpu_clones"] = leaders

            def restore():
                options["multigpu_clones"] = clones
        return groups, restore


class SplitForwardWrapper(_Wrapper):
    """APPLY_MODEL wrapper (outermost): one forward split over its group's GPUs (see the module's docstring)."""

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        cp = self.cp
        topts = transformer_options if transformer_options is not None else {}
        run = cp.run
        if CP_KEY in topts or run is None:  # a GPU's own share (or no run state: one GPU)
            return executor(x, t, c_concat, c_crossattn, control, topts, **kwargs)
        ranks = run.by_leader.get(x.device)
        if ranks is None or len(ranks) < 2:
            return executor(x, t, c_concat, c_crossattn, control, topts, **kwargs)
        with cp._lock:
            run.forwards += 1
        why = self.why_not(control)
        if why:
            cp.say(why, f"a forward runs on one GPU: {why}", show=True)
            return executor(x, t, c_concat, c_crossattn, control, topts, **kwargs)
        dm = ranks[0][1].diffusion_model
        floor = cp.floor(dm, topts, run.graphs, run.dynamic)
        # with graphs, also what the forward's Python depends on in its options (a kept graph serves the same only)
        shapes = (_shapes((x, c_concat, c_crossattn, *kwargs.items())), floor.get("min_tflop"), floor.get("min_tokens"),
                  options_key(topts) if run.graphs else None)
        if shapes in run.whole:  # a forward of these shapes ran whole for them: no other GPU's thread is started
            return executor(x, t, c_concat, c_crossattn, control, topts, **kwargs)
        # under torch.compile every GPU runs its model's forward uncompiled, through apply_model without the compile
        # wrapper (the first GPU's executor would run the compiled module: see the module's docstring)
        uncompiled = COMPILE_KEY in topts.get("wrappers", {}).get("apply_model", {})
        if uncompiled:
            cp.say("compile", "torch.compile is on: the forwards split over GPUs run uncompiled (compiled, they measured no "
                   "faster: docs/multi-gpu.md); forwards on one GPU stay compiled")
        call = (executor, (x, t, c_concat, c_crossattn, control), topts, kwargs, uncompiled)
        # over as many of the GPUs as its work pays on (gpus_for): known once its shapes split, before that at least
        # what its latent and text make (two GPUs where that cannot be told); all of them under a token floor
        n = len(ranks)
        if "work" in floor and n > 2:
            tflop = run.split_shapes.get(shapes) or cp.least_work(dm, x, c_crossattn)
            n = gpus_for(tflop, n) if tflop is not None else 2
        if n < len(ranks):
            cp.say(f"fewer:{n}", f"steps of {cp.unit.name} this size split over {n} of the {len(ranks)} GPUs: on more, "
                   "each GPU's share would be too short to pay", show=True)
            ranks = ranks[:n]
        # a forward of shapes that split before in this run replays as CUDA graphs, where the run allows them
        gkey = (*shapes, len(ranks))  # graphs recorded over as many GPUs as replay them
        graphs = run.graphs and shapes in run.split_shapes and gkey not in run.no_graphs \
            and (run.split_shapes[shapes] or 0) < GRAPHS_BELOW_TFLOP
        try:
            out, ctx = self._split(run, ranks, floor, dm, call, gkey if graphs else None)
        except NotResident as e:  # no graph can rely on where the weights are: the rest of the run without them
            with cp._lock:
                again = run.inherited  # the last run's graphs: this run records its own from its next forward
                run.graphs = again
                run.inherited = False
                run.pieces.clear()  # the graphs' memory goes
            if again:
                log.info("%s: %s since the last run: its CUDA graphs recorded again", NODE, e)
            else:
                cp.say("graphs-moved", f"{e}: the rest of the run without CUDA graphs (short steps may then stay on one "
                       "GPU)")
            graphs = False
            out, ctx = self._split(run, ranks, floor, dm, call, None)
        except Exception as e:
            if not graphs or type(e).__name__ == "InterruptProcessingException":
                raise
            with cp._lock:
                run.no_graphs.add(gkey)
                for k in [k for k in run.pieces if k[0] == gkey]:
                    del run.pieces[k]
            log.debug("%s: CUDA graphs of a forward failed", NODE, exc_info=True)
            cp.say("graphs-failed", f"a forward of {cp.unit.name} could not run as CUDA graphs ({type(e).__name__}: {e}); "
                   "forwards of its shapes run without them in this run")
            graphs = False
            out, ctx = self._split(run, ranks, floor, dm, call, None)
        if ctx.split or ctx.split is None:  # split, or no block ran: a step cache reused an output
            with cp._lock:
                run.split_forwards += bool(ctx.split)
                run.graphed += bool(ctx.split) and graphs
                run.reused += ctx.split is None
                if ctx.split:
                    run.split_shapes[shapes] = ctx.tflop
                    run.split_over[len(ranks)] += 1
        else:
            if ctx.by_shapes:
                with cp._lock:
                    run.whole.add(shapes)
            cp.say("whole:" + ctx.why, f"a forward of {cp.unit.name} ran on one GPU: {ctx.why}", show=True)
        return out

    def _split(self, run, ranks, floor: dict, dm, call, graphs):
        """One forward over the GPUs of ``ranks``; ``graphs``: the forward's shapes, where it replays as CUDA graphs
        (recorded at its first such forward of the run).  Returns its output and the first GPU's context."""
        executor, (x, t, c_concat, c_crossattn, control), topts, kwargs, uncompiled = call
        cp = self.cp
        group = Group([d for d, _ in ranks], **floor)
        if graphs is not None:
            group.staged = False  # q, k and v sent at the attention call: one island, not three (parallel/graphs.py)
        keys = cp.unit.block_keys(dm)
        ctxs = [RankContext(group, r, cp.unit) for r in range(group.size)]
        for c in ctxs:
            c.last_key = keys[-1]

        handoff = Handoff(_to)  # the other GPUs run the first GPU's diffusion-model call (nodes/handoff.py)

        def options(r, device):
            o = self.rank_options(topts, ctxs[r], keys, device, uncompiled)
            o = handoff.following(o) if r else handoff.leading(o)
            return o if graphs is None else _graphed(o, GraphWrapper(run, graphs, ranks[r][0], cp.graph_type))

        futures = []
        for r in range(1, group.size):
            dev, model = ranks[r]
            worker = run.workers[(ranks[0][0], r)]
            futures.append(worker.submit(self._rank, run, model, ctxs[r], dev, (x, t, c_concat, c_crossattn, control),
                                         options(r, dev), kwargs))
        try:
            try:
                first = options(0, None)
                if uncompiled:
                    out = executor.class_obj.apply_model(x, t, c_concat, c_crossattn, control, first, **kwargs)
                else:
                    out = executor(x, t, c_concat, c_crossattn, control, first, **kwargs)
                handoff.end()
            except BaseException as e:
                handoff.end()
                group.abort(e)
                concurrent.futures.wait(futures)
                if isinstance(e, GroupAborted):  # another GPU failed first: its error is the one to report
                    raise _first_error(futures) or e from None
                raise
            err = _first_error(futures)  # every GPU's forward returned
            if err is not None:
                raise err
        finally:
            handoff.close()
        if graphs is not None:
            group.settle_all()  # no GPU writes its graphs' memory again before the others have read it
        return out, ctxs[0]

    @staticmethod
    def why_not(control) -> str:
        """Why this forward cannot be split ("" where it can)."""
        if control is not None:
            return "a ControlNet's residuals are made for the whole sequence"
        return ""

    @staticmethod
    def rank_options(topts: dict, ctx: RankContext, keys: list, device, uncompiled: bool = False) -> dict:
        """The forward's transformer_options for one GPU: its context, the unit's block patches over any already there,
        the top-level tensors on its device, and (``uncompiled``) its wrappers without the torch.compile one."""
        out = {k: (_to(v, device) if device is not None else v) for k, v in topts.items()}
        if uncompiled:
            wrappers = dict(out.get("wrappers", {}))
            wrappers["apply_model"] = {k: v for k, v in wrappers.get("apply_model", {}).items() if k != COMPILE_KEY}
            out["wrappers"] = wrappers
        replace = dict(out.get("patches_replace", {}))
        dit = dict(replace.get("dit", {}))
        for key in keys:
            dit[key] = BlockPatch(ctx.unit, key, dit.get(key))
        replace["dit"] = dit
        out["patches_replace"] = replace
        out[CP_KEY] = ctx
        return out

    @staticmethod
    def _rank(run, model, ctx, device, args, topts, kwargs):
        try:
            with on_device(device), torch.inference_mode(run.inference), torch.set_grad_enabled(run.grad):
                x, t, c_concat, c_crossattn, control = (_to(a, device) for a in args)
                return model.apply_model(x, t, c_concat, c_crossattn, control, topts, **_to(kwargs, device))
        except StopRank:
            return None
        except BaseException as e:
            ctx.group.abort(e)
            raise


ASYNC_ALLOCATOR = ("PyTorch runs its cudaMallocAsync allocator (ComfyUI's default; start ComfyUI with "
                   "--disable-cuda-malloc for them)")


def _async_allocator() -> bool:
    """PyTorch's CUDA memory comes from its cudaMallocAsync allocator (ComfyUI sets it up at its start unless told
    --disable-cuda-malloc): it records one CUDA graph at a time in the process, and a tensor made before a recording
    and freed during it stops the process (measured through ComfyUI's server, 2x H200, PyTorch 2.11): no graphs then."""
    try:
        return torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    except Exception:  # an allocator not started: the setting says which it will be
        return "cudaMallocAsync" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def graphs_off(cp, groups, grad: bool = False) -> str:
    """Why the split forwards of a run on ``groups`` cannot replay as CUDA graphs ("": they can): the node's setting,
    the model's family, devices other than CUDA GPUs (tests give a stand-in graph), or weights that move during the
    run (ComfyUI's estimate-based loader offloading part of a model: a graph replays the addresses it recorded), or
    PyTorch's cudaMallocAsync allocator (:func:`_async_allocator`).  Under
    ComfyUI's dynamic VRAM each forward holds the weights where its graphs read them, or runs without graphs
    (:class:`GraphWrapper`)."""
    if not cp.graphs:
        return "off"
    if not cp.unit.graphs:
        return f"{cp.unit.name} forwards are not replayed as graphs"
    if grad:
        return "gradients are on"
    if cp.graph_type is None and any(d.type != "cuda" for g in groups for d, _ in g):
        return "not on CUDA GPUs"
    if cp.graph_type is None and _async_allocator():
        return ASYNC_ALLOCATOR
    for g in groups:
        for _, m in g:
            if getattr(m, "model_lowvram", False):
                return "ComfyUI keeps part of the model's weights off the GPU"
    return ""


class GraphWrapper:
    """DIFFUSION_MODEL wrapper, innermost, of one GPU's share of a forward that replays as CUDA graphs: records the
    diffusion model's forward at the first call of its arguments' shapes in the run, replays it from then on
    (:class:`~..parallel.graphs.Pieces`, kept in the :class:`Run`'s ``pieces``).

    Weights in ComfyUI's dynamic VRAM (comfy-aimdo maps them to GPU memory as they are used, and may take the memory
    back between uses) are held on the GPU for the recording and each replay, and a replay runs only where they are the
    pages its recording read (:class:`~..parallel.graphs.Residency`; every GPU or none); otherwise
    :class:`~..parallel.graphs.NotResident`, and the node runs the rest of the run without graphs."""

    def __init__(self, run: Run, shapes, device, graph_type=None):
        self.run, self.shapes, self.device, self.graph_type = run, shapes, device, graph_type

    def __call__(self, executor, *args, **kwargs):
        topts = next(v for v in (*args, *kwargs.values()) if isinstance(v, dict) and CP_KEY in v)
        ctx = topts[CP_KEY]
        key, tensors = signature(args, kwargs, topts)
        k = (self.shapes, ctx.rank, key)
        # where the weights are: ComfyUI may put other tensors in their place during a run (hooks that patch weights
        # per step), and a graph would read the ones it recorded
        pieces = self.run.pieces.get(k)
        if pieces is not None:
            now = _weights(pieces.modules)
            if now != pieces.weights:
                self._say_moved(pieces, now)
                pieces = None
        module = executor.class_obj
        modules = pieces.modules if pieces is not None else \
            list(module.modules()) if isinstance(module, torch.nn.Module) else []
        resident = self._residency(module, modules)
        # weights in ComfyUI's dynamic VRAM: held where the graphs read them, or no graphs
        held = resident.pin() if resident is not None else None
        try:
            if resident is not None:
                moved = held is None or (pieces is not None and pieces.resident != held)
                if ctx.any(moved):  # every GPU replays, or none does
                    raise NotResident("ComfyUI's dynamic VRAM moved or could not hold the model's weights on a GPU")
            if pieces is not None:
                return pieces.replay(tensors, ctx, topts)
            pieces = Pieces(self.device if self.device is not None else ctx.group.devices[ctx.rank], self.graph_type,
                            ctx.rank)
            pieces.modules = modules
            out = pieces.record(executor, args, kwargs, tensors, ctx, topts)
            pieces.weights, pieces.resident = _weights(modules), held
            self.run.pieces[k] = pieces
            if ctx.rank == 0:  # forwards recorded, counted once
                self.run.recorded += 1
                self.run.inherited = False
            return out
        finally:
            if held is not None:
                resident.unpin()

    def _say_moved(self, pieces, now: tuple) -> None:
        """How many of the model's weights are elsewhere than where its graphs read them (so it records again), said
        once per run: a hook that patches weights during a run, or ComfyUI loading them again between runs."""
        if "weights-moved" in self.run.said:
            return
        self.run.said.add("weights-moved")
        tensors = [t for m in pieces.modules for t in m._parameters.values() if t is not None] + \
                  [t for m in pieces.modules for t in m._buffers.values() if t is not None]
        moved = [t for t, a, b in zip(tensors, (*now[0], *now[1]), (*pieces.weights[0], *pieces.weights[1])) if a != b]
        size = sum(t.numel() * t.element_size() for t in moved)
        if now[2] != pieces.weights[2]:
            log.info("%s: some of the model's modules were replaced since its CUDA graphs were recorded: recorded again",
                     NODE)
        else:
            log.info("%s: %d of the model's %d weights (%s) are elsewhere than where its CUDA graphs read them: recorded "
                     "again", NODE, len(moved), len(tensors), _size(size))

    def _residency(self, module, modules: list):
        """``module``'s :class:`~..parallel.graphs.Residency` (None: no weights in dynamic VRAM), found once per
        run."""
        known = self.run.residency
        if id(module) not in known:
            r = Residency(modules)
            known[id(module)] = r if r.runs else None
        return known[id(module)]


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024


def _weights(modules: list) -> tuple:
    """Where the parameters and buffers of ``modules`` (a model's, listed once) are, and which modules they hold: a
    tensor put in the place of a weight moves it, a module put in the place of another changes the modules held.  A
    walk of the listed modules' own dicts, a tenth of the time of ``parameters()`` over the model each forward."""
    return (tuple(t.data_ptr() for m in modules for t in m._parameters.values() if t is not None),
            tuple(t.data_ptr() for m in modules for t in m._buffers.values() if t is not None),
            tuple(id(c) for m in modules for c in m._modules.values()))


GRAPHS_KEY = "patch_attention_context_parallel_graphs"


def _graphed(topts: dict, wrapper) -> dict:
    """``topts`` with ``wrapper`` as its innermost DIFFUSION_MODEL wrapper."""
    wrappers = dict(topts.get("wrappers", {}))
    wrappers["diffusion_model"] = {**wrappers.get("diffusion_model", {}), GRAPHS_KEY: [wrapper]}
    return {**topts, "wrappers": wrappers}


def _first_error(futures):
    for f in futures:
        e = f.exception()
        if e is not None and not isinstance(e, (GroupAborted, StopRank)):
            return e
    return None


class BlockPatch:
    """One block's patch in a split forward: the unit's handling, over the patch that was there (if any)."""

    def __init__(self, unit, key, previous):
        self.unit, self.key, self.previous = unit, key, previous

    def __call__(self, args, extra):
        ctx = args["transformer_options"].get(CP_KEY)
        if self.previous is not None:
            def inner(a):
                return self.previous(a, extra)
        else:
            inner = extra["original_block"]
        if ctx is None:
            return inner(args)
        out = self.unit.block(self.key, args, inner, ctx)
        return out


def _to(obj, device):
    """Tensors in ``obj`` (nested lists, tuples, dicts) on ``device``; anything else as it is."""
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in obj):
        return type(obj)(_to(v, device) for v in obj)
    return obj


# ---------------------------------------------------------------- the node

class ShortRunWrapper(_Wrapper):
    """OUTER_SAMPLE wrapper: a run told too short to split before it starts (:meth:`ContextParallel.whole_run`) samples
    on the first GPU as one GPU does: the other GPUs' copies are left out of the run (ComfyUI neither loads nor
    prepares them), and the node says why.  A run whose steps split over fewer GPUs than the node has
    (:meth:`ContextParallel.run_gpus`) leaves the copies it does not use out the same way.  After the run the copies
    are those ComfyUI matched for it (its loaded entries refer to them) and the ones left out."""

    def __call__(self, executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = getattr(guider, "model_patcher", None)
        noise = args[0] if args else kwargs.get("noise")
        copies = patcher.get_additional_models_with_key("multigpu") if patcher is not None else []
        packed = len(kwargs.get("latent_shapes") or ()) > 1  # several latents in one (LTX-2's audio and video)
        if not copies or packed or type(noise) is not torch.Tensor:
            return executor(*args, **kwargs)
        topts = (getattr(guider, "model_options", None) or {}).get("transformer_options", {})
        shape, conds, cfg = tuple(noise.shape), getattr(guider, "conds", None) or {}, getattr(guider, "cfg", 1.0)
        why = self.cp.whole_run(patcher, shape, conds, topts, cfg)
        if why:
            keep, level = [], logging.WARNING
            msg = f"a run of {self.cp.unit.name} sampled on one GPU, the other GPUs' copies left out: {why}"
        else:
            n = self.cp.run_gpus(patcher, shape, conds, cfg)
            if n is None or n > len(copies):
                return executor(*args, **kwargs)
            keep, level = copies[:n - 1], logging.INFO
            msg = (f"a run of {self.cp.unit.name} split over {n} of the {1 + len(copies)} GPUs, the other GPUs' copies "
                   "left out: on more, each GPU's share of a step would be too short to pay")
        log.log(level, "%s: %s", NODE, msg)
        show_on_node(self.cp.node, "\n".join((self.cp.note, msg[:1].upper() + msg[1:] + ".")))
        if keep:
            patcher.set_additional_models("multigpu", keep)
        else:
            patcher.remove_additional_models("multigpu")
        try:
            return executor(*args, **kwargs)
        finally:
            # ComfyUI replaces the copies it runs with clones of them at the run's start (match_multigpu_clones), and
            # its loaded entries refer to those: they stay, beside the ones left out
            ran = patcher.get_additional_models_with_key("multigpu") if keep else []
            patcher.set_additional_models("multigpu", ran + copies[len(keep):])


class OneGpuNotice(SharedWrapper):
    """OUTER_SAMPLE wrapper of a model the node could not split: says why once per sampling run."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, executor, *args, **kwargs):
        log.warning("%s: %s", NODE, self.why)
        return executor(*args, **kwargs)


# A forward splits over real GPUs only where its work per block (parallel/work.py: its matrix multiplies and its
# self-attention over the whole sequence, in TFLOP) reaches this floor, by the attention it runs. Every GPU's thread runs
# the whole model's Python under one interpreter lock, so a step's host work is done once per GPU: a forward with too
# little work per block becomes host-bound when split. Faster kernels (Patch Attention's, ComfyUI started with sage or
# flash attention) leave less GPU time to hide the host's in, and their calls cost more of it: they need more work.
# Measured on 2x H100 80GB (ComfyUI 0.33.0, random bf16 weights, the node's threads, every forward split; one GPU's s/step
# over the split's, TFLOP per block as Work.tflop_per_block gives it):
#
#   model, size                 tokens  TFLOP/block  ComfyUI's attention  sage_fp8_sm90
#   Flux.1 dev 1024²             4,608     1.3           x0.83               x0.50
#   Wan 2.1 1.3B 480p/33f       14,040     2.4           x1.40               x0.77
#   Wan 2.1 14B 480p/9f          4,680     3.25          x1.31               (one GPU)
#   Qwen-Image 1664²            11,072     4.0           x1.30               x0.89
#   Flux.1 dev 1536²             9,728     3.4           x1.59               x1.06
#   Wan 2.1 1.3B 480p/49f       20,280     4.2           x1.72               x0.82
#   Wan 2.1 1.3B 480p/65f       26,520     6.5           x1.82               x1.34
#   Wan 2.1 14B 480p/17f         7,800     5.9           x1.64               x1.22
#   Wan 2.1 1.3B 480p/81f       32,760     9.3           x1.86               x1.43-1.73
#   Wan 2.1 14B 480p/33f        14,040    12.4           x1.88               x1.85
#
# "comfyui": ComfyUI's own PyTorch attention, no attention override under the split's; "pack": anything else (only
# sage_fp8_sm90 was measured: every other kernel takes its floor, the higher and safer one). The host's work per block
# differs by family: Qwen-Image's split step at 1664² took 0.457 s for 0.297 s of GPU work a GPU, so at its own 1328²
# (2.2 TFLOP a block, one GPU 0.339 s a step) a split would run about x0.75: the floor for ComfyUI's attention is 3.0,
# above it, though Wan 2.1 1.3B at 33 frames (2.4) gained x1.40. tests/test_cp_floor.py checks every row against these.
#
# "graphs-...": a family whose split forwards replay as CUDA graphs (parallel/graphs.py; Unit.graphs), in a run whose
# weights stay where they are: the model's Python no longer runs per forward, only the attention calls and exchanges
# (about 1 ms of the host's time per call and GPU). Measured the same way on 2x H200, ComfyUI 0.33.0, four machines for
# Flux and two for Qwen-Image (the ratios moved with the machine's host):
#
#   model, size                 tokens  TFLOP/block  ComfyUI's attention  auto_exact    sage_fp8_sm90
#   Flux.1 dev 1024²             4,608     1.3        x1.02-1.36          x0.88-1.18    x0.52-0.82
#   Qwen-Image 1328²             7,145     2.2        x1.59-1.70          x1.39-1.64    x1.16-1.25
#   Wan 2.1 1.3B 480p/33f       14,040     2.4        x1.64-1.70          -             x0.87-1.17
#   Wan 2.1 14B 480p/17f         7,800     5.9        x1.76               -             x1.68
#
# and with the exchange as it is now (heads first, from its plan; 2026-11-28, Flux 1024² on two machines, the others on
# one):
#
#   model, size                 tokens  TFLOP/block  ComfyUI's attention  auto, auto_exact  sage_fp8_sm90
#   Flux.1 dev 768²              2,816     0.75       x0.95               x0.89, x0.98      x0.64
#   Flux.1 dev 1024²             4,608     1.3        x1.54-1.56          x1.39-1.57        x1.13
#   Wan 2.1 1.3B 480p/33f       14,040     2.4        x1.65               x0.85 (auto)      x0.96
#
# The floor is per attention call of a block (Unit.calls_per_block), each of which a replay still runs on the host:
# Wan's blocks make two, self-attention (exchanged) and cross-attention (not: counted as half a call), so Wan 2.1 1.3B
# at 33 frames has 1.6 TFLOP a call, between Flux at 1024² (1.3) and Qwen-Image at 1328² (2.2). Flux at 1024² pays
# step by step with Patch Attention's kernels too (x1.13-1.57), and a whole 20-step prompt through ComfyUI's server,
# with each run's graphs kept for the next (Kept), ran x1.07-1.50 (four 2x H200 machines, --disable-cuda-malloc
# --disable-dynamic-vram; never slower than one GPU):
# Flux's unit sets its own floor for them (parallel/families/flux.py), below Wan's 33 frames, which did not pay.
# Under ComfyUI's dynamic VRAM the same prompt ran x0.90 (each prompt loads the weights again and the first GPU records
# its graphs again): the unit's floor there keeps Flux 1024² on one GPU.
SPLIT_TFLOP = {"comfyui": 3.0, "pack": 5.5, "graphs-comfyui": 1.2, "graphs-pack": 2.0}
MOVED = " where ComfyUI offloads part of the weights"


def gpus_for(tflop: float | None, most: int) -> int:
    """Over how many of ``most`` GPUs a forward with ``tflop`` of work per block splits (None: all of them): two, and
    more only as far as each GPU's share keeps :data:`MORE_GPUS_TFLOP`.  Past two, every GPU's thread takes its turn at
    the host's one interpreter lock, and the host's share of a step grows faster than the GPUs' shrinks."""
    if tflop is None or most <= 2:
        return most
    return max(2, min(most, int(tflop / MORE_GPUS_TFLOP)))


def _over(counts, most: int) -> str:
    """How many GPUs a run's split forwards split over, for its log line: "4 GPUs", "2 of the 4 GPUs", or "the 4 GPUs
    (12 over 2, 8 over 4)" where forwards of other sizes split over other counts."""
    if len(counts) > 1:
        return f"the {most} GPUs (" + ", ".join(f"{c} over {n}" for n, c in sorted(counts.items())) + ")"
    n = next(iter(counts), most)
    return f"{n} GPUs" if n == most else f"{n} of the {most} GPUs"


# More than two GPUs pay where each GPU's share of a block's work is at least this (TFLOP); the floors above were
# measured on two.  Auto at CFG 1 on 4x H200 (NVLink between every pair), each against one GPU of that machine, the node
# splitting every step: Flux.1 dev 1024² (1.3 TFLOP a block) x1.48 over two, x0.50 over four (unpatched x1.45, x0.51);
# Flux 1536² (3.4) x1.66, x1.06; Qwen-Image 1328² (2.3) x1.56, x0.79; Wan 2.1 1.3B 480p/81f (9.3) x1.64, x1.10 over three,
# x0.66-0.76 over four.  On 4x H100: Wan 2.1 14B 480p/81f (41.6) x1.89 over two, x2.63 over three, x2.73-3.42 over four;
# 720p/81f (162) x1.93, x3.74-3.78.  Between 3.1 a GPU (Wan 1.3B over three: lost) and 10.4 (Wan 14B 480p over four:
# gained); nothing measured between them.
MORE_GPUS_TFLOP = 6.0


def graphs_floor(unit, kind: str, dynamic: bool = False) -> float:
    """The floor (TFLOP a call) of a run of ``unit``'s family replaying its split forwards as CUDA graphs, for the
    attention it runs (``kind``), its model's weights in ComfyUI's dynamic VRAM or not (``dynamic``): the family's own
    floors (``Unit.floors``) where it has them, else :data:`SPLIT_TFLOP`'s."""
    floors = {**SPLIT_TFLOP, **getattr(unit, "floors", {})}
    key = f"graphs-{kind}"
    return floors.get(key + "-dynamic", floors[key]) if dynamic else floors[key]


def _dynamic(patcher) -> bool:
    """Whether ``patcher``'s weights are in ComfyUI's dynamic VRAM (comfy-aimdo; ComfyUI 0.33's default where it runs)."""
    try:
        return bool(patcher.is_dynamic())
    except Exception:  # before ComfyUI 0.33, or a stand-in
        return False

# Split forwards of the families that offer it (Unit.graphs) replay as CUDA graphs (ContextParallel(graphs=) overrides),
# those with less work per block than this (TFLOP): above it a split keeps the GPUs busy without them. Wan 2.1 1.3B
# 480p on 2x H200, every forward split: 33 frames (2.4) x1.70 with graphs against x1.50 without (sage_fp8_sm90 x1.17
# against x0.70); 81 frames (9.3) x1.86 against x1.88 (x1.79 against x1.81).
GRAPHS = True
GRAPHS_BELOW_TFLOP = 8.0

# A token floor for every node instead (the split part's tokens; 0: every forward splits, as tests/gpu/soak.py sets it);
# None: the work floor above.
MIN_SPLIT_TOKENS: int | None = None


def context_parallel(model, gpus: int = 0, cfg_split: bool = True, simulate: int = 0, min_tokens: int | None = None):
    """:func:`split_model`'s clone alone."""
    return split_model(model, gpus, cfg_split, simulate, min_tokens)[0]


def split_model(model, gpus: int = 0, cfg_split: bool = True, simulate: int = 0, min_tokens: int | None = None):
    """A clone of ``model`` whose sampling runs split each forward's tokens over ``gpus`` GPUs (0: all); with
    ``cfg_split``, conds run on separate groups of GPUs.  ``simulate``: tests, that many ranks on the model's device.
    ``min_tokens``: forwards with fewer tokens to split run on one GPU and say so (0: every forward splits); None: on
    GPUs, forwards with less work per block than :data:`SPLIT_TFLOP` for the attention they run (or
    :data:`MIN_SPLIT_TOKENS` where it is set), none when simulated.  Where it cannot split (no CUDA GPU, one GPU, a
    model family without a unit, ComfyUI before 0.33, a model that cannot be copied) the clone says why when sampling
    starts.

    Returns the clone and what the node shows on the canvas: what it splits over how many GPUs, or why it cannot."""
    import comfy.patcher_extension as pe

    m = model.clone()
    unit = unit_for(model.model.diffusion_model)
    n, why = (simulate, "") if simulate else _gpus_here(gpus)
    why = why or (_no_unit(model) if unit is None else "") or ("" if simulate else _no_multigpu())
    if not why and not simulate:
        m, why = _with_copies(m, n)
    m.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    if why:
        log.warning("%s: %s", NODE, why)
        m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, OneGpuNotice(why))
        return m, why[:1].upper() + why[1:] + "."
    if min_tokens is None:
        min_tokens = 0 if simulate else MIN_SPLIT_TOKENS
    cp = ContextParallel(unit, cfg_split, simulate, min_tokens, node=executing_node())
    steps, otherwise = cp.steps(model.model.diffusion_model, _dynamic(model))
    cp.note = (f"{unit.name}: {steps} split over {cp.over(model.model.diffusion_model, n)}{otherwise}"
               + ("; above CFG 1, each prompt on half of them." if cfg_split else "."))
    install(m, cp)
    return m, cp.note


def _gpus_here(gpus: int) -> tuple[int, str]:
    """How many of ComfyUI's GPUs a split runs on (``gpus``; 0: all of them), and why it cannot ("": it can)."""
    import comfy.model_management as mm

    if hasattr(mm, "get_all_torch_devices"):
        devices = mm.get_all_torch_devices()
    else:  # before ComfyUI 0.33: its device, and the other CUDA GPUs beside it
        first = mm.get_torch_device()
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if first.type == "cuda" else [first]
    n = len(devices) if gpus <= 0 else min(gpus, len(devices))
    if n >= 2:
        return n, ""
    if len(devices) >= 2:
        return n, f"the gpus input is {gpus}, of the {len(devices)} GPUs here: nothing to split over (0: all of them)"
    if devices[0].type != "cuda":
        if torch.cuda.is_available():
            return n, f"ComfyUI runs on {devices[0].type} here, not on CUDA: Context Parallel needs two or more CUDA GPUs"
        return n, "no CUDA GPU here: Context Parallel needs two or more"
    return n, f"one GPU here ({torch.cuda.get_device_name(devices[0])}): Context Parallel needs two or more"


def _no_unit(model) -> str:
    """Why a model of a family without a unit samples on one GPU, naming the families that have one."""
    config = getattr(model.model, "model_config", None)
    family = type(config if config is not None else model.model).__name__
    units = "; ".join(name for name, _ in supported())
    return (f"{family} ({type(model.model.diffusion_model).__name__}) has no Context Parallel unit, so it samples on one "
            f"GPU. Models with one: {units}")


def _no_multigpu() -> str:
    """Why this ComfyUI cannot give the other GPUs a copy of the model ("": it can)."""
    try:
        import comfy.multigpu  # noqa: F401 - only whether it is there (_with_copies uses it)
    except ImportError:
        return "splitting a model over GPUs needs ComfyUI 0.33 or later (its MultiGPU model copies): one GPU"
    return ""


class CopyFailed(Exception):
    """The loaded model could not be copied for another GPU (the message says why)."""


def _with_copies(m, n: int):
    """``m`` (the node's clone) with ComfyUI's MultiGPU copies on ``n`` GPUs, and "" (or ``m`` and why it samples on one
    GPU).  ComfyUI builds the copies with the loader's reload function (``cached_patcher_init``); only its own loaders
    register one (ComfyUI-GGUF's does not): for such a model this clone alone gets one that copies the loaded model."""
    copied = []
    if m.cached_patcher_init is None:
        m.cached_patcher_init = (copy_of_loaded, (m.model, m.load_device, m.offload_device, copied))
    try:
        out = _deepclones(m, n)
    except CopyFailed as e:
        m.cached_patcher_init = None
        return m, f"{e}: one GPU"
    if copied:
        log.info("%s: the other GPUs' copies of %s are copies of the loaded model (its loader registers no reload "
                 "function)", NODE, type(m.model).__name__)
    return out, ""


def _deepclones(m, n: int):
    """``comfy.multigpu.create_multigpu_deepclones``, reusing the copies already loaded on the GPUs.  ComfyUI 0.33's
    reuse reads every loaded model's patcher, which is None for a model it reports as leaked ("memory leak with model
    ..."); then it raises AttributeError: the copies are made afresh instead."""
    import comfy.model_management as mm
    import comfy.multigpu

    leaked = any(p is None for p in mm.loaded_models())
    if leaked:
        log.info("%s: a leaked model is among ComfyUI's loaded models: the GPUs' copies are made afresh", NODE)
    return comfy.multigpu.create_multigpu_deepclones(m, n, reuse_loaded=not leaked)


def copy_of_loaded(base, load_device, offload_device, copied=None, disable_dynamic=False):
    """A reload function for a model whose loader registers none: a patcher of a deep copy of ``base`` (the BaseModel)
    as it is when ComfyUI calls it.  ComfyUI unloads the model first (``deepclone_multigpu``), which takes the weight
    patches (LoRA, ...) off it; ComfyUI puts them on the copy as on the model."""
    import copy

    import comfy.model_patcher

    try:
        import comfy.memory_management as memory
    except ImportError:  # before ComfyUI 0.33
        memory = None
    if getattr(memory, "aimdo_enabled", False):
        # measured: a copy of a GGUF model loaded under dynamic VRAM shares comfy-aimdo's buffers with the model, and
        # the process aborts with a double free when both are freed
        raise CopyFailed(f"ComfyUI's dynamic VRAM is on and {type(base).__name__}'s loader registers no reload "
                         "function: its weights cannot be copied for the other GPUs under dynamic VRAM")
    if getattr(base, "current_weight_patches_uuid", None) is not None:  # loaded where ComfyUI's unload did not reach
        raise CopyFailed(f"{type(base).__name__}'s weights are still patched on another device, so they cannot be "
                         "copied for the other GPUs (its loader registers no reload function)")
    try:  # the copy shares the model's config (ComfyUI's model configs cannot be deep-copied; nothing changes them)
        config = getattr(base, "model_config", None)
        model = copy.deepcopy(base, {id(config): config})
    except (TypeError, RuntimeError, NotImplementedError, MemoryError, copy.Error) as e:
        raise CopyFailed(f"its loader registers no reload function and {type(base).__name__} cannot be copied for the "
                         f"other GPUs ({type(e).__name__}: {e})") from e
    if copied is not None:
        copied.append(True)
    return comfy.model_patcher.ModelPatcher(model, load_device, offload_device)


def install(m, cp: ContextParallel) -> None:
    """The wrappers (APPLY_MODEL outermost) and the attention hook on the clone ``m``."""
    import comfy.patcher_extension as pe

    topts = m.model_options.setdefault("transformer_options", {})
    current = topts.get(OVERRIDE_KEY)
    if isinstance(current, ContextParallelAttention):
        current = current.inner
    topts[OVERRIDE_KEY] = ContextParallelAttention(current)
    m.remove_wrappers_with_key(pe.WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY)
    m.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY, RunWrapper(cp))
    m.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, ShortRunWrapper(cp))
    # the graphs kept from one run to the next go when ComfyUI unloads the model or a GPU's copy (their memory with them)
    m.remove_callbacks_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY)
    m.add_callback_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY, cp.release)
    keep_pins_on(m)  # the GPUs' copies' offloaded weights stay pinned from run to run (nodes/loaded.py)
    wrappers = topts.setdefault("wrappers", {})
    rest = {k: v for k, v in wrappers.get(pe.WrappersMP.APPLY_MODEL, {}).items() if k != WRAPPER_KEY}
    wrappers[pe.WrappersMP.APPLY_MODEL] = {WRAPPER_KEY: [SplitForwardWrapper(cp)], **rest}
