"""The example workflows: every node type and widget checked against the registered node definitions."""

import glob
import json
import os
import re

import pytest
from pack import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UI = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))
API = sorted(glob.glob(os.path.join(ROOT, "workflows", "api", "*.json")))
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


FRONTEND_ONLY = {"Note"}  # drawn by the frontend, not a server node
A14B = "Wan 2.2 A14B"  # the two-expert template


def test_there_are_image_video_and_tuning_workflows_in_both_formats():
    names = {os.path.basename(p) for p in UI}
    # the file name is the template's title in ComfyUI's template browser
    assert {"SD 1.5 image 512px.json", "SDXL image 1024px.json", "Flux.1 dev image 1024px.json",
            "Wan 2.1 video 480p 81 frames.json", "Wan 2.1 sparse attention tuning.json"} <= names
    assert names == {os.path.basename(p) for p in API}
    # and each has its thumbnail (the frontend asks for <title>.jpg)
    assert all(os.path.exists(p[:-len(".json")] + ".jpg") for p in UI)


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_workflows", os.path.join(ROOT, "tests", "tools", "make_workflows.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_the_wan_templates_run_the_size_their_note_quotes_and_readme_quotes_the_same_number():
    gen = _generator()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    e2e = open(os.path.join(ROOT, "docs", "end-to-end.md"), encoding="utf-8").read()
    for name in ("Wan 2.1 video 480p 81 frames", "Wan 2.1 sparse attention tuning"):
        wf = json.load(open(os.path.join(ROOT, "workflows", f"{name}.json")))
        latent = next(n for n in wf["nodes"] if n["type"] == "EmptyHunyuanLatentVideo")
        assert latent["widgets_values"][:3] == [832, 480, 81], name  # 480p, 81 frames: what was measured
    note = next(n for n in json.load(open(os.path.join(ROOT, "workflows", "Wan 2.1 video 480p 81 frames.json")))["nodes"]
                if n["type"] == "Note")["widgets_values"][0]
    m = gen.measured()
    assert m["wan"] in note and "H100" in note and "ComfyUI 0.33" in note and "unpatched" in note
    # README's table of measured speed-ups, per release, quotes the data files the notes quote
    assert f"| Wan 2.1 1.3B 480p/81f, `auto_fast` (the earlier `auto`), whole run | {m['wan']} (10 steps) | {m['wan_0364']} (4 steps) |" in readme
    assert m["wan_0364"] in note and "ComfyUI 0.3.64" in note
    assert f"**{m['wan_exact']}**" in e2e  # docs/end-to-end.md's table gives three decimals
    flux = next(n for n in json.load(open(os.path.join(ROOT, "workflows", "Flux.1 dev image 1024px.json")))["nodes"]
                if n["type"] == "Note")["widgets_values"][0]
    assert m["flux"] in flux and f"| Flux-dev 1024², `auto_fast`, per step | {m['flux']} |" in readme


def _pack_nodes():
    return {n.node_id: n for n in load().nodes.definitions.NODES}


@pytest.mark.parametrize("path", UI, ids=os.path.basename)
def test_every_loader_names_its_model_files_with_their_download_url_and_folder(path):
    """As ComfyUI's own templates do: the Missing Models panel then offers each file for download."""
    wf = json.load(open(path))
    loaders = [n for n in wf["nodes"] if n["type"] in ("CheckpointLoaderSimple", "UNETLoader", "DualCLIPLoader",
                                                        "CLIPLoader", "VAELoader")]
    assert loaders
    for n in loaders:
        models = n["properties"]["models"]
        files = [v for v in n["widgets_values"] if isinstance(v, str) and v.endswith(".safetensors")]
        assert [m["name"] for m in models] == files, n
        for m in models:
            assert set(m) == {"name", "url", "directory"}
            assert re.fullmatch(r"https://huggingface\.co/[\w.-]+/[\w.-]+/resolve/main/([\w./-]+/)?" + re.escape(m["name"])
                                + r"(\?download=true)?", m["url"]), m
            assert m["directory"] == {"CheckpointLoaderSimple": "checkpoints", "UNETLoader": "diffusion_models",
                                      "DualCLIPLoader": "text_encoders", "CLIPLoader": "text_encoders",
                                      "VAELoader": "vae"}[n["type"]]


@pytest.mark.parametrize("path", UI, ids=os.path.basename)
def test_the_notes_explain_every_input_of_the_pack_s_nodes_and_why_a_value_is_not_the_default(path):
    gen = _generator()
    wf = json.load(open(path))
    notes = "\n".join(n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "Note")
    pack = _pack_nodes()
    for n in wf["nodes"]:
        if n["type"] not in pack:
            continue
        node = pack[n["type"]]
        widgets = [i for i in node.inputs if i.kind in gen.WIDGET_KINDS]
        values = dict(zip([i.name for i in widgets], n["widgets_values"]))
        for i in widgets:
            assert f"{i.name} " in notes, f"{n['type']}.{i.name} is not in the note"
            if values[i.name] != i.default:
                why = gen.NOTE_WHY.get((n["type"], i.name))
                assert why and why in notes, f"{n['type']}.{i.name} = {values[i.name]!r} (default {i.default!r}): no reason"
    # the tuning budget is the node's own default, SpargeAttn's 0.07
    if "tuning" in path:
        tune = next(n for n in wf["nodes"] if n["type"] == "TuneSpargeAttn")
        assert tune["widgets_values"][1] == pack["TuneSpargeAttn"].inputs[2].default == 0.07


@pytest.mark.parametrize("path", UI, ids=os.path.basename)
def test_the_saved_view_shows_the_whole_graph_in_a_1600x1000_window_at_a_readable_zoom(path):
    """extra.ds fits the groups into the part of the canvas both frontends leave free in a 1600x1000 window, at zoom 1:
    text at the frontend's own size (tests/test_browser.py checks it in the frontends themselves)."""
    gen = _generator()
    wf = json.load(open(path))
    ds = wf["extra"]["ds"]
    assert ds["scale"] == gen.SCALE == 1.0
    left, top, right, bottom = gen.VIEW
    for x, y, w, h in [g["bounding"] for g in wf["groups"]]:
        sx, sy = (x + ds["offset"][0]) * ds["scale"], (y + ds["offset"][1]) * ds["scale"]
        assert left - 1 <= sx and sx + w * ds["scale"] <= right + 1 and top - 1 <= sy and sy + h * ds["scale"] <= bottom + 1


def test_every_speed_up_in_readme_names_the_comfyui_release_it_was_measured_on():
    """A ratio is against unpatched ComfyUI, which differs per release: each line with one names its release, or
    stands in a table whose columns do."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table, found = False, 0
    for line in readme.splitlines():
        if line.startswith("| model, what | ComfyUI 0.33 | ComfyUI 0.3.64 |"):
            table = True
        elif not line.startswith("|"):
            table = False
        for ratio in re.findall(r"×\d+\.\d+|\d+(?:\.\d+)?-\d+(?:\.\d+)?× slower", line):
            found += 1
            assert table or re.search(r"ComfyUI 0\.3\.64|ComfyUI 0\.33|0\.3\.64|one call at a time", line) or \
                re.search(r"ComfyUI 0\.33|ComfyUI 0\.3\.64", _paragraph(readme, line)), (ratio, line)
    assert found > 15


def _paragraph(text: str, line: str) -> str:
    """The paragraph or list item that holds ``line``."""
    block = []
    for chunk in re.split(r"\n\s*\n|\n(?=- )", text):
        if line in chunk:
            block.append(chunk)
    return "\n".join(block)


def test_the_tuning_template_says_what_to_do_without_spargeattn():
    wf = json.load(open(os.path.join(ROOT, "workflows", "Wan 2.1 sparse attention tuning.json")))
    note = next(n for n in wf["nodes"] if n["type"] == "Note")["widgets_values"][0]
    assert "Windows" in note and "kitchen_sol" in note and "Tune Sparse Attention" in note and "Tune SpargeAttn" not in note
    assert any(g["title"].startswith("1 · Tune Sparse Attention") for g in wf["groups"])


def test_the_templates_sample_with_the_default_auto_at_its_own_gate():
    """Every template's Patch Attention samples with the node's default, auto, its gate inputs at their defaults (0:
    auto's own gate, the quality-first one). (The tuning template's second run, muted and not in its API file, names
    the profile's kernel.)"""
    P = load()
    defaults = {i.name: i.default for i in P.nodes.definitions.PATCH.inputs}
    assert defaults["backend"] == "auto" and defaults["auto_min_cos"] == defaults["auto_max_rel_l1"] == P.nodes.patch.GATE_OWN
    backends = []
    for path in API:
        for node in json.load(open(path)).values():
            if node["class_type"] == "PatchAttention":
                i = node["inputs"]
                backends.append(i["backend"])
                assert (i["auto_min_cos"], i["auto_max_rel_l1"]) == (defaults["auto_min_cos"], defaults["auto_max_rel_l1"])
    assert backends == ["auto"] * 5


def test_the_video_templates_save_an_h264_mp4_through_comfyui_s_video_nodes():
    """As ComfyUI's own Wan templates end: the decoded frames through Create Video at Wan's 16 frames per second into
    Save Video, an MP4 of H.264 under output/video/ (ComfyUI's Save Animated WEBP, which the templates used before,
    encodes on one CPU core: a quarter of a whole Wan 2.2 A14B prompt). Save Video's format and codec in the form both
    releases take: ComfyUI 0.3.64's two combos, which 0.33 reads as format and its nested codec (UI) or its legacy
    codec input (API). The image templates keep Save Image."""
    videos = 0
    for ui_path, api_path in zip(UI, API):
        ui, api = json.load(open(ui_path)), json.load(open(api_path))
        nodes = {n["id"]: n for n in ui["nodes"]}
        types = [n["type"] for n in ui["nodes"]]
        assert "SaveAnimatedWEBP" not in types and all(n["class_type"] != "SaveAnimatedWEBP" for n in api.values())
        if "EmptyHunyuanLatentVideo" not in types:
            assert types.count("SaveImage") == 1 and "SaveVideo" not in types and "CreateVideo" not in types, ui_path
            continue
        videos += 1
        assert types.count("CreateVideo") == types.count("SaveVideo") == 1 and "SaveImage" not in types, ui_path
        create, save = (next(n for n in ui["nodes"] if n["type"] == t) for t in ("CreateVideo", "SaveVideo"))
        links = {lid: (src, dst) for lid, src, _slot, dst, _dslot, _t in ui["links"]}
        assert nodes[links[create["inputs"][0]["link"]][0]]["type"] in ("VAEDecode", "VAEDecodeMultiGPU")
        assert links[save["inputs"][0]["link"]][0] == create["id"]
        assert create["widgets_values"] == [16.0]
        prefix, *form = save["widgets_values"]
        assert form == ["mp4", "h264"] and prefix.startswith("video/"), save["widgets_values"]
        ((cid, c),), (v,) = ([(k, n) for k, n in api.items() if n["class_type"] == "CreateVideo"],
                             [n for n in api.values() if n["class_type"] == "SaveVideo"])
        assert api[c["inputs"]["images"][0]]["class_type"] in ("VAEDecode", "VAEDecodeMultiGPU")
        assert c["inputs"]["fps"] == 16.0 and v["inputs"]["video"] == [cid, 0]
        assert v["inputs"] == {"filename_prefix": prefix, "format": "mp4", "codec": "h264", "video": [cid, 0]}
    assert videos == 4


OLD_API = os.path.join(ROOT, "tests", "fixture_workflows", "wan21_sparge_tuning_saved_before_sparse_settings.api.json")


def test_a_workflow_saved_before_the_settings_type_was_renamed_still_validates():
    """API format: inputs by id (sparge_settings kept), links by slot; no type is stored."""
    check_api(json.load(open(OLD_API)), own_node_info())


def test_workflows_are_what_the_generator_writes(tmp_path, monkeypatch):
    """workflows/ is generated (tests/tools/make_workflows.py): a hand edit would be lost on the next run."""
    gen = _generator()
    for name, graph in gen.WORKFLOWS.items():
        assert json.load(open(os.path.join(ROOT, "workflows", f"{name}.json"))) == json.loads(json.dumps(gen.to_ui(graph)))
        assert json.load(open(os.path.join(ROOT, "workflows", "api", f"{name}.json"))) == json.loads(json.dumps(gen.to_api(graph)))


@pytest.mark.parametrize("path", UI, ids=os.path.basename)
def test_every_ui_workflow_has_a_note_and_titled_groups_around_every_node(path):
    wf = json.load(open(path))
    notes = [n for n in wf["nodes"] if n["type"] == "Note"]
    assert notes and all(len(n["widgets_values"][0]) > 200 for n in notes)
    assert wf["groups"] and all(g["title"] for g in wf["groups"])
    for n in wf["nodes"]:
        x, y = n["pos"]
        w, h = n["size"]
        assert any(g["bounding"][0] <= x and x + w <= g["bounding"][0] + g["bounding"][2] and g["bounding"][1] <= y - 30
                   and y + h <= g["bounding"][1] + g["bounding"][3] for g in wf["groups"]), f"{n['type']} is in no group"


# ComfyUI 0.33's combo whose choice brings inputs of its own (Save Video's format, and the codec under it): in
# widgets_values its value is followed by the chosen option's widgets; in the API format those are "format.codec"
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"


def widget_inputs(info, inputs=None):
    """[(name, type, opts, options, optional)] of the widget inputs, in the order ComfyUI stores widgets_values (a
    dynamic combo's options: its keys). ``inputs``: a dynamic combo option's own inputs instead of the node's."""
    if inputs is None:
        inputs, order = info["input"], info["input_order"]
    else:  # an option's inputs, in their order
        order = {section: list(inputs.get(section, {})) for section in ("required", "optional")}
    out = []
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = inputs[section][name]
            t = spec[0]
            opts = spec[1] if len(spec) > 1 else {}
            kind = "COMBO" if isinstance(t, list) or t == "COMBO" else t
            if kind == DYNAMIC_COMBO:
                out.append((name, kind, opts, [o["key"] for o in opts["options"]], section == "optional"))
            elif kind in WIDGET_TYPES and not opts.get("forceInput"):
                options = t if isinstance(t, list) else opts.get("options", [])
                out.append((name, kind, opts, options, section == "optional"))
    return out


def take_widgets(node_type, info, values, inputs=None):
    """Check the values of a node's widgets, in order, taking them from ``values`` (its widgets_values); a dynamic
    combo's value is followed by its chosen option's widgets. Optional widgets after the last value are left to their
    defaults, as the frontend leaves them (Create Video's bit_depth, new in ComfyUI 0.33)."""
    for name, kind, opts, options, optional in widget_inputs(info, inputs):
        if not values:
            assert optional, f"{node_type}: missing widget value for {name}"
            return
        value = values.pop(0)
        check_value(node_type, name, kind, opts, options, value)
        if kind == DYNAMIC_COMBO:
            take_widgets(node_type, info, values, next(o for o in opts["options"] if o["key"] == value)["inputs"])
        elif opts.get("control_after_generate"):
            assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")


def check_value(node_type, name, kind, opts, options, value):
    where = f"{node_type}.{name}={value!r}"
    if kind == DYNAMIC_COMBO:
        assert value in options, f"{where} not in {options}"
    elif kind == "COMBO":
        if options and not name.endswith("_name") and not name.startswith("clip_name") and name != "profile":
            assert value in options, f"{where} not in {options}"
        assert isinstance(value, str), where
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), where
    elif kind in ("INT", "FLOAT"):
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
        if "min" in opts:
            assert value >= opts["min"], where
        if "max" in opts:
            assert value <= opts["max"], where
    elif kind == "STRING":
        assert isinstance(value, str), where


def check_ui(wf, node_info):
    nodes = {n["id"]: n for n in wf["nodes"]}
    for n in wf["nodes"]:
        info = node_info(n["type"])
        if info is None:
            continue
        values = list(n.get("widgets_values", []))
        take_widgets(n["type"], info, values)
        assert not values, f"{n['type']}: {len(values)} widget values too many: {values}"
        for inp in n.get("inputs", []):
            all_inputs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
            assert inp["name"] in all_inputs, f"{n['type']} has no input {inp['name']}"
    for lid, src, slot, dst, dslot, typ in wf["links"]:
        assert nodes[dst]["inputs"][dslot]["link"] == lid
        assert lid in nodes[src]["outputs"][slot]["links"]
        si, di = node_info(nodes[src]["type"]), node_info(nodes[dst]["type"])
        if si is not None:
            assert si["output"][slot] == typ, f"link {lid}: {nodes[src]['type']} output {slot} is {si['output'][slot]}, not {typ}"
        if di is not None:
            name = nodes[dst]["inputs"][dslot]["name"]
            spec = {**di["input"].get("required", {}), **di["input"].get("optional", {})}[name]
            assert spec[0] == typ, f"link {lid}: {nodes[dst]['type']}.{name} takes {spec[0]}, not {typ}"


def old_names():
    """{node type: {earlier input id: current id}}: the ids a saved workflow may still use (Node.run maps them)."""
    return {n.node_id: {o: i.name for i in n.inputs for o in i.old_names} for n in load().nodes.definitions.NODES}


def check_api(wf, node_info):
    renamed = old_names()
    for node in wf.values():
        info = node_info(node["class_type"])
        if info is None:
            continue
        req, opt = info["input"].get("required", {}), info["input"].get("optional", {})
        for name in req:
            assert name in node["inputs"], f"{node['class_type']} is missing required input {name}"
        widgets = {name: (kind, opts, options) for name, kind, opts, options, _ in widget_inputs(info)}
        for name, value in node["inputs"].items():
            name = renamed.get(node["class_type"], {}).get(name, name)
            assert name in req or name in opt, f"{node['class_type']} has no input {name}"
            if isinstance(value, list):
                src = wf[value[0]]
                sinfo = node_info(src["class_type"])
                if sinfo is not None:
                    want = (req.get(name) or opt.get(name))[0]
                    assert sinfo["output"][value[1]] == want, f"{node['class_type']}.{name}"
            else:
                check_value(node["class_type"], name, *widgets[name], value)


def own_node_info():
    """This pack's node definitions, in ComfyUI's /object_info shape (classic mappings)."""
    mappings = load().nodes.v1.NODE_CLASS_MAPPINGS

    def info(node_type):
        cls = mappings.get(node_type)
        if cls is None:
            return None
        it = cls.INPUT_TYPES()
        return {"input": it, "input_order": {k: list(v) for k, v in it.items()}, "output": cls.RETURN_TYPES}

    return info


@pytest.mark.parametrize("path", UI, ids=os.path.basename)
def test_ui_workflows_against_this_packs_nodes(path):
    wf = json.load(open(path))
    check_ui(wf, own_node_info())
    # the Wan 2.2 A14B template holds a Context Parallel node per expert instead: its two chains with Patch Attention
    # do not fit the window at zoom 1 (its note says where Patch Attention goes)
    assert any(n["type"] == ("ContextParallel" if A14B in path else "PatchAttention") for n in wf["nodes"])


@pytest.mark.parametrize("path", API, ids=os.path.basename)
def test_api_workflows_against_this_packs_nodes(path):
    wf = json.load(open(path))
    check_api(wf, own_node_info())
    if A14B in path:  # each expert's sampler gets its model through a Context Parallel node of its own
        samplers = [n for n in wf.values() if n["class_type"] == "KSamplerAdvanced"]
        feeders = [n["inputs"]["model"][0] for n in samplers]
        assert len(samplers) == 2 and len(set(feeders)) == 2
        assert all(wf[f]["class_type"] == "ContextParallel" for f in feeders)
        return
    # Patch Attention (or, in the tuning workflow's first run, Tune SpargeAttn) feeds the sampler its model, through
    # Context Parallel in the several-GPU template
    patch = next(k for k, n in wf.items() if n["class_type"] in ("PatchAttention", "TuneSpargeAttn"))
    sampler = next(n for n in wf.values() if n["class_type"] == "KSampler")
    feeder = sampler["inputs"]["model"][0]
    if wf[feeder]["class_type"] == "ContextParallel":
        feeder = wf[feeder]["inputs"]["model"][0]
    assert feeder == patch


@pytest.mark.comfyui
@pytest.mark.parametrize("path", UI + API + [OLD_API], ids=lambda p: os.path.relpath(p, ROOT))
def test_workflows_against_comfyui_node_definitions(path):
    import asyncio

    from comfyui_support import load_pack

    load_pack()
    import nodes

    if "FluxGuidance" not in nodes.NODE_CLASS_MAPPINGS:
        asyncio.run(nodes.init_builtin_extra_nodes())
    from comfy_api.internal import _ComfyNodeInternal

    def info(node_type):
        if node_type in FRONTEND_ONLY:
            return None
        cls = nodes.NODE_CLASS_MAPPINGS.get(node_type)
        assert cls is not None, f"node type {node_type} is not registered in this ComfyUI"
        if issubclass(cls, _ComfyNodeInternal):
            return cls.GET_NODE_INFO_V1()
        it = cls.INPUT_TYPES()
        return {"input": it, "input_order": {k: list(v) for k, v in it.items()}, "output": cls.RETURN_TYPES}

    wf = json.load(open(path))
    (check_api if "/api/" in path or path.endswith(".api.json") else check_ui)(wf, info)
