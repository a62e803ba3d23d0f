"""The ranks of one model forward split over several devices, one thread each, in one process.

A :class:`Group` is made per forward. Its ranks meet at each exchange (a ``threading.Barrier``); a rank posts the tensors
it offers, and after the barrier every rank *pulls* what it needs from the others with PyTorch's own device-to-device
copies (``Tensor.copy_`` across devices: a peer copy over NVLink or PCIe where the GPUs allow it, through host memory
otherwise). There is no collective written by hand: an exchange is a barrier (the ranks' tensors are all posted) and
plain copies, each enqueued on the *source* rank's stream (the stream it posted with), so it starts after the kernels
that made the tensor and before the source memory can be reused, and PyTorch makes the destination's stream wait for it.
No rank waits for another rank's GPU work on the host: the barrier only waits until every rank has *enqueued* its part.

Posted tensors stay referenced until the round after next (two slots, alternating), by which time every rank has
enqueued its copies from them.  An error in one rank aborts the barrier, so the others stop with
:class:`GroupAborted` instead of waiting for ever; the forward then reports the first rank's error.

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
    """``len(devices)`` ranks of one forward (a device may repeat: ranks simulated on the CPU in tests)."""

    def __init__(self, devices, timeout: float | None = 600.0):
        self.devices = [torch.device(d) for d in devices]
        self.size = len(self.devices)
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = ([None] * self.size, [None] * self.size)
        self._round = [0] * self.size
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

    def exchange(self, rank: int, tensors: tuple, fill) -> None:
        """Post ``tensors`` (this rank's, on its device) and, once all ranks have, call ``fill(peer, peer_tensors,
        copy)`` for every rank ``peer`` (this one included): ``copy(dst, src)`` copies a peer's tensor (or a view of it)
        into ``dst`` on this rank's device, on the peer's stream."""
        stream = torch.cuda.current_stream(self.devices[rank]) if self.devices[rank].type == "cuda" else None
        posted = self._post(rank, (tuple(tensors), stream))
        for peer in range(self.size):
            peer_tensors, peer_stream = posted[peer]
            fill(peer, peer_tensors, _copier(peer_stream if peer != rank else None))


def _copier(stream):
    """``copy(dst, src)`` on ``stream`` (the source's), or on the current stream when None (a rank's own tensors).

    Between devices only whole blocks of memory travel: a strided source (a share of the heads) is first made
    contiguous on its own device, and a strided destination is filled from a contiguous copy on this one; a strided
    copy across devices would read or write the other GPU's memory in pieces of one head's row."""
    if stream is None:
        def copy(dst, src):
            dst.copy_(src)
    else:
        def copy(dst, src):
            with torch.cuda.stream(stream):
                if not src.is_contiguous():
                    src = src.contiguous()
                if dst.is_contiguous():
                    dst.copy_(src, non_blocking=True)
                    return
                tmp = src.to(dst.device, non_blocking=True)
            dst.copy_(tmp)
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
