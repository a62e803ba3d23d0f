"""One tiled VAE decode (or encode) over several devices: the host's tiles, decoded one per thread, blended as on one.

A tiled decode cuts the latent into overlapping tiles, decodes them one at a time and blends each into the output with
a feathered mask as it comes (ComfyUI's ``comfy.utils.tiled_scale_multidim``).  Here the host's tiling loop still runs
and still blends, in the calling thread and in its own order; the function it calls per tile is a :class:`TileRun`,
which knows the tiles beforehand (:func:`tiles`: the views that loop takes, in its order), has them decoded by one
thread per device, each with its own copy of the model, and hands each tile's output back when the loop asks for it.
So the blend is the host's own, and each tile's pixels are what its device's decode gives: on identical devices the
output is bit for bit the one-device tiled decode with the same tiles.  The loop blends tile ``i`` while the devices
decode the next ones.

Which tile the loop asks for is read from the view it passes (its data pointer, shape and strides: the loop narrows
the tensor it was given, and :func:`tiles` narrows it the same way), never assumed from the order; a view that is not
in the plan (a host whose loop tiles differently) stops the threads and is decoded in the calling thread on the first
device, as are the tiles after it, and counted.

Nothing here imports ComfyUI: the caller passes the tensor the loop will tile, the loop's tile and overlap per call, and
one decode function per device.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .group import on_device

log = logging.getLogger("patch_attention.vae")


# ---------------------------------------------------------------- the tiles of a tiled decode


def tiles(samples: torch.Tensor, tile: Sequence[int], overlap: Sequence[int]) -> list[torch.Tensor]:
    """The views of ``samples`` that the host's tiling loop (``tiled_scale_multidim(samples, f, tile, overlap)``) passes
    to ``f``, in its order: per batch element, the whole element where it fits in one tile, else every tile of the
    product of the positions along each tiled dimension (after batch and channels).  A dimension that needs tiles
    with a tile no larger than its overlap is refused (the loop would step by zero or backwards: no tiles, a NaN
    output)."""
    dims = len(tile)
    shape = samples.shape[2:]
    if len(shape) != dims or len(overlap) != dims:
        raise ValueError(f"a tile of {dims} dimensions for a tensor of {len(shape)} after batch and channels")
    for d in range(dims):
        if shape[d] > tile[d] and tile[d] <= overlap[d]:
            raise ValueError(f"a tile of {tile[d]} along a dimension of {shape[d]} is not larger than its overlap of "
                             f"{overlap[d]}: make the tile larger or the overlap smaller")
    out = []
    for b in range(samples.shape[0]):
        s = samples[b:b + 1]
        if all(shape[d] <= tile[d] for d in range(dims)):
            out.append(s)
            continue
        for it in itertools.product(*(tiles_along(shape[d], tile[d], overlap[d]) for d in range(dims))):
            view = s
            for d, pos in enumerate(it):
                view = view.narrow(d + 2, pos, min(tile[d], shape[d] - pos))
            out.append(view)
    return out


def tiles_along(length: int, size: int, overlap: int) -> list[int]:
    """The tiling loop's start positions along one dimension of ``length`` for tiles of ``size``."""
    if length <= size:
        return [0]
    return [max(0, min(length - overlap, p)) for p in range(0, length - overlap, size - overlap)]


def split_length(length: int, parts: int, overlap: int, multiple: int = 1) -> int | None:
    """The tile (a multiple of ``multiple``) that the tiling loop, with ``overlap``, cuts a dimension of ``length``
    into ``parts`` tiles with: all that size but the last, which is as long or a little shorter; None where no such
    tile exists (too short a dimension for so many parts)."""
    if parts == 1:
        return length
    size = math.ceil(math.ceil((length + (parts - 1) * overlap) / parts) / multiple) * multiple
    if size <= overlap or len(tiles_along(length, size, overlap)) != parts:
        return None
    return size


def even_tiles(spatial: Sequence[int], devices: int, overlap: int, fits: Callable[[tuple], bool] = lambda t: True,
               multiple: int = 1) -> tuple[int, int]:
    """(height, width) of tiles of one size over the last two dimensions of ``spatial`` (the ones a tiled decode cuts
    in space): as many tiles as ``devices`` or a multiple of it, the fewest for which ``fits(tile)`` (a tile small
    enough for a device's memory); of the grids of that many tiles, the one that decodes the least area twice.
    ``multiple``: tiles a multiple of it (an encoder's downscale, so that tiles start on its grid).  A latent too small
    for ``devices`` tiles gets as many as it takes; where none fits, the smallest tried."""
    h, w = spatial[-2], spatial[-1]

    def best_grid(k):
        grids = []
        for rows in (r for r in range(1, k + 1) if k % r == 0):
            th, tw = split_length(h, rows, overlap, multiple), split_length(w, k // rows, overlap, multiple)
            if th and tw:
                grids.append((rows * th * (k // rows) * tw, rows, (th, tw)))
        return min(grids)[2] if grids else None

    smallest = None
    for k in [devices * m for m in range(1, 9)] + list(range(devices - 1, 0, -1)):
        tile = best_grid(k)
        if tile is None:
            continue
        if fits(tile):
            return tile
        smallest = tile if smallest is None or tile[0] * tile[1] < smallest[0] * smallest[1] else smallest
        if k < devices:  # fewer tiles than devices already: fewer still are no smaller
            break
    return smallest or (h, w)


# ---------------------------------------------------------------- the run


class TileRun:
    """The function a tiling loop calls per tile, for tiles known beforehand: ``plan`` (views, in the loop's order) is
    decoded by one thread per entry of ``decoders`` (``decoders[r](view)`` -> the tile's output, run with ``devices[r]``
    current), the first tile of each thread fixed (tile ``r`` for thread ``r``: every device decodes one at least
    where there are as many tiles), the rest taken in order by whichever thread is free, at most ``window`` tiles
    ahead of the one the loop asks for.  ``check()`` runs before each tile and raises to stop the run (the host's
    interruption): the loop gets that exception.  Use as a context manager: the threads start on entry and are joined
    on exit."""

    def __init__(self, plan: list[torch.Tensor], decoders: list[Callable], devices: list, window: int | None = None,
                 check: Callable[[], None] = lambda: None):
        self.plan = plan
        self.decoders = decoders
        self.devices = [torch.device(d) for d in devices]
        self.window = window or 2 * len(decoders)
        self.check = check
        self.counts = [0] * len(decoders)  # tiles decoded per thread
        self.busy = [0.0] * len(decoders)  # seconds each thread spent in its decoder (host time)
        self.finished = [0.0] * len(decoders)  # when each thread's last tile came back (time.perf_counter)
        self.unplanned = 0  # tiles the loop asked for outside the plan (decoded in the calling thread)
        self._index = collections.defaultdict(collections.deque)
        for i, v in enumerate(plan):
            self._index[self._key(v)].append(i)
        self._results: dict[int, torch.Tensor] = {}
        self._taken = len(decoders)  # the next tile a free thread takes (each thread's first tile is its own)
        self._asked = 0  # the tile the loop asks for next, in plan order
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._threads = []
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    @staticmethod
    def _key(view: torch.Tensor):
        return view.data_ptr(), tuple(view.shape), view.stride()

    def __enter__(self) -> TileRun:
        for r, dev in enumerate(self.devices):
            t = threading.Thread(target=self._work, args=(r,), name=f"vae-tiles-{dev}-{r}", daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    # ------------------------------------------------------------ the threads

    def _next(self, r: int, first: bool) -> int | None:
        """The next tile for thread ``r`` (None: no more), once it is within the window."""
        with self._cond:
            if first:
                i = r
            else:
                i = self._taken
                self._taken += 1
            while not self._closed and self._error is None and i < len(self.plan) and i >= self._asked + self.window:
                self._cond.wait()
            if self._closed or self._error is not None or i >= len(self.plan):
                return None
            return i

    def _work(self, r: int) -> None:
        grad, inference = self._modes
        with on_device(self.devices[r]), torch.inference_mode(inference), torch.set_grad_enabled(grad):
            first = True
            while (i := self._next(r, first)) is not None:
                first = False
                try:
                    self.check()
                    start = time.perf_counter()
                    out = self.decoders[r](self.plan[i])
                except BaseException as e:
                    log.warning("a tile of %s on %s failed: %s: %s", tuple(self.plan[i].shape), self.devices[r],
                                type(e).__name__, e)
                    with self._cond:
                        self._error = self._error or e
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._results[i] = out
                    self.counts[r] += 1
                    self.finished[r] = time.perf_counter()
                    self.busy[r] += self.finished[r] - start
                    self._cond.notify_all()

    # ------------------------------------------------------------ the loop's side

    def __call__(self, view: torch.Tensor) -> torch.Tensor:
        """The output of the tile ``view`` (called by the tiling loop, in its thread)."""
        queue = self._index.get(self._key(view))
        if not queue or self._closed:
            return self._unplanned(view, queue)
        i = queue.popleft()
        with self._cond:
            self._asked = max(self._asked, i + 1)
            self._cond.notify_all()
            while i not in self._results and self._error is None and not self._closed:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            out = self._results.pop(i, None)
        return out if out is not None else self._unplanned(view, None)

    def _unplanned(self, view: torch.Tensor, queue) -> torch.Tensor:
        """A tile outside the plan (or after the threads stopped): the threads are stopped and it is decoded here, on
        the first device; a planned tile already decoded is still used."""
        if not self._closed:
            log.warning("the tiling loop asked for a tile outside the plan (%s): the rest is decoded on %s alone",
                        tuple(view.shape), self.devices[0])
            self._close()
        if queue:
            done = self._results.pop(queue.popleft(), None)
            if done is not None:
                return done
        self.unplanned += 1
        grad, inference = self._modes
        with on_device(self.devices[0]), torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return self.decoders[0](view)
