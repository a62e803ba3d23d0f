"""Ranks in processes of their own (parallel/dist.py ProcessGroupRanks over torch.distributed, gloo on the CPU), 2, 3
and 4 of them, their transfers batched point-to-point or one all-to-all each: the exchanged attention call (an all-to-all: SentExchange; text held whole before and after the split
part, grouped key/value heads that do not divide over the ranks, a key mask), a tensor made whole from every rank's
shard and the flags every rank takes the same way give what one process gives (fp64 whole attention, the thread ranks
of parallel/group.py), bit for bit where the arithmetic is the same."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _modules():
    sys.path.insert(0, HERE)
    from pack import load

    p = load()
    return (importlib.import_module(p.__name__ + ".parallel.group"), importlib.import_module(p.__name__ + ".parallel.dist"),
            importlib.import_module(p.__name__ + ".parallel.context"))


def _inputs(n):
    """fp64 q, k, v over the whole sequence, a key mask over it, and the layout's numbers."""
    from test_context_parallel import rand_qkv

    g = torch.Generator().manual_seed(100 + n)
    b, heads, kv_heads, d, tokens, prefix, suffix = 2, 6, 3, 8, 41, 5, 3
    L = prefix + tokens + suffix
    q, k, v = rand_qkv(g, b, L, heads, kv_heads, d, d + 2)
    key_mask = -3 * torch.rand(b, 1, L, generator=g, dtype=torch.float64)
    return q, k, v, key_mask, tokens, prefix, suffix


def _rank_results(group, r, n):
    """What rank ``r`` of a group computes: the exchanged call with and without a key mask, a whole tensor, flags."""
    from test_context_parallel import rank_rows, whole

    G, D, C = _modules()
    q, k, v, key_mask, tokens, prefix, suffix = _inputs(n)
    ctx = C.RankContext(group, r, None)
    assert ctx.start(tokens, others={7}, prefix=prefix, suffix=suffix)
    lay = ctx.layout
    mine = [rank_rows(t, lay, r) for t in (q, k, v)]

    def kernel(qf, kf, vf, mask=None):
        return whole(qf, kf, vf, None if mask is None else mask.unsqueeze(-2) if mask.ndim == 3 else mask)

    plain = ctx.attention(*mine, kernel)
    masked = ctx.attention(*mine, kernel, mask=rank_rows(key_mask, lay, r, dim=-1))
    made_whole = ctx.whole(mine[2])
    return {"plain": plain, "masked": masked, "whole": made_whole, "any": ctx.any(r == n - 1), "union": ctx.union([r, 0]),
            "ref_plain": rank_rows(whole(q, k, v), lay, r),
            "ref_masked": rank_rows(whole(q, k, v, key_mask.unsqueeze(-2)), lay, r)}


def _process_rank(r, n, store_path, out_dir, collective=False):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this process's own: the ranks meet on this machine
    dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=r, world_size=n)
    try:
        G, D, C = _modules()
        group, swaps = D.ProcessGroupRanks(dist.group.WORLD, "cpu", collective=collective), []
        real = group.swap
        group.swap = lambda *a: swaps.append(a) or real(*a)  # every transfer between the processes
        res = _rank_results(group, r, n)
        res["swaps"] = len(swaps)
        torch.save(res, os.path.join(out_dir, f"rank{r}.pt"))
        dist.barrier()  # no rank tears gloo down while another still talks to it (an abort at exit, seen once in CI)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("collective", [False, True], ids=["p2p", "all_to_all"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ranks_in_processes_give_what_ranks_in_threads_give(n, collective, tmp_path):
    from test_context_parallel import run_ranks

    G, D, C = _modules()
    mp.start_processes(_process_rank, args=(n, str(tmp_path / "store"), str(tmp_path), collective), nprocs=n,
                       start_method="spawn")
    group = G.Group(["cpu"] * n)
    threads, errs = run_ranks(n, lambda r: _rank_results(group, r, n))
    assert not any(errs), errs
    q, k, v, *_ = _inputs(n)
    for r in range(n):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name in ("plain", "masked"):
            torch.testing.assert_close(got[name], got["ref_" + name], rtol=1e-12, atol=1e-12)
            assert torch.equal(got[name], threads[r][name]), (r, name)
        # each exchanged call two (q, k, v and the mask out, the output back), whole() one
        assert got["swaps"] == 5, r
        assert torch.equal(got["whole"], v), r  # v's whole sequence, from every rank's shard
        assert got["any"] is True and got["union"] == [0, *range(1, n)]


def test_a_post_from_another_rank_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    G, D, C = _modules()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = D.ProcessGroupRanks(dist.group.WORLD, "cpu")
        with pytest.raises(ValueError, match="rank 1 posted in the process of rank 0"):
            group.post(1, (torch.zeros(2),))
        assert group.post(0, (torch.ones(2),))[0][0][0].sum() == 2  # one rank: its own tensors, nothing sent
    finally:
        dist.destroy_process_group()


@pytest.mark.comfyui
def test_the_process_benchmark_splits_every_forward_and_matches_one_process(tmp_path):
    """tests/gpu/multigpu_procs.py --cpu-check: two gloo processes, each with ComfyUI and a tiny Wan, every forward split,
    the final latent one process's, bit for bit (unpatched and through Patch Attention)."""
    import json
    import subprocess

    sys.path.insert(0, HERE)
    import comfyui_support

    path = comfyui_support.comfy()
    out = tmp_path / "procs.json"
    env = {**os.environ, "COMFYUI_PATH": path, "GLOO_SOCKET_IFNAME": "lo"}
    run = subprocess.run([sys.executable, os.path.join(HERE, "gpu", "multigpu_procs.py"), "--cpu-check", "--rows",
                          "1:unpatched,procs:unpatched,1:sdpa,procs:sdpa", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = {r["row"]: r for r in json.load(open(out))["rows"]}
    for backend in ("unpatched", "sdpa"):
        split = rows[f"procs:{backend}"]
        assert split["forwards_split"] == 4 and split["forwards_whole"] == 0, split  # a warm-up step and 3 timed
        assert split["rel_l1_vs_1gpu"] == 0, split


def test_a_graphed_forward_keys_on_its_tensors_and_runs_a_control_dict_eagerly():
    """tests/gpu/multigpu_procs.py's CUDA-graph wrapper: ComfyUI passes ``transformer_options`` positionally; a forward is
    keyed by its tensors' shapes (not by that dict), and one with ControlNet's dict runs eagerly (on the CPU here, no
    capture is reached: the first forwards of a shape run eagerly)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_multigpu_procs", os.path.join(HERE, "gpu", "multigpu_procs.py"))
    procs = importlib.util.module_from_spec(spec)  # not tests/gpu on the path: its zoo.py would hide tests/zoo
    spec.loader.exec_module(procs)
    GraphedForward = procs.GraphedForward

    class Model:
        def _forward(self, x, timestep, context, y=None, control=None, transformer_options=None, **kwargs):
            return x * 2

    class Executor:  # what ComfyUI's WrapperExecutor gives a wrapper: the original bound method, callable
        def __init__(self, m):
            self.original = m._forward

        def __call__(self, *args, **kwargs):
            return self.original(*args, **kwargs)

    g, ex = GraphedForward(warmup=2), Executor(Model())
    x, t, c = torch.ones(1, 4), torch.zeros(1), torch.ones(1, 3, 8)
    key = g._key(ex, (x, t, c, None, None, {"wrappers": {}}), {"guidance": torch.ones(1)})
    assert key == (("x", (1, 4), torch.float32, x.device), ("timestep", (1,), torch.float32, x.device),
                   ("context", (1, 3, 8), torch.float32, x.device), ("y", None), ("control", None),
                   ("guidance", (1,), torch.float32, x.device))
    assert g._key(ex, (x, t, c, None, {"input": [x]}, {}), {}) is None
    for _ in range(2):
        assert torch.equal(g(ex, x, t, c, None, None, {}), x * 2)
    assert g(ex, x, t, c, None, {"input": [x]}, {}).sum() == 8
    assert (g.eager, g.captured, g.replayed) == (3, 0, 0)
