"""Several sampling threads through one patched model (MultiGPU CFG Split runs each GPU's conds in its own thread, all
through the same override): each thread gets its own lane, and two threads give what one batch gives (CPU)."""

import threading

import torch
from conftest import sdpa_ref
from pack import load

P = load()
A = P.attention
patch = P.nodes.patch


def _lossy(q, k, v, *, layout, mask, scale, opts):
    """A batch-independent stand-in for an 8-bit kernel: SDPA rounded to 3 decimals."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).round(decimals=3)


def _register(pack_backend, name="t_lanes", fn=_lossy):
    pack_backend(A.Backend(name=name, family="test", fn=fn, constraints=(), probe=lambda: A.Availability(True),
                           accuracy="8bit"))


def _calls(batch, seed):
    """One 'model forward': three attention calls of different shapes (self, cross, skip_reshape)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(batch, 40, 2 * 16, generator=g) for _ in range(3)],
        [torch.randn(batch, 40, 2 * 16, generator=g), *(torch.randn(batch, 12, 2 * 16, generator=g) for _ in range(2))],
        [torch.randn(batch, 2, 24, 16, generator=g) for _ in range(3)],
    ]


def _forward(ov, fw, calls, steps):
    """``steps`` model forwards through the APPLY_MODEL wrapper; each returns its three outputs."""
    outs = []
    for step in range(steps):
        def forward(x, t):
            res = []
            for i, (q, k, v) in enumerate(calls):
                kw = {"skip_reshape": True, "skip_output_reshape": True} if i == 2 else {}
                res.append(ov(None, q, k, v, 2, transformer_options={}, **kw))
            return res

        outs.append(fw(forward, calls[0][0], torch.tensor([float(10 - step)])))
    return outs


def _split(batch2, i):
    return [[t[i:i + 1] for t in call] for call in batch2]


def test_two_threads_give_the_batch_one_thread_gives(pack_backend):
    """The MultiGPU split: one thread with the CFG batch (2) against two threads with one cond each, at once, through
    one override -- every output row bit-identical, each thread's layer counter its own (dense_layers hit the same
    layer in both), statistics merged."""
    _register(pack_backend)
    calls = _calls(2, seed=3)

    def make():
        ov = patch.AttentionOverride(A.AttentionConfig(backend="t_lanes", check_finite="deferred"),
                                     dense_layers=patch.parse_layers("1"), audit=False)
        return ov, patch.ForwardWrapper(ov)

    ov1, fw1 = make()
    one = _forward(ov1, fw1, calls, 4)
    ov2, fw2 = make()
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = _forward(ov2, fw2, _split(calls, i), 4)
            barrier.wait(timeout=60)  # alive until both are done: a finished thread's lane is taken over, by design
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for step in range(4):
        for j in range(3):
            assert torch.equal(one[step][j], torch.cat([results[0][step][j], results[1][step][j]]))
    assert len(ov2.lanes()) == 2 and len(ov1.lanes()) == 1
    merged = ov2.stats
    # per forward: layers 0 and 2 on the kernel, layer 1 dense (ComfyUI's function is not given: the dispatcher's SDPA)
    assert merged.calls == {"t_lanes": 2 * 4 * 2, "sdpa": 2 * 4} == {k: 2 * v for k, v in ov1.stats.calls.items()}
    for ln in ov2.lanes():
        assert ln.config is not ov2.lanes()[0].config or ln is ov2.lanes()[0]
        assert ln.config.stats.calls == ov1.stats.calls


def test_a_nan_layer_found_in_one_thread_runs_dense_in_every_thread(pack_backend):
    """As in one batch on one GPU: a layer the NaN net sends to dense is dense for the other device's forwards too."""
    state = {"nan": False}

    def flaky(q, k, v, *, layout, mask, scale, opts):
        o = _lossy(q, k, v, layout=layout, mask=mask, scale=scale, opts=opts)
        return torch.full_like(o, float("nan")) if state["nan"] and q.shape[2] == 40 else o

    _register(pack_backend, "t_flaky_lanes", flaky)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_flaky_lanes", check_finite="deferred"), audit=False)
    ov.hides_nan = False
    fw = patch.ForwardWrapper(ov)
    calls = _calls(1, seed=4)
    go, done, seen = threading.Event(), threading.Event(), []

    def other_device():  # a worker that stays alive: one clean forward, then one after the NaN was found elsewhere
        _forward(ov, fw, calls, 1)
        done.set()
        go.wait()
        seen.extend(_forward(ov, fw, calls, 1))

    t = threading.Thread(target=other_device)
    t.start()
    done.wait()
    state["nan"] = True  # now the calls with 40 queries give NaN in this thread's forwards
    mine = _forward(ov, fw, calls, 2)
    assert ov.nonfinite_layers == {0, 1}  # the layers with 40 queries (self- and cross-attention)
    assert all(torch.isfinite(o).all() for f in mine for o in f)
    state["nan"] = False
    go.set()
    t.join()
    assert len(ov.lanes()) == 2
    q, k, v = calls[0]
    torch.testing.assert_close(seen[0][0], sdpa_ref(q, k, v, 2), rtol=1e-5, atol=1e-5)  # dense, not the rounded kernel


def test_a_lane_whose_thread_ended_is_taken_over_by_the_next_thread_on_its_device(pack_backend):
    """ComfyUI starts new worker threads for each run: the new thread on a device continues that device's lane (its
    auto choices and lean entries), instead of the lanes piling up."""
    _register(pack_backend)
    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_lanes", check_finite="deferred"), audit=False)
    fw = patch.ForwardWrapper(ov)
    calls = _calls(1, seed=5)
    main = _forward(ov, fw, calls, 1)
    for _ in range(3):
        t = threading.Thread(target=lambda: _forward(ov, fw, calls, 2))
        t.start()
        t.join()
    lanes = ov.lanes()
    assert len(lanes) == 2  # this thread's, and one for the worker threads (all on the CPU here)
    worker = next(ln for ln in lanes if ln.config is not ov.config)
    assert worker.lean and worker.config.stats.calls["t_lanes"] == 3 * 2 * 3
    assert torch.equal(main[0][0], _forward(ov, fw, calls, 1)[0][0])
