#!/bin/bash
# GPU session 4: SpargeAttn tuned vs defaults on the calibrated video-like inputs, then the benchmark and the
# correctness matrix again with the final input generator. Carries the same as run_session2.sh.
source tests/gpu/env.sh
echo "### sparge tuning"
timeout 150 $PY tests/gpu/sparge_tune_bench.py --md "$OUT/sparge-tune.md" --json "$OUT/sparge-tune.json" 2>&1 | tail -n 25
echo "### bench"
timeout 240 $PY -m attention.bench --json "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | grep -v "run/s\]" | tail -n 5
echo "### matrix"
timeout 150 $PY tests/gpu/matrix.py --out "$OUT/matrix.json" --md "$OUT/matrix.md" 2>&1 | tail -n 25
