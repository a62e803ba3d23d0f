"""Lanes: what the calls of one sampling thread on one device change, and the statistics of all of them.

ComfyUI samples a model's conds on several GPUs at once, one thread per GPU (MultiGPU CFG Split), all through one
override (model options are deep-copied, the override is shared).  Everything a call changes lives in its sampling
thread's *lane*, one per (device, thread): the layer counter and the forward's state, the dispatcher's config
(statistics, per-shape plans, deferred NaN flags), ``auto``'s choices and the lean entries.  A lane whose thread has
ended is taken over by the next thread on its device (ComfyUI starts new worker threads for each run).  Statistics are
merged over the lanes for the report.
"""

from __future__ import annotations

import dataclasses
import threading

from ..attention import AUTO_EXACT, REFERENCE, AttentionConfig
from ..attention.stats import Stats


class Lane:
    """What the calls of one sampling thread on one device change (see the module's docstring)."""

    def __init__(self, config: AttentionConfig, device, thread: int):
        self.config = config
        # the calls Patch Attention leaves dense: the fastest exact kernel for their shape (this lane's exact selector,
        # shared with the config's fallbacks); PyTorch's SDPA where there is none (ComfyUI's own function is chosen)
        self.dense = AttentionConfig(backend=AUTO_EXACT if config.exact_selector is not None else REFERENCE, exact_selector=config.exact_selector,
                                     stats=config.stats, check_finite=False)
        self.calls = config.stats.calls  # the Counter itself (reset clears it in place): one lookup on the hot path
        self.device = device
        self.thread = thread
        self.layer = 0  # attention call index within the current model forward
        self.active = None  # step schedule for the current forward (None: not in a forward, read sigma per call)
        # this forward checks auto's lossy choices against dense attention: "first"/"sparse-start"/"mid"/"last"
        self.check_phase = None
        self.check_round = 0  # check forwards so far (each compares other query rows)
        self.phases_run = set()  # the phases (sparse_ok) auto's calls have run in this run
        self.probes = []  # this forward's accuracy checks, their sums on the device (recheck.probe)
        self.gate_seen = 0  # the rechecks' gate_version this lane's cached calls were made under
        self.first_forward = True
        self.lean = {}  # call key -> entry(func, args, kwargs, layer), or False: this shape takes the full path
        self.host = ()  # ComfyUI's exact attention function once seen (the hot path compares identity)
        self.audited = set()  # call kinds whose first call was compared with dense
        self.checked = set()  # (phase, signature) re-checked this run
        self.layer_calls = {}  # layer -> calls of it this run (the sparse report's error every N calls)
        self.dense_cache = {}  # layer -> in dense_layers
        self.refused = {}  # call shape -> why the explicit backend cannot take it (None: it can), over a previous override

    def start_run(self) -> None:
        cfg = self.config
        cfg.stats.reset()
        cfg.take_nonfinite()
        self.layer_calls = {}
        self.checked = set()
        self.probes = []
        self.phases_run = set()
        self.lean.clear()
        self.first_forward = True
        cfg.sparse_ok = True
        if cfg.auto is not None:
            cfg.auto.demoted.clear()
            cfg._fast.clear()

    def count_layer(self, layer: int) -> int:
        """Calls of ``layer`` in this run before this one."""
        n = self.layer_calls.get(layer, 0)
        self.layer_calls[layer] = n + 1
        return n


class Lanes:
    """The lanes of one override, by (device, thread); the first lane runs ``config`` itself, the others a copy."""

    def __init__(self, config: AttentionConfig):
        self.config = config
        self.check_finite = config.check_finite  # what each lane's config starts with (the NaN net toggles it)
        self.tls = threading.local()  # .lane: this thread's lane (the hot path reads it)
        self._lanes: list[Lane] = []
        self._lock = threading.Lock()

    def lane(self, device=None) -> Lane:
        """This thread's lane (on ``device``, when given: a thread that moves to another device gets that device's)."""
        ln = getattr(self.tls, "lane", None)
        if ln is not None and (device is None or ln.device == device):
            return ln
        return self._enter(device if device is not None else (ln.device if ln is not None else None))

    def _enter(self, device) -> Lane:
        me = threading.get_ident()
        with self._lock:
            ln = next((x for x in self._lanes if x.device == device and x.thread == me), None)
            if ln is None:
                alive = {t.ident for t in threading.enumerate()}
                ln = next((x for x in self._lanes if x.device == device and x.thread not in alive), None)
                if ln is not None:
                    ln.thread = me  # a new worker thread for this device (ComfyUI starts them per run)
            if ln is None:
                ln = Lane(self.config if not self._lanes else self._lane_config(), device, me)
                self._lanes.append(ln)
        self.tls.lane = ln
        return ln

    def _lane_config(self) -> AttentionConfig:
        """A config like the first lane's, with statistics, plans, NaN flags and ``auto``'s choices of its own."""
        base = self.config

        def own(sel):  # what auto refused stays shared by the lanes (``refused``: the same dict)
            return sel and dataclasses.replace(sel, decisions={}, reports={}, demoted={}, tune_ms=0.0, _loaded=False)

        return dataclasses.replace(base, stats=Stats(), auto=own(base.auto), exact_selector=own(base.exact_selector), in_forward=False,
                                   check_finite=self.check_finite)

    def all(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes)

    def start_run(self) -> None:
        lanes = self.all()
        for ln in lanes:
            ln.start_run()
        if not lanes:
            self.config.stats.reset()

    @property
    def stats(self) -> Stats:
        """The statistics of every lane (every device of a MultiGPU split), merged."""
        lanes = self.all()
        if len(lanes) <= 1:
            return self.config.stats
        return Stats.merged([ln.config.stats for ln in lanes])
