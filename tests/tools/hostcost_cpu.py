"""Host time per attention call on the CPU: the dispatcher's cached path and the override's lean path, tiny tensors.

    COMFYUI_PATH=... python tests/tools/hostcost_cpu.py [--rounds 300] [--per-forward 100] [--roots A,B]

What the GPU stage (tests/gpu/hostcost.py) measures on a real GPU, here with a trivial kernel (it returns q) and
``[1, 16, 2*8]`` tensors, so the numbers are the Python each path runs per call. Each row makes ``--per-forward``
calls inside a simulated model forward (the override's lane set up as the node's APPLY_MODEL wrapper sets it, its
deferred NaN flags read at the end); ``--rounds`` forwards per row, rows interleaved round by round. Reported: the
median over rounds of µs per call, and the minimum (on a shared machine contention only adds time: the minimum is
the steadier of the two).

``--roots``: pack checkouts to compare in one process (each loaded as its own package), their rows interleaved, so
drift on a shared machine falls on both alike. Rows:

- ``dispatch``: ``attention()`` on a cached call shape (explicit exact kernel);
- ``dispatch/q8-flag``: the same with a quantized kernel and a deferred NaN flag per call;
- ``hook/<case>``: Patch Attention on ComfyUI's hook (ComfyUI's wrapped ``attention_pytorch`` called with
  ``transformer_options``, as a model calls it), the lean path after a shape's first call: ``exact`` (an exact
  kernel, NHD), ``q8-flag`` (quantized, NaN flag per call), ``q8-no-net``, ``hnd`` (a kernel that takes HND only:
  a transpose each way), ``hnd-in`` (``skip_reshape`` calls), ``dense`` (a forward Patch Attention runs dense: the
  fastest exact kernel for the shape), ``previous`` (a dense forward over another override), ``sdpa`` (calls handed
  to ComfyUI's own function);
- ``op/exact``: the compiled models' custom op's eager side (``op_call``), lean path.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

B, N, H, D = 1, 16, 2, 8


def load(root: str, name: str):
    """The pack at ``root`` imported as package ``name`` (the way ComfyUI imports it)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"), submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def comfy_attention():
    """ComfyUI's wrapped ``attention_pytorch`` (the hook is its ``wrap_attn``)."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        raise SystemExit("set COMFYUI_PATH: the hook rows call ComfyUI's own wrapped attention function")
    sys.path.insert(0, path)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ldm.modules.attention as cattn

    return cattn.attention_pytorch


def trivial(q, k, v, *, layout, mask, scale, opts):
    return q


def register(P) -> None:
    A = P.attention
    for name, acc, layouts in (("t_exact", "exact", ("NHD", "HND")), ("t_q8", "8bit", ("NHD", "HND")),
                               ("t_hnd", "exact", ("HND",))):
        if name not in A.REGISTRY:
            A.REGISTRY.register(A.Backend(name=name, family="test", fn=trivial, constraints=(), accuracy=acc,
                                          layouts=layouts, probe=lambda: A.Availability(True)))
    A.dispatch.clear_plan_cache()


def rows(P, func):
    """name -> (one forward of ``n`` calls)."""
    A, patch = P.attention, P.nodes.patch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, H * D, generator=g) for _ in range(3))
    qh, kh, vh = (t.view(B, N, H, D).transpose(1, 2).contiguous() for t in (q, k, v))
    exclude = {n for n in A.REGISTRY.names() if n != "sdpa"}
    out = {}

    def dispatch_row(backend, check):
        cfg = A.AttentionConfig(backend=backend, check_finite=check)

        def forward(n):
            cfg.in_forward = True
            for _ in range(n):
                A.attention(q, k, v, H, config=cfg)
            cfg.in_forward = False
            assert not cfg.take_nonfinite()

        forward(3)
        return forward

    out["dispatch"] = dispatch_row("t_exact", False)
    out["dispatch/q8-flag"] = dispatch_row("t_q8", "deferred")

    def hook_row(backend, check="deferred", active=True, skip=False, previous=None):
        exact = A.AutoSelector.exact(exclude=exclude)
        field = "exact_selector" if "exact_selector" in A.AttentionConfig.__dataclass_fields__ else "exact"  # earlier trees
        cfg = A.AttentionConfig(backend=backend, check_finite=check, **{field: None if backend == "sdpa" else exact})
        ov = patch.AttentionOverride(cfg, audit=False, previous=previous)
        topts = {"optimized_attention_override": ov}
        args = (qh, kh, vh) if skip else (q, k, v)
        kw = {"skip_reshape": True, "skip_output_reshape": True} if skip else {}

        def forward(n):
            ln = ov.lane()
            ln.active, ln.layer, ln.config.in_forward = active, 0, True
            for _ in range(n):
                func(*args, H, transformer_options=topts, **kw)
            ln.active, ln.config.in_forward = None, False
            assert not ln.config.take_nonfinite()

        forward(3)
        assert ov.lane().lean or backend == "sdpa", backend
        return forward

    out["hook/exact"] = hook_row("t_exact")
    out["hook/q8-flag"] = hook_row("t_q8")
    out["hook/q8-no-net"] = hook_row("t_q8", check=False)
    out["hook/hnd"] = hook_row("t_hnd")
    out["hook/hnd-in"] = hook_row("t_exact", skip=True)
    out["hook/dense"] = hook_row("t_exact", active=False)

    def other(func, *args, **kwargs):
        return args[0]

    out["hook/previous"] = hook_row("t_exact", active=False, previous=other)
    out["hook/sdpa"] = hook_row("sdpa")

    ov = patch.AttentionOverride(A.AttentionConfig(backend="t_exact", check_finite="deferred"), audit=False)

    def op_forward(n):
        ln = ov.lane(q.device)
        ln.active, ln.layer, ln.config.in_forward = True, 0, True
        for _ in range(n):
            ov.op_call(q, k, v, None, H, False, False, False)
        ln.active, ln.config.in_forward = None, False

    op_forward(3)
    assert ov.lane(q.device).lean
    out["op/exact"] = op_forward
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--per-forward", type=int, default=100)
    ap.add_argument("--roots", default=ROOT, help="comma-separated pack checkouts to compare (default: this one)")
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    func = comfy_attention()
    roots = [os.path.abspath(r) for r in a.roots.split(",") if r]
    made = {}
    for i, root in enumerate(roots):
        P = load(root, f"pa_hostcost_{i}")
        register(P)
        for name, fwd in rows(P, func).items():
            if not a.only or name in a.only.split(","):
                made[(i, name)] = fwd
    times = {key: [] for key in made}
    for _ in range(a.rounds):
        for key, fwd in made.items():
            t0 = time.perf_counter_ns()
            fwd(a.per_forward)
            times[key].append((time.perf_counter_ns() - t0) / a.per_forward / 1000)
    names = list(dict.fromkeys(name for _, name in made))
    head = "".join(f" | {os.path.basename(r) or r}: median (min)" for r in roots)
    print(f"µs per call, {a.rounds} rounds of {a.per_forward} calls, torch {torch.__version__}")
    print(f"| row{head}" + (" | change: median (min) |" if len(roots) == 2 else " |"))
    for name in names:
        cells, got = [], []
        for i in range(len(roots)):
            t = times.get((i, name))
            if t is None:
                cells.append("-")
                continue
            got.append((statistics.median(t), min(t)))
            cells.append(f"{got[-1][0]:7.2f} ({got[-1][1]:6.2f})")
        change = ""
        if len(roots) == 2 and len(got) == 2:
            (m0, n0), (m1, n1) = got
            change = f" | {100 * (m1 - m0) / m0:+5.1f} % ({100 * (n1 - n0) / n0:+5.1f} %)"
        print(f"| {name:<17} | " + " | ".join(cells) + change + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
