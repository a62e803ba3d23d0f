"""One registry of attention backends.

A backend is registered once, with what it supports (a tuple of
:mod:`constraints`), the layouts it accepts and a probe that says whether its
package is importable here.  A backend whose package is missing stays in the
registry as *unavailable* with the reason, so "why can't I use X here?" always
has an answer.  What the capability table (:mod:`capabilities`, shared with
install.py) says of a backend's package -- the GPUs it runs on, the archs known
to give wrong output there -- is added to its rules when it registers.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .capabilities import KERNELS, KNOWN_BAD, dist_of, kernel_of
from .constraints import CallSpec, ComputeCapability, Constraint, DeviceTypes, NotKnownBad, plan

log = logging.getLogger("patch_attention.registry")

LAYOUTS = ("HND", "NHD")  # [B, H, N, D] and [B, N, H, D]


@dataclass(frozen=True)
class Accuracy:
    """An accuracy class: the bound every backend of the class must keep against fp32 SDPA on any supported call
    (cosine similarity and relative L1 of the output), and whether calls that ask for full precision may use it."""

    name: str
    min_cos: float
    max_rel_l1: float
    full_precision: bool  # may take calls with attn_precision=fp32 / low_precision_attention=False
    text: str
    nan_propagates: bool = True  # a NaN in q/k/v gives NaN where fp32 attention gives NaN (quantizers map NaN to numbers)

    def describe(self) -> str:
        return f"{self.name}: cos >= {self.min_cos}, rel-L1 <= {self.max_rel_l1} vs fp32 SDPA ({self.text})"


# Bounds from the H100 contract matrix (docs/gpu-correctness.md); a kernel outside its class on a call the
# registry lets it take is a bug, fixed in the call or declared in its constraints.
ACCURACY = {
    "exact": Accuracy("exact", 0.9999, 0.02, True, "half-precision rounding only"),
    "8bit": Accuracy("8bit", 0.995, 0.08, False, "INT8 Q/K and FP8/FP16 P/V quantization", False),
    "sparse": Accuracy("sparse", 0.99, 0.15, False, "8-bit plus blocks skipped where attention mass is small", False),
    # A fixed share of key blocks per query block, whatever the attention looks like: on attention that is not
    # concentrated (the contract matrix's random inputs) topk=0.5 drops half the mass, rel-L1 ~1.0 on the H100.
    # No bound holds for every input; each explicit use is audited against fp32 on its first call and auto's gate
    # decides per call shape.
    "topk": Accuracy("topk", -1.0, float("inf"), False, "a fixed share of key blocks kept per query block",
                     False),
    "4bit": Accuracy("4bit", 0.98, 0.2, False, "FP4 microscaling", False),
    # Key blocks routed by score and attended exactly, the rest through one pooled term per block (Sol-Attn): close to
    # dense where attention is concentrated (rel-L1 0.0015 on structured Wan-480p inputs), far from it where it is flat
    # (the contract matrix's random inputs: rel-L1 0.22 at 256 tokens, 0.76 at 16k, H100). No bound holds for every
    # input: explicit use is audited on its first call of each kind, and auto's gate decides per call shape.
    "routed": Accuracy("routed", -1.0, float("inf"), False, "key blocks routed by score exact, the rest pooled",
                       False),
}


SPARSE_CLASSES = ("sparse", "topk", "routed")  # kernels that skip attention mass: held off until the sparse schedule starts


@dataclass
class Availability:
    ok: bool
    reason: str = ""
    version: str = ""


@dataclass
class Backend:
    """One callable kernel.

    ``fn(q, k, v, *, layout, mask, scale, opts)`` gets q/k/v in ``layout`` (one of
    ``layouts``), a 4-D mask broadcastable to ``[B, H, Nq, Nk]`` or ``None``,
    the softmax scale and the per-backend options dict; it returns the output
    in the same layout.  ``probe()`` returns an :class:`Availability`.
    """

    name: str
    family: str
    fn: Callable
    constraints: tuple[Constraint, ...]
    layouts: tuple[str, ...] = ("HND",)
    probe: Callable[[], Availability] = field(default=lambda: Availability(True))
    description: str = ""
    options: dict = field(default_factory=dict)  # default per-call options
    # Quantized kernels can return NaN on degenerate inputs (e.g. SageAttention on all-equal keys, as a
    # zeroed negative prompt gives); the dispatcher checks their output when config.check_finite is on.
    quantized: bool = False
    accuracy: str = "exact"  # a key of ACCURACY; a quantized backend is at least "8bit"
    # The kernel computes in whichever of ``layouts`` it is handed, reads its inputs through their strides and
    # writes its output in that layout: the dispatcher hands it the layout whose output needs no copy for what the
    # caller returns ([B, N, H*D] is a free view of NHD; [B, H, N, D] is HND), whatever the call's own layout.
    layout_by_output: bool = False
    # The kernel's Python wrapper subtracts K's mean over the sequence before quantizing (SageAttention's
    # ``smooth_k``; attention is unchanged by it: every query's logits shift by one constant) unless told
    # ``smooth_k=False``.  A compiled model does that subtraction in its graph, where inductor fuses it with the ops
    # that produce K, and tells the kernel so, instead of running it eagerly inside the custom op.
    smooth_k: bool = False
    # A refusal that depends on the per-model options, checked after the static constraints: (spec, options) -> why
    # not, or None (Sol-Attn's minimum token count, which the user sets). The options then also reach ``fn``.
    declines: Callable | None = None
    # False: never faster than the others where it runs (SDPA's unfused math kernel): auto never times it as a
    # candidate and the benchmarks leave it out of their default rows.
    timed: bool = True
    _avail: Availability | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.accuracy not in ACCURACY:
            raise ValueError(f"backend {self.name!r}: accuracy must be one of {list(ACCURACY)}, got {self.accuracy!r}")
        if self.quantized and self.accuracy == "exact":
            self.accuracy = "8bit"
        self.quantized = self.accuracy != "exact"

    @property
    def sparse(self) -> bool:
        """Skips attention mass (SpargeAttn, Sol-Attn): such kernels wait for the sparse step schedule."""
        return self.accuracy in SPARSE_CLASSES

    @property
    def accuracy_class(self) -> Accuracy:
        return ACCURACY[self.accuracy]

    def availability(self) -> Availability:
        if self._avail is None:
            try:
                self._avail = self.probe()
            except Exception as e:  # a probe must never take the pack down
                self._avail = Availability(False, f"probe failed: {type(e).__name__}: {e}")
        return self._avail

    @property
    def available(self) -> bool:
        return self.availability().ok

    def plan(self, spec: CallSpec) -> tuple[CallSpec, str | None]:
        """The spec this backend would compute, and why it cannot (or None)."""
        av = self.availability()
        if not av.ok:
            return spec, f"not installed: {av.reason}"
        return plan(self.constraints, spec)

    def refuses(self, spec: CallSpec, opts: dict | None) -> str | None:
        """Why the option-dependent rule (``declines``) refuses ``spec`` with ``opts``, or None."""
        return None if self.declines is None else self.declines(spec, {**self.options, **(opts or {})})

    def describe(self) -> str:
        return "; ".join(c.describe() for c in self.constraints)


class Registry:
    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend) -> Backend:
        if backend.name in self._backends:
            raise ValueError(f"backend {backend.name!r} is already registered")
        bad = [x for x in backend.layouts if x not in LAYOUTS]
        if bad or not backend.layouts:
            raise ValueError(f"backend {backend.name!r}: layouts must be from {LAYOUTS}, got {backend.layouts}")
        # What its package runs on and the archs known to be bad are declared once, in the capability table
        # (install.py reads the same table).
        backend.constraints = with_package_rules(backend.name, tuple(backend.constraints)) + tuple(
            NotKnownBad(kb) for kb in KNOWN_BAD if backend.name in kb.backends
        )
        self._backends[backend.name] = backend
        return backend

    def check_table(self) -> None:
        """The capability table and the registry agree: every backend the table names is registered, under one
        package only (ValueError otherwise; run once every backend module is imported)."""
        listed = [n for k in KERNELS.values() for n in k.backends] + [n for kb in KNOWN_BAD for n in kb.backends]
        missing = sorted({n for n in listed if n not in self._backends})
        twice = sorted({n for k in KERNELS.values() for n in k.backends if kernel_of(n) is not k})
        problems = [f"{what}: {', '.join(names)}" for what, names in
                    (("backends nobody registers", missing), ("backends under two packages", twice)) if names]
        if problems:
            raise ValueError("attention.capabilities names " + "; ".join(problems))

    def unregister(self, name: str) -> None:
        self._backends.pop(name, None)

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise KeyError(
                f"unknown attention backend {name!r}; known: {', '.join(self._backends)}"
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._backends

    def names(self, family: str | None = None) -> list[str]:
        """Every backend's name (the ones a user can pick), in registration order; of one ``family`` if given."""
        return [n for n, b in self._backends.items() if family is None or b.family == family]

    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def available(self) -> list[str]:
        return [b.name for b in self._backends.values() if b.available]

    def untimed(self) -> set[str]:
        """The backends auto and the benchmarks leave out (``Backend.timed`` off)."""
        return {b.name for b in self._backends.values() if not b.timed}

    def why_not(self, name: str, spec: CallSpec | None = None) -> str | None:
        """``None`` if ``name`` can run (``spec``, when given), else the reason."""
        b = self.get(name)
        if spec is None:
            av = b.availability()
            return None if av.ok else av.reason
        return b.plan(spec)[1]

    def refresh(self) -> None:
        """Forget cached probes (after installing a kernel in a running process)."""
        for b in self._backends.values():
            b._avail = None


REGISTRY = Registry()


def with_package_rules(name: str, rules: tuple[Constraint, ...]) -> tuple[Constraint, ...]:
    """``rules`` with the compute-capability window of the package that provides backend ``name``
    (``capabilities.KERNELS``), placed after the device rule. A backend may narrow that window with rules of its own
    (one entry point of a package that needs a newer GPU), never widen it."""
    k = kernel_of(name)
    if k is None:
        return rules
    own = [r for r in rules if isinstance(r, ComputeCapability)]
    wide = [r.describe() for r in own if not r.within(k)]
    if wide:
        raise ValueError(f"backend {name!r}: {', '.join(wide)} is wider than its package {k.key} runs on "
                         f"({k.describe_arch()}, attention.capabilities)")
    if own:
        return rules
    at = next((i + 1 for i, r in enumerate(rules) if isinstance(r, DeviceTypes)), 0)
    return rules[:at] + (ComputeCapability.of_kernel(k.key),) + rules[at:]


def check_bounded_options(opts: dict, bounds: dict, label: str, known=None) -> dict:
    """A backend's options checked: a name outside ``known`` (default: the bounded names) or a value outside its
    ``bounds`` entry is a ValueError naming ``label``; returns the options as given."""
    known = bounds.keys() if known is None else known
    out = {}
    for key, val in (opts or {}).items():
        if key not in known:
            raise ValueError(f"unknown {label} option {key!r}; known: {', '.join(sorted(known))}")
        if key in bounds:
            lo, hi = bounds[key]
            if not (lo <= float(val) <= hi):
                raise ValueError(f"{label} {key}={val} out of range [{lo}, {hi}]")
        out[key] = val
    return out


def import_probe(module: str, *, attr: str | None = None, check: Callable | None = None):
    """A probe that imports ``module`` (and needs ``attr`` in it, and ``check(mod)``)."""

    def probe() -> Availability:
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            return Availability(False, f"import {module} failed: {type(e).__name__}: {e}")
        if attr is not None and not hasattr(mod, attr):
            return Availability(False, f"{module} has no {attr} (version {version_of(module)})")
        if check is not None:
            reason = check(mod)
            if reason:
                return Availability(False, reason)
        return Availability(True, version=version_of(module))

    return probe


def version_of(module: str) -> str:
    """The installed version of what provides ``module``: its distribution as the capability table names it, else
    one named as the module is, else the module's ``__version__``."""
    from importlib import metadata

    top = module.split(".")[0]
    dist = dist_of(module) or top
    for name in (dist, dist.replace("_", "-"), top):
        try:
            return metadata.version(name)
        except Exception:
            continue
    mod = importlib.import_module(top)
    return str(getattr(mod, "__version__", "?"))
