#!/bin/bash
# install.py as ComfyUI Manager runs it (no arguments, non-interactive) on a machine without network, then a
# forced rebuild of SageAttention from a local archive to watch the build progress bar. Carries .src and .whl.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
echo "### install.py with no arguments, stdin not a terminal"
t0=$(date +%s)
python3 install.py < /dev/null > "$OUT/manager-run.log" 2>&1; rc=$?
echo "rc=$rc seconds=$(( $(date +%s) - t0 ))"; grep -v "^\s*$" "$OUT/manager-run.log" | grep -v "step/s\]" | tail -n 30
echo "### forced SageAttention rebuild from a local archive"
t0=$(date +%s)
timeout 420 python3 install.py --yes --force --only sageattention --sage-source .src/SageAttention.tar.gz --no-verify \
  --log-dir /tmp/pa-logs > "$OUT/rebuild.log" 2>&1; rc=$?
echo "rc=$rc seconds=$(( $(date +%s) - t0 ))"
tr '\r' '\n' < "$OUT/rebuild.log" | grep -E "sageattention: +[0-9]+%|step" | awk 'NR % 15 == 1' | tail -n 12
tr '\r' '\n' < "$OUT/rebuild.log" | grep -v "step" | tail -n 8
