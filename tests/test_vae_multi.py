"""VAE Decode / Encode (several GPUs) on the CPU: N = 2, 3 and 4 devices simulated as threads on the CPU, each with its
own copy of the VAE.

Tiny VAEs built from ComfyUI's own classes with random weights (Wan 2.1's, HunyuanVideo's, an image VAE): the decode
over N equals ComfyUI's ``VAE.decode_tiled`` with the same settings bit for bit (and the encode ``encode_tiled``),
differs from the plain decode exactly as ComfyUI's tiled decode does, and every simulated device decoded a tile.  The
tile plan (parallel/vae.py) against ComfyUI's tiling loop, tiles of one size for several GPUs, a tile the plan lacks,
a failing device, the copies kept per VAE, and bad input refused with the reason.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading

import pytest
import torch
from pack import load

P = load()
T = importlib.import_module(P.__name__ + ".parallel.vae")


@pytest.fixture(scope="module")
def cf():
    """ComfyUI imported (CPU), the pack loaded through its loader, one CPU thread per op (ranks are threads), inference
    mode as ComfyUI runs nodes: the pack's nodes.vae module."""
    from comfyui_support import comfy, load_pack

    comfy()
    mod, _ = load_pack()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.inference_mode():
        yield importlib.import_module(mod.__name__ + ".nodes.vae")
    torch.set_num_threads(threads)


def _fill(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():  # ComfyUI's layers skip initialisation: fill every parameter
            scale = p[0].numel() ** -0.5 if p.ndim > 1 else 0.05
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith(("gamma", "norm.weight")) else 0))
    return m


def detected(sd: dict, model):
    """``comfy.sd.VAE`` built from ``sd`` (the tensors its detection reads, at their full-size shapes: the settings of
    that VAE kind), with ``model`` (a smaller one of the class it built) as its model."""
    import comfy.model_patcher
    import comfy.sd

    logging.disable(logging.WARNING)  # "Missing VAE keys": the state dict holds only what the detection reads
    try:
        vae = comfy.sd.VAE(sd=sd)
    finally:
        logging.disable(logging.NOTSET)
    assert type(vae.first_stage_model) is type(model)
    vae.first_stage_model = model.eval().to(vae.vae_dtype)
    vae.patcher = comfy.model_patcher.ModelPatcher(model, load_device=vae.device, offload_device=vae.device)
    vae.size = None
    return vae


def wan_vae(seed=0):
    """A Wan 2.1 VAE as ``comfy.sd.VAE`` detects one (x4 in time, x8 in space, 16 latent channels), its model ComfyUI's
    WanVAE with 8 base channels instead of 96."""
    import comfy.ldm.wan.vae as wan

    z = torch.zeros
    sd = {"decoder.middle.0.residual.0.gamma": z(384, 1, 1, 1), "decoder.head.0.gamma": z(96, 1, 1, 1),
          "encoder.conv1.weight": z(96, 3, 3, 3, 3), "decoder.head.2.weight": z(3, 96, 3, 3, 3)}
    return detected(sd, _fill(wan.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                         temperal_downsample=[False, True, True], dropout=0.0), seed))


def hunyuan_vae(seed=0):
    """A HunyuanVideo VAE as ``comfy.sd.VAE`` detects one (its 3-D AutoencoderKL: x4 in time, x8 in space, 16 latent
    channels), its model of the same class with 32 base channels and one block per level."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    sd = {"decoder.conv_in.conv.weight": torch.zeros(512, 16, 3, 3, 3),
          "post_quant_conv.weight": torch.zeros(16, 16, 1, 1, 1)}
    dd = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0, "conv3d": True,
          "time_compress": 4}
    return detected(sd, _fill(AutoencoderKL(ddconfig=dd, embed_dim=16), seed))


def image_vae():
    from comfyui_support import tiny_vae

    return tiny_vae()


def latent(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def decoded(cf, vae, lat, n, **settings):
    out, report = cf.decode(vae, lat, simulate=n, **settings)
    return out, report


def assert_as_comfyui(vae, lat, out, report, n, plain=None):
    """``out`` is ComfyUI's decode_tiled with the tiles ``report`` names, bit for bit; its difference to the plain
    decode is ComfyUI's tiled decode's; each of the ``n`` devices decoded a tile."""
    ref = vae.decode_tiled(lat, **report.tiling.args())
    assert torch.equal(out, ref), float((out - ref).abs().max())
    assert len(report.counts) == n and min(report.counts) >= 1 and report.unplanned == 0, report
    if plain is not None:
        assert torch.equal((out - plain).abs(), (ref - plain).abs())
        assert float((out - plain).abs().max()) > 0  # tiles really were blended


# ---------------------------------------------------------------- the plan against ComfyUI's loop


@pytest.mark.parametrize("shape,tile,overlap", [
    ((1, 2, 5, 12, 20), (999, 8, 12), (1, 2, 2)),
    ((1, 2, 5, 12, 20), (2, 6, 7), (1, 2, 3)),
    ((2, 2, 13, 17), (6, 5), (2, 2)),
    ((1, 2, 3, 8, 8), (999, 8, 8), (1, 2, 2)),  # fits in one tile
    ((1, 2, 21, 90, 160), (999, 49, 84), (1, 8, 8)),
])
def test_the_plan_is_the_views_comfyuis_tiling_loop_takes_in_its_order(cf, shape, tile, overlap):
    import comfy.utils

    x = torch.zeros(shape)
    seen = []

    def record(v):
        seen.append((v.data_ptr(), tuple(v.shape), v.stride()))
        return torch.zeros(v.shape[0], 3, *v.shape[2:])

    comfy.utils.tiled_scale_multidim(x, record, tile=tile, overlap=overlap, upscale_amount=1, out_channels=3)
    assert [(v.data_ptr(), tuple(v.shape), v.stride()) for v in T.tiles(x, tile, overlap)] == seen


def test_a_tile_not_larger_than_its_overlap_is_refused():
    with pytest.raises(ValueError, match="a tile of 4 along a dimension of 12 is not larger than its overlap of 4"):
        T.tiles(torch.zeros(1, 2, 3, 12, 12), (999, 4, 8), (1, 4, 4))
    assert len(T.tiles(torch.zeros(1, 2, 3, 4, 12), (999, 4, 8), (1, 4, 4))) == 2  # a dimension in one tile: no step


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("h,w", [(90, 160), (60, 104), (160, 90), (30, 52)])
def test_even_tiles_give_one_tile_per_device_all_of_one_size(n, h, w):
    th, tw = T.even_tiles((21, h, w), n, 8)
    rows, cols = T.tiles_along(h, th, 8), T.tiles_along(w, tw, 8)
    assert len(rows) * len(cols) == n
    for starts, size, length in ((rows, th, h), (cols, tw, w)):
        sizes = [min(size, length - s) for s in starts]
        assert max(sizes) - min(sizes) <= len(starts), sizes  # the last is at most a few shorter
        assert size > 8 or len(starts) == 1


def test_even_tiles_grow_in_number_until_one_fits_and_keep_the_encoders_grid():
    th, tw = T.even_tiles((21, 90, 160), 2, 8, fits=lambda t: t[0] * t[1] <= 49 * 84)
    assert len(T.tiles_along(90, th, 8)) * len(T.tiles_along(160, tw, 8)) == 4
    th, tw = T.even_tiles((81, 720, 1280), 2, 64, multiple=8)
    assert tw % 8 == 0 and (th == 720 or th % 8 == 0) and len(T.tiles_along(1280, tw, 64)) == 2
    assert T.even_tiles((3, 6, 6), 4, 8) == (6, 6)  # too small to cut: one tile


# ---------------------------------------------------------------- decode and encode against ComfyUI's


@pytest.mark.parametrize("n", [2, 3, 4])
def test_wan_decode_over_n_devices_is_comfyuis_tiled_decode_bit_for_bit(cf, n):
    vae, lat = wan_vae(), latent(1, 16, 3, 12, 20)
    plain = vae.decode(lat)
    out, report = decoded(cf, vae, lat, n, overlap=16)
    assert out.shape == plain.shape == (1, 9, 96, 160, 3)
    assert_as_comfyui(vae, lat, out, report, n, plain)


def test_wan_decode_with_square_tiles_and_temporal_tiles_as_vae_decode_tiled(cf):
    """Settings as VAE Decode (Tiled) takes them: its node, on one device, gives the same frames."""
    import nodes

    vae, lat = wan_vae(), latent(1, 16, 3, 12, 20)
    settings = {"tile_size": 64, "overlap": 16, "temporal_size": 8, "temporal_overlap": 4}
    out, report = decoded(cf, vae, lat, 3, **settings)
    assert sum(report.counts) == 12  # 2 x 3 in space, 2 in time
    assert_as_comfyui(vae, lat, out, report, 3)
    (ref,) = nodes.VAEDecodeTiled().decode(vae, {"samples": lat}, **settings)
    assert torch.equal(out.reshape(ref.shape), ref)


def test_hunyuan_video_decode_over_two_devices_is_comfyuis_tiled_decode_bit_for_bit(cf):
    vae, lat = hunyuan_vae(), latent(1, 16, 2, 8, 12)
    plain = vae.decode(lat)
    out, report = decoded(cf, vae, lat, 2, overlap=16)
    assert out.shape == plain.shape == (1, 5, 64, 96, 3)
    assert_as_comfyui(vae, lat, out, report, 2, plain)


def test_image_decode_and_encode_over_three_devices_are_comfyuis_tiled_ones(cf):
    """An image VAE's tiled decode averages three tilings (and its encode three others): each is planned."""
    vae = image_vae()
    lat = latent(2, 16, 24, 20)
    out, report = decoded(cf, vae, lat, 3, tile_size=128, overlap=32)
    assert_as_comfyui(vae, lat, out, report, 3)
    pixels = torch.rand(2, 160, 136, 3, generator=torch.Generator().manual_seed(2))
    z, report = cf.encode(vae, pixels, tile_size=64, overlap=16, simulate=3)
    assert torch.equal(z, vae.encode_tiled(pixels, **report.tiling.args()))
    assert min(report.counts) >= 1


@pytest.mark.parametrize("n", [2, 4])
def test_wan_encode_over_n_devices_is_comfyuis_tiled_encode_bit_for_bit(cf, n):
    vae = wan_vae()
    frames = torch.rand(9, 96, 160, 3, generator=torch.Generator().manual_seed(3))
    z, report = cf.encode(vae, frames, overlap=32, simulate=n)
    ref = vae.encode_tiled(frames, **report.tiling.args())
    assert z.shape == ref.shape == (1, 16, 3, 12, 20)
    assert torch.equal(z, ref) and len(report.counts) == n and min(report.counts) >= 1
    assert report.tiling.tile_y % 8 == 0


def test_one_device_decodes_with_comfyuis_tiled_decode_and_says_why(cf, caplog):
    vae, lat = wan_vae(), latent(1, 16, 3, 12, 20)
    with caplog.at_level(logging.INFO, logger="patch_attention.vae"):
        out, report = cf.decode(vae, lat, overlap=16)  # on the CPU, not simulated: the VAE's own device
    assert report.why == "the VAE runs on the CPU" and report.counts == [0]
    assert torch.equal(out, vae.decode_tiled(lat, **report.tiling.args()))
    assert [r.getMessage() for r in caplog.records] == [
        "VAE Decode (several GPUs): one device (cpu): the VAE runs on the CPU; ComfyUI's tiled decode there"]


def test_the_node_returns_frames_as_vae_decode_tiled_and_its_errors_name_it(cf):
    from comfyui_support import load_pack

    _, mappings = load_pack()
    defs = importlib.import_module(cf.__name__.rsplit(".", 1)[0] + ".definitions")
    vae, lat = wan_vae(), latent(1, 16, 3, 12, 20)
    (images,) = defs.VAE_DECODE.run(samples={"samples": lat}, vae=vae, tile_size=64)  # overlap 64 // 4
    assert images.shape == (9, 96, 160, 3)
    assert torch.equal(images, vae.decode_tiled(lat, tile_x=8, tile_y=8, overlap=2).reshape(images.shape))
    (z,) = defs.VAE_ENCODE.run(pixels=images, vae=vae)
    assert z["samples"].shape == (1, 16, 3, 12, 20)
    with pytest.raises(ValueError, match=r"^VAE Decode \(several GPUs\): the latent has 4 channels, this VAE takes 16"):
        defs.VAE_DECODE.run(samples={"samples": latent(1, 4, 3, 12, 20)}, vae=vae)
    assert {"VAEDecodeMultiGPU", "VAEEncodeMultiGPU"} <= set(mappings)


@pytest.mark.parametrize("settings,lat_shape,msg", [
    ({}, (1, 48, 3, 12, 20), "the latent has 48 channels, this VAE takes 16"),
    ({}, (1, 16, 12, 20), r"a latent of shape \(1, 16, 12, 20\) for a VAE of video latents"),
    ({"tile_size": 128, "overlap": 64}, (1, 16, 3, 12, 20), "a tile must be at least 4x its overlap"),
    ({"temporal_size": 8, "temporal_overlap": 8}, (1, 16, 3, 12, 20), "a tile must be at least 2x its overlap"),
    ({"overlap": -8}, (1, 16, 3, 12, 20), "0 or more"),
])
def test_bad_input_is_refused_with_the_reason(cf, settings, lat_shape, msg):
    with pytest.raises(ValueError, match=msg):
        cf.decode(wan_vae(), latent(*lat_shape), simulate=2, **settings)


def test_an_encode_tile_not_larger_than_its_overlap_is_refused(cf):
    with pytest.raises(ValueError, match="a tile must be larger than its overlap"):
        cf.encode(wan_vae(), torch.rand(9, 96, 160, 3), tile_size=64, overlap=64, simulate=2)


# ---------------------------------------------------------------- the copies


def test_copies_are_made_once_per_vae_and_device_and_go_with_the_vae(cf):
    vae, lat = wan_vae(), latent(1, 16, 3, 12, 20)
    cf.decode(vae, lat, overlap=16, simulate=3)
    first = cf.patchers(vae, [vae.device] * 3)
    assert first[0] is vae.patcher and len({id(p) for p in first}) == 3
    assert all(p.model is not vae.first_stage_model for p in first[1:])
    cf.decode(vae, lat, overlap=16, simulate=3)
    assert all(a is b for a, b in zip(cf.patchers(vae, [vae.device] * 3), first))
    gone = [p.model for p in first[1:]]
    watch = [__import__("weakref").ref(m) for m in gone]
    del vae, first, gone
    gc.collect()
    assert all(w() is None for w in watch)


# ---------------------------------------------------------------- the run: outside the plan, a failing device


def test_a_tile_outside_the_plan_is_decoded_on_the_first_device_and_counted(cf, caplog):
    import comfy.utils

    x = latent(1, 2, 12, 20)
    calls = [((8, 8), (2, 2))]
    plan = T.tiles(x, *calls[0])
    del plan[3]  # the loop will ask for a tile the plan lacks
    twice = [lambda v: v * 2] * 3
    with caplog.at_level(logging.WARNING, logger="patch_attention.vae"):
        with T.TileRun(plan, twice, ["cpu"] * 3) as run:
            out = comfy.utils.tiled_scale_multidim(x, run, tile=(8, 8), overlap=(2, 2), upscale_amount=1, out_channels=2)
    ref = comfy.utils.tiled_scale_multidim(x, lambda v: v * 2, tile=(8, 8), overlap=(2, 2), upscale_amount=1,
                                           out_channels=2)
    assert torch.equal(out, ref)
    assert run.unplanned >= 1 and sum(run.counts) + run.unplanned <= len(plan) + 1
    assert any("outside the plan" in r.getMessage() for r in caplog.records)


def test_a_failing_device_stops_the_run_with_its_error_and_no_thread_is_left(cf):
    import comfy.utils

    x = latent(1, 2, 12, 20)
    plan = T.tiles(x, (8, 8), (2, 2))
    before = threading.active_count()

    def broken(v):
        raise RuntimeError("device 1 is broken")

    with pytest.raises(RuntimeError, match="device 1 is broken"):
        with T.TileRun(plan, [lambda v: v, broken], ["cpu"] * 2) as run:
            comfy.utils.tiled_scale_multidim(x, run, tile=(8, 8), overlap=(2, 2), upscale_amount=1, out_channels=2)
    assert threading.active_count() == before
