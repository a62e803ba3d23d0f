"""tests/gpu/offload.py without a GPU: the card's arithmetic, the rows, the weight budgets recorded, the profiler trace's
summary, the limit's guess and the md table drawn from a result."""

from __future__ import annotations

import importlib.util
import os
import re
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


@pytest.fixture(scope="module")
def ob():
    spec = importlib.util.spec_from_file_location("gpu_offload", os.path.join(HERE, "gpu", "offload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_24_gib_card_on_80_gib_gpus(ob):
    card = ob.emulated_card([80 * GIB, 80 * GIB], 24)
    assert card["card_bytes"] == 24 * GIB
    assert card["fractions"] == [0.3, 0.3]
    assert card["reserve_bytes"] == 56 * GIB
    assert card["reserve_vram_gib"] == 56.0
    # what ComfyUI makes of --reserve-vram: the reserve in bytes, exactly
    assert card["reserve_vram_gib"] * 1024 * 1024 * 1024 == card["reserve_bytes"]


def test_unequal_gpus_get_the_largest_reserve_and_their_own_fraction(ob):
    totals = [int(79.2 * GIB), int(139.8 * GIB)]
    card = ob.emulated_card(totals, 24)
    assert card["reserve_bytes"] == totals[1] - 24 * GIB  # no GPU budgeted more than the card
    assert card["fractions"][0] == pytest.approx(24 / 79.2, rel=1e-6)
    assert card["fractions"][1] == pytest.approx(24 / 139.8, rel=1e-6)
    assert card["fractions"][0] * totals[0] == pytest.approx(24 * GIB, rel=1e-9)


def test_no_card_and_a_card_too_large(ob):
    assert ob.emulated_card([80 * GIB], 0) is None
    with pytest.raises(ValueError, match="not smaller than GPU 1"):
        ob.emulated_card([200 * GIB, 80 * GIB], 80)


def test_comfyui_turns_reserve_vram_into_bytes_as_the_stage_assumes():
    from comfyui_support import find_comfyui

    path = find_comfyui()
    if path is None:
        pytest.skip("no ComfyUI checkout (COMFYUI_PATH)")
    src = open(os.path.join(path, "comfy", "model_management.py")).read()
    assert re.search(r"EXTRA_RESERVED_VRAM = args\.reserve_vram \* 1024 \* 1024 \* 1024", src)
    assert "def extra_reserved_memory():\n    return EXTRA_RESERVED_VRAM" in src


def test_rows_parse(ob):
    rows = ob.parse_rows("1:sage_fp8_sm90,cp:sage_fp8_sm90, 1:unpatched ,cp-g3:kitchen_sol[tau=0.5]")
    assert [r["row"] for r in rows] == ["1:sage_fp8_sm90", "cp:sage_fp8_sm90", "1:unpatched", "cp-g3:kitchen_sol[tau=0.5]"]
    assert [(r["mode"], r["gpus"], r["backend"]) for r in rows] == [
        ("1", 0, "sage_fp8_sm90"), ("cp", 0, "sage_fp8_sm90"), ("1", 0, "unpatched"), ("cp", 3, "kitchen_sol[tau=0.5]")]
    assert all(r["pins"] for r in rows)
    off = ob.parse_rows("1-nopin:sage,cp-g2-nopin:sage")
    assert [(r["mode"], r["gpus"], r["pins"]) for r in off] == [("1", 0, False), ("cp", 2, False)]


@pytest.mark.parametrize("bad, why", [("2:sage", "expected"), ("cp:", "expected"), ("cp-x:sage", "expected"),
                                      ("cp-g1:sage", "N >= 2"), ("cfg:sage", "expected"), ("1:a,1:a", "twice"),
                                      ("cp-nopin-g2:sage", "expected"),
                                      (" , ", "no rows")])
def test_bad_rows_are_refused(ob, bad, why):
    with pytest.raises(ValueError, match=why):
        ob.parse_rows(bad)


def test_the_budget_is_what_was_loaded_plus_what_the_load_may_add(ob):
    class LoadedModel:
        def __init__(self, device, loaded):
            self.device, self.loaded = device, loaded

        def model_loaded_memory(self):
            return self.loaded

        def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
            return ("loaded", lowvram_model_memory)

    mm = types.SimpleNamespace(LoadedModel=LoadedModel)
    ob.record_loads(mm)
    ob.record_loads(mm)  # once only
    ob.LOADS.clear()
    assert LoadedModel("cuda:0", 0).model_load(10 * GIB) == ("loaded", 10 * GIB)
    LoadedModel("cuda:1", 0).model_load(lowvram_model_memory=9 * GIB)
    LoadedModel("cuda:0", 10 * GIB).model_load(2 * GIB)  # a second load adds to what is there
    LoadedModel("cuda:2", 0).model_load(0)  # no limit
    assert len(ob.LOADS) == 4
    assert ob.budgets(ob.LOADS) == {"cuda:0": 12.0, "cuda:1": 9.0, "cuda:2": "full"}
    ob.LOADS.clear()


def test_the_cast_clock_counts_per_device_only_while_on(ob):
    clock = ob.CastClock()
    timed = clock.wrap(lambda s, input=None, dtype=None, device=None, offloadable=False: (s, device))
    timed("m", types.SimpleNamespace(device="cuda:0"), offloadable=True)
    assert clock.result() == {}
    clock.on = True
    timed("m", types.SimpleNamespace(device="cuda:0"), offloadable=True)
    timed("m", types.SimpleNamespace(device="cuda:0"))
    assert timed("m", None, None, "cuda:1") == ("m", "cuda:1")
    res = clock.result()
    assert res["cuda:0"]["calls"] == 2 and res["cuda:1"]["calls"] == 1
    assert set(res) == {"cuda:0", "cuda:1"}


def _ev(cat, name, ms, dur_ms, **args):
    """A chrome-trace span (the profiler's times are µs)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ms * 1000, "dur": dur_ms * 1000, "pid": args.get("device", 99),
            "tid": 1, "args": args}


def _host(cat, name, ms, dur_ms, tid, correlation=None):
    return {"ph": "X", "cat": cat, "name": name, "ts": ms * 1000, "dur": dur_ms * 1000, "pid": 7, "tid": tid,
            "args": {} if correlation is None else {"correlation": correlation}}


def test_the_trace_summary_per_gpu(ob):
    events = [
        _ev("kernel", "gemm", 0, 100, device=0, correlation=1),
        _ev("kernel", "attn", 150, 150, device=0, correlation=2),
        _ev("kernel", "gemm", 120, 20, device=0, correlation=3),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 150, device=0, correlation=4, bytes=GIB),
        _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 100, 20, device=0, correlation=5, bytes=2**20),
        _ev("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 10, 10, device=0, correlation=6, bytes=GIB // 2),
        _ev("kernel", "gemm", 1000, 500, device=1, correlation=7),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 900, 200, device=1, correlation=8, bytes=GIB),
        # host thread 1 launches on GPU 0, thread 2 on GPU 1 (a driver call: Triton's launch); each syncs once
        _host("cuda_runtime", "cudaLaunchKernel", 0, 5, 1, correlation=1),
        _host("cuda_runtime", "cudaMemcpyAsync", 40, 30, 1, correlation=5),
        _host("cuda_runtime", "cudaStreamSynchronize", 80, 400, 1),
        _host("cuda_driver", "cuLaunchKernel", 990, 8, 2, correlation=7),
        _host("cuda_runtime", "cudaStreamSynchronize", 1000, 600, 2),
        _host("cuda_runtime", "cudaGetDevice", 0, 1, 3),  # a thread with no device work: left out
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},  # not a span: left out
    ]
    out = ob.trace_summary(events)
    assert set(out) == {"cuda:0", "cuda:1"}
    g0, g1 = out["cuda:0"], out["cuda:1"]
    assert (g0["kernels"], g0["span_ms"], g0["kernel_busy_ms"], g0["no_kernel_ms"]) == (3, 300.0, 270.0, 30.0)
    assert g0["copies"] == {"htod_pinned": {"n": 1, "ms": 150.0, "gib": 1.0},
                            "htod_pageable": {"n": 1, "ms": 20.0, "gib": 0.001},
                            "ptop": {"n": 1, "ms": 10.0, "gib": 0.5}}
    # the pinned copy (50-200) runs beside no kernel at 100-120 and 140-150, the pageable one (100-120) not at all
    assert g0["htod_no_kernel_ms"] == 50.0
    assert g0["host"] == {"threads": 1, "memcpy_ms": 30.0, "sync_ms": 400.0, "launch_ms": 5.0}
    assert (g1["kernels"], g1["span_ms"], g1["kernel_busy_ms"], g1["no_kernel_ms"]) == (1, 600.0, 500.0, 100.0)
    assert g1["htod_no_kernel_ms"] == 100.0  # 900-1000
    assert g1["host"] == {"threads": 1, "memcpy_ms": 0.0, "sync_ms": 600.0, "launch_ms": 8.0}


def test_copy_kinds(ob):
    assert ob.copy_kind("Memcpy HtoD (Pinned -> Device)") == "htod_pinned"
    assert ob.copy_kind("Memcpy HtoD (Pageable -> Device)") == "htod_pageable"
    assert ob.copy_kind("Memcpy DtoH (Device -> Pageable)") == "dtoh"
    assert ob.copy_kind("Memcpy PtoP (Device -> Device)") == "ptop"
    assert ob.copy_kind("Memcpy DtoD (Device -> Device)") == "dtod"
    assert ob.copy_kind("Memset (Device)") == "other"


def test_the_next_row_is_guessed_from_the_longest(ob):
    assert ob.predict([], profiled=True) == 0.0
    done = [{"row": "1:a", "seconds": 40.0, "s_per_step": 9.6}, {"row": "cp:a", "seconds": 30.0, "s_per_step": 8.1},
            {"row": "1:b", "not_run": "..."}]
    assert ob.predict(done, profiled=False) == 40.0
    assert ob.predict(done, profiled=True) == pytest.approx(40.0 + 3 * 9.6 + 30.0)


def _gpu(dev, on_gpu, on_cpu, pinned):
    return {"device": dev, "patcher": "ModelPatcher", "dynamic": False, "model_gib": on_gpu + on_cpu,
            "loaded_gib": on_gpu, "on_gpu_gib": on_gpu, "on_cpu_gib": on_cpu, "cpu_pinned_gib": pinned}


META = {"gpus": "NVIDIA H100 80GB HBM3 + NVIDIA H100 80GB HBM3", "torch": "2.11.0", "comfyui": "0.33.0",
        "date": "2026-01-01", "preset": "wan-14b-720p", "cfg": 1.0, "steps": 2, "loader": "estimate", "card_gib": 24.0,
        "reserve_gib": 55.2}


def test_the_md_shows_rows_gpus_profiles_errors_and_rows_not_run(ob):
    prof = {"step_ms": 9590.0, "cast": {"cuda:0": {"ms": 412.0, "calls": 400}},
            "gpus": {"cuda:0": {"span_ms": 9580.0, "kernels": 5000, "kernel_busy_ms": 7100.0, "no_kernel_ms": 2480.0,
                                "htod_no_kernel_ms": 950.0,
                                "copies": {"htod_pinned": {"n": 300, "ms": 1900.0, "gib": 18.4},
                                           "htod_pageable": {"n": 41, "ms": 3.0, "gib": 0.002}},
                                "host": {"threads": 1, "memcpy_ms": 60.0, "sync_ms": 2100.0, "launch_ms": 300.0}}}}
    rows = [
        {"row": "1:sage_fp8_sm90", "s_per_step": 9.59, "s_per_step_whole": 9.7, "budget_gib": {"cuda:0": 10.04},
         "gpus": [_gpu("cuda:0", 10.2, 18.4, 18.3)], "peak_gib": [22.1, 0.0], "peak_reserved_gib": [23.5, 0.0],
         "profile": prof},
        {"row": "cp:sage_fp8_sm90", "s_per_step": 8.11, "s_per_step_whole": 8.2, "vs_1gpu": 1.182,
         "rel_l1_vs_1gpu": 3.1e-3, "budget_gib": {"cuda:0": 10.04, "cuda:1": 9.87},
         "gpus": [_gpu("cuda:0", 10.2, 18.4, 18.3), _gpu("cuda:1", 9.9, 18.7, 18.7)],
         "peak_gib": [20.5, 20.4], "peak_reserved_gib": [22.0, 21.9], "profile_error": "RuntimeError: no trace"},
        {"row": "1:unpatched", "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"},
        {"row": "cp:unpatched", "not_run": "expected 95 s, 40 s left of --limit 480"},
    ]
    md = ob.render(META, rows)
    lines = md.splitlines()
    assert "wan-14b-720p" in lines[0] and "loader estimate" in lines[0] and "a 24 GiB card emulated" in lines[0]
    assert "reserve 55.2 GiB" in lines[0]
    table = [line for line in lines if line.startswith("| ")]
    cells = {}
    for line in table:  # the main table's line of each row (the profile table's come after)
        cells.setdefault(line.split(" | ")[0][2:], line)
    one, cp = cells["1:sage_fp8_sm90"], cells["cp:sage_fp8_sm90"]
    assert "| 9.590 | 9.700 | - | - | 10.04 | 10.2 | 18.4 | 18.3 | 22.1 / 0.0 | 23.5 / 0.0 |" in one
    assert "| 8.110 | 8.200 | x1.18 | 3.10e-03 | 10.04 / 9.87 | 10.2 / 9.9 | 18.4 / 18.7 | 18.3 / 18.7 |" in cp
    assert "error: OutOfMemoryError: CUDA out of memory" in cells["1:unpatched"]
    assert "not run: expected 95 s, 40 s left of --limit 480" in cells["cp:unpatched"]
    header = next(line for line in table if line.startswith("| row | s/step"))
    # every row of the main table has the header's number of cells
    for name in ("1:sage_fp8_sm90", "cp:sage_fp8_sm90", "1:unpatched", "cp:unpatched"):
        assert cells[name].count("|") == header.count("|"), name
    prof_line = next(line for line in table if line.startswith("| 1:sage_fp8_sm90 | cuda:0 |"))
    assert "| 9590 | 7100 | 2480 | 300, 18.40, 1900 | 41, 0.00, 3 | 950 | 0.00 | 60 / 2100 | 412 (400) |" in prof_line
    assert not any(line.startswith("| cp:sage_fp8_sm90 | cuda:") for line in table)  # its profile failed
    assert "- the profile of cp:sage_fp8_sm90 failed: RuntimeError: no trace" in lines


def test_the_md_without_a_card_or_profiles(ob):
    md = ob.render({**META, "card_gib": 0.0}, [{"row": "1:unpatched", "s_per_step": 1.0, "s_per_step_whole": 1.0}])
    assert "the GPUs as they are" in md and "torch.profiler" not in md
    assert "| 1:unpatched | 1.000 | 1.000 | - | - | - | - | - | - | - | - |" in md
    failed = ob.render(META, [{"row": "1:a", "s_per_step": 1.0, "s_per_step_whole": 1.0, "profile_error": "E: x"}])
    assert failed.splitlines()[-1] == "- the profile of 1:a failed: E: x"


def test_compare_takes_the_same_backend_on_one_gpu(ob):
    import torch

    a = torch.ones(4)
    rows = [{"row": "1:s", "s_per_step": 9.6, "s_per_step_whole": 9.8},
            {"row": "cp:s", "s_per_step": 8.0, "s_per_step_whole": 8.0},
            {"row": "cp:t", "s_per_step": 4.0, "s_per_step_whole": 4.0},
            {"row": "1:unpatched", "s_per_step": 12.0, "s_per_step_whole": 12.0}]
    lat = {"1:s": a, "cp:s": a * 1.01, "cp:t": a, "1:unpatched": a * 2}
    ob.compare(rows, lat)
    by = {r["row"]: r for r in rows}
    assert by["cp:s"]["vs_1gpu"] == 1.2 and by["cp:s"]["whole_vs_1gpu"] == pytest.approx(1.225, abs=1e-3)
    assert by["cp:s"]["rel_l1_vs_1gpu"] == pytest.approx(0.01)
    assert "vs_1gpu" not in by["cp:t"] and "vs_1gpu" not in by["1:s"]  # no one-GPU row of t; a row not against itself
    assert by["1:s"]["rel_l1_vs_unpatched_1gpu"] == pytest.approx(0.5)
    assert "rel_l1_vs_unpatched_1gpu" not in by["1:unpatched"]
