"""Split forwards replayed as CUDA graphs (parallel/graphs.py, the Context Parallel node's GraphWrapper) on the CPU.

A CUDA graph needs a GPU; here a stand-in with its interface records every operation of a piece (a dispatch mode) and
runs them again, into the tensors it recorded, at each replay: what a graph does, on the CPU.  So the node's pieces and
islands are what is tested -- which work a replay skips, what it runs again, with which forward's values -- on 2, 3 and
4 simulated ranks; that real graphs record the same work is checked on GPUs (tests/gpu/run.sh stage ``multigpu-graphs``: latents bit for bit).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import importlib
import logging
import sys
import threading
import types
import weakref

import pytest
import torch
from test_context_parallel import _case, _split, rel_l1, work_floor_when_simulated
from test_cp_qwen_image import _qwen_case
from torch.utils._python_dispatch import TorchDispatchMode

zoo = importlib.import_module("test_context_parallel").zoo  # the fixture


class _Recorder(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _same_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _into(dst, src):
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        if not _same_memory(dst, src):  # an in-place operation or a view wrote (or is) the recorded tensor already
            dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _into(d, s)


class RecordedGraph:
    """``torch.cuda.CUDAGraph``'s interface on the CPU.  Capture runs and records each operation (a CUDA capture records
    without running: the first replay after a capture is therefore a no-op here); a replay runs them again on the
    recorded tensors, writing into the recorded outputs, with none of the Python that made them."""

    replays = 0
    graphs = 0

    def capture_begin(self, pool=None, capture_error_mode=None):
        self.ops, self.fresh = [], True
        self.mode = _Recorder(self.ops)
        self.mode.__enter__()
        RecordedGraph.graphs += 1

    def capture_end(self):
        self.mode.__exit__(None, None, None)

    def replay(self):
        if self.fresh:
            self.fresh = False
            return
        RecordedGraph.replays += 1
        for func, args, kwargs, out in self.ops:
            _into(out, func(*args, **kwargs))


class FailingGraph(RecordedGraph):
    """A graph whose capture fails as CUDA's does where a piece makes a tensor on the CPU."""

    def capture_begin(self, pool=None, capture_error_mode=None):
        raise RuntimeError("operation not permitted when stream is capturing")


def _node(mod):
    return importlib.import_module(mod.__name__ + ".nodes.context_parallel")


def graphed(mod, model, n, graph_type=RecordedGraph, graphs=True):
    """``model`` split over ``n`` simulated ranks whose split forwards replay on ``graph_type`` graphs."""
    m = _split(mod, model, n)
    cp = m.wrappers["sampler_sample"][_node(mod).WRAPPER_KEY][0].cp
    cp.graph_type, cp.graphs = graph_type, graphs
    return m


CASES = [("Flux", None), ("FluxSchnell", None), ("Flux2", None), ("QwenImage", "t2i"), ("QwenImage", "edit-2511"),
         ("WAN21_T2V", None)]


def sample(z, model, case):
    """As ComfyUI samples: in inference mode (a run with gradients on keeps its forwards eager)."""
    with torch.inference_mode():
        return z.sample(model, case)


def _build(z, name, config):
    if config is None:
        cls, case = _case(z, name)
    else:
        name, case = _qwen_case(z, config)
        import comfy.supported_models as sm

        cls = getattr(sm, name)
    return z.build(cls, z.with_(case, steps=4)), z.with_(case, steps=4)


@pytest.mark.comfyui
@pytest.mark.parametrize("name,config", CASES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_replayed_graphs_give_the_eager_split_latent_bit_for_bit(zoo, caplog, name, config, n):
    """4 steps: the first forward of its shapes runs eagerly, the second is recorded, the last two replay; the latent
    is the eager split's bit for bit (the same operations on the same values) and the one-device latent's."""
    z, mod, _ = zoo
    base, case = _build(z, name, config)
    ref = sample(z, base, case)
    eager = sample(z, graphed(mod, base, n, graphs=False), case)
    RecordedGraph.replays = RecordedGraph.graphs = 0
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"):
        out = sample(z, graphed(mod, base, n), case)
    assert torch.equal(out, eager)
    assert rel_l1(out, ref) < 1e-5
    assert RecordedGraph.replays > 0
    said = [r.getMessage() for r in caplog.records if "forwards split" in r.getMessage()]
    assert said and "3 of them replayed as CUDA graphs" in said[-1], said


@pytest.mark.comfyui
def test_a_replay_skips_the_models_python_and_runs_every_attention_call(zoo, monkeypatch):
    """What replays is the graphs and the islands: the model's blocks are not called again (their Python is in the
    graphs), every attention call is, on every rank, in the forward's own order."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    dm = base.model.diffusion_model
    blocks = [0]
    for b in (*dm.double_blocks, *dm.single_blocks):
        forward = b.forward

        def counted(*a, _f=forward, **k):
            blocks[0] += 1
            return _f(*a, **k)

        monkeypatch.setattr(b, "forward", counted)
    n = 3
    m = graphed(mod, base, n)
    hook = m.model_options["transformer_options"]["optimized_attention_override"]
    calls = [0]
    route = type(hook)._route

    def counting(self, *a, **k):
        calls[0] += 1
        return route(self, *a, **k)

    monkeypatch.setattr(type(hook), "_route", counting)
    sample(z, m, case)
    per_forward = len(dm.double_blocks) + len(dm.single_blocks)
    # every rank runs its blocks in the eager forward and the recorded one; none in the two replayed
    assert blocks[0] == 2 * n * per_forward
    # every attention call of every forward, replayed or not (one joint call per block)
    assert calls[0] == 4 * n * per_forward


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 4])
def test_a_replay_hands_its_own_steps_sigma_to_patch_attention(zoo, n):
    """Patch Attention's kernel between 40 % and 100 % of the run, exact elsewhere: the choice is taken per call from
    the forward's sigma, so each replayed step must see its own (the lanes count the same calls as the eager split)."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    patch = mod.nodes.patch.patch_model

    def counts(graphs):
        m = graphed(mod, patch(base, "sdpa_math", start_percent=0.4, end_percent=1.0, log_stats=True), n,
                    graphs=graphs)
        ov = m.model_options["transformer_options"]["optimized_attention_override"].inner
        out = sample(z, m, case)
        return out, sorted(sorted(dict(ln.config.stats.calls).items()) for ln in ov.lanes())

    eager, eager_calls = counts(False)
    out, calls = counts(True)
    assert torch.equal(out, eager)
    assert calls == eager_calls
    assert len({k for lane in calls for k, _ in lane}) == 2  # two kinds of calls: the kernel's and the exact ones


@pytest.mark.comfyui
@pytest.mark.parametrize("what", ["weight", "module"])
@pytest.mark.parametrize("n", [2, 3])
def test_weights_put_in_place_of_others_during_a_run_are_recorded_again(zoo, caplog, n, what):
    """ComfyUI's hooks may patch weights between steps by putting new tensors in place of the old (or a node a new
    layer in place of one): a replay would read the old ones, so the forward is recorded again (the latent is the eager
    split's with the same change), and the log says how many weights moved, once."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    dm = base.model.diffusion_model
    attn = dm.double_blocks[0].img_attn

    def sampled(graphs, swap=True):
        layer = attn.qkv
        original = layer.weight
        seen, lock = [0], threading.Lock()

        def swapped(module, args):  # after two steps (every rank's forward), a new weight in the old one's place
            with lock:  # the ranks' threads
                seen[0] += 1
                if swap and seen[0] == 2 * n + 1:
                    if what == "weight":
                        layer.weight = torch.nn.Parameter(original.detach() * 1.5, requires_grad=False)
                    else:
                        new = copy.deepcopy(layer)
                        new.weight.data.mul_(1.5)
                        attn.qkv = new

        hook = dm.register_forward_pre_hook(swapped)
        try:
            RecordedGraph.graphs = 0
            return sample(z, graphed(mod, base, n, graphs=graphs), case), RecordedGraph.graphs
        finally:
            hook.remove()
            attn.qkv = layer
            layer.weight = original

    eager, _ = sampled(False)
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"):
        out, graphs = sampled(True)
    assert torch.equal(out, eager)
    said = [r.getMessage() for r in caplog.records if "recorded again" in r.getMessage()]
    if what == "weight":
        kib = f"{attn.qkv.weight.numel() * attn.qkv.weight.element_size() / 1024:,.1f} KiB"
        assert said == [f"Context Parallel: 1 of the model's {len(list(dm.parameters()))} weights ({kib}) are elsewhere "
                        "than where its CUDA graphs read them: recorded again"], said
    else:
        assert said == ["Context Parallel: some of the model's modules were replaced since its CUDA graphs were "
                        "recorded: recorded again"], said
    _, once = sampled(True, swap=False)
    assert graphs == 2 * once  # every rank recorded its forward again after the swap


@pytest.mark.comfyui
def test_a_graph_that_cannot_be_recorded_leaves_the_run_eager_and_says_so_once(zoo, caplog):
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    ref = sample(z, graphed(mod, base, 2, graphs=False), case)
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"):
        out = sample(z, graphed(mod, base, 2, graph_type=FailingGraph), case)
    assert torch.equal(out, ref)
    said = [r.getMessage() for r in caplog.records if "could not run as CUDA graphs" in r.getMessage()]
    assert len(said) == 1 and "operation not permitted when stream is capturing" in said[0]
    done = [r.getMessage() for r in caplog.records if "forwards split" in r.getMessage()]
    assert "CUDA graphs" not in done[-1]


class _Model:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.comfyui
def test_weights_that_move_during_a_run_keep_it_eager(zoo):
    """A graph replays the addresses it recorded: a model ComfyUI's estimate-based loader partly offloads runs without
    graphs, and so does a family that does not offer them; dynamic VRAM is checked forward by forward."""
    z, mod, _ = zoo
    node = _node(mod)
    base, _ = _build(z, "Flux", None)
    cp = graphed(mod, base, 2).wrappers["sampler_sample"][node.WRAPPER_KEY][0].cp
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]

    def why(model, devices=cuda, graph_type=RecordedGraph):
        cp.graph_type = graph_type
        return node.graphs_off(cp, [[(d, model) for d in devices]])

    assert why(_Model()) == ""
    assert "part of the model's weights" in why(_Model(model_lowvram=True))
    assert why(_Model(dynamic_vbars={cuda[0]: object()})) == ""  # checked at each forward (below)
    assert why(_Model(), devices=[torch.device("cpu")] * 2, graph_type=None) == "not on CUDA GPUs"
    # PyTorch's cudaMallocAsync allocator (ComfyUI's default) stopped the process recording split forwards
    node_async = node._async_allocator
    try:
        node._async_allocator = lambda: True
        assert why(_Model(), graph_type=None) == node.ASYNC_ALLOCATOR
        assert "--disable-cuda-malloc" in node.ASYNC_ALLOCATOR
        assert why(_Model()) == ""  # a stand-in graph records no CUDA memory
    finally:
        node._async_allocator = node_async
    cp.graphs = False
    assert why(_Model()) == "off"
    families = importlib.import_module(mod.__name__ + ".parallel.families")
    vace = node.ContextParallel(families.BY_CLASS["VaceWanModel"])
    assert "not replayed as graphs" in node.graphs_off(vace, [[(d, _Model()) for d in cuda]])


class _Space:
    """comfy-aimdo's virtual address space of a model's weights, as the node uses it: ranges held (``fault``, with the
    signature of their pages) and let go (``unpin``).  ``move_at``: the fault from which its pages are other pages (the
    memory was taken back and mapped again); ``full``: no memory to map them (``fault`` gives None)."""

    def __init__(self, move_at=None, full=False):
        self.move_at, self.full = move_at, full
        self.faults = self.pins = 0
        self.lock = threading.Lock()

    def fault(self, addr, size):
        if self.full:
            return None
        with self.lock:  # every GPU's thread
            self.faults += 1
            self.pins += 1
            moved = self.move_at is not None and self.faults >= self.move_at
        return (ctypes.c_uint32 * 2)(int(moved), 7)

    def unpin(self, addr, size):
        with self.lock:
            self.pins -= 1


@contextlib.contextmanager
def _in_space(model, space):
    """Every weight of ``model``'s diffusion model given a range of ``space`` while the block runs, as ComfyUI's dynamic
    VRAM does (``module._v``: the space, an address, bytes; 512-byte aligned, one after the other)."""
    addr = 1 << 20
    modules = list(model.model.diffusion_model.modules())
    for m in modules:
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            n = w.numel() * w.element_size()
            m._v = (space, addr, n)
            addr += (n + 511) // 512 * 512
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop("_v", None)


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", ["held", "moved", "full"])
def test_dynamic_vram_weights_are_held_for_each_replay_or_the_run_goes_on_without_graphs(zoo, caplog, n, case):
    """Under ComfyUI's dynamic VRAM a forward's weights are held where its graphs read them (every range in one piece)
    for the recording and each replay, and let go after; where the pages are no longer those the recording read, or
    cannot be mapped, every GPU runs that forward and the rest of the run without graphs, and the log says so.  The
    latent is the eager split's either way."""
    z, mod, _ = zoo
    base, case_ = _build(z, "Flux", None)
    eager = sample(z, graphed(mod, base, n, graphs=False), case_)
    space = _Space(move_at=n + 1 if case == "moved" else None, full=case == "full")  # moved: at the first replay
    m = graphed(mod, base, n)
    RecordedGraph.replays = 0
    with _in_space(m, space), caplog.at_level(logging.INFO, logger="patch_attention.parallel"):
        out = sample(z, m, case_)
    assert torch.equal(out, eager)
    assert space.pins == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    if case == "held":
        assert space.faults == 3 * n  # the recorded forward and the two replayed, on every GPU: one range each
        assert RecordedGraph.replays > 0 and "3 of them replayed as CUDA graphs (1 recorded)" in said
        assert "dynamic VRAM" not in said
    else:  # moved: the recorded forward, then none; full: none recorded
        assert RecordedGraph.replays == 0
        assert ("1 of them replayed as CUDA graphs" in said) == (case == "moved")
        assert "ComfyUI's dynamic VRAM moved or could not hold the model's weights on a GPU: the rest of the run " \
               "without CUDA graphs" in said


def test_the_allocator_is_read_from_pytorch_or_from_its_setting(zoo, monkeypatch):
    """Which allocator PyTorch's CUDA memory comes from: PyTorch says, once it runs; before, its setting
    (PYTORCH_CUDA_ALLOC_CONF, where ComfyUI puts backend:cudaMallocAsync); no CUDA, none."""
    _, mod, _ = zoo
    node = _node(mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert node._async_allocator()
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert not node._async_allocator()

    def not_started():
        raise RuntimeError("no CUDA allocator yet")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", not_started)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,backend:cudaMallocAsync")
    assert node._async_allocator()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not node._async_allocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert not node._async_allocator()


def test_an_islands_arguments_are_bound_to_each_replays_context_by_a_function_built_once():
    """What a replay hands an island: the recorded arguments with this forward's context and transformer_options in
    place of the recording's marks, its dicts and lists new each time (an island may change them), its plain tuples
    (tensors, numbers) as they are."""
    from comfyui_support import load_pack

    mod, _ = load_pack()
    G = importlib.import_module(mod.__name__ + ".parallel.graphs")
    t = torch.zeros(2)
    plain = (t, 3, "x")
    ctx1, topts1 = object(), {"a": 1}
    recorded = (("self", ctx1, plain), {"transformer_options": topts1, "mask": None, "extra": [t],
                                        "copy": {"cond_or_uncond": [0], "ctx": ctx1}})
    marked = G._mark(recorded, ctx1, topts1)
    bind = G._binder(marked)
    ctx2, topts2 = object(), {"b": 2}
    (args, kwargs), (args2, kwargs2) = bind(ctx2, topts2), bind(ctx2, topts2)
    assert args == ("self", ctx2, plain) and args[2] is args2[2]  # the same tuple at every replay
    # a dict holding the context is a copy of transformer_options the model made: this forward's, as the mark says
    assert kwargs == {"transformer_options": topts2, "mask": None, "extra": [t], "copy": topts2}
    assert kwargs is not kwargs2 and kwargs["extra"] is not kwargs2["extra"]
    assert G._binder(plain) is None


def test_recordings_of_a_rank_on_a_device_share_one_capture_stream(monkeypatch):
    """cuBLAS keeps a workspace (32 MiB on Hopper) for every stream its matrix multiplies ran on until the process
    ends: a stream made for each recording held 33 MiB more per GPU with every run that recorded.  Every recording of a
    rank on a device runs on one stream, made once even when the GPUs' threads ask at once; another rank or device
    has its own."""
    from comfyui_support import load_pack

    mod, _ = load_pack()
    G = importlib.import_module(mod.__name__ + ".parallel.graphs")
    made = []

    class Stream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(G, "_STREAMS", {})
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    got = []
    threads = [threading.Thread(target=lambda: got.append(G.capture_stream(d0, 0))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(s is got[0] for s in got)
    assert G.capture_stream(torch.device("cuda:0"), 0) is got[0]
    assert G.capture_stream(d1, 1) is not got[0] and G.capture_stream(d0, 1) is not got[0]
    assert G.capture_stream(d1, 1) is G.capture_stream(d1, 1) and made == [d0, d1, d0]


def test_the_weights_ranges_are_held_as_few_ranges_and_let_go_on_any_failure():
    """A model's weights in comfy-aimdo's spaces (``module._v``, one range a module, 512-byte aligned one after the
    other) are held as one range per run of neighbours; where a range cannot be held (no memory: None; or an error of
    comfy-aimdo's) the ranges held before it are let go."""
    from comfyui_support import load_pack

    mod, _ = load_pack()
    G = importlib.import_module(mod.__name__ + ".parallel.graphs")

    class Space(_Space):
        def __init__(self, fail=None, **kw):
            super().__init__(**kw)
            self.fail, self.held = fail, []

        def fault(self, addr, size):
            if self.fail:
                raise self.fail
            self.held.append((addr, size))
            return super().fault(addr, size)

    a, b = Space(), Space()
    mods = [types.SimpleNamespace(_v=(a, 1024, 100)), types.SimpleNamespace(_v=(a, 1536, 200)),  # neighbours: one
            types.SimpleNamespace(_v=(a, 8192, 10)), types.SimpleNamespace(_v=(b, 0, 64)), types.SimpleNamespace()]
    r = G.Residency(mods)
    assert [(s, x, n) for s, x, n in r.runs] == [(a, 1024, 712), (a, 8192, 10), (b, 0, 64)] or \
        [(s, x, n) for s, x, n in r.runs] == [(b, 0, 64), (a, 1024, 712), (a, 8192, 10)]
    sig = r.pin()
    assert len(sig) == 3 and a.pins == 2 and b.pins == 1
    r.unpin()
    assert a.pins == b.pins == 0
    for bad in (Space(full=True), Space(fail=RuntimeError("Fault failed: 2"))):
        r = G.Residency([types.SimpleNamespace(_v=(a, 0, 64)), types.SimpleNamespace(_v=(bad, 0, 64))])
        r.runs.sort(key=lambda run: run[0] is bad)  # the good range first
        if bad.fail:
            with pytest.raises(RuntimeError, match="Fault failed"):
                r.pin()
        else:
            assert r.pin() is None
        assert a.pins == 0 and bad.pins == 0


def _runs_said(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "forwards split" in r.getMessage()]


def _cp(mod, m):
    return m.wrappers["sampler_sample"][_node(mod).WRAPPER_KEY][0].cp


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_next_run_of_the_same_model_replays_the_last_runs_graphs_from_its_first_forward(zoo, caplog, n):
    """ComfyUI keeps a model loaded from one prompt to the next: the next run (a new seed) replays the graphs the last
    one recorded from its first forward, and its latent is the eager split's for that seed bit for bit."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    eager = [z.sample(graphed(mod, base, n, graphs=False), case, seed=s) for s in (1, 2)]
    m = graphed(mod, base, n)
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"), torch.inference_mode():
        out = [z.sample(m, case, seed=s) for s in (1, 2)]
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    said = _runs_said(caplog)
    assert "3 of them replayed as CUDA graphs (1 recorded)" in said[0], said
    assert "4 of them replayed as CUDA graphs (0 recorded)" in said[1], said


@pytest.mark.comfyui
@pytest.mark.parametrize("change", ["weight patch", "option", "object patch", "a plain clone"])
def test_a_run_with_other_patches_or_options_records_its_own_graphs(zoo, caplog, change):
    """What a kept graph was recorded with must be what the next run runs: a weight patch added to the model (a LoRA), a
    value changed in its transformer_options, or a clone with an object patch sampled: the run records its own graphs
    (and the last run's go); a clone with nothing changed replays them.  The latent is the eager split's."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    n = 2
    m = graphed(mod, base, n)
    with torch.inference_mode():
        z.sample(m, case, seed=1)
    cp = _cp(mod, m)
    assert cp.kept is not None
    if change == "weight patch":
        key = next(k for k in m.model_state_dict() if k.endswith("img_in.weight"))
        m.add_patches({key: (torch.full_like(m.model_state_dict()[key], 0.01),)}, 1.0)
    elif change == "option":
        m.model_options["transformer_options"]["a_value_the_model_may_read"] = 1
    elif change == "object patch":
        m = m.clone()
        m.add_object_patch("diffusion_model.final_layer", m.model.diffusion_model.final_layer)
    else:
        m = m.clone()
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"), torch.inference_mode():
        out = z.sample(m, case, seed=2)
        cp.graphs = False
        eager = z.sample(m, case, seed=2)
    assert torch.equal(out, eager)
    said = _runs_said(caplog)
    want = "4 of them replayed as CUDA graphs (0 recorded)" if change == "a plain clone" else \
        "3 of them replayed as CUDA graphs (1 recorded)"
    assert want in said[0], said


@pytest.mark.comfyui
def test_kept_graphs_go_when_comfyui_unloads_the_model(zoo):
    """The graphs kept between runs hold GPU memory ComfyUI does not count: they go when ComfyUI unloads the model
    (its ON_DETACH callback), and not when another model's patcher is unloaded."""
    import comfy.model_management as mm

    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    m = graphed(mod, base, 2)
    with torch.inference_mode():
        z.sample(m, case, seed=1)
    cp = _cp(mod, m)
    kept = cp.kept
    assert kept is not None and kept.pieces
    other, _ = _build(z, "Flux", None)
    cp.release(other)
    assert cp.kept is kept
    mm.unload_all_models()
    assert cp.kept is None and not kept.pieces


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 4])
def test_kept_graphs_go_with_their_clone_without_waiting_for_pythons_cycle_collector(zoo, n):
    """A clone ComfyUI lets go of (its output cache dropped it: the user changed an input above the node) takes its kept
    graphs with it at once, and its runs leave no tensor or object of the pack in a reference cycle (each forward's
    handoff to the other GPUs held the first GPU's call so).  Memory held only by a cycle waits for Python's full
    collections, rare in a server: graphs of old clones piled up on the GPUs (a soak of 216 prompts with a backend
    changed between them: +1.2 GB allocated a GPU, 2x H200)."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    m = graphed(mod, base, n)
    with torch.inference_mode():
        z.sample(m, case, seed=1)
    refs = [weakref.ref(p) for p in _cp(mod, m).kept.pieces.values()]
    assert len(refs) == n
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():  # a second run, each of its forwards handed from the first GPU to the others
            z.sample(m, case, seed=2)
        del m
        alive = sum(r() is not None for r in refs)
        gc.set_debug(gc.DEBUG_SAVEALL)  # what only the cycle collector would free (ComfyUI's own cycles aside)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor)
                or (getattr(type(o), "__module__", None) or "").startswith(mod.__name__)]
        names = sorted({type(o).__name__ for o in held})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert alive == 0
    assert not held, names


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [2, 3])
def test_kept_graphs_of_weights_dynamic_vram_moved_since_are_recorded_again(zoo, caplog, n):
    """Under ComfyUI's dynamic VRAM the weights' pages may be others by the next run (memory taken back between
    prompts): its first forward finds the kept graphs stale, runs eagerly and the run records its own (rather than
    running without graphs), the latent the eager split's."""
    z, mod, _ = zoo
    base, case = _build(z, "Flux", None)
    eager = z.sample(graphed(mod, base, n, graphs=False), case, seed=2)
    space = _Space(move_at=3 * n + 1)  # the last run: recorded and two replays; the next: other pages
    m = graphed(mod, base, n)
    with _in_space(m, space), caplog.at_level(logging.INFO, logger="patch_attention.parallel"), \
            torch.inference_mode():
        z.sample(m, case, seed=1)
        out = z.sample(m, case, seed=2)
    assert torch.equal(out, eager)
    assert space.pins == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "since the last run: its CUDA graphs recorded again" in said
    assert "without CUDA graphs" not in said
    assert "3 of them replayed as CUDA graphs (1 recorded)" in _runs_said(caplog)[1]


@pytest.mark.comfyui
def test_kept_graphs_serve_the_next_run_through_comfyuis_own_copies_for_each_device(zoo, monkeypatch, caplog):
    """Through ComfyUI's MultiGPU copies (two devices as ComfyUI sees them; not simulated ranks), which ComfyUI gives
    new patchers at every run over the same models: the next run still replays the last one's graphs from its first
    forward, and its latent is the eager split's."""
    import comfy.model_management as mm
    from comfyui_support import sample as sample_flux
    from comfyui_support import tiny_flux

    _, mod, _ = zoo
    node = _node(mod)
    devs = [torch.device("cpu"), torch.device("cpu", 1)]
    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(devs))
    try:
        m = node.context_parallel(tiny_flux(), gpus=0, min_tokens=0)
        cp = _cp(mod, m)
        cp.graph_type = RecordedGraph
        with caplog.at_level(logging.INFO, logger="patch_attention.parallel"), torch.inference_mode():
            out = [sample_flux(m, seed=s) for s in (1, 2)]
            cp.graphs = False
            eager = sample_flux(m, seed=2)
    finally:
        mm.unload_all_models()
    assert torch.equal(out[1], eager)
    said = _runs_said(caplog)
    assert "over 2 GPUs, 3 of them replayed as CUDA graphs (1 recorded)" in said[0], said
    assert "over 2 GPUs, 4 of them replayed as CUDA graphs (0 recorded)" in said[1], said


@pytest.mark.comfyui
@pytest.mark.parametrize("held", ["held", "let go"])
def test_a_nodes_new_output_recording_lets_go_of_the_graphs_its_earlier_outputs_keep(zoo, monkeypatch, held):
    """ComfyUI's output cache keeps a node's earlier outputs (its default while the host has RAM to spare), and its
    MultiGPU copies and the clone they were made for refer to each other, so even an output let go of lives until
    Python's cycle collector runs: graphs kept with every output the user made (a backend changed above the node) piled
    up on the GPUs.  When the node's new output records, the earlier outputs' graphs over the same model go, whoever
    still holds those outputs; another node's output over the same model (a second pass) keeps its own, and so does
    the node's output over another model."""
    import comfy.model_management as mm
    from comfyui_support import sample as sample_flux
    from comfyui_support import tiny_flux

    _, mod, _ = zoo
    node = _node(mod)
    cpmod = sys.modules[node.__name__]
    devs = [torch.device("cpu"), torch.device("cpu", 1)]
    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(devs))
    base, other_model = tiny_flux(), tiny_flux()

    def output(node_id, model=base):
        monkeypatch.setattr(cpmod, "executing_node", lambda: node_id)
        m = node.context_parallel(model, gpus=0, min_tokens=0)
        _cp(mod, m).graph_type = RecordedGraph
        with torch.inference_mode():
            sample_flux(m, seed=1)
        return m, [weakref.ref(p) for p in _cp(mod, m).kept.pieces.values()]

    gc.collect()
    gc.disable()  # as in a server with a large heap, where the collector runs rarely
    try:
        earlier, dropped = output("7")
        second_pass, stay = output("8")
        elsewhere, stay_too = output("7", other_model)
        cps = [weakref.ref(_cp(mod, m)) for m in (earlier, second_pass, elsewhere)]
        if held == "let go":
            del earlier
        newer, _ = output("7")
        alive = [sum(r() is not None for r in refs) for refs in (dropped, stay, stay_too)]
        keeping = [cp() is not None and cp().kept is not None for cp in cps]
    finally:
        gc.enable()
        mm.unload_all_models()
    assert len(dropped) == len(stay) == len(stay_too) == 2
    assert alive == [0, 2, 2]
    assert keeping == [False, True, True]


@pytest.mark.comfyui
@pytest.mark.parametrize("n", [3, 4])
def test_forwards_split_over_fewer_gpus_than_the_run_has_replay_their_graphs(zoo, monkeypatch, caplog, n):
    """On ``n`` GPUs a step whose work pays on two only (the work floor, nodes/context_parallel.py gpus_for) records and
    replays its graphs over those two: the eager split's latent bit for bit, three of four forwards replayed."""
    z, mod, _ = zoo
    cpn = _node(mod)
    base, case = _build(z, "Flux", None)
    work_floor_when_simulated(cpn, monkeypatch)
    monkeypatch.setattr(cpn, "SPLIT_TFLOP", dict.fromkeys(cpn.SPLIT_TFLOP, 0.0))  # every forward splits
    monkeypatch.setattr(cpn, "graphs_floor", lambda *a: 0.0)
    monkeypatch.setattr(cpn, "MORE_GPUS_TFLOP", 1e9)  # over two
    eager = sample(z, graphed(mod, base, 2, graphs=False), case)
    RecordedGraph.replays = RecordedGraph.graphs = 0
    with caplog.at_level(logging.INFO, logger="patch_attention.parallel"):
        out = sample(z, graphed(mod, base, n), case)
    assert torch.equal(out, eager)
    said = [r.getMessage() for r in caplog.records]
    assert not any("could not run as CUDA graphs" in m for m in said), said
    assert any(f"4 of 4 forwards split over 2 of the {n} GPUs, 3 of them replayed" in m for m in said), said

