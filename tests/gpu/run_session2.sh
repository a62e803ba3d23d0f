#!/bin/bash
# GPU session 2: benchmark (+ auto), ComfyUI sampling with real kernels, SpargeAttn threshold sweep.
# Carries: .whl (comfy-kitchen, einops/torchsde wheels), .build/kernels/kernels.tgz (SageAttention2 + SpargeAttn
# built by install.py in session 1 on this GPU type), .build/comfyui.tgz (a ComfyUI checkout).
source tests/gpu/env.sh
echo "### bench"
timeout 300 $PY -m attention.bench --json "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | grep -v "it/s\]" | tail -n 60
echo "### comfy"
timeout 150 $PY tests/gpu/comfy_gpu.py --md "$OUT/comfy-gpu.md" 2>&1 | tail -n 50
echo "### sparge"
timeout 100 $PY tests/gpu/sparge_sweep.py --md "$OUT/sparge.md" --json "$OUT/sparge.json" 2>&1 | tail -n 40
