"""Per-call statistics: calls and time per backend, fallbacks with their reasons."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class Stats:
    calls: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)  # (from, to, reason) -> n
    errors: Counter = field(default_factory=Counter)  # (backend, error) -> n
    metrics: dict = field(default_factory=lambda: defaultdict(list))  # (backend, name) -> values
    decisions: dict = field(default_factory=dict)  # auto: signature -> text
    unreached: Counter = field(default_factory=Counter)  # (model, why) -> runs (lanes) whose attention never reached
    _cpu_time: Counter = field(default_factory=Counter)
    _events: dict = field(default_factory=lambda: defaultdict(list))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_call(self, backend: str) -> None:
        self.calls[backend] += 1

    def count_fallback(self, frm: str, to: str | None, reason: str) -> None:
        self.fallbacks[(frm, to, reason)] += 1

    def count_error(self, backend: str, error: str) -> None:
        self.errors[(backend, error)] += 1

    def count_unreached(self, model: str, why: str) -> None:
        """A run whose first model forward made no attention call that reached the override (the model's attention
        bypasses it)."""
        self.unreached[(model, why)] += 1

    def add_metrics(self, backend: str, values: dict) -> None:
        for k, v in values.items():
            self.metrics[(backend, k)].append(float(v))

    def add_time(self, backend: str, start, end) -> None:
        """``start``/``end``: CUDA events (read lazily, no sync per call) or perf_counter floats."""
        if isinstance(start, float):
            self._cpu_time[backend] += end - start
        else:
            with self._lock:
                self._events[backend].append((start, end))

    def time_ms(self) -> dict[str, float]:
        out = {k: v * 1000.0 for k, v in self._cpu_time.items()}
        with self._lock:
            pending = {k: list(v) for k, v in self._events.items()}
            self._events.clear()
        for backend, pairs in pending.items():
            if pairs:
                pairs[-1][1].synchronize()
            ms = sum(s.elapsed_time(e) for s, e in pairs)
            self._cpu_time[backend] += ms / 1000.0
            out[backend] = out.get(backend, 0.0) + ms
        return out

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_fallbacks(self) -> int:
        return sum(self.fallbacks.values())

    @classmethod
    def merged(cls, parts: list[Stats]) -> Stats:
        """One Stats holding the sums of ``parts`` (the lanes of several devices), read at report time."""
        out = cls()
        for p in parts:
            for name, ms in p.time_ms().items():
                out._cpu_time[name] += ms / 1000.0
            out.calls.update(p.calls)
            out.fallbacks.update(p.fallbacks)
            out.errors.update(p.errors)
            out.unreached.update(p.unreached)
            for key, vals in p.metrics.items():
                out.metrics[key].extend(vals)
            out.decisions.update(p.decisions)
        return out

    def reset(self) -> None:
        self.time_ms()
        self.calls.clear()
        self.fallbacks.clear()
        self.errors.clear()
        self.unreached.clear()
        self.metrics.clear()
        self._cpu_time.clear()  # decisions stay: they describe what `auto` chose, which still holds

    def as_dict(self) -> dict:
        times = self.time_ms()
        return {
            "calls": dict(self.calls),
            "time_ms": {k: round(v, 3) for k, v in times.items()},
            "fallbacks": [
                {"from": f, "to": t, "reason": r, "count": n} for (f, t, r), n in self.fallbacks.items()
            ],
            "errors": [{"backend": b, "error": e, "count": n} for (b, e), n in self.errors.items()],
            "unreached": [{"model": m, "why": w, "runs": n} for (m, w), n in self.unreached.items()],
            "metrics": {
                f"{b}.{k}": {"mean": sum(v) / len(v), "n": len(v)} for (b, k), v in self.metrics.items() if v
            },
            "auto": dict(self.decisions),
        }

    def summary(self) -> str:
        d = self.as_dict()
        lines = ["attention calls per backend:"]
        for name, n in sorted(d["calls"].items(), key=lambda x: -x[1]):
            t = d["time_ms"].get(name)
            lines.append(f"  {name:<24} {n:>8} calls" + (f"  {t:10.1f} ms" if t is not None else ""))
        if not d["calls"]:
            lines.append("  (none)")
        if d["fallbacks"]:
            lines.append("fallbacks:")
            for f in d["fallbacks"]:
                lines.append(f"  {f['from']} -> {f['to']}: {f['reason']} ({f['count']}x)")
        for u in d["unreached"]:
            lines.append(f"attention not reached: {u['model']}: {u['why']}")
        for key, m in d["metrics"].items():
            lines.append(f"  {key}: mean {m['mean']:.4f} over {m['n']} calls")
        from .auto import EXACT_SUFFIX, FAST_SUFFIX

        for sig, why in d["auto"].items():
            who = "auto_exact" if sig.endswith(EXACT_SUFFIX) else "auto_fast" if sig.endswith(FAST_SUFFIX) else "auto"
            lines.append(f"  {who} {sig}: {why}")
        return "\n".join(lines)


def cuda_event():
    return torch.cuda.Event(enable_timing=True)
