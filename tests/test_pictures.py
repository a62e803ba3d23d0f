"""The end-to-end benchmark's pictures (measure/pictures.py): the speed/PSNR chart with the exact floor and its band,
the decoded frames beside their difference to the unpatched row, all as ComfyUI IMAGE tensors. No ComfyUI."""

import math
from importlib import import_module

import pytest
import torch
from pack import load

M = load().__name__ + ".measure"
pic = import_module(M + ".pictures")
stats = import_module(M + ".stats")
report = import_module(M + ".report")


def _row(name, speed, psnr, exact=False, preset="standin-480p", ref="fp32"):
    return {"row": name, "preset": preset, "s_per_step": 1 / speed, "s_per_step_whole": 1 / speed,
            "whole_vs_unpatched": speed, "psnr": psnr, "ssim": 0.99, "exact": exact, "reference": ref, "cos": 1.0,
            "rel_l1": 0.0, "finite": True}


def _standin_rows():
    rows = [_row("unpatched", 1.0, 58.9, True), _row("sdpa_cudnn", 1.401, 58.74, True), _row("sage_fp8_sm90", 1.622, 56.36),
            _row("auto", 1.679, 46.15), _row("kitchen_sol", 1.66, 46.15),
            {"row": "flash_attn4", "preset": "standin-480p", "error": "not installed"}]
    stats.add_floor(rows)
    return rows


def _pixels(img, colour, box):
    """How many pixels of ``colour`` the image has in ``box`` (x0, y0, x1, y1)."""
    t = pic.to_image(img.crop(tuple(round(v) for v in box)))[0]
    return int((t == torch.tensor(colour) / 255.0).all(dim=-1).sum())


def test_images_are_comfyui_image_tensors():
    for img in (pic.chart(_standin_rows()).image, pic.message("No VAE connected."),
                pic.frames([_row("unpatched", 1.0, math.inf)], {"unpatched": torch.zeros(1, 4, 8, 8)},
                           lambda z: torch.zeros(1, 64, 64, 3)).image):
        t = pic.to_image(img)
        assert t.dtype == torch.float32 and t.ndim == 4 and t.shape[0] == 1 and t.shape[-1] == 3
        assert (t.shape[1], t.shape[2]) == (img.height, img.width) and t.shape[1] >= 32 and t.shape[2] >= 32
        assert 0.0 <= float(t.min()) and float(t.max()) <= 1.0 and float(t.max()) > float(t.min())


def test_chart_draws_the_exact_floor_and_the_band_below_it():
    c = pic.chart(_standin_rows(), "H100")
    (ax,) = c.panels
    assert ax.floor == 58.74 and ax.y(58.74) < ax.y(58.74 - pic.BAND_DB)  # higher PSNR is higher up
    inside = lambda y0, y1: (ax.left + 2, y0, ax.right - 2, y1)  # noqa: E731
    band = _pixels(c.image, pic.BAND, inside(ax.y(58.74) + 3, ax.y(58.74 - pic.BAND_DB) - 1))
    assert band > 0.5 * (ax.right - ax.left) * (ax.y(58.74 - pic.BAND_DB) - ax.y(58.74) - 4)  # the band fills its rows
    assert _pixels(c.image, pic.BAND, inside(ax.top, ax.y(58.74) - 2)) == 0  # nothing above the floor
    assert _pixels(c.image, pic.BAND, inside(ax.y(58.74 - pic.BAND_DB) + 2, ax.bottom)) == 0  # nor below the band
    assert _pixels(c.image, pic.FLOOR, inside(ax.y(58.74) - 1, ax.y(58.74) + 2)) > 0.9 * (ax.right - ax.left)
    # each drawn row is a point of its colour where its speed and PSNR put it: exact grey, auto red, others blue
    for name, colour in (("sdpa_cudnn", pic.EXACT), ("auto", pic.AUTO), ("sage_fp8_sm90", pic.OTHER)):
        r = next(r for r in _standin_rows() if r["row"] == name)
        x, y = ax.x(r["whole_vs_unpatched"]), ax.y(r["psnr"])
        assert _pixels(c.image, colour, (x - 3, y - 3, x + 3, y + 3)) >= 9, name


def test_chart_without_a_floor_draws_no_band_and_puts_equal_rows_on_their_lane():
    rows = [_row("unpatched", 1.0, math.inf, True, "Flux", "unpatched"), _row("sdpa", 1.01, math.inf, True, "Flux", "unpatched"),
            _row("sage", 1.5, 50.0, False, "Flux", "unpatched")]
    stats.add_floor(rows)  # the only exact row besides the reference equals it: the floor is infinite
    c = pic.chart(rows)
    (ax,) = c.panels
    assert ax.floor is None and ax.inf_lane is not None and ax.inf_lane < ax.y(50.0)
    assert _pixels(c.image, pic.BAND, (0, 0, c.image.width, c.image.height)) == 0
    assert _pixels(c.image, pic.EXACT, (ax.x(1.0) - 3, ax.inf_lane - 3, ax.x(1.0) + 3, ax.inf_lane + 3)) >= 9
    # several presets: one panel each, stacked; a preset with no PSNR says so instead of failing
    both = pic.chart(rows + _standin_rows() + [{"row": "unpatched", "preset": "sd15", "s_per_step": 1.0}])
    assert [a.preset for a in both.panels] == ["Flux", "standin-480p"] and both.image.height > c.image.height * 2


def test_heatmap_is_black_for_no_difference_and_bright_for_a_large_one():
    assert int(pic.heatmap(torch.zeros(8, 8)).sum()) == 0
    small, large = pic.heatmap(torch.full((4, 4), 0.01)), pic.heatmap(torch.full((4, 4), 0.5))
    assert 0 < int(small.sum()) < int(large.sum()) and large[0, 0].tolist() == [255, 255, 255]
    assert pic.heatmap(torch.tensor([[float("nan")]]))[0, 0].tolist() == [255, 255, 255]  # a NaN output: the most


def _video_decode(z):
    """A stand-in for a video VAE's decode: [B, C, T, H, W] -> [B, T, 4H, 4W, 3] in [0, 1]."""
    x = torch.sigmoid(z[:, :3]).permute(0, 2, 3, 4, 1)
    return x.repeat_interleave(4, 2).repeat_interleave(4, 3)


def test_frames_show_each_row_beside_its_difference_to_unpatched():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 4, 9, 12, 20, generator=g)
    latents = {"unpatched": base, "sdpa_cudnn": base.clone(), "sage": base + 0.1 * torch.randn(base.shape, generator=g)}
    rows = [_row("unpatched", 1.0, 58.9, True), _row("sdpa_cudnn", 1.4, 58.9, True), _row("sage", 1.6, 50.0),
            {"row": "flash_attn4", "preset": "standin-480p", "error": "not installed"}]
    f = pic.frames(rows, latents, _video_decode)
    assert list(f.heat) == ["unpatched", "sdpa_cudnn", "sage"]  # the failed row has no latent: left out
    assert [len(b) for b in f.heat.values()] == [3, 3, 3]  # a strip of three of the nine frames
    t = pic.to_image(f.image)
    for name, boxes in f.heat.items():
        for x0, y0, x1, y1 in boxes:
            tile = t[0, y0:y1, x0:x1]
            assert tile.shape[:2] == (48, 80)  # the decoded frame's size: no scaling needed
            if name == "sage":
                assert float(tile.max()) > 0.2  # its output differs: the heatmap shows it
            else:
                assert float(tile.max()) == 0.0  # identical latents: a black heatmap
    x0, y0, x1, y1 = f.shown["sage"][0]
    expect = _video_decode(latents["sage"])[0, 0]  # the first frame, shown as decoded
    assert torch.allclose(t[0, y0:y1, x0:x1], (expect * 255).round() / 255, atol=1 / 255 + 1e-6)


def test_frames_of_an_image_model_and_a_vae_that_cannot_decode():
    lat = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    latents = {"unpatched": lat, "auto": lat + 0.2}
    rows = [_row("unpatched", 1.0, math.inf, True, "SD15", "unpatched"), _row("auto", 1.3, 40.0, False, "SD15", "unpatched")]
    image_decode = lambda z: torch.sigmoid(z[:, :3]).permute(0, 2, 3, 1).repeat_interleave(8, 1).repeat_interleave(8, 2)  # noqa: E731
    f = pic.frames(rows, latents, image_decode)
    assert [len(b) for b in f.heat.values()] == [1, 1]  # one image per row
    (x0, y0, x1, y1), = f.heat["auto"]
    assert float(pic.to_image(f.image)[0, y0:y1, x0:x1].max()) > 0
    bad = pic.frames(rows, latents, lambda z: (_ for _ in ()).throw(RuntimeError("expected 16 channels, got 4")))
    assert not bad.heat and bad.image.width >= 320  # a message image, not an exception after a long benchmark
    assert pic.frames(rows[1:], {"auto": lat}, image_decode).heat == {}  # no unpatched row: nothing to compare with


@pytest.mark.parametrize("count, t, want", [(3, 21, [0, 10, 20]), (3, 2, [0, 1]), (3, 1, [0]), (4, 9, [0, 3, 5, 8])])
def test_frame_indices_spread_over_the_clip(count, t, want):
    assert pic.frame_indices(t, count) == want


def test_bench_e2e_writes_the_chart_beside_its_json(tmp_path, capsys):
    import argparse
    import json
    import os
    import sys

    from PIL import Image

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_e2e

    a = argparse.Namespace(md=None, json=str(tmp_path / "e2e.json"), png=None, profile=False)
    meta = {"gpu": "GPU", "torch": "2.x", "date": "2026-01-01", "steps": 10}
    bench_e2e.save(a, meta, "header", _standin_rows(), report, final=True)
    assert len(json.loads((tmp_path / "e2e.json").read_text())["rows"]) == 6
    with Image.open(tmp_path / "e2e-chart.png") as img:
        assert img.size == pic.chart(_standin_rows(), "t").image.size
    assert "| standin-480p | auto |" in capsys.readouterr().out
