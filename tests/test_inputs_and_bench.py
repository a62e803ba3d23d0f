import json
import re
import sys
import threading
import types
from importlib import import_module

import torch
from pack import load

bench = import_module(load().__name__ + ".measure.bench")
structured_qkv = import_module(load().__name__ + ".measure.inputs").structured_qkv


def test_structured_inputs_have_locality_and_key_bias():
    q, k, v = structured_qkv(1, 2, 1024, 1024, 64, seed=1, kind="image")
    assert q.shape == (1, 2, 1024, 64) and k.shape == v.shape == (1, 2, 1024, 64)
    near = torch.nn.functional.cosine_similarity(q[0, 0, :-1], q[0, 0, 1:], dim=-1).mean()
    far = torch.nn.functional.cosine_similarity(q[0, 0, :512], q[0, 0, 512:], dim=-1).mean()
    assert near > 0.5 > far.abs()
    # the channel bias: K's mean over tokens is far from zero relative to Q's
    assert k.mean(dim=2).abs().mean() > 3 * q.mean(dim=2).abs().mean()
    qi, _, _ = structured_qkv(1, 2, 1024, 1024, 64, seed=1, kind="iid")
    near_iid = torch.nn.functional.cosine_similarity(qi[0, 0, :-1], qi[0, 0, 1:], dim=-1).mean()
    assert near_iid.abs() < 0.1


def test_video_grid_and_cross_lengths():
    q, k, v = structured_qkv(1, 1, 4 * 8 * 8, 77, 32, kind="video", grid=(4, 8, 8), dtype=torch.bfloat16)
    assert q.shape == (1, 1, 256, 32) and k.shape == (1, 1, 77, 32) and q.dtype == torch.bfloat16


def test_bench_renders_tables_from_json(tmp_path, capsys):
    rows = [
        {"backend": "sdpa", "shape": "flux", "ms": 0.43, "cos": 1.0, "rel_l1": 0.001, "peak_mib": 10, "speedup_vs_sdpa": 1.0},
        {"backend": "sage_fp8_sm90", "shape": "flux", "ms": 0.54, "cos": 0.9998, "rel_l1": 0.02, "peak_mib": 12,
         "speedup_vs_sdpa": 0.796, "direct_ms": 0.53, "wrapper_pct": 1.9},
        {"backend": "sparge", "shape": "flux", "refused": "head dim 40 unsupported"},
        {"backend": "auto", "shape": "flux", "ms": 0.44, "cos": 1.0, "rel_l1": 0.001, "peak_mib": 10,
         "speedup_vs_sdpa": 0.977, "auto_choice": "sdpa", "auto_report": "sdpa [sdpa 0.43 ms]"},
    ]
    meta = {"gpu": "X", "torch": "t", "dtype": "bf16", "date": "d", "reps": 3}
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"meta": meta, "rows": rows}))
    md = tmp_path / "r.md"
    assert bench.main(["--from-json", str(p), "--md", str(md)]) == 0
    text = md.read_text()
    assert "| sage_fp8_sm90 | 0.540 ms ×0.80 |" in text
    assert "| auto | 0.440 ms ×0.98 → sdpa |" in text
    assert "sparge @ flux: head dim 40 unsupported" in text
    assert "(+1.9 %)" in text


def test_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        return
    assert bench.main(["--preset", "flux"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------------------- rows that cannot contradict each other


def _timed(rows):
    return {r["backend"]: r for r in rows if "ms" in r}


def test_rows_timed_beside_a_busy_thread_do_not_contradict_each_other():
    """A thread spinning Python and torch work while the benchmark runs: every row reports a median inside its
    spread, and auto (which runs SDPA through the same dispatcher path) is not faster than SDPA's row beyond SDPA's
    spread; the report says nothing of a speed-up it did not measure."""
    stop = threading.Event()

    def busy():
        x = torch.randn(192, 192)
        while not stop.is_set():
            x = torch.tanh(x @ x)
            sum(i * i for i in range(3000))

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    try:
        table = {"1,2,256,64": bench.AttentionShape(1, 2, 256, 64, None, None, "busy")}
        meta, rows = bench.run(table, reps=2, warmup=1, rounds=25, device=torch.device("cpu"), progress=False)
    finally:
        stop.set()
        spinner.join()
    timed = _timed(rows)
    assert set(timed) == {"sdpa", "sdpa_math", "auto", "peer:comfy_default"}
    for r in timed.values():
        assert r["ms_low"] <= r["ms"] <= r["ms_high"] and r["rounds"] == 25
    auto = timed["auto"]
    kernel = timed[auto["auto_choice"]]
    assert auto["auto_choice"] == "sdpa" and auto["ms"] >= kernel["ms_low"]
    assert "auto_check" not in auto
    md = bench.render_markdown(meta, rows, bench.SHAPE_PRESETS)
    assert f"({auto['ms_low']:.3f}–{auto['ms_high']:.3f}) → sdpa |" in md and "25 interleaved rounds" in md


def test_auto_faster_than_the_kernel_it_runs_is_reported_as_no_speed_up():
    rows = [{"backend": "sdpa", "shape": "s", "ms": 9.084, "ms_low": 8.0, "ms_high": 11.0, "cos": 1.0, "rel_l1": 0.0},
            {"backend": "auto", "shape": "s", "ms": 1.903, "ms_low": 1.8, "ms_high": 2.2, "cos": 1.0, "rel_l1": 0.0,
             "auto_choice": "sdpa"}]
    bench.check_auto(rows[1], {r["backend"]: r for r in rows})
    assert "the kernel it runs" in rows[1]["auto_check"] and "no speed-up" in rows[1]["auto_check"]
    meta = {"gpu": "CPU", "device": "cpu", "torch": "t", "dtype": "bf16", "date": "d", "reps": 10, "rounds": 15}
    md = bench.render_markdown(meta, rows, bench.SHAPE_PRESETS)
    assert "auto against the kernel it runs:" in md and "- s: measured faster than sdpa" in md
    within = dict(rows[1], ms=8.5)  # inside SDPA's spread: nothing to say
    del within["auto_check"]
    bench.check_auto(within, {r["backend"]: r for r in rows})
    assert "auto_check" not in within


def test_the_cpu_defaults_plan_small_work_with_progress_every_round():
    """The node's defaults on a CPU (presets sd15, sdxl, flux; reps 10): the presets scaled down, a bounded number of
    calls and FLOPs (counted, not timed), and a progress tick per row per round, each at most one preset call's work."""
    cpu = torch.device("cpu")
    table = bench.parse_shapes(["sd15", "sdxl", "flux"], [], device=cpu)
    assert all(bench.call_flops(s) <= bench.CPU_CALL_FLOPS for s in table.values())
    assert [s.q_tokens for s in table.values()] == [256, 192, 128] and "on the CPU 256 of its 4096" in table["sd15"].description
    plan = bench.make_plan(table, device=cpu, reps=10)
    assert [len(s.entries) for s in plan.shapes] == [4, 4, 4]  # sdpa, sdpa_math, auto, ComfyUI's default call
    assert plan.calls <= 250 and plan.flops <= 5e10
    assert plan.ticks == sum(len(s.entries) * (1 + bench.ROUNDS) for s in plan.shapes)
    assert max(s.reps * bench.call_flops(s.shape) for s in plan.shapes) <= bench.ROUND_FLOPS["cpu"]
    # a user's shapes are run as given; on a GPU the presets are too
    assert bench.parse_shapes([], ["2,8,4096,40"], device=cpu)["2,8,4096,40"][:5] == (2, 8, 4096, 40, None)
    assert bench.parse_shapes(["flux"], [], device=torch.device("cuda"))["flux"] == bench.SHAPE_PRESETS["flux"]


def test_the_plan_and_its_estimate_come_before_the_first_timed_call():
    said, ticks = [], []
    table = {"1,1,64,32": bench.AttentionShape(1, 1, 64, 32, None, None, "tiny")}
    plan = bench.make_plan(table, device=torch.device("cpu"), reps=1, warmup=1, rounds=3)
    meta, rows = bench.run(table, reps=1, warmup=1, rounds=3, device=torch.device("cpu"),
                           announce=lambda text: said.append((text, len(ticks))), progress=lambda: ticks.append(1))
    (text, at), = said
    assert at == 0 and f"{plan.calls:,} calls, about " in text and text.endswith("s on this CPU")
    assert len(ticks) == plan.ticks and meta["plan"] == text and "wall_s" in meta


def test_the_node_shows_its_plan_as_progress_text_before_timing(monkeypatch):
    """The Attention Benchmark node sends the plan and its estimate to ComfyUI's progress text on the node (the
    executing one), before the first timed call."""
    pack = load()
    progress = import_module(pack.__name__ + ".nodes.progress")
    defs = import_module(pack.__name__ + ".nodes.definitions")
    sent = []
    server = types.ModuleType("server")
    server.PromptServer = type("PromptServer", (), {"instance": types.SimpleNamespace(
        send_progress_text=lambda text, node_id: sent.append((text, node_id)))})
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(progress, "executing_node", lambda: "12")
    timed = []
    real = bench.time_call
    monkeypatch.setattr(bench, "time_call", lambda *a, **k: (timed.append(len(sent)), real(*a, **k))[1])
    (text,) = defs.run_benchmark(presets="", shapes="1,1,64,32", dtype="bf16", reps=1)
    (said, node), = sent
    rows = re.match(r"Attention Benchmark: 1 shape\(s\), (\d+) timed rows each", said)
    assert node == "12" and rows and " about " in said
    rows = int(rows[1])  # 4 SDPA rows on the CPU; every installed kernel's on a GPU
    assert rows >= 4
    # only the probe that makes the estimate times anything before it is said; then 15 rounds of the rows
    assert sorted(timed) == timed and timed.count(1) == rows * bench.ROUNDS and timed.count(0) <= rows
    assert said.split(": ", 1)[1] in text  # the report repeats the plan
    monkeypatch.setattr(progress, "executing_node", lambda: None)  # outside ComfyUI's executor: nothing sent
    progress.progress_text("outside")
    assert len(sent) == 1
