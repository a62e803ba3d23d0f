"""No silent no-ops: a patched model whose attention never reaches the override (it calls ComfyUI's attention without
``transformer_options``) is said once per sampling run, naming the model and why, and counted in the statistics that
``log_stats`` reports. Models whose attention reaches the hook, compiled ``sdpa`` (ComfyUI's function inside the graph,
uncounted) and a Patch Attention that another override replaced get no such warning."""

import logging

import pytest
import torch
from conftest import capture
from pack import load

P = load()
A = P.attention
patch = P.nodes.patch


def _warnings(records):
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "cannot reach the attention" in r.getMessage()]


def _run(ov, forwards, calls_per_forward):
    """One sampling run through the node's two wrappers; each forward makes ``calls_per_forward`` attention calls."""
    fw, sw = patch.ForwardWrapper(ov), patch.SampleWrapper(ov)
    q = torch.randn(1, 16, 32)

    def forward(x, t):
        for _ in range(calls_per_forward):
            ov(None, q, q, q, 2, transformer_options={})
        return x

    def run(*args):
        for i in range(forwards):
            fw(forward, torch.zeros(1), torch.tensor([float(10 - i)]))

    sw(run, None, None, None, torch.tensor([10.0, 5.0, 0.0]))


def test_a_model_whose_attention_never_reaches_the_hook_is_said_once_per_run_and_counted():
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"), log_stats=True)
    with capture("patch_attention") as recs:
        _run(ov, forwards=3, calls_per_forward=0)
        _run(ov, forwards=2, calls_per_forward=0)
    warns = _warnings(recs)
    assert len(warns) == 2  # once per run
    assert "transformer_options" in warns[0] and "ComfyUI's own attention" in warns[0]
    [(model, why)] = list(ov.stats.unreached)
    assert ov.stats.unreached[(model, why)] == 1  # the last run (statistics are per run)
    summary = [r.getMessage() for r in recs if r.levelno == logging.INFO and "attention not reached" in r.getMessage()]
    assert len(summary) == 2 and "transformer_options" in summary[-1]


def test_only_the_first_forward_decides():
    """A forward with no attention call later in a run (a cache node skipping the model's blocks) is no bypass."""
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"))
    fw, sw = patch.ForwardWrapper(ov), patch.SampleWrapper(ov)
    q = torch.randn(1, 16, 32)

    def forward(x, t):
        ov(None, q, q, q, 2, transformer_options={})
        return x

    def run(*args):
        fw(forward, torch.zeros(1), torch.tensor([10.0]))
        fw(lambda x, t: x, torch.zeros(1), torch.tensor([5.0]))  # cached: the blocks did not run

    with capture("patch_attention") as recs:
        sw(run, None, None, None, torch.tensor([10.0, 5.0, 0.0]))
    assert not _warnings(recs) and not ov.stats.unreached


def test_the_tuning_run_says_it_by_its_own_name():
    """Tune Sparse Attention on a model its override cannot reach: the same warning, naming the tuning node."""
    from importlib import import_module

    tuner = import_module(P.__name__ + ".measure.sparge_tune").SpargeTuner(budget=0.05)
    ov = patch.TuningOverride(tuner, "profile.json", "fp", "Model")
    with capture("patch_attention") as recs:
        patch.ForwardWrapper(ov)(lambda x, t: x, torch.zeros(1), torch.tensor([1.0]))
    warns = _warnings(recs)
    assert len(warns) == 1 and warns[0].startswith("Tune Sparse Attention (sparge)")


def test_a_model_whose_attention_reaches_the_hook_gets_no_warning():
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"))
    with capture("patch_attention") as recs:
        _run(ov, forwards=3, calls_per_forward=2)
    assert not _warnings(recs) and not ov.stats.unreached and ov.stats.calls["sdpa_math"] == 6


def test_a_replaced_patch_attention_is_not_taken_for_a_model_the_hook_cannot_reach():
    """Another override applied after Patch Attention: no call reaches it, and the warning that says so is the
    composition's ("replaced"), not this one."""
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"))
    ov.replaced_by = "another override"
    with capture("patch_attention") as recs:
        fw = patch.ForwardWrapper(ov)
        fw(lambda x, t: x, torch.zeros(1), torch.tensor([1.0]))
    assert not _warnings(recs) and not ov.stats.unreached


def test_compiled_sdpa_traced_into_the_graph_is_not_taken_for_a_bypassed_model():
    """`sdpa` under torch.compile runs ComfyUI's own function inside the graph: no call is counted, and none must be
    reported unreached. The traced branch marks the override; the graph stays one graph."""
    import torch._dynamo

    def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                          **kwargs):
        b = q.shape[0]
        qh, kh, vh = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(b, -1, q.shape[-1])

    attention_pytorch.__module__ = "comfy.ldm.modules.attention"
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa"))
    torch._dynamo.reset()
    model = torch.compile(lambda x: ov(attention_pytorch, x, x, x, 2, transformer_options={}), backend="eager",
                          fullgraph=True)
    fw = patch.ForwardWrapper(ov)
    x = torch.randn(1, 16, 32)
    try:
        with capture("patch_attention") as recs:
            for i in range(2):
                fw(lambda x, t: model(x), x, torch.tensor([float(i)]))
    finally:
        torch._dynamo.reset()
    assert ov.traced_host and ov.stats.total_calls == 0
    assert not _warnings(recs) and not ov.stats.unreached


# ---------------------------------------------------------------- real zoo models (both releases)

@pytest.fixture(scope="module")
def zoo():
    from comfyui_support import comfy, load_pack

    comfy()
    import zoo as z

    z.load_families()
    mod, mappings = load_pack()
    return z, mod, mappings


def _patched(zoo, name, backend="sdpa_math", log_stats=True):
    import comfy.supported_models as sm
    from test_comfyui_integration import patch as node_patch

    z, mod, mappings = zoo
    cls = getattr(sm, name)
    case = z.BUILDERS[name](cls, False)
    base = z.build(cls, case)
    return case, base, node_patch(mappings, base, backend, log_stats=log_stats)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", ["PixArtAlpha", "HunyuanDiT"])
def test_no_op_family_is_said_once_with_its_class(zoo, name):
    z, mod, _ = zoo
    case, base, patched = _patched(zoo, name)
    assert case.outside_hook.startswith("all:")
    with capture("patch_attention") as recs:
        out = z.sample(patched, case)
    warns = _warnings(recs)
    cls_name = {"PixArtAlpha": "PixArtMS", "HunyuanDiT": "HunYuanDiT"}[name]
    assert len(warns) == 1 and cls_name in warns[0] and "transformer_options" in warns[0]
    st = mod.nodes.patch.override_of(patched).stats
    assert st.total_calls == 0 and sum(st.unreached.values()) == 1  # the run's first forward said it
    assert torch.isfinite(out).all()


@pytest.mark.comfyui
def test_family_that_reaches_the_hook_gets_no_warning(zoo):
    z, mod, _ = zoo
    case, base, patched = _patched(zoo, "SD15")
    with capture("patch_attention") as recs:
        z.sample(patched, case)
    st = mod.nodes.patch.override_of(patched).stats
    assert not _warnings(recs) and not st.unreached and st.calls["sdpa_math"] > 0


@pytest.mark.comfyui
def test_compiled_sdpa_on_a_real_model_gets_no_warning(zoo):
    """ComfyUI's own torch.compile wrapper (the TorchCompileModel node's), with dynamo's eager backend to keep it
    cheap. Where ComfyUI's function is attention_pytorch, `sdpa` traces it into the graph and nothing is counted;
    otherwise (ComfyUI's CPU choice) the calls run through the custom op and are counted. Either way nothing is
    reported unreached."""
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    z, mod, _ = zoo
    case, base, patched = _patched(zoo, "SD15", backend="sdpa", log_stats=False)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    try:
        with capture("patch_attention") as recs:
            z.sample(compiled, case)
    finally:
        torch._dynamo.reset()
    ov = mod.nodes.patch.override_of(compiled)
    assert ov.traced_host or ov.stats.total_calls > 0
    assert not _warnings(recs) and not ov.stats.unreached
