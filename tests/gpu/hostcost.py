"""Host time per attention call through ComfyUI's hook: Patch Attention's paths against a bare peer call.

    python tests/gpu/hostcost.py --md hostcost.md --json hostcost.json

On host-bound models (SD1.5/SDXL on a big GPU) every microsecond of Python per attention call is step time, so this
measures it directly: each row makes the same call ``--per-forward`` times inside a simulated model forward (the
override's APPLY_MODEL state set, its deferred NaN flags read once at the end, as the node does), with no sync in the
loop; ``--rounds`` such forwards per row, rows interleaved. At the small shape the GPU finishes each kernel before the host has launched the next, so wall time per
call is host time; at the SDXL shape it is whichever side is slower. Rows:

- ``comfyui``: ComfyUI's own ``attention_pytorch``, called as an unpatched model calls it (through ``wrap_attn``);
- ``sdpa``: Patch Attention's ``sdpa`` (the call handed to that same function);
- ``<kernel>``: Patch Attention with that backend, its lean path (after the first call of the shape);
- ``<kernel>/no-nan-net``: the same without the NaN net (what the net costs per call);
- ``peer:<kernel>``: the kernel called straight from the hook, the way other packs patch.

Then one forward per row runs under CUDA's sync debug mode ("error"): a sync inside a path is reported in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (pack loader)
from pack import load  # noqa: E402

P = load()
A = P.attention
patch = P.nodes.patch
import importlib  # noqa: E402

peer = importlib.import_module(P.__name__ + ".measure.peer")

SHAPES = {  # name: (batch, tokens, keys, heads, head dim)
    "small (host-bound)": (2, 128, 128, 10, 64),
    "SDXL self 1024²": (2, 4096, 4096, 10, 64),
    "SDXL cross": (2, 4096, 77, 10, 64),
}


def host_function():
    if os.environ.get("COMFYUI_PATH"):
        sys.path.insert(0, os.environ["COMFYUI_PATH"])
        from comfy.cli_args import args

        args.cpu = not torch.cuda.is_available()
        import comfy.ldm.modules.attention as cattn

        return cattn.attention_pytorch
    raise SystemExit("set COMFYUI_PATH: the rows compare with ComfyUI's own attention function")


def _sync_mode(mode):
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_row(row, func, q, k, v, heads):
    """(one call, forward start, forward end) for ``row``."""
    topts = {}
    ov = None
    if row.startswith("peer:"):
        topts["optimized_attention_override"] = peer.peer_override(row[5:])
    elif row != "comfyui":
        name, _, flag = row.partition("/")
        cfg = A.AttentionConfig(backend=name, check_finite=False if flag == "no-nan-net" else "deferred")
        ov = patch.AttentionOverride(cfg, audit=False)
        topts["optimized_attention_override"] = ov

    def call():
        return func(q, k, v, heads, transformer_options=topts)

    def start():
        if ov is not None:
            ln = ov.lane()
            ln.active, ln.layer, ln.config.in_forward = True, 0, True

    def end():
        if ov is not None:
            bad = ov.lane().config.take_nonfinite()
            assert not bad, bad

    return call, start, end, ov


def measure_shape(rows, func, q, k, v, heads, per_forward, rounds):
    """Rows interleaved round by round (drift spreads over all of them); per row the minimum and the median over
    rounds of the wall time per call of one forward's calls (contention on a shared host only adds time: the
    minimum is the estimate, the median shows the spread). Then one forward per row under CUDA's sync debug mode."""
    made = {r: make_row(r, func, q, k, v, heads) for r in rows}
    for call, start, end, _ in made.values():
        start()
        for _ in range(3):
            call()  # the first call of a shape takes the full path and builds the lean entry
        end()
    _sync()
    times = {r: [] for r in rows}
    for _ in range(rounds):
        for r, (call, start, end, _) in made.items():
            start()
            t0 = time.perf_counter()
            for _ in range(per_forward):
                call()
            times[r].append((time.perf_counter() - t0) / per_forward * 1e6)
            end()
            _sync()
    syncs = {}
    for r, (call, start, end, _) in made.items():
        start()
        _sync_mode("error")
        try:
            for _ in range(per_forward):
                call()
            syncs[r] = "none"
        except RuntimeError as e:
            syncs[r] = f"SYNC: {str(e).splitlines()[0][:80]}"
        finally:
            _sync_mode(0)
        end()
    return {r: (min(times[r]), statistics.median(times[r]), syncs[r], dict(made[r][3].config.stats.calls) if made[r][3] else {})
            for r in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="sage_fp8_sm90,sage")
    ap.add_argument("--per-forward", type=int, default=140, help="calls per simulated forward (SDXL: 140)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    host = host_function()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script itself
    kernels = [x for x in a.kernels.split(",") if x and A.REGISTRY.get(x).available]
    rows = ["comfyui", "sdpa"] + [r for kname in kernels for r in (kname, f"{kname}/no-nan-net", f"peer:{kname}")]
    results = []
    for shape_name, (b, n, m, h, d) in SHAPES.items():
        if dev == "cpu":
            b, n, m = 1, min(n, 64), min(m, 64)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, t, h * d, device=dev, dtype=torch.bfloat16, generator=g) for t in (n, m, m))
        for row, (mn, med, sync, calls) in measure_shape(rows, host, q, k, v, h, a.per_forward, a.rounds).items():
            results.append({"shape": shape_name, "row": row, "us_per_call": round(mn, 2), "median": round(med, 2),
                            "syncs": sync, "calls": calls})
            print(f"{shape_name:<20} {row:<28} min {mn:8.2f} median {med:8.2f} µs/call  syncs {sync}  {calls}", flush=True)
    base = {}
    for r in results:
        if r["row"].startswith("peer:"):
            base[(r["shape"], r["row"][5:])] = r["us_per_call"]
        if r["row"] == "comfyui":
            base[(r["shape"], "sdpa")] = r["us_per_call"]
    lines = ["| shape | row | µs per call, min (median) | vs its yardstick | syncs in a forward |", "|---|---|---|---|---|"]
    for r in results:
        y = base.get((r["shape"], r["row"].split("/")[0]))
        diff = f"{r['us_per_call'] - y:+.2f} µs" if y is not None and not r["row"].startswith("peer:") else ""
        lines.append(f"| {r['shape']} | {r['row']} | {r['us_per_call']:.2f} ({r['median']:.2f}) | {diff} | {r['syncs']} |")
    md = "\n".join(lines)
    print(md)
    meta = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__, "rounds": a.rounds,
            "per_forward": a.per_forward}
    if a.md:
        with open(a.md, "w") as f:
            f.write(f"Host time per attention call ({meta['gpu']}, torch {meta['torch']}; {a.rounds} rounds of "
                    f"{a.per_forward} calls (one forward) per row, rows interleaved; NaN flags read once per forward)\n\n{md}\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
