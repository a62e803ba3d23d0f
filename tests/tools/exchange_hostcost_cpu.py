"""Host time of one exchanged attention call (Ulysses over simulated ranks on the CPU), several checkouts compared.

    python tests/tools/exchange_hostcost_cpu.py --roots OLD,NEW [--rounds 40] [--calls 200] [--ranks 2]

Each rank is a thread, as Context Parallel runs them; the kernel returns its query (no arithmetic), and the tensors are
tiny (``[1, 64 tokens, 4 heads, 8]``), so the time is the exchange's Python and its rendezvous. The checkouts' rounds are
interleaved, so drift on a shared machine falls on all of them alike; the median and the minimum over rounds of µs per
call are printed. A split forward makes one such call per attention layer: on a host-bound split (Wan 1.3B 480p,
SageAttention) every µs here is step time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import threading
import time

import torch


def load(root: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roots", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    packs = []
    for i, root in enumerate(a.roots.split(",")):
        load(os.path.abspath(root), f"pa_exchange_cost_{i}")
        group = importlib.import_module(f"pa_exchange_cost_{i}.parallel.group")
        ulysses = importlib.import_module(f"pa_exchange_cost_{i}.parallel.ulysses")
        try:
            layout = importlib.import_module(f"pa_exchange_cost_{i}.parallel.exchange").shard_layout
        except ImportError:  # a checkout with the exchange inside ulysses.py
            layout = ulysses.shard_layout
        packs.append((root, group, ulysses, layout))
    q = torch.randn(1, 64, 4, 8)
    times = {root: [] for root, *_ in packs}
    for _ in range(a.rounds):
        for root, group, ulysses, shard_layout in packs:
            lay = shard_layout(q.shape[1], a.ranks)
            g = group.Group(["cpu"] * a.ranks)
            local = [q[:, s:s + c] for s, c in lay.shards]

            def rank(r, ulysses=ulysses, g=g, lay=lay, local=local):
                for _ in range(a.calls):
                    ulysses.ulysses(g, r, lay, local[r], local[r], local[r], lambda q, k, v: q)

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(a.ranks)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times[root].append((time.perf_counter() - t0) / a.calls * 1e6)
    for root, ts in times.items():
        print(f"{root}: µs per exchanged call, median {statistics.median(ts):.1f}, min {min(ts):.1f}")


if __name__ == "__main__":
    main()
