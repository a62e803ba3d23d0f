"""What ComfyUI 0.33+ adds on the attention hook, honoured on every path of the override (CPU): ``enable_gqa`` (K/V
with fewer heads), ``scale``, ``low_precision_attention`` / ``attn_precision``, a ``preferred_attention`` keyword,
tensor containers, and a clear error for a call no attention function can take."""

import weakref

import pytest
import torch
from conftest import cos_rel
from pack import load

P = load()
A = P.attention
patch = P.nodes.patch


def _rounded(q, k, v, *, layout, mask, scale, opts):
    """A lossy stand-in kernel that takes grouped-query calls (HND)."""
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, **kw).round(decimals=3)


@pytest.fixture
def lossy(pack_backend):
    pack_backend(A.Backend(name="t_kw", family="test", fn=_rounded, constraints=(), probe=lambda: A.Availability(True),
                           accuracy="8bit"))
    return "t_kw"


def _ref(q, k, v, heads, scale=None, skip_reshape=False):
    """fp32 SDPA of a ComfyUI call with fewer key heads (enable_gqa) and a given scale, as [B, N, H*D]."""
    if skip_reshape:
        qh, kh, vh = q, k, v
    else:
        d = q.shape[-1] // heads
        qh, kh, vh = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), scale=scale,
                                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return o.transpose(1, 2).flatten(2)


def _gqa_call(seed=0, heads=4, kv_heads=2, d=16, n=24):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, n, heads * d, generator=g), torch.randn(2, n, kv_heads * d, generator=g),
            torch.randn(2, n, kv_heads * d, generator=g))


def _forwards(ov, call, n=3):
    fw = patch.ForwardWrapper(ov)
    return [fw(lambda x, t: call(), None, torch.tensor([float(10 - i)])) for i in range(n)]


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "t_kw", "auto"])
def test_enable_gqa_and_scale_reach_the_kernel_on_every_eager_path(lossy, backend):
    q, k, v = _gqa_call()
    ref = _ref(q, k, v, 4, scale=0.11)
    sel = A.AutoSelector(timer=lambda name, fn, dev: {"t_kw": 1.0}.get(name, 5.0),
                         exclude={n for n in A.REGISTRY.names() if n not in ("sdpa", "t_kw")})
    ov = patch.AttentionOverride(A.AttentionConfig(backend=backend, check_finite="deferred", auto=sel), audit=False)
    outs = _forwards(ov, lambda: ov(None, q, k, v, 4, enable_gqa=True, scale=0.11, transformer_options={}))
    for out in outs:  # the first call takes the full path; later ones must not take a lean entry that drops them
        assert out.shape == ref.shape and cos_rel(out, ref)[1] < 2e-3
    assert not ov.lane().lean  # calls with scale / enable_gqa keep the full path
    # without the scale the result is another one: the keyword is not ignored
    plain = ov(None, q, k, v, 4, enable_gqa=True, transformer_options={})
    assert cos_rel(plain, ref)[1] > 0.01


def test_grouped_query_without_enable_gqa_is_a_clear_error():
    q, k, v = _gqa_call()
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"))
    with pytest.raises(ValueError, match=r"q width 64 != k width 32 \(pass enable_gqa=True"):
        ov(None, q, k, v, 4, transformer_options={})


def test_a_width_that_is_not_a_multiple_of_heads_is_a_clear_error():
    """The bad-input case that escaped: width 35 with 4 heads on `sdpa`, which hands the call to ComfyUI's own
    function (its view raised "shape '[1, -1, 4, 8]' is invalid")."""
    def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                          **kwargs):
        b, _, dim = q.shape
        return q.view(b, -1, heads, dim // heads)  # what ComfyUI's function does first

    attention_pytorch.__module__ = "comfy.ldm.modules.attention"
    q = torch.randn(1, 8, 35)
    for backend in ("sdpa", "sdpa_math"):
        ov = patch.AttentionOverride(A.AttentionConfig(backend=backend))
        for _ in range(2):  # the first call and the hot path after it
            with pytest.raises(ValueError, match="q width 35 is not divisible by heads=4"):
                ov(attention_pytorch, q, q, q, 4, transformer_options={})


@pytest.mark.parametrize("request_kw", [{"low_precision_attention": False}, {"attn_precision": torch.float32}])
def test_precision_requests_with_gqa_never_reach_a_lossy_kernel(lossy, request_kw):
    q, k, v = _gqa_call(seed=1)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_kw", check_finite="deferred"), audit=False)
    out = _forwards(ov, lambda: ov(None, q, k, v, 4, enable_gqa=True, transformer_options={}, **request_kw))[-1]
    assert cos_rel(out, _ref(q, k, v, 4))[1] < 1e-5  # exact: the rounding kernel never ran
    assert "t_kw" not in ov.stats.calls


def test_preferred_attention_is_accepted_on_every_path(lossy):
    """ComfyUI 0.38 passes a checkpoint's own attention choice as `preferred_attention`; an override on the hook takes
    precedence, and the keyword never breaks a call (passthrough, lean, full path, compiled)."""
    seen = []

    def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                          **kwargs):
        seen.append(kwargs.get("preferred_attention"))
        return _ref(q, k, v, heads).to(q.dtype)

    attention_pytorch.__module__ = "comfy.ldm.modules.attention"
    pref = object()
    q, k, v = (torch.randn(1, 20, 32) for _ in range(3))
    ref = _ref(q, k, v, 2)
    for backend in ("sdpa", "t_kw"):
        ov = patch.AttentionOverride(A.AttentionConfig(backend=backend, check_finite="deferred"), audit=False)
        for out in _forwards(ov, lambda ov=ov: ov(attention_pytorch, q, k, v, 2, preferred_attention=pref,
                                                  transformer_options={})):
            assert cos_rel(out, ref)[1] < 2e-3
    assert seen and all(p is pref for p in seen)  # handed on untouched where ComfyUI's function runs
    compiled = torch.compile(lambda q, k, v: ov(None, q, k, v, 2, preferred_attention=pref, transformer_options={}),
                             backend="eager", fullgraph=True)
    assert cos_rel(compiled(q, k, v), ref)[1] < 2e-3


def test_compiled_calls_keep_gqa_scale_and_precision_requests(lossy):
    """Under torch.compile the call is the custom op: scale and enable_gqa go through it, a precision request keeps
    the op on SDPA, all in one graph."""
    import torch._dynamo

    q, k, v = _gqa_call(seed=2)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_kw", check_finite="deferred"), audit=False)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, **kw: ov(None, q, k, v, 4, enable_gqa=True, transformer_options={}, **kw),
                      backend="eager", fullgraph=True)
    out = f(q, k, v, scale=0.11)
    assert cos_rel(out, _ref(q, k, v, 4, scale=0.11))[1] < 2e-3 and ov.stats.calls["t_kw"] == 1
    exact = f(q, k, v, low_precision_attention=False)
    assert cos_rel(exact, _ref(q, k, v, 4))[1] < 1e-5 and ov.stats.calls["t_kw"] == 1


class Container:
    """ComfyUI 0.33's AttentionTensorContainer (single owner: take() empties it)."""

    __slots__ = ("tensor",)

    def __init__(self, t):
        self.tensor = t

    def take(self):
        t, self.tensor = self.tensor, None
        if t is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return t


def test_containers_are_emptied_and_nothing_keeps_qkv_after_the_call(lossy):
    """With containers the override takes q/k/v out: afterwards neither the containers nor the override hold them,
    so they are freed as soon as the caller's own references go (the model keeps none)."""
    q, k, v = (torch.randn(1, 20, 32) for _ in range(3))
    ref = _ref(q, k, v, 2)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_kw", check_finite="deferred"), audit=False)
    assert hasattr(ov, "container_function")
    for _ in range(3):  # full path, then the lean entry
        qc, kc, vc = Container(q.clone()), Container(k.clone()), Container(v.clone())
        refs = [weakref.ref(c.tensor) for c in (qc, kc, vc)]
        out = ov.container_function(qc, kc, vc, 2, transformer_options={})
        assert cos_rel(out, ref)[1] < 2e-3
        assert qc.tensor is None and kc.tensor is None and vc.tensor is None
        assert all(r() is None for r in refs)  # freed: nothing of the pack kept a reference
    with pytest.raises(RuntimeError, match="already been consumed"):
        ov.container_function(qc, kc, vc, 2, transformer_options={})
