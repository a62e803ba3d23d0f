"""What a backend can take, as small frozen rules that explain themselves.

Every backend in the registry declares a tuple of these.  The dispatcher asks
each rule about a :class:`CallSpec` (the shape of one attention call, no
tensors) before it calls the kernel.  Two rules can also *adapt* a call
instead of refusing it: :class:`DTypes` (fp32 is computed in a kernel dtype
and cast back) and :class:`HeadDims` (a head dim is zero-padded to the next
one the kernel has).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .capabilities import KERNELS, Kernel, KnownBad


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class CallSpec:
    """Everything about one call that decides which backend can take it."""

    device_type: str
    cc: tuple[int, int] | None
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    mask: str | None  # None, "bool" or "float"

    def replace(self, **kw) -> CallSpec:
        return dataclasses.replace(self, **kw)

    def short(self) -> str:
        m = f", mask={self.mask}" if self.mask else ""
        return (
            f"{self.device_type} {_dt(self.dtype)} B={self.batch} H={self.heads} "
            f"Nq={self.q_len} Nk={self.kv_len} D={self.head_dim}{m}"
        )


class Constraint:
    """Base class: ``check`` returns ``None`` when fine, else the reason."""

    def check(self, spec: CallSpec) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def adapt(self, spec: CallSpec) -> CallSpec:
        """Return the call this rule would turn ``spec`` into (default: as is)."""
        return spec

    def describe(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class DeviceTypes(Constraint):
    types: tuple[str, ...]

    def check(self, spec):
        if spec.device_type not in self.types:
            return f"runs on {'/'.join(self.types)}, not {spec.device_type}"
        return None

    def describe(self):
        return f"device in {{{', '.join(self.types)}}}"


@dataclass(frozen=True)
class ComputeCapability(Constraint):
    """CUDA compute capability window, or an exact list of archs."""

    min: tuple[int, int] | None = None
    max: tuple[int, int] | None = None
    exact: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of_kernel(cls, key: str) -> ComputeCapability:
        k = KERNELS[key]
        return cls(min=k.min_cc, max=k.max_cc, exact=k.arch_families)

    def within(self, k: Kernel) -> bool:
        """Every GPU this rule admits is one package ``k`` runs on."""
        if self.exact:
            return all(k.runs_on(a) for a in self.exact)
        if k.arch_families or (k.min_cc and (self.min is None or self.min < k.min_cc)):
            return False
        return k.max_cc is None or (self.max is not None and self.max <= k.max_cc)

    def check(self, spec):
        if spec.device_type != "cuda":
            return None  # DeviceTypes speaks for other devices
        if spec.cc is None:
            return "compute capability unknown"
        if self.exact and spec.cc not in self.exact:
            return f"needs {self.describe()}, this GPU is {spec.cc[0]}.{spec.cc[1]}"
        if (self.min and spec.cc < self.min) or (self.max and spec.cc > self.max):
            return f"needs {self.describe()}, this GPU is {spec.cc[0]}.{spec.cc[1]}"
        return None

    def describe(self):
        if self.exact:
            return "compute capability " + " or ".join(f"{a}.{b}" for a, b in self.exact)
        parts = []
        if self.min:
            parts.append(f">= {self.min[0]}.{self.min[1]}")
        if self.max:
            parts.append(f"<= {self.max[0]}.{self.max[1]}")
        return "compute capability " + " and ".join(parts)


@dataclass(frozen=True)
class NotKnownBad(Constraint):
    """Refuses the archs where the kernel is known to give NaN or wrong output (``capabilities.KNOWN_BAD``)."""

    entry: KnownBad

    def check(self, spec):
        if spec.device_type == "cuda" and spec.cc in self.entry.archs:
            return self.entry.describe()
        return None

    def describe(self):
        return "not on " + ", ".join(f"sm {a}.{b}" for a, b in self.entry.archs) + f" ({self.entry.reference})"


@dataclass(frozen=True)
class DTypes(Constraint):
    """Supported input dtypes; fp32 is cast to a supported half dtype when ``cast_fp32``."""

    dtypes: tuple[torch.dtype, ...]
    cast_fp32: bool = True

    def adapt(self, spec):
        if spec.dtype in self.dtypes or not self.cast_fp32 or spec.dtype != torch.float32:
            return spec
        bf16_ok = spec.device_type != "cuda" or (spec.cc is not None and spec.cc >= (8, 0))
        for cand in ((torch.bfloat16, torch.float16) if bf16_ok else (torch.float16,)):
            if cand in self.dtypes:
                return spec.replace(dtype=cand)
        return spec

    def check(self, spec):
        if spec.dtype not in self.dtypes:
            return f"dtype {_dt(spec.dtype)} not in {{{', '.join(_dt(d) for d in self.dtypes)}}}"
        if spec.dtype == torch.bfloat16 and spec.device_type == "cuda" and spec.cc and spec.cc < (8, 0):
            return "bfloat16 needs compute capability >= 8.0"
        return None

    def describe(self):
        s = "dtype in {" + ", ".join(_dt(d) for d in self.dtypes) + "}"
        return s + (" (float32 cast)" if self.cast_fp32 and torch.float32 not in self.dtypes else "")


@dataclass(frozen=True)
class HeadDims(Constraint):
    """Head dims a kernel takes: an explicit set and/or a maximum and a multiple.

    With ``pad`` a head dim the kernel lacks is zero-padded up to the next one it
    has (the softmax scale stays that of the original head dim).
    """

    dims: tuple[int, ...] = ()
    max: int | None = None
    multiple_of: int = 1
    pad: bool = True
    pairs: tuple[tuple[int, int], ...] = ()  # (q/k head dim, v head dim) taken besides what the rule above takes

    def ok(self, d: int) -> bool:
        if self.dims and d not in self.dims:
            return False
        if self.max is not None and d > self.max:
            return False
        return d % self.multiple_of == 0

    def padded(self, d: int) -> int | None:
        if self.ok(d) or (d, d) in self.pairs:
            return d
        if not self.pad:
            return None
        if self.dims:
            bigger = [x for x in sorted(self.dims) if x >= d and self.ok(x)]
            p = bigger[0] if bigger else None
        else:
            p = -(-d // self.multiple_of) * self.multiple_of
            p = p if self.ok(p) else None
        if p is None:
            square = sorted(a for a, b in self.pairs if a == b and a >= d)
            p = square[0] if square else None
        return p

    def adapt(self, spec):
        if spec.head_dim != spec.v_head_dim:
            return spec
        p = self.padded(spec.head_dim)
        if p is None or p == spec.head_dim:
            return spec
        return spec.replace(head_dim=p, v_head_dim=p)

    def check(self, spec):
        if (spec.head_dim, spec.v_head_dim) in self.pairs:
            return None
        for d in {spec.head_dim, spec.v_head_dim}:
            if not self.ok(d):
                what = f"head dim {d}" if spec.head_dim == spec.v_head_dim else f"head dims {spec.head_dim}/{spec.v_head_dim}"
                return f"{what} unsupported ({self.describe()})"
        return None

    def describe(self):
        parts = []
        if self.dims:
            parts.append("head dim in {" + ", ".join(map(str, self.dims)) + "}")
        if self.max is not None:
            parts.append(f"head dim <= {self.max}")
        if self.multiple_of > 1:
            parts.append(f"head dim % {self.multiple_of} == 0")
        s = " and ".join(parts) or "any head dim"
        if self.pairs:
            s += ", or (q/k, v) in {" + ", ".join(f"({a}, {b})" for a, b in self.pairs) + "}"
        return s + (" (padded)" if self.pad else "")


@dataclass(frozen=True)
class Masks(Constraint):
    """Attention masks: none, or the kinds (``bool``/``float``) the kernel applies."""

    kinds: tuple[str, ...] = ()

    def check(self, spec):
        if spec.mask is None:
            return None
        if not self.kinds:
            return "no attention-mask support"
        if spec.mask not in self.kinds:
            return f"no {spec.mask} attention-mask support"
        return None

    def describe(self):
        return "masks: " + ("/".join(self.kinds) if self.kinds else "none")


@dataclass(frozen=True)
class MinSeqLen(Constraint):
    q: int = 0
    kv: int = 0

    def check(self, spec):
        if spec.q_len < self.q:
            return f"query length {spec.q_len} < {self.q}"
        if spec.kv_len < self.kv:
            return f"key length {spec.kv_len} < {self.kv}"
        return None

    def describe(self):
        return f"query length >= {self.q}, key length >= {self.kv}"


@dataclass(frozen=True)
class SameSeqLen(Constraint):
    """Self-attention only (query and key of one length)."""

    def check(self, spec):
        if spec.q_len != spec.kv_len:
            return f"query length {spec.q_len} != key length {spec.kv_len}"
        return None

    def describe(self):
        return "self-attention only (Nq == Nk)"


@dataclass(frozen=True)
class GroupedQuery(Constraint):
    """Whether K/V may have fewer heads than Q."""

    allowed: bool = False

    def check(self, spec):
        if spec.kv_heads != spec.heads and not self.allowed:
            return f"{spec.heads} query heads vs {spec.kv_heads} key heads (no GQA)"
        return None

    def describe(self):
        return "grouped-query heads" + ("" if self.allowed else ": no")


@dataclass(frozen=True)
class SameHeadDimV(Constraint):
    def check(self, spec):
        if spec.v_head_dim != spec.head_dim:
            return f"value head dim {spec.v_head_dim} != query head dim {spec.head_dim}"
        return None

    def describe(self):
        return "value head dim == query head dim"


@dataclass(frozen=True)
class PerArch(Constraint):
    """Rules that differ by GPU architecture: ``table`` maps compute-capability majors to the rules that hold there.

    The first row naming the call's major applies; a CUDA call on a major no row names is refused (say which archs
    a kernel runs on with :class:`ComputeCapability` as well: that rule gives the plainer reason).  Calls on other
    devices are left to :class:`DeviceTypes`.
    """

    table: tuple[tuple[tuple[int, ...], tuple[Constraint, ...]], ...]

    def rules(self, spec: CallSpec) -> tuple[Constraint, ...] | None:
        if spec.device_type != "cuda" or spec.cc is None:
            return None
        return next((rules for majors, rules in self.table if spec.cc[0] in majors), None)

    def adapt(self, spec):
        for r in self.rules(spec) or ():
            spec = r.adapt(spec)
        return spec

    def check(self, spec):
        if spec.device_type != "cuda" or spec.cc is None:
            return None
        rules = self.rules(spec)
        if rules is None:
            return f"nothing declared for sm {spec.cc[0]}.x ({self.describe()})"
        for r in rules:
            reason = r.check(spec)
            if reason:
                return f"on sm {spec.cc[0]}.x: {reason}"
        return None

    def describe(self):
        return "; ".join("on sm " + "/".join(f"{m}.x" for m in majors) + ": " + ", ".join(r.describe() for r in rules)
                         for majors, rules in self.table)


def plan(constraints: tuple[Constraint, ...], spec: CallSpec) -> tuple[CallSpec, str | None]:
    """Adapt ``spec`` with every rule, then check it; returns (adapted spec, reason or None)."""
    adapted = spec
    for c in constraints:
        adapted = c.adapt(adapted)
    for c in constraints:
        reason = c.check(adapted)
        if reason:
            return adapted, reason
    return adapted, None
