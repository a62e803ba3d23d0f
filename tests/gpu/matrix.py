"""GPU contract matrix: every installed backend, called through the override ComfyUI calls, against fp32 attention.

    python tests/gpu/matrix.py --out contract.json --md contract.md [--backends a,b] [--quick]

Each call goes through ``AttentionOverride`` exactly as ComfyUI's ``wrap_attn`` calls it (ComfyUI's own
``attention_pytorch`` as ``func`` when COMFYUI_PATH is set), configured as the Patch Attention node configures it
(fallback on, deferred NaN check), outside a model forward.  For every case the backend that actually ran is read
from the statistics, and its output must stay inside that backend's declared accuracy class
(``attention.registry.ACCURACY``) against fp32 attention; NaN in the reference must be NaN in the output and
nowhere else.  A case outside its class, or an exception, is a violation: the script lists them and exits 1.

Cases: head dims 32-256; bf16/fp16/fp32; ComfyUI's two layouts; masks (none; bool and additive; 2-D, 3-D, 4-D;
broadcast over batch or heads); self-attention and cross-attention to 77 and 1 keys; 1 query token; long sequences;
equal keys (a zeroed prompt); NaN in the inputs; grouped-query heads.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (pack loader)
from pack import load  # noqa: E402

P = load()
A = P.attention

HEAD_DIMS = (32, 40, 64, 72, 80, 96, 128, 160, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def host_func(device):
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    sys.path.insert(0, path)
    from comfy.cli_args import args

    args.disable_smart_memory = True
    args.cpu = device.type == "cpu"
    import comfy.ldm.modules.attention as ca

    return ca.attention_pytorch


def make_mask(kind, b, h, nq, nk, device, dtype):
    """kind: None or '<bool|add><2d|3d|4d|4d-bh1|4d-1h>' (4d-bh1: one mask for all heads, 4d-1h: for all batch)."""
    if kind is None:
        return None
    g = torch.Generator(device="cpu").manual_seed(nq * 31 + nk)
    keep = torch.rand(b, h, nq, nk, generator=g) > 0.25
    keep[..., 0] = True  # no fully masked row
    shape = kind[kind.index("-") + 1:] if "-" in kind else kind[-2:]
    if shape == "2d":
        keep = keep[0, 0]
    elif shape == "3d":
        keep = keep[:, 0]
    elif shape == "bh1":
        keep = keep[:, :1]
    elif shape == "1h":
        keep = keep[:1]
    keep = keep.to(device)
    if kind.startswith("bool"):
        return keep
    return torch.zeros(keep.shape, device=device, dtype=dtype).masked_fill(~keep, -10000.0)


def cases(quick: bool):
    """(label, dict) for every case; a case: b, h, hk, nq, nk, d, dtype, mask kind, layout, special."""
    dims = (40, 64, 128) if quick else HEAD_DIMS
    for d, dtype, skip, nk in itertools.product(dims, DTYPES, (False, True), ("self", 77, 1)):
        yield dict(b=2, h=4, hk=4, nq=256, nk=256 if nk == "self" else nk, d=d, dtype=dtype, mask=None, skip=skip)
    masks = ("bool-4d", "add-4d", "add-2d", "add-3d", "bool-2d", "add-4d-bh1", "bool-4d-1h", "add-4d-1h")
    for d, dtype, skip, nk, mk in itertools.product((40, 64, 128), (torch.bfloat16, torch.float32), (False, True),
                                                    ("self", 77), masks):
        yield dict(b=2, h=4, hk=4, nq=256, nk=256 if nk == "self" else nk, d=d, dtype=dtype, mask=mk, skip=skip)
    for d, dtype in itertools.product((64, 128), (torch.bfloat16, torch.float16)):
        yield dict(b=1, h=4, hk=4, nq=1, nk=1, d=d, dtype=dtype, mask=None, skip=False)  # 1 token
        yield dict(b=1, h=4, hk=4, nq=1, nk=300, d=d, dtype=dtype, mask=None, skip=False)  # 1 query, many keys
        if not quick:
            yield dict(b=1, h=8, hk=8, nq=16384, nk=16384, d=d, dtype=dtype, mask=None, skip=False)  # long sequence
        yield dict(b=2, h=4, hk=4, nq=1024, nk=77, d=d, dtype=dtype, mask=None, skip=False, special="equal-keys")
        yield dict(b=2, h=4, hk=4, nq=256, nk=256, d=d, dtype=dtype, mask=None, skip=False, special="nan-input")
        yield dict(b=2, h=8, hk=2, nq=512, nk=512, d=d, dtype=dtype, mask=None, skip=True)  # GQA
        yield dict(b=2, h=8, hk=2, nq=512, nk=77, d=d, dtype=dtype, mask="add-4d", skip=True)  # GQA + mask


def label(c):
    return (f"D{c['d']} {str(c['dtype'])[6:]} {'HND' if c['skip'] else 'BNC'} Nq={c['nq']} Nk={c['nk']} H={c['h']}/{c['hk']}"
            f" mask={c['mask']}" + (f" {c['special']}" if c.get("special") else ""))


def inputs(c, dev):
    g = torch.Generator(device="cpu").manual_seed(c["d"] * 7 + c["nk"] + c["nq"])
    b, h, hk, nq, nk, d = c["b"], c["h"], c["hk"], c["nq"], c["nk"], c["d"]
    q = torch.randn(b, h, nq, d, generator=g)
    k = torch.randn(b, hk, nk, d, generator=g) + 0.5 * torch.randn(1, hk, 1, d, generator=g)  # a shared key offset
    v = torch.randn(b, hk, nk, d, generator=g)
    if c.get("special") == "equal-keys":  # a zeroed prompt: every key (and value) of the cross-attention is equal
        k = k[:, :, :1].expand_as(k).contiguous() * 0 + 0.1
        v = v[:, :, :1].expand_as(v).contiguous()
    if c.get("special") == "nan-input":
        q[0, 1, 5] = float("nan")
    q, k, v = (t.to(dev, c["dtype"]) for t in (q, k, v))
    if not c["skip"]:
        q, k, v = (t.transpose(1, 2).reshape(b, t.shape[2], t.shape[1] * d) for t in (q, k, v))
    return q, k, v, make_mask(c["mask"], b, h, nq, nk, dev, c["dtype"])


def judge(out, ref, dtype, ran):
    """(cos, rel) if the output keeps the class of the backend that ran, else the reason."""
    cls = A.REGISTRY.get(ran).accuracy_class
    if out.shape != ref.shape or out.dtype != dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {dtype}"
    nan_ref, nan_out = torch.isnan(ref), ~torch.isfinite(out)
    if torch.any(nan_out & ~nan_ref):
        return f"non-finite where fp32 attention is finite ({int((nan_out & ~nan_ref).sum())} elements)"
    if cls.nan_propagates and not torch.equal(nan_ref, nan_out):
        return f"finite where fp32 attention is NaN ({int((nan_ref & ~nan_out).sum())} elements), class {cls.name} propagates NaN"
    keep = ~nan_ref
    cos, rel = A.auto.accuracy(out[keep], ref[keep]) if keep.any() else (1.0, 0.0)
    if cos < cls.min_cos or rel > cls.max_rel_l1:
        return f"cos {cos:.5f} rel-L1 {rel:.4f} outside {cls.name} (cos >= {cls.min_cos}, rel-L1 <= {cls.max_rel_l1})"
    return (cos, rel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--md")
    ap.add_argument("--backends", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--options", default="", help="per-backend options, e.g. 'kitchen_sol:min_tokens=128;tau=1.3' "
                                                  "(Sol-Attn declines calls under 12288 tokens by default)")
    a = ap.parse_args()
    options = {}
    for part in filter(None, a.options.split(",")):
        name, _, kvs = part.partition(":")
        options[name] = {k: float(v) if "." in v else int(v) for k, v in (kv.split("=") for kv in kvs.split(";"))}
    dev = torch.device(a.device)
    func = host_func(dev)
    names = [n for n in (a.backends.split(",") if a.backends else A.REGISTRY.names()) if A.REGISTRY.get(n).available]
    all_cases = list(cases(a.quick))
    res = defaultdict(lambda: {"cases": 0, "ran_itself": 0, "routed": defaultdict(int), "violations": [], "worst": {},
                               "seconds": 0.0})
    t0 = last_print = time.time()
    for c in all_cases:
        q, k, v, mask = inputs(c, dev)
        ref = A.dispatch.fp32_reference(q, k, v, c["h"], mask, skip_reshape=c["skip"], skip_output_reshape=c["skip"])
        lab = label(c)
        for name in names:
            r = res[name]
            r["cases"] += 1
            started = time.perf_counter()
            cfg = A.AttentionConfig(backend=name, check_finite="deferred",  # as the node: fallback on, NaN net on
                                    options={name: options[name]} if name in options else {})
            ov = P.nodes.patch.AttentionOverride(cfg, audit=False)
            try:
                out = ov(func, q, k, v, c["h"], mask=mask, skip_reshape=c["skip"], skip_output_reshape=c["skip"],
                         transformer_options={})
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                r["violations"].append(f"{lab}: raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                continue
            finally:
                r["seconds"] += time.perf_counter() - started
            ran = next(iter(cfg.stats.calls))
            ran = "sdpa" if ran == P.nodes.hook.HOST else ran
            if ran == name:
                r["ran_itself"] += 1
            else:
                why = next((rs for (f, t, rs) in cfg.stats.fallbacks), "")
                r["routed"][f"{ran}: {why.split(' (')[0][:70]}"] += 1
            verdict = judge(out, ref, c["dtype"], ran)
            if isinstance(verdict, str):
                r["violations"].append(f"{lab}: ran {ran}: {verdict}")
            elif ran == name:
                w = r["worst"]
                if not w or verdict[1] > w["rel_l1"]:
                    r["worst"] = {"cos": verdict[0], "rel_l1": verdict[1], "case": lab}
        del q, k, v, mask, ref
        if time.time() - last_print > 30:  # where a long run is (seconds per backend so far), saved as it stands
            last_print = time.time()
            done = all_cases.index(c) + 1
            print(f"case {done} of {len(all_cases)}, {last_print - t0:.0f} s: "
                  + ", ".join(f"{n} {r['seconds']:.1f}" for n, r in res.items()), flush=True)
            save(a, _meta(names, done, t0, func, options, dev), res, final=False)
    save(a, _meta(names, len(all_cases), t0, func, options, dev), res, final=True)
    sys.exit(1 if any(r["violations"] for r in res.values()) else 0)


def _meta(names, cases, t0, func, options, dev) -> dict:
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "versions": {n: A.REGISTRY.get(n).availability().version for n in names},
            "cases": cases, "seconds": round(time.time() - t0, 1), "host_func": getattr(func, "__name__", None),
            "classes": {n: A.REGISTRY.get(n).accuracy for n in names}, "options": options}


def save(a, meta, res, final: bool) -> None:
    """The results so far (``final``: all cases) as JSON (--out) and markdown (--md; printed when final): a run cut
    short by its time limit keeps what it checked."""
    with open(a.out, "w") as f:
        json.dump({"meta": {**meta, "complete": final}, "results": res}, f, indent=1, default=dict)
    md = render(meta, res)
    if final:
        print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)


def render(meta, res):
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, {meta['date']}; {meta['cases']} cases per backend through "
             f"AttentionOverride (host function: {meta['host_func']}); reference fp32 attention; {meta['seconds']} s.", "",
             "| backend | class | ran itself | routed elsewhere | violations | worst own rel-L1 (cos) | worst case | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        w = r["worst"]
        lines.append(f"| {n} | {meta['classes'][n]} | {r['ran_itself']} | {sum(r['routed'].values())} | {len(r['violations'])} | "
                     + (f"{w['rel_l1']:.4f} ({w['cos']:.5f}) | {w['case']} |" if w else "- | - |")
                     + f" {r.get('seconds', 0):.1f} |")
    lines.append("")
    for n, r in res.items():
        for why, cnt in sorted(r["routed"].items(), key=lambda x: -x[1])[:6]:
            lines.append(f"- {n} routed to {why} ({cnt} cases)")
        for v in r["violations"][:10]:
            lines.append(f"- **{n} VIOLATION** {v}")
        if len(r["violations"]) > 10:
            lines.append(f"- {n}: {len(r['violations']) - 10} more violations")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
