"""Context Parallel composed with what users put around it, on every GPU of the machine (ComfyUI 0.33):

    python tests/gpu/cp_compose.py --preset wan-1.3b-33f --json cp-compose.json

Cases, each against the same model on one GPU (the final latent's relative L1; 0: bit-identical):

- ``plain``: the model split, nothing else.
- ``lora-before`` / ``lora-after``: a LoRA-like weight patch (``ModelPatcher.add_patches`` with weight differences, as
  the LoRA loaders leave it) on the model before the Context Parallel node, or on its output (a LoRA loader after it):
  every GPU's copy must sample with the patched weights.
- ``patch-after``: Patch Attention (``sdpa_cudnn``: one exact kernel on both sides) applied after the node.
- ``compile``: ComfyUI's TorchCompileModel wrapper (inductor) on the split model: the node keeps those forwards on one
  GPU (the compiled module is the first GPU's) and says why; the latent is the compiled one-GPU latent's.

The model is the preset's class with random bf16 weights (tests/gpu/multigpu.py's copies on the other GPUs); every
forward is split however short (``min_tokens=0``) except where the case says otherwise. Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def lora_patches(model, scale: float = 0.02, seed: int = 1) -> dict:
    """Weight differences for every self-attention q/k/v/o weight of the diffusion model (a rank-8 product each)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, w in model.model.state_dict().items():
        if key.startswith("diffusion_model.") and ".self_attn." in key and key.endswith(".weight") and w.ndim == 2:
            a = torch.randn(w.shape[0], 8, generator=g) * scale
            b = torch.randn(8, w.shape[1], generator=g) / w.shape[1] ** 0.5
            out[key] = ((a @ b).to(w.dtype),)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="wan-1.3b-33f")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cases", default="lora-before,lora-after,patch-after,compile")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import multigpu as MG

    pack, e2e, cpn = MG.load()
    job = e2e.build_preset(a.preset)
    job.cfg, job.steps = 1.0, a.steps
    extra = MG.copies(e2e, job, a.preset)
    patch = pack.nodes.patch.patch_model
    base = job.model
    said = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger().addHandler(Catch(level=logging.WARNING))

    def sample(m):
        return e2e._sample(m, job, job.steps).float().cpu()

    def split(m):
        return cpn.context_parallel(MG.with_copies(m, extra), gpus=0, cfg_split=False, min_tokens=0)

    def lora(m):
        m = m.clone()
        m.add_patches(lora_patches(m), 1.0)
        return m

    def compiled(m):
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        m = m.clone()
        set_torch_compile_wrapper(m, backend="inductor")
        return m

    cases = {
        "plain": (lambda: base, lambda: split(base)),
        "lora-before": (lambda: lora(base), lambda: split(lora(base))),
        "lora-after": (lambda: lora(base), lambda: lora(split(base))),
        "patch-after": (lambda: patch(base, "sdpa_cudnn"), lambda: patch(split(base), "sdpa_cudnn")),
        "compile": (lambda: compiled(base), lambda: compiled(split(base))),
    }
    # the process's first sampling run differs from every later one (first-use settings: measured, rel-L1 7e-3 with
    # nothing split), so every case runs after one
    e2e._sample(base, job, 1)
    results, failed = [], 0
    for name in [c for c in a.cases.split(",") if c]:
        r = {"case": name.split("#")[0]}
        name = r["case"]
        t0 = time.perf_counter()
        try:
            one, many = cases[name]
            ref = sample(one())
            del said[:]
            out = sample(many())
            r["rel_l1_vs_1gpu"] = float((out.double() - ref.double()).abs().sum() / ref.double().abs().sum())
            r["finite"] = bool(torch.isfinite(out).all())
            r["said"] = [s for s in said if "Context Parallel" in s][:3]
            one_gpu = any("runs on one GPU" in s or "ran on one GPU" in s for s in r["said"])
            r["split"] = not one_gpu
            want_split = name != "compile"
            r["ok"] = r["finite"] and r["rel_l1_vs_1gpu"] == 0.0 and r["split"] == want_split
        except Exception as e:  # a case's failure is a result
            r.update(ok=False, error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-2000:])
        r["seconds"] = round(time.perf_counter() - t0, 1)
        failed += not r["ok"]
        results.append(r)
        print(f"cp-compose {name}: {'ok' if r['ok'] else 'FAIL'} " + json.dumps({k: v for k, v in r.items()
                                                                                   if k not in ('case', 'trace')}), flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                       "results": results}, f, indent=1)
    print(f"cp-compose: {len(results) - failed} of {len(results)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
