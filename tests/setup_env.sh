#!/usr/bin/env bash
# The test environment on a fresh machine without a GPU, as CI builds it:
#   bash tests/setup_env.sh [VENV=.venv] [COMFY_DIR=.build/comfyui]
# 1. a venv with torch + torchvision (ComfyUI's model classes import torchvision), used on the CPU;
# 2. ComfyUI 0.3.64 unpacked outside the tracked tree from ../shared/comfyui/ComfyUI-0.3.64.tgz (or $COMFYUI_TGZ),
#    with its own requirements.txt (torch lines excluded, so torch stays the one above);
# 3. the test requirements; 4. Chromium for the browser tier.
# Afterwards: `. VENV/bin/activate; export COMFYUI_PATH=COMFY_DIR/ComfyUI; python -m pytest tests`.
set -euo pipefail
VENV=${1:-.venv}
COMFY_DIR=${2:-.build/comfyui}
TGZ=${COMFYUI_TGZ:-../shared/comfyui/ComfyUI-0.3.64.tgz}
# torch 2.14.1 + torchvision 0.29.1 are a matching pair on PyPI; a constraints file keeps every later install on them.
TORCH_PINS="torch==2.14.1 torchvision==0.29.1"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
cons=$(mktemp)
printf '%s\n' $TORCH_PINS >"$cons"
"$PY" -m pip install -q -c "$cons" $TORCH_PINS

if [ -f "$TGZ" ]; then
  if [ ! -f "$COMFY_DIR/ComfyUI/main.py" ]; then
    mkdir -p "$COMFY_DIR"
    tar xzf "$TGZ" -C "$COMFY_DIR"
  fi
  req=$(mktemp)
  # ComfyUI's requirements without torch/torchvision/torchaudio. Its "non essential" ones too: without spandrel the
  # frontend's model-to-node store throws and draws VAELoader/CheckpointLoaderSimple as missing nodes.
  grep -v -E '^(torch|torchvision|torchaudio)([<>=~ ].*)?$' "$COMFY_DIR/ComfyUI/requirements.txt" >"$req"
  # requests: ComfyUI's server imports it (its frontend manager) without listing it
  "$PY" -m pip install -q -c "$cons" -r "$req" requests
else
  echo "setup_env: $TGZ not found: the real-ComfyUI tests will be skipped (set COMFYUI_TGZ or COMFYUI_PATH)" >&2
fi
"$PY" -m pip install -q -c "$cons" -r requirements-test.txt

# 4. headless Chromium and its driver for the browser tier (Debian's packages); without them that tier is skipped
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
      || echo "setup_env: chromium could not be installed: the browser tests will be skipped" >&2
  else
    echo "setup_env: no chromium and no root apt-get: the browser tests will be skipped" >&2
  fi
fi
