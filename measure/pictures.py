"""Pictures of an end-to-end benchmark (:mod:`.e2e`): the speed/quality chart, and each row's decoded output beside
its difference to the unpatched row.

- :func:`chart`: per preset, every row at (whole-run speed against unpatched, PSNR against the reference run), labelled;
  the exact floor (the exact kernels' PSNR, :func:`.stats.add_floor`) as a line and the band ``BAND_DB`` below it (a row
  inside loses at most that much against what exact kernels reach).  Rows whose output equals the reference's (PSNR
  infinite) sit on a lane at the top.  Exact rows are grey, the selectors' (:mod:`.rows`) red, the others blue.
- :func:`frames`: per row, its final latent decoded (a VAE's ``decode``, ComfyUI's layout: ``[B, H, W, 3]``, or
  ``[B, T, H, W, 3]`` for video, of which a few frames are shown), then a heatmap of the absolute difference to the
  unpatched row's decoded output on one fixed scale for every row (black: none; square-root scale, white at
  ``HEAT_FULL`` of the pixel range), so rows compare at a glance and an exact row's map stays black.

Pillow only (ComfyUI requires it).  :func:`to_image` makes a ComfyUI IMAGE (float32 ``[1, H, W, 3]`` in [0, 1]).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from .rows import SELECTOR, UNPATCHED, role_of

log = logging.getLogger("patch_attention.e2e")

BAND_DB = 3.0  # the band below the exact floor that the chart shades
HEAT_FULL = 0.25  # a difference of this share of the pixel range (or more) is white in the heatmaps

WHITE = (255, 255, 255)
PAPER = (236, 236, 236)  # behind the frames: a white (largest) difference stands out from it
INK = (30, 30, 30)
GRID = (228, 228, 228)
BAND = (206, 234, 206)  # the band below the floor (no other part of the chart uses it)
FLOOR = (34, 130, 60)
EXACT = (120, 120, 120)
AUTO = (200, 40, 40)
OTHER = (40, 90, 170)


def font(size: int = 14):
    """Pillow's own font at ``size`` (a scalable one since Pillow 10.1; the fixed bitmap font before)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def to_image(img: Image.Image) -> torch.Tensor:
    """A Pillow image as a ComfyUI IMAGE: float32 ``[1, H, W, 3]`` in [0, 1]."""
    data = torch.frombuffer(bytearray(img.convert("RGB").tobytes()), dtype=torch.uint8)
    return data.view(1, img.height, img.width, 3).float() / 255.0


def text(d: ImageDraw.ImageDraw, xy, s: str, fill, f, anchor: str = "la") -> None:
    """``d.text`` with an anchor (l/m/r horizontally, a/m vertically) that works with every font Pillow has."""
    x0, y0, x1, y1 = d.textbbox((0, 0), s, font=f)
    x, y = xy
    x -= {"l": x0, "m": (x0 + x1) / 2, "r": x1}[anchor[0]]
    y -= {"a": y0, "m": (y0 + y1) / 2}[anchor[1]]
    d.text((x, y), s, fill=fill, font=f)


def message(what: str, width: int = 640) -> Image.Image:
    """A small image that says ``what`` (wrapped to ``width``): where a picture cannot be drawn, and why."""
    f = font(15)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines, line = [], ""
    for word in what.split():
        cand = f"{line} {word}".strip()
        if line and probe.textlength(cand, font=f) > width - 24:
            lines.append(line)
            line = word
        else:
            line = cand
    lines.append(line)
    img = Image.new("RGB", (width, 24 + 20 * len(lines)), WHITE)
    d = ImageDraw.Draw(img)
    for i, ln in enumerate(lines):
        d.text((12, 12 + 20 * i), ln, fill=INK, font=f)
    return img


# ---------------------------------------------------------------- the speed / quality chart


def _step(span: float, ticks: int = 6) -> float:
    raw = max(span, 1e-9) / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


@dataclass
class Axes:
    """One panel's plot area (pixels) and data ranges; ``x(speed)`` / ``y(db)`` map data to pixels."""

    preset: str
    left: int
    top: int
    right: int
    bottom: int
    x0: float
    x1: float
    y0: float
    y1: float
    floor: float | None = None
    inf_lane: int | None = None  # the pixel row of the lane for rows equal to the reference

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def y(self, db: float) -> float:
        if db == math.inf and self.inf_lane is not None:
            return self.inf_lane
        return self.bottom - (db - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)


@dataclass
class Chart:
    image: Image.Image
    panels: list  # Axes, one per preset


@dataclass
class Frames:
    image: Image.Image
    shown: dict = field(default_factory=dict)  # row -> the boxes (x0, y0, x1, y1) of its frames
    heat: dict = field(default_factory=dict)  # row -> the boxes of its difference heatmaps


def chart(rows: list[dict], title: str = "", width: int = 960, panel_height: int = 560) -> Chart:
    """The speed/quality chart of ``rows`` (:func:`.e2e.measure`'s), one panel per preset, stacked."""
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    head = 34 if title else 0
    img = Image.new("RGB", (width, head + panel_height * max(1, len(presets))), WHITE)
    d = ImageDraw.Draw(img)
    if title:
        d.text((12, 10), title, fill=INK, font=font(14))
    panels = []
    for i, p in enumerate(presets):
        box = (0, head + i * panel_height, width, head + (i + 1) * panel_height)
        panels.append(_panel(d, box, p, [r for r in rows if r["preset"] == p]))
    if not presets:
        d.text((12, head + 12), "no rows", fill=INK, font=font(14))
    return Chart(img, [a for a in panels if a is not None])


def _speed(r: dict) -> float | None:
    return r.get("whole_vs_unpatched", r.get("vs_unpatched"))


def _panel(d: ImageDraw.ImageDraw, box, preset: str, rows: list[dict]) -> Axes | None:
    bx0, by0, bx1, by1 = box
    f, small = font(14), font(12)
    ref = next((r.get("reference") for r in rows if r.get("reference")), UNPATCHED)
    d.text((bx0 + 12, by0 + 8), f"{preset}: speed of the whole run against PSNR of the final output vs {ref}",
           fill=INK, font=f)
    pts = [r for r in rows if "psnr" in r and _speed(r) is not None and not math.isnan(r["psnr"])]
    missing = [r["row"] for r in rows if r not in pts]
    if not pts:
        d.text((bx0 + 12, by0 + 34), "no row has both a speed and a PSNR: nothing to draw", fill=INK, font=f)
        return None
    floor = next((r["floor_psnr"] for r in pts if r.get("floor_psnr") is not None), None)
    finite_floor = floor if floor is not None and math.isfinite(floor) else None
    has_inf = any(r["psnr"] == math.inf for r in pts)
    dbs = [r["psnr"] for r in pts if math.isfinite(r["psnr"])]
    if finite_floor is not None:
        dbs += [finite_floor, finite_floor - BAND_DB]
    if not dbs:
        dbs = [0.0, 1.0]
    lo_db, hi_db = min(dbs), max(dbs)
    pad = max(1.0, 0.06 * (hi_db - lo_db))
    xs = [_speed(r) for r in pts] + [1.0]
    lo_x, hi_x = min(xs), max(xs)
    xpad = max(0.05, 0.08 * (hi_x - lo_x))
    ax = Axes(preset, left=bx0 + 70, top=by0 + 40 + (28 if has_inf else 0), right=bx1 - 150, bottom=by1 - 64,
              x0=lo_x - xpad, x1=hi_x + xpad, y0=lo_db - pad, y1=hi_db + pad, floor=finite_floor)
    if has_inf:
        ax.inf_lane = ax.top - 16
    if finite_floor is not None:  # the band first: the grid stays visible on it
        d.rectangle([ax.left + 1, ax.y(finite_floor), ax.right - 1, ax.y(finite_floor - BAND_DB)], fill=BAND)
    # grid and ticks
    step = _step(ax.x1 - ax.x0)
    v = math.ceil(ax.x0 / step) * step
    while v <= ax.x1 + 1e-9:
        px = ax.x(v)
        d.line([(px, ax.top), (px, ax.bottom)], fill=GRID)
        text(d, (px, ax.bottom + 6), f"x{v:g}", INK, small, "ma")
        v += step
    step = _step(ax.y1 - ax.y0)
    v = math.ceil(ax.y0 / step) * step
    while v <= ax.y1 + 1e-9:
        py = ax.y(v)
        d.line([(ax.left, py), (ax.right, py)], fill=GRID)
        text(d, (ax.left - 6, py), f"{v:g}", INK, small, "rm")
        v += step
    if finite_floor is not None:
        d.line([(ax.left, ax.y(finite_floor)), (ax.right, ax.y(finite_floor))], fill=FLOOR, width=2)
        text(d, (ax.right + 6, ax.y(finite_floor)), f"exact floor {finite_floor:.2f} dB", FLOOR, small, "lm")
        text(d, (ax.right + 6, ax.y(finite_floor - BAND_DB)), f"{BAND_DB:g} dB below it", FLOOR, small, "lm")
    if has_inf:
        d.line([(ax.left, ax.top - 4), (ax.right, ax.top - 4)], fill=GRID, width=1)
        text(d, (ax.left - 6, ax.inf_lane), "inf", INK, small, "rm")
        text(d, (ax.right + 6, ax.inf_lane), f"equal to {ref}", INK, small, "lm")
    unpatched = ax.x(1.0)
    d.line([(unpatched, ax.top), (unpatched, ax.bottom)], fill=EXACT, width=1)
    d.rectangle([ax.left, ax.top - (28 if has_inf else 0), ax.right, ax.bottom], outline=INK)
    text(d, ((ax.left + ax.right) / 2, ax.bottom + 24), "whole run: speed against unpatched (higher is faster)", INK, f,
         "ma")
    text(d, (bx0 + 12, (ax.top + ax.bottom) / 2), "PSNR dB", INK, small, "lm")
    marks = [(ax.x(_speed(r)), ax.y(r["psnr"]), r) for r in sorted(pts, key=lambda r: (-r["psnr"], _speed(r)))]
    taken = [(px - 5, py - 5, px + 5, py + 5) for px, py, _ in marks]  # labels keep off every point
    for px, py, r in marks:
        colour = EXACT if r.get("exact") else AUTO if role_of(r["row"]) == SELECTOR else OTHER
        d.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        _label(d, taken, px, py, r["row"], colour, small, (ax.left, ax.top - 28, ax.right + 140, ax.bottom))
    if missing:
        d.text((ax.left, by1 - 18), "not drawn (no speed or PSNR): " + ", ".join(missing)[:140], fill=INK, font=small)
    elif finite_floor is None:
        d.text((ax.left, by1 - 18), f"no exact floor: no exact row besides {ref} (add one, e.g. sdpa_cudnn)", fill=INK,
               font=small)
    return ax


def _label(d, taken: list, px: float, py: float, text: str, colour, f, bounds) -> None:
    """The row's name beside its point: of eight places around it, the first that overlaps no point and no earlier
    label and stays in ``bounds`` (else the one that overlaps least)."""
    w = d.textlength(text, font=f)
    h = 14

    def overlap(bb):
        area = sum(max(0, min(bb[2], t[2]) - max(bb[0], t[0])) * max(0, min(bb[3], t[3]) - max(bb[1], t[1])) for t in taken)
        outside = bb[0] < bounds[0] or bb[2] > bounds[2] or bb[1] < bounds[1] or bb[3] > bounds[3]
        return area + (10 * w * h if outside else 0)

    places = [(px + dx, py + dy, px + dx + w, py + dy + h) for dx, dy in
              ((8, -h / 2), (-8 - w, -h / 2), (6, -h - 4), (6, 4), (-6 - w, -h - 4), (-6 - w, 4), (-w / 2, -h - 8),
               (-w / 2, 8))]
    bb = min(places, key=lambda b: (overlap(b) > 0, overlap(b)))
    taken.append(bb)
    d.text((bb[0], bb[1]), text, fill=colour, font=f)


# ---------------------------------------------------------------- decoded outputs and their differences


def heatmap(diff: torch.Tensor) -> torch.Tensor:
    """``[H, W]`` absolute differences (pixel units, [0, 1]) -> ``[H, W, 3]`` uint8: black for none, through red and
    yellow to white at ``HEAT_FULL`` or more (square-root scale: small differences stay visible); NaN is white."""
    v = (diff.float().nan_to_num(nan=HEAT_FULL) / HEAT_FULL).clamp(0, 1).sqrt()
    rgb = torch.stack([(3 * v).clamp(0, 1), (3 * v - 1).clamp(0, 1), (3 * v - 2).clamp(0, 1)], dim=-1)
    return (rgb * 255).round().to(torch.uint8)


def frame_indices(t: int, count: int = 3) -> list[int]:
    """``count`` frames of ``t`` spread evenly, the first and the last included."""
    k = min(count, t)
    return sorted({round(i * (t - 1) / max(k - 1, 1)) for i in range(k)})


def pick_frames(images: torch.Tensor, count: int = 3) -> torch.Tensor:
    """The frames to show of one decoded output: ``[H, W, 3]`` -> ``[1, H, W, 3]``; ``[T, H, W, 3]`` -> the
    :func:`frame_indices` of T."""
    return images[None] if images.ndim == 3 else images[frame_indices(images.shape[0], count)]


def _tile(x: torch.Tensor, size: tuple[int, int]) -> Image.Image:
    """``[H, W, 3]`` (float in [0, 1], or uint8) as a Pillow image of ``size`` (width, height), area-averaged."""
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    x = x.float().nan_to_num(0.0).clamp(0, 1)
    if (x.shape[1], x.shape[0]) != size:
        x = F.interpolate(x.permute(2, 0, 1)[None], size=(size[1], size[0]), mode="area")[0].permute(1, 2, 0)
    return Image.fromarray((x * 255).round().to(torch.uint8).numpy(), "RGB")


def _caption(r: dict) -> str:
    psnr = r.get("psnr")
    bits = [r["row"]]
    if psnr is not None:
        bits.append("PSNR inf (equal to the reference)" if psnr == math.inf else f"PSNR {psnr:.2f} dB")
    if _speed(r) is not None:
        bits.append(f"x{_speed(r):.3f} whole run")
    if r.get("finite") is False:
        bits.append("output not finite (NaN/inf)")
    return " | ".join(bits)


def frames(rows: list[dict], latents: dict, decode, count: int = 3, width: int = 1600, max_tile_height: int = 320) -> Frames:
    """Each row's final latent (``latents[row name]``) decoded, its frames beside the heatmap of their difference to
    the unpatched row's; one band per row, labelled with its PSNR and speed.  ``decode(latent)`` returns ComfyUI's
    image layout (a VAE's ``decode``).  Rows without a latent (a row that failed) are left out."""
    names = [r["row"] for r in rows if r["row"] in latents]
    base = next((n for n in names if n.startswith(UNPATCHED)), None)
    if base is None:
        return Frames(message("No unpatched row with an output: nothing to compare the rows' frames with."))
    decoded, frames_of = {}, []

    def shown(name):
        if name not in decoded:
            out = decode(latents[name][:1])[0].detach().float().cpu()
            if not frames_of:
                frames_of.append(out.shape[0] if out.ndim == 4 else 0)
            decoded[name] = pick_frames(out, count)
        return decoded[name]

    try:
        ref = shown(base)
    except Exception as e:  # a VAE that does not fit this model's latent: the benchmark's other outputs stand
        log.warning("e2e frames: decoding %s failed", base, exc_info=True)
        return Frames(message(f"The VAE could not decode the {base} row's latent {tuple(latents[base].shape)}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
    n, h, w = ref.shape[0], ref.shape[1], ref.shape[2]
    gap = 3
    scale = min(1.0, width / (2 * n * w), max_tile_height / h)
    tw, th = max(1, round(w * scale)), max(1, round(h * scale))
    step = tw + gap
    label_h = 22
    by_name = {r["row"]: r for r in rows}
    f = font(13)
    what = (f"frames {', '.join(str(i + 1) for i in frame_indices(frames_of[0], count))} of {frames_of[0]} of its "
            "output" if frames_of[0] else "its output")
    header = (f"Each row: {what}, then the difference to {base}'s (black: none; white: {HEAT_FULL:.0%} of the pixel "
              "range or more)")
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    text_w = max(probe.textlength(t, font=f) for t in [header, *(_caption(by_name[nm]) for nm in names)])
    img = Image.new("RGB", (max(2 * n * step + 8, round(text_w) + 8), 30 + len(names) * (th + label_h + 6)), PAPER)
    d = ImageDraw.Draw(img)
    out = Frames(img)
    d.text((4, 6), header, fill=INK, font=f)
    y = 30
    for name in names:
        r = by_name[name]
        try:
            got = shown(name)
        except Exception as e:  # one row that cannot be decoded is said so, the others are still drawn
            log.warning("e2e frames: decoding %s failed: %s", name, e, exc_info=True)
            d.text((4, y + 3), f"{name}: could not decode: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                   fill=AUTO, font=f)
            y += th + label_h + 6
            continue
        if got.shape != ref.shape:
            d.text((4, y + 3), f"{name}: decoded to {tuple(got.shape)}, the unpatched row to {tuple(ref.shape)}",
                   fill=AUTO, font=f)
            y += th + label_h + 6
            continue
        d.text((4, y + 3), _caption(r), fill=INK, font=f)
        y += label_h
        for i in range(n):
            box = (i * step, y, i * step + tw, y + th)
            img.paste(_tile(got[i], (tw, th)), box[:2])
            out.shown.setdefault(name, []).append(box)
            box = (n * step + 8 + i * step, y, n * step + 8 + i * step + tw, y + th)
            img.paste(_tile(heatmap((got[i] - ref[i]).abs().mean(dim=-1)), (tw, th)), box[:2])
            out.heat.setdefault(name, []).append(box)
        y += th + 6
    return out
