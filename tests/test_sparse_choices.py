"""comfy-kitchen's Sol-Attn as a backend, and the sparse kernels in ``auto`` and in the step schedule (CPU).

The CUDA kernel is stood in by a function with ``comfy_kitchen.sol_attn``'s signature that enforces the CUDA entry's
checks (bf16/fp16, q/k/v of one shape, head dim 128, a contiguous last dim, 16-byte alignment, leading strides in
multiples of 8) and computes dense attention; the stand-in itself is checked against the real package's contract
(signature, call rule, and its eager reference on the CPU) where comfy-kitchen >= 0.2.40 is available
($PA_KITCHEN_SOL, which tests/setup_env.sh fills).
"""

import inspect
import os
import sys
import types

import pytest
import torch
from conftest import cos_rel
from pack import load

P = load()
A = P.attention
patch = P.nodes.patch
kitchen = sys.modules[A.__name__ + ".backends.kitchen"]
SOL_SIGNATURE = ["q", "k", "v", "tau", "scale", "sink_blocks", "sink_q", "key_bias", "topk_ratio", "tail", "block_len",
                 "coarse_gate", "token_aug"]


def standin_sol_attn(calls):
    def sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None, topk_ratio=0.0, tail=True,
                 block_len=None, coarse_gate=None, token_aug=0):
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"sol_attn: q/k/v must be bfloat16 or float16, got {q.dtype}")
        for name, x in (("k", k), ("v", v)):
            if x.shape != q.shape or x.dtype != q.dtype:
                raise ValueError(f"sol_attn: {name}: must have the same shape and dtype as q")
        if q.shape[-1] != 128:
            raise ValueError("sol_attn: q: head_dim must be 128")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.stride(-1) != 1 or x.data_ptr() % 16 or any(x.shape[d] > 1 and x.stride(d) % 8 for d in range(3)):
                raise ValueError(f"sol_attn: {name} must have a contiguous last dim, 16-byte alignment, strides % 8")
        calls.append({"tau": tau, "topk_ratio": topk_ratio, "token_aug": token_aug, "scale": scale,
                      "strides": q.stride(), "shape": tuple(q.shape)})
        o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), scale=scale)
        return o.transpose(1, 2).to(q.dtype).contiguous()  # (B, T, H, 128), contiguous, as the CUDA entry writes

    return sol_attn


@pytest.fixture
def sol(pack_backend, monkeypatch):
    """kitchen_sol / kitchen_sol_topk as registered, on the CPU: the same functions and rules but the device ones,
    calling the stand-in."""
    calls = []
    fake = types.ModuleType("comfy_kitchen")
    fake.sol_attn = standin_sol_attn(calls)
    monkeypatch.setitem(sys.modules, "comfy_kitchen", fake)
    names = {}
    for name in ("kitchen_sol", "kitchen_sol_topk"):
        b = A.REGISTRY.get(name)
        rules = tuple(c for c in b.constraints if type(c).__name__ not in ("DeviceTypes", "ComputeCapability"))
        names[name] = pack_backend(A.Backend(name=f"t_{name}", family="test", fn=b.fn, constraints=rules,
                                             layouts=b.layouts, probe=lambda: A.Availability(True), options=b.options,
                                             accuracy=b.accuracy, declines=b.declines)).name
    return names, calls


def _video_call(n=256, heads=2, seed=0, skip_reshape=False):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(1, n, heads * 128, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    if skip_reshape:  # Flux's convention: [B, H, N, D] views
        t = [x.unflatten(-1, (heads, 128)).transpose(1, 2) for x in t]
    return t


def test_sol_backends_declare_what_core_s_node_does():
    for name in ("kitchen_sol", "kitchen_sol_topk"):
        b = A.REGISTRY.get(name)
        assert b.family == "kitchen_sol" and b.layouts == ("NHD",) and b.sparse
        text = b.describe()
        for rule in ("device in {cuda}", "compute capability >= 8.0", "head dim in {128}", "masks: none",
                     "self-attention only", "grouped-query heads: no", "bfloat16, float16"):
            assert rule.replace("bfloat16, float16", "bfloat16, float16") in text or rule in text, (name, rule, text)
    # routed: no bound for every input (the H100 contract matrix: rel-L1 0.22-0.76 on random inputs, where attention is
    # flat); audited on first use, auto's gate decides per call shape
    assert A.REGISTRY.get("kitchen_sol").accuracy == "routed" and A.REGISTRY.get("kitchen_sol_topk").accuracy == "topk"
    assert A.REGISTRY.get("kitchen_sol").options == {"tau": 1.3, "extra_tokens": 256, "min_tokens": 12288}


def test_sol_through_the_dispatcher_takes_views_and_maps_the_options(sol):
    names, calls = sol
    for skip in (False, True):  # [B, N, H*D] and Flux's [B, H, N, D]: both reach the kernel as (B, T, H, 128) views
        q, k, v = _video_call(skip_reshape=skip)
        cfg = A.AttentionConfig(backend=names["kitchen_sol"], options={names["kitchen_sol"]: {"min_tokens": 128}})
        out = A.attention(q, k, v, 2, skip_reshape=skip, skip_output_reshape=skip, config=cfg)
        ref = A.dispatch.fp32_reference(q, k, v, 2, skip_reshape=skip, skip_output_reshape=skip)
        assert cos_rel(out, ref)[1] < 0.01 and cfg.stats.calls == {names["kitchen_sol"]: 1}
        assert calls[-1]["tau"] == 1.3 and calls[-1]["token_aug"] == 256 and calls[-1]["topk_ratio"] == 0.0
        assert calls[-1]["shape"] == (1, 256, 2, 128)
    cfg = A.AttentionConfig(backend=names["kitchen_sol_topk"],
                            options={names["kitchen_sol_topk"]: {"keep_ratio": 0.25, "extra_tokens": 0, "min_tokens": 0}})
    A.attention(*_video_call(), 2, config=cfg)
    assert calls[-1]["topk_ratio"] == 0.25 and calls[-1]["token_aug"] == 0
    # fp32 calls are computed in bf16 and cast back, as core's node does
    q, k, v = (t.float() for t in _video_call())
    out = A.attention(q, k, v, 2, config=A.AttentionConfig(backend=names["kitchen_sol"],
                                                             options={names["kitchen_sol"]: {"min_tokens": 0}}))
    assert out.dtype == torch.float32


def test_sol_refuses_what_it_cannot_take_and_falls_back_counted(sol):
    names, calls = sol
    cfg = A.AttentionConfig(backend=names["kitchen_sol"])  # default min_tokens 12288
    A.attention(*_video_call(n=256), 2, config=cfg)
    assert not calls and cfg.stats.calls == {"sdpa": 1}
    assert any("256 tokens < min_tokens 12288" in r for (_, _, r) in cfg.stats.fallbacks)
    g = torch.Generator().manual_seed(1)
    cross = (torch.randn(1, 256, 256, generator=g, dtype=torch.bfloat16),
             *(torch.randn(1, 77, 256, generator=g, dtype=torch.bfloat16) for _ in range(2)))
    d64 = [torch.randn(1, 256, 128, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    cfg = A.AttentionConfig(backend=names["kitchen_sol"], options={names["kitchen_sol"]: {"min_tokens": 0}})
    A.attention(*cross, 2, config=cfg)
    A.attention(*d64, 2, config=cfg)
    reasons = " | ".join(r for (_, _, r) in cfg.stats.fallbacks)
    assert not calls and "query length 256 != key length 77" in reasons and "head dim 64 unsupported" in reasons
    with pytest.raises(ValueError, match="extra_tokens=100: use 0 or a multiple of 64"):
        kitchen.check_sol_options({"extra_tokens": 100})
    with pytest.raises(ValueError, match="unknown Sol-Attn option 'cdfthreshd'"):
        kitchen.check_sol_options({"cdfthreshd": 0.9})


def test_sol_attn_settings_node_feeds_patch_attention(sol):
    names, _ = sol
    defs = P.nodes.definitions
    (s,) = defs.run_sol_settings("kitchen_sol", tau=1.6, extra_tokens=0, min_tokens=4096)
    assert s.variant == "kitchen_sol" and s.options == {"tau": 1.6, "extra_tokens": 0, "min_tokens": 4096}
    (t,) = defs.run_sol_settings("kitchen_sol_topk", keep_percent=20.0)
    assert t.options["keep_ratio"] == pytest.approx(0.2) and "tau" not in t.options
    with pytest.raises(ValueError, match="Sol-Attn extra_tokens=96"):
        defs.run_sol_settings("kitchen_sol", extra_tokens=96)


def _auto(names_time, exclude_all_but):
    return A.AutoSelector(timer=lambda name, fn, dev: names_time.get(name, 50.0),
                          exclude={n for n in A.REGISTRY.names() if n not in exclude_all_but})


def test_auto_considers_sol_on_long_self_attention_only_and_not_before_the_sparse_schedule(sol):
    names, calls = sol
    s, st = names["kitchen_sol"], names["kitchen_sol_topk"]
    sel = _auto({"sdpa": 10.0, s: 4.0, st: 3.0}, {"sdpa", s, st})
    cfg = A.AttentionConfig(backend="auto", auto=sel, options={s: {"min_tokens": 200}, st: {"min_tokens": 200}})
    long_call, short_call = _video_call(n=256), _video_call(n=128)
    A.attention(*long_call, 2, config=cfg)
    A.attention(*short_call, 2, config=cfg)
    by_n = {sig.split("/Nq")[1].split("/")[0]: name for sig, name in sel.decisions.items()}
    # long: both Sol entries measured; topk's fixed share failed the gate or won -- the gate decides, per signature
    assert by_n["256"] in (s, st) and by_n["128"] == "sdpa"  # 128 tokens < min_tokens 200: not a candidate
    report = next(r for sig, r in sel.reports.items() if "/Nq256/" in sig)
    assert {c.name for c in report} == {"sdpa", s, st} and all(c.cos is not None for c in report)
    # before the sparse schedule starts: a decision of its own, without the sparse kernels
    cfg.sparse_ok = False
    A.attention(*long_call, 2, config=cfg)
    early = {sig: n for sig, n in sel.decisions.items() if sig.endswith("/dense-early")}
    assert list(early.values()) == ["sdpa"]


def test_the_sparse_schedule_holds_an_explicit_sparse_backend_dense_then_runs_it(sol, monkeypatch):
    """sparse_start_percent: an explicit sparse backend runs dense in the forwards before it (as core's Model Sparse
    Attention with start_percent 0.2), the kernel after; the forwards read their sigma for it."""
    names, calls = sol
    s = names["kitchen_sol"]
    cfg = A.AttentionConfig(backend=s, options={s: {"min_tokens": 0}}, check_finite="deferred")
    ov = patch.AttentionOverride(cfg, audit=False, sparse_sigma=5.0)
    fw = patch.ForwardWrapper(ov)
    q, k, v = _video_call()
    for sigma in (10.0, 7.0, 5.0, 2.0):
        fw(lambda x, t: ov(None, q, k, v, 2, transformer_options={}), None, torch.tensor([sigma]))
    assert ov.stats.calls == {"sdpa": 2, s: 2} and len(calls) == 2


def test_the_sparse_schedule_draws_the_boundary_where_core_draws_it(sol):
    """At the start's own sigma and one float32 ulp either side, the step is sparse exactly when core's Model Sparse
    Attention runs it sparse (dense while ``float(sigmas[0]) > start``): with the same start_percent the two run the
    same steps dense, so their latents and times compare (a tolerance here ran one step of ten differently)."""
    names, calls = sol
    s = names["kitchen_sol"]
    start = torch.tensor(0.9697, dtype=torch.float32)
    below, above = (torch.nextafter(start, torch.tensor(x, dtype=torch.float32)) for x in (0.0, 2.0))
    q, k, v = _video_call()
    for sigma in (start, below, above):
        cfg = A.AttentionConfig(backend=s, options={s: {"min_tokens": 0}}, check_finite="deferred")
        ov = patch.AttentionOverride(cfg, audit=False, sparse_sigma=float(start))
        fw = patch.ForwardWrapper(ov)
        fw(lambda x, t, ov=ov: ov(None, q, k, v, 2, transformer_options={}), None, sigma.reshape(1))
        core_dense = float(sigma) > float(start)
        assert ov.stats.calls == ({"sdpa": 1} if core_dense else {s: 1}), float(sigma)


def test_auto_with_a_sparse_schedule_chooses_per_phase_and_stops_reading_sigma_without_sparse_choices(sol, monkeypatch):
    names, calls = sol
    s = names["kitchen_sol"]
    nan_net = P.nodes.nan_net
    reads = []
    real = nan_net.as_float
    monkeypatch.setattr(nan_net, "as_float", lambda x: (reads.append(x) if torch.is_tensor(x) else None) or real(x))
    q, k, v = _video_call()
    sigmas = (10.0, 7.0, 5.0, 2.0, 1.0)

    def run(timings):
        sel = _auto(timings, {"sdpa", s})
        cfg = A.AttentionConfig(backend="auto", auto=sel, options={s: {"min_tokens": 0}}, check_finite="deferred")
        ov = patch.AttentionOverride(cfg, sparse_sigma=5.0)
        fw = patch.ForwardWrapper(ov)
        reads.clear()
        for sigma in sigmas:
            fw(lambda x, t: ov(None, q, k, v, 2, transformer_options={}), None, torch.tensor([sigma]))
        return ov, sel, len(reads)

    ov, sel, n = run({"sdpa": 10.0, s: 4.0})  # Sol faster: dense-early phase on SDPA, then Sol
    assert sorted(sel.decisions.values()) == sorted(["sdpa", s]) and ov.stats.calls[s] == 3
    assert n == len(sigmas)  # a sparse choice: every forward reads its sigma for the schedule
    ov, sel, n = run({"sdpa": 1.0, s: 4.0})  # Sol slower: nothing sparse runs, and the reads stop once past the start
    assert set(sel.decisions.values()) == {"sdpa"} and s not in ov.stats.calls
    assert n == 3  # 10 (first forward), 7 (still early), 5 (past the start: sparse allowed, none chosen) -- then none


# ------------------------------------------------------------------ the stand-in against the real package

@pytest.fixture
def real_kitchen(monkeypatch):
    """comfy-kitchen >= 0.2.40 from $PA_KITCHEN_SOL (or installed), imported for one test and forgotten afterwards."""
    path = os.environ.get("PA_KITCHEN_SOL")
    if path:
        monkeypatch.syspath_prepend(path)
    saved = {k: v for k, v in sys.modules.items() if k == "comfy_kitchen" or k.startswith("comfy_kitchen.")}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    try:
        import comfy_kitchen
    except ImportError as e:
        pytest.skip(f"comfy-kitchen with sol_attn not importable ({e}); tests/setup_env.sh puts 0.2.40 in .build")
    try:
        if not hasattr(comfy_kitchen, "sol_attn"):
            pytest.skip(f"comfy-kitchen {getattr(comfy_kitchen, '__version__', '?')} has no sol_attn")
        yield comfy_kitchen
    finally:
        for k in [k for k in sys.modules if k == "comfy_kitchen" or k.startswith("comfy_kitchen.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_the_stand_in_keeps_the_real_sol_attn_contract(real_kitchen):
    """The stand-in has the real signature; the real call rule refuses what the registry's rules refuse; and our
    backend function, run on the real package's eager reference (CPU), gives Sol-Attn's output."""
    ck = real_kitchen
    assert list(inspect.signature(ck.sol_attn).parameters) == SOL_SIGNATURE
    assert list(inspect.signature(standin_sol_attn([])).parameters) == SOL_SIGNATURE
    from comfy_kitchen.constraints import sol_attn_common_call_rule

    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    assert sol_attn_common_call_rule({"q": q, "k": q, "v": q}).success
    assert not sol_attn_common_call_rule({"q": q, "k": q[:, :77], "v": q[:, :77]}).success  # our SameSeqLen
    q64 = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    assert not sol_attn_common_call_rule({"q": q64, "k": q64, "v": q64}).success  # our HeadDims((128,))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 512, 2, 128, generator=g)
    qs, ks, vs = (x + 0.5 * torch.randn(x.shape, generator=g) for _ in range(3))
    fn = A.REGISTRY.get("kitchen_sol").fn
    out = fn(*(t.bfloat16() for t in (qs, ks, vs)), layout="NHD", mask=None, scale=None, opts={"tau": 0.5})
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs))).transpose(1, 2)
    cos, rel = cos_rel(out, ref)
    assert out.shape == (1, 512, 2, 128) and cos > 0.99 and rel < 0.15  # concentrated attention: close to dense
