"""The runtime apart from measurement: nothing that runs while a patched model samples imports ``measure/``, and
``measure/`` and ``nodes/`` import each other without a circle.

Runtime: every module of ``attention/`` and ``nodes/``.  ``nodes/`` may call into ``measure/`` from inside a function
(the benchmark nodes, the tuning run); ``attention/`` never.  Each check imports in a fresh interpreter (or with the
pack's modules purged), so a module another test imported earlier cannot hide an import.
"""

import ast
import json
import os
import subprocess
import sys

import pytest
from comfyui_support import ROOT, find_comfyui

PACK = "pa_layering_pack"
RUNTIME = ("attention", "nodes")
MEASURE = "measure"


def modules(folder: str) -> list[str]:
    """Dotted names (relative to the pack) of every module under ``folder``, packages included."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        rel = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
        for f in sorted(files):
            if f.endswith(".py"):
                out.append(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    return sorted(out)


def _path(mod: str) -> str:
    base = os.path.join(ROOT, *mod.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def imports(mod: str) -> list[tuple[str, bool]]:
    """(imported pack module, whether at module level) for every relative import in ``mod``, in functions too."""
    tree = ast.parse(open(_path(mod)).read())
    package = mod if _path(mod).endswith("__init__.py") else mod.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    for n in tree.body:  # module level also covers try/if blocks at the top of the file
        if isinstance(n, (ast.Try, ast.If)):
            top |= {id(x) for x in ast.walk(n)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:  # `from ..measure import e2e` imports the submodule e2e
            sub = f"{target}.{alias.name}".lstrip(".")
            out.append((sub if os.path.exists(_path(sub)) else target, id(node) in top))
    return out


def test_the_module_walk_finds_the_layers():
    assert {"attention.dispatch", "attention.backends.sage", "nodes.override", "nodes.definitions"} <= set(
        modules("attention") + modules("nodes"))
    assert {"measure.e2e", "measure.pictures", "measure.bench", "measure.sparge_tune"} <= set(modules(MEASURE))
    # the walk sees function-level imports and tells them apart (definitions calls the benchmark lazily)
    assert ("measure.e2e", False) in imports("nodes.definitions")
    assert ("nodes.patch", True) in imports("measure.e2e")


def test_attention_never_imports_measurement_and_nodes_only_inside_functions():
    for mod in modules("attention"):
        bad = [m for m, _ in imports(mod) if m.split(".")[0] == MEASURE]
        assert not bad, f"{mod} imports {bad}: the kernel layer must not use measurement code"
    for mod in modules("nodes"):
        bad = [m for m, top in imports(mod) if m.split(".")[0] == MEASURE and top]
        assert not bad, f"{mod} imports {bad} at load time: import it inside the function that measures"


def test_no_import_circle_through_measure():
    """Module-to-module edges, function-level imports included (a circle of lazy imports is still a circle)."""
    graph = {m: {t for t, _ in imports(m)} for m in modules("attention") + modules("nodes") + modules(MEASURE)}

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for t in graph.get(m, ()):
                if t == goal:
                    return True
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return False

    circles = [m for m in modules(MEASURE) if reaches(m, m)]
    assert not circles, f"import circle through {circles}"
    assert not any(t == "nodes.definitions" for m in modules(MEASURE) for t in graph[m]), \
        "measure/ imports the node declarations: pass what it needs from them as arguments"


SCRIPT = r"""
import importlib, importlib.util, json, os, sys
root, pack, names, comfy = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
if comfy:  # ComfyUI importable (for nodes/v3.py), in CPU mode, after the pack on the path
    sys.path.append(comfy)
    from comfy.cli_args import args
    args.cpu = True
def fresh_pack(run_init):
    for m in [m for m in sys.modules if m == pack or m.startswith(pack + ".")]:
        del sys.modules[m]
    spec = importlib.util.spec_from_file_location(pack, os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[pack] = mod
    if run_init:
        spec.loader.exec_module(mod)
result = {}
for name in names:
    fresh_pack(run_init=(name == ""))
    try:
        if name:
            importlib.import_module(f"{pack}.{name}")
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    result[name or "<the pack, as ComfyUI loads it>"] = {
        "error": err, "measure": sorted(m for m in sys.modules if m.startswith(f"{pack}.measure"))}
print(json.dumps(result))
"""


def _import_each(names: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, ROOT, PACK, json.dumps(names), find_comfyui() or ""],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_modules_import_nothing_of_measure_each_in_a_fresh_pack():
    names = ["", *(m for m in modules("attention") + modules("nodes") if m != "nodes.v3" or find_comfyui())]
    res = _import_each(names)
    failed = {n: r["error"] for n, r in res.items() if r["error"]}
    assert not failed, failed
    leaked = {n: r["measure"] for n, r in res.items() if r["measure"]}
    assert not leaked, f"runtime modules that import measurement code: {leaked}"


def test_every_measure_and_node_module_imports_alone():
    """A module that imports a partly initialised one (an import circle at load time) fails here."""
    names = [m for m in modules(MEASURE) + modules("nodes") if m != "nodes.v3" or find_comfyui()]
    res = _import_each(names)
    failed = {n: r["error"] for n, r in res.items() if r["error"]}
    assert not failed, failed
    assert "pa_layering_pack.measure.rows" in res["measure.pictures"]["measure"]


RUN = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from comfyui_support import load_pack, sample, tiny_flux
mod, mappings = load_pack()
cls = mappings["PatchAttention"]
args = dict(model=tiny_flux(), backend="auto", fallback=True, start_percent=0.0, end_percent=1.0, dense_layers="",
            log_stats=True)
patched = (cls.execute(**args).result if hasattr(cls, "execute") else getattr(cls(), cls.FUNCTION)(**args))[0]
out = sample(patched, steps=2)
calls = mod.nodes.patch.override_of(patched).stats.total_calls
print(json.dumps({"calls": calls, "measure": sorted(m for m in sys.modules if m.startswith(mod.__name__ + ".measure"))}))
"""


@pytest.mark.comfyui
def test_patching_and_sampling_through_comfyui_import_nothing_of_measure():
    """The node as ComfyUI runs it: loaded by ComfyUI's loader, Patch Attention (auto) applied, a model sampled."""
    path = find_comfyui()
    if path is None:
        pytest.skip("no ComfyUI found (COMFYUI_PATH)")
    out = subprocess.run([sys.executable, "-c", RUN, os.path.join(ROOT, "tests")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["calls"] > 0 and res["measure"] == []
