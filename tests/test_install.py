"""install.py's detectors, planner, pins and source fixes against simulated machines."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("pa_install", ROOT / "install.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


inst = _load()


def machine(gpus=(("NVIDIA H100 80GB HBM3", (9, 0)),), nvcc=(13, 0), torch="2.11.0+cu130", cuda="13.0", gcc=(13, 3), **kw):
    return inst.Machine(
        torch=torch, torch_cuda=cuda, gpus=[inst.GPU(n, cc) for n, cc in gpus], nvcc=nvcc,
        nvcc_path="/usr/local/cuda/bin/nvcc" if nvcc else None, cuda_home="/usr/local/cuda" if nvcc else None,
        gcc=gcc, cores=16, mem_gb=128, pinned={"torch": torch.split("+")[0]},
        build_tools={t: "1" for t in inst.BUILD_TOOLS}, **kw,
    )


def actions(steps):
    return {s.kernel: s.action for s in steps}


def test_hopper_with_toolkit_builds_sage2_and_sparge_with_the_gcc13_fix():
    steps = inst.plan(machine())
    a = actions(steps)
    assert a == {"sageattention": "build", "sageattn3": "skip", "spas_sage_attn": "build", "comfy_kitchen": "wheel"}
    sage = next(s for s in steps if s.kernel == "sageattention")
    sparge = next(s for s in steps if s.kernel == "spas_sage_attn")
    assert sage.env["TORCH_CUDA_ARCH_LIST"] == "9.0" and sparge.env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert "sparge-cassert-gcc13" in [f.name for f in sparge.fixes]
    assert not sage.fixes


def test_gcc12_does_not_get_the_cassert_fix():
    sparge = next(s for s in inst.plan(machine(gcc=(12, 2))) if s.kernel == "spas_sage_attn")
    assert "sparge-cassert-gcc13" not in [f.name for f in sparge.fixes]


@pytest.mark.parametrize(
    "gpus, expect",
    [
        ((("A100", (8, 0)),), {"sageattention": "build", "spas_sage_attn": "build", "sageattn3": "skip"}),
        ((("RTX 3090", (8, 6)),), {"sageattention": "build", "spas_sage_attn": "build", "sageattn3": "skip"}),
        ((("RTX 4090", (8, 9)),), {"sageattention": "build", "spas_sage_attn": "build", "sageattn3": "skip"}),
        ((("B200", (10, 0)),), {"sageattention": "build", "spas_sage_attn": "skip", "sageattn3": "build"}),
        ((("RTX 5090", (12, 0)),), {"sageattention": "build", "spas_sage_attn": "skip", "sageattn3": "build"}),
        ((("T4", (7, 5)),), {"sageattention": "skip", "sageattention1": "wheel", "spas_sage_attn": "skip", "sageattn3": "skip"}),
    ],
)
def test_plan_per_architecture(gpus, expect):
    a = actions(inst.plan(machine(gpus=gpus)))
    for k, v in expect.items():
        assert a.get(k) == v, (k, a)


def test_mixed_gpus_build_for_the_union_of_archs():
    steps = inst.plan(machine(gpus=(("RTX 4090", (8, 9)), ("RTX 3090", (8, 6)), ("RTX 5090", (12, 0)))))
    sage = next(s for s in steps if s.kernel == "sageattention")
    sparge = next(s for s in steps if s.kernel == "spas_sage_attn")
    assert sage.env["TORCH_CUDA_ARCH_LIST"] == "8.6;8.9;12.0"
    assert sparge.env["TORCH_CUDA_ARCH_LIST"] == "8.6;8.9"  # sparge stops at 9.0


def test_no_toolkit_falls_back_to_sage_triton_wheel():
    steps = inst.plan(machine(nvcc=None))
    a = actions(steps)
    assert a["sageattention"] == "skip" and a["sageattention1"] == "wheel" and a["spas_sage_attn"] == "skip"
    reason = next(s.reason for s in steps if s.kernel == "sageattention")
    assert "no CUDA toolkit" in reason


def test_nvcc_torch_cuda_mismatch_is_refused():
    steps = inst.plan(machine(nvcc=(12, 8), cuda="13.0"))
    assert "does not match torch's CUDA 13.0" in next(s.reason for s in steps if s.kernel == "sageattention")


def test_nvcc_too_old_for_the_arch():
    steps = inst.plan(machine(gpus=(("RTX 5090", (12, 0)),), nvcc=(12, 4), cuda="12.4"))
    assert "too old for sm_120" in next(s.reason for s in steps if s.kernel == "sageattention")


@pytest.mark.parametrize(
    "m, text",
    [
        (dict(gpus=()), "no NVIDIA GPU found"),
        (dict(torch=None), "torch is not installed"),
        (dict(torch_hip="6.2"), "ROCm torch"),
    ],
)
def test_machines_with_nothing_to_build(m, text):
    kw = dict(m)
    mm = machine(**{k: v for k, v in kw.items() if k in ("gpus",)})
    if "torch" in kw:
        mm.torch = kw["torch"]
    if "torch_hip" in kw:
        mm.torch_hip = kw["torch_hip"]
    steps = inst.plan(mm)
    assert [s.action for s in steps] == ["skip"] and text in steps[0].reason
    assert "nothing to install" in inst.render_plan(mm, steps)


def test_second_run_has_nothing_to_do():
    m = machine(installed={"sageattention": "2.2.0", "spas_sage_attn": "0.1.0", "comfy-kitchen": "0.2.40"},
                sage_modules={"_qattn_sm80": True, "_qattn_sm89": True, "_qattn_sm90": True, "_fused": True})
    steps = inst.plan(m)
    assert {s.action for s in steps} <= {"ok", "skip"}
    assert "everything planned is already there" in inst.render_plan(m, steps)
    # a 2.x install missing the sm90 module is rebuilt
    m.sage_modules["_qattn_sm90"] = False
    assert actions(inst.plan(m))["sageattention"] == "build"
    # --force rebuilds
    assert actions(inst.plan(machine(installed={"spas_sage_attn": "0.1.0"}), force=True))["spas_sage_attn"] == "build"


def test_sage1_installed_is_upgraded_to_sage2_when_buildable():
    a = actions(inst.plan(machine(installed={"sageattention": "1.0.6"})))
    assert a["sageattention"] == "build"


def test_only_skip_and_optional_wheels():
    assert set(actions(inst.plan(machine(), only=["spas_sage_attn"]))) == {"spas_sage_attn"}
    assert "comfy_kitchen" not in actions(inst.plan(machine(), skip=["comfy_kitchen"]))
    a = actions(inst.plan(machine(), only=["xformers", "flash_attn"]))
    assert a == {"xformers": "wheel", "flash_attn": "wheel"}
    x = next(s for s in inst.plan(machine(), only=["xformers"]))
    assert x.pip_args == ["--only-binary=:all:", "xformers"]
    with pytest.raises(SystemExit, match="unknown kernel"):
        inst.plan(machine(), only=["nope"])
    assert actions(inst.plan(machine(torch="2.8.0+cu128", cuda="12.8", nvcc=(12, 8)), only=["comfy_kitchen"])) == {"comfy_kitchen": "skip"}


def test_missing_build_tools_are_installed_first():
    m = machine()
    m.build_tools["ninja"] = None
    steps = inst.plan(m)
    assert steps[0].kernel == "build-tools" and steps[0].pip_args == ["ninja"]


def test_sources_are_passed_through():
    steps = inst.plan(machine(), sources={"sageattention": "/src/Sage", "spas_sage_attn": "/src/Sparge"})
    assert {s.kernel: s.source for s in steps if s.action == "build"} == {"sageattention": "/src/Sage", "spas_sage_attn": "/src/Sparge"}


def test_pins_file_and_every_pip_call_use_it(tmp_path, monkeypatch):
    m = machine()
    m.pinned = {"torch": "2.11.0", "torchvision": "0.26.0"}
    installer = inst.Installer(m, tmp_path, pip_extra=["--no-index"], quiet=True)
    assert installer.constraints.read_text() == "torch==2.11.0\ntorchvision==0.26.0\n"
    seen = {}

    def fake_stream(cmd, log, env=None, position=0):
        seen["cmd"], seen["env"] = cmd, env
        return 0

    monkeypatch.setattr(installer, "_stream", fake_stream)
    installer.pip(["xformers"], tmp_path / "x.log")
    assert seen["cmd"][:4] == [sys.executable, "-m", "pip", "install"]
    assert "--constraint" in seen["cmd"] and str(installer.constraints) in seen["cmd"] and "--no-index" in seen["cmd"]


def test_torch_moved_is_detected_and_rolled_back(tmp_path, monkeypatch):
    m = machine()
    m.pinned = {"torch": "0.0.1"}  # pretend torch was something else before
    installer = inst.Installer(m, tmp_path, quiet=True)
    assert "torch 0.0.1 ->" in installer.torch_moved()
    calls = []
    monkeypatch.setattr(installer, "_one", lambda s, pos: None)
    seq = iter([{"a"}, {"a", "newpkg"}])
    monkeypatch.setattr(installer, "installed_now", lambda: next(seq))
    monkeypatch.setattr(installer, "torch_moved", lambda: "torch 0.0.1 -> 2.99")
    monkeypatch.setattr(inst.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    step = inst.Step("xformers", "wheel", "x", pip_args=["xformers"])
    installer._guarded([step])
    assert step.status == "failed" and "torch moved" in step.detail and "newpkg" in step.detail
    assert calls and calls[0][-1] == "newpkg" and "uninstall" in calls[0]


SPARGE_SETUP = '''NVCC_FLAGS = [
    "-O3",
    "-Xcompiler", "-include,cassert", # fix error occurs when compiling for SM90+ with newer CUDA toolkits
]
def run_instantiations(src_dir):
    for py_file in files:
        os.system(f"python {py_file}")
'''


SPARGE_AUTOTUNE = """import torch
# (upstream: a comment line)
from tools.gpu_process import GPUProcessPoolExecutor
executor = GPUProcessPoolExecutor()

class SparseAttentionMeansim(torch.nn.Module):
    pass
"""


def test_fixes_apply_to_a_copy_of_the_source(tmp_path):
    src = tmp_path / "SpargeAttn"
    src.mkdir()
    (src / "setup.py").write_text(SPARGE_SETUP)
    (src / "spas_sage_attn").mkdir()
    (src / "spas_sage_attn" / "autotune.py").write_text(SPARGE_AUTOTUNE)
    (src / "README.md").write_text("x")
    log = tmp_path / "log"
    copy = inst.fetch_source(str(src), tmp_path / "work", log)
    fixes = [f for f in inst.FIXES if f.kernel == "spas_sage_attn"]
    assert all(f.apply(copy) for f in fixes)
    text = (copy / "setup.py").read_text()
    assert "-include,cassert" not in text and "os.system(f\"python" not in text and "executable" in text
    assert (src / "setup.py").read_text() == SPARGE_SETUP  # the user's source is untouched
    assert not any(f.apply(copy) for f in fixes)  # applying twice finds nothing to change
    compile(text, "setup.py", "exec")
    # the patched autotune module imports without the repository's tools/ folder (what `import yunchang` does)
    import runpy

    ns = runpy.run_path(str(copy / "spas_sage_attn" / "autotune.py"))
    assert ns["executor"] is None and "SparseAttentionMeansim" in ns


def test_fetch_source_unpacks_archives(tmp_path):
    import tarfile

    d = tmp_path / "Pkg"
    d.mkdir()
    (d / "setup.py").write_text("")
    arc = tmp_path / "Pkg.tar.gz"
    with tarfile.open(arc, "w:gz") as t:
        t.add(d, arcname="Pkg")
    out = inst.fetch_source(str(arc), tmp_path / "w", tmp_path / "log")
    assert (out / "setup.py").exists()
    assert inst.fetch_source("not a path", tmp_path / "w2", tmp_path / "log2") is None


@pytest.mark.parametrize(
    "log, cause",
    [
        ("error: redefinition of 'void std::__terminate()'", "sparge-cassert-gcc13"),
        ("OSError: CUDA_HOME environment variable is not set", "no CUDA toolkit"),
        ("c++: fatal error: Killed signal terminated program cc1plus", "out of memory"),
        ("ERROR: No matching distribution found for flash-attn", "no wheel"),
        ("#error -- unsupported GNU version! gcc versions later than 13 are not supported!", "host compiler too new"),
        ("something else", "see the log"),
        # from install.py run the way ComfyUI Manager runs it, on the H100 without network (2026-11-22):
        ("fatal: unable to access 'https://github.com/thu-ml/SageAttention/': Could not resolve host: github.com", "no network"),
        ("WARNING: Retrying ... Failed to establish a new connection: [Errno -3] Temporary failure in name resolution\n"
         "ERROR: No matching distribution found for comfy-kitchen", "no network"),
    ],
)
def test_likely_cause(log, cause):
    assert cause in inst.likely_cause(log)


def test_max_jobs_respects_memory():
    m = machine()
    m.cores, m.mem_gb = 64, 16
    assert inst.max_jobs(m) == 5
    m.cores, m.mem_gb = 2, 128
    assert inst.max_jobs(m) == 2


def test_dry_run_on_this_machine_prints_a_plan():
    r = subprocess.run([sys.executable, str(ROOT / "install.py"), "--dry-run"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")})
    assert r.returncode == 0, r.stderr
    assert "plan:" in r.stdout and "torch" in r.stdout
    if "GPUs: none" in r.stdout:
        assert "no NVIDIA GPU found" in r.stdout and "nothing to install" in r.stdout


def test_json_dry_run_is_machine_readable():
    import json

    r = subprocess.run([sys.executable, str(ROOT / "install.py"), "--dry-run", "--json"], capture_output=True, text=True, timeout=120)
    data = json.loads(r.stdout)
    assert "machine" in data and "plan" in data and data["machine"]["python"]


def test_a_wheel_that_installs_but_cannot_run_is_removed(tmp_path, monkeypatch):
    installer = inst.Installer(machine(), tmp_path, quiet=True)
    calls = []
    monkeypatch.setattr(inst.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    x = inst.Step("xformers", "wheel", "x", status="installed")
    k = inst.Step("comfy_kitchen", "wheel", "k", status="installed")
    rows = [{"backend": "xformers", "status": "absent", "detail": "xformers 0.0.35 cannot load its CUDA kernels (built for torch 2.10.0)"},
            {"backend": "kitchen_int8", "status": "ok", "detail": "cos 0.99990 vs SDPA"}]
    installer.roll_back_unusable([x, k], rows)
    assert x.status == "removed" and "built for torch 2.10.0" in x.detail
    assert k.status == "installed"
    assert calls == [[sys.executable, "-m", "pip", "uninstall", "-y", "xformers"]]


def test_build_progress_follows_ninja_lines_in_pip_verbose_output(monkeypatch):
    bars = []

    class FakeBar:
        def __init__(self, **kw):
            self.n, self.total, self.closed = 0, None, False
            bars.append(self)

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", FakeBar)
    feed = inst._progress("spas_sage_attn", quiet=False)
    for line in ["Building wheels for collected packages", "  [1/292] /usr/local/cuda/bin/nvcc -c a.cu", "  [57/292] nvcc b.cu"]:
        feed(line)
    feed(None)
    assert bars[0].n == 57 and bars[0].total == 292 and bars[0].closed
