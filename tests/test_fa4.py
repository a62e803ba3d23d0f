"""FlashAttention-4 without a GPU: what the registry declares per architecture, what its probe says when it cannot
import, and that ``auto`` pays a JIT kernel's first-call compile outside its timings and its tuning budget."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import cos_rel, sdpa_ref

from attention import REGISTRY, AttentionConfig, AutoSelector, Backend, CallSpec, attention
from attention.backends import flash
from attention.capabilities import KERNELS
from attention.constraints import plan
from attention.registry import Availability

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec(cc=(9, 0), d=128, dv=None, dtype=torch.bfloat16, mask=None, heads=24, kv_heads=None):
    return CallSpec("cuda", cc, dtype, 1, heads, kv_heads or heads, 4096, 4096, d, dv or d, mask)


def fa4(s):
    return plan(REGISTRY.get("flash_attn4").constraints, s)


# ------------------------------------------------------------------ declarations, from FA4 4.0.0b36's interface checks

@pytest.mark.parametrize("d", range(8, 257, 8))
def test_hopper_takes_every_head_dim_from_8_to_256_in_steps_of_8_as_it_is(d):
    adapted, why = fa4(spec(d=d))
    assert why is None and adapted.head_dim == d


@pytest.mark.parametrize("d, padded", [(4, 8), (36, 40), (100, 104), (250, 256)])
def test_hopper_pads_other_head_dims_to_the_next_multiple_of_8(d, padded):
    adapted, why = fa4(spec(d=d))
    assert why is None and adapted.head_dim == padded


@pytest.mark.parametrize("cc", [(10, 0), (10, 3), (11, 0)])
@pytest.mark.parametrize("d, expect", [(8, 8), (40, 40), (64, 64), (72, 72), (128, 128), (256, 256), (160, 256),
                                       (136, 256), (192, 256)])
def test_blackwell_takes_8_to_128_and_256_and_pads_between(cc, d, expect):
    """sm 10.x/11.x: standard range 8..128, or the hd256 kernel; 160 has no kernel there and is padded to 256."""
    adapted, why = fa4(spec(cc=cc, d=d))
    assert why is None and adapted.head_dim == expect


@pytest.mark.parametrize("cc, d, dv, ok", [
    ((9, 0), 64, 128, True),  # sm90: q/k and v head dims each 8..256
    ((9, 0), 256, 128, True),
    ((10, 0), 64, 128, True),  # sm100: both in the standard range
    ((10, 0), 192, 128, True),  # its DeepSeek shape
    ((10, 0), 256, 128, False),  # hd256 only with a 256 value dim
    ((10, 0), 128, 192, False),
    ((9, 0), 264, 264, False),
    ((9, 0), 64, 36, False),  # value head dims are not padded
])
def test_query_and_value_head_dims_per_arch(cc, d, dv, ok):
    _, why = fa4(spec(cc=cc, d=d, dv=dv))
    assert (why is None) == ok, why
    if not ok:
        assert f"on sm {cc[0]}.x:" in why and "unsupported" in why


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (12, 0), (12, 1), (7, 5)])
def test_not_offered_on_archs_its_hopper_and_blackwell_kernels_do_not_serve(cc):
    _, why = fa4(spec(cc=cc, dtype=torch.float16))
    assert why and "needs compute capability 9.0 or 10.0 or 10.1 or 10.3 or 11.0" in why
    assert not KERNELS["flash_attn4"].runs_on(cc)  # install.py reads the same table


def test_dtypes_gqa_masks_and_devices():
    assert fa4(spec(dtype=torch.float16))[1] is None
    adapted, why = fa4(spec(dtype=torch.float32))
    assert why is None and adapted.dtype == torch.bfloat16  # computed in bf16, cast back
    assert fa4(spec(heads=24, kv_heads=8))[1] is None  # grouped-query heads: packed in the kernel
    for kind in ("bool", "float"):
        assert "no attention-mask support" in fa4(spec(mask=kind))[1]
    cpu = CallSpec("cpu", None, torch.float32, 1, 4, 4, 64, 64, 64, 64, None)
    assert "runs on cuda, not cpu" in fa4(cpu)[1]


def test_the_description_says_what_it_takes_per_arch():
    text = REGISTRY.get("flash_attn4").describe()
    assert "on sm 9.x: head dim <= 256 and head dim % 8 == 0 (padded)" in text
    assert "on sm 10.x/11.x: head dim <= 128 and head dim % 8 == 0, or (q/k, v) in {(192, 128), (256, 256)}" in text
    assert "masks: none" in text


# ------------------------------------------------------------------ the probe: why it cannot import, in user words

FAKE_FA4 = {
    # flash-attn-4 as pip lays it out: flash_attn/cute (no flash_attn/__init__.py), and nvidia-cutlass-dsl's cutlass
    # package under nvidia_cutlass_dsl/dsl_packages, reached only through the .pth file of nvidia-cutlass-dsl
    "flash_attn/cute/__init__.py": "import cutlass\nfrom cutlass import flash_attn_func\n",
    "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "def flash_attn_func(*a, **k):\n    return 'ran'\n",
    "nvidia_cutlass_dsl_packages.pth": "import sys, os, nvidia_cutlass_dsl; "
                                       "sys.path.insert(0, os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n",
    "flash_attn_4-4.0.0b36.dist-info/METADATA": "Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n",
}

PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from attention.backends import flash
    av = flash._fa4_probe()
    print(json.dumps({{"ok": av.ok, "reason": av.reason, "version": av.version, "path_has_dsl":
                      any(p.endswith("dsl_packages") for p in sys.path)}}))
""")


def _probe_in(site, *extra_path, site_dir=False):
    """The probe in a fresh Python that has ``site`` on its path: as a site directory (its .pth files processed, as
    pip's site-packages) or as a plain PYTHONPATH entry (as ``pip install --target``)."""
    import json

    code = PROBE.format(root=ROOT)
    if site_dir:
        code = f"import site; site.addsitedir({str(site)!r})\n" + code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([] if site_dir else [str(site)]), *map(str, extra_path)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_fa4(tmp_path):
    site = tmp_path / "site"
    for rel, text in FAKE_FA4.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return site


def test_a_target_install_without_the_pth_names_the_folder_to_add_and_the_pack_never_adds_it(fake_fa4):
    got = _probe_in(fake_fa4)
    folder = str(fake_fa4 / "nvidia_cutlass_dsl" / "dsl_packages")
    assert not got["ok"] and f"the CuTe DSL folder {folder} is not on the import path" in got["reason"]
    assert "add that folder to PYTHONPATH or to a .pth file" in got["reason"]
    assert not got["path_has_dsl"]  # the probe left sys.path as it was
    # the user adds the folder: it imports, with the distribution's version
    got = _probe_in(fake_fa4, folder)
    assert got == {"ok": True, "reason": "", "version": "4.0.0b36", "path_has_dsl": True}


def test_a_site_packages_install_imports_through_its_pth(fake_fa4):
    got = _probe_in(fake_fa4, site_dir=True)
    assert got["ok"] and got["version"] == "4.0.0b36"


def test_not_installed_and_incomplete_installs_say_what_to_do(fake_fa4, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    got = _probe_in(empty)
    assert not got["ok"] and got["reason"].startswith("flash-attn-4 is not installed (install.py installs it")
    import shutil

    # the DSL's Python package without its compiled libraries (nvidia-cutlass-dsl-libs-base and -cu12/-cu13)
    (fake_fa4 / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py").write_text(
        "from ._mlir._mlir_libs import _cutlass_ir\n")
    got = _probe_in(fake_fa4, fake_fa4 / "nvidia_cutlass_dsl" / "dsl_packages")
    assert not got["ok"] and got["reason"].startswith("the CuTe DSL is incomplete (no module cutlass._mlir)")
    shutil.rmtree(fake_fa4 / "nvidia_cutlass_dsl")
    got = _probe_in(fake_fa4)
    assert not got["ok"] and "installed without nvidia-cutlass-dsl" in got["reason"] and "install.py" in got["reason"]


def test_windows_gets_the_reason_before_any_import(monkeypatch):
    monkeypatch.setattr(flash.sys, "platform", "win32")
    av = flash._fa4_probe()
    assert not av.ok and av.reason == "FlashAttention-4 runs on Linux only (it imports fcntl, which Windows lacks)"


def test_backends_info_says_why_not_and_whether_this_gpu_could_run_it(monkeypatch):
    from attention import report, report_rows

    b = REGISTRY.get("flash_attn4")
    monkeypatch.setattr(b, "_avail", Availability(False, "flash-attn-4 is not installed (install.py installs it ...)"))
    ada = report.row(b, spec(cc=(8, 9), dtype=torch.float16))
    assert not ada["installed"] and not ada["usable"]
    assert ada["why_not"] == ("flash-attn-4 is not installed (install.py installs it ...); this GPU could not run it "
                              "anyway: needs compute capability 9.0 or 10.0 or 10.1 or 10.3 or 11.0, this GPU is 8.9")
    hopper = report.row(b, spec(cc=(9, 0), dtype=torch.float16))
    assert hopper["why_not"] == "flash-attn-4 is not installed (install.py installs it ...)"
    monkeypatch.setattr(b, "_avail", Availability(True, version="4.0.0b36"))
    assert report.row(b, spec(cc=(9, 0), dtype=torch.float16))["usable"]
    assert "masks: none" in report.row(b, spec(cc=(9, 0), dtype=torch.float16))["supports"]
    monkeypatch.setattr(b, "_avail", None)
    [r] = [r for r in report_rows() if r["backend"] == "flash_attn4"]  # this machine: its real probe
    assert r["installed"] == b.availability().ok and (r["installed"] or r["why_not"].startswith(b.availability().reason))


# ------------------------------------------------------------------ auto pays a JIT compile once, untimed, unbudgeted

def _compiling_backend(name, compile_s, seen):
    """A stand-in for a JIT kernel: its first call for each shape sleeps ``compile_s`` (the compile), later calls are
    SDPA. ``seen`` records (shape, was_first) per call."""
    compiled = set()

    def fn(q, k, v, *, layout, mask, scale, opts):
        key = tuple(q.shape)
        first = key not in compiled
        seen.append((key, first))
        if first:
            time.sleep(compile_s)
            compiled.add(key)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o

    return Backend(name=name, family="test", fn=fn, constraints=(), probe=lambda: Availability(True, version="t"))


def test_auto_never_times_a_compile_nor_spends_its_budget_on_it(temp_backend):
    seen_slow, seen_other = [], []
    temp_backend(_compiling_backend("t_jit", 2.0, seen_slow))
    temp_backend(_compiling_backend("t_jit_other", 0.0, seen_other))
    exclude = {n for n in REGISTRY.names() if n not in ("sdpa", "t_jit", "t_jit_other")}
    # a budget far below one compile (and far above the timings, on a loaded 2-core machine too): the candidate after
    # the compiling one must still be measured
    sel = AutoSelector(exclude=exclude, warmup=1, reps=2, max_tune_s=1.0)
    cfg = AttentionConfig(backend="auto", auto=sel)
    q = torch.randn(1, 128, 2 * 32)
    out = attention(q, q, q, 2, config=cfg)
    [report] = sel.reports.values()
    by = {c.name: c for c in report}
    assert by["t_jit"].passed and by["t_jit"].ms is not None and by["t_jit"].ms < 100, by["t_jit"]
    assert by["t_jit_other"].ms is not None and not by["t_jit_other"].error, by["t_jit_other"]  # not skipped
    # the compile happened once, on the first (accuracy) call; every timed call found it compiled
    assert [first for _, first in seen_slow].count(True) == 1 and seen_slow[0][1]
    assert len(seen_slow) >= 1 + 1 + 3 * 2  # accuracy call, warm-up, rounds x reps
    assert cos_rel(out, sdpa_ref(q, q, q, 2))[0] >= 0.9999
    # a second shape (another signature) compiles again: again untimed
    q2 = torch.randn(1, 256, 2 * 32)
    attention(q2, q2, q2, 2, config=cfg)
    second = [c for sig, rep in sel.reports.items() for c in rep if "Nq256" in sig and c.name == "t_jit"]
    assert second and second[0].ms < 100 and [f for _, f in seen_slow].count(True) == 2


def test_the_budget_still_bounds_slow_timings(temp_backend):
    """What the budget leaves out is the first call only: slow timed calls still use it up."""
    temp_backend(_compiling_backend("t_jit", 0.0, []))

    def slow(name, fn, device):
        fn()
        time.sleep(0.4)
        return 1.0

    exclude = {n for n in REGISTRY.names() if n not in ("sdpa", "t_jit")}
    sel = AutoSelector(exclude=exclude, timer=slow, max_tune_s=0.3)
    cfg = AttentionConfig(backend="auto", auto=sel)
    q = torch.randn(1, 64, 2 * 16)
    attention(q, q, q, 2, config=cfg)
    [report] = sel.reports.values()
    assert report[1].name == "t_jit" and report[1].error.startswith("not measured: tuning budget of 0.3 s spent")
