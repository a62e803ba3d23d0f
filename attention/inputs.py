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


def _grid_for(n: int, kind: str, grid):
    if grid is not None:
        return tuple(grid)
    if kind == "image":
        s = int(math.isqrt(n))
        if s * s == n:
            return (s, s)
    return (n,)


def _field(b, h, n, d, grid, scale, g):
    """A smooth random field over ``grid`` (product == n), flattened to [b, h, n, d]."""
    if math.prod(grid) != n:
        grid = (n,)
    low = tuple(max(1, s // scale) for s in grid)
    base = torch.randn(b * h, d, *low, generator=g)
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(grid)]
    up = F.interpolate(base, size=grid, mode=mode, align_corners=False)
    return up.reshape(b, h, d, n).transpose(2, 3)


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
    locality: float = 0.9,  # share of the smooth field in each token (0: i.i.d.)
    scale: int = 8,  # field resolution: one random value per `scale` tokens along each axis
    k_bias: float = 4.0,  # per-channel bias on K, in units of K's own std
    sharpness: float = 1.5,  # logit scale: how peaked attention is
):
    """Return q, k, v as ``[B, H, N, D]`` tensors."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "iid":
        q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (nq, nk, nk))
    else:
        fk = "image" if kind in ("image", "video") else "sequence"
        gq = _grid_for(nq, fk, grid)
        gk = gq if nk == nq else _grid_for(nk, fk, None)
        noise = math.sqrt(max(0.0, 1.0 - locality**2))
        shared = _field(b, h, max(nq, nk), d, gq if nq >= nk else gk, scale, g)  # q and k see the same scene
        q = locality * shared[:, :, :nq] + noise * torch.randn(b, h, nq, d, generator=g)
        k = locality * shared[:, :, :nk] + noise * torch.randn(b, h, nk, d, generator=g)
        if nk != nq:
            k = locality * _field(b, h, nk, d, gk, scale, g) + noise * torch.randn(b, h, nk, d, generator=g)
        v = _field(b, h, nk, d, gk, scale, g) * locality + noise * torch.randn(b, h, nk, d, generator=g)
        q = q * sharpness
        k = k * sharpness
    if k_bias:
        k = k + k_bias * k.std() * torch.randn(1, h, 1, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype).contiguous() for t in (q, k, v))
