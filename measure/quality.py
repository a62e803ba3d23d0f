"""Image-quality measures of a sampled output against a reference run of the same seed: PSNR and SSIM.

Papers judge an attention approximation by PSNR/SSIM (and LPIPS) of the same-seed video against dense attention.  Here
they are taken on what every sampling run returns, the final latent (``[B, C, H, W]`` or ``[B, C, T, H, W]``), each
channel of each frame a 2-D image:

- PSNR: ``10 log10(range^2 / MSE)`` over the whole tensor, ``range`` the reference's peak-to-peak value (a latent has
  no fixed [0, 1] range).
- SSIM: Wang et al. 2004 with an 11x11 Gaussian window (sigma 1.5), ``K1 = 0.01``, ``K2 = 0.03``, the same ``range``,
  averaged over the valid (unpadded) positions of every 2-D slice.  Slices smaller than the window use a window of
  their size.

No ComfyUI here: tensors in, floats out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def data_range(ref: torch.Tensor) -> float:
    r = ref.float()
    return float(r.max() - r.min()) or 1.0


def psnr(x: torch.Tensor, ref: torch.Tensor, value_range: float | None = None) -> float:
    """PSNR of ``x`` against ``ref`` in dB (``inf`` when they are equal)."""
    if x.shape != ref.shape:
        raise ValueError(f"psnr: shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    rng = data_range(ref) if value_range is None else float(value_range)
    mse = float((x.double() - ref.double()).square().mean())
    if mse == 0.0:
        return math.inf
    if not math.isfinite(mse):
        return -math.inf
    return 10.0 * math.log10(rng * rng / mse)


def _slices(t: torch.Tensor) -> torch.Tensor:
    """Every 2-D image of a latent: ``[..., H, W]`` -> ``[S, 1, H, W]``."""
    if t.ndim < 2:
        raise ValueError(f"ssim: need at least 2 dims, got {tuple(t.shape)}")
    return t.reshape(-1, 1, t.shape[-2], t.shape[-1])


def _gauss(size: int, sigma: float, device) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64, device=device) - (size - 1) / 2
    g = torch.exp(-(x * x) / (2 * sigma * sigma))
    return g / g.sum()


def ssim(x: torch.Tensor, ref: torch.Tensor, value_range: float | None = None, win: int = 11, sigma: float = 1.5,
         k1: float = 0.01, k2: float = 0.03) -> float:
    """Mean SSIM of ``x`` against ``ref`` over every 2-D slice (see the module docstring)."""
    if x.shape != ref.shape:
        raise ValueError(f"ssim: shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    rng = data_range(ref) if value_range is None else float(value_range)
    a, b = _slices(x.double()), _slices(ref.double())
    wh, ww = min(win, a.shape[-2]), min(win, a.shape[-1])
    gh = _gauss(wh, sigma, a.device).view(1, 1, wh, 1)
    gw = _gauss(ww, sigma, a.device).view(1, 1, 1, ww)

    def filt(t):
        return F.conv2d(F.conv2d(t, gh), gw)

    mu_a, mu_b = filt(a), filt(b)
    saa = filt(a * a) - mu_a * mu_a
    sbb = filt(b * b) - mu_b * mu_b
    sab = filt(a * b) - mu_a * mu_b
    c1, c2 = (k1 * rng) ** 2, (k2 * rng) ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * sab + c2)) / ((mu_a * mu_a + mu_b * mu_b + c1) * (saa + sbb + c2))
    return float(s.mean())


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """``{"psnr": dB, "ssim": mean SSIM}`` of ``x`` against ``ref``, with the reference's range (on the GPU where there
    is one: a 720p video latent is 5,000 slices for SSIM's float64 filters)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, ref = x.detach().float().to(dev), ref.detach().float().to(dev)
    rng = data_range(ref)
    return {"psnr": psnr(x, ref, rng), "ssim": ssim(x, ref, rng)}


AT_FLOOR = "at the exact floor"


def verdict(row_psnr: float, floor_psnr: float | None, tolerance_db: float = 1.0) -> str:
    """How a row's PSNR (against the reference) compares with the exact-kernel floor: at or above it (its error is no
    larger than the difference between two exact kernels), within ``tolerance_db`` below it, or how far below."""
    if floor_psnr is None or math.isnan(floor_psnr):
        return ""
    if row_psnr >= floor_psnr:
        return AT_FLOOR
    if math.isinf(floor_psnr):
        return "differs where the exact kernels agree bit for bit"
    gap = floor_psnr - row_psnr
    if gap <= tolerance_db:
        return f"within {tolerance_db:g} dB of the floor ({gap:.2f} dB below)"
    return f"{gap:.1f} dB below the floor"
