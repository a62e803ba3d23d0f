"""Adding a backend is one module in attention/backends/ (and, for a package install.py should install, that package's
entry in attention/capabilities.py): a toy backend module dropped into a copy of the pack, with its install recipe, is
taken up by the registry, Patch Attention's backend list, auto, the benchmarks, the Info node and install.py's plan,
with no other edit."""

import importlib
import importlib.util
import shutil
import sys

import pytest
import torch
from pack import ROOT

TOY_MODULE = '''
"""Toy attention: SDPA in fp32; toy_slow is the same kernel, declared never faster than the others."""

import torch
import torch.nn.functional as F

from ..constraints import DeviceTypes, DTypes, Masks
from ..registry import REGISTRY, Backend


def _toy(q, k, v, *, layout, mask, scale, opts):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).to(q.dtype)


for name, timed in (("toy", True), ("toy_slow", False)):
    REGISTRY.register(Backend(name=name, family="toy", fn=_toy, timed=timed, description="toy attention",
                              constraints=(DeviceTypes(("cpu", "cuda")), DTypes((torch.float32, torch.float16, torch.bfloat16)),
                                           Masks(()))))
'''

# its install recipe: one entry of the capability table
TOY_RECIPE = '''
KERNELS["toy_attn"] = Kernel(key="toy_attn", import_name="toy_attn", pip_name="toy-attn", min_cc=(8, 0),
                             backends=("toy", "toy_slow"), default=True, title="Toy Attention")
'''


def _load(name, path, package_dir=None):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package_dir)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A copy of the pack with the toy module and its recipe added (nothing else edited), loaded as ComfyUI loads it;
    and its install.py."""
    dest = tmp_path_factory.mktemp("pack") / "pack"
    keep = ("__init__.py", "install.py", "attention", "nodes", "parallel", "measure")
    shutil.copytree(ROOT, dest, ignore=lambda d, names: [n for n in names if (d == ROOT and n not in keep) or n == "__pycache__"])
    (dest / "attention" / "backends" / "toy.py").write_text(TOY_MODULE)
    with open(dest / "attention" / "capabilities.py", "a") as f:
        f.write(TOY_RECIPE)
    pack = _load("pa_pack_with_a_toy_backend", dest / "__init__.py", [str(dest)])
    return pack, _load("pa_install_with_a_toy_backend", dest / "install.py")


def test_the_registry_and_patch_attention_take_it_up(copy):
    pack, _ = copy
    A = pack.attention
    assert {"toy", "toy_slow"} <= set(A.REGISTRY.names())
    choices = next(i for i in pack.nodes.definitions.PATCH.inputs if i.name == "backend").choices()
    assert {"toy", "toy_slow"} <= set(choices)
    q, k, v = (torch.randn(2, 64, 2 * 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cfg = A.AttentionConfig(backend="toy", allow_fallback=False)
    out = A.attention(q, k, v, 2, config=cfg)
    ref = A.dispatch.fp32_reference(q, k, v, 2)
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.9999
    assert cfg.stats.calls == {"toy": 1}


def test_auto_and_the_benchmarks_read_its_declaration(copy):
    pack, _ = copy
    spec = pack.attention.make_spec(*(torch.empty(1, 256, 2, 64, device="meta"),) * 3, "NHD", None).replace(
        device_type="cpu", dtype=torch.float32)
    candidates = pack.attention.AutoSelector().candidates(spec)
    assert "toy" in candidates and "toy_slow" not in candidates and "sdpa_math" not in candidates
    measure = importlib.import_module(pack.__name__ + ".measure")
    assert importlib.import_module(measure.__name__ + ".bench").SKIP_BY_DEFAULT == {"sdpa_math", "toy_slow"}
    rows = importlib.import_module(measure.__name__ + ".rows").default_rows(peers=False)
    assert "toy" in rows and "toy_slow" not in rows


def test_the_info_node_and_install_py_read_its_recipe(copy):
    pack, inst = copy
    rows = {r["backend"]: r for r in pack.attention.report_rows(torch.device("cpu"))}
    assert rows["toy"]["usable"] and rows["toy"]["description"] == "toy attention"
    # the GPUs its package runs on: one declaration, which the dispatcher and the installer both read
    old_gpu = pack.attention.make_spec(*(torch.empty(1, 256, 2, 64, device="meta"),) * 3, "NHD", None).replace(
        device_type="cuda", cc=(7, 5), dtype=torch.float32)
    assert "needs compute capability >= 8.0, this GPU is 7.5" in pack.attention.REGISTRY.get("toy").plan(old_gpu)[1]
    assert "Toy Attention" in pack.nodes.definitions.addable((9, 0), windows=False)
    assert "Toy Attention" not in pack.nodes.definitions.addable((7, 5), windows=False)

    def machine(cc):
        return inst.Machine(os="Linux", machine="x86_64", python="3.12.3", torch="2.11.0+cu130", torch_cuda="13.0",
                            gpus=[inst.GPU("GPU", cc)], nvcc=(13, 0), nvcc_path="/usr/local/cuda/bin/nvcc",
                            cuda_home="/usr/local/cuda", gcc=(13, 3), cores=16, mem_gb=128, pinned={"torch": "2.11.0"},
                            triton="3.6.0", triton_dist="triton", build_tools={t: "1" for t in inst.BUILD_TOOLS})

    hopper = {s.kernel: s for s in inst.plan(machine((9, 0)))}
    assert hopper["toy_attn"].action == "wheel" and hopper["toy_attn"].pip_args[-1] == "toy-attn"
    turing = {s.kernel: s for s in inst.plan(machine((7, 5)))}
    assert turing["toy_attn"].action == "skip" and "needs compute capability >= 8.0" in turing["toy_attn"].reason
