"""tests/gpu/prompts.py on the CPU: ComfyUI's server in CPU mode seeing two devices runs every row's one-GPU and
several-GPU workflow (this repository's API workflows) on tiny random-weight files that tests/gpu/model_files.py wrote
in ComfyUI's own layouts.  Every prompt completes and is timed from ComfyUI's history; the several-GPU prompts ran the
Context Parallel node (what it showed, its split or ComfyUI's copies for the second device) and, for Wan, VAE Decode
(several GPUs) over both devices; the one-GPU prompts neither; the two workflows differ nowhere else; and ComfyUI's
detection finds each file as the model it stands for, with no key missing or left over."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import comfyui_support
import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.server]

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLERS = {"wan22-a14b": 2, "wan21-14b": 1, "flux-dev": 1}
DIFFUSION = {"wan21-14b": "WAN21_T2V", "wan22-high": "WAN21_T2V", "wan22-low": "WAN21_T2V", "flux-dev": "Flux"}
TEXT = {"umt5-xxl": "T5_XXL", "t5xxl": "T5_XXL", "clip-l": "CLIP_L"}
VAES = {"wan-vae": ("WanVAE", 3), "flux-ae": ("AutoencodingEngine", 2)}


def gpu_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", os.path.join(HERE, "gpu", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every row once: a warm-up and one timed prompt per workflow; (results, server log, models folder, out folder)."""
    comfyui_support.comfy()  # skips where no ComfyUI is found
    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        pytest.skip("the multi-GPU nodes need ComfyUI 0.33 or later")
    pytest.importorskip("sentencepiece", reason="ComfyUI's umT5 tokenizer (and the umT5 file's) needs it")
    out = tmp_path_factory.mktemp("prompts")
    models = out / "models"
    rc = gpu_module("prompts").main(["--out", str(out), "--cpu", "--devices", "2", "--rounds", "1",
                                      "--models", str(models), "--profile", "--split-tflop", "graphs-pack=1.5",
                                      "--inputs", "PatchAttention.check_finite=false"])
    res = json.load(open(out / "prompts.json"))
    assert rc == 0, [(p["mode"], p["error"]) for r in res["rows"] for p in r["prompts"] if not p["ok"]]
    return res, (out / "prompts-server.log").read_text(), str(models), out


def test_every_prompt_of_every_row_completes_timed_by_comfyuis_history(run):
    res, log, _, out = run
    assert [r["row"] for r in res["rows"]] == list(SAMPLERS)
    for r in res["rows"]:
        assert r["status"] == "done", (r["row"], r["reason"])
        ps = r["prompts"]
        assert [(p["mode"], p["warmup"]) for p in ps] == [("one", True), ("one", False), ("several", True),
                                                          ("several", False)]  # --order grouped, the default
        assert all(p["ok"] and p["source"] == "history" and p["seconds"] > 0 for p in ps), r["row"]
        assert all(p["phases"]["sampling"] > 0 and p["phases"]["decode"] > 0 for p in ps), r["row"]
        assert all(sum(s["steps"] for s in p["samplers"]) == r["steps"] for p in ps), r["row"]  # progress seen
        s = r["summary"]
        assert s["one"]["n"] == s["several"]["n"] == 1 and s["ratio"] > 0
    seeds = [p["seed"] for r in res["rows"] for p in r["prompts"]]
    assert len(set(seeds)) == len(seeds)  # a new seed each prompt
    for bad in ("unet missing", "unet unexpected", "clip missing", "Missing VAE keys", "left over keys"):
        assert bad not in log
    md = (out / "prompts.md").read_text()
    assert "one GPU / several" in md and "not run" not in md


def test_several_gpu_prompts_ran_the_multigpu_nodes_and_one_gpu_prompts_did_not(run):
    res, _, _, _ = run
    for r in res["rows"]:
        assert r["differences"] == [], r["row"]  # the workflows differ only in the several-GPU nodes
        n = SAMPLERS[r["row"]]
        for p in r["prompts"]:
            shown = [t for t in p["shown"].values() if "split over 2 GPUs" in t]  # Context Parallel's canvas text
            split = [x for x in p["log"] if re.search(r"Context Parallel: (\d+) of \1 forwards split over 2 GPUs", x)]
            copies = [x for x in p["log"] if re.search(r"deepclone of WAN21 for cpu:1", x)]
            vae = [x for x in p["log"] if re.search(r"VAE Decode \(several GPUs\): \d+ tiles .* over 2 devices", x)]
            if p["mode"] == "one":
                assert not shown and not p["log"], (r["row"], p["log"])
                continue
            # the multi-GPU nodes run (their canvas text, ComfyUI's copies made) in the first several-GPU prompt; the
            # next one takes their outputs from ComfyUI's cache, as a user's next prompt of the same workflow does
            assert len(shown) == (n if p["warmup"] else 0), (r["row"], p["shown"])
            if r["cfg"] == 1:
                assert len(split) == n, (r["row"], p["log"])  # every forward split over both devices
            else:  # CFG 5: the conds on both devices (ComfyUI's copy on the second)
                assert bool(copies) == p["warmup"], (r["row"], p["log"])
            assert len(vae) == (0 if r["row"] == "flux-dev" else 1), (r["row"], p["log"])


def test_the_files_are_detected_as_the_models_they_stand_for(run):
    _, _, models, _ = run
    import comfy.model_detection
    import comfy.sd
    import comfy.utils
    import torch

    mf = gpu_module("model_files")

    def load(name):
        spec = mf.SPECS[name]
        sd, meta = comfy.utils.load_torch_file(os.path.join(models, spec.folder, spec.file), return_metadata=True)
        assert mf.cached(models, name, True)
        assert {t.dtype for k, t in sd.items() if k != "spiece_model"} == {torch.bfloat16}
        return sd, meta

    for name, cls in DIFFUSION.items():
        sd, meta = load(name)
        assert type(comfy.model_detection.model_config_from_unet(sd, "", metadata=meta)).__name__ == cls
    for name, te in TEXT.items():
        sd, _ = load(name)
        assert comfy.sd.detect_te_model(sd) == getattr(comfy.sd.TEModel, te)
        assert ("spiece_model" in sd) == (name == "umt5-xxl")  # umT5's tokenizer, as ComfyUI's umT5 files carry
    for name, (cls, dims) in VAES.items():
        sd, meta = load(name)
        vae = comfy.sd.VAE(sd=sd, metadata=meta)
        assert (type(vae.first_stage_model).__name__, vae.latent_channels, vae.latent_dim) == (cls, 16, dims)
    made = mf.ensure(models, list(mf.SPECS), tiny=True, log=lambda _: None)
    assert not any(m["made"] for m in made.values())  # a second call keeps the cache


def test_with_profile_every_samplers_run_in_the_server_is_profiled(run):
    """--profile: one file per sampler run (warm-ups and timed prompts of every row), each naming the sampler's own
    functions (its steps ran under the profiler in the server's thread)."""
    res, _, _, out = run
    runs = sum(SAMPLERS[r["row"]] for r in res["rows"] for p in r["prompts"] if p["ok"])
    files = sorted(out.glob("profile-*.txt"))
    assert len(files) == runs, (len(files), runs)
    for f in files:
        text = f.read_text()
        assert text.startswith("CFGGuider.sample: ") and "sample" in text and "function calls" in text, text[:300]


def test_the_floors_asked_for_are_set_in_the_server_and_reported(run):
    """--split-tflop sets the Context Parallel node's floors in ComfyUI's server (the others as they are), and the
    report says so."""
    res, _, _, out = run
    floors = res["meta"]["split_tflop"]
    assert floors["graphs-pack"] == 1.5 and floors["pack"] > 1.5
    assert 'Context Parallel floors set to {"comfyui"' in (out / "prompts.md").read_text()


def test_an_input_asked_for_is_set_in_both_workflows_of_every_row_that_has_the_node(run):
    """--inputs sets a node's input in the one-GPU and several-GPU workflows alike (they still differ nowhere else),
    and the report says so."""
    res, _, _, out = run
    assert res["meta"]["inputs"] == {"PatchAttention.check_finite": False}
    assert all(not r.get("differences") for r in res["rows"])
    assert '; the workflows with {"PatchAttention.check_finite": false}' in (out / "prompts.md").read_text()


@pytest.fixture(scope="module")
def pair(run, tmp_path_factory):
    """--pair 2 on Flux's row (the files the first run wrote): two servers, a warm-up and one timed prompt each."""
    out = tmp_path_factory.mktemp("prompts-pair")
    rc = gpu_module("prompts").main(["--out", str(out), "--cpu", "--pair", "2", "--rounds", "1", "--rows", "flux-dev",
                                      "--models", run[2]])
    res = json.load(open(out / "prompts.json"))
    assert rc == 0, [(p["mode"], p["error"]) for r in res["rows"] for p in r["prompts"] if not p["ok"]]
    return res, out


def test_with_pair_each_workflow_runs_on_a_server_of_its_own_at_the_same_time(pair):
    """--pair N: the one-GPU workflow's prompts on a server seeing one device, the several-GPU workflow's on one seeing
    N, both servers' prompts at the same time (their spans overlap), each server's log its own, the ratio of the two."""
    res, out = pair
    assert res["meta"]["pair"] == {"one": "cpu x1", "several": "cpu x2"}
    (r,) = res["rows"]
    assert r["status"] == "done", r["reason"]
    by = {m: [p for p in r["prompts"] if p["mode"] == m] for m in ("one", "several")}
    assert [p["warmup"] for p in by["one"]] == [p["warmup"] for p in by["several"]] == [True, False]
    assert all(p["ok"] and p["source"] == "history" for p in r["prompts"])
    one, sev = by["one"][0]["span"], by["several"][0]["span"]
    assert one[0] < sev[1] and sev[0] < one[1], (one, sev)  # the warm-ups ran at once
    assert len({p["seed"] for p in r["prompts"]}) == 4
    logs = {m: (out / f"prompts-server-{m}.log").read_text() for m in ("one", "several")}
    assert not (out / "prompts-server.log").exists()
    assert "split over 2 GPUs" not in logs["one"] and not any(p["log"] for p in by["one"])
    assert re.search(r"Context Parallel: (\d+) of \1 forwards split over 2 GPUs", logs["several"])
    assert all(any("split over 2 GPUs" in x for x in p["log"]) for p in by["several"])
    assert r["summary"]["ratio"] > 0
    assert "two servers at once (--pair), the one-GPU workflow's seeing cpu x1" in (out / "prompts.md").read_text()
