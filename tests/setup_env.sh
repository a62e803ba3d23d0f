#!/usr/bin/env bash
# The test environment on a fresh machine without a GPU, as CI builds it:
#   bash tests/setup_env.sh [VENV=.venv] [COMFY_DIR=.build/comfyui]
# 1. a venv with torch + torchvision (ComfyUI's model classes import torchvision), used on the CPU;
# 2. every ComfyUI release packed in ../shared/comfyui/ComfyUI-<version>.tgz (or the files in $COMFYUI_TGZ), unpacked
#    outside the tracked tree into COMFY_DIR/<version>/ComfyUI. The oldest release's requirements go into the venv;
#    what a newer release pins differently (its frontend, templates, comfy-kitchen, ...) goes into
#    COMFY_DIR/<version>/site, which `python tests/run.py` puts first on that release's path. torch lines are never
#    installed from ComfyUI's files: torch stays the one above;
# 3. the test requirements; 4. Chromium for the browser tier.
# Afterwards: `. VENV/bin/activate; python tests/run.py` (every release), or one release by hand:
#   COMFYUI_PATH=COMFY_DIR/<version>/ComfyUI PYTHONPATH=COMFY_DIR/<version>/site python -m pytest tests
set -euo pipefail
VENV=${1:-.venv}
COMFY_DIR=${2:-.build/comfyui}
TGZS=${COMFYUI_TGZ:-$(ls ../shared/comfyui/ComfyUI-*.tgz 2>/dev/null || true)}
# torch 2.14.1 + torchvision 0.29.1 are a matching pair on PyPI; a constraints file keeps every later install on them.
TORCH_PINS="torch==2.14.1 torchvision==0.29.1"
# ComfyUI 0.33 imports torchaudio at start-up. torchaudio's last release, 2.11.0, is built on the stable ABI (abi3)
# and declares no torch pin: it imports beside torch 2.14.1 (installed without dependencies, so torch stays).
TORCHAUDIO_PIN="torchaudio==2.11.0"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
cons=$(mktemp)
printf '%s\n' $TORCH_PINS >"$cons"
"$PY" -m pip install -q -c "$cons" $TORCH_PINS
"$PY" -m pip install -q --no-deps "$TORCHAUDIO_PIN"
"$PY" -m pip install -q -c "$cons" -r requirements-test.txt
# comfy-kitchen 0.2.40 (the first with sol_attn), beside the venv: the Sol-Attn stand-in is checked against its
# contract and its CPU reference (tests/test_sparse_choices.py); no release's own comfy-kitchen pin is touched
[ -d .build/kitchen-sol/comfy_kitchen ] || "$PY" -m pip install -q --no-deps --target .build/kitchen-sol comfy-kitchen==0.2.40

version_of() { basename "$1" .tgz | sed 's/^ComfyUI-//'; }
# oldest first: it defines the venv, the others add what they pin differently
sorted=$(for t in $TGZS; do echo "$(version_of "$t") $t"; done | sort -V | cut -d' ' -f2)
[ -n "$sorted" ] || echo "setup_env: no ComfyUI release found: the real-ComfyUI tests will be skipped (set COMFYUI_TGZ or COMFYUI_PATH)" >&2
first=1
for tgz in $sorted; do
  ver=$(version_of "$tgz")
  dest="$COMFY_DIR/$ver"
  if [ ! -f "$dest/ComfyUI/main.py" ]; then
    mkdir -p "$dest"
    tar xzf "$tgz" -C "$dest"
  fi
  req=$(mktemp)
  # ComfyUI's requirements without torch/torchvision/torchaudio. Its "non essential" ones too: without spandrel the
  # frontend's model-to-node store throws and draws VAELoader/CheckpointLoaderSimple as missing nodes.
  # requests: ComfyUI 0.3.64's server imports it (its frontend manager) without listing it.
  grep -v -E '^(torch|torchvision|torchaudio)([<>=~ ].*)?$' "$dest/ComfyUI/requirements.txt" >"$req"
  echo requests >>"$req"
  if [ $first = 1 ]; then
    "$PY" -m pip install -q -c "$cons" -r "$req"
    first=0
  else
    # what this release needs beyond the venv (pip's own resolution against it), installed into its own folder
    report=$(mktemp)
    "$PY" -m pip install -q --dry-run -c "$cons" -r "$req" --report "$report" >/dev/null
    pins=$("$PY" -c "import json,sys; print(' '.join(f\"{i['metadata']['name']}=={i['metadata']['version']}\" for i in json.load(open(sys.argv[1]))['install']))" "$report")
    if [ -n "$pins" ]; then
      "$PY" -m pip install -q --no-deps --target "$dest/site" --upgrade $pins
    fi
  fi
  echo "setup_env: ComfyUI $ver in $dest/ComfyUI$([ -d "$dest/site" ] && echo " (its own pins in $dest/site)")"
done

# 4. headless Chromium and its driver for the browser tier (Debian's packages); without them that tier is skipped
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
      || echo "setup_env: chromium could not be installed: the browser tests will be skipped" >&2
  else
    echo "setup_env: no chromium and no root apt-get: the browser tests will be skipped" >&2
  fi
fi
