"""Context Parallel composed with what users put around it, on every GPU of the machine (ComfyUI 0.33):

    python tests/gpu/cp_compose.py --preset wan-1.3b-33f --json cp-compose.json

Cases, each against the same model on one GPU (the final latent's relative L1; 0: bit-identical):

- ``plain``: the model split, nothing else.
- ``lora-before`` / ``lora-after``: a LoRA-like weight patch (``ModelPatcher.add_patches`` with weight differences, as
  the LoRA loaders leave it) on the model before the Context Parallel node, or on its output (a LoRA loader after it):
  every GPU's copy must sample with the patched weights.
- ``patch-after``: Patch Attention (``sdpa_cudnn``: one exact kernel on both sides) applied after the node.
- ``compile``: ComfyUI's TorchCompileModel wrapper (inductor, the wrapper's default options) on the split model, after
  the model sampled compiled on one GPU: the split forwards run uncompiled on every GPU, so the latent is the
  uncompiled model's on one GPU bit for bit (its difference to the compiled one, other graphs, is recorded).
- ``compile-node``: the same with the TorchCompileModel node's own options (its guard filter: no guards on anything
  reached through ``transformer_options``, so the code compiled on one GPU would run again in a split forward if the
  node let it, and the other GPUs would wait).

The model is the preset's class with random bf16 weights (tests/gpu/multigpu.py's copies on the other GPUs); every
forward is split however short (``min_tokens=0``) except where the case says otherwise.

Models as users load them: the same weights saved to a file in /tmp, loaded by the loader a workflow uses, sampled on
one GPU and through the Context Parallel node, whose GPUs' copies ComfyUI makes (``create_multigpu_deepclones``); the
log must show every forward split:

- ``fp8-scaled``: the block linears' weights in fp8 (e4m3fn) with a scale per weight, in ComfyUI 0.33's per-layer
  format (``<layer>.comfy_quant``, ``<layer>.weight_scale``), loaded by ``comfy.sd.load_diffusion_model`` (UNETLoader);
  the copies are the loader's reloads. Bit-identical expected (the activations are cast to fp8 with scale 1, per
  token: nothing depends on how the tokens are split).
- ``gguf``: the 2-D weights in Q8_0 as ComfyUI-GGUF's tools/convert.py lays out a Wan model (arch ``wan``, the
  modulations, 1-D and small tensors and the 5-D patch embedding in F32), loaded by ComfyUI-GGUF's UnetLoaderGGUF
  (``--gguf-node``: its checkout); that loader registers no reload function, so the copies are copies of the loaded
  model. Expected within rounding of one GPU, most likely bit-identical (the same Q8_0 bytes on every GPU, dequantized
  element by element, then the bf16 matmuls of the plain case): at most 1e-3 passes.
- ``dynamic``: the bf16 file loaded by ``comfy.sd.load_diffusion_model`` with ComfyUI's dynamic VRAM on (comfy-aimdo;
  ``--dynamic-vram``, switched on before any model loads: one process of its own, which can also run ``gguf`` and
  ``fp8-scaled`` under it). Bit-identical expected.

Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # tests/: comfyui_support


def lora_patches(model, scale: float = 0.02, seed: int = 1) -> dict:
    """Weight differences for every self-attention q/k/v/o weight of the diffusion model (a rank-8 product each)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, w in model.model.state_dict().items():
        if key.startswith("diffusion_model.") and ".self_attn." in key and key.endswith(".weight") and w.ndim == 2:
            a = torch.randn(w.shape[0], 8, generator=g) * scale
            b = torch.randn(8, w.shape[1], generator=g) / w.shape[1] ** 0.5
            out[key] = ((a @ b).to(w.dtype),)
    return out


FILE_CASES = ("fp8-scaled", "gguf", "dynamic")
SPLIT = re.compile(r"Context Parallel: (\d+) of (\d+) forwards split over (\d+) GPUs")


def diffusion_state_dict(model) -> dict:
    """The diffusion model's weights on the CPU, keyed as in a diffusion-model file (UNETLoader's)."""
    return {k: t.detach().to("cpu") for k, t in model.model.diffusion_model.state_dict().items()}


def save_bf16(sd: dict, path: str) -> None:
    import comfy.utils

    comfy.utils.save_torch_file(sd, path)


def save_fp8_scaled(sd: dict, path: str) -> None:
    """The blocks' 2-D (linear) weights in fp8 e4m3fn, each with its scale (amax / 448), in ComfyUI 0.33's per-layer
    quantization format; the rest as it is."""
    import comfy.utils

    fp8 = torch.float8_e4m3fn
    conf = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    out = {}
    for key, t in sd.items():
        if key.startswith("blocks.") and key.endswith(".weight") and t.ndim == 2:
            layer = key[:-len(".weight")]
            scale = t.float().abs().amax() / torch.finfo(fp8).max
            out[key] = (t.float() / scale).to(fp8)
            out[layer + ".weight_scale"] = scale.reshape(())
            out[layer + ".comfy_quant"] = conf.clone()
        else:
            out[key] = t
    comfy.utils.save_torch_file(out, path)


def save_gguf(sd: dict, path: str, arch: str = "wan") -> None:
    """A Q8_0 GGUF file as ComfyUI-GGUF's tools/convert.py (then llama.cpp's quantize) lays it out: the keys as in the
    diffusion model, 2-D weights in Q8_0; 1-D tensors, tensors of at most 1,024 values, ``.modulation`` (its
    ``keys_hiprec``) and the 5-D patch embedding (tools/fix_5d_tensors.py adds it) in F32."""
    import gguf

    w = gguf.GGUFWriter(path=None, arch=arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    for key, t in sd.items():
        data = t.float().numpy()
        qtype = q8 if data.ndim == 2 and data.size > 1024 and ".modulation" not in key and data.shape[-1] % 32 == 0 \
            else f32
        w.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_gguf(path: str, node_dir: str):
    """``path`` loaded by ComfyUI-GGUF's UnetLoaderGGUF (its checkout ``node_dir`` loaded as ComfyUI loads a custom node),
    the file's folder registered where the loader looks (diffusion_models, which its unet_gguf list follows)."""
    import asyncio

    import comfy.sd
    import folder_paths
    from absent import stand_in_if_missing

    stand_in_if_missing("av")  # ComfyUI's nodes.py imports PyAV (its video types), which the GPU machine lacks; unused
    # ComfyUI's nodes.py, which ComfyUI-GGUF imports too (this repository's nodes/ is earlier on the path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(comfy.sd.__file__))))
    try:
        import nodes
    finally:
        del sys.path[0]
    if not hasattr(nodes, "load_custom_node"):
        raise RuntimeError(f"'nodes' is {nodes.__file__}, not ComfyUI's nodes.py")
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(path))
    if "UnetLoaderGGUF" not in nodes.NODE_CLASS_MAPPINGS:
        if not os.path.isdir(node_dir) or not asyncio.run(nodes.load_custom_node(node_dir)):
            raise RuntimeError(f"ComfyUI-GGUF did not load from {node_dir!r} (--gguf-node)")
    if os.path.dirname(path) not in folder_paths.get_folder_paths("unet_gguf"):
        folder_paths.add_model_folder_path("unet_gguf", os.path.dirname(path))
    return nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(os.path.basename(path))[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="wan-1.3b-33f")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--inference", action="store_true",
                    help="sample in inference mode, as ComfyUI does (with 4 steps or more, the split forwards of the "
                         "families that offer it replay as CUDA graphs from the third)")
    ap.add_argument("--cases", default="lora-before,lora-after,patch-after,compile")
    ap.add_argument("--dynamic-vram", action="store_true",
                    help="ComfyUI's dynamic VRAM on before any model loads (the file cases only; the dynamic case needs it)")
    ap.add_argument("--gguf-node", default=os.environ.get("COMFYUI_GGUF") or os.path.join(
        os.environ.get("COMFYUI_PATH", "."), "custom_nodes", "ComfyUI-GGUF"), help="a ComfyUI-GGUF checkout")
    ap.add_argument("--json")
    ap.add_argument("--stacks", help="write every thread's stack to this file after --stacks-after seconds (a case that "
                    "hangs shows where it waits)")
    ap.add_argument("--stacks-after", type=float, default=0.0)
    a = ap.parse_args(argv)
    if a.stacks and a.stacks_after > 0:
        stacks = open(a.stacks, "w")  # open for the process's life: faulthandler writes to it from its own thread
        faulthandler.dump_traceback_later(a.stacks_after, exit=False, file=stacks)
    names = [c for c in a.cases.split(",") if c]
    if a.dynamic_vram and any(c.split("#")[0] not in FILE_CASES for c in names):
        ap.error(f"--dynamic-vram runs the file cases only ({', '.join(FILE_CASES)})")
    if "dynamic" in names and not a.dynamic_vram:
        ap.error("the dynamic case needs --dynamic-vram (a process of its own)")
    if a.dynamic_vram:  # before any comfy module: comfy_aimdo.host_buffer binds the native library when imported
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import multigpu as MG

    pack, e2e, cpn = MG.load()
    presets = importlib.import_module(pack.__name__ + ".measure.presets")
    job = presets.build_preset(a.preset)
    job.cfg, job.steps = 1.0, a.steps
    copies = []
    patch = pack.nodes.patch.patch_model
    base = job.model
    said = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger().addHandler(Catch(level=logging.WARNING))
    plog = logging.getLogger("patch_attention.parallel")  # its info lines: how many forwards split, how copies were made
    plog.setLevel(logging.INFO)
    plog.addHandler(Catch(level=logging.INFO))
    plog.propagate = False

    def sample(m):
        with torch.inference_mode(a.inference):  # as ComfyUI's executor samples: split forwards may replay as graphs
            return e2e._sample(m, job, job.steps).float().cpu()

    def split(m):
        return cpn.context_parallel(MG.with_copies(m, copies), gpus=0, cfg_split=False, min_tokens=0)

    def node(m):  # the node alone: ComfyUI makes the GPUs' copies, as in a workflow
        return cpn.context_parallel(m, gpus=0, cfg_split=False, min_tokens=0)

    def lora(m):
        m = m.clone()
        m.add_patches(lora_patches(m), 1.0)
        return m

    # the copies on the other GPUs before anything runs, as this script made them when its plain cases were measured
    if not a.dynamic_vram:
        copies.extend(MG.copies(e2e, job, a.preset))
    # the process's first sampling run differs from every later one (first-use settings: measured, rel-L1 7e-3 with
    # nothing split), so every case runs after one
    e2e._sample(base, job, 1)
    folder = tempfile.mkdtemp(prefix="pa-cp-compose-")
    files, loaded = {}, {}
    writers = {"fp8-scaled": ("fp8-scaled.safetensors", save_fp8_scaled), "gguf": ("q8_0.gguf", save_gguf),
               "dynamic": ("bf16.safetensors", save_bf16)}

    def write(names):  # the files, from the preset's weights
        sd = diffusion_state_dict(base)
        for name in names:
            fname, writer = writers[name]
            files[name] = os.path.join(folder, fname)
            t0 = time.perf_counter()
            try:
                writer(sd, files[name])
                print(f"cp-compose: wrote {fname} ({os.path.getsize(files[name]) / 2**30:.2f} GiB) in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
            except Exception as e:  # the case fails with it
                files[name] = e

    if a.dynamic_vram:  # every file before dynamic VRAM is on (its models load lazily) and the preset's model is gone
        write(sorted({c.split("#")[0] for c in names} & set(FILE_CASES)))
        del job.model, base
        torch.cuda.empty_cache()
        presets.enable_dynamic_vram()

    def from_file(name):
        if name not in files:
            write([name])
        if isinstance(files[name], Exception):
            raise RuntimeError(f"writing the file failed: {files[name]}") from files[name]
        if name not in loaded:
            import comfy.sd

            loaded[name] = load_gguf(files[name], a.gguf_node) if name == "gguf" else \
                comfy.sd.load_diffusion_model(files[name])
        return loaded[name]

    cases = {
        "plain": (lambda: base, lambda: split(base)),
        "lora-before": (lambda: lora(base), lambda: split(lora(base))),
        "lora-after": (lambda: lora(base), lambda: lora(split(base))),
        "patch-after": (lambda: patch(base, "sdpa_cudnn"), lambda: patch(split(base), "sdpa_cudnn")),
        "compile": (lambda: MG.compiled(base, False), lambda: MG.compiled(split(base), False)),
        "compile-node": (lambda: MG.compiled(base), lambda: MG.compiled(split(base))),
    }
    for name in FILE_CASES:
        cases[name] = (lambda n=name: from_file(n), lambda n=name: node(from_file(n)))
    results, failed, uncompiled = [], 0, None
    for name in names:
        r = {"case": name.split("#")[0]}
        name = r["case"]
        if name in FILE_CASES:
            r["dynamic_vram"] = a.dynamic_vram
        t0 = time.perf_counter()
        try:
            one, many = cases[name]
            ref = sample(one())
            del said[:]
            out = sample(many())
            r["rel_l1_vs_1gpu"] = MG.rel_l1(out, ref)
            if name.startswith("compile"):  # the split forwards ran uncompiled: the uncompiled model's latent
                if uncompiled is None:
                    uncompiled = sample(base)
                r["rel_l1_vs_1gpu_uncompiled"] = MG.rel_l1(out, uncompiled)
            r["finite"] = bool(torch.isfinite(out).all())
            r["said"] = [s for s in said if "Context Parallel" in s][:4]
            one_gpu = any("runs on one GPU" in s or "ran on one GPU" in s or s.endswith("one GPU") for s in r["said"])
            if name in FILE_CASES:
                m = loaded[name]
                r["patcher"] = f"{type(m).__name__}{' (dynamic)' if m.is_dynamic() else ''}"
                r["copies_made_by_copying"] = any("copies of the loaded model" in s for s in said)
                n = torch.cuda.device_count()
                counts = [tuple(map(int, x.groups())) for x in map(SPLIT.search, said) if x]
                r["split"] = not one_gpu and bool(counts) and all(s == f and s > 0 and g == n for s, f, g in counts)
                exact = r["rel_l1_vs_1gpu"] <= 1e-3 if name == "gguf" else r["rel_l1_vs_1gpu"] == 0.0
                # GGUF under dynamic VRAM: no copy (it would share comfy-aimdo's buffers): one GPU, and the log says why
                want_split = not (name == "gguf" and a.dynamic_vram)
                said_why = want_split or any("cannot be copied for the other GPUs under dynamic VRAM" in s for s in said)
                r["ok"] = r["finite"] and exact and r["split"] == want_split and said_why and \
                    (name != "dynamic" or m.is_dynamic())
            else:
                r["split"] = not one_gpu
                # compiled: the split forwards run uncompiled, as the model uncompiled on one GPU, bit for bit (the
                # compiled model on one GPU runs other graphs: its difference is recorded, not judged)
                exact = r.get("rel_l1_vs_1gpu_uncompiled", r["rel_l1_vs_1gpu"])
                r["ok"] = r["finite"] and exact == 0.0 and r["split"]
        except Exception as e:  # a case's failure is a result
            r.update(ok=False, error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-2000:])
        r["seconds"] = round(time.perf_counter() - t0, 1)
        failed += not r["ok"]
        results.append(r)
        print(f"cp-compose {name}: {'ok' if r['ok'] else 'FAIL'} " + json.dumps({k: v for k, v in r.items()
                                                                                   if k not in ('case', 'trace')}), flush=True)
        loaded.pop(name, None)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                       "dynamic_vram": a.dynamic_vram, "results": results}, f, indent=1)
    print(f"cp-compose: {len(results) - failed} of {len(results)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
