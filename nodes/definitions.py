"""The nodes, declared once as data; ``v1.py`` and ``v3.py`` turn them into ComfyUI node classes."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..attention import REGISTRY, environment, report_rows
from ..attention.backends.kitchen import SOL_BOUNDS, SOL_DEFAULTS, SOL_TOPK_DEFAULTS, check_sol_options
from ..attention.backends.sparge import BOUNDS, DEFAULTS
from ..attention.sparge_profile import (
    SOL_VARIANTS,
    SPARGE_VARIANTS,
    VARIANTS,
    SpargeProfile,
    default_options,
    fingerprint_state_dict,
)
from ..attention.sparge_tune import DEFAULT_BUDGET
from . import files
from .patch import GATE_OWN, SPARSE_START, patch_model, tune_model

CATEGORY = "model_patches/attention"
# The settings that SpargeAttn Settings and Sol-Attn Settings hand to Patch Attention. Saved workflows keep loading
# across the rename from SPARGE_SETTINGS: links are restored by slot, and the input keeps its id (sparge_settings).
SPARGE_TYPE = "SPARSE_SETTINGS"


@dataclass
class In:
    name: str
    kind: str  # MODEL, COMBO, BOOLEAN, FLOAT, INT, STRING, or a custom type name
    default: object = None
    tooltip: str = ""
    optional: bool = False
    options: list = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    step: float | None = None
    multiline: bool = False
    label: str = ""  # what the UI shows where it differs from the id saved in workflows

    def choices(self) -> list:
        """A COMBO's entries; ``options`` may be a function (a file list, read each time ComfyUI asks for the nodes)."""
        return list(self.options() if callable(self.options) else self.options)


@dataclass
class Node:
    node_id: str
    display_name: str
    description: str
    inputs: list
    outputs: list  # [(kind, name)]
    fn: Callable
    output_node: bool = False
    category: str = CATEGORY
    # checks some inputs before the run, in ComfyUI's prompt validation: ``validate(cls, <input names>...)`` returns
    # True or the reason; an input it names skips core's own check (a profile list accepts the empty name of old files)
    validate: Callable | None = None


def backend_choices() -> list[str]:
    return ["auto", "disabled", "auto_exact", "auto_fast", *REGISTRY.names()]


def accuracy_text() -> str:
    """The backends by accuracy class, from the registry (for the backend tooltip)."""
    from ..attention.registry import ACCURACY

    by = {}
    for b in REGISTRY.backends():
        by.setdefault(b.accuracy, []).append(b.name)
    parts = []
    for key, cls in ACCURACY.items():
        if key in by:
            bound = "no bound, checked on first use" if cls.max_rel_l1 == float("inf") else f"rel-L1 <= {cls.max_rel_l1}"
            parts.append(f"{key} ({bound}): {', '.join(by[key])}")
    return "; ".join(parts)


BACKEND_TOOLTIP = (
    "auto: measures the kernels this GPU can run on your model, keeps the fastest within cos 0.999 / rel-L1 0.039 "
    "of exact, checked on each layer as it runs. Stand-in, H100, ComfyUI 0.33: 8-bit like sage_fp8_sm90, x1.62 "
    "(480p) / x1.94 (720p) over unpatched, 2.4 / 2.1 dB below exact (auto: pending).\n"
    "auto_fast: the earlier auto (cos 0.995 / rel-L1 0.08, judged on the calls it times): sparse kernels where they "
    "pass. Stand-in, H100, ComfyUI 0.33: x1.68 over unpatched at 12.6 dB below exact (480p), x1.92 at 8.5 dB (720p).\n"
    "auto_exact: the same among exact kernels only (SDPA's kernels, FlashAttention 2/3/4, xformers): the fastest "
    "kernel with no 8-bit or sparse error.\n"
    "sdpa: ComfyUI's own attention. disabled: removes an earlier patch. Any other entry forces one kernel; calls it "
    "cannot take, and the calls left dense (schedule, dense_layers), run on the fastest exact kernel, counted. "
    "By accuracy: " + accuracy_text() + ". Attention Backends Info shows what is installed here."
)


# ---------------------------------------------------------------- Patch Attention

def run_patch(model, backend, fallback=True, start_percent=0.0, end_percent=1.0, dense_layers="", log_stats=False,
              sparge_settings=None, auto_retune=False, auto_min_cos=GATE_OWN, auto_max_rel_l1=GATE_OWN,
              check_finite=True, sparse_start_percent=SPARSE_START):
    if sparge_settings is not None and sparge_settings.profile is not None:
        fp = fingerprint_state_dict(model.model.diffusion_model.state_dict())
        sparge_settings.profile.check_model(fp, type(model.model.diffusion_model).__name__)
    if sparge_settings is not None and backend not in ("auto", "auto_fast", "disabled", sparge_settings.variant):
        raise ValueError(f"the sparse-attention settings are for {sparge_settings.variant}, the backend is {backend}: "
                         f"choose {sparge_settings.variant} or auto, or connect settings for {backend}")
    m = patch_model(
        model, backend, fallback=fallback, start_percent=start_percent, end_percent=end_percent,
        dense_layers=dense_layers, log_stats=log_stats, sparge=sparge_settings, auto_retune=auto_retune,
        auto_min_cos=auto_min_cos, auto_max_rel_l1=auto_max_rel_l1, check_finite=check_finite,
        sparse_start_percent=sparse_start_percent,
    )
    return (m,)


PATCH = Node(
    node_id="PatchAttention",
    display_name="Patch Attention",
    description="Returns a clone of the model whose attention runs on the chosen kernel. The input model is untouched.",
    inputs=[
        In("model", "MODEL"),
        In("backend", "COMBO", "auto", BACKEND_TOOLTIP, options=backend_choices()),
        In("fallback", "BOOLEAN", True, "On: a call the backend cannot take runs on the fastest exact kernel for its shape, "
           "counted and logged once. Off: such a call stops the run with the reason."),
        In("start_percent", "FLOAT", 0.0, "Use the chosen backend from this fraction of the sampling schedule on; the fastest exact kernel before.",
           min=0.0, max=1.0, step=0.01),
        In("end_percent", "FLOAT", 1.0, "Use the chosen backend until this fraction of the schedule; the fastest exact kernel after.",
           min=0.0, max=1.0, step=0.01),
        In("dense_layers", "STRING", "", "Attention layers kept dense (the fastest exact kernel), by index within one model forward: "
           "'0-3, 10, 50-'. Flux: 0-18 double blocks, 19-56 single blocks.", ),
        In("log_stats", "BOOLEAN", False, "After each sampling run, log calls, fallbacks and GPU time per backend."),
        In("sparge_settings", SPARGE_TYPE, None, "Settings (and a per-layer profile) from a SpargeAttn Settings or "
           "Sol-Attn Settings node; they apply to that node's kernel, chosen here or by auto.",
           optional=True, label="sparse_settings"),
        In("auto_retune", "BOOLEAN", False, "auto, auto_fast, auto_exact: measure again instead of using remembered decisions.",
           optional=True),
        In("auto_min_cos", "FLOAT", GATE_OWN, "auto, auto_fast: the cosine to exact attention a lossy kernel must keep. 0: "
           "the choice's own (auto 0.999, auto_fast 0.995); 0.995, the default of earlier versions, reads as 0 too.",
           optional=True, min=0.0, max=1.0, step=0.0005),
        In("auto_max_rel_l1", "FLOAT", GATE_OWN, "auto, auto_fast: the relative L1 error a lossy kernel must stay within. "
           "0: the choice's own (auto 0.039, auto_fast 0.08); 0.08, the default of earlier versions, reads as 0 too.",
           optional=True, min=0.0, max=1.0, step=0.005),
        In("check_finite", "BOOLEAN", True, "Check quantized kernels' output for NaN/inf and redo such a call on an exact kernel "
           "(SageAttention returns NaN when all keys are equal, e.g. a zeroed negative prompt). Each call is checked on a "
           "run's first step, then each step's output (per call throughout for models that hide NaN, e.g. Flux); one GPU "
           "sync per step.",
           optional=True),
        In("sparse_start_percent", "FLOAT", SPARSE_START, "Sparse kernels (SpargeAttn, Sol-Attn) only from this fraction "
           "of the schedule on (the early steps set the layout; ComfyUI's Model Sparse Attention waits 20 % too). "
           "Before it, a sparse backend runs on the fastest exact kernel and auto chooses among the other kernels.",
           optional=True, min=0.0, max=1.0, step=0.01),
    ],
    outputs=[("MODEL", "model")],
    fn=run_patch,
)


# ---------------------------------------------------------------- SpargeAttn Settings

@dataclass
class SpargeSettings:
    variant: str
    options: dict
    profile: SpargeProfile | None = None
    report_error_every: int = 0

    def layer_options(self, layer, call):
        if self.profile is None:
            return None
        return self.profile.thresholds(layer)

    def __deepcopy__(self, memo):
        return self


def run_sparge_settings(variant, simthreshd1, cdfthreshd, pvthreshd, topk=0.5, profile="", report_error_every=0):
    opts = default_options(variant)
    opts.update({"simthreshd1": simthreshd1, "pvthreshd": pvthreshd})
    if variant == "sparge_topk":
        opts["topk"] = topk
    else:
        opts["cdfthreshd"] = cdfthreshd
    return (SpargeSettings(variant, opts, load_profile(profile, variant, SPARGE_NAME), int(report_error_every or 0)),)


def load_profile(profile: str, variant: str, node: str) -> SpargeProfile | None:
    """The per-layer profile chosen in ``node`` (None for none), a file in models/sparge_profiles, which must be
    ``variant``'s."""
    path = files.resolve_profile(profile, node)
    if path is None:
        return None
    prof = SpargeProfile.load(path)
    if prof.variant != variant:
        raise ValueError(f"{node}: profile {profile.strip()} was tuned for {prof.variant}, this node selects {variant}")
    return prof


def profile_validator(node: str):
    """Prompt validation of ``node``'s profile input: none, empty (workflows saved before the list) or a listed file."""

    def validate(cls, profile=None):
        try:
            files.resolve_profile(profile, node)
        except files.FileNameError as e:
            return str(e)
        return True

    return validate


PROFILE_TOOLTIP = ("Optional per-layer profile from Tune Sparse Attention: a file in models/sparge_profiles (press R to "
                   "refresh the list). Layers without an entry use the values above.")


SPARGE_NAME = "SpargeAttn Settings"
SPARGE = Node(
    node_id="SpargeAttnSettings",
    display_name=SPARGE_NAME,
    description="Thresholds for the SpargeAttn backends of Patch Attention, per model, optionally per layer from a profile.",
    inputs=[
        In("variant", "COMBO", "sparge", "sparge: SpargeAttn on SageAttention2; sparge_topk: keep the top-k blocks; "
           "sparge_sage1: on SageAttention1 kernels.", options=list(SPARGE_VARIANTS)),
        In("simthreshd1", "FLOAT", DEFAULTS["simthreshd1"], "Block self-similarity above which a block may be skipped "
           "(higher: fewer skipped, more accurate).", min=BOUNDS["simthreshd1"][0], max=BOUNDS["simthreshd1"][1], step=0.01),
        In("cdfthreshd", "FLOAT", DEFAULTS["cdfthreshd"], "Share of attention mass kept per row (lower: sparser, faster, less accurate).",
           min=BOUNDS["cdfthreshd"][0], max=BOUNDS["cdfthreshd"][1], step=0.001),
        In("pvthreshd", "FLOAT", float(DEFAULTS["pvthreshd"]), "PV-stage skip threshold (higher: fewer skipped).",
           min=BOUNDS["pvthreshd"][0], max=1000.0, step=1.0),
        In("topk", "FLOAT", 0.5, "sparge_topk only: fraction of key blocks kept per query block.", optional=True,
           min=0.0, max=1.0, step=0.01),
        In("profile", "COMBO", files.NONE, PROFILE_TOOLTIP, optional=True, options=files.profile_names),
        In("report_error_every", "INT", 0, "With Patch Attention's log_stats: per-layer sparsity, and every N-th call of a layer "
           "also its rel-L1 error vs dense SDPA (0: sparsity only). Costs a dense call each time.", optional=True,
           min=0, max=1000, step=1),
    ],
    outputs=[(SPARGE_TYPE, "sparse_settings")],
    fn=run_sparge_settings,
    validate=profile_validator(SPARGE_NAME),
)


# ---------------------------------------------------------------- Sol-Attn Settings

def run_sol_settings(method, tau=SOL_DEFAULTS["tau"], keep_percent=100 * SOL_TOPK_DEFAULTS["keep_ratio"],
                     extra_tokens=SOL_DEFAULTS["extra_tokens"], min_tokens=SOL_DEFAULTS["min_tokens"], profile=""):
    opts = {"extra_tokens": int(extra_tokens), "min_tokens": int(min_tokens)}
    if method == "kitchen_sol":
        opts["tau"] = float(tau)
    else:
        opts["keep_ratio"] = float(keep_percent) / 100.0
    return (SpargeSettings(method, check_sol_options(opts), load_profile(profile, method, SOL_NAME)),)


SOL_NAME = "Sol-Attn Settings"
SOL = Node(
    node_id="SolAttnSettings",
    display_name=SOL_NAME,
    description="Options for comfy-kitchen's Sol-Attn kernels in Patch Attention (the kernel of ComfyUI's Model Sparse "
                "Attention node), per model, optionally per layer from a tuned profile. Needs comfy-kitchen 0.2.40 or "
                "later (ComfyUI 0.33 comes with 0.2.31: Attention Backends Info says how to add it).",
    inputs=[
        In("method", "COMBO", "kitchen_sol", "kitchen_sol: a training-free threshold tau picks the key blocks each query "
           "block attends exactly (the rest through one pooled term per block). kitchen_sol_topk: a fixed share of key "
           "blocks (SLA), for weights distilled for that pattern.", options=list(SOL_VARIANTS)),
        In("tau", "FLOAT", SOL_DEFAULTS["tau"], "kitchen_sol: threshold in sigmas of each block's score distribution; "
           "higher is sparser and faster (1.0 keeps ~16 % of key blocks exact, 1.5 ~7 %, 2.0 ~2.7 %).",
           min=SOL_BOUNDS["tau"][0], max=SOL_BOUNDS["tau"][1], step=0.05),
        In("keep_percent", "FLOAT", 100 * SOL_TOPK_DEFAULTS["keep_ratio"], "kitchen_sol_topk: percent of key blocks "
           "each query block keeps exactly.", min=0.5, max=95.0, step=0.5),
        In("extra_tokens", "INT", SOL_DEFAULTS["extra_tokens"], "Extra top-scoring tokens each query block attends "
           "exactly beyond its blocks (0-256, multiples of 64): closer to dense for more time.", min=0, max=256, step=64),
        In("min_tokens", "INT", SOL_DEFAULTS["min_tokens"], "Calls with fewer tokens run dense (faster there).",
           min=0, max=1 << 20, step=512),
        In("profile", "COMBO", files.NONE, PROFILE_TOOLTIP, optional=True, options=files.profile_names),
    ],
    outputs=[(SPARGE_TYPE, "sparse_settings")],
    fn=run_sol_settings,
    validate=profile_validator(SOL_NAME),
)


# ---------------------------------------------------------------- Tune Sparse Attention

def parse_pv_values(text: str) -> tuple:
    try:
        vals = tuple(float(x) for x in (text or "50").replace(";", ",").split(",") if x.strip())
    except ValueError:
        raise ValueError(f"pvthreshd_values: use numbers separated by commas, e.g. '50, 20', got {text!r}") from None
    lo, hi = BOUNDS["pvthreshd"]
    bad = [v for v in vals if not lo <= v <= hi]
    if not vals or bad:
        raise ValueError(f"pvthreshd_values must be numbers in [{lo}, {hi}], got {text!r}")
    return vals


def run_tune(model, variant, error_budget, profile_name, pvthreshd_values="50"):
    name = files.check_plain_name(profile_name, TUNE_NAME)
    return (tune_model(model, variant, error_budget, name, parse_pv_values(pvthreshd_values)),)


def validate_tune(cls, profile_name=None):
    """Prompt validation of the profile's file name: a plain name, before anything runs."""
    try:
        files.check_plain_name(profile_name, TUNE_NAME)
    except files.FileNameError as e:
        return str(e)
    return True


TUNE_NAME = "Tune Sparse Attention"
TUNE = Node(
    node_id="TuneSpargeAttn",
    display_name=TUNE_NAME,
    description="Connect between the model and a KSampler and run the graph once: every attention layer's sparse-attention "
                "thresholds (SpargeAttn's, or Sol-Attn's tau / keep share) are searched against dense attention (the run "
                "itself samples dense) and a per-layer profile is written to models/sparge_profiles. Load it with "
                "SpargeAttn Settings or Sol-Attn Settings -> profile.",
    inputs=[
        In("model", "MODEL"),
        In("variant", "COMBO", "sparge", "Which sparse kernel to tune for: SpargeAttn's (sparge*) or comfy-kitchen's "
           "Sol-Attn (kitchen_sol: tau per layer; kitchen_sol_topk: keep share per layer).", options=list(VARIANTS)),
        In("error_budget", "FLOAT", DEFAULT_BUDGET, "Largest relative L1 error vs dense attention a layer may have at any "
           "sampled call (SpargeAttn's own tuning criterion; its default is 0.07).", min=0.001, max=0.5, step=0.001),
        In("profile_name", "STRING", "my_model", "A plain file name (letters, digits, - and _; .json is added); the "
           "profile is written to models/sparge_profiles. Folders and paths are not accepted."),
        In("pvthreshd_values", "STRING", "50", "SpargeAttn: pvthreshd values to search, comma-separated (each multiplies "
           "the tuning work); 50 is the library's default. Ignored for Sol-Attn.", optional=True),
    ],
    outputs=[("MODEL", "model")],
    fn=run_tune,
    validate=validate_tune,
)


# ---------------------------------------------------------------- Attention Benchmark

def run_benchmark(presets, shapes="", dtype="bf16", reps=10):
    import torch

    from ..attention import bench

    if not torch.cuda.is_available():
        return ("no CUDA GPU: nothing to benchmark; PyTorch SDPA is what runs here.",)
    wanted = [p.strip() for p in presets.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in bench.PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(bench.PRESETS)}")
    shape_list = [s.strip() for s in shapes.replace(";", "\n").splitlines() if s.strip()]
    table = bench.parse_shapes(wanted if wanted else ([] if shape_list else None), shape_list)
    if not wanted and shape_list:
        table = {k: v for k, v in table.items() if k in shape_list}
    check_shapes_fit(table, torch.device("cuda"))
    meta, rows = bench.run(table, dtype=dtype, reps=reps)
    return (bench.render_markdown(meta, rows, bench.PRESETS),)


def shape_bytes(shape, device) -> int:
    """What benchmarking one ``(B, H, N, D, Nk, ...)`` shape holds at once, generously: bf16 q/k/v and two outputs, the
    fp32 reference, and on the CPU the attention matrix PyTorch's math kernel builds."""
    b, h, n, d, nk = shape[:5]
    nk = nk or n
    held = b * h * (n * d * 2 * 3 + n * d * 2 * 2 + n * d * 4 + nk * d * 2 * 2)
    if device.type != "cuda":
        held += b * h * n * nk * 4 * 2
    return held


def check_shapes_fit(table: dict, device) -> None:
    """A ValueError naming the shape, before anything is allocated, for a shape the device cannot hold (70 % of its
    free memory) or one over 2^31 elements in a tensor (beyond what the kernels index)."""
    import torch

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    for label, shape in table.items():
        b, h, n, d, nk = shape[:5]
        need = shape_bytes(shape, device)
        if max(n, nk or n) * b * h * d >= 2**31:
            raise ValueError(f"Attention Benchmark: shape {label} has over 2^31 elements in one tensor; use a smaller B, H "
                             "or N")
        if need > 0.7 * free:
            raise ValueError(f"Attention Benchmark: shape {label} needs about {need / 2**30:.1f} GiB and "
                             f"{device.type.upper()} memory has {free / 2**30:.1f} GiB free; use a smaller B, H or N")


BENCH = Node(
    node_id="AttentionBenchmark",
    display_name="Attention Benchmark",
    description="Times every attention backend usable on this GPU (and auto, and ComfyUI's default) on model shapes, "
                "with speed-ups against SDPA from the same run and accuracy against fp32 SDPA. Takes seconds to minutes.",
    inputs=[
        In("presets", "STRING", "sd15,sdxl,flux", "Comma-separated presets: sd15, sd15-cross, sdxl, sd3, flux, wan-480p, "
           "hunyuan-480p (video presets take minutes). Empty: only the shapes below."),
        In("shapes", "STRING", "", "Your own shapes, one per line: B,H,N,D or B,H,N,D,Nk.", multiline=True),
        In("dtype", "COMBO", "bf16", "Input dtype.", options=["bf16", "fp16"]),
        In("reps", "INT", 10, "Back-to-back calls per timing round (5 rounds, median).", min=1, max=1000, step=1),
    ],
    outputs=[("STRING", "report")],
    fn=run_benchmark,
    output_node=True,
)


# ---------------------------------------------------------------- Attention Benchmark (end to end)

def _sampling_options():
    try:
        import comfy.samplers

        return list(comfy.samplers.KSampler.SAMPLERS), list(comfy.samplers.KSampler.SCHEDULERS)
    except Exception:  # outside ComfyUI (tests of the node contract)
        return ["euler"], ["simple"]


def validate_rows(cls, rows=None):
    """Prompt validation of the end-to-end benchmark's rows: readable, and a profile they name is a listed file."""
    from . import e2e

    try:
        for r in (rows or "").replace(";", ",").split(","):
            if r.strip() and r.strip() != "all":
                opts = e2e.parse_row(r.strip())[1]
                if "profile" in opts:
                    files.resolve_profile(opts["profile"], BENCH_E2E_NAME)
    except files.FileNameError as e:
        return str(e)
    except ValueError as e:
        return f"{BENCH_E2E_NAME}: {e}"
    return True


def run_benchmark_e2e(model, positive, negative, latent_image, steps=4, cfg=5.0, sampler_name="euler", scheduler="simple",
                      seed=0, rows="all", peers=True, compile=False):
    from . import e2e

    chosen = [r.strip() for r in rows.replace(";", ",").split(",") if r.strip() and r.strip() != "all"]
    if chosen:
        known = set(e2e.default_rows(peers=True)) | {"sdpa_math", *REGISTRY.names(), *e2e.CORE_ROWS}
        unknown = [r for r in chosen if e2e.parse_row(r)[0] not in known
                   and not (r.startswith(e2e.PEER) and r[len(e2e.PEER):] in REGISTRY)]
        if unknown:
            raise ValueError(f"unknown row(s) {', '.join(unknown)}; use unpatched, auto, auto_exact, a backend name, peer:<backend>, "
                             f"{e2e.CORE_INT8} or {e2e.CORE_SOL}")
    row_list = chosen or e2e.default_rows(peers=peers)
    job = e2e.Job(model, positive, negative, latent_image["samples"], steps=steps, cfg=cfg, sampler=sampler_name,
                  scheduler=scheduler, seed=seed, label=type(model.model.diffusion_model).__name__)
    bar = None
    try:
        import comfy.utils

        bar = comfy.utils.ProgressBar(len(row_list))
    except Exception:
        pass
    from tqdm import tqdm

    with tqdm(total=len(row_list), desc="end-to-end benchmark", unit="row") as t:
        def progress(r):
            t.set_postfix_str(r["row"])
            t.update(1)
            if bar is not None:
                bar.update(1)

        results = e2e.measure(job, row_list, compile=compile, progress=progress)
    return (e2e.render_markdown(results, f"{steps} {sampler_name}/{scheduler} steps per row after a 2-step warm-up, "
                                         f"cfg {cfg}; final latent compared with the unpatched model's (PSNR/SSIM: "
                                         f"each channel of each frame as an image)"),)


SAMPLERS, SCHEDULERS = _sampling_options()

BENCH_E2E_NAME = "Attention Benchmark (end to end)"
BENCH_E2E = Node(
    node_id="AttentionBenchmarkE2E",
    display_name=BENCH_E2E_NAME,
    description="Samples your model with your conditioning and latent once per attention backend (and unpatched, auto, "
                "and peer patches that call a kernel straight from ComfyUI's hook): seconds per step, speed against "
                "unpatched, how far each final latent is from the unpatched one (cosine, relative L1, PSNR and SSIM, beside "
                "the difference between two exact kernels), peak VRAM, which kernels ran. "
                "Real weights are where sparse and 8-bit kernels show their real error. Takes a while: rows x (steps+1).",
    inputs=[
        In("model", "MODEL"),
        In("positive", "CONDITIONING", None, "Your positive conditioning (as into your KSampler)."),
        In("negative", "CONDITIONING", None, "Your negative conditioning."),
        In("latent_image", "LATENT", None, "Your latent (its size sets the attention shapes)."),
        In("steps", "INT", 4, "Timed steps per row (a 2-step warm-up run comes first).", min=1, max=100, step=1),
        In("cfg", "FLOAT", 5.0, "CFG scale, as in your KSampler.", min=0.0, max=100.0, step=0.1),
        In("sampler_name", "COMBO", "euler", "Sampler.", options=SAMPLERS),
        In("scheduler", "COMBO", "simple", "Scheduler.", options=SCHEDULERS),
        In("seed", "INT", 0, "Noise seed (the same for every row).", min=0, max=2**31 - 1, step=1),
        In("rows", "STRING", "all", "'all', or a comma-separated list: unpatched, auto, auto_exact, backend names, peer:<backend>, "
           "core:kitchen-int8 (ComfyUI's Model Attention Backend), core:sol-attn (ComfyUI's Model Sparse Attention), "
           "a sparse backend with options or a tuned profile from models/sparge_profiles: kitchen_sol[tau=2.0], "
           "sparge[profile=my_model.json]."),
        In("peers", "BOOLEAN", True, "With 'all': add a peer row per kernel (the kernel called straight from ComfyUI's hook)."),
        In("compile", "BOOLEAN", False, "Run every row under torch.compile (inductor); compile time is in the warm-up, not the timing."),
    ],
    outputs=[("STRING", "report")],
    fn=run_benchmark_e2e,
    output_node=True,
    validate=validate_rows,
)


# ---------------------------------------------------------------- Attention Backends Info

def info_text() -> str:
    env = environment()
    lines = [f"torch {env['torch']} (CUDA {env['cuda'] or '-'}{', ROCm ' + env['hip'] if env['hip'] else ''}), Python {env['python']}"]
    if env["gpus"]:
        for g in env["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']} — compute capability {g['cc']} ({g['arch']})")
    else:
        lines.append("no CUDA GPU: only PyTorch SDPA can run here")
    lines.append("")
    for r in report_rows():
        mark = "yes" if r["usable"] else ("installed" if r["installed"] else "no")
        ver = f" {r['version']}" if r["version"] else ""
        why = f" — {_why(r['why_not'])}" if r["why_not"] else ""
        lines.append(f"[{mark:>9}] {r['backend']}{ver}{why}")
    lines.append("")
    lines.append("'installed': the package imports but cannot run a typical call here (the reason follows it).")
    lines.append("To add what this GPU can run, with the Python that runs ComfyUI:")
    lines.append(f"  {_quote(sys.executable)} {_quote(os.path.join(PACK_DIR, 'install.py'))} --dry-run   (its plan)")
    lines.append(f"  {_quote(sys.executable)} {_quote(os.path.join(PACK_DIR, 'install.py'))} --yes")
    return "\n".join(lines)


PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _why(reason: str) -> str:
    """A package that is not there says so plainly; any other import failure keeps its error (a missing dependency,
    an ABI mismatch)."""
    m = re.fullmatch(r"import ([\w.]+) failed: ModuleNotFoundError: No module named '([\w.]+)'", reason)
    return "not installed" if m and m.group(2) == m.group(1).split(".")[0] else reason


def _quote(path: str) -> str:
    return f'"{path}"' if " " in path else path


def run_info():
    return (info_text(),)


INFO = Node(
    node_id="AttentionBackendsInfo",
    display_name="Attention Backends Info",
    description="What attention kernels are installed, what this GPU is, and why a backend cannot run here.",
    inputs=[],
    outputs=[("STRING", "report")],
    fn=run_info,
    output_node=True,
)

# ---------------------------------------------------------------- Context Parallel

def run_context_parallel(model, gpus=0, cfg_split=False):
    from .context_parallel import context_parallel

    return (context_parallel(model, gpus=int(gpus), cfg_split=bool(cfg_split)),)


def context_parallel_description() -> str:
    from ..parallel.families import supported

    return ("Splits each sampling step of one image or video over several GPUs of this machine (the tokens, with "
            "attention exchanged between the GPUs), with any Patch Attention backend before or after it. Supported: "
            + "; ".join(name for name, _ in supported()) + ". Other models, and machines with one GPU, sample on one GPU "
            "and the log says why. Needs ComfyUI 0.33 or later.")


CONTEXT_PARALLEL = Node(
    node_id="ContextParallel",
    display_name="Context Parallel (multi-GPU)",
    description=context_parallel_description(),
    inputs=[
        In("model", "MODEL"),
        In("gpus", "INT", 0, "How many GPUs to split each step over (0: all of them).", min=0, max=64, step=1),
        In("cfg_split", "BOOLEAN", False, "With CFG above 1 and 4 or more GPUs: run the positive and negative prompts "
           "on separate halves of the GPUs, each split over its half. Off: both prompts together over all GPUs."),
    ],
    outputs=[("MODEL", "model")],
    fn=run_context_parallel,
)

NODES = [PATCH, SPARGE, SOL, TUNE, INFO, BENCH, BENCH_E2E, CONTEXT_PARALLEL]
