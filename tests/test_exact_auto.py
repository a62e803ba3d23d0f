"""``auto_exact`` and the calls Patch Attention leaves dense (CPU: stand-in kernels, injected timings).

- ``auto_exact`` measures only kernels of the accuracy class "exact" and keeps the fastest per call shape, gated on that
  class's bound; its decisions are keyed apart from ``auto``'s, in memory and in the decisions file.
- What a decision names is what was timed, and that is what runs: each candidate's timing runs its own kernel and
  nothing else, and ``sdpa`` is PyTorch's SDPA called by the dispatcher -- never ComfyUI's function, which on ComfyUI
  0.33 with a GPU runs under ComfyUI's own kernel priority (FlashAttention-2 first), a kernel nobody timed.
- Every call Patch Attention runs dense by its own choice (outside start/end_percent, before sparse_start_percent,
  dense_layers, a shape the kernel refuses, the NaN net's redo, a full-precision request) runs on the fastest exact
  kernel measured for its shape (the stand-in ``t_exact_fast`` here), per lane, on the lean path after its first call;
  an override applied under Patch Attention still serves the calls declined by choice; an explicit ``sdpa`` stays
  ComfyUI's own call.
"""

import json
import threading

import pytest
import torch
from conftest import cos_rel, sdpa_ref
from pack import load
from test_override_safety import _qkv, host_attention_pytorch

P = load()
A = P.attention
patch = P.nodes.patch
auto_mod = A.auto

FAST = "t_exact_fast"  # an exact kernel, the fastest exact one
LOSSY = "t_lossy_fastest"  # an 8-bit kernel, faster than every exact one
SPARSE = "t_sparse"  # a sparse kernel
LONG = "t_long_only"  # an 8-bit kernel that refuses every call shorter than 10**6 tokens
NAN = "t_nan"  # an 8-bit kernel that returns NaN
TIMES = {"sdpa": 2.0, FAST: 1.0, LOSSY: 0.5, SPARSE: 0.4}


def _sdpa(q, k, v, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.fixture
def kernels(pack_backend):
    """The stand-ins, registered for one test; returns the list every kernel call appends its name to."""
    ran = []

    def kernel(name, post=lambda o: o):
        def fn(q, k, v, *, layout, mask, scale, opts):
            ran.append(name)
            return post(_sdpa(q, k, v, mask, scale))
        return fn

    def add(name, accuracy, post=lambda o: o, constraints=()):
        pack_backend(A.Backend(name=name, family="test", fn=kernel(name, post), constraints=constraints,
                               probe=lambda: A.Availability(True, version="t"), accuracy=accuracy))

    add(FAST, "exact")
    add(LOSSY, "8bit", lambda o: o.round(decimals=2))  # rel-L1 ~0.01: inside auto's gate, far outside exact's
    add(SPARSE, "sparse", lambda o: o.round(decimals=2))
    add(LONG, "8bit", constraints=(A.constraints.MinSeqLen(q=10**6, kv=1),))
    add(NAN, "8bit", lambda o: torch.full_like(o, float("nan")))
    return ran


def _others(keep=("sdpa", FAST, LOSSY, SPARSE)):
    """Every registered backend but ``keep``: the real kernels stay out of these selections."""
    return {n for n in A.REGISTRY.names() if n not in keep}


def _timer(calls, times=TIMES):
    def timer(name, fn, device):
        calls.append((name, threading.get_ident()))
        fn()
        return times[name]

    return timer


def _exact(calls, times=TIMES, **kw):
    return A.AutoSelector.exact(timer=_timer(calls, times), exclude=_others(), **kw)


def _forwards(ov, func, sigmas, layers=1, call_kw=None, qkv=None):
    """One model forward per sigma through the APPLY_MODEL wrapper, each making ``layers`` calls of one shape."""
    q, k, v = qkv or _qkv()
    fw = patch.ForwardWrapper(ov)
    outs = []
    for s in sigmas:
        def forward(x, t):
            return [ov(func, q, k, v, 2, transformer_options={}, **(call_kw or {})) for _ in range(layers)]

        outs.append(fw(forward, None, torch.tensor([float(s)])))
    return outs


# ------------------------------------------------------------------ the selector


def test_auto_exact_times_only_exact_kernels_and_keeps_the_fastest(kernels):
    calls = []
    cfg = A.AttentionConfig(backend="auto_exact", exact_selector=_exact(calls))
    q, k, v = _qkv()
    out = A.attention(q, k, v, 2, config=cfg)
    assert sorted(n for n, _ in calls) == ["sdpa", FAST]  # the 8-bit and sparse kernels are not even timed
    assert cfg.stats.calls == {FAST: 1} and kernels == [FAST] * 3  # the gate's check, the timing, the call
    [(sig, why)] = cfg.stats.decisions.items()
    assert sig.endswith("/exact") and why.startswith(f"{FAST} [") and LOSSY not in why
    assert f"auto_exact {sig}: {FAST} [" in cfg.stats.summary()  # log_stats names the selector
    cos, rel = cos_rel(out, sdpa_ref(q, k, v, 2))
    assert cos >= A.registry.ACCURACY["exact"].min_cos and rel < 1e-6
    # a kernel declared exact that is not (rel-L1 ~0.03: inside auto's gate of 0.08) fails auto_exact's gate, the exact
    # class's bound, however fast it is
    A.REGISTRY.get(FAST).fn = lambda q, k, v, *, layout, mask, scale, opts: (
        _sdpa(q, k, v, mask, scale) * (1 + 0.06 * torch.rand_like(q[..., :1])))
    cfg = A.AttentionConfig(backend="auto_exact", exact_selector=_exact([]))
    A.attention(q, k, v, 2, config=cfg)
    assert cfg.stats.calls == {"sdpa": 1} and f"{FAST}: failed gate" in next(iter(cfg.stats.decisions.values()))


def test_auto_exact_never_lowers_a_calls_precision(pack_backend):
    """A kernel that takes half dtypes only would compute an fp32 call in bf16 (the dispatcher casts): for auto_exact it
    is no candidate there, however fast; on a bf16 call it is."""
    half = A.constraints.DTypes((torch.bfloat16, torch.float16))
    pack_backend(A.Backend(name="t_half", family="test", constraints=(half,), probe=lambda: A.Availability(True),
                           fn=lambda q, k, v, *, layout, mask, scale, opts: _sdpa(q, k, v, mask, scale)))
    for dtype, want in ((torch.float32, "sdpa"), (torch.bfloat16, "t_half")):
        calls = []
        sel = A.AutoSelector.exact(timer=_timer(calls, {"sdpa": 2.0, "t_half": 1.0}),
                                   exclude=_others(keep=("sdpa", "t_half")))
        cfg = A.AttentionConfig(backend="auto_exact", exact_selector=sel)
        A.attention(*(t.to(dtype) for t in _qkv()), 2, config=cfg)
        assert cfg.stats.calls == {want: 1}, dtype
        assert [n for n, _ in calls] == ([] if dtype == torch.float32 else ["sdpa", "t_half"])  # fp32: SDPA alone


def test_auto_exact_decisions_are_keyed_apart_from_autos(kernels, tmp_path):
    """A decisions file holding auto's lossy choice for the same signature, and a lossy name under an exact key: neither
    reaches auto_exact. Its own decision is saved under its own key and reused by the next session without timing."""
    q, k, v = _qkv()
    spec = A.calls.prepare(q, k, v, 2)[4]
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({auto_mod.fingerprint(): {auto_mod.signature(spec): LOSSY}}))
    lossy = A.AttentionConfig(backend="auto", auto=A.AutoSelector(cache_path=str(path), exclude=_others()))
    A.attention(q, k, v, 2, config=lossy)
    assert lossy.stats.calls == {LOSSY: 1} and not lossy.stats.decisions  # auto: its remembered choice, not tuned
    calls = []
    exact = A.AttentionConfig(backend="auto_exact", exact_selector=_exact(calls, cache_path=str(path)))
    A.attention(q, k, v, 2, config=exact)
    assert exact.stats.calls == {FAST: 1} and calls  # tuned: auto's decision is not one of auto_exact's
    saved = json.loads(path.read_text())[auto_mod.fingerprint()]
    assert saved == {auto_mod.signature(spec): LOSSY, auto_mod.exact_signature(spec): FAST}
    # a lossy name under auto_exact's key (a file edited, or written by a bug) is not taken
    path.write_text(json.dumps({auto_mod.fingerprint(): {auto_mod.exact_signature(spec): LOSSY}}))
    calls.clear()
    again = A.AttentionConfig(backend="auto_exact", exact_selector=_exact(calls, cache_path=str(path)))
    A.attention(q, k, v, 2, config=again)
    assert again.stats.calls == {FAST: 1} and calls
    # the next session: auto_exact's own decision, no timing; auto does not read it as one of its own
    calls.clear()
    third = A.AttentionConfig(backend="auto_exact", exact_selector=_exact(calls, cache_path=str(path)))
    A.attention(q, k, v, 2, config=third)
    assert third.stats.calls == {FAST: 1} and not calls
    sel = A.AutoSelector(cache_path=str(path), exclude=_others())
    sel._load()
    assert sel.decisions == {}


def test_what_is_timed_is_what_runs_and_sdpa_is_never_comfyuis_function(kernels, monkeypatch):
    """How the selectors keep their word: each candidate's timing runs that candidate's registry kernel and nothing
    else (``sdpa``: the registry's PyTorch SDPA, with no priority context around it); the call then runs exactly the
    kernel that won, on the full path and on the lean path. ComfyUI's attention function is neither timed nor run, for
    ``auto_exact`` and for ``auto`` alike: on ComfyUI 0.33 with a GPU it runs FlashAttention-2 first."""
    ran = kernels
    sdpa = A.REGISTRY.get("sdpa")
    real = sdpa.fn
    monkeypatch.setattr(sdpa, "fn", lambda *a, **kw: ran.append("sdpa") or real(*a, **kw))
    cases = [("auto_exact", {"sdpa": 1.0, FAST: 2.0}, "sdpa"), ("auto_exact", {"sdpa": 2.0, FAST: 1.0}, FAST),
             ("auto", {"sdpa": 1.0, FAST: 2.0, LOSSY: 0.99, SPARSE: 3.0}, "sdpa")]  # auto: within the margin
    for backend, times, want in cases:
        timed = {}

        def timer(name, fn, device, times=times, timed=timed):
            n = len(ran)
            fn()
            timed[name] = set(ran[n:])
            return times[name]

        sel = A.AutoSelector(timer=timer, exclude=_others()) if backend == "auto" else \
            A.AutoSelector.exact(timer=timer, exclude=_others())
        cfg = A.AttentionConfig(backend=backend, check_finite="deferred",
                                **({"auto": sel} if backend == "auto" else {"exact_selector": sel}))
        ov = patch.AttentionOverride(cfg)
        func, host = host_attention_pytorch()
        _forwards(ov, func, (10.0,))
        assert timed == {n: {n} for n in times}, backend  # each timing ran its own kernel, nothing else
        ran.clear()
        _forwards(ov, func, (9.0, 8.0, 7.0))
        assert ran == [want] * 3 and not host and ov.stats.calls == {want: 4}, (backend, want)
        assert list(ov.lane().lean.values())[0].exact  # the lean path took it


def test_auto_hands_its_exact_measurements_over_and_a_demoted_choice_runs_on_the_fastest_exact_kernel(kernels):
    calls = []
    sel = A.AutoSelector(timer=_timer(calls), exclude=_others())
    exact = A.AutoSelector.exact(timer=lambda *a: pytest.fail("auto_exact timed a kernel auto had timed"),
                                 exclude=_others())
    cfg = A.AttentionConfig(backend="auto", auto=sel, exact_selector=exact)
    q, k, v = _qkv(n=64)
    A.attention(q, k, v, 2, config=cfg)
    spec = A.calls.prepare(q, k, v, 2)[4]
    assert cfg.stats.calls == {SPARSE: 1} and exact.decisions == {auto_mod.exact_signature(spec): FAST}
    # auto's re-check demotes its lossy choice for the rest of the run: the fastest exact kernel, not SDPA
    sel.demote(auto_mod.signature(spec), "failed the gate at the mid step")
    cfg._fast.clear()
    A.attention(q, k, v, 2, config=cfg)
    assert cfg.stats.calls == {SPARSE: 1, FAST: 1} and len(calls) == 4  # nothing timed again
    # before the sparse schedule (auto's dense-early phase): a choice of its own among the others, lossy ones included
    cfg.sparse_ok = False
    A.attention(q, k, v, 2, config=cfg)
    assert cfg.stats.calls[LOSSY] == 1 and [n for n, _ in calls[4:]] == ["sdpa", FAST, LOSSY]


# ------------------------------------------------------------------ the calls left dense


CASES = {  # reason: (backend, override keywords, layers per forward, call keywords, dense calls in 4 forwards)
    "outside start/end_percent": (LOSSY, {"sigma_range": (8.0, 0.0)}, 1, {}, 2),
    "before sparse_start_percent": (SPARSE, {"sparse_sigma": 8.0}, 1, {}, 2),
    "dense_layers": (LOSSY, {"dense_layers": ((1, 1),)}, 2, {}, 4),
    "a shape the kernel refuses": (LONG, {}, 1, {}, 4),
    "the NaN net's redo": (NAN, {}, 1, {}, 4),
    "a full-precision request": (LOSSY, {}, 1, {"low_precision_attention": False}, 4),
    "a full-precision request under auto": ("auto", {}, 1, {"attn_precision": torch.float32}, 4),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_every_call_left_dense_runs_on_the_fastest_exact_kernel(kernels, reason):
    """Forwards at sigma 10, 9, 5, 4: each reason's dense calls run on the stand-in exact kernel the exact selector
    measured fastest (never ComfyUI's function, never a lossy kernel, whatever its speed), with SDPA's result; the
    selector tunes once per shape; the counts say where the calls went."""
    backend, ov_kw, layers, call_kw, n_dense = CASES[reason]
    calls = []
    auto = A.AutoSelector(timer=_timer(calls), exclude=_others()) if backend == "auto" else None
    cfg = A.AttentionConfig(backend=backend, check_finite="deferred", auto=auto, exact_selector=_exact(calls))
    ov = patch.AttentionOverride(cfg, audit=False, **ov_kw)
    ov.hides_nan = False
    func, host = host_attention_pytorch()
    qkv = _qkv()
    outs = _forwards(ov, func, (10.0, 9.0, 5.0, 4.0), layers, call_kw, qkv)
    st = ov.stats
    assert st.calls[FAST] == n_dense and not host, (reason, st.calls)
    assert sum(st.calls.values()) == 4 * layers + (backend == NAN)  # the NaN forward ran twice (found, redone)
    tuned = [n for n, _ in calls]
    assert tuned == ["sdpa", FAST], tuned  # the exact selector, once; auto never sees a call that must be exact
    ref = sdpa_ref(*qkv, 2)
    dense_out = outs[-1][-1] if reason == "dense_layers" else outs[0][0]
    assert cos_rel(dense_out, ref)[1] < 1e-6  # SDPA's result: no lossy kernel's rounding in it
    if backend in (LONG, NAN) or "full-precision" in reason:
        [(frm, to, why)] = [key for key in st.fallbacks]
        assert (frm, to) == (backend, FAST if backend == LONG else "auto_exact"), st.fallbacks


def test_dense_forwards_take_the_lean_path_after_their_first_call(kernels, monkeypatch):
    """No per-call cost that could run once per shape: the first call of a dense forward takes the full path (and the
    tuning), later dense forwards run the cached entry, as the kernel's forwards do."""
    cfg = A.AttentionConfig(backend=LOSSY, check_finite="deferred", exact_selector=_exact([]))
    ov = patch.AttentionOverride(cfg, audit=False, sigma_range=(8.0, 0.0))
    full = []
    run = ov._run
    monkeypatch.setattr(ov, "_run", lambda *a, **kw: full.append(1) or run(*a, **kw))
    func, host = host_attention_pytorch()
    _forwards(ov, func, (10.0, 9.5, 9.0, 5.0, 4.0))
    assert len(full) == 2 and ov.stats.calls == {FAST: 3, LOSSY: 2} and not host  # one full call per phase
    entries = ov.lane().lean
    assert {key[-1]: e.exact for key, e in entries.items()} == {None: True, True: False}  # dense forward: exact


def test_explicit_sdpa_stays_comfyuis_own_call_dense_calls_included(kernels):
    cfg = A.AttentionConfig(backend="sdpa", check_finite="deferred")
    ov = patch.AttentionOverride(cfg, sigma_range=(8.0, 0.0))
    func, host = host_attention_pytorch()
    _forwards(ov, func, (10.0, 5.0), call_kw={})
    _forwards(ov, func, (10.0,), call_kw={"low_precision_attention": False})
    assert len(host) == 3 and ov.stats.calls == {"comfyui": 3} and cfg.exact_selector is None and not kernels


def test_over_a_previous_override_it_serves_the_calls_declined_by_choice_and_never_those_that_must_be_exact(kernels):
    """The composition rule: the override Patch Attention was applied over serves the dense forwards (full path, then
    lean) and refused shapes; a full-precision request goes to the fastest exact kernel, also in a dense forward."""
    prev = []

    def previous(func, q, k, v, heads, **kw):
        prev.append(1)
        return func(q, k, v, heads, **kw)

    cfg = A.AttentionConfig(backend=LOSSY, check_finite="deferred", exact_selector=_exact([]))
    ov = patch.AttentionOverride(cfg, audit=False, sigma_range=(8.0, 0.0), previous=previous)
    func, host = host_attention_pytorch()
    _forwards(ov, func, (10.0, 9.0, 5.0))
    _forwards(ov, func, (10.0, 5.0), call_kw={"low_precision_attention": False})
    assert len(prev) == 2 == len(host) and ov.stats.calls == {"previous override": 2, LOSSY: 1, FAST: 2}
    refusing = patch.AttentionOverride(A.AttentionConfig(backend=LONG, check_finite="deferred", exact_selector=_exact([])),
                                       audit=False, previous=previous)
    _forwards(refusing, func, (5.0, 4.0))
    assert refusing.stats.calls == {"previous override": 2} and len(prev) == 4
    assert set(refusing.stats.fallbacks) == {(LONG, "previous override", "query length 32 < 1000000")}


def test_each_sampling_thread_has_its_own_exact_selector(kernels):
    """Lanes: two threads sampling through one override each tune and keep their own exact choices (no shared dict
    written by two threads); the statistics are merged."""
    calls = []
    cfg = A.AttentionConfig(backend=LOSSY, check_finite="deferred", exact_selector=_exact(calls))
    ov = patch.AttentionOverride(cfg, audit=False, sigma_range=(8.0, 0.0))
    barrier, errors = threading.Barrier(2), []

    def worker():
        try:
            barrier.wait()
            _forwards(ov, None, (10.0, 9.0, 5.0))
            barrier.wait()  # both alive until both have sampled: a finished thread's lane is taken over by design
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    lanes = ov.lanes()
    assert len(lanes) == 2 and lanes[0].config.exact_selector is not lanes[1].config.exact_selector
    for ln in lanes:
        assert ln.dense.exact_selector is ln.config.exact_selector and list(ln.config.exact_selector.decisions.values()) == [FAST]
    assert len({t for _, t in calls}) == 2 and len(calls) == 4  # sdpa and the stand-in, timed once in each thread
    assert ov.stats.calls == {FAST: 4, LOSSY: 2}


# ------------------------------------------------------------------ in real ComfyUI sampling


@pytest.fixture
def comfy_pack(monkeypatch, tmp_path):
    """The pack as ComfyUI loads it, with the stand-in exact kernel registered, auto_exact's timings injected, and
    the decisions file in a temporary folder."""
    from comfyui_support import load_pack

    mod, mappings = load_pack()
    A2 = mod.attention
    ran = []

    def fast(q, k, v, *, layout, mask, scale, opts):
        ran.append(1)
        return _sdpa(q, k, v, mask, scale)

    A2.REGISTRY.register(A2.Backend(name=FAST, family="test", fn=fast, constraints=(),
                                    probe=lambda: A2.Availability(True, version="t")))
    A2.dispatch.clear_plan_cache()
    made = A2.AutoSelector.exact
    others = {n for n in A2.REGISTRY.names() if n not in ("sdpa", FAST)}
    monkeypatch.setattr(A2.AutoSelector, "exact", classmethod(
        lambda cls, **kw: made(**{**kw, "timer": lambda name, fn, dev: (fn(), TIMES[name])[1], "exclude": others})))
    monkeypatch.setattr(mod.nodes.patch, "auto_cache_path", lambda: str(tmp_path / "auto.json"))
    yield mod, mappings, ran
    A2.REGISTRY.unregister(FAST)
    A2.dispatch.clear_plan_cache()


@pytest.mark.comfyui
def test_auto_exact_and_dense_steps_in_real_sampling(comfy_pack):
    from comfyui_support import sample, tiny_flux
    from test_comfyui_integration import patch as run_patch
    from test_comfyui_integration import rel, stats_of

    mod, mappings, ran = comfy_pack
    base = tiny_flux()
    ref = sample(base)
    m = run_patch(mappings, base, "auto_exact")
    out = sample(m)
    tuned = len(mod.nodes.patch.override_of(m).config.exact_selector.decisions)  # call shapes: each timed once (and checked)
    assert rel(out, ref) < 1e-4 and stats_of(mod, m).calls == {FAST: 8} and len(ran) == 8 + 2 * tuned
    # an explicit kernel: the steps outside its schedule run on the fastest exact kernel, not ComfyUI's function
    late = run_patch(mappings, base, "sdpa_math", start_percent=0.5)
    out = sample(late)
    st = stats_of(mod, late)
    assert rel(out, ref) < 1e-4 and st.calls[FAST] > 0 and "comfyui" not in st.calls
    assert st.calls[FAST] + st.calls["sdpa_math"] == 8


@pytest.mark.comfyui
def test_end_to_end_benchmark_has_an_auto_exact_row(comfy_pack):
    import importlib

    from comfyui_support import flux_conds, tiny_flux

    mod, _, _ = comfy_pack
    e2e = importlib.import_module(mod.__name__ + ".measure.e2e")
    report = importlib.import_module(mod.__name__ + ".measure.report")
    assert "auto_exact" in importlib.import_module(mod.__name__ + ".measure.rows").default_rows(peers=False)
    pos, neg = flux_conds()
    job = e2e.Job(tiny_flux(), pos, neg, torch.zeros(1, 16, 16, 16), steps=2, label="tiny")
    rows = e2e.measure(job, ["unpatched", "sdpa_math", "auto_exact"], rounds=3)
    by = {r["row"]: r for r in rows}
    ax = by["auto_exact"]
    assert ax["rel_l1"] < 1e-4 and ax["auto_exact"] == FAST and FAST in ax["kernels"]
    assert ax["best_row"] in ("unpatched", "sdpa_math") and "vs_best" in ax["paired"]
    targets = {t["target"].split(" (")[0] for t in report.targets(rows)}
    assert targets == {"auto_exact within 2% of the best exact row", "auto_exact within 2% of unpatched"}
    assert "(auto_exact: t_exact_fast)" in report.render_markdown(rows)
