"""The model zoo on a CUDA GPU: every configuration the zoo builds (tests/zoo), at its GPU sizes (each family's real head
dims, >= 128 query and key tokens where the family has them), in bf16 (or the configuration's first supported dtype),
sampled unpatched and through the Patch Attention node's function with every installed backend and ``auto``.

    python tests/gpu/zoo.py --json zoo-gpu.json --md zoo-gpu.md [--budget 480] [--part 1/2] [--only A,B] [--backends a,b]

Per configuration and backend: the final latent is finite, and within the backend's accuracy class of the unpatched
latent (``attention.registry.ACCURACY`` max_rel_l1; ``auto``: its gate; classes without a bound: finite only, the error
reported); every fallback is counted with its reason (from the run's statistics); NaN from a kernel is caught by the
NaN net (a counted fallback "non-finite output") or the case fails. A crash is a failure with its error. One line per
case on stdout ("zoo <config> <backend>: ok|FAIL|CRASH ..."). Results are written after every configuration, so a
stage killed by its time limit still leaves them; configurations not reached within ``--budget`` seconds are listed.

Needs ComfyUI (COMFYUI_PATH: 0.33 from the runner's env stage, comfy-kitchen on PYTHONPATH: 0.33's model code calls its
fused RoPE/norm ops). Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)


def import_comfy(path: str, cpu: bool = False):
    """ComfyUI on the GPU (as comfyui_support.comfy does on the CPU, without --cpu); its ``nodes`` module or None."""
    if not os.path.exists(os.path.join(path, "comfy", "model_base.py")):
        sys.exit(f"zoo: no ComfyUI at {path!r}: set COMFYUI_PATH (the runner's env stage does)")
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    if "nodes" in sys.modules and not getattr(sys.modules["nodes"], "__file__", "").startswith(path):
        del sys.modules["nodes"]
    from comfy.cli_args import args

    args.disable_smart_memory = True  # each configuration's model leaves the GPU after its runs
    args.cpu = cpu
    import comfy.model_management  # noqa: F401
    import comfy.sample  # noqa: F401

    try:
        from absent import stand_in_if_missing

        # ComfyUI's nodes module imports PyAV for its video types only; a GPU machine without it still runs the
        # ControlNet and style-model cases (which need nodes) with stand-in modules, never called
        if stand_in_if_missing("av"):
            print("zoo: PyAV is not installed: stand-in modules let ComfyUI's nodes import", flush=True)
        import utils.install_util  # noqa: F401  (main.py imports it before nodes: comfy/utils.py would shadow it)

        import nodes

        return nodes
    except Exception as e:  # the zoo still runs; the ControlNet variant needs nodes and will say so
        print(f"zoo: ComfyUI's nodes module does not import here ({type(e).__name__}: {e}); the pack is loaded "
              "directly", flush=True)
        return None


def load_pack(nodes):
    """The pack as ComfyUI's loader loads it (else imported directly under another name); returns its module."""
    if nodes is not None:
        try:
            if asyncio.run(nodes.load_custom_node(ROOT)):
                return sys.modules[ROOT.replace(".", "_x_")]
        except Exception as e:
            print(f"zoo: ComfyUI's loader failed ({type(e).__name__}: {e}); the pack is loaded directly", flush=True)
    from pack import load

    return load()


def release(path: str) -> str:
    try:
        with open(os.path.join(path, "comfyui_version.py")) as f:
            return f.read().split("__version__ = ")[1].split()[0].strip("\"'")
    except (OSError, IndexError):
        return "unknown"


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout("timed out")


def free_models(device):
    """Every model ComfyUI holds unloaded, and the cache emptied: the next configuration starts clean."""
    import comfy.model_management as mm
    import torch

    mm.unload_all_models()
    mm.soft_empty_cache()
    if device == "cuda":
        torch.cuda.empty_cache()


def rel_l1(a, b) -> float:
    return float((a.double() - b.double()).abs().sum() / b.double().abs().sum().clamp_min(1e-30))


def bound_of(A, backend: str, floor: float = 0.0) -> float:
    """The final latent's rel-L1 bound for ``backend``: its accuracy class's (auto: its gate; auto_exact: the exact
    class) plus ``floor``, how far this model's latent moves with bf16 rounding alone (unpatched bf16 against
    unpatched fp32): on random weights a few steps amplify rounding, and two exact kernels' latents differ by up to
    that much."""
    if backend in ("auto", "auto_fast"):
        # auto_fast's per-call gate (auto's is tighter): the kernels either admits are 8-bit-class or better per call,
        # and an 8-bit kernel's own row is held to 0.08, whichever auto runs it
        cls = A.auto.FAST_MAX_REL_L1
    elif backend == "auto_exact":
        cls = A.registry.ACCURACY["exact"].max_rel_l1
    else:
        cls = A.registry.ACCURACY[A.REGISTRY.get(backend).accuracy].max_rel_l1
    return cls + floor


def rounding_floor(z, cls, case, base, ref, dtype, device):
    """rel-L1 of the unpatched latent (``ref``, sampled in ``dtype``) against the same weights sampled in fp32: the
    noise floor bf16 rounding alone gives this model. 0.0 when ``dtype`` is fp32."""
    import torch

    if dtype == torch.float32:
        return 0.0
    dm = base.model.diffusion_model
    full = z.build(cls, case, dtype=torch.float32, device=device)
    full.model.diffusion_model.load_state_dict({k: v.float() for k, v in dm.state_dict().items()}, strict=False)
    try:
        out = z.sample(full, case)
    finally:
        del full
    return rel_l1(ref, out) if torch.isfinite(out).all() else 0.0


def pick_dtype(cls, device):
    import torch

    if device == "cpu":
        return torch.float32
    dtypes = list(getattr(cls, "supported_inference_dtypes", None) or [torch.bfloat16])
    return torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]


def run_config(z, mod, name, cls, builder, backends, case_timeout, device="cuda"):
    """One configuration: unpatched, then each backend. Returns its result dict (and prints one line per case)."""
    import torch

    A = mod.attention
    definitions = sys.modules[mod.__name__ + ".nodes.definitions"]
    override_of = mod.nodes.patch.override_of
    res = {"configuration": cls.__name__, "family_module": builder.__module__.rsplit(".", 1)[-1], "runs": {}}
    t0 = time.perf_counter()
    dtype = pick_dtype(cls, device)
    res["dtype"] = str(dtype).replace("torch.", "")
    case = builder(cls, True)
    res["outside_hook"] = case.outside_hook
    base = z.build(cls, case, dtype=dtype, device=device)
    res["model"] = f"{type(base.model).__name__} ({type(base.model.diffusion_model).__name__})"
    signal.alarm(case_timeout)
    try:
        ref = z.sample(base, case)
    finally:
        signal.alarm(0)
    res["unpatched"] = {"finite": bool(torch.isfinite(ref).all()), "abs_mean": float(ref.abs().mean()),
                        "seconds": round(time.perf_counter() - t0, 2)}
    signal.alarm(case_timeout)
    try:
        floor = res["rounding_floor"] = rounding_floor(z, cls, case, base, ref, dtype, device)
    except Exception as e:  # the floor is an allowance, never a reason to skip the runs
        floor = res["rounding_floor"] = 0.0
        res["rounding_floor_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        signal.alarm(0)
    print(f"zoo {name} unpatched: {'ok' if res['unpatched']['finite'] else 'FAIL non-finite'} ({res['dtype']}, "
          f"{res['unpatched']['seconds']} s with the build; bf16 rounding floor rel-L1 {floor:.4f})", flush=True)
    for backend in backends:
        t1 = time.perf_counter()
        run = res["runs"][backend] = {"bound_rel_l1": bound_of(A, backend, floor)}
        try:
            signal.alarm(case_timeout)
            try:
                patched = definitions.run_patch(base, backend)[0]
                out = z.sample(patched, case)
            finally:
                signal.alarm(0)
            st = override_of(patched).stats.as_dict()
            run.update(finite=bool(torch.isfinite(out).all()), rel_l1=rel_l1(out, ref), calls=st["calls"],
                       fallbacks=st["fallbacks"], errors=st["errors"], unreached=st["unreached"], auto=st["auto"])
            nan_caught = sum(f["count"] for f in st["fallbacks"] if "non-finite" in f["reason"])
            run["nan_caught"] = nan_caught
            within = math.isinf(run["bound_rel_l1"]) or run["rel_l1"] <= run["bound_rel_l1"]
            run["ok"] = run["finite"] and res["unpatched"]["finite"] and within
            verdict = "ok" if run["ok"] else "FAIL"
            why = "" if run["ok"] else (" non-finite latent" if not run["finite"] else
                                        " beyond its class" if not within else " unpatched non-finite")
            fb = "; ".join(f"{f['from']}->{f['to']} {f['count']}x: {f['reason'][:80]}" for f in st["fallbacks"])
            calls = ",".join(f"{k}={v}" for k, v in sorted(st["calls"].items()))
            print(f"zoo {name} {backend}: {verdict}{why} rel-L1 {run['rel_l1']:.4f} (bound {run['bound_rel_l1']:g}) "
                  f"calls {calls or 'none'}{'; fallbacks ' + fb if fb else ''}"
                  f"{'; NaN caught ' + str(nan_caught) if nan_caught else ''}", flush=True)
        except Exception as e:
            run.update(ok=False, crash=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                       traceback=traceback.format_exc()[-2000:])
            print(f"zoo {name} {backend}: CRASH {run['crash']}", flush=True)
        run["seconds"] = round(time.perf_counter() - t1, 2)
    del base
    free_models(device)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def render(meta, results, not_reached, unbuilt) -> str:
    backends = meta["backends"]
    lines = [f"# Model zoo on {meta['gpu']} ({meta['date']})", "",
             f"ComfyUI {meta['comfyui']}, torch {meta['torch']}; GPU sizes (real head dims, >= 128 tokens where the "
             f"family has them), 2 steps. Cell: rel-L1 of the final latent against unpatched; bound: the backend's "
             f"accuracy class (auto: its gate; auto_exact: the exact class) plus the model's bf16 rounding floor (its "
             f"unpatched bf16 latent against the same weights sampled in fp32: on random weights a few steps amplify "
             f"rounding, so two exact kernels differ by up to that much); FAIL beyond it or non-finite, CRASH an "
             f"exception; * a fallback was counted (see the JSON for the reasons).", "",
             "| configuration | dtype | bf16 floor | " + " | ".join(backends) + " |",
             "|---|---|---|" + "---|" * len(backends)]
    for name, r in results.items():
        cells = []
        if "crash" in r:
            lines.append(f"| {name} | - | - | CRASH before the runs: {r['crash']} |" + " |" * (len(backends) - 1))
            continue
        for b in backends:
            run = r["runs"].get(b)
            if run is None:
                cells.append("-")
            elif "crash" in run:
                cells.append("CRASH")
            else:
                mark = "" if run["ok"] else "FAIL "
                star = "*" if run["fallbacks"] else ""
                cells.append(f"{mark}{run['rel_l1']:.3f}{star}")
        lines.append(f"| {name} | {r.get('dtype', '-')} | {r.get('rounding_floor', 0.0):.3f} | " + " | ".join(cells) + " |")
    if not_reached:
        lines += ["", f"Not reached within the time budget ({meta['budget_s']} s): {', '.join(not_reached)}"]
    if unbuilt:
        lines += ["", "Not built (why: tests/zoo):", *[f"- {n}: {w}" for n, w in unbuilt.items()]]
    fails = [f"{n} {b}" for n, r in results.items() for b, run in r.get("runs", {}).items() if not run.get("ok")]
    fails += [f"{n} (build/unpatched)" for n, r in results.items() if "crash" in r]
    lines += ["", f"Failures: {', '.join(fails) if fails else 'none'}"]
    return "\n".join(lines) + "\n"


def common_args(ap, env: str, budget: float, backends: str) -> None:
    """The zoo's options (also tests/gpu/cp_zoo.py's); each option's default from ``<env>_<OPTION>`` when set."""
    ap.add_argument("--json", required=True)
    ap.add_argument("--md")
    ap.add_argument("--budget", type=float, default=float(os.environ.get(f"{env}_BUDGET", budget)),
                    help=f"seconds; no configuration starts after it (default {budget:g}, {env}_BUDGET)")
    ap.add_argument("--part", default=os.environ.get(f"{env}_PART", "1/1"),
                    help="i/n: every n-th configuration from the i-th")
    ap.add_argument("--only", default=os.environ.get(f"{env}_ONLY", ""), help="comma-separated configurations/variants")
    ap.add_argument("--backends", default=os.environ.get(f"{env}_BACKENDS", ""),
                    help=f"comma-separated (default: {backends})")
    ap.add_argument("--case-timeout", type=int, default=int(os.environ.get(f"{env}_CASE_TIMEOUT", 120)),
                    help="seconds for one sampling run before it is recorded as timed out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script in fp32 (no kernels)")


def config_names(z, only: str = "") -> list[str]:
    """Every configuration of the ComfyUI under test, then the zoo's variants (``only``: comma-separated, those)."""
    import comfy.supported_models as sm

    names = [c.__name__ for c in sm.models] + list(z.VARIANTS)
    if only:
        want = set(only.split(","))
        names = [n for n in names if n in want]
    return names


def part_of(names: list, part: str) -> list:
    """``part`` "i/n": every n-th of ``names`` from the i-th."""
    i, n = (int(x) for x in part.split("/"))
    return names[i - 1::n]


def resolve(z, name: str):
    """(configuration class name, builder) of a configuration or variant; (name, None) where tests/zoo builds none."""
    if name in z.VARIANTS:
        return z.VARIANTS[name]
    return name, z.BUILDERS.get(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "ZOO", 480, "every installed backend and auto")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("zoo: no CUDA device")
    path = os.environ.get("COMFYUI_PATH", "")
    nodes = import_comfy(path, cpu=a.device == "cpu")
    mod = load_pack(nodes)
    import comfy.supported_models as sm
    import zoo as z

    z.load_families()
    A = mod.attention
    installed = [n for n in A.REGISTRY.available()]
    backends = [b for b in a.backends.split(",") if b] or [*installed, "auto"]
    names = part_of(config_names(z, a.only), a.part)
    meta = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (dry run)", "torch": torch.__version__, "comfyui": release(path),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "backends": backends, "installed": installed,
            "budget_s": a.budget, "part": a.part, "steps": 2}
    print(f"zoo: {len(names)} configurations (part {a.part}), backends {', '.join(backends)}; budget {a.budget:g} s",
          flush=True)
    signal.signal(signal.SIGALRM, _alarm)
    results, not_reached, unbuilt = {}, [], {}

    def write():
        meta["seconds"] = round(time.perf_counter() - t_start, 1)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results, "not_reached": not_reached, "unbuilt": unbuilt}, f, indent=1)
        if a.md:
            with open(a.md, "w") as f:
                f.write(render(meta, results, not_reached, unbuilt))

    for k, name in enumerate(names):
        if time.perf_counter() - t_start > a.budget:
            not_reached += names[k:]
            print(f"zoo: time budget spent; not reached: {', '.join(names[k:])}", flush=True)
            break
        config, builder = resolve(z, name)
        if builder is None:
            unbuilt[name] = z.UNBUILT.get(name, "no builder in tests/zoo")
            print(f"zoo {name}: not built: {unbuilt[name][:120]}", flush=True)
            continue
        cls = getattr(sm, config)
        try:
            results[name] = run_config(z, mod, name, cls, builder, backends, a.case_timeout, a.device)
        except Exception as e:
            results[name] = {"configuration": config, "crash": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                             "traceback": traceback.format_exc()[-2000:]}
            print(f"zoo {name}: CRASH before the runs: {results[name]['crash']}", flush=True)
            free_models(a.device)
        write()
    write()
    fails = sum(1 for r in results.values() for run in r.get("runs", {}).values() if not run.get("ok"))
    fails += sum(1 for r in results.values() if "crash" in r)
    print(f"zoo: {len(results)} configurations run, {fails} failing cases, {len(not_reached)} not reached, "
          f"{len(unbuilt)} not built; {meta['seconds']} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
