"""The dispatcher on CPU: layouts, masks, padding, casts, fallback, stats, validation."""

import re

import pytest
import torch
from conftest import capture, cos_rel, sdpa_ref, smoothing_kernel

from attention import REGISTRY, AttentionConfig, Backend, BackendUnavailableError, attention, use_backend
from attention.constraints import DTypes, HeadDims, Masks
from attention.registry import Availability

torch.manual_seed(0)


def bnc(b, n, h, d, dtype=torch.float32):
    return torch.randn(b, n, h * d, dtype=dtype)


@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
@pytest.mark.parametrize("nk", [77, 300])
def test_sdpa_matches_reference_in_every_layout(skip_reshape, skip_output_reshape, nk):
    b, h, d, nq = 2, 3, 40, 300
    q, k, v = bnc(b, nq, h, d), bnc(b, nk, h, d), bnc(b, nk, h, d)
    if skip_reshape:
        q, k, v = (t.view(b, t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))
    out = attention(q, k, v, h, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    ref = sdpa_ref(q, k, v, h, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    assert out.shape == ref.shape
    cos, rel = cos_rel(out, ref)
    assert cos >= 0.9999 and rel < 1e-5


def test_output_matches_comfyui_shapes():
    q = bnc(1, 64, 4, 32)
    assert attention(q, q, q, 4).shape == (1, 64, 128)
    assert attention(q, q, q, 4, skip_output_reshape=True).shape == (1, 4, 64, 32)


@pytest.mark.parametrize("mask_ndim", [2, 3, 4])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_follow_comfyui_broadcast_rules(mask_ndim, kind):
    b, h, d, nq, nk = 2, 2, 16, 20, 12
    q, k, v = bnc(b, nq, h, d), bnc(b, nk, h, d), bnc(b, nk, h, d)
    keep = torch.rand(b, h, nq, nk) > 0.3
    keep[..., 0] = True
    m = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -1e4)
    m = {2: m[0, 0], 3: m[:, 0], 4: m}[mask_ndim]
    out = attention(q, k, v, h, m)
    ref = sdpa_ref(q, k, v, h, m)
    assert cos_rel(out, ref)[0] >= 0.9999
    # and the mask matters
    assert cos_rel(attention(q, k, v, h), ref)[0] < 0.999


def test_grouped_query_heads_through_skip_reshape():
    q = torch.randn(1, 8, 30, 16)
    k = torch.randn(1, 2, 30, 16)
    v = torch.randn(1, 2, 30, 16)
    out = attention(q, k, v, 8, skip_reshape=True, skip_output_reshape=True)
    ref = sdpa_ref(q, k, v, 8, skip_reshape=True, skip_output_reshape=True)
    assert cos_rel(out, ref)[0] >= 0.9999


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(1, 10, 64), torch.randn(1, 10, 64), torch.randn(1, 10, 64), 3), "not divisible by heads=3"),
        ((torch.randn(1, 10, 64), torch.randn(1, 10, 64, dtype=torch.float64), torch.randn(1, 10, 64), 4), "different dtypes"),
        ((torch.randn(1, 10, 64), torch.randn(2, 10, 64), torch.randn(2, 10, 64), 4), "batch sizes differ"),
        ((torch.randn(1, 10, 64), torch.randn(1, 12, 64), torch.randn(1, 11, 64), 4), "key length 12 != value length 11"),
        ((torch.randn(1, 4, 10, 16),) * 3 + (4,), "must be [B, N, H*D] (3-D)"),
        ((torch.randn(1, 10, 64), torch.randn(1, 10, 32), torch.randn(1, 10, 32), 4), "q width 64 != k width 32"),
        ((torch.randn(1, 10, 64).int(),) * 3 + (4,), "floating point"),
        ((torch.randn(1, 10, 64),) * 3 + (0,), "heads must be a positive int"),
    ],
)
def test_malformed_input_is_a_clear_value_error(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        attention(*args)


def test_skip_reshape_validation():
    q = torch.randn(1, 4, 10, 16)
    with pytest.raises(ValueError, match="q has 4 heads but heads=2"):
        attention(q, q, q, 2, skip_reshape=True)
    with pytest.raises(ValueError, match="must be equal and divide 4"):
        attention(q, torch.randn(1, 3, 10, 16), torch.randn(1, 3, 10, 16), 4, skip_reshape=True)


def test_mask_that_does_not_broadcast_is_named():
    q = bnc(1, 10, 2, 8)
    with pytest.raises(ValueError, match=r"does not broadcast to \[B, H, Nq, Nk\]"):
        attention(q, q, q, 2, torch.zeros(3, 3))


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown attention backend 'nope'.*sdpa"):
        AttentionConfig(backend="nope")


# ---------------------------------------------------------------- adaptation on a CPU test backend

def _recording_backend(name, constraints, seen, layouts=("HND",), raises=None):
    def fn(q, k, v, *, layout, mask, scale, opts):
        seen.append({"dtype": q.dtype, "d": q.shape[-1], "layout": layout, "scale": scale, "opts": dict(opts),
                     "mask": None if mask is None else mask.dtype, "contig_last": q.stride(-1) == 1})
        if raises:
            raise raises
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o if layout == "HND" else o.transpose(1, 2)

    return Backend(name=name, family="test", fn=fn, constraints=constraints, layouts=layouts,
                   probe=lambda: Availability(True, version="test"))


def test_head_dim_is_padded_with_the_original_scale(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_pad", (HeadDims(dims=(64, 96, 128)),), seen))
    for d in (40, 80, 160 - 32):
        q, k, v = bnc(1, 50, 2, d), bnc(1, 70, 2, d), bnc(1, 70, 2, d)
        out = attention(q, k, v, 2, config=AttentionConfig(backend="t_pad"))
        assert seen[-1]["d"] in (64, 96, 128) and seen[-1]["d"] >= d
        assert seen[-1]["scale"] == pytest.approx(d**-0.5)
        assert out.shape == q.shape
        assert cos_rel(out, sdpa_ref(q, k, v, 2))[0] >= 0.9999


def test_head_dim_without_a_bigger_size_falls_back(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_pad2", (HeadDims(dims=(64, 128)),), seen))
    cfg = AttentionConfig(backend="t_pad2")
    q = bnc(1, 20, 2, 160)
    out = attention(q, q, q, 2, config=cfg)
    assert not seen
    assert cfg.stats.calls["sdpa"] == 1
    [(frm, to, reason)] = list(cfg.stats.fallbacks)
    assert (frm, to) == ("t_pad2", "sdpa") and "head dim 160 unsupported" in reason
    assert cos_rel(out, sdpa_ref(q, q, q, 2))[0] >= 0.9999


def test_fp32_is_computed_in_a_kernel_dtype_and_cast_back(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_half", (DTypes((torch.float16, torch.bfloat16)),), seen))
    q, k, v = bnc(2, 33, 2, 16), bnc(2, 33, 2, 16), bnc(2, 33, 2, 16)
    out = attention(q, k, v, 2, config=AttentionConfig(backend="t_half"))
    assert seen[-1]["dtype"] == torch.bfloat16
    assert out.dtype == torch.float32
    cos, rel = cos_rel(out, sdpa_ref(q, k, v, 2))
    assert cos >= 0.999 and rel < 0.03


def test_no_cast_when_the_backend_refuses_to(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_nocast", (DTypes((torch.float16,), cast_fp32=False),), seen))
    cfg = AttentionConfig(backend="t_nocast")
    q = bnc(1, 8, 1, 8)
    attention(q, q, q, 1, config=cfg)
    assert not seen and "dtype float32 not in {float16}" in next(iter(cfg.stats.fallbacks))[2]


@pytest.mark.parametrize("src_skip", [False, True])
def test_layout_handed_to_the_kernel_is_a_view_it_accepts(temp_backend, src_skip):
    for lay in ("HND", "NHD"):
        seen = []
        temp_backend(_recording_backend(f"t_{lay}_{src_skip}", (), seen, layouts=(lay,)))
        b, h, d = 1, 3, 16
        q = bnc(b, 40, h, d)
        if src_skip:
            q = q.view(b, 40, h, d).transpose(1, 2)
        out = attention(q, q, q, h, skip_reshape=src_skip, config=AttentionConfig(backend=f"t_{lay}_{src_skip}"))
        assert seen[-1]["layout"] == lay and seen[-1]["contig_last"]
        assert cos_rel(out, sdpa_ref(q, q, q, h, skip_reshape=src_skip))[0] >= 0.9999


@pytest.mark.parametrize("src_skip", [False, True])
@pytest.mark.parametrize("out_skip", [False, True])
def test_a_layout_by_output_kernel_gets_the_layout_whose_output_needs_no_copy(temp_backend, src_skip, out_skip):
    """[B, N, H*D] is a free view of NHD, [B, H, N, D] is HND: whatever the call's layout, such a kernel computes in
    the one the caller returns, through both the full path and the lean per-shape call."""
    from attention.dispatch import direct_call

    seen = []
    be = _recording_backend(f"t_free_{src_skip}_{out_skip}", (), seen, layouts=("HND", "NHD"))
    be.layout_by_output = True
    temp_backend(be)
    b, h, d, n = 2, 3, 16, 40
    q, k, v = bnc(b, n, h, d), bnc(b, 50, h, d), bnc(b, 50, h, d)
    if src_skip:
        q, k, v = (t.view(b, -1, h, d).transpose(1, 2).contiguous() for t in (q, k, v))
    want = "HND" if out_skip else "NHD"
    cfg = AttentionConfig(backend=be.name)
    ref = sdpa_ref(q, k, v, h, skip_reshape=src_skip, skip_output_reshape=out_skip)
    out = attention(q, k, v, h, skip_reshape=src_skip, skip_output_reshape=out_skip, config=cfg)
    assert seen[-1]["layout"] == want and seen[-1]["contig_last"]
    assert out.shape == ref.shape and cos_rel(out, ref)[0] >= 0.9999
    call, refused = direct_call(cfg, be.name, q, k, v, h, src_skip, out_skip)
    assert refused is None
    out2 = call(q, k, v, 0)
    assert seen[-1]["layout"] == want and out2.shape == ref.shape and cos_rel(out2, ref)[0] >= 0.9999


def _smoothing_backend(name, seen):
    return Backend(name=name, family="test", fn=smoothing_kernel(seen), constraints=(), layouts=("HND", "NHD"),
                   smooth_k=True, probe=lambda: Availability(True, version="test"))


def test_a_k_smoothed_call_tells_smooth_k_backends_and_only_them(temp_backend):
    """A compiled graph subtracts K's mean for a smooth_k backend; the dispatcher then passes smooth_k=False to such a
    backend (full path and lean call), and nothing to any other: attention is the same with a shifted K."""
    from attention.dispatch import direct_call

    seen, other = [], []
    temp_backend(_smoothing_backend("t_smooth", seen))
    temp_backend(_recording_backend("t_plain", (), other))
    q, k, v = bnc(1, 40, 2, 16), bnc(1, 60, 2, 16) + 3.0, bnc(1, 60, 2, 16)
    ref = sdpa_ref(q, k, v, 2)
    ks = k - k.mean(dim=1, keepdim=True)
    out = attention(q, k, v, 2, config=AttentionConfig(backend="t_smooth"))
    assert "smooth_k" not in seen[-1]["opts"] and seen[-1]["k_mean"] > 1.0
    cfg = AttentionConfig(backend="t_smooth")
    out_s = attention(q, ks, v, 2, config=cfg, k_smoothed=True)
    assert seen[-1]["opts"] == {"smooth_k": False} and seen[-1]["k_mean"] < 1e-5
    # the per-shape fast path keeps it apart: a repeat gets smooth_k=False again, the same shape unsmoothed does not
    attention(q, ks, v, 2, config=cfg, k_smoothed=True)
    assert cfg._fast and seen[-1]["opts"] == {"smooth_k": False}
    attention(q, k, v, 2, config=cfg)
    assert "smooth_k" not in seen[-1]["opts"]
    call, _ = direct_call(AttentionConfig(backend="t_smooth"), "t_smooth", q, ks, v, 2, k_smoothed=True)
    out_l = call(q, ks, v, 0)
    assert seen[-1]["opts"] == {"smooth_k": False}
    attention(q, ks, v, 2, config=AttentionConfig(backend="t_plain"), k_smoothed=True)
    assert other[-1]["opts"] == {}
    for o in (out, out_s, out_l):
        assert cos_rel(o, ref)[0] >= 0.9999


def test_mask_goes_only_to_backends_that_declare_it(temp_backend):
    seen_no, seen_yes = [], []
    temp_backend(_recording_backend("t_nomask", (Masks(()),), seen_no))
    temp_backend(_recording_backend("t_boolmask", (Masks(("bool",)),), seen_yes))
    q = bnc(1, 16, 2, 8)
    keep = torch.rand(16, 16) > 0.3
    keep[:, 0] = True
    cfg = AttentionConfig(backend="t_nomask", fallbacks=("t_boolmask",))
    out = attention(q, q, q, 2, keep, config=cfg)
    assert not seen_no and seen_yes[-1]["mask"] == torch.bool
    assert cfg.stats.calls == {"t_boolmask": 1}
    assert ("t_nomask", "t_boolmask", "no attention-mask support") in cfg.stats.fallbacks
    assert cos_rel(out, sdpa_ref(q, q, q, 2, keep))[0] >= 0.9999
    # a float mask is not a bool mask: both refuse, SDPA takes it
    cfg2 = AttentionConfig(backend="t_nomask", fallbacks=("t_boolmask",))
    fmask = torch.zeros(16, 16).masked_fill(~keep, -1e4)
    attention(q, q, q, 2, fmask, config=cfg2)
    assert cfg2.stats.calls == {"sdpa": 1}


def test_a_raising_backend_falls_back_counted_and_warns_once(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_boom", (), seen, raises=RuntimeError("kernel exploded\nsecond line")))
    cfg = AttentionConfig(backend="t_boom")
    q = bnc(1, 16, 2, 8)
    with capture() as logs:
        for _ in range(5):
            out = attention(q, q, q, 2, config=cfg)
    assert len(seen) == 5
    assert cfg.stats.calls == {"sdpa": 5}
    assert cfg.stats.errors[("t_boom", "RuntimeError: kernel exploded")] == 5
    assert cfg.stats.fallbacks[("t_boom", "sdpa", "raised RuntimeError: kernel exploded")] == 5
    warns = [r for r in logs if r.levelname == "WARNING"]
    assert len(warns) == 1 and "t_boom" in warns[0].getMessage() and "using sdpa" in warns[0].getMessage()
    assert cos_rel(out, sdpa_ref(q, q, q, 2))[0] >= 0.9999


def test_fallback_off_raises_with_the_reason(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_strict", (HeadDims(dims=(64,), pad=False),), seen))
    q = bnc(1, 8, 2, 40)
    with pytest.raises(BackendUnavailableError, match=r"'t_strict' cannot take .* head dim 40 unsupported .*fallback is off"):
        attention(q, q, q, 2, config=AttentionConfig(backend="t_strict", allow_fallback=False))
    temp_backend(_recording_backend("t_strict_boom", (), seen, raises=RuntimeError("nope")))
    with pytest.raises(RuntimeError, match="nope"):
        attention(q, q, q, 2, config=AttentionConfig(backend="t_strict_boom", allow_fallback=False))


def test_uninstalled_backend_falls_back_with_the_import_reason():
    cfg = AttentionConfig(backend="sparge")
    q = bnc(1, 8, 2, 64)
    attention(q, q, q, 2, config=cfg)
    [(frm, to, reason)] = list(cfg.stats.fallbacks)
    assert frm == "sparge" and to == "sdpa"
    assert ("not installed" in reason) or ("runs on cuda" in reason)


def test_per_call_options_override_config_options(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_opts", (), seen))
    cfg = AttentionConfig(backend="t_opts", options={"t_opts": {"a": 1, "b": 2}})
    q = bnc(1, 8, 2, 8)
    attention(q, q, q, 2, config=cfg)
    attention(q, q, q, 2, config=cfg, options={"b": 3})
    assert seen[0]["opts"] == {"a": 1, "b": 2} and seen[1]["opts"] == {"a": 1, "b": 3}


def test_use_backend_forces_a_block(temp_backend):
    seen = []
    temp_backend(_recording_backend("t_forced", (), seen))
    cfg = AttentionConfig(backend="sdpa")
    q = bnc(1, 8, 2, 8)
    with use_backend("t_forced"):
        attention(q, q, q, 2, config=cfg)
    attention(q, q, q, 2, config=cfg)
    assert cfg.stats.calls == {"t_forced": 1, "sdpa": 1}


def test_stats_time_and_summary():
    cfg = AttentionConfig(backend="sdpa_math", record_time=True)
    q = bnc(1, 64, 2, 16)
    for _ in range(3):
        attention(q, q, q, 2, config=cfg)
    d = cfg.stats.as_dict()
    assert d["calls"] == {"sdpa_math": 3}
    assert d["time_ms"]["sdpa_math"] > 0
    s = cfg.stats.summary()
    assert "sdpa_math" in s and "3 calls" in s
    cfg.stats.reset()
    assert cfg.stats.total_calls == 0


def test_registry_answers_why_not():
    assert REGISTRY.why_not("sdpa") is None
    for name in REGISTRY.names():
        b = REGISTRY.get(name)
        if not b.available:
            assert REGISTRY.why_not(name)  # an unavailable backend always has a reason
    with pytest.raises(ValueError, match="already registered"):
        REGISTRY.register(REGISTRY.get("sdpa"))


def _nan_backend(name, quantized=True):
    def fn(q, k, v, *, layout, mask, scale, opts):
        return torch.full_like(q, float("nan"))

    return Backend(name=name, family="test", fn=fn, constraints=(), probe=lambda: Availability(True, version="t"),
                   quantized=quantized)


def test_non_finite_output_of_a_quantized_backend_is_redone_on_sdpa(temp_backend):
    temp_backend(_nan_backend("t_nan"))
    cfg = AttentionConfig(backend="t_nan")
    q = bnc(1, 16, 2, 8)
    with capture() as logs:
        out = attention(q, q, q, 2, config=cfg)
        attention(q, q, q, 2, config=cfg)
    assert torch.isfinite(out).all()
    assert cos_rel(out, sdpa_ref(q, q, q, 2))[0] >= 0.9999
    assert cfg.stats.calls == {"sdpa": 2}
    assert cfg.stats.fallbacks[("t_nan", "sdpa", "non-finite output")] == 2
    assert len([r for r in logs if r.levelname == "WARNING"]) == 1


def test_non_finite_check_can_be_switched_off_and_strict_mode_names_it(temp_backend):
    temp_backend(_nan_backend("t_nan2"))
    q = bnc(1, 16, 2, 8)
    out = attention(q, q, q, 2, config=AttentionConfig(backend="t_nan2", check_finite=False))
    assert torch.isnan(out).all()
    with pytest.raises(RuntimeError, match="t_nan2 returned non-finite values"):
        attention(q, q, q, 2, config=AttentionConfig(backend="t_nan2", allow_fallback=False))


class _LargestTemporary(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any op creates while active, in bytes (outputs of every aten op)."""

    def __init__(self, skip=()):
        super().__init__()
        self.largest, self.skip = 0, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.skip:
            given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:  # not a view
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("mask_shape", [None, (300, 120), (4, 300, 120), (2, 1, 300, 120), (2, 4, 1, 120)])
def test_reference_attention_works_in_parts_within_its_budget(mask_shape):
    """One batch element, a block of key/value heads and a chunk of query rows at a time, converted to fp32 there:
    the same result as whole fp32 attention (grouped-query heads, masks of every broadcast shape), and no fp32 copy
    of q, k or v as a whole (at Wan 14B 720p those took 8.7 GB on a patched model's first step)."""
    from attention.reference import reference_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 120, 16, generator=g).bfloat16(), torch.randn(2, 2, 120, 8, generator=g).bfloat16()
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=g) > 0.3
        mask[..., 0] = True
    full = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            enable_gqa=True)
    budget = 2 * 120 * 24 * 4 + 1  # one key/value head at a time, 16-row chunks
    with _LargestTemporary(skip=(torch.ops.aten.empty.memory_format,)) as seen:
        parts = reference_attention(q, k, v, mask, budget_bytes=budget)
    assert torch.equal(full, parts)
    assert seen.largest < q.numel() * 4 / 8  # nothing near a whole fp32 q (the output is allocated once, skipped)


def test_reference_attention_on_cuda_streams_whole_parts(monkeypatch):
    """The CUDA path (PyTorch's memory-efficient kernel through its ATen op, no grouped-query heads there): k/v
    repeated per query head, all query rows of a part at once; the same result; a refusal falls back to chunks."""
    import attention.backends.sdpa as sdpa_mod
    from attention import reference

    calls = []

    def efficient(q, k, v, *, layout, mask, scale, opts):
        assert q.shape[1] == k.shape[1] and q.dtype == torch.float32
        calls.append(q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    monkeypatch.setattr(sdpa_mod, "_efficient", efficient)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 300, 16, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 120, 16, generator=g).bfloat16(), torch.randn(2, 2, 120, 8, generator=g).bfloat16()
    mask = torch.rand(2, 1, 300, 120, generator=g) > 0.3
    mask[..., 0] = True
    full = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            enable_gqa=True)
    assert torch.equal(reference._reference(q, k, v, mask, None, 1e6, streaming=True), full)
    assert calls == [300, 300]  # a part per batch element, every head and row at once
    calls.clear()
    assert torch.equal(reference._reference(q, k, v, mask, None, 2 * 2 * 120 * 24 * 4, streaming=True), full)
    assert len(calls) > 4 and sum(calls) == 2 * 2 * 300  # one key/value head (2 query heads) at a time, in chunks

    def refuses(*a, **kw):
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(sdpa_mod, "_efficient", refuses)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert torch.equal(reference.reference_attention(q, k, v, mask, budget_bytes=2 * 120 * 24 * 4 + 1), full)


def test_accuracy_works_in_pieces_whatever_the_strides():
    from attention.reference import accuracy

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 50, 7, 9, generator=g)
    b = a + 0.01 * torch.randn(a.shape, generator=g)
    o, r = a.flatten().double(), b.flatten().double()
    want_cos = ((o * r).sum() / (o.square().sum() * r.square().sum()).sqrt()).item()
    want_rel = ((o - r).abs().sum() / r.abs().sum()).item()
    strided = b.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    ah, want_h = a.bfloat16(), accuracy(a.bfloat16(), b.bfloat16())
    for piece in (5, 40, 1000, 1 << 24):
        for other in (b.bfloat16(), strided.bfloat16().transpose(1, 2).contiguous().transpose(1, 2)):
            with _LargestTemporary() as seen:
                cos, rel = accuracy(ah, other, piece=piece)
            assert (cos, rel) == pytest.approx(want_h, abs=1e-12)
            if piece < a.numel():
                assert seen.largest <= 8 * max(piece, 9 * 7)  # a piece in fp64 at most, never the whole tensor
    assert accuracy(a, b) == pytest.approx((want_cos, want_rel), abs=1e-8)  # fp32 products, fp64 sums


@pytest.mark.parametrize("which", [0, 1, 2])
def test_each_of_qkv_gets_a_contiguous_head_dim(temp_backend, which):
    seen = []

    def fn(q, k, v, *, layout, mask, scale, opts):
        seen.append((q.stride(-1), k.stride(-1), v.stride(-1)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    temp_backend(Backend(name=f"t_contig{which}", family="test", fn=fn, constraints=(), probe=lambda: Availability(True)))
    b, h, n, d = 1, 2, 12, 8
    ts = [torch.randn(b, h, n, d) for _ in range(3)]
    ts[which] = torch.randn(b, h, d, n).transpose(2, 3)  # head dim strided, as a transposed upstream op leaves it
    out = attention(*ts, h, skip_reshape=True, skip_output_reshape=True, config=AttentionConfig(backend=f"t_contig{which}"))
    assert seen == [(1, 1, 1)]
    assert cos_rel(out, sdpa_ref(*ts, h, skip_reshape=True, skip_output_reshape=True))[0] >= 0.9999
