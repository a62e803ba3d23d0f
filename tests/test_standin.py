"""The stand-in (tools/standin.py) on the CPU at tiny widths: the code path the H100 trains at Wan 1.3B's geometry.

It trains a few steps, saves, loads through ComfyUI's own ``comfy.sd.load_diffusion_model`` (model detection infers
the config from the keys), samples through ComfyUI, measures its attention's concentration during sampling, and runs
the end-to-end benchmark's quality columns against its fp32 copy.
"""

import importlib.util
import os

import pytest
import torch
from comfyui_support import comfy

pytestmark = pytest.mark.comfyui

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = (2, 8, 12)  # latent T, H, W: 2 x 4 x 6 = 48 tokens


def _standin():
    """tools/standin.py as the benchmark loads it."""
    from bench_e2e import standin_module

    return standin_module()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    comfy()
    sd = _standin()
    path = str(tmp_path_factory.mktemp("standin") / "tiny.safetensors")
    logs = []
    meta = sd.make(sd.TINY, path, device="cpu", seed=3, steps=4, seconds=120, grids=sd.TINY_GRIDS, tokens_per_step=64,
                   text_tokens=8, images=(sd.procedural_images(2, 48, 3), "procedural textures (test)"), lr=1e-3,
                   warmup=1, log=logs.append)
    return sd, path, meta, logs


def test_standin_trains_saves_and_loads_through_comfyuis_loader(trained):
    import comfy.model_base
    import comfy.sd
    from safetensors.torch import load_file

    sd, path, meta, logs = trained
    assert meta["train"]["steps"] == 4 and meta["train"]["stopped_by"] == "steps" and len(meta["priors"]) == 2
    assert meta == sd.read_meta(path) and any("saved" in line for line in logs)
    saved = load_file(path)
    assert not any(k.startswith("model.") for k in saved)  # a bare diffusion-model state dict, as ComfyUI ships Wan
    loaded = comfy.sd.load_diffusion_model(path)
    m = loaded.model
    assert isinstance(m, comfy.model_base.WAN21) and type(m.model_config).__name__ == "WAN21_T2V"
    dm = m.diffusion_model
    assert (dm.dim, dm.ffn_dim, dm.num_heads, len(dm.blocks), dm.freq_dim, dm.text_dim) == (128, 256, 1, 2, 256, 4096)
    assert m.model_sampling.shift == 8.0  # WAN21_T2V's ModelSamplingDiscreteFlow
    got = dm.state_dict()
    assert set(got) == set(saved) and all(torch.equal(got[k].to(saved[k].dtype), saved[k]) for k in saved)
    # training moved the weights away from their initialisation (the zero output layer first of all)
    assert saved["head.head.weight"].abs().max() > 0
    # the RoPE prior: equal q and k biases on the self-attention, at the norms' gain
    b0 = saved["blocks.0.self_attn.q.bias"].float()
    assert b0.abs().max() > 0.5 and torch.allclose(saved["blocks.0.self_attn.k.bias"].float(), b0, atol=0.05)


def test_standin_samples_through_comfyui_and_decodes_frames(trained):
    sd, path, meta, _ = trained
    patcher = sd.load(path, torch.float32, "cpu")
    pos, neg = sd.conditioning(meta)
    assert pos[0][0].shape == (1, 8, 4096) and neg[0][0].shape == (1, 8, 4096)
    a = sd.sample(patcher, GRID, pos, neg, steps=3, seed=1)
    b = sd.sample(patcher, GRID, pos, neg, steps=3, seed=1)
    assert a.shape == (1, 16, *GRID) and torch.isfinite(a).all() and torch.equal(a, b)  # seeded
    frames = sd.decode(patcher, a, meta)
    assert frames.shape == (1, 3, GRID[0], 2 * GRID[1], 2 * GRID[2]) and 0 <= frames.min() and frames.max() <= 1


def test_codec_round_trips_frames_and_scenes_move():
    sd = _standin()
    g = torch.Generator().manual_seed(0)
    scenes = sd.Scenes(sd.procedural_images(2, 48, 0))
    clip, cls = scenes.clip(5, 16, 24, g)
    assert clip.shape == (3, 5, 16, 24) and 0 <= cls < 2 * len(sd.KINDS)
    codec = sd.Codec(1)
    z = codec.encode(clip[None])
    assert z.shape == (1, 16, 5, 8, 12)
    assert torch.allclose(codec.decode(z), clip[None], atol=1e-5)
    data = sd.Data("cpu", 0, 8, images=(sd.procedural_images(2, 48, 0), "test"))
    x0, c = data.batch(3, (4, 8, 12), torch.Generator().manual_seed(1))
    assert x0.shape == (3, 16, 4, 8, 12) and 0.3 < float(x0.std()) < 3 and c.shape == (3,)
    assert data.captions.shape == (2 * len(sd.KINDS) + 1, 8, 4096)


def test_concentration_is_measured_during_sampling(trained):
    sd, path, meta, _ = trained
    patcher = sd.load(path, torch.float32, "cpu")
    pos, neg = sd.conditioning(meta)
    res = sd.measure_concentration(patcher, GRID, pos, neg, steps=3, measure=(1, 2), chunk=128)
    assert sorted((r["step"], r["layer"]) for r in res) == [(1, 0), (1, 1), (2, 0), (2, 1)]  # both blocks, both steps
    st = res[0]["stats"]
    assert st.grid == (2, 4, 6) and len(st.heads) == 1
    h = st.heads[0]
    assert 0 < h.block_share_90 <= 1 and 0 < h.window_mass <= 1 + 1e-6 and h.spatial_mass + 1e-6 >= 0


def test_benchmark_reports_psnr_and_ssim_against_the_fp32_run(trained, pack_backend):
    """Rows against the stand-in's fp32 run: exact rows at the floor, a lossy row below it, the table says so."""
    from pack import load

    sd, path, meta, _ = trained
    mod = load()  # the pack the pack_backend fixture registers in
    e2e = importlib.import_module(mod.__name__ + ".measure.e2e")
    A = mod.attention

    def lossy(q, k, v, *, layout, mask, scale, opts):  # q and k on a coarse grid: an 8-bit-like error
        q, k = ((t.float() * 8).round() / 8 for t in (q, k))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v.float(), scale=scale)
        return o.to(v.dtype)

    pack_backend(A.Backend(name="t_coarse", family="test", fn=lossy, constraints=(), layouts=("HND",), accuracy="8bit"))
    pos, neg = sd.conditioning(meta)
    model = sd.load(path, torch.float32, "cpu")
    job = e2e.Job(model, pos, neg, torch.zeros(1, 16, *GRID), steps=3, label="tiny-standin",
                  extra={"decode": lambda lat: sd.decode(model, lat, meta)}, reference=sd.load(path, torch.float32, "cpu"))
    rows = e2e.measure(job, ["unpatched", "sdpa_math", "t_coarse"])
    by = {r["row"]: r for r in rows}
    assert all(r["reference"] == "fp32" for r in rows)
    assert by["unpatched"]["exact"] and by["sdpa_math"]["exact"] and not by["t_coarse"]["exact"]
    floor = by["unpatched"]["floor_psnr"]
    assert floor == min(by["unpatched"]["psnr"], by["sdpa_math"]["psnr"]) and floor > 60
    assert by["unpatched"]["quality"] == "at the exact floor" and by["sdpa_math"]["quality"] == "at the exact floor"
    assert by["t_coarse"]["psnr"] < floor - 1 and "below the floor" in by["t_coarse"]["quality"]
    assert 0 < by["t_coarse"]["ssim"] < 1 and "psnr_frames" in by["t_coarse"]
    assert by["sdpa_math"]["psnr_vs_unpatched"] > 60 and by["unpatched"]["psnr_vs_unpatched"] == float("inf")
    md = importlib.import_module(mod.__name__ + ".measure.report").render_markdown(rows)
    assert "PSNR dB / SSIM vs fp32" in md and "dB below the floor" in md and "Exact floor" in md
    assert "Exact kernels against the unpatched one (PSNR): sdpa_math " in md


def test_gpu_stage_dry_run_on_the_cpu(tmp_path):
    """tests/gpu/quality.py --tiny: the H100 stage's whole flow (train, load, concentration, rows, calibration, 720p)
    on the CPU with a tiny model, so that the one H100 run does not fail on a bug a CPU can find."""
    comfy()
    from comfy.cli_args import args

    spec = importlib.util.spec_from_file_location("pa_quality_stage", os.path.join(ROOT, "tests", "gpu", "quality.py"))
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    smart = args.disable_smart_memory  # the stage sets it, as bench_e2e.py does: restored for the other tests
    try:
        res = stage.main(["--tiny", "--out", str(tmp_path), "--budget", "900", "--train-seconds", "60",
                          "--weights", str(tmp_path / "w.safetensors"), "--rows", "unpatched"])
    finally:
        args.disable_smart_memory = smart
    assert not res["errors"], res["errors"]
    assert res["train"]["train"]["steps"] == 6
    for key in ("concentration-init", "concentration-480p", "concentration-720p"):
        assert res[key]["overall"]["heads"] >= 1
    rows = {r["row"]: r for r in res["rows-480p"]}
    assert {"unpatched", "sdpa_math", stage.DRYRUN_LOSSY, "auto", "auto_fast"} <= set(rows)
    assert rows[stage.DRYRUN_LOSSY]["psnr"] < rows["sdpa_math"]["psnr"]
    assert res["per_call"][stage.DRYRUN_LOSSY]["cos"] < 1.0
    assert res["calibration"]["gate"]["floor_psnr"] == rows["unpatched"]["floor_psnr"]
    assert len(res["calibration"]["curve"]) == 4 and "rows-720p" in res
    for key in ("rows-480p", "rows-720p"):  # the benchmark's pictures of each run: chart, frames through the codec
        assert (tmp_path / f"{key}-chart.png").stat().st_size > 0 and (tmp_path / f"{key}-frames.png").stat().st_size > 0
    md = (tmp_path / "quality.md").read_text()
    assert "## Attention concentration, 480p/81f" in md and "## Calibration (480p)" in md
    assert "## End to end at 480p/81f" in md and "## End to end at 720p/81f" in md and "Exact floor: PSNR" in md
