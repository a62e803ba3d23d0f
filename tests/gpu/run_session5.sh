#!/bin/bash
# GPU session 5: image-model presets again after the dispatcher's fast path and the deferred NaN check,
# and ComfyUI sampling with real kernels (the zeroed negative prompt makes SageAttention return NaN).
source tests/gpu/env.sh
echo "### bench"
timeout 200 $PY -m attention.bench --preset sd15 --preset sd15-cross --preset sdxl --preset sd3 --preset flux \
  --json "$OUT/bench-image.json" --md "$OUT/bench-image.md" 2>&1 | grep -v "run/s\]" | tail -n 12
echo "### comfy"
timeout 150 $PY tests/gpu/comfy_gpu.py --md "$OUT/comfy-gpu.md" 2>&1 | grep -v "^|  auto" | tail -n 40
