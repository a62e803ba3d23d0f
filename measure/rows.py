"""The rows of the end-to-end benchmark: what a row's name means, written once as a table.

A row is one way of running a model's attention, named as a user types it (the node's ``rows`` input, bench_e2e.py's
``--rows``). :data:`ROW_KINDS` holds every kind, matched in order; everything else (building the row's model,
checking a typed list, the rows ``all`` means, exactness and sparsity, which rows a paired comparison or a target
takes, the colours of the pictures) reads it. Adding a kind of row is one :class:`RowKind` entry here (a core node: one
entry in :mod:`.core_nodes`) plus its test.

- ``unpatched``: ComfyUI's own attention, the row every ratio is against;
- ``<kernel>[key=value ...]``: a sparse backend with its options or a tuned profile (``profile=NAME``);
- ``core:<name>``: one of ComfyUI's own attention nodes (:mod:`.core_nodes`);
- ``peer:<kernel>``: the kernel called straight from ComfyUI's hook, as other packs do (:mod:`.peer`);
- ``<kernel>/no-nan-net``: a backend with its NaN net off (what the net costs);
- ``auto``, ``auto_exact``, ``auto_fast``: Patch Attention's selectors;
- ``<kernel>``: Patch Attention with that backend.

A row run under torch.compile is named ``<row> +compile`` in results.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..attention import AUTO, AUTO_EXACT, AUTOS, REGISTRY
from ..nodes.patch import SPARSE_START, SparseSettings, patch_model
from . import core_nodes
from .peer import peer_override

UNPATCHED = "unpatched"
PEER = "peer:"
NO_NAN_NET = "/no-nan-net"  # row suffix: the backend with its NaN net off, to measure what the net costs
COMPILED = " +compile"  # a row's name in results when it ran under torch.compile
CORE_ROWS = tuple(core_nodes.CORE_NODES)
CORE_INT8, CORE_SOL = CORE_ROWS
AUTO_ROWS = ("auto", "auto_fast")  # the selectors a user picks for speed (auto_exact: exact kernels only)

# What a row is for (RowKind.role): the comparisons and pictures read these, never row names.
BASELINE = "baseline"  # ComfyUI's own attention: every ratio is against it
KERNEL = "kernel"  # Patch Attention with one backend (with options or not): the explicit choices
SELECTOR = "selector"  # auto, auto_exact, auto_fast
PEER_ROLE = "peer"  # a kernel called the way other packs call it
VARIANT = "variant"  # a backend with a part of Patch Attention switched off
CORE = "core"  # ComfyUI's own attention nodes

ROW_OPTIONS = re.compile(r"^([A-Za-z0-9_]+)\[([^\[\]]*)\]$")


def _usable() -> list[str]:
    return [b.name for b in REGISTRY.backends() if b.available and b.timed]


def _kernel_exact(name: str) -> bool:
    return name in REGISTRY and not REGISTRY.get(name).quantized


def _kernel_sparse(name: str) -> bool:
    return name in REGISTRY and REGISTRY.get(name).sparse


def _patched(model, row: str, profiles):
    return patch_model(model, row, auto_retune=True, sparse_start_percent=SPARSE_START), None


def _with_options(model, row: str, profiles):
    base, opts = parse_row(row)
    return patch_model(model, base, auto_retune=True, sparse=row_settings(base, opts, profiles),
                       sparse_start_percent=SPARSE_START), None


def _without_net(model, row: str, profiles):
    return patch_model(model, row[: -len(NO_NAN_NET)], auto_retune=True, check_finite=False,
                       sparse_start_percent=SPARSE_START), None


def _peer(model, row: str, profiles):
    m = model.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = peer_override(row[len(PEER):])
    return m, row[len(PEER):]


@dataclass(frozen=True)
class RowKind:
    """One kind of row: how its name reads, how its model is built, what it is for."""

    name: str
    syntax: str  # how a user writes one (the unknown-row error lists these)
    role: str  # BASELINE, KERNEL, SELECTOR, PEER_ROLE, VARIANT or CORE
    claims: Callable[[str], bool]  # a row's name is of this kind (kinds are tried in order)
    build: Callable  # (model, row, profiles) -> (clone, note: what ran where no override counts it, or None)
    kernel: Callable[[str], str] = lambda row: row  # the kernel the row runs (for exactness and sparsity)
    known: Callable[[str], bool] = lambda row: True  # the name is one this kind can run (else: an unknown row)
    in_all: Callable[[bool], list] = lambda peers: []  # the rows of this kind that ``all`` means (peers: with peers)
    all_order: int = 0  # where those rows come in ``all`` (ascending)
    exact: Callable[[str], bool] = _kernel_exact  # of the kernel: its attention is exact (rounding only)
    sparse: Callable[[str], bool] = _kernel_sparse  # of the kernel: it skips attention mass


ROW_KINDS = (
    RowKind("unpatched", UNPATCHED, BASELINE, lambda r: r == UNPATCHED,
            lambda model, row, profiles: (model.clone(), "ComfyUI attention"),
            in_all=lambda peers: [UNPATCHED], all_order=0, exact=lambda k: True, sparse=lambda k: False),
    RowKind("options", "a sparse backend with options, e.g. kitchen_sol[tau=2.0] or sparge[profile=NAME]", KERNEL,
            lambda r: ROW_OPTIONS.match(r) is not None, _with_options, kernel=lambda r: parse_row(r)[0],
            known=lambda r: parse_row(r)[0] in REGISTRY),
    RowKind("core", ", ".join(CORE_ROWS), CORE, lambda r: r in core_nodes.CORE_NODES,
            lambda model, row, profiles: core_nodes.apply(model, row),
            in_all=lambda peers: [r for r in CORE_ROWS if core_nodes.missing(r) is None], all_order=3,
            exact=lambda k: False, sparse=lambda k: core_nodes.CORE_NODES[k].sparse),
    RowKind("peer", PEER + "<backend>", PEER_ROLE, lambda r: r.startswith(PEER), _peer,
            kernel=lambda r: r[len(PEER):], known=lambda r: r[len(PEER):] in REGISTRY,
            in_all=lambda peers: [PEER + n for n in _usable() if REGISTRY.get(n).family != "sdpa"] if peers else [],
            all_order=4),
    RowKind("no-nan-net", "<backend>" + NO_NAN_NET, VARIANT, lambda r: r.endswith(NO_NAN_NET), _without_net,
            kernel=lambda r: r[: -len(NO_NAN_NET)], known=lambda r: r[: -len(NO_NAN_NET)] in REGISTRY),
    RowKind("selector", ", ".join(AUTOS), SELECTOR, lambda r: r in AUTOS, _patched,
            in_all=lambda peers: [AUTO, AUTO_EXACT], all_order=2, exact=lambda k: False, sparse=lambda k: False),
    RowKind("backend", "a backend name", KERNEL, lambda r: True, _patched, known=lambda r: r in REGISTRY,
            in_all=lambda peers: _usable(), all_order=1),
)


@dataclass(frozen=True)
class Row:
    """A row's name read: its kind and the kernel it runs."""

    name: str  # without " +compile"
    kind: RowKind
    kernel: str

    @property
    def role(self) -> str:
        return self.kind.role

    @property
    def exact(self) -> bool:
        return self.kind.exact(self.kernel)

    @property
    def sparse(self) -> bool:
        return self.kind.sparse(self.kernel)


def parse(row: str) -> Row:
    """``row`` (a name as typed, or as results name it, `` +compile`` included) read against :data:`ROW_KINDS`."""
    name = row.strip().replace(COMPILED, "")
    kind = next(k for k in ROW_KINDS if k.claims(name))
    return Row(name, kind, kind.kernel(name))


def role_of(row: str) -> str:
    return parse(row).role


def is_exact_row(row: str) -> bool:
    """A row whose attention is exact (half-precision rounding only): unpatched, an exact backend, its peer."""
    return parse(row).exact


def is_sparse_row(row: str) -> bool:
    """A row whose kernel skips attention mass (SpargeAttn, Sol-Attn, top-k; core's Model Sparse Attention)."""
    return parse(row).sparse


def parse_row(row: str) -> tuple[str, dict]:
    """``"kitchen_sol[tau=2.0 extra_tokens=128]"`` -> ("kitchen_sol", {"tau": 2.0, "extra_tokens": 128}); a row without
    brackets -> (row, {}).  ``profile=NAME`` names a tuned per-layer profile (Tune Sparse Attention's file in
    models/sparge_profiles)."""
    m = ROW_OPTIONS.match(row.strip())
    if m is None:
        return row, {}
    opts = {}
    for part in m.group(2).split():
        key, eq, val = part.partition("=")
        if not eq or not key or not val:
            raise ValueError(f"row {row!r}: cannot read {part!r}; use name[key=value key=value]")
        if key == "profile":
            opts[key] = val
            continue
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"row {row!r}: {key}={val!r} is not a number") from None
        opts[key] = int(num) if num.is_integer() and key in ("extra_tokens", "min_tokens", "pvthreshd") else num
    return m.group(1), opts


def read_profile(path: str, variant: str):
    """A row's ``profile=PATH``: the per-layer profile Tune Sparse Attention wrote at PATH, which must be ``variant``'s
    (None for an empty PATH)."""
    from ..attention.sparge_profile import SpargeProfile

    if not path:
        return None
    prof = SpargeProfile.load(path)
    if prof.variant != variant:
        raise ValueError(f"profile {path} was tuned for {prof.variant}, the row selects {variant}")
    return prof


def row_settings(backend: str, opts: dict, profiles=None):
    """The sparse-attention settings a row's options make (what a SpargeAttn / Sol-Attn Settings node would give).
    ``profiles(name, variant)`` reads a ``profile=`` option (default :func:`read_profile`: the name is a path)."""
    from ..attention.sparge_profile import VARIANTS, check_thresholds, default_options

    if backend not in VARIANTS:
        raise ValueError(f"row options are for the sparse backends ({', '.join(VARIANTS)}), not {backend}")
    rest = {k: v for k, v in opts.items() if k != "profile"}
    options = check_thresholds(backend, {**default_options(backend), **rest})
    return SparseSettings(backend, options, (profiles or read_profile)(opts.get("profile", ""), backend))


def build_row(model, row: str, profiles=None):
    """``(clone, note)``: a clone of ``model`` for ``row`` (see :data:`ROW_KINDS`), and what ran where no Patch Attention
    override counts it (ComfyUI attention, the peer's kernel, the core node), else None. ``profiles`` reads a
    ``profile=`` option (:func:`row_settings`). :class:`.core_nodes.RowUnavailable` for a row that cannot run here."""
    r = parse(row)
    return r.kind.build(model, r.name, profiles)


def make_row_model(model, row: str, profiles=None):
    """A clone of ``model`` for ``row`` (:func:`build_row` without the note)."""
    return build_row(model, row, profiles)[0]


def default_rows(peers=True) -> list[str]:
    """What ``all`` means: unpatched, every timed backend usable here (``Backend.timed``: not the slow math
    reference), auto, auto_exact, the rows of ComfyUI's own attention nodes that run here, and a peer row per non-SDPA
    kernel."""
    return [row for kind in sorted(ROW_KINDS, key=lambda k: k.all_order) for row in kind.in_all(peers)]


def rows_from_text(text: str, peers: bool = True) -> list[str]:
    """The rows a comma-separated list names (the node's ``rows`` input), checked; ``all`` or nothing: :func:`default_rows`."""
    chosen = [r.strip() for r in text.replace(";", ",").split(",") if r.strip() and r.strip() != "all"]
    unknown = [r for r in chosen if not parse(r).kind.known(r)]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; use " + ", ".join(k.syntax for k in ROW_KINDS))
    return chosen or default_rows(peers=peers)
