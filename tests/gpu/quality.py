"""GPU stage ``quality``: train the stand-in, measure its attention, restate the end-to-end rows at a quality.

    OUT=/tmp/out python tests/gpu/quality.py --out $OUT [--budget 460] [--train-seconds 190]
    python tests/gpu/quality.py --tiny --out /tmp/q    (a dry run of the whole flow on the CPU with a tiny model)

In one process, within ``--budget`` seconds (phases that would not fit are skipped and listed, never cut mid-way by
this script; the runner's ``timeout`` is the hard stop), results written after every phase:

1. ``train``: the stand-in (tools/standin.py: ComfyUI's Wan class, Wan 1.3B's layer geometry, 3 blocks) from its seed,
   its attention concentration measured at initialisation first (480p, one forward), then trained for
   ``--train-seconds`` and saved to ``$STANDIN_WEIGHTS`` (default /tmp/standin.safetensors; too big to come back).
   ``--skip-train`` uses that file as it is (a second call on the same machine, with ``--phases``).
2. ``load``: through ``comfy.sd.load_diffusion_model``, in bf16 and in fp32 (the quality reference).
3. ``concentration-480p``: per layer and head, at steps 2, 5 and 8 of a 10-step run (measure.concentration).
4. ``tune``: Tune Sparse Attention on the stand-in (SpargeAttn and Sol-Attn profiles at the default budget; Sol-Attn
   also at tighter and looser budgets, for the budget calibration).
5. ``rows-480p``: unpatched, flash_attn4 (if present), sdpa_cudnn, sage_fp8_sm90, sparge, sparge_topk, kitchen_sol,
   core:sol-attn, the tuned profiles, auto and auto_fast; 10 steps; s/step, whole-run s/step, PSNR/SSIM against the
   fp32 run.
6. ``concentration-720p``, then ``rows-720p`` (6 steps): the most telling rows that fit (unpatched, sdpa_cudnn,
   sage_fp8_sm90, kitchen_sol, auto, auto_fast first), the fp32 reference if it fits (else the unpatched row).
7. ``calibration-480p``: per-call (cos, rel-L1) of every lossy setting on captured real calls (what auto's gate sees),
   more settings sampled end to end as the budget allows (``--sweep``), the gate and budget proposed by the rule
   (measure.calibrate), and the rule at 1, 3, 6 and 10 dB below the floor.

Writes ``quality.json``, ``quality.md``, ``quality-rows.json`` (``bench_e2e.py --plot-from`` reads it),
``quality-frontier.png`` (where matplotlib is), and per run of rows the benchmark node's pictures, ``<run>-chart.png``
(speed against PSNR, the exact floor and the 3 dB band) and ``<run>-frames.png`` (each row's frames through the
stand-in's codec beside their difference to unpatched), under ``--out`` (the stand-in's metadata is in quality.json);
one line per measured case in the log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAIN_ROWS = ["unpatched", "flash_attn4", "sdpa_cudnn", "sage_fp8_sm90", "sparge", "sparge_topk", "kitchen_sol",
             "core:sol-attn"]
# more settings for the calibration (end to end and per call)
SWEEP_ROWS = ["kitchen_sol[tau=1.0]", "kitchen_sol[tau=2.0]", "sparge[cdfthreshd=0.95]", "sparge_topk[topk=0.3]",
              "kitchen_int8", "kitchen_sol[tau=1.6]", "kitchen_sol[tau=2.5]", "sparge[cdfthreshd=0.9]", "sage_fp16_cuda",
              "sparge[cdfthreshd=0.995]", "sparge_topk[topk=0.7]", "kitchen_sol_topk"]  # the most telling first
SOL_BUDGETS = (0.03, 0.15)  # beside the default 0.07
SPARSE_TARGETS = {"rows-480p": 1.90, "rows-720p": 2.40}  # whole run over unpatched, within 3 dB of the exact floor


class Stage:
    def __init__(self, out: str, budget: float, phases=None):
        self.out, self.budget, self.t0 = out, budget, time.perf_counter()
        self.wanted = set(phases) if phases else None
        self.res = {"phases": {}, "skipped": [], "errors": {}}
        os.makedirs(out, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def say(self, msg: str) -> None:
        print(f"[quality {time.perf_counter() - self.t0:6.0f}s] {msg}", flush=True)

    def phase(self, name: str, estimate: float, fn):
        if self.wanted is not None and name not in self.wanted:
            return None
        if self.left() < estimate:
            why = f"needs ~{estimate:.0f} s, {self.left():.0f} s of the budget left"
            self.res["skipped"].append({"phase": name, "why": why})
            self.say(f"{name}: SKIPPED ({why})")
            self.write()
            return None
        t = time.perf_counter()
        self.say(f"{name}: start (estimate {estimate:.0f} s, {self.left():.0f} s left)")
        try:
            out = fn()
        except Exception as e:  # a phase's failure is recorded; later phases that need it skip
            self.res["errors"][name] = f"{type(e).__name__}: {e}"[:500] + "\n" + traceback.format_exc()[-1500:]
            self.say(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            out = None
        self.res["phases"][name] = round(time.perf_counter() - t, 1)
        self.say(f"{name}: done in {self.res['phases'][name]} s")
        self.write()
        return out

    def write(self) -> None:
        with open(os.path.join(self.out, "quality.json"), "w") as f:
            json.dump(self.res, f, indent=1, default=_json)
        with open(os.path.join(self.out, "quality.md"), "w") as f:
            f.write(render(self.res) + "\n")
        rows = [r for k in ("rows-480p", "calibration-rows-480p", "rows-720p") for r in self.res.get(k) or []]
        if rows:  # bench_e2e.py --plot-from quality-rows.json --png x.png draws the frontier where matplotlib is
            with open(os.path.join(self.out, "quality-rows.json"), "w") as f:
                json.dump({"meta": self.res.get("meta", {}), "rows": rows}, f, indent=1, default=_json)


def _json(o):
    if hasattr(o, "__dict__"):
        return {k: v for k, v in vars(o).items() if not k.startswith("_")}
    return str(o)


# ---------------------------------------------------------------- concentration summaries

def conc_summary(results, conc) -> dict:
    """Per layer and head (pooled over the measured steps) and overall, from standin.measure_concentration."""
    if not results:
        return {}
    per = {}
    for r in results:
        for h, hs in enumerate(r["stats"].heads):
            per.setdefault((r["layer"], h), []).append(hs)
    heads = []
    for (layer, h), lst in sorted(per.items()):
        n = len(lst)
        hs = conc.HeadStats(sum(x.block_share_90 for x in lst) / n, sum(x.window_mass for x in lst) / n,
                            sum(x.spatial_mass for x in lst) / n, sum(x.temporal_mass for x in lst) / n)
        heads.append({"layer": layer, "head": h, "block_share_90": round(hs.block_share_90, 4),
                      "window_mass": round(hs.window_mass, 4), "spatial_mass": round(hs.spatial_mass, 4),
                      "temporal_mass": round(hs.temporal_mass, 4), "kind": hs.kind})
    first = results[0]["stats"]
    steps = sorted({r["step"] for r in results})
    by_step = {s: conc.summarize_calls([r["stats"] for r in results if r["step"] == s]) for s in steps}
    return {"grid": first.grid, "window": first.window, "window_share": round(first.window_share, 4),
            "column_radius": first.radius, "steps": steps, "overall": conc.summarize_calls([r["stats"] for r in results]),
            "by_step": by_step, "heads": heads, "query_blocks_per_head": first.query_blocks}


# ---------------------------------------------------------------- per-call accuracy (what auto's gate sees)

def capture_calls(sd, patcher, grid, pos, neg, steps, at_steps, max_calls=6):
    """q/k/v (HND, the CFG batch) of the self-attention calls at sampling steps ``at_steps``, with their layer index
    (the i-th attention call of the forward, as profiles count)."""
    import torch

    t, h, w = grid
    n = t * (h // 2) * (w // 2)
    calls, state = [], {"sigma": None, "layer": 0}

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        topts = kwargs.get("transformer_options") or {}
        s = float(topts["sigmas"].flatten()[0])
        if s != state["sigma"]:
            state["sigma"], state["layer"] = s, 0
        step = int((topts["sample_sigmas"].float().cpu() - s).abs().argmin())
        nq = q.shape[2] if skip_reshape else q.shape[1]
        nk = k.shape[2] if skip_reshape else k.shape[1]
        if step in at_steps and nq == n and nk == n and len(calls) < max_calls:
            b = q.shape[0]
            hnd = (lambda x: x) if skip_reshape else (lambda x: x.view(b, n, heads, -1).transpose(1, 2))
            calls.append({"step": step, "layer": state["layer"], "q": hnd(q).contiguous().clone(),
                          "k": hnd(k).contiguous().clone(), "v": hnd(v).contiguous().clone(), "heads": heads})
        state["layer"] += 1
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)

    m = patcher.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    sd.sample(m, grid, pos, neg, steps=steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return calls


def per_call_accuracy(pack, calls, row: str, grammar) -> dict:
    """(worst cos, worst rel-L1, first call's cos, rel-L1) of a lossy row's kernel on the captured calls against fp32
    attention, as auto's tuning compares; per-layer profile options where the row has a profile."""
    A = pack.attention
    ref_mod = importlib.import_module(pack.__name__ + ".attention.reference")
    base, opts = grammar.parse_row(row)
    settings = grammar.row_settings(base, opts) if opts else None
    options = settings.options if settings else {}
    out = []
    for c in calls:
        if "ref" not in c:
            c["ref"] = ref_mod.reference_attention(c["q"], c["k"], c["v"])
        per_layer = settings.layer_options(c["layer"], None) if settings else None
        cfg = A.AttentionConfig(backend=base, allow_fallback=False, check_finite=False, options={base: options})
        o = A.attention(c["q"], c["k"], c["v"], c["heads"], skip_reshape=True, skip_output_reshape=True, config=cfg,
                        options=per_layer or None)
        out.append(ref_mod.accuracy(o, c["ref"]))
    return {"cos": min(x[0] for x in out), "rel_l1": max(x[1] for x in out), "first_cos": out[0][0],
            "first_rel_l1": out[0][1], "calls": len(out)}


# ---------------------------------------------------------------- the report

def _f(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def render(res: dict) -> str:
    L = ["# Quality stage (stand-in)", ""]
    m = res.get("meta", {})
    if m:
        L += [f"{m.get('gpu', '?')} · torch {m.get('torch', '?')} · ComfyUI {m.get('comfyui', '?')} · {m.get('date', '')} · "
              f"budget {m.get('budget')} s", ""]
    tr = res.get("train")
    if tr:
        t = tr["train"]
        L += ["## Training", "", f"{tr.get('parameters_m')} M parameters, geometry {tr['geometry']}; data: {tr['data'][:300]}",
              f"{t['steps']} steps ({t['planned']} planned) in {t['seconds']} s, stopped by {t['stopped_by']}; loss "
              + " → ".join(f"{x['loss']:.4f}@{x['step']}" for x in t["loss"][:: max(1, len(t["loss"]) // 8)]), ""]
    for key, title in (("concentration-init", "Attention concentration at initialisation (480p, one forward on a "
                                              "training clip at sigma 0.5)"),
                       ("concentration-trained-clip", "The same forward after training"),
                       ("concentration-480p", "Attention concentration, 480p/81f (32,760 tokens)"),
                       ("concentration-720p", "Attention concentration, 720p/81f (75,600 tokens)")):
        c = res.get(key)
        if not c:
            continue
        o = c["overall"]
        L += [f"## {title}", "", f"grid {c['grid']}, steps {c['steps']}, 3-D window {c['window']} "
              f"({100 * c['window_share']:.1f} % of the tokens), column radius {c['column_radius']}", "",
              "| | this model | published |", "|---|---|---|",
              f"| share of 128-key blocks holding 90 % of a query block's mass (median head / mean) | "
              f"{_f(o['block_share_90_median'])} / {_f(o['block_share_90_mean'])} | target: most heads <= 0.25 |",
              f"| heads within 25 % of the key blocks | {_f(o['heads_within_target'], 2)} | target: most |",
              f"| mass in a 3-D window of {100 * c['window_share']:.1f} % of the tokens (mean) | "
              f"{_f(o['window_mass_mean'])} | ~0.70 (HunyuanVideo, STA, 15.5 %) |",
              f"| spatial / temporal heads | {_f(o['spatial_heads'], 2)} / {_f(o['temporal_heads'], 2)} | 0.29 / 0.67 "
              "(HunyuanVideo, Sparse VideoGen) |", ""]
        if c.get("by_step"):
            L += ["| step | block share 90 (median) | heads within 25 % | window mass | spatial heads |", "|---|---|---|---|---|"]
            for s, o2 in c["by_step"].items():
                L.append(f"| {s} | {_f(o2['block_share_90_median'])} | {_f(o2['heads_within_target'], 2)} | "
                         f"{_f(o2['window_mass_mean'])} | {_f(o2['spatial_heads'], 2)} |")
            L.append("")
        L += ["| layer | head | block share 90 | window mass | spatial mass | temporal mass | kind |",
              "|---|---|---|---|---|---|---|"]
        L += [f"| {h['layer']} | {h['head']} | {h['block_share_90']:.3f} | {h['window_mass']:.3f} | {h['spatial_mass']:.3f} | "
              f"{h['temporal_mass']:.3f} | {h['kind']} |" for h in c["heads"]]
        L.append("")
    titles = {"rows-480p": "End to end at 480p/81f", "calibration-rows-480p": "More settings at 480p/81f (calibration)",
              "rows-720p": "End to end at 720p/81f"}
    for key in ("rows-480p", "calibration-rows-480p", "rows-720p"):
        if res.get(key + "-md"):
            L += [f"## {titles[key]}", "", res[key + "-md"], ""]
        if res.get(key + "-targets"):
            L += ["| target | ratio | verdict | detail |", "|---|---|---|---|"]
            for t in res[key + "-targets"]:
                verdict = "n/a" if not t["applies"] else ("met" if t["met"] else "MISSED")
                L.append(f"| {t['target']} | x{t['ratio']:.3f} | {verdict} | {t['detail']} |")
            L.append("")
    if res.get("calibration-md"):
        L += ["## Calibration (480p)", "", res["calibration-md"], ""]
    if res.get("skipped"):
        L += ["## Not reached", ""] + [f"- {s['phase']}: {s['why']}" for s in res["skipped"]] + [""]
    if res.get("errors"):
        L += ["## Errors", ""] + [f"- {k}: {v.splitlines()[0]}" for k, v in res["errors"].items()] + [""]
    if res.get("phases"):
        L += ["Phase times (s): " + ", ".join(f"{k} {v}" for k, v in res["phases"].items())]
    return "\n".join(L)


# ---------------------------------------------------------------- main

def mode(tiny: bool, sd) -> dict:
    """What the stage runs: the H100 sizes, or ``--tiny`` (the same flow on the CPU with a tiny model, for a dry run:
    tests/test_standin.py runs it)."""
    if not tiny:
        return {"device": "cuda", "geometry": sd.WAN_1_3B, "g480": sd.LATENT_GRIDS["480p"], "g720": sd.LATENT_GRIDS["720p"],
                "steps480": 10, "steps720": 6, "conc_steps480": (2, 5, 8), "conc_steps720": (2, 4), "calib_steps": {2, 6},
                "tune_steps": 5, "chunk": 1024, "train": {}, "extra_rows": []}
    return {"device": "cpu", "geometry": sd.TINY, "g480": (3, 8, 12), "g720": (3, 12, 16), "steps480": 4, "steps720": 4,
            "conc_steps480": (1, 2), "conc_steps720": (2,), "calib_steps": {1, 2}, "tune_steps": 2, "chunk": 128,
            "train": {"steps": 6, "grids": sd.TINY_GRIDS, "tokens_per_step": 64, "lr": 1e-3, "warmup": 2,
                      "text_tokens": 8, "images": (sd.procedural_images(3, 64, 0), "procedural textures (tiny)")},
            "extra_rows": ["sdpa_math", DRYRUN_LOSSY]}


DRYRUN_LOSSY = "dryrun_int8"


def register_dryrun_backend(pack) -> None:
    """The dry run's lossy kernel (the CPU has none): q and k rounded to int8 per token, then fp32 attention."""
    import torch

    A = pack.attention
    if DRYRUN_LOSSY in A.REGISTRY:
        return

    def fn(q, k, v, *, layout, mask, scale, opts):
        def q8(t):
            s = t.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
            return (t.float() / s).round().clamp(-127, 127) * s

        if layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q8(q), q8(k), v.float(), scale=scale).to(v.dtype)
        return o if layout == "HND" else o.transpose(1, 2)

    A.REGISTRY.register(A.Backend(name=DRYRUN_LOSSY, family="test", fn=fn, constraints=(), layouts=("HND",),
                                  accuracy="8bit", description="dry run: int8 q/k"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/pa-out"))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("QUALITY_BUDGET", 460)))
    ap.add_argument("--train-seconds", type=float, default=float(os.environ.get("TRAIN_SECONDS", 190)))
    ap.add_argument("--weights", default=os.environ.get("STANDIN_WEIGHTS", "/tmp/standin.safetensors"))
    ap.add_argument("--skip-train", action="store_true", help="use --weights as they are")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a dry run of the whole flow on the CPU with a tiny model")
    ap.add_argument("--rows", help="comma-separated rows instead of the default main rows (the dry run's test)")
    ap.add_argument("--profile-rows", default=os.environ.get("QUALITY_PROFILE_ROWS", ""),
                    help="comma-separated rows profiled for one step after the timed runs (their attention kernels' "
                         "share of the step: what a faster attention could still win)")
    ap.add_argument("--phases", help="only these phases (comma-separated; with --skip-train: a second call on the same "
                                     "machine, e.g. load,rows-720p,calibration-480p)")
    ap.add_argument("--sweep", type=int, default=int(os.environ.get("QUALITY_SWEEP", 6)),
                    help="at most this many extra calibration rows (beside the tuned-budget rows)")
    a = ap.parse_args(argv)
    st = Stage(a.out, a.budget, [p.strip() for p in a.phases.split(",")] if a.phases else None)

    sys.path.insert(0, ROOT)
    import bench_e2e as be

    cpath = be._comfyui()
    if cpath in sys.path:
        sys.path.remove(cpath)
    sys.path.insert(0, cpath)
    from comfy.cli_args import args as comfy_args

    comfy_args.disable_smart_memory = True
    if a.tiny:
        comfy_args.cpu = True
    import torch

    if not a.tiny and not torch.cuda.is_available():
        sys.exit("quality: needs a CUDA GPU (--tiny: a dry run on the CPU)")
    pack = be._load_pack()
    e2e = importlib.import_module(pack.__name__ + ".measure.e2e")
    grammar = importlib.import_module(pack.__name__ + ".measure.rows")
    report = importlib.import_module(pack.__name__ + ".measure.report")
    pictures = importlib.import_module(pack.__name__ + ".measure.pictures")
    patch = importlib.import_module(pack.__name__ + ".nodes.patch")
    conc = importlib.import_module(pack.__name__ + ".measure.concentration")
    cal = importlib.import_module(pack.__name__ + ".measure.calibrate")
    auto_mod = importlib.import_module(pack.__name__ + ".attention.auto")
    sd = be.standin_module()
    REG = pack.attention.REGISTRY
    AUTO_ROWS = list(grammar.AUTO_ROWS)  # measured last (after the tuned profiles): auto, and the faster, lossier choice
    M = mode(a.tiny, sd)
    if a.tiny:
        register_dryrun_backend(pack)
    dev = M["device"]
    try:
        from comfyui_version import __version__ as comfy_version
    except ImportError:
        comfy_version = "?"
    import datetime

    st.res["meta"] = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "torch": torch.__version__,
                      "comfyui": comfy_version, "date": datetime.date.today().isoformat(), "budget": a.budget,
                      "usable": [b.name for b in REG.backends() if b.available],
                      "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)}
    st.say(f"usable backends: {', '.join(st.res['meta']['usable'])}")
    g480, g720 = M["g480"], M["g720"]

    # 1. train
    def train():
        tr = dict(M["train"])
        model = sd.build(M["geometry"], device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        priors = sd.init_weights(model.diffusion_model, a.seed)
        text_tokens = tr.pop("text_tokens", sd.TEXT_TOKENS)
        data = sd.Data(dev, a.seed, text_tokens, images=tr.pop("images", None))
        st.say(f"data: {data.source[:160]}")
        x0, cls = data.batch(1, g480, torch.Generator().manual_seed(a.seed + 5))
        init = sd.concentration_at(model, x0, data.captions[int(cls[0])][None], 0.5, query_stride=2, chunk=M["chunk"])
        st.res["concentration-init"] = conc_summary(init, conc)
        o = st.res["concentration-init"]["overall"]
        st.say(f"concentration at init: block share 90 median {o['block_share_90_median']:.3f}, heads within 25 % "
               f"{o['heads_within_target']:.2f}, window mass {o['window_mass_mean']:.3f}, spatial {o['spatial_heads']:.2f}")
        st.write()
        steps = tr.pop("steps", "auto")
        report = sd.train(model, data, steps=steps, seconds=a.train_seconds, seed=a.seed, log=st.say, **tr)
        after = sd.concentration_at(model, x0, data.captions[int(cls[0])][None], 0.5, query_stride=2, chunk=M["chunk"])
        st.res["concentration-trained-clip"] = conc_summary(after, conc)  # the same clip and noise, after training
        meta = {"geometry": M["geometry"], "seed": a.seed, "caption_seed": a.seed + 99, "codec_seed": a.seed + 1234,
                "text_tokens": text_tokens, "prior": True, "data": data.source, "train": report,
                "grids": [list(gr) + [w] for gr, w in tr.get("grids", sd.GRIDS)], "torch": torch.__version__,
                "device": st.res["meta"]["gpu"], "priors": priors}
        sd.save(model, a.weights, meta)
        st.res["train"] = {**meta, "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                           "file_mib": round(os.path.getsize(a.weights) / 2**20, 1)}
        del model, data
        if dev == "cuda":
            torch.cuda.empty_cache()
        return True

    if a.skip_train:
        if not os.path.exists(a.weights):
            st.res["errors"]["load"] = f"no stand-in weights at {a.weights}: run the quality stage first on this machine"
            st.say(st.res["errors"]["load"])
            st.write()
            return st.res
        st.say(f"using {a.weights}")
    elif not st.phase("train", a.train_seconds + 40, train):
        return st.res

    # 2. load through ComfyUI's loader
    loaded = {}

    def load():
        meta = sd.read_meta(a.weights)
        loaded["job480"] = be.standin_job(e2e, a.weights, "standin-480p", dev, g480)
        loaded["job480"].steps = M["steps480"]
        loaded["pos"], loaded["neg"] = sd.conditioning(meta)
        return True

    if not st.phase("load", 15, load):
        return st.res
    job = loaded["job480"]
    pos, neg = loaded["pos"], loaded["neg"]

    # 3. concentration at 480p
    def conc480():
        r = sd.measure_concentration(job.model, g480, pos, neg, steps=M["steps480"], measure=M["conc_steps480"],
                                     chunk=M["chunk"])
        st.res["concentration-480p"] = conc_summary(r, conc)
        o = st.res["concentration-480p"]["overall"]
        st.say(f"concentration 480p: block share 90 median {o['block_share_90_median']:.3f}, heads within 25 % "
               f"{o['heads_within_target']:.2f}, window mass {o['window_mass_mean']:.3f}, spatial {o['spatial_heads']:.2f} "
               f"temporal {o['temporal_heads']:.2f}")
        return True

    st.phase("concentration-480p", 30, conc480)

    # 4. tuned profiles (Tune Sparse Attention on the stand-in)
    profiles = {}

    def tune():
        jobs = [("sparge", 0.07), ("kitchen_sol", 0.07)] + [("kitchen_sol", b) for b in SOL_BUDGETS]
        for variant, budget in jobs:
            if not REG.get(variant).available:
                st.say(f"tune {variant}: not available here")
                continue
            # written to models/sparge_profiles, as the node does; the rows name it by its path
            name = f"standin-{variant}-{budget}.json"
            t = time.perf_counter()
            m = patch.tune_model(job.model, variant, budget, name)
            sd.sample(m, g480, pos, neg, steps=M["tune_steps"])
            path = m.model_options["transformer_options"]["optimized_attention_override"].path
            prof = importlib.import_module(pack.__name__ + ".attention.sparge_profile").SpargeProfile.load(path)
            profiles[(variant, budget)] = path  # rows name it by path (this script runs locally)
            st.say(f"tune {variant} budget {budget}: {len(prof.layers)} layers tuned in {time.perf_counter() - t:.0f} s: "
                   + "; ".join(f"{i}: " + " ".join(f"{k}={v}" for k, v in e.items() if k in ("tau", "cdfthreshd",
                               "simthreshd1", "topk", "sparsity", "rel_l1")) for i, e in sorted(prof.layers.items())))
            with open(path) as f:
                st.res.setdefault("profiles", {})[f"{variant}@{budget}"] = json.load(f)
        return True

    st.phase("tune", 45, tune)

    def progress(r):
        if "error" in r:
            st.say(f"row {r['preset']} {r['row']}: error {r['error']}")
        else:
            st.say(f"row {r['preset']} {r['row']}: {r['s_per_step']:.4f} s/step, whole run "
                   f"{r['s_per_step_whole']:.4f}, PSNR {r.get('psnr', float('nan')):.2f}, SSIM {r.get('ssim', float('nan')):.4f}, "
                   f"rel-L1 vs unpatched {r['rel_l1']:.4f}, kernels {r.get('kernels', '')[:80]}")

    def usable(row):
        base = grammar.parse_row(row)[0]
        if base == "unpatched" or base in AUTO_ROWS:
            return True
        if base == grammar.CORE_SOL:
            return REG.get("kitchen_sol").available
        return base in REG and REG.get(base).available

    def profile_rows():
        out = []
        if ("sparge", 0.07) in profiles:
            out.append(f"sparge[profile={profiles[('sparge', 0.07)]}]")
        if ("kitchen_sol", 0.07) in profiles:
            out.append(f"kitchen_sol[profile={profiles[('kitchen_sol', 0.07)]}]")
        return out

    def run_rows(key, j, rows):
        rows = [r for r in rows if usable(r)]
        finals = {}
        res = e2e.measure(j, rows, progress=progress, final_latents=finals)
        for r in res:
            r.pop("profile", None)
        for r in res:  # the step under the profiler: attention's share, and the step without it (a bound on any kernel)
            if r["row"] in prof_rows and "error" not in r and st.left() > 40:
                p = e2e.profile_one_step(grammar.make_row_model(j.model, r["row"], j.profiles), j)
                r["attention_profile"] = {k: p[k] for k in ("step", "wall_ms", "device_ms", "attention_ms")}
                st.say(f"profile {key} {r['row']}: step {p['wall_ms']} ms wall, {p['device_ms']} ms on the device, "
                       f"attention kernels {p['attention_ms']} ms")
        # the pictures the benchmark node returns: speed against PSNR, and the frames through the stand-in's codec
        pictures.chart(res, f"{key}: {j.steps} steps").image.save(os.path.join(st.out, f"{key}-chart.png"))
        pictures.frames(res, finals, j.extra["vae_decode"]).image.save(os.path.join(st.out, f"{key}-frames.png"))
        del finals
        st.res[key] = res
        st.res[key + "-md"] = report.render_markdown(res)
        st.res[key + "-targets"] = report.targets(res) + report.quality_targets(res, sparse_target=SPARSE_TARGETS.get(key))
        for t in st.res[key + "-targets"]:
            st.say(f"target {key}: {t['target']}: x{t['ratio']:.3f} {'met' if t['met'] else 'MISSED' if t['applies'] else 'n/a'}"
                   f" ({t['detail']})")
        return res

    prof_rows = {r.strip() for r in a.profile_rows.split(",") if r.strip()}

    # 5. the rows at 480p
    base_rows = [r.strip() for r in a.rows.split(",")] if a.rows else MAIN_ROWS
    main480 = base_rows + M["extra_rows"] + profile_rows() + AUTO_ROWS
    est = {"row": 8.0 if dev == "cuda" else 1.0}  # seconds per 480p row (warm-up and timed run), measured below
    rows480 = st.phase("rows-480p", est["row"] * len(main480) + 20, lambda: run_rows("rows-480p", job, main480))
    if rows480:
        ok = [r for r in rows480 if "warmup_s" in r]
        if ok:
            est["row"] = max(3.0 if dev == "cuda" else 0.5,
                             sum(r["warmup_s"] + 1.2 * r["s_per_step_whole"] * job.steps for r in ok) / len(ok))

    # 6. 720p: concentration, then the most telling rows as the budget allows (calibration needs ~60 s after them)
    def conc720():
        r = sd.measure_concentration(job.model, g720, pos, neg, steps=M["steps720"], measure=M["conc_steps720"],
                                     query_stride=2, chunk=M["chunk"])
        st.res["concentration-720p"] = conc_summary(r, conc)
        o = st.res["concentration-720p"]["overall"]
        st.say(f"concentration 720p: block share 90 median {o['block_share_90_median']:.3f}, heads within 25 % "
               f"{o['heads_within_target']:.2f}, window mass {o['window_mass_mean']:.3f}, spatial {o['spatial_heads']:.2f}")
        return True

    st.phase("concentration-720p", 30, conc720)
    per720 = est["row"] * (3.0 if dev == "cuda" else 1.5) * M["steps720"] / M["steps480"]  # attention ~ tokens^2
    order = ["unpatched", "sdpa_cudnn", "sage_fp8_sm90", "kitchen_sol", "auto", "auto_fast", "core:sol-attn",
             "flash_attn4"]
    rows720 = sorted([r for r in base_rows + M["extra_rows"] + profile_rows() + AUTO_ROWS if usable(r)],
                     key=lambda r: order.index(r) if r in order else len(order))
    auto_tune720 = 50.0 if dev == "cuda" else 0.0  # auto measures its candidates on 75,600-token calls: ~2 signatures
    reserve = 70 if st.wanted is None or "calibration-480p" in st.wanted else 15  # the calibration after them
    cost, fit = 0.0, 0
    for r in rows720:
        c = per720 + (auto_tune720 if r in AUTO_ROWS else 0.0)
        if cost + c > st.left() - reserve:
            break
        cost, fit = cost + c, fit + 1
    if st.wanted is None or "rows-720p" in st.wanted:
        if fit >= 3:
            if fit < len(rows720):
                st.res["skipped"].append({"phase": "rows-720p: " + ", ".join(rows720[fit:]),
                                          "why": f"{fit} of {len(rows720)} rows fit the budget"})
                rows720 = rows720[:fit]
            job720 = be.standin_job(e2e, a.weights, "standin-720p", dev, g720)
            job720.steps = M["steps720"]
            if st.left() - reserve < cost + 4 * per720:
                job720.reference = None  # the fp32 run does not fit: the unpatched row is the reference
                st.say("rows-720p: the unpatched row is the reference (no time for the fp32 run)")
            st.phase("rows-720p", 0.8 * per720 * len(rows720), lambda: run_rows("rows-720p", job720, rows720))
        else:
            st.res["skipped"].append({"phase": "rows-720p", "why": f"{st.left():.0f} s left"})

    # 7. calibration at 480p: per-call numbers of every lossy setting, extra rows as the budget allows, the proposals
    def calibration():
        calls = capture_calls(sd, job.model, g480, pos, neg, M["steps480"], M["calib_steps"])
        st.say(f"calibration: {len(calls)} self-attention calls captured (steps {sorted(M['calib_steps'])})")
        sweep = [r for r in SWEEP_ROWS if usable(r)][: a.sweep]
        budget_rows = [f"kitchen_sol[profile={profiles[('kitchen_sol', b)]}]" for b in SOL_BUDGETS if ("kitchen_sol", b) in profiles]
        lossy_main = [r for r in (rows480 or []) if "psnr" in r and not r.get("exact") and r["row"] not in AUTO_ROWS
                      and not r["row"].startswith("core:")]
        per_call = {}
        for row in [r["row"] for r in lossy_main] + budget_rows + sweep:
            try:
                per_call[row] = per_call_accuracy(pack, calls, row, grammar)
                pc = per_call[row]
                st.say(f"per-call {row}: worst cos {pc['cos']:.5f}, worst rel-L1 {pc['rel_l1']:.4f} (first call "
                       f"{pc['first_cos']:.5f} / {pc['first_rel_l1']:.4f})")
            except Exception as e:
                st.say(f"per-call {row}: error {type(e).__name__}: {str(e)[:200]}")
        del calls
        if dev == "cuda":
            torch.cuda.empty_cache()
        st.res["per_call"] = per_call
        left_rows = max(0, int((st.left() - 25) // est["row"]))
        extra = (["unpatched", "sdpa_cudnn" if dev == "cuda" else "sdpa_math"] + budget_rows + sweep)[:left_rows]
        if len(extra) < 2 + len(budget_rows + sweep):
            st.res["skipped"].append({"phase": "calibration rows: " + ", ".join((budget_rows + sweep)[len(extra) - 2:]),
                                      "why": f"{left_rows} rows fit the budget"})
        res = run_rows("calibration-rows-480p", job, extra) if len(extra) > 2 else []
        pts = {}
        for r in list(rows480 or []) + list(res):
            if "psnr" not in r or r["row"].startswith("core:"):
                continue
            name = r["row"]
            pc = per_call.get(name, {})
            setting = {}
            if "profile=" in name:
                b = next((bb for (v, bb), p in profiles.items() if p in name), None)
                setting = {"budget": b, "variant": grammar.parse_row(name)[0]}
            pts[name] = cal.Point(name, r["s_per_step_whole"], r["psnr"], exact=bool(r.get("exact")), cos=pc.get("cos"),
                                  rel_l1=pc.get("rel_l1"), setting=setting)
        points = [p for n, p in pts.items() if n not in AUTO_ROWS]
        floor = cal.exact_floor(points)
        if floor is None:
            raise RuntimeError("no exact row measured: no floor")
        gate = cal.propose_gate(points, floor, current=(auto_mod.DEFAULT_MIN_COS, auto_mod.DEFAULT_MAX_REL_L1))
        # what auto's gate and auto_fast's let through at the 3 dB the default keeps to
        gate["at_3db"] = {r: vars(cal.check_gate(points, floor, c, e, 3.0)) for r, c, e in (
            ("auto", auto_mod.DEFAULT_MIN_COS, auto_mod.DEFAULT_MAX_REL_L1),
            ("auto_fast", auto_mod.FAST_MIN_COS, auto_mod.FAST_MAX_REL_L1))}
        sol_pts = [p for p in points if p.setting.get("variant") == "kitchen_sol"]
        budgets = cal.propose_budget(sol_pts, floor)
        curve = cal.by_tolerance(points, floor)
        budget_curve = [{"tolerance_db": t, **cal.propose_budget(sol_pts, floor, t)} for t in (1.0, 3.0, 6.0, 10.0)]
        st.res["calibration"] = {"points": [vars(p) for p in points], "gate": gate, "budget": budgets, "curve": curve,
                                 "budget_curve": budget_curve,
                                 **{r: vars(pts[r]) if r in pts else None for r in AUTO_ROWS}}
        st.res["calibration-md"] = cal.render_markdown(points, gate, budgets, curve) + "\n\nTuning budget by tolerance: " + \
            "; ".join(f"{b['tolerance_db']:g} dB: {b['budget']}" for b in budget_curve)
        st.say(f"calibration: floor {floor:.2f} dB; rule's setting {gate['target']}; proposed gate cos >= "
               f"{gate['min_cos']}, rel-L1 <= {gate['max_rel_l1']}; budget {budgets['budget']}; by tolerance: "
               + "; ".join(f"{c['tolerance_db']:g} dB -> {c['target']}" for c in curve))
        return True

    st.phase("calibration-480p", 25, calibration)

    try:
        pts = [r for k in ("rows-480p", "calibration-rows-480p", "rows-720p") for r in st.res.get(k) or []]
        if pts:
            be.plot_frontier(pts, os.path.join(a.out, "quality-frontier.png"), st.res["meta"])
    except Exception as e:
        st.say(f"frontier plot: {type(e).__name__}: {e}")
    st.write()
    st.say("done")
    return st.res


if __name__ == "__main__":
    main()
