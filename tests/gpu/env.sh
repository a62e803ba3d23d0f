# Sourced by the GPU session scripts: install the carried kernels and (when carried) a ComfyUI checkout.
# Carries: .build/kernels/kernels.tgz (SageAttention2 + SpargeAttn built by install.py on this GPU type in
# session 1), .whl (comfy-kitchen; einops/torchsde/trampoline for ComfyUI), optionally .build/comfyui.tgz.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
PY=python3
mkdir -p /tmp/kern && tar xzf .build/kernels/kernels.tgz -C /tmp/kern
$PY -m pip install -q --no-index --no-deps --target /tmp/kern .whl/comfy_kitchen-*.whl $(ls .whl/einops-*.whl .whl/torchsde-*.whl .whl/trampoline-*.whl 2>/dev/null) 2>&1 | tail -2
export PYTHONPATH=/tmp/kern
if [ -f .build/comfyui.tgz ]; then
  mkdir -p /tmp/ComfyUI && tar xzf .build/comfyui.tgz -C /tmp/ComfyUI
  export COMFYUI_PATH=/tmp/ComfyUI
fi
