"""The end-to-end benchmark's rows (measure/rows.py, measure/core_nodes.py): one table of row kinds that every other
place reads, and core's attention nodes applied through their own classes, or reported as not available."""

import dataclasses
import sys
import types
from importlib import import_module

import pytest
import torch
from pack import load

M = load().__name__ + ".measure"
rows = import_module(M + ".rows")
core_nodes = import_module(M + ".core_nodes")
report = import_module(M + ".report")
stats = import_module(M + ".stats")


@pytest.mark.parametrize("name, kind, role, kernel, exact, sparse", [
    ("unpatched", "unpatched", rows.BASELINE, "unpatched", True, False),
    ("sdpa_math", "backend", rows.KERNEL, "sdpa_math", True, False),
    ("sage_fp8_sm90 +compile", "backend", rows.KERNEL, "sage_fp8_sm90", False, False),
    ("kitchen_sol[tau=2.0]", "options", rows.KERNEL, "kitchen_sol", False, True),
    ("peer:sdpa_flash", "peer", rows.PEER_ROLE, "sdpa_flash", True, False),
    ("sparge/no-nan-net", "no-nan-net", rows.VARIANT, "sparge", False, True),
    ("auto_fast", "selector", rows.SELECTOR, "auto_fast", False, False),
    ("core:sol-attn", "core", rows.CORE, "core:sol-attn", False, True),
    ("core:kitchen-int8", "core", rows.CORE, "core:kitchen-int8", False, False),
])
def test_a_row_name_reads_as_its_kind(name, kind, role, kernel, exact, sparse):
    r = rows.parse(name)
    assert (r.kind.name, r.role, r.kernel, r.exact, r.sparse) == (kind, role, kernel, exact, sparse)
    assert rows.is_exact_row(name) is exact and rows.is_sparse_row(name) is sparse


def test_typed_rows_are_checked_against_the_table():
    assert rows.rows_from_text("unpatched, auto_fast; sdpa_math/no-nan-net, peer:sdpa_math, core:sol-attn") == [
        "unpatched", "auto_fast", "sdpa_math/no-nan-net", "peer:sdpa_math", "core:sol-attn"]
    with pytest.raises(ValueError, match="unknown row") as e:
        rows.rows_from_text("sdpa, nope, peer:nope, nope/no-nan-net, nope[tau=1]")
    msg = str(e.value)
    assert "nope, peer:nope, nope/no-nan-net, nope[tau=1];" in msg and "sdpa," not in msg.split(";")[0]
    for kind in rows.ROW_KINDS:  # the error names every kind the way a user writes it
        assert kind.syntax in msg
    assert rows.rows_from_text("all", peers=False) == rows.default_rows(peers=False)


def test_all_means_unpatched_the_usable_backends_the_selectors_then_peers():
    usable = [b.name for b in rows.REGISTRY.backends() if b.available and b.timed]
    without = rows.default_rows(peers=False)
    assert without[: 1 + len(usable) + 2] == ["unpatched", *usable, "auto", "auto_exact"]
    assert "sdpa_math" not in without and all(rows.parse(r).role != rows.PEER_ROLE for r in without)
    peers = [r for r in rows.default_rows(peers=True) if r not in without]
    assert all(r.startswith(rows.PEER) for r in peers)


def test_a_new_kind_of_row_is_one_table_entry(monkeypatch):
    """A kind added to ROW_KINDS is read, checked, listed in 'all', compared and coloured with no other edit."""
    half = rows.RowKind("half", "half:<backend>", rows.VARIANT, lambda r: r.startswith("half:"),
                        lambda model, row, profiles: (model, "half"), kernel=lambda r: r[5:],
                        known=lambda r: r[5:] in rows.REGISTRY, in_all=lambda peers: ["half:sdpa"], all_order=5)
    monkeypatch.setattr(rows, "ROW_KINDS", (half, *rows.ROW_KINDS))
    assert rows.parse("half:sdpa_math").exact and rows.role_of("half:sdpa") == rows.VARIANT
    assert rows.default_rows(peers=False)[-1] == "half:sdpa"
    assert rows.rows_from_text("half:sdpa") == ["half:sdpa"]
    with pytest.raises(ValueError, match="half:<backend>"):
        rows.rows_from_text("half:nope")
    assert rows.build_row(object(), "half:sdpa")[1] == "half"
    # a variant is neither a rival of auto nor compared with a peer
    times = {"unpatched": [1.0, 1.0, 1.0], "sdpa": [0.5, 0.5, 0.5], "half:sdpa": [0.1, 0.1, 0.1], "auto": [0.6] * 3}
    out = [{"row": r} for r in times]
    stats.add_paired(out, list(times), times)
    assert out[3]["best_row"] == "sdpa"


def test_core_rows_have_a_twin_target_from_the_table():
    mk = lambda name, s, rel: {"row": name, "s_per_step": s, "rel_l1": rel}  # noqa: E731
    res = [mk("unpatched", 1.0, 0.0), mk("kitchen_sol", 0.5, 0.05), mk("core:sol-attn", 0.52, 0.05), mk("auto", 0.6, 0.01)]
    got = {t["target"]: t for t in report.targets(res)}
    assert got["kitchen_sol within 2% of core:sol-attn"]["met"] is True
    assert "auto >= core:sol-attn (where auto's error <= its error)" in got
    assert not any("core:kitchen-int8" in t for t in got)  # no such row in this run


# ---------------------------------------------------------------- core nodes through ComfyUI


@pytest.fixture()
def comfy_model():
    from comfyui_support import comfy, release, tiny_flux

    comfy()
    return tiny_flux(), release()


def test_a_core_node_this_comfyui_lacks_is_reported_not_available(comfy_model):
    model, version = comfy_model
    if "comfy_extras.nodes_sparse_attention" in sys.modules or _importable("comfy_extras.nodes_sparse_attention"):
        pytest.skip("this ComfyUI has Model Sparse Attention")
    with pytest.raises(core_nodes.RowUnavailable, match=f"^Model Sparse Attention is not available on ComfyUI {version} "):
        rows.build_row(model, "core:sol-attn")
    assert "core:sol-attn" not in rows.default_rows()
    assert core_nodes.missing("core:sol-attn").startswith("Model Sparse Attention is not available on ComfyUI")


def _importable(name):
    try:
        import_module(name)
    except ImportError:
        return False
    return True


def test_a_core_row_applies_the_node_class_with_its_defaults(comfy_model, monkeypatch):
    """core:sol-attn calls core's node (a V3 node: ``execute``) with the inputs a graph with its default widgets passes,
    and samples the model it returns; nothing of the node is copied into the pack."""
    model, _ = comfy_model
    seen = {}

    class BlockSparseAttention:  # core's node as the running ComfyUI would have it
        @classmethod
        def define_schema(cls):
            return None

        @classmethod
        def execute(cls, model, **kwargs):
            seen.update(kwargs)
            m = model.clone()
            m.model_options.setdefault("transformer_options", {})["sparse_node"] = True
            return (m,)

    fake = types.ModuleType("comfy_extras.nodes_sparse_attention")
    fake.BlockSparseAttention = BlockSparseAttention
    monkeypatch.setitem(sys.modules, "comfy_extras.nodes_sparse_attention", fake)
    node = core_nodes.CORE_NODES["core:sol-attn"]
    monkeypatch.setitem(core_nodes.CORE_NODES, "core:sol-attn", dataclasses.replace(node, kernel_missing=lambda: None))
    m, note = rows.build_row(model, "core:sol-attn")
    assert m.model_options["transformer_options"]["sparse_node"] is True and m is not model
    assert note == "Model Sparse Attention node"
    assert seen == {"selection": {"selection": "sol-attn", "tau": 1.3}, "start_percent": 0.2, "end_percent": 1.0,
                    "dense_blocks": "", "min_tokens": 12288, "extra_tokens": 256,
                    "sink_conditioning": "exact_kv_and_rows", "verbose": False}
    assert "core:sol-attn" in rows.default_rows()
    # its kernel missing here: the row says so instead of timing a dense fallback under the node's name
    monkeypatch.setitem(core_nodes.CORE_NODES, "core:sol-attn", dataclasses.replace(node, kernel_missing=lambda: "no GPU"))
    with pytest.raises(core_nodes.RowUnavailable, match="^no GPU$"):
        rows.build_row(model, "core:sol-attn")


def test_the_benchmark_reports_an_unavailable_core_row_and_runs_the_others(comfy_model):
    from comfyui_support import flux_conds

    model, version = comfy_model
    e2e = import_module(M + ".e2e")
    pos, neg = flux_conds()
    job = e2e.Job(model, pos, neg, torch.zeros(1, 16, 16, 16), steps=1, label="tiny")
    res = {r["row"]: r for r in e2e.measure(job, ["unpatched", "core:kitchen-int8", "core:sol-attn"], warmup_steps=1)}
    assert "s_per_step" in res["unpatched"]
    for row in ("core:kitchen-int8", "core:sol-attn"):  # neither runs on a CPU; each row says why
        assert "s_per_step" not in res[row] and res[row]["error"]
    assert res["core:sol-attn"]["error"].startswith(("Model Sparse Attention is not available on ComfyUI " + version,
                                                     "comfy-kitchen's Sol-Attn kernel is not available here"))
    md = report.render_markdown(list(res.values()))
    assert f"| tiny | core:sol-attn | error: {res['core:sol-attn']['error']} |" in md


def test_core_int8_row_runs_core_model_attention_backend_node(comfy_model, monkeypatch):
    """ComfyUI 0.33's Model Attention Backend (a classic node: ``FUNCTION``) applied by the row, its kernel's flag
    forced on (the kernel is CUDA-only): the model's hook calls the function core's node put there."""
    model, _ = comfy_model
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend  # noqa: F401
    except ImportError:
        pytest.skip("this ComfyUI has no Model Attention Backend node")
    import comfy.ldm.modules.attention as ca

    got = []
    monkeypatch.setattr(ca, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", True)
    monkeypatch.setitem(ca.REGISTERED_ATTENTION_FUNCTIONS, "comfy_kitchen_int8", lambda *a, **k: got.append(a) or "out")
    m, note = rows.build_row(model, "core:kitchen-int8")
    assert note == "Model Attention Backend node" and m is not model
    hook = m.model_options["transformer_options"]["optimized_attention_override"]
    assert hook(None, "q", "k", "v", 2) == "out" and got == [("q", "k", "v", 2)]


def test_a_guidance_scale_from_the_command_line_is_in_the_presets_description():
    """bench_e2e --cfg: the description says what ran (CFG 1 has no CFG batch)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_e2e

    wan = "Wan 2.1 1.3B t2v, 480p (832x480), 81 frames, CFG batch"
    assert bench_e2e._with_cfg(wan, None) == wan
    assert bench_e2e._with_cfg(wan, 1.0) == "Wan 2.1 1.3B t2v, 480p (832x480), 81 frames, CFG 1 (one prompt per step)"
    assert bench_e2e._with_cfg(wan, 3.5) == wan + ", CFG 3.5"
