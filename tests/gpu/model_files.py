"""Random-weight model files in ComfyUI's own layouts, full size, for timing whole prompts without the real weights.

    python tests/gpu/model_files.py --models DIR --only wan21-14b,umt5-xxl,wan-vae [--evict]
    python tests/gpu/model_files.py --models DIR --tiny --only ...     # tiny configurations, written on the CPU
    python tests/gpu/model_files.py --list [--tiny]                      # every file: its folder, size and where from

The files go to DIR/<ComfyUI's model folder>/<file> (diffusion_models, text_encoders, vae), safetensors, bf16:

  wan21-14b, wan22-high, wan22-low  Wan 2.1 14B t2v (Wan 2.2 A14B's two experts have its architecture), 28.6 GB each
  flux-dev                          Flux.1 dev, 23.8 GB
  umt5-xxl                          umT5-XXL's encoder, as CLIPLoader's type "wan" loads it, 11.4 GB (with a
                                    SentencePiece model, spiece_model, as ComfyUI's umT5 files carry: its tokenizer)
  t5xxl, clip-l                     T5-XXL's encoder and CLIP-L, DualCLIPLoader's type "flux", 9.5 GB and 0.25 GB
  wan-vae, flux-ae                  Wan 2.1's VAE and Flux's autoencoder, 0.25 GB and 0.17 GB

Key names and shapes are those of ComfyUI's own classes, built on the meta device (nothing allocated): the diffusion
models through comfy.supported_models' configurations (measure/presets.py's WAN_14B and FLUX_DEV), the text encoders
through the classes ComfyUI's loaders build (comfy.text_encoders.wan.te, comfy.text_encoders.flux.flux_clip: the
modules whose state dicts ``CLIP.load_sd`` loads), the VAEs through the classes ``comfy.sd.VAE`` builds for these files
(``WanVAE`` with Wan 2.1's configuration; ``AutoencodingEngine`` with ComfyUI's KL configuration, 16 latent channels,
as for Flux's ae).  ComfyUI's detection then finds them as those models (tests/test_whole_prompt.py checks it).

Values: measure/presets.py's ``_fill_random`` rule (weights of two or more dimensions normal, scaled by their fan-in;
norms' weights and scales one, biases zero; the Wan VAE's norm gammas, whatever their shape, one), drawn on the GPU in
pieces of at most 256 MiB, each copied to the host and written after the header in turn: one piece in host memory at a
time, never the whole file.

Cache: a file is kept when DIR/<folder>/<file>.json (written once the file is complete) names the same layout and size;
otherwise it is made again.  The disk is checked first: the bytes to write against the free space, and where they do not
fit, ``--evict`` removes this script's other files in DIR (those with such a .json), else it stops (exit status 3) and
says how much is needed.

``--tiny``: the same classes with small widths and few layers (what ComfyUI's detection reads kept: umT5's and T5's 24
blocks of 10,240-wide feed-forwards, the VAEs' layouts), for the CPU check; ComfyUI builds the tiny text encoders only
with :func:`tiny_te_options` in its loaders' model options (tests/gpu/prompts.py does that in its CPU mode), and the tiny
Wan file names its text width in its metadata (ComfyUI's ``config`` metadata, which its detection reads).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PIECE = 64 << 20  # elements drawn at a time (256 MiB of float32 on the GPU, 128 MiB of bf16 on the host)
MARGIN = 2 << 30  # bytes left free on the disk
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class Spec:
    folder: str  # ComfyUI's model folder
    file: str
    kind: str  # diffusion, te or vae
    what: str  # the model class (comfy.supported_models), the text encoder's name in ComfyUI, or the VAE
    seed: int
    gb: float  # its size at full size (estimates before anything is built)


SPECS = {
    "wan21-14b": Spec("diffusion_models", "wan2.1_t2v_14B_bf16.safetensors", "diffusion", "WAN21_T2V", 1, 28.58),
    "wan22-high": Spec("diffusion_models", "wan2.2_t2v_high_noise_14B_bf16.safetensors", "diffusion", "WAN21_T2V", 2, 28.58),
    "wan22-low": Spec("diffusion_models", "wan2.2_t2v_low_noise_14B_bf16.safetensors", "diffusion", "WAN21_T2V", 3, 28.58),
    "flux-dev": Spec("diffusion_models", "flux1-dev_bf16.safetensors", "diffusion", "Flux", 4, 23.8),
    "umt5-xxl": Spec("text_encoders", "umt5_xxl_bf16.safetensors", "te", "umt5xxl", 5, 11.36),
    "t5xxl": Spec("text_encoders", "t5xxl_bf16.safetensors", "te", "t5xxl", 6, 9.52),
    "clip-l": Spec("text_encoders", "clip_l.safetensors", "te", "clip_l", 7, 0.25),
    "wan-vae": Spec("vae", "wan_2.1_vae.safetensors", "vae", "wan21", 8, 0.25),
    "flux-ae": Spec("vae", "ae.safetensors", "vae", "flux", 9, 0.17),
}
FULL = {"WAN21_T2V": "WAN_14B", "Flux": "FLUX_DEV"}  # measure/presets.py's configurations

# tiny: the text encoders' width is the diffusion models' text and pooled input
TINY_TEXT = 32
TINY_DIFFUSION = {
    "WAN21_T2V": {"dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 2, "text_dim": TINY_TEXT},
    "Flux": {"hidden_size": 256, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "context_in_dim": TINY_TEXT,
             "vec_in_dim": TINY_TEXT},  # 2 heads of 128 (ComfyUI's detection: hidden size / sum of the rope axes)
}
TINY_T5 = {"d_model": TINY_TEXT, "num_heads": 2, "d_kv": 16}  # 24 blocks, 10,240 wide: T5-XXL to the detection
TINY_TE = {"umt5xxl": TINY_T5, "t5xxl": TINY_T5,
           "clip_l": {"hidden_size": TINY_TEXT, "intermediate_size": 64, "num_attention_heads": 2,
                      "num_hidden_layers": 2, "projection_dim": TINY_TEXT}}

# the VAEs as comfy.sd.VAE builds them for these files (its detection reads Wan's dim and the KL decoder's width)
WAN_VAE = {"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
           "temperal_downsample": [False, True, True], "image_channels": 3, "conv_out_channels": 3, "dropout": 0.0}
KL_VAE = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
TINY_VAE = {"wan21": {"dim": 16}, "flux": {"ch": 32}}  # Flux: the decoder only (ComfyUI reads no encoder width)


_PRESETS = None  # measure/presets.py, once loaded


class NoRoom(RuntimeError):
    """The files asked for do not fit the disk."""


def tiny_te_options(model_options: dict | None = None) -> dict:
    """``model_options`` (a text encoder's) with what makes ComfyUI's text encoder classes tiny: ``SDClipModel``
    reads ``<name>_model_config``; the settings already there (ComfyUI's own, such as CLIP's positions) kept."""
    out = dict(model_options or {})
    for name, cfg in TINY_TE.items():
        key = f"{name}_model_config"
        out[key] = {**cfg, **out.get(key, {})}
    return out


# ---------------------------------------------------------------- layouts (ComfyUI imported)


def load_comfy(comfyui: str | None = None, cpu: bool = True):
    """ComfyUI importable (COMFYUI_PATH, CPU mode unless ``cpu`` is False) and measure/presets.py through the pack."""
    sys.path.insert(0, comfyui or os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, "..", ".."))
    sys.path.insert(1, os.path.dirname(HERE))  # tests/: pack, absent
    from absent import stand_in_if_missing

    stand_in_if_missing("av")  # ComfyUI's video types import PyAV, which the GPU machine lacks
    from comfy.cli_args import args

    args.cpu = args.cpu or cpu
    import comfy.model_management  # noqa: F401 - ComfyUI's start-up order
    import pack

    global _PRESETS
    _PRESETS = importlib.import_module(pack.load().__name__ + ".measure.presets")
    return _PRESETS


def layout(name: str, tiny: bool = False) -> tuple[dict, dict, dict]:
    """(key -> shape, safetensors metadata, key -> bytes of further uint8 tensors) of ``name``'s file."""
    import torch

    spec = SPECS[name]
    with torch.device("meta"):
        if spec.kind == "diffusion":
            module, meta = _diffusion(spec.what, tiny)
        elif spec.kind == "te":
            module, meta = _text_encoder(spec.what, tiny), {}
        else:
            module, meta = _vae(spec.what, tiny), {}
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    extra = {"spiece_model": spiece_model()} if spec.what == "umt5xxl" else {}
    return shapes, meta, extra


def _diffusion(cls: str, tiny: bool):
    import comfy.supported_models as sm
    import torch

    presets = _PRESETS or load_comfy()
    unet = getattr(presets, FULL[cls])
    unet = {**unet, **TINY_DIFFUSION[cls]} if tiny else unet
    config = getattr(sm, cls)(presets.model_config(cls, unet))
    config.set_inference_dtype(torch.bfloat16, None)
    meta = {"config": json.dumps({"transformer": {"text_dim": TINY_TEXT}})} if tiny and cls == "WAN21_T2V" else {}
    return config.get_model({}, "", device="meta").diffusion_model, meta


def _text_encoder(what: str, tiny: bool):
    """The module whose state dict ComfyUI's CLIP loads from the file (the encoder inside the loader's class)."""
    import comfy.text_encoders.flux as flux
    import comfy.text_encoders.wan as wan
    import torch

    opts = tiny_te_options() if tiny else {}
    if what == "umt5xxl":
        return wan.te()(device="meta", dtype=torch.bfloat16, model_options=opts).umt5xxl.transformer
    return getattr(flux.flux_clip()(device="meta", dtype=torch.bfloat16, model_options=opts), what).transformer


def _vae(what: str, tiny: bool):
    if what == "wan21":
        import comfy.ldm.wan.vae as wan

        return wan.WanVAE(**{**WAN_VAE, **(TINY_VAE["wan21"] if tiny else {})})
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    def part(cls, cfg):
        return {"target": f"comfy.ldm.modules.diffusionmodules.model.{cls}", "params": cfg}

    decoder = {**KL_VAE, **(TINY_VAE["flux"] if tiny else {})}
    return AutoencodingEngine(regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                              encoder_config=part("Encoder", KL_VAE), decoder_config=part("Decoder", decoder))


def spiece_model(vocab: int = 2000) -> bytes:
    """A SentencePiece unigram model trained on generated words, with umT5's special ids (pad 0, eos 1, unk 2): what
    ComfyUI's umT5 tokenizer reads from the file (its prompts pad to 512 tokens whatever the vocabulary)."""
    import io
    import random

    import sentencepiece as spm

    rnd = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 9))) for _ in range(4000)]
    lines = [" ".join(rnd.choice(words) for _ in range(12)) for _ in range(6000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   hard_vocab_limit=False, minloglevel=2)
    return buf.getvalue()


# ---------------------------------------------------------------- writing


def fill(key: str, shape: tuple) -> tuple[str, float]:
    """("normal", scale) or ("const", value) for one tensor: measure/presets.py's ``_fill_random`` rule."""
    if key.endswith(("gamma", "scale")):
        return "const", 1.0
    if len(shape) >= 2:
        return "normal", math.prod(shape[1:]) ** -0.5
    return ("const", 1.0) if key.endswith("weight") else ("const", 0.0)


def pieces(key: str, shape: tuple, gen, device):
    """The tensor's bytes (bf16) in pieces of whole rows, drawn on ``device`` with ``gen``."""
    import torch

    kind, value = fill(key, shape)
    rows, per_row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    step = max(1, PIECE // max(1, per_row))
    for r in range(0, rows, step):
        sub = (min(step, rows - r), *shape[1:]) if shape else ()
        if kind == "normal":
            t = torch.randn(sub, generator=gen, device=device, dtype=torch.float32).mul_(value).to(torch.bfloat16)
            t = t.cpu()
        else:
            t = torch.full(sub, value, dtype=torch.bfloat16)
        yield t.reshape(-1).view(torch.uint8).numpy()


def header(shapes: dict, meta: dict, extra: dict) -> tuple[bytes, int]:
    """The safetensors header (its length first, padded to 8 bytes) and the data's size, tensors in ``shapes``' order,
    then ``extra``'s."""
    h, off = ({"__metadata__": meta} if meta else {}), 0
    for k, s in shapes.items():
        n = math.prod(s) * 2
        h[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    for k, b in extra.items():
        h[k] = {"dtype": "U8", "shape": [len(b)], "data_offsets": [off, off + len(b)]}
        off += len(b)
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, off


def fingerprint(name: str, tiny: bool, shapes: dict, meta: dict, extra: dict) -> str:
    body = json.dumps([LAYOUT_VERSION, name, tiny, SPECS[name].seed, list(shapes.items()), meta,
                       {k: hashlib.sha256(b).hexdigest() for k, b in extra.items()}])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def write(path: str, name: str, shapes: dict, meta: dict, extra: dict, device) -> int:
    """The file, through ``path``.part (renamed when complete); its size."""
    import torch

    head, data = header(shapes, meta, extra)
    gen = torch.Generator(device=device).manual_seed(SPECS[name].seed)
    part = path + ".part"
    with open(part, "wb") as f:
        f.write(head)
        for k, s in shapes.items():
            for piece in pieces(k, s, gen, device):
                f.write(piece.data)
        for b in extra.values():
            f.write(b)
    os.replace(part, path)
    return len(head) + data


# ---------------------------------------------------------------- the cache


def sidecar(path: str) -> dict:
    try:
        with open(path + ".json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def cached(models: str, name: str, tiny: bool, layout_id: str | None = None) -> bool:
    """Whether ``name``'s file in ``models`` is complete (its .json: the same name, size and, where given, layout)."""
    spec = SPECS[name]
    path = os.path.join(models, spec.folder, spec.file)
    s = sidecar(path)
    return (os.path.isfile(path) and s.get("name") == name and s.get("tiny") == tiny
            and s.get("bytes") == os.path.getsize(path) and (layout_id is None or s.get("layout") == layout_id))


def evictable(models: str, keep: set) -> list[str]:
    """This script's files in ``models`` other than ``keep``'s paths: complete ones (with their .json) and unfinished
    ones (.part, of a run cut short)."""
    out, ours = [], {s.file for s in SPECS.values()}
    for folder in {s.folder for s in SPECS.values()}:
        d = os.path.join(models, folder)
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            p = os.path.join(d, f)
            if p not in keep and (f.endswith(".part") and f[:-5] in ours or sidecar(p).get("name") in SPECS):
                out.append(p)
    return sorted(out, key=lambda p: not p.endswith(".part"))


def make_room(models: str, need: int, keep: set, evict: bool, log) -> None:
    """``need`` bytes (and :data:`MARGIN`) free on ``models``' disk, this script's other files removed where
    ``evict``; else :class:`NoRoom`."""
    free = shutil.disk_usage(models).free
    log(f"model files: {need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free on {models}")
    if need + MARGIN <= free:
        return
    for p in evictable(models, keep) if evict else []:
        size = os.path.getsize(p)
        for f in (p, p + ".json"):
            if os.path.exists(f):
                os.remove(f)
        free += size
        log(f"model files: removed {p} ({size / 1e9:.1f} GB) for room")
        if need + MARGIN <= free:
            return
    raise NoRoom(f"the model files need {need / 1e9:.1f} GB (and {MARGIN / 2**30:.0f} GiB spare), {free / 1e9:.1f} GB "
                 f"free on {models}" + ("" if evict else "; --evict removes this script's other files there"))


def ensure(models: str, names: list, tiny: bool = False, device=None, evict: bool = False, log=print) -> dict:
    """Every file of ``names`` in ``models``, made where missing (on ``device``: the first GPU, else the CPU);
    {name: {"path", "bytes", "made", "seconds"}}.  Raises :class:`NoRoom`."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plans = {}
    for n in names:
        shapes, meta, extra = layout(n, tiny)
        spec = SPECS[n]
        path = os.path.join(models, spec.folder, spec.file)
        head, data = header(shapes, meta, extra)
        size = len(head) + data
        plans[n] = (path, shapes, meta, extra, size, fingerprint(n, tiny, shapes, meta, extra))
    todo = [n for n, p in plans.items() if not cached(models, n, tiny, p[5])]
    make_room(models, sum(plans[n][4] for n in todo), {p[0] for p in plans.values()}, evict, log)
    out = {}
    for n, (path, shapes, meta, extra, size, lid) in plans.items():
        t0, made = time.time(), n in todo
        if made:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            size = write(path, n, shapes, meta, extra, device)
            with open(path + ".json", "w") as f:
                json.dump({"name": n, "tiny": tiny, "bytes": size, "layout": lid}, f)
            dt = time.time() - t0
            log(f"model files: wrote {path} ({size / 1e9:.2f} GB) in {dt:.0f} s ({size / 1e9 / max(dt, 1e-3):.2f} GB/s)")
        out[n] = {"path": path, "bytes": size, "made": made, "seconds": time.time() - t0}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="/root/pa-models", help="the cache: ComfyUI's model folders inside")
    ap.add_argument("--only", default=",".join(SPECS), help=f"comma-separated, of {', '.join(SPECS)}")
    ap.add_argument("--tiny", action="store_true", help="tiny configurations (the CPU check)")
    ap.add_argument("--evict", action="store_true", help="remove this script's other files in --models for room")
    ap.add_argument("--list", action="store_true", help="every file's folder and size; nothing written")
    ap.add_argument("--report", help="a JSON file: what was made or kept")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)}")
    import torch

    load_comfy(cpu=a.tiny or not torch.cuda.is_available())
    if a.list:
        for n in names:
            shapes, meta, extra = layout(n, a.tiny)
            head, data = header(shapes, meta, extra)
            print(f"{n:11s} {SPECS[n].folder}/{SPECS[n].file}: {len(shapes)} tensors, {(len(head) + data) / 1e9:.2f} GB")
        return 0
    os.makedirs(a.models, exist_ok=True)
    try:
        done = ensure(a.models, names, a.tiny, "cpu" if a.tiny else None, a.evict)
    except NoRoom as e:
        print(f"model files: {e}", flush=True)
        if a.report:
            with open(a.report, "w") as f:
                json.dump({"error": str(e)}, f)
        return 3
    if a.report:
        with open(a.report, "w") as f:
            json.dump(done, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
