"""Patch Attention beside everything else that writes ComfyUI's attention hook, in real ComfyUI sampling (CPU): Model
Attention Backend before and after it, another pack's override after it, core's stacking protocol (Model Sparse
Attention's: declined calls go to the override that was there before), TorchCompileModel and Select Model Device.
Each case is a row of README's composition table."""

import logging

import pytest
import torch
from comfyui_support import load_pack, sample, tiny_flux
from conftest import capture
from test_comfyui_integration import patch, rel, stats_of

pytestmark = pytest.mark.comfyui
KEY = "optimized_attention_override"


@pytest.fixture(scope="module")
def pack():
    return load_pack()


@pytest.fixture
def mab():
    """ComfyUI's Model Attention Backend node (0.33+)."""
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend
    except ImportError:
        pytest.skip("this ComfyUI has no Model Attention Backend node (added after 0.3.64)")
    return lambda model: ModelAttentionBackend().patch(model, "pytorch attention")[0]


def _with_plain_override(model, ran):
    """A clone of ``model`` with a node pack's plain override on its hook (as KJNodes' Sage patch writes it): it counts
    its calls in ``ran`` and runs ComfyUI's function."""

    def kj_style_sage_override(func, q, k, v, heads, **kwargs):
        ran.append(1)
        return func(q, k, v, heads, **kwargs)

    m = model.clone()
    m.model_options["transformer_options"][KEY] = kj_style_sage_override
    return m


def _replaced_warnings(records):
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING and "is not on this model's" in r.getMessage()]


def test_model_attention_backend_before_patch_attention_serves_the_calls_left_dense(pack, mab):
    """Model Attention Backend, then Patch Attention: the backend's override becomes Patch Attention's dense fallback
    (here for the steps before start_percent and for dense_layers), counted as such; the rest runs on the kernel."""
    mod, mappings = pack
    base = tiny_flux()
    ref = sample(base)
    under = mab(base)
    with capture("patch_attention.nodes") as recs:
        m = patch(mappings, under, "sdpa_math", start_percent=0.5, dense_layers="1")
    assert any("goes over Model Attention Backend (attention_pytorch)" in r.getMessage() for r in recs)
    ov = mod.nodes.patch.override_of(m)
    assert ov.previous is under.model_options["transformer_options"][KEY]
    with capture("patch_attention.nodes") as recs:
        out = sample(m)
    assert not _replaced_warnings(recs)
    st = stats_of(mod, m)
    # 4 steps x 2 layers: the first 3 steps come before 50 % of Flux's (shifted) schedule, both layers -> previous;
    # the last step: layer 1 (dense_layers) -> previous, layer 0 -> sdpa_math
    assert st.calls == {"previous override": 7, "sdpa_math": 1}
    assert rel(out, ref) < 1e-4
    # "disabled" takes Patch Attention off and leaves the backend's override on the hook
    off = patch(mappings, m, "disabled")
    assert off.model_options["transformer_options"][KEY] is ov.previous


def test_model_attention_backend_after_patch_attention_replaces_it_and_says_so_once(pack, mab):
    mod, mappings = pack
    base = tiny_flux()
    m = mab(patch(mappings, base, "sdpa_math"))
    with capture("patch_attention.nodes") as recs:
        sample(m)
        sample(m)
    warn = _replaced_warnings(recs)
    assert len(warn) == 1
    assert "Model Attention Backend (attention_pytorch) replaced it" in warn[0] and "Patch Attention after it" in warn[0]
    assert mod.nodes.patch.override_of(m) is None  # the hook holds the backend's override: it ran, not ours


def test_another_packs_override_after_patch_attention_replaces_it_and_says_so(pack):
    """A node pack that writes its own function on the hook (as KJNodes' Sage patch does) after Patch Attention."""
    mod, mappings = pack
    base = tiny_flux()
    m = patch(mappings, base, "sdpa_math")
    ov = mod.nodes.patch.override_of(m)
    ran = []
    m2 = _with_plain_override(m, ran)
    with capture("patch_attention.nodes") as recs:
        sample(m2)
    warn = _replaced_warnings(recs)
    assert len(warn) == 1 and "kj_style_sage_override replaced it" in warn[0]
    assert ran and ov.stats.total_calls == 0


def core_style_sparse_override(previous, decline):
    """An override following core's stacking protocol (Model Sparse Attention's ``make_attention_override``): what it
    declines goes to ``previous(func, q, k, v, heads, ...)``, the override that was on the hook before it."""
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                  skip_output_reshape=skip_output_reshape, **kwargs)
        if decline(q):
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
        return func(q, k, v, heads, **kw)  # "sparse" here: ComfyUI's own function stands in for the kernel

    return override


def test_core_stacking_protocol_reaches_patch_attention_which_counts_the_calls(pack):
    """Model Sparse Attention applied after Patch Attention: the calls it declines (short sequences, its dense blocks,
    its schedule) reach Patch Attention's dispatcher through ``previous`` and are counted; nothing is reported lost."""
    mod, mappings = pack
    base = tiny_flux()
    ref = sample(patch(mappings, base, "sdpa_math"))
    m = patch(mappings, base, "sdpa_math")
    ov = mod.nodes.patch.override_of(m)
    m2 = m.clone()
    topts = m2.model_options["transformer_options"]
    topts[KEY] = core_style_sparse_override(topts[KEY], decline=lambda q: True)
    with capture("patch_attention.nodes") as recs:
        out = sample(m2)
    assert not _replaced_warnings(recs)
    assert ov.stats.calls == {"sdpa_math": 8}
    assert rel(out, ref) < 1e-6


def test_select_model_device_after_patch_attention_keeps_it(pack):
    """Select Model Device (0.33+) on a model with a loader's reload factory (what the node and the MultiGPU split
    use): the patch survives and counts its calls."""
    try:
        from comfy_extras.nodes_multigpu import SelectModelDeviceNode
    except ImportError:
        pytest.skip("this ComfyUI has no Select Model Device node (added after 0.3.64)")
    mod, mappings = pack
    base = tiny_flux()
    # what a loader registers so that ComfyUI can build the model again (Select Model Device, MultiGPU's per-GPU
    # clones); tiny_flux's weights come from a fixed seed, so the factory's model equals this one
    base.cached_patcher_init = (lambda *a, **kw: tiny_flux(), ())
    ref = sample(base)
    m = patch(mappings, base, "sdpa_math")
    moved = SelectModelDeviceNode.execute(m, "cpu").result[0]
    out = sample(moved)
    assert rel(out, ref) < 1e-4
    st = stats_of(mod, moved)
    assert st.calls == {"sdpa_math": 8}


def test_torch_compile_model_over_patch_attention_runs_through_the_op(pack):
    """TorchCompileModel after Patch Attention: ComfyUI's compile wrapper over the patched model (the full check, per
    backend, is tests/test_compile.py); here the composition: the override stays on the hook, its op runs."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    mod, mappings = pack
    m = patch(mappings, tiny_flux(), "sdpa_math")
    ref = sample(m, steps=2)
    compiled = m.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    with capture("patch_attention.nodes") as recs:
        out = sample(compiled, steps=2)
    assert not _replaced_warnings(recs)
    assert rel(out, ref) < 1e-5 and stats_of(mod, compiled).calls["sdpa_math"] == 4
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "auto"])
def test_a_call_no_attention_can_take_is_a_clear_error_through_comfyuis_hook(pack, backend):
    """Through ComfyUI's own wrap_attn: a hidden width that is not a multiple of heads (35 with 4 heads) is a
    ValueError naming both, whichever path takes the call (ComfyUI's function raised a bare view error before)."""
    import comfy.ldm.modules.attention as ca

    mod, _ = pack
    ov = mod.nodes.patch.AttentionOverride(mod.attention.AttentionConfig(backend=backend))
    q = torch.randn(1, 8, 35)
    for _ in range(2):  # the first call and the hot path after it
        with pytest.raises(ValueError, match="q width 35 is not divisible by heads=4"):
            ca.optimized_attention(q, q, q, 4, transformer_options={KEY: ov})


def test_tensor_containers_through_comfyuis_hook(pack):
    """ComfyUI 0.33's containers through its own wrap_attn: the override's container_function gets them, takes the
    tensors, and the result is ComfyUI's own attention's."""
    import comfy.ldm.modules.attention as ca

    if not hasattr(ca, "AttentionTensorContainer"):
        pytest.skip("this ComfyUI has no attention tensor containers (added after 0.3.64)")
    mod, _ = pack
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 64, generator=g) for _ in range(3))
    ref = ca.optimized_attention(q, k, v, 2)
    for backend in ("sdpa", "sdpa_math"):
        ov = mod.nodes.patch.AttentionOverride(mod.attention.AttentionConfig(backend=backend))
        conts = [ca.AttentionTensorContainer(t.clone()) for t in (q, k, v)]
        out = ca.optimized_attention(*conts, 2, transformer_options={KEY: ov})
        assert rel(out, ref) < 1e-5 and all(c.tensor is None for c in conts)
        assert ov.stats.total_calls == 1


@pytest.fixture
def long_only(pack):
    """A test backend in the pack as ComfyUI loaded it, for one test: it refuses every call shorter than 10**6."""
    A = pack[0].attention
    A.REGISTRY.register(A.Backend(name="t_long_only", family="test", fn=lambda q, k, v, **kw: None,
                                  constraints=(A.constraints.MinSeqLen(q=10**6, kv=1),),
                                  probe=lambda: A.Availability(True), description="a kernel for very long sequences",
                                  accuracy="exact", layouts=("HND",)))
    A.dispatch.clear_plan_cache()
    yield "t_long_only"
    A.REGISTRY.unregister("t_long_only")
    A.dispatch.clear_plan_cache()


def test_a_shape_the_kernel_refuses_goes_to_the_previous_override_validated_once_per_shape(pack, long_only, monkeypatch):
    """Over another override, a call the explicit backend cannot take goes to that override, counted with the reason.
    The refusal is found once per call shape per sampling lane, not on every call: with ``dense_layers`` on, the lean
    path is off and every call takes the full path."""
    mod, mappings = pack
    A = mod.attention
    base = tiny_flux()
    ref = sample(base)
    seen = []
    m = patch(mappings, _with_plain_override(base, seen), long_only, dense_layers="99")
    prepared = []
    real = A.calls.prepare
    monkeypatch.setattr(A.calls, "prepare", lambda *a, **k: (prepared.append(tuple(a[0].shape)), real(*a, **k))[1])
    out = sample(m)
    st = stats_of(mod, m)
    assert st.calls == {"previous override": len(seen)} and len(seen) >= 8
    assert {(frm, to) for frm, to, _ in st.fallbacks} == {("t_long_only", "previous override")}
    assert all(why.startswith("query length") and why.endswith("< 1000000") for _, _, why in st.fallbacks)
    assert sum(st.fallbacks.values()) == len(seen)
    assert len(prepared) == len(set(prepared)) < len(seen)
    assert rel(out, ref) < 1e-4
