"""A soak of ComfyUI's server with this pack: many prompts through /prompt, the attention backend changed between
consecutive prompts, on one GPU, with Context Parallel and with ComfyUI's MultiGPU CFG Split.

    python tests/gpu/soak.py --out DIR [--prompts 216] [--backends disabled,sdpa,auto] [--cfgs 1,5] [--steps 2]
    python tests/gpu/soak.py --out DIR --cpu --devices 2 --prompts 12     # the check on a machine without GPUs

ComfyUI's server (``main.py`` of COMFYUI_PATH) starts in a temporary base directory whose custom_nodes hold this pack,
its test nodes (tests/fixture_nodes: random conditioning) and this file (loaded by ComfyUI as a custom node: the state
route below).  A tiny random-weight Wan 2.1 T2V file (2 heads of 128, ComfyUI's own detection finds it) is written to
its models/diffusion_models and loaded by ComfyUI's UNETLoader, which registers the reload function MultiGPU copies are
made with.  Every prompt: UNETLoader -> Patch Attention (the backend) -> [Context Parallel | MultiGPU CFG Split | none]
-> KSampler (CFG 1 or 5, a new seed) -> SaveLatent; the multi-GPU nodes keep their own ids, as in one graph where the
user switches between them.  Prompts go in rounds of every (mode, CFG, backend), backends innermost: consecutive
prompts never share a backend.

After each prompt the state route gives the server's host RSS, each GPU's memory (PyTorch's allocated and reserved,
and the device's used memory), ComfyUI's loaded models (those whose patcher is gone: ComfyUI's "memory leak" entries)
and how many "memory leak" warnings ComfyUI logged.  Expected: no failed prompt; memory flat after the first round
(the last quarter of the prompts within --rss-tolerance / --gpu-tolerance MiB of the end of the first round), with
ComfyUI's LRU output cache (its default keeps every prompt's outputs while the host has RAM to spare).
Results: DIR/soak.json (every prompt) and DIR/soak.md; exit status 1 on a failure or growth.

``--cpu --devices N``: ComfyUI in CPU mode sees N devices (the CPU and ``cpu:1`` ..., labels on the CPU, as the pack's CPU
tests do), so that both multi-GPU nodes make their copies and run their paths; forwards split from 0 tokens.  What only
GPUs check: per-GPU memory, the copies' weights on other devices, peer copies, CUDA streams.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.realpath(__file__))  # this file, also where ComfyUI loads it through a link
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = "pa_soak_wan.safetensors"
MODES = ("one", "cp", "cfg")  # one GPU, the pack's Context Parallel node, ComfyUI's MultiGPU CFG Split node
LRU = 32  # node outputs ComfyUI's cache keeps (--cache-lru): more than one round of prompts' models and copies


# ---------------------------------------------------------------- inside the server (loaded as a custom node)

def _install_server_side() -> None:
    """The state route, the count of ComfyUI's "memory leak" warnings, and (PA_SOAK_DEVICES) the devices ComfyUI
    sees on the CPU and the pack's split from 0 tokens."""
    import comfy.model_management as mm
    from aiohttp import web
    from server import PromptServer

    leaks = []

    class Leaks(logging.Handler):
        def emit(self, record):
            if "memory leak with model" in record.getMessage():
                leaks.append(record.getMessage())

    logging.getLogger().addHandler(Leaks())
    n = int(os.environ.get("PA_SOAK_DEVICES", "0"))
    if n:
        import torch

        devs = [torch.device("cpu")] + [torch.device("cpu", i) for i in range(1, n)]
        mm.get_all_torch_devices = lambda exclude_current=False: list(devs)

    @PromptServer.instance.routes.get("/pa_soak/state")
    async def state(request):
        # the soak's Context Parallel prompts split every forward (its tiny model is below every work floor); the pack
        # may load after this file: it is looked up here, before the first prompt
        if n or os.environ.get("PA_SOAK_SPLIT_ALL") == "1":
            import importlib

            init = os.path.join(ROOT, "__init__.py")
            for name, m in list(sys.modules.items()):
                if os.path.realpath(getattr(m, "__file__", None) or "") == init:
                    importlib.import_module(name + ".nodes.context_parallel").MIN_SPLIT_TOKENS = 0
        return web.json_response(server_state(mm, leaks))


def server_state(mm, leaks: list) -> dict:
    import torch

    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"allocated": torch.cuda.memory_allocated(i), "reserved": torch.cuda.memory_reserved(i),
                     "used": total - free})
    loaded = [None if p is None else f"{type(p.model).__name__}@{p.load_device}" for p in mm.loaded_models()]
    return {"rss": rss, "gpus": gpus, "loaded": loaded, "dead": loaded.count(None), "leak_warnings": len(leaks)}


if __name__ != "__main__" and os.environ.get("PA_SOAK") == "1":
    _install_server_side()
NODE_CLASS_MAPPINGS: dict = {}


# ---------------------------------------------------------------- the client

def write_model(path: str, comfyui: str) -> None:
    """A tiny Wan 2.1 T2V (2 blocks, 2 heads of 128, umT5's 4096-wide text input) with random weights, as a
    diffusion-model file (ComfyUI's detection reads its sizes from the weights)."""
    sys.path.insert(0, comfyui)
    sys.path.insert(1, os.path.dirname(HERE))  # tests/: the zoo
    from comfy.cli_args import args

    args.cpu = True
    import comfy.supported_models as sm
    import comfy.utils
    import zoo

    case = zoo.Case(unet_config=dict(dim=256, ffn_dim=512, freq_dim=256, text_dim=4096, num_heads=2, num_layers=2,
                                     patch_size=(1, 2, 2)), latent=(1, 16, 1, 8, 8), positive=[], init_std=0.05)
    m = zoo.build(sm.WAN21_T2V, case)
    comfy.utils.save_torch_file({k: t.contiguous() for k, t in m.model.diffusion_model.state_dict().items()}, path)


def call(url: str, data=None, timeout: float = 10):
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start(a, base: str, comfyui: str):
    """ComfyUI's server in ``base`` (this pack, its test nodes and this file as custom nodes, the tiny Wan file in its
    models); (process, url)."""
    models = os.path.join(base, "models", "diffusion_models")
    os.makedirs(models)
    write_model(os.path.join(models, MODEL), comfyui)
    # ComfyUI 0.33's default output cache keeps every prompt's outputs until the host runs short of RAM (a new seed each
    # prompt: 8.4 MiB more per prompt, with or without this pack, measured); its LRU cache keeps the outputs of the last
    # prompts (the models, the multi-GPU nodes' copies among them, as the default does), so what stays beyond them is
    # what the prompts leave
    return launch(a, base, comfyui, os.path.join(a.out, "soak-server.log"),
                  ["--cache-lru", str(LRU), *getattr(a, "server_args", "").split()], env={"PA_SOAK_SPLIT_ALL": "1"})


def launch(a, base: str, comfyui: str, log_path: str, server_args=(), nodes=None, env=None):
    """ComfyUI's main.py in ``base`` (``--base-directory``), its custom nodes this pack, its test nodes, this file (the
    state route; ``a.cpu``: CPU mode seeing ``a.devices`` devices) and ``nodes`` (file name -> path), ``env`` added to
    its environment, ``server_args`` to its arguments, its log to ``log_path``; (process, url) once it answers."""
    nodes_dir = os.path.join(base, "custom_nodes")
    os.makedirs(nodes_dir)
    os.symlink(ROOT, os.path.join(nodes_dir, "ComfyUI-PatchAttention"))
    os.symlink(os.path.join(ROOT, "tests", "fixture_nodes"), os.path.join(nodes_dir, "pa_test_fixtures"))
    os.symlink(os.path.abspath(__file__), os.path.join(nodes_dir, "pa_soak.py"))
    for name, path in (nodes or {}).items():
        os.symlink(os.path.abspath(path), os.path.join(nodes_dir, name))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PA_SOAK": "1", "PA_SOAK_DEVICES": str(a.devices if a.cpu else 0), **(env or {})}
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", base, "--disable-auto-launch", "--database-url", "sqlite:///:memory:", *server_args]
    cmd += ["--cpu"] if a.cpu else []
    import importlib.util

    if importlib.util.find_spec("comfyui_frontend_package") is None:  # no frontend here: a page of its own
        web = os.path.join(base, "web")
        os.makedirs(web)
        with open(os.path.join(web, "index.html"), "w") as f:
            f.write("<html></html>")
        cmd += ["--front-end-root", web]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            call(url + "/pa_soak/state", timeout=2)
            return proc, url
        except Exception:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"soak: ComfyUI did not start ({os.path.basename(log_path)})")


def node_inputs(url: str, node: str) -> dict:
    """A node's required widget inputs at their defaults (from /object_info)."""
    spec = call(f"{url}/object_info/{node}")[node]["input"]["required"]
    out = {}
    for name, s in spec.items():
        opts = s[1] if len(s) > 1 and isinstance(s[1], dict) else {}
        if "default" in opts:
            out[name] = opts["default"]
        elif isinstance(s[0], list) and s[0]:
            out[name] = s[0][0]
    return out


def prompt(a, defaults: dict, k: int, mode: str, cfg: float, backend: str) -> dict:
    w, h, frames = a.size
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
        "2": {"class_type": "PatchAttention", "inputs": {**defaults["PatchAttention"], "model": ["1", 0],
                                                         "backend": backend, "log_stats": False}},
        "5": {"class_type": "PATestConditioning", "inputs": {"seed": 1, "tokens": 16, "context_dim": 4096,
                                                             "pooled_dim": 8}},
        "6": {"class_type": "PATestConditioning", "inputs": {"seed": 2, "tokens": 16, "context_dim": 4096,
                                                             "pooled_dim": 8}},
        "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": w, "height": h, "length": frames,
                                                                  "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": k, "steps": a.steps, "cfg": cfg,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["5", 0],
                                                   "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "pa_soak"}},
    }
    if mode == "cp":
        p["3"] = {"class_type": "ContextParallel", "inputs": {**defaults["ContextParallel"], "model": ["2", 0]}}
        p["8"]["inputs"]["model"] = ["3", 0]
    elif mode == "cfg":
        p["4"] = {"class_type": "MultiGPU_WorkUnits", "inputs": {"model": ["2", 0], "max_gpus": a.gpus}}
        p["8"]["inputs"]["model"] = ["4", 0]
    return p


def run(url: str, p: dict, timeout: float) -> tuple[bool, str, float]:
    """Queue ``p`` and wait: (succeeded, the error ComfyUI reported, seconds)."""
    ok, err, secs, _ = run_entry(url, p, timeout)
    return ok, err, secs


def run_entry(url: str, p: dict, timeout: float, client: str = "pa-soak") -> tuple[bool, str, float, dict | None]:
    """:func:`run`, and the prompt's /history entry with its id as ``prompt_id`` (None: refused or not finished)."""
    t0 = time.time()
    try:
        pid = call(url + "/prompt", {"prompt": p, "client_id": client})["prompt_id"]
    except urllib.error.HTTPError as e:  # refused at validation
        return False, e.read().decode(errors="replace")[:600], 0.0, None
    while time.time() - t0 < timeout:
        entry = call(f"{url}/history/{pid}").get(pid)
        status = (entry or {}).get("status", {})
        if status.get("completed"):
            return True, "", time.time() - t0, {**entry, "prompt_id": pid}
        if status.get("status_str") == "error":
            err = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
            e = err[0] if err else {}
            return False, f"{e.get('node_type')}: {e.get('exception_type')}: {e.get('exception_message', '')}"[:600], \
                time.time() - t0, {**entry, "prompt_id": pid}
        time.sleep(0.05)
    return False, f"not finished in {timeout:.0f} s", time.time() - t0, None


def plan(a) -> list[tuple[str, float, str]]:
    """(mode, cfg, backend) of every prompt: rounds of every combination, backends innermost."""
    combos = [(m, c, b) for m in MODES for c in a.cfgs for b in a.backends]
    return [combos[i % len(combos)] for i in range(a.prompts)]


def verdict(a, rows: list, first_round: int) -> dict:
    """Failures, and memory growth from the end of the first round to the last quarter (mean), host and per GPU."""
    done = [r for r in rows if r["state"]]
    base = done[min(first_round, len(done)) - 1]["state"] if done else None
    tail = [r["state"] for r in done[-max(1, len(done) // 4):]]
    mib = 2 ** 20
    out = {"prompts": len(rows), "failed": sum(not r["ok"] for r in rows), "errors": {}}
    for r in rows:
        if not r["ok"]:
            out["errors"][r["error"]] = out["errors"].get(r["error"], 0) + 1
    if base is None:
        return {**out, "flat": False}
    out["rss_growth_mib"] = (sum(s["rss"] for s in tail) / len(tail) - base["rss"]) / mib

    def grown(key: str) -> list:  # each GPU's ``key`` memory, from the end of the first round to the last quarter
        return [(sum(s["gpus"][i][key] for s in tail) / len(tail) - g[key]) / mib for i, g in enumerate(base["gpus"])]

    out["gpu_growth_mib"] = grown("used")
    # PyTorch's tensors alone: growth here is memory held (a leak), growth of the device's used memory alone is cache
    out["allocated_growth_mib"] = grown("allocated")
    out["dead_entries_max"] = max(r["state"]["dead"] for r in done)
    out["leak_warnings"] = done[-1]["state"]["leak_warnings"]
    out["flat"] = out["rss_growth_mib"] <= a.rss_tolerance and all(g <= a.gpu_tolerance for g in out["gpu_growth_mib"])
    return out


def render(meta: dict, v: dict, rows: list) -> str:
    mib = 2 ** 20
    lines = [f"# Soak: {v['prompts']} prompts through ComfyUI's server", "",
             f"{meta['device']}, ComfyUI {meta['comfyui']}, torch {meta['torch']}, {meta['date']}; backends "
             f"{', '.join(meta['backends'])} x {', '.join(MODES)} x CFG {', '.join(f'{c:g}' for c in meta['cfgs'])}; "
             f"{meta['steps']} steps, latent {meta['size']}"
             f"{'; ComfyUI started with ' + meta['server_args'] if meta.get('server_args') else ''}", "",
             f"- failed prompts: {v['failed']} (0 expected)"]
    lines += [f"  - {n}x {e}" for e, n in v["errors"].items()]
    if "rss_growth_mib" in v:
        lines += [f"- host RSS: {v['rss_growth_mib']:+.0f} MiB from the end of the first round to the last quarter",
                  *[f"- GPU {i} used: {g:+.0f} MiB (PyTorch's tensors: {t:+.0f} MiB)"
                    for i, (g, t) in enumerate(zip(v["gpu_growth_mib"], v["allocated_growth_mib"]))],
                  f"- ComfyUI's loaded models whose patcher was gone: at most {v['dead_entries_max']}; its \"memory "
                  f"leak\" warnings: {v['leak_warnings']}",
                  f"- memory flat: {'yes' if v['flat'] else 'NO'}",
                  f"- sampling runs split over the GPUs: {v.get('split_runs', 0)}, of them {v.get('graph_runs', 0)} "
                  f"replayed CUDA graphs, {v.get('kept_graph_runs', 0)} only graphs kept from the run before"]
    lines += ["", "| # | mode | CFG | backend | ok | s | RSS MiB | GPU used MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["state"] or {}
        gpu = " / ".join(f"{g['used'] / mib:.0f}" for g in s.get("gpus", []))
        lines.append(f"| {r['i']} | {r['mode']} | {r['cfg']:g} | {r['backend']} | {'yes' if r['ok'] else 'NO'} | "
                     f"{r['seconds']:.1f} | {s.get('rss', 0) / mib:.0f} | {gpu} |")
    return "\n".join(lines) + "\n"


def serve(args: list) -> None:
    """ComfyUI's main.py (the current directory) with ``args``; a package it imports at start-up that this Python lacks
    and the soak never uses (PyAV on the GPU machine) is an empty stand-in."""
    import runpy

    sys.path.insert(0, os.getcwd())
    sys.path.insert(1, os.path.dirname(HERE))  # tests/: comfyui_support
    from absent import stand_in_if_missing  # torch is main.py's to import (it picks the CUDA allocator first)

    stand_in_if_missing("av")
    sys.argv = ["main.py", *args]
    runpy.run_path("main.py", run_name="__main__")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=216)
    ap.add_argument("--backends", default="disabled,sdpa,auto,auto_exact,sage_fp8_sm90")
    ap.add_argument("--cfgs", default="1,5")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", default="832x480x41", help="width x height x frames (Wan: 17,160 tokens at 832x480x41)")
    ap.add_argument("--gpus", type=int, default=2, help="MultiGPU CFG Split's max_gpus")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI in CPU mode (the check without GPUs)")
    ap.add_argument("--devices", type=int, default=2, help="with --cpu: the devices ComfyUI sees")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a prompt may take")
    ap.add_argument("--server-args", default="",
                    help="more arguments for ComfyUI's main.py (e.g. --disable-cuda-malloc: split forwards replayed as "
                         "CUDA graphs, kept from prompt to prompt)")
    ap.add_argument("--rss-tolerance", type=float, default=256, help="MiB")
    ap.add_argument("--gpu-tolerance", type=float, default=128, help="MiB")
    a = ap.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    a.cfgs = [float(c) for c in a.cfgs.split(",")]
    a.size = tuple(int(x) for x in a.size.split("x"))
    comfyui = os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", "..")
    os.makedirs(a.out, exist_ok=True)
    base = tempfile.mkdtemp(prefix="pa-soak-")
    proc, url = start(a, base, comfyui)
    try:
        rows, meta = soak(a, url, comfyui)
    finally:
        stop(proc, base)
    v = verdict(a, rows, len(MODES) * len(a.cfgs) * len(a.backends))
    v.update(split_runs(os.path.join(a.out, "soak-server.log")))
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump({"meta": meta, "verdict": v, "prompts": rows}, f, indent=1)
    md = render(meta, v, rows)
    with open(os.path.join(a.out, "soak.md"), "w") as f:
        f.write(md)
    print("\n".join(md.splitlines()[:12 + len(v["errors"])]))
    return 0 if v["failed"] == 0 and v["flat"] and v["split_runs"] else 1


def split_runs(log_path: str) -> dict:
    """The sampling runs the Context Parallel node split (its "N of M forwards split" line in the server's log), and of
    them those that replayed CUDA graphs and those that recorded none (replayed graphs kept from the run before): a
    soak whose split prompts split nothing has not soaked the split."""
    with open(log_path, errors="replace") as f:
        lines = [ln for ln in f if "forwards split over" in ln]
    return {"split_runs": sum(not re.search(r": 0 of \d+ forwards split", ln) for ln in lines),
            "graph_runs": sum("replayed as CUDA graphs" in ln for ln in lines),
            "kept_graph_runs": sum("(0 recorded)" in ln for ln in lines)}


def stop(proc, base: str) -> None:
    """The server stopped (killed if it does not end within 30 s) and its base directory removed."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(base, ignore_errors=True)


def machine(a, comfyui: str) -> dict:
    """The devices the server runs on (nvidia-smi's names, or the CPU), ComfyUI's release and torch's, read without
    CUDA in this process (its memory would count as the server's)."""
    sys.path.insert(0, comfyui)
    import torch  # its version only
    from comfyui_version import __version__ as version

    device = f"CPU ({a.devices} devices seen by ComfyUI)"
    if not a.cpu:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True).stdout.split("\n")
        device = " + ".join(n.strip() for n in names if n.strip())
    return {"device": device, "comfyui": version, "torch": torch.__version__}


def soak(a, url: str, comfyui: str):
    """Every prompt of :func:`plan`, with the server's state after each; (rows, meta)."""
    import datetime

    defaults = {n: node_inputs(url, n) for n in ("PatchAttention", "ContextParallel")}
    first = call(url + "/pa_soak/state")
    meta = {**machine(a, comfyui), "date": datetime.date.today().isoformat(), "backends": a.backends, "cfgs": a.cfgs, "steps": a.steps, "size": "x".join(map(str, a.size)),
            "server_args": a.server_args, "state_at_start": first}
    rows = []
    for i, (mode, cfg, backend) in enumerate(plan(a)):
        ok, err, secs = run(url, prompt(a, defaults, i, mode, cfg, backend), a.timeout)
        try:
            state = call(url + "/pa_soak/state")
        except Exception:  # the server is gone: every later prompt fails the same way
            state = None
        rows.append({"i": i, "mode": mode, "cfg": cfg, "backend": backend, "ok": ok, "error": err, "seconds": secs,
                     "state": state})
        rss = "" if state is None else f" rss {state['rss'] / 2**20:.0f} MiB, {state['dead']} dead entries"
        print(f"soak {i:4d} {mode:3s} cfg {cfg:g} {backend:14s} {'ok' if ok else 'FAILED ' + err[:160]} {secs:.1f} s{rss}",
              flush=True)
        if state is None:
            break
    return rows, meta


if __name__ == "__main__":
    sys.exit(main())
