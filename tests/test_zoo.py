"""The model zoo tier: every model configuration of the ComfyUI under test (``comfy.supported_models.models``), built
tiny through ComfyUI's own classes (tests/zoo), sampled unpatched and through the Patch Attention node as ComfyUI loads
the pack, with ``auto``, ``sdpa`` (with ``log_stats``: the dispatcher's timed path), ``sdpa_math`` and ``sage`` (not
installed on the CPU: its fallback to SDPA counted with the reason).

Per configuration (one test each, named after it): the unpatched latent is finite; each patched one is finite and
equal to it within fp32 rounding (rel-L1 1e-4, or tighter: a tenth of what a kernel with a halved softmax scale moves
that configuration's latent, so that such a kernel would always fail); the pack counts exactly the calls that reached
the hook and each fallback with a reason; the ``outside_hook`` declaration matches a measurement of where the calls
went (tests/zoo/measure.py); the no-op warning appears exactly for models whose attention never reaches the hook. A configuration without a builder fails the
test unless its family module declares why it is not built (reported, skipped), so configurations a newer ComfyUI adds
are picked up. Workflow variants (a ControlNet, a LoRA) run the same checks. A second test per configuration builds
the GPU zoo's sizes and runs one step in fp32 on the CPU, so those sizes never rot.

The report, per configuration (built or why not, the backends run, which backend ran the calls, fallbacks and their
reasons, the measured outside-hook calls), goes to ``.build/artifacts/zoo-<release>.json``.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import time

import pytest
import torch
from comfyui_support import ROOT, find_comfyui
from conftest import capture

pytestmark = pytest.mark.comfyui

TOL = 1e-4  # fp32 rel-L1 of a patched final latent against the unpatched one (observed <= 1.4e-5 on the CPU: SVD)
MARGIN = 10  # the tolerance a configuration is held to: TOL, or a tenth of what a wrong kernel moves its latent
RUNS = (("auto", False), ("sdpa", True), ("sdpa_math", False), ("sage", False))
PERTURBED = "zoo_halved_scale"


def release_models(path: str | None) -> list[str]:
    """The names in ``comfy.supported_models.models`` of the ComfyUI at ``path``, read from its source (collection
    cannot import ComfyUI): ``models = [...]`` and any ``models += [...]``, in order."""
    if path is None:
        return []
    with open(os.path.join(path, "comfy", "supported_models.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = []
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AugAssign) else None
        if isinstance(target, ast.Name) and target.id == "models" and isinstance(node.value, ast.List):
            names += [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    return names


def zoo_variants() -> list[str]:
    """Workflow variants registered in tests/zoo (``@variant("name", "Config")``), read from the source."""
    here = os.path.join(ROOT, "tests", "zoo")
    out = []
    for fn in sorted(os.listdir(here)):
        if fn.endswith(".py"):
            with open(os.path.join(here, fn), encoding="utf-8") as f:
                out += re.findall(r'^@variant\("([^"]+)",\s*"([^"]+)"\)', f.read(), flags=re.M)
    return [n for n, _ in out]


COMFY = find_comfyui()
MODELS = release_models(COMFY)
NAMES = MODELS + zoo_variants() if MODELS else ["(no ComfyUI)"]


# ---------------------------------------------------------------- the session: ComfyUI, the pack, the report

@pytest.fixture(scope="module")
def zoo():
    from comfyui_support import comfy, load_pack, release

    comfy()
    import zoo as z

    z.load_families()
    mod, mappings = load_pack()
    # one intra-op thread: the models are tiny, and on a shared CI machine a second thread that is not scheduled
    # costs a time slice per op (the tier took 10x longer with two threads on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report = {"release": release(), "torch": torch.__version__, "tolerance_rel_l1": TOL, "margin": MARGIN, "listed": NAMES, "runs": [b for b, _ in RUNS],
              "configurations": {}, "gpu_sizes": {}}
    try:
        yield z, mod, mappings, report
    finally:
        torch.set_num_threads(threads)
        report["unbuilt"] = {n: w for n, w in z.UNBUILT.items() if n in MODELS}
        out = os.path.join(ROOT, ".build", "artifacts", f"zoo-{release()}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


def resolve(z, name):
    """(configuration class, builder, family module) for a configuration or a variant; fails or skips otherwise."""
    import comfy.supported_models as sm

    if name in z.VARIANTS:
        config, builder = z.VARIANTS[name]
    elif name in z.BUILDERS:
        config, builder = name, z.BUILDERS[name]
    elif name in z.UNBUILT:
        pytest.skip(f"{name} is not built: {z.UNBUILT[name]}")
    else:
        pytest.fail(f"new configuration {name}: add a builder in a tests/zoo family module, or unbuilt({name!r}, "
                    f"'<why it cannot be built>')")
    cls = getattr(sm, config, None)
    if cls is None:
        pytest.skip(f"{name}: configuration {config} is not in this ComfyUI")
    return cls, builder, builder.__module__.rsplit(".", 1)[-1]


def sample_wrong_kernel(z, mod, mappings, base, case):
    """``case`` sampled with a wrong kernel: attention at half the softmax scale (registered for this run only, so
    that auto never meets it)."""
    A = mod.attention

    def halved(q, k, v, *, layout, mask, scale, opts):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale * 0.5)

    A.REGISTRY.register(A.Backend(name=PERTURBED, family="test", fn=halved, constraints=(),
                                  probe=lambda: A.Availability(True, version="test")))
    A.dispatch.clear_plan_cache()
    try:
        return z.sample(_node_patch(mappings, base, PERTURBED, False), case)
    finally:
        A.REGISTRY.unregister(PERTURBED)
        A.dispatch.clear_plan_cache()


def rel_l1(a, b) -> float:
    return float((a.double() - b.double()).abs().sum() / b.double().abs().sum().clamp_min(1e-30))


def _unreached_warnings(records) -> list[str]:
    return [r.getMessage() for r in records
            if r.levelno == logging.WARNING and "cannot reach the attention" in r.getMessage()]


def _node_patch(mappings, model, backend, log_stats):
    from test_comfyui_integration import patch

    return patch(mappings, model, backend, log_stats=log_stats)


# ---------------------------------------------------------------- one configuration

def test_configurations_are_read_as_comfyui_lists_them():
    """The names the tier is parametrized over (read from the source at collection) are ComfyUI's own list."""
    from comfyui_support import comfy

    comfy()
    from zoo import configurations

    assert MODELS == [c.__name__ for c in configurations()]


@pytest.mark.parametrize("name", NAMES)
def test_configuration(zoo, name):
    if name == "(no ComfyUI)":
        pytest.skip("no ComfyUI found (COMFYUI_PATH)")
    z, mod, mappings, report = zoo
    from zoo.measure import probe

    cls, builder, module = resolve(z, name)
    t0 = time.perf_counter()
    entry = report["configurations"][name] = {"configuration": cls.__name__, "family_module": module, "built": True}
    override_cls = mod.nodes.override.AttentionOverride
    case = builder(cls, False)
    entry.update(outside_hook=case.outside_hook, notes=case.notes, runs={})
    base = z.build(cls, case)
    entry["model"] = f"{type(base.model).__name__} ({type(base.model.diffusion_model).__name__})"
    with probe(override_cls) as unpatched_counts:
        ref = z.sample(base, case)
    entry["unpatched"] = {"finite": bool(torch.isfinite(ref).all()), "abs_mean": float(ref.abs().mean()),
                          "attention_calls": unpatched_counts.as_dict()}
    assert torch.isfinite(ref).all(), f"{name}: the unpatched model's latent is not finite"
    failures = []
    measured = None
    for backend, log_stats in RUNS:
        patched = _node_patch(mappings, base, backend, log_stats)
        with probe(override_cls) as counts, capture("patch_attention") as records:
            out = z.sample(patched, case)
        st = mod.nodes.patch.override_of(patched).stats
        d = st.as_dict()
        run = entry["runs"][backend] = {
            "log_stats": log_stats, "finite": bool(torch.isfinite(out).all()), "rel_l1": rel_l1(out, ref),
            "calls": d["calls"], "fallbacks": d["fallbacks"], "measured": counts.as_dict(),
            "unreached_warnings": len(_unreached_warnings(records))}
        if backend == "sdpa_math":
            measured = counts
        if not run["finite"]:
            failures.append(f"{backend}: non-finite latent")
        if st.total_calls != counts.reached:
            failures.append(f"{backend}: the pack counted {st.total_calls} calls, {counts.reached} reached the hook")
        for f in d["fallbacks"]:
            if not f["reason"]:
                failures.append(f"{backend}: a fallback {f['from']} -> {f['to']} without a reason")
        if backend == "sage":
            from_sage = sum(f["count"] for f in d["fallbacks"] if f["from"] == "sage")
            if from_sage != st.total_calls or "sage" in d["calls"]:
                failures.append(f"sage: {from_sage} fallbacks counted for {st.total_calls} calls")
        want = 1 if case.outside_hook.startswith("all:") else 0
        if run["unreached_warnings"] != want:
            failures.append(f"{backend}: {run['unreached_warnings']} 'cannot reach' warnings, expected {want}")
    # the outside-hook declaration against the measurement (sdpa_math run)
    entry["measured_outside_hook"] = measured.as_dict()
    kind = case.outside_hook.split(":", 1)[0] if case.outside_hook else ""
    seen = "all" if measured.reached == 0 else "some" if measured.bypassing else ""
    if kind != seen:
        failures.append(f"outside_hook declared {case.outside_hook or 'none'!r}, measured {measured.as_dict()} "
                        f"(reached / ComfyUI calls outside the hook / direct SDPA calls): that is {seen or 'none'!r}")
    # the comparison can fail: a kernel computing the wrong attention must move the latent at least MARGIN times the
    # tolerance this configuration is held to (TOL, or tighter where the latent moves less: "tighter where it holds")
    tol = TOL
    if measured.reached:
        moved = rel_l1(sample_wrong_kernel(z, mod, mappings, base, case), ref)
        entry["sensitivity_rel_l1"] = moved
        tol = min(TOL, moved / MARGIN)
    entry["tolerance_rel_l1"] = tol
    for backend, run in entry["runs"].items():
        if run["finite"] and run["rel_l1"] > tol:
            failures.append(f"{backend}: rel-L1 {run['rel_l1']:.2e} against unpatched > {tol:.2e}"
                            + ("" if tol == TOL else f" (a kernel with half the softmax scale moves the latent by "
                                                     f"{entry['sensitivity_rel_l1']:.2e}: the comparison must tell "
                                                     f"a {MARGIN}x smaller difference)"))
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["failures"] = failures
    assert not failures, f"{name}: " + "; ".join(failures)


@pytest.mark.parametrize("name", NAMES)
def test_gpu_sizes_build_and_run(zoo, name, monkeypatch):
    """The GPU zoo's sizes (real head dims, >= 128 tokens) build and run one model forward in fp32 on the CPU (one
    step, without the negative prompt unless the model needs CFG's batch), once per builder (a builder serving several configurations runs with the
    first)."""
    if name == "(no ComfyUI)":
        pytest.skip("no ComfyUI found (COMFYUI_PATH)")
    import dataclasses

    z, mod, mappings, report = zoo
    if name not in z.BUILDERS and name not in z.VARIANTS and name not in z.UNBUILT:
        pytest.skip(f"{name} has no builder (test_configuration fails for it)")
    cls, builder, _ = resolve(z, name)
    first = next(n for n in NAMES if n in z.BUILDERS and z.BUILDERS[n] is builder or
                 n in z.VARIANTS and z.VARIANTS[n][1] is builder)
    if first != name:
        pytest.skip(f"{name}: its builder's GPU sizes run with {first}")
    t0 = time.perf_counter()
    with monkeypatch.context() as m:  # on the CPU also where CUDA is present (builders put a ControlNet on the GPU then)
        m.setattr(torch.cuda, "is_available", lambda: False)
        case = builder(cls, True)
    # one step; without the negative prompt unless the model's forward needs CFG's cond + uncond batch
    case = dataclasses.replace(case, steps=1, cfg=case.cfg if case.extra.get("needs_uncond") else 1.0)
    out = z.sample(z.build(cls, case), case)
    report["gpu_sizes"][name] = {"finite": bool(torch.isfinite(out).all()), "seconds": round(time.perf_counter() - t0, 2)}
    assert torch.isfinite(out).all(), f"{name}: the GPU sizes give a non-finite latent"
