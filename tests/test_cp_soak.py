"""tests/gpu/soak.py on the CPU: ComfyUI's server in CPU mode seeing two devices, a round of prompts through /prompt
(one device, Context Parallel, ComfyUI's MultiGPU CFG Split; CFG 1 and 5; the backend changed between prompts): none
fails, the split and CFG Split's copies both ran, and the report says so."""

from __future__ import annotations

import importlib.util
import json
import os

import comfyui_support
import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.server]

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_round_of_prompts_through_the_server_fails_none_and_runs_both_multigpu_paths(tmp_path):
    comfyui_support.comfy()  # skips where no ComfyUI is found
    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        pytest.skip("the multi-GPU nodes need ComfyUI 0.33 or later")
    spec = importlib.util.spec_from_file_location("gpu_soak", os.path.join(HERE, "gpu", "soak.py"))
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    rc = soak.main(["--out", str(tmp_path), "--cpu", "--devices", "2", "--prompts", "12", "--backends", "sdpa,sdpa_math",
                    "--size", "96x96x5", "--server-args=--disable-cuda-malloc"])
    res = json.load(open(tmp_path / "soak.json"))
    assert res["meta"]["server_args"] == "--disable-cuda-malloc"  # what the GPU stage starts ComfyUI with for graphs
    assert res["verdict"]["split_runs"] > 0  # the Context Parallel prompts split (the soak's model is below every floor)
    assert rc == 0 and res["verdict"]["failed"] == 0 and res["verdict"]["flat"], res["verdict"]
    assert [(r["mode"], r["cfg"]) for r in res["prompts"][:4]] == [("one", 1.0)] * 2 + [("one", 5.0)] * 2
    assert len({r["backend"] for r in res["prompts"]}) == 2
    assert all(a["backend"] != b["backend"] for a, b in zip(res["prompts"], res["prompts"][1:]))
    log = (tmp_path / "soak-server.log").read_text()
    assert "Context Parallel: 2 of 2 forwards split over 2 GPUs" in log  # the pack's split, at CFG 1
    assert "Creating deepclone of WAN21 for cpu:1" in log  # a MultiGPU copy on the second device
    assert "Reusing loaded multigpu deepclone of WAN21 for cpu:1" in log  # ComfyUI's reuse, which read the entries
