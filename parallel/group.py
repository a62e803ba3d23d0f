"""The ranks of one model forward split over several devices, one thread each, in one process.

A :class:`Group` is made per forward. Its ranks meet at each exchange (a ``threading.Barrier``); a rank posts the tensors
it offers, and after the barrier every rank *pulls* what it needs from the others with PyTorch's own device-to-device
copies (``Tensor.copy_`` across devices: a peer copy over NVLink or PCIe where the GPUs allow it, through host memory
otherwise). There is no collective written by hand: an exchange is a barrier (the ranks' tensors are all posted) and
plain copies.

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
import threading

import torch


class GroupAborted(RuntimeError):
    """Another rank of the forward failed; its error is the one reported."""


class Group:
    """``len(devices)`` ranks of one forward (a device may repeat: ranks simulated on the CPU in tests).  ``pipeline``:
    in how many parts an exchanged attention call sends its heads (None: by the sequence's length)."""

    def __init__(self, devices, timeout: float | None = 600.0, pipeline: int | None = None, min_tokens: int = 0):
        self.devices = [torch.device(d) for d in devices]
        self.min_tokens = min_tokens  # a forward with fewer tokens to split runs on the first rank alone
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

    def gather_objects(self, rank: int, obj) -> list:
        """Every rank's ``obj`` (plain Python values: flags, layer lists), in rank order."""
        return list(self._post(rank, obj))

    def post(self, rank: int, tensors: tuple) -> list:
        """Post ``tensors`` (this rank's, on its device) and wait until every rank posted its own: every rank's posting,
        by rank, for :meth:`puller`."""
        device = self.devices[rank]
        if device.type != "cuda":
            return list(self._post(rank, (tuple(tensors), None, None)))
        send = self._stream(self._send, rank)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        for t in tensors:
            if t.device == device:
                t.record_stream(send)
        return list(self._post(rank, (tuple(tensors), ready, send)))

    def puller(self, rank: int, peer: int, posted: list, stream=None):
        """``copy(dst, src)``: a copy of ``peer``'s posted tensor ``src`` (or a view of it) into ``dst`` on this rank's
        device, ordered before this rank's work on ``stream`` (default: its current stream) from here on."""
        _, ready, send = posted[peer]
        if peer == rank or send is None:
            return _copy
        stream = stream or torch.cuda.current_stream(self.devices[rank])
        return _puller(send, ready, stream, self.devices[peer] == self.devices[rank])

    def receiving(self, rank: int):
        """This rank's receive stream (None off CUDA): copies into buffers its later kernels wait for, one by one."""
        return self._stream(self._recv, rank) if self.devices[rank].type == "cuda" else None

    def _stream(self, streams: list, rank: int):
        """``streams[rank]``, made on first use (from PyTorch's pool of streams on the rank's device)."""
        if streams[rank] is None:
            streams[rank] = torch.cuda.Stream(self.devices[rank])
        return streams[rank]

    def exchange(self, rank: int, tensors: tuple, fill) -> None:
        """Post ``tensors`` (this rank's, on its device) and, once all ranks have, call ``fill(peer, peer_tensors,
        copy)`` for every rank ``peer`` (this one included): ``copy(dst, src)`` copies a peer's tensor (or a view of it)
        into ``dst`` on this rank's device; this rank's current stream waits for it."""
        posted = self.post(rank, tensors)
        for peer in range(self.size):
            fill(peer, posted[peer][0], self.puller(rank, peer, posted))


def _copy(dst, src):
    dst.copy_(src)


def _puller(send, ready, stream, same_device: bool):
    """``copy(dst, src)`` of a peer's tensor on the peer's send stream, after the peer's ``ready`` event, with
    ``stream`` (this rank's) waiting for it.

    Between devices only whole blocks of memory travel: a strided source (a share of the heads) is first made
    contiguous on its own device, and a strided destination is filled from a contiguous copy on this one; a strided
    copy across devices would read or write the other GPU's memory in pieces of one head's row.  Across devices PyTorch
    orders the copy between the two current streams (``send`` and ``stream`` here); on one device (ranks simulated on
    one GPU) that is done here."""
    waited = []

    def copy(dst, src):
        with torch.cuda.stream(stream), torch.cuda.stream(send):
            if not waited:
                send.wait_event(ready)
                waited.append(True)
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
    return copy


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items over ``parts`` as (start, count): the first ``total % parts`` parts get one more."""
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
