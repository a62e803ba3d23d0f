"""ComfyUI 0.33's MultiGPU CFG Split node after Patch Attention, the backend changed between prompts, on the CPU with two
devices (the second a label: the node makes its copy there and splits the conds over both).

ComfyUI's MultiGPU copies and the model they were made for hold each other (a reference cycle): once a graph drops
them, the garbage collector frees their patchers all at once and ComfyUI's loaded entries for them are left without a
patcher ("memory leak with model WAN21").  The CFG Split node's reuse of loaded copies then reads ``.model`` of such an
entry's patcher (None) and the prompt fails.  Patch Attention, which runs before it whenever its backend changes, drops
those entries first (nodes/loaded.py).
"""

from __future__ import annotations

import gc

import pytest
import test_context_parallel
import torch
from test_context_parallel import _case, rel_l1
from test_cp_a14b import devices

zoo = test_context_parallel.zoo  # the fixture: ComfyUI with the zoo's families and the pack loaded
devices = devices  # the fixture: ComfyUI sees n devices

pytestmark = pytest.mark.comfyui


def cfg_split(model):
    """ComfyUI's own MultiGPU CFG Split node (max_gpus 2), as a workflow runs it."""
    from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode

    out = MultiGPUCFGSplitNode.execute(model, 2)
    return out.result[0] if hasattr(out, "result") else out[0]


def test_cfg_split_runs_again_after_its_copies_were_freed_with_the_backend_changed(zoo, devices, caplog):
    import comfy.model_management as mm

    z, mod, _ = zoo
    patch = mod.nodes.patch.patch_model
    cls, case = _case(z, "WAN21_T2V")
    case = z.with_(case, cfg=5.0)  # two conds: one on each device
    loader = z.build(cls, case)
    loader.cached_patcher_init = (z.build, (cls, case))  # a reload function, as ComfyUI's UNETLoader registers
    ref = z.sample(loader, case)
    devices(2)
    held = {}  # the nodes' outputs, as ComfyUI's cache holds them until a node runs again or leaves the graph

    def prompt(backend, split=True):  # Patch Attention (its backend changed) -> [MultiGPU CFG Split] -> KSampler
        held["patch"] = patch(loader, backend)
        if split:
            held["split"] = cfg_split(held["patch"])  # the output it replaces goes: its copies' cycle is garbage
        else:
            held.pop("split", None)  # bypassed: the graph lets it go
        gc.collect()  # Python's collector, whenever it runs
        assert rel_l1(z.sample(held["split" if split else "patch"], case), ref) < 1e-5

    prompt("sdpa_math")
    prompt("sdpa")  # the copy is reused; the first prompt's patchers were freed all at once
    assert None in mm.loaded_models()  # what ComfyUI reports as a memory leak: the scene this test is about
    prompt("sdpa_math", split=False)  # one GPU for a prompt: the copy's entry is not the first any more
    with caplog.at_level("INFO", "patch_attention"):
        prompt("sdpa")  # before the guard: AttributeError ('NoneType' object has no attribute 'model')
    assert None not in mm.loaded_models()
    assert any("dropped" in r.getMessage() and "MultiGPU CFG Split" in r.getMessage() for r in caplog.records)
    (copy,) = held["split"].get_additional_models_with_key("multigpu")
    assert copy.load_device == torch.device("cpu", 1)


def test_nothing_is_collected_without_multigpu_copies(zoo, monkeypatch):
    """Without MultiGPU copies or released entries among ComfyUI's loaded models, Patch Attention runs no garbage
    collection (it costs a full pass over the process's objects)."""
    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    model = z.build(cls, case)
    z.sample(model, case)  # loaded, on one device
    runs = []
    monkeypatch.setattr(mod.nodes.loaded.gc, "collect", lambda *a: runs.append(a) or 0)
    mod.nodes.patch.patch_model(model, "sdpa_math")
    assert runs == []
