"""tests/gpu/cp_zoo.py's dry run on the CPU (2 ranks simulated as threads, tiny sizes): a configuration with a unit is
split and gives the one-device latent, a ControlNet forward is kept on one device with the node's reason, a model
without a unit is listed as such, and kernels that need CUDA are reported as not runnable, not dropped."""

from __future__ import annotations

import importlib.util
import os

import pytest
import test_context_parallel

zoo = test_context_parallel.zoo  # the fixture: ComfyUI, the zoo and the pack

HERE = os.path.dirname(os.path.abspath(__file__))


def _cp_zoo():
    spec = importlib.util.spec_from_file_location("gpu_cp_zoo", os.path.join(HERE, "gpu", "cp_zoo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CZ = _cp_zoo()


def _run(zoo, name, backends):
    import comfy.supported_models as sm

    z, mod, _ = zoo
    config, builder = CZ.GZ.resolve(z, name)
    return CZ.run_config(z, mod, name, getattr(sm, config), builder, backends, 0, device="cpu", ranks=2,
                         gpu_sizes=False)


@pytest.mark.comfyui
def test_a_configuration_with_a_unit_is_split_and_kernels_that_need_cuda_are_reported(zoo):
    res = _run(zoo, "WAN21_T2V", ["unpatched", "sdpa", "sdpa_cudnn", "flash_attn4"])
    assert res["unit"] == "Wan 2.1/2.2"
    for backend in ("unpatched", "sdpa"):
        run = res["runs"][backend]
        assert run["status"] == "ok" and run["split"] == "split", run
        assert run["rel_l1"] <= run["bound_rel_l1"] == 1e-5
    assert res["runs"]["sdpa"]["calls"] == {"comfyui": 8}  # both ranks' lanes, 2 steps, self- and cross-attention
    assert res["runs"]["sdpa_cudnn"]["status"] == "not runnable here"
    assert "cuda" in res["runs"]["sdpa_cudnn"]["why"]
    assert res["runs"]["flash_attn4"]["status"] == "not runnable here"  # installed or not, never dropped


@pytest.mark.comfyui
def test_a_controlnet_forward_stays_on_one_device_with_the_reason(zoo):
    run = _run(zoo, "Flux+ControlNet", ["unpatched"])["runs"]["unpatched"]
    assert run["ok"] and run["split"] == "declined" and "ControlNet" in run["split_detail"]


@pytest.mark.comfyui
def test_a_model_without_a_unit_is_listed(zoo):
    res = _run(zoo, "SD15", ["unpatched"])
    assert res["no_unit"] == "UNetModel" and res["runs"] == {}


def test_a_split_where_a_rank_exchanged_nothing_fails():
    seen = {"ranks": [0, 0, 0], "forwards": (2, 2), "whole": []}
    assert CZ.split_verdict(seen, 2)[0] == "not split"
    seen["ranks"] += [1, 1, 1]
    assert CZ.split_verdict(seen, 2) == ("split", "2/2 forwards split, exchanged calls per GPU [3, 3]")
