"""ComfyUI 0.33's estimate-based loader pins a partly loaded model's offloaded weights, in one set shared by every
patcher of the model, and a freed patcher unpins the whole set (``ModelPatcher.__del__``).  Each sampling run makes and
frees patchers of the GPUs' copies (``match_multigpu_clones``): nodes/loaded.py's PREPARE_SAMPLING wrapper pins again,
once the run's models are loaded, what they have offloaded and lost the pins of.  On the CPU nothing is pinned for
real: ComfyUI's pin and unpin calls are recorded instead."""

from __future__ import annotations

import gc
import importlib
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytestmark = pytest.mark.comfyui


@pytest.fixture
def comfy_pins(monkeypatch):
    """(the pack, ComfyUI's model_management, the weights ComfyUI was asked to unpin)."""
    import comfyui_support

    pack, _ = comfyui_support.load_pack()
    import comfy.model_management as mm

    if not hasattr(mm, "unpin_memory"):
        pytest.skip("this ComfyUI does not pin offloaded weights (0.33 does)")
    unpinned = []
    monkeypatch.setattr(mm, "unpin_memory", lambda t: unpinned.append(t) or True)
    return pack, mm, unpinned


def _with_copy():
    """A tiny Flux's patcher with a MultiGPU copy registered (the copy: another patcher of its own model, as ComfyUI's
    deep clones are), one of the copy's weights recorded as pinned."""
    import comfyui_support

    base = comfyui_support.tiny_flux()
    copy = comfyui_support.tiny_flux()
    copy.clone_base_uuid, copy.is_multigpu_base_clone = base.clone_base_uuid, True
    key = "diffusion_model.img_in.weight"
    copy.pinned.add(key)
    m = base.clone()
    m.set_additional_models("multigpu", [copy])
    return m, copy.model, key


def _run(m, wrapper):
    """What a sampling run's preparation does first (``_prepare_sampling``: the copies' patchers replaced), through
    ``wrapper`` when given; the replaced patchers freed."""
    prepare = lambda model, *a, **k: model.match_multigpu_clones()  # noqa: E731
    (wrapper(prepare, m) if wrapper else prepare(m))
    gc.collect()


def test_a_run_frees_the_copies_patchers_and_comfyui_unpins_the_copy(comfy_pins):
    """The behaviour the wrapper exists for, seen without it: after two runs the copy's weight was unpinned and its
    record is gone from the set the live patcher shares."""
    _, _, unpinned = comfy_pins
    m, model, key = _with_copy()
    _run(m, None)
    _run(m, None)
    live = m.get_additional_models_with_key("multigpu")[0]
    assert live.model is model and key not in live.pinned
    assert len(unpinned) == 1 and unpinned[0] is model.diffusion_model.img_in.weight


def test_keep_pins_pins_the_copys_offloaded_weights_again_after_each_run(comfy_pins, monkeypatch):
    """The copy partly loaded (its input layer offloaded): after each run's preparation its weights are asked to be
    pinned again through the live patcher of the copy, and the main model's, loaded whole, is left alone."""
    import comfy.model_patcher

    pack, _, unpinned = comfy_pins
    loaded = sys.modules[pack.__name__ + ".nodes.loaded"]
    m, model, key = _with_copy()
    model.model_lowvram = True
    model.diffusion_model.img_in.prev_comfy_cast_weights = False  # what ComfyUI's partial load marks offloaded
    asked = []
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device",
                        lambda self, k: asked.append((self.model, k)))
    wrapper = loaded.KeepPins()
    for run in range(1, 3):
        _run(m, wrapper)
        live = m.get_additional_models_with_key("multigpu")[0]
        assert live.model is model
        assert asked == [(model, "diffusion_model.img_in.weight"), (model, "diffusion_model.img_in.bias")] * run
    assert len(unpinned) == 1  # ComfyUI unpinned the copy at the first run's start: what the wrapper mends


def test_repin_pins_the_offloaded_weights_found_unpinned(comfy_pins, monkeypatch):
    """A partly loaded model: the weights of modules ComfyUI offloaded, on the CPU and not pinned, are pinned again
    through the patcher (ComfyUI's own call); modules loaded whole and models loaded whole are left alone."""
    import comfyui_support

    pack, _, _ = comfy_pins
    loaded = sys.modules[pack.__name__ + ".nodes.loaded"]
    p = comfyui_support.tiny_flux()
    asked = []
    monkeypatch.setattr(p, "pin_weight_to_device", asked.append)
    assert loaded.repin(p) == 0 and asked == []  # loaded whole: nothing offloaded
    p.model.model_lowvram = True
    p.model.diffusion_model.img_in.prev_comfy_cast_weights = False  # what ComfyUI's partial load marks offloaded
    loaded.repin(p)
    assert asked == ["diffusion_model.img_in.weight", "diffusion_model.img_in.bias"]


def test_both_nodes_put_the_wrapper_on_their_clone_and_disabled_takes_it_off(comfy_pins):
    import comfy.patcher_extension as pe
    import comfyui_support

    pack, _, _ = comfy_pins
    loaded = sys.modules[pack.__name__ + ".nodes.loaded"]
    cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")

    def keepers(m):
        return [w for w in m.get_wrappers(pe.WrappersMP.PREPARE_SAMPLING, loaded.KEY)]

    base = comfyui_support.tiny_flux()
    patched = pack.nodes.patch.patch_model(base, "sdpa")
    assert [type(w).__name__ for w in keepers(patched)] == ["KeepPins"]
    assert keepers(pack.nodes.patch.patch_model(patched, "disabled")) == []
    split = cpn.context_parallel(base, simulate=2)
    assert [type(w).__name__ for w in keepers(split)] == ["KeepPins"]


def test_a_failing_pin_is_logged_and_the_run_goes_on(comfy_pins, monkeypatch, caplog):
    import logging

    import comfy.model_patcher

    pack, _, _ = comfy_pins
    loaded = sys.modules[pack.__name__ + ".nodes.loaded"]
    m, model, key = _with_copy()
    model.model_lowvram = True
    model.diffusion_model.img_in.prev_comfy_cast_weights = False

    def refuse(self, k):
        raise RuntimeError("no pinning here")

    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device", refuse)
    with caplog.at_level(logging.WARNING, logger="patch_attention"):
        assert loaded.KeepPins()(lambda model, *a, **k: "prepared", m) == "prepared"
    assert "could not pin the offloaded weights of Flux" in caplog.text and "no pinning here" in caplog.text
