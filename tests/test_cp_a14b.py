"""Wan 2.2 A14B under Context Parallel on the CPU: two expert models (high noise, low noise) sampled in turn by two
KSampler (Advanced) nodes, the first leaving noise for the second, each model through ModelSamplingSD3 (shift 8) and its
own Context Parallel node, as ComfyUI's Wan 2.2 14B template samples them.  The A14B checkpoints load as ComfyUI's
Wan 2.1 configuration (WAN21_T2V: 16-channel latents), so the experts are two tiny WAN21_T2V models with different
weights.

Against the same two models on one device, for N = 2 and 3: ranks simulated on one device (the node's ``simulate``),
and ComfyUI's own MultiGPU copies made for N devices (the second and third device a label on the CPU: ComfyUI makes
each expert's copies with its loader's reload function, the run splits over them), where the copies of both experts
must stay apart, be reused by a second prompt, and be freed with the graph.
"""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import test_context_parallel
import torch
from test_context_parallel import _case, _split, counting_exchanges, rel_l1

zoo = test_context_parallel.zoo  # the fixture: ComfyUI with the zoo's families and the pack loaded

pytestmark = pytest.mark.comfyui

STEPS, SWITCH = 4, 2  # ComfyUI's template: 20 steps, the low-noise expert from step 10


def experts(z):
    """(high-noise expert, low-noise expert, the case they are sampled with): two WAN21_T2V models, other weights."""
    cls, case = _case(z, "WAN21_T2V")
    return shifted(z.build(cls, case)), shifted(z.build(cls, z.with_(case, seed=1))), case


def shifted(model):
    """ModelSamplingSD3 (shift 8), before the pack's nodes as in the template."""
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    return ModelSamplingSD3().patch(model, 8.0)[0]


def a14b(z, high, low, case):
    """The template's sampling: KSampler (Advanced) with the high-noise expert for steps 0-SWITCH (noise added,
    leftover noise returned), then the low-noise expert to the end."""
    import nodes

    ks = nodes.KSamplerAdvanced()
    neg = z.zeroed(case.positive)
    latent = {"samples": torch.zeros(case.latent)}
    (latent,) = ks.sample(high, "enable", 7, STEPS, case.cfg, "euler", "simple", case.positive, neg, latent, 0, SWITCH,
                          "enable")
    (latent,) = ks.sample(low, "disable", 7, STEPS, case.cfg, "euler", "simple", case.positive, neg, latent, SWITCH,
                          10000, "disable")
    return latent["samples"].float()


@pytest.mark.parametrize("n", [2, 3])
def test_two_pairsplit_in_turn_give_the_one_device_latent(zoo, n):
    z, mod, _ = zoo
    high, low, case = experts(z)
    ref = a14b(z, high, low, case)
    with counting_exchanges(mod) as counts:
        out = a14b(z, _split(mod, high, n), _split(mod, low, n), case)
    assert rel_l1(out, ref) < 1e-5, rel_l1(out, ref)
    # every step of either expert split over every rank: one self-attention call per block and rank
    blocks = len(high.model.diffusion_model.blocks)
    assert sorted(set(counts)) == list(range(n)) and len(counts) == n * blocks * STEPS


@pytest.fixture
def devices(zoo, monkeypatch):
    """``devices(n)``: ComfyUI sees n devices, the CPU and ``cpu:1``, ``cpu:2`` (labels on the CPU): the node asks
    ComfyUI for a MultiGPU copy of the model on each other device, and the run splits over them."""
    import comfy.model_management as mm

    def make(n):
        devs = [torch.device("cpu")] + [torch.device("cpu", i) for i in range(1, n)]
        monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(devs))
        return devs

    mm.unload_all_models()
    yield make
    mm.unload_all_models()


def reloadable(z, model, case):
    """``model`` with a reload function as ComfyUI's UNETLoader registers one (the same weights, loaded afresh)."""
    import comfy.supported_models as sm

    model.cached_patcher_init = (z.build, (sm.WAN21_T2V, case))
    return model


@pytest.mark.parametrize("n", [2, 3])
def test_each_expert_gets_its_own_copies_reused_by_the_next_prompt_and_freed_with_the_graph(zoo, devices, n):
    import comfy.model_management as mm

    z, mod, _ = zoo
    cpn = importlib.import_module(mod.__name__ + ".nodes.context_parallel")
    high, low, case = experts(z)
    hc, lc = case, z.with_(case, seed=1)
    ref = a14b(z, high, low, case)
    devices(n)
    pair = {"high": reloadable(z, high, hc), "low": reloadable(z, low, lc)}
    del high, low

    held = {}  # the nodes' outputs, kept as ComfyUI's cache keeps them until the nodes run again

    def prompt():  # the two Context Parallel nodes (run again, as after an edit upstream), then the two samplers
        out = {k: cpn.context_parallel(m, gpus=0, cfg_split=False, min_tokens=0) for k, m in pair.items()}
        held.update(out)
        with counting_exchanges(mod) as counts:
            latent = a14b(z, held["high"], held["low"], case)
        assert rel_l1(latent, ref) < 1e-5, rel_l1(latent, ref)
        assert sorted(set(counts)) == list(range(n))
        return [sorted(c.load_device.index for c in m.get_additional_models_with_key("multigpu")) for m in out.values()]

    def on_devices():
        return {(m.load_device, id(m.model)) for m in mm.loaded_models()}

    assert prompt() == [list(range(1, n))] * 2  # each expert: a copy on every other device
    loaded = on_devices()
    assert len(loaded) == 2 * n  # both experts on every device, no copy shared between them
    models = [weakref.ref(m) for m in {id(p.model): p.model for p in mm.loaded_models()}.values()]
    gc.collect()
    prompt()  # the nodes again: ComfyUI reuses the loaded copies, no expert is copied again
    assert on_devices() == loaded
    held.clear()
    pair.clear()
    mm.unload_all_models()
    mm.cleanup_models()
    gc.collect()
    alive = [r() for r in models if r() is not None]
    assert not alive, [type(o).__name__ for o in gc.get_referrers(alive[0])][:8]
    assert mm.loaded_models() == []
