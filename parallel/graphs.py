"""One rank's split forward replayed as CUDA graphs, in pieces between its exchanges.

A short sequence split over GPUs leaves each GPU less work than the host needs to launch it: every GPU's thread runs the
model's Python under one interpreter lock (docs/multi-gpu.md, "Threads or a process per GPU").  A CUDA graph launches a
piece of a forward's kernels at once, with none of the model's Python.  What cannot be in a graph runs between the
pieces, eagerly, as it does now: the *islands* -- every attention call (the exchange between GPUs is a rendezvous of
threads, and some kernels, SageAttention's sm90 one among them, launch on the legacy stream, which a capture does not
record) and every other exchange of the forward (a gather of the tokens).  So a forward is

    piece 0, island 0, piece 1, island 1, ..., piece n

and :class:`Pieces` records it once (the forward runs its Python while each piece is captured; each piece is then
replayed at once, so the island after it sees real values, and the recording's output is the forward's) and replays it
from then on: each piece's graph, each island's function again on the same tensors (the graphs' memory keeps its
addresses), its output copied where the next piece reads it.  The attention kernels, ``auto``'s checks, the NaN flags
and the statistics run in the islands as before; the model's own Python runs once per run and shape.

What a replay takes from the forward it replaces: the inputs' tensors (copied into the recording's), this forward's
:class:`~.context.RankContext` and ``transformer_options`` for the islands (in place of the recording's: the run's
per-step values, sigma among them, are read there), and the values the model writes into ``transformer_options`` as it
goes (block index, ...), set again before each island.  What it cannot see: a per-step Python value the model reads in
a piece.  Where that matters the family's unit does not offer graphs (``Unit.graphs``).

No ComfyUI here; the node decides which forwards replay (nodes/context_parallel.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
import uuid
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# the RankContext fields a replay sets as the recording had them at each island (the others are the forward's own)
_SNAPSHOT = ("layout", "_layout", "others", "whole_queries", "masks", "split", "why", "by_shapes", "state")


class NotResident(Exception):
    """A forward's weights in ComfyUI's dynamic VRAM are not all on the GPU where its graphs recorded them (the message
    says why): it runs without graphs."""


class Residency:
    """The weights a forward reads from ComfyUI's dynamic VRAM (comfy-aimdo: each module's weights a range of a virtual
    address space, ``module._v`` = (its space, address, bytes), whose 32-MiB pages are mapped to GPU memory while in use
    and may be taken back between uses), as a few contiguous ranges.

    :meth:`pin` maps and holds every range and returns their signature, which tells whether each page is the one mapped
    before (ComfyUI's own graphs of a block check the same: comfy/model_prefetch.py); :meth:`unpin` lets them go.  A
    graph recorded under one signature may replay under the same: its weights are where it read them."""

    GAP = 512  # bytes: comfy-aimdo aligns each module's range to this

    def __init__(self, modules):
        spans = sorted(((v[0], v[1], v[1] + v[2]) for m in modules if (v := getattr(m, "_v", None)) is not None),
                       key=lambda x: (id(x[0]), x[1]))
        runs = []
        for space, a, b in spans:
            if runs and runs[-1][0] is space and a <= runs[-1][2] + self.GAP:
                runs[-1][2] = max(runs[-1][2], b)
            else:
                runs.append([space, a, b])
        self.runs = [(space, a, b - a) for space, a, b in runs]

    def pin(self):
        """Every range mapped and held: their signature (bytes per range), or None where one could not be mapped (no
        memory left for it; none is held then)."""
        out = []
        for i, (space, a, n) in enumerate(self.runs):
            try:
                sig = space.fault(a, n)
            except BaseException:  # comfy-aimdo's own error: those held so far let go
                self.unpin(i)
                raise
            if sig is None:
                self.unpin(i)
                return None
            out.append(bytes(sig))
        return tuple(out)

    def unpin(self, upto: int | None = None) -> None:
        """The ranges held by :meth:`pin` (the first ``upto``) let go."""
        for space, a, n in self.runs[:upto]:
            space.unpin(a, n)


class Unkeyable(Exception):
    """A forward's arguments hold something a replay could not take from the next forward (the message says what)."""


class _Mark:
    """Where the recorded forward's context or ``transformer_options`` stood in an island's arguments."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


CTX, TOPTS = _Mark("context"), _Mark("transformer_options")


def signature(args: tuple, kwargs: dict, topts: dict) -> tuple[tuple, list]:
    """(key, tensors) of a forward's arguments: the key tells two forwards a replay serves alike (shapes, dtypes,
    devices, strides, plain values); the tensors are what a replay copies in.  ``topts`` (the forward's
    ``transformer_options``) is taken from the forward itself.  :class:`Unkeyable` for anything else."""
    tensors = []
    return _keyed((tuple(args), dict(kwargs)), topts, tensors), tensors


def _keyed(v, topts: dict, tensors: list):
    """:func:`signature`'s key of ``v``, its tensors appended to ``tensors`` (a function of the module: a nested
    function calling itself would be a reference cycle holding ``topts``, and through its wrappers a run's graphs, until
    Python's cycle collector ran)."""
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return "T", tuple(v.shape), v.dtype, v.device, v.stride()
    if v is topts:
        return "TOPTS"
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return type(v).__name__, tuple(_keyed(x, topts, tensors) for x in v)
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return "dict", tuple((k, _keyed(x, topts, tensors)) for k, x in v.items())
    raise Unkeyable(f"a {type(v).__name__} among the diffusion model's arguments")


class Same:
    """An object in a key, equal to the same object only, while it lives: a weak reference where the object takes one,
    so that a key kept from one sampling run to the next neither keeps the object alive nor matches another one made
    later at its address."""

    __slots__ = ("_ref", "_hash")

    def __init__(self, obj):
        try:
            self._ref = weakref.ref(obj)
        except TypeError:  # no weak reference (a builtin's instance): held
            self._ref = lambda: obj
        self._hash = id(obj)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if not isinstance(other, Same) or other._hash != self._hash:
            return False
        obj = self._ref()
        return obj is not None and obj is other._ref()

    def __repr__(self):
        return f"<same {type(self._ref()).__name__}>"


def options_key(v):
    """What a forward's Python may depend on in ``v`` (its ``transformer_options``), as a key: plain values as they are,
    tensors by shape, dtype and device, containers walked, anything else (patches, wrappers, the attention override) by
    identity (:class:`Same`; a bound method by its object and function).  Two sampling runs whose forwards have equal
    keys run the same Python, where the objects behave alike from run to run.  The ids ComfyUI gives each run's conds
    (``uuids``) count by number only."""
    if isinstance(v, torch.Tensor):
        return "T", tuple(v.shape), v.dtype, v.device
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return v
    if isinstance(v, uuid.UUID):
        return "UUID"
    if isinstance(v, (list, tuple)):
        return type(v).__name__, tuple(options_key(x) for x in v)
    if isinstance(v, dict):
        return "dict", tuple((options_key(k), options_key(x)) for k, x in v.items())
    if isinstance(v, types.MethodType):
        return "method", Same(v.__self__), Same(v.__func__)
    return Same(v)


DEEPER = object()  # what a :func:`walk` function returns for a value it leaves to the walk


def walk(v, fn):
    """``v`` with every value ``x`` in it (``v`` itself, and what its lists, tuples and dicts hold, nested) replaced by
    ``fn(x)``; where ``fn`` returns :data:`DEEPER`, a container's values are walked in turn and anything else is kept."""
    out = fn(v)
    if out is not DEEPER:
        return out
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(walk(x, fn) for x in v)
    if isinstance(v, dict):
        return {k: walk(x, fn) for k, x in v.items()}
    return v


def rebuild(args: tuple, kwargs: dict, topts: dict, tensors: list) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their tensors, in :func:`signature`'s order, replaced by ``tensors``."""
    it = iter(tensors)

    def fn(v):
        if isinstance(v, torch.Tensor):
            return next(it)
        return v if v is topts else DEEPER

    return walk(tuple(args), fn), walk(dict(kwargs), fn)


def _mark(v, ctx, topts):
    """``v`` with the recorded forward's ``ctx`` and ``topts`` marked; a copy of ``topts`` the model made on the way (a
    dict that holds ``ctx``) counts as ``topts``."""

    def fn(x):
        if x is ctx:
            return CTX
        if x is topts or (isinstance(x, dict) and any(y is ctx for y in x.values())):
            return TOPTS
        return DEEPER

    return walk(v, fn)


def _binder(v):
    """``fn(ctx, topts)``: the marked ``v`` (:func:`_mark`) with ``ctx`` and ``topts`` in place of the marks, by a
    function built once (a replay calls it at every island): dicts, lists and containers with a mark inside are made
    again at each call, in their order (the island may change them); the rest is ``v``'s own.  None where ``v`` is
    neither (it is handed on as it is)."""
    if v is CTX:
        return lambda ctx, topts: ctx
    if v is TOPTS:
        return lambda ctx, topts: topts
    if isinstance(v, dict):
        items = [(k, _binder(x), x) for k, x in v.items()]
        return lambda ctx, topts: {k: x if b is None else b(ctx, topts) for k, b, x in items}
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        parts = [(_binder(x), x) for x in v]
        if isinstance(v, list) or any(b is not None for b, _ in parts):
            kind = type(v)
            return lambda ctx, topts: kind(x if b is None else b(ctx, topts) for b, x in parts)
    return None


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it (as PyTorch's CUDA graph trees hold a graph's tensors)."""
    st = t.untyped_storage()
    memory = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(memory, t.storage_offset(), t.size(), t.stride())


def _copy_into(dst, src) -> None:
    """``src``'s values into ``dst`` (the recorded island's output: tensors in nested tuples and lists)."""
    if isinstance(dst, torch.Tensor):
        if src is not dst:
            dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _clone(v):
    return walk(v, lambda x: x.clone() if isinstance(x, torch.Tensor) else DEEPER)


_STREAMS = {}  # (device, rank) -> the stream a rank records its graphs on there (capture_stream)
_STREAMS_LOCK = threading.Lock()


def capture_stream(device: torch.device, rank: int) -> torch.cuda.Stream:
    """The stream rank ``rank`` records its graphs on ``device`` with, one for the process (as ``torch.cuda.graph``
    keeps one capture stream for the process): cuBLAS keeps a workspace for every stream its matrix multiplies ran on
    (32 MiB on Hopper) until the process ends, so a stream of its own for each recording held 33 MiB more on every GPU
    with every run that recorded (a soak of 216 prompts through ComfyUI's server: +857 MiB a GPU, 2x H200).  A rank
    records one forward at a time, and ranks on one device (simulated) each have their own."""
    key = (device, rank)
    with _STREAMS_LOCK:
        stream = _STREAMS.get(key)
        if stream is None:
            stream = _STREAMS[key] = torch.cuda.Stream(device)
    return stream


class Pieces:
    """One rank's forward of one key (:func:`signature`) as graphs between islands.  ``graph_type``: the class of a
    graph (``torch.cuda.CUDAGraph``; tests give a stand-in that records and replays on the CPU)."""

    def __init__(self, device, graph_type=None, rank: int = 0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.graph_type = graph_type or torch.cuda.CUDAGraph
        self.graphs = []
        self.islands = []  # (fn, its arguments' binder (:func:`_binder`), context fields, topts writes, recorded output)
        self.static = []  # the recorded forward's input tensors, which every replay fills
        self.out = None
        self.final = None  # (context fields, topts writes) at the forward's end
        self.inside = False  # an island of the recording is running (the calls it makes are not islands of their own)
        self._graph = None
        self._stream = capture_stream(self.device, rank) if self.cuda else None
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._outer = None
        self._ctx = self._topts = self._start = None
        self._staging = {}  # (shape, dtype) -> where a replayed island's output waits for the next piece
        self._weak = []  # (the storage's weak reference, its alias) of every island argument held by alias

    # ------------------------------------------------------------------ recording

    def record(self, fn, args: tuple, kwargs: dict, tensors: list, ctx, topts: dict):
        """Run ``fn(*args, **kwargs)`` (the diffusion model's forward: ``tensors`` its input tensors, ``ctx`` and
        ``topts`` this rank's context and ``transformer_options``) while recording it; its output (a copy)."""
        self.static = [t.clone() for t in tensors]
        args, kwargs = rebuild(args, kwargs, topts, self.static)
        self._ctx, self._topts, self._start = ctx, topts, dict(topts)
        ctx.graph = self
        self._begin()
        try:
            # a tensor the model makes without naming a device (Wan's timestep frequencies, moved to the GPU next) is
            # made on the GPU, which a capture needs (this thread only, while it records)
            with torch.device(self.device) if self.cuda else contextlib.nullcontext():
                out = fn(*args, **kwargs)
            self._end()
        except BaseException:
            self._abort()
            raise
        finally:
            ctx.graph = None
        self.final = (self._fields(ctx), self._writes())
        self.out = out
        # the forward's options let go: they hold the model's wrappers, and through them what keeps these graphs
        self._ctx = self._topts = self._start = None
        self._check_aliases()
        return _clone(out)

    def island(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` run eagerly between two pieces of the recording (and again at every replay, with the
        replayed forward's context and ``transformer_options`` where the recording's stood in its arguments)."""
        ctx, topts = self._ctx, self._topts
        self._end()
        fields, writes = self._fields(ctx), self._writes()
        self.inside = True
        try:
            out = fn(*args, **kwargs)
        finally:
            self.inside = False
        ctx.group.settle(ctx.rank)
        args, kwargs = _mark(args, ctx, topts), _mark(kwargs, ctx, topts)
        stage = None
        if self.cuda:
            # the island's inputs are held by alias: their memory, the graphs', serves the later pieces too (a piece
            # writes them again only after the island read them, in stream order); its output waits in a buffer
            # shared by the islands of its shape, which the next piece copies first
            args, kwargs = self._held(args), self._held(kwargs)
            if isinstance(out, torch.Tensor) and out.is_contiguous():
                stage = self._staging.get((out.shape, out.dtype))
                if stage is None:
                    stage = self._staging[(out.shape, out.dtype)] = torch.empty_like(out)
                stage.copy_(out)
        # (args, kwargs): kwargs a dict, made again at each replay, so there is always a binder
        self.islands.append((fn, _binder((args, kwargs)), fields, writes, out if stage is None else stage))
        self._begin()
        return out if stage is None else stage.clone()

    def _held(self, v):
        """``v`` with its CUDA tensors replaced by aliases (:func:`_alias`)."""

        def fn(x):
            if not (isinstance(x, torch.Tensor) and x.is_cuda):
                return DEEPER
            a = _alias(x)
            self._weak.append((StorageWeakRef(x.untyped_storage()), a))
            return a

        return walk(v, fn)

    def _check_aliases(self) -> None:
        """Every island argument held by alias whose tensor is gone lies in the graphs' own memory, which lives as long
        as the graphs (the others are kept by their owners: the model's weights, the recording's inputs).  A clear
        error otherwise (the node then runs the forward without graphs)."""
        gone = [a for ref, a in self._weak if ref.expired()]
        self._weak = []
        if not gone:
            return
        pool = tuple(self._pool)
        spans = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
                 if tuple(s.get("segment_pool_id", ())) == pool]
        for a in gone:
            p = a.untyped_storage().data_ptr()
            if not any(lo <= p < hi for lo, hi in spans):
                raise RuntimeError("an attention call's input lies outside the CUDA graphs' memory, so a replay could "
                                   "not read it")

    def _writes(self) -> dict:
        """What the forward wrote into its ``transformer_options`` so far (the block index, ...)."""
        start = self._start
        return {k: v for k, v in self._topts.items() if k not in start or start[k] is not v}

    @staticmethod
    def _fields(ctx) -> dict:
        return {k: getattr(ctx, k) for k in _SNAPSHOT}

    def _begin(self) -> None:
        g = self.graph_type()
        if self.cuda:
            self._outer = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(self._outer)
            torch.cuda.set_stream(self._stream)
            try:
                g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            except BaseException:
                torch.cuda.set_stream(self._outer)
                raise
        else:
            g.capture_begin()
        self._graph = g

    def _end(self) -> None:
        g, self._graph = self._graph, None
        try:
            g.capture_end()
        finally:
            if self.cuda:
                torch.cuda.set_stream(self._outer)
                self._outer.wait_stream(self._stream)
        self.graphs.append(g)
        g.replay()  # the piece's values, for the island after it

    def _abort(self) -> None:
        """A recording that failed: its capture ended (its error, if any, left to the one that stopped it)."""
        if self._graph is not None:
            try:
                self._end()
            except Exception:  # the capture was invalidated by what failed in it
                pass
        self.graphs, self.islands = [], []

    # ------------------------------------------------------------------ replaying

    def replay(self, tensors: list, ctx, topts: dict):
        """The recorded forward on ``tensors`` (its inputs, in :func:`signature`'s order) for the forward whose
        context and ``transformer_options`` are ``ctx`` and ``topts``; its output (a copy)."""
        for s, t in zip(self.static, tensors):
            s.copy_(t)
        for g, (fn, bind, fields, writes, out) in zip(self.graphs, self.islands):
            g.replay()
            for k, v in fields.items():
                setattr(ctx, k, v)
            topts.update(writes)
            args, kwargs = bind(ctx, topts)
            _copy_into(out, fn(*args, **kwargs))
            ctx.group.settle(ctx.rank)
        self.graphs[-1].replay()
        fields, writes = self.final
        for k, v in fields.items():
            setattr(ctx, k, v)
        topts.update(writes)
        return _clone(self.out)
