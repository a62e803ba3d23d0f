"""Which kernel packages can run on which GPU architecture, and how install.py gets them.

Pure data, importable without torch: ``install.py`` plans what to install from
this table (in its order), and the registry gives each backend a package lists
the compute-capability window of that package, so what gets installed and what
the dispatcher accepts never disagree.  A backend whose package install.py does
not install (PyTorch's own kernels) has no entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kernel:
    """One installable kernel package."""

    key: str
    import_name: str
    pip_name: str
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    source: str = "wheel"  # "wheel": from PyPI; "build": compiled from source
    note: str = ""
    arch_families: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    backends: tuple[str, ...] = ()  # registry names this package provides
    needs_triton: bool = False  # imports triton (on Windows: the triton-windows wheel matching torch)
    default: bool = False  # install.py installs it unless told --only/--skip; the others on request (--only/--with)
    title: str = ""  # its name in the Info node's advice (none for comfy-kitchen, which ComfyUI itself depends on)
    instead_of: str = ""  # installed only where this other entry cannot be (SageAttention 1 for 2)
    part_of: str = ""  # the same package as this other entry, installed by it (no step of its own)

    def runs_on(self, cc: tuple[int, int]) -> bool:
        if self.min_cc is not None and tuple(cc) < self.min_cc:
            return False
        if self.max_cc is not None and tuple(cc) > self.max_cc:
            return False
        if self.arch_families and (cc[0], cc[1]) not in self.arch_families:
            return False
        return True

    def describe_arch(self) -> str:
        parts = []
        if self.arch_families:
            parts.append("sm " + ", ".join(f"{a}.{b}" for a, b in self.arch_families))
        else:
            if self.min_cc:
                parts.append(f">= {self.min_cc[0]}.{self.min_cc[1]}")
            if self.max_cc:
                parts.append(f"<= {self.max_cc[0]}.{self.max_cc[1]}")
        return "compute capability " + (" and ".join(parts) if parts else "any")


# In install.py's order (SageAttention 2 is planned before 1, which it replaces where it can run).
KERNELS: dict[str, Kernel] = {
    k.key: k
    for k in (
        Kernel(
            key="sageattention",
            needs_triton=True,
            backends=("sage", "sage_triton", "sage_fp16_cuda", "sage_fp8_cuda", "sage_fp8_cuda_fp16acc", "sage_fp8_sm90"),
            import_name="sageattention",
            pip_name="sageattention",
            min_cc=(8, 0),
            source="build",
            note="SageAttention 2.x, CUDA kernels built for the detected archs",
            default=True, title="SageAttention 2",
        ),
        Kernel(
            key="sageattention1",
            needs_triton=True,
            backends=("sage1_triton",),
            import_name="sageattention",
            pip_name="sageattention==1.0.6",
            min_cc=(7, 5),
            source="wheel",
            note="SageAttention 1.0.6 (Triton only); used where 2.x cannot be built",
            default=True, title="SageAttention 1", instead_of="sageattention",
        ),
        Kernel(
            key="sageattn3",
            backends=("sage3",),
            import_name="sageattn3",
            pip_name="sageattn3",
            min_cc=(10, 0),
            source="build",
            note="SageAttention3 (FP4), Blackwell only; source in sageattention3_blackwell/",
            default=True, title="SageAttention 3",
        ),
        Kernel(
            key="spas_sage_attn",
            needs_triton=True,
            backends=("sparge", "sparge_topk", "sparge_sage1"),
            import_name="spas_sage_attn",
            pip_name="spas_sage_attn",
            min_cc=(8, 0),
            max_cc=(9, 0),
            source="build",
            note="SpargeAttn sparse attention",
            default=True, title="SpargeAttn",
        ),
        Kernel(
            key="flash_attn4",
            backends=("flash_attn4",),
            import_name="flash_attn.cute",
            pip_name="flash-attn-4",
            # flash-attn-4 4.0.0b36's forward: its Hopper kernel on sm 9.x, its Blackwell (tcgen05) kernel on sm 10.x
            # and 11.x (Thor reports 10.1 to CUDA 12, 11.0 to CUDA 13). It also has an SM80-style path (mma.sync) for
            # sm 8.x and 12.x whose head dims are bounded by shared memory and checked nowhere in its interface: not
            # offered here until measured on such a GPU.
            arch_families=((9, 0), (10, 0), (10, 1), (10, 3), (11, 0)),
            source="wheel",
            note="FlashAttention-4 (CuTe DSL), pinned wheels from PyPI; Linux only",
            default=True, title="FlashAttention-4",
        ),
        Kernel(
            key="flash_attn",
            backends=("flash_attn2",),
            import_name="flash_attn",
            pip_name="flash-attn",
            min_cc=(8, 0),
            source="wheel",
            note="flash-attn 2; only a wheel matching the installed torch",
        ),
        Kernel(
            key="flash_attn3",
            backends=("flash_attn3",),
            import_name="flash_attn_interface",
            pip_name="flash_attn_3",
            arch_families=((9, 0),),
            source="wheel",
            note="FlashAttention-3 (Hopper)",
        ),
        Kernel(
            key="xformers",
            backends=("xformers",),
            import_name="xformers",
            pip_name="xformers",
            min_cc=(5, 0),
            source="wheel",
            note="only a wheel built for the installed torch",
        ),
        Kernel(
            key="comfy_kitchen",
            backends=("kitchen_int8",),
            import_name="comfy_kitchen",
            pip_name="comfy-kitchen",
            min_cc=(7, 5),
            source="wheel",
            note="int8 attention from comfy-kitchen",
            default=True,
        ),
        Kernel(
            key="comfy_kitchen_sol",
            backends=("kitchen_sol", "kitchen_sol_topk"),
            import_name="comfy_kitchen",
            pip_name="comfy-kitchen",
            min_cc=(8, 0),
            source="wheel",
            note="Sol-Attn sparse attention from comfy-kitchen >= 0.2.40 (the comfy-kitchen install.py handles; "
                 "the version ComfyUI pins is kept)",
            part_of="comfy_kitchen",
        ),
    )
}


def default_set() -> tuple[str, ...]:
    """The kernels install.py installs when told nothing else."""
    return tuple(key for key, k in KERNELS.items() if k.default)


def optional_set() -> tuple[str, ...]:
    """The kernels install.py installs only when named (``--only``/``--with``)."""
    return tuple(key for key, k in KERNELS.items() if not k.default and not k.part_of)


def kernel_of(backend: str) -> Kernel | None:
    """The package that provides registry backend ``backend`` (None: PyTorch's own, or one install.py does not know)."""
    return next((k for k in KERNELS.values() if backend in k.backends), None)


def dist_of(module: str) -> str | None:
    """The pip distribution that installs importable ``module`` (its top-level package is enough), or None."""
    top = module.split(".")[0]
    for k in sorted(KERNELS.values(), key=lambda k: k.import_name != module):  # an exact match first
        if k.import_name.split(".")[0] == top:
            return k.pip_name.split("==")[0]
    return None


@dataclass(frozen=True)
class KnownBad:
    """Backends that gave NaN or wrong output on some architectures: not offered there.

    ``confirmed`` says whether this project reproduced it; a report with a reproduction and an upstream
    fix is enough to stop offering the kernel (it would be worse than SDPA: a black image), not to call it
    proven. The dispatcher refuses these backends on ``archs`` with ``reason`` (Attention Backends Info
    shows it) and ``install.py`` lists it in the plan.
    """

    backends: tuple[str, ...]
    archs: tuple[tuple[int, int], ...]
    reason: str
    reference: str
    confirmed: bool = False

    def describe(self) -> str:
        archs = ", ".join(f"sm {a}.{b}" for a, b in self.archs)
        how = "confirmed here" if self.confirmed else "reported upstream, not reproduced here"
        return f"known bad on {archs}: {self.reason} ({self.reference}; {how})"


KNOWN_BAD: tuple[KnownBad, ...] = (
    KnownBad(
        # SageAttention 2.2's sageattn() sends sm 8.6 to the Triton kernel; sm 8.0 gets the CUDA fp16 one.
        backends=("sage", "sage_triton"),
        archs=((8, 6),),
        reason="SageAttention 2's Triton kernel (what sageattn() runs on sm 8.6) gives NaN, i.e. black images, "
        "on Qwen-Image; sage_fp16_cuda is the reporter's fix",
        reference="ComfyUI #9773",
    ),
)


def known_bad(backend: str, cc: tuple[int, int]) -> KnownBad | None:
    for kb in KNOWN_BAD:
        if backend in kb.backends and tuple(cc) in kb.archs:
            return kb
    return None


def arch_name(cc: tuple[int, int]) -> str:
    """A human name for a compute capability."""
    names = {
        (7, 0): "Volta",
        (7, 5): "Turing",
        (8, 0): "Ampere (A100)",
        (8, 6): "Ampere",
        (8, 7): "Ampere (Orin)",
        (8, 9): "Ada",
        (9, 0): "Hopper",
        (10, 0): "Blackwell (B200)",
        (10, 3): "Blackwell (B300)",
        (12, 0): "Blackwell (consumer)",
        (12, 1): "Blackwell (GB10)",
    }
    return names.get(tuple(cc), f"sm_{cc[0]}{cc[1]}")
