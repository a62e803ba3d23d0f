"""Write the example workflows in workflows/, in ComfyUI's UI format and its API format, from one description.

    python tests/tools/make_workflows.py                        # the JSON files
    python tests/tools/make_workflows.py --thumbnails .build/artifacts
                                    # workflows/<name>.jpg (template browser) from tests/test_browser.py's screenshots
    python tests/tools/make_workflows.py --captions [NAME...]   # only the description band of existing thumbnails

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

# node type -> (inputs that are links [(name, type)], widget names in order, outputs [(name, type)])
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
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [], [("IMAGE", "IMAGE")]),
    "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], []),
    "SaveAnimatedWEBP": ([("images", "IMAGE")], ["filename_prefix", "fps", "lossless", "quality", "method"], []),
    "PatchAttention": ([("model", "MODEL"), ("sparge_settings", "SPARSE_SETTINGS")],
                       ["backend", "fallback", "start_percent", "end_percent", "dense_layers", "log_stats",
                        "auto_retune", "auto_min_cos", "auto_max_rel_l1", "check_finite", "sparse_start_percent"],
                       [("model", "MODEL")]),
    "SpargeAttnSettings": ([], ["variant", "simthreshd1", "cdfthreshd", "pvthreshd", "topk", "profile", "report_error_every"],
                           [("sparse_settings", "SPARSE_SETTINGS")]),
    "TuneSpargeAttn": ([("model", "MODEL")], ["variant", "error_budget", "profile_name", "pvthreshd_values"],
                       [("model", "MODEL")]),
    "AttentionBackendsInfo": ([], [], [("report", "STRING")]),
    "Note": ([], ["text"], []),
}
OPTIONAL_LINKS = {("PatchAttention", "sparge_settings")}
LABELS = {("PatchAttention", "sparge_settings"): "sparse_settings"}  # the input's display name, saved as the frontend does
UI_ONLY = {"Note"}  # not in the API format
SEED_CONTROL = "fixed"  # KSampler's seed widget carries a "control after generate" value in the UI format

# Estimated node heights in the frontend (title, one row per slot pair, one per widget); the browser test measures
# the real boxes and fails on any overlap, so these only need to be generous.
TITLE, SLOT, WIDGET, MULTILINE = 34, 22, 26, 110
WIDTH = {"PatchAttention": 360, "Note": 380, "AttentionBackendsInfo": 380, "CLIPTextEncode": 400, "KSampler": 320,
         "SpargeAttnSettings": 340, "TuneSpargeAttn": 340}
EXTRA_HEIGHT = {"AttentionBackendsInfo": 260, "SaveImage": 260, "SaveAnimatedWEBP": 300}  # room for what they show
COL_GAP, ROW_GAP, GROUP_PAD = 70, 40, 40
GROUP_TITLE = 80  # from a group's top to its first node's position: the group's title bar, then the node's title


def node_size(typ, widgets):
    ins, names, outs = IO[typ]
    multiline = {"CLIPTextEncode": 1, "Note": 1}.get(typ, 0)
    h = TITLE + SLOT * max(len(ins), len(outs)) + WIDGET * (len(names) - multiline) + MULTILINE * multiline
    if typ == "Note":
        h = max(h, 60 + 17 * (widgets.get("text", "").count("\n") + len(widgets.get("text", "")) // 52))
    return [WIDTH.get(typ, 300), h + EXTRA_HEIGHT.get(typ, 0)]


def patch_widgets(backend="auto", start=0.0, end=1.0, dense="", log_stats=True):
    return {"backend": backend, "fallback": True, "start_percent": start, "end_percent": end, "dense_layers": dense,
            "log_stats": log_stats, "auto_retune": False, "auto_min_cos": 0.0, "auto_max_rel_l1": 0.0, "check_finite": True,
            "sparse_start_percent": 0.2}


PATCH_NOTE = (
    "Patch Attention: the model that comes out attends with the backend you pick; the model that goes in is "
    "untouched.\n\n"
    "Try first: backend = auto. On the first run it times the kernels this GPU can run on your model's attention "
    "calls and keeps the fastest that stays close to exact attention (remembered for later runs); auto_exact does the "
    "same among exact kernels only; auto_fast allows more error for more speed where sparse kernels pass. log_stats "
    "prints which kernel ran, per call kind, after each run.\n\n"
    "backend: a kernel by name, or sdpa (ComfyUI's own attention). fallback: calls a kernel cannot take go to the "
    "fastest exact kernel, counted. start/end_percent: use the kernel only in this part of the schedule. "
    "dense_layers: layers kept exact ('0-3, 10'). check_finite: redo a step whose 8-bit kernel returned NaN. sparse_start_percent: sparse "
    "kernels (SpargeAttn, Sol-Attn) only from this part of the schedule on.\n\n"
    "Attention Backends Info (below) shows what is installed and why a kernel cannot run here."
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
    flux = _rows("e2e-exact-image-h100.json")[("flux-dev", "auto")]
    img = _rows("e2e-image-h100-paired.json")
    sd15, sdxl = img[("sd15", "auto")]["paired"]["vs_unpatched"], img[("sdxl", "auto")]["paired"]["vs_unpatched"]
    return {
        "wan": f"\u00d7{auto['whole_vs_unpatched']:.2f}",
        "wan_exact": f"\u00d7{auto['whole_vs_unpatched']:.3f}",
        "wan_note": (
            f"Measured on one H100 with ComfyUI 0.33, this model at this size (480p, 81 frames), {auto['steps']} steps, "
            f"random weights: auto_fast (the earlier auto) took {auto['s_per_step_whole']:.2f} s per step against "
            f"{unp['s_per_step_whole']:.2f} s unpatched (ComfyUI's own attention, which runs PyTorch's flash kernel "
            f"there): \u00d7{auto['whole_vs_unpatched']:.2f} over the whole run. The default auto, which stays closer "
            "to exact, is not measured at this size yet. Other GPUs are not measured: the "
            "Attention Benchmark (end to end) node measures yours."),
        "flux": f"\u00d7{flux['vs_unpatched']:.2f}",
        "flux_note": (
            f"Measured on one H100 with ComfyUI 0.33, Flux-dev at 1024x1024, random weights: auto ran "
            f"\u00d7{flux['vs_unpatched']:.2f} per step against unpatched (ComfyUI's own attention, PyTorch's flash "
            f"kernel there; auto ran {_shares(flux['kernels'])}). Other GPUs are not measured: the "
            "Attention Benchmark (end to end) node measures yours."),
        "sd_note": (
            "Measured on one H100 with ComfyUI 0.3.64, random weights, 20 rounds: against unpatched, auto ran "
            f"SD1.5 \u00d7{sd15[0]:.2f} (95 % interval {sd15[1]:.2f}-{sd15[2]:.2f}) and SDXL \u00d7{sdxl[0]:.2f} "
            f"({sdxl[1]:.2f}-{sdxl[2]:.2f}) per step: no difference beyond the noise. These models keep an H100 "
            "waiting on the CPU, not on attention. Other GPUs are not measured: the Attention Benchmark (end to end) "
            "node measures yours."),
    }


MEASURED = measured()


def sd_graph(ckpt, size, steps, cfg, sampler, scheduler, prompt):
    return {
        "groups": [("Load", 0), ("Patch attention", 1), ("Prompt and latent", 2), ("Sample", 3), ("Decode and save", 4)],
        "nodes": [
            (1, "CheckpointLoaderSimple", {"ckpt_name": ckpt}, {}, 0),
            (10, "Note", {"text": PATCH_NOTE + "\n\n" + MEASURED["sd_note"]}, {}, 1),
            (2, "PatchAttention", patch_widgets(), {"model": (1, 0)}, 1),
            (9, "AttentionBackendsInfo", {}, {}, 1),
            (3, "CLIPTextEncode", {"text": prompt}, {"clip": (1, 1)}, 2),
            (4, "CLIPTextEncode", {"text": "blurry, low quality"}, {"clip": (1, 1)}, 2),
            (5, "EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}, {}, 2),
            (6, "KSampler", {"seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
                             "denoise": 1.0}, {"model": (2, 0), "positive": (3, 0), "negative": (4, 0), "latent_image": (5, 0)}, 3),
            (7, "VAEDecode", {}, {"samples": (6, 0), "vae": (1, 2)}, 4),
            (8, "SaveImage", {"filename_prefix": "patch_attention"}, {"images": (7, 0)}, 4),
        ],
    }


def flux_graph():
    return {
        "groups": [("Load", 0), ("Patch attention", 1), ("Prompt and latent", 2), ("Sample", 3), ("Decode and save", 4)],
        "nodes": [
            (1, "UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}, {}, 0),
            (3, "DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                                   "device": "default"}, {}, 0),
            (9, "VAELoader", {"vae_name": "ae.safetensors"}, {}, 0),
            (13, "Note", {"text": PATCH_NOTE + "\n\n" + MEASURED["flux_note"]}, {}, 1),
            (2, "PatchAttention", patch_widgets(), {"model": (1, 0)}, 1),
            (12, "AttentionBackendsInfo", {}, {}, 1),
            (4, "CLIPTextEncode", {"text": "a lighthouse on a cliff at dawn, photograph"}, {"clip": (3, 0)}, 2),
            (5, "FluxGuidance", {"guidance": 3.5}, {"conditioning": (4, 0)}, 2),
            # Flux-dev ignores the negative prompt at cfg 1; a short one instead of an empty box says so
            (6, "CLIPTextEncode", {"text": "(unused by Flux-dev at cfg 1.0)"}, {"clip": (3, 0)}, 2),
            (7, "EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, {}, 2),
            (8, "KSampler", {"seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
             {"model": (2, 0), "positive": (5, 0), "negative": (6, 0), "latent_image": (7, 0)}, 3),
            (10, "VAEDecode", {}, {"samples": (8, 0), "vae": (9, 0)}, 4),
            (11, "SaveImage", {"filename_prefix": "patch_attention_flux"}, {"images": (10, 0)}, 4),
        ],
    }


WAN_FRAMES = 81  # the size the numbers in the note were measured at
WAN_FILES = {"unet": "wan2.1_t2v_1.3B_fp16.safetensors", "clip": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
             "vae": "wan_2.1_vae.safetensors"}  # the names ComfyUI's own Wan 2.1 example uses


def wan_graph():
    return {
        "groups": [("Load", 0), ("Patch attention", 1), ("Prompt and latent", 2), ("Sample", 3), ("Decode and save", 4)],
        "nodes": [
            (1, "UNETLoader", {"unet_name": WAN_FILES["unet"], "weight_dtype": "default"}, {}, 0),
            (2, "CLIPLoader", {"clip_name": WAN_FILES["clip"], "type": "wan", "device": "default"}, {}, 0),
            (3, "VAELoader", {"vae_name": WAN_FILES["vae"]}, {}, 0),
            (4, "ModelSamplingSD3", {"shift": 8.0}, {"model": (1, 0)}, 0),
            (13, "Note", {"text": PATCH_NOTE + "\n\nVideo is where kernels pay most. " + MEASURED["wan_note"]}, {}, 1),
            (5, "PatchAttention", patch_widgets(), {"model": (4, 0)}, 1),
            (12, "AttentionBackendsInfo", {}, {}, 1),
            (6, "CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic"},
             {"clip": (2, 0)}, 2),
            (7, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, {"clip": (2, 0)}, 2),
            (8, "EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": WAN_FRAMES, "batch_size": 1}, {}, 2),
            (9, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
             {"model": (5, 0), "positive": (6, 0), "negative": (7, 0), "latent_image": (8, 0)}, 3),
            (10, "VAEDecode", {}, {"samples": (9, 0), "vae": (3, 0)}, 4),
            (11, "SaveAnimatedWEBP", {"filename_prefix": "patch_attention_wan", "fps": 16.0, "lossless": False, "quality": 90,
                                      "method": "default"}, {"images": (10, 0)}, 4),
        ],
    }


SPARGE_NOTE = (
    "Sparse attention tuned per layer (SpargeAttn), in two runs.\n\n"
    "1. Queue once as it is: Tune Sparse Attention samples dense and, for every attention layer, finds the sparsest "
    "SpargeAttn thresholds within the error budget; it writes models/sparge_profiles/wan2.1_t2v_1.3B.json.\n\n"
    "2. Then select the muted group below (click its title) and press Ctrl+M to un-mute it, mute group 1 the same "
    "way, and queue again: SpargeAttn Settings loads the profile and Patch Attention samples with it.\n\n"
    "A profile belongs to one model file; another model is refused with the reason.\n\n"
    "SpargeAttn is installed on Linux only (install.py builds it there; Windows installs have none, and "
    "Attention Backends Info says so). Without it, set variant to kitchen_sol in Tune Sparse Attention and use a "
    "Sol-Attn Settings node instead of SpargeAttn Settings (Sol-Attn needs comfy-kitchen 0.2.40 or later), or "
    "sample with backend = auto."
)


def sparge_graph():
    return {
        "groups": [("Load", 0), ("Prompt and latent", 1), ("1 · Tune Sparse Attention (run once)", 2),
                   ("2 · Sample with the profile (un-mute after run 1)", 3)],
        "nodes": [
            (1, "UNETLoader", {"unet_name": WAN_FILES["unet"], "weight_dtype": "default"}, {}, 0),
            (2, "CLIPLoader", {"clip_name": WAN_FILES["clip"], "type": "wan", "device": "default"}, {}, 0),
            (3, "VAELoader", {"vae_name": WAN_FILES["vae"]}, {}, 0),
            (4, "ModelSamplingSD3", {"shift": 8.0}, {"model": (1, 0)}, 0),
            (20, "Note", {"text": SPARGE_NOTE}, {}, 1),
            (6, "CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic"},
             {"clip": (2, 0)}, 1),
            (7, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, {"clip": (2, 0)}, 1),
            (8, "EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": WAN_FRAMES, "batch_size": 1}, {}, 1),
            (9, "TuneSpargeAttn", {"variant": "sparge", "error_budget": 0.05, "profile_name": "wan2.1_t2v_1.3B",
                                   "pvthreshd_values": "50"}, {"model": (4, 0)}, 2),
            (10, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
             {"model": (9, 0), "positive": (6, 0), "negative": (7, 0), "latent_image": (8, 0)}, 2),
            (11, "VAEDecode", {}, {"samples": (10, 0), "vae": (3, 0)}, 2),
            (12, "SaveAnimatedWEBP", {"filename_prefix": "sparge_tuning_run", "fps": 16.0, "lossless": False, "quality": 90,
                                      "method": "default"}, {"images": (11, 0)}, 2),
            (13, "SpargeAttnSettings", {"variant": "sparge", "simthreshd1": 0.6, "cdfthreshd": 0.98, "pvthreshd": 50.0,
                                        "topk": 0.5, "profile": "wan2.1_t2v_1.3B.json", "report_error_every": 0}, {}, 3, 2),
            (14, "PatchAttention", patch_widgets(backend="sparge"), {"model": (4, 0), "sparge_settings": (13, 0)}, 3, 2),
            (15, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
             {"model": (14, 0), "positive": (6, 0), "negative": (7, 0), "latent_image": (8, 0)}, 3, 2),
            (16, "VAEDecode", {}, {"samples": (15, 0), "vae": (3, 0)}, 3, 2),
            (17, "SaveAnimatedWEBP", {"filename_prefix": "sparge_profile_run", "fps": 16.0, "lossless": False, "quality": 90,
                                      "method": "default"}, {"images": (16, 0)}, 3, 2),
        ],
        # group 2 is laid out as a row under group 1, not as a column
        "rows": {3: 2},
    }


def _nodes(graph):
    """(id, type, widgets, links, column, mode) for every node."""
    for n in graph["nodes"]:
        nid, typ, widgets, links, col = n[:5]
        yield nid, typ, widgets, links, col, (n[5] if len(n) > 5 else 0)


def to_api(graph):
    api = {}
    for nid, typ, widgets, links, _col, mode in _nodes(graph):
        if typ in UI_ONLY or mode != 0:  # muted nodes are not part of the prompt ComfyUI would queue
            continue
        inputs = dict(widgets)
        for name, (src, slot) in links.items():
            inputs[name] = [str(src), slot]
        api[str(nid)] = {"class_type": typ, "inputs": inputs, "_meta": {"title": typ}}
    return api


def layout(graph):
    """Node positions: one column per group, stacked top to bottom; a group listed in ``rows`` is laid out as a row
    below the group it names.  Returns ({id: (pos, size)}, [(title, bounding)])."""
    cols = {}
    for nid, typ, widgets, _l, col, _m in _nodes(graph):
        cols.setdefault(col, []).append((nid, node_size(typ, widgets)))
    rows = graph.get("rows", {})
    place, bounds = {}, {}
    x = 40
    for col in sorted(c for c in cols if c not in rows):
        y = 40 + GROUP_TITLE
        w = max(s[0] for _, s in cols[col])
        for nid, size in cols[col]:
            place[nid] = ([x + GROUP_PAD / 2, y], size)
            y += size[1] + ROW_GAP
        bounds[col] = [x, 40, w + GROUP_PAD, y - 40]
        x += w + GROUP_PAD + COL_GAP
    for col, under in rows.items():
        top = max(b[1] + b[3] for b in bounds.values()) + COL_GAP
        x = bounds[under][0]
        h = max(s[1] for _, s in cols[col])
        for nid, size in cols[col]:
            place[nid] = ([x + GROUP_PAD / 2, top + GROUP_TITLE], size)
            x += size[0] + COL_GAP
        bounds[col] = [bounds[under][0], top, x - bounds[under][0], h + GROUP_TITLE + ROW_GAP]
    titles = dict((c, t) for t, c in graph["groups"])
    return place, [(titles[c], bounds[c]) for c in sorted(bounds)]


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
    place, groups = layout(graph)
    for order, (nid, typ, widgets, _ins, _col, mode) in enumerate(items):
        link_ins, widget_names, outs = IO[typ]
        values = []
        for w in widget_names:
            values.append(widgets.get(w))
            if typ == "KSampler" and w == "seed":
                values.append(SEED_CONTROL)
        inputs = []
        for name, t in link_ins:
            link = next((lid_ for lid_, s, sl, d, n in links if d == nid and n == name), None)
            slot = {"name": name, "type": t, "link": link}
            if (typ, name) in LABELS:
                slot["label"] = LABELS[(typ, name)]
            if (typ, name) in OPTIONAL_LINKS:
                slot["shape"] = 7
            inputs.append(slot)
        outputs = [{"name": n, "type": t, "links": out_links.get((nid, k), []), "slot_index": k} for k, (n, t) in enumerate(outs)]
        pos, size = place[nid]
        node = {"id": nid, "type": typ, "pos": pos, "size": size, "flags": {}, "order": order, "mode": mode,
                "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": typ}, "widgets_values": values}
        if typ == "Note":
            node["color"], node["bgcolor"] = "#432", "#653"
        nodes.append(node)
    return {
        "last_node_id": max(n["id"] for n in nodes), "last_link_id": lid, "nodes": nodes, "links": ui_links,
        "groups": [{"title": t, "bounding": b, "color": "#3f789e", "font_size": 24, "flags": {}} for t, b in groups],
        "config": {}, "extra": {"ds": {"scale": 0.6, "offset": [0, 0]}}, "version": 0.4,
    }


# File name = the template's title in ComfyUI's template browser (frontend 1.49 shows custom nodes' templates by
# file name, with no index of titles or descriptions).
WORKFLOWS = {
    "SD 1.5 image 512px": sd_graph("v1-5-pruned-emaonly.safetensors", 512, 20, 7.0, "euler", "normal",
                                   "a watercolor fox in a snowy forest"),
    "SDXL image 1024px": sd_graph("sd_xl_base_1.0.safetensors", 1024, 25, 6.0, "dpmpp_2m", "karras",
                                  "a red vintage car on a coastal road, golden hour"),
    "Flux.1 dev image 1024px": flux_graph(),
    "Wan 2.1 video 480p 81 frames": wan_graph(),
    "Wan 2.1 sparse attention tuning": sparge_graph(),
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
}


def thumbnails(shots: str, size: int = 512):
    """workflows/<name>.jpg: the graph (from tests/test_browser.py's screenshot) above the template's description."""
    from PIL import Image, ImageChops, ImageFont

    band = 150
    font = ImageFont.load_default(size=26)
    for name in WORKFLOWS:
        shot = Image.open(os.path.join(shots, f"{name}.png")).convert("RGB")
        shot = shot.crop((60, 60, min(shot.width, 1900), min(shot.height, 1250)))  # the canvas, without the side bar
        box = ImageChops.difference(shot, Image.new("RGB", shot.size, shot.getpixel((shot.width - 1, shot.height - 1))))
        bbox = box.convert("L").point(lambda v: 255 if v > 24 else 0).getbbox() or (0, 0, shot.width, shot.height)
        shot = shot.crop(bbox)
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


def main():
    import sys

    if "--thumbnails" in sys.argv:
        return thumbnails(sys.argv[sys.argv.index("--thumbnails") + 1])
    if "--captions" in sys.argv:
        return recaption(sys.argv[sys.argv.index("--captions") + 1:])
    os.makedirs(os.path.join(OUT, "api"), exist_ok=True)
    for stale in glob.glob(os.path.join(OUT, "*.json")) + glob.glob(os.path.join(OUT, "api", "*.json")):
        if os.path.splitext(os.path.basename(stale))[0] not in WORKFLOWS:  # a template renamed or dropped
            os.remove(stale)
    for name, graph in WORKFLOWS.items():
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(to_ui(graph), f, indent=1)
        with open(os.path.join(OUT, "api", f"{name}.json"), "w") as f:
            json.dump(to_api(graph), f, indent=1)
    print("wrote", ", ".join(WORKFLOWS))


if __name__ == "__main__":
    main()
