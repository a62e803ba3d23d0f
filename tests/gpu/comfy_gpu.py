"""Patch Attention in real ComfyUI sampling on a GPU: bf16 models from ComfyUI's classes, every backend and auto.

    COMFYUI_PATH=/path/to/ComfyUI python tests/gpu/comfy_gpu.py --md out.md

For each backend: a patched clone samples 4 steps; its final latent is compared with the
unpatched model's (ComfyUI's own attention), and the stats say which kernel ran.
"""

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/
sys.path.insert(0, os.environ["COMFYUI_PATH"])

from comfy.cli_args import args  # noqa: E402

args.disable_smart_memory = True
import comfy.model_patcher  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.supported_models as sm  # noqa: E402
from pack import load  # noqa: E402

P = load()

FLUX = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=128, context_in_dim=256, hidden_size=1536, mlp_ratio=4.0,
            num_heads=12, depth=2, depth_single_blocks=4, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
            guidance_embed=False)
SD = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
      "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
      "transformer_depth_output": [1, 1, 1, 1], "channel_mult": [1, 2], "transformer_depth_middle": 1,
      "use_linear_in_transformer": False, "context_dim": 256, "num_heads": 8, "num_head_channels": -1,
      "use_temporal_attention": False, "use_temporal_resblock": False}


def build(kind):
    mc = sm.Flux(dict(FLUX)) if kind == "flux" else sm.SD15(dict(SD))
    mc.set_inference_dtype(torch.bfloat16, None)
    model = mc.get_model({}, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    dev = torch.device("cuda")
    return comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)


def run(model, kind):
    g = torch.Generator(device="cpu").manual_seed(1)
    if kind == "flux":
        latent = torch.zeros(1, 16, 128, 128)
        pos = [[torch.randn(1, 64, 256, generator=g), {"pooled_output": torch.randn(1, 128, generator=g)}]]
        neg = pos
        cfg = 1.0
    else:
        latent = torch.zeros(1, 4, 64, 64)
        pos = [[torch.randn(1, 77, 256, generator=g), {}]]
        neg = [[torch.zeros(1, 77, 256), {}]]
        cfg = 5.0
    noise = torch.randn(latent.shape, generator=g)
    torch.cuda.synchronize()
    t = time.time()
    out = comfy.sample.sample(model, noise, 4, cfg, "euler", "simple", pos, neg, latent, disable_pbar=True)
    torch.cuda.synchronize()
    return out.float(), time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", required=True)
    a = ap.parse_args()
    names = ["auto"] + [n for n in P.attention.REGISTRY.names() if P.attention.REGISTRY.get(n).available]
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, ComfyUI from COMFYUI_PATH; bf16 models built from "
             "ComfyUI's classes with random weights; 4 euler steps; final latent vs the unpatched model.", ""]
    for kind in ("flux", "sd"):
        base = build(kind)
        ref, t_ref = run(base, kind)
        run(base, kind)
        ref, t_ref = run(base, kind)
        lines += [f"### {kind}: " + ("Flux-style DiT, 4096+64 tokens, head dim 128" if kind == "flux" else
                                     "SD1.5-style UNet, 64x64 latent, head dims 40 and 80, cross-attention to 77 tokens"),
                  "", f"unpatched: {t_ref:.3f} s", "",
                  "| backend | cos vs unpatched | rel-L1 | s (4 steps) | calls by kernel | fallbacks |", "|---|---|---|---|---|---|"]
        for name in names:
            try:
                m = P.nodes.patch.patch_model(base, name, log_stats=False, record_time=False)
                run(m, kind)  # warm-up (auto tunes here; Triton compiles)
                out, t = run(m, kind)
                ov = P.nodes.patch.override_of(m)
                st = ov.config.stats
                cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
                rel = ((out - ref).abs().sum() / ref.abs().sum()).item()
                calls = ", ".join(f"{k} {v}" for k, v in st.calls.items())
                fb = "; ".join(f"{f}->{to}: {r} ({n})" for (f, to, r), n in st.fallbacks.items()) or "-"
                lines.append(f"| {name} | {cos:.5f} | {rel:.4f} | {t:.3f} | {calls} | {fb[:200]} |")
                if name == "auto":
                    for sig, why in st.decisions.items():
                        lines.append(f"|  auto: {sig} | | | | {why[:300]} | |")
            except Exception as e:
                lines.append(f"| {name} | error | | | {type(e).__name__}: {str(e)[:200]} | |")
            print(lines[-1], flush=True)
        if kind == "flux":  # Tune SpargeAttn mechanics on a real architecture (random weights: little structure to exploit)
            try:
                path = os.path.join(os.environ.get("OUT", "/tmp"), "tiny_flux_sparge_profile.json")
                tuned = P.nodes.patch.tune_model(base, "sparge", 0.07, path)
                t0 = time.time()
                run(tuned, kind)
                prof = P.attention.sparge_profile.SpargeProfile.load(path)
                settings = P.nodes.definitions.SpargeSettings("sparge", {"simthreshd1": 0.6, "cdfthreshd": 0.98, "pvthreshd": 50}, prof)
                m = P.nodes.patch.patch_model(base, "sparge", sparge=settings, log_stats=True)
                out, t = run(m, kind)
                cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
                lines.append(f"Tune SpargeAttn on this model: {len(prof.layers)} of 6 layers tuned in {time.time() - t0:.1f} s "
                             f"({prof.notes}); sampling with the profile: cos {cos:.5f} vs unpatched, "
                             f"{P.nodes.patch.override_of(m).config.stats.summary()}".replace("\n", "; "))
            except Exception as e:
                lines.append(f"Tune SpargeAttn: error {type(e).__name__}: {e}")
            print(lines[-1], flush=True)
        lines.append("")
        del base
        torch.cuda.empty_cache()
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
