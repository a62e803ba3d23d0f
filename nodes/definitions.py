"""The nodes, declared once as data; ``v1.py`` and ``v3.py`` turn them into ComfyUI node classes."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..attention import REGISTRY, environment, report_rows
from ..attention.backends.kitchen import SOL_BOUNDS, SOL_DEFAULTS, SOL_TOPK_DEFAULTS, check_sol_options
from ..attention.backends.sparge import BOUNDS, DEFAULTS
from ..attention.capabilities import KERNELS
from ..attention.sparge_profile import (
    DEFAULT_BUDGET,
    SOL_VARIANTS,
    SPARGE_VARIANTS,
    VARIANTS,
    SpargeProfile,
    default_options,
    fingerprint_state_dict,
)
from . import files
from .patch import GATE_OWN, SPARSE_START, SparseSettings, patch_model, tune_model
from .progress import progress_bar, progress_text

CATEGORY = "model_patches/attention"
# The settings that SpargeAttn Settings and Sol-Attn Settings hand to Patch Attention (the type was SPARGE_SETTINGS;
# a link keeps no type in the API format, and the frontends restore a saved link by its slot).
SPARSE_SETTINGS_TYPE = "SPARSE_SETTINGS"
TOOLTIP_MAX = 300  # characters: what a tooltip box shows without scrolling; the detail is in README and docs/


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
    # Earlier ids of this input: a workflow saved with one (API format, or a UI link the frontend keeps by its saved
    # name) still reaches the node function under the current name.
    old_names: tuple = ()

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
    search_aliases: list = field(default_factory=list)  # what people type into the node search for this node
    # the function returns, after the outputs, a line of text the node shows on the canvas (web/patch_attention.js:
    # NOTE_NODES), e.g. why it changed nothing on this machine
    note: bool = False

    @property
    def report(self) -> bool:
        """The node shows its first output, a text report, on the canvas after it runs."""
        return self.output_node and bool(self.outputs) and self.outputs[0][0] == "STRING"

    def shown(self, result) -> tuple:
        """The node function's result as (its outputs, the text the node shows on the canvas or None)."""
        if self.note:
            return tuple(result[:-1]), result[-1]
        return result, (result[0] if self.report else None)

    def run(self, **kwargs):
        """The node function on the inputs ComfyUI hands over (earlier input ids mapped to the current ones). A bad
        value's error names this node, as the user knows it."""
        for i in self.inputs:
            for old in i.old_names:
                if old in kwargs and i.name not in kwargs:
                    kwargs[i.name] = kwargs.pop(old)
                kwargs.pop(old, None)
        try:
            return self.fn(**kwargs)
        except (ValueError, OSError, RuntimeError) as e:
            if len(e.args) == 1 and isinstance(e.args[0], str) and not e.args[0].startswith(self.display_name + ":"):
                e.args = (f"{self.display_name}: {e.args[0]}",)
            raise


def backend_choices() -> list[str]:
    return ["auto", "disabled", "auto_exact", "auto_fast", *REGISTRY.names()]


BACKEND_TOOLTIP = (
    "auto: the fastest kernel within 3 dB of exact (Wan stand-in, H100: x1.63 at 480p, x1.88 at 720p). auto_fast: "
    "sparse speed, 9-13 dB below exact (x1.70, x1.95). auto_exact: exact kernels only (x1.40, x1.48). sdpa: ComfyUI's "
    "own attention; disabled removes a patch; a kernel's name forces it."
)


# ---------------------------------------------------------------- Patch Attention

def run_patch(model, backend, fallback=True, start_percent=0.0, end_percent=1.0, dense_layers="", log_stats=False,
              sparse_settings=None, auto_retune=False, auto_min_cos=GATE_OWN, auto_max_rel_l1=GATE_OWN,
              check_finite=True, sparse_start_percent=SPARSE_START):
    if sparse_settings is not None and sparse_settings.profile is not None:
        fp = fingerprint_state_dict(model.model.diffusion_model.state_dict())
        sparse_settings.profile.check_model(fp, type(model.model.diffusion_model).__name__)
    if sparse_settings is not None and backend not in ("auto", "auto_fast", "disabled", sparse_settings.variant):
        raise ValueError(f"the sparse-attention settings are for {sparse_settings.variant}, the backend is {backend}: "
                         f"choose {sparse_settings.variant} or auto, or connect settings for {backend}")
    m = patch_model(
        model, backend, fallback=fallback, start_percent=start_percent, end_percent=end_percent,
        dense_layers=dense_layers, log_stats=log_stats, sparse=sparse_settings, auto_retune=auto_retune,
        auto_min_cos=auto_min_cos, auto_max_rel_l1=auto_max_rel_l1, check_finite=check_finite,
        sparse_start_percent=sparse_start_percent,
    )
    return (m,)


KERNEL_WORDS = ["sage", "sageattention", "sage attention", "sageattn", "flash attention", "flash-attn", "flashattention",
                "fa2", "fa3", "fa4", "xformers", "sparge", "spargeattn", "sparse attention", "sdpa"]

PATCH = Node(
    node_id="PatchAttention",
    display_name="Patch Attention",
    description="Returns a clone of the model whose attention runs on the chosen kernel. The input model is untouched.",
    search_aliases=[*KERNEL_WORDS, "sparse", "sol-attn", "attention backend", "attention", "speed up", "faster",
                    "accelerate", "optimize", "patch sage attention", "sage patch"],
    inputs=[
        In("model", "MODEL"),
        In("backend", "COMBO", "auto", BACKEND_TOOLTIP, options=backend_choices()),
        In("fallback", "BOOLEAN", True, "On: a call the kernel cannot take runs on the fastest exact kernel for its "
           "shape, counted and logged once. Off: such a call stops the run with the reason."),
        In("start_percent", "FLOAT", 0.0, "Fraction of the sampling schedule (0-1) from which the chosen kernel runs; "
           "before it, the fastest exact kernel.", min=0.0, max=1.0, step=0.01),
        In("end_percent", "FLOAT", 1.0, "Fraction of the sampling schedule (0-1) until which the chosen kernel runs; "
           "after it, the fastest exact kernel.", min=0.0, max=1.0, step=0.01),
        In("dense_layers", "STRING", "", "Attention layers kept on the fastest exact kernel, by index within one model "
           "forward, e.g. '0-3, 10, 50-' (Flux: 0-18 double blocks, 19-56 single blocks)."),
        In("log_stats", "BOOLEAN", False, "After each sampling run, log per kernel its calls, fallbacks and GPU time "
           "(ms)."),
        In("sparse_settings", SPARSE_SETTINGS_TYPE, None, "Options, and optionally a per-layer profile, from a SpargeAttn "
           "Settings or Sol-Attn Settings node; they apply to that node's kernel, chosen here or by auto.",
           optional=True, old_names=("sparge_settings",)),
        In("auto_retune", "BOOLEAN", False, "auto, auto_fast, auto_exact: measure the kernels again instead of using the "
           "decisions remembered for this GPU.", optional=True),
        In("auto_min_cos", "FLOAT", GATE_OWN, "auto, auto_fast: the cosine to exact attention a lossy kernel must keep. 0: "
           "the choice's own (auto 0.999, auto_fast 0.995); 0.995, the default of earlier versions, reads as 0 too.",
           optional=True, min=0.0, max=1.0, step=0.0005),
        In("auto_max_rel_l1", "FLOAT", GATE_OWN, "auto, auto_fast: the relative L1 error a lossy kernel must stay within. "
           "0: the choice's own (auto 0.039 = 3.9 %, auto_fast 0.08 = 8 %); 0.08, the earlier default, reads as 0 too.",
           optional=True, min=0.0, max=1.0, step=0.005),
        In("check_finite", "BOOLEAN", True, "Check 8-bit and sparse kernels' output for NaN (black images) and redo "
           "such a step with the affected layers on an exact kernel. SageAttention gives NaN when all keys are equal, "
           "e.g. a zeroed negative prompt; one GPU sync per step.", optional=True),
        In("sparse_start_percent", "FLOAT", SPARSE_START, "Fraction of the schedule (0-1) from which sparse kernels "
           "(SpargeAttn, Sol-Attn) run; before it they run on the fastest exact kernel and auto picks among the "
           "others. ComfyUI's Model Sparse Attention waits 0.2 too.", optional=True, min=0.0, max=1.0, step=0.01),
    ],
    outputs=[("MODEL", "model")],
    fn=run_patch,
)


# ---------------------------------------------------------------- SpargeAttn Settings



def run_sparge_settings(variant, simthreshd1, cdfthreshd, pvthreshd, topk=0.5, profile="", report_error_every=0):
    opts = default_options(variant)
    opts.update({"simthreshd1": simthreshd1, "pvthreshd": pvthreshd})
    if variant == "sparge_topk":
        opts["topk"] = topk
    else:
        opts["cdfthreshd"] = cdfthreshd
    return (SparseSettings(variant, opts, load_profile(profile, variant, SPARGE_NAME), int(report_error_every or 0)),)


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


def _reason(check, *args):
    """What ComfyUI's prompt validation wants from a node's check: True, or the refusal's message."""
    try:
        check(*args)
    except files.FileNameError as e:
        return str(e)
    return True


def profile_validator(node: str):
    """Prompt validation of ``node``'s profile input: none, empty (workflows saved before the list) or a listed file."""

    def validate(cls, profile=None):
        return _reason(files.resolve_profile, profile, node)

    return validate


PROFILE_TOOLTIP = ("Optional per-layer profile from Tune Sparse Attention: a file in models/sparge_profiles (press R to "
                   "refresh the list). Layers without an entry use the values above.")


SPARGE_NAME = "SpargeAttn Settings"
SPARGE = Node(
    node_id="SpargeAttnSettings",
    display_name=SPARGE_NAME,
    description="Thresholds for the SpargeAttn backends of Patch Attention, per model, optionally per layer from a profile.",
    search_aliases=["sparge", "spargeattn", "sparge attention", "sparse", "sparse attention", "sparsity", "sage",
                    "sageattention", "speed up", "faster"],
    inputs=[
        In("variant", "COMBO", "sparge", "sparge: SpargeAttn on SageAttention2; sparge_topk: keep the top-k blocks; "
           "sparge_sage1: on SageAttention1 kernels.", options=list(SPARGE_VARIANTS)),
        In("simthreshd1", "FLOAT", DEFAULTS["simthreshd1"], "Block self-similarity (-1 to 1) above which a block may be "
           "skipped; higher skips fewer blocks and stays closer to dense attention.", min=BOUNDS["simthreshd1"][0], max=BOUNDS["simthreshd1"][1], step=0.01),
        In("cdfthreshd", "FLOAT", DEFAULTS["cdfthreshd"], "Share of each row's attention mass kept (0-1); lower is "
           "sparser and faster, and further from dense attention.",
           min=BOUNDS["cdfthreshd"][0], max=BOUNDS["cdfthreshd"][1], step=0.001),
        In("pvthreshd", "FLOAT", float(DEFAULTS["pvthreshd"]), "Skip threshold of the PV stage (a plain number, no unit); "
           "higher skips fewer blocks.",
           min=BOUNDS["pvthreshd"][0], max=1000.0, step=1.0),
        In("topk", "FLOAT", 0.5, "sparge_topk only: fraction of key blocks (0-1) "
           "each query block keeps.", optional=True,
           min=0.0, max=1.0, step=0.01),
        In("profile", "COMBO", files.NONE, PROFILE_TOOLTIP, optional=True, options=files.profile_names),
        In("report_error_every", "INT", 0, "With Patch Attention's log_stats: each layer's sparsity, and "
           "every N-th call (a count) also its relative L1 error against dense attention (0: sparsity only). Each error "
           "costs one dense call.", optional=True,
           min=0, max=1000, step=1),
    ],
    outputs=[(SPARSE_SETTINGS_TYPE, "sparse_settings")],
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
    return (SparseSettings(method, check_sol_options(opts), load_profile(profile, method, SOL_NAME)),)


SOL_NAME = "Sol-Attn Settings"
SOL = Node(
    node_id="SolAttnSettings",
    display_name=SOL_NAME,
    description="Options for comfy-kitchen's Sol-Attn kernels in Patch Attention (the kernel of ComfyUI's Model Sparse "
                "Attention node), per model, optionally per layer from a tuned profile. Needs comfy-kitchen 0.2.40 or "
                "later (ComfyUI 0.33 comes with 0.2.31: Attention Backends Info says how to add it).",
    search_aliases=["sol", "sol-attn", "sol attention", "solattn", "sparse", "sparse attention", "sla", "comfy-kitchen",
                    "kitchen", "model sparse attention", "speed up", "faster"],
    inputs=[
        In("method", "COMBO", "kitchen_sol", "kitchen_sol: a training-free threshold tau picks the key blocks each query "
           "block attends exactly (the rest through one pooled term per block). kitchen_sol_topk: a fixed share of key "
           "blocks (SLA), for weights distilled for that pattern.", options=list(SOL_VARIANTS)),
        In("tau", "FLOAT", SOL_DEFAULTS["tau"], "kitchen_sol: threshold in sigmas of each block's score distribution; "
           "higher is sparser and faster (1.0 keeps ~16 % of key blocks exact, 1.5 ~7 %, 2.0 ~2.7 %).",
           min=SOL_BOUNDS["tau"][0], max=SOL_BOUNDS["tau"][1], step=0.05),
        In("keep_percent", "FLOAT", 100 * SOL_TOPK_DEFAULTS["keep_ratio"], "kitchen_sol_topk: percent (%) of key blocks "
           "each query block keeps exactly.", min=0.5, max=95.0, step=0.5),
        In("extra_tokens", "INT", SOL_DEFAULTS["extra_tokens"], "Extra top-scoring tokens (0-256, multiples of 64) "
           "each query block attends exactly beyond its blocks: closer to dense attention, for more time.", min=0, max=256, step=64),
        In("min_tokens", "INT", SOL_DEFAULTS["min_tokens"], "Calls with fewer tokens (sequence length) than this "
           "run dense, which is faster there.",
           min=0, max=1 << 20, step=512),
        In("profile", "COMBO", files.NONE, PROFILE_TOOLTIP, optional=True, options=files.profile_names),
    ],
    outputs=[(SPARSE_SETTINGS_TYPE, "sparse_settings")],
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
    return _reason(files.check_plain_name, profile_name, TUNE_NAME)


TUNE_NAME = "Tune Sparse Attention"
TUNE = Node(
    node_id="TuneSpargeAttn",
    display_name=TUNE_NAME,
    description="Connect between the model and a KSampler and run the graph once: every attention layer's sparse-attention "
                "thresholds (SpargeAttn's, or Sol-Attn's tau / keep share) are searched against dense attention (the run "
                "itself samples dense) and a per-layer profile is written to models/sparge_profiles. Load it with "
                "SpargeAttn Settings or Sol-Attn Settings -> profile.",
    search_aliases=["tune", "tuning", "autotune", "calibrate", "sparge", "spargeattn", "sparse", "sparse attention",
                    "sol-attn", "profile", "per layer"],
    inputs=[
        In("model", "MODEL"),
        In("variant", "COMBO", "sparge", "Which sparse kernel to tune for: SpargeAttn's (sparge*) or comfy-kitchen's "
           "Sol-Attn (kitchen_sol: tau per layer; kitchen_sol_topk: keep share per layer).", options=list(VARIANTS)),
        In("error_budget", "FLOAT", DEFAULT_BUDGET, "Largest relative L1 error against dense "
           "attention (0.07 = 7 %) a layer may have at any sampled call; 0.07 is SpargeAttn's own tuning default.", min=0.001, max=0.5, step=0.001),
        In("profile_name", "STRING", "my_model", "A plain file name (letters, digits, - and _; .json is added); the "
           "profile is written to models/sparge_profiles. Folders and paths are not accepted."),
        In("pvthreshd_values", "STRING", "50", "SpargeAttn: pvthreshd values to search, "
           "comma-separated (each one multiplies the tuning time); 50 is the library's default. Ignored for Sol-Attn.", optional=True),
    ],
    outputs=[("MODEL", "model")],
    fn=run_tune,
    validate=validate_tune,
)


# ---------------------------------------------------------------- Attention Benchmark

def run_benchmark(presets, shapes="", dtype="bf16", reps=10):
    import torch

    from ..measure import bench

    wanted = [p.strip() for p in presets.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in bench.SHAPE_PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(bench.SHAPE_PRESETS)}")
    shape_list = [s.strip() for s in shapes.replace(";", "\n").splitlines() if s.strip()]
    if not wanted and not shape_list:
        raise ValueError("nothing to time: give presets, shapes, or both")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    table = bench.parse_shapes(wanted, shape_list, device=device)  # presets with fewer tokens on a CPU
    if not wanted:  # parse_shapes takes every preset for an empty list
        table = {k: v for k, v in table.items() if k in shape_list}
    check_shapes_fit(table, device)
    bar = progress_bar(bench.tick_count(table, device, reps=reps))
    meta, rows = bench.run(table, dtype=dtype, reps=reps, device=device,
                           progress=(lambda: bar.update(1)) if bar is not None else True,
                           announce=lambda text: progress_text(f"Attention Benchmark: {text}"))
    return (bench.render_markdown(meta, rows, bench.SHAPE_PRESETS),)


def shape_bytes(shape, device) -> int:
    """What benchmarking one ``(B, H, N, D, Nk, ...)`` shape holds at once, generously: bf16 q/k/v and two outputs, the
    fp32 reference, and on the CPU the attention matrix PyTorch's math kernel builds."""
    b, h, n, d, nk = shape[:5]
    nk = nk or n
    held = b * h * (n * d * 2 * 3 + n * d * 2 * 2 + n * d * 4 + nk * d * 2 * 2)
    if device.type != "cuda":
        held += b * h * n * nk * 4 * 2
    return held


def _available_ram() -> int:
    """Bytes of RAM available: psutil's figure (ComfyUI installs it), else the free pages the OS reports."""
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_shapes_fit(table: dict, device) -> None:
    """A ValueError naming the shape, before anything is allocated, for a shape the device cannot hold (70 % of its
    free memory) or one over 2^31 elements in a tensor (beyond what the kernels index)."""
    import torch

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = _available_ram()
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
                "in interleaved rounds (every row once per round): each row's median and the range of its rounds, "
                "speed-ups against SDPA from the same rounds, accuracy against fp32 SDPA. Says before it starts how "
                "many calls it makes and about how long they take. Without a CUDA GPU it times PyTorch's SDPA kernels "
                "on the CPU, on the presets with fewer tokens (under a minute for the defaults).",
    search_aliases=["benchmark", "speed test", "attention benchmark", "kernel benchmark", "attention", *KERNEL_WORDS,
                    "compare kernels"],
    inputs=[
        In("presets", "STRING", "sd15,sdxl,flux", "Comma-separated presets: sd15, sd15-cross, sdxl, sd3, flux, "
           "wan-480p, hunyuan-480p (on a CPU they run with fewer tokens; video ones take minutes on a GPU). Empty: "
           "only your shapes."),
        In("shapes", "STRING", "", "Your own shapes, one per line: B,H,N,D or B,H,N,D,Nk (batch, heads, query tokens, "
           "head dim, key tokens).", multiline=True),
        In("dtype", "COMBO", "bf16", "Data type of the inputs (bf16 or fp16).", options=["bf16", "fp16"]),
        In("reps", "INT", 10, "Back-to-back calls per row in each of the 15 interleaved rounds (a count; fewer where "
           "one call is long), the median and the range over the rounds reported.", min=1, max=1000, step=1),
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
    from ..measure.rows import parse_row

    try:
        for r in (rows or "").replace(";", ",").split(","):
            if r.strip() and r.strip() != "all":
                opts = parse_row(r.strip())[1]
                if "profile" in opts:
                    files.resolve_profile(opts["profile"], BENCH_E2E_NAME)
    except files.FileNameError as e:
        return str(e)
    except ValueError as e:
        return f"{BENCH_E2E_NAME}: {e}"
    return True


def run_benchmark_e2e(model, positive, negative, latent_image, steps=4, cfg=5.0, sampler_name="euler", scheduler="simple",
                      seed=0, rows="all", peers=True, compile=False, vae=None):
    from ..measure import e2e, pictures, report
    from ..measure.rows import rows_from_text

    row_list = rows_from_text(rows, peers=peers)
    job = e2e.Job(model, positive, negative, latent_image["samples"], steps=steps, cfg=cfg, sampler=sampler_name,
                  scheduler=scheduler, seed=seed, label=type(model.model.diffusion_model).__name__,
                  profiles=lambda name, variant: load_profile(name, variant, BENCH_E2E_NAME))
    latents = {} if vae is not None else None
    with _progress(len(row_list), "end-to-end benchmark") as progress:
        results = e2e.measure(job, row_list, compile=compile, progress=lambda r: progress(r["row"]), final_latents=latents)
    what = f"{steps} {sampler_name}/{scheduler} steps per row after a 2-step warm-up, cfg {cfg}"
    text = report.render_markdown(results, f"{what}; final latent compared with the unpatched model's (PSNR/SSIM: each "
                                           f"channel of each frame as an image)")
    chart = pictures.chart(results, f"Attention Benchmark (end to end): {what}").image
    if vae is None:
        frames = pictures.message("No VAE connected: connect your model's VAE to see each row's decoded output beside "
                                  "its difference to the unpatched row.")
    else:
        frames = pictures.frames(results, latents, vae.decode).image
    return text, pictures.to_image(chart), pictures.to_image(frames)


@contextlib.contextmanager
def _progress(total: int, desc: str):
    """A progress callback (one call per finished item) for the console and ComfyUI's progress bar."""
    from tqdm import tqdm

    bar = progress_bar(total)
    with tqdm(total=total, desc=desc, unit="row") as t:
        def progress(name):
            t.set_postfix_str(name)
            t.update(1)
            if bar is not None:
                bar.update(1)

        yield progress


SAMPLERS, SCHEDULERS = _sampling_options()

BENCH_E2E_NAME = "Attention Benchmark (end to end)"
BENCH_E2E = Node(
    node_id="AttentionBenchmarkE2E",
    display_name=BENCH_E2E_NAME,
    description="Samples your model with your conditioning and latent once per attention backend (and unpatched, auto, "
                "and peer patches that call a kernel straight from ComfyUI's hook): seconds per step, speed against "
                "unpatched, how far each final latent is from the unpatched one (cosine, relative L1, PSNR and SSIM, beside "
                "the difference between two exact kernels), peak VRAM, which kernels ran. "
                "Real weights are where sparse and 8-bit kernels show their real error. Takes a while: rows x (steps+1). "
                "Besides the report: a chart of each row's speed against its PSNR, with the exact kernels' PSNR (the "
                "floor) and the band 3 dB below it, and with a VAE each row's decoded output beside its difference to "
                "the unpatched row (connect Preview Image to see them).",
    search_aliases=["benchmark", "end to end", "e2e", "speed test", "sampling speed", "compare", "speed up", "faster",
                    *KERNEL_WORDS],
    inputs=[
        In("model", "MODEL"),
        In("positive", "CONDITIONING", None, "Your positive conditioning (as into your KSampler)."),
        In("negative", "CONDITIONING", None, "Your negative conditioning."),
        In("latent_image", "LATENT", None, "Your latent (its size sets the attention shapes)."),
        In("steps", "INT", 4, "Timed sampling steps per row (a 2-step warm-up run comes first).", min=1, max=100, step=1),
        In("cfg", "FLOAT", 5.0, "CFG scale, as in your KSampler.", min=0.0, max=100.0, step=0.1),
        In("sampler_name", "COMBO", "euler", "Sampler, as in your KSampler.", options=SAMPLERS),
        In("scheduler", "COMBO", "simple", "Scheduler, as in your KSampler.", options=SCHEDULERS),
        In("seed", "INT", 0, "Noise seed (the same for every row).", min=0, max=2**31 - 1, step=1),
        In("rows", "STRING", "all", "'all', or a comma-separated list of rows as the report names them, e.g. unpatched, "
           "auto, sage, peer:sage, core:sol-attn, kitchen_sol[tau=2.0] or sparge[profile=my_model.json] (a file in "
           "models/sparge_profiles); an unknown name's error lists every kind of row."),
        In("peers", "BOOLEAN", True, "With 'all': add a peer row per kernel, which calls the kernel straight from ComfyUI's hook."),
        In("compile", "BOOLEAN", False, "Run every row under torch.compile (inductor); the compile time falls in the warm-up, not in the timing."),
        In("vae", "VAE", None, "Optional: your model's VAE. Each row's final latent is decoded (once, after the timing) "
           "and shown beside its difference to the unpatched row in the frames output.", optional=True),
    ],
    outputs=[("STRING", "report"), ("IMAGE", "chart"), ("IMAGE", "frames")],
    fn=run_benchmark_e2e,
    output_node=True,
    validate=validate_rows,
)


# ---------------------------------------------------------------- Attention Backends Info

def info_text() -> str:
    env = environment()
    lines = [f"torch {env['torch']} (CUDA {env['cuda'] or '-'}{', ROCm ' + env['hip'] if env['hip'] else ''}), Python {env['python']}"]
    for g in env["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']} — compute capability {g['cc']} ({g['arch']})")
    if not env["gpus"]:
        lines.append("no CUDA GPU")
    lines.append("")
    rows = report_rows()
    if not env["gpus"]:  # the GPU kernels' rows say nothing a user here can act on
        lines += [f"[      yes] {r['backend']}" for r in rows if r["usable"]]
    else:
        for r in rows:
            mark = "yes" if r["usable"] else ("installed" if r["installed"] else "no")
            ver = f" {r['version']}" if r["version"] else ""
            why = f" — {_why(r['why_not'])}" if r["why_not"] else ""
            lines.append(f"[{mark:>9}] {r['backend']}{ver}{why}")
        lines.append("")
        lines.append("'installed': the package imports but cannot run a typical call here (the reason follows it).")
    lines.append("")
    lines += advice(env)
    return "\n".join(lines)


# Data-centre and workstation NVIDIA GPUs by name; the rest (GeForce, TITAN) are consumer cards.
_DATACENTRE = re.compile(r"\b(Tesla|[ABHL]\d{1,3}S?|[GB]B?\d00|H\d00|H20|B\d00|GB\d00|RTX PRO|RTX A\d|Quadro|"
                         r"A\d{2,3}|V100|T4|P100|P40|DGX)\b", re.IGNORECASE)


def gpu_kind(name: str) -> str:
    """'consumer' (GeForce, TITAN) or 'data-centre' (H100, A100, L40S, RTX PRO, ...) for an NVIDIA GPU's name."""
    if re.search(r"GeForce|TITAN", name, re.IGNORECASE):
        return "consumer"
    return "data-centre" if _DATACENTRE.search(name) else "consumer"


# What install.py installs by default, in the words a user knows (attention.capabilities says which GPUs take each):
# kernel key -> title; the stand-ins (SageAttention 1 for 2) apart.
INSTALLED_BY_DEFAULT = {k.key: k.title for k in KERNELS.values() if k.default and k.title and not k.instead_of}
WINDOWS_WHEEL = "sageattention"  # on Windows install.py adds the prebuilt SageAttention 2 wheel only


def addable(cc: tuple[int, int], windows: bool) -> list[str]:
    """The kernels install.py can add for a GPU of compute capability ``cc`` (Windows: the prebuilt SageAttention 2
    wheel only; a stand-in, SageAttention 1, where the kernel it replaces cannot run)."""
    keys = [k for k in INSTALLED_BY_DEFAULT if KERNELS[k].runs_on(cc) and (not windows or k == WINDOWS_WHEEL)]
    for k in KERNELS.values():
        if k.default and k.instead_of and k.instead_of not in keys and k.runs_on(cc):
            keys.insert(0, k.key)
    return [KERNELS[k].title for k in keys]


def advice(env: dict, system: str | None = None) -> list[str]:
    """What to do next, for the machine this runs on: nothing to install without a CUDA GPU; on a GPU, what
    install.py adds for it and what that needs."""
    import platform

    if not env["gpus"]:
        where = "this ROCm build of torch" if env["hip"] else "this machine"
        return [f"No CUDA GPU on {where}: ComfyUI's own attention (PyTorch SDPA) is what runs, and the GPU kernels "
                "(SageAttention, FlashAttention, SpargeAttn, xformers) need an NVIDIA GPU. Leave models unpatched "
                "here; there is nothing to install."]
    g = env["gpus"][0]
    cc = tuple(int(x) for x in g["cc"].split("."))
    windows = (system or platform.system()) == "Windows"
    kernels = addable(cc, windows)
    cuda = env["cuda"] or "?"
    if not kernels:
        return [f"{g['name']} (sm {g['cc']}) is older than every kernel install.py adds: PyTorch SDPA is what runs "
                "here. Leave models unpatched."]
    if windows:
        how = "It comes as a prebuilt wheel where one matches this torch; nothing is compiled on Windows."
    else:
        built = [v for k, v in INSTALLED_BY_DEFAULT.items() if v in kernels and KERNELS[k].source == "build"]
        how = " ".join(filter(None, [
            built and f"Building {' and '.join(built)} needs the CUDA toolkit {cuda.split('.')[0]}.x, as torch's CUDA "
                      f"is {cuda}.",
            "FlashAttention-4 comes as wheels." if "FlashAttention-4" in kernels else ""]))
    kind = "a consumer GPU" if gpu_kind(g["name"]) == "consumer" else "a data-centre GPU"
    head = f"{g['name']} is {kind}: install.py adds {', '.join(kernels)}. {how}".strip()
    return [
        head,
        "With the Python that runs ComfyUI (--dry-run prints the plan and changes nothing):",
        f"  {_quote(sys.executable)} {_quote(os.path.join(PACK_DIR, 'install.py'))} --dry-run",
        f"  {_quote(sys.executable)} {_quote(os.path.join(PACK_DIR, 'install.py'))} --yes",
    ]


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
    search_aliases=["attention backends", "attention info", "installed kernels", "system info", "gpu info",
                    "diagnostics", "check install", *KERNEL_WORDS],
    inputs=[],
    outputs=[("STRING", "report")],
    fn=run_info,
    output_node=True,
)

# ---------------------------------------------------------------- Context Parallel

def run_context_parallel(model, gpus=0, cfg_split=True):
    from .context_parallel import split_model

    return split_model(model, gpus=int(gpus), cfg_split=bool(cfg_split))  # the model, and the text for the canvas


def context_parallel_description() -> str:
    from ..parallel.families import supported

    return ("Splits each sampling step of one image or video over several GPUs of this machine (the tokens, with "
            "attention exchanged between the GPUs), with any Patch Attention backend before or after it. Supported: "
            + "; ".join(name for name, _ in supported()) + ". Other models, steps too short to gain from a split (small images, "
            "short clips: faster on one GPU; where that ends depends on the model and on the attention it runs, and the "
            "node shows it) and machines with one GPU sample on one GPU, and the node says why. "
            "Every GPU holds a whole copy of the model (LoRA, fp8-scaled and GGUF models too). Needs ComfyUI 0.33 or "
            "later.")


CONTEXT_PARALLEL = Node(
    node_id="ContextParallel",
    display_name="Context Parallel (multi-GPU)",
    description=context_parallel_description(),
    inputs=[
        In("model", "MODEL"),
        In("gpus", "INT", 0, "How many GPUs a step may split over (0: all of them). Past two, a step splits over more "
           "only where each GPU's share still pays (the box says from how many tokens).", min=0, max=64, step=1),
        In("cfg_split", "BOOLEAN", True, "On: with CFG above 1, the positive and negative prompts run on separate halves "
           "of the GPUs (on 2 GPUs, one each: faster there with a Patch Attention kernel), each split over its half. CFG 1, "
           "or off: every GPU splits each step (faster on 2 GPUs with ComfyUI's own attention)."),
    ],
    outputs=[("MODEL", "model")],
    fn=run_context_parallel,
    note=True,
    search_aliases=["multi gpu", "multigpu", "multiple gpus", "two gpus", "2 gpus", "context parallel",
                    "sequence parallel", "ulysses", "usp", "xdit", "distributed", "speed up", "faster"],
)

# ---------------------------------------------------------------- VAE Decode / Encode (several GPUs)

VAE_OVERLAP = 64  # px: VAE Decode (Tiled)'s default overlap (a quarter of smaller tiles, as it lowers it there)


def run_vae_decode(samples, vae, gpus=0, tile_size=0):
    from .vae import decode

    latent = samples["samples"]
    if latent.is_nested:
        latent = latent.unbind()[0]
    overlap = min(VAE_OVERLAP, tile_size // 4) if tile_size else VAE_OVERLAP
    images, _ = decode(vae, latent, int(gpus), int(tile_size), overlap)
    if images.ndim == 5:  # a video's frames, as VAE Decode (Tiled) returns them
        images = images.reshape(-1, *images.shape[-3:])
    return (images,)


def run_vae_encode(pixels, vae, gpus=0, tile_size=0):
    from .vae import encode

    overlap = min(VAE_OVERLAP, tile_size // 4) if tile_size else VAE_OVERLAP
    latent, _ = encode(vae, pixels, int(gpus), int(tile_size), overlap)
    return ({"samples": latent},)


VAE_WORDS = ["multi gpu", "multigpu", "multiple gpus", "several gpus", "two gpus", "2 gpus", "distributed", "tiled",
             "vae tiled", "video", "wan vae", "speed up", "faster"]
GPUS_TOOLTIP = "How many GPUs share the tiles (0: all of them)."
TILE_TOOLTIP = ("Tile width and height in pixels; tiles overlap by 64 (a quarter of smaller tiles). 0: a video gets "
                "one tile per GPU, all of one size (more where one would not fit a GPU), an image 512.")


def vae_node(node_id: str, name: str, description: str, data: In, vae_tip: str, step: int, output: tuple, fn,
             words: list) -> Node:
    """VAE Decode / VAE Encode (several GPUs): ``data`` in, the VAE, the GPUs, the tile size; ``output`` out."""
    return Node(node_id=node_id, display_name=name, description=description, search_aliases=[*words, *VAE_WORDS],
                inputs=[data, In("vae", "VAE", None, vae_tip), In("gpus", "INT", 0, GPUS_TOOLTIP, min=0, max=64, step=1),
                        In("tile_size", "INT", 0, TILE_TOOLTIP, min=0, max=4096, step=step)],
                outputs=[output], fn=fn)


VAE_DECODE = vae_node(
    "VAEDecodeMultiGPU", "VAE Decode (several GPUs)",
    "Decodes a latent with ComfyUI's tiled VAE decode, its tiles spread over the GPUs of this machine (a copy of the VAE "
    "on each, kept for the next prompts). On GPUs of one kind the frames are bit for bit ComfyUI's tiled decode with "
    "the same tiles (tile_size set: VAE Decode (Tiled) with it, overlap 64, temporal_size 4096, temporal_overlap 4); "
    "tiled and plain decodes differ a little where tiles meet. Wan 2.1/2.2, HunyuanVideo and image VAEs; one GPU, or a "
    "VAE that tiles itself: ComfyUI's tiled decode, and the log says so.",
    In("samples", "LATENT", None, "The latent to decode."), "The VAE of the model that made the latent.", 32,
    ("IMAGE", "IMAGE"), run_vae_decode, ["vae decode", "decode", "decode latent", "latent to image"])

VAE_ENCODE = vae_node(
    "VAEEncodeMultiGPU", "VAE Encode (several GPUs)",
    "Encodes images or a video's frames with ComfyUI's tiled VAE encode, its tiles spread over the GPUs of this "
    "machine (a copy of the VAE on each). On GPUs of one kind the latent is bit for bit ComfyUI's tiled encode with the "
    "same tiles. One GPU, or a VAE that tiles itself: ComfyUI's tiled encode, and the log says so.",
    In("pixels", "IMAGE", None, "The images, or a video's frames, to encode."), "The VAE of the model the latent is for.",
    64, ("LATENT", "LATENT"), run_vae_encode, ["vae encode", "encode", "encode image", "image to latent"])

NODES = [PATCH, SPARGE, SOL, TUNE, INFO, BENCH, BENCH_E2E, CONTEXT_PARALLEL, VAE_DECODE, VAE_ENCODE]
