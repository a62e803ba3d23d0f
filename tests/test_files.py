"""No file outside models/sparge_profiles for anyone who reaches the server: the pack's file-naming inputs.

First the rules themselves (nodes/files.py, with the profile folder pointed at a temporary one), then every input that
names a file, through ComfyUI's own prompt validation on a real server: each hostile name is refused with a clear
error that names the node, and nothing is read or written outside the folder.
"""

import json
import os
import urllib.error

import pytest
from pack import load
from test_comfyui_server import server  # noqa: F401  (the fixture: ComfyUI's server with this pack installed)

P = load()
files = P.nodes.files
defs = P.nodes.definitions

PROFILE = {"format": "patch_attention.sparge_profile/1", "variant": "sparge", "model": {"fingerprint": "", "class": ""},
           "error_budget": {"metric": "rel_l1", "max": 0.07}, "layers": {"0": {"cdfthreshd": 0.9}}, "notes": ""}
# names a prompt could send for a file the pack reads: every one must be refused before a file is opened
HOSTILE_READS = ["/etc/passwd", "../../outside.json", "..\\..\\outside.json", "sub/../../../outside.json",
                 "C:outside.json", "x\x00.json", "a\nb.json", "a" * 250 + ".json", "link.json", "missing.json"]
# names for the file the pack writes
HOSTILE_WRITES = ["/tmp/evil", "../evil", "../../evil", "sub/evil", "..", ".", ".hidden", "evil\x00", "evil\r",
                  "a\\evil", "C:evil", "con", "a" * 201, "", "   "]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    root = tmp_path / "models" / "sparge_profiles"
    root.mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({**PROFILE, "variant": "sparge_topk", "layers": {"0": {"topk": 0.5}}}))
    (root / "good.json").write_text(json.dumps(PROFILE))
    (root / "sub").mkdir()
    (root / "sub" / "nested.json").write_text(json.dumps(PROFILE))
    os.symlink(outside, root / "link.json")
    monkeypatch.setattr(files, "folders", lambda: [str(root)])
    return root


@pytest.mark.parametrize("name", HOSTILE_READS)
def test_a_hostile_profile_name_is_refused_before_any_file_is_opened(folder, name, monkeypatch):
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    with pytest.raises(files.FileNameError, match=r"^Sol-Attn Settings: profile "):
        files.resolve_profile(name, "Sol-Attn Settings")
    with pytest.raises(ValueError, match=r"^SpargeAttn Settings: profile "):
        defs.run_sparge_settings("sparge", 0.6, 0.98, 50.0, profile=name)
    assert opened == []


def test_a_listed_profile_loads_and_none_means_none(folder):
    assert files.resolve_profile("good.json", "x") == os.path.realpath(folder / "good.json")
    assert files.resolve_profile("sub/nested.json", "x") == os.path.realpath(folder / "sub" / "nested.json")
    for empty in ("", "none", "  ", None):
        assert files.resolve_profile(empty, "x") is None
    (s,) = defs.run_sparge_settings("sparge", 0.6, 0.98, 50.0, profile="good.json")
    assert s.layer_options(0, None) == {"cdfthreshd": 0.9}
    with pytest.raises(ValueError, match="^SpargeAttn Settings: profile good.json was tuned for sparge, this node "
                                         "selects sparge_topk"):
        defs.run_sparge_settings("sparge_topk", 0.6, 0.98, 50.0, profile="good.json")


@pytest.mark.parametrize("name", HOSTILE_WRITES)
def test_a_hostile_file_name_to_write_is_refused(folder, name):
    before = sorted(p for p in folder.parent.parent.rglob("*"))
    with pytest.raises(files.FileNameError, match=r"^Tune Sparse Attention: profile_name "):
        files.write_json(name, PROFILE, "Tune Sparse Attention")
    assert sorted(p for p in folder.parent.parent.rglob("*")) == before


def test_a_plain_name_is_written_atomically_into_the_folder_only(folder):
    path = files.write_json("my_model", PROFILE, "Tune Sparse Attention")
    assert path == str(folder / "my_model.json") and json.loads((folder / "my_model.json").read_text()) == PROFILE
    files.write_json("my_model.json", {**PROFILE, "notes": "again"}, "Tune Sparse Attention")
    assert json.loads((folder / "my_model.json").read_text())["notes"] == "again"
    assert not [p for p in os.listdir(folder) if p.startswith(".tmp")]
    # a link at the name is never written through
    with pytest.raises(files.FileNameError, match="link.json in models/sparge_profiles is a link"):
        files.write_json("link", PROFILE, "Tune Sparse Attention")
    assert json.loads((folder.parent.parent / "outside.json").read_text())["variant"] == "sparge_topk"


def test_the_validators_report_the_rule_and_the_node(folder):
    assert defs.profile_validator("Sol-Attn Settings")(None, profile="good.json") is True
    assert defs.profile_validator("Sol-Attn Settings")(None, profile="") is True  # workflows saved before the list
    why = defs.profile_validator("Sol-Attn Settings")(None, profile="../../outside.json")
    assert why.startswith("Sol-Attn Settings: profile '../../outside.json' is a path")
    assert defs.validate_tune(None, profile_name="mine") is True
    assert "Tune Sparse Attention: profile_name '../evil' holds a folder separator" in defs.validate_tune(
        None, profile_name="../evil")
    assert defs.validate_rows(None, rows="auto, sparge[profile=good.json]") is True
    assert defs.validate_rows(None, rows="sparge[profile=/etc/passwd]").startswith(
        "Attention Benchmark (end to end): profile '/etc/passwd' is a path")


def test_a_benchmark_shape_the_device_cannot_hold_is_refused_before_allocating():
    import torch

    table = {"huge": (64, 40, 200_000, 128, None, None, "user shape")}
    with pytest.raises(ValueError, match=r"^Attention Benchmark: shape huge (has over 2\^31 elements|needs about)"):
        defs.check_shapes_fit(table, torch.device("cpu"))
    big = {"big": (8, 40, 32760, 128, None, None, "user shape")}  # 34 GiB of attention matrix on the CPU
    with pytest.raises(ValueError, match=r"^Attention Benchmark: shape big needs about \d+\.\d GiB and CPU memory has"):
        defs.check_shapes_fit(big, torch.device("cpu"))
    defs.check_shapes_fit({"small": (1, 2, 256, 64, None, None, "user shape")}, torch.device("cpu"))


# ---------------------------------------------------------------- through a real ComfyUI server

def _prompt_with(node_id: str, inputs: dict) -> dict:
    """A prompt in which ``node_id`` (with ``inputs``) feeds a sampler, so ComfyUI validates it."""
    base = {
        "1": {"class_type": "PATestTinyFluxLoader", "inputs": {"unet_name": "tiny_flux.safetensors"}},
        "3": {"class_type": "PATestConditioning", "inputs": {"seed": 1, "tokens": 8, "context_dim": 32, "pooled_dim": 32}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["5", 0], "seed": 3, "steps": 1, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
                                                   "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "pa_files"}},
    }
    patch = {"model": ["1", 0], "backend": "auto", "fallback": True, "start_percent": 0.0, "end_percent": 1.0,
             "dense_layers": "", "log_stats": False}
    if node_id == "TuneSpargeAttn":
        base["5"] = {"class_type": node_id, "inputs": {"model": ["1", 0], "variant": "sparge", "error_budget": 0.07,
                                                       **inputs}}
    elif node_id == "AttentionBenchmarkE2E":
        del base["6"], base["7"]
        base["5"] = {"class_type": node_id, "inputs": {"model": ["1", 0], "positive": ["3", 0], "negative": ["3", 0],
                                                       "latent_image": ["4", 0], "steps": 1, "cfg": 1.0,
                                                       "sampler_name": "euler", "scheduler": "simple", "seed": 0,
                                                       "peers": False, "compile": False, **inputs}}
    else:
        settings = {"SpargeAttnSettings": {"variant": "sparge", "simthreshd1": 0.6, "cdfthreshd": 0.98, "pvthreshd": 50.0},
                    "SolAttnSettings": {"method": "kitchen_sol", "tau": 1.3, "keep_percent": 20.0, "extra_tokens": 256,
                                        "min_tokens": 4096}}[node_id]
        base["2"] = {"class_type": node_id, "inputs": {**settings, **inputs}}
        base["5"] = {"class_type": "PatchAttention", "inputs": {**patch, "sparse_settings": ["2", 0]}}
    return base


INPUTS = [("SpargeAttnSettings", "profile", "SpargeAttn Settings", lambda n: {"profile": n}),
          ("SolAttnSettings", "profile", "Sol-Attn Settings", lambda n: {"profile": n}),
          ("AttentionBenchmarkE2E", "rows", "Attention Benchmark (end to end)", lambda n: {"rows": f"sparge[profile={n}]"}),
          ("TuneSpargeAttn", "profile_name", "Tune Sparse Attention", lambda n: {"profile_name": n})]


@pytest.mark.comfyui
@pytest.mark.server
def test_every_file_input_refuses_hostile_names_in_comfyuis_prompt_validation(server):  # noqa: F811
    from test_comfyui_server import post

    url, base = server
    profiles = base / "models" / "sparge_profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "good.json").write_text(json.dumps(PROFILE))
    outside = base / "outside.json"
    outside.write_text(json.dumps(PROFILE))
    if not (profiles / "link.json").exists():
        os.symlink(outside, profiles / "link.json")
    def snapshot():
        skip = {"output", "temp", "user", "server.log"}
        return {p: p.stat().st_mtime_ns for p in base.rglob("*") if p.is_file() and not skip & set(p.relative_to(base).parts)}

    before = snapshot()
    for node_id, name, shown, make in INPUTS:
        hostile = HOSTILE_WRITES if node_id == "TuneSpargeAttn" else HOSTILE_READS
        for bad in hostile:
            if bad == "/tmp/evil":
                bad = str(base / "evil")
            if bad == "/etc/passwd":
                bad = str(outside)
            with pytest.raises(urllib.error.HTTPError, match="") as err:
                accepted = post(url + "/prompt", {"prompt": _prompt_with(node_id, make(bad)), "client_id": "pa-files"})
                pytest.fail(f"{node_id} accepted {bad!r}: {accepted}")
            body = json.loads(err.value.read())
            details = [e.get("details", "") + e.get("message", "") for n in body.get("node_errors", {}).values()
                       for e in n["errors"]]
            assert any(d.startswith(f"{name} - {shown}: ") for d in details), (node_id, repr(bad), body)
    assert snapshot() == before  # nothing written anywhere (no evil*.json, nothing under the base folder changed)
    assert not list(base.rglob("evil*"))
    # the listed file passes validation (the prompt is queued)
    for node_id, _, _, make in INPUTS[:2]:
        assert "prompt_id" in post(url + "/prompt", {"prompt": _prompt_with(node_id, make("good.json")),
                                                     "client_id": "pa-files"})
