"""VAE Decode / VAE Encode (several GPUs): ComfyUI's tiled VAE decode and encode with the tiles spread over the GPUs.

The output is ComfyUI's own tiled decode with the same tiles (``VAE.decode_tiled``, the node's settings converted as
VAE Decode (Tiled) converts them), bit for bit on GPUs of one kind: ComfyUI's tiling loop
(``comfy.utils.tiled_scale_multidim``) runs and blends in this thread as on one GPU, and each tile it asks for was
decoded on one of the GPUs by that GPU's copy of the VAE (:class:`..parallel.vae.TileRun`).  The loop blends on the
first GPU where it has the room (:func:`_blend_device`: the same bits as on the CPU), and the frames go to ComfyUI's
output device once, through page-locked buffers (:func:`_to_device`).  The calls of that loop
here are those of ``VAE.decode_tiled`` and ``VAE.encode_tiled`` (their arguments and order, the same in ComfyUI 0.3.64
and 0.33: tests/test_vae_multi.py compares with ComfyUI's own on both).  VAEs that tile themselves (``handles_tiling``),
audio VAEs (one-dimensional latents), a VAE placed on the CPU, and machines with one GPU decode with ComfyUI's own
tiled decode on the VAE's device, and the log says why.

The GPUs' copies of the VAE: ComfyUI's per-device deep clones where it has them (``ModelPatcher.deepclone_multigpu``,
0.33+, through the loader's reload function, as Select VAE Device makes them; for a VAE whose loader registers none, a
copy of the loaded VAE, as Context Parallel's ``copy_of_loaded``), made once per VAE and device and kept while the
VAE object lives (keyed weakly by it).  They are models of ComfyUI's memory management like the VAE itself: each decode
loads the VAE and every copy with room for one tile asked on each GPU (``load_models_gpu``), and ComfyUI unloads them
to its offload device when it needs the room (or on Unload Models), as it does the VAE.  Dropping a copy while ComfyUI
unloads it would free it inside ComfyUI's own loop over its loaded models (which then fails), so a copy lives as long
as its VAE.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..parallel.vae import TileRun, even_tiles, tiles
from .context_parallel import CopyFailed, copy_of_loaded

log = logging.getLogger("patch_attention.vae")

DECODE_NAME = "VAE Decode (several GPUs)"
ENCODE_NAME = "VAE Encode (several GPUs)"
DEFAULT_TILE = 512  # px: VAE Decode (Tiled)'s default, for image VAEs with tile_size 0
MEMORY_SHARE = 0.8  # of a GPU's memory that one tile may take in ComfyUI's estimate (tile_size 0 sizes tiles by it)


@dataclass
class Tiling:
    """``VAE.decode_tiled`` / ``encode_tiled``'s arguments (latent pixels for a decode, pixels for an encode)."""

    tile_x: int
    tile_y: int
    overlap: int
    tile_t: int | None = None
    overlap_t: int | None = None

    def args(self) -> dict:
        return {"tile_x": self.tile_x, "tile_y": self.tile_y, "overlap": self.overlap, "tile_t": self.tile_t,
                "overlap_t": self.overlap_t}

    def decode_calls(self, dims: int) -> list[tuple[tuple, tuple]]:
        """(tile, overlap) of each call ``VAE.decode_tiled`` makes of the tiling loop, in its order."""
        if dims == 3:  # decode_tiled_3d: tile_x cuts the height, tile_y the width
            t = 999 if self.tile_t is None else max(2, self.tile_t)
            return [((t, self.tile_x, self.tile_y), (1 if self.overlap_t is None else max(1, self.overlap_t),
                                                     self.overlap, self.overlap))]
        x, y, o = self.tile_x, self.tile_y, (self.overlap, self.overlap)  # decode_tiled_: three tilings, averaged
        return [((y * 2, x // 2), o), ((y // 2, x * 2), o), ((y, x), o)]

    def encode_calls(self, vae, dims: int) -> list[tuple[tuple, tuple]]:
        """(tile, overlap) of each call ``VAE.encode_tiled`` makes of the tiling loop, in its order."""
        if dims == 3:
            down, up = vae.downscale_ratio[0], vae.upscale_ratio[0]
            t_latent = 9999 if self.tile_t is None else max(2, down(self.tile_t))
            o_t = 1 if self.overlap_t is None else up(max(1, min(t_latent // 2, down(self.overlap_t))))
            return [((up(t_latent), self.tile_x, self.tile_y), (o_t, self.overlap, self.overlap))]
        x, y, o = self.tile_x, self.tile_y, (self.overlap, self.overlap)  # encode_tiled_: three tilings, averaged
        return [((y, x), o), ((y // 2, x * 2), o), ((y * 2, x // 2), o)]


# ---------------------------------------------------------------- settings and checks


def check_settings(tile_size: int, overlap: int, temporal_size: int, temporal_overlap: int, decode: bool) -> None:
    """Sizes that give no tiles are refused; so are settings VAE Decode (Tiled) would quietly change (it lowers the
    overlap), each with what to set."""
    if min(tile_size, overlap, temporal_size, temporal_overlap) < 0:
        raise ValueError("sizes and overlaps are pixels or frames: 0 or more")
    if decode and tile_size and tile_size < 4 * overlap:
        raise ValueError(f"tiles of {tile_size} px with an overlap of {overlap} px: a tile must be at least 4x its "
                         f"overlap (tile_size {4 * overlap} or more, or overlap {tile_size // 4} or less)")
    if decode and temporal_size and temporal_size < 2 * temporal_overlap:
        raise ValueError(f"{temporal_size} frames per tile with {temporal_overlap} overlapping: a tile must be at least "
                         f"2x its overlap (temporal_size {2 * temporal_overlap} or more)")
    if tile_size and tile_size <= overlap:
        raise ValueError(f"tiles of {tile_size} px with an overlap of {overlap} px: a tile must be larger than its "
                         "overlap")


def check_latent(vae, latent: torch.Tensor) -> None:
    """A latent this VAE cannot decode is refused before anything loads."""
    if vae.latent_dim not in (2, 3) or vae.extra_1d_channel is not None:
        raise ValueError(f"{type(vae.first_stage_model).__name__} is an audio VAE: decode with ComfyUI's VAE Decode")
    if latent.ndim - 2 != vae.latent_dim:
        kind = "video" if vae.latent_dim == 3 else "image"
        raise ValueError(f"a latent of shape {tuple(latent.shape)} for a VAE of {kind} latents ({vae.latent_dim + 2} "
                         "dimensions): connect the VAE of the model that made it")
    if latent.shape[1] != vae.latent_channels:
        raise ValueError(f"the latent has {latent.shape[1]} channels, this VAE takes {vae.latent_channels}: connect the "
                         "VAE of the model that made it")


def decode_tiling(vae, shape, n: int, fits, tile_size: int, overlap: int, temporal_size: int,
                  temporal_overlap: int) -> Tiling:
    """VAE Decode (Tiled)'s conversion of the settings to latent pixels; ``tile_size`` 0: video latents get tiles of
    one size, as many as the ``n`` GPUs (or a multiple, where one does not ``fits`` a GPU's memory), image latents
    VAE Decode (Tiled)'s default."""
    comp = vae.spacial_compression_decode()
    tile_t = overlap_t = None
    tc = vae.temporal_compression_decode()
    if tc is not None and temporal_size:
        tile_t = max(2, temporal_size // tc)
        overlap_t = max(1, min(tile_t // 2, temporal_overlap // tc))
    if tile_size or len(shape) != 5:
        size = (tile_size or DEFAULT_TILE) // comp
        return Tiling(size, size, overlap // comp, tile_t, overlap_t)
    frames = shape[2] if tile_t is None else min(shape[2], tile_t)
    h, w = even_tiles(shape[2:], n, overlap // comp, lambda t: fits((1, shape[1], frames, *t)))
    return Tiling(h, w, overlap // comp, tile_t, overlap_t)


def encode_tiling(vae, shape, n: int, fits, tile_size: int, overlap: int, temporal_size: int,
                  temporal_overlap: int) -> Tiling:
    """VAE Encode (Tiled)'s settings (pixels, frames); ``tile_size`` 0: as :func:`decode_tiling`, tiles a multiple of
    the VAE's downscale."""
    tile_t, overlap_t = (temporal_size, temporal_overlap) if temporal_size else (None, None)
    if tile_size or len(shape) != 5:
        return Tiling(tile_size or DEFAULT_TILE, tile_size or DEFAULT_TILE, overlap, tile_t, overlap_t)
    frames = shape[2] if tile_t is None else min(shape[2], tile_t)
    h, w = even_tiles(shape[2:], n, overlap, lambda t: fits((1, shape[1], frames, *t)),
                      multiple=vae.spacial_compression_encode())
    return Tiling(h, w, overlap, tile_t, overlap_t)


# ---------------------------------------------------------------- devices and copies


def devices_for(vae, gpus: int, simulate: int = 0) -> tuple[list, str]:
    """The devices a decode runs on (the VAE's own first) and, where that is one, why."""
    if simulate:
        return [vae.device] * simulate, ""
    import comfy.model_management as mm

    dev = torch.device(vae.device)
    if dev.type == "cpu":
        return [dev], "the VAE runs on the CPU"
    every = mm.get_all_torch_devices()
    if dev not in every:
        return [dev], f"the VAE is on {dev}, not one of ComfyUI's GPUs"
    devices = [dev] + [d for d in every if d != dev]
    devices = devices[:gpus] if gpus > 0 else devices
    if len(devices) < 2:
        return devices, f"{len(every)} GPU{'s' if len(every) != 1 else ''} here" if gpus != 1 else "gpus is set to 1"
    return devices, ""


def unsupported(vae) -> str:
    """Why this VAE's tiled decode stays on one GPU ("" where it spreads)."""
    if getattr(vae, "handles_tiling", False):
        return f"{type(vae.first_stage_model).__name__} tiles its decode itself"
    return ""


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # VAE -> {(rank, device): ModelPatcher}
_LOCK = threading.RLock()


def patchers(vae, devices: list) -> list:
    """The VAE's patcher, then its copy for each further device (made on first use, kept: see the module's docstring).
    Raises :class:`CopyFailed` where the VAE cannot be copied."""
    with _LOCK:
        have = _COPIES.setdefault(vae, {})
        for r, dev in enumerate(devices[1:], 1):
            if (r, str(dev)) not in have:
                have[(r, str(dev))] = _copy(vae, dev)
        return [vae.patcher] + [have[(r, str(dev))] for r, dev in enumerate(devices[1:], 1)]


def _copy(vae, device):
    """A patcher of a copy of ``vae``'s model for ``device``."""
    src = vae.patcher
    if hasattr(src, "deepclone_multigpu"):  # ComfyUI 0.33+
        if src.cached_patcher_init is None:
            src = src.clone()
            src.cached_patcher_init = (copy_of_loaded, (vae.patcher.model, vae.patcher.load_device,
                                                         vae.patcher.offload_device))
        try:
            p = src.deepclone_multigpu(new_load_device=device)
        except RuntimeError as e:
            raise CopyFailed(f"ComfyUI could not copy the VAE for {device} ({e})") from e
    else:  # before 0.33: as its deep clones, the VAE unloaded (its weights as loaded from the file), then copied
        _unload(src)
        p = copy_of_loaded(vae.patcher.model, device, vae.patcher.offload_device)
    dtype = next(vae.first_stage_model.parameters()).dtype
    if next(p.model.parameters()).dtype != dtype:
        raise CopyFailed(f"the VAE's copy for {device} loads in {next(p.model.parameters()).dtype}, the VAE runs in "
                         f"{dtype}")
    return p


def _unload(patcher) -> None:
    """``patcher`` and its clones unloaded from ComfyUI's loaded models (0.33's ``unload_model_and_clones``)."""
    import comfy.model_management as mm

    for i in reversed(range(len(mm.current_loaded_models))):
        loaded = mm.current_loaded_models[i]
        if loaded.model is not None and loaded.model.is_clone(patcher) and loaded.model_unload():
            mm.current_loaded_models.pop(i)


# ---------------------------------------------------------------- the run


@dataclass
class Report:
    """What one call did: its tiling (``VAE.decode_tiled`` / ``encode_tiled``'s arguments for the same output), tiles
    per device (one device: ComfyUI's own tiled decode, and ``why``), the largest tile, seconds."""

    tiling: Tiling
    devices: list
    counts: list
    tile: tuple = ()
    seconds: float = 0.0
    why: str = ""
    unplanned: int = 0

    def line(self, node: str) -> str:
        if self.why:
            what = "encode" if node == ENCODE_NAME else "decode"
            return f"{node}: one device ({self.devices[0]}): {self.why}; ComfyUI's tiled {what} there"
        per = ", ".join(f"{d} {c}" for d, c in zip(self.devices, self.counts))
        more = f"; {self.unplanned} outside the plan, on {self.devices[0]}" if self.unplanned else ""
        return (f"{node}: {sum(self.counts) + self.unplanned} tiles of {'x'.join(map(str, self.tile))} over "
                f"{len(self.devices)} devices ({per}{more}) in {self.seconds:.2f} s")


def _fits(vae, devices, estimate):
    """Whether a tile of a shape fits every device in ComfyUI's own estimate (``estimate(shape, dtype)``)."""
    import comfy.model_management as mm

    if all(torch.device(d).type == "cpu" for d in devices):
        return lambda shape: True
    budget = min(mm.get_total_memory(torch.device(d)) for d in devices) * MEMORY_SHARE - vae.model_size()
    return lambda shape: estimate(shape, vae.vae_dtype) <= budget


def _output_dtype(vae):
    return vae.vae_output_dtype() if hasattr(vae, "vae_output_dtype") else torch.float32  # ComfyUI 0.3.64: .float()


def _tiled(vae, samples, tiling, calls, loop_kwargs, make_fn, estimate, devices, node: str, out_bytes: int = 0):
    """ComfyUI's tiling loop once per call in ``calls`` over ``samples``, each tile decoded by ``make_fn(vae, model,
    device, output_device)`` on one of ``devices`` (room for a tile asked by ComfyUI's ``estimate``), blended where
    :func:`_blend_device` says for an output of ``out_bytes`` (0: ComfyUI's output device): (the loop's outputs,
    Report)."""
    import comfy.model_management as mm
    import comfy.utils

    plan = [v for tile, ov in calls for v in tiles(samples, tile, ov)]
    ps = patchers(vae, devices)
    tile = tuple(min(t, s) for t, s in zip(calls[-1][0], samples.shape[2:]))
    tile_memory = estimate((1, samples.shape[1], *tile), vae.vae_dtype)
    mm.load_models_gpu(ps, memory_required=tile_memory, force_full_load=vae.disable_offload)
    out = _blend_device(vae, devices[0], out_bytes, tile_memory) if out_bytes else vae.output_device
    pbar = comfy.utils.ProgressBar(len(plan))
    start = time.perf_counter()
    fns = [make_fn(vae, p.model, torch.device(d), out) for p, d in zip(ps, devices)]
    with TileRun(plan, fns, devices, check=mm.throw_exception_if_processing_interrupted) as run:
        outs = [comfy.utils.tiled_scale_multidim(samples, run, tile=t, overlap=o, pbar=pbar,
                                                 **{**loop_kwargs, "output_device": out}) for t, o in calls]
    report = Report(tiling, list(devices), list(run.counts), tile, time.perf_counter() - start,
                    unplanned=run.unplanned)
    log.info(report.line(node))
    log.debug("%s: each device's decoding %s s, its last tile back at %s s, blended by %.3f s (on %s)", node,
              _seconds(run.busy), _seconds(t - start for t in run.finished), report.seconds, out)
    return outs, report


def _seconds(values) -> str:
    return "/".join(f"{v:.3f}" for v in values)


# The frames are blended on the first GPU where it has this many times their size free beside a tile's decode: the
# output, the sum of the tiles' masks, one tile and its mask.
BLEND_ROOM = 3


def _blend_device(vae, first, out_bytes: int, tile_memory: float):
    """Where the tiles are blended: the first GPU, where it has the room, else ComfyUI's output device.  ComfyUI's loop
    blends with element-wise multiplies, adds and one divide, correctly rounded on a GPU as on the CPU (no fused
    multiply-add: each is its own kernel), so the frames are the same bits either way (the GPU stage checks it against
    ComfyUI's tiled decode blending on the CPU); on the GPU the blend takes milliseconds, and the frames cross to the
    output device once."""
    import comfy.model_management as mm

    first = torch.device(first)
    if first.type != "cuda" or torch.device(vae.output_device) == first:
        return vae.output_device
    if mm.get_free_memory(first) < BLEND_ROOM * out_bytes + tile_memory:
        return vae.output_device
    return first


def _decoder(vae, model, device, out):
    dtype, vae_dtype = _output_dtype(vae), vae.vae_dtype
    return lambda a: model.decode(a.to(vae_dtype).to(device)).to(dtype=dtype).to(out)


def _encoder(vae, model, device, out):
    dtype, vae_dtype = _output_dtype(vae), vae.vae_dtype
    return lambda a: model.encode(vae.process_input(a).to(vae_dtype).to(device)).to(dtype=dtype).to(out)


# ---------------------------------------------------------------- decode and encode


def decode(vae, latent: torch.Tensor, gpus: int = 0, tile_size: int = 0, overlap: int = 64, temporal_size: int = 0,
           temporal_overlap: int = 8, simulate: int = 0):
    """``latent`` decoded by ``vae`` over ``gpus`` GPUs (0: all; ``simulate``: tests, that many threads on the VAE's
    device): (images ``[B, H, W, C]`` or ``[B, T, H, W, C]`` as ``VAE.decode_tiled`` returns them, Report)."""
    vae.throw_exception_if_invalid()
    check_settings(tile_size, overlap, temporal_size, temporal_overlap, decode=True)
    check_latent(vae, latent)
    return _spread(DECODE_NAME, vae, gpus, simulate, vae.memory_used_decode,
                   lambda n, fits: decode_tiling(vae, latent.shape, n, fits, tile_size, overlap, temporal_size,
                                                 temporal_overlap),
                   lambda tiling, devices: _decode_over(vae, latent, tiling, devices),
                   lambda tiling: vae.decode_tiled(latent, **tiling.args()))


def _spread(node: str, vae, gpus: int, simulate: int, estimate, tiling_for, over, on_one):
    """A decode (or encode) over the devices: ``tiling_for(count, fits)`` its tiles, ``over(tiling, devices)`` the
    run over them -> (output, Report); on one device (and why) ``on_one(tiling)``, ComfyUI's own tiled call."""
    devices, why = devices_for(vae, gpus, simulate)
    why = why or unsupported(vae)
    n = 1 if why else len(devices)
    tiling = tiling_for(n, _fits(vae, devices[:n], estimate))
    if not why:
        try:
            return over(tiling, devices)
        except CopyFailed as e:
            why = str(e)
    report = Report(tiling, devices[:1], [0], why=why)
    log.info(report.line(node))
    return on_one(tiling), report


def _decode_over(vae, latent, tiling: Tiling, devices):
    """``VAE.decode_tiled`` with its tiles over ``devices`` (its steps, in its order)."""
    dims = latent.ndim - 2
    calls = tiling.decode_calls(dims)
    if dims == 3:
        kw = {"upscale_amount": vae.upscale_ratio, "out_channels": vae.output_channels,
              "index_formulas": vae.upscale_index_formula, "output_device": vae.output_device}
    else:  # tiled_scale's (its out_channels default, 3)
        kw = {"upscale_amount": vae.upscale_ratio, "output_device": vae.output_device}
    outs, report = _tiled(vae, latent, tiling, calls, kw, _decoder, vae.memory_used_decode, devices, DECODE_NAME,
                          out_bytes=len(calls) * _frames_bytes(vae, latent.shape))
    start = time.perf_counter()
    output = vae.process_output(outs[0] if dims == 3 else (outs[0] + outs[1] + outs[2]) / 3.0)
    output = _to_device(output, vae.output_device)
    log.debug("%s: the frames to %s in %.3f s", DECODE_NAME, vae.output_device, time.perf_counter() - start)
    return output.movedim(1, -1), report


STAGED_COPY = True  # frames from a GPU to the CPU through two page-locked buffers (False: Tensor.to, pageable)
STAGE_BYTES = 64 << 20


def _to_device(frames: torch.Tensor, device) -> torch.Tensor:
    """``frames`` on ``device``.  From a GPU to the CPU (ComfyUI's output device): in pieces through two page-locked
    buffers in turn, each piece copied from the GPU at the bus's rate while the one before goes on into ordinary
    memory (a copy straight into ordinary memory goes through the driver's own staging, slower); the output is ordinary
    memory, as ComfyUI's own decode returns."""
    device = torch.device(device)
    if frames.device.type != "cuda" or device.type != "cpu" or not STAGED_COPY:
        return frames.to(device)
    src = frames.contiguous().view(-1)
    out = torch.empty(frames.shape, dtype=frames.dtype)
    dst = out.view(-1)
    n = max(1, STAGE_BYTES // frames.element_size())
    pieces = [(s, min(n, src.numel() - s)) for s in range(0, src.numel(), n)]
    bufs = [torch.empty(min(n, src.numel()), dtype=frames.dtype, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    stream = torch.cuda.current_stream(frames.device)
    for k in range(len(pieces) + 1):
        if k < len(pieces):  # the buffer's last piece went on into ``out`` at k - 1
            s, m = pieces[k]
            bufs[k % 2][:m].copy_(src[s:s + m], non_blocking=True)
            done[k % 2].record(stream)
        if k:
            s, m = pieces[k - 1]
            done[(k - 1) % 2].synchronize()
            dst[s:s + m].copy_(bufs[(k - 1) % 2][:m])
    return out


def _frames_bytes(vae, shape) -> int:
    """The size of the frames decoded from a latent of ``shape`` (ComfyUI's intermediate dtype)."""
    up = vae.upscale_ratio if isinstance(vae.upscale_ratio, (tuple, list)) else [vae.upscale_ratio] * (len(shape) - 2)
    sizes = [u(n) if callable(u) else u * n for u, n in zip(up, shape[2:])]
    return int(shape[0] * vae.output_channels * math.prod(sizes)) * _output_dtype(vae).itemsize


def encode(vae, pixels: torch.Tensor, gpus: int = 0, tile_size: int = 0, overlap: int = 64, temporal_size: int = 0,
           temporal_overlap: int = 8, simulate: int = 0):
    """``pixels`` (``[frames, H, W, C]``) encoded by ``vae`` over ``gpus`` GPUs, as :func:`decode`: (latent, Report)."""
    vae.throw_exception_if_invalid()
    if pixels.ndim != 4:
        raise ValueError(f"images of shape {tuple(pixels.shape)}: an IMAGE is [frames, height, width, channels]")
    if vae.latent_dim not in (2, 3) or vae.extra_1d_channel is not None:
        raise ValueError(f"{type(vae.first_stage_model).__name__} is an audio VAE: encode with ComfyUI's VAE Encode")
    check_settings(tile_size, overlap, temporal_size, temporal_overlap, decode=False)
    shaped = _encode_input(vae, pixels)
    return _spread(ENCODE_NAME, vae, gpus, simulate, vae.memory_used_encode,
                   lambda n, fits: encode_tiling(vae, shaped.shape, n, fits, tile_size, overlap, temporal_size,
                                                 temporal_overlap),
                   lambda tiling, devices: _encode_over(vae, shaped, tiling, devices),
                   lambda tiling: vae.encode_tiled(pixels, **tiling.args()))


def _encode_input(vae, pixels):
    """What ``VAE.encode_tiled`` hands its tiling loop: cropped, channels first, a video as one batch of frames, cut
    to the frames the VAE encodes."""
    x = vae.vae_encode_crop_pixels(pixels).movedim(-1, 1)
    if vae.latent_dim != 3:
        return x
    x = x.unsqueeze(2) if vae.not_video else x.movedim(1, 0).unsqueeze(0)
    return x[:, :, :vae.upscale_ratio[0](vae.downscale_ratio[0](x.shape[2]))]


def _encode_over(vae, shaped, tiling: Tiling, devices):
    """``VAE.encode_tiled`` with its tiles over ``devices`` (its steps, in its order)."""
    dims = vae.latent_dim
    calls = tiling.encode_calls(vae, dims)
    if dims == 3:
        kw = {"upscale_amount": vae.downscale_ratio, "out_channels": vae.latent_channels, "downscale": True,
              "index_formulas": vae.downscale_index_formula, "output_device": vae.output_device}
    else:
        kw = {"upscale_amount": 1 / vae.downscale_ratio, "out_channels": vae.latent_channels,
              "output_device": vae.output_device}
    outs, report = _tiled(vae, shaped, tiling, calls, kw, _encoder, vae.memory_used_encode, devices, ENCODE_NAME)
    samples = outs[0]
    if dims == 2:
        samples += outs[1]
        samples += outs[2]
        samples /= 3.0
    if getattr(vae, "format_encoded", None) is not None:
        samples = vae.format_encoded(samples)
    return samples, report
