#!/usr/bin/env bash
# The test environment on a fresh machine without a GPU, as CI builds it:
#   bash tests/setup_env.sh [VENV=.venv] [COMFY_DIR=.build/comfyui]
# 1. a venv with torch, torchvision and torchaudio, used on the CPU: PyTorch's CPU builds where its CPU index answers
#    and they import, else PyPI's builds, which carry CUDA libraries the tests never use (3.2 GB of the 6.2 GB venv).
#    PyPI has no CPU build of torchvision or torchaudio (theirs need torch's CUDA libraries), so the CPU route needs
#    that index;
# 2. the ComfyUI releases to test against, oldest first, in COMFY_DIR/<version>/ComfyUI (outside the tracked tree):
#    - COMFYUI_PATH: a ComfyUI you have (a checkout or an unpacked release), linked there as it is;
#    - COMFYUI_TGZ: archives (space-separated: ComfyUI-<version>.tgz as CI keeps them, or GitHub's release archives,
#      ComfyUI-<version>.tar.gz / v<version>.tar.gz), unpacked there; default ../shared/comfyui/*.tgz (CI's);
#    - neither: the releases in COMFYUI_RELEASES (default 0.3.64 and 0.33.0, the ones CI tests) downloaded from GitHub
#      into COMFY_DIR/downloads where the network allows (COMFYUI_RELEASES= turns that off).
#    The oldest release's requirements go into the venv; what a newer release pins differently (its frontend,
#    templates, comfy-kitchen, ...) goes into COMFY_DIR/<version>/site, which `python tests/run.py` puts first on that
#    release's path. torch lines are never installed from ComfyUI's files: torch stays the one above;
# 3. the test requirements; 4. Chromium for the browser tier.
# Afterwards: `. VENV/bin/activate; python tests/run.py` (every release; its last lines say which real-ComfyUI tiers
# ran), or one release by hand:
#   COMFYUI_PATH=COMFY_DIR/<version>/ComfyUI PYTHONPATH=COMFY_DIR/<version>/site python -m pytest tests
# Without any ComfyUI the tiers that need none run, and the real-ComfyUI tiers are skipped with the reason.
set -euo pipefail
t_start=$(date +%s)
VENV=${1:-.venv}
COMFY_DIR=${2:-.build/comfyui}
TGZS=${COMFYUI_TGZ:-$(ls ../shared/comfyui/ComfyUI-*.tgz 2>/dev/null || true)}
COMFYUI_RELEASES=${COMFYUI_RELEASES-0.3.64 0.33.0}
# {version} is replaced; a file:// URL works too
GITHUB_RELEASE='https://github.com/Comfy-Org/ComfyUI/archive/refs/tags/v{version}.tar.gz'
COMFYUI_RELEASE_URL=${COMFYUI_RELEASE_URL:-$GITHUB_RELEASE}
# torch 2.14.1 + torchvision 0.29.1 are a matching pair; a constraints file keeps every later install on them.
TORCH_V=2.14.1
VISION_V=0.29.1
TORCH_PINS="torch==$TORCH_V torchvision==$VISION_V"
# ComfyUI 0.33 imports torchaudio at start-up. torchaudio's last release, 2.11.0, is built on the stable ABI (abi3)
# and declares no torch pin: it imports beside torch 2.14.1 (installed without dependencies, so torch stays).
TORCHAUDIO_V=2.11.0
# PyTorch's CPU index; TORCH_CPU_INDEX= (empty) goes straight to PyPI's builds
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
cons=$(mktemp)
printf '%s\n' $TORCH_PINS >"$cons"
imports_torch() { "$PY" -c "import torch, torchvision, torchaudio" >/dev/null 2>&1; }
have=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ "$have" = "$TORCH_V+cpu" ] && imports_torch; then
  torch_from="PyTorch's CPU builds (already installed)"
elif [ -n "$TORCH_CPU_INDEX" ] && [ "${have%+cpu}" != "$TORCH_V" ] \
    && "$PY" -m pip install -q --no-deps --timeout 20 --retries 1 --index-url "$TORCH_CPU_INDEX" \
         "torch==$TORCH_V+cpu" "torchvision==$VISION_V+cpu" "torchaudio==$TORCHAUDIO_V+cpu" >/dev/null 2>&1 \
    && "$PY" -m pip install -q -c "$cons" $TORCH_PINS && imports_torch; then
  torch_from="PyTorch's CPU builds ($TORCH_CPU_INDEX)"
else
  # the CPU index is out of reach (CI reaches PyPI only), or its builds did not import: PyPI's builds
  now=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
  case "$now" in *+cpu) "$PY" -m pip uninstall -q -y torch torchvision torchaudio >/dev/null 2>&1 || true ;; esac
  "$PY" -m pip install -q -c "$cons" $TORCH_PINS
  "$PY" -m pip install -q --no-deps "torchaudio==$TORCHAUDIO_V"
  torch_from="PyPI's builds (with CUDA libraries, used on the CPU)"
fi
echo "setup_env: torch $("$PY" -c "import torch; print(torch.__version__)") from $torch_from"
"$PY" -m pip install -q -c "$cons" -r requirements-test.txt
# comfy-kitchen 0.2.40 (the first with sol_attn), beside the venv: the Sol-Attn stand-in is checked against its
# contract and its CPU reference (tests/test_sparse_choices.py); no release's own comfy-kitchen pin is touched
[ -d .build/kitchen-sol/comfy_kitchen ] || "$PY" -m pip install -q --no-deps --target .build/kitchen-sol comfy-kitchen==0.2.40

# ComfyUI-0.33.0.tgz, ComfyUI-0.33.0.tar.gz, v0.33.0.tar.gz -> 0.33.0
version_of() { basename "$1" | sed -E 's/\.(tgz|tar\.gz)$//; s/^ComfyUI-//; s/^v//'; }
# a ComfyUI tree's own version (comfyui_version.py)
tree_version() { sed -nE 's/^__version__ = "([^"]+)".*/\1/p' "$1/comfyui_version.py" 2>/dev/null; }
sources=""  # "<version> <archive or tree>" lines
for t in $TGZS; do sources+="$(version_of "$t") $t"$'\n'; done
if [ -n "${COMFYUI_PATH:-}" ]; then
  [ -f "$COMFYUI_PATH/main.py" ] || { echo "setup_env: COMFYUI_PATH=$COMFYUI_PATH holds no ComfyUI (no main.py)" >&2; exit 1; }
  ver=$(tree_version "$COMFYUI_PATH")
  [ -n "$ver" ] || { echo "setup_env: $COMFYUI_PATH has no comfyui_version.py: ComfyUI older than the pack supports?" >&2; exit 1; }
  sources+="$ver $(cd "$COMFYUI_PATH" && pwd)"$'\n'
fi
if [ -z "$sources" ] && [ -n "$COMFYUI_RELEASES" ]; then
  # no ComfyUI given: the pinned releases from GitHub, where it answers (CI has ../shared/comfyui and never gets here)
  mkdir -p "$COMFY_DIR/downloads"
  for ver in $COMFYUI_RELEASES; do
    file="$COMFY_DIR/downloads/ComfyUI-$ver.tar.gz"
    url=${COMFYUI_RELEASE_URL//\{version\}/$ver}
    if [ -s "$file" ] || "$PY" - "$url" "$file" <<'PYEOF'
import sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
try:
    with urllib.request.urlopen(url, timeout=30) as r, open(out + ".part", "wb") as f:
        f.write(r.read())
except OSError as e:
    sys.exit(f"setup_env: could not download ComfyUI {url}: {e}")
import os
os.replace(out + ".part", out)
PYEOF
    then
      sources+="$ver $file"$'\n'
      echo "setup_env: ComfyUI $ver from $url"
    fi
  done
fi
# oldest first: it defines the venv, the others add what they pin differently
sorted=$(printf '%s' "$sources" | sed '/^$/d' | sort -V -k1,1)
[ -n "$sorted" ] || echo "setup_env: no ComfyUI release found: the real-ComfyUI tests will be skipped (set COMFYUI_PATH to your ComfyUI, or COMFYUI_TGZ to release archives)" >&2
first=1
while read -r ver src <&3; do
  [ -n "$ver" ] || continue
  dest="$COMFY_DIR/$ver"
  if [ -d "$src" ]; then
    # your own ComfyUI, linked (a link already there is replaced; a release unpacked there is kept)
    mkdir -p "$dest"
    if [ -L "$dest/ComfyUI" ] || [ ! -e "$dest/ComfyUI" ]; then
      ln -sfn "$src" "$dest/ComfyUI"
    elif [ "$(cd "$dest/ComfyUI" && pwd -P)" != "$(cd "$src" && pwd -P)" ]; then
      echo "setup_env: $dest/ComfyUI already holds ComfyUI $ver: tests/run.py uses $COMFYUI_PATH while COMFYUI_PATH is set" >&2
    fi
  elif [ ! -f "$dest/ComfyUI/main.py" ]; then
    tgz=$src
    mkdir -p "$dest"
    tar xzf "$tgz" -C "$dest"
    # GitHub's release archives hold ComfyUI-<version>/ (or ComfyUI-<commit>/) instead of ComfyUI/
    if [ ! -f "$dest/ComfyUI/main.py" ]; then
      for top in "$dest"/*/main.py; do
        [ -f "$top" ] && mv "$(dirname "$top")" "$dest/ComfyUI" && break
      done
    fi
    [ -f "$dest/ComfyUI/main.py" ] || { echo "setup_env: $tgz holds no ComfyUI (no main.py at its top folder)" >&2; exit 1; }
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
done 3<<<"$sorted"

# 4. headless Chromium and its driver for the browser tier (Debian's packages); without them that tier is skipped
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
      || echo "setup_env: chromium could not be installed: the browser tests will be skipped" >&2
  else
    echo "setup_env: no chromium and no root apt-get: the browser tests will be skipped" >&2
  fi
fi
echo "setup_env: done in $(( $(date +%s) - t_start )) s; on disk: $(du -sh "$VENV" | cut -f1) in $VENV, \
$(du -sh "$COMFY_DIR" 2>/dev/null | cut -f1 || echo 0) in $COMFY_DIR"
