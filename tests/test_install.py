"""install.py's detectors, planner, pins and source fixes against simulated machines."""

import importlib.util
import os
import re
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
    """A Linux venv by default (torch's Linux wheels bring their Triton)."""
    kw.setdefault("os", "Linux")
    kw.setdefault("machine", "x86_64")
    kw.setdefault("python", "3.12.3")
    if kw["os"] == "Linux":
        kw.setdefault("triton", {(2, 11): "3.6.0", (2, 8): "3.4.0", (2, 12): "3.7.0"}.get(inst._torch_tuple(torch)))
        kw.setdefault("triton_dist", "triton" if kw["triton"] else None)
    return inst.Machine(
        torch=torch, torch_cuda=cuda, gpus=[inst.GPU(n, cc) for n, cc in gpus], nvcc=nvcc,
        nvcc_path="/usr/local/cuda/bin/nvcc" if nvcc else None, cuda_home="/usr/local/cuda" if nvcc else None,
        gcc=gcc, cores=16, mem_gb=128, pinned={"torch": torch.split("+")[0]},
        build_tools={t: "1" for t in inst.BUILD_TOOLS}, **kw,
    )


def windows(gpus, torch, python="3.12.10", layout="portable", installer="pip", triton=None, nvcc=None, **kw):
    """ComfyUI on Windows as users have it: no toolkit, no compiler; portable's python_embeded has no headers."""
    cuda = {"cu124": "12.4", "cu126": "12.6", "cu128": "12.8", "cu129": "12.9", "cu130": "13.0"}[torch.split("+")[1]]
    return machine(gpus=gpus, torch=torch, cuda=cuda, nvcc=nvcc, gcc=None, os="Windows", machine="amd64", python=python,
                   layout=layout, installer=installer, triton=triton, triton_dist="triton-windows" if triton else None,
                   python_headers=layout != "portable", **kw)


def actions(steps):
    return {s.kernel: s.action for s in steps}


def test_hopper_with_toolkit_builds_sage2_and_sparge_with_the_gcc13_fix():
    steps = inst.plan(machine())
    a = actions(steps)
    assert a == {"sageattention": "build", "sageattn3": "skip", "spas_sage_attn": "build", "flash_attn4": "wheel",
                 "comfy_kitchen": "wheel"}
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


def test_nvcc_torch_cuda_mismatch_is_refused_before_any_build_with_the_fix_in_one_line(capsys):
    m = machine(nvcc=(12, 8), cuda="13.0")
    steps = inst.plan(m)
    assert not any(s.action == "build" for s in steps)  # nothing is built against the wrong toolkit
    reason = next(s.reason for s in steps if s.kernel == "sageattention")
    assert reason.startswith("nvcc 12.8 (found /usr/local/cuda/bin/nvcc) does not match torch's CUDA 13.0")
    assert "fix: install the CUDA toolkit 13.x (torch's CUDA is 13.0) and point CUDA_HOME at it" in reason
    assert next(s.reason for s in steps if s.kernel == "spas_sage_attn") == reason
    plan = inst.render_plan(m, steps)
    line = next(x for x in plan.splitlines() if x.strip().startswith("sageattention "))
    assert "does not match" in line and "fix: install the CUDA toolkit 13.x" in line  # the problem and its fix: one line


@pytest.mark.parametrize("m, want", [
    (dict(nvcc=None, cuda="12.8", torch="2.8.0+cu128"), "no CUDA toolkit (nvcc not found); fix: install the CUDA toolkit 12.x "
                                                        "(torch's CUDA is 12.8)"),
    (dict(gpus=(("RTX 5090", (12, 0)),), nvcc=(12, 4), cuda="12.4", torch="2.8.0+cu124"),
     "nvcc 12.4 is too old for sm_120 (needs 12.8); fix: install the CUDA toolkit 12.8 or later (torch's CUDA is 12.4)"),
])
def test_a_toolkit_that_cannot_build_here_says_the_fix(m, want):
    steps = inst.plan(machine(**m))
    assert want in next(s.reason for s in steps if s.kernel == "sageattention")


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


def fa4_installed(cuda=13):
    """What a Linux machine holds after install.py put FlashAttention-4 there (torch >= 2.10 brings cuda-bindings)."""
    have = {d.name: d.version for d in (*inst.FA4_SET, inst.FA4_LIBS[cuda])}
    return {**have, "einops": "0.8.2", "cuda-bindings": inst.CUDA_BINDINGS[cuda].version, "cuda-pathfinder": "1.9.0"}


def test_second_run_has_nothing_to_do():
    m = machine(installed={"sageattention": "2.2.0", "spas_sage_attn": "0.1.0", "comfy-kitchen": "0.2.40", **fa4_installed()},
                sage_modules={"_qattn_sm80": True, "_qattn_sm89": True, "_qattn_sm90": True, "_fused": True})
    steps = inst.plan(m)
    assert {s.action for s in steps} <= {"ok", "skip"}
    assert "everything planned is already there" in inst.render_plan(m, steps)
    # a 2.x install missing the sm90 module is rebuilt
    m.sage_modules["_qattn_sm90"] = False
    assert actions(inst.plan(m))["sageattention"] == "build"
    # --force rebuilds
    assert actions(inst.plan(machine(installed={"spas_sage_attn": "0.1.0"}), force=True))["spas_sage_attn"] == "build"


def test_the_comfy_kitchen_comfyui_pins_is_never_changed(tmp_path):
    """ComfyUI 0.33 pins comfy-kitchen 0.2.31 (no sol_attn): install.py keeps it -- or installs exactly the pin where it
    is missing -- and says that kitchen_sol needs 0.2.40; it never upgrades what ComfyUI pins."""
    pinned = {"comfy-kitchen": "0.2.31"}
    k = next(s for s in inst.plan(machine(installed={"comfy-kitchen": "0.2.31"}, comfyui_pins=pinned))
             if s.kernel == "comfy_kitchen")
    assert k.action == "ok" and "pinned by ComfyUI" in k.reason and "kitchen_sol needs >= 0.2.40 (not upgraded)" in k.reason
    k = next(s for s in inst.plan(machine(comfyui_pins=pinned)) if s.kernel == "comfy_kitchen")
    assert k.action == "wheel" and k.pip_args == ["comfy-kitchen==0.2.31"]
    k = next(s for s in inst.plan(machine(installed={"comfy-kitchen": "0.2.40"})) if s.kernel == "comfy_kitchen")
    assert k.action == "ok" and "kitchen_sol" not in k.reason
    # the pins are read from the requirements.txt of the ComfyUI the pack is cloned into
    pack = tmp_path / "ComfyUI" / "custom_nodes" / "ComfyUI-PatchAttention"
    pack.mkdir(parents=True)
    (tmp_path / "ComfyUI" / "requirements.txt").write_text("torch\ncomfy-kitchen==0.2.31\ncomfy_aimdo==0.4.13\nav>=16.0.0\n")
    assert inst.comfyui_pins(str(pack)) == {"comfy-kitchen": "0.2.31", "comfy-aimdo": "0.4.13"}
    assert inst.comfyui_pins(str(tmp_path)) == {}


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
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # in a terminal
    feed = inst._progress("spas_sage_attn", quiet=False)
    for line in ["Building wheels for collected packages", "  [1/292] /usr/local/cuda/bin/nvcc -c a.cu", "  [57/292] nvcc b.cu"]:
        feed(line)
    feed(None)
    assert bars[0].n == 57 and bars[0].total == 292 and bars[0].closed


def test_a_build_in_a_captured_log_prints_a_plain_progress_line_at_least_every_15_s(monkeypatch, tmp_path, capsys):
    """ComfyUI Manager runs install.py without a terminal: no tqdm bar (its carriage returns), a line every
    HEARTBEAT_S seconds saying how long and where the build is, even while the compiler prints nothing."""
    assert inst.HEARTBEAT_S <= 15
    monkeypatch.setattr(inst, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    script = ("import time\nprint('Building wheel for spas_sage_attn', flush=True)\n"
              "print('[1/4] /usr/local/cuda/bin/nvcc -c /tmp/src/csrc/qattn/qk_int_sv_f8_cuda_sm90.cu -o a.o', flush=True)\n"
              "time.sleep(0.8)\nprint('[4/4] c++ -shared a.o -o x.so', flush=True)\n")
    i = inst.Installer(machine(), tmp_path / "logs")
    assert i._stream([sys.executable, "-c", script], tmp_path / "logs" / "spas_sage_attn.log") == 0
    out = capsys.readouterr()
    beats = [x for x in out.out.splitlines() if x.startswith("  spas_sage_attn: ")]
    assert len(beats) >= 4, out.out  # 0.8 s of silence, one line per 0.1 s
    assert any(x.endswith(", compiling 1 of 4 (qk_int_sv_f8_cuda_sm90.cu)") for x in beats), beats
    assert "\r" not in out.out + out.err
    assert "[4/4]" in (tmp_path / "logs" / "spas_sage_attn.log").read_text()  # the full output stays in the log


def test_heartbeat_lines_read_well():
    import io

    now = [0.0]
    out = io.StringIO()
    hb = inst.Heartbeat("sageattention", interval=3600, out=out, clock=lambda: now[0])
    assert hb.line() == "  sageattention: 0 s, started"
    hb("Running command Building wheel for sageattention (pyproject.toml)")
    now[0] = 42
    assert hb.line() == "  sageattention: 42 s, last output: Running command Building wheel for sageattention (pyproject.toml)"
    hb("[57/292] /usr/local/cuda/bin/nvcc --generate-dependencies -c /x/csrc/fused/fused.cu -o /x/fused.o")
    now[0] = 255
    assert hb.line() == "  sageattention: 4 min 15 s, compiling 57 of 292 (fused.cu)"
    hb("x" * 300)  # a long line after the step: the step still says where the build is
    assert hb.line().endswith("compiling 57 of 292 (fused.cu)")
    hb(None)
    assert out.getvalue() == ""  # nothing printed before its interval


# ------------------------------------------------------------------ the machines ComfyUI users have (simulated)

def step(steps, kernel):
    return next(s for s in steps if s.kernel == kernel)


RTX5090, RTX4090, RTX3060, A100, B200 = ("RTX 5090", (12, 0)), ("RTX 4090", (8, 9)), ("RTX 3060", (8, 6)), ("A100", (8, 0)), ("B200", (10, 0))

# (name, machine, expected action per kernel, expected prebuilt wheel or pin, expected triton requirement)
MATRIX = [
    ("win portable, 5090, torch 2.10 cu130, py3.13", lambda: windows((RTX5090,), "2.10.0+cu130", python="3.13.9"),
     {"sageattention": "wheel", "sageattn3": "skip", "spas_sage_attn": "skip", "comfy_kitchen": "wheel"},
     "sageattention-2.2.0+cu130torch2.10.0andhigher.post6-cp310-abi3-win_amd64.whl", "triton-windows>=3.6,<3.7"),
    ("win portable, 5090, torch 2.11 cu128 (andhigher, CUDA major)", lambda: windows((RTX5090,), "2.11.0+cu128"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu128torch2.10.0andhigher.post6-cp310-abi3-win_amd64.whl",
     "triton-windows>=3.6,<3.7"),
    ("win portable, 4090, torch 2.8 cu128", lambda: windows((RTX4090,), "2.8.0+cu128"),
     {"sageattention": "wheel", "spas_sage_attn": "skip", "comfy_kitchen": "skip"},
     "sageattention-2.2.0+cu128torch2.8.0.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.4,<3.5"),
    ("win portable, cu129 torch takes the cu128 file (same CUDA major)", lambda: windows((RTX4090,), "2.8.0+cu129"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu128torch2.8.0.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.4,<3.5"),
    ("win venv, 3060, torch 2.9.1 cu128 (exact beats same-minor)", lambda: windows((RTX3060,), "2.9.1+cu128", layout="venv"),
     {"sageattention": "wheel", "sage, sage_triton": "note"},
     "sageattention-2.2.0+cu128torch2.9.1.post6-cp310-abi3-win_amd64.whl", "triton-windows>=3.5,<3.6"),
    ("win venv, 4090, torch 2.9.0 cu130 (post3 exact)", lambda: windows((RTX4090,), "2.9.0+cu130", layout="venv"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu130torch2.9.0.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.5,<3.6"),
    ("win venv, torch 2.7.0 takes the 2.7.1 file (same minor)", lambda: windows((RTX4090,), "2.7.0+cu128", layout="venv"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu128torch2.7.1.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.3,<3.4"),
    ("win desktop (uv, no pip), 4090, torch 2.8 with the wrong triton-windows",
     lambda: windows((RTX4090,), "2.8.0+cu128", layout="desktop", installer="uv", triton="3.3.1.post19"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu128torch2.8.0.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.4,<3.5"),
    ("win desktop, 5090, torch 2.10 cu130 with the right triton-windows",
     lambda: windows((RTX5090,), "2.10.0+cu130", layout="desktop", installer="uv", triton="3.6.0.post26"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu130torch2.10.0andhigher.post6-cp310-abi3-win_amd64.whl", None),
    ("win portable, torch 2.10 cu126: no file, SageAttention 1 from PyPI", lambda: windows((RTX4090,), "2.10.0+cu126"),
     {"sageattention": "skip", "sageattention1": "wheel"}, None, "triton-windows>=3.6,<3.7"),
    ("win portable, py3.9 cannot take the cp310-abi3 post6 file: the cp39 one of the same minor",
     lambda: windows((RTX4090,), "2.9.1+cu128", python="3.9.13"),
     {"sageattention": "wheel"}, "sageattention-2.2.0+cu128torch2.9.0.post3-cp39-abi3-win_amd64.whl", "triton-windows>=3.5,<3.6"),
    ("win portable, py3.9 with torch 2.10: no file", lambda: windows((RTX4090,), "2.10.0+cu128", python="3.9.13"),
     {"sageattention": "skip", "sageattention1": "wheel"}, None, "triton-windows>=3.6,<3.7"),
    ("linux venv, H100, toolkit: pinned build", lambda: machine(),
     {"sageattention": "build", "spas_sage_attn": "build", "sageattn3": "skip"}, "pin", None),
    ("linux venv, B200, toolkit: SageAttention 2 and 3 from the pin", lambda: machine(gpus=(B200,)),
     {"sageattention": "build", "sageattn3": "build", "spas_sage_attn": "skip"}, "pin", None),
    ("linux venv, A100, CUDA 12.8 toolkit", lambda: machine(gpus=(A100,), torch="2.8.0+cu128", cuda="12.8", nvcc=(12, 8)),
     {"sageattention": "build", "spas_sage_attn": "build"}, "pin", None),
    ("linux venv, 3060, toolkit: built, two backends not offered", lambda: machine(gpus=(RTX3060,)),
     {"sageattention": "build", "sage, sage_triton": "note"}, "pin", None),
    ("linux venv, 4090, no toolkit: SageAttention 1 from PyPI", lambda: machine(gpus=(RTX4090,), nvcc=None),
     {"sageattention": "skip", "sageattention1": "wheel", "spas_sage_attn": "skip"}, None, None),
    ("linux conda torch without triton", lambda: machine(gpus=(RTX4090,), triton=None, layout="conda"),
     {"sageattention": "build"}, "pin", "triton>=3.6,<3.7"),
    ("linux, 5090, torch 2.12 cu130, toolkit", lambda: machine(gpus=(RTX5090,), torch="2.12.0+cu130"),
     {"sageattention": "build", "sageattn3": "build", "spas_sage_attn": "skip"}, "pin", None),
]


@pytest.mark.parametrize("name, make, expect, source, triton", MATRIX, ids=[m[0] for m in MATRIX])
def test_plan_matrix(name, make, expect, source, triton):
    m = make()
    steps = inst.plan(m)
    a = actions(steps)
    for k, v in expect.items():
        assert a.get(k) == v, (k, a, [(s.kernel, s.reason) for s in steps])
    sage = step(steps, "sageattention")
    if source == "pin":
        assert sage.pin is inst.PINS["sageattention"] and sage.source == inst.PINS["sageattention"].url
    elif source:
        assert sage.wheel and sage.wheel.filename == source and len(sage.wheel.sha256) == 64
    else:
        assert sage.wheel is None and sage.pin is None
    t = [s for s in steps if s.kernel == "triton"]
    assert (t[0].pip_args == [triton]) if triton else not t, [(s.kernel, s.pip_args) for s in t]
    if triton:
        assert steps.index(t[0]) < steps.index(next(s for s in steps if s.action in ("wheel", "build") and s.kernel != "triton"))
    # never a step that names torch
    for s in steps:
        assert not any(re.match(r"(torch|torchvision|torchaudio)\b", x) for x in s.pip_args), s
    text = inst.render_plan(m, steps)
    assert m.layout in text and "plan:" in text


def test_windows_never_builds_upstream_sources_but_a_given_tree_with_msvc():
    m = windows((RTX5090,), "2.10.0+cu126", layout="venv", nvcc=(12, 8))
    assert "no build on Windows" in step(inst.plan(m), "sageattention").reason
    m2 = windows((RTX5090,), "2.10.0+cu126", layout="venv", nvcc=(12, 8))
    assert "MSVC" in step(inst.plan(m2, sources={"sageattention": "C:/src/Sage"}), "sageattention").reason
    m2.msvc = True
    s = step(inst.plan(m2, sources={"sageattention": "C:/src/Sage"}), "sageattention")
    assert s.action == "build" and s.pin is None and s.source == "C:/src/Sage"
    m3 = windows((RTX5090,), "2.10.0+cu126", layout="portable", nvcc=(12, 8), msvc=True)
    assert "no headers" in step(inst.plan(m3, sources={"sageattention": "C:/src/Sage"}), "sageattention").reason


def test_a_given_source_beats_the_prebuilt_wheel():
    s = step(inst.plan(windows((RTX4090,), "2.8.0+cu128", layout="venv", nvcc=(12, 8), msvc=True),
                       sources={"sageattention": "C:/src/Sage"}), "sageattention")
    assert s.action == "build" and s.wheel is None


def test_unknown_torch_gets_no_triton_guess():
    m = windows((RTX5090,), "2.15.0+cu130")
    steps = inst.plan(m)
    sage = step(steps, "sageattention")
    assert sage.action == "skip" and "no known triton-windows pairing for torch 2.15.0" in sage.reason
    assert not [s for s in steps if s.kernel == "triton"]


def test_no_pip_and_no_uv_is_said_plainly():
    steps = inst.plan(windows((RTX4090,), "2.8.0+cu128", installer=None))
    assert [s.action for s in steps] == ["skip"] and "neither pip nor uv" in steps[0].reason


def test_known_bad_note_names_the_reason_and_reference():
    note = step(inst.plan(windows((RTX3060,), "2.9.1+cu128")), "sage, sage_triton")
    assert "ComfyUI #9773" in note.reason and "not reproduced here" in note.reason
    assert not [s for s in inst.plan(windows((RTX4090,), "2.9.1+cu128")) if s.action == "note"]


def test_every_prebuilt_wheel_parses_and_is_hash_pinned():
    for w in inst.PREBUILT_WHEELS:
        f = w.fields
        assert f["platform"] == "win_amd64" and f["abi3"] and len(w.sha256) == 64 and int(w.sha256, 16) >= 0
        assert w.url.startswith("https://github.com/woct0rdho/SageAttention/releases/download/v2.2.0-windows.post")
        assert "%2B" in w.url  # the + of the local version, quoted
    for p in inst.PINS.values():
        assert re.fullmatch(r"[0-9a-f]{40}", p.commit) and re.fullmatch(r"[0-9a-f]{64}", p.tree_sha256) and p.verified[:4] == "2026"


@pytest.mark.parametrize(
    "exe, prefix, base, env, make, expect",
    [
        ("C:\\ComfyUI_windows_portable\\python_embeded\\python.exe", "C:\\ComfyUI_windows_portable\\python_embeded",
         "C:\\ComfyUI_windows_portable\\python_embeded", {}, None, "portable"),
        ("/opt/conda/envs/c/bin/python", "/opt/conda/envs/c", "/opt/conda", {"CONDA_PREFIX": "/opt/conda/envs/c"}, None, "conda"),
        ("/usr/bin/python3", "/usr", "/usr", {}, None, "system"),
        (None, "desktop", "/base", {}, "desktop", "desktop"),
        (None, "venv-in-comfyui", "/base", {}, "comfy-venv", "venv"),
    ],
)
def test_detect_layout(tmp_path, exe, prefix, base, env, make, expect):
    if make == "desktop":  # Documents/ComfyUI/.venv (uv) beside custom_nodes/, ComfyUI's code inside the app
        root = tmp_path / "ComfyUI"
        (root / "custom_nodes").mkdir(parents=True)
        (root / ".venv").mkdir()
        (root / ".venv" / "pyvenv.cfg").write_text("home = C:\\\\uv\\\\python\nuv = 0.8.22\nversion_info = 3.12.11\n")
        prefix, exe = str(root / ".venv"), str(root / ".venv" / "Scripts" / "python.exe")
    elif make == "comfy-venv":  # a git clone of ComfyUI with its own .venv: main.py is there
        root = tmp_path / "ComfyUI"
        (root / "custom_nodes").mkdir(parents=True)
        (root / "main.py").write_text("")
        (root / ".venv").mkdir()
        (root / ".venv" / "pyvenv.cfg").write_text("uv = 0.8.22\n")
        prefix, exe = str(root / ".venv"), str(root / ".venv" / "bin" / "python")
    assert inst.detect_layout(exe, prefix, base, env) == expect


def test_uv_is_used_where_there_is_no_pip(tmp_path, monkeypatch):
    assert inst.detect_installer(True, "/usr/bin/uv") == "pip"
    assert inst.detect_installer(False, "/usr/bin/uv") == "uv"
    assert inst.detect_installer(False, None) is None
    m = windows((RTX4090,), "2.8.0+cu128", layout="desktop", installer="uv")
    installer = inst.Installer(m, tmp_path, quiet=True)
    seen = []
    monkeypatch.setattr(installer, "_stream", lambda cmd, log, env=None, position=0: seen.append(cmd) or 0)
    monkeypatch.setattr(inst.shutil, "which", lambda name: "/usr/bin/uv" if name == "uv" else None)
    installer.pip(["x"], tmp_path / "l")
    assert seen[0][:5] == ["/usr/bin/uv", "pip", "install", "--python", sys.executable] and "--constraint" in seen[0]


# ------------------------------------------------------------------ downloads, hashes, pinned sources

def _sha(p):
    import hashlib

    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_download_from_a_mirror_checks_the_hash(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "pkg-1.0+cu128-cp39-abi3-win_amd64.whl").write_bytes(b"wheel bytes")
    good = _sha(mirror / "pkg-1.0+cu128-cp39-abi3-win_amd64.whl")
    url = "https://example.invalid/rel/pkg-1.0%2Bcu128-cp39-abi3-win_amd64.whl"
    out = inst.download(url, tmp_path / "d" / "a.whl", sha256=good, mirror=str(mirror))
    assert out.read_bytes() == b"wheel bytes"
    with pytest.raises(inst.DownloadError, match="sha256 mismatch for pkg-1.0\\+cu128"):
        inst.download(url, tmp_path / "d" / "b.whl", sha256="0" * 64, mirror=str(mirror))
    assert not (tmp_path / "d" / "b.whl").exists() and not list((tmp_path / "d").glob("*.part"))
    with pytest.raises(inst.DownloadError, match="not in the mirror folder"):
        inst.download("https://example.invalid/other.whl", tmp_path / "d" / "c.whl", mirror=str(mirror))


def test_download_without_network_says_so(tmp_path):
    with pytest.raises(inst.DownloadError, match="cannot download") as e:
        inst.download("http://127.0.0.1:9/none.tar.gz", tmp_path / "x")
    assert "no network" in inst.likely_cause(str(e.value))


def _pinned_tree(tmp_path):
    import tarfile

    src = tmp_path / "up" / "Sage-abc"
    (src / "csrc").mkdir(parents=True)
    (src / "assets").mkdir()
    (src / "setup.py").write_text("print('build')\n")
    (src / "csrc" / "k.cu").write_text("// kernel\n")
    (src / "assets" / "big.png").write_bytes(b"\x89PNG" * 1000)
    commit = "a" * 40
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    with tarfile.open(mirror / f"{commit}.tar.gz", "w:gz") as t:
        t.add(src, arcname=src.name)
    pin = inst.Pin(repo="up/Sage", commit=commit, tree_sha256=inst.tree_digest(src, ("assets/",)), skip=("assets/",),
                   verified="2026-11-23: test")
    return src, mirror, pin


def test_pinned_source_is_checked_by_its_tree_hash(tmp_path, monkeypatch):
    src, mirror, pin = _pinned_tree(tmp_path)
    monkeypatch.setenv("PATCH_ATTENTION_MIRROR", str(mirror))
    log = tmp_path / "log"
    root = inst.fetch_pinned(pin, tmp_path / "w" / "src", log)
    assert root is not None and (root / "setup.py").exists() and "matches the pin" in log.read_text()
    # the same commit without assets/ (a trimmed archive) checks too
    import shutil as sh

    sh.rmtree(src / "assets")
    assert inst.tree_digest(src, pin.skip) == pin.tree_sha256
    # a changed file is refused, with both hashes in the log
    bad = inst.Pin(**{**pin.__dict__, "tree_sha256": "f" * 64})
    log2 = tmp_path / "log2"
    assert inst.fetch_pinned(bad, tmp_path / "w2" / "src", log2) is None
    assert "source tree sha256 mismatch" in log2.read_text() and "f" * 64 in log2.read_text()


def test_the_shipped_pins_match_archives_made_by_the_pin_tool(tmp_path):
    """tests/tools/pin_source.py makes what install.py checks: the digest function is the same one."""
    src = tmp_path / "t"
    (src / "a").mkdir(parents=True)
    (src / "a-b").mkdir()
    (src / "a" / "x").write_text("1")
    (src / "a-b" / "y").write_text("2")
    # string order of paths ("a-b/y" < "a/x"), the same on every OS
    import hashlib

    h = hashlib.sha256()
    for rel in ("a-b/y", "a/x"):
        h.update(rel.encode() + b"\0" + _sha(src / rel).encode() + b"\n")
    assert inst.tree_digest(src) == h.hexdigest()


def test_build_of_a_pin_goes_through_the_checked_fetch(tmp_path, monkeypatch):
    src, mirror, pin = _pinned_tree(tmp_path)
    monkeypatch.setenv("PATCH_ATTENTION_MIRROR", str(mirror))
    installer = inst.Installer(machine(), tmp_path / "logs", quiet=True)
    seen = []
    monkeypatch.setattr(installer, "pip", lambda args, log, env=None, position=0: seen.append(args) or 0)
    s = inst.Step("sageattention", "build", "x", pin=pin, source=pin.url, env={})
    log = tmp_path / "b.log"
    log.write_text("")
    assert installer.build(s, log) == 0 and seen[0][-1].endswith("Sage-abc")
    bad = inst.Step("sageattention", "build", "x", pin=inst.Pin(**{**pin.__dict__, "tree_sha256": "0" * 64}), env={})
    assert installer.build(bad, log) == 1 and not seen[1:]


def test_prebuilt_wheel_is_downloaded_checked_and_installed_without_deps(tmp_path, monkeypatch):
    w0 = inst.PREBUILT_WHEELS[-1]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / w0.filename).write_bytes(b"not the real wheel")
    w = inst.PrebuiltWheel(w0.kernel, w0.index, w0.tag, w0.filename, _sha(mirror / w0.filename))
    monkeypatch.setenv("PATCH_ATTENTION_MIRROR", str(mirror))
    installer = inst.Installer(windows((RTX5090,), "2.10.0+cu130"), tmp_path / "logs", quiet=True)
    seen = []
    monkeypatch.setattr(installer, "pip", lambda args, log, env=None, position=0: seen.append(args) or 0)
    log = tmp_path / "w.log"
    log.write_text("")
    assert installer.install_prebuilt(w, log) == 0 and seen == [["--no-deps", str(tmp_path / "logs" / "downloads" / w.filename)]]
    # the shipped hash does not match these bytes: refused before pip runs
    assert installer.install_prebuilt(w0, log) == 1 and len(seen) == 1 and "sha256 mismatch" in log.read_text()


def test_verify_code_compiles_and_judges_by_accuracy_class():
    code = inst.VERIFY_CODE.format(root=str(ROOT))
    compile(code, "verify", "exec")
    assert "accuracy_class" in code  # a topk backend is not called WRONG for keeping no bound on random inputs


def test_an_incomplete_sage2_that_cannot_be_rebuilt_says_what_it_lacks():
    m = machine(nvcc=None, installed={"sageattention": "2.2.0"},
                sage_modules={"_qattn_sm80": True, "_qattn_sm89": True, "_qattn_sm90": False})
    sage = step(inst.plan(m), "sageattention")
    assert sage.action == "skip" and sage.reason.startswith("sageattention 2.2.0 lacks _qattn_sm90; cannot rebuild: no CUDA")


# ------------------------------------------------------------------ FlashAttention-4: one pinned, hash-checked set

H100, B300, THOR = ("NVIDIA H100 80GB HBM3", (9, 0)), ("B300", (10, 3)), ("Thor", (11, 0))


@pytest.mark.parametrize("gpus, torch, cuda, libs", [
    ((H100,), "2.11.0+cu130", "13.0", "nvidia-cutlass-dsl-libs-cu13"),
    ((B200,), "2.10.0+cu128", "12.8", "nvidia-cutlass-dsl-libs-cu12"),
    ((B300, H100), "2.12.0+cu130", "13.0", "nvidia-cutlass-dsl-libs-cu13"),
    ((THOR,), "2.11.0+cu130", "13.0", "nvidia-cutlass-dsl-libs-cu13"),
])
def test_fa4_is_installed_by_default_on_linux_hopper_and_blackwell(gpus, torch, cuda, libs):
    m = machine(gpus=gpus, torch=torch, cuda=cuda, nvcc=None, installed={"einops": "0.8.2", "cuda-bindings": cuda + ".3"})
    s = step(inst.plan(m), "flash_attn4")
    assert s.action == "wheel" and f"CUDA {cuda[:2]} libraries" in s.reason
    names = [d.split("==")[0] for d in s.dists]
    assert names == [d.name for d in inst.FA4_SET] + [libs]  # exactly the set, the one libs flavor, nothing else
    assert not any(re.match(r"(torch|torchvision|torchaudio)(==| |$)", x) for x in s.dists + s.hashed + s.pip_args)
    for line, dist in zip(s.hashed, s.dists):  # every line pins a version and lists only hashes of that version's files
        assert line.startswith(dist + " --hash=sha256:")
        pinned = inst.PINNED_DISTS[tuple(dist.split("=="))]
        assert line.split()[1:] == [f"--hash=sha256:{h}" for _, h in pinned.files]


def test_fa4_adds_einops_and_the_cuda_bindings_of_torchs_cuda_major_where_missing():
    s = step(inst.plan(machine(torch="2.9.1+cu128", cuda="12.8", nvcc=None, installed={})), "flash_attn4")
    assert s.dists[-3:] == ["einops==0.8.2", "cuda-bindings==12.9.4", "cuda-pathfinder==1.4.2"]
    s = step(inst.plan(machine(installed={"einops": "0.7.0", "cuda-pathfinder": "1.3.0"})), "flash_attn4")
    assert s.dists[-1] == "cuda-bindings==13.0.3"  # the pathfinder that is there is kept
    s = step(inst.plan(machine(torch="2.10.0+cu128", cuda="12.8", installed={"einops": "0.8.2", "cuda-bindings": "13.0.3"})),
             "flash_attn4")
    assert "nvidia-cutlass-dsl-libs-cu12==4.8.1" in s.dists and "cuda-bindings" not in " ".join(s.dists)
    assert "needs a CUDA 13 driver" in s.reason  # what the CuTe DSL will check at start


@pytest.mark.parametrize("make, text", [
    (lambda: windows((RTX4090,), "2.10.0+cu130"), "runs on Linux only (it imports fcntl, which Windows lacks)"),
    (lambda: windows((("H100", (9, 0)),), "2.10.0+cu130", layout="venv"), "runs on Linux only"),
    (lambda: machine(gpus=(RTX4090,)), "needs compute capability sm 9.0, 10.0, 10.1, 10.3, 11.0"),
    (lambda: machine(gpus=(RTX5090,)), "GPUs here: RTX 5090 (sm 12.0"),
    (lambda: machine(gpus=(A100,)), "its Hopper and Blackwell kernels"),
    (lambda: machine(python="3.9.18"), "for CPython 3.10-3.14, this is 3.9.18"),
    (lambda: machine(python="3.15.0"), "for CPython 3.10-3.14, this is 3.15.0"),
    (lambda: machine(python="3.14.0", gil_disabled=True), "free-threaded"),
    (lambda: machine(machine="ppc64le"), "x86_64 and aarch64, this is ppc64le"),
    (lambda: machine(torch="2.7.1+cu118", cuda="11.8"), "exist for CUDA 12 and 13, this torch has CUDA 11.8"),
    (lambda: machine(torch="2.3.1+cu121", cuda="12.1"), "torch-c-dlpack-ext, which FlashAttention-4 uses, supports torch >= 2.4"),
])
def test_fa4_is_not_installed_where_it_cannot_run_and_the_plan_says_why(make, text):
    m = make()
    s = step(inst.plan(m), "flash_attn4")
    assert s.action == "skip" and text in s.reason, s.reason
    assert f"flash_attn4      skip   {s.reason}" in inst.render_plan(m, inst.plan(m))


def test_fa4_skip_opts_out_and_only_installs_it_alone():
    assert "flash_attn4" not in actions(inst.plan(machine(), skip=["flash_attn4"]))
    assert actions(inst.plan(machine(), only=["flash_attn4"])) == {"flash_attn4": "wheel"}


def test_fa4_already_there_is_kept_an_incomplete_set_is_completed_and_force_reinstalls():
    full = fa4_installed()
    assert step(inst.plan(machine(installed=full)), "flash_attn4").action == "ok"
    partial = {k: v for k, v in full.items() if k not in ("nvidia-cutlass-dsl-libs-cu13", "quack-kernels")}
    s = step(inst.plan(machine(installed=partial)), "flash_attn4")
    assert s.action == "wheel" and s.dists == ["quack-kernels==0.6.5", "nvidia-cutlass-dsl-libs-cu13==4.8.1"]
    assert "is installed without quack-kernels, nvidia-cutlass-dsl-libs-cu13" in s.reason
    s = step(inst.plan(machine(installed=full), force=True), "flash_attn4")
    assert s.action == "wheel" and len(s.dists) == len(inst.FA4_SET) + 1 and "replaces" not in s.reason
    # another version of a member that is there (a CuTe DSL another tool installed) is replaced, and the plan says so
    s = step(inst.plan(machine(installed={"nvidia-cutlass-dsl": "4.3.0", "einops": "0.8.2", "cuda-bindings": "13.0.3"})),
             "flash_attn4")
    assert s.reason.endswith("; replaces nvidia-cutlass-dsl 4.3.0 -> 4.8.1")


def test_every_pinned_file_is_of_its_dist_and_version_and_every_accepted_platform_has_one():
    from packaging.utils import parse_wheel_filename

    for d in inst.PINNED_DISTS.values():
        assert d.files
        for fn, sha in d.files:
            name, ver, _, tags = parse_wheel_filename(fn)
            assert name == d.name and str(ver) == str(parse_wheel_filename(f"x-{d.version}-py3-none-any.whl")[1]), fn
            assert re.fullmatch(r"[0-9a-f]{64}", sha)
    lo, hi = inst.FA4_PYTHONS
    for minor in range(lo[1], hi[1] + 1):
        for arch in ("x86_64", "aarch64"):
            for cuda in (12, 13):
                for d in (*inst.FA4_SET, inst.FA4_LIBS[cuda], *inst.FA4_IF_MISSING, inst.CUDA_BINDINGS[cuda],
                          inst.CUDA_PATHFINDER):
                    ok = [fn for fn, _ in d.files if fn.endswith("-py3-none-any.whl")
                          or (f"-cp3{minor}-cp3{minor}-" in fn and fn.endswith(f"_{arch}.whl"))]
                    assert ok, f"{d.name} {d.version} has no file for CPython 3.{minor} on {arch}"
    assert "cu13" in inst.FA4_VERIFIED or "CUDA 13" in inst.FA4_VERIFIED


def _fake_wheel(folder, dist, version, files):
    import zipfile

    norm = dist.replace("-", "_")
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\nRequires-Dist: torch\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_a_hashed_step_runs_pip_offline_without_deps_and_refuses_a_file_whose_hash_is_not_pinned(tmp_path, monkeypatch):
    """pip for real, offline (--find-links DIR --no-index, as on the GPU machine), into a --target folder: the pinned
    files install although their metadata requires torch (--no-deps); a file whose sha256 is not pinned is refused."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    a = _fake_wheel(wheels, "pa-fake-kernel", "1.0", {"pa_fake_kernel/__init__.py": "X = 1\n"})
    b = _fake_wheel(wheels, "pa-fake-dsl", "2.0", {"pa_fake_dsl/__init__.py": "", "pa_fake_dsl.pth": "import sys\n"})
    dists = [inst.PinnedDist("pa-fake-kernel", "1.0", ((a.name, _sha(a)),)),
             inst.PinnedDist("pa-fake-dsl", "2.0", ((b.name, _sha(b)), ("other-file.whl", "0" * 64)))]
    target = tmp_path / "site"
    installer = inst.Installer(machine(), tmp_path / "logs", pip_extra=[f"--find-links={wheels}", "--no-index"], quiet=True)
    monkeypatch.setattr(installer, "installer_cmd", lambda verb: [sys.executable, "-m", "pip", verb, "--target", str(target),
                                                                  "--disable-pip-version-check"])
    s = inst.Step("flash_attn4", "wheel", "x", hashed=[d.requirement() for d in dists],
                  dists=[f"{d.name}=={d.version}" for d in dists])
    log = tmp_path / "fa4.log"
    log.write_text("")
    assert installer.install_hashed(s, log) == 0, log.read_text()[-2000:]
    assert (target / "pa_fake_kernel" / "__init__.py").exists() and (target / "pa_fake_dsl.pth").exists()
    assert "torch" not in {p.name.split("-")[0] for p in target.iterdir()}  # nothing resolved, torch not reached
    cmd = log.read_text().splitlines()[0]
    assert "--no-deps" in cmd and "--require-hashes" in cmd and "--only-binary=:all:" in cmd and "--constraint" in cmd
    # a file that is not the pinned one (same name and version, other bytes) is refused before anything is installed
    _fake_wheel(wheels, "pa-fake-kernel", "1.0", {"pa_fake_kernel/__init__.py": "X = 2\n"})
    log2 = tmp_path / "fa4-2.log"
    log2.write_text("")
    target2 = tmp_path / "site2"
    monkeypatch.setattr(installer, "installer_cmd", lambda verb: [sys.executable, "-m", "pip", verb, "--target", str(target2),
                                                                  "--disable-pip-version-check"])
    assert installer.install_hashed(s, log2) != 0
    assert "pinned hash" in inst.likely_cause(log2.read_text()) and not (target2 / "pa_fake_kernel").exists()


def test_a_hashed_step_that_cannot_run_is_removed_with_everything_it_installed(tmp_path, monkeypatch):
    installer = inst.Installer(machine(), tmp_path, quiet=True)
    calls = []
    monkeypatch.setattr(inst.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    s = inst.Step("flash_attn4", "wheel", "x", status="installed", dists=["flash-attn-4==4.0.0b36", "quack-kernels==0.6.5"])
    installer.roll_back_unusable([s], [{"backend": "flash_attn4", "status": "unusable", "detail": "DSLRuntimeError: x"}])
    assert s.status == "removed" and calls == [[sys.executable, "-m", "pip", "uninstall", "-y", "flash-attn-4", "quack-kernels"]]


@pytest.mark.parametrize("argv, rc, text", [
    (["--only", "sageattention", "--yes"], 1, "cannot install what was asked for: sageattention"),
    (["--with", "xformers", "--yes"], 1, "cannot install what was asked for: xformers"),
    (["--yes"], 0, None),
    (["--only", "sageattention", "--dry-run"], 0, None),
])
def test_a_kernel_named_that_cannot_be_installed_exits_non_zero(argv, rc, text, monkeypatch, capsys):
    """On a machine without a GPU nothing can be installed: a default run says so and exits 0, a kernel named with
    --only/--with exits 1 (README: an explicit request that cannot be met is an error)."""
    monkeypatch.setattr(inst, "detect", lambda: machine(gpus=()))
    monkeypatch.setattr(inst, "Installer", None)  # nothing may be installed
    assert inst.main(argv) == rc
    out = capsys.readouterr().out
    assert "no NVIDIA GPU found" in out
    assert (text in out) if text else "cannot install" not in out


def test_named_kernels_that_are_skipped_on_a_gpu_machine_exit_non_zero_after_the_rest_installed(monkeypatch, capsys):
    monkeypatch.setattr(inst, "detect", lambda: machine(gpus=(RTX4090,)))
    ran = []

    class FakeInstaller:
        def __init__(self, *a, **kw):
            pass

        def run_all(self, todo):
            for s in todo:
                ran.append(s.kernel)
                s.status = "installed"

        def roll_back_unusable(self, todo, rows):
            pass

    monkeypatch.setattr(inst, "Installer", FakeInstaller)
    monkeypatch.setattr(inst, "verify", lambda: [])
    assert inst.main(["--only", "flash_attn4,xformers", "--yes"]) == 1  # FA4 cannot run on sm 8.9
    assert ran == ["xformers"] and "cannot install what was asked for: flash_attn4" in capsys.readouterr().out
    assert inst.main(["--only", "xformers", "--yes"]) == 0
    # a source tree for SageAttention asks for SageAttention 2; its SageAttention3 half is skipped on sm 8.9, no error
    monkeypatch.setattr(inst, "detect", lambda: machine(gpus=(RTX4090,), installed=fa4_installed()))
    ran.clear()
    assert inst.main(["--sage-source", "/src/Sage", "--yes"]) == 0 and "sageattention" in ran
    capsys.readouterr()
    assert inst.main(["--sparge-source", "/src/Sparge", "--yes"]) == 0
    monkeypatch.setattr(inst, "detect", lambda: machine(gpus=(B200,), installed=fa4_installed()))
    assert inst.main(["--sparge-source", "/src/Sparge", "--yes"]) == 1  # SpargeAttn stops at sm 9.0
    assert "cannot install what was asked for: spas_sage_attn" in capsys.readouterr().out


# ------------------------------------------------------------------ README's install blocks

def _install_blocks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"```(bash|bat)\n(.*?)```", section, re.S))


def test_readme_linux_install_block_runs_as_pasted(tmp_path):
    """Pasted into a shell in ComfyUI's folder: the clone lands in custom_nodes, install.py runs from it with --yes
    under the environment's python, and ComfyUI starts (git and the pack's files stubbed; nothing is downloaded)."""
    block = _install_blocks()["bash"]
    comfy = tmp_path / "ComfyUI"
    (comfy / "custom_nodes").mkdir(parents=True)
    (comfy / "main.py").write_text("import os\nopen(os.environ['PA_LOG'], 'a').write('main.py ' + os.getcwd() + '\\n')\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake_install = ("import os, sys\nopen(os.environ['PA_LOG'], 'a').write('install.py ' + os.path.abspath(__file__) + ' '"
                    " + ' '.join(sys.argv[1:]) + '\\n')\n")
    (bin_ / "git").write_text("#!/bin/sh\n# git clone URL [DIR]\nd=${3:-$(basename \"$2\")}\nmkdir -p \"$d\"\n"
                              f"cat > \"$d/install.py\" <<'PY'\n{fake_install}PY\n")
    (bin_ / "git").chmod(0o755)
    (bin_ / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bin_ / "python").chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", PA_LOG=str(log))
    r = subprocess.run(["bash", "-e", "-c", block], cwd=comfy, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert lines == [f"install.py {comfy}/custom_nodes/ComfyUI-PatchAttention/install.py --yes", f"main.py {comfy}"]


def test_readme_windows_portable_install_block_uses_the_embedded_python_on_the_cloned_pack():
    block = _install_blocks()["bat"].strip().splitlines()
    clone, install, start = block
    target = clone.split()[-1]
    assert clone.startswith("git clone https://github.com/patch-attention/ComfyUI-PatchAttention ")
    assert target == r"ComfyUI\custom_nodes\ComfyUI-PatchAttention"  # relative to ComfyUI_windows_portable
    # .\ makes it run in PowerShell as in Command Prompt; the embedded Python is the one that runs ComfyUI there
    assert install == rf".\python_embeded\python.exe {target}\install.py --yes"
    assert start == r".\run_nvidia_gpu.bat"
    assert "/" not in install and "&&" not in " ".join(block)  # no bash syntax
