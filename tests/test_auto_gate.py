"""``auto``'s gate over a sampling run, and ``auto_fast`` beside it (CPU: stand-in kernels, injected timings).

- The default gate is the calibration's at 3 dB below the exact floor, checked here on the H100 calibration's own
  points (docs/data/quality-standin-h100.json); auto_fast's, the earlier one, lets a setting 12 dB below through.
- A lossy choice is judged where it runs: every layer it serves, at the run's check steps (the first forward, the first
  of the sparse phase, the middle and the last step), each phase's choice on its own calls.  One whose error grows on
  a later layer or step is refused the moment a check step sees it beyond the gate, for good and in every lane, and
  that forward is computed again without it.
- No check step reads the device more often than any other forward: the errors come back with the NaN net's flag.
- auto_fast keeps the earlier gate and way of judging; its decisions, and those of a hand-set gate, are keyed apart.

The stand-in kernels scale SDPA's output by (1 + e): their relative L1 error is e exactly, their cosine 1, so each
call's error against the gates (rel-L1 0.039 for auto, 0.08 for auto_fast) is set by the test.
"""

import json
import os
import threading

import pytest
import torch
from conftest import cos_rel, sdpa_ref
from pack import load
from test_override_safety import _qkv

P = load()
A = P.attention
patch = P.nodes.patch
auto_mod = A.auto
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROW = "t_grow"  # 8-bit stand-in: error by (kernel, layer, sigma) from STATE["error"]
SPARSE = "t_sparse_grow"  # sparse stand-in, the same
STATE = {"layer": 0, "sigma": 0.0, "error": lambda name, layer, sigma: 0.0, "ran": []}


def _kernel(name):
    def fn(q, k, v, *, layout, mask, scale, opts):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        STATE["ran"].append((name, STATE["sigma"], STATE["layer"], threading.get_ident()))
        return o * (1.0 + STATE["error"](name, STATE["layer"], STATE["sigma"]))
    return fn


@pytest.fixture
def kernels(pack_backend):
    STATE.update(layer=0, sigma=0.0, error=lambda name, layer, sigma: 0.0, ran=[])
    for name, acc in ((GROW, "8bit"), (SPARSE, "sparse")):
        pack_backend(A.Backend(name=name, family="test", fn=_kernel(name), constraints=(),
                               probe=lambda: A.Availability(True, version="t"), accuracy=acc))
    yield STATE
    STATE["error"] = lambda name, layer, sigma: 0.0


def _selector(make=A.AutoSelector, keep=(GROW,), **kw):
    times = {"sdpa": 2.0, GROW: 1.0, SPARSE: 0.5}
    return make(timer=lambda name, fn, dev: (fn(), times[name])[1],
                exclude={n for n in A.REGISTRY.names() if n not in ("sdpa", *keep)}, **kw)


@pytest.fixture
def reads(monkeypatch):
    """Every read of a tensor's value on the host (on a GPU, each is a device sync): .tolist(), .item(), bool(),
    float(), int()."""
    n = [0]
    for meth in ("tolist", "item", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, meth)

        def counted(self, *a, _real=real, **kw):
            n[0] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, meth, counted)
    return n


def _run(ov, sigmas, layers=3, qkv=None, per_forward=None, outs=None, reads=None):
    """One sampling run through the wrappers: a forward per step, ``layers`` attention calls of one shape each."""
    fw, sw = patch.ForwardWrapper(ov), patch.SampleWrapper(ov)
    q, k, v = qkv or _qkv()

    def forward(x, t):
        res = []
        for i in range(layers):
            STATE["layer"] = i
            res.append(ov(None, q, k, v, 2, transformer_options={}))
        return torch.stack(res)

    def run(*args):
        for s in sigmas[:-1]:
            STATE["sigma"] = float(s)
            before = reads[0] if reads is not None else 0
            out = fw(forward, None, torch.tensor([float(s)]))
            if per_forward is not None:
                per_forward.append(reads[0] - before)
            if outs is not None:
                outs.append(max(cos_rel(o, sdpa_ref(q, k, v, 2))[1] for o in out))

    sw(run, None, None, None, torch.tensor(sigmas))


# ------------------------------------------------------------------ the default gate


def test_default_gate_is_the_calibrations_at_3_db_and_auto_fasts_is_not():
    cal = P.__name__ + ".measure.calibrate"
    import importlib

    cal = importlib.import_module(cal)
    with open(os.path.join(ROOT, "docs", "data", "quality-standin-h100.json")) as f:
        points = [cal.Point(**p) for p in json.load(f)["calibration"]["points"]]
    floor = cal.exact_floor(points)
    proposed = cal.propose_gate(points, floor, 3.0)
    ours = cal.check_gate(points, floor, auto_mod.DEFAULT_MIN_COS, auto_mod.DEFAULT_MAX_REL_L1, 3.0)
    assert ours.valid and sorted(ours.admitted) == sorted(proposed["admitted"]) and ours.pick == proposed["pick"]
    assert ours.pick == "sage_fp8_sm90" and abs(auto_mod.DEFAULT_MIN_COS - proposed["min_cos"]) < 2e-4
    assert abs(auto_mod.DEFAULT_MAX_REL_L1 - proposed["max_rel_l1"]) < 2e-3
    fast = cal.check_gate(points, floor, auto_mod.FAST_MIN_COS, auto_mod.FAST_MAX_REL_L1, 3.0)
    assert not fast.valid and fast.pick_psnr < floor - 10  # the lossier choice, by name: 12 dB below on this model


# ------------------------------------------------------------------ judged where it runs


@pytest.mark.parametrize("hides_nan", [False, True], ids=["output-flag", "per-call-flags"])
def test_check_steps_judge_every_layer_without_a_read_of_their_own(kernels, reads, hides_nan):
    """A lossy choice inside the gate: the first, middle and last step compare every layer's call with dense
    attention, and no forward reads the device more often than a forward without checks."""
    kernels["error"] = lambda name, layer, sigma: 0.02 if layer == 2 else 0.0  # inside auto's gate (rel-L1 0.039)
    sel = _selector()
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    ov.hides_nan = hides_nan
    per_forward = []
    _run(ov, [10.0, 8.0, 6.0, 4.0, 2.0, 0.0], per_forward=per_forward, reads=reads)
    # step 10: tuning; then every forward: its sigma, and the NaN net's read with the gate's sums in it
    assert per_forward[1:] == [2, 2, 2, 2]
    assert set(sel.decisions.values()) == {GROW} and not sel.refused
    m = cfg.stats.as_dict()["metrics"]
    for phase in ("first", "mid", "last"):  # steps 10, 6 and 2: all three layers
        assert m[f"{GROW}@gate-{phase}.rel_l1_vs_dense"]["n"] == 3
    assert abs(m[f"{GROW}@gate-mid.rel_l1_vs_dense"]["mean"] - 0.02 / 3) < 1e-4
    assert not any(k.startswith(f"{GROW}@gate-") and "sparse" in k for k in m)  # no sparse schedule here


def test_check_steps_compute_their_reference_on_the_fastest_exact_kernel(kernels, pack_backend):
    """The check steps' reference rows run on the fastest exact kernel auto measured for the call's shape (auto_exact
    learns it from auto's own timing), not on whatever PyTorch's SDPA picks; the gate reads the same error."""
    exact = "t_exact"
    pack_backend(A.Backend(name=exact, family="test", fn=_kernel(exact), constraints=(),
                           probe=lambda: A.Availability(True, version="t"), accuracy="exact"))
    kernels["error"] = lambda name, layer, sigma: 0.02 if name == GROW and layer == 2 else 0.0
    times = {"sdpa": 2.0, GROW: 1.0, exact: 1.5}
    sel = A.AutoSelector(timer=lambda name, fn, dev: (fn(), times[name])[1],
                         exclude={n for n in A.REGISTRY.names() if n not in times})
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    _run(ov, [10.0, 8.0, 6.0, 4.0, 2.0, 0.0])
    assert set(sel.decisions.values()) == {GROW}
    ran = [(sigma, layer) for name, sigma, layer, _ in kernels["ran"] if name == exact]
    # the middle and last steps (6, 2): one reference per layer; none on the other steps after tuning
    assert [r for r in ran if r[0] != 10.0] == [(6.0, 0), (6.0, 1), (6.0, 2), (2.0, 0), (2.0, 1), (2.0, 2)]
    m = cfg.stats.as_dict()["metrics"]
    assert abs(m[f"{GROW}@gate-mid.rel_l1_vs_dense"]["mean"] - 0.02 / 3) < 1e-4
    assert exact not in cfg.stats.calls  # the reference is not a call of the model's


def test_the_first_check_is_where_auto_first_runs(kernels):
    """With start_percent, the forwards before it run dense (no choice of auto's): the first check step is the first
    forward auto serves, every layer."""
    kernels["error"] = lambda name, layer, sigma: 0.02 if layer == 1 else 0.0
    sel = _selector()
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg, sigma_range=(8.0, 0.0))
    _run(ov, [10.0, 8.0, 7.0, 6.0, 5.0, 0.0])  # mid and last: 7 and 5
    m = cfg.stats.as_dict()["metrics"]
    assert m[f"{GROW}@gate-first.rel_l1_vs_dense"]["n"] == 3 and {s for n, s, layer, _ in kernels["ran"]} == {8, 7, 6, 5}
    assert [k for k in m if "@gate-" in k and k.endswith("rel_l1_vs_dense")] == [
        f"{GROW}@gate-{p}.rel_l1_vs_dense" for p in ("first", "mid", "last")]


def test_a_kernel_whose_error_grows_on_a_later_layer_and_step_is_refused_there_for_good(kernels, reads):
    """Tuned on layer 0 of the first step, where it is exact; from sigma 6 on layer 2 is beyond auto's gate (still
    within auto_fast's). The middle step's check finds it: that forward is computed again without the kernel, which
    never runs again for that signature, in this run or the next."""
    kernels["error"] = lambda name, layer, sigma: (0.01 if sigma > 6 else 0.06) if layer == 2 else 0.0
    sel = _selector()
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    ov.hides_nan = False
    per_forward, outs = [], []
    sigmas = [10.0, 8.0, 6.0, 4.0, 2.0, 0.0]  # the middle step: 6
    _run(ov, sigmas, per_forward=per_forward, outs=outs, reads=reads)
    ran = [(s, layer) for name, s, layer, _ in kernels["ran"] if name == GROW]
    assert [x for x in ran if x[0] <= 6.0] == [(6.0, 0), (6.0, 1), (6.0, 2)]  # the check step's calls, then never
    assert 0.005 < outs[1] < 0.02 and max(outs[2:]) < 1e-5  # step 6's output: computed again, exact
    # the refusal costs that forward once more (its own NaN read), nothing else
    assert per_forward[1:] == [2, 3, 2, 2]
    [sig] = sel.decisions
    assert sel.decisions[sig] == "sdpa" and GROW in sel.refused[sig]
    why = cfg.stats.decisions[sig]
    assert why.startswith("sdpa from then on") and "mid step on layer 2" in why and "rel-L1 0.0600" in why
    kernels["ran"].clear()
    _run(ov, sigmas, outs=outs)
    assert not [r for r in kernels["ran"] if r[0] == GROW]  # the next run too


def test_each_phase_is_judged_on_its_own_calls(kernels):
    """Before the sparse schedule starts auto has a choice of its own (dense-early); the sparse phase's is tuned on its
    first call and judged on every layer of the first sparse forward, and again at the middle step. The 8-bit kernel
    is fine before the sparse start and beyond the gate on layer 2 after it; the sparse kernel is beyond it on layer 1.
    Each is refused where it fails -- the sparse kernel at the sparse start, and the 8-bit kernel that replaced it on
    the same forward, computed again and judged again -- and the 8-bit kernel keeps the dense-early phase."""
    kernels["error"] = lambda name, layer, sigma: 0.06 if sigma <= 6 and layer == {SPARSE: 1, GROW: 2}[name] else 0.0
    sel = _selector(keep=(GROW, SPARSE))
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg, sparse_sigma=6.0)
    ov.hides_nan = False
    outs = []
    _run(ov, [10.0, 8.0, 6.0, 4.0, 3.0, 2.0, 0.0], outs=outs)  # sparse from 6; middle and last steps: 4 and 2
    [early] = [s for s in sel.decisions if s.endswith("/dense-early")]
    [late] = [s for s in sel.decisions if not s.endswith("/dense-early")]
    assert sel.decisions[early] == GROW and sel.decisions[late] == "sdpa"
    assert set(sel.refused) == {late} and set(sel.refused[late]) == {SPARSE, GROW}
    assert "sparse-start step on layer 2" in cfg.stats.decisions[late]  # GROW, refused second, on the same forward
    after = {(n, layer) for n, s, layer, _ in kernels["ran"] if s < 6}
    assert not after  # from the sparse start's forward on, neither kernel runs
    assert {n for n, s, layer, _ in kernels["ran"] if s > 6} == {GROW}  # the dense-early phase keeps GROW
    assert max(outs) < 1e-5  # every step's output within the gate (step 6: computed again until it was)


def test_a_refusal_holds_in_every_lane(kernels):
    """Two sampling threads (lanes) through one override, each with its own choices: when one lane refuses a kernel,
    the other drops its cached calls at its next forward and does not run it again."""
    kernels["error"] = lambda name, layer, sigma: 0.06 if (layer == 2 and sigma <= 6) else 0.0
    sel = _selector()
    cfg = A.AttentionConfig(backend="auto", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    ov.hides_nan = False
    sigmas = torch.tensor([10.0, 8.0, 6.0, 4.0, 2.0, 0.0])
    ov.start_run(sigmas)
    fw, (q, k, v) = patch.ForwardWrapper(ov), _qkv()
    go, done, errors = threading.Event(), threading.Event(), []

    def forward(x, t):
        for i in range(3):
            STATE["layer"] = i
            ov(None, q, k, v, 2, transformer_options={})

    def step(s):
        STATE["sigma"] = s
        fw(forward, None, torch.tensor([s]))

    def other_lane():
        try:
            step(10.0)
            step(8.0)  # its own choice, cached on the lean path
            done.set()
            go.wait(10)
            step(4.0)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    t = threading.Thread(target=other_lane)
    t.start()
    assert done.wait(10)
    other = t.ident
    assert {n for n, s, layer, tid in kernels["ran"] if tid == other and s == 8.0} == {GROW}
    for s in (10.0, 8.0, 6.0):  # this lane: refused at the middle step
        step(s)
    go.set()
    t.join()
    assert not errors and len(ov.lanes()) == 2
    assert not [r for r in kernels["ran"] if r[3] == other and r[1] == 4.0]  # the other lane: SDPA from then on
    assert ov.lanes()[0].config.auto.refused is ov.lanes()[1].config.auto.refused


# ------------------------------------------------------------------ auto_fast, and the gate by hand


def test_auto_fast_keeps_the_earlier_gate_and_its_decisions_are_keyed_apart(kernels, tmp_path):
    """A kernel at rel-L1 0.06: within auto_fast's gate (0.08), beyond auto's (0.039). auto_fast chooses it and files
    it under its own keys; auto, reading the same decisions file, measures again and keeps SDPA; a hand-set gate is
    keyed apart from both."""
    kernels["error"] = lambda name, layer, sigma: 0.06
    path = str(tmp_path / "auto.json")
    q, k, v = _qkv()
    picks = {}
    for backend, sel in (("auto_fast", _selector(A.AutoSelector.fast, cache_path=path)),
                         ("auto", _selector(cache_path=path)),
                         ("auto", _selector(cache_path=path, min_cos=0.99, max_rel_l1=0.07))):
        cfg = A.AttentionConfig(backend=backend, auto=sel)
        A.attention(q, k, v, 2, config=cfg)
        [(sig, name)] = sel.decisions.items()
        picks[sig.split("/mask=None")[1]] = name
    assert picks == {"/fast": GROW, "": "sdpa", "/gate0.99,0.07": GROW}
    saved = json.load(open(path))[auto_mod.fingerprint()]
    assert sorted(v for s, v in saved.items() if not s.endswith("/exact")) == ["sdpa", GROW, GROW]
    # each reads back its own decision without timing anything
    for make, kw, want in ((A.AutoSelector.fast, {}, GROW), (A.AutoSelector, {}, "sdpa")):
        sel = make(cache_path=path, timer=lambda *a: pytest.fail("timed again"), **kw)
        cfg = A.AttentionConfig(backend="auto", auto=sel)
        A.attention(q, k, v, 2, config=cfg)
        assert list(sel.decisions.values()) == [want]
    # auto_fast made from the config alone (no selector given)
    cfg = A.AttentionConfig(backend="auto_fast")
    A.attention(q, k, v, 2, config=cfg)
    assert not cfg.auto.over_run and (cfg.auto.min_cos, cfg.auto.max_rel_l1) == (0.995, 0.08)


def test_auto_fast_judges_as_the_earlier_auto_did(kernels):
    """The growing kernel of the test above under auto_fast: the middle step's spot check compares one call per
    signature (the first, layer 0, exact), so the kernel keeps running through the run, and it is chosen again in
    the next."""
    kernels["error"] = lambda name, layer, sigma: (0.01 if sigma > 6 else 0.06) if layer == 2 else 0.0
    sel = _selector(A.AutoSelector.fast)
    cfg = A.AttentionConfig(backend="auto_fast", auto=sel, check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    _run(ov, [10.0, 8.0, 6.0, 4.0, 2.0, 0.0])
    assert {s for n, s, layer, _ in kernels["ran"]} == {10.0, 8.0, 6.0, 4.0, 2.0} and not sel.refused
    m = cfg.stats.as_dict()["metrics"]
    assert m[f"{GROW}@recheck-mid.rel_l1_vs_dense"]["n"] == 1 and not any("@gate-" in key for key in m)


def test_gate_inputs_zero_and_the_earlier_defaults_mean_the_choices_own():
    gi = patch.gate_input
    assert gi(0.0, 0.995, "auto_min_cos") is None and gi(None, 0.995, "auto_min_cos") is None
    assert gi(0.995, 0.995, "auto_min_cos") is None and gi(0.9950000000000001, 0.995, "auto_min_cos") is None
    assert gi(0.08, 0.08, "auto_max_rel_l1") is None and gi(0.05, 0.08, "auto_max_rel_l1") == 0.05
    with pytest.raises(ValueError, match=r"auto_min_cos must be in \(0, 1\]"):
        gi(1.5, 0.995, "auto_min_cos")


@pytest.mark.comfyui
def test_the_node_builds_each_autos_gate(monkeypatch, tmp_path):
    """Patch Attention's inputs: auto and auto_fast with their own gates at the inputs' defaults and at the defaults
    earlier versions saved (0.995 / 0.08); a value set by hand replaces that threshold and keeps the way of judging."""
    from comfyui_support import load_pack, tiny_flux
    from test_comfyui_integration import patch as run_patch

    mod, mappings = load_pack()
    monkeypatch.setattr(mod.nodes.patch, "auto_cache_path", lambda: str(tmp_path / "auto.json"))
    base = tiny_flux()

    def gate(backend, **kw):
        sel = mod.nodes.patch.override_of(run_patch(mappings, base, backend, **kw)).config.auto
        return sel.min_cos, sel.max_rel_l1, sel.over_run

    assert gate("auto") == (0.999, 0.039, True) == gate("auto", auto_min_cos=0.995, auto_max_rel_l1=0.08)
    assert gate("auto_fast") == (0.995, 0.08, False) == gate("auto_fast", auto_min_cos=0.0, auto_max_rel_l1=0.08)
    assert gate("auto", auto_min_cos=0.998, auto_max_rel_l1=0.05) == (0.998, 0.05, True)
    assert gate("auto_fast", auto_min_cos=0.9985) == (0.9985, 0.08, False)
