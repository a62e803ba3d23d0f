"""The override's promises on one call, without ComfyUI: precision requests, the NaN net outside a forward, the
free dense path, the audit of an explicitly chosen lossy kernel, and auto_fast's spot checks during a run (auto's gate
over the run: tests/test_auto_gate.py)."""

import logging

import pytest
import torch
from conftest import capture, cos_rel, sdpa_ref
from pack import load

P = load()
A = P.attention
patch = P.nodes.patch
nan_net = P.nodes.nan_net


@pytest.fixture
def backends():
    added = []

    def add(name, fn, accuracy="8bit", layouts=("HND",)):
        A.REGISTRY.register(A.Backend(name=name, family="test", fn=fn, constraints=(), probe=lambda: A.Availability(True),
                                      accuracy=accuracy, layouts=layouts))
        added.append(name)
        A.dispatch.clear_plan_cache()

    yield add
    for n in added:
        A.REGISTRY.unregister(n)
    A.dispatch.clear_plan_cache()
    A.dispatch.reset_warnings()


def _sdpa(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)


def _qkv(n=32, heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads * d, generator=g) for _ in range(3)]


def host_attention_pytorch():
    """A stand-in with the name and module of ComfyUI's attention_pytorch, counting its calls."""
    calls = []

    def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                          **kwargs):
        calls.append(kwargs.get("transformer_options"))
        return sdpa_ref(q, k, v, heads, mask).to(q.dtype)

    attention_pytorch.__module__ = "comfy.ldm.modules.attention"
    return attention_pytorch, calls


def test_sdpa_and_dense_calls_go_to_comfyuis_own_function():
    func, calls = host_attention_pytorch()
    q, k, v = _qkv()
    ov = patch.AttentionOverride(A.AttentionConfig(backend="sdpa"))
    out = ov(func, q, k, v, 2, transformer_options={"x": 1})
    assert len(calls) == 1 and calls[0] == {"x": 1} and ov.config.stats.calls == {"comfyui": 1}
    assert cos_rel(out, sdpa_ref(q, k, v, 2))[1] < 1e-6
    # a function that is not one of ComfyUI's exact ones (e.g. --use-sage-attention's) is not trusted for dense calls
    other = patch.AttentionOverride(A.AttentionConfig(backend="sdpa"))
    other(lambda *a, **kw: pytest.fail("called"), q, k, v, 2, transformer_options={})
    assert other.config.stats.calls == {"sdpa": 1}


@pytest.mark.parametrize("request_kw", [{"low_precision_attention": False}, {"attn_precision": torch.float32}])
def test_full_precision_request_never_runs_on_a_lossy_kernel(backends, request_kw):
    backends("t_lossy", lambda q, k, v, *, layout, mask, scale, opts: pytest.fail("lossy kernel ran"))
    func, calls = host_attention_pytorch()
    q, k, v = _qkv()
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_lossy"), audit=False)
    out = ov(func, q, k, v, 2, transformer_options={}, **request_kw)
    # the fastest exact kernel for the shape (auto_exact's selector; on the CPU SDPA is the only exact candidate)
    assert not calls and cos_rel(out, sdpa_ref(q, k, v, 2))[1] < 1e-6 and ov.config.stats.calls == {"sdpa": 1}
    assert ov.config.stats.fallbacks[("t_lossy", "auto_exact", "full precision requested by the model")] == 1
    # an exact backend keeps such calls
    exact = patch.AttentionOverride(A.AttentionConfig(backend="sdpa_math"))
    exact(func, q, k, v, 2, transformer_options={}, **request_kw)
    assert exact.config.stats.calls == {"sdpa_math": 1}


def test_nan_outside_a_forward_is_caught_at_once(backends):
    backends("t_nan", lambda q, k, v, *, layout, mask, scale, opts: torch.full_like(q, float("nan")))
    q, k, v = _qkv()
    cfg = A.AttentionConfig(backend="t_nan", check_finite="deferred")  # as the node configures it
    ov = patch.AttentionOverride(cfg, audit=False)
    out = ov(None, q, k, v, 2, transformer_options={})  # no APPLY_MODEL wrapper around this call
    assert torch.isfinite(out).all() and cos_rel(out, sdpa_ref(q, k, v, 2))[1] < 1e-6
    assert cfg.stats.calls == {"sdpa": 1} and ("t_nan", "sdpa", "non-finite output") in cfg.stats.fallbacks
    assert not cfg._pending  # nothing deferred that nobody would read


def test_an_explicit_lossy_kernel_beyond_the_gate_is_logged_once_with_its_error(backends):
    def noisy(q, k, v, *, layout, mask, scale, opts):
        o = _sdpa(q, k, v, scale)
        return o + 0.5 * o.std() * torch.randn_like(o)

    backends("t_noisy", noisy)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_noisy"))
    q, k, v = _qkv()
    with capture("patch_attention.nodes") as recs:
        for _ in range(3):
            ov(None, q, k, v, 2, transformer_options={})
    warns = [r.getMessage() for r in recs if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "t_noisy on attention layer 0" in warns[0] and "beyond auto's gate" in warns[0]
    m = ov.config.stats.as_dict()["metrics"]
    assert m["t_noisy@first-call.rel_l1_vs_dense"]["n"] == 1 and m["t_noisy@first-call.rel_l1_vs_dense"]["mean"] > 0.08


def test_an_accurate_lossy_kernel_is_audited_silently(backends):
    backends("t_fine", lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q, k, v, scale))
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_fine"))
    q, k, v = _qkv()
    with capture("patch_attention.nodes") as recs:
        ov(None, q, k, v, 2, transformer_options={})
    assert not [r for r in recs if r.levelno >= logging.WARNING]
    assert ov.config.stats.as_dict()["metrics"]["t_fine@first-call.cos_vs_dense"]["mean"] > 0.9999


def test_auto_fast_rechecks_its_lossy_choice_mid_run_and_falls_back_when_it_drifts(backends, monkeypatch):
    """auto_fast judges as auto did before its gate was judged over the run (tests/test_auto_gate.py): a spot check of
    one call per signature at the middle and last step, SDPA for the rest of that run when it fails."""
    drift = {"on": False}
    reads = []
    real = nan_net.as_float
    monkeypatch.setattr(nan_net, "as_float", lambda s: reads.append(s) or real(s))

    def drifting(q, k, v, *, layout, mask, scale, opts):
        o = _sdpa(q, k, v, scale)
        return o + 0.5 * o.std() * torch.randn_like(o) if drift["on"] else o

    backends("t_drift", drifting)
    sel = A.AutoSelector.fast(timer=lambda name, fn, dev: {"sdpa": 2.0, "t_drift": 1.0}[name],
                              exclude={n for n in A.REGISTRY.names() if n not in ("sdpa", "t_drift")})
    cfg = A.AttentionConfig(backend="auto_fast", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    fw, sw = patch.ForwardWrapper(ov), patch.SampleWrapper(ov)
    q, k, v = _qkv()
    sigmas = torch.tensor([10.0, 7.0, 4.0, 2.0, 0.0])  # steps at 10, 7, 4, 2: mid = 4, last = 2
    seen = []

    def run(*args):
        for s in sigmas[:-1]:
            if float(s) == 7.0:
                drift["on"] = True  # attention changes after the first steps
            out = fw(lambda x, t: ov(None, q, k, v, 2, transformer_options={}), None, s.reshape(1))
            seen.append(cos_rel(out, sdpa_ref(q, k, v, 2))[1])

    sw(run, None, None, None, sigmas)
    assert sel.decisions and list(sel.decisions.values()) == ["t_drift"]
    assert seen[0] < 1e-5 and seen[1] > 0.1  # step 2 ran the drifted kernel: nothing checks between the gates
    assert seen[2] < 1e-5 and seen[3] < 1e-5  # mid step: failed the re-check, redone dense, dense from then on
    assert len(reads) >= 3  # once a lossy choice ran, every later forward reads its sigma for the phase
    d = cfg.stats.as_dict()
    assert "t_drift failed the gate at the mid step" in next(iter(d["auto"].values()))
    assert d["metrics"]["t_drift@recheck-mid.rel_l1_vs_dense"]["mean"] > 0.08
    # the next run starts from the tuned choice again
    drift["on"] = False
    seen.clear()
    sw(run, None, None, None, sigmas)
    assert cfg.stats.calls["t_drift"] >= 1


# ------------------------------------------------------------------ the lean path (cached resolved call per shape)

def _forwards(ov, func, calls, n):
    """``n`` model forwards through the APPLY_MODEL wrapper, each making ``calls`` = [(q, k, v, heads, kwargs)]."""
    fw = patch.ForwardWrapper(ov)
    outs = []
    for step in range(n):
        def forward(x, t):
            return [ov(func, q, k, v, h, transformer_options={}, **kw) for q, k, v, h, kw in calls]

        outs.append(fw(forward, None, torch.tensor([float(10 - step)])))
    return outs


def test_lean_path_gives_the_full_paths_result_and_counts(backends):
    seen = []

    def q8(q, k, v, *, layout, mask, scale, opts):
        seen.append(layout)
        if layout == "NHD":
            return _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2).round(decimals=2)
        return _sdpa(q, k, v, scale).round(decimals=2)

    backends("t_q8", q8, layouts=("HND", "NHD"))
    calls = [(*_qkv(32, 2, 16, seed=1), 2, {}), (*_qkv(48, 4, 8, seed=2), 4, {}),
             (*[t.unflatten(-1, (2, 16)).transpose(1, 2) for t in _qkv(32, 2, 16, seed=3)], 2,
              {"skip_reshape": True, "skip_output_reshape": True})]
    lean = patch.AttentionOverride(A.AttentionConfig(backend="t_q8", check_finite="deferred"))
    full = patch.AttentionOverride(A.AttentionConfig(backend="t_q8", check_finite="deferred"))
    full.lean_ok = False
    a, b = _forwards(lean, None, calls, 4), _forwards(full, None, calls, 4)
    for x, y in zip(a, b):
        for o1, o2 in zip(x, y):
            assert torch.equal(o1, o2)
    assert len(lean.lane().lean) == 3 and all(callable(e) for e in lean.lane().lean.values())
    assert lean.config.stats.calls == full.config.stats.calls == {"t_q8": 12}
    assert set(seen) == {"NHD", "HND"}  # each call in its own layout, no transpose on the lean path
    # a backend that takes only HND gets NHD calls as transposed views on the lean path too, with the full path's result
    hnd_layouts = []
    backends("t_hnd", lambda q, k, v, *, layout, mask, scale, opts: hnd_layouts.append(layout) or _sdpa(q, k, v, scale))
    hnd = patch.AttentionOverride(A.AttentionConfig(backend="t_hnd", check_finite="deferred"))
    hnd_full = patch.AttentionOverride(A.AttentionConfig(backend="t_hnd", check_finite="deferred"))
    hnd_full.lean_ok = False
    for x, y in zip(_forwards(hnd, None, calls, 3), _forwards(hnd_full, None, calls, 3)):
        for o1, o2 in zip(x, y):
            assert torch.equal(o1, o2)
    assert len(hnd.lane().lean) == 3 and all(callable(e) for e in hnd.lane().lean.values()) and set(hnd_layouts) == {"HND"}


def test_nan_on_the_lean_path_is_caught_and_the_layer_goes_dense(backends):
    state = {"n": 0}

    def flaky(q, k, v, *, layout, mask, scale, opts):
        state["n"] += 1
        o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)
        return o if state["n"] < 5 else torch.full_like(o, float("nan"))  # from the 3rd forward on: NaN

    backends("t_flaky", flaky, layouts=("NHD",))
    func, host_calls = host_attention_pytorch()
    calls = [(*_qkv(32, 2, 16, seed=1), 2, {}), (*_qkv(40, 2, 16, seed=2), 2, {})]
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_flaky", check_finite="deferred"), audit=False)
    outs = _forwards(ov, func, calls, 4)
    assert all(torch.isfinite(o).all() for x in outs for o in x)
    for (q, k, v, h, _), o in zip(calls, outs[-1]):
        assert cos_rel(o, sdpa_ref(q, k, v, h))[1] < 1e-5
    # lean, NaN, redone, then dense: on the fastest exact kernel (SDPA on the CPU), not ComfyUI's function
    assert len(ov.lane().lean) == 2 and ov.nonfinite_layers == {0, 1} and not host_calls and ov.config.stats.calls["sdpa"]
    assert ov.config.stats.fallbacks[("t_flaky", "auto_exact", "non-finite output (forward redone)")] == 2


def test_a_shape_the_kernel_refuses_goes_to_the_fastest_exact_kernel_on_the_lean_path_too(backends):
    A.REGISTRY.register(A.Backend(name="t_d64", family="test", constraints=(A.constraints.MinSeqLen(kv=100),),
                                  fn=lambda *a, **kw: pytest.fail("refused shape reached the kernel"),
                                  probe=lambda: A.Availability(True), accuracy="8bit"))
    try:
        func, host_calls = host_attention_pytorch()
        ov = patch.AttentionOverride(A.AttentionConfig(backend="t_d64", check_finite="deferred"), audit=False)
        _forwards(ov, func, [(*_qkv(32, 2, 16), 2, {})], 3)
        st = ov.config.stats
        assert st.calls == {"sdpa": 3} and not host_calls  # SDPA: the only exact kernel on the CPU
        assert st.fallbacks == {("t_d64", "sdpa", "key length 32 < 100"): 3}
        assert len(ov.lane().lean) == 1 and callable(next(iter(ov.lane().lean.values())))
    finally:
        A.REGISTRY.unregister("t_d64")
        A.dispatch.clear_plan_cache()


@pytest.mark.parametrize("kw", [{"mask": "m"}, {"low_precision_attention": False}, {"attn_precision": torch.float32}])
def test_masked_and_precision_calls_never_take_the_lean_path(backends, kw):
    backends("t_q8b", lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q.transpose(1, 2), k.transpose(1, 2),
                                                                          v.transpose(1, 2), scale).transpose(1, 2),
             layouts=("NHD",))
    q, k, v = _qkv()
    if kw.get("mask") == "m":
        kw = {"mask": torch.zeros(32, 32)}
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_q8b", check_finite="deferred"), audit=False)
    _forwards(ov, None, [(q, k, v, 2, kw)], 3)
    assert not ov.lane().lean


def test_nan_net_checks_calls_on_the_first_forward_then_the_output(backends, monkeypatch):
    """After the first forward of a run only the forward's output is checked; a NaN there is traced back to its layers
    with one more forward with per-call flags, and those layers run dense from then on."""
    state = {"n": 0}

    def flaky(q, k, v, *, layout, mask, scale, opts):
        state["n"] += 1
        o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)
        return torch.full_like(o, float("nan")) if state["n"] in (5, 7) else o  # layer 0 from the 3rd forward on

    backends("t_flaky2", flaky, layouts=("NHD",))
    flags = []
    real = A.dispatch.finite_flag
    monkeypatch.setattr(A.dispatch, "finite_flag", lambda out: flags.append(1) or real(out))
    func, host_calls = host_attention_pytorch()
    calls = [(*_qkv(32, 2, 16, seed=1), 2), (*_qkv(40, 2, 16, seed=2), 2)]
    cfg = A.AttentionConfig(backend="t_flaky2", check_finite="deferred")
    ov = patch.AttentionOverride(cfg, audit=False)
    ov.hides_nan = False  # a model whose code does not sanitize NaN (see model_hides_nan)
    fw = patch.ForwardWrapper(ov)
    outs = []
    for step in range(4):
        def forward(x, t):
            return torch.cat([ov(func, q, k, v, h, transformer_options={}).flatten() for q, k, v, h in calls])

        outs.append(fw(forward, None, torch.tensor([float(10 - step)])))
        if step == 1:
            assert len(flags) == 2  # forward 1: one flag per call; forward 2: none
    assert all(torch.isfinite(o).all() for o in outs)
    # forward 3: the output was NaN -> redone with per-call flags (layer 0 NaN again) -> layer 0 dense, redone again
    assert len(flags) == 5 and ov.nonfinite_layers == {0} and not host_calls  # 2 + 2 (finding) + 1 (the redo)
    assert cfg.stats.fallbacks[("t_flaky2", "auto_exact", "non-finite output (forward redone)")] == 1
    ref = torch.cat([sdpa_ref(q, k, v, h).flatten() for q, k, v, h in calls])
    assert cos_rel(outs[-1], ref)[1] < 1e-5
    assert cfg.check_finite == "deferred"  # outside a forward the net checks at once again


def test_nan_net_leaves_forwards_of_exact_kernels_alone(backends, monkeypatch):
    """Only a lossy kernel can put NaN where the unpatched model had none: on exact kernels (`sdpa`, auto keeping SDPA)
    no forward's output is checked, so no forward waits for the device (on SD1.5 that wait was ~3 % of a step)."""
    checked = []
    real = nan_net.output_flag
    monkeypatch.setattr(nan_net, "output_flag", lambda out: checked.append(1) or real(out))
    backends("t_exact", lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q, k, v, scale), accuracy="exact")
    backends("t_lossy", lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q, k, v, scale))
    func, _ = host_attention_pytorch()
    for name, want in (("sdpa", 0), ("t_exact", 0), ("t_lossy", 3)):
        checked.clear()
        ov = patch.AttentionOverride(A.AttentionConfig(backend=name, check_finite="deferred"), audit=False)
        ov.hides_nan = False
        fw, (q, k, v) = patch.ForwardWrapper(ov), _qkv()
        forward = lambda x, t, ov=ov, q=q, k=k, v=v: ov(func, q, k, v, 2, transformer_options={})  # noqa: E731
        for step in range(4):
            fw(forward, None, torch.tensor([float(10 - step)]))
        assert len(checked) == want, name  # every forward after the first, for the lossy kernel only


def test_an_unknown_model_keeps_per_call_flags(backends):
    backends("t_ok", lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q, k, v, scale))
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_ok", check_finite="deferred"), audit=False)
    _forwards(ov, None, [(*_qkv(), 2, {})], 2)
    assert ov.hides_nan is True  # an executor without a model: per-call flags on every forward
    assert patch.model_hides_nan(None) is True


def test_auto_sdpa_choices_run_what_was_timed_through_the_recheck_steps(backends, monkeypatch):
    """auto's exact choices need no re-check: at the middle and last step they keep the lean path, and no forward reads
    its sigma (a device sync) for the phase. ``sdpa`` runs as it was timed: PyTorch's SDPA called by the dispatcher,
    never ComfyUI's function (on ComfyUI 0.33 that runs under its own kernel priority, FlashAttention-2 first)."""
    reads = []
    real = nan_net.as_float
    monkeypatch.setattr(nan_net, "as_float", lambda s: reads.append(s) or real(s))
    sel = A.AutoSelector(timer=lambda name, fn, dev: {"sdpa": 1.0}.get(name, 9.0),
                         exclude={n for n in A.REGISTRY.names() if n != "sdpa"})
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    fw, sw = patch.ForwardWrapper(ov), patch.SampleWrapper(ov)
    func, host_calls = host_attention_pytorch()
    q, k, v = _qkv()
    sigmas = torch.tensor([10.0, 7.0, 4.0, 2.0, 0.0])

    def run(*args):
        for s in sigmas[:-1]:
            fw(lambda x, t: ov(func, q, k, v, 2, transformer_options={}), None, s.reshape(1))

    sw(run, None, None, None, sigmas)
    assert list(sel.decisions.values()) == ["sdpa"]
    assert cfg.stats.calls == {"sdpa": 4} and not host_calls  # tuned on the 1st, then the lean path
    assert len(ov.lane().lean) == 1 and all(e.exact for e in ov.lane().lean.values())
    assert not reads


def test_same_shape_with_a_strided_head_dim_leaves_the_lean_path(backends):
    seen = []

    def strict(q, k, v, *, layout, mask, scale, opts):
        seen.append(q.stride(-1))
        return _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)

    backends("t_strict", strict, layouts=("NHD",))
    q, k, v = _qkv()
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_strict", check_finite="deferred"), audit=False)
    _forwards(ov, None, [(q, k, v, 2, {})], 2)
    qs, ks, vs = (torch.randn(1, 32, 64)[..., ::2] for _ in range(3))  # same shape, stride 2 in the last dim
    out = _forwards(ov, None, [(qs, ks, vs, 2, {})], 1)[0][0]
    assert seen and set(seen) == {1}  # the kernel only ever saw a contiguous head dim
    assert cos_rel(out, sdpa_ref(qs, ks, vs, 2))[1] < 1e-5
