"""SpargeAttn profiles and threshold search (CPU: the search runs against fake error functions)."""

import json

import pytest
import torch

from attention import Backend
from attention.registry import Availability
from attention.sparge_profile import ProfileMismatchError, SpargeProfile, fingerprint_state_dict, search_layer
from attention.sparge_tune import SpargeTuner, candidates, tuning_attention


def test_profile_round_trip(tmp_path):
    p = SpargeProfile(variant="sparge", model_fingerprint="abc", model_class="Flux", error_budget=0.05,
                      layers={0: {"simthreshd1": 0.5, "cdfthreshd": 0.97, "pvthreshd": 50, "sparsity": 0.4, "rel_l1": 0.03},
                              7: {"simthreshd1": 0.6, "cdfthreshd": 0.99, "pvthreshd": 50}})
    path = tmp_path / "prof.json"
    p.save(str(path))
    q = SpargeProfile.load(str(path))
    assert q.layers == p.layers and q.model_fingerprint == "abc" and q.error_budget == 0.05
    assert q.thresholds(0) == {"simthreshd1": 0.5, "cdfthreshd": 0.97, "pvthreshd": 50}  # measurements are not options
    assert q.thresholds(3) is None
    assert json.loads(path.read_text())["format"] == "patch_attention.sparge_profile/1"


def test_profile_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="profile not found"):
        SpargeProfile.load(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        SpargeProfile.load(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a sparse-attention profile"):
        SpargeProfile.load(str(bad))
    with pytest.raises(ValueError, match="cdfthreshd=1.5 out of range"):
        SpargeProfile(layers={0: {"cdfthreshd": 1.5}})
    with pytest.raises(ValueError, match="unknown sparse-attention variant .sparse.; known: sparge.*kitchen_sol"):
        SpargeProfile(variant="sparse")


def test_fingerprint_mismatch_is_a_clear_error():
    m1 = torch.nn.Linear(4, 4)
    m2 = torch.nn.Linear(4, 4)
    f1, f2 = fingerprint_state_dict(m1.state_dict()), fingerprint_state_dict(m2.state_dict())
    assert f1 == fingerprint_state_dict(m1.state_dict()) and f1 != f2
    p = SpargeProfile(model_fingerprint=f1, model_class="Linear")
    p.check_model(f1)
    with pytest.raises(ProfileMismatchError, match="tuned for another model"):
        p.check_model(f2, "Linear")


def fake_error(th):
    """Error and sparsity grow as cdfthreshd falls and simthreshd1 falls (as on real layers)."""
    c, s = th["cdfthreshd"], th["simthreshd1"]
    sparsity = (1 - c) * 5 * (1.2 - s)
    return sparsity * 0.1, sparsity


def test_search_picks_the_sparsest_within_budget():
    th, err, sp, tried = search_layer(fake_error, budget=0.03)
    assert err <= 0.03
    for walk in candidates("sparge"):
        for cand in walk:
            e, s = fake_error(cand)
            if e <= 0.03:
                assert s <= sp + 1e-12
    assert tried < sum(len(w) for w in candidates("sparge"))  # walks stop early
    assert search_layer(lambda th: (1.0, 0.9), budget=0.05) is None


def test_tuner_keeps_the_worst_error_over_calls():
    tuner = SpargeTuner(budget=0.05)
    # layer 0: call 2 is harder (errors x2): candidates fine at call 1 but over budget at call 2 are dropped
    tuner.evaluate(0, fake_error)
    tuner.evaluate(0, lambda th: (fake_error(th)[0] * 2, fake_error(th)[1]))
    th, err, sp = tuner.best(0)
    assert err <= 0.05 and fake_error(th)[0] * 2 <= 0.05
    single = SpargeTuner(budget=0.05)
    single.evaluate(0, fake_error)
    assert single.best(0)[2] > sp  # the harder call made layer 0 more conservative
    tuner.evaluate(1, lambda th: (1.0, 0.9))  # nothing fits: layer 1 keeps per-model thresholds
    prof = tuner.profile("fp", "Model")
    assert set(prof.layers) == {0} and prof.layers[0]["calls"] == 2 and prof.error_budget == 0.05


def test_tuning_run_returns_dense_attention_and_measures_candidates(temp_backend):
    def fake_sparge(q, k, v, *, layout, mask, scale, opts):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        noise = (1 - opts["cdfthreshd"]) * 0.5
        return o + noise * o.std() * torch.randn_like(o), {"sparsity": 1 - opts["cdfthreshd"]}

    temp_backend(Backend(name="t_sparge", family="test", fn=fake_sparge, constraints=(), probe=lambda: Availability(True)))
    tuner = SpargeTuner(variant="t_sparge", budget=0.03, grid={"simthreshd1": (0.6,), "walk_key": "cdfthreshd",
                                                                "walk": (0.99, 0.98, 0.95, 0.9, 0.8), "pvthreshd": 50})
    q = torch.randn(1, 256, 2 * 16)
    out = tuning_attention(tuner, 0, q, q, q, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(*(q.view(1, 256, 2, 16).transpose(1, 2),) * 3)
    assert torch.allclose(out, ref.transpose(1, 2).reshape(1, 256, 32), atol=1e-6)
    th, err, sp = tuner.best(0)
    assert err <= 0.03 and th["cdfthreshd"] < 0.99 and tuner.evaluations >= 2


def test_pvthreshd_is_searched_when_several_values_are_given():
    grid = {"simthreshd1": (0.6,), "walk_key": "cdfthreshd", "walk": (0.99, 0.95), "pvthreshd": (50, 10)}
    walks = candidates("sparge", grid)
    assert [[c["pvthreshd"] for c in w] for w in walks] == [[50, 50], [10, 10]]

    def err(th):  # a lower pvthreshd skips more PV work: sparser, a little less accurate
        sp = (1 - th["cdfthreshd"]) * 5 + (50 - th["pvthreshd"]) / 200
        return sp * 0.1, sp

    th, e, sp, _ = search_layer(err, budget=0.05, grid=grid)
    assert th["pvthreshd"] == 10 and e <= 0.05
