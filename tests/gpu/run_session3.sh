#!/bin/bash
# GPU session 3: benchmark with contiguous inputs, ComfyUI sampling (+ Tune SpargeAttn), SpargeAttn tuning vs defaults.
# Carries the same as run_session2.sh.
source tests/gpu/env.sh
echo "### sparge tuning"
timeout 170 $PY tests/gpu/sparge_tune_bench.py --md "$OUT/sparge-tune.md" --json "$OUT/sparge-tune.json" 2>&1 | tail -n 30
echo "### bench"
timeout 240 $PY -m attention.bench --json "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | grep -v "run/s\]" | tail -n 45
echo "### comfy"
timeout 120 $PY tests/gpu/comfy_gpu.py --md "$OUT/comfy-gpu.md" 2>&1 | grep -v "^|  auto" | tail -n 12
