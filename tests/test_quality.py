"""Quality measures (PSNR, SSIM), attention concentration, and the calibration rule: known values, no ComfyUI."""

import math
from importlib import import_module

import pytest
import torch
from pack import load

M = load().__name__ + ".measure"
cal = import_module(M + ".calibrate")
conc = import_module(M + ".concentration")
call_stats, column_radius, summarize_calls, window_dims = conc.call_stats, conc.column_radius, conc.summarize_calls, conc.window_dims
_quality = import_module(M + ".quality")
AT_FLOOR, compare, psnr, ssim, verdict = (_quality.AT_FLOOR, _quality.compare, _quality.psnr, _quality.ssim,
                                         _quality.verdict)

# ---------------------------------------------------------------- PSNR / SSIM


def test_psnr_known_values():
    ref = torch.zeros(1, 4, 3, 8, 8)
    ref[..., 0, 0] = 2.0  # range 2
    x = ref + 0.02  # MSE 4e-4: PSNR = 10 log10(4 / 4e-4) = 40 dB
    assert psnr(x, ref) == pytest.approx(40.0, abs=1e-5)
    assert psnr(ref, ref) == math.inf
    assert psnr(x, ref, value_range=1.0) == pytest.approx(10 * math.log10(1 / 4e-4))
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(x[..., :4], ref)


def test_ssim_known_values():
    # two constant images: the contrast/structure term is C2/C2 = 1, the luminance term (2ab + C1) / (a^2 + b^2 + C1)
    a, b = torch.full((16, 16), 0.3), torch.full((16, 16), 0.5)
    c1 = (0.01 * 1.0) ** 2
    assert ssim(a, b, value_range=1.0) == pytest.approx((2 * 0.3 * 0.5 + c1) / (0.09 + 0.25 + c1), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 16, 5, 20, 24, generator=g)
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    # anticorrelated noise around the same mean: structure term negative
    n = torch.randn(40, 40, generator=g)
    assert ssim(0.5 + 0.1 * n, 0.5 - 0.1 * n, value_range=1.0) < 0
    # slices smaller than the window use a window of their size
    assert ssim(x[..., :4, :5], x[..., :4, :5]) == pytest.approx(1.0, abs=1e-12)
    out = compare(x + 0.01, x)
    assert set(out) == {"psnr", "ssim"} and 30 < out["psnr"] < 50 and 0.9 < out["ssim"] < 1.0


def test_verdict_against_the_exact_floor():
    assert verdict(45.0, 44.0) == AT_FLOOR and verdict(44.0, 44.0) == AT_FLOOR
    assert verdict(43.5, 44.0).startswith("within 1 dB")
    assert verdict(40.0, 44.0) == "4.0 dB below the floor"
    assert verdict(math.inf, math.inf) == AT_FLOOR
    assert "bit for bit" in verdict(60.0, math.inf)
    assert verdict(40.0, None) == ""


# ---------------------------------------------------------------- concentration


def _grid_qk(grid, fn, d=64, heads=1):
    t, h, w = grid
    n = t * h * w
    idx = torch.arange(n)
    pos = torch.stack((idx // (h * w), (idx // w) % h, idx % w), dim=-1)
    q, k = fn(pos, d)
    return q.expand(1, heads, n, d).contiguous(), k.expand(1, heads, n, d).contiguous()


def test_flat_attention_spreads_over_every_block_and_the_window_holds_its_share():
    grid = (5, 8, 12)  # 480 tokens, 4 blocks (the last one 96 tokens)
    q = k = torch.zeros(1, 2, 480, 16)
    st = call_stats(q, k, grid, chunk=128)
    h = st.heads[0]
    assert h.block_share_90 == 1.0  # 0.9 of the mass needs all four blocks
    assert h.window_mass == pytest.approx(st.window_share, abs=1e-6)
    assert h.spatial_mass == pytest.approx(1 / 5, abs=1e-6)
    # the column is clipped at the grid's borders: its mean size per frame is the product of the mean clipped widths
    r = st.radius
    mean_w = lambda n: sum(min(i + r, n - 1) - max(i - r, 0) + 1 for i in range(n)) / n  # noqa: E731
    assert h.temporal_mass == pytest.approx(4 * mean_w(8) * mean_w(12) / 480, abs=1e-6)


def test_self_attention_is_one_block_and_all_in_the_window():
    grid = (5, 8, 12)
    g = torch.Generator().manual_seed(0)
    e = torch.randn(480, 64, generator=g)
    e = e / e.norm(dim=-1, keepdim=True) * 40  # q.k = 1600 / 8 on itself, ~0 elsewhere
    st = call_stats(e[None, None], e[None, None], grid, chunk=256)
    h = st.heads[0]
    assert h.block_share_90 == pytest.approx(0.25) and h.window_mass == pytest.approx(1.0, abs=1e-6)
    assert h.kind == "spatial" and h.spatial_mass == pytest.approx(1.0, abs=1e-6)


def test_temporal_head_attends_to_its_position_in_every_frame():
    """Keys equal at the same (row, column) in every frame: each query's mass is spread over its column of T frames."""
    grid = (6, 8, 12)

    def fn(pos, d):
        g = torch.Generator().manual_seed(1)
        codes = torch.randn(8 * 12, d, generator=g)
        codes = codes / codes.norm(dim=-1, keepdim=True) * 30
        e = codes[pos[:, 1] * 12 + pos[:, 2]]
        return e[None, None], e[None, None]

    q, k = _grid_qk(grid, fn)
    st = call_stats(q, k, grid, chunk=128)
    h = st.heads[0]
    assert h.kind == "temporal"
    assert h.spatial_mass == pytest.approx(1 / 6, abs=1e-4) and h.temporal_mass == pytest.approx(5 / 6, abs=1e-4)
    s = st.summary()
    assert s["temporal_heads"] == 1.0 and s["spatial_heads"] == 0.0


def test_blockwise_results_do_not_depend_on_the_chunk_and_stride_samples_blocks():
    grid = (4, 8, 16)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 3, 512, 32, generator=g) * 2, torch.randn(1, 3, 512, 32, generator=g) * 2
    a = call_stats(q, k, grid, chunk=128)
    b = call_stats(q, k, grid, chunk=512)
    for x, y in zip(a.heads, b.heads):
        assert x.block_share_90 == pytest.approx(y.block_share_90) and x.window_mass == pytest.approx(y.window_mass)
    c = call_stats(q, k, grid, chunk=256, query_stride=2)
    assert c.query_blocks == 2 and a.query_blocks == 4
    with pytest.raises(ValueError, match="grid"):
        call_stats(q, k, (4, 8, 8))
    with pytest.raises(ValueError, match="multiple of 128"):
        call_stats(q, k, grid, chunk=100)
    pooled = summarize_calls([a, b])
    assert pooled["heads"] == 6 and 0 <= pooled["heads_within_target"] <= 1


def test_window_and_column_sizes():
    assert window_dims((21, 30, 52)) == (12, 17, 25)  # 5100 of 32,760 tokens: 15.57 %
    wt, wh, ww = window_dims((21, 45, 80))
    assert abs(wt * wh * ww / (21 * 45 * 80) - 0.155) < 0.002
    assert column_radius((21, 30, 52)) == 4  # 9 x 9 x 21 = 1701 tokens, a frame has 1560


# ---------------------------------------------------------------- the calibration rule


def _pts():
    P = cal.Point
    return [
        P("unpatched", 1.00, 50.0, exact=True),
        P("sdpa_cudnn", 0.80, 49.0, exact=True),  # the floor: the worst exact row
        P("sage", 0.60, 48.5, cos=0.9990, rel_l1=0.040),  # within 1 dB
        P("sol_mild", 0.45, 48.2, cos=0.9980, rel_l1=0.050),  # within 1 dB, faster: the rule's setting
        P("sol_hard", 0.30, 40.0, cos=0.9950, rel_l1=0.090),  # fastest, 9 dB below
        P("sparge", 0.70, 47.0, cos=0.9970, rel_l1=0.060),  # 2 dB below, slower than sol_mild
    ]


def test_rule_is_the_fastest_setting_within_tolerance_of_the_floor():
    pts = _pts()
    floor = cal.exact_floor(pts)
    assert floor == 49.0
    assert cal.fastest_within(pts, floor).name == "sol_mild"
    assert cal.fastest_within(pts, floor, tolerance_db=10).name == "sol_hard"
    assert cal.fastest_within([p for p in pts if p.name != "sol_mild" and p.name != "sage"], floor).name == "sdpa_cudnn"


def test_proposed_gate_admits_nothing_below_tolerance_and_reaches_the_rule():
    pts = _pts()
    g = cal.propose_gate(pts, 49.0, current=(0.995, 0.08))
    assert g["target"] == "sol_mild" and g["pick"] == "sol_mild"
    check = cal.check_gate(pts, 49.0, g["min_cos"], g["max_rel_l1"])
    assert check.valid and check.pick == "sol_mild"
    assert "sparge" not in check.admitted and "sol_hard" not in check.admitted
    # the thresholds sit between the worst admitted setting and the nearest excluded one
    assert 0.9970 < g["min_cos"] <= 0.9980 and 0.050 <= g["max_rel_l1"] < 0.060
    # the current defaults: what they let through, and that one of them is below tolerance
    cur = g["current"]
    assert cur["valid"] is False and set(cur["bad_admitted"]) == {"sparge"} and "sol_hard" not in cur["admitted"]
    assert cur["pick"] == "sol_mild"


def test_unseparable_settings_are_named_and_no_lossy_setting_means_exact_only():
    # better per call than sage and sol_mild, far below at the end: no gate admits them without it
    pts = _pts() + [cal.Point("liar", 0.2, 30.0, cos=0.99995, rel_l1=0.01)]
    g = cal.propose_gate(pts, 49.0)
    assert any(c.startswith("liar") for c in g["conflicts"])
    assert g["admitted"] == [] and g["pick"] == "sdpa_cudnn"
    assert not cal.check_gate(pts, 49.0, g["min_cos"], 1.0).admitted
    bad_only = [p for p in _pts() if p.exact or p.psnr < 45]
    g2 = cal.propose_gate(bad_only, 49.0)
    assert g2["admitted"] == [] and g2["pick"] == "sdpa_cudnn" and g2["max_rel_l1"] is None
    assert not cal.check_gate(bad_only, 49.0, g2["min_cos"], 1.0).admitted  # the proposed cos keeps them all out
    md = cal.render_markdown(bad_only, g2, curve=cal.by_tolerance(bad_only, 49.0))
    assert "keep them all out" in md and "| 10 dB | sol_hard |" in md


def test_budget_rule_picks_the_fastest_profile_within_tolerance():
    P = cal.Point
    pts = [P("sol[0.03]", 0.50, 48.9, setting={"budget": 0.03}), P("sol[0.07]", 0.40, 48.3, setting={"budget": 0.07}),
           P("sol[0.15]", 0.35, 44.0, setting={"budget": 0.15}), P("unpatched", 1.0, 49.0, exact=True)]
    assert cal.propose_budget(pts, 49.0)["budget"] == 0.07
    assert cal.propose_budget(pts, 49.0, tolerance_db=6)["budget"] == 0.15
    assert cal.propose_budget(pts[1:2], 55.0)["budget"] is None


# ---------------------------------------------------------------- rows of the end-to-end benchmark (no ComfyUI)


@pytest.fixture(scope="module")
def e2e():
    """The end-to-end benchmark's names these tests use: the row grammar, the statistics, the report."""
    import importlib
    import types

    from pack import load

    rows, stats, report = (importlib.import_module(f"{load().__name__}.measure.{m}") for m in ("rows", "stats", "report"))
    return types.SimpleNamespace(parse_row=rows.parse_row, row_settings=rows.row_settings, is_exact_row=rows.is_exact_row,
                                 add_floor=stats.add_floor, render_markdown=report.render_markdown,
                                 quality_targets=report.quality_targets)


def test_row_options_parse_and_refuse_what_they_cannot_set(e2e):
    assert e2e.parse_row("kitchen_sol[tau=2.0 extra_tokens=128]") == ("kitchen_sol", {"tau": 2.0, "extra_tokens": 128})
    assert e2e.parse_row("sparge[profile=/tmp/p.json]") == ("sparge", {"profile": "/tmp/p.json"})
    assert e2e.parse_row("sage_fp8_sm90") == ("sage_fp8_sm90", {})
    with pytest.raises(ValueError, match="key=value"):
        e2e.parse_row("sparge[cdfthreshd]")
    with pytest.raises(ValueError, match="not a number"):
        e2e.parse_row("sparge[cdfthreshd=high]")
    with pytest.raises(ValueError, match="sparse backends"):
        e2e.row_settings("sage", {"smooth_k": 0})
    with pytest.raises(ValueError, match="tau"):
        e2e.row_settings("kitchen_sol", {"tau": 9.0})  # Sol-Attn's bounds
    s = e2e.row_settings("kitchen_sol", {"tau": 2.0})
    assert s.variant == "kitchen_sol" and s.options["tau"] == 2.0 and s.options["extra_tokens"] == 256


def _row(name, s, psnr, exact=False, whole=None, ref="fp32"):
    return {"row": name, "preset": "p", "s_per_step": s, "s_per_step_whole": whole or s, "psnr": psnr, "ssim": 0.99,
            "exact": exact, "reference": ref, "cos": 1.0, "rel_l1": 0.0, "finite": True}


def test_floor_and_verdicts_against_an_fp32_reference(e2e):
    rows = [_row("unpatched", 1.0, 52.0, True), _row("sdpa_cudnn", 0.8, 51.0, True), _row("sage_fp8_sm90", 0.6, 50.5),
            _row("kitchen_sol", 0.4, 38.0), {"row": "flash_attn4", "preset": "p", "error": "not here"}]
    e2e.add_floor(rows)
    assert rows[0]["floor_psnr"] == 51.0
    assert rows[0]["quality"] == AT_FLOOR and rows[1]["quality"] == AT_FLOOR
    assert rows[2]["quality"].startswith("within 1 dB") and rows[3]["quality"] == "13.0 dB below the floor"
    md = e2e.render_markdown(rows)
    assert "PSNR dB / SSIM vs fp32" in md and "Exact floor: PSNR 51.00 dB against fp32" in md
    assert "| 38.00 / 0.9900 | 13.0 dB below the floor |" in md and "error: not here" in md


def test_floor_against_the_unpatched_row_is_two_exact_kernels_difference(e2e):
    rows = [_row("unpatched", 1.0, math.inf, True, ref="unpatched"), _row("sdpa_cudnn", 0.8, 61.0, True, ref="unpatched"),
            _row("auto", 0.5, 45.0, ref="unpatched")]
    e2e.add_floor(rows)
    assert rows[2]["floor_psnr"] == 61.0 and "16.0 dB below" in rows[2]["quality"]
    alone = [_row("unpatched", 1.0, math.inf, True, ref="unpatched"), _row("auto", 0.5, 45.0, ref="unpatched")]
    e2e.add_floor(alone)
    assert alone[1]["floor_psnr"] is None and "no floor" in alone[1]["quality"]
    assert "No exact floor" in e2e.render_markdown(alone)
    assert e2e.is_exact_row("unpatched") and e2e.is_exact_row("sdpa_cudnn") and e2e.is_exact_row("peer:sdpa_flash")
    assert not e2e.is_exact_row("sage") and not e2e.is_exact_row("auto") and not e2e.is_exact_row("kitchen_sol[tau=2]")
    assert not e2e.is_exact_row("core:sol-attn")


def test_quality_targets(e2e):
    rows = [_row("unpatched", 1.0, 52.0, True, whole=1.0), _row("sdpa_cudnn", 0.8, 51.0, True, whole=0.8),
            _row("sage_fp8_sm90", 0.6, 49.0, whole=0.6), _row("sparge", 0.7, 48.5, whole=0.7),
            _row("kitchen_sol", 0.40, 40.0, whole=0.5), _row("kitchen_sol[profile=/t.json]", 0.35, 41.0, whole=0.45),
            _row("auto", 0.59, 50.5, whole=0.61), _row("auto_fast", 0.45, 41.0, whole=0.46)]
    e2e.add_floor(rows)
    for r in rows:
        r["whole_vs_unpatched"] = round(1.0 / r["s_per_step_whole"], 3)
    t = {x["target"].split(" (")[0]: x for x in e2e.quality_targets(rows, sparse_target=1.9)}
    assert t["auto within 3 dB of the exact floor"]["met"] is True  # 0.5 dB below the floor of 51.0
    # the band holds sdpa_cudnn, sage_fp8_sm90 and sparge (auto_fast and kitchen_sol are 10 dB below): Sage is fastest
    within = next(x for x in e2e.quality_targets(rows) if x["target"].startswith("auto whole run"))
    assert "(sage_fp8_sm90)" in within["target"] and within["ratio"] == pytest.approx(0.6 / 0.61, abs=1e-3)
    assert within["met"] is True  # x0.984 >= x0.98
    sparse = next(x for x in e2e.quality_targets(rows, sparse_target=1.9) if "sparse setting" in x["target"])
    assert "(sparge)" in sparse["target"] and sparse["met"] is False and sparse["ratio"] == pytest.approx(1 / 0.7, abs=1e-3)
    fast = t["auto_fast"]
    assert fast["applies"] is False and "10.0 dB below" in fast["detail"]
    tuned = t["tuned kitchen_sol profile faster than its defaults at equal or better PSNR"]
    assert tuned["met"] is True and tuned["ratio"] == pytest.approx(0.40 / 0.35, abs=1e-3)
    # auto 4 dB below the floor, and slower than Sage: both missed
    rows[6]["psnr"], rows[6]["s_per_step_whole"] = 47.0, 0.65
    rows[6]["whole_vs_unpatched"] = round(1 / 0.65, 3)
    t = {x["target"].split(" (")[0]: x for x in e2e.quality_targets(rows)}
    assert t["auto within 3 dB of the exact floor"]["met"] is False
    assert t["auto whole run >= x0.98 of the fastest row within 3 dB"]["met"] is False
