"""One call path (CPU): the KernelCall that the dispatcher, its per-shape cache, the node's lean calls and the
benchmarks' bare call all run, and the per-shape key that keeps apart what its plan depends on."""

import pytest
import torch
from conftest import cos_rel, sdpa_ref
from pack import load

from attention import AttentionConfig, Availability, Backend, attention
from attention.calls import call_key, plan_call
from attention.constraints import DTypes, HeadDims

P = load()
A = P.attention
patch = P.nodes.patch


def _kernel(seen):
    """SDPA in whichever layout it is handed, recording the layout and dtype it got."""
    def fn(q, k, v, *, layout, mask, scale, opts):
        seen.append((layout, q.dtype, q.shape[-1]))
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o if layout == "HND" else o.transpose(1, 2)

    return fn


def _qkv(b=2, n=40, h=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h * d, generator=g) for _ in range(3)]


def test_the_dispatch_cache_keeps_apart_calls_that_differ_only_in_the_output_layout(temp_backend):
    """A layout_by_output kernel computes in the layout the caller returns, so a call with skip_output_reshape is
    planned apart from the same call without it, also when the second comes from the per-shape cache."""
    seen = []
    temp_backend(Backend(name="t_byout", family="test", fn=_kernel(seen), constraints=(), layouts=("HND", "NHD"),
                         layout_by_output=True, probe=lambda: Availability(True)))
    cfg = AttentionConfig(backend="t_byout")
    q, k, v = _qkv()
    for out_skip in (False, True, False, True):
        out = attention(q, k, v, 3, skip_output_reshape=out_skip, config=cfg)
        ref = sdpa_ref(q, k, v, 3, skip_output_reshape=out_skip)
        assert out.shape == ref.shape and cos_rel(out, ref)[0] >= 0.9999
        assert seen[-1][0] == ("HND" if out_skip else "NHD")
    assert len(cfg._fast) == 2 and cfg.stats.calls == {"t_byout": 4}


def test_the_bare_call_is_the_dispatchers_and_counts_nothing(temp_backend):
    seen = []
    be = temp_backend(Backend(name="t_half", family="test", fn=_kernel(seen), accuracy="8bit",
                              constraints=(DTypes((torch.float16,)), HeadDims(dims=(32,))), layouts=("HND",),
                              probe=lambda: Availability(True)))
    cfg = AttentionConfig(backend="t_half", check_finite=True)
    q, k, v = _qkv()  # fp32, head dim 16: cast to fp16 and padded to 32 for this kernel
    full = attention(q, k, v, 3, config=cfg)
    bare, why = plan_call(be, q, k, v, 3)
    assert why is None
    out = bare.run(q, k, v)
    assert seen[-1] == ("HND", torch.float16, 32) and out.dtype == torch.float32 and out.shape == full.shape
    assert torch.equal(out, full)
    assert cos_rel(out, sdpa_ref(q, k, v, 3))[0] >= 0.999
    # a shape the kernel refuses: no call, the reason
    bare, why = plan_call(be, *_qkv(d=40), 3)
    assert bare is None and "head dim 40" in why


def test_a_call_the_kernel_computes_in_another_dtype_takes_the_lean_path_with_the_full_paths_result(pack_backend):
    """fp32 calls on a half-precision kernel (cast there and back) run the cached KernelCall after their first call,
    with what the full path gives, counted the same."""
    seen = []
    pack_backend(A.Backend(name="t_q16", family="test", fn=_kernel(seen), accuracy="8bit",
                           constraints=(A.constraints.DTypes((torch.float16,)),), layouts=("HND",),
                           probe=lambda: A.Availability(True)))
    outs = {}
    q, k, v = _qkv()
    for lean in (True, False):
        ov = patch.AttentionOverride(A.AttentionConfig(backend="t_q16", check_finite="deferred"), audit=False)
        ov.lean_ok = lean
        fw = patch.ForwardWrapper(ov)
        outs[lean] = [fw(lambda x, t, ov=ov: ov(None, q, k, v, 3, transformer_options={}), None,
                         torch.tensor([float(10 - i)])) for i in range(3)]
        assert ov.stats.calls == {"t_q16": 3}
        assert bool(ov.lane().lean) == lean and all(callable(e) for e in ov.lane().lean.values())
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert {s[1] for s in seen} == {torch.float16} and outs[True][0].dtype == torch.float32


@pytest.mark.parametrize("field", ["skip_output_reshape", "mask", "enable_gqa", "k_smoothed", "phase", "k dtype"])
def test_the_call_key_tells_apart_what_a_plan_depends_on(field):
    q, k, v = _qkv()
    base = call_key(q, k, v, 3, False)
    other = {
        "skip_output_reshape": lambda: call_key(q, k, v, 3, False, True),
        "mask": lambda: call_key(q, k, v, 3, False, mask=torch.zeros(40, 40)),
        "enable_gqa": lambda: call_key(q, k, v, 3, False, enable_gqa=True),
        "k_smoothed": lambda: call_key(q, k, v, 3, False, k_smoothed=True),
        "phase": lambda: call_key(q, k, v, 3, False, phase=False),
        "k dtype": lambda: call_key(q, k.half(), v, 3, False),
    }[field]()
    assert other != base and call_key(q, k, v, 3, False) == base
