"""Against a real ComfyUI: the pack loads through ComfyUI's loader, and patched models sample correctly.

Skipped (with the reason) when no ComfyUI is found; see README for COMFYUI_PATH.
"""

import json
import logging

import pytest
import torch
from comfyui_support import load_pack, sample, tiny_flux, tiny_sd

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def pack():
    return load_pack()


def run_node(mappings, node_id, **kwargs):
    cls = mappings[node_id]
    if hasattr(cls, "execute"):  # V3
        out = cls.execute(**kwargs)
        return out.result
    return getattr(cls(), cls.FUNCTION)(**kwargs)


def patch(mappings, model, backend, **kw):
    args = dict(model=model, backend=backend, fallback=True, start_percent=0.0, end_percent=1.0, dense_layers="", log_stats=False)
    args.update(kw)
    return run_node(mappings, "PatchAttention", **args)[0]


def stats_of(pack_mod, model):
    ov = pack_mod.nodes.patch.override_of(model)
    assert ov is not None, "the clone carries no Patch Attention override"
    return ov.stats


def rel(a, b):
    return ((a - b).abs().sum() / b.abs().sum()).item()


def test_pack_loads_through_comfyui_loader(pack):
    mod, mappings = pack
    for node_id in ("PatchAttention", "SpargeAttnSettings", "AttentionBackendsInfo"):
        assert node_id in mappings
    import nodes

    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["PatchAttention"] == "Patch Attention"
    # V3 schema where comfy_api exists: the backend combo lists auto, disabled and every registry backend
    cls = mappings["PatchAttention"]
    info = cls.GET_SCHEMA() if hasattr(cls, "GET_SCHEMA") else None
    if info is not None:
        combo = next(i for i in info.inputs if i.id == "backend")
        assert combo.options[:2] == ["auto", "disabled"] and "sage_fp8_sm90" in combo.options and "sdpa" in combo.options


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "sage", "auto"])
def test_patched_flux_samples_like_the_unpatched_model(pack, backend):
    mod, mappings = pack
    base = tiny_flux()
    ref = sample(base)
    patched = patch(mappings, base, backend)
    out = sample(patched)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-4
    st = stats_of(mod, patched)
    assert st.total_calls == 8  # 2 attention layers x 4 steps, all through the override
    if backend == "sage":  # not installed on CPU: counted fallback to the fastest exact kernel (SDPA, the only exact
        # one on the CPU), same result, on the full path and on the lean path after it
        assert st.calls == {"sdpa": 8}
        assert sum(n for (f, _, _), n in st.fallbacks.items() if f == "sage") == 8


def test_sd_unet_head_dims_40_and_80_with_padding(pack):
    mod, mappings = pack
    reg = mod.attention.REGISTRY
    from importlib import import_module

    constraints = import_module(mod.attention.__name__ + ".constraints")
    seen = []

    def fn(q, k, v, *, layout, mask, scale, opts):
        seen.append(q.shape[-1])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    be = mod.attention.Backend(name="t_pad_cpu", family="test", fn=fn, constraints=(constraints.HeadDims(dims=(64, 96, 128)),),
                               probe=lambda: mod.attention.Availability(True, version="t"))
    reg.register(be)
    try:
        base = tiny_sd()
        ref = sample(base, "sd", steps=2, cfg=2.0)
        out = sample(patch(mappings, base, "t_pad_cpu"), "sd", steps=2, cfg=2.0)
        assert set(seen) == {64, 96}  # 40 -> 64, 80 -> 96
        assert rel(out, ref) < 1e-4
    finally:
        reg.unregister("t_pad_cpu")


def test_clone_rule_input_model_and_other_clones_untouched(pack):
    mod, mappings = pack
    base = tiny_flux()
    before = dict(base.model_options.get("transformer_options", {}))
    a = patch(mappings, base, "sdpa")
    b = patch(mappings, base, "sdpa_math")
    assert base.model_options.get("transformer_options", {}) == before
    assert "optimized_attention_override" not in base.model_options.get("transformer_options", {})
    sample(a)
    sample(b)
    sample(base)
    assert stats_of(mod, a).calls == {"comfyui": 8}  # `sdpa` hands the call to ComfyUI's own attention_pytorch
    assert stats_of(mod, b).calls == {"sdpa_math": 8}
    # re-patching a patched model replaces its backend; "disabled" removes it
    c = patch(mappings, a, "sdpa_math")
    sample(c)
    assert stats_of(mod, c).calls == {"sdpa_math": 8} and stats_of(mod, a).calls == {"comfyui": 8}
    d = patch(mappings, a, "disabled")
    assert mod.nodes.patch.override_of(d) is None and mod.nodes.patch.override_of(a) is not None


def test_step_schedule_in_real_sampling(pack):
    mod, mappings = pack
    base = tiny_flux()
    m = patch(mappings, base, "sdpa_math", start_percent=0.0, end_percent=0.5)
    ref = sample(base, steps=4)
    out = sample(m, steps=4)
    st = stats_of(mod, m)
    # fast backend early; dense late, on the fastest exact kernel (SDPA: the only exact one on the CPU), not ComfyUI's
    # own function (on 0.33 with a GPU that runs FlashAttention-2 first)
    assert st.calls["sdpa_math"] > 0 and st.calls["sdpa"] > 0 and "comfyui" not in st.calls
    assert st.calls["sdpa_math"] + st.calls["sdpa"] == 8
    assert st.calls["sdpa_math"] < 8
    assert rel(out, ref) < 1e-4
    late = patch(mappings, base, "sdpa_math", start_percent=0.5, end_percent=1.0)
    sample(late, steps=4)
    st2 = stats_of(mod, late)
    assert st2.calls["sdpa_math"] + st2.calls["sdpa"] == 8
    assert st2.calls["sdpa_math"] == 8 - st.calls["sdpa_math"] or st2.calls["sdpa_math"] > 0


def test_block_filter_in_real_sampling(pack):
    mod, mappings = pack
    base = tiny_flux()
    m = patch(mappings, base, "sdpa_math", dense_layers="0")
    sample(m, steps=3)
    st = stats_of(mod, m)
    assert st.calls == {"sdpa_math": 3, "sdpa": 3}  # layer 0 (the double block) dense (the fastest exact) in every step
    with pytest.raises(ValueError, match="cannot read 'x'"):
        patch(mappings, base, "sdpa_math", dense_layers="x")


def test_log_stats_after_sampling(pack, caplog):
    mod, mappings = pack
    m = patch(mappings, tiny_flux(), "sdpa_math", log_stats=True)
    with caplog.at_level(logging.INFO, logger="patch_attention.nodes"):
        sample(m, steps=2)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "patch_attention.nodes")
    assert "Patch Attention (sdpa_math)" in text and "sdpa_math" in text and "4 calls" in text and " ms" in text


def test_fallback_off_stops_with_the_reason(pack):
    mod, mappings = pack
    # sparse_start_percent 0: the first step already runs the sparse kernel (by default it waits for 20 % of the run)
    m = patch(mappings, tiny_flux(), "sparge", fallback=False, sparse_start_percent=0.0)
    with pytest.raises(Exception, match="cannot take .*fallback is off"):
        sample(m, steps=1)


def test_old_comfyui_without_the_hook_is_told_so(pack, monkeypatch):
    mod, mappings = pack
    import comfy.ldm.modules.attention as ca

    monkeypatch.delattr(ca, "wrap_attn")
    with pytest.raises(RuntimeError, match="no attention override hook.*Update ComfyUI"):
        patch(mappings, tiny_flux(), "sdpa")


def test_info_node_reports_backends(pack):
    mod, mappings = pack
    (text,) = run_node(mappings, "AttentionBackendsInfo")
    assert "[      yes] sdpa" in text
    if torch.cuda.is_available():
        assert "sage_fp8_sm90" in text and "install.py" in text
    else:  # what runs here, and no advice about GPU kernels
        assert "no CUDA GPU" in text and "sage_fp8_sm90" not in text and "install.py" not in text


def test_sparge_settings_node_feeds_patch(pack, tmp_path):
    mod, mappings = pack
    (settings,) = run_node(mappings, "SpargeAttnSettings", variant="sparge", simthreshd1=0.5, cdfthreshd=0.97, pvthreshd=20.0)
    assert settings.options == {"simthreshd1": 0.5, "cdfthreshd": 0.97, "pvthreshd": 20.0}
    m = patch(mappings, tiny_flux(), "sparge", sparse_settings=settings)
    assert mod.nodes.patch.override_of(m).config.options["sparge"]["cdfthreshd"] == 0.97
    with pytest.raises(ValueError, match=r"^SpargeAttn Settings: profile 'missing.json' is not in models/sparge_profiles"):
        run_node(mappings, "SpargeAttnSettings", variant="sparge", simthreshd1=0.5, cdfthreshd=0.97, pvthreshd=20.0,
                 profile="missing.json")


def test_tune_sparge_node_writes_a_profile_that_patch_attention_loads(pack, tmp_path, monkeypatch):
    """Mechanics on CPU with a stand-in SpargeAttn kernel (the real one needs CUDA; its numbers come from tests/gpu)."""
    mod, mappings = pack
    monkeypatch.setattr(mod.nodes.files, "folders", lambda: [str(tmp_path)])  # models/sparge_profiles
    A = mod.attention
    constraints = __import__(A.__name__ + ".constraints", fromlist=["x"])

    def fake_sparge(q, k, v, *, layout, mask, scale, opts):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return o + (1 - opts["cdfthreshd"]) * 0.3 * o.std() * torch.randn_like(o), {"sparsity": 1 - opts["cdfthreshd"]}

    reg = A.REGISTRY
    real = reg.get("sparge")
    reg.unregister("sparge")
    reg.register(A.Backend(name="sparge", family="sparge", fn=fake_sparge, constraints=(constraints.MinSeqLen(q=16, kv=16),),
                           probe=lambda: A.Availability(True, version="stand-in"), quantized=True))
    mod.attention.dispatch.clear_plan_cache()
    import comfy.utils
    from comfy_execution.utils import CurrentNodeContext

    bars = []
    hook = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None, **kw: bars.append((node_id, value, total)))
    try:
        base = tiny_flux()
        path = tmp_path / "tiny.json"
        with CurrentNodeContext("p1", "9"):  # ComfyUI runs the Tune node as node 9, before the sampler
            (tuned,) = run_node(mappings, "TuneSpargeAttn", model=base, variant="sparge", error_budget=0.02,
                                profile_name="tiny")
        ref = sample(base, steps=2)
        out = sample(tuned, steps=2)
        assert rel(out, ref) < 1e-4  # a tuning run samples dense
        # the tuning run's steps on the Tune node's bar (the sampler's own bar is off in these samples)
        # (ComfyUI 0.33's bar sends the first and the last update at once and throttles those between)
        mine = [b for b in bars if b[0] == "9"]
        values = [v for _, v, _ in mine]
        assert mine and {t for _, _, t in mine} == {2} and values[0] == 0 and values[-1] == 2, bars
        assert values == sorted(values)
        prof = json.loads(path.read_text())
        assert set(prof["layers"]) == {"0", "1"} and prof["model"]["class"] == "Flux"
        for e in prof["layers"].values():
            assert e["rel_l1"] <= 0.02 and e["calls"] == 2 and e["cdfthreshd"] < 0.999
        (settings,) = run_node(mappings, "SpargeAttnSettings", variant="sparge", simthreshd1=0.6, cdfthreshd=0.98, pvthreshd=50.0,
                               profile="tiny.json", report_error_every=1)
        m = patch(mappings, base, "sparge", sparse_settings=settings, log_stats=True)
        sample(m, steps=2)
        st = stats_of(mod, m).as_dict()
        assert st["calls"] == {"sparge": 4}
        assert "sparge@layer0.sparsity" in st["metrics"] and "sparge@layer1.rel_l1_vs_dense" in st["metrics"]
        # another model's profile is refused with the reason
        other = tiny_flux()
        with torch.no_grad():
            next(other.model.diffusion_model.parameters()).add_(1.0)
        with pytest.raises(ValueError, match="tuned for another model"):
            patch(mappings, other, "sparge", sparse_settings=settings)
    finally:
        comfy.utils.set_progress_bar_global_hook(hook)
        reg.unregister("sparge")
        reg.register(real)
        mod.attention.dispatch.clear_plan_cache()


def test_nan_from_a_quantized_kernel_on_a_zeroed_prompt_is_redone_dense(pack):
    """SageAttention returns NaN when all keys are equal (a zeroed negative prompt does that to cross-attention).
    A stand-in kernel with that behaviour: the sampled image must still equal the unpatched one."""
    mod, mappings = pack
    A = mod.attention

    def sage_like(q, k, v, *, layout, mask, scale, opts):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        degenerate = (k.float().std(dim=2) == 0).flatten(1).all(dim=1)  # per batch element
        return torch.where(degenerate.view(-1, 1, 1, 1), torch.full_like(o, float("nan")), o)

    A.REGISTRY.register(A.Backend(name="t_sage_like", family="test", fn=sage_like, constraints=(),
                                  probe=lambda: A.Availability(True), quantized=True))
    try:
        base = tiny_sd()
        ref = sample(base, "sd", steps=2, cfg=2.0)
        m = patch(mappings, base, "t_sage_like")
        out = sample(m, "sd", steps=2, cfg=2.0)
        assert torch.isfinite(out).all() and rel(out, ref) < 1e-4
        st = stats_of(mod, m)
        assert any(r == "non-finite output (forward redone)" for (_, _, r) in st.fallbacks)
        assert mod.nodes.patch.override_of(m).nonfinite_layers  # the cross-attention layers went dense
        off = patch(mappings, base, "t_sage_like", check_finite=False)
        assert not torch.isfinite(sample(off, "sd", steps=2, cfg=2.0)).all()  # what the check prevents
    finally:
        A.REGISTRY.unregister("t_sage_like")


def test_end_to_end_benchmark_node_on_a_real_model(pack):
    """The node samples the user's model once per row: unpatched first, ratios and latent error against it."""
    mod, mappings = pack
    from comfyui_support import flux_conds

    pos, neg = flux_conds()
    latent = {"samples": torch.zeros(1, 16, 16, 16)}
    report, chart, frames = run_node(mappings, "AttentionBenchmarkE2E", model=tiny_flux(), positive=pos, negative=neg,
                                     latent_image=latent, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", seed=0,
                                     rows="unpatched, sdpa, sdpa_math, auto, peer:sdpa_math", peers=True, compile=False)
    for img in (chart, frames):  # ComfyUI IMAGEs: [1, H, W, 3] in [0, 1]; without a VAE the frames say so
        assert img.dtype == torch.float32 and img.shape[0] == 1 and img.shape[-1] == 3 and 0 <= img.min() < img.max() <= 1
    assert chart.shape[1] >= 400 and chart.shape[2] >= 600 and frames.shape[1] < 200
    lines = [ln for ln in report.splitlines() if ln.startswith("| Flux |")]
    assert [ln.split(" | ")[1] for ln in lines] == ["unpatched", "sdpa", "sdpa_math", "auto", "peer:sdpa_math"]
    for ln in lines:  # every row exact here: the same latent as unpatched
        cos, rel_l1 = (float(x) for x in ln.split(" | ")[5].split(" / "))
        assert cos > 0.99999 and rel_l1 < 1e-4
    assert "comfyui 100%" in lines[1] and "sdpa_math 100%" in lines[2] and "×1.000" in lines[0]
    with pytest.raises(ValueError, match="unknown row"):
        run_node(mappings, "AttentionBenchmarkE2E", model=tiny_flux(), positive=pos, negative=neg, latent_image=latent,
                 steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", seed=0, rows="nope", peers=True, compile=False)


def test_end_to_end_benchmark_node_decodes_every_row_with_the_vae(pack):
    """With a VAE (ComfyUI's own VAE object): each row's final latent decoded beside its difference to unpatched."""
    _, mappings = pack
    from comfyui_support import flux_conds, tiny_vae

    pos, neg = flux_conds()
    decoded = []
    vae = tiny_vae()
    decode = vae.decode
    vae.decode = lambda z: decoded.append(tuple(z.shape)) or decode(z)
    report, chart, frames = run_node(mappings, "AttentionBenchmarkE2E", model=tiny_flux(), positive=pos, negative=neg,
                                     latent_image={"samples": torch.zeros(1, 16, 16, 16)}, steps=1, cfg=1.0,
                                     sampler_name="euler", scheduler="simple", seed=0, rows="unpatched, sdpa_math",
                                     peers=False, compile=False, vae=vae)
    assert "| Flux | sdpa_math |" in report
    assert decoded == [(1, 16, 16, 16)] * 2  # each row's final latent, once
    assert frames.dtype == torch.float32 and frames.shape[0] == 1 and frames.shape[-1] == 3
    assert frames.shape[1] >= 2 * 128 and frames.shape[2] >= 2 * 128  # two rows of a 128 px frame and its heatmap
    assert 0 <= frames.min() < frames.max() <= 1


def test_median_interval_is_distribution_free():
    import importlib

    from pack import load

    stats = importlib.import_module(load().__name__ + ".measure.stats")
    # n = 30: ranks 10 and 21 (1-based) bound the median with 95.7 % coverage; n = 8: the whole range (99.2 %)
    assert stats.median_ci(list(range(30, 0, -1))) == (15.5, 10, 21)
    assert stats.median_ci([3, 1, 2, 8, 5, 4, 7, 6]) == (4.5, 1, 8)
    med, lo, hi = stats.paired_ratio([1.0, 2.0, 4.0], [1.0, 1.0, 2.0])  # ratios 1, 2, 2
    assert (med, lo, hi) == (2.0, 1.0, 2.0)


def test_benchmark_rounds_give_paired_ratios_against_unpatched_peer_and_best(pack):
    """With rounds, every row gets a per-round ratio against unpatched with an interval; a kernel row against its
    peer; auto against the fastest of unpatched and the explicit rows. The table shows them."""
    import importlib

    mod, _ = pack
    e2e = importlib.import_module(mod.__name__ + ".measure.e2e")
    from comfyui_support import flux_conds

    pos, neg = flux_conds()
    job = e2e.Job(tiny_flux(), pos, neg, torch.zeros(1, 16, 16, 16), steps=3, label="tiny")
    rows = e2e.measure(job, ["unpatched", "sdpa_math", "auto", "peer:sdpa_math"], rounds=3)
    by = {r["row"]: r for r in rows}
    for r in rows:
        med, lo, hi = r["paired"]["vs_unpatched"]
        assert lo <= med <= hi and len(r["s_per_step_runs"]) == 3
    assert by["unpatched"]["paired"]["vs_unpatched"] == [1.0, 1.0, 1.0]
    assert "vs_peer" in by["sdpa_math"]["paired"] and "vs_best" in by["auto"]["paired"]
    assert "vs_peer" not in by["auto"]["paired"]
    for r in rows:  # the whole run holds the first step and both intervals whose median is s/step
        assert r["s_per_step_whole"] * 3 >= 2 * r["s_per_step"] and r["whole_vs_unpatched"] > 0
    import comfy.patcher_extension as pe

    _, _, whole = e2e._timed_sample(job.model, job)
    assert whole > 0 and not job.model.get_wrappers(pe.WrappersMP.SAMPLER_SAMPLE, e2e.TIMER_KEY)  # none left behind
    md = importlib.import_module(mod.__name__ + ".measure.report").render_markdown(rows)
    assert "whole run: s/step, vs unpatched" in md
    assert by["auto"]["best_row"] in ("unpatched", "sdpa_math")
    assert "paired per round" in md and "vs peer ×" in md and f"vs {by['auto']['best_row']} (best) ×" in md


def test_benchmark_profiles_the_last_step_of_a_run(pack, monkeypatch):
    """The profiled step is the run's last one (past the sparse schedule's start, as the timed steps are), not a
    one-step run that never leaves the dense phase: the profiler starts after steps-1 model calls and stops after one
    more."""
    import importlib

    import torch.profiler

    mod, _ = pack
    e2e = importlib.import_module(mod.__name__ + ".measure.e2e")
    from comfyui_support import flux_conds

    calls, marks = [], []

    class Recorder:
        def __init__(self, *a, **k):
            pass

        def start(self):
            marks.append(("start", len(calls)))

        def stop(self):
            marks.append(("stop", len(calls)))

        def key_averages(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", Recorder)
    model = tiny_flux().clone()
    model.set_model_unet_function_wrapper(lambda f, a: (calls.append(1), f(a["input"], a["timestep"], **a["c"]))[1])
    pos, neg = flux_conds()
    job = e2e.Job(model, pos, neg, torch.zeros(1, 16, 16, 16), steps=3, label="tiny")
    out = e2e.profile_one_step(model, job)
    assert marks == [("start", 2), ("stop", 3)] and len(calls) == 3
    wall = out.pop("wall_ms")
    assert wall > 0 and out == {"step": 2, "device_ms": 0.0, "attention_ms": 0.0, "top": []}
    calls.clear(), marks.clear()
    assert e2e.profile_one_step(model, job, step=1)["step"] == 1 and marks == [("start", 1), ("stop", 2)]


def test_peer_row_calls_the_kernel_straight_from_the_hook(pack):
    mod, _ = pack
    import importlib

    rows = importlib.import_module(mod.__name__ + ".measure.rows")
    base = tiny_flux()
    ref = sample(base)
    m = rows.make_row_model(base, "peer:sdpa_math")
    assert rel(sample(m), ref) < 1e-4
    assert mod.nodes.patch.override_of(m) is None  # not Patch Attention's override: a bare function in the hook


def test_models_that_sanitize_nan_keep_per_call_nan_flags(pack):
    """Flux/Chroma call nan_to_num in fp16: NaN from a kernel would be gone from their output, so the NaN net keeps
    per-call flags there; SD/SDXL's UNet and Wan do not, and get one output check per forward after the first."""
    from types import SimpleNamespace

    import comfy.ldm.flux.model as flux
    import comfy.ldm.modules.diffusionmodules.openaimodel as unet
    import comfy.ldm.wan.model as wan

    mod, _ = pack
    hides = mod.nodes.patch.model_hides_nan
    m = lambda cls: SimpleNamespace(diffusion_model=object.__new__(cls))  # noqa: E731
    assert hides(m(flux.Flux)) is True
    assert hides(m(unet.UNetModel)) is False
    assert hides(m(wan.WanModel)) is False
