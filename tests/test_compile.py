"""torch.compile (inductor, on the CPU) of real ComfyUI models carrying the patch: ComfyUI's own TorchCompileModel
wrapper and a plain torch.compile of the diffusion model.  Same output as eager, no graph break, and no recompile
per attention call shape."""

import pytest
import torch
from comfyui_support import load_pack, sample, tiny_flux, tiny_sd
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
    # every attention call ran through the op's eager implementation (and so through the dispatcher)
    assert st.total_calls == eager_calls and "comfyui" not in st.calls


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
