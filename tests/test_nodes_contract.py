"""The node layer's contract, without ComfyUI: definitions, classic mappings, parsing, the override callable."""

import importlib
import re

import pytest
import torch
from pack import load

P = load()


defs = P.nodes.definitions
patch = P.nodes.patch
v1 = P.nodes.v1


def test_pack_exports_nodes_under_any_folder_name():
    # without comfy_api the classic mappings are exported; with it, only comfy_entrypoint
    if P.nodes.comfy_entrypoint is None:
        assert set(P.NODE_CLASS_MAPPINGS) == {"PatchAttention", "SpargeAttnSettings", "SolAttnSettings", "TuneSpargeAttn",
                                              "AttentionBackendsInfo",
                                              "AttentionBenchmark", "AttentionBenchmarkE2E", "ContextParallel",
                                              "VAEDecodeMultiGPU", "VAEEncodeMultiGPU"}
    else:
        assert callable(P.comfy_entrypoint)


def test_classic_input_types_follow_the_definitions():
    cls = v1.NODE_CLASS_MAPPINGS["PatchAttention"]
    it = cls.INPUT_TYPES()
    assert list(it["required"]) == ["model", "backend", "fallback", "start_percent", "end_percent", "dense_layers", "log_stats"]
    assert set(it["optional"]) == {"sparse_settings", "auto_retune", "auto_min_cos", "auto_max_rel_l1", "check_finite",
                                   "sparse_start_percent"}
    choices, opts = it["required"]["backend"]
    assert choices[:2] == ["auto", "disabled"] and "sdpa" in choices and "kitchen_int8" in choices
    assert opts["default"] == "auto" and "fastest kernel within 3 dB of exact" in opts["tooltip"]
    assert it["required"]["start_percent"] == ("FLOAT", {"default": 0.0, "tooltip": it["required"]["start_percent"][1]["tooltip"],
                                                         "min": 0.0, "max": 1.0, "step": 0.01})
    assert cls.RETURN_TYPES == ("MODEL",) and cls.FUNCTION == "run" and cls.CATEGORY.startswith("model_patches")
    assert v1.NODE_CLASS_MAPPINGS["AttentionBackendsInfo"].OUTPUT_NODE is True
    assert v1.NODE_DISPLAY_NAME_MAPPINGS["SpargeAttnSettings"] == "SpargeAttn Settings"
    for node in defs.NODES:
        for i in node.inputs:
            if i.kind not in ("MODEL", defs.SPARSE_SETTINGS_TYPE):
                assert i.tooltip, f"{node.node_id}.{i.name} has no tooltip"


def test_info_node_output_is_shown_in_the_ui():
    out = v1.NODE_CLASS_MAPPINGS["AttentionBackendsInfo"]().run()
    assert out["ui"]["text"][0] == out["result"][0]
    assert "sdpa" in out["result"][0]
    assert [n.node_id for n in defs.NODES if n.report] == ["AttentionBackendsInfo", "AttentionBenchmark",
                                                          "AttentionBenchmarkE2E"]


def test_every_tooltip_is_one_or_two_sentences_of_at_most_300_characters():
    tips = [(f"{n.node_id}.{i.name}", i.tooltip) for n in defs.NODES for i in n.inputs if i.tooltip]
    assert len(tips) > 40
    for where, tip in tips:
        assert len(tip) <= defs.TOOLTIP_MAX, f"{where}: {len(tip)} characters"
        # sentences end with '.', '!' or '?' followed by a space and a capital (not 'e.g. a' or '0.5')
        sentences = len(re.findall(r"[.!?](?=\s+[A-Z])", tip)) + 1
        assert sentences <= 2, f"{where}: {sentences} sentences: {tip}"
        assert tip.rstrip().endswith((".", ")")), f"{where} does not end as a sentence: {tip}"
    tip = dict(tips)
    # the numbers a user types carry their unit or range
    for where, unit in [("PatchAttention.start_percent", "(0-1)"), ("PatchAttention.auto_max_rel_l1", "8 %"),
                        ("TuneSpargeAttn.error_budget", "7 %"), ("SolAttnSettings.keep_percent", "percent (%)"),
                        ("SolAttnSettings.tau", "sigmas"), ("AttentionBenchmark.reps", "a count"),
                        ("PatchAttention.log_stats", "(ms)")]:
        assert unit in tip[where], (where, tip[where])
    assert tip["PatchAttention.auto_max_rel_l1"].startswith("auto, auto_fast: the relative L1 error")


def test_every_node_is_found_by_the_words_people_search_for():
    words = {n.node_id: set(n.search_aliases) for n in defs.NODES}
    assert all(words.values()), words
    assert {"sage", "sageattention", "sage attention", "flash attention", "flash-attn", "fa4", "xformers", "sparge",
            "sparse", "sdpa", "attention backend", "speed up"} <= words["PatchAttention"]
    assert {"sparse", "sparse attention", "spargeattn"} <= words["SpargeAttnSettings"]
    assert {"sparse", "sol-attn"} <= words["SolAttnSettings"]
    assert {"benchmark", "sageattention"} <= words["AttentionBenchmark"]
    assert all(w == w.lower() and w.strip() == w for ws in words.values() for w in ws)
    cls = v1.NODE_CLASS_MAPPINGS["PatchAttention"]
    assert cls.SEARCH_ALIASES == defs.PATCH.search_aliases  # the classic API's attribute (ComfyUI 0.33 reads it)


def test_an_input_renamed_still_takes_its_old_id_and_errors_name_the_node():
    seen = {}

    def fn(**kw):
        seen.update(kw)
        if kw.get("x") == "bad":
            raise ValueError("x: cannot read 'bad'")
        return ("ok",)

    node = defs.Node("T", "Test Node", "", [defs.In("x", "STRING", old_names=("old_x",))], [("STRING", "r")], fn)
    assert node.run(old_x="a") == ("ok",) and seen == {"x": "a"}
    seen.clear()
    assert node.run(x="b", old_x="stale") == ("ok",) and seen == {"x": "b"}  # the current id wins
    with pytest.raises(ValueError, match=r"^Test Node: x: cannot read 'bad'$"):
        node.run(x="bad")
    # through the adapters: Patch Attention's settings input was saved as sparge_settings
    spec = defs.PATCH.inputs[[i.name for i in defs.PATCH.inputs].index("sparse_settings")]
    assert spec.old_names == ("sparge_settings",)


def test_a_sol_attn_settings_error_names_that_node_and_no_other_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(P.nodes.files, "folders", lambda: [str(tmp_path)])  # models/sparge_profiles
    prof = P.attention.sparge_profile.SpargeProfile(variant="sparge", layers={0: {"cdfthreshd": 0.9}})
    prof.save(str(tmp_path / "p.json"))
    cls = v1.NODE_CLASS_MAPPINGS["SolAttnSettings"]
    for bad, msg in [("p.json", "tuned for sparge, this node selects kitchen_sol"),
                     ("missing.json", "is not in models/sparge_profiles")]:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            cls().run(method="kitchen_sol", profile=bad)
        assert str(e.value).startswith("Sol-Attn Settings: ") and msg in str(e.value), str(e.value)
        assert "SpargeAttn" not in str(e.value)
    (tmp_path / "x.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="^Sol-Attn Settings: not a sparse-attention profile"):
        cls().run(method="kitchen_sol", profile="x.json")


@pytest.mark.parametrize(
    "text, ranges",
    [("", ()), ("3", ((3, 3),)), ("0-3, 7, 40-", ((0, 3), (7, 7), (40, None))), ("-5", ((0, 5),)), (" 1 - 2 ; 9", ((1, 2), (9, 9)))],
)
def test_parse_layers(text, ranges):
    assert patch.parse_layers(text) == ranges


@pytest.mark.parametrize("bad, msg", [("a", "cannot read 'a'"), ("5-2", "ends before it starts"), ("1,,x", "cannot read 'x'")])
def test_parse_layers_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        patch.parse_layers(bad)


def _cfg(backend="sdpa_math"):
    return P.attention.AttentionConfig(backend=backend)


def test_override_binds_comfyui_arguments_and_counts_layers():
    ov = patch.AttentionOverride(_cfg(), dense_layers=patch.parse_layers("1"))
    q = torch.randn(1, 16, 2 * 8)
    called = []

    def default_func(*a, **k):  # ComfyUI's own attention: never used by the override
        called.append(1)

    for _ in range(2):
        ov.start_forward()
        ov(default_func, q, q, q, 2, transformer_options={}, _inside_attn_wrapper=True)  # layer 0
        ov(default_func, q, q, q, heads=2, mask=None, skip_reshape=False, transformer_options={})  # layer 1: dense
        ov(default_func, q, q, q, 2, None, None, False, False, transformer_options={})  # layer 2
    assert not called
    assert ov.config.stats.calls == {"sdpa_math": 4, "sdpa": 2}


def test_override_schedule_reads_sigma():
    ov = patch.AttentionOverride(_cfg(), sigma_range=(10.0, 1.0))
    q = torch.randn(1, 8, 8)
    for s in (14.0, 10.0, 5.0, 1.0, 0.5):
        ov(None, q, q, q, 1, transformer_options={"sigmas": torch.tensor([s])})
    assert ov.config.stats.calls == {"sdpa_math": 3, "sdpa": 2}


def test_override_survives_deepcopy_of_model_options():
    import copy

    ov = patch.AttentionOverride(_cfg())
    opts = {"transformer_options": {"optimized_attention_override": ov}}
    assert copy.deepcopy(opts)["transformer_options"]["optimized_attention_override"] is ov


def test_sparge_settings_validation():
    (s,) = defs.run_sparge_settings("sparge_topk", 0.3, 0.98, 50.0, topk=0.4)
    assert s.options == {"simthreshd1": 0.3, "topk": 0.4, "pvthreshd": 50.0} and s.variant == "sparge_topk"
    # profiles by name, in models/sparge_profiles only: tests/test_files.py


def test_nonfinite_layers_are_redone_dense_with_one_check_per_forward(pack_backend):
    A = P.attention

    def nan_fn(q, k, v, *, layout, mask, scale, opts):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return torch.full_like(o, float("nan")) if q.shape[-1] == 16 else o  # "degenerate" only at layer 1's head dim

    pack_backend(A.Backend(name="t_nanq", family="test", fn=nan_fn, constraints=(), probe=lambda: A.Availability(True),
                                quantized=True))
    cfg = A.AttentionConfig(backend="t_nanq", check_finite="deferred")
    ov = patch.AttentionOverride(cfg)
    wrapper = patch.ForwardWrapper(ov)
    q8 = torch.randn(1, 32, 2 * 8)
    q16 = torch.randn(1, 32, 2 * 16)
    forwards = []

    def forward():
        forwards.append(1)
        return torch.stack([ov(None, q8, q8, q8, 2, transformer_options={}), ov(None, q16, q16, q16, 2, transformer_options={}).mean()
                            * torch.ones_like(ov(None, q8, q8, q8, 2, transformer_options={}))])

    out = wrapper(lambda: forward())
    assert torch.isfinite(out).all() and len(forwards) == 2  # redone once
    assert ov.nonfinite_layers == {1}
    out2 = wrapper(lambda: forward())
    assert torch.isfinite(out2).all() and len(forwards) == 3  # later forwards: layer 1 dense, no redo
    # the layer goes to the fastest exact kernel for its shape (auto_exact's selector)
    assert cfg.stats.fallbacks[("t_nanq", "auto_exact", "non-finite output (forward redone)")] == 1


def test_benchmark_node_without_a_gpu_times_sdpa_on_the_cpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the node times it (tests/gpu)")
    cls = v1.NODE_CLASS_MAPPINGS["AttentionBenchmark"]
    out = cls().run(presets="", shapes="1,2,128,64\n1,2,128,64,77", dtype="bf16", reps=1)
    text = out["result"][0]
    assert out["ui"]["text"][0] == text
    assert text.startswith("CPU · torch") and "No CUDA GPU: these are PyTorch's SDPA kernels on the CPU" in text
    assert "(wall clock)" in text and "CUDA events" not in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and " ms " in line}
    assert set(rows) == {"sdpa", "sdpa_math", "auto", "peer:comfy_default"}  # no GPU kernel is listed as if timed
    assert rows["sdpa"].count(" ms ×1.00") == 2  # each shape timed, SDPA the baseline of its own column
    assert "1.0000 / 0.00" in text  # SDPA's math kernel against fp32 SDPA
    with pytest.raises(ValueError, match="^Attention Benchmark: unknown preset"):
        cls().run(presets="sd15,nope", shapes="", dtype="bf16", reps=1)
    with pytest.raises(ValueError, match="^Attention Benchmark: nothing to time"):
        cls().run(presets=" ", shapes="", dtype="bf16", reps=1)


def test_benchmark_rounds_are_counted_for_the_progress_bar():
    bench = importlib.import_module(P.__name__ + ".measure.bench")
    ticks = []
    table = bench.parse_shapes([], ["1,1,64,32"])
    table = {k: v for k, v in table.items() if k == "1,1,64,32"}
    meta, rows = bench.run(table, reps=1, warmup=1, device=torch.device("cpu"), progress=lambda: ticks.append(1))
    assert len(rows) == 4 and len(ticks) == bench.tick_count(table, torch.device("cpu"), reps=1) == 4 * (1 + bench.ROUNDS)


def test_end_to_end_benchmark_returns_its_report_and_two_images_and_takes_an_optional_vae():
    cls = v1.NODE_CLASS_MAPPINGS["AttentionBenchmarkE2E"]
    assert cls.RETURN_TYPES == ("STRING", "IMAGE", "IMAGE") and cls.RETURN_NAMES == ("report", "chart", "frames")
    vae = cls.INPUT_TYPES()["optional"]["vae"]
    assert vae[0] == "VAE" and "decoded" in vae[1]["tooltip"] and "vae" not in cls.INPUT_TYPES()["required"]


def test_benchmark_shapes_are_parsed_with_clear_errors():
    from importlib import import_module

    bench = import_module(P.__name__ + ".measure.bench")
    shapes = bench.parse_shapes(["flux"], ["1,2,300,64", "2,4,100,40,77"])
    assert shapes["1,2,300,64"][:5] == (1, 2, 300, 64, None) and shapes["2,4,100,40,77"][4] == 77 and "flux" in shapes
    with pytest.raises(ValueError, match="B,H,N,D or B,H,N,D,Nk"):
        bench.parse_shapes([], ["1,2,3"])


def test_pvthreshd_values_are_parsed_with_clear_errors():
    assert defs.parse_pv_values("50, 20") == (50.0, 20.0)
    assert defs.parse_pv_values("") == (50.0,)
    with pytest.raises(ValueError, match="numbers separated by commas"):
        defs.parse_pv_values("a,b")
    with pytest.raises(ValueError, match=r"must be numbers in \[0.0"):
        defs.parse_pv_values("-3")


def _gpu_env(name, cc, cuda="12.8"):
    return {"gpus": [{"index": 0, "name": name, "cc": cc, "arch": ""}], "hip": None, "cuda": cuda}


def test_backends_info_advice_fits_the_machine():
    import os
    import sys

    install = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "install.py")
    # no CUDA GPU: what runs here, no install advice for GPU kernels
    cpu = " ".join(defs.advice({"gpus": [], "hip": None, "cuda": None}))
    assert "No CUDA GPU" in cpu and "nothing to install" in cpu and "install.py" not in cpu
    assert "ROCm" in " ".join(defs.advice({"gpus": [], "hip": "6.2", "cuda": None}))
    if not torch.cuda.is_available():
        text = defs.info_text()
        assert "install.py" not in text and "[      yes] sdpa" in text and "flash_attn4" not in text
    # a consumer GPU on Windows: the SageAttention 2 wheel, no compiler; on Linux: builds that need the toolkit
    win = defs.advice(_gpu_env("NVIDIA GeForce RTX 4090", "8.9"), "Windows")
    assert win[0].startswith("NVIDIA GeForce RTX 4090 is a consumer GPU: install.py adds SageAttention 2.")
    assert "prebuilt wheel" in win[0] and "FlashAttention-4" not in win[0]
    assert f"{sys.executable} {install} --dry-run" in " ".join(win).replace('"', "")
    lin = defs.advice(_gpu_env("NVIDIA GeForce RTX 4090", "8.9"), "Linux")[0]
    assert "SageAttention 2, SpargeAttn" in lin and "CUDA toolkit 12.x" in lin and "FlashAttention-4" not in lin
    # a data-centre GPU: FlashAttention-4 where it runs
    h100 = defs.advice(_gpu_env("NVIDIA H100 80GB HBM3", "9.0", "13.0"), "Linux")[0]
    assert "is a data-centre GPU" in h100 and "FlashAttention-4 comes as wheels" in h100 and "toolkit 13.x" in h100
    assert defs.gpu_kind("NVIDIA L40S") == defs.gpu_kind("NVIDIA A100-SXM4-80GB") == "data-centre"
    assert defs.gpu_kind("NVIDIA GeForce RTX 3060") == "consumer"
    old = defs.advice(_gpu_env("NVIDIA GeForce GTX 1080", "6.1"), "Linux")
    assert "older than every kernel install.py adds" in old[0] and len(old) == 1


def test_backends_info_names_the_install_command_for_this_python_and_folder():
    text = defs.info_text()
    assert "in this folder" not in text
    # a package that is not there says so; another import failure keeps its error
    assert defs._why("import sageattention failed: ModuleNotFoundError: No module named 'sageattention'") == "not installed"
    dep = "import flash_attn.cute failed: ModuleNotFoundError: No module named 'cutlass'"
    assert defs._why(dep) == dep


def test_sol_attn_on_an_older_comfy_kitchen_says_how_to_add_it(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "comfy_kitchen", types.ModuleType("comfy_kitchen"))  # 0.2.31: no sol_attn
    av = P.attention.backends.kitchen._sol_probe()
    assert not av.ok
    assert "needs 0.2.40 or later" in av.reason and "python -m pip install comfy-kitchen==0.2.40" in av.reason


def test_the_settings_nodes_and_patch_attention_share_one_type_and_one_name():
    sparge, sol = v1.NODE_CLASS_MAPPINGS["SpargeAttnSettings"], v1.NODE_CLASS_MAPPINGS["SolAttnSettings"]
    assert sparge.RETURN_TYPES == sol.RETURN_TYPES == ("SPARSE_SETTINGS",)
    assert sparge.RETURN_NAMES == sol.RETURN_NAMES == ("sparse_settings",)
    spec = v1.NODE_CLASS_MAPPINGS["PatchAttention"].INPUT_TYPES()["optional"]["sparse_settings"]
    # one name on screen and in saved workflows (those saved as sparge_settings still load: Node.run maps it)
    assert spec[0] == "SPARSE_SETTINGS" and "display_name" not in spec[1]
    assert v1.NODE_DISPLAY_NAME_MAPPINGS["TuneSpargeAttn"] == "Tune Sparse Attention"
