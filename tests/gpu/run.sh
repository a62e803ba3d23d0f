#!/bin/bash
# The GPU runner: one script, named stages, logs and results under $OUT.
#   bash tests/gpu/run.sh STAGE [STAGE ...]        (from the repo root, on the CUDA machine)
#
# Carried (ignored paths), in $CARRY (default .build/gpu): kernels.tgz or kernels.tar.xz (SageAttention2 + SpargeAttn built by install.py
# for this GPU, torch and Python), kitchen-<version>.tar.xz (comfy-kitchen's package, its ROCm library left out; the
# newest is used unless KITCHEN=<version>; where the carry is tight, its CUDA library cut down to the GPU's architecture
# by tests/tools/fatbin_keep.py: 21 MB -> 2.6 MB for sm 9.0), comfyui.tar.xz (a ComfyUI source tree), *.whl (wheels the machine lacks:
# torchsde, trampoline, comfy-aimdo, gguf), site-<name>.tar.xz (a package's installed files, unpacked beside the wheels:
# PyAV for ComfyUI's Save Video, smaller so than its wheel), comfyui-gguf.tar.xz (a ComfyUI-GGUF checkout, top folder
# ComfyUI-GGUF: the cp-compose stage's GGUF case), .src (the pinned upstream archives, <commit>.tar.gz, made by
# tests/tools/pin_source.py, for the install stages).
#
# Stages:
#   env            unpack kernels, comfy-kitchen, wheels, ComfyUI and ComfyUI-GGUF (every other stage needs it; run it
#                  first); FA4_SITE=<dir>: FlashAttention-4 installed there with pip --target (added to the path)
#   pytest         the CPU test suite with CUDA present (compile tests excluded: they run in CI; PYTEST_LIMIT, PYTEST_PATHS, PYTEST_K)
#   threads        tests/test_threads.py with CUDA present: no SDPA backend switches PyTorch's global SDPA state
#   matrix         the contract matrix through the override (tests/gpu/matrix.py), every installed backend
#                  (MATRIX_BACKENDS=a,b limits it; MATRIX_OPTIONS passes per-backend options; MATRIX_LIMIT seconds,
#                  default 560: every backend took over 400 s on an H200, most of it in kernels that plan or compile
#                  per new shape: sdpa_cudnn, the Triton kernels of sage_triton and sparge*; a run cut short keeps the
#                  cases it checked)
#   matrix-sdpa    the matrix for the SDPA family (each kernel through its ATen op)
#   kitchen-check  comfy-kitchen's CUDA library runs here: ComfyUI's calls into it (RoPE, fp8 quantization) against its
#                  eager backend (tests/gpu/kitchen_check.py)
#   matrix-kitchen the matrix for comfy-kitchen's backends, once per carried comfy-kitchen version (Sol-Attn with
#                  min_tokens 128 so that it takes the matrix's calls)
#   sol-bench      kernel level: Sol-Attn (the pack's call and core's), int8, SDPA, Sage, SpargeAttn on one Wan-14B
#                  480p self-attention call (tests/gpu/sol_bench.py)
#   e2e-image      end-to-end benchmark, SD1.5 / SDXL (host-bound), main rows, 20 rounds: minimum, and paired
#                  per-round ratios with 95 % intervals (vs unpatched, vs peer, auto vs the best row)
#   e2e-flux       end-to-end benchmark, Flux-dev, main rows, 3 rounds, median
#   e2e-image-all  the same, every row, one round, profiled
#   e2e-wan        end-to-end benchmark, Wan 2.1 1.3B 480p/81f, every row, profiled
#   e2e-wan14      end-to-end benchmark, Wan 2.1 14B, the main rows
#   e2e-core       against ComfyUI's own attention nodes (core rows): Wan 1.3B 480p/81f, Flux-dev, SDXL, one round
#   e2e-core-720p  the same for Wan 1.3B 720p/81f, the main rows (a call of its own)
#   e2e-core-wan14 Wan 14B 480p/81f against the core rows
#   e2e-core-profile  Wan 1.3B 480p/81f: auto, its kernels alone and the Sol-Attn rows, the last (sparse-phase) step profiled
#                  (STEPS=n, PROFILE_STEP=i: another step, e.g. a dense one before the sparse start; ROWS=a,b)
#   e2e-core-whole Wan 1.3B 480p/81f, 10 steps: whole runs, the dense steps before the sparse schedule's start included
#                  (ROUNDS=n, ROWS=a,b; e2e-core-whole-720p: Wan 1.3B 720p/81f, 8 steps, the Sol-Attn rows and auto)
#   dynamic        ComfyUI 0.33's dynamic (comfy-aimdo) model patcher under Patch Attention: Wan 1.3B 33 frames
#   vram           peak VRAM of one step of Wan 14B 720p/81f with and without 0.33's attention tensor containers
#   vram-trace     the allocations alive at the peak of one step, per row, and where they were made
#   vram-calls     one Wan 14B 720p attention call: memory beyond q/k/v per backend (through the pack and called directly)
#   e2e-compile    end-to-end under torch.compile (inductor): Flux-dev and Wan 1.3B, main rows (e2e-compile-flux:
#                  Flux, 6 rounds; e2e-compile-wan: Wan, compiled rows only, 2 rounds)
#   install        install.py for real, its pinned sources served from .src by --mirror (clean state), then again
#   install-manager  install.py as ComfyUI Manager runs it: no arguments, no terminal, no network
#   hostcost       host time per attention call: ComfyUI's function, sdpa, each Sage kernel with/without the NaN net, peers
#   sparge         SpargeAttn threshold sweep and tuned-vs-default (tests/gpu/sparge_*.py)
#   quality        the stand-in (tests/gpu/quality.py, docs/quality.md): trains it (TRAIN_SECONDS, default 190), saves it
#                  to STANDIN_WEIGHTS (default /tmp/standin.safetensors), measures its attention's concentration, the
#                  rows at 480p (and 720p) with PSNR/SSIM against its fp32 run, and the gate calibration, inside
#                  QUALITY_BUDGET seconds (default 460; what does not fit is listed as not reached)
#   quality-720p   auto and auto_fast at 720p beside unpatched, sdpa_cudnn, sage_fp8_sm90 and sparse settings, the step of
#                  unpatched and sage_fp8_sm90 profiled (attention's share); trains first unless STANDIN_WEIGHTS exists
#                  (QUALITY_ROWS, QUALITY_PROFILE_ROWS, QUALITY_BUDGET default 500 s)
#   quality-more   a second call on the same machine with the saved weights: 720p rows and the whole calibration sweep
#   quality-auto   auto and auto_fast beside unpatched, sdpa_cudnn, sage_fp8_sm90 and kitchen_sol at 480p, then 720p
#                  (the stand-in from STANDIN_WEIGHTS when a quality call on this machine left it, else trained first;
#                  QUALITY_BUDGET, default 480 s)
#   fa4            FlashAttention-4, the four parts below in turn (~7-8 min expected, each time-boxed; each is a stage too):
#   fa4-install    install.py --only flash_attn4 for real from the wheels in FA4_WHEELS (default $CARRY/fa4; a wheel over
#                  the carry limit may come as X.whl.part-aa, -ab, ...: joined there), offline, torch checked before and
#                  after, a second run, a --target install's import path without the .pth; then a fresh process imports
#                  flash_attn.cute and calls it through the pack (tests/gpu/fa4.py install / check)
#   fa4-compile    first-call (JIT compile) and steady time per declared head dim (bf16; fp16 on the common ones), which
#                  new shapes compile again, FA4's own disk cache across processes (FA4_COMPILE_BUDGET s, default 100)
#   fa4-mask       ComfyUI's bool/additive masks through FA4's mask_mod/score_mod: exactness vs fp32 SDPA, speed vs SDPA
#                  with the same mask (FA4_MASK_BUDGET s, default 80)
#   fa4-matrix     the contract matrix for flash_attn4 with its per-arch declarations
#   exact-auto     auto_exact per call shape (tests/gpu/exact_auto.py): its choice among the exact kernels installed, the
#                  device kernel that runs through ComfyUI's hook against the one it timed (profiler), its error vs fp32,
#                  ComfyUI's own function beside it (run once per carried ComfyUI release)
#   e2e-exact      Wan 1.3B 480p/81f, 10 steps, whole runs: unpatched, sdpa_cudnn, flash_attn4, auto_exact, auto and the
#                  explicit sparse rows (their dense steps on the fastest exact kernel); rows not usable here are left out
#                  (PRESET, STEPS, ROWS and E2E_LIMIT override; e2e-exact-720p: Wan 1.3B 720p/81f, 2 steps, the exact rows)
#   e2e-auto       the default auto on real sizes: Wan 2.1 1.3B 480p/81f, CFG 1, 8 steps, 2 rounds, whole runs, one
#                  step between auto's check steps profiled: unpatched, sage_fp8_sm90, sdpa_cudnn, auto_exact, auto,
#                  auto_fast (rows not usable here are left out; PRESET, CFG, STEPS, ROUNDS, ROWS and PROFILE_STEP override)
#   e2e-exact-image  Flux-dev and SDXL, 6 steps: unpatched, sdpa, sdpa_cudnn, flash_attn4, auto_exact, auto
#   multigpu       several GPUs (tests/gpu/multigpu.py): context parallelism and MultiGPU CFG Split against the same
#                  backend on one GPU: s/step, ratio, latent difference, peak VRAM per GPU (MG_PRESET, MG_CFG, MG_STEPS,
#                  MG_ROUNDS: every row that many times, interleaved, the median s/step,
#                  MG_ROWS, MG_DIAGNOSE=backends: why CFG Split's latent differs from one GPU's, MG_LIMIT seconds,
#                  MG_DEBUG=1: the pack's debug lines in the log (a CUDA graph's failure with its traceback),
#                  MG_MIN_TOKENS: split shorter sequences than the node does, e.g. 0 for Flux at 1024²; rows take the
#                  exchange's settings after the mode: cp-flat, cp-a128, cp@2: tests/gpu/multigpu.py)
#   multigpu-procs the node's threads against one process per GPU (tests/gpu/multigpu_procs.py), every forward split,
#                  each against one GPU in the same design: PROCS_PRESET (default flux-dev), PROCS_BACKENDS (default
#                  unpatched,sage_fp8_sm90), PROCS_CFG (default 1), PROCS_STEPS, PROCS_ROUNDS, PROCS_LIMIT (seconds for each half)
#   multigpu-wan14 Wan 2.1 14B at CFG 1, 720p then 480p: auto_exact and sage_fp8_sm90 on one GPU and split (Sage also
#                  with the exchange not overlapped, cp@1, and in 4 parts, cp@4)
#   multigpu-table the table of docs/multi-gpu.md in one call (~8 min): Wan 14B 480p and 720p at CFG 1 (also one GPU on
#                  the machine's last GPU), Wan 1.3B at CFG 1 and CFG 5 (CFG Split and Context Parallel), each row against
#                  the same backend on one GPU
#   multigpu-wan14-cfg5  Wan 2.1 14B 480p at CFG 5 (~4 min): one GPU, MultiGPU CFG Split and Context Parallel with
#                  cfg_split off, with sage_fp8_sm90 and auto_exact
#   multigpu-4gpu  on a 4-GPU machine (~8 min): Wan 2.1 14B 720p and 480p at CFG 1 on one GPU and split over 2, (480p:
#                  3) and 4; 480p at CFG 5: MultiGPU CFG Split, Context Parallel with 2 GPUs per cond, and over all 4
#   multigpu-4gpu-fewer  on a 4-GPU machine (~5 min): Flux.1 dev 1024² and 1536², Qwen-Image 1328², Wan 2.1 1.3B
#                  480p/81f with auto at CFG 1 and the node's own floor, on one GPU, 2 (Wan: 3) and all 4, where the node
#                  splits each step over as many as pay; then Qwen-Image and Wan 1.3B with every step over all 4 (forced/;
#                  FEWER_FORCED=0: not)
#   multigpu-compile  Wan 2.1 1.3B 480p at CFG 1 with sage_fp8_sm90, on one GPU and split, each also under ComfyUI's
#                  TorchCompileModel (inductor; the split forwards run uncompiled); MG_ROUNDS=2: a compiled row twice
#   multigpu-more  Flux-dev 1024² at CFG 1, CFG Split unpatched vs sdpa (the pass-through's cost), Wan 14B 480p auto_exact
#                  on one GPU and split, one step of each profiled
#   multigpu-profile  one step of MG_PRESET (default wan-1.3b) with MG_BACKEND (default unpatched) under torch.profiler,
#                  on one GPU and split (the top device operations of both GPUs)
#   multigpu-diagnose  the per-call diagnosis of CFG Split's latent for MG_DIAGNOSE (default sage_fp8_sm90)
#   multigpu-floor sizes between what splits and what does not (Wan 1.3B 49/65 frames, Wan 14B 17 frames, Flux 1536²,
#                  Qwen-Image 1664²), one GPU against every forward split, unpatched and sage_fp8_sm90 (~9 min)
#   multigpu-floor-node  the same sizes and Flux 1024² with the node's own floor: which it splits, and what that gives
#   multigpu-graphs split forwards replayed as CUDA graphs (~6 min): Flux.1 dev 1024² and Qwen-Image 1328² at CFG 1, every
#                  forward split (cp: graphs, cp-eager: none) against one GPU; GRAPHS_PRESETS as FLOOR_PRESETS
#   multigpu-exchange the exchange as it is against the exchange before (EXCHANGE_BEFORE, a row's mode: cp-recv, the
#                  default, or cp-views-unplanned, ...): Flux.1 dev 1024², every forward split, unpatched / auto /
#                  auto_exact, 3 rounds (~3 min)
#   multigpu-caches ComfyUI's EasyCache and LazyCache (threshold CACHE_THRESHOLD/100, default 20) after the node, Wan 2.1
#                  1.3B 480p/81f, 10 steps, CFG 1 (CACHE_PRESET, CACHE_STEPS, CACHE_BACKEND): does the ratio multiply?
#   multigpu-smoke the same on Wan 1.3B 33 frames, three rows: does a split run at all on these GPUs
#   offload        Context Parallel against one GPU when the weights do not fit the card (tests/gpu/offload.py): a card of
#                  OFFLOAD_CARD GiB (default 24; 0: none) emulated on every GPU (PyTorch's allocator capped, ComfyUI's
#                  reserve as --reserve-vram), the weights on the CPU, ComfyUI's loader OFFLOAD_LOADER (estimate: the
#                  ModelPatcher partial load, default; dynamic: 0.33's dynamic VRAM); per row s/step, ratio and latent
#                  against one GPU, per GPU the weights on the GPU and on the CPU (pinned), peak memory; OFFLOAD_PROFILE
#                  rows: one step profiled (host-to-device copies pinned/pageable, kernel and idle time, host time in
#                  casts); OFFLOAD_PRESET (default wan-14b-720p), OFFLOAD_ROWS, OFFLOAD_STEPS, OFFLOAD_LIMIT seconds
#                  (default 480: rows that would not fit are listed as not run)
#   zoo            the model zoo (tests/gpu/zoo.py): every configuration tests/zoo builds, at its GPU sizes, in bf16, with
#                  every installed backend and auto against unpatched (ComfyUI 0.33 and comfy-kitchen from env);
#                  ZOO_BUDGET seconds (default 420), ZOO_PART=i/n splits it over several calls (zoo-gpu-<i>of<n>.json),
#                  ZOO_ONLY=a,b and ZOO_BACKENDS=a,b narrow it
#   cp-exchange    the Ulysses exchange alone, one Wan 14B 480p self-attention call over every GPU: strided shares as 2-D
#                  copies against made contiguous first, with and without the kernel, bit-identical to one GPU
#                  (tests/gpu/cp_exchange.py; CP_TOKENS, default 32760)
#   cp-compose     Context Parallel over every GPU with a LoRA-like patch before and after the node, Patch Attention
#                  after it, and torch.compile (split forwards uncompiled), then models loaded from files by the loaders users use:
#                  fp8-scaled (UNETLoader's), GGUF Q8_0 (ComfyUI-GGUF's, from comfyui-gguf.tar.xz), each against one GPU,
#                  last torch.compile with TorchCompileModel's own guard filter (compile-node); 15 s before the limit
#                  every thread's stack goes to cp-compose-stacks.txt (tests/gpu/cp_compose.py); cp-compose-dynamic:
#                  the bf16 file and the GGUF one under ComfyUI's dynamic VRAM (a process of its own); CP_COMPOSE_STEPS
#                  (default 2), CP_COMPOSE_INFERENCE=1 (sampled in inference mode, as ComfyUI does: with 4 steps or
#                  more the split forwards replay as CUDA graphs from the third)
#   cp-ltx         LTX-Video and LTX-2 split by the Context Parallel node (tests/gpu/cp_lightricks.py): 2-4 ranks on the
#                  first GPU and over the GPUs there are, bf16 and fp32, unpatched and sdpa_math, against one GPU
#   cp-hunyuan     context parallelism, HunyuanVideo 1.0/1.5 (tests/gpu/cp_hunyuan.py): the family's zoo configurations
#                  at GPU sizes in bf16, split (2 and 4 ranks on the first GPU; every GPU of the machine) against one
#                  GPU; CP_BACKENDS=a,b adds Patch Attention's backends as the local kernel
#   cp-flux        context parallelism for Flux.1/Flux.2 on every GPU of the machine (tests/gpu/cp_flux.py): the zoo's Flux
#                  configurations split over 2 and all GPUs against one GPU, and a Flux-dev-shaped model's time per step
#                  (CP_GPUS=2,4 picks the counts, CP_DEPTH its double blocks)
#   cp-zoo         context parallelism over the model zoo (tests/gpu/cp_zoo.py): every zoo configuration whose model has a
#                  context-parallel unit, at its GPU sizes in bf16, per backend on the first GPU and split over every GPU,
#                  the split latent against the one-GPU one within the backend's class, every forward split (or the
#                  unit's reason logged); backends CP_ZOO_BACKENDS (default unpatched,auto,auto_exact,sage_fp8_sm90,
#                  sdpa_cudnn,flash_attn4; those not installed are reported as such), CP_ZOO_BUDGET seconds (default
#                  270), CP_ZOO_ONLY=a,b, CP_ZOO_GPUS=n, CP_ZOO_CASE_TIMEOUT (default 60 s), CP_ZOO_DEVICE=cpu (the dry
#                  run: fp32, ranks simulated as threads); fails when a case fails
#   soak           ComfyUI's server with a tiny random-weight Wan 2.1 file, SOAK_PROMPTS (default 216) prompts through /prompt
#                  (tests/gpu/soak.py): backends SOAK_BACKENDS (default disabled,sdpa,auto,auto_exact,sage_fp8_sm90) x one
#                  GPU, Context Parallel and ComfyUI's MultiGPU CFG Split (SOAK_GPUS, default 2) x CFG 1 and 5, the backend
#                  changed between prompts; failed prompts (0 expected), host RSS and each GPU's memory (flat expected) in
#                  soak.md and soak.json, ComfyUI's log in soak-server.log; fails on a failed prompt or growth;
#                  SOAK_SERVER_ARGS=--disable-cuda-malloc: split forwards replayed as CUDA graphs, kept between prompts
#                  (ComfyUI's server imports SQLAlchemy and alembic, which the GPU machine lacks: carry their wheels,
#                  with Mako and greenlet, in $CARRY)
#   prompts        whole prompts through ComfyUI's server, one GPU against several (tests/gpu/prompts.py): the
#                  repository's API workflows on random bf16 model files in ComfyUI's layouts (tests/gpu/model_files.py,
#                  cached in PROMPTS_MODELS, default /root/pa-models); PROMPTS_ROWS (default wan22-a14b,wan21-14b,flux-dev:
#                  Wan 2.2 A14B 720p/81f 4 steps CFG 1 ~69 GB of files, Wan 2.1 14B 720p/81f 20 steps CFG 5 ~40 GB, Flux
#                  dev 1024² 20 steps ~34 GB; one row per call in practice), PROMPTS_ROUNDS (default 2) timed prompts per
#                  workflow after a warm-up, PROMPTS_LIMIT seconds (default 540: a row not expected to fit is listed as not
#                  run), PROMPTS_STEPS=ROW=N (fewer steps, the row's extrapolated; Wan 2.1 at 20 steps does not fit a
#                  call), PROMPTS_WARMUP_STEPS, PROMPTS_ORDER (grouped, the default, or alternate), PROMPTS_PROFILE=1 (each
#                  sampler's run in the server under cProfile: profile-<n>.txt), PROMPTS_SPLIT_TFLOP=graphs-pack=1.2 (the
#                  Context Parallel node's floors in the server: sizes it keeps whole, split), PROMPTS_INPUTS=
#                  PatchAttention.log_stats=false (an input set in both workflows), PROMPTS_PAIR=N (two servers at once:
#                  the one-GPU workflow on the first GPU, the several-GPU one on the next N); s/prompt, the ratio and where the time
#                  went in prompts.md and prompts.json
#                  (soak's wheels, and sentencepiece's for Wan's umT5 tokenizer where the machine lacks it)
#   nccl-threads   the GPUs' threads of one process, each a rank of an NCCL process group of its own: all-to-all eager
#                  and inside CUDA graphs (values checked), and a Flux.1-dev-sized stack of blocks with Ulysses attention,
#                  one graph per rank, against one GPU (tests/gpu/nccl_threads.py; needs no env stage)
#   model-files    the prompts stage's files written ahead, MODEL_FILES (default wan21-14b,umt5-xxl,wan-vae: Wan 2.1
#                  14B's row) into PROMPTS_MODELS (tests/gpu/model_files.py)
#   vae            the VAE decode over every GPU (tests/gpu/vae_multi.py): Wan 2.1's VAE (full size, random bf16 weights),
#                  a 720p/81f latent, ComfyUI's plain and tiled decode on the first GPU against VAE Decode (several GPUs)
#                  on all: seconds (median of VAE_ROUNDS, default 3, after a warm-up), ratios, the largest difference of
#                  the frames (VAE_ROWS, default plain,tiled,multi,multi-pageable,multi-cpu,multi-2x; -cpu blended on the
#                  CPU, -2x twice as many tiles)
#
# The runner's exit status is 1 when a stage returned non-zero (cp-zoo, cp-compose and cp-compose-dynamic on a failing case).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
PY=python3
MAIN_ROWS=unpatched,sdpa,sage,sage_fp8_sm90,sage_fp16_cuda,sparge,auto,peer:sage,peer:sage_fp8_sm90,peer:sage_fp16_cuda,peer:sparge
say() { echo "### $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }

stage_env() {
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  $PY -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda)"
  local carry=${CARRY:-.build/gpu}
  mkdir -p /tmp/kern
  [ -f "$carry/kernels.tgz" ] && tar xzf "$carry/kernels.tgz" -C /tmp/kern
  [ -f "$carry/kernels.tar.xz" ] && tar xJf "$carry/kernels.tar.xz" -C /tmp/kern
  for k in "$carry"/kitchen-*.tar.xz; do
    [ -f "$k" ] || continue
    local v; v=$(basename "$k" .tar.xz); v=${v#kitchen-}
    mkdir -p "/tmp/kitchen-$v" && tar xJf "$k" -C "/tmp/kitchen-$v"
    KITCHENS="${KITCHENS:-} $v"
  done
  export KITCHENS
  local use=${KITCHEN:-$(for v in $KITCHENS; do echo "$v"; done | sort -V | tail -1)}
  ls "$carry"/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/kern "$carry"/*.whl 2>&1 | tail -2
  for t in "$carry"/site-*.tar.xz; do  # a package's installed files, tarred (PyAV's wheel is 40 MB, its files in xz 28)
    [ -f "$t" ] && tar xJf "$t" -C /tmp/kern
  done
  export PYTHONPATH=/tmp/kern${use:+:/tmp/kitchen-$use}
  if [ -n "${FA4_SITE:-}" ]; then  # FlashAttention-4 installed with pip --target there (no .pth: its DSL's path too)
    PYTHONPATH=$PYTHONPATH:$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages
  fi
  if [ -f "$carry/comfyui.tar.xz" ]; then
    mkdir -p /tmp/comfy && tar xJf "$carry/comfyui.tar.xz" -C /tmp/comfy
    export COMFYUI_PATH=/tmp/comfy/ComfyUI
  fi
  if [ -f "$carry/comfyui-gguf.tar.xz" ]; then  # ComfyUI-GGUF, loaded as a custom node by cp_compose.py's gguf case
    mkdir -p /tmp/custom_nodes && tar xJf "$carry/comfyui-gguf.tar.xz" -C /tmp/custom_nodes
    export COMFYUI_GGUF=/tmp/custom_nodes/ComfyUI-GGUF
  fi
  echo "comfy-kitchen versions: ${KITCHENS:-none}; in use: ${use:-none}; ComfyUI: $($PY -c "import sys;sys.path.insert(0,'${COMFYUI_PATH:-.}');from comfyui_version import __version__ as v;print(v)" 2>/dev/null)"
  $PY -c "import attention; print('usable:', attention.REGISTRY.available())"
}

# compile tests run in CI; the server tier needs ComfyUI's frontend package, which this machine cannot fetch
stage_pytest() {  # PYTEST_LIMIT seconds (default 540: the suite took 409 s on an H200 machine); PYTEST_PATHS, PYTEST_K
  timeout "${PYTEST_LIMIT:-540}" $PY -m pytest ${PYTEST_PATHS:-tests} -q -rfE -p no:cacheprovider \
    -k "${PYTEST_K:-not compile and not server}" 2>&1 | tee "$OUT/pytest.txt" | tail -n 40
  return $(( PIPESTATUS[0] != 0 ))
}

stage_threads() { timeout 120 $PY -m pytest tests/test_threads.py tests/test_lanes.py -q 2>&1 | tail -n 8; }

stage_matrix-sdpa() {
  timeout 220 $PY tests/gpu/matrix.py --out "$OUT/contract-sdpa.json" --md "$OUT/contract-sdpa.md" \
    --backends sdpa,sdpa_flash,sdpa_cudnn,sdpa_efficient,sdpa_math 2>&1 | tail -n 30
}

stage_kitchen-check() { timeout 120 $PY tests/gpu/kitchen_check.py 2>&1 | tail -n 8; return $(( PIPESTATUS[0] != 0 )); }

stage_matrix-kitchen() {
  for v in $KITCHENS; do
    echo "## comfy-kitchen $v"
    PYTHONPATH=/tmp/kern:/tmp/kitchen-$v timeout 150 $PY tests/gpu/matrix.py --out "$OUT/contract-kitchen-$v.json" \
      --md "$OUT/contract-kitchen-$v.md" --backends kitchen_int8,kitchen_sol,kitchen_sol_topk \
      --options "kitchen_sol:min_tokens=128,kitchen_sol_topk:min_tokens=128" 2>&1 | tail -n 25
  done
}

stage_sol-bench() { timeout 120 $PY tests/gpu/sol_bench.py --md "$OUT/sol-bench.md" --json "$OUT/sol-bench.json" 2>&1 | tail -n 25; }

CORE_ROWS=unpatched,sdpa,sage_fp8_sm90,kitchen_int8,kitchen_sol,sparge,auto,core:kitchen-int8,core:sol-attn
stage_e2e-core() {  # the comparison with ComfyUI's own attention nodes, one round each (720p: e2e-core-720p)
  e2e e2e-core-wan 330 --preset wan-1.3b --steps 3 --rows "$CORE_ROWS"
  e2e e2e-core-image 200 --preset flux-dev --preset sdxl --steps 4 \
    --rows unpatched,sdpa,sage_fp8_sm90,kitchen_int8,kitchen_sol,auto,core:kitchen-int8,core:sol-attn
}
stage_e2e-core-720p() {  # alone: nine rows at ~4 s/step with the two-step warm-up do not fit one 10-minute call
  e2e e2e-core-720p 560 --preset wan-1.3b-720p --steps 2 --rows unpatched,sage_fp8_sm90,kitchen_sol,auto,core:kitchen-int8,core:sol-attn
}
stage_e2e-core-wan14() {
  e2e e2e-core-wan14 560 --preset wan-14b --steps 2 --rows unpatched,sage_fp8_sm90,kitchen_sol,sparge,auto,core:kitchen-int8,core:sol-attn
}
stage_e2e-core-profile() {  # where auto's time goes against core:sol-attn (the target it misses)
  e2e e2e-core-profile 500 --preset wan-1.3b --steps "${STEPS:-2}" --profile ${PROFILE_STEP:+--profile-step $PROFILE_STEP} \
    --rows "${ROWS:-unpatched,sdpa_cudnn,sparge_topk,kitchen_sol,auto,core:sol-attn}"
}
stage_e2e-core-whole() {
  e2e e2e-core-whole 500 --preset wan-1.3b --steps 10 --rounds "${ROUNDS:-1}" \
    --rows "${ROWS:-unpatched,sdpa_cudnn,kitchen_sol,auto,core:kitchen-int8,core:sol-attn}"
}
stage_e2e-core-whole-720p() {
  e2e e2e-core-whole-720p 560 --preset wan-1.3b-720p --steps 8 --rows unpatched,kitchen_sol,auto,core:sol-attn
}
stage_dynamic() {
  e2e dynamic 100 --preset wan-1.3b-33f --steps 2 --dynamic-vram --rows unpatched,sage_fp8_sm90,auto
}
stage_vram-calls() {  # one Wan 14B 720p attention call: the memory each row allocates beyond q/k/v
  timeout 200 $PY tests/gpu/vram.py --calls --preset "${PRESET:-wan-14b-720p}" \
    --rows "${ROWS:-sdpa,sdpa_cudnn,flash_attn4,sage,sage_fp8_sm90,sage_fp16_cuda,kitchen_int8,kitchen_sol,sparge}" \
    --md "$OUT/vram-calls.md" --json "$OUT/vram-calls.json" 2>&1 | tail -n 30
}
stage_vram-trace() {  # what is alive at one step's peak, per row (PRESET, ROWS)
  timeout 560 $PY tests/gpu/vram.py --trace --preset "${PRESET:-wan-14b-720p}" --rows "${ROWS:-unpatched,sage_fp8_sm90}" \
    --md "$OUT/vram-trace.md" --json "$OUT/vram-trace.json" 2>&1 | tail -n 80
}
stage_vram() {
  timeout 580 $PY tests/gpu/vram.py --preset wan-14b-720p --rows "${ROWS:-unpatched,sage_fp8_sm90}" \
    --modes "${VRAM_MODES:-plain,containers}" --md "$OUT/vram.md" --json "$OUT/vram.json" 2>&1 | tail -n 20
}

stage_matrix() {
  timeout "${MATRIX_LIMIT:-560}" $PY tests/gpu/matrix.py --out "$OUT/contract.json" --md "$OUT/contract.md" --backends "${MATRIX_BACKENDS:-}" 2>&1 \
    | tail -n 60
}

e2e() {  # name, timeout, bench_e2e arguments...  (RUN_AS: a prefix such as nice/taskset)
  local name=$1 t=$2; shift 2
  timeout "$t" ${RUN_AS:-} $PY bench_e2e.py "$@" --md "$OUT/$name.md" --json "$OUT/$name.json" 2>&1 | grep -v "row/s\]" | tail -n 40
}
IMAGE_ROWS=unpatched,sdpa,sage,peer:sage,sage_fp8_sm90,sage_fp8_sm90/no-nan-net,peer:sage_fp8_sm90,sparge,peer:sparge,auto
PAIRED_ROWS=unpatched,sdpa,sage,peer:sage,sage_fp8_sm90,peer:sage_fp8_sm90,auto
# SD1.5/SDXL are host-bound at these sizes and this host is shared: every row timed 20x in turn; the minimum is one
# estimate (contention only adds time), the paired per-round ratios with their intervals are the comparison;
# Flux-dev is GPU-bound: 3 rounds, median
# Host-bound rows are timed at raised priority on four fixed cores: the unpatched SD1.5 row then spread 27-39 ms/step
# over 20 rounds, against 28-68 ms without.
stage_e2e-image() {
  RUN_AS="nice -n -15 taskset -c 2-5" e2e e2e-image 480 --preset sd15 --preset sdxl --steps 5 --rounds 20 --stat min \
    --rows "$PAIRED_ROWS" --png "$OUT/e2e-image.png"
}
stage_e2e-flux() { e2e e2e-flux 300 --preset flux-dev --steps 10 --rounds 3 --rows "$IMAGE_ROWS"; }
stage_e2e-image-all() { e2e e2e-image-all 560 --preset sd15 --preset sdxl --preset flux-dev --steps 8 --profile; }
stage_e2e-wan() { e2e e2e-wan 560 --preset wan-1.3b --steps 4 --profile --rows "$MAIN_ROWS,sdpa_cudnn,sdpa_flash,sparge_topk,peer:sparge_topk"; }
stage_e2e-wan14() { e2e e2e-wan14 580 --preset wan-14b --steps 3 --rows unpatched,sdpa,sage_fp8_sm90,peer:sage_fp8_sm90,sparge,auto; }
stage_e2e-compile-flux() {
  e2e e2e-compile-flux 570 --preset flux-dev --steps 4 --rounds 6 --compile --rows unpatched,sdpa,sage_fp8_sm90,peer:sage_fp8_sm90,auto
}
stage_e2e-compile-wan() {
  e2e e2e-compile-wan 560 --preset wan-1.3b --steps 4 --rounds 2 --compile-only --rows unpatched,sage_fp8_sm90,peer:sage_fp8_sm90,auto
}
stage_e2e-compile() {
  e2e e2e-compile-flux 330 --preset flux-dev --steps 4 --compile --rows unpatched,sdpa,sage_fp8_sm90,peer:sage_fp8_sm90,auto
  e2e e2e-compile-wan 300 --preset wan-1.3b --steps 4 --compile --rows unpatched,sdpa,sage_fp8_sm90,peer:sage_fp8_sm90,auto
}

stage_install() {
  local before; before=$($PY -c "import torch;print(torch.__version__)")
  $PY -m pip show triton 2>/dev/null | grep -i '^version' | sed 's/^/triton /'
  t0=$(date +%s)
  timeout 450 $PY install.py --yes --mirror .src --find-links .whl --no-index --log-dir /tmp/pa-logs 2>&1 \
    | grep -v '^\s*$' | grep -v 'step/s\]' | tail -n 40
  echo "run 1 rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - t0 ))"
  grep -h "tree sha256" /tmp/pa-logs/*.log
  t0=$(date +%s)
  timeout 120 $PY install.py --yes --mirror .src --find-links .whl --no-index --log-dir /tmp/pa-logs2 --no-verify 2>&1 | tail -n 15
  echo "run 2 rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - t0 )); torch before $before after $($PY -c 'import torch;print(torch.__version__)')"
  tar czf "$OUT/install-logs.tgz" -C /tmp pa-logs 2>/dev/null
}

stage_install-manager() {
  t0=$(date +%s)
  $PY install.py < /dev/null > "$OUT/manager-run.log" 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))"
  grep -v "^\s*$" "$OUT/manager-run.log" | grep -v "step/s\]" | tail -n 30
}

stage_hostcost() { timeout 200 $PY tests/gpu/hostcost.py --md "$OUT/hostcost.md" --json "$OUT/hostcost.json" 2>&1 | tail -n 30; }

avail_rows() {  # the rows of $1 that can run here: unpatched, auto, auto_exact, core:/peer: rows, usable backends
  $PY - "$1" <<'PYEOF'
import sys
import attention as A
rows = sys.argv[1].split(",")
print(",".join(r for r in rows if r in ("unpatched", "auto", "auto_exact") or r.startswith(("core:", "peer:"))
               or (r in A.REGISTRY and A.REGISTRY.get(r).available)))
PYEOF
}
stage_exact-auto() {
  timeout 300 $PY tests/gpu/exact_auto.py --md "$OUT/exact-auto.md" --json "$OUT/exact-auto.json" 2>&1 | tail -n 30
}
stage_e2e-exact() {
  e2e e2e-exact "${E2E_LIMIT:-570}" --preset "${PRESET:-wan-1.3b}" --steps "${STEPS:-10}" \
    --rows "$(avail_rows "${ROWS:-unpatched,sdpa_cudnn,flash_attn4,auto_exact,auto,kitchen_sol,sparge}")"
}
stage_e2e-auto() {
  e2e e2e-auto "${E2E_LIMIT:-560}" --preset "${PRESET:-wan-1.3b}" --cfg "${CFG:-1}" --steps "${STEPS:-8}" --rounds "${ROUNDS:-2}" \
    --profile --profile-step "${PROFILE_STEP:-3}" \
    --rows "$(avail_rows "${ROWS:-unpatched,sage_fp8_sm90,sdpa_cudnn,auto_exact,auto,auto_fast}")"
}
stage_e2e-exact-720p() {
  e2e e2e-exact-720p "${E2E_LIMIT:-560}" --preset wan-1.3b-720p --steps "${STEPS:-2}" \
    --rows "$(avail_rows "${ROWS:-unpatched,sdpa_cudnn,flash_attn4,auto_exact}")"
}
stage_e2e-exact-image() {
  e2e e2e-exact-image 420 --preset flux-dev --preset sdxl --steps 6 \
    --rows "$(avail_rows unpatched,sdpa,sdpa_cudnn,flash_attn4,auto_exact,auto)"
}

stage_sparge() {
  timeout 120 $PY tests/gpu/sparge_sweep.py --md "$OUT/sparge.md" --json "$OUT/sparge.json" 2>&1 | tail -n 30
  timeout 200 $PY tests/gpu/sparge_tune_bench.py --md "$OUT/sparge-tune.md" --json "$OUT/sparge-tune.json" 2>&1 | tail -n 25
}

stage_quality() {
  timeout 520 $PY tests/gpu/quality.py --out "$OUT" 2>&1 | grep -v "call/s\]\|it/s\]\|row/s\]"
}
standin_rows() {  # out-folder limit-seconds budget phases quality.py-arguments...: the stand-in trained first unless
  # STANDIN_WEIGHTS exists (a quality call on this machine left it)
  local out=$1 limit=$2 budget=$3 phases=$4 skip=
  shift 4
  [ -f "${STANDIN_WEIGHTS:-/tmp/standin.safetensors}" ] && { phases=${phases#train,}; skip=--skip-train; }
  timeout "$limit" $PY tests/gpu/quality.py --out "$OUT/$out" --budget "$budget" $skip --phases "$phases" "$@" 2>&1 \
    | grep -v "call/s\]\|it/s\]\|row/s\]"
}
stage_quality-auto() {
  standin_rows auto 540 "${QUALITY_BUDGET:-480}" train,load,rows-480p,rows-720p \
    --rows unpatched,sdpa_cudnn,sage_fp8_sm90,kitchen_sol
}
QUALITY720_ROWS=unpatched,sdpa_cudnn,sage_fp8_sm90,kitchen_sol,sparge,kitchen_sol[tau=0.5],sparge[cdfthreshd=0.9]
stage_quality-720p() {  # auto and auto_fast at 720p beside the exact, 8-bit and sparse rows; two rows profiled
  local budget=${QUALITY_BUDGET:-500}
  standin_rows q720 $(( budget + 45 )) "$budget" train,load,rows-720p --rows "${QUALITY_ROWS:-$QUALITY720_ROWS}" \
    --profile-rows "${QUALITY_PROFILE_ROWS:-unpatched,sage_fp8_sm90}"
}
stage_quality-more() {
  timeout 560 $PY tests/gpu/quality.py --out "$OUT/more" --skip-train --budget "${QUALITY_BUDGET:-520}" --sweep 12 \
    --phases load,tune,rows-480p,concentration-720p,rows-720p,calibration-480p 2>&1 | grep -v "call/s\]\|it/s\]\|row/s\]"
}

FA4_DIR=${FA4_WHEELS:-${CARRY:-.build/gpu}/fa4}
FA4_END=0  # set by stage_fa4: one deadline for its four parts
fa4_limit() {  # the part's own limit, cut to what is left before FA4_END
  local own=$1 now; now=$(date +%s)
  if [ "$FA4_END" -gt 0 ]; then own=$(( own < FA4_END - now ? own : FA4_END - now )); fi
  echo $(( own > 10 ? own : 10 ))
}
stage_fa4-install() { timeout "$(fa4_limit 330)" $PY tests/gpu/fa4.py install --wheels "$FA4_DIR" --out "$OUT" 2>&1 | tail -n 70; }
stage_fa4-compile() {
  local b=${FA4_COMPILE_BUDGET:-100}
  timeout "$(fa4_limit $(( b + 100 )))" $PY tests/gpu/fa4.py compile --out "$OUT" --budget "$b" 2>&1 | tail -n 100
}
stage_fa4-mask() {
  local b=${FA4_MASK_BUDGET:-80}
  timeout "$(fa4_limit $(( b + 70 )))" $PY tests/gpu/fa4.py mask --out "$OUT" --budget "$b" 2>&1 | tail -n 40
}
stage_fa4-matrix() {
  timeout "$(fa4_limit 200)" $PY tests/gpu/matrix.py --out "$OUT/contract-fa4.json" --md "$OUT/contract-fa4.md" \
    --backends flash_attn4 2>&1 | tail -n 30
}
stage_fa4() {  # all four within FA4_TOTAL seconds (default 540: one 10-minute call with a minute to spare)
  FA4_END=$(( $(date +%s) + ${FA4_TOTAL:-540} ))
  stage_fa4-install; stage_fa4-compile; stage_fa4-mask; stage_fa4-matrix
  FA4_END=0
}

MG_ROWS_DEFAULT=1:unpatched,1:auto_exact,1:sage_fp8_sm90,1:auto,cp:unpatched,cp:auto_exact,cp:sage_fp8_sm90,cp:auto
stage_multigpu() {
  local p=${MG_PRESET:-wan-1.3b} c=${MG_CFG:-1}
  timeout "${MG_LIMIT:-540}" $PY tests/gpu/multigpu.py --preset "$p" --cfg "$c" --steps "${MG_STEPS:-3}" \
    --rows "${MG_ROWS:-$MG_ROWS_DEFAULT}" --diagnose "${MG_DIAGNOSE:-}" --profile "${MG_PROFILE:-}" --rounds "${MG_ROUNDS:-1}" \
    ${MG_MIN_TOKENS:+--min-tokens "$MG_MIN_TOKENS"} \
    --json "$OUT/multigpu-$p-cfg$c.json" --md "$OUT/multigpu-$p-cfg$c.md" 2>&1 | grep -v "it/s\]" | tail -n 60
}
MG14_ROWS=1:auto_exact,1:sage_fp8_sm90,cp@1:sage_fp8_sm90,cp:sage_fp8_sm90,cp@4:sage_fp8_sm90,cp:auto_exact
stage_multigpu-wan14() {  # Wan 2.1 14B, CFG 1: 720p, then 480p (one 10-minute call); cp@1: no overlap, cp@4: 4 parts
  MG_PRESET=wan-14b-720p MG_STEPS=2 MG_LIMIT=${MG14_LIMIT:-320} MG_ROWS=${MG14_ROWS_720P:-$MG14_ROWS} stage_multigpu
  MG_PRESET=wan-14b MG_STEPS=3 MG_LIMIT=${MG14_LIMIT_480P:-200} MG_ROWS=${MG14_ROWS_480P:-$MG14_ROWS} \
    MG_PROFILE=${MG14_PROFILE:-} stage_multigpu
}
stage_multigpu-table() {  # the table of docs/multi-gpu.md in one call: Wan 14B 480p and 720p, 1.3B at CFG 1 and CFG 5
  MG_PRESET=wan-14b MG_STEPS=3 MG_LIMIT=200 \
    MG_ROWS=1:auto_exact,last:auto_exact,cp:auto_exact,1:sage_fp8_sm90,last:sage_fp8_sm90,cp:sage_fp8_sm90,1:auto,cp:auto \
    stage_multigpu
  MG_PRESET=wan-14b-720p MG_STEPS=2 MG_LIMIT=320 \
    MG_ROWS=1:auto_exact,last:auto_exact,cp:auto_exact,1:sage_fp8_sm90,last:sage_fp8_sm90,cp:sage_fp8_sm90 stage_multigpu
  MG_PRESET=wan-1.3b MG_STEPS=3 MG_LIMIT=90 \
    MG_ROWS=1:unpatched,1:auto_exact,1:sage_fp8_sm90,1:auto,cp:unpatched,cp:auto_exact,cp:sage_fp8_sm90,cp:auto stage_multigpu
  MG_PRESET=wan-1.3b MG_CFG=5 MG_STEPS=3 MG_LIMIT=90 \
    MG_ROWS=1:unpatched,1:sage_fp8_sm90,cfg:unpatched,cfg:sage_fp8_sm90,cp:unpatched,cp:sage_fp8_sm90 stage_multigpu
}
stage_multigpu-procs() {  # threads (the node today) against a process per GPU, every forward split (PROCS_PRESET: one or
  # several, comma-separated; PROCS_BACKENDS; PROCS_MODES: the process rows' modes, e.g. 1,1-g,procs-a2a,procs-a2a-g;
  # PROCS_THREADS=0: no thread rows)
  local p b=${PROCS_BACKENDS:-unpatched,sage_fp8_sm90} modes=${PROCS_MODES:-1,procs} status=0
  local rows=() prows=() x y
  for x in ${b//,/ }; do
    rows+=("1:$x" "cp:$x")
    for y in ${modes//,/ }; do prows+=("$y:$x"); done
  done
  for p in $(echo "${PROCS_PRESET:-flux-dev}" | tr , ' '); do
    if [ "${PROCS_THREADS:-1}" != 0 ]; then
      MG_PRESET=$p MG_CFG=${PROCS_CFG:-1} MG_STEPS=${PROCS_STEPS:-4} MG_MIN_TOKENS=0 MG_LIMIT=${PROCS_LIMIT:-240} \
        MG_ROUNDS=${PROCS_ROUNDS:-2} MG_ROWS=$(IFS=,; echo "${rows[*]}") stage_multigpu
    fi
    timeout "${PROCS_LIMIT:-240}" $PY tests/gpu/multigpu_procs.py --preset "$p" --steps "${PROCS_STEPS:-4}" \
      --rounds "${PROCS_ROUNDS:-2}" --cfg "${PROCS_CFG:-1}" --rows "$(IFS=,; echo "${prows[*]}")" \
      --json "$OUT/procs-$p.json" --md "$OUT/procs-$p.md" 2>&1 | grep -v "it/s\]" | tail -n 30
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  return $status
}
stage_multigpu-floor() {  # where splitting starts to pay, under the node's threads, every forward split (FLOOR_PRESETS:
  # preset=seconds, comma-separated; FLOOR_ROWS: the rows of each)
  local x p status=0
  for x in $(echo "${FLOOR_PRESETS:-wan-1.3b-49f=70,wan-1.3b-65f=70,flux-dev-1536=90,wan-14b-17f=110,qwen-image-1664=130}" | tr , ' '); do
    p=${x%%=*}
    MG_PRESET=$p MG_STEPS=${FLOOR_STEPS:-3} MG_ROUNDS=${FLOOR_ROUNDS:-2} MG_MIN_TOKENS=0 MG_LIMIT=${x#*=} \
      MG_ROWS=${FLOOR_ROWS:-1:unpatched,cp:unpatched,1:sage_fp8_sm90,cp:sage_fp8_sm90} stage_multigpu || status=1
  done
  return $status
}
stage_multigpu-graphs() {  # CUDA graphs of split forwards against the eager split and one GPU (GRAPHS_PRESETS: preset=seconds)
  local x p status=0
  for x in $(echo "${GRAPHS_PRESETS:-flux-dev=150,qwen-image=240}" | tr , ' '); do
    p=${x%%=*}
    MG_PRESET=$p MG_STEPS=${GRAPHS_STEPS:-6} MG_ROUNDS=${GRAPHS_ROUNDS:-2} MG_MIN_TOKENS=${GRAPHS_MIN_TOKENS-0} \
      MG_LIMIT=${x#*=} MG_ROWS=${GRAPHS_ROWS:-1:unpatched,cp:unpatched,cp-eager:unpatched,1:sage_fp8_sm90,cp:sage_fp8_sm90,1:auto_exact,cp:auto_exact} \
      stage_multigpu || status=1
  done
  return $status
}
stage_multigpu-exchange() {  # the exchange as it is against EXCHANGE_BEFORE's (a row mode), Flux every forward split
  local r rows="" before=${EXCHANGE_BEFORE:-cp-recv}
  for r in unpatched auto auto_exact; do rows="$rows,1:$r,cp:$r,$before:$r"; done
  GRAPHS_PRESETS=flux-dev=${EXCHANGE_LIMIT:-240} GRAPHS_ROUNDS=${EXCHANGE_ROUNDS:-3} GRAPHS_ROWS=${rows#,} \
    stage_multigpu-graphs
}
stage_multigpu-floor-node() {  # the node's own floor (no --min-tokens) on sizes either side of it: what a user gets
  MG_PRESET=flux-dev MG_STEPS=4 MG_ROUNDS=2 MG_LIMIT=80 MG_ROWS=1:unpatched,cp:unpatched,1:sage_fp8_sm90,cp:sage_fp8_sm90 \
    stage_multigpu
  local x
  for x in wan-1.3b-49f=70 flux-dev-1536=80 wan-14b-17f=100; do
    MG_PRESET=${x%%=*} MG_STEPS=3 MG_ROUNDS=2 MG_LIMIT=${x#*=} \
      MG_ROWS=1:unpatched,cp:unpatched,1:sage_fp8_sm90,cp:sage_fp8_sm90 stage_multigpu
  done
}
stage_multigpu-caches() {  # ComfyUI's EasyCache and LazyCache after the node: one GPU against the split, each cached
  local t=${CACHE_THRESHOLD:-20} b=${CACHE_BACKEND:-unpatched}
  MG_PRESET=${CACHE_PRESET:-wan-1.3b} MG_STEPS=${CACHE_STEPS:-10} MG_LIMIT=${CACHE_LIMIT:-240} \
    MG_ROWS=1:$b,cp:$b,1-easycache$t:$b,cp-easycache$t:$b,1-lazycache$t:$b,cp-lazycache$t:$b stage_multigpu
}
stage_multigpu-wan14-cfg5() {  # Wan 2.1 14B 480p at CFG 5: CFG Split against Context Parallel (cfg_split off)
  MG_PRESET=wan-14b MG_CFG=5 MG_STEPS=2 MG_LIMIT=${MG_LIMIT:-280} \
    MG_ROWS=1:sage_fp8_sm90,cfg:sage_fp8_sm90,cp:sage_fp8_sm90,1:auto_exact,cfg:auto_exact,cp:auto_exact stage_multigpu
}
stage_multigpu-4gpu() {  # on 4 GPUs: Wan 2.1 14B at CFG 1 over 2, 3 and 4 of them; 480p at CFG 5 with CFG Split, 2 per cond, 4
  local r=1:auto_exact,cp-g2:auto_exact,cp:auto_exact,1:sage_fp8_sm90,cp-g2:sage_fp8_sm90,cp:sage_fp8_sm90
  MG_PRESET=wan-14b-720p MG_STEPS=2 MG_LIMIT=230 MG_ROWS=$r stage_multigpu
  MG_PRESET=wan-14b MG_STEPS=3 MG_LIMIT=130 MG_ROWS=$r,cp-g3:auto_exact stage_multigpu
  MG_PRESET=wan-14b MG_CFG=5 MG_STEPS=2 MG_LIMIT=140 \
    MG_ROWS=1:sage_fp8_sm90,cfg:sage_fp8_sm90,cp-cfg:sage_fp8_sm90,cp:sage_fp8_sm90 stage_multigpu
}
stage_multigpu-4gpu-fewer() {  # on 4 GPUs: the node's own floor picks how many GPUs a step splits over (gpus_for)
  local x p r s l
  for x in flux-dev=6=70 flux-dev-1536=6=90 qwen-image=6=100 wan-1.3b=3=100; do
    IFS== read -r p s l <<< "$x"
    r=1:auto,cp-g2:auto,cp:auto
    [ "$p" = wan-1.3b ] && r=1:auto,cp-g2:auto,cp-g3:auto,cp:auto
    MG_PRESET=$p MG_STEPS=$s MG_ROUNDS=2 MG_LIMIT=$l MG_ROWS=$r stage_multigpu
  done
  [ "${FEWER_FORCED:-1}" = 1 ] || return 0
  mkdir -p "$OUT/forced"  # every forward over all four, where the node splits over fewer
  for x in qwen-image=6=70 wan-1.3b=3=70; do
    IFS== read -r p s l <<< "$x"
    OUT=$OUT/forced MG_PRESET=$p MG_STEPS=$s MG_ROUNDS=2 MG_LIMIT=$l MG_MIN_TOKENS=0 MG_ROWS=1:auto,cp:auto stage_multigpu
  done
}
stage_multigpu-compile() {  # Wan 2.1 1.3B 480p at CFG 1 (host-bound split) with TorchCompileModel after the node
  MG_PRESET=wan-1.3b MG_STEPS=3 MG_LIMIT=${MG_LIMIT:-500} \
    MG_ROWS=1:sage_fp8_sm90,cp:sage_fp8_sm90,1-compile:sage_fp8_sm90,cp-compile:sage_fp8_sm90 stage_multigpu
}
stage_multigpu-more() {  # Flux-dev 1024² at CFG 1, CFG Split's pass-through (Wan 1.3B, CFG 5), Wan 14B 480p profiled
  MG_PRESET=flux-dev MG_STEPS=4 MG_LIMIT=170 MG_MIN_TOKENS=0 \
    MG_ROWS=1:unpatched,cp:unpatched,1:auto_exact,cp:auto_exact,1:sage_fp8_sm90,cp:sage_fp8_sm90 stage_multigpu
  MG_PRESET=wan-1.3b MG_CFG=5 MG_STEPS=3 MG_LIMIT=110 MG_ROWS=1:unpatched,1:sdpa,cfg:unpatched,cfg:sdpa stage_multigpu
  MG_PRESET=wan-14b MG_STEPS=2 MG_LIMIT=100 MG_ROWS=1:auto_exact,cp:auto_exact MG_PROFILE=1:auto_exact,cp:auto_exact \
    stage_multigpu
}
stage_multigpu-profile() {  # one step of MG_PRESET with MG_BACKEND profiled on one GPU and split (where the time goes)
  local b=${MG_BACKEND:-unpatched}
  MG_STEPS=2 MG_LIMIT=${MG_LIMIT:-150} MG_ROWS=1:$b,cp:$b MG_PROFILE=1:$b,cp:$b stage_multigpu
}
stage_multigpu-diagnose() {  # why Sage's CFG Split latent differs from one GPU's (Wan 1.3B 480p, CFG 5)
  MG_CFG=5 MG_ROWS=none MG_DIAGNOSE=${MG_DIAGNOSE:-sage_fp8_sm90} MG_LIMIT=90 stage_multigpu
}
stage_multigpu-smoke() {
  MG_PRESET=wan-1.3b-33f MG_STEPS=2 MG_LIMIT=240 MG_ROWS=1:unpatched,cp:unpatched,cp:sdpa_math stage_multigpu
}

OFFLOAD_ROWS_DEFAULT=1:sage_fp8_sm90,cp:sage_fp8_sm90,1:unpatched,cp:unpatched
stage_offload() {  # weights beyond an emulated card, on the CPU: one GPU against Context Parallel, per GPU what loaded
  local p=${OFFLOAD_PRESET:-wan-14b-720p} l=${OFFLOAD_LOADER:-estimate} c=${OFFLOAD_CARD:-24} limit=${OFFLOAD_LIMIT:-480}
  timeout $(( ${limit%.*} + 60 )) $PY tests/gpu/offload.py --preset "$p" --loader "$l" --card-gib "$c" \
    --steps "${OFFLOAD_STEPS:-2}" --rows "${OFFLOAD_ROWS:-$OFFLOAD_ROWS_DEFAULT}" --profile "${OFFLOAD_PROFILE:-}" \
    --limit "$limit" --json "$OUT/offload-$p-$l-card$c.json" --md "$OUT/offload-$p-$l-card$c.md" 2>&1 \
    | grep -v "it/s\]" | tail -n 60
  return $(( PIPESTATUS[0] != 0 ))
}

stage_zoo() {
  local part=${ZOO_PART:-1/1} budget=${ZOO_BUDGET:-420}
  local tag=${part/\//of}
  timeout $(( ${budget%.*} + 100 )) $PY tests/gpu/zoo.py --json "$OUT/zoo-gpu-$tag.json" --md "$OUT/zoo-gpu-$tag.md" \
    --budget "$budget" --part "$part" > "$OUT/zoo-gpu-$tag.txt" 2>&1
  echo "tests/gpu/zoo.py exit status $? (part $part); every case in zoo-gpu-$tag.txt"
  grep -E "FAIL|CRASH|^zoo:|Traceback|Error" "$OUT/zoo-gpu-$tag.txt" | tail -n 80
}

stage_cp-exchange() {
  timeout 150 $PY tests/gpu/cp_exchange.py --tokens "${CP_TOKENS:-32760}" --json "$OUT/cp-exchange.json" 2>&1 | tail -n 16
}

stage_cp-compose() {  # Context Parallel with a LoRA before/after it, Patch Attention after it, torch.compile, fp8, GGUF
  local limit=${CP_COMPOSE_LIMIT:-420}  # every thread's stack in cp-compose-stacks.txt 15 s before the limit
  timeout "$limit" $PY tests/gpu/cp_compose.py --preset "${CP_COMPOSE_PRESET:-wan-1.3b-33f}" \
    --steps "${CP_COMPOSE_STEPS:-2}" --stacks "$OUT/cp-compose-stacks.txt" --stacks-after $(( limit - 15 )) \
    --cases "${CP_COMPOSE_CASES:-lora-before,lora-after,patch-after,compile,fp8-scaled,gguf,compile-node}" \
    --json "$OUT/cp-compose.json" 2>&1 | grep -E "^cp-compose|Traceback|Error" | tail -n 30
  return $(( PIPESTATUS[0] != 0 ))
}
stage_cp-compose-dynamic() {  # the file cases under ComfyUI's dynamic VRAM: switched on before any model loads
  timeout "${CP_COMPOSE_LIMIT:-300}" $PY tests/gpu/cp_compose.py --preset "${CP_COMPOSE_PRESET:-wan-1.3b-33f}" \
    --steps "${CP_COMPOSE_STEPS:-2}" ${CP_COMPOSE_INFERENCE:+--inference} --dynamic-vram --cases "${CP_COMPOSE_DYNAMIC_CASES:-dynamic,gguf}" --json "$OUT/cp-compose-dynamic.json" 2>&1 \
    | grep -E "^cp-compose|Traceback|Error" | tail -n 30
  return $(( PIPESTATUS[0] != 0 ))
}

stage_cp-ltx() {
  timeout "${CP_LIMIT:-400}" $PY tests/gpu/cp_lightricks.py --json "$OUT/cp-ltx.json" 2>&1 | grep -v "it/s\]" | tail -n 60
}

stage_cp-hunyuan() {
  timeout 560 $PY tests/gpu/cp_hunyuan.py --json "$OUT/cp-hunyuan.json" --backends "${CP_BACKENDS:-}" \
    > "$OUT/cp-hunyuan.txt" 2>&1
  echo "tests/gpu/cp_hunyuan.py exit status $?"
  grep -E "^cp |FAIL|CRASH|Traceback|Error" "$OUT/cp-hunyuan.txt" | tail -n 80
}

stage_cp-flux() {
  timeout 560 $PY tests/gpu/cp_flux.py --json "$OUT/cp-flux.json" --md "$OUT/cp-flux.md" --gpus "${CP_GPUS:-}" \
    --depth "${CP_DEPTH:-4}" > "$OUT/cp-flux.txt" 2>&1
  echo "tests/gpu/cp_flux.py exit status $?"
  tail -n 40 "$OUT/cp-flux.txt"
}

CP_ZOO_BACKENDS_DEFAULT=unpatched,auto,auto_exact,sage_fp8_sm90,sdpa_cudnn,flash_attn4
stage_cp-zoo() {
  local budget=${CP_ZOO_BUDGET:-270} rc
  timeout $(( ${budget%.*} + 90 )) $PY tests/gpu/cp_zoo.py --json "$OUT/cp-zoo.json" --md "$OUT/cp-zoo.md" \
    --budget "$budget" --backends "${CP_ZOO_BACKENDS:-$CP_ZOO_BACKENDS_DEFAULT}" --gpus "${CP_ZOO_GPUS:-0}" \
    --case-timeout "${CP_ZOO_CASE_TIMEOUT:-60}" --device "${CP_ZOO_DEVICE:-cuda}" ${CP_ZOO_ONLY:+--only "$CP_ZOO_ONLY"} \
    > "$OUT/cp-zoo.txt" 2>&1
  rc=$?
  echo "tests/gpu/cp_zoo.py exit status $rc; every case in cp-zoo.txt, the table in cp-zoo.md"
  grep -E "FAIL|CRASH|^    \| |^cp-zoo:|Traceback|Error" "$OUT/cp-zoo.txt" | grep -vE ": not (installed|runnable here) \(" \
    | tail -n 100
  echo "not run here (cases):"
  grep -E "^cp-zoo [^ ]+ [^ ]+: not (installed|runnable here) \(" "$OUT/cp-zoo.txt" | sed -E 's/^cp-zoo [^ ]+ //' \
    | sort | uniq -c
  return $(( rc != 0 ))
}

stage_soak() {
  timeout "${SOAK_LIMIT:-540}" $PY tests/gpu/soak.py --out "$OUT" --prompts "${SOAK_PROMPTS:-216}" \
    --backends "${SOAK_BACKENDS:-disabled,sdpa,auto,auto_exact,sage_fp8_sm90}" --gpus "${SOAK_GPUS:-2}" \
    ${SOAK_SERVER_ARGS:+--server-args="$SOAK_SERVER_ARGS"} > "$OUT/soak.txt" 2>&1
  local rc=$?
  echo "tests/gpu/soak.py exit status $rc; every prompt in soak.txt and soak.md"
  grep -E "FAILED|Traceback|Error" "$OUT/soak.txt" | head -n 20
  head -n 16 "$OUT/soak.md" 2>/dev/null
  return $(( rc != 0 ))
}

stage_prompts() {  # whole prompts, one GPU against several: one row per call in practice (PROMPTS_ROWS)
  local limit=${PROMPTS_LIMIT:-540}
  timeout $(( ${limit%.*} + 60 )) $PY tests/gpu/prompts.py --out "$OUT" --rows "${PROMPTS_ROWS:-wan22-a14b,wan21-14b,flux-dev}" \
    --rounds "${PROMPTS_ROUNDS:-2}" --limit "$limit" --models "${PROMPTS_MODELS:-/root/pa-models}" \
    ${PROMPTS_STEPS:+--steps "$PROMPTS_STEPS"} ${PROMPTS_WARMUP_STEPS:+--warmup-steps "$PROMPTS_WARMUP_STEPS"} \
    ${PROMPTS_ORDER:+--order "$PROMPTS_ORDER"} ${PROMPTS_PROFILE:+--profile} ${PROMPTS_SERVER_ARGS:+--server-args="$PROMPTS_SERVER_ARGS"} \
    ${PROMPTS_SPLIT_TFLOP:+--split-tflop "$PROMPTS_SPLIT_TFLOP"} ${PROMPTS_INPUTS:+--inputs "$PROMPTS_INPUTS"} ${PROMPTS_PAIR:+--pair "$PROMPTS_PAIR"} \
    > "$OUT/prompts.txt" 2>&1
  local rc=$?
  echo "tests/gpu/prompts.py exit status $rc; every prompt in prompts.txt and prompts.md, ComfyUI's log in prompts-server*.log"
  grep -E "^prompts |^model files:|Traceback|Error" "$OUT/prompts.txt" | tail -n 40
  sed -n '/^| row |/,/^## Every prompt/p' "$OUT/prompts.md" 2>/dev/null | head -n 30
  return $(( rc != 0 ))
}

stage_nccl-threads() {  # NCCL_THREADS_STAGES (default eager,graph,blocks); NCCL_THREADS_ENV: NCCL settings for this stage
  env ${NCCL_THREADS_ENV:-} timeout 420 $PY tests/gpu/nccl_threads.py --stages "${NCCL_THREADS_STAGES:-eager,graph,blocks}" --hang "${NCCL_THREADS_HANG:-0}" \
    --md "$OUT/nccl-threads${NCCL_THREADS_TAG:-}.md" --json "$OUT/nccl-threads${NCCL_THREADS_TAG:-}.json" 2>&1 | tail -n 60
}

stage_model-files() {  # the prompts stage's random-weight files written ahead (a call of their own before a long row)
  timeout "${MODEL_FILES_LIMIT:-300}" $PY tests/gpu/model_files.py --models "${PROMPTS_MODELS:-/root/pa-models}" \
    --only "${MODEL_FILES:-wan21-14b,umt5-xxl,wan-vae}" --evict 2>&1 | tail -n 12
  return $(( PIPESTATUS[0] != 0 ))
}

stage_vae() {
  timeout "${VAE_LIMIT:-300}" $PY tests/gpu/vae_multi.py --rounds "${VAE_ROUNDS:-3}" \
    --rows "${VAE_ROWS:-plain,tiled,multi,multi-pageable,multi-cpu,multi-2x}" --json "$OUT/vae-multi.json" --md "$OUT/vae-multi.md" 2>&1 \
    | grep -v "it/s\]" | tail -n 30
  return $(( PIPESTATUS[0] != 0 ))
}

[ $# -gt 0 ] || { sed -n '2,/^set -u$/{/^#/p;}' "$0"; exit 2; }
for s in "$@"; do
  declare -F "stage_$s" >/dev/null || { echo "unknown stage $s"; exit 2; }
done
status=0
for s in "$@"; do
  say "$s"
  "stage_$s" > >(tee -a "$OUT/$s.log") 2>&1 || { status=1; say "$s returned non-zero"; }  # not a pipe: stage_env's exports must reach later stages
done
say "done"
exit $status
