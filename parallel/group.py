"""The ranks of one model forward split over several devices, one thread each, in one process.

A :class:`Group` is made per forward. Its ranks meet at each exchange (a ``threading.Barrier``); a rank posts the tensors
it offers, and after the barrier every rank *pulls* what it needs from the others with device-to-device copies:
PyTorch's (``Tensor.copy_`` across devices: a peer copy over NVLink or PCIe where the GPUs allow it, through host memory
otherwise), and for a strided share (some heads of every token) the CUDA runtime's 2-D copy, one block of rows a fixed
pitch apart, by the copy engine (:func:`pitched_plan`).  There is no collective written by hand: an exchange is a
barrier (the ranks' tensors are all posted) and plain copies.  Under ``torch.compile`` the rendezvous is never traced.

Streams: a rank posts its tensors with an event recorded on its compute stream. A peer's copies out of them run on the
posting rank's *send stream* (one per rank and forward, from PyTorch's stream pool), after that event; PyTorch makes the
pulling rank's compute stream wait for them. So no rank's work lands on another rank's compute stream: a rank's own
kernels (and ``auto``'s timing of them) never wait behind copies a peer enqueued, and the copies out of a rank run
beside its compute. The posted tensors are recorded on the send stream (``record_stream``): their memory is not reused
before the copies out of them are done. No rank waits for another rank's GPU work on the host: the barrier only waits
until every rank has *enqueued* its part.

Posted tensors stay referenced until the round after next (two slots, alternating).  An error in one rank aborts the
barrier, so the others stop with :class:`GroupAborted` instead of waiting for ever; the forward then reports the first
rank's error.

Why threads and not processes: ComfyUI already keeps a copy of the model per device in its own process (its MultiGPU
deep clones, run by one worker thread per device); a process per GPU would load every model once more and need a
rendezvous outside ComfyUI (docs/multi-gpu.md).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .work import Work


class GroupAborted(RuntimeError):
    """Another rank of the forward failed; its error is the one reported."""


class Group:
    """``len(devices)`` ranks of one forward (a device may repeat: ranks simulated on the CPU in tests).  ``pipeline``:
    in how many parts an exchanged attention call sends its heads (None: ulysses.PIPELINE_PARTS)."""

    def __init__(self, devices, timeout: float | None = 600.0, pipeline: int | None = None, min_tokens: int = 0,
                 pitched: bool | None = None, align: int | None = None, staged: bool | None = None,
                 words: bool | None = None, work: Work | None = None, min_tflop: float = 0.0, attention: str = "",
                 copy_2d=None):
        self.devices = [torch.device(d) for d in devices]
        # strided shares cross between GPUs as 2-D copies (False: made contiguous first; None: PITCHED)
        self.pitched = PITCHED if pitched is None else pitched
        # ``copy_2d(dst, dpitch, src, spitch, width, height, stream) -> error``: an exchange whose every copy is a 2-D
        # copy runs from its plan (:func:`planned`) by it; None: copy by copy.  On CUDA GPUs: the runtime's
        # cudaMemcpy2DAsync, where PITCHED and PLANNED; tests give a function over CPU memory
        cuda = all(d.type == "cuda" for d in self.devices)
        if copy_2d is None and self.pitched and PLANNED and cuda:
            copy_2d = _memcpy_2d()
        self.copy_2d = copy_2d
        self._events: dict = {}  # (rank, what, device) -> an event of this rank's, recorded again each time
        # each rank's share of a split sequence a multiple of this many tokens (but the last's; None: ALIGN)
        self.align = ALIGN if align is None else align
        # a model's unit may send q, k and v one by one as it makes them (None: STAGED)
        self.staged = STAGED if staged is None else staged
        # a rank's own strided share copied as 8-byte words where its rows allow (None: WORDS)
        self.words = WORDS if words is None else words
        self.min_tokens = min_tokens  # a forward with fewer tokens to split runs on the first rank alone
        # a forward whose work per block (the model's ``work``, over its whole sequence) is below ``min_tflop`` runs on
        # the first rank alone; ``attention``: the attention it runs, for the message saying so
        self.work, self.min_tflop, self.attention = work, min_tflop, attention
        self.pipeline = pipeline  # parts of the heads per exchanged attention call (None: ulysses.PIPELINE_PARTS)
        self.size = len(self.devices)
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = ([None] * self.size, [None] * self.size)
        self._round = [0] * self.size
        self._send: list = [None] * self.size  # per rank: the stream peers' copies out of its tensors run on
        self._recv: list = [None] * self.size  # per rank: the stream its pipelined attention receives on
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ the rendezvous

    def _post(self, rank: int, item) -> list:
        """Post ``item`` for this rank and wait until every rank posted its own; the posted items by rank."""
        slot = self._slots[self._round[rank] & 1]
        self._round[rank] += 1
        slot[rank] = item
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise GroupAborted(f"rank {rank}: another rank of this forward failed ({self.error!r})") from None
        return slot

    def abort(self, error: BaseException) -> None:
        """Stop every rank waiting (or about to wait) at an exchange of this forward."""
        if self.error is None:
            self.error = error
        self._barrier.abort()

    # ------------------------------------------------------------------ exchanges

    @torch.compiler.disable  # a rendezvous of threads and copies between devices: run as it is, never traced
    def gather_objects(self, rank: int, obj) -> list:
        """Every rank's ``obj`` (plain Python values: flags, layer lists), in rank order."""
        return list(self._post(rank, obj))

    def post(self, rank: int, tensors: tuple, like=None) -> list:
        """Post ``tensors`` (this rank's, on its device) and wait until every rank posted its own: every rank's posting,
        by rank, for :meth:`puller`.  ``like(peer, i)``: the shape of ``peer``'s ``tensors[i]``
        (here every rank sees the others' tensors themselves; ranks in processes of their own receive copies of them
        and need it: :class:`~.dist.ProcessGroupRanks`)."""
        device = self.devices[rank]
        if device.type != "cuda":
            return list(self._post(rank, (tuple(tensors), None, None)))
        send = self._stream(self._send, rank)
        # two events by round, as the slots: a peer waits for one before it meets this rank at the next round's post
        ready = self.mark(rank, ("ready", self._round[rank] & 1), torch.cuda.current_stream(device))
        for t in tensors:
            if t.device == device:
                t.record_stream(send)
        return list(self._post(rank, (tuple(tensors), ready, send)))

    def puller(self, rank: int, peer: int, posted: list, stream=None):
        """``copy(dst, src)``: a copy of ``peer``'s posted tensor ``src`` (or a view of it) into ``dst`` on this rank's
        device, ordered before this rank's work on ``stream`` (default: its current stream) from here on."""
        _, ready, send = posted[peer]
        if peer == rank or send is None:
            return _copy_words if self.words else _copy
        stream = stream or torch.cuda.current_stream(self.devices[rank])
        return _puller(send, ready, stream, self.devices[peer] == self.devices[rank], self.pitched)

    def run_plan(self, rank: int, posted: list, plan: tuple, dsts: list, stream, own) -> None:
        """The copies of ``plan`` (:func:`planned`) from every rank's ``posted`` tensors into ``dsts``: a peer's on its
        send stream, after its posting and after ``stream`` (where ``dsts`` were made ready), with ``stream`` waiting
        for them; this rank's own on ``own`` (its compute stream, as its kernels).  Off CUDA: in order."""
        fn = self.copy_2d
        dptr = [d.data_ptr() for d in dsts]
        for peer, entries in enumerate(plan):
            if not entries:
                continue
            tensors, ready, send = posted[peer]
            sptr = [t.data_ptr() for t in tensors]
            copies = [(dptr[i] + do, dp, sptr[i] + so, sp, w, h) for i, do, dp, so, sp, w, h in entries]
            if send is None:  # CPU ranks (tests)
                _run_2d(fn, copies, None)
                continue
            on = own if peer == rank else send
            if peer != rank:
                _peer_access(self.devices[peer], self.devices[rank], send)
                send.wait_event(ready)
                self.after(rank, send, stream)
            with torch.cuda.device(on.device):
                _run_2d(fn, copies, on.cuda_stream)
            if peer != rank:
                self.after(rank, stream, send)

    def mark(self, rank: int, what, stream):
        """This rank's event ``what`` recorded on ``stream``: one event per rank, name and device, recorded again each
        time (PyTorch's ``record_event`` makes a new one each time)."""
        key = (rank, what, stream.device)
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event()
        ev.record(stream)
        return ev

    def after(self, rank: int, waiter, stream) -> None:
        """``waiter`` (a CUDA stream) waits for ``stream``'s work so far (``waiter.wait_stream(stream)`` with an event of
        this rank's, reused: recorded and waited for at once, by this rank's thread alone)."""
        waiter.wait_event(self.mark(rank, "after", stream))

    def settle(self, rank: int) -> None:
        """This rank's later work waits for the copies the other ranks have enqueued out of its tensors so far (on its
        send stream).  Eagerly the memory allocator keeps a posted tensor until they are done; a tensor of a CUDA graph
        has its place in the graph's memory, which a later piece of the graph writes again (:mod:`.graphs`)."""
        send = self._send[rank]
        if send is not None:
            self.after(rank, torch.cuda.current_stream(self.devices[rank]), send)

    def settle_all(self) -> None:
        """:meth:`settle` for every rank, once every rank's forward has returned (from any thread: each device's
        current stream here is its default stream, which the ranks' threads run on)."""
        for rank in range(self.size):
            self.settle(rank)

    def receiving(self, rank: int):
        """This rank's receive stream (None off CUDA): copies into buffers its later kernels wait for, one by one."""
        return self._stream(self._recv, rank) if self.devices[rank].type == "cuda" else None

    def _stream(self, streams: list, rank: int):
        """``streams[rank]``, made on first use (from PyTorch's pool of streams on the rank's device)."""
        if streams[rank] is None:
            streams[rank] = torch.cuda.Stream(self.devices[rank])
        return streams[rank]

    @torch.compiler.disable  # a rendezvous of threads and copies between devices: run as it is, never traced
    def exchange(self, rank: int, tensors: tuple, fill, like=None) -> None:
        """Post ``tensors`` (this rank's, on its device) and, once all ranks have, call ``fill(peer, peer_tensors,
        copy)`` for every rank ``peer`` (this one included): ``copy(dst, src)`` copies a peer's tensor (or a view of it)
        into ``dst`` on this rank's device; this rank's current stream waits for it.  ``like``: as for :meth:`post`."""
        posted = self.post(rank, tensors, like)
        for peer in range(self.size):
            copy = self.puller(rank, peer, posted)
            fill(peer, posted[peer][0], copy)
            finish(copy)


def _copy(dst, src):
    dst.copy_(src)


def _copy_words(dst, src):
    """``dst.copy_(src)`` on one device, a strided copy of small elements as 8-byte words where both tensors allow it
    (:func:`_words`): a rank's own share of the heads (each token's row of them contiguous, the rows a pitch apart) is
    strided, and PyTorch copies a strided tensor element by element; as words, a bf16 share moves in a quarter of the
    elements.  The same bytes land either way."""
    if dst.dtype == src.dtype and dst.shape == src.shape \
            and _words(dst.shape, dst.stride(), dst.storage_offset(), dst.element_size()) \
            and _words(src.shape, src.stride(), src.storage_offset(), src.element_size()):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


@functools.lru_cache(maxsize=256)
def _words(shape: tuple, stride: tuple, offset: int, es: int) -> bool:
    """Whether a strided tensor of that shape, strides, storage offset and element size can be viewed as 8-byte words
    along its last dimension (its last dimension contiguous; every row, every other stride, a dimension of one's too, and
    the offset whole words) and its elements are smaller than a word.  Made once per layout (every layer of a forward
    copies the same)."""
    if not shape or stride[-1] != 1 or es >= 8 or (shape[-1] * es) % 8 or (offset * es) % 8:
        return False
    return not any((st * es) % 8 for st in stride[:-1])  # every stride, as Tensor.view(dtype) asks


def _puller(send, ready, stream, same_device: bool, pitched: bool = True):
    """``copy(dst, src)`` of a peer's tensor on the peer's send stream, after the peer's ``ready`` event, with
    ``stream`` (this rank's) waiting for it.

    Between devices only whole rows of memory travel: a share of the heads (each token's row of those heads is one
    block, a fixed pitch apart) goes as a 2-D copy of the copy engine (``cudaMemcpy2DAsync``: no kernel, no extra
    buffer on either side); where that is not available, a strided source is first made contiguous on its own device
    and a strided destination filled from a contiguous copy on this one.  A strided copy by a kernel across devices
    would read or write the other GPU's memory in pieces of one head's row.  Across devices PyTorch orders the copy
    between the two current streams (``send`` and ``stream`` here), and the 2-D copy is ordered the same way; on one
    device (ranks simulated on one GPU) that is done here.

    The 2-D copies of one puller are ordered as one: ``send`` waits for ``stream`` before the first, and ``stream``
    waits for ``send`` once the caller has made them all (``copy.done()``, :func:`finish`): every copy into a buffer
    before anything on ``stream`` reads it, with two waits instead of two per copy (the host's work per exchanged
    call, what short sequences are bound by)."""
    state = [False, False, False]  # waited for ``ready``; ``send`` after ``stream``; ``stream`` still to wait

    def copy(dst, src):
        if not state[0]:
            send.wait_event(ready)
            state[0] = True
        if not same_device:  # the 2-D copy names its stream: no current stream to set
            memcpy_2d = _memcpy_2d() if pitched and not (src.is_contiguous() and dst.is_contiguous()) else None
            plan = pitched_plan(dst, src) if memcpy_2d is not None else None
            if plan is not None:
                if not state[1]:
                    send.wait_stream(stream)  # as PyTorch orders a copy between devices
                    state[1] = True
                _copy_2d(memcpy_2d, dst, src, plan, send)
                state[2] = True
                return
        with torch.cuda.stream(stream), torch.cuda.stream(send):
            if same_device:
                send.wait_stream(stream)
                dst.copy_(src)
                stream.wait_stream(send)
                return
            if not src.is_contiguous():
                src = src.contiguous()
            if dst.is_contiguous():
                dst.copy_(src, non_blocking=True)
                return
            tmp = src.to(dst.device, non_blocking=True)
            dst.copy_(tmp)  # on ``stream``: this device's current stream here

    def done():
        if state[2]:
            stream.wait_stream(send)
            state[2] = False

    copy.done = done
    return copy


def finish(copy) -> None:
    """The copies a puller made are ordered before its stream's later work (``copy.done()`` where it has one)."""
    done = getattr(copy, "done", None)
    if done is not None:
        done()


# Each rank's share of a split sequence a multiple of this many tokens (the last rank's: the rest). 1: an even split.
# Measured on 2x H200 (Wan 2.1 14B block's matrix multiplies, cuBLAS picks its kernel by the row count): even shares
# cost 3.3 % (480p: 16,380 rows) and 0.1 % (720p) more per token than the whole sequence; shares a multiple of 8 to 512
# tokens 3-9 % more. Kept as a setting to measure other GPUs and libraries with (tests/gpu/cp_exchange.py).
ALIGN = 1

# A family unit that can send an exchanged call's q, k and v one by one, as the model makes them, does (Wan's
# self-attention; Group(staged=False) overrides: all three at the attention call).
STAGED = True

# A rank's own strided share of a tensor (within its device) is copied as 8-byte words where its rows allow
# (Group(words=False) overrides: element by element, PyTorch's copy of a strided tensor).
WORDS = True

# Strided shares of a tensor cross between GPUs as 2-D copies (Group(pitched=False) overrides: made contiguous first).
PITCHED = True

# An exchange whose every copy is a 2-D copy runs from a plan made once per geometry (Exchange._plan), each copy a
# call of the CUDA runtime; False: copy by copy (views, PyTorch's copies, the exchange before).
PLANNED = True

# At most this many 2-D copies for one tensor (a batch of several, each its own block of rows); more: the other path.
MAX_BLOCKS = 8


def pitched_plan(dst, src):
    """``dst.copy_(src)`` as 2-D copies: ``((dst_offset, dst_pitch, src_offset, src_pitch, width, height), ...)`` in
    bytes (offsets from each tensor's ``data_ptr()``): ``height`` rows of ``width`` contiguous bytes, each tensor's rows
    its own pitch apart.  None where the copy is not of that form (other dtypes or shapes, a last dimension with a
    stride, overlapping or broadcast rows, more than :data:`MAX_BLOCKS` blocks).  Made once per shape and strides (every
    layer of a forward copies the same)."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.numel() == 0:
        return None
    return _plan(tuple(dst.shape), dst.stride(), src.stride(), dst.element_size())


@functools.lru_cache(maxsize=256)
def _plan(shape: tuple, dst_strides: tuple, src_strides: tuple, es: int):
    dims = [(n, ds, ss) for n, ds, ss in zip(shape, dst_strides, src_strides) if n != 1]
    width = 1  # elements: the innermost run contiguous in both
    while dims and dims[-1][1] == width and dims[-1][2] == width:
        width *= dims.pop()[0]
    if width == 1 and dims:
        return None
    if not dims:
        return ((0, width * es, 0, width * es, width * es, 1),)
    out = []

    def rows_of(dims):  # the dimensions as one run of rows: (rows, dst pitch, src pitch), or None
        rows, dp, sp = dims[-1]
        for n, ds, ss in reversed(dims[:-1]):
            if ds != dp * rows or ss != sp * rows:
                return None
            rows *= n
        return rows, dp, sp

    def walk(dims, doff, soff):
        run = rows_of(dims)
        if run is None:
            n, ds, ss = dims[0]
            for i in range(n):
                if not walk(dims[1:], doff + i * ds, soff + i * ss):
                    return False
            return True
        rows, dp, sp = run
        if min(dp, sp) < width or len(out) >= MAX_BLOCKS:
            return False
        out.append((doff * es, dp * es, soff * es, sp * es, width * es, rows))
        return True

    return tuple(out) if walk(dims, 0, 0) else None


_MEMCPY_2D = []


def _memcpy_2d():
    """``cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream) -> error``: from NVIDIA's
    cuda-bindings where installed (PyTorch 2.10+ brings it), else from the CUDA runtime PyTorch loaded; None: neither."""
    if not _MEMCPY_2D:
        fn = None
        try:
            from cuda.bindings import runtime

            def fn(dst, dp, src, sp, w, h, stream, _f=runtime.cudaMemcpy2DAsync,
                   _kind=runtime.cudaMemcpyKind.cudaMemcpyDefault):
                return int(_f(dst, dp, src, sp, w, h, _kind, stream)[0])
        except Exception:  # not installed, or a version without it
            try:
                import ctypes

                lib = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
                f = lib.cudaMemcpy2DAsync
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                              ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

                def fn(dst, dp, src, sp, w, h, stream, _f=f):
                    return int(_f(dst, dp, src, sp, w, h, 4, stream))  # 4: cudaMemcpyDefault
            except Exception:
                fn = None
        _MEMCPY_2D.append(fn)
    return _MEMCPY_2D[0]


_PEERS = set()  # (source device, destination device) pairs PyTorch has copied between


def _peer_access(src, dst, stream) -> None:
    """The first time between two devices, one element goes through PyTorch's own copy (on ``stream``, a send stream,
    not a rank's compute stream): PyTorch then enables the source device's access to the destination's memory (peer
    access), which the 2-D copy uses."""
    pair = (src, dst)
    if pair not in _PEERS and src != dst:
        with torch.cuda.stream(stream):
            torch.empty(1, device=dst).copy_(torch.zeros(1, device=src))
        _PEERS.add(pair)


def _run_2d(fn, copies, stream, what: str = "") -> None:
    """``fn(dst, dpitch, src, spitch, width, height, stream)`` for each of ``copies``; a clear error where one fails
    (``what``: the copy it was part of)."""
    for c in copies:
        err = fn(*c, stream)
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed (CUDA error {err}) copying "
                               f"{what or f'{c[5]} rows of {c[4]} bytes'}")


def planned(copies: list, dsts: list, sources: list):
    """An exchange's copies as 2-D copies: ``copies[peer]``, (index ``i``, destination view, source view) of every copy
    from that rank's tensor ``sources[peer][i]`` into ``dsts[i]``, become by rank a tuple of (index, destination byte
    offset, pitch, source byte offset, pitch, width, height), each offset from its tensor's first element
    (:func:`pitched_plan`); None where a copy is not a 2-D copy."""
    plan = []
    for peer, rank_copies in enumerate(copies):
        entries = []
        for i, dst, src in rank_copies:
            if dst.numel() == 0 and dst.shape == src.shape:  # nothing to copy (a rank with no heads)
                continue
            p = pitched_plan(dst, src)
            if p is None:
                return None
            db, sb = dst.data_ptr() - dsts[i].data_ptr(), src.data_ptr() - sources[peer][i].data_ptr()
            entries += [(i, db + do, dp, sb + so, sp, w, h) for do, dp, so, sp, w, h in p]
        plan.append(_joined(entries))
    return tuple(plan)


def _joined(entries: list) -> tuple:
    """``entries`` of :func:`planned` with copies that continue one another (the next rows of the same tensors, the
    same pitches: a GPU's own text tokens and its share after them) made one."""
    out = []
    for e in entries:
        for k, f in enumerate(out):
            joined = _join(f, e) or _join(e, f)
            if joined:
                out[k] = joined
                break
        else:
            out.append(e)
    return tuple(out)


def _join(a: tuple, b: tuple):
    """One copy for copy ``a`` and then copy ``b`` where ``b`` goes on where ``a`` ends, in both tensors: its next
    rows, or the next bytes of each of its rows (heads first: a head's text tokens, then its share); None otherwise."""
    i, do, dp, so, sp, w, h = a
    i2, do2, dp2, so2, sp2, w2, h2 = b
    if (i, dp, sp) != (i2, dp2, sp2):
        return None
    if w == w2 and do2 == do + h * dp and so2 == so + h * sp:
        return i, do, dp, so, sp, w, h + h2
    if h == h2 and do2 == do + w and so2 == so + w and w + w2 <= min(dp, sp):
        return i, do, dp, so, sp, w + w2, h
    return None


def _copy_2d(fn, dst, src, plan, stream) -> None:
    """The copies of :func:`pitched_plan` by ``fn`` (:func:`_memcpy_2d`) on ``stream`` (CUDA, with unified addressing:
    either device's memory).  The first time between two devices, one element goes through PyTorch's own copy first:
    PyTorch then enables the source device's access to the destination's memory (peer access), which the 2-D copy
    uses."""
    _peer_access(src.device, dst.device, stream)
    d, s = dst.data_ptr(), src.data_ptr()
    with torch.cuda.device(stream.device):
        _run_2d(fn, [(d + doff, dp, s + soff, sp, w, rows) for doff, dp, soff, sp, w, rows in plan], stream.cuda_stream,
                f"{tuple(src.shape)} {src.device} -> {dst.device}")


def split(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``total`` items over ``parts`` as (start, count): the first ``total % parts`` parts get one more.  ``align`` > 1:
    every part but the last a multiple of ``align`` items (the parts within ``align`` of each other), where ``total``
    has ``align`` items for each part."""
    if align > 1 and total >= parts * align:
        blocks, rest = divmod(total, align)
        out = [(start * align, n * align) for start, n in split(blocks, parts)]
        start, n = out[-1]
        out[-1] = (start, n + rest)
        return out
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


@contextlib.contextmanager
def on_device(device: torch.device):
    """The current device for a rank's thread (CUDA's is per thread)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
