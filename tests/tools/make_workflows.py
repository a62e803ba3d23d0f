"""Write the example workflows in workflows/, in ComfyUI's UI format and its API format, from one description.

    python tests/tools/make_workflows.py                        # the JSON files
    python tests/tools/make_workflows.py --thumbnails .build/artifacts/comfyui-0.33.0
                                    # workflows/<name>.jpg (template browser) from tests/test_browser.py's screenshots
    python tests/tools/make_workflows.py --captions [NAME...]   # only the description band of existing thumbnails
    python tests/tools/make_workflows.py --report-picture .build/artifacts/comfyui-0.33.0
                                    # docs/report-on-canvas.png from tests/test_browser.py's screenshot

tests/test_workflows.py checks every node type and widget in the output against the node definitions
(ComfyUI's own where a ComfyUI is found, this pack's always).
"""

from __future__ import annotations

import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "workflows")
DATA = os.path.join(ROOT, "docs", "data")

# node type -> (inputs that are links [(name, type)], widget names in order, outputs [(name, type)]); the pack's own
# nodes are read from nodes/definitions.py (pack_io below)
IO = {
    "CheckpointLoaderSimple": ([], ["ckpt_name"], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")]),
    "UNETLoader": ([], ["unet_name", "weight_dtype"], [("MODEL", "MODEL")]),
    "DualCLIPLoader": ([], ["clip_name1", "clip_name2", "type", "device"], [("CLIP", "CLIP")]),
    "CLIPLoader": ([], ["clip_name", "type", "device"], [("CLIP", "CLIP")]),
    "VAELoader": ([], ["vae_name"], [("VAE", "VAE")]),
    "ModelSamplingSD3": ([("model", "MODEL")], ["shift"], [("MODEL", "MODEL")]),
    "CLIPTextEncode": ([("clip", "CLIP")], ["text"], [("CONDITIONING", "CONDITIONING")]),
    "FluxGuidance": ([("conditioning", "CONDITIONING")], ["guidance"], [("CONDITIONING", "CONDITIONING")]),
    "EmptyLatentImage": ([], ["width", "height", "batch_size"], [("LATENT", "LATENT")]),
    "EmptySD3LatentImage": ([], ["width", "height", "batch_size"], [("LATENT", "LATENT")]),
    "EmptyHunyuanLatentVideo": ([], ["width", "height", "length", "batch_size"], [("LATENT", "LATENT")]),
    "KSampler": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent_image", "LATENT")],
                 ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"], [("LATENT", "LATENT")]),
    "KSamplerAdvanced": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                          ("latent_image", "LATENT")],
                         ["add_noise", "noise_seed", "steps", "cfg", "sampler_name", "scheduler", "start_at_step",
                          "end_at_step", "return_with_leftover_noise"], [("LATENT", "LATENT")]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [], [("IMAGE", "IMAGE")]),
    "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], []),
    # ComfyUI's video save, as its own Wan templates end: frames -> Create Video -> Save Video (an H.264 MP4). Their
    # inputs as ComfyUI 0.3.64 has them, which 0.33 takes too (see VIDEO_SAVE)
    "CreateVideo": ([("images", "IMAGE"), ("audio", "AUDIO")], ["fps"], [("VIDEO", "VIDEO")]),
    "SaveVideo": ([("video", "VIDEO")], ["filename_prefix", "format", "codec"], []),
    "Note": ([], ["text"], []),
}
WIDGET_KINDS = {"COMBO", "BOOLEAN", "FLOAT", "INT", "STRING"}


def pack_nodes():
    """The pack's node declarations (nodes/definitions.py), imported as ComfyUI would import the pack."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("pack_for_workflows", os.path.join(ROOT, "tests", "pack.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules.setdefault("pack_for_workflows", mod)
    return {n.node_id: n for n in mod.load().nodes.definitions.NODES}


PACK = pack_nodes()
for _n in PACK.values():
    IO[_n.node_id] = ([(i.name, i.kind) for i in _n.inputs if i.kind not in WIDGET_KINDS],
                      [i.name for i in _n.inputs if i.kind in WIDGET_KINDS], [(nm, k) for k, nm in _n.outputs])
OPTIONAL_LINKS = {(n.node_id, i.name) for n in PACK.values() for i in n.inputs if i.optional and i.kind not in WIDGET_KINDS}
OPTIONAL_LINKS.add(("CreateVideo", "audio"))
UI_ONLY = {"Note"}  # not in the API format
SEED_CONTROL = "fixed"  # KSampler's seed widget carries a "control after generate" value in the UI format


def defaults(node_type: str) -> dict:
    """The pack node's widget defaults, as a new node in the frontend has them."""
    return {i.name: i.default for i in PACK[node_type].inputs if i.kind in WIDGET_KINDS}


# The model files, as ComfyUI's own templates name them: file, where ComfyUI's Missing Models panel downloads it
# from (the URLs of comfyui-workflow-templates for the same files), and its folder under models/.
MODELS = {
    "v1-5-pruned-emaonly-fp16.safetensors": (
        "https://huggingface.co/Comfy-Org/stable-diffusion-v1-5-archive/resolve/main/v1-5-pruned-emaonly-fp16.safetensors"
        "?download=true", "checkpoints"),
    "sd_xl_base_1.0.safetensors": (
        "https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/resolve/main/sd_xl_base_1.0.safetensors"
        "?download=true", "checkpoints"),
    "flux1-dev.safetensors": ("https://huggingface.co/Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors",
                              "diffusion_models"),
    "clip_l.safetensors": ("https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
                           "text_encoders"),
    "t5xxl_fp16.safetensors": (
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors", "text_encoders"),
    "ae.safetensors": (
        "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors", "vae"),
    "wan2.1_t2v_1.3B_fp16.safetensors": (
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.1_t2v_1.3B_fp16.safetensors?download=true", "diffusion_models"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": (
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
        "umt5_xxl_fp8_e4m3fn_scaled.safetensors?download=true", "text_encoders"),
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": (
        "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "diffusion_models"),
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": (
        "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/diffusion_models/"
        "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "diffusion_models"),
    "wan_2.1_vae.safetensors": (
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/wan_2.1_vae.safetensors"
        "?download=true", "vae"),
}
LOADERS = {"CheckpointLoaderSimple", "UNETLoader", "DualCLIPLoader", "CLIPLoader", "VAELoader"}


def models_of(typ: str, widgets: dict) -> list:
    """properties.models of a loader node: every model file it loads, as [{name, url, directory}]."""
    if typ not in LOADERS:
        return []
    names = [v for k, v in widgets.items() if k.endswith("_name") or k.startswith("clip_name")]
    return [{"name": n, "url": MODELS[n][0], "directory": MODELS[n][1]} for n in names]


# The window a template is made to be read in (ComfyUI's page in a 1600x1000 browser window, as headless Chromium
# gives it: the canvas is 1600x857) and the frontend's own parts over the canvas: the side bar on the left, the tab bar
# and graph menu at the top, the zoom controls at the bottom right. Frontend 1.27 (ComfyUI 0.3.64) puts its canvas
# beside the side bar and below the menu (1536x779 from 64, 78): the same area in canvas pixels fits in it. The
# minimap both frontends show by default (about 250x200 at the bottom right) is not left out: of the layouts layout()
# finds at zoom 1, none keeps every node out of that corner, so view() puts the graph at the top and the minimap covers
# the lowest part of the last column until it is closed.
WINDOW = (1600, 1000)
VIEW = (60, 86, 1526, 772)  # left, top, right, bottom of the canvas area a graph is fitted into (canvas pixels)
SCALE = 1.0  # the zoom a template opens at: the frontend's own text size (layout() refuses a graph that needs less)

# Node sizes as the frontend computes them (LiteGraph's computeSize in frontends 1.27 and 1.49): a row of SLOT per
# input/output pair (one at least), WIDGET per widget, TEXT_BOX for a multiline text box, BOTTOM below the last widget
# (NO_WIDGETS where there is none). The frontend keeps a saved size that is at least that (it enlarges a smaller one);
# tests/test_browser.py checks that it keeps every size written here and that no two boxes overlap.
SLOT, WIDGET, TEXT_BOX, BOTTOM, NO_WIDGETS = 20, 24, 54, 14, 6
TEXT_BOXES = {"CLIPTextEncode": 1, "AttentionBackendsInfo": 1}  # Backends Info: its report box (web/patch_attention.js)
# widgets the frontend shows beyond IO's: "control after generate"; the report box; in ComfyUI 0.33, Create Video's
# bit_depth and, under Save Video's codec h264, its encoding mode (the widgets 0.3.64 lacks, left at their defaults)
EXTRA_WIDGETS = {"KSampler": 1, "KSamplerAdvanced": 1, "AttentionBackendsInfo": 1, "CreateVideo": 1, "SaveVideo": 1}
# widths: the frontend's own least is 140-250 for these nodes; loaders show most of a model file's name
WIDTH = {"CheckpointLoaderSimple": 300, "UNETLoader": 300, "CLIPLoader": 300, "DualCLIPLoader": 300,
         "CLIPTextEncode": 270, "EmptyHunyuanLatentVideo": 260, "VAEDecode": 160, "KSamplerAdvanced": 254}
DEFAULT_WIDTH = 250
# room for what they show: the prompt, the report (it scrolls), the image once sampled
EXTRA_HEIGHT = {"CLIPTextEncode": 12, "AttentionBackendsInfo": 32, "SaveImage": 100}
NOTE_SIZE = (300, 220)  # the least a Note gets (its text scrolls); it grows into the room its group leaves
# nodes that take the free height at the bottom of their stack in a group, in this order (not Save Video: ComfyUI 0.33's
# frontend sets its height to its widgets' own when it adds the inputs of the format it loads)
STRETCH = ("Note", "SaveImage", "AttentionBackendsInfo")
# between stacks in a group, between nodes in a stack, between groups; a group's margin left, right and below its nodes
# (the video templates, whose save is two nodes, fit the window at zoom 1 with these, not with 10 and 8)
COL_GAP, ROW_GAP, GROUP_GAP = 16, 6, 16
GROUP_PAD = 6
NODE_TITLE = 30  # a node's title bar, above its position (its size is the body's)
GROUP_TITLE = 66  # from a group's top to its first node's position: the group's title bar (30 in frontend 1.49, 34 in
#                   1.27), then the node's title
STEP = ROW_GAP + NODE_TITLE  # from a node's bottom to the next node's position below it


def node_size(typ, widgets=None):
    """[width, height] of a node's body (below its title): the frontend's own size, and the room in EXTRA_HEIGHT."""
    if typ == "Note":
        return list(NOTE_SIZE)
    ins, names, outs = IO[typ]
    rows = max(len(ins), len(outs), 1)
    count, boxes = len(names) + EXTRA_WIDGETS.get(typ, 0), TEXT_BOXES.get(typ, 0)
    h = SLOT * rows + (WIDGET * (count - boxes) + TEXT_BOX * boxes + BOTTOM if count else NO_WIDGETS)
    return [WIDTH.get(typ, DEFAULT_WIDTH), h + EXTRA_HEIGHT.get(typ, 0)]


def patch_widgets(**set_here):
    """Patch Attention's widgets: the node's defaults, and what a template sets (each needs a reason in NOTE_WHY)."""
    return {**defaults("PatchAttention"), **set_here}


# What each input of the pack's nodes does, in a template's note (the tooltips say the same at more length), and why
# a template sets an input away from the node's default: tests/test_workflows.py checks that every such input has
# its reason in the note.
EXPLAIN = {
    ("PatchAttention", "backend"): "auto times the kernels this GPU runs on your model's attention calls and keeps the "
                                   "fastest that stays close to exact attention (auto_fast: more error for more "
                                   "speed; auto_exact: exact kernels only; a name forces one kernel)",
    ("PatchAttention", "fallback"): "a call the kernel cannot take runs on the fastest exact kernel, counted",
    ("PatchAttention", "start_percent"): "the part of the sampling schedule (0-1) that uses the kernel",
    ("PatchAttention", "end_percent"): None,  # explained with start_percent
    ("PatchAttention", "dense_layers"): "layers kept exact, e.g. '0-3, 10' (empty: none)",
    ("PatchAttention", "log_stats"): "on, after each run the terminal lists which kernel ran, per kind of call; it "
                                     "times every call, which slows a step split over several GPUs",
    ("PatchAttention", "auto_retune"): "auto uses what it measured before on this GPU unless on",
    ("PatchAttention", "auto_min_cos"): "how close to exact attention auto must stay (cosine similarity, relative L1 "
                                        "error); 0: the chosen auto's own limits (auto 0.999 / 0.039)",
    ("PatchAttention", "auto_max_rel_l1"): None,  # explained with auto_min_cos
    ("PatchAttention", "check_finite"): "a step whose 8-bit kernel returned NaN (a black image) is redone on an "
                                        "exact kernel",
    ("PatchAttention", "sparse_start_percent"): "sparse kernels (SpargeAttn, Sol-Attn) run from this part of the "
                                                "schedule on",
    ("TuneSpargeAttn", "variant"): "the kernel tuned for: sparge (SpargeAttn); kitchen_sol tunes Sol-Attn",
    ("TuneSpargeAttn", "error_budget"): "the largest relative L1 error against dense attention a layer may have "
                                        "(0.07 = 7 %)",
    ("TuneSpargeAttn", "profile_name"): "the file the run writes in models/sparge_profiles",
    ("TuneSpargeAttn", "pvthreshd_values"): "the PV-stage thresholds searched (each one more multiplies the tuning "
                                            "time)",
    ("SpargeAttnSettings", "variant"): "the SpargeAttn kernel the profile was tuned for",
    ("SpargeAttnSettings", "simthreshd1"): "SpargeAttn's defaults, for layers the profile lacks",
    ("SpargeAttnSettings", "cdfthreshd"): None,
    ("SpargeAttnSettings", "pvthreshd"): None,
    ("SpargeAttnSettings", "topk"): None,
    ("SpargeAttnSettings", "profile"): "the per-layer profile",
    ("ContextParallel", "gpus"): "how many GPUs split each step (0: all of them)",
    ("ContextParallel", "cfg_split"): "with CFG above 1 each prompt gets half of the GPUs (on two, one each: ComfyUI's "
                                      "MultiGPU CFG Split, faster there); at CFG 1 every GPU splits each step",
    ("SpargeAttnSettings", "report_error_every"): "with log_stats, each layer's sparsity (N: also every N-th call's "
                                                  "error, one dense call each)",
}
NOTE_WHY = {
    ("PatchAttention", "log_stats"): "off by default",
    ("PatchAttention", "backend"): "the kernel the profile was tuned for",
    ("TuneSpargeAttn", "profile_name"): "named after the model it is tuned on",
    ("SpargeAttnSettings", "profile"): "the file Tune Sparse Attention writes in run 1",
}


ONLY_SET = {("PatchAttention", "log_stats"): "the terminal lists which kernel ran after each run (off by default)"}


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:g}"
    return "(empty)" if v == "" else str(v)


def inputs_note(node_type: str, widgets: dict, only_set: bool = False) -> str:
    """One line per input of a pack node as this template sets it: its value, what it does, and why where it is not
    the node's default (``only_set``: those lines only, the defaults listed in one line)."""
    base = defaults(node_type)
    lines = []
    names = IO[node_type][1]
    if only_set:
        off = [n for n in names if widgets[n] != base[n]]
        lines = [f"- {n} {_fmt(widgets[n])}: {ONLY_SET.get((node_type, n), NOTE_WHY[(node_type, n)])}." for n in off]
        rest = ", ".join(f"{n} {_fmt(widgets[n])}" for n in names if n not in off)
        return "\n".join(lines + [f"The node's defaults: {rest}."])
    for i, name in enumerate(names):
        what = EXPLAIN[(node_type, name)]
        if what is None:
            continue
        shown = [name]
        for nxt in names[i + 1:]:  # the inputs explained with this one
            if EXPLAIN[(node_type, nxt)] is not None:
                break
            shown.append(nxt)
        value = " / ".join(f"{n} {_fmt(widgets[n])}" for n in shown)
        why = [NOTE_WHY[(node_type, n)] for n in shown if widgets[n] != base[n]]
        lines.append(f"- {value}: {what}" + (f"; {'; '.join(why)}" if why else "") + ".")
    off = [n for n in names if widgets[n] != base[n]]
    tail = f"Every value but {', '.join(off)} is the node's default." if off else "Every value is the node's default."
    return "\n".join(lines + [tail])


def patch_note(widgets: dict, measured: str, extra: str = "") -> str:
    return (
        "Patch Attention: the model that comes out attends with the kernel you pick; the one that goes in is "
        "untouched.\n" + inputs_note("PatchAttention", widgets) + "\n\n" + extra + measured +
        "\n\nAttention Backends Info lists what is installed and why a kernel cannot run here (its report shows on "
        "the node)."
    )


def _rows(name):
    with open(os.path.join(DATA, name)) as f:
        return {(r["preset"], r["row"]): r for r in json.load(f)["rows"]}


def _shares(kernels: str) -> str:
    """'flash_attn4 67%, sdpa_cudnn 33% (auto: ...)' -> 'flash_attn4 for 67 % of the calls, sdpa_cudnn for 33 %'."""
    parts = [p.strip().rsplit(" ", 1) for p in kernels.split(" (")[0].split(",")]
    text = [f"{name} for {share.rstrip('%')} %" for name, share in parts]
    return ", ".join([text[0] + " of the calls", *text[1:]])


def measured():
    """What each template's note quotes, from the run's own data file (docs/data), so that the notes, README and
    docs/end-to-end.md quote one number."""
    wan = _rows("e2e-exact-wan-1.3b-h100.json")
    unp, auto = wan[("wan-1.3b", "unpatched")], wan[("wan-1.3b", "auto")]
    old = _rows("e2e-exact-wan-1.3b-0.3.64-h100.json")[("wan-1.3b", "auto")]  # the same model and size on 0.3.64
    flux = _rows("e2e-exact-image-h100.json")[("flux-dev", "auto")]
    img = _rows("e2e-image-h100-paired.json")
    sd15, sdxl = img[("sd15", "auto")]["paired"]["vs_unpatched"], img[("sdxl", "auto")]["paired"]["vs_unpatched"]
    return {
        "wan": f"\u00d7{auto['whole_vs_unpatched']:.2f}",
        "wan_exact": f"\u00d7{auto['whole_vs_unpatched']:.3f}",
        "wan_0364": f"\u00d7{old['whole_vs_unpatched']:.2f}",
        "wan_note": (
            f"Measured on one H100, this model at this size (480p, 81 frames), random weights: with auto_fast (the "
            f"earlier auto) on ComfyUI 0.33, {auto['s_per_step_whole']:.2f} s per step against "
            f"{unp['s_per_step_whole']:.2f} s unpatched (ComfyUI's own attention, PyTorch's flash kernel there), "
            f"\u00d7{auto['whole_vs_unpatched']:.2f} over a {auto['steps']}-step run; on ComfyUI 0.3.64, whose unpatched "
            f"attention runs cuDNN, \u00d7{old['whole_vs_unpatched']:.2f} over a {old['steps']}-step run. The default "
            "auto, which stays closer to exact, is not measured at this size yet. Other GPUs are not measured: the "
            "Attention Benchmark (end to end) node measures yours."),
        "flux": f"\u00d7{flux['vs_unpatched']:.2f}",
        "flux_note": (
            f"Measured on one H100 with ComfyUI 0.33, Flux-dev at 1024x1024, random weights: auto ran "
            f"\u00d7{flux['vs_unpatched']:.2f} per step against unpatched (ComfyUI's own attention, PyTorch's flash "
            f"kernel there; auto ran {_shares(flux['kernels'])}). Not measured on ComfyUI 0.3.64 with FlashAttention-4 "
            "or on other GPUs: the Attention Benchmark (end to end) node measures yours."),
        "sd_note": (
            "Measured on one H100 with ComfyUI 0.3.64, random weights, 20 rounds: against unpatched, auto ran "
            f"SD1.5 \u00d7{sd15[0]:.2f} (95 % interval {sd15[1]:.2f}-{sd15[2]:.2f}) and SDXL \u00d7{sdxl[0]:.2f} "
            f"({sdxl[1]:.2f}-{sdxl[2]:.2f}) per step: no difference beyond the noise. These models keep an H100 "
            "waiting on the CPU, not on attention. Not measured this way on ComfyUI 0.33 or on other GPUs: the "
            "Attention Benchmark (end to end) node measures yours."),
    }


MEASURED = measured()
# groups as (title, key), in the order layout() keeps when it sets them side by side or one above the other
GROUPS = [("Load", 0), ("Prompt and latent", 2), ("Patch attention", 1), ("Sample and save", 3)]


def sd_graph(ckpt, size, steps, cfg, sampler, scheduler, prompt):
    pw = patch_widgets()
    return {
        "groups": GROUPS,
        "nodes": [
            (1, "CheckpointLoaderSimple", {"ckpt_name": ckpt}, {}, 0),
            (10, "Note", {"text": patch_note(pw, MEASURED["sd_note"])}, {}, 1),
            (2, "PatchAttention", pw, {"model": (1, 0)}, 1),
            (9, "AttentionBackendsInfo", {}, {}, 1),
            (3, "CLIPTextEncode", {"text": prompt}, {"clip": (1, 1)}, 2),
            (4, "CLIPTextEncode", {"text": "blurry, low quality"}, {"clip": (1, 1)}, 2),
            (5, "EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}, {}, 2),
            (6, "KSampler", {"seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
                             "denoise": 1.0}, {"model": (2, 0), "positive": (3, 0), "negative": (4, 0), "latent_image": (5, 0)}, 3),
            (7, "VAEDecode", {}, {"samples": (6, 0), "vae": (1, 2)}, 3),
            (8, "SaveImage", {"filename_prefix": "patch_attention"}, {"images": (7, 0)}, 3),
        ],
    }


def flux_graph():
    pw = patch_widgets()
    return {
        "groups": [GROUPS[i] for i in (0, 2, 1, 3)],
        "nodes": [
            (1, "UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}, {}, 0),
            (3, "DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                                   "device": "default"}, {}, 0),
            (9, "VAELoader", {"vae_name": "ae.safetensors"}, {}, 0),
            (13, "Note", {"text": patch_note(pw, MEASURED["flux_note"])}, {}, 1),
            (2, "PatchAttention", pw, {"model": (1, 0)}, 1),
            (12, "AttentionBackendsInfo", {}, {}, 1),
            (4, "CLIPTextEncode", {"text": "a lighthouse on a cliff at dawn, photograph"}, {"clip": (3, 0)}, 2),
            (5, "FluxGuidance", {"guidance": 3.5}, {"conditioning": (4, 0)}, 2),
            # Flux-dev ignores the negative prompt at cfg 1; a short one instead of an empty box says so
            (6, "CLIPTextEncode", {"text": "(unused by Flux-dev at cfg 1.0)"}, {"clip": (3, 0)}, 2),
            (7, "EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, {}, 2),
            (8, "KSampler", {"seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
             {"model": (2, 0), "positive": (5, 0), "negative": (6, 0), "latent_image": (7, 0)}, 3),
            (10, "VAEDecode", {}, {"samples": (8, 0), "vae": (9, 0)}, 3),
            (11, "SaveImage", {"filename_prefix": "patch_attention_flux"}, {"images": (10, 0)}, 3),
        ],
    }


# A video template's save: ComfyUI's Create Video at Wan's 16 frames per second, then Save Video as an H.264 MP4 (encoded
# on several CPU cores; ComfyUI's Save Animated WEBP, which these templates used before, encodes on one). format and
# codec as ComfyUI 0.3.64's plain combos: ComfyUI 0.33's frontend puts codec into format's nested codec (format.codec),
# and its server takes the API's top-level codec through the legacy input it keeps for workflows of 0.3.x.
VIDEO_FPS = 16.0
VIDEO_SAVE = {"format": "mp4", "codec": "h264"}


def save_video(create_id: int, save_id: int, prefix: str, frames: tuple, group: int) -> list:
    """Create Video (``create_id``) from the ``frames`` link, and Save Video (``save_id``) writing it to
    output/<prefix>_NNNNN_.mp4, both in ``group``."""
    return [(create_id, "CreateVideo", {"fps": VIDEO_FPS}, {"images": frames}, group),
            (save_id, "SaveVideo", {"filename_prefix": prefix, **VIDEO_SAVE}, {"video": (create_id, 0)}, group)]


WAN_FRAMES = 81  # the size the numbers in the note were measured at
WAN_FILES = {"unet": "wan2.1_t2v_1.3B_fp16.safetensors", "clip": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
             "vae": "wan_2.1_vae.safetensors"}  # the names ComfyUI's own Wan 2.1 example uses
WAN_SAMPLING = ("30 uni_pc steps, cfg 6 and shift 8 are ComfyUI's own Wan 2.1 example's; 81 frames is the size "
                "measured below. ")


def wan_graph():
    pw = patch_widgets()
    return {
        "groups": GROUPS,
        "nodes": [
            (1, "UNETLoader", {"unet_name": WAN_FILES["unet"], "weight_dtype": "default"}, {}, 0),
            (2, "CLIPLoader", {"clip_name": WAN_FILES["clip"], "type": "wan", "device": "default"}, {}, 0),
            (3, "VAELoader", {"vae_name": WAN_FILES["vae"]}, {}, 0),
            (4, "ModelSamplingSD3", {"shift": 8.0}, {"model": (1, 0)}, 0),
            # the note and Backends Info one above the other, Patch Attention beside them: so the save's two nodes fit
            (13, "Note", {"text": patch_note(pw, MEASURED["wan_note"], WAN_SAMPLING)}, {}, 1),
            (12, "AttentionBackendsInfo", {}, {}, 1),
            (5, "PatchAttention", pw, {"model": (4, 0)}, 1),
            (6, "CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic"},
             {"clip": (2, 0)}, 2),
            (7, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, {"clip": (2, 0)}, 2),
            (8, "EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": WAN_FRAMES, "batch_size": 1}, {}, 2),
            (9, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
             {"model": (5, 0), "positive": (6, 0), "negative": (7, 0), "latent_image": (8, 0)}, 3),
            (10, "VAEDecode", {}, {"samples": (9, 0), "vae": (3, 0)}, 3),
            *save_video(16, 11, "video/patch_attention_wan", (10, 0), 3),
        ],
    }


# VAE Decode (several GPUs) in a note: what it does and its inputs at their defaults
VAE_MULTI_NOTE = (
    "VAE Decode (several GPUs) decodes the video on all the GPUs too, one tile each, with a copy of the VAE on each; "
    "the frames are ComfyUI's tiled decode with those tiles, bit for bit.\n"
    "- gpus 0: all of them.\n"
    "- tile_size 0: one tile of one size per GPU (a number: square tiles of that many pixels, as VAE Decode (Tiled) "
    "makes them)."
)
CP_NOTE = (
    "Context Parallel (multi-GPU): each sampling step runs on all the GPUs of this machine; on one GPU it does nothing "
    "and the terminal says so. It copies the model to every GPU, so the model must fit on one.\n"
    + inputs_note("ContextParallel", defaults("ContextParallel")) + "\n\nMeasured on 2x H100 (ComfyUI 0.33, Wan 2.1, "
    "81 frames, random weights): at CFG 5 (1.3B and 14B, 480p), a prompt per GPU ran x1.99 against one GPU with "
    "sage_fp8_sm90; at CFG 1 (a distilled LoRA) the split step ran x1.87-1.89 (14B, 480p; x1.81-1.86 on 2x H200) "
    "and x1.93-1.94 (14B, 720p); Wan 1.3B x1.8 with sage_fp8_sm90 or auto (x1.6-1.8 on 2x H200), held back by the "
    "CPU, x1.88 with auto_exact. Images and short clips stay on one GPU, where they ran faster (the node shows from "
    "how many tokens this model splits). "
    "Needs ComfyUI 0.33 or later.\n\n" + VAE_MULTI_NOTE
)


def wan_multigpu_graph():
    """The Wan 2.1 template with Context Parallel between Patch Attention and the sampler (its note under the Patch
    Attention note, the node under Patch Attention), and the VAE decode over the GPUs: VAE Decode (several GPUs), its
    defaults, in VAE Decode's place in the graph, under the Context Parallel note that describes it (the sampler's group
    has no room for it beside the save's two nodes at zoom 1)."""
    g = wan_graph()
    nodes, patch_group = [], []
    for n in g["nodes"]:
        if n[1] == "KSampler":
            n = (n[0], n[1], n[2], {**n[3], "model": (14, 0)}, n[4])
        if n[1] == "VAEDecode":
            n = (n[0], "VAEDecodeMultiGPU", defaults("VAEDecodeMultiGPU"), n[3], 1)
        (patch_group if n[4] == 1 else nodes).append(n)
    note, patch, info, decode = (next(n for n in patch_group if n[1] == t)
                                 for t in ("Note", "PatchAttention", "AttentionBackendsInfo", "VAEDecodeMultiGPU"))
    patch_group = [note, (15, "Note", {"text": CP_NOTE}, {}, 1), decode, patch,
                   (14, "ContextParallel", defaults("ContextParallel"), {"model": (5, 0)}, 1), info]
    groups = [(("Patch attention, several GPUs" if key == 1 else title), key) for title, key in g["groups"]]
    return {"groups": groups, "nodes": nodes + patch_group}


# ComfyUI's own Wan 2.2 14B text-to-video template: its files, its size (1280x704, 121 frames), 20 euler steps at CFG 3.5,
# the high-noise expert for the first 10; its ModelSamplingSD3 nodes set shift 8, the models' own (left out here)
WAN22_FILES = {"high": "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
               "low": "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"}
WAN22_NOTE = (
    "Wan 2.2 A14B on several GPUs: two expert models, the high-noise one for the first 10 of the 20 steps and the "
    "low-noise one for the rest (the files, size and sampling of ComfyUI's own Wan 2.2 14B template), each through a "
    "Context Parallel node of its own. Each expert is copied to every GPU, so each must fit on one. For Patch "
    "Attention's kernels, put one before each Context Parallel node (the Wan 2.1 template on several GPUs shows how).\n"
    + inputs_note("ContextParallel", defaults("ContextParallel")) + "\n\nNot measured with these two models yet. "
    "Wan 2.1 14B, the size of each expert, ran x1.97 per step against one GPU at CFG 5 on 2x H100 (ComfyUI 0.33, 480p, "
    "81 frames, random weights, auto_exact, a prompt per GPU). Needs ComfyUI 0.33 or later.\n\n" + VAE_MULTI_NOTE
)


def wan22_multigpu_graph():
    """Wan 2.2 A14B: a UNETLoader -> Context Parallel chain per expert, and two KSampler (Advanced), the first leaving
    noise for the second (the decoder and Create Video under the high-noise sampler, Save Video under the low-noise
    one, the video size with the loaders: so the graph fits the window at zoom 1)."""
    ks = {"noise_seed": 42, "steps": 20, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple"}
    create, save = save_video(18, 17, "video/context_parallel_wan22", (16, 0), 3)
    nodes = [
        (1, "UNETLoader", {"unet_name": WAN22_FILES["high"], "weight_dtype": "default"}, {}, 0),
        (2, "UNETLoader", {"unet_name": WAN22_FILES["low"], "weight_dtype": "default"}, {}, 0),
        (3, "CLIPLoader", {"clip_name": WAN_FILES["clip"], "type": "wan", "device": "default"}, {}, 0),
        (4, "VAELoader", {"vae_name": WAN_FILES["vae"]}, {}, 0),
        (13, "EmptyHunyuanLatentVideo", {"width": 1280, "height": 704, "length": 121, "batch_size": 1}, {}, 0),
        (11, "CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic"},
         {"clip": (3, 0)}, 2),
        (12, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, {"clip": (3, 0)}, 2),
        (20, "Note", {"text": WAN22_NOTE}, {}, 1),
        (9, "ContextParallel", defaults("ContextParallel"), {"model": (1, 0)}, 1),
        (10, "ContextParallel", defaults("ContextParallel"), {"model": (2, 0)}, 1),
        (14, "KSamplerAdvanced", {"add_noise": "enable", **ks, "start_at_step": 0, "end_at_step": 10,
                                  "return_with_leftover_noise": "enable"},
         {"model": (9, 0), "positive": (11, 0), "negative": (12, 0), "latent_image": (13, 0)}, 3),
        (16, "VAEDecodeMultiGPU", defaults("VAEDecodeMultiGPU"), {"samples": (15, 0), "vae": (4, 0)}, 3),
        create,
        (15, "KSamplerAdvanced", {"add_noise": "disable", **ks, "start_at_step": 10, "end_at_step": 10000,
                                  "return_with_leftover_noise": "disable"},
         {"model": (10, 0), "positive": (11, 0), "negative": (12, 0), "latent_image": (14, 0)}, 3),
        save,
    ]
    return {"groups": [("Load, video size", 0), ("Prompt", 2), ("Several GPUs", 1), ("Sample and save", 3)],
            "nodes": nodes}


TUNE_WIDGETS = {**defaults("TuneSpargeAttn"), "variant": "sparge", "profile_name": "wan2.1_t2v_1.3B"}
SETTINGS_WIDGETS = {**defaults("SpargeAttnSettings"), "variant": "sparge", "profile": "wan2.1_t2v_1.3B.json"}
SPARSE_PATCH = patch_widgets(backend="sparge", log_stats=True)
SPARSE_NOTE = (
    "Sparse attention tuned per layer, in two runs.\n"
    "1. Queue as it is: Tune Sparse Attention samples dense, finds each layer's sparsest SpargeAttn thresholds within "
    "the error budget and writes them to models/sparge_profiles. SpargeAttn Settings and Patch Attention are bypassed "
    "(purple) in this run: the model passes them untouched.\n"
    + inputs_note("TuneSpargeAttn", TUNE_WIDGETS) + "\n\n"
    "2. After run 1: click Tune Sparse Attention's title and press Ctrl+B (bypassed now); click SpargeAttn Settings' "
    "title, Ctrl+click Patch Attention's and press Ctrl+B (they run now). Queue again. The profile fits one model file "
    "only.\n"
    "SpargeAttn Settings:\n" + inputs_note("SpargeAttnSettings", SETTINGS_WIDGETS) + "\n"
    "Patch Attention:\n" + inputs_note("PatchAttention", SPARSE_PATCH, only_set=True) + " The Wan 2.1 video "
    "template's note explains each of them.\n\n"
    "SpargeAttn is installed on Linux only (install.py builds it there; Windows has none). Without it, set variant to "
    "kitchen_sol and use a Sol-Attn Settings node instead of SpargeAttn Settings (it needs comfy-kitchen 0.2.40 or "
    "later), or sample with backend = auto."
)
BYPASS = 4  # a node's mode: bypassed (its input goes through to its output of the same type)


def sparge_graph():
    """Tune, then sample with the profile: one sampler whose model comes through Tune Sparse Attention and Patch
    Attention, of which one is bypassed in each run (run 1: Patch Attention and its settings)."""
    return {
        # the second run's group last: at the right, the full height of the window, so the save's two nodes fit
        "groups": [("Load", 0), ("Prompt and latent", 1), ("1 · Tune Sparse Attention (run 1)", 2),
                   ("Sample and save", 4), ("2 · Sample with the profile (run 2)", 3)],
        "nodes": [
            (1, "UNETLoader", {"unet_name": WAN_FILES["unet"], "weight_dtype": "default"}, {}, 0),
            (2, "CLIPLoader", {"clip_name": WAN_FILES["clip"], "type": "wan", "device": "default"}, {}, 0),
            (3, "VAELoader", {"vae_name": WAN_FILES["vae"]}, {}, 0),
            (4, "ModelSamplingSD3", {"shift": 8.0}, {"model": (1, 0)}, 0),
            (6, "CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic"},
             {"clip": (2, 0)}, 1),
            (7, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, {"clip": (2, 0)}, 1),
            (8, "EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": WAN_FRAMES, "batch_size": 1}, {}, 1),
            (20, "Note", {"text": SPARSE_NOTE}, {}, 2),
            (9, "TuneSpargeAttn", TUNE_WIDGETS, {"model": (4, 0)}, 2),
            (13, "SpargeAttnSettings", SETTINGS_WIDGETS, {}, 3, BYPASS),
            (14, "PatchAttention", SPARSE_PATCH, {"model": (9, 0), "sparse_settings": (13, 0)}, 3, BYPASS),
            (10, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
             {"model": (14, 0), "positive": (6, 0), "negative": (7, 0), "latent_image": (8, 0)}, 4),
            (11, "VAEDecode", {}, {"samples": (10, 0), "vae": (3, 0)}, 4),
            *save_video(15, 12, "video/sparse_attention_wan", (11, 0), 4),
        ],
    }


def _nodes(graph):
    """(id, type, widgets, links, group, mode) for every node."""
    for n in graph["nodes"]:
        nid, typ, widgets, links, col = n[:5]
        yield nid, typ, widgets, links, col, (n[5] if len(n) > 5 else 0)


def to_api(graph):
    """The prompt the frontend would queue: muted and bypassed nodes left out, a link from a bypassed node taken from
    that node's input of the same type (as the frontend does)."""
    nodes = {nid: (typ, links, mode) for nid, typ, _w, links, _c, mode in _nodes(graph)}

    def source(src, slot):
        while nodes[src][2] == BYPASS:
            out_type = IO[nodes[src][0]][2][slot][1]
            ins = dict(IO[nodes[src][0]][0])
            src, slot = next(link for name, link in nodes[src][1].items() if ins[name] == out_type)
        return src, slot

    api = {}
    for nid, typ, widgets, links, _col, mode in _nodes(graph):
        if typ in UI_ONLY or mode != 0:  # muted or bypassed: not part of the prompt ComfyUI would queue
            continue
        inputs = dict(widgets)
        for name, link in links.items():
            src, slot = source(*link)
            inputs[name] = [str(src), slot]
        api[str(nid)] = {"class_type": typ, "inputs": inputs, "_meta": {"title": typ}}
    return api


def _cuts(items: list) -> list:
    """Every way to cut ``items`` (in their order) into consecutive runs."""
    out = []
    for cuts in range(1 << max(0, len(items) - 1)):
        runs = [[items[0]]]
        for i, x in enumerate(items[1:]):
            if cuts >> i & 1:
                runs.append([x])
            else:
                runs[-1].append(x)
        out.append(runs)
    return out


def _group_options(sizes: list) -> list:
    """The ways a group's nodes (sizes, in their order) stand in one to four side-by-side stacks of consecutive nodes:
    [(width, height, [[node index]])], only those that no other way beats in both width and height."""
    options = []
    for runs in _cuts(list(range(len(sizes)))):
        if len(runs) > 4:
            continue
        w = sum(max(sizes[i][0] for i in r) for r in runs) + COL_GAP * (len(runs) - 1) + 2 * GROUP_PAD
        h = GROUP_TITLE + max(sum(sizes[i][1] for i in r) + STEP * (len(r) - 1) for r in runs) + GROUP_PAD
        options.append((w, h, runs))
    options.sort(key=lambda o: (o[0], o[1]))
    best = []
    for o in options:
        if not best or o[1] < best[-1][1]:
            best.append(o)
    return best


def _blocks(lo: int, hi: int) -> list:
    """Every way to arrange groups lo..hi-1 (in their order) as nested blocks: a group's index, or ("h", left, right)
    side by side, or ("v", upper, lower) one above the other."""
    if hi - lo == 1:
        return [lo]
    return [(o, a, b) for m in range(lo + 1, hi) for a in _blocks(lo, m) for b in _blocks(m, hi) for o in "hv"]


def _extent(block, boxes) -> tuple:
    """(width, height) of a block of groups whose boxes are ``boxes``."""
    if isinstance(block, int):
        return boxes[block][:2]
    (aw, ah), (bw, bh) = _extent(block[1], boxes), _extent(block[2], boxes)
    return (aw + GROUP_GAP + bw, max(ah, bh)) if block[0] == "h" else (max(aw, bw), ah + GROUP_GAP + bh)


def _fill(block, boxes, x, y, w, h, out: dict) -> dict:
    """Each group's rectangle when ``block`` fills (x, y, w, h): blocks side by side share the height, blocks one above
    the other the width, and the last of two takes the room the first leaves."""
    if isinstance(block, int):
        out[block] = [x, y, w, h]
        return out
    aw, ah = _extent(block[1], boxes)
    if block[0] == "h":
        _fill(block[1], boxes, x, y, aw, h, out)
        _fill(block[2], boxes, x + aw + GROUP_GAP, y, w - aw - GROUP_GAP, h, out)
    else:
        _fill(block[1], boxes, x, y, w, ah, out)
        _fill(block[2], boxes, x, y + ah + GROUP_GAP, w, h - ah - GROUP_GAP, out)
    return out


def _place(members: list, runs: list, rect: list) -> dict:
    """Positions and sizes of a group's nodes in its rectangle: its stacks side by side, the room the group has beyond
    its nodes shared out to the stacks' widths, every node as wide as its stack, and the height a stack leaves free
    given to its first node that shows text or a picture (STRETCH)."""
    x0, y0, w, h = rect
    widths = [max(members[i][1][0] for i in r) for r in runs]
    spare = w - (sum(widths) + COL_GAP * (len(runs) - 1) + 2 * GROUP_PAD)
    widths = [cw + spare // len(runs) for cw in widths]
    inner = h - GROUP_TITLE - GROUP_PAD  # from the first node's position to the group's bottom margin
    place, x = {}, x0 + GROUP_PAD
    for r, cw in zip(runs, widths):
        sizes = {i: [cw, members[i][1][1]] for i in r}
        free = inner - (sum(s[1] for s in sizes.values()) + STEP * (len(r) - 1))
        grow = next((i for t in STRETCH for i in r if members[i][2] == t), None)
        if grow is not None:
            sizes[grow][1] += free
        y = y0 + GROUP_TITLE
        for i in r:
            place[members[i][0]] = ([x, y], sizes[i])
            y += sizes[i][1] + STEP
        x += cw + COL_GAP
    return place


def fit(width: float, height: float) -> float:
    """The largest scale (at most SCALE: the frontend's own size) at which a graph this big fits the VIEW."""
    left, top, right, bottom = VIEW
    return min(SCALE, (right - left) / width, (bottom - top) / height)


def layout(graph):
    """Node positions. A group's nodes stand in one to four stacks side by side; the groups (in their order) stand in
    nested blocks, side by side or one above the other. Of every such layout that fits the VIEW at zoom SCALE, the one
    with the fewest links that run right to left, then the shortest links. Raises ValueError when none fits.
    Returns ({id: (pos, size)}, [(title, bounding)], (width, height))."""
    import itertools

    members, links = {}, []
    for nid, typ, widgets, ins, col, _m in _nodes(graph):
        members.setdefault(col, []).append((nid, node_size(typ, widgets), typ))
        links += [(src, nid) for src, _slot in ins.values()]
    order = [c for _, c in graph["groups"]]
    options = [_group_options([s for _, s, _t in members[c]]) for c in order]
    blocks = _blocks(0, len(order))
    best, smallest = None, None
    for pick in itertools.product(*options):
        for block in blocks:
            size = _extent(block, pick)
            if smallest is None or fit(*size) > fit(*smallest):
                smallest = size
            if fit(*size) < SCALE:
                continue
            rects = _fill(block, pick, 0, 0, *size, {})
            place = {}
            for k, c in enumerate(order):
                place.update(_place(members[c], pick[k][2], rects[k]))
            back = sum(place[dst][0][0] < place[src][0][0] for src, dst in links)
            length = sum(abs(place[dst][0][0] - place[src][0][0] - place[src][1][0]) + abs(place[dst][0][1] - place[src][0][1])
                         for src, dst in links)
            key = (back, length)
            if best is None or key < best[0]:
                best = (key, place, rects, size)
    if best is None:
        left, top, right, bottom = VIEW
        raise ValueError(
            f"the graph does not fit a {WINDOW[0]}x{WINDOW[1]} window at zoom {SCALE}: its smallest layout is "
            f"{smallest[0]}x{smallest[1]} canvas pixels (zoom {fit(*smallest):.3f}), the view {right - left}x{bottom - top}; "
            "make nodes or notes smaller, or split a group")
    _key, place, rects, size = best
    titles = {c: t for t, c in graph["groups"]}
    return place, [(titles[c], rects[k]) for k, c in enumerate(order)], size


def view(size) -> dict:
    """extra.ds: the graph (origin at 0, 0) at zoom SCALE in the VIEW of a WINDOW-sized browser window, centred across,
    at the top (as far as it can be from the minimap, which both frontends show at the bottom right by default)."""
    scale = fit(*size)
    if scale < SCALE:
        raise ValueError(f"a {size[0]}x{size[1]} graph does not fit the view at zoom {SCALE}")
    left, top, right, _ = VIEW
    x = left + ((right - left) - size[0] * scale) / 2
    return {"scale": round(scale, 4), "offset": [round(x / scale, 1), round(top / scale, 1)]}


def to_ui(graph):
    links, nodes = [], []
    out_links = {}
    lid = 0
    items = list(_nodes(graph))
    for nid, _typ, _w, ins, _c, _m in items:
        for name, (src, slot) in ins.items():
            lid += 1
            links.append((lid, src, slot, nid, name))
            out_links.setdefault((src, slot), []).append(lid)
    types = {nid: typ for nid, typ, *_ in items}
    ui_links = []
    for lid_, src, slot, dst, name in links:
        in_types = dict(IO[types[dst]][0])
        ui_links.append([lid_, src, slot, dst, [n for n, _ in IO[types[dst]][0]].index(name), in_types[name]])
    place, groups, size = layout(graph)
    for order, (nid, typ, widgets, _ins, _col, mode) in enumerate(items):
        link_ins, widget_names, outs = IO[typ]
        values = []
        for w in widget_names:
            values.append(widgets.get(w))
            if (typ, w) in (("KSampler", "seed"), ("KSamplerAdvanced", "noise_seed")):
                values.append(SEED_CONTROL)
        inputs = []
        for name, t in link_ins:
            link = next((lid_ for lid_, s, sl, d, n in links if d == nid and n == name), None)
            slot = {"name": name, "type": t, "link": link}
            if (typ, name) in OPTIONAL_LINKS:
                slot["shape"] = 7
            inputs.append(slot)
        outputs = [{"name": n, "type": t, "links": out_links.get((nid, k), []), "slot_index": k} for k, (n, t) in enumerate(outs)]
        pos, nsize = place[nid]
        properties = {"Node name for S&R": typ}
        if models_of(typ, widgets):
            properties["models"] = models_of(typ, widgets)
        node = {"id": nid, "type": typ, "pos": pos, "size": nsize, "flags": {}, "order": order, "mode": mode,
                "inputs": inputs, "outputs": outputs, "properties": properties, "widgets_values": values}
        if typ == "Note":
            node["color"], node["bgcolor"] = "#432", "#653"
        nodes.append(node)
    return {
        "last_node_id": max(n["id"] for n in nodes), "last_link_id": lid, "nodes": nodes, "links": ui_links,
        "groups": [{"title": t, "bounding": b, "color": "#3f789e", "font_size": 24, "flags": {}} for t, b in groups],
        # saved_view: web/patch_attention.js opens the template at extra.ds from the template browser too, where
        # frontend 1.49 would fit it into 75 % of the canvas instead (zoom 0.82 here)
        "config": {}, "extra": {"ds": view(size), "patch_attention": {"saved_view": True}}, "version": 0.4,
    }


# File name = the template's title in ComfyUI's template browser (frontend 1.49 shows custom nodes' templates by
# file name, with no index of titles or descriptions).
WORKFLOWS = {
    "SD 1.5 image 512px": sd_graph("v1-5-pruned-emaonly-fp16.safetensors", 512, 20, 7.0, "euler", "normal",
                                   "a watercolor fox in a snowy forest"),
    "SDXL image 1024px": sd_graph("sd_xl_base_1.0.safetensors", 1024, 25, 6.0, "dpmpp_2m", "karras",
                                  "a red vintage car on a coastal road, golden hour"),
    "Flux.1 dev image 1024px": flux_graph(),
    "Wan 2.1 video 480p 81 frames": wan_graph(),
    "Wan 2.1 sparse attention tuning": sparge_graph(),
    "Wan 2.1 video on several GPUs": wan_multigpu_graph(),
    "Wan 2.2 A14B video on several GPUs": wan22_multigpu_graph(),
}


# What a template's card says under its title: frontend 1.49 shows a custom node pack's template as its thumbnail and
# file name only, so the thumbnail carries the description.
DESCRIPTIONS = {
    "SD 1.5 image 512px": "SD 1.5, 512x512, 20 steps. Patch Attention set to auto; the note says what each input does.",
    "SDXL image 1024px": "SDXL, 1024x1024, 25 steps. Patch Attention set to auto; the note says what each input does.",
    "Flux.1 dev image 1024px": f"Flux.1 dev, 1024x1024. auto ran {MEASURED['flux']} per step on an H100 "
                               "(ComfyUI 0.33).",
    "Wan 2.1 video 480p 81 frames": "Wan 2.1 1.3B text to video, 480p, 81 frames. Patch Attention set to auto; the "
                                    "note gives the measured speed-up.",
    "Wan 2.1 sparse attention tuning": "Wan 2.1: tune sparse attention per layer in one run, then sample with the "
                                       "profile in the next.",
    "Wan 2.1 video on several GPUs": "Wan 2.1 1.3B 480p on all your GPUs: Context Parallel after Patch Attention. "
                                     "x1.99 on 2x H100, CFG 5, ComfyUI 0.33.",
    "Wan 2.2 A14B video on several GPUs": "Wan 2.2 A14B text to video, 1280x704, 121 frames: both experts on all your "
                                          "GPUs, a Context Parallel node each. ComfyUI 0.33+.",
}


def thumbnails(shots: str, size: int = 512):
    """workflows/<name>.jpg: the graph above the template's description, from tests/test_browser.py's picture-<name>.png
    (the workflow loaded without the frontend's model-file checks: no red ring or notice for the files the test
    machine lacks, the minimap closed)."""
    from PIL import Image, ImageFont

    band = 150
    font = ImageFont.load_default(size=26)
    for name, graph in WORKFLOWS.items():
        shot = Image.open(os.path.join(shots, f"picture-{name}.png")).convert("RGB")
        # the graph where its saved view puts it (ComfyUI 0.33's frontend: the canvas fills the window)
        ds = view(layout(graph)[2])
        (ox, oy), sc = ds["offset"], ds["scale"]
        width, height = layout(graph)[2]
        shot = shot.crop((int(ox * sc), int(oy * sc), int((ox + width) * sc), int((oy + height) * sc)))
        shot.thumbnail((size - 16, size - band - 16))
        card = Image.new("RGB", (size, size), (32, 32, 36))
        card.paste(shot, ((size - shot.width) // 2, 8 + (size - band - 16 - shot.height) // 2))
        caption(card, name, band, font)
        card.save(os.path.join(OUT, f"{name}.jpg"), quality=88)
    print("thumbnails for", ", ".join(WORKFLOWS))


def caption(card, name: str, band: int = 150, font=None):
    """The template's description in the band at the bottom of its thumbnail ``card`` (drawn over what is there)."""
    import textwrap

    from PIL import ImageDraw, ImageFont

    font = font or ImageFont.load_default(size=26)
    size = card.height
    draw = ImageDraw.Draw(card)
    draw.rectangle((0, size - band, card.width, size), fill=(20, 20, 24))
    text = DESCRIPTIONS[name].replace("\u00d7", "x")  # the built-in font has no multiplication sign
    for i, line in enumerate(textwrap.wrap(text, 36)[:4]):
        draw.text((16, size - band + 12 + 32 * i), line, font=font, fill=(235, 235, 235))


def recaption(names=()):
    """Redraw only the description band of the existing thumbnails (``names``, or all), after a measured number
    changed, keeping the graph above it: no screenshots needed."""
    from PIL import Image

    for name in names or WORKFLOWS:
        path = os.path.join(OUT, f"{name}.jpg")
        card = Image.open(path).convert("RGB")
        caption(card, name)
        card.save(path, quality=88)
    print("captions for", ", ".join(names or WORKFLOWS))


def report_picture(shots: str, out: str = os.path.join(ROOT, "docs", "report-on-canvas.png")):
    """docs/report-on-canvas.png: the two report nodes from tests/test_browser.py's report-on-canvas.png (ComfyUI 0.33's
    frontend, 1600x1000 window), cut to the nodes."""
    from PIL import Image

    shot = Image.open(os.path.join(shots, "report-on-canvas.png")).convert("RGB")
    shot = shot.crop((90, 100, min(shot.width, 1562), min(shot.height, 600)))  # the two nodes, below the top bar
    shot.save(out, optimize=True)
    print("wrote", os.path.relpath(out, ROOT), shot.size)


def main():
    import sys

    if "--thumbnails" in sys.argv:
        return thumbnails(sys.argv[sys.argv.index("--thumbnails") + 1])
    if "--report-picture" in sys.argv:
        return report_picture(sys.argv[sys.argv.index("--report-picture") + 1])
    if "--captions" in sys.argv:
        return recaption(sys.argv[sys.argv.index("--captions") + 1:])
    os.makedirs(os.path.join(OUT, "api"), exist_ok=True)
    for stale in glob.glob(os.path.join(OUT, "*.json")) + glob.glob(os.path.join(OUT, "api", "*.json")):
        if os.path.splitext(os.path.basename(stale))[0] not in WORKFLOWS:  # a template renamed or dropped
            os.remove(stale)
    for name, graph in WORKFLOWS.items():
        try:
            ui = to_ui(graph)
        except ValueError as e:  # the graph does not fit the window at zoom SCALE
            raise SystemExit(f"{name}: {e}") from None
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(ui, f, indent=1)
        with open(os.path.join(OUT, "api", f"{name}.json"), "w") as f:
            json.dump(to_api(graph), f, indent=1)
    print("wrote", ", ".join(WORKFLOWS))


if __name__ == "__main__":
    main()
