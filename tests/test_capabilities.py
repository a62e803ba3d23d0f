"""The real backends' declared capabilities, checked against CUDA call specs (no GPU needed)."""

import pytest
import torch

from attention import REGISTRY, CallSpec
from attention.capabilities import KERNELS
from attention.constraints import plan


def spec(cc=(9, 0), dtype=torch.bfloat16, d=128, nq=4096, nk=None, mask=None, heads=24, kv_heads=None, device="cuda"):
    return CallSpec(device, cc if device == "cuda" else None, dtype, 1, heads, kv_heads or heads, nq, nk or nq, d, d, mask)


def why(name, s):
    """What the backend's constraints say (installed or not), and the spec it would run."""
    adapted, reason = plan(REGISTRY.get(name).constraints, s)
    return adapted, reason


@pytest.mark.parametrize(
    "name, s, expect",
    [
        ("sage_fp8_sm90", spec(cc=(8, 9)), "needs compute capability 9.0, this GPU is 8.9"),
        ("sage_fp8_sm90", spec(cc=(9, 0)), None),
        ("sage_fp8_cuda", spec(cc=(8, 6)), "needs compute capability >= 8.9"),
        ("sage_fp16_cuda", spec(cc=(7, 5)), "needs compute capability >= 8.0"),
        ("sage", spec(d=256), "head dim 256 unsupported"),
        ("sage", spec(mask="bool"), "no attention-mask support"),
        ("sage_triton", spec(mask="float"), "no attention-mask support"),  # additive masks were wrong on the H100
        ("sage_triton", spec(), None),
        ("sparge", spec(cc=(12, 0)), "needs compute capability >= 8.0 and <= 9.0"),
        ("sparge", spec(nq=77), "query length 77 < 128"),
        ("sparge", spec(nk=77), "key length 77 < 128"),
        ("sparge", spec(d=256), "head dim 256 unsupported"),
        ("sparge", spec(kv_heads=8), "no GQA"),
        ("flash_attn3", spec(cc=(8, 0)), "needs compute capability 9.0"),
        ("flash_attn2", spec(mask="bool"), "no attention-mask support"),
        ("sdpa_flash", spec(device="cpu", dtype=torch.float32), "runs on cuda, not cpu"),
        ("sdpa_cudnn", spec(d=256), "head dim 256 unsupported"),
        ("sdpa_cudnn", spec(nq=77, nk=1), "key length 1 < 2"),  # found by the H100 contract matrix
        ("sage_fp16_cuda", spec(nq=77, nk=1), "key length 1 < 2"),
        ("sdpa_efficient", spec(kv_heads=8), "no GQA"),
        ("kitchen_int8", spec(d=257), "head dim 257 unsupported"),
        ("kitchen_int8", spec(mask="float", d=160), None),
        ("xformers", spec(cc=(9, 0), mask="bool", d=40), None),
        ("sage3", spec(cc=(9, 0)), "needs compute capability >= 10.0"),
        ("sage3", spec(cc=(12, 0)), None),
        ("sdpa", spec(device="cpu", dtype=torch.float32, mask="bool", kv_heads=4), None),
    ],
)
def test_declared_constraints(name, s, expect):
    _, reason = why(name, s)
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and expect in reason


@pytest.mark.parametrize("d, padded", [(40, 64), (64, 64), (72, 96), (80, 96), (96, 96), (128, 128), (160, None)])
def test_sage1_gets_sd15_head_dims_padded(d, padded):
    adapted, reason = why("sage1_triton", spec(cc=(8, 6), d=d))
    if padded is None:
        assert reason and "head dim 160 unsupported" in reason
    else:
        assert reason is None and adapted.head_dim == padded


@pytest.mark.parametrize("name", ["sage_fp8_sm90", "sage_fp16_cuda", "sage_triton", "sage_fp8_cuda"])
@pytest.mark.parametrize("d", [32, 40, 72, 80, 96, 128, 160])
def test_sage2_takes_head_dims_up_to_128_as_they_are(name, d):
    """SageAttention 2.x pads to 64 or 128 itself: padding before it would copy twice (80 -> 96 -> 128)."""
    adapted, reason = why(name, spec(d=d))
    if d > 128:
        assert reason and f"head dim {d} unsupported" in reason
    else:
        assert reason is None and adapted.head_dim == d


def test_fp32_plans_to_bf16_on_ampere_and_fp16_before():
    adapted, reason = why("sage_fp16_cuda", spec(dtype=torch.float32, cc=(8, 6)))
    assert reason is None and adapted.dtype == torch.bfloat16
    adapted, reason = why("kitchen_int8", spec(dtype=torch.float32, cc=(7, 5)))
    assert reason is None and adapted.dtype == torch.float32  # kitchen takes fp32 itself
    adapted, reason = why("flash_attn2", spec(dtype=torch.float32, cc=(7, 5)))
    assert adapted.dtype == torch.float16 and "needs compute capability >= 8.0" in reason


def test_every_backend_describes_itself_and_has_a_kernel_entry_or_is_torch():
    provided = {n for k in KERNELS.values() for n in k.backends}
    for b in REGISTRY.backends():
        assert b.describe()
        assert b.description
        if b.family != "sdpa":
            assert b.name in provided, f"{b.name} is not listed in attention.capabilities (install.py would not know it)"


def test_capability_table_and_registry_agree_on_arch_windows():
    # the sparge backends' compute-capability rule is the table's
    for name in ("sparge", "sparge_topk", "sparge_sage1"):
        cc_rules = [c for c in REGISTRY.get(name).constraints if type(c).__name__ == "ComputeCapability"]
        assert cc_rules[0].min == KERNELS["spas_sage_attn"].min_cc and cc_rules[0].max == KERNELS["spas_sage_attn"].max_cc


def test_known_bad_archs_are_refused_with_the_reason():
    """capabilities.KNOWN_BAD is the one table: the registry adds the refusal, install.py lists it in the plan."""
    import torch

    from attention import REGISTRY
    from attention.capabilities import KNOWN_BAD, known_bad
    from attention.constraints import plan
    from attention.dispatch import make_spec

    q = torch.empty((1, 4096, 24, 128), dtype=torch.float16, device="meta")
    base = make_spec(q, q, q, "NHD", None).replace(device_type="cuda", dtype=torch.float16)
    for kb in KNOWN_BAD:
        for name in kb.backends:
            b = REGISTRY.get(name)
            for arch in kb.archs:
                why = plan(b.constraints, base.replace(cc=arch))[1]
                assert why and kb.reference in why and kb.reason in why
                assert known_bad(name, arch) is kb
            assert "not on sm" in b.describe()
    assert plan_ok("sage_fp16_cuda", base.replace(cc=(8, 6)))  # the reporter's fix stays offered
    assert plan_ok("sage_triton", base.replace(cc=(8, 9)))


def plan_ok(name, spec):
    from attention import REGISTRY
    from attention.constraints import plan

    return plan(REGISTRY.get(name).constraints, spec)[1] is None


def test_a_backend_gets_its_package_window_and_may_narrow_it_never_widen_it():
    from attention.constraints import ComputeCapability, DeviceTypes
    from attention.registry import with_package_rules

    rules = with_package_rules("sparge", (DeviceTypes(("cuda",)),))
    assert rules[1] == ComputeCapability.of_kernel("spas_sage_attn")  # right after the device rule
    assert with_package_rules("not_in_the_table", (DeviceTypes(("cuda",)),)) == (DeviceTypes(("cuda",)),)
    for narrower in (ComputeCapability(min=(8, 9), max=(9, 0)), ComputeCapability(exact=((8, 6), (9, 0)))):
        assert with_package_rules("sparge", (narrower,)) == (narrower,)  # its own rule, not the package's too
    for wider in (ComputeCapability(min=(7, 5)), ComputeCapability(min=(8, 0)),
                  ComputeCapability(exact=((9, 0), (10, 0)))):
        with pytest.raises(ValueError, match="wider than its package spas_sage_attn runs on"):
            with_package_rules("sparge", (wider,))  # SpargeAttn runs on 8.0 to 9.0


def test_the_capability_table_names_only_registered_backends():
    from attention.registry import Registry

    REGISTRY.check_table()
    with pytest.raises(ValueError, match="backends nobody registers: .*sage_fp8_sm90"):
        Registry().check_table()
