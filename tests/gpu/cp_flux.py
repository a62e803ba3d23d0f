"""Context parallelism for Flux.1/Flux.2 on CUDA GPUs (ComfyUI 0.33): each forward split over several GPUs of the machine
through the Context Parallel node's function, against the same model on one GPU.

    python tests/gpu/cp_flux.py --json cp-flux.json [--md cp-flux.md] [--gpus 2,4] [--only Flux,Flux2] [--no-timing]

- **Parity**: the zoo's Flux configurations (Kontext, schnell + Redux's attention-bias mask, Fill, LongCat-Image,
  Flux.2 with two references) at their GPU sizes (head dim 128) in bf16: the final latent's rel-L1 against one GPU, with
  the bound this model's bf16 rounding gives (its bf16 latent against its fp32 latent on one GPU: a split reorders no
  sum inside an attention head, but its matrix products run on other row counts), and that every GPU exchanged every
  block's attention call.
- **Timing**: a Flux-dev-shaped model (width 3072, 24 heads of 128, ``--depth`` double and single blocks of its 19 and
  38, 1024x1024: 4096 image + 512 text tokens, CFG 1, random weights) sampled on one GPU and split over each GPU count:
  seconds per step after a warm-up run, and the latents' rel-L1.

``--device cpu``: a dry run of this script on the CPU in fp32, ranks simulated as threads (the CPU tests' way). Exit
status 1 when a configuration fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the zoo package, pack.py


def _gpu_zoo():
    """tests/gpu/zoo.py (its ComfyUI start-up and measures), under a name of its own: ``zoo`` is the zoo's package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_zoo", os.path.join(HERE, "zoo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_Z = _gpu_zoo()
free_models, import_comfy, load_pack, rel_l1, release, rounding_floor = (
    _Z.free_models, _Z.import_comfy, _Z.load_pack, _Z.rel_l1, _Z.release, _Z.rounding_floor)

CONFIGS = ["Flux", "FluxSchnell", "FluxInpaint", "LongCatImage", "Flux2"]


def split_model(mod, model, n: int, device: str):
    cp = __import__(mod.__name__ + ".nodes.context_parallel", fromlist=["context_parallel"])
    if device == "cpu":
        return cp.context_parallel(model, simulate=n)
    return cp.context_parallel(model, gpus=n, min_tokens=0)  # the zoo's sizes: split however short


def counting(mod):
    """(calls, undo): every exchanged attention call's rank, recorded while sampling."""
    ctx_cls = mod.parallel.context.RankContext
    real, calls = ctx_cls.attention, []

    def attention(self, *a, **k):
        calls.append(self.rank)
        return real(self, *a, **k)

    ctx_cls.attention = attention

    def undo():
        ctx_cls.attention = real

    return calls, undo


def buildable(z, cls, case, dtype, device):
    """``z.build`` with the loader factory ComfyUI's MultiGPU copies are made from (the same seeded weights)."""
    base = z.build(cls, case, dtype=dtype, device=device)
    base.cached_patcher_init = (z.build, (cls, case, dtype, "cpu"))
    return base


def sample_timed(z, model, case, device):
    import torch

    def sync():
        if device != "cpu":
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)

    sync()
    t0 = time.perf_counter()
    out = z.sample(model, case)
    sync()
    return out, time.perf_counter() - t0


def parity(z, mod, name, gpus, dtype, device):
    import comfy.supported_models as sm

    cls = getattr(sm, name)
    case = z.BUILDERS[name](cls, device != "cpu")
    base = buildable(z, cls, case, dtype, device)
    blocks = len(base.model.diffusion_model.double_blocks) + len(base.model.diffusion_model.single_blocks)
    ref = z.sample(base, case)
    floor = rounding_floor(z, cls, case, base, ref, dtype, device)
    bound = max(floor, 1e-5)
    row = {"configuration": name, "bf16_floor": floor, "bound": bound, "runs": {}}
    for n in gpus:
        calls, undo = counting(mod)
        try:
            out = z.sample(split_model(mod, base, n, device), case)
        finally:
            undo()
        rel = rel_l1(out, ref)
        per_rank = [calls.count(r) for r in range(n)]
        split_all = per_rank == [blocks * case.steps] * n
        ok = bool(out.isfinite().all()) and rel <= bound and split_all
        row["runs"][n] = {"rel_l1": rel, "exchanged_per_gpu": per_rank, "expected": blocks * case.steps, "ok": ok}
        print(f"cp-flux {name} x{n}: {'ok' if ok else 'FAIL'} rel-L1 {rel:.2e} (bound {bound:.2e}), exchanged per GPU "
              f"{per_rank} of {blocks * case.steps}", flush=True)
        free_models(device)
    del base
    free_models(device)
    return row


def timing(z, mod, gpus, depth, steps, dtype, device):
    import comfy.supported_models as sm
    import torch
    from zoo.image_dit import _flux, _unit_norms

    gpu = device != "cpu"
    cfg = _flux(True, hidden_size=3072 if gpu else 64, num_heads=24 if gpu else 2, mlp_ratio=4.0, depth=depth,
                depth_single_blocks=2 * depth, axes_dim=[16, 56, 56] if gpu else [8, 12, 12],
                context_in_dim=4096 if gpu else 32, vec_in_dim=768 if gpu else 32)
    g = torch.Generator().manual_seed(0)
    txt = torch.randn(1, 512 if gpu else 16, cfg["context_in_dim"], generator=g)
    pos = [[txt, {"pooled_output": torch.randn(1, cfg["vec_in_dim"], generator=g), "guidance": 3.5}]]
    hw = 128 if gpu else 16
    case = z.Case(unet_config=cfg, latent=(1, 16, hw, hw), positive=pos, cfg=1.0, steps=steps, init_std=0.02,
                  init=_unit_norms)
    cls = sm.Flux
    base = buildable(z, cls, case, dtype, device)
    z.sample(base, z.with_(case, steps=1))  # warm-up: loading, kernels' first calls
    ref, t1 = sample_timed(z, base, case, device)
    out = {"model": f"Flux-dev shapes, {depth}+{2 * depth} blocks, {hw * 8}x{hw * 8}, {steps} steps, CFG 1",
           "one_gpu_s_per_step": t1 / steps, "split": {}}
    print(f"cp-flux timing: one GPU {t1 / steps:.3f} s/step", flush=True)
    for n in gpus:
        m = split_model(mod, base, n, device)
        z.sample(m, z.with_(case, steps=1))  # warm-up: the other GPUs' copies load
        lat, tn = sample_timed(z, m, case, device)
        rel = rel_l1(lat, ref)
        out["split"][n] = {"s_per_step": tn / steps, "speedup": t1 / tn, "rel_l1": rel}
        print(f"cp-flux timing: {n} GPUs {tn / steps:.3f} s/step (x{t1 / tn:.2f}), rel-L1 {rel:.2e}", flush=True)
        del m
        free_models(device)
    del base
    free_models(device)
    return out


def render(meta, rows, timed) -> str:
    lines = [f"# Context parallelism, Flux.1/Flux.2: {meta['gpu']} x{meta['gpu_count']}, ComfyUI {meta['comfyui']}, "
             f"torch {meta['torch']}, {meta['date']}", "",
             "| configuration | GPUs | rel-L1 vs one GPU | bound (bf16 vs fp32) | exchanged per GPU | ok |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "crash" in r:
            lines.append(f"| {r['configuration']} | | crash: {r['crash']} | | | no |")
            continue
        for n, run in r["runs"].items():
            lines.append(f"| {r['configuration']} | {n} | {run['rel_l1']:.2e} | {r['bound']:.2e} | "
                         f"{run['exchanged_per_gpu']} of {run['expected']} | {'yes' if run['ok'] else 'no'} |")
    if timed:
        lines += ["", f"Timing: {timed.get('model', '')}", "", "| GPUs | s/step | speed-up | rel-L1 vs one GPU |",
                  "|---|---|---|---|"]
        if "one_gpu_s_per_step" in timed:
            lines.append(f"| 1 | {timed['one_gpu_s_per_step']:.3f} | 1.00 | |")
        for n, s in timed.get("split", {}).items():
            lines.append(f"| {n} | {s['s_per_step']:.3f} | {s['speedup']:.2f} | {s['rel_l1']:.2e} |")
        if "crash" in timed:
            lines.append(f"| crash: {timed['crash']} | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--md")
    ap.add_argument("--gpus", default="", help="comma-separated GPU counts (default: 2 and every GPU here)")
    ap.add_argument("--only", default="", help="comma-separated configurations (default: " + ",".join(CONFIGS) + ")")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--depth", type=int, default=4, help="the timing model's double blocks (single blocks: twice that)")
    ap.add_argument("--steps", type=int, default=4, help="the timing run's steps")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run in fp32, ranks simulated as threads")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    gpu = a.device != "cpu"
    if gpu and torch.cuda.device_count() < 2:
        sys.exit("cp-flux: fewer than 2 CUDA devices")
    path = os.environ.get("COMFYUI_PATH", "")
    nodes = import_comfy(path, cpu=not gpu)
    mod = load_pack(nodes)
    import zoo as z

    z.load_families()
    count = torch.cuda.device_count() if gpu else 4
    gpus = [int(x) for x in a.gpus.split(",") if x] or sorted({2, count})
    device = "cuda:0" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    names = [n for n in CONFIGS if not a.only or n in a.only.split(",")]
    meta = {"gpu": torch.cuda.get_device_name(0) if gpu else "cpu (dry run)", "gpu_count": count,
            "torch": torch.__version__, "comfyui": release(path), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "gpus": gpus}
    rows, timed = [], {}

    def write():
        meta["seconds"] = round(time.perf_counter() - t_start, 1)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "parity": rows, "timing": timed}, f, indent=1)
        if a.md:
            with open(a.md, "w") as f:
                f.write(render(meta, rows, timed))

    for name in names:
        try:
            rows.append(parity(z, mod, name, gpus, dtype, device))
        except Exception as e:
            rows.append({"configuration": name, "crash": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
            print(f"cp-flux {name}: CRASH {rows[-1]['crash']}\n{rows[-1]['traceback']}", flush=True)
            free_models(device)
        write()
    if not a.no_timing:
        try:
            timed.update(timing(z, mod, gpus, a.depth, a.steps, dtype, device))
        except Exception as e:
            timed["crash"] = f"{type(e).__name__}: {e}"
            print(f"cp-flux timing: CRASH {timed['crash']}\n{traceback.format_exc()[-3000:]}", flush=True)
        write()
    fails = sum(1 for r in rows if "crash" in r or not all(run["ok"] for run in r["runs"].values()))
    fails += "crash" in timed
    print(f"cp-flux: {len(rows)} configurations, {fails} failing; {meta['seconds']} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
