#!/bin/bash
# GPU session 1: install.py for real (clean state, then again), then the correctness matrix.
# Run through the device tool from the repo root, carrying .whl (wheels) and .src (source archives):
#   bash tests/gpu/run_h100.sh
# Writes to $OUT: summary.txt, install-logs.tgz, matrix.{json,md}, matrix-sage1.md, kernels.tgz*
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
S="$OUT/summary.txt"
PY=python3
say() { echo "### $*" | tee -a "$S"; }

say "machine"
{ nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader; $PY -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda)"; gcc --version | head -1; nvcc --version | tail -1; nproc; } 2>&1 | tee -a "$S"
TORCH_BEFORE=$($PY -c "import torch;print(torch.__version__)")

say "install.py run 1 (clean state)"
t0=$(date +%s)
timeout 450 $PY install.py --yes --sage-source .src/SageAttention.tar.gz --sparge-source .src/SpargeAttn.tar.gz \
  --with xformers --find-links .whl --no-index --log-dir /tmp/pa-logs 2>&1 | grep -v '^\s*$' | tail -n 60 | tee -a "$S"
echo "run 1 rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - t0 ))" | tee -a "$S"

say "install.py run 2 (idempotence)"
t0=$(date +%s)
timeout 120 $PY install.py --yes --sage-source .src/SageAttention.tar.gz --sparge-source .src/SpargeAttn.tar.gz \
  --with xformers --find-links .whl --no-index --log-dir /tmp/pa-logs2 --no-verify 2>&1 | tail -n 20 | tee -a "$S"
echo "run 2 rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - t0 ))" | tee -a "$S"
echo "torch before: $TORCH_BEFORE after: $($PY -c 'import torch;print(torch.__version__)')" | tee -a "$S"
tar czf "$OUT/install-logs.tgz" -C /tmp pa-logs 2>/dev/null

say "pack built kernels for later sessions"
SP=$($PY -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
mkdir -p /tmp/kern && cd "$SP" && cp -r sageattention* spas_sage_attn* /tmp/kern/ 2>/dev/null; cd - >/dev/null
find /tmp/kern -name '*.so' -exec strip --strip-debug {} \; 2>/dev/null
tar czf /tmp/kernels.tgz -C /tmp/kern . && split -b 15m /tmp/kernels.tgz "$OUT/kernels.tgz.part" && ls -la "$OUT" | tee -a "$S"

say "correctness matrix (sage 2.x environment)"
timeout 240 $PY tests/gpu/matrix.py --out "$OUT/matrix.json" --md "$OUT/matrix.md" 2>&1 | tail -n 5 | tee -a "$S"

say "correctness matrix (sageattention 1.0.6 from PyPI, own target dir)"
$PY -m pip install -q --no-index --no-deps --target /tmp/sage1 .whl/sageattention-1.0.6-*.whl
PYTHONPATH=/tmp/sage1 timeout 120 $PY tests/gpu/matrix.py --backends sage,sage1_triton --out /tmp/m1.json --md "$OUT/matrix-sage1.md" 2>&1 | tail -n 5 | tee -a "$S"
say "done"
