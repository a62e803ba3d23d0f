"""Statistics of the benchmarks' timings and the quality columns derived from a run's rows.

- :func:`spread`: a row's times over rounds as median and range (the kernel benchmark's cells);
- :func:`median_ci` and :func:`paired_ratio`: a distribution-free interval for a median, and per-round ratios of two
  rows timed in the same rounds (drift of a shared machine cancels);
- :func:`add_paired`: those ratios for the end-to-end benchmark's rows (against unpatched, a kernel against its peer,
  a selector against the best row it could have been);
- :func:`add_floor`: the exact-kernel floor beside every row's PSNR.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

from ..attention import AUTO_EXACT
from .quality import verdict
from .rows import KERNEL, PEER, SELECTOR, UNPATCHED, parse


class Spread(NamedTuple):
    """A timing over rounds: the median and the range it spread over (min, max), and how many rounds."""

    median: float
    low: float
    high: float
    rounds: int

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


def spread(xs) -> Spread:
    xs = list(xs)
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs))


def median_ci(xs, conf: float = 0.95):
    """(median, low, high): the median of ``xs`` and a distribution-free interval for it (order statistics whose ranks
    the binomial(n, 1/2) distribution puts around the middle with at least ``conf`` coverage; the whole range when n
    is too small for that)."""
    xs = sorted(xs)
    n = len(xs)
    med = statistics.median(xs)
    lo, tail = 0, 0.0  # largest lo with P(Binom(n, 1/2) < lo + 1) <= (1 - conf) / 2, counting ranks from 0
    for j in range(n // 2):
        tail += math.comb(n, j) / 2**n
        if tail > (1 - conf) / 2:
            break
        lo = j + 1
    lo = min(lo, (n - 1) // 2)
    return (med, xs[lo - 1], xs[n - lo]) if lo else (med, xs[0], xs[-1])


def paired_ratio(ref_times, row_times, conf: float = 0.95):
    """Speed of a row against a reference row (>1: faster) from the rounds they shared, each ratio taken within one
    round (rows run in turn, so drift of a shared machine cancels): (median, low, high) of ``ref / row``."""
    return median_ci([a / b for a, b in zip(ref_times, row_times)], conf)


def add_paired(out_rows, rows, times) -> None:
    """Per-round paired ratios with 95 % intervals (``paired``): every row against unpatched; a Patch Attention kernel
    row against its peer; a selector (``auto``) against the fastest of unpatched and the explicit kernel rows,
    ``auto_exact`` against the fastest of unpatched and the explicit exact kernel rows (``best_row``)."""
    explicit = [r for r in times if parse(r).role == KERNEL]
    exact = [r for r in explicit if parse(r).exact]
    for x, row in zip(out_rows, rows):
        if row not in times or UNPATCHED not in times:
            continue
        p = {"vs_unpatched": paired_ratio(times[UNPATCHED], times[row])}
        if PEER + row in times:
            p["vs_peer"] = paired_ratio(times[PEER + row], times[row])
        if parse(row).role == SELECTOR:  # the row with the best median (a per-round minimum would favour many rows)
            rivals = exact if row == AUTO_EXACT else explicit
            best = min([UNPATCHED, *rivals], key=lambda r: statistics.median(times[r]))
            p["vs_best"] = paired_ratio(times[best], times[row])
            x["best_row"] = best
        x["paired"] = {k: [round(v, 4) for v in val] for k, val in p.items()}


def add_floor(out_rows) -> None:
    """The exact-kernel floor beside every row's PSNR: against an fp32 reference, the worst PSNR of the exact rows
    (what half-precision rounding alone costs); against the unpatched row, the PSNR of the other exact rows (two exact
    kernels' difference).  Each row gets ``floor_psnr`` and ``quality`` (:func:`.quality.verdict`)."""
    measured = [r for r in out_rows if "psnr" in r]
    if not measured:
        return
    ref_is_row = measured[0].get("reference") == UNPATCHED
    exact = [r for r in measured if r.get("exact") and not (ref_is_row and r["row"].startswith(UNPATCHED))]
    floor = min((r["psnr"] for r in exact), default=None)
    for r in measured:
        r["floor_psnr"] = floor
        r["quality"] = verdict(r["psnr"], floor) if floor is not None else "no exact row besides the reference: no floor"
