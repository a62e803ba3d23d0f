"""torch.compile (inductor, on the CPU) of real ComfyUI models carrying the patch: ComfyUI's own TorchCompileModel
wrapper and a plain torch.compile of the diffusion model.  Same output as eager, no graph break, and no recompile
per attention call shape."""

import pytest
import torch
from comfyui_support import compiled_as_the_node, load_pack, sample, tiny_flux, tiny_sd
from conftest import smoothing_kernel
from test_comfyui_integration import patch, rel, stats_of

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def pack():
    return load_pack()


def _compile_counts():
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend, kind", [("auto", "flux"), ("sdpa", "sd"), ("sdpa_math", "flux")])
def test_torch_compile_model_wrapper_runs_the_patch_through_the_custom_op(pack, dynamo, backend, kind):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    mod, mappings = pack
    base = tiny_flux() if kind == "flux" else tiny_sd()
    eager = patch(mappings, base, backend)
    ref = sample(eager, kind, steps=2)
    eager_calls = stats_of(mod, eager).total_calls
    compiled = eager.clone()
    set_torch_compile_wrapper(compiled, backend="inductor")  # what ComfyUI's TorchCompileModel node does
    out = sample(compiled, kind, steps=2)
    assert rel(out, ref) < 1e-4
    breaks, graphs = _compile_counts()
    assert breaks == 0 and graphs == 1
    st = stats_of(mod, compiled)
    if backend == "sdpa" and host_name(compiled) == "attention_pytorch":
        # `sdpa` is ComfyUI's own SDPA function: traced into the graph as in the unpatched model, the op is not used
        assert st.total_calls == 0
    else:
        # every attention call ran through the op's eager implementation (and so through the dispatcher)
        assert st.total_calls == eager_calls and "comfyui" not in st.calls


def host_name(model):
    import comfy.ldm.modules.attention as cattn

    return getattr(cattn.optimized_attention, "__name__", "")  # the tiny SD model's attention function


def test_sdpa_under_compile_traces_comfyuis_sdpa_function(pack, dynamo, monkeypatch):
    """With ComfyUI's attention_pytorch as the model's attention (NVIDIA's default), a compiled `sdpa` model has
    ComfyUI's SDPA call in its graph, as the unpatched model does: no custom op, nothing counted."""
    import comfy.ldm.flux.math as fmath
    import comfy.ldm.modules.attention as cattn

    mod, mappings = pack
    monkeypatch.setattr(fmath, "optimized_attention", cattn.attention_pytorch)
    base = tiny_flux()
    eager = patch(mappings, base, "sdpa")
    ref = sample(eager, "flux", steps=2)
    compiled = eager.clone()
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    set_torch_compile_wrapper(compiled, backend="inductor")
    ops = []
    real = mod.attention.op.attention_op
    monkeypatch.setattr(mod.attention.op, "attention_op", lambda *a, **k: ops.append(1) or real(*a, **k))
    out = sample(compiled, "flux", steps=2)
    assert rel(out, ref) < 1e-4 and not ops
    breaks, graphs = _compile_counts()
    assert breaks == 0 and graphs == 1


@pytest.mark.parametrize("kind", ["flux", "sd"])
def test_a_smooth_k_backend_gets_its_k_smoothed_in_the_graph(pack, dynamo, kind):
    """A backend whose wrapper subtracts K's mean (SageAttention's smooth_k) gets that done in the compiled graph,
    where inductor fuses it with the ops producing K, and is told so; the output is the eager one, in one graph."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    mod, mappings = pack
    A = mod.attention
    seen = []
    A.REGISTRY.register(A.Backend(name="t_smooth", family="test", fn=smoothing_kernel(seen), constraints=(),
                                  layouts=("HND", "NHD"), layout_by_output=True, smooth_k=True,
                                  probe=lambda: A.Availability(True)))
    try:
        base = tiny_flux() if kind == "flux" else tiny_sd()
        eager = patch(mappings, base, "t_smooth")
        ref = sample(eager, kind, steps=2)
        assert seen and all("smooth_k" not in s["opts"] for s in seen)  # eager: the kernel's wrapper smooths
        seen.clear()
        compiled = eager.clone()
        set_torch_compile_wrapper(compiled, backend="inductor")
        out = sample(compiled, kind, steps=2)
        assert rel(out, ref) < 1e-4
        assert seen and all(s["opts"] == {"smooth_k": False} and s["k_mean"] < 1e-4 for s in seen)  # done in the graph
        breaks, graphs = _compile_counts()
        assert breaks == 0 and graphs == 1
    finally:
        A.REGISTRY.unregister("t_smooth")
        A.dispatch.clear_plan_cache()


def test_a_new_patch_of_a_compiled_model_reaches_its_own_backend(pack, dynamo):
    """TorchCompileModel's node keeps no guard on what the model carries in transformer_options, so the graph compiled
    for one Patch Attention clone runs again for the next clone of the same model (another backend picked, the
    workflow queued again).  The op reads its handler from the clone at every call: the new clone's calls reach its
    own backend, with the first clone gone, and give its eager output."""
    import gc


    mod, mappings = pack
    A = mod.attention
    seen = {"t_one": [], "t_two": []}
    for name, calls in seen.items():
        A.REGISTRY.register(A.Backend(name=name, family="test", fn=smoothing_kernel(calls), constraints=(),
                                      layouts=("HND", "NHD"), layout_by_output=True,
                                      probe=lambda: A.Availability(True)))

    try:
        base = tiny_flux()
        sample(compiled_as_the_node(patch(mappings, base, "t_one")), "flux", steps=2)
        assert seen["t_one"] and not seen["t_two"]
        gc.collect()  # the first clone is gone, as when a workflow's node gives a new one
        second = patch(mappings, base, "t_two")
        ref = sample(second, "flux", steps=2)
        eager_calls = len(seen["t_two"])
        seen["t_one"].clear()
        out = sample(compiled_as_the_node(second), "flux", steps=2)
        assert not seen["t_one"] and len(seen["t_two"]) == 2 * eager_calls
        assert rel(out, ref) < 1e-4
        _, graphs = _compile_counts()
        assert graphs == 1  # the first clone's graph ran for the second
    finally:
        for name in seen:
            A.REGISTRY.unregister(name)
        A.dispatch.clear_plan_cache()


def test_a_patch_added_to_a_model_already_compiled_says_what_runs(pack, dynamo, monkeypatch):
    """The model sampled under TorchCompileModel (its node's guard filter; ComfyUI's attention_pytorch, NVIDIA's
    default, traced in one graph), then Patch Attention is added and the model compiled again: the code compiled without
    the patch runs (nothing tells dynamo the patch changed), no call reaches the patch, and the warning names
    torch.compile as the likely cause and how to clear it."""
    import comfy.ldm.flux.math as fmath
    import comfy.ldm.modules.attention as cattn
    from conftest import capture

    mod, mappings = pack
    monkeypatch.setattr(fmath, "optimized_attention", cattn.attention_pytorch)
    base = tiny_flux()

    sample(compiled_as_the_node(base), "flux", steps=1)
    patched = patch(mappings, base, "sdpa_math", log_stats=True)
    with capture("patch_attention") as recs:
        sample(compiled_as_the_node(patched), "flux", steps=1)
    said = [r.getMessage() for r in recs if "cannot reach the attention" in r.getMessage()]
    assert len(said) == 1 and "torch.compile is on" in said[0] and "restarting ComfyUI" in said[0]
    st = stats_of(mod, patched)
    assert st.total_calls == 0 and [why for _, why in st.unreached] == [mod.nodes.override.UNREACHED_COMPILED]


def test_new_call_shapes_do_not_recompile_per_shape(pack, dynamo):
    mod, mappings = pack
    m = patch(mappings, tiny_sd(), "sdpa_math")
    dm = m.model.diffusion_model
    compiled = torch.compile(dm, backend="inductor")
    m.add_object_patch("diffusion_model", compiled)
    outs = {}
    for size in (16, 24, 32, 40):  # SD's self-attention sees 64 .. 400 tokens, cross-attention 77 keys
        x = torch.randn(1, 4, size, size)
        outs[size] = sample_latent(m, x)
        assert torch.isfinite(outs[size]).all()
    breaks, graphs = _compile_counts()
    assert breaks == 0 and graphs <= 2  # the first shape, then one dynamic-shape graph for all later ones
    assert stats_of(mod, m).calls["sdpa_math"] > 0


def sample_latent(model, latent):
    import comfy.sample
    from comfyui_support import sd_conds

    pos, neg = sd_conds()
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", pos, neg, latent, disable_pbar=True)
