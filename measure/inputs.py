"""Q/K/V with the structure of a diffusion transformer's, for tests and benchmarks.

i.i.d. noise flatters quantized kernels (no outliers) and starves sparse ones
(no locality).  Real DiT activations have (a) tokens that resemble their
spatial / spatio-temporal neighbours and (b) a large per-channel bias in K
(what SageAttention's "smooth K" removes).  ``structured_qkv`` makes both:
a low-resolution random field upsampled over the token grid (image: H x W,
video: T x H x W, in raster order) plus noise, and a shared channel bias on K.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Smoothness per kind: octaves of (downsampling factor per grid axis, weight).  Raster-order tokens make a
# 64/128-token block a strip along the last axis, so the coarse octave is smooth along it (as a real frame's
# rows are over short spans); calibrated on the H100 so that SpargeAttn's default thresholds find 0.25-0.65
# sparsity across the locality/sharpness range (docs/sparge.md); one octave found none.
OCTAVES = {
    "sequence": (((8,), 0.5), ((32,), 1.0)),
    "image": (((4, 8), 0.5), ((16, 32), 1.0)),
    "video": (((1, 4, 8), 0.5), ((4, 16, 32), 1.0)),
}


def _grid_for(n: int, kind: str, grid):
    if grid is not None and math.prod(grid) == n:
        return tuple(grid)
    if kind == "image":
        s = int(math.isqrt(n))
        if s * s == n:
            return (s, s)
    return (n,)


def _field(b, h, n, d, grid, octaves, g):
    """A smooth random field over ``grid`` (product == n), unit variance, flattened to [b, h, n, d]."""
    total = 0
    for factors, weight in octaves:
        f = tuple(factors[-len(grid):]) if len(factors) >= len(grid) else (factors[-1],) * len(grid)
        low = tuple(max(1, s // x) for s, x in zip(grid, f))
        base = torch.randn(b * h, d, *low, generator=g)
        mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(grid)]
        up = F.interpolate(base, size=grid, mode=mode, align_corners=False)
        total = total + weight * up / up.std().clamp_min(1e-6)
    total = total / total.std().clamp_min(1e-6)
    return total.reshape(b, h, d, n).transpose(2, 3)


def structured_qkv(
    b: int,
    h: int,
    nq: int,
    nk: int,
    d: int,
    *,
    device="cpu",
    dtype=torch.float32,
    seed: int = 0,
    kind: str = "image",  # "iid", "sequence", "image", "video"
    grid=None,  # token grid for q (and k when nk == nq), e.g. (T, H, W)
    locality: float = 0.95,  # share of the smooth field in each token (0: i.i.d.)
    octaves=None,  # override OCTAVES[kind]
    k_bias: float = 4.0,  # per-channel bias on K, in units of K's own std
    sharpness: float = 1.5,  # logit scale: how peaked attention is
):
    """Return q, k, v as contiguous ``[B, H, N, D]`` tensors."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "iid":
        q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (nq, nk, nk))
    else:
        fk = "video" if kind == "video" else ("image" if kind == "image" else "sequence")
        oct_ = octaves or OCTAVES[fk]
        gq = _grid_for(nq, "image" if fk != "sequence" else fk, grid)
        gk = gq if nk == nq else _grid_for(nk, "image" if fk != "sequence" else fk, None)
        noise = math.sqrt(max(0.0, 1.0 - locality**2))
        fq = _field(b, h, nq, d, gq, oct_, g)
        fkf = fq if nk == nq else _field(b, h, nk, d, gk, oct_, g)  # self-attention: q and k see the same scene
        q = locality * fq + noise * torch.randn(b, h, nq, d, generator=g)
        k = locality * fkf + noise * torch.randn(b, h, nk, d, generator=g)
        v = locality * _field(b, h, nk, d, gk, oct_, g) + noise * torch.randn(b, h, nk, d, generator=g)
        q = q * sharpness
        k = k * sharpness
    if k_bias:
        k = k + k_bias * k.std() * torch.randn(1, h, 1, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype).contiguous() for t in (q, k, v))
