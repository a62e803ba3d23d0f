"""Context parallelism over the model zoo: every configuration tests/zoo builds whose diffusion-model class has a
context-parallel unit (``parallel/families``), at its GPU sizes in bf16, with each backend on one GPU and split over
every GPU of the machine by the Context Parallel node.

    python tests/gpu/cp_zoo.py --json cp-zoo.json --md cp-zoo.md [--budget 270] [--gpus 0] [--only A,B] \
        [--backends unpatched,auto,auto_exact,sage_fp8_sm90,sdpa_cudnn,flash_attn4] [--part 1/2] [--device cpu]

Per configuration and backend (``unpatched``: no Patch Attention): the model on the first GPU with that backend, and the
same model split over the GPUs: copies on the other GPUs with the same weights, registered as ComfyUI's MultiGPU clones
(tests/gpu/multigpu.py's ``with_copies``), Patch Attention applied before the Context Parallel node's function as a
workflow would, ``cfg_split`` off (the conds stay batched and every forward is split by tokens), the same seed, the
zoo's two steps.  A case is ok when the split latent is finite, within the backend's accuracy class of the one-GPU
latent of the same backend (exact kernels, ``unpatched`` and ``auto_exact``: the model's bf16 rounding floor, as
tests/gpu/zoo.py computes it, plus 1e-3 (fp32: 1e-5); ``auto`` and lossy kernels: their class's bound plus that floor)
and the forwards were split: every GPU exchanged attention calls, or the unit kept the forward on one GPU and the
node logged why (recorded as "declined: <why>").  A crash is a failure with its error.  Backends that cannot run here
are reported per case as "not installed" (with the registry's reason), never dropped; configurations whose class has no
unit are listed as "no unit", configurations the zoo does not build as "not built".

The configurations run one family (unit module) after another in turn, so a spent ``--budget`` leaves every family
reached; those not started are listed as not reached.  One line per case on stdout ("cp-zoo <config> <backend>:
ok|FAIL|CRASH|not installed ..."); JSON (and Markdown) written after every configuration.  Exit status 1 when any case
failed or crashed.

``--device cpu``: a dry run on the CPU in fp32 at the same sizes, the ranks simulated as threads (the CPU tests' way);
kernels that run on CUDA only are reported as "not runnable here".  Needs ComfyUI 0.33 (COMFYUI_PATH; the runner's env
stage sets it, with comfy-kitchen on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)

DEFAULT_BACKENDS = "unpatched,auto,auto_exact,sage_fp8_sm90,sdpa_cudnn,flash_attn4"
EXACT_SLACK = {True: 1e-3, False: 1e-5}  # over the rounding floor, for half-precision / fp32 models
SKIPPED = ("not installed", "not runnable here")  # case statuses that are not failures
PSEUDO = ("unpatched", "auto", "auto_exact", "auto_fast")  # backends that are not one kernel of the registry


def _script(name: str, as_name: str):
    """tests/gpu/<name>.py under a name of its own (``zoo`` is the zoo's package)."""
    if as_name in sys.modules:
        return sys.modules[as_name]
    spec = importlib.util.spec_from_file_location(as_name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[as_name] = module
    spec.loader.exec_module(module)
    return module


GZ = _script("zoo", "gpu_zoo")
MG = _script("multigpu", "gpu_multigpu")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _tail(tb: str, lines: int = 8) -> str:
    """A traceback's last lines, each indented under the case's line (the runner's summary shows them)."""
    return "\n".join("    | " + ln for ln in tb.rstrip().splitlines()[-lines:])


# ---------------------------------------------------------------- what can run, and against which bound

def cannot_run(A, backend: str, device: str):
    """(status, why) when ``backend`` cannot run here, else None: not installed (its probe's reason), or on the CPU a
    kernel that runs on other devices only (or is not installed there)."""
    if backend in PSEUDO:
        return None
    cpu = device == "cpu"
    b = A.REGISTRY.get(backend)
    av = b.availability()
    if not av.ok:
        return ("not runnable here" if cpu else "not installed"), av.reason
    if cpu:
        for c in b.constraints:
            types = getattr(c, "types", None)
            if type(c).__name__ == "DeviceTypes" and types and "cpu" not in types:
                return "not runnable here", f"runs on {'/'.join(types)} only"
    return None


def is_exact(A, backend: str) -> bool:
    if backend in ("unpatched", "auto_exact"):
        return True
    return backend in A.REGISTRY and A.REGISTRY.get(backend).accuracy == "exact"


def split_bound(A, backend: str, floor: float, half: bool) -> tuple[float, str]:
    """The split latent's rel-L1 bound against the one-GPU latent of the same backend, and what it is."""
    if is_exact(A, backend):
        slack = EXACT_SLACK[half]
        return floor + slack, f"exact: rounding floor + {slack:g}"
    bound = GZ.bound_of(A, backend, floor)
    cls = "auto's gate" if backend in ("auto", "auto_fast") else f"{A.REGISTRY.get(backend).accuracy} class"
    return bound, f"{cls} + rounding floor"


# ---------------------------------------------------------------- which configurations, in which order

def classify(z, mod, names: list) -> dict:
    """name -> (unit module or None, diffusion-model class name, error): from a tiny CPU build of each (the class does not
    depend on the sizes); the run checks the unit again on its own build."""
    import comfy.supported_models as sm

    unit_for = mod.parallel.families.unit_for
    out = {}
    for name in names:
        config, builder = GZ.resolve(z, name)
        if builder is None:
            continue
        try:
            base = z.build(getattr(sm, config), builder(getattr(sm, config), False))
            dm = base.model.diffusion_model
            unit = unit_for(dm)
            out[name] = (type(unit).__module__.rsplit(".", 1)[-1] if unit else None, type(dm).__name__, "")
            del base, dm
        except Exception as e:  # the run builds it again and reports what fails
            out[name] = ("?", "?", _err(e))
    return out


def interleave(names: list, family: dict) -> list:
    """``names`` one family after another in turn (each family's in their order), so a time budget reaches every
    family before a second configuration of any."""
    groups = {}
    for n in names:
        groups.setdefault(family[n], []).append(n)
    out, queues = [], list(groups.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


# ---------------------------------------------------------------- the split and what it did

@contextlib.contextmanager
def watching(mod):
    """While sampling: the rank of every exchanged attention call, the node's count of split forwards, and why a
    forward ran on one GPU (what the node logged)."""
    from comfyui_support import counting_exchanges

    seen = {"ranks": [], "forwards": None, "whole": []}

    class Catch(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "forwards split over" in msg and isinstance(record.args, tuple) and len(record.args) >= 3:
                seen["forwards"] = (int(record.args[1]), int(record.args[2]))
            elif "on one GPU" in msg and msg not in seen["whole"]:
                seen["whole"].append(msg)

    log = logging.getLogger("patch_attention.parallel")
    handler, level, propagate = Catch(logging.INFO), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the count of split forwards is an INFO record
    log.propagate = False  # what it says is on the case's line
    try:
        with counting_exchanges(mod) as seen["ranks"]:
            yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def split_verdict(seen: dict, n: int) -> tuple[str, str]:
    """("split" | "declined" | "not split", detail) from what :func:`watching` saw on ``n`` ranks."""
    per_rank = [seen["ranks"].count(r) for r in range(n)]
    split, total = seen["forwards"] or (0, 0)
    why = seen["whole"][0].split(": ", 1)[-1] if seen["whole"] else ""
    if split and all(per_rank):
        more = f"; {total - split} on one GPU: {why}" if split < total else ""
        return "split", f"{split}/{total} forwards split, exchanged calls per GPU {per_rank}{more}"
    if not split and not any(per_rank) and why:
        return "declined", why
    return "not split", (f"{split}/{total} forwards split, exchanged calls per GPU {per_rank}"
                         + (f"; logged: {why}" if why else "; the node logged no split run"))


def zoo_copies(z, cls, case, dtype, base, devices: list) -> list:
    """``base``'s copies on ``devices`` with its weights, flagged as ComfyUI's MultiGPU base clones of it."""
    out = []
    for dev in devices:
        p = z.build(cls, case, dtype=dtype, device=dev)
        p.model.diffusion_model.load_state_dict(base.model.diffusion_model.state_dict())
        p.clone_base_uuid = base.clone_base_uuid
        p.is_multigpu_base_clone = True
        out.append(p)
    return out


def split_model(mod, model, n: int, extra: list | None):
    """``model`` split over ``n`` ranks by the Context Parallel node's function: over the GPUs (``extra``: the copies on
    the others), or simulated as threads on its own device (``extra`` None)."""
    cpn = importlib.import_module(mod.__name__ + ".nodes.context_parallel")
    if extra is None:
        return cpn.context_parallel(model, simulate=n, cfg_split=False)
    return cpn.context_parallel(MG.with_copies(model, extra), gpus=n, cfg_split=False, min_tokens=0)


def _timed(case_timeout: int, fn, *a):
    if case_timeout > 0:
        signal.alarm(case_timeout)
    try:
        return fn(*a)
    finally:
        signal.alarm(0)


def free(device: str) -> None:
    import torch

    GZ.free_models("cpu" if device == "cpu" else "cuda")
    if device != "cpu":
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- one configuration

def run_config(z, mod, name, cls, builder, backends, case_timeout, device="cuda", ranks=2, gpu_sizes=True):
    """One configuration over ``ranks`` GPUs (``device`` "cpu": ranks simulated as threads): the one-GPU latent and the
    split latent per backend.  Returns its result dict and prints one line per case."""
    import torch

    A = mod.attention
    definitions = sys.modules[mod.__name__ + ".nodes.definitions"]
    override_of = mod.nodes.patch.override_of
    cpu = device == "cpu"
    lead = "cpu" if cpu else "cuda:0"  # the first GPU by index: MultiGPU's other devices are told apart from it
    t0 = time.perf_counter()
    res = {"configuration": cls.__name__, "ranks": ranks, "runs": {}}
    dtype = GZ.pick_dtype(cls, device)
    half = dtype != torch.float32
    res["dtype"] = str(dtype).replace("torch.", "")
    case = builder(cls, gpu_sizes)
    base = z.build(cls, case, dtype=dtype, device=lead)
    dm = base.model.diffusion_model
    unit = mod.parallel.families.unit_for(dm)
    res["model"] = f"{type(base.model).__name__} ({type(dm).__name__})"
    if unit is None:
        res["no_unit"] = type(dm).__name__
        print(f"cp-zoo {name}: no unit ({type(dm).__name__})", flush=True)
        del base, dm
        free(device)
        return res
    res["unit"] = unit.name
    extra = None if cpu else zoo_copies(z, cls, case, dtype, base, [f"cuda:{i}" for i in range(1, ranks)])
    ref = _timed(case_timeout, z.sample, base, case)
    res["unpatched_finite"] = bool(torch.isfinite(ref).all())
    try:
        floor = _timed(case_timeout, GZ.rounding_floor, z, cls, case, base, ref, dtype, lead)
    except Exception as e:  # the floor is an allowance, never a reason to skip the runs
        floor, res["rounding_floor_error"] = 0.0, _err(e)
    res["rounding_floor"] = floor
    print(f"cp-zoo {name}: {res['model']}, unit {unit.name}, {res['dtype']}, rounding floor {floor:.4f}, "
          f"{ranks} {'simulated ranks' if cpu else 'GPUs'} ({time.perf_counter() - t0:.1f} s with the builds)", flush=True)
    for backend in backends:
        t1 = time.perf_counter()
        run = res["runs"][backend] = {}
        skip = cannot_run(A, backend, device)
        if skip is not None:
            run.update(status=skip[0], why=skip[1], ok=True)
            print(f"cp-zoo {name} {backend}: {skip[0]} ({skip[1][:140]})", flush=True)
            continue
        bound, what = split_bound(A, backend, floor, half)
        run.update(bound_rel_l1=bound, bound_is=what)
        where = "one-GPU run"
        try:
            model = base if backend == "unpatched" else definitions.run_patch(base, backend)[0]
            one = ref if backend == "unpatched" else _timed(case_timeout, z.sample, model, case)
            where = "split run"
            m = split_model(mod, model, ranks, extra)
            with watching(mod) as seen:
                out = _timed(case_timeout, z.sample, m, case)
            del m
            run["split"], run["split_detail"] = split_verdict(seen, ranks)
            run.update(finite=bool(torch.isfinite(out).all()), one_gpu_finite=bool(torch.isfinite(one).all()),
                       rel_l1=GZ.rel_l1(out, one), rel_l1_vs_unpatched=GZ.rel_l1(out, ref))
            ov = override_of(model)
            if ov is not None:
                st = ov.stats.as_dict()
                run.update(calls=st["calls"], fallbacks=st["fallbacks"], errors=st["errors"],
                           lanes=sorted({str(ln.device) for ln in ov.lanes()}))
            within = math.isfinite(run["rel_l1"]) and run["rel_l1"] <= bound
            run["within"] = within
            run["ok"] = run["finite"] and run["one_gpu_finite"] and within and run["split"] != "not split"
            run["status"] = "ok" if run["ok"] else "FAIL"
            why = "" if run["ok"] else (" non-finite split latent" if not run["finite"] else
                                        " non-finite one-GPU latent" if not run["one_gpu_finite"] else
                                        " beyond its bound" if not within else "")
            fb = "; ".join(f"{f['from']}->{f['to']} {f['count']}x: {f['reason'][:80]}" for f in run.get("fallbacks", []))
            calls = ",".join(f"{k}={v}" for k, v in sorted(run.get("calls", {}).items()))
            print(f"cp-zoo {name} {backend}: {run['status']}{why} {run['split']} ({run['split_detail'][:160]}) rel-L1 "
                  f"{run['rel_l1']:.2e} vs one GPU (bound {bound:.2e}, {what})"
                  f"{'; calls ' + calls if calls else ''}{'; fallbacks ' + fb if fb else ''}", flush=True)
        except Exception as e:
            run.update(ok=False, status="CRASH", crash=f"{where}: {_err(e)}", traceback=traceback.format_exc()[-2500:])
            print(f"cp-zoo {name} {backend}: CRASH in the {run['crash']}\n{_tail(run['traceback'])}", flush=True)
        run["seconds"] = round(time.perf_counter() - t1, 2)
    del base, dm, extra
    free(device)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------- the report

def _cell(run) -> str:
    if run is None:
        return "-"
    st = run.get("status", "")
    if st in SKIPPED:
        return "n/i" if st == "not installed" else "n/r"
    if st == "CRASH":
        return "CRASH"
    mark = "" if run["ok"] else "FAIL "
    how = {"split": "", "declined": " (1 GPU)", "not split": " not split"}[run["split"]]
    return f"{mark}{run['rel_l1']:.1e}{how}{'*' if run.get('fallbacks') else ''}"


def failures(results: dict) -> list[str]:
    out = [f"{n} {b}" for n, r in results.items() for b, run in r.get("runs", {}).items() if not run.get("ok")]
    return out + [f"{n} (build/one-GPU unpatched)" for n, r in results.items() if "crash" in r]


def render(meta, results, no_unit, not_reached, unbuilt) -> str:
    backends = meta["backends"]
    lines = [f"# Context parallelism over the model zoo: {meta['gpu']} ({meta['date']})", "",
             f"ComfyUI {meta['comfyui']}, torch {meta['torch']}; the zoo's GPU sizes, 2 steps, split over "
             f"{meta['ranks']} {meta['rank_kind']} by the Context Parallel node (cfg_split off), Patch Attention applied "
             f"before it. Cell: rel-L1 of the split latent against the one-GPU latent of the same backend; bound: exact "
             f"kernels (unpatched, auto_exact) the model's rounding floor (bf16 against fp32) + 1e-3, auto and lossy "
             f"kernels their class's bound + that floor; (1 GPU): the unit kept the forwards on one GPU (why: JSON); "
             f"n/i not installed, n/r not runnable here; * a fallback was counted.", "",
             "| configuration | unit | dtype | floor | " + " | ".join(backends) + " |",
             "|---|---|---|---|" + "---|" * len(backends)]
    for name, r in results.items():
        if "crash" in r:
            lines.append(f"| {name} | - | - | - | CRASH before the runs: {r['crash']} |" + " |" * (len(backends) - 1))
            continue
        cells = [_cell(r["runs"].get(b)) for b in backends]
        lines.append(f"| {name} | {r.get('unit', '-')} | {r.get('dtype', '-')} | {r.get('rounding_floor', 0.0):.3f} | "
                     + " | ".join(cells) + " |")
    skipped = {}
    for r in results.values():
        for b, run in r.get("runs", {}).items():
            if run.get("status") in SKIPPED:
                skipped[b] = f"{run['status']}: {run['why']}"
    if skipped:
        lines += ["", "Backends not run:", *[f"- {b}: {w}" for b, w in skipped.items()]]
    if no_unit:
        lines += ["", "No context-parallel unit (not split, not failures): "
                  + ", ".join(f"{n} ({c})" for n, c in no_unit.items())]
    if not_reached:
        lines += ["", f"Not reached within the time budget ({meta['budget_s']:g} s): {', '.join(not_reached)}"]
    if unbuilt:
        lines += ["", "Not built (why: tests/zoo):", *[f"- {n}: {w}" for n, w in unbuilt.items()]]
    fails = failures(results)
    lines += ["", f"Failures: {', '.join(fails) if fails else 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    GZ.common_args(ap, "CP_ZOO", 270, DEFAULT_BACKENDS)
    ap.add_argument("--gpus", type=int, default=0,
                    help="GPUs to split over (0: every GPU here); --device cpu: simulated ranks (0: 2)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    cpu = a.device == "cpu"
    count = 0 if cpu else torch.cuda.device_count()
    if not cpu and count < 2:
        sys.exit(f"cp-zoo: {count} CUDA device{'s' if count != 1 else ''}: context parallelism needs 2 or more")
    ranks = a.gpus or (2 if cpu else count)
    if not cpu and ranks > count:
        sys.exit(f"cp-zoo: --gpus {ranks} but {count} CUDA devices")
    path = os.environ.get("COMFYUI_PATH", "")
    nodes = GZ.import_comfy(path, cpu=cpu)
    mod = GZ.load_pack(nodes)
    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        sys.exit("cp-zoo: splitting over GPUs needs ComfyUI 0.33 or later (its MultiGPU model copies)")
    import comfy.supported_models as sm
    import zoo as z

    z.load_families()
    A = mod.attention
    backends = [b for b in (a.backends or DEFAULT_BACKENDS).split(",") if b]
    unknown = [b for b in backends if b not in PSEUDO and b not in A.REGISTRY]
    if unknown:
        sys.exit(f"cp-zoo: no such backend: {', '.join(unknown)} (known: {', '.join([*PSEUDO, *A.REGISTRY.names()])})")
    names = GZ.config_names(z, a.only)
    unbuilt = {n: z.UNBUILT.get(n, "no builder in tests/zoo") for n in names if GZ.resolve(z, n)[1] is None}
    kinds = classify(z, mod, [n for n in names if n not in unbuilt])
    no_unit = {n: c for n, (u, c, _) in kinds.items() if u is None}
    todo = GZ.part_of(interleave([n for n in names if n in kinds and n not in no_unit],
                                 {n: kinds[n][0] for n in kinds}), a.part)
    gpu = "cpu (dry run, ranks simulated as threads)" if cpu else \
        " + ".join(torch.cuda.get_device_name(i) for i in range(ranks))
    meta = {"gpu": gpu, "torch": torch.__version__, "comfyui": GZ.release(path),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "backends": backends,
            "installed": A.REGISTRY.available(), "budget_s": a.budget, "part": a.part, "steps": 2, "ranks": ranks,
            "rank_kind": "simulated ranks" if cpu else "GPUs", "cfg_split": False}
    for n in unbuilt:
        print(f"cp-zoo {n}: not built: {unbuilt[n][:120]}", flush=True)
    for n, c in no_unit.items():
        print(f"cp-zoo {n}: no unit ({c})", flush=True)
    print(f"cp-zoo: {len(todo)} configurations with a unit (part {a.part}), {len(no_unit)} without; backends "
          f"{', '.join(backends)}; {ranks} {meta['rank_kind']}; budget {a.budget:g} s "
          f"({time.perf_counter() - t_start:.0f} s spent starting)", flush=True)
    signal.signal(signal.SIGALRM, GZ._alarm)
    results, not_reached = {}, []

    def write():
        meta["seconds"] = round(time.perf_counter() - t_start, 1)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results, "no_unit": no_unit, "not_reached": not_reached,
                       "unbuilt": unbuilt}, f, indent=1)
        if a.md:
            with open(a.md, "w") as f:
                f.write(render(meta, results, no_unit, not_reached, unbuilt))

    for k, name in enumerate(todo):
        if time.perf_counter() - t_start > a.budget:
            not_reached += todo[k:]
            print(f"cp-zoo: time budget spent; not reached: {', '.join(todo[k:])}", flush=True)
            break
        config, builder = GZ.resolve(z, name)
        try:
            r = run_config(z, mod, name, getattr(sm, config), builder, backends, a.case_timeout, a.device, ranks)
        except Exception as e:
            r = {"configuration": config, "crash": _err(e), "traceback": traceback.format_exc()[-2500:]}
            print(f"cp-zoo {name}: CRASH before the runs: {r['crash']}\n{_tail(r['traceback'])}", flush=True)
            free(a.device)
        if "no_unit" in r:
            no_unit[name] = r["no_unit"]
        else:
            results[name] = r
        write()
    write()
    fails = failures(results)
    cases = sum(len(r.get("runs", {})) for r in results.values())
    skipped = sum(1 for r in results.values() for run in r.get("runs", {}).values() if run.get("status") in SKIPPED)
    print(f"cp-zoo: {len(results)} configurations run, {cases} cases ({skipped} not run here), {len(fails)} failing"
          f"{': ' + ', '.join(fails) if fails else ''}; {len(no_unit)} without a unit, {len(not_reached)} not reached, "
          f"{len(unbuilt)} not built; {meta['seconds']} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
