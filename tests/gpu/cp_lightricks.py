"""LTX-Video and LTX-2 split by the Context Parallel node on CUDA, against the same model on one GPU.

    python tests/gpu/cp_lightricks.py [--dtypes bf16,fp32] [--backends unpatched,sdpa_math] [--json cp-ltx.json]

The zoo's LTXV (image to video through a guide frame at strength 0.8: its attention mask, per-token timesteps) and
LTXAV (audio + video) configurations at their GPU sizes (tests/zoo/video.py), with 2 blocks.  Rows per configuration,
dtype and backend (``unpatched`` or a Patch Attention backend, applied before the split as a workflow would):

- ``sim<N>``: N ranks simulated on the first GPU (N = 2, 3, 4): ComfyUI's fused CUDA ops (comfy-kitchen's RoPE and
  RMS AdaLN) and the attention kernel on every rank's share;
- ``gpus<N>``: the node over N GPUs (each with its copy of the model, the same weights), where the machine has them.

Per row: the final latent's relative L1 against the same backend on one GPU unsplit, the exchanged attention calls,
seconds.  fp32 rows should agree within 1e-5 (the CPU tests' bound).  Needs ComfyUI 0.33 (COMFYUI_PATH, from the
runner's env stage) and comfy-kitchen on PYTHONPATH.  Exit status 1 when a row failed or an fp32 row missed 1e-5.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def gpu_zoo():
    """tests/gpu/zoo.py (ComfyUI on the GPU, the pack as ComfyUI loads it) under a name of its own."""
    spec = importlib.util.spec_from_file_location("gpu_zoo", os.path.join(HERE, "zoo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel_l1(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum())


def copies(z, cls, case, dtype, base, n):
    """``base`` with its copies on GPUs 1..n-1 (the zoo's seeded weights: the same on each) as ComfyUI's MultiGPU
    clones."""
    import comfy.multigpu

    extra = []
    for i in range(1, n):
        p = z.build(cls, case, dtype=dtype, device=f"cuda:{i}")
        p.clone_base_uuid = base.clone_base_uuid
        p.is_multigpu_base_clone = True
        extra.append(p)
    m = base.clone()
    m.set_additional_models("multigpu", extra)
    m.match_multigpu_clones()
    comfy.multigpu.GPUOptionsGroup().register(m)
    return m


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--backends", default="unpatched,sdpa_math")
    ap.add_argument("--configs", default="LTXV,LTXAV")
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu", action="store_true", help="a smoke run of the simulated rows on the CPU")
    a = ap.parse_args()

    g = gpu_zoo()
    nodes = g.import_comfy(os.environ.get("COMFYUI_PATH", ""), cpu=a.cpu)
    pack = g.load_pack(nodes)
    import comfy.supported_models as sm
    import zoo as z

    z.load_families()
    cpn = importlib.import_module(pack.__name__ + ".nodes.context_parallel")
    rc = importlib.import_module(pack.__name__ + ".parallel.context").RankContext
    counted = []
    real_attention = rc.attention

    def counting(self, *args, **kwargs):
        counted.append(self.rank)
        return real_attention(self, *args, **kwargs)

    rc.attention = counting
    gpus = 0 if a.cpu else torch.cuda.device_count()
    device = "cpu" if a.cpu else "cuda:0"
    where = "CPU" if a.cpu else f"{torch.cuda.get_device_name(0)} x{gpus}"
    print(f"cp-ltx: {where}, ComfyUI {g.release(os.environ.get('COMFYUI_PATH', ''))}", flush=True)
    rows, bad = [], 0
    for name in a.configs.split(","):
        cls = getattr(sm, name)
        case = z.BUILDERS[name](cls, True)
        case = z.with_(case, unet_config={**case.unet_config, "num_layers": 2})
        for dn in a.dtypes.split(","):
            dtype = DTYPES[dn]
            base = z.build(cls, case, dtype=dtype, device=device)
            for backend in a.backends.split(","):
                model = base if backend == "unpatched" else pack.nodes.patch.patch_model(base, backend)
                ref = z.sample(model, case)
                ranks = [int(x) for x in a.ranks.split(",")]
                modes = [("sim", n) for n in ranks] + [("gpus", n) for n in ranks if n <= gpus]
                for kind, n in modes:
                    r = {"config": name, "dtype": dn, "backend": backend, "mode": f"{kind}{n}"}
                    counted.clear()
                    try:
                        if kind == "sim":
                            m = cpn.context_parallel(model, simulate=n)
                        else:
                            m = cpn.context_parallel(copies(z, cls, case, dtype, model, n), gpus=n, min_tokens=0)
                        t0 = time.perf_counter()
                        out = z.sample(m, case)
                        r.update(seconds=round(time.perf_counter() - t0, 2), rel_l1=rel_l1(out, ref),
                                 finite=bool(torch.isfinite(out).all()), exchanged=len(counted))
                        if dn == "fp32" and not r["rel_l1"] < 1e-5 or not r["finite"] or not counted:
                            bad += 1
                            r["bad"] = True
                    except Exception as e:  # a row's failure is a row
                        bad += 1
                        r.update(error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-2000:])
                    rows.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
                    if not a.cpu:
                        torch.cuda.empty_cache()
    rc.attention = real_attention
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"cp-ltx: {len(rows)} rows, {bad} bad", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
