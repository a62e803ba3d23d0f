#!/bin/bash
# GPU session 3: benchmark with contiguous inputs, ComfyUI sampling (+ Tune SpargeAttn), SpargeAttn tuning vs defaults.
# Carries the same as run_session2.sh.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
PY=python3
mkdir -p /tmp/kern && tar xzf .build/kernels/kernels.tgz -C /tmp/kern
$PY -m pip install -q --no-index --no-deps --target /tmp/kern .whl/comfy_kitchen-*.whl .whl/einops-*.whl .whl/torchsde-*.whl .whl/trampoline-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/kern
mkdir -p /tmp/ComfyUI && tar xzf .build/comfyui.tgz -C /tmp/ComfyUI
export COMFYUI_PATH=/tmp/ComfyUI
echo "### sparge tuning"
timeout 170 $PY tests/gpu/sparge_tune_bench.py --md "$OUT/sparge-tune.md" --json "$OUT/sparge-tune.json" 2>&1 | tail -n 30
echo "### bench"
timeout 240 $PY -m attention.bench --json "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | grep -v "run/s\]" | tail -n 45
echo "### comfy"
timeout 120 $PY tests/gpu/comfy_gpu.py --md "$OUT/comfy-gpu.md" 2>&1 | grep -v "^|  auto" | tail -n 12
