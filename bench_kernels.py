"""Kernel-level benchmark: speed, peak memory and accuracy of every installed attention backend on model shapes (CUDA).

    cd ComfyUI/custom_nodes/ComfyUI-PatchAttention
    python bench_kernels.py                                  # all presets, all usable backends
    python bench_kernels.py --preset flux --preset wan-480p --json out.json --png out.png
    python bench_kernels.py --shape 2,10,4096,64 --shape 1,24,4608,128,512

The same measurement as the Attention Benchmark node; needs no ComfyUI.  Whole sampling runs: bench_e2e.py.
"""

from __future__ import annotations

import importlib
import sys

from bench_e2e import _load_pack

if __name__ == "__main__":
    sys.exit(importlib.import_module(_load_pack().__name__ + ".measure.bench").main())
