"""comfy-kitchen's CUDA library runs on this GPU: the calls ComfyUI 0.33 makes into it (RoPE for Flux and Wan, fp8
quantization), its CUDA backend against its eager one (PyTorch); the pack's kitchen backends are the matrix-kitchen
stage's.  For a carried library cut down to this GPU's architecture (tests/tools/fatbin_keep.py): the same
results as its whole build.

    python tests/gpu/kitchen_check.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the pack's root


def main() -> int:
    import comfy_kitchen as ck

    from attention.reference import accuracy  # (cosine, rel-L1), as the contract matrix measures

    def both(fn, *args):
        """``fn(*args)`` on comfy-kitchen's CUDA backend and on its eager one, and their rel-L1."""
        with ck.use_backend("cuda"):
            c = fn(*args)
        with ck.use_backend("eager"):
            e = fn(*args)
        pairs = list(zip(c, e)) if isinstance(c, tuple) else [(c, e)]
        return max(accuracy(x, y)[1] for x, y in pairs)

    cuda = ck.list_backends().get("cuda", {})
    print("comfy-kitchen", getattr(ck, "__version__", "?"), "cuda backend:", cuda.get("available"),
          cuda.get("unavailable_reason") or "")
    if not cuda.get("available"):
        return 1
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0

    # RoPE as ComfyUI's flux/math.py calls it for Wan 2.1 (interleaved pairs, [B, L, H, D], fp32 frequencies)
    q = torch.randn(1, 4096, 40, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 4096, 40, 128, device=dev, dtype=torch.bfloat16, generator=g)
    ang = torch.rand(1, 4096, 1, 64, device=dev, generator=g) * 6.28
    freqs = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], -1).view(1, 4096, 1, 64, 2, 2)
    d = both(ck.apply_rope, q, k, freqs)
    print(f"apply_rope cuda vs eager: rel-L1 {d:.2e}")
    worst = max(worst, d)

    # fp8 quantization (ComfyUI's quant_ops for fp8-scaled weights)
    w = torch.randn(5120, 5120, device=dev, dtype=torch.bfloat16, generator=g)
    scale = (w.abs().amax().float() / 448.0).reshape(())
    d = both(ck.quantize_per_tensor_fp8, w, scale, torch.float8_e4m3fn)
    print(f"quantize_per_tensor_fp8 cuda vs eager: rel-L1 {d:.2e}")
    worst = max(worst, d)

    ok = worst < 1e-2
    print("kitchen check:", "ok" if ok else f"FAILED (largest rel-L1 {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
