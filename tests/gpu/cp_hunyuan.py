"""Context parallelism for HunyuanVideo 1.0/1.5 on CUDA: every configuration of the family the zoo builds and the
image-to-video guidance variants (tests/test_cp_hunyuan.py), at the zoo's GPU sizes (heads of 128, 128 text tokens,
the padded prompt's mask) in bf16, sampled on one GPU and split through the Context Parallel node:

- ``sim-N``: N ranks as threads on the first GPU (``simulate``: the exchange's copies and streams on CUDA);
- ``gpus-N``: the node on N real GPUs (ComfyUI 0.33's MultiGPU copies), when the machine has them;
- with ``--backends a,b``: the same split with Patch Attention's backend as every GPU's local kernel, against that
  backend on one GPU.

    python tests/gpu/cp_hunyuan.py --json cp-hunyuan.json [--ranks 2,4] [--backends auto] [--device cpu]

Per run: the final latent's rel-L1 against the one-GPU latent, whether every forward split (attention calls
exchanged on every GPU) and the padded prompt's mask rode along, the seconds.  Bound: the model's bf16 rounding floor
(its one-GPU bf16 latent against the same weights in fp32, as the zoo computes it) plus 1e-3: a split computes each
token's rows with matrices of fewer rows, which may round differently, never more than bf16 rounding alone moves the
latent.  One line per run on stdout ("cp <config> <run>: ok|FAIL|CRASH ..."); exit status 1 on any failure.
Needs COMFYUI_PATH (0.33, the runner's env stage sets it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)


def _gpu_zoo():
    """tests/gpu/zoo.py (its ComfyUI import, pack loading, bf16 rounding floor), under a name that is not the zoo's."""
    spec = importlib.util.spec_from_file_location("gpu_zoo", os.path.join(HERE, "zoo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configurations(z):
    import comfy.supported_models as sm
    import test_cp_hunyuan as t

    out = {name: (getattr(sm, name), z.BUILDERS[name](getattr(sm, name), True)) for name in t.CASES}
    for variant, fn in t.VARIANTS.items():
        out[f"HunyuanVideo {variant}"] = fn(z, gpu=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--ranks", default="2,4", help="simulated rank counts on the first GPU")
    ap.add_argument("--backends", default="", help="Patch Attention backends as the local kernel (e.g. auto)")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run in fp32")
    a = ap.parse_args(argv)
    import torch

    gz = _gpu_zoo()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cp_hunyuan: no CUDA device")
    nodes = gz.import_comfy(os.environ.get("COMFYUI_PATH", ""), cpu=a.device == "cpu")
    mod = gz.load_pack(nodes)
    import zoo as z

    z.load_families()
    cp = importlib.import_module(mod.__name__ + ".nodes.context_parallel")
    patch = mod.nodes.patch.patch_model
    Ctx = mod.parallel.context.RankContext
    real_attention = Ctx.attention
    seen = []

    def counting(self, q, k, v, local, mask=None):
        seen.append((self.rank, mask is not None))
        return real_attention(self, q, k, v, local, mask)

    Ctx.attention = counting
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    ranks = [int(r) for r in a.ranks.split(",") if r]
    only = {s for s in a.only.split(",") if s}
    device = "cuda:0" if a.device == "cuda" else a.device  # the first GPU by index: MultiGPU's other devices differ from it
    results, failed = {}, False
    for name, (cls, case) in configurations(z).items():
        if only and name not in only:
            continue
        dtype = gz.pick_dtype(cls, a.device)
        res = results[name] = {"dtype": str(dtype).replace("torch.", ""), "runs": {}}
        try:
            base = z.build(cls, case, dtype=dtype, device=device)
            t0 = time.perf_counter()
            ref = z.sample(base, case)
            res["one_gpu_seconds"] = round(time.perf_counter() - t0, 2)
            floor = res["rounding_floor"] = gz.rounding_floor(z, cls, case, base, ref, dtype, device)
        except Exception as e:
            failed = True
            res["crash"] = f"{type(e).__name__}: {e}"
            print(f"cp {name}: CRASH before the runs: {res['crash']}\n{traceback.format_exc()[-1500:]}", flush=True)
            continue
        masked = any("attention_mask" in ex for _, ex in case.positive)
        runs = [(f"sim-{n}", None, n, 0) for n in ranks]
        runs += [(f"gpus-{n}", None, 0, n) for n in sorted({2, gpus}) if 2 <= n <= gpus]
        for b in [b for b in a.backends.split(",") if b]:
            runs += [(f"{b} sim-{ranks[-1]}", b, ranks[-1], 0)]
            runs += [(f"{b} gpus-{gpus}", b, 0, gpus)] if gpus >= 2 else []
        backend_refs = {}
        for label, backend, sim, real in runs:
            run = res["runs"][label] = {}
            try:
                m = base
                if backend is not None:
                    if backend not in backend_refs:
                        backend_refs[backend] = z.sample(patch(base, backend), case)
                    m = patch(base, backend)
                m = cp.context_parallel(m, gpus=real, simulate=sim, min_tokens=0)
                seen.clear()
                t1 = time.perf_counter()
                out = z.sample(m, case)
                run["seconds"] = round(time.perf_counter() - t1, 2)
                target = backend_refs.get(backend, ref)
                n = sim or real
                run["rel_l1"] = gz.rel_l1(out, target)
                run["bound"] = floor + 1e-3
                run["ranks_exchanging"] = len({r for r, _ in seen})
                run["masked_calls"] = sum(1 for _, mk in seen if mk)
                run["ok"] = bool(torch.isfinite(out).all()) and run["rel_l1"] <= run["bound"] and \
                    run["ranks_exchanging"] == n and (run["masked_calls"] > 0) == masked
                failed |= not run["ok"]
                print(f"cp {name} {label}: {'ok' if run['ok'] else 'FAIL'} rel-L1 {run['rel_l1']:.5f} (bound "
                      f"{run['bound']:.4f}), {run['ranks_exchanging']}/{n} GPUs exchanged, {run['masked_calls']} masked "
                      f"calls, {run['seconds']} s (one GPU {res['one_gpu_seconds']} s)", flush=True)
            except Exception as e:
                failed = True
                run.update(ok=False, crash=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
                print(f"cp {name} {label}: CRASH {run['crash']}", flush=True)
        del base
        gz.free_models(a.device)
    Ctx.attention = real_attention
    meta = {"gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "gpus": gpus,
            "comfyui": gz.release(os.environ.get("COMFYUI_PATH", "")), "torch": torch.__version__}
    with open(a.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
