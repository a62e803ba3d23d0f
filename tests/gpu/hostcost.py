"""Host time per attention call through ComfyUI's hook: Patch Attention's paths against a bare peer call.

    python tests/gpu/hostcost.py --md hostcost.md --json hostcost.json

On host-bound models (SD1.5/SDXL on a big GPU) every microsecond of Python per attention call is step time, so this
measures it directly: each row makes the same call ``--calls`` times inside a simulated model forward (the override's
APPLY_MODEL state set, its deferred NaN flags read once per ``--per-forward`` calls, as the node does), with no sync
in the loop. At the small shape the GPU finishes each kernel before the host has launched the next, so wall time per
call is host time; at the SDXL shape it is whichever side is slower. Rows:

- ``comfyui``: ComfyUI's own ``attention_pytorch``, called as an unpatched model calls it (through ``wrap_attn``);
- ``sdpa``: Patch Attention's ``sdpa`` (the call handed to that same function);
- ``<kernel>``: Patch Attention with that backend, its lean path (after the first call of the shape);
- ``<kernel>/no-nan-net``: the same without the NaN net (what the net costs per call);
- ``peer:<kernel>``: the kernel called straight from the hook, the way other packs patch.

CUDA's sync debug mode is on ("error") around every loop but the per-forward read: a sync in any path fails the run.
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

e2e = importlib.import_module(P.__name__ + ".nodes.e2e")

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


def run_row(row, func, q, k, v, heads, calls, per_forward, rounds):
    topts = {}
    if row == "comfyui":
        call = lambda: func(q, k, v, heads, transformer_options=topts)  # noqa: E731
        ov = None
    else:
        if row.startswith("peer:"):
            topts["optimized_attention_override"] = e2e.peer_override(row[5:])
            ov = None
        else:
            name, _, flag = row.partition("/")
            cfg = A.AttentionConfig(backend=name, check_finite=False if flag == "no-nan-net" else "deferred")
            ov = patch.AttentionOverride(cfg, audit=False)
            topts["optimized_attention_override"] = ov
        call = lambda: func(q, k, v, heads, transformer_options=topts)  # noqa: E731

    def forward_start():
        if ov is not None:
            ov.active, ov.config.in_forward = True, True
            ov.start_forward()

    def forward_end():
        if ov is not None:
            bad = ov.config.take_nonfinite()
            assert not bad, bad

    forward_start()
    for _ in range(3):
        call()  # first call of the shape: full path, builds the lean entry
    forward_end()
    _sync()
    per_call = []
    for _ in range(rounds):
        t = 0.0
        n = 0
        while n < calls:
            forward_start()
            _sync_mode("error")
            t0 = time.perf_counter()
            for _ in range(per_forward):
                call()
            t += time.perf_counter() - t0
            _sync_mode(0)
            forward_end()
            n += per_forward
        _sync()
        per_call.append(t / n * 1e6)
    stats = ov.config.stats.calls if ov is not None else {}
    return statistics.median(per_call), dict(stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="sage_fp8_sm90,sage")
    ap.add_argument("--calls", type=int, default=2800)
    ap.add_argument("--per-forward", type=int, default=140, help="calls per simulated forward (SDXL: 140)")
    ap.add_argument("--rounds", type=int, default=5)
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
        for row in rows:
            us, calls = run_row(row, host, q, k, v, h, a.calls, a.per_forward, a.rounds)
            results.append({"shape": shape_name, "row": row, "us_per_call": round(us, 2), "calls": calls})
            print(f"{shape_name:<20} {row:<28} {us:8.2f} µs/call  {calls}", flush=True)
    base = {}
    for r in results:
        if r["row"].startswith("peer:"):
            base[(r["shape"], r["row"][5:])] = r["us_per_call"]
        if r["row"] == "comfyui":
            base[(r["shape"], "sdpa")] = r["us_per_call"]
    lines = ["| shape | row | µs per call (wall, no sync) | vs its yardstick |", "|---|---|---|---|"]
    for r in results:
        y = base.get((r["shape"], r["row"].split("/")[0]))
        diff = f"{r['us_per_call'] - y:+.2f} µs" if y is not None and not r["row"].startswith("peer:") else ""
        lines.append(f"| {r['shape']} | {r['row']} | {r['us_per_call']:.2f} | {diff} |")
    md = "\n".join(lines)
    print(md)
    meta = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__, "calls": a.calls, "rounds": a.rounds,
            "per_forward": a.per_forward}
    if a.md:
        with open(a.md, "w") as f:
            f.write(f"Host time per attention call ({meta['gpu']}, torch {meta['torch']}; median of {a.rounds} rounds of "
                    f"{a.calls} calls, NaN flags read every {a.per_forward} calls)\n\n{md}\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
