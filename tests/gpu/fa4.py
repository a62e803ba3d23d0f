"""FlashAttention-4 on the GPU machine: install.py for real (offline), compile cost, mask support.

    python tests/gpu/fa4.py install --wheels DIR --out DIR   install.py --only flash_attn4 from DIR (--find-links, --no-index),
                                                           torch checked before/after, a second run, the import path of a
                                                           --target install without the .pth; then `check` in a fresh process
    python tests/gpu/fa4.py check --out DIR                 import flash_attn.cute and calls through the pack (a fresh process)
    python tests/gpu/fa4.py compile --out DIR [--budget S]   first-call (JIT compile) and steady time per declared head dim
                                                           and dtype; which new shapes compile again; FA4's own disk cache
    python tests/gpu/fa4.py mask --out DIR [--budget S]      ComfyUI's bool / additive masks through FA4's mask_mod /
                                                           score_mod: error vs fp32 SDPA, speed vs SDPA with the same mask

Each part writes fa4-<part>.json and fa4-<part>.md under --out (the JSON after every case, so a timeout leaves what was
done) and prints one line per case. Nothing here changes the pack; ``mask`` uses tests/gpu/fa4_mods.py.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
FA4_SET_NAMES = ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-base",
                 "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi", "torch-c-dlpack-ext",
                 "quack-kernels", "einops", "cuda-bindings", "cuda-pathfinder", "torch", "torchvision", "torchaudio")


class Report:
    """Rows of one part, written as JSON after each row and as markdown at the end."""

    def __init__(self, out, part, meta=None):
        self.out, self.part = out, part
        self.data = {"meta": dict(meta or {}), "rows": []}
        os.makedirs(out, exist_ok=True)

    def add(self, row, line):
        self.data["rows"].append(row)
        print(line, flush=True)
        self.save()

    def save(self):
        with open(os.path.join(self.out, f"fa4-{self.part}.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def md(self, text):
        with open(os.path.join(self.out, f"fa4-{self.part}.md"), "w") as f:
            f.write(text)
        print(text, flush=True)


def short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def run(cmd, timeout, env=None):
    """(rc, seconds, combined output) of a command; rc 124 on timeout."""
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        return r.returncode, time.time() - t0, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return 124, time.time() - t0, out.decode(errors="replace") if isinstance(out, bytes) else out


def versions(env=None) -> dict:
    code = ("import json\nfrom importlib import metadata as m\nout={}\nfor n in %r:\n try: out[n]=m.version(n)\n"
            " except Exception: pass\nprint(json.dumps(out))" % (FA4_SET_NAMES,))
    rc, _, out = run([PY, "-c", code], 60, env)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": out[-300:]}


def load_install():
    spec = importlib.util.spec_from_file_location("pa_install_gpu", os.path.join(ROOT, "install.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def join_parts(wheels: str) -> list[str]:
    """A wheel carried in parts (``X.whl.part-aa``, ``-ab``, ...) is joined into ``X.whl`` where that is missing."""
    done = []
    for first in sorted(glob.glob(os.path.join(wheels, "*.whl.part-*"))):
        whl = first.rsplit(".part-", 1)[0]
        if os.path.exists(whl) or whl in done:
            continue
        with open(whl + ".tmp", "wb") as f:
            for part in sorted(glob.glob(whl + ".part-*")):
                with open(part, "rb") as p:
                    f.write(p.read())
        os.replace(whl + ".tmp", whl)
        done.append(whl)
    return done


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


PROBE = """
import json, sys, time
sys.path.insert(0, {root!r})
t0 = time.time()
from attention.backends import flash
av = flash._fa4_probe()
row = {{"ok": av.ok, "reason": av.reason, "version": av.version, "import_s": round(time.time() - t0, 2)}}
if av.ok and {call}:
    import torch
    from attention import AttentionConfig, attention
    from attention.dispatch import fp32_reference
    from attention.reference import accuracy
    q, k, v = (torch.randn(1, 4096, 8 * 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = AttentionConfig(backend="flash_attn4", allow_fallback=False)
    out = attention(q, k, v, 8, config=cfg)
    cos, rel = accuracy(out, fp32_reference(q, k, v, 8))
    row.update(call_ran=sorted(cfg.stats.calls), cos=round(cos, 6), rel_l1=round(rel, 5))
print("JSON:" + json.dumps(row))
"""


def probe_in(extra_path, call=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, *filter(None, [env.get("PYTHONPATH")])])
    rc, s, out = run([PY, "-c", PROBE.format(root=ROOT, call=call)], 180, env)
    for line in out.splitlines():
        if line.startswith("JSON:"):
            return {**json.loads(line[5:]), "seconds": round(s, 1)}
    return {"ok": False, "reason": f"probe process rc={rc}: {out[-400:]}", "seconds": round(s, 1)}


# ------------------------------------------------------------------ (a) install

def cmd_install(a):
    rep = Report(a.out, "install", {"wheels": a.wheels})
    inst = load_install()
    joined = join_parts(a.wheels)
    pinned = {fn: sha for d in inst.PINNED_DISTS.values() for fn, sha in d.files}
    files = sorted(glob.glob(os.path.join(a.wheels, "*.whl")))
    listing = []
    for f in files:
        fn = os.path.basename(f)
        listing.append({"file": fn, "mb": round(os.path.getsize(f) / 2**20, 1),
                        "pinned": pinned.get(fn) == sha256(f) if fn in pinned else "not in the pinned table"})
    rep.data["meta"].update(joined=joined, files=listing)
    rep.add({"case": "wheels", "files": len(files), "joined": len(joined)},
            f"wheels: {len(files)} files in {a.wheels} ({len(joined)} joined from parts); "
            + "; ".join(f"{x['file']} {x['mb']} MB pinned={x['pinned']}" for x in listing))
    before = versions()
    rep.data["meta"]["before"] = before
    m = inst.detect()
    st = inst.fa4_step(m, force=True)
    rep.add({"case": "plan", "action": st.action, "reason": st.reason, "dists": st.dists},
            f"plan: flash_attn4 {st.action}: {st.reason}; {', '.join(st.dists)}")

    # The import path of a --target install, where nvidia-cutlass-dsl's .pth is not processed (before the real install:
    # once flash-attn-4 is in site-packages its .pth puts the folder on every process's path)
    if "flash-attn-4" in before:
        rep.add({"case": "target", "skipped": "flash-attn-4 already in site-packages"},
                "target install: skipped (flash-attn-4 is already installed in site-packages)")
    elif st.action == "wheel":
        target = tempfile.mkdtemp(prefix="pa-fa4-target-")
        req = os.path.join(target, "..", os.path.basename(target) + "-req.txt")
        with open(req, "w") as f:
            f.write("".join(line + "\n" for line in st.hashed))
        rc, s, out = run([PY, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--require-hashes", "--no-index",
                          "--find-links", a.wheels, "--target", target, "-r", req], 240)
        row = {"case": "target", "pip_rc": rc, "seconds": round(s, 1)}
        if rc != 0:
            row["pip_tail"] = out[-600:]
            rep.add(row, f"target install: pip rc={rc} after {s:.0f} s: {out.strip().splitlines()[-1:] }")
        else:
            folder = os.path.join(target, "nvidia_cutlass_dsl", "dsl_packages")
            without = probe_in([target], call=False)
            with_dir = probe_in([target, folder])
            row.update(without_pth=without, folder_added=with_dir, folder=folder)
            named = (not without["ok"]) and folder in without.get("reason", "")
            rep.add(row, f"target install ({s:.0f} s): without the .pth -> ok={without['ok']}, reason names the folder: "
                         f"{named}; with {folder} on PYTHONPATH -> ok={with_dir['ok']} ran={with_dir.get('call_ran')} "
                         f"cos={with_dir.get('cos')} rel-L1={with_dir.get('rel_l1')}")

    log_dir = os.path.join(tempfile.gettempdir(), "pa-fa4-logs")
    cmd = [PY, "install.py", "--only", "flash_attn4", "--yes", "--find-links", a.wheels, "--no-index", "--log-dir", log_dir]
    rc, s, out = run(cmd, 360)
    after = versions()
    moved = {n: (before.get(n), after.get(n)) for n in ("torch", "torchvision", "torchaudio") if before.get(n) != after.get(n)}
    installed = {n: after[n] for n in FA4_SET_NAMES[:12] if n in after}
    rep.add({"case": "install", "rc": rc, "seconds": round(s, 1), "torch_moved": moved, "installed": installed,
             "tail": out.strip().splitlines()[-30:]},
            f"install.py --only flash_attn4 (offline): rc={rc} in {s:.0f} s; torch {before.get('torch')} -> "
            f"{after.get('torch')} ({'unchanged' if not moved else 'MOVED ' + str(moved)}); installed: "
            + ", ".join(f"{k} {v}" for k, v in installed.items()))
    for line in out.strip().splitlines()[-14:]:
        print("    " + line)
    rc2, s2, out2 = run(cmd[:-2] + ["--no-verify", "--log-dir", log_dir + "-2"], 120)
    again = "already installed" in out2
    rep.add({"case": "second run", "rc": rc2, "seconds": round(s2, 1), "already_installed": again},
            f"second run: rc={rc2} in {s2:.0f} s; says already installed: {again}")
    rc3, s3, out3 = run([PY, os.path.join(HERE, "fa4.py"), "check", "--out", a.out], 300)
    rep.add({"case": "check (fresh process)", "rc": rc3, "seconds": round(s3, 1)},
            f"fresh process check: rc={rc3} in {s3:.0f} s (fa4-check.md)")
    print(out3[-3000:])
    lines = ["FlashAttention-4 install (install.py --only flash_attn4, offline from carried wheels)", "",
             "| case | result |", "|---|---|"]
    for r in rep.data["rows"]:
        lines.append(f"| {r['case']} | " + json.dumps({k: v for k, v in r.items() if k not in ('case', 'tail', 'pip_tail')},
                                                    default=str)[:400].replace("|", "/") + " |")
    rep.md("\n".join(lines) + "\n")
    ok = rc == 0 and not moved and again and rc3 == 0
    return 0 if ok else 1


# ------------------------------------------------------------------ check (a fresh process)

_PACK = []


def pack():
    """The pack, loaded as ComfyUI loads it (tests/pack.py), once."""
    if not _PACK:
        sys.path.insert(0, os.path.dirname(HERE))
        from pack import load

        _PACK.append(load())
    return _PACK[0]


def out0(out):
    """FA4 returns (out, lse)."""
    return out[0] if isinstance(out, tuple) else out


def timed(fn, reps=10, rounds=3):
    import torch

    A = pack().attention
    return A.auto.time_call(fn, torch.device("cuda"), warmup=2, reps=reps, rounds=rounds)


def cmd_check(a):
    import torch

    rep = Report(a.out, "check")
    t0 = time.time()
    try:
        fc = importlib.import_module("flash_attn.cute")
        cutlass = importlib.import_module("cutlass")
        lib = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
        rep.data["meta"].update(import_s=round(time.time() - t0, 2), cutlass=cutlass.__version__,
                                dsl_cuda=str(getattr(cutlass, "CUDA_VERSION", "?")),
                                cutlass_ir=os.path.basename(getattr(lib, "__file__", "") or ""), fa4_file=fc.__file__)
        rep.add({"case": "import", "ok": True, **rep.data["meta"]},
                f"import flash_attn.cute: ok in {time.time() - t0:.1f} s; cutlass {cutlass.__version__}, DSL CUDA "
                f"{rep.data['meta']['dsl_cuda']}, {rep.data['meta']['cutlass_ir']}")
    except Exception as e:
        rep.add({"case": "import", "ok": False, "error": short(e)}, f"import flash_attn.cute: FAILED {short(e)}")
        rep.md(f"import flash_attn.cute failed: {short(e)}\n")
        return 1
    P = pack()
    A = P.attention
    av = A.REGISTRY.get("flash_attn4").availability()
    rep.add({"case": "probe", "ok": av.ok, "version": av.version, "reason": av.reason},
            f"pack probe: ok={av.ok} version={av.version} {av.reason}")
    dev = torch.device("cuda")
    fails = 0

    def call(label, q, k, v, heads, skip=False, gqa=False):
        nonlocal fails
        cfg = A.AttentionConfig(backend="flash_attn4", allow_fallback=False)
        kw = dict(skip_reshape=skip, skip_output_reshape=skip, enable_gqa=gqa)
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = A.attention(q, k, v, heads, config=cfg, **kw)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            ms = timed(lambda: A.attention(q, k, v, heads, config=cfg, **kw))
            cos, rel = A.auto.accuracy(out, A.dispatch.fp32_reference(q, k, v, heads, **kw))
            exact = A.registry.ACCURACY["exact"]
            ok = cos >= exact.min_cos and rel <= exact.max_rel_l1 and sorted(cfg.stats.calls) == ["flash_attn4"]
            fails += not ok
            rep.add({"case": label, "ok": ok, "first_s": round(first, 3), "ms": round(ms, 3), "cos": cos, "rel_l1": rel,
                     "ran": sorted(cfg.stats.calls)},
                    f"{label}: {'ok' if ok else 'FAIL'} ran={sorted(cfg.stats.calls)} first call {first:.2f} s, steady "
                    f"{ms:.3f} ms, cos {cos:.6f} rel-L1 {rel:.5f}")
        except Exception as e:
            fails += 1
            rep.add({"case": label, "ok": False, "error": short(e)}, f"{label}: FAILED {short(e)}")

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)

    q = r(1, 32760, 12 * 128)  # Wan 1.3B 480p/81f self-attention, ComfyUI's [B, N, H*D]
    call("Wan 1.3B self-attention [1, 32760, 12x128] bf16", q, r(1, 32760, 12 * 128), r(1, 32760, 12 * 128), 12)
    call("cross-attention to 512 keys [2, 4096, 24x128]", r(2, 4096, 24 * 128), r(2, 512, 24 * 128), r(2, 512, 24 * 128), 24)
    call("GQA 24/8 heads, [B, H, N, D] D=128", r(1, 24, 4096, 128), r(1, 8, 4096, 128), r(1, 8, 4096, 128), 24, skip=True)
    call("value head dim 128, q/k 64 (sm 9.x)", r(1, 8, 2048, 64), r(1, 8, 2048, 64), r(1, 8, 2048, 128), 8, skip=True)
    call("head dim 40 (SD1.5)", r(2, 4096, 8 * 40), r(2, 4096, 8 * 40), r(2, 4096, 8 * 40), 8)
    call("head dim 256", r(1, 1024, 4 * 256), r(1, 1024, 4 * 256), r(1, 1024, 4 * 256), 4)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; flash-attn-4 {av.version}; calls through the "
             "pack's attention() with backend flash_attn4 and no fallback; error vs fp32 attention", "",
             "| case | ok | first call s | steady ms | cos | rel-L1 |", "|---|---|---|---|---|---|"]
    for row in rep.data["rows"][2:]:
        if "error" in row:
            lines.append(f"| {row['case']} | no | {row['error']} | | | |")
        else:
            lines.append(f"| {row['case']} | {'yes' if row['ok'] else 'NO'} | {row['first_s']:.2f} | {row['ms']:.3f} | "
                         f"{row['cos']:.6f} | {row['rel_l1']:.5f} |")
    rep.md("\n".join(lines) + "\n")
    return 1 if fails or not av.ok else 0


# ------------------------------------------------------------------ (b) compile cost

DISK = """
import json, sys, time
t0 = time.time()
import torch, flash_attn.cute as fc
imp = time.time() - t0
q = torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t = time.time()
fc.flash_attn_func(q, q, q)
torch.cuda.synchronize()
print("JSON:" + json.dumps({"import_s": round(imp, 2), "first_call_s": round(time.time() - t, 3)}))
"""


FP16_DIMS = (32, 40, 64, 72, 80, 96, 128, 160, 192, 256)  # every bf16 head dim is measured; fp16 these


def declared_dims(A, cc, dtype):
    """Head dims flash_attn4 takes as they are on this arch (from its registry entry)."""
    b = A.REGISTRY.get("flash_attn4")
    plan = importlib.import_module(A.__name__ + ".constraints").plan
    out = []
    for d in range(8, 257, 8):
        s = A.CallSpec("cuda", tuple(cc), dtype, 1, 16, 16, 4096, 4096, d, d, None)
        adapted, why = plan(b.constraints, s)
        if why is None and adapted.head_dim == d:
            out.append(d)
    return out


def cmd_compile(a):
    import torch

    P = pack()
    A = P.attention
    cc = torch.cuda.get_device_capability()
    rep = Report(a.out, "compile", {"gpu": torch.cuda.get_device_name(), "cc": cc, "torch": torch.__version__})
    av = A.REGISTRY.get("flash_attn4").availability()
    if not av.ok:
        rep.add({"case": "probe", "ok": False, "reason": av.reason}, f"flash_attn4 not available: {av.reason}")
        rep.md(f"flash_attn4 not available: {av.reason}\n")
        return 1
    t_start = time.time()
    dev = torch.device("cuda")

    def first_and_steady(label, q, k, v, heads, kw=None, steady=True):
        kw = kw or {}
        cfg = A.AttentionConfig(backend="flash_attn4", allow_fallback=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        A.attention(q, k, v, heads, config=cfg, **kw)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        ms = timed(lambda: A.attention(q, k, v, heads, config=cfg, **kw), reps=10, rounds=3) if steady else None
        return first, ms

    budget_hit = False
    for dtype in (torch.bfloat16, torch.float16):
        dims = declared_dims(A, cc, dtype)
        rep.data["meta"][f"dims_{str(dtype)[6:]}"] = dims
        if dtype == torch.float16:  # the compile costs the same per dtype: fp16 on the head dims models use
            dims = [d for d in dims if d in FP16_DIMS]
        for d in dims:
            if time.time() - t_start > a.budget:
                budget_hit = True
                rep.add({"case": "budget", "dtype": str(dtype)[6:], "d": d, "skipped": "time budget spent"},
                        f"{str(dtype)[6:]} D={d} and later: not measured (budget {a.budget} s spent)")
                break
            heads = 16
            q, k, v = (torch.randn(1, 4096, heads * d, device=dev, dtype=dtype) for _ in range(3))
            try:
                first, ms = first_and_steady(f"D{d}", q, k, v, heads)
                sdpa_cfg = A.AttentionConfig(backend="sdpa")
                sdpa_ms = timed(lambda q=q, k=k, v=v, h=heads, c=sdpa_cfg: A.attention(q, k, v, h, config=c))
                rep.add({"case": "head dim", "dtype": str(dtype)[6:], "d": d, "first_s": round(first, 3), "ms": round(ms, 4),
                         "sdpa_ms": round(sdpa_ms, 4)},
                        f"{str(dtype)[6:]} D={d:3d} [1, 4096, 16x{d}]: first call {first:.2f} s, steady {ms:.3f} ms "
                        f"(sdpa {sdpa_ms:.3f} ms, x{sdpa_ms / ms:.2f})")
            except Exception as e:
                rep.add({"case": "head dim", "dtype": str(dtype)[6:], "d": d, "error": short(e)},
                        f"{str(dtype)[6:]} D={d}: FAILED {short(e)}")
            del q, k, v
        if budget_hit:
            break

    # which later shapes compile again (D=128 bf16 is compiled above): sequence lengths, cross-attention, GQA, batch
    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    again = [
        ("new sequence length 5000", (r(1, 5000, 16 * 128), r(1, 5000, 16 * 128), r(1, 5000, 16 * 128), 16), {}),
        ("cross-attention, 77 keys", (r(1, 4096, 16 * 128), r(1, 77, 16 * 128), r(1, 77, 16 * 128), 16), {}),
        ("one query, one key", (r(1, 1, 16 * 128), r(1, 1, 16 * 128), r(1, 1, 16 * 128), 16), {}),
        ("batch 2", (r(2, 4096, 16 * 128), r(2, 4096, 16 * 128), r(2, 4096, 16 * 128), 16), {}),
        ("GQA 16/4 heads", (r(1, 16, 4096, 128), r(1, 4, 4096, 128), r(1, 4, 4096, 128), 16),
         {"skip_reshape": True, "skip_output_reshape": True}),
        ("GQA 16/4 heads, new length 3000", (r(1, 16, 3000, 128), r(1, 4, 3000, 128), r(1, 4, 3000, 128), 16),
         {"skip_reshape": True, "skip_output_reshape": True}),
    ]
    for label, (q, k, v, heads), kw in again:
        if time.time() - t_start > a.budget + 30:
            break
        try:
            first, ms = first_and_steady(label, q, k, v, heads, kw)
            rep.add({"case": "recompile?", "shape": label, "first_s": round(first, 3), "ms": round(ms, 4)},
                    f"D=128 bf16, {label}: first call {first:.3f} s (steady {ms:.3f} ms): "
                    f"{'compiled again' if first > 0.3 else 'no compile'}")
        except Exception as e:
            rep.add({"case": "recompile?", "shape": label, "error": short(e)}, f"D=128 bf16, {label}: FAILED {short(e)}")

    # FA4's own on-disk cache (off by default; FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1): a second process loads the
    # compiled kernel instead of compiling it
    cache = tempfile.mkdtemp(prefix="pa-fa4-cache-")
    env = {**os.environ, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": cache}
    for i in (1, 2):
        rc, s, out = run([PY, "-c", DISK], 150, env)
        got = next((json.loads(x[5:]) for x in out.splitlines() if x.startswith("JSON:")), None)
        files = sum(len(fs) for _, _, fs in os.walk(cache))
        rep.add({"case": "disk cache", "process": i, "rc": rc, **(got or {"error": out[-300:]}), "cache_files": files},
                f"FA4 disk cache, process {i}: rc={rc} " + (f"import {got['import_s']} s, first call D=128 {got['first_call_s']} s"
                                                             if got else out[-200:]) + f"; {files} files in the cache")

    rows = [x for x in rep.data["rows"] if x["case"] == "head dim" and "first_s" in x]
    lines = [f"{rep.data['meta']['gpu']} (sm {cc[0]}.{cc[1]}), torch {torch.__version__}, flash-attn-4 {av.version}: first call "
             "(FA4's JIT compile, once per process per kernel) and steady time per declared head dim, [1, 4096, 16xD] "
             "through the pack; sdpa = PyTorch's choice on the same call", "",
             "| dtype | D | first call s | steady ms | sdpa ms | sdpa / fa4 |", "|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['dtype']} | {x['d']} | {x['first_s']:.2f} | {x['ms']:.3f} | {x['sdpa_ms']:.3f} | "
                     f"x{x['sdpa_ms'] / x['ms']:.2f} |")
    if rows:
        fs = sorted(x["first_s"] for x in rows)
        lines.append(f"\nfirst call: min {fs[0]:.2f} s, median {fs[len(fs) // 2]:.2f} s, max {fs[-1]:.2f} s over {len(fs)} "
                     "kernels")
    for x in rep.data["rows"]:
        if x["case"] in ("recompile?", "disk cache", "budget"):
            lines.append(f"- {x['case']}: " + json.dumps({k: v for k, v in x.items() if k != "case"}, default=str))
    rep.md("\n".join(lines) + "\n")
    return 0


# ------------------------------------------------------------------ (c) masks through mask_mod / score_mod

def padded_view(mask4, b, h, nq, nk, dtype, fill):
    """``mask4`` (broadcastable to [B, H, Nq, Nk]) as a [B, H, Nq, Nk] view of a buffer padded to 384 query rows and
    256 keys (FA4's last tiles read past Nq/Nk), size-1 batch/head dims kept at stride 0."""
    import torch

    mb, mh = mask4.shape[0], mask4.shape[1]
    pq, pk = -(-nq // 384) * 384, -(-nk // 256) * 256
    buf = torch.full((mb, mh, pq, pk), fill, dtype=dtype, device=mask4.device)
    buf[:, :, :nq, :nk] = mask4.expand(mb, mh, nq, nk).to(dtype)
    return buf[:, :, :nq, :nk].expand(b, h, nq, nk)


def cmd_mask(a):
    import torch
    import torch.nn.functional as F

    P = pack()
    A = P.attention
    rep = Report(a.out, "mask", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    try:
        import flash_attn.cute as fc

        sys.path.insert(0, HERE)
        import fa4_mods
    except Exception as e:
        rep.add({"case": "import", "error": short(e)}, f"import: FAILED {short(e)}")
        rep.md(f"flash-attn-4 or the mods did not import: {short(e)}\n")
        return 1
    dev = torch.device("cuda")
    exact = A.registry.ACCURACY["exact"]
    t_start = time.time()
    g = torch.Generator(device="cpu").manual_seed(1)

    def cases():
        # key padding of a text encoder's tokens, as ComfyUI hands cross-attention: [B, 1, 1, Nk] bool
        b, h, nq, nk, d = 2, 24, 4096, 512, 128
        keep = torch.ones(b, 1, 1, nk, dtype=torch.bool)
        keep[0, ..., 300:] = False
        keep[1, ..., 450:] = False
        yield "key padding [B,1,1,Nk] bool, cross 4096->512", (b, h, nq, nk, d), keep
        # regional prompting / attention couple: a [1, 1, N, N] bool mask of 4 regions plus 256 shared tokens
        b, h, n, d = 1, 24, 4096, 128
        region = torch.arange(n) * 4 // n
        keep = (region[:, None] == region[None, :]) | (torch.arange(n)[None, :] < 256)
        yield "regions [1,1,N,N] bool, self 4096", (b, h, n, n, d), keep[None, None]
        # the same as an additive mask (0 / -10000, as ComfyUI builds them) plus a soft bias: real-valued entries
        bias = torch.where(keep, 0.0, -10000.0) + 0.5 * torch.randn(n, n, generator=g)
        yield "regions [1,1,N,N] additive + soft bias, self 4096", (b, h, n, n, d), bias[None, None]
        # head-specific additive bias [1, H, N, N] (an ALiBi-like position bias)
        pos = torch.arange(2048, dtype=torch.float32)
        slopes = 2.0 ** (-8.0 * (torch.arange(1, 9, dtype=torch.float32)) / 8)
        alibi = -(slopes[:, None, None] * (pos[None, :, None] - pos[None, None, :]).abs())
        yield "per-head additive [1,H,N,N], self 2048", (1, 8, 2048, 2048, 64), alibi[None]

    lines = [f"{rep.data['meta']['gpu']}, torch {torch.__version__}: ComfyUI masks through FlashAttention-4's mask_mod "
             "(bool, read from an int32 aux tensor) and score_mod (additive, fp32 aux tensor) vs SDPA with the same mask "
             "(what the pack runs for masked calls today); error vs fp32 SDPA; bf16; ms = median of 3 rounds x 10 calls",
             "", "| case | kernel | first call s | ms | vs SDPA+mask | cos | rel-L1 | exact class |",
             "|---|---|---|---|---|---|---|---|"]
    def measure(label, b, h, nq, nk, d, mask):
        q = torch.randn(b, h, nq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, h, nk, d, device=dev, dtype=torch.bfloat16) + 0.5 * torch.randn(1, h, 1, d, device=dev,
                                                                                           dtype=torch.bfloat16)
        v = torch.randn(b, h, nk, d, device=dev, dtype=torch.bfloat16)
        mask = mask.to(dev)
        ref = A.reference.reference_attention(q, k, v, mask)  # fp32, HND
        qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))  # FA4 takes [B, N, H, D]
        sdpa_mask = mask if mask.dtype == torch.bool else mask.to(torch.bfloat16)
        runs = [("sdpa + mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask), True),
                ("sdpa, no mask", lambda: F.scaled_dot_product_attention(q, k, v), False),
                ("fa4, no mask", lambda: out0(fc.flash_attn_func(qn, kn, vn)).transpose(1, 2), False)]
        try:
            if mask.dtype == torch.bool:
                keep_aux = padded_view(mask, b, h, nq, nk, torch.int32, 1)
                runs.append(("fa4 mask_mod", lambda: out0(fc.flash_attn_func(
                    qn, kn, vn, mask_mod=fa4_mods.keep_mask_mod, aux_tensors=[keep_aux])).transpose(1, 2), True))
                bias = torch.zeros(mask.shape, dtype=torch.float32, device=dev).masked_fill(~mask, float("-inf"))
            else:
                bias = mask.float()
            bias_aux = padded_view(bias, b, h, nq, nk, torch.float32, 0.0)
            runs.append(("fa4 score_mod", lambda: out0(fc.flash_attn_func(
                qn, kn, vn, score_mod=fa4_mods.bias_score_mod, aux_tensors=[bias_aux])).transpose(1, 2), True))
        except Exception as e:
            rep.add({"case": label, "kernel": "aux tensors", "error": short(e)}, f"{label}: aux tensors FAILED {short(e)}")
        sdpa_ms = None
        for name, fn, masked in runs:
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t
                ms = timed(fn)
                cos, rel = A.auto.accuracy(out, ref) if masked else (float("nan"), float("nan"))
                if name == "sdpa + mask":
                    sdpa_ms = ms
                is_exact = masked and cos >= exact.min_cos and rel <= exact.max_rel_l1
                speed = f"x{sdpa_ms / ms:.2f}" if sdpa_ms else "-"
                rep.add({"case": label, "kernel": name, "first_s": round(first_s, 3), "ms": round(ms, 4), "cos": cos,
                         "rel_l1": rel, "exact": is_exact, "vs_sdpa_mask": speed},
                        f"{label} | {name}: first {first_s:.2f} s, {ms:.3f} ms ({speed} vs SDPA+mask)"
                        + (f", cos {cos:.6f} rel-L1 {rel:.5f} {'exact' if is_exact else 'NOT EXACT'}" if masked else ""))
                lines.append(f"| {label} | {name} | {first_s:.2f} | {ms:.3f} | {speed} | "
                             + (f"{cos:.6f} | {rel:.5f} | {'yes' if is_exact else 'NO'} |" if masked else "- | - | - |"))
            except Exception as e:
                rep.add({"case": label, "kernel": name, "error": short(e)}, f"{label} | {name}: FAILED {short(e)}")
                lines.append(f"| {label} | {name} | failed: {short(e)[:120].replace('|', '/')} | | | | | |")

    for label, (b, h, nq, nk, d), mask in cases():
        if time.time() - t_start > a.budget:
            rep.add({"case": label, "skipped": "budget"}, f"{label}: not measured (budget {a.budget} s spent)")
            continue
        measure(label, b, h, nq, nk, d, mask)
        torch.cuda.empty_cache()
    rep.md("\n".join(lines) + "\n")
    return 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--wheels", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("check")
    p.add_argument("--out", required=True)
    for name, budget in (("compile", 100.0), ("mask", 80.0)):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--budget", type=float, default=budget, help="seconds; what is left is recorded as not measured")
    a = ap.parse_args()
    if a.cmd != "install":
        import torch

        if not torch.cuda.is_available():
            Report(a.out, a.cmd).md(f"fa4.py {a.cmd}: no CUDA device here\n")
            return 1
    return {"install": cmd_install, "check": cmd_check, "compile": cmd_compile, "mask": cmd_mask}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
