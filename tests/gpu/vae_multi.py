"""The VAE decode over every GPU against one GPU: Wan 2.1's VAE (ComfyUI's class at full size, random bf16 weights),
a 720p/81f latent (16 x 21 x 90 x 160).

    python tests/gpu/vae_multi.py [--rounds 3] [--rows plain,tiled,multi,multi-2x] --json vae.json --md vae.md

Rows: ``plain`` (ComfyUI's ``VAE.decode`` on the first GPU), ``tiled`` (ComfyUI's ``VAE.decode_tiled`` on the first
GPU with the tiles the node picks for this machine), ``multi`` (VAE Decode (several GPUs) over every GPU, its
defaults: one tile of one size per GPU), ``multi-cpu`` (the same, the tiles blended on the CPU as where the first GPU
lacks the room), ``multi-2x`` (twice as many tiles, all of one size: the balance against the area decoded twice),
``tiled-2x`` (ComfyUI's tiled decode with those tiles, one GPU), ``multi-pageable`` (the frames to the CPU by
``Tensor.to``, not through page-locked buffers).  Per row:
seconds (median of ``--rounds`` after one warm-up run; the first ``multi`` run also makes the VAE's copies), the ratio
of ``plain`` and of the ``tiled`` row with the same tiles to it, the largest absolute difference of its frames to
``plain`` and to the one-GPU tiled decode with the same tiles (0: bit for bit), the tiles per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def load():
    sys.path.insert(0, os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", ".."))
    sys.path.insert(0, ROOT)
    sys.path.insert(1, os.path.dirname(HERE))
    from absent import stand_in_if_missing

    stand_in_if_missing("av")  # ComfyUI's video types import PyAV, which the GPU machine lacks
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()  # a dry run of the script on a machine without a GPU
    import comfy.model_management  # noqa: F401 - ComfyUI's start-up order: model management before nodes

    be = importlib.import_module("bench_e2e")
    pack = be._load_pack()
    return importlib.import_module(pack.__name__ + ".nodes.vae"), importlib.import_module(pack.__name__ + ".parallel.vae")


def wan21_vae(seed=0):
    """Wan 2.1's VAE as ComfyUI loads it from its file (``comfy.sd.VAE``'s detection), random weights."""
    import comfy.ldm.wan.vae as wan
    import comfy.sd

    m = wan.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True], dropout=0.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():  # ComfyUI's layers skip initialisation: fill every parameter
            scale = p[0].numel() ** -0.5 if p.ndim > 1 else 0.05
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("gamma") else 0.0))
    return comfy.sd.VAE(sd={k: v.contiguous() for k, v in m.state_dict().items()})


def sync():
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def timed(fn, rounds: int):
    """(median seconds over ``rounds`` after one warm-up run, the times, the last output)."""
    out = fn()
    times = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, out


def maxabs(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="plain,tiled,multi")
    ap.add_argument("--shape", default="16,21,90,160", help="the latent: channels, frames, height, width")
    ap.add_argument("--json"), ap.add_argument("--md")
    a = ap.parse_args(argv)
    nv, pv = load()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("patch_attention.vae").setLevel(logging.DEBUG)  # per call: each device's time, the copy out
    import comfy.model_management as mm

    devices = mm.get_all_torch_devices()
    vae = wan21_vae()
    latent = torch.randn(1, *map(int, a.shape.split(",")), generator=torch.Generator().manual_seed(1))
    rows = a.rows.split(",")
    tilings = {"": None, "-2x": None}
    with torch.inference_mode():
        _, report = nv.decode(vae, latent, tile_size=0)  # the node's own choice (and the copies made)
        tilings[""] = report.tiling
        h, w = pv.even_tiles(latent.shape[2:], 2 * len(devices), report.tiling.overlap)
        tilings["-2x"] = nv.Tiling(h, w, report.tiling.overlap)
        meta = {"date": datetime.date.today().isoformat(),
                "gpus": [torch.cuda.get_device_name(d) if d.type == "cuda" else str(d) for d in devices],
                "torch": torch.__version__, "comfyui": comfyui_version(), "latent": list(latent.shape),
                "vae_dtype": str(vae.vae_dtype), "rounds": a.rounds}

        table = []

        def done(results, frames):  # written after every row: a run stopped at its limit keeps the rows it finished
            compare(results, frames)
            table[:] = [report_out(meta, results, a.json, a.md)]

        run_rows(nv, vae, latent, rows, tilings, devices, a.rounds, done)
    print(table[0] if table else "no rows")


def run_rows(nv, vae, latent, rows, tilings, devices, rounds, done):
    results, frames = {}, {}
    for row in rows:
        suffix = "-2x" if row.endswith("-2x") else ""
        tiling = tilings[suffix]
        if row == "plain":
            fn = lambda: vae.decode(latent)  # noqa: E731
        elif row.startswith("tiled"):
            fn = lambda t=tiling: vae.decode_tiled(latent, **t.args())  # noqa: E731
        elif row.startswith("multi-pageable"):  # the frames to the CPU by Tensor.to (the driver's own staging)
            fn = lambda t=tiling: with_setting(nv, "STAGED_COPY", False, vae, latent, t, devices)  # noqa: E731
        elif row.startswith("multi-cpu"):  # the tiles blended on the CPU (ComfyUI's output device), as without room
            fn = lambda t=tiling: blended_on_cpu(nv, vae, latent, t, devices)  # noqa: E731
        else:
            fn = lambda t=tiling: nv._decode_over(vae, latent, t, devices)  # noqa: E731
        med, times, out = timed(fn, rounds)
        r = {"row": row, "seconds": med, "all": times, "tiles": [tiling.tile_x, tiling.tile_y, tiling.overlap]
             if tiling and row != "plain" else None}
        if isinstance(out, tuple):
            out, rep = out
            r["per_gpu"] = dict(zip(map(str, rep.devices), rep.counts))
        frames[row] = out
        results[row] = r
        print(f"vae {row}: {med:.3f} s (rounds {', '.join(f'{t:.3f}' for t in times)})", flush=True)
        done(results, frames)


def blended_on_cpu(nv, vae, latent, tiling, devices):
    return with_setting(nv, "BLEND_ROOM", float("inf"), vae, latent, tiling, devices)


def with_setting(nv, name, value, vae, latent, tiling, devices):
    """The node's decode with one of its module's settings changed for the call."""
    old = getattr(nv, name)
    setattr(nv, name, value)
    try:
        return nv._decode_over(vae, latent, tiling, devices)
    finally:
        setattr(nv, name, old)


def compare(results, frames):
    plain = frames.get("plain")
    for row, r in results.items():
        same = "tiled" + ("-2x" if row.endswith("-2x") else "")
        if plain is not None:
            r["vs_plain"] = maxabs(frames[row], plain)
            r["ratio_vs_plain"] = results["plain"]["seconds"] / r["seconds"]
        if row.startswith("multi") and same in frames:
            r["vs_tiled"] = maxabs(frames[row], frames[same])
            r["ratio_vs_tiled"] = results[same]["seconds"] / r["seconds"]


def comfyui_version() -> str:
    try:
        from comfyui_version import __version__

        return __version__
    except ImportError:
        return "unknown"


def report_out(meta, results, json_path, md_path):
    gpus = f"{len(meta['gpus'])}x {meta['gpus'][0]}" if meta["gpus"] else "no GPU"
    lines = [f"# VAE decode over the GPUs: Wan 2.1 VAE, latent {'x'.join(map(str, meta['latent'][1:]))}, {gpus}",
             "", f"ComfyUI {meta['comfyui']}, torch {meta['torch']}, VAE in {meta['vae_dtype']}, random weights, "
             f"{meta['date']}; seconds: median of {meta['rounds']} after a warm-up.", "",
             "| row | tiles (h x w latent, overlap) | s | plain / row | tiled (same tiles) / row | max abs vs plain | "
             "max abs vs tiled | tiles per GPU |", "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        t = r.get("tiles")
        lines.append(f"| {r['row']} | {f'{t[0]}x{t[1]}, {t[2]}' if t else 'whole'} | {r['seconds']:.3f} | "
                     f"{_x(r.get('ratio_vs_plain'))} | {_x(r.get('ratio_vs_tiled'))} | {_f(r.get('vs_plain'))} | "
                     f"{_f(r.get('vs_tiled'))} | {r.get('per_gpu', '')} |")
    text = "\n".join(lines) + "\n"
    if md_path:
        with open(md_path, "w") as f:
            f.write(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": list(results.values())}, f, indent=1)
    return text


def _x(v):
    return "" if v is None else f"x{v:.2f}"


def _f(v):
    return "" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    main()
