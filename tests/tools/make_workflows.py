"""Write the example workflows in workflows/, in ComfyUI's UI format and its API format, from one description.

    python tests/tools/make_workflows.py

tests/test_workflows.py checks every node type and widget in the output against the node definitions
(ComfyUI's own where a ComfyUI is found, this pack's always).
"""

from __future__ import annotations

import json
import os

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "workflows")

# node type -> (inputs that are links [(name, type)], widget names in order, outputs [(name, type)])
IO = {
    "CheckpointLoaderSimple": ([], ["ckpt_name"], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")]),
    "UNETLoader": ([], ["unet_name", "weight_dtype"], [("MODEL", "MODEL")]),
    "DualCLIPLoader": ([], ["clip_name1", "clip_name2", "type", "device"], [("CLIP", "CLIP")]),
    "VAELoader": ([], ["vae_name"], [("VAE", "VAE")]),
    "CLIPTextEncode": ([("clip", "CLIP")], ["text"], [("CONDITIONING", "CONDITIONING")]),
    "FluxGuidance": ([("conditioning", "CONDITIONING")], ["guidance"], [("CONDITIONING", "CONDITIONING")]),
    "EmptyLatentImage": ([], ["width", "height", "batch_size"], [("LATENT", "LATENT")]),
    "EmptySD3LatentImage": ([], ["width", "height", "batch_size"], [("LATENT", "LATENT")]),
    "KSampler": ([("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent_image", "LATENT")],
                 ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"], [("LATENT", "LATENT")]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [], [("IMAGE", "IMAGE")]),
    "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], []),
    "PatchAttention": ([("model", "MODEL"), ("sparge_settings", "SPARGE_SETTINGS")],
                       ["backend", "fallback", "start_percent", "end_percent", "dense_layers", "log_stats",
                        "auto_retune", "auto_min_cos", "auto_max_rel_l1", "check_finite"], [("model", "MODEL")]),
    "AttentionBackendsInfo": ([], [], [("report", "STRING")]),
}
SEED_CONTROL = "fixed"  # KSampler's seed widget carries a "control after generate" value in the UI format


def patch_widgets(backend="auto", start=0.0, end=1.0, dense="", log_stats=True):
    return {"backend": backend, "fallback": True, "start_percent": start, "end_percent": end, "dense_layers": dense,
            "log_stats": log_stats, "auto_retune": False, "auto_min_cos": 0.995, "auto_max_rel_l1": 0.08, "check_finite": True}


def sd_graph(ckpt, size, steps, cfg, sampler, scheduler, prompt):
    return [
        (1, "CheckpointLoaderSimple", {"ckpt_name": ckpt}, {}),
        (2, "PatchAttention", patch_widgets(), {"model": (1, 0)}),
        (3, "CLIPTextEncode", {"text": prompt}, {"clip": (1, 1)}),
        (4, "CLIPTextEncode", {"text": "blurry, low quality"}, {"clip": (1, 1)}),
        (5, "EmptyLatentImage", {"width": size, "height": size, "batch_size": 1}, {}),
        (6, "KSampler", {"seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0},
         {"model": (2, 0), "positive": (3, 0), "negative": (4, 0), "latent_image": (5, 0)}),
        (7, "VAEDecode", {}, {"samples": (6, 0), "vae": (1, 2)}),
        (8, "SaveImage", {"filename_prefix": "patch_attention"}, {"images": (7, 0)}),
        (9, "AttentionBackendsInfo", {}, {}),
    ]


def flux_graph():
    return [
        (1, "UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}, {}),
        (2, "PatchAttention", patch_widgets(), {"model": (1, 0)}),
        (3, "DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                               "device": "default"}, {}),
        (4, "CLIPTextEncode", {"text": "a lighthouse on a cliff at dawn, photograph"}, {"clip": (3, 0)}),
        (5, "FluxGuidance", {"guidance": 3.5}, {"conditioning": (4, 0)}),
        (6, "CLIPTextEncode", {"text": ""}, {"clip": (3, 0)}),
        (7, "EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, {}),
        (8, "KSampler", {"seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
         {"model": (2, 0), "positive": (5, 0), "negative": (6, 0), "latent_image": (7, 0)}),
        (9, "VAELoader", {"vae_name": "ae.safetensors"}, {}),
        (10, "VAEDecode", {}, {"samples": (8, 0), "vae": (9, 0)}),
        (11, "SaveImage", {"filename_prefix": "patch_attention_flux"}, {"images": (10, 0)}),
        (12, "AttentionBackendsInfo", {}, {}),
    ]


def to_api(graph):
    api = {}
    for nid, typ, widgets, links in graph:
        inputs = dict(widgets)
        for name, (src, slot) in links.items():
            inputs[name] = [str(src), slot]
        api[str(nid)] = {"class_type": typ, "inputs": inputs, "_meta": {"title": typ}}
    return api


def to_ui(graph):
    links, nodes = [], []
    out_links = {}
    lid = 0
    for nid, _typ, _w, ins in graph:
        for name, (src, slot) in ins.items():
            lid += 1
            links.append((lid, src, slot, nid, name))
            out_links.setdefault((src, slot), []).append(lid)
    types = {nid: typ for nid, typ, _, _ in graph}
    ui_links = []
    for lid_, src, slot, dst, name in links:
        in_types = dict(IO[types[dst]][0])
        ui_links.append([lid_, src, slot, dst, [n for n, _ in IO[types[dst]][0]].index(name), in_types[name]])
    order = {nid: i for i, (nid, *_rest) in enumerate(graph)}
    for i, (nid, typ, widgets, _ins) in enumerate(graph):
        link_ins, widget_names, outs = IO[typ]
        values = []
        for w in widget_names:
            values.append(widgets.get(w))
            if typ == "KSampler" and w == "seed":
                values.append(SEED_CONTROL)
        inputs = []
        for name, t in link_ins:
            link = next((lid_ for lid_, s, sl, d, n in links if d == nid and n == name), None)
            if link is None and typ == "PatchAttention" and name == "sparge_settings":
                inputs.append({"name": name, "type": t, "link": None, "shape": 7})
            elif link is not None or typ != "PatchAttention":
                inputs.append({"name": name, "type": t, "link": link})
        outputs = [{"name": n, "type": t, "links": out_links.get((nid, k), []), "slot_index": k} for k, (n, t) in enumerate(outs)]
        col, row = divmod(i, 4)
        nodes.append({
            "id": nid, "type": typ, "pos": [40 + 380 * col, 60 + 260 * row], "size": [340, 200], "flags": {},
            "order": order[nid], "mode": 0, "inputs": inputs, "outputs": outputs,
            "properties": {"Node name for S&R": typ}, "widgets_values": values,
        })
    return {
        "last_node_id": max(n["id"] for n in nodes), "last_link_id": lid, "nodes": nodes, "links": ui_links,
        "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4,
    }


WORKFLOWS = {
    "sd15_patch_attention": sd_graph("v1-5-pruned-emaonly.safetensors", 512, 20, 7.0, "euler", "normal",
                                     "a watercolor fox in a snowy forest"),
    "sdxl_patch_attention": sd_graph("sd_xl_base_1.0.safetensors", 1024, 25, 6.0, "dpmpp_2m", "karras",
                                     "a red vintage car on a coastal road, golden hour"),
    "flux_patch_attention": flux_graph(),
}


def main():
    os.makedirs(os.path.join(OUT, "api"), exist_ok=True)
    for name, graph in WORKFLOWS.items():
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(to_ui(graph), f, indent=1)
        with open(os.path.join(OUT, "api", f"{name}.json"), "w") as f:
            json.dump(to_api(graph), f, indent=1)
    print("wrote", ", ".join(WORKFLOWS))


if __name__ == "__main__":
    main()
