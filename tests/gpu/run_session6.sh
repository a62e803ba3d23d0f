#!/bin/bash
# GPU session 6: image-model presets with 40 back-to-back calls per timing round (less run-to-run noise at
# 0.05-0.6 ms per call), for the auto-vs-fastest comparison in docs/benchmarks.md.
source tests/gpu/env.sh
echo "### bench"
timeout 300 $PY -m attention.bench --preset sd15 --preset sd15-cross --preset sdxl --preset sd3 --preset flux --reps 40 \
  --json "$OUT/bench-image.json" --md "$OUT/bench-image.md" 2>&1 | grep -v "run/s\]" | grep -A12 "What .auto. measured"
