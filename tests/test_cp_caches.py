"""Step caches under Context Parallel on the CPU: ComfyUI's EasyCache and LazyCache on a tiny Wan model split over
N = 2, 3 and 4 simulated ranks, against the same cached model on one device.

EasyCache decides in a DIFFUSION_MODEL wrapper, inside each GPU's forward; LazyCache in a PREDICT_NOISE wrapper, around
the step.  Either way one decision must hold for every GPU (nodes/handoff.py): the latent is the one-device cached
run's, every rank runs the same forwards (the steps the cache skipped, none), and the cache skipped some steps (the
thresholds are chosen so that it does: otherwise the test would pass with no cache at all).
"""

from __future__ import annotations

import pytest
import test_context_parallel
from comfyui_support import step_cache
from test_context_parallel import _case, _split, rel_l1

zoo = test_context_parallel.zoo  # the fixture: ComfyUI with the zoo's families and the pack loaded

pytestmark = pytest.mark.comfyui

STEPS = 10
# threshold -> the steps the tiny model's one-device run skips with it (10 steps, start 0.15, end 0.95)
THRESHOLDS = {"EasyCache": 0.5, "LazyCache": 0.5}


def skipped(caplog, node: str) -> int:
    """The steps the cache says it skipped in the last run ("EasyCache - skipped 3/10 steps")."""
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{node} - skipped ")]
    assert said, f"{node} said nothing"
    return int(said[-1].split("skipped ")[1].split("/")[0])


@pytest.fixture
def forwards(zoo, monkeypatch):
    """The rank of every forward whose blocks ran on it (RankContext.start, at the first block), as they come."""
    _, mod, _ = zoo
    ctx = mod.parallel.context.RankContext
    seen, real = [], ctx.start

    def start(self, *a, **k):
        seen.append(self.rank)
        return real(self, *a, **k)

    monkeypatch.setattr(ctx, "start", start)
    return seen


@pytest.mark.parametrize("node", list(THRESHOLDS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_step_cache_decides_once_for_every_gpu(zoo, forwards, caplog, node, n):
    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    case = z.with_(case, steps=STEPS)
    base = z.build(cls, case)
    with caplog.at_level("INFO"):
        ref = z.sample(step_cache(base, node, THRESHOLDS[node]), case)
        one = skipped(caplog, node)
        caplog.clear()
        out = z.sample(step_cache(_split(mod, base, n), node, THRESHOLDS[node]), case)
        split = skipped(caplog, node)
    assert 0 < one < STEPS - 1  # the cache skipped steps, and not all of them
    assert split == one  # counted once, not once per GPU
    # every rank ran the forwards the cache did not skip, and only those (the conds of a step: one batch)
    assert [forwards.count(r) for r in range(n)] == [STEPS - one] * n
    assert rel_l1(out, ref) < 1e-5, rel_l1(out, ref)
    if node == "EasyCache":  # its reused forwards are counted apart from the split ones
        said = [r.getMessage() for r in caplog.records if "forwards split" in r.getMessage()]
        assert said == [f"Context Parallel: {STEPS - one} of {STEPS} forwards split over {n} GPUs ({one} reused a "
                        "step cache's output)"]


def test_the_other_gpus_run_the_call_the_first_gpu_hands_them(zoo, forwards):
    """A DIFFUSION_MODEL wrapper that changes the diffusion model's inputs runs once, on the first GPU, and every rank
    computes with what it handed on: the latent of the same wrapper on one device."""
    import comfy.patcher_extension as pe

    z, mod, _ = zoo
    cls, case = _case(z, "WAN21_T2V")
    base = z.build(cls, case)
    calls = []

    def scaled(executor, x, *args, **kwargs):  # the diffusion model's input, scaled
        calls.append(x.shape)
        return executor(x * 0.9, *args, **kwargs)

    def wrapped(m):
        m = m.clone()
        m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_scale", scaled)
        return m

    ref = z.sample(wrapped(base), case)
    calls.clear()
    out = z.sample(wrapped(_split(mod, base, 3)), case)
    assert len(calls) == case.steps  # once per forward, not once per rank
    assert [forwards.count(r) for r in range(3)] == [case.steps] * 3
    assert rel_l1(out, ref) < 1e-5 and rel_l1(out, z.sample(base, case)) > 1e-3
