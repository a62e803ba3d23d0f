"""A stand-in for a trained video diffusion model: ComfyUI's own Wan 2.1 class with Wan 1.3B's layer geometry and a
few blocks, trained in minutes as a flow-matching model on procedural video.

Random weights make attention flat, so they cannot say how fast a sparse kernel is on a trained model, nor how far
any kernel moves the output (a random network amplifies bf16 rounding until every kernel sits on one noise floor).
This model has what the kernels care about: Wan 1.3B's layer geometry (width 1536, 12 heads of 128, FFN 8960, text
context width 4096, frequency dim 256; ``blocks`` deep, 3 by default), ComfyUI's 3-D RoPE, and attention learned on
video with local structure.  It is saved as a safetensors state dict that ``comfy.sd.load_diffusion_model`` reads
(model detection infers the config from the keys) and it samples through ComfyUI (``WAN21_T2V``:
``ModelSamplingDiscreteFlow``, shift 8, Euler).

**Data** (made on the fly, on the GPU): camera pans, zooms and orbits over natural images -- scikit-image's sample
images where scikit-image is installed, procedural textures (1/f noise and shapes) elsewhere -- with up to three
objects moving across, each clip rendered at twice the latent's resolution and encoded by a fixed linear "VAE"
(:class:`Codec`: 2x2 pixel unshuffle, an orthonormal 12 -> 16 map).  Captions: one fixed random embedding per
motion kind and speed (16) and one negative, ``[tokens, 4096]`` like umt5's output; 10 % of training clips get the
negative (CFG works).

**Why the attention is concentrated, and why that carries to 32k tokens.**  Each self-attention head starts with a
RoPE locality prior: equal constant components in its q and k biases on a band of RoPE frequencies, which gives a
logit ``sum_i A_i cos(w_i * offset)`` per axis, peaked at offset 0 (a head's band and its weight per axis -- frames
or rows/columns -- are random, so some heads start spatial and some temporal).  Training keeps what helps denoising
(local structure: texture, edges, motion from neighbouring frames), at a reduced learning rate for q/k.  RoPE is
relative, so a locality learned on small grids holds on large ones; what grows with the grid is the number of
distant keys, so the training mix includes full 480p grids (32,760 tokens) and 720p-wide ones, at a token budget per
step (batch x tokens about constant).  ``tests/gpu/quality.py`` measures what the trained model's attention really is
(:mod:`measure.concentration`) at 480p and 720p.

    python tools/standin.py train --out standin.safetensors          (CUDA; about 4 minutes on an H100)
    python tools/standin.py sample --weights standin.safetensors --grid 21,60,104 --steps 10

Needs a ComfyUI (``COMFYUI_PATH``, or the ComfyUI this pack sits in).  Seeded: the same seed, step count, GPU and
torch give the same weights (``--steps auto`` fixes the step count from the measured speed of the first steps; the
count is in the file's metadata).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WAN_1_3B = {"dim": 1536, "ffn_dim": 8960, "blocks": 3}  # heads = dim // 128 (ComfyUI's detection), text 4096, freq 256
TINY = {"dim": 128, "ffn_dim": 256, "blocks": 2}  # one head of 128: the CPU test's size
TEXT_TOKENS = 512  # umt5's padded length in ComfyUI's Wan workflows
LATENT_CHANNELS = 16
LATENT_GRIDS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}  # latent (T, H, W) of 81 frames: 32,760 and 75,600 tokens
KINDS = ("pan right", "pan left", "pan down", "pan up", "zoom in", "zoom out", "orbit", "still camera, moving objects")
SHIFT = 8.0  # WAN21_T2V's sampling shift
# training grids (latent T, H, W) and their share of steps: full 480p, 720p-wide, and smaller crops at the same pixel
# density (batched up to the token budget)
GRIDS = (((21, 60, 104), 0.35), ((9, 90, 160), 0.15), ((13, 40, 72), 0.15), ((9, 30, 52), 0.2), ((5, 24, 40), 0.15))
TINY_GRIDS = (((2, 8, 12), 0.5), ((2, 8, 8), 0.5))


def unet_config(dim: int, ffn_dim: int, blocks: int) -> dict:
    """WAN21_T2V's config at this geometry: what ComfyUI's model detection infers from such a state dict."""
    return {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "dim": dim, "ffn_dim": ffn_dim,
            "num_heads": dim // 128, "num_layers": blocks, "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
            "cross_attn_norm": True, "eps": 1e-6, "in_dim": LATENT_CHANNELS, "out_dim": LATENT_CHANNELS}


def tokens(grid) -> int:
    t, h, w = grid
    return t * (h // 2) * (w // 2)


# ---------------------------------------------------------------- the model

def build(geometry: dict, device="cpu", dtype=torch.float32):
    """ComfyUI's ``model_base.WAN21`` through ``supported_models.WAN21_T2V``, uninitialised (ComfyUI's layers skip
    initialisation: :func:`init_weights` does it)."""
    import comfy.supported_models as sm

    if geometry["dim"] % 128:
        raise ValueError(f"stand-in width {geometry['dim']} is not a multiple of 128 (ComfyUI's Wan detection assumes "
                         "heads of 128)")
    mc = sm.WAN21_T2V(unet_config(geometry["dim"], geometry["ffn_dim"], geometry["blocks"]))
    mc.set_inference_dtype(dtype, None)
    return mc.get_model({}, device=device)


def rope_bands(head_dim: int = 128, theta: float = 10000.0):
    """Wan's RoPE layout for one head: per axis (frames, rows, columns), the channel-pair indices and frequencies."""
    d = head_dim
    axes = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    out, start = [], 0
    for a in axes:
        n = a // 2
        freqs = [theta ** (-2 * i / a) for i in range(n)]
        out.append((list(range(start, start + n)), freqs))
        start += n
    return out


def init_weights(dm, seed: int = 0, prior: bool = True, gain: float = 1.25) -> list[dict]:
    """Initialise a WanModel in place: fan-in scaled weights, zero biases, adaLN gates at 0.2, a zero output layer;
    with ``prior``, each self-attention head gets the RoPE locality prior (module docstring).  Returns the prior of
    each head (block, head, axis weights, frequency cut-offs, bias energy)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in dm.named_parameters():
            if name.endswith("modulation"):
                p.zero_()
                if p.shape[1] == 6:  # shift, scale, gate (attention), shift, scale, gate (FFN)
                    p[:, 2].fill_(0.2)
                    p[:, 5].fill_(0.2)
            elif p.ndim >= 2:
                std = p[0].numel() ** -0.5
                if name.startswith("time_projection"):
                    std *= 0.1
                if name.startswith("head.head"):
                    std = 0.0
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or name.endswith("norm3.weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return rope_prior(dm, seed + 1, gain) if prior else []


def rope_prior(dm, seed: int, gain: float = 1.25) -> list[dict]:
    """Per self-attention head, equal constant components in the q and k biases on Wan's RoPE channel pairs, with
    amplitudes ``A_i ~ w_i exp(-(w_i s)^2 / 2)`` per axis (frames, rows, columns): a logit of ``sum_i A_i cos(w_i
    offset)``, close to a Gaussian of width ``s`` tokens in each axis (the amplitude's ``w_i`` factor makes up for the
    log spacing of RoPE's frequencies).  Per head: ``s`` log-uniform in [0.7, 8] tokens per axis, the axes weighted by
    a flat Dirichlet draw, the bias energy 1-4x the content's per channel; the q/k norms' gain is ``gain``."""
    g = torch.Generator().manual_seed(seed)
    bands = rope_bands()
    out = []
    with torch.no_grad():
        for bi, block in enumerate(dm.blocks):
            sa = block.self_attn
            hd, nh = sa.head_dim, sa.num_heads
            if hd != 128:
                raise ValueError("the RoPE prior assumes heads of 128 (Wan's)")
            bias = torch.zeros(nh, hd // 2, 2)
            info = []
            for h in range(nh):
                w = _dirichlet(g, 3)
                width = [math.exp(_u(g, math.log(0.7), math.log(8.0))) for _ in range(3)]
                energy = _u(g, 1.0, 4.0)  # mean bias^2 per channel of the head
                amp = torch.zeros(hd // 2)
                for a, (pairs, freqs) in enumerate(bands):
                    f = torch.tensor(freqs)
                    spec = f * torch.exp(-0.5 * (f * width[a]) ** 2)
                    amp[pairs] = float(w[a]) * spec / spec.sum()
                amp = amp / amp.sum() * energy * hd  # sum over the head's channels of bias^2
                phase = torch.rand(hd // 2, generator=g) * 2 * math.pi
                bias[h, :, 0] = amp.sqrt() * phase.cos()
                bias[h, :, 1] = amp.sqrt() * phase.sin()
                info.append({"block": bi, "head": h, "axis_weights": [round(float(x), 3) for x in w],
                             "width": [round(x, 2) for x in width], "energy": round(energy, 2)})
            flat = bias.reshape(-1).to(sa.q.bias.dtype)
            sa.q.bias.copy_(flat)
            sa.k.bias.copy_(flat)
            sa.norm_q.weight.fill_(gain)
            sa.norm_k.weight.fill_(gain)
            out += info
    return out


def _dirichlet(g, n):
    x = -torch.log(torch.rand(n, generator=g).clamp_min(1e-9))  # Gamma(1) draws
    return x / x.sum()


# ---------------------------------------------------------------- the data

class Codec:
    """RGB frames in [0, 1] at twice the latent's resolution <-> 16-channel latents (the model's space): 2x2 pixel
    unshuffle (12 values per latent pixel), a fixed orthonormal 12 -> 16 map, a gain for about unit variance."""

    GAIN = 2.0

    def __init__(self, seed: int = 1234, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        m, _ = torch.linalg.qr(torch.randn(LATENT_CHANNELS, 12, generator=g, dtype=torch.float64))
        self.m = m.float().to(device)  # [16, 12], orthonormal columns

    def encode(self, rgb: torch.Tensor) -> torch.Tensor:
        """[B, 3, T, 2H, 2W] -> [B, 16, T, H, W]."""
        b, _, t, hh, ww = rgb.shape
        x = (rgb * 2 - 1).transpose(1, 2).reshape(b * t, 3, hh, ww)
        x = F.pixel_unshuffle(x, 2)  # [BT, 12, H, W]
        z = torch.einsum("oc,bchw->bohw", self.m.to(x.dtype), x) * self.GAIN
        return z.reshape(b, t, LATENT_CHANNELS, hh // 2, ww // 2).transpose(1, 2).contiguous()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """[B, 16, T, H, W] -> [B, 3, T, 2H, 2W] in [0, 1] (clamped)."""
        b, _, t, h, w = z.shape
        x = z.float().transpose(1, 2).reshape(b * t, LATENT_CHANNELS, h, w) / self.GAIN
        x = torch.einsum("oc,bohw->bchw", self.m.to(x.device), x)
        x = F.pixel_shuffle(x, 2)
        return ((x + 1) / 2).clamp(0, 1).reshape(b, t, 3, 2 * h, 2 * w).transpose(1, 2)


def load_images(device="cpu", seed: int = 0, min_side: int = 256, max_side: int = 1024):
    """(images, source): scikit-image's bundled sample images (read from its package folder: no download), each as
    [3, H, W] in [0, 1]; procedural textures where scikit-image is missing."""
    try:
        import skimage.data
        import skimage.io
    except ImportError:
        return procedural_images(10, 512, seed, device), "procedural textures (scikit-image not installed)"
    folder = os.path.dirname(skimage.data.__file__)
    imgs, names = [], []
    for f in sorted(os.listdir(folder)):
        if not f.lower().endswith((".png", ".jpg")):
            continue
        try:
            a = skimage.io.imread(os.path.join(folder, f))
        except Exception:
            continue
        t = torch.as_tensor(a).float()
        if t.ndim == 2:
            t = t[..., None].expand(-1, -1, 3)
        if t.ndim != 3 or t.shape[-1] < 3:
            continue
        t = t[..., :3].permute(2, 0, 1)
        t = t / (255.0 if a.dtype.kind == "u" and a.dtype.itemsize == 1 else max(float(t.max()), 1.0))
        if min(t.shape[-2:]) < min_side:
            continue
        if max(t.shape[-2:]) > max_side:
            s = max_side / max(t.shape[-2:])
            t = F.interpolate(t[None], scale_factor=s, mode="area")[0]
        if float(t.std()) < 0.02:
            continue
        imgs.append(t.contiguous().to(device))
        names.append(f)
    if len(imgs) < 4:
        return procedural_images(10, 512, seed, device), "procedural textures (too few scikit-image sample images)"
    return imgs, "scikit-image sample images: " + ", ".join(names)


def procedural_images(n: int, size: int, seed: int, device="cpu"):
    """1/f noise in colour with a few hard-edged shapes: natural-image statistics without image files."""
    g = torch.Generator().manual_seed(seed)
    fy = torch.fft.fftfreq(size).abs()[:, None]
    fx = torch.fft.rfftfreq(size)[None]
    f = (fy * fy + fx * fx).sqrt().clamp_min(1.0 / size)
    out = []
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    for _ in range(n):
        beta = 1.6 + 0.6 * float(torch.rand(1, generator=g))
        chans = []
        base = torch.randn(size, size // 2 + 1, 2, generator=g)
        for _c in range(3):
            spec = torch.complex(*(0.7 * base + 0.3 * torch.randn(size, size // 2 + 1, 2, generator=g)).unbind(-1))
            chans.append(torch.fft.irfft2(spec / f ** beta, s=(size, size)))
        img = torch.stack(chans)
        img = (img - img.mean()) / (img.std() * 4) + 0.5
        for _s in range(int(torch.randint(3, 9, (1,), generator=g))):
            cy, cx = (torch.rand(2, generator=g) * size).tolist()
            r = float(8 + torch.rand(1, generator=g) * size / 6)
            col = torch.rand(3, 1, 1, generator=g)
            m = (((yy - cy) ** 2 + (xx - cx) ** 2) < r * r).float()
            img = img * (1 - m) + col * m
        out.append(img.clamp(0, 1).to(device))
    return out


def _u(g, lo, hi):
    return lo + (hi - lo) * float(torch.rand(1, generator=g))


def _ri(g, n):
    return int(torch.randint(n, (1,), generator=g))


class Scenes:
    """Procedural clips: a camera moving over a natural image (pan, zoom, orbit, or still) with up to three objects
    (textured ellipses cut from other images) moving across.  Motion in rendered pixels per frame, so clips at
    different sizes share their local statistics (a smaller grid is a crop at the same pixel density)."""

    def __init__(self, images, device="cpu"):
        self.images = images
        self.device = torch.device(device)

    def _sample_img(self, img, cy, cx, rho, py, px):
        """``img`` sampled at image pixel ``(cy + rho * py, cx + rho * px)``; py/px: [T, H, W] offsets; reflection
        at the image's borders."""
        ih, iw = img.shape[-2:]
        y = (cy + rho * py) / max(ih - 1, 1) * 2 - 1
        x = (cx + rho * px) / max(iw - 1, 1) * 2 - 1
        grid = torch.stack((x, y), dim=-1)
        return F.grid_sample(img[None].expand(grid.shape[0], -1, -1, -1), grid, mode="bilinear",
                             padding_mode="reflection", align_corners=True)

    def clip(self, t: int, hh: int, ww: int, g) -> tuple[torch.Tensor, int]:
        """One clip, [3, T, hh, ww] in [0, 1] (rendered pixels), and its caption class (kind * 2 + fast)."""
        dev = self.device
        kind, fast = _ri(g, len(KINDS)), _ri(g, 2)
        speed = _u(g, 1.6, 4.0) if fast else _u(g, 0.4, 1.2)
        img = self.images[_ri(g, len(self.images))]
        ih, iw = img.shape[-2:]
        rho0 = _u(g, 0.8, 1.8)
        tt = torch.arange(t, device=dev, dtype=torch.float32)
        ys = (torch.arange(hh, device=dev, dtype=torch.float32) - (hh - 1) / 2)
        xs = (torch.arange(ww, device=dev, dtype=torch.float32) - (ww - 1) / 2)
        py, px = ys[None, :, None].expand(t, hh, ww), xs[None, None, :].expand(t, hh, ww)
        cy0 = _u(g, min(ih / 2, hh * rho0 / 2), max(ih / 2, ih - hh * rho0 / 2))
        cx0 = _u(g, min(iw / 2, ww * rho0 / 2), max(iw / 2, iw - ww * rho0 / 2))
        rho = torch.full((t,), rho0, device=dev)
        cy, cx = torch.full((t,), cy0, device=dev), torch.full((t,), cx0, device=dev)
        name = KINDS[kind]
        if name.startswith("pan"):
            dy, dx = {"pan right": (0, 1), "pan left": (0, -1), "pan down": (1, 0), "pan up": (-1, 0)}[name]
            cy, cx = cy + dy * speed * rho0 * tt, cx + dx * speed * rho0 * tt
        elif name.startswith("zoom"):
            z = speed / 100.0
            rho = rho0 * torch.exp((-z if name == "zoom in" else z) * tt)
        elif name == "orbit":
            radius = _u(g, 10, 40)
            om = speed / radius
            ph = _u(g, 0, 2 * math.pi)
            cy = cy + radius * rho0 * torch.sin(om * tt + ph)
            cx = cx + radius * rho0 * torch.cos(om * tt + ph)
        frame = self._sample_img(img, cy[:, None, None], cx[:, None, None], rho[:, None, None], py, px)  # [T, 3, hh, ww]
        n_obj = 2 + _ri(g, 2) if name.startswith("still") else _ri(g, 3)
        for _ in range(n_obj):
            src = self.images[_ri(g, len(self.images))]
            sh, sw = src.shape[-2:]
            r = min(_u(g, 8, 36), 0.4 * min(hh, ww))
            asp = _u(g, 0.6, 1.6)
            v = _u(g, 0.5, 4.0)
            ang = _u(g, 0, 2 * math.pi)
            oy = _u(g, -hh / 2, hh / 2) + v * math.sin(ang) * tt
            ox = _u(g, -ww / 2, ww / 2) + v * math.cos(ang) * tt
            ry, rx = py - oy[:, None, None], px - ox[:, None, None]
            d = ((ry / (r / asp)) ** 2 + (rx / (r * asp)) ** 2).sqrt()
            mask = torch.sigmoid((1 - d) * r * 0.7)[:, None]
            rho_o = _u(g, 0.8, 1.6)
            sprite = self._sample_img(src, _u(g, sh * 0.25, sh * 0.75), _u(g, sw * 0.25, sw * 0.75), rho_o, ry, rx)
            frame = frame * (1 - mask) + sprite * mask
        return frame.transpose(0, 1).clamp(0, 1), kind * 2 + fast


class Data:
    """Training batches: clips from :class:`Scenes`, encoded by :class:`Codec`, and caption embeddings."""

    NEGATIVE = 2 * len(KINDS)

    def __init__(self, device="cpu", seed: int = 0, text_tokens: int = TEXT_TOKENS, images=None):
        """``images``: (list of [3, H, W] tensors, where they come from), or None for :func:`load_images`."""
        images, self.source = load_images(device, seed) if images is None else images
        self.scenes = Scenes(images, device)
        self.codec = Codec(seed + 1234, device)
        self.captions = captions(seed + 99, text_tokens, device)

    def batch(self, b: int, grid, g):
        """``b`` clips at latent ``grid`` (T, H, W): (x0 [b, 16, T, H, W], caption classes [b])."""
        t, h, w = grid
        clips, cls = zip(*(self.scenes.clip(t, 2 * h, 2 * w, g) for _ in range(b)))
        return self.codec.encode(torch.stack(clips)), torch.tensor(cls)


def captions(seed: int, text_tokens: int = TEXT_TOKENS, device="cpu", dim: int = 4096) -> torch.Tensor:
    """``[2 * len(KINDS) + 1, text_tokens, dim]``: per caption class, 16 class tokens then a shared padding embedding;
    the last row is the negative prompt."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * len(KINDS) + 1
    pad = torch.randn(text_tokens, dim, generator=g) * 0.3
    out = pad[None].repeat(n, 1, 1)
    k = min(16, text_tokens)
    out[:, :k] = torch.randn(n, k, dim, generator=g)
    return out.to(device)


# ---------------------------------------------------------------- training

def _sigma_shift(u, shift):
    return shift * u / (1 + (shift - 1) * u)


def train(model, data: Data, *, steps="auto", seconds: float = 230.0, seed: int = 0, lr: float = 2e-4,
          qk_lr: float = 0.3, tokens_per_step: int = 32768, grids=GRIDS, warmup: int = 50, calib: int = 30,
          log=print, log_every: int = 25) -> dict:
    """Train ``model`` (a ``model_base.WAN21``) in place as a flow-matching model: x_t = (1 - s) x0 + s noise, the
    network predicts noise - x0 at timestep 1000 s (ComfyUI's ``ModelSamplingDiscreteFlow``), s drawn uniformly and
    with Wan's shift 8 (half each).  The model computes in its own dtype (bf16 on the GPU, as it samples); AdamW updates
    fp32 master copies, warm-up then cosine decay; self-attention q/k at ``qk_lr`` times the rate (their RoPE prior
    moves slowly).  ``steps``: a count, or "auto" (as many as fit ``seconds``, from the speed of steps
    5-``calib``).  Stops at ``seconds`` in any case."""
    import comfy.model_management as mm

    dm = model.diffusion_model
    params = [p for p in dm.parameters()]
    dev = params[0].device
    cuda = dev.type == "cuda"
    dtype = model.get_dtype()
    was_training = getattr(mm, "in_training", False)
    mm.in_training = True  # ComfyUI 0.33: eager RoPE and activations, which autograd can differentiate
    dm.requires_grad_(True)
    dm.train()
    slow_names = {n for n, _ in dm.named_parameters() if re.match(r"blocks\.\d+\.self_attn\.(q|k|norm_q|norm_k)\.", n)}
    named = list(dm.named_parameters())
    master = [p.detach().float().clone().requires_grad_(True) for _, p in named]
    fast = [m for (n, _), m in zip(named, master) if n not in slow_names]
    slow = [m for (n, _), m in zip(named, master) if n in slow_names]
    opt = torch.optim.AdamW([{"params": fast, "lr": lr, "base": lr}, {"params": slow, "lr": lr * qk_lr, "base": lr * qk_lr}],
                            betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)
    g = torch.Generator().manual_seed(seed)
    gdev = torch.Generator(device=dev).manual_seed(seed + 7)
    weights = torch.tensor([w for _, w in grids])
    total = None if steps == "auto" else int(steps)
    t0 = time.perf_counter()
    t_cal = None
    hist, window = [], []
    stopped = "steps"
    step = 0
    try:
        while total is None or step < total:
            elapsed = time.perf_counter() - t0
            if elapsed > seconds:
                stopped = f"time limit {seconds:g} s"
                break
            grid = grids[int(torch.multinomial(weights, 1, generator=g))][0]
            b = max(1, tokens_per_step // tokens(grid))
            x0, cls = data.batch(b, grid, g)
            noise = torch.randn(x0.shape, generator=gdev, device=dev)
            u = torch.rand(b, generator=g)
            shift = torch.where(torch.rand(b, generator=g) < 0.5, torch.tensor(SHIFT), torch.tensor(1.0))
            sigma = _sigma_shift(u, shift).clamp(1e-3, 1.0).to(dev)
            drop = torch.rand(b, generator=g) < 0.1
            cls = torch.where(drop, torch.tensor(Data.NEGATIVE), cls)
            ctx = data.captions[cls.to(data.captions.device)].to(dev, dtype)
            s5 = sigma.view(-1, 1, 1, 1, 1)
            xt = ((1 - s5) * x0 + s5 * noise).to(dtype)
            v = dm(xt, sigma * 1000.0, context=ctx, transformer_options={})
            loss = F.mse_loss(v.float(), noise - x0)
            for p in params:
                p.grad = None
            loss.backward()
            for p, m in zip(params, master):
                m.grad = None if p.grad is None else p.grad.float()
            torch.nn.utils.clip_grad_norm_(master, 1.0)
            frac = step / total if total else 0.0
            scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            for grp in opt.param_groups:
                grp["lr"] = grp["base"] * scale
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
            window.append(float(loss.detach()) if step % 5 == 0 or not cuda else None)
            step += 1
            if step == 5:
                if cuda:
                    torch.cuda.synchronize()
                t_cal = time.perf_counter()
            if total is None and step == calib:
                if cuda:
                    torch.cuda.synchronize()
                per = (time.perf_counter() - t_cal) / (calib - 5)
                left = seconds - (time.perf_counter() - t0)
                total = calib + max(0, int(0.97 * left / per))
                log(f"standin: {per:.3f} s/step over steps 5-{calib}: {total} steps planned in {seconds:g} s")
            if step % log_every == 0:
                vals = [x for x in window if x is not None]
                hist.append({"step": step, "loss": round(sum(vals) / max(len(vals), 1), 5),
                             "seconds": round(time.perf_counter() - t0, 1), "lr": round(opt.param_groups[0]["lr"], 7)})
                window = []
                log(f"standin: step {step}/{total or '?'} loss {hist[-1]['loss']:.4f} lr {hist[-1]['lr']:.2e} "
                    f"{hist[-1]['seconds']:.0f} s (grid {grid} x{b})")
    finally:
        mm.in_training = was_training
        dm.requires_grad_(False)
        for p in params:
            p.grad = None
        dm.eval()
    if cuda:
        torch.cuda.synchronize()
    vals = [x for x in window if x is not None]
    if vals:
        hist.append({"step": step, "loss": round(sum(vals) / len(vals), 5), "seconds": round(time.perf_counter() - t0, 1),
                     "lr": round(opt.param_groups[0]["lr"], 7)})
    return {"steps": step, "planned": total, "seconds": round(time.perf_counter() - t0, 1), "stopped_by": stopped,
            "loss": hist, "tokens_per_step": tokens_per_step, "lr": lr, "qk_lr": qk_lr, "seed": seed,
            "dtype": str(dtype).replace("torch.", "")}


def save(model, path: str, meta: dict, dtype=torch.bfloat16) -> None:
    """The diffusion model's state dict (no prefix: ComfyUI's loader takes it as a diffusion model) as safetensors."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.diffusion_model.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(sd, path, metadata={"patch_attention_standin": json.dumps(meta)})


def read_meta(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return json.loads((f.metadata() or {}).get("patch_attention_standin", "{}"))


def load(path: str, dtype=torch.bfloat16, device=None):
    """The stand-in through ComfyUI's loader (``comfy.sd.load_diffusion_model``, which detects the config from the
    keys), then kept resident on ``device`` (default: ComfyUI's torch device) as the benchmark's presets are."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    loaded = comfy.sd.load_diffusion_model(path, model_options={"dtype": dtype})
    dev = torch.device(device) if device is not None else mm.get_torch_device()
    model = loaded.model.to(dev)
    return comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)


# ---------------------------------------------------------------- sampling

def conditioning(meta: dict, device="cpu", kind: int = 0):
    """(positive, negative) ComfyUI conditioning lists for caption class ``kind`` (default: a slow pan right), from
    the caption seed and token count in the stand-in's metadata."""
    caps = captions(meta.get("caption_seed", 99), meta.get("text_tokens", TEXT_TOKENS), "cpu")
    return [[caps[kind][None], {}]], [[caps[Data.NEGATIVE][None], {}]]


def sample(patcher, grid, positive, negative, *, steps: int = 10, cfg: float = 5.0, seed: int = 0, sampler="euler",
           scheduler="simple", callback=None):
    """Sample through ComfyUI (``comfy.sample.sample``); returns the final latent (ComfyUI's latent space)."""
    import comfy.sample

    shape = (1, LATENT_CHANNELS, *grid)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return comfy.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive, negative, torch.zeros(shape),
                                   disable_pbar=True, seed=seed, callback=callback)


def decode(patcher, latent: torch.Tensor, meta: dict) -> torch.Tensor:
    """A sampled latent (ComfyUI's latent space) as RGB frames through the stand-in's codec: [B, 3, T, 2H, 2W]."""
    z = patcher.model.process_latent_in(latent.float())
    return Codec(meta.get("codec_seed", 1234), "cpu").decode(z.cpu())


# ---------------------------------------------------------------- attention concentration during sampling

def concentration_override(grid, steps_to_measure, results: list, *, chunk: int = 1024, query_stride: int = 1,
                           previous=None):
    """An attention override that measures the concentration (:func:`measure.concentration.call_stats`) of every
    self-attention call over ``grid`` (latent T, H, W) at the sampling steps ``steps_to_measure``, appending
    ``{"step", "layer", "stats"}`` to ``results``, and returns ComfyUI's own attention (or ``previous``'s)."""
    conc = pack_module("concentration")
    call_stats, to_hnd = conc.call_stats, conc.to_hnd

    t, h, w = grid
    n = t * (h // 2) * (w // 2)
    state = {"layer": 0, "sigma": None}

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        topts = kwargs.get("transformer_options") or {}
        nq = q.shape[2] if skip_reshape else q.shape[1]
        nk = k.shape[2] if skip_reshape else k.shape[1]
        if nq == n and nk == n and mask is None:
            sig = topts.get("sigmas")
            sched = topts.get("sample_sigmas")
            step = None
            if sig is not None and sched is not None:
                s = float(sig.flatten()[0])
                if state["sigma"] != s:
                    state["sigma"], state["layer"] = s, 0
                step = int((sched.float().cpu() - s).abs().argmin())
            if step in steps_to_measure:
                stats = call_stats(to_hnd(q, heads, skip_reshape), to_hnd(k, heads, skip_reshape), (t, h // 2, w // 2),
                                   scale=kwargs.get("scale"), chunk=chunk, query_stride=query_stride)
                results.append({"step": step, "sigma": state["sigma"], "layer": state["layer"], "stats": stats})
            state["layer"] += 1
        kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                  skip_output_reshape=skip_output_reshape, **kwargs)
        return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)

    return override


def measure_concentration(patcher, grid, positive, negative, *, steps: int = 10, measure=(2, 5, 8), cfg: float = 5.0,
                          seed: int = 0, chunk: int = 1024, query_stride: int = 1) -> list[dict]:
    """Sample once with :func:`concentration_override` on a clone; the measured calls."""
    results = []
    m = patcher.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = concentration_override(
        grid, set(measure), results, chunk=chunk, query_stride=query_stride)
    sample(m, grid, positive, negative, steps=steps, cfg=cfg, seed=seed)
    return results


def concentration_at(model, x0: torch.Tensor, context: torch.Tensor, sigma: float, *, chunk: int = 1024,
                     query_stride: int = 1, seed: int = 0) -> list[dict]:
    """One forward of ``model`` (a ``model_base.WAN21``, no sampler, no model management) on a clip ``x0`` (model
    space, [1, 16, T, H, W]) noised to ``sigma``, with :func:`concentration_override` on every self-attention call."""
    results = []
    grid = tuple(x0.shape[2:])
    ov = concentration_override(grid, {1}, results, chunk=chunk, query_stride=query_stride)
    dev = x0.device
    noise = torch.randn(x0.shape, generator=torch.Generator(device=dev).manual_seed(seed), device=dev)
    s = torch.full((x0.shape[0],), float(sigma), device=dev)
    topts = {"optimized_attention_override": ov, "sigmas": s, "sample_sigmas": torch.tensor([1.0, float(sigma), 0.0])}
    with torch.no_grad():
        model.apply_model((1 - sigma) * x0 + sigma * noise, s, c_crossattn=context.to(dev), transformer_options=topts)
    return results


# ---------------------------------------------------------------- command line

def pack_module(name: str):
    """``measure/<name>.py`` of this pack, loaded on its own (a module without relative imports): the pack itself
    is not imported, so a ComfyUI that already loaded it keeps one copy."""
    import importlib.util

    key = f"patch_attention_standalone_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "measure", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def comfy_path() -> str:
    path = os.environ.get("COMFYUI_PATH") or os.path.dirname(os.path.dirname(ROOT))
    if not os.path.exists(os.path.join(path, "comfy", "model_base.py")):
        sys.exit("standin: no ComfyUI found: set COMFYUI_PATH, or run this from ComfyUI/custom_nodes/<this pack>")
    return path


def setup_comfy(cpu: bool = False) -> None:
    path = comfy_path()
    if path not in sys.path:
        sys.path.insert(0, path)
    from comfy.cli_args import args

    if cpu:
        args.cpu = True
    import comfy.model_management  # noqa: F401


def make(geometry: dict, out: str, *, device, seed: int = 0, steps="auto", seconds: float = 230.0, grids=GRIDS,
         tokens_per_step: int = 32768, text_tokens: int = TEXT_TOKENS, prior: bool = True, log=print,
         images=None, lr: float = 2e-4, warmup: int = 50) -> dict:
    """Build, initialise, train and save the stand-in; returns its metadata (also in the file)."""
    model = build(geometry, device=device, dtype=torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    priors = init_weights(model.diffusion_model, seed, prior=prior)
    data = Data(device, seed, text_tokens, images=images)
    log(f"standin: {sum(p.numel() for p in model.diffusion_model.parameters()) / 1e6:.1f} M parameters; data: "
        f"{data.source[:200]}")
    report = train(model, data, steps=steps, seconds=seconds, seed=seed, grids=grids, tokens_per_step=tokens_per_step,
                   log=log, lr=lr, warmup=warmup)
    meta = {"geometry": geometry, "seed": seed, "caption_seed": seed + 99, "codec_seed": seed + 1234,
            "text_tokens": text_tokens, "prior": prior, "data": data.source, "train": report,
            "grids": [list(gr) + [w] for gr, w in grids], "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else "cpu",
            "priors": priors}
    save(model, out, meta)
    log(f"standin: saved {out} ({os.path.getsize(out) / 2**20:.0f} MiB) after {report['steps']} steps, "
        f"{report['seconds']} s, stopped by {report['stopped_by']}")
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train and save the stand-in")
    t.add_argument("--out", required=True)
    t.add_argument("--blocks", type=int, default=WAN_1_3B["blocks"])
    t.add_argument("--steps", default="auto", help="a step count, or auto (as many as fit --seconds)")
    t.add_argument("--seconds", type=float, default=230.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (the code path of the CPU test)")
    t.add_argument("--no-prior", action="store_true", help="no RoPE locality prior at initialisation")
    s = sub.add_parser("sample", help="load through ComfyUI's loader and sample once")
    s.add_argument("--weights", required=True)
    s.add_argument("--grid", default="21,60,104", help="latent T,H,W (480p: 21,60,104; 720p: 21,90,160)")
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--png", help="write the first, middle and last decoded frame here")
    a = ap.parse_args(argv)
    setup_comfy(cpu=getattr(a, "tiny", False) or not torch.cuda.is_available())
    if a.cmd == "train":
        tiny = a.tiny
        geo = dict(TINY if tiny else {**WAN_1_3B, "blocks": a.blocks})
        steps = a.steps if a.steps == "auto" else int(a.steps)
        make(geo, a.out, device="cpu" if tiny else "cuda", seed=a.seed, steps=steps, seconds=a.seconds,
             grids=TINY_GRIDS if tiny else GRIDS, tokens_per_step=64 if tiny else 32768,
             text_tokens=8 if tiny else TEXT_TOKENS, prior=not a.no_prior,
             images=(procedural_images(3, 64, a.seed), "procedural textures (tiny)") if tiny else None,
             lr=1e-3 if tiny else 2e-4, warmup=2 if tiny else 50)
        return
    meta = read_meta(a.weights)
    patcher = load(a.weights)
    grid = tuple(int(x) for x in a.grid.split(","))
    pos, neg = conditioning(meta)
    t0 = time.perf_counter()
    lat = sample(patcher, grid, pos, neg, steps=a.steps)
    print(f"sampled {tuple(lat.shape)} in {time.perf_counter() - t0:.1f} s; latent std {float(lat.std()):.3f}")
    if a.png:
        frames = decode(patcher, lat, meta)[0]
        idx = [0, frames.shape[1] // 2, frames.shape[1] - 1]
        strip = torch.cat([frames[:, i] for i in idx], dim=-1)
        from PIL import Image

        Image.fromarray((strip.permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(a.png)


if __name__ == "__main__":
    main()
