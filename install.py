#!/usr/bin/env python
"""Install the attention kernels this machine's GPUs can run, without touching torch.

Run by ComfyUI Manager after cloning (non-interactive, ComfyUI's Python), or by
hand with the Python that runs ComfyUI:

    python install.py --dry-run          # print the plan only
    python install.py --yes              # do it
    python install.py --sage-source ~/src/SageAttention --sparge-source ~/src/SpargeAttn

Where a kernel comes from, in this order: already installed and complete; a
prebuilt wheel that matches this Python, torch, CUDA and platform exactly, from
an index in ``WHEEL_INDEXES`` and checked by sha256; a build from the pinned
upstream commit in ``PINS`` (checked by a hash of its source tree) where a CUDA
toolkit can build it; SageAttention 1.0.6 from PyPI (Triton) otherwise. On
Windows the ``triton-windows`` release that matches the installed torch comes
with any kernel that needs Triton. FlashAttention-4 (Linux, sm 9.x/10.x/11.0) is
one pinned, sha256-checked set of PyPI wheels installed with ``--no-deps``
(``FA4_SET``), its CuTe DSL libraries chosen by torch's CUDA major.

Every pip call runs with a constraints file that pins the installed torch,
torchvision and torchaudio; torch is checked again after each step and what a
step installed is removed if torch moved anyway. Every download goes through
``download()``; ``--mirror DIR`` (or ``PATCH_ATTENTION_MIRROR``) serves them
from a folder instead, for machines without network and for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load_capabilities():
    """``attention/capabilities.py`` by path: pure data, no torch, no package import."""
    spec = importlib.util.spec_from_file_location("_pa_capabilities", HERE / "attention" / "capabilities.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


CAPS = _load_capabilities()
KERNELS = CAPS.KERNELS

PINNED = ("torch", "torchvision", "torchaudio")
# Minimum nvcc per arch (SageAttention's setup.py refuses older ones).
NVCC_MIN_FOR_ARCH = {(8, 9): (12, 4), (9, 0): (12, 3), (12, 0): (12, 8), (12, 1): (12, 9), (10, 0): (12, 8)}
BUILD_TOOLS = ("setuptools", "wheel", "packaging", "ninja")  # what a --no-build-isolation build imports


# ============================================================ data: where each kernel comes from
# The one place to update when upstream moves. Each entry says when and how it was last verified.

@dataclass(frozen=True)
class Pin:
    """An upstream commit to build from, checked by ``tree_digest`` of its source (not the archive's bytes:
    GitHub does not promise byte-stable archives). ``skip``: folders the build never reads (images, examples),
    left out of the digest so a trimmed copy of the same commit checks too."""

    repo: str
    commit: str
    tree_sha256: str
    skip: tuple[str, ...]
    verified: str

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/archive/{self.commit}.tar.gz"

    def describe(self) -> str:
        return f"{self.repo}@{self.commit[:7]} (pinned; source tree sha256-checked)"


_SAGE_PIN = Pin(
    repo="thu-ml/SageAttention",
    commit="d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5",  # main, 2026-01-17 (after tag v2.2.0)
    tree_sha256="c7bb606cb27638024c3915630ef4508218935d9a9a973589a95c13d462862dad",
    skip=("assets/", "example/", "bench/"),
    verified="2026-11-22: built by this script and checked on the H100 (sm 9.0, torch 2.11+cu130, nvcc 13.0, GCC 13)",
)
PINS: dict[str, Pin] = {
    "sageattention": _SAGE_PIN,
    "sageattn3": _SAGE_PIN,  # sageattention3_blackwell/ of the same tree; not built on real hardware yet
    "spas_sage_attn": Pin(
        repo="thu-ml/SpargeAttn",
        commit="bfd980b781784c04ad6a53e7ee657c0645d99171",  # main, 2025-12-29
        tree_sha256="702aad0526128de45e1043d6a4c910ae246ab79c2942b253cd1bd6842c014dc4",
        skip=("assets/", "inference_examples/", "evaluate/"),
        verified="2026-11-22: built by this script (with the FIXES below) and checked on the H100",
    ),
}


@dataclass(frozen=True)
class WheelIndex:
    name: str
    url: str
    platforms: str
    covers: str
    used: str  # how this script uses it


WHEEL_INDEXES: tuple[WheelIndex, ...] = (
    WheelIndex("PyPI", "https://pypi.org/simple", "all",
               "sageattention 1.0.6 (Triton only; 2.x is not on PyPI), triton-windows 3.2-3.8, xformers, comfy-kitchen",
               "pip's own resolution, under the torch pins"),
    WheelIndex("woct0rdho/SageAttention releases", "https://github.com/woct0rdho/SageAttention/releases", "Windows x64",
               "SageAttention 2.2.0 for torch 2.5.1/2.6.0/2.7.1/2.8.0/2.9.0 (post3), 2.9.1 and >= 2.10 (post6, "
               "libtorch stable ABI); CUDA 12.4-13.0; CPython >= 3.9/3.10 (abi3); kernels for sm 7.5-12.0",
               "the files in PREBUILT_WHEELS only, each checked by sha256"),
    WheelIndex("woct0rdho/SpargeAttn releases", "https://github.com/woct0rdho/SpargeAttn/releases", "Windows x64",
               "SpargeAttn 0.1.0 for torch 2.5.1-2.8.0 (post1-post3) and >= 2.9 (post4); CUDA 12.4-13.0",
               "not installed: no sha256 of these files is recorded here yet; install one by hand if you want it"),
)


_WHEEL_NAME = re.compile(
    r"^(?P<dist>[a-z_]+)-(?P<ver>[\d.]+)\+cu(?P<cu>\d+)torch(?P<torch>[\d.]+?)(?P<andhigher>andhigher)?"
    r"(?:\.post(?P<post>\d+))?-cp(?P<py>\d+)-(?P<abi>abi3|cp\d+)-(?P<plat>\w+)\.whl$"
)


@dataclass(frozen=True)
class PrebuiltWheel:
    """One file of a release index. What it covers is read from its name (the publisher's convention:
    ``cu128torch2.8.0`` is that torch minor; ``torch2.10.0andhigher`` uses libtorch's stable ABI; ``cp310-abi3``
    is CPython >= 3.10). The publisher documents that the CUDA minor may differ, the major may not."""

    kernel: str
    index: str
    tag: str
    filename: str
    sha256: str

    @property
    def url(self) -> str:
        releases = next(ix.url for ix in WHEEL_INDEXES if ix.name == self.index)  # a GitHub releases page
        return f"{releases}/download/{self.tag}/{urllib.parse.quote(self.filename)}"

    @property
    def fields(self) -> dict:
        mt = _WHEEL_NAME.match(self.filename)
        if not mt:
            raise ValueError(f"cannot read {self.filename}")
        cu = mt["cu"]
        return {
            "cuda": (int(cu[:-1]), int(cu[-1])),
            "torch": tuple(int(x) for x in mt["torch"].split(".")),
            "andhigher": bool(mt["andhigher"]),
            "post": int(mt["post"] or 0),
            "python": (int(mt["py"][0]), int(mt["py"][1:])),
            "abi3": mt["abi"] == "abi3",
            "platform": mt["plat"],
        }

    def rank(self, m: Machine) -> tuple | None:
        """None if this wheel does not fit ``m``, else a sort key (higher is better)."""
        f = self.fields
        if f["platform"] != m.platform_tag or not m.torch_cuda:
            return None
        cuda = _version_tuple(m.torch_cuda, r"(\d+)\.(\d+)")
        if cuda is None or f["cuda"][0] != cuda[0] or f["cuda"] > cuda:
            return None
        py = _version_tuple(m.python, r"(\d+)\.(\d+)")
        if py is None or (py < f["python"] if f["abi3"] else py != f["python"]):
            return None
        torch = _version3(m.torch)
        if f["andhigher"]:
            if torch < f["torch"]:
                return None
            fit = 0
        elif torch == f["torch"]:
            fit = 2
        elif torch[:2] == f["torch"][:2]:
            fit = 1
        else:
            return None
        return (fit, f["post"], f["torch"])


# sha256 of each file as pinned by other installers that hashed the downloaded assets (two independent
# ones agree on the post6 files); not downloaded here (no network to GitHub). pip checks the hash, so a
# replaced file is refused, never installed.
PREBUILT_WHEELS: tuple[PrebuiltWheel, ...] = tuple(
    PrebuiltWheel("sageattention", "woct0rdho/SageAttention releases", tag, name, sha)
    for tag, name, sha in (
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu124torch2.5.1.post3-cp39-abi3-win_amd64.whl",
         "b8dc7014d4046f3ee1db774acf8a0f956e5b6620e33cec2d02ab57427e0ed31a"),
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu126torch2.6.0.post3-cp39-abi3-win_amd64.whl",
         "04cc82fbac669e3958650deea8a04843dd0dea005603c4e7241d01bdfce27ab6"),
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu128torch2.7.1.post3-cp39-abi3-win_amd64.whl",
         "7acbe7e274282e1ca9927e9e123bcdd512875492640fe55dce3c8b992506ec91"),
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu128torch2.8.0.post3-cp39-abi3-win_amd64.whl",
         "7dabcd00e63229b28f046c5a69ec37cf4756afb375dbadd1975dadec045ae21c"),
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu128torch2.9.0.post3-cp39-abi3-win_amd64.whl",
         "eb555644b49eacb26f336bbdf0701779a24c5639a620c963f48a14ab65c2c29c"),
        ("v2.2.0-windows.post3", "sageattention-2.2.0+cu130torch2.9.0.post3-cp39-abi3-win_amd64.whl",
         "5d6b5799379e3ae66ffd9acd5dcce4a7a17f4e9114a9c24d4e09b69aead20068"),
        ("v2.2.0-windows.post6", "sageattention-2.2.0+cu128torch2.9.1.post6-cp310-abi3-win_amd64.whl",
         "867862a3c582a058caf825bedeff6e36cabafe6ca954236db5544b78c626f9e9"),
        ("v2.2.0-windows.post6", "sageattention-2.2.0+cu130torch2.9.1.post6-cp310-abi3-win_amd64.whl",
         "5ee9c3fe060481f27bb001b32d8983c468c9b6b03095d84344d4cc4ec44fd74a"),
        ("v2.2.0-windows.post6", "sageattention-2.2.0+cu128torch2.10.0andhigher.post6-cp310-abi3-win_amd64.whl",
         "103e06df49486daa87c3338bf2490ada2b074da1422f2b90566a8f2f81a6b76e"),
        ("v2.2.0-windows.post6", "sageattention-2.2.0+cu130torch2.10.0andhigher.post6-cp310-abi3-win_amd64.whl",
         "1635283f5c01ec3cda58a784d0d7eabbcaffaf9511d1b263db4750e1ed7958bb"),
    )
)
PREBUILT_VERIFIED = "2026-11-23: file names and hashes recorded; none installed on real Windows hardware by this project"

# The Triton minor each torch minor requires (torch's own Requires-Dist on PyPI, read 2026-11-23 for 2.9-2.14;
# 2.6-2.8 from PyTorch's release notes). triton-windows follows Triton's version numbers.
TRITON_FOR_TORCH: dict[tuple[int, int], tuple[int, int]] = {
    (2, 6): (3, 2), (2, 7): (3, 3), (2, 8): (3, 4), (2, 9): (3, 5), (2, 10): (3, 6),
    (2, 11): (3, 6), (2, 12): (3, 7), (2, 13): (3, 7), (2, 14): (3, 8),
}


@dataclass(frozen=True)
class PinnedDist:
    """One PyPI distribution at one version, with the sha256 of every file of it this script may install (Linux x86_64
    and aarch64, CPython 3.10-3.14): pip installs it only from a file whose hash is listed (``--require-hashes``)."""

    name: str
    version: str
    files: tuple[tuple[str, str], ...]  # (file name, sha256)

    def requirement(self) -> str:
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{sha}" for _, sha in self.files)


# FlashAttention-4 and what it imports, hashes from PyPI's JSON API (read 2026-11-23). Installed with --no-deps as one
# explicit list: pip never resolves (so never reaches torch), and exactly this set is what runs. nvidia-cutlass-dsl's
# metadata requires its cu12 libraries whatever the CUDA; the set takes the libraries of torch's CUDA major only (the
# DSL loads the newest flavor the driver supports: with torch's, that is the one torch runs on). protobuf, which the
# DSL's metadata also names, is imported by none of its Python code; einops, cuda-bindings (torch >= 2.10 brings it)
# and cuda-pathfinder are added only where missing.
_PINNED_DISTS = (
    PinnedDist("flash-attn-4", "4.0.0b36", (("flash_attn_4-4.0.0b36-py3-none-any.whl",
                                  "b6f0e2a264334cb1b59289ddd309c7c76d3a8d184268316b43403e51ba8795d2"),)),
    PinnedDist("nvidia-cutlass-dsl", "4.8.1", (("nvidia_cutlass_dsl-4.8.1-py3-none-any.whl",
                                  "43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227"),)),
    PinnedDist("nvidia-cutlass-dsl-libs-core", "4.8.1", (("nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl",
                                  "bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431"),)),
    PinnedDist("nvidia-cutlass-dsl-libs-base", "4.8.1", (
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp310-cp310-manylinux_2_28_aarch64.whl", "81b8ac34569a9c5cbc78c130e1d3b41a73e7166792d45a40ebf27fb898155247"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp310-cp310-manylinux_2_28_x86_64.whl", "22643a9fc530465ef0917101d20f838f341499452af24caae8ce060fe6cc92fc"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp311-cp311-manylinux_2_28_aarch64.whl", "8d51bae072ed83cf559a8a28335d40eb40f1fef5e0511c405d9e1da6fd2b1320"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp311-cp311-manylinux_2_28_x86_64.whl", "04f60d4815d40b8588dc12bc58572923619f1b9547936195e80634a9468c0fb2"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_aarch64.whl", "c6312f8b2f1aadd959a0276daf3c4bacc05c783c6ea1119859ed4ebd3c07e3b1"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl", "ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp313-cp313-manylinux_2_28_aarch64.whl", "7bc199a0244176849b1a971cbc37fc4164f70b7121a7b426c9c42bdf2403cb19"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp313-cp313-manylinux_2_28_x86_64.whl", "334d8b219ff9504479e50ef86fadaa5695a11f21a87e5c87a75354b0d6ba10fc"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp314-cp314-manylinux_2_28_aarch64.whl", "e84b1ca6a138a4f462b40ba0554b017fbced3b6e825333512d9e1b01d6518f89"),
        ("nvidia_cutlass_dsl_libs_base-4.8.1-cp314-cp314-manylinux_2_28_x86_64.whl", "16941a44d4e8a7633dbe66d3e5b64ed4c136134bf14fd57db84cbdf57092e72b"),
    )),
    PinnedDist("nvidia-cutlass-dsl-libs-cu12", "4.8.1", (
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp310-cp310-manylinux_2_28_aarch64.whl", "bc949d4bb5158127e15b000e482a8c77006f6d7cc193368711d5c677b45a2bb5"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp310-cp310-manylinux_2_28_x86_64.whl", "df37bd90613a67a29f3d5b04dbd125dd9195b3926f6dce1b605d7edf3d8dd7c0"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp311-cp311-manylinux_2_28_aarch64.whl", "70ac0e10918387e5b1b32bb3bc08ea56556c4e500c389dc68a178c5d4e98f3df"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp311-cp311-manylinux_2_28_x86_64.whl", "dfa8be20b257bfb50a8843928277176b69a58ec3a0fcf22d7d4825f2c383ed81"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_aarch64.whl", "c89d9ff9574e94561e17be23c0c06d67fc1edb6a4bc3eb067f38a1dc1f682b6e"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl", "440b88739120c65d96c5f15bbe496a3bd7c26392874d5af6061d38497f84c70c"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp313-cp313-manylinux_2_28_aarch64.whl", "249b2947f500d13aec562bd527c99135c43b520332d982f047a86661e7c6a929"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp313-cp313-manylinux_2_28_x86_64.whl", "49d2a6413aef69b606bded3c4bc481233542b9f93cde241f8695a7ea62b4f228"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp314-cp314-manylinux_2_28_aarch64.whl", "e4d3e7c07dfe9d57f85a623853bf8f0e453ce70613079bf1e9be68da0ef07aca"),
        ("nvidia_cutlass_dsl_libs_cu12-4.8.1-cp314-cp314-manylinux_2_28_x86_64.whl", "e21d95e78c80f63c90eb00481458994906ef0f7fd1eb4ab57b23425b38d4c7a1"),
    )),
    PinnedDist("nvidia-cutlass-dsl-libs-cu13", "4.8.1", (
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp310-cp310-manylinux_2_28_aarch64.whl", "c79ab08f9e68ae70f65a3340c6ca48b9788e6bdf297a4c273d1c1fce98421716"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp310-cp310-manylinux_2_28_x86_64.whl", "f862ebf428815e2f61e3e1858f3b7813a57bb3c6eba46af4c96e23ac13cb80bd"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp311-cp311-manylinux_2_28_aarch64.whl", "0f0aa394eb2101134c44a9633bea776daf315f2fea2ab723ccc6c9114f89d7ea"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp311-cp311-manylinux_2_28_x86_64.whl", "969cdb8ecfe8c8b5181001f7f48429f7dd531d43c6609ae58ebf8c928185cf4f"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_aarch64.whl", "862378c0c51a3af2e053b363656501b06f9a54f777eee5be8c0046d780b66956"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl", "50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp313-cp313-manylinux_2_28_aarch64.whl", "d7d85ff421d83134aef05673e9a468949fefd8a7ccaf7e39011f5bffb98d9890"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp313-cp313-manylinux_2_28_x86_64.whl", "e0637fc7ec1f119cf88fc42d5007c77f76f527cb820920e47665bc193b78b0be"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp314-cp314-manylinux_2_28_aarch64.whl", "0ff2a8943e1243b9335e6d185cec841de2733f0c07f8508a5418b3bfb98460f9"),
        ("nvidia_cutlass_dsl_libs_cu13-4.8.1-cp314-cp314-manylinux_2_28_x86_64.whl", "31d7f25c91bee24a9758cd699a675269fb8a592953876029bee8c3e478f7765b"),
    )),
    PinnedDist("apache-tvm-ffi", "0.1.15.post2", (
        ("apache_tvm_ffi-0.1.15.post2-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "a63c5bad39aa22f0a81450f29613fd76d71227b3385736aa9afff00f17a32944"),
        ("apache_tvm_ffi-0.1.15.post2-cp310-cp310-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "f39ed18bdf7e0aead59050186174f1626a476897a10680a5be3f5270bd1ef968"),
        ("apache_tvm_ffi-0.1.15.post2-cp311-cp311-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "13efa12e3b81add67e40a2b5453203421af55827bd9cecc1fac56efd6e614282"),
        ("apache_tvm_ffi-0.1.15.post2-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "8ecebe749834f6ac0f2693d5964acf9ac75d0bc26e6ba64c46eb7ab00ea50fac"),
        ("apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "5c807217f134272d6e08ffdeeb9f1b2c1f366e096712b4e47b88ee9103f80113"),
        ("apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b"),
        ("apache_tvm_ffi-0.1.15.post2-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "de48c255b2753fae02b06b6ca0a30742593e46c6828938a29eafb5e2ccff430f"),
        ("apache_tvm_ffi-0.1.15.post2-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "eae72eb5bcbbddbc68d54eb6c16af860c628ca2f2b02cc4af2693e01a8186f73"),
        ("apache_tvm_ffi-0.1.15.post2-cp314-cp314-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "cdf3f10bcc698e2cf19b408fa82e708a4364648eaa6dcf8b2643da804d6fdf6a"),
        ("apache_tvm_ffi-0.1.15.post2-cp314-cp314-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "950682d8e5f088e2d4925cb03b6690a2a554e08c28b28ea721e9ca7727ff19d5"),
    )),
    PinnedDist("torch-c-dlpack-ext", "0.1.5", (
        ("torch_c_dlpack_ext-0.1.5-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "ba3d88f0f7d5e1d9c3d4a3179037fc8e261c3b77ac1fad23edc0d3a9214ef193"),
        ("torch_c_dlpack_ext-0.1.5-cp310-cp310-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "c7468df84ec152d930fbc3acf460c44a60b3462b95af3d3a676d133629c7e176"),
        ("torch_c_dlpack_ext-0.1.5-cp311-cp311-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "fba674110e1fab0b176bb5a28223e157db65c90767d4ba74abdbee9f537b0e9d"),
        ("torch_c_dlpack_ext-0.1.5-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "3448c4f0d64104d0b2e58080a7efa72304a04960c18f338024b80b13cd3eca26"),
        ("torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "3562ee411258676f9c38b8ad39306d1c8d027b6a86f6a87c920d2d009a9d1510"),
        ("torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "e6f9da4bb9af70e27facc777458be62e10dbbbddda7672d16138db0553c5a524"),
        ("torch_c_dlpack_ext-0.1.5-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "49f1e99d13c64e22dac0a34a1560e9e5a398a49a9fa81df83053e04fde6ec5bd"),
        ("torch_c_dlpack_ext-0.1.5-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "debe62e5ef93e631065d6b9f6e60d3d39bae6b89fa1b25d9523f40b3efbf8aba"),
        ("torch_c_dlpack_ext-0.1.5-cp314-cp314-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "3a58fdf45fb0bda7bc459632cec891570f31c11636d5851c825cf308ec8b73c2"),
        ("torch_c_dlpack_ext-0.1.5-cp314-cp314-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "7b985a324c68241cf83a9474b28015524b66775b12a91930dd4c0760aa628d01"),
    )),
    PinnedDist("quack-kernels", "0.6.5", (("quack_kernels-0.6.5-py3-none-any.whl",
                                  "df1ddd31366c82eb9692fe087c671209189dcbde53c909c81a865d4ee66b158d"),)),
    PinnedDist("einops", "0.8.2", (("einops-0.8.2-py3-none-any.whl",
                                  "54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193"),)),
    PinnedDist("cuda-bindings", "12.9.4", (
        ("cuda_bindings-12.9.4-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "a022c96b8bd847e8dc0675523431149a4c3e872f440e3002213dbb9e08f0331a"),
        ("cuda_bindings-12.9.4-cp310-cp310-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "4d3c842c2a4303b2a580fe955018e31aea30278be19795ae05226235268032e5"),
        ("cuda_bindings-12.9.4-cp311-cp311-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "a6a429dc6c13148ff1e27c44f40a3dd23203823e637b87fd0854205195988306"),
        ("cuda_bindings-12.9.4-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "c912a3d9e6b6651853eed8eed96d6800d69c08e94052c292fec3f282c5a817c9"),
        ("cuda_bindings-12.9.4-cp312-cp312-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "694ba35023846625ef471257e6b5a4bc8af690f961d197d77d34b1d1db393f56"),
        ("cuda_bindings-12.9.4-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "fda147a344e8eaeca0c6ff113d2851ffca8f7dfc0a6c932374ee5c47caa649c8"),
        ("cuda_bindings-12.9.4-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "cf8bfaedc238f3b115d957d1fd6562b7e8435ba57f6d0e2f87d0e7149ccb2da5"),
        ("cuda_bindings-12.9.4-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "32bdc5a76906be4c61eb98f546a6786c5773a881f3b166486449b5d141e4a39f"),
        ("cuda_bindings-12.9.4-cp314-cp314-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "1f53a7f453d4b2643d8663d036bafe29b5ba89eb904c133180f295df6dc151e5"),
        ("cuda_bindings-12.9.4-cp314-cp314-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "8b72ee72a9cc1b531db31eebaaee5c69a8ec3500e32c6933f2d3b15297b53686"),
    )),
    PinnedDist("cuda-bindings", "13.0.3", (
        ("cuda_bindings-13.0.3-cp310-cp310-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "d56e46a9e984bb754e56b9d060cf027fe99f08a97651ce6d8aa1c2032476d01e"),
        ("cuda_bindings-13.0.3-cp310-cp310-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "c5f797ce534a303525259be0ae7ee9cfcf4f7874b22f1f9b8e85555509dccb83"),
        ("cuda_bindings-13.0.3-cp311-cp311-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "dfd66c25a133365c4f93e3396c38c64b04400ccafd18c3a889ae251a1bfabaa1"),
        ("cuda_bindings-13.0.3-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "9afede5937474864aa794eb57399dbdf5d2b05427aadcac275209b0857528a61"),
        ("cuda_bindings-13.0.3-cp312-cp312-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "b899e5a513c11eaa18648f9bf5265d8de2a93f76ef66a6bfca0a2887303965cd"),
        ("cuda_bindings-13.0.3-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "cf41d9e69019939aa15296fa66ea7d3fdb8d2c6383f729f4b1156c8b37808a06"),
        ("cuda_bindings-13.0.3-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "fb16a7f769c9c67469add7a1d9f6c14dd44637f6921cb6b9eb82cb5015b35c3d"),
        ("cuda_bindings-13.0.3-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "512d0d803a5e47a8a42d5a34ce0932802bf72fe952fdb11ac798715a35c6e5cb"),
        ("cuda_bindings-13.0.3-cp314-cp314-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl", "7c7e6e89cdfc9b34f16a065cc6ad6c4bab19ce5dcef8da3ace8ad10bda899fa0"),
        ("cuda_bindings-13.0.3-cp314-cp314-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "e93866465e7ff4b7ebdf711cf9cd680499cd875f992058c68be08d4775ac233d"),
    )),
    PinnedDist("cuda-pathfinder", "1.4.2", (("cuda_pathfinder-1.4.2-py3-none-any.whl",
                                  "eb354abc20278f8609dc5b666a24648655bef5613c6dfe78a238a6fd95566754"),)),
)
PINNED_DISTS = {(d.name, d.version): d for d in _PINNED_DISTS}
_BY_NAME = {}
for _d in _PINNED_DISTS:
    _BY_NAME.setdefault(_d.name, _d)
FA4_SET = tuple(_BY_NAME[n] for n in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core",
                                      "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi", "torch-c-dlpack-ext",
                                      "quack-kernels"))
FA4_LIBS = {12: _BY_NAME["nvidia-cutlass-dsl-libs-cu12"], 13: _BY_NAME["nvidia-cutlass-dsl-libs-cu13"]}
FA4_IF_MISSING = (_BY_NAME["einops"],)
CUDA_BINDINGS = {12: PINNED_DISTS[("cuda-bindings", "12.9.4")], 13: PINNED_DISTS[("cuda-bindings", "13.0.3")]}
CUDA_PATHFINDER = _BY_NAME["cuda-pathfinder"]  # cuda-bindings 12.9/13.0 need cuda-pathfinder ~= 1.1
FA4_PYTHONS = ((3, 10), (3, 14))  # every dist of the set has a wheel for these (no free-threaded build of them all)
FA4_VERIFIED = ("2026-11-23: hashes from PyPI; the cp312 x86_64 CUDA 13 set ran flash_attn4 on the H100 (torch 2.11+cu130, "
                "which brings cuda-bindings 13); the CUDA 12 set and the added cuda-bindings not run on hardware yet")
FA4_DIST_NAMES = tuple(sorted({d.name for d in _PINNED_DISTS}))


# ============================================================ detection

@dataclass
class GPU:
    name: str
    cc: tuple[int, int]


@dataclass
class Machine:
    os: str = platform.system()
    python: str = platform.python_version()
    torch: str | None = None
    torch_cuda: str | None = None
    torch_hip: str | None = None
    gpus: list[GPU] = field(default_factory=list)
    gpu_source: str = ""  # "torch" or "nvidia-smi"
    nvcc: tuple[int, int] | None = None
    nvcc_path: str | None = None
    cuda_home: str | None = None
    gcc: tuple[int, int] | None = None
    cores: int = 1
    mem_gb: float = 8.0
    installed: dict = field(default_factory=dict)  # dist name -> version
    sage_modules: dict = field(default_factory=dict)  # "_qattn_sm90" -> bool
    pinned: dict = field(default_factory=dict)  # torch/torchvision/torchaudio -> version
    build_tools: dict = field(default_factory=lambda: {t: "?" for t in BUILD_TOOLS})  # name -> version or None
    machine: str = platform.machine().lower()  # "x86_64", "amd64", "aarch64"
    layout: str = "venv"  # "portable" (python_embeded), "desktop" (ComfyUI Desktop's .venv), "venv", "conda", "system"
    installer: str | None = "pip"  # "pip", "uv" (uv-made venvs such as Desktop's may lack pip), or None
    triton: str | None = None  # installed Triton: "3.6.0" ("triton" on Linux, "triton-windows" on Windows)
    triton_dist: str | None = None
    python_headers: bool = True  # Python.h (python_embeded has none: nothing can be compiled against it)
    gil_disabled: bool = False  # a free-threaded CPython build (3.13t/3.14t)
    msvc: bool = False  # cl.exe on PATH (Windows builds)
    comfyui_pins: dict = field(default_factory=dict)  # what the ComfyUI this pack sits in pins (its requirements.txt)

    @property
    def archs(self) -> list[tuple[int, int]]:
        return sorted({g.cc for g in self.gpus})

    @property
    def platform_tag(self) -> str:
        if self.os == "Windows":
            return "win_amd64" if self.machine in ("amd64", "x86_64") else f"win_{self.machine}"
        return f"linux_{self.machine}" if self.os == "Linux" else self.os.lower()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _run(cmd, **kw) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _version_tuple(text: str | None, pattern: str) -> tuple[int, int] | None:
    if not text:
        return None
    m = re.search(pattern, text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def find_nvcc() -> tuple[str | None, str | None]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = []
    if home:
        cands.append(os.path.join(home, "bin", "nvcc"))
    which = shutil.which("nvcc")
    if which:
        cands.append(which)
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and os.path.exists(c):
            return c, home or str(Path(c).resolve().parent.parent)
    return None, home


def detect_layout(executable: str, prefix: str, base_prefix: str, environ: dict) -> str:
    """How this Python was installed, from its paths: the ComfyUI distributions differ in what they lack."""
    exe = executable.replace("\\", "/").lower()
    if "/python_embeded/" in exe:
        return "portable"
    if environ.get("CONDA_PREFIX") and os.path.normcase(environ["CONDA_PREFIX"]) == os.path.normcase(prefix):
        return "conda"
    if prefix != base_prefix:
        root = Path(prefix)
        try:
            made_by_uv = any(line.startswith("uv =") for line in (root / "pyvenv.cfg").read_text().splitlines())
        except OSError:
            made_by_uv = False
        # ComfyUI Desktop: a uv-made .venv in its base folder, beside custom_nodes/, with ComfyUI's code elsewhere
        if root.name == ".venv" and made_by_uv and (root.parent / "custom_nodes").is_dir() and not (root.parent / "main.py").exists():
            return "desktop"
        return "venv"
    return "system"


def detect_installer(has_pip: bool, uv: str | None) -> str | None:
    return "pip" if has_pip else ("uv" if uv else None)


def comfyui_pins(here: str = os.path.dirname(os.path.abspath(__file__))) -> dict:
    """``name==version`` lines of the requirements.txt of the ComfyUI this pack is cloned into (custom_nodes/<pack>)."""
    req = Path(here).parent.parent / "requirements.txt"
    if Path(here).parent.name != "custom_nodes" or not req.exists():
        return {}
    pins = {}
    for line in req.read_text(errors="replace").splitlines():
        mt = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if mt:
            pins[mt[1].lower().replace("_", "-")] = mt[2]
    return pins


def detect() -> Machine:
    m = Machine()
    m.comfyui_pins = comfyui_pins()
    m.layout = detect_layout(sys.executable, sys.prefix, sys.base_prefix, dict(os.environ))
    m.installer = detect_installer(importlib.util.find_spec("pip") is not None, shutil.which("uv"))
    m.python_headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    m.gil_disabled = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    m.msvc = m.os == "Windows" and shutil.which("cl") is not None
    for dist in ("triton-windows", "triton"):
        v = _dist_version(dist)
        if v:
            m.triton, m.triton_dist = v, dist
            break
    m.cores = os.cpu_count() or 1
    try:
        m.mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch

        m.torch = torch.__version__
        m.torch_cuda = torch.version.cuda
        m.torch_hip = getattr(torch.version, "hip", None)
        if torch.cuda.is_available() and not m.torch_hip:
            for i in range(torch.cuda.device_count()):
                m.gpus.append(GPU(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i))))
            m.gpu_source = "torch"
    except Exception:
        pass
    if not m.gpus and not m.torch_hip:
        out = _run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        for line in (out or "").strip().splitlines():
            try:
                name, cap = [x.strip() for x in line.rsplit(",", 1)]
                a, b = cap.split(".")
                m.gpus.append(GPU(name, (int(a), int(b))))
                m.gpu_source = "nvidia-smi"
            except ValueError:
                continue
    m.nvcc_path, m.cuda_home = find_nvcc()
    if m.nvcc_path:
        m.nvcc = _version_tuple(_run([m.nvcc_path, "--version"]), r"release (\d+)\.(\d+)")
    m.gcc = _version_tuple(_run([os.environ.get("CXX", "g++"), "-dumpfullversion", "-dumpversion"]), r"(\d+)\.(\d+)")
    if m.gcc is None:
        v = _run([os.environ.get("CXX", "g++"), "-dumpversion"])
        if v and v.strip().isdigit():
            m.gcc = (int(v.strip()), 0)
    for dist in sorted({k.pip_name.split("==")[0] for k in KERNELS.values()} | set(FA4_DIST_NAMES)):
        v = _dist_version(dist)
        if v:
            m.installed[dist] = v
    for name in PINNED:
        v = _dist_version(name)
        if v:
            m.pinned[name] = v
    m.build_tools = {t: _dist_version(t) for t in BUILD_TOOLS}
    if "sageattention" in m.installed:
        m.sage_modules = _sage_modules()
    return m


def _sage_modules() -> dict:
    out = {}
    for mod in ("_qattn_sm80", "_qattn_sm89", "_qattn_sm90", "_fused"):
        try:
            out[mod] = importlib.util.find_spec(f"sageattention.{mod}") is not None
        except Exception:
            out[mod] = False
    return out


# ============================================================ planning

@dataclass
class Step:
    kernel: str
    action: str  # "build", "wheel", "ok" (already there), "skip"
    reason: str
    pip_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    fixes: list = field(default_factory=list)
    source: str | None = None
    pin: Pin | None = None  # a build from PINS (checked), or None for a source the user gave
    wheel: PrebuiltWheel | None = None  # a file from PREBUILT_WHEELS (checked)
    hashed: list = field(default_factory=list)  # PinnedDist requirement lines: installed --no-deps --require-hashes
    dists: list = field(default_factory=list)  # what the step installs (removed again if it cannot run here)
    subdir: str | None = None
    status: str = "planned"
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Fix:
    """A known build problem, patched in a copy of the source."""

    name: str
    kernel: str
    file: str
    old: str
    new: str
    why: str

    def applies(self, m: Machine) -> bool:
        if self.name == "sparge-cassert-gcc13":
            return (m.gcc or (0, 0)) >= (13, 0)
        return True

    def apply(self, root: Path) -> bool:
        p = root / self.file
        text = p.read_text()
        if self.old not in text:
            return False
        p.write_text(text.replace(self.old, self.new))
        return True


FIXES = (
    Fix(
        name="sparge-cassert-gcc13",
        kernel="spas_sage_attn",
        file="setup.py",
        old='"-Xcompiler", "-include,cassert",',
        new="",
        why="GCC >= 13 with CUDA 13: forcing <cassert> into every nvcc unit redefines std::__terminate",
    ),
    Fix(
        name="sparge-autogen-interpreter",
        kernel="spas_sage_attn",
        file="setup.py",
        old='os.system(f"python {py_file}")',
        new="os.system(f'\"{__import__(\"sys\").executable}\" \"{py_file}\"')",
        why="its kernel-instantiation generator runs `python`, which may be absent or another Python",
    ),
    Fix(
        name="sparge-autotune-tools-import",
        kernel="spas_sage_attn",
        file="spas_sage_attn/autotune.py",
        old="from tools.gpu_process import GPUProcessPoolExecutor\nexecutor = GPUProcessPoolExecutor()",
        new=("try:  # patched by Patch Attention's install.py: `tools` is a folder of the SpargeAttn repository that its\n"
             "    # package does not install; yunchang (xDiT, raylight) imports this module whenever spas_sage_attn is there\n"
             "    from tools.gpu_process import GPUProcessPoolExecutor\n"
             "    executor = GPUProcessPoolExecutor()\n"
             "except ImportError:\n"
             "    executor = None  # SpargeAttn's own multi-GPU tuning needs the repository's tools/; nothing else uses it"),
        why="spas_sage_attn.autotune imports the repository-only module tools.gpu_process, so `import yunchang` fails "
            "with No module named 'tools' once SpargeAttn is installed",
    ),
)


def arch_list(archs) -> str:
    return ";".join(f"{a}.{b}" for a, b in archs)


def toolkit_fix(m: Machine, need: tuple[int, int] | None = None) -> str:
    """The one line that says how to get a CUDA toolkit that can build for this torch (and, with ``need``, for the GPU's
    architecture): the version to install, and where to point CUDA_HOME."""
    major = m.torch_cuda.split(".")[0] if m.torch_cuda else "?"
    want = f"{need[0]}.{need[1]} or later" if need else f"{major}.x"
    return (f"fix: install the CUDA toolkit {want} (torch's CUDA is {m.torch_cuda or '?'}) and point CUDA_HOME at it, "
            "then run install.py again")


def toolkit_problem(m: Machine, archs, user_source: bool = False) -> str | None:
    """Why a CUDA extension cannot be built here, or None: checked before anything is built, each reason with its fix
    on the same line."""
    if m.os not in ("Linux", "Windows"):
        return f"building on {m.os} is not supported"
    if m.os == "Windows" and not user_source:
        return ("no build on Windows from the upstream sources (they need the Windows fork's changes); "
                "give --sage-source/--sparge-source a Windows-ready tree to build one")
    if not m.torch_cuda:
        return "this torch has no CUDA"
    if not m.nvcc:
        return "no CUDA toolkit (nvcc not found); " + toolkit_fix(m)
    torch_major = int(m.torch_cuda.split(".")[0])
    if m.nvcc[0] != torch_major:
        where = f" (found {m.nvcc_path})" if m.nvcc_path else ""
        return (f"nvcc {m.nvcc[0]}.{m.nvcc[1]}{where} does not match torch's CUDA {m.torch_cuda} (major versions must "
                "agree); " + toolkit_fix(m))
    for a in archs:
        need = NVCC_MIN_FOR_ARCH.get(a)
        if need and m.nvcc < need:
            return (f"nvcc {m.nvcc[0]}.{m.nvcc[1]} is too old for sm_{a[0]}{a[1]} (needs {need[0]}.{need[1]}); "
                    + toolkit_fix(m, need))
    if m.os == "Windows" and not m.msvc:
        return "no C++ compiler (MSVC's cl.exe is not on PATH; run from a Developer Command Prompt)"
    if m.os == "Linux" and m.gcc is None:
        return "no C++ compiler (g++) found"
    if not m.python_headers:
        return f"this Python ({m.layout}) has no headers (Python.h), so nothing can be compiled against it"
    return None


def max_jobs(m: Machine) -> int:
    # nvcc on these kernels takes ~3 GB per job at its peak
    return max(1, min(m.cores, int(m.mem_gb // 3)))


def _wants(key: str, only, skip) -> bool:
    if KERNELS[key].part_of:
        return False  # its package is the other entry's step
    if only:
        return key in only
    if key in skip:
        return False
    return KERNELS[key].default


def pick_wheel(key: str, m: Machine) -> PrebuiltWheel | None:
    """The best file of PREBUILT_WHEELS for this machine, or None."""
    ranked = [(w.rank(m), w) for w in PREBUILT_WHEELS if w.kernel == key]
    ranked = [(r, w) for r, w in ranked if r is not None]
    return max(ranked, key=lambda rw: rw[0])[1] if ranked else None


def triton_need(m: Machine) -> tuple[str | None, str]:
    """(pip requirement or None, why): the Triton this torch needs, when it is missing or another minor."""
    want = TRITON_FOR_TORCH.get(_torch_tuple(m.torch))
    dist = "triton-windows" if m.os == "Windows" else "triton"
    if want is None:
        return None, f"no known {dist} pairing for torch {m.torch} (TRITON_FOR_TORCH in install.py)"
    have = _version_tuple(m.triton, r"(\d+)\.(\d+)") if m.triton else None
    if have == want and m.triton_dist == dist:
        return None, f"{m.triton_dist} {m.triton} matches torch {m.torch}"
    spec = f"{dist}>={want[0]}.{want[1]},<{want[0]}.{want[1] + 1}"
    if m.triton is None:
        return spec, f"torch {m.torch} needs Triton {want[0]}.{want[1]}; none is installed"
    return spec, f"torch {m.torch} needs Triton {want[0]}.{want[1]}; {m.triton_dist} {m.triton} is installed"


def _known_bad_here(m: Machine) -> list:
    return [kb for kb in CAPS.KNOWN_BAD if any(a in kb.archs for a in m.archs)]


def plan(m: Machine, *, only=(), skip=(), sources=None, force=False) -> list[Step]:
    sources = sources or {}
    only, skip = set(only), set(skip)
    unknown = (only | skip) - set(KERNELS)
    if unknown:
        raise SystemExit(f"unknown kernel(s): {', '.join(sorted(unknown))}; known: {', '.join(KERNELS)}")
    steps: list[Step] = []
    if m.torch is None:
        return [Step("*", "skip", "torch is not installed in this Python; run with ComfyUI's Python")]
    if m.torch_hip:
        return [Step("*", "skip", f"ROCm torch ({m.torch_hip}): these kernels are CUDA-only; PyTorch SDPA stays in use")]
    if not m.gpus:
        return [Step("*", "skip", "no NVIDIA GPU found (torch and nvidia-smi see none): nothing to build, PyTorch SDPA is used")]
    if m.installer is None:
        return [Step("*", "skip", f"neither pip nor uv can install into this Python ({m.layout}); "
                     "install pip (python -m ensurepip) or uv")]

    tk_reason = None
    sage2 = False  # SageAttention 2 is there or planned
    for key, k in KERNELS.items():  # the table's order
        if not _wants(key, only, skip):
            continue
        if key == "flash_attn4":
            steps.append(fa4_step(m, force))
            continue
        archs = [a for a in m.archs if k.runs_on(a)]
        dist = k.pip_name.split("==")[0]
        if not archs:
            steps.append(Step(key, "skip", f"needs {k.describe_arch()}; GPUs here: {describe_gpus(m)}"))
            continue
        if k.source == "build":
            have = m.installed.get(dist)
            lacking = ""  # an installed SageAttention 2 without a module this GPU needs: said when it cannot be redone
            if key == "sageattention" and have and have.startswith("2") and not force:
                need = {"_qattn_sm80"} | ({"_qattn_sm89"} if any(a >= (8, 9) for a in archs) else set())
                need |= {"_qattn_sm90"} if (9, 0) in archs else set()
                missing = [x for x in sorted(need) if not m.sage_modules.get(x)]
                if not missing:
                    steps.append(Step(key, "ok", f"sageattention {have} with {', '.join(sorted(need))}"))
                    sage2 = True
                    continue
                lacking = f"sageattention {have} lacks {', '.join(missing)}; cannot rebuild: "
            elif have and key != "sageattention" and not force:
                steps.append(Step(key, "ok", f"{dist} {have} already installed"))
                continue
            wheel = None if key in sources else pick_wheel(key, m)
            if wheel:
                steps.append(Step(key, "wheel", f"prebuilt {wheel.filename} from {wheel.index} (sha256-checked)", wheel=wheel))
                sage2 = sage2 or key == "sageattention"
                continue
            tk_reason = toolkit_problem(m, archs, user_source=key in sources)
            if tk_reason:
                steps.append(Step(key, "skip", lacking + tk_reason
                                  + ("" if m.os == "Linux" else "; no prebuilt wheel for this torch/CUDA")))
                continue
            env = {"TORCH_CUDA_ARCH_LIST": arch_list(archs), "MAX_JOBS": str(max_jobs(m))}
            if m.cuda_home:
                env["CUDA_HOME"] = m.cuda_home
            pin = None if key in sources else PINS[key]
            steps.append(
                Step(
                    key, "build", f"build from source for {arch_list(archs)}",
                    env=env, fixes=[f for f in FIXES if f.kernel == key and f.applies(m)],
                    source=sources.get(key) or pin.url, pin=pin,
                    subdir="sageattention3_blackwell" if key == "sageattn3" else None,
                )
            )
            sage2 = sage2 or key == "sageattention"
            continue
        # wheels from PyPI
        if key == "sageattention1":
            if sage2:
                continue  # 2.x covers it; 1.0.6 would replace it (same module name)
            have = m.installed.get("sageattention")
            if have and not force:
                steps.append(Step(key, "ok", f"sageattention {have} already installed"))
                continue
            why = tk_reason or "SageAttention 2 not selected"
            steps.append(Step(key, "wheel", f"Triton build from PyPI ({why})", pip_args=[k.pip_name]))
            continue
        have = m.installed.get(dist)
        pin = m.comfyui_pins.get(dist) if key == "comfy_kitchen" else None
        if key == "comfy_kitchen" and (have or pin):
            # ComfyUI >= 0.33 pins comfy-kitchen: that version is kept, whatever it lacks (sol_attn from 0.2.40 on)
            sol = "" if _version3(have or pin) >= (0, 2, 40) else "; kitchen_sol needs >= 0.2.40 (not upgraded)"
            if have:
                steps.append(Step(key, "ok", f"{dist} {have} already installed{' (pinned by ComfyUI)' if pin else ''}{sol}"))
            else:
                steps.append(Step(key, "wheel", f"the version ComfyUI pins{sol}", pip_args=[f"{dist}=={pin}"]))
            continue
        if have and not force:
            steps.append(Step(key, "ok", f"{dist} {have} already installed"))
            continue
        if key == "comfy_kitchen" and _torch_tuple(m.torch) < (2, 10):
            steps.append(Step(key, "skip", f"comfy-kitchen needs torch >= 2.10, this is {m.torch}"))
            continue
        if key == "xformers" and _torch_tuple(m.torch) < (2, 10):
            steps.append(Step(key, "skip", f"xformers wheels on PyPI need torch >= 2.10, this is {m.torch}"))
            continue
        steps.append(Step(key, "wheel", "prebuilt wheel matching the pinned torch", pip_args=["--only-binary=:all:", k.pip_name]))

    # Triton: what the Sage/Sparge kernels import. Torch brings it on Linux; on Windows it is the triton-windows
    # wheel of the same minor as torch's pairing (another minor is what breaks there).
    tritoned = [s for s in steps if s.action in ("wheel", "build", "ok") and KERNELS.get(s.kernel) and KERNELS[s.kernel].needs_triton]
    if tritoned:
        spec, why = triton_need(m)
        if spec:
            steps.insert(0, Step("triton", "wheel", why, pip_args=[spec]))
        elif _torch_tuple(m.torch) not in TRITON_FOR_TORCH:
            for s in tritoned:
                if s.action != "ok":
                    s.action, s.reason = "skip", f"needs Triton: {why}"
    if any(s.action == "build" for s in steps):
        missing = [t for t, v in m.build_tools.items() if not v]
        if missing:
            steps.insert(0, Step("build-tools", "wheel", "needed to compile: " + ", ".join(missing), pip_args=missing))
    for kb in _known_bad_here(m):
        if any(KERNELS[s.kernel].backends and set(KERNELS[s.kernel].backends) & set(kb.backends)
               for s in steps if s.kernel in KERNELS and s.action in ("wheel", "build", "ok")):
            steps.append(Step(", ".join(kb.backends), "note", "not offered here: " + kb.describe()))
    return steps


def fa4_problem(m: Machine) -> str | None:
    """Why the pinned FlashAttention-4 set cannot run here (platform, Python, torch, GPU), or None."""
    k = KERNELS["flash_attn4"]
    if m.os == "Windows":
        return "FlashAttention-4 runs on Linux only (it imports fcntl, which Windows lacks)"
    if m.os != "Linux":
        return f"FlashAttention-4's wheels are for Linux, this is {m.os}"
    if m.machine not in ("x86_64", "aarch64"):
        return f"the CuTe DSL's wheels are for x86_64 and aarch64, this is {m.machine}"
    py = _version_tuple(m.python, r"(\d+)\.(\d+)") or (0, 0)
    lo, hi = FA4_PYTHONS
    if not lo <= py <= hi:
        return f"the pinned wheels are for CPython {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, this is {m.python}"
    if m.gil_disabled:
        return "no wheels of the set for a free-threaded Python (torch-c-dlpack-ext has none)"
    archs = [a for a in m.archs if k.runs_on(a)]
    if not archs:
        return f"needs {k.describe_arch()} (its Hopper and Blackwell kernels); GPUs here: {describe_gpus(m)}"
    major = int((m.torch_cuda or "0").split(".")[0])
    if major not in FA4_LIBS:
        return f"the CuTe DSL's libraries exist for CUDA 12 and 13, this torch has CUDA {m.torch_cuda or '-'}"
    if _torch_tuple(m.torch) < (2, 4):
        return f"torch {m.torch}: torch-c-dlpack-ext, which FlashAttention-4 uses, supports torch >= 2.4"
    return None


def fa4_step(m: Machine, force: bool) -> Step:
    """The FlashAttention-4 step: the pinned set for torch's CUDA major, or what of it is missing; never torch."""
    why = fa4_problem(m)
    if why:
        return Step("flash_attn4", "skip", why)
    major = int(m.torch_cuda.split(".")[0])
    want = [*FA4_SET, FA4_LIBS[major]]
    extra = [d for d in FA4_IF_MISSING if d.name not in m.installed]
    if "cuda-bindings" not in m.installed:
        extra.append(CUDA_BINDINGS[major])
        if "cuda-pathfinder" not in m.installed:
            extra.append(CUDA_PATHFINDER)
    have = m.installed.get("flash-attn-4")
    if have and not force:
        todo = [d for d in want if d.name not in m.installed] + extra
        if not todo:
            return Step("flash_attn4", "ok", f"flash-attn-4 {have} already installed "
                                             f"(CuTe DSL {m.installed.get('nvidia-cutlass-dsl', '?')})")
        reason = f"flash-attn-4 {have} is installed without {', '.join(d.name for d in todo)}: adding the pinned ones"
    else:
        todo = want + extra
        reason = (f"pinned wheels from PyPI, sha256-checked, --no-deps: flash-attn-4 {FA4_SET[0].version} with the CuTe "
                  f"DSL's CUDA {major} libraries")
    replaced = [f"{d.name} {m.installed[d.name]} -> {d.version}" for d in todo
                if d.name in m.installed and m.installed[d.name] != d.version]
    if replaced:
        reason += "; replaces " + ", ".join(replaced)
    bindings = m.installed.get("cuda-bindings")
    if bindings and _version3(bindings)[0] > major:  # the DSL refuses to start on a driver older than its bindings' CUDA
        reason += f" (cuda-bindings {bindings} is installed: the CuTe DSL then needs a CUDA {_version3(bindings)[0]} driver)"
    return Step("flash_attn4", "wheel", reason, hashed=[d.requirement() for d in todo],
                dists=[f"{d.name}=={d.version}" for d in todo])


def _torch_tuple(v: str) -> tuple[int, int]:
    return _version_tuple(v, r"(\d+)\.(\d+)") or (0, 0)


def _version3(v: str | None) -> tuple[int, int, int]:
    mt = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v or "")
    return (int(mt[1]), int(mt[2]), int(mt[3] or 0)) if mt else (0, 0, 0)


_KERNEL_DISTS = {k.pip_name.split("==")[0] for k in KERNELS.values()}


def describe_gpus(m: Machine) -> str:
    return ", ".join(f"{g.name} (sm {g.cc[0]}.{g.cc[1]}, {CAPS.arch_name(g.cc)})" for g in m.gpus) or "none"


def render_plan(m: Machine, steps: list[Step]) -> str:
    lines = [
        f"Python {m.python} on {m.os} ({m.layout}, installs with {m.installer or 'nothing'}); torch {m.torch or '-'}"
        + (f" (CUDA {m.torch_cuda})" if m.torch_cuda else "")
        + (f" (ROCm {m.torch_hip})" if m.torch_hip else "")
        + (f"; {m.triton_dist} {m.triton}" if m.triton else "; no Triton"),
        f"GPUs: {describe_gpus(m)}" + (f" [via {m.gpu_source}]" if m.gpu_source else ""),
        f"nvcc: {'%d.%d' % m.nvcc if m.nvcc else '-'} ({m.nvcc_path or 'not found'}); "
        f"g++: {'%d.%d' % m.gcc if m.gcc else '-'}; {m.cores} cores, {m.mem_gb:.0f} GB",
        "installed: " + (", ".join(f"{k} {v}" for k, v in sorted(m.installed.items()) if k in _KERNEL_DISTS)
                         or "none of the kernels"),
        "pinned: " + (", ".join(f"{k}=={v}" for k, v in m.pinned.items()) or "-"),
        "",
        "plan:",
    ]
    for s in steps:
        extra = ""
        if s.action == "build":
            src = s.pin.describe() if s.pin else f"{s.source} (given; not checked)"
            extra = f"  [{' '.join(f'{k}={v}' for k, v in s.env.items() if k != 'CUDA_HOME')}; source {src}]"
            for f in s.fixes:
                extra += f"\n      fix {f.name}: {f.why}"
        if s.dists and s.action == "wheel":
            extra = "\n      " + ", ".join(s.dists)
        lines.append(f"  {s.kernel:<16} {s.action:<6} {s.reason}{extra}")
    todo = [s for s in steps if s.action in ("build", "wheel")]
    if not todo:
        lines.append("nothing to install: " + ("everything planned is already there" if any(s.action == "ok" for s in steps) else "see the reasons above"))
    return "\n".join(lines)


# ============================================================ execution

class Installer:
    def __init__(self, m: Machine, log_dir: Path, pip_extra=(), quiet=False):
        self.m = m
        self.log_dir = log_dir
        self.pip_extra = list(pip_extra)
        self.quiet = quiet
        log_dir.mkdir(parents=True, exist_ok=True)
        self.constraints = log_dir / "torch-pins.txt"
        self.constraints.write_text("".join(f"{k}=={v}\n" for k, v in m.pinned.items()))

    def installer_cmd(self, verb: str) -> list[str]:
        """``pip <verb>`` for this Python: its own pip, or uv aimed at it (uv-made venvs may have no pip)."""
        if self.m.installer == "uv":
            return [shutil.which("uv") or "uv", "pip", verb, "--python", sys.executable]
        return [sys.executable, "-m", "pip", verb]

    def pip(self, args, log: Path, env=None, position=0) -> int:
        cmd = [*self.installer_cmd("install"), "--constraint", str(self.constraints), *self.pip_extra, *args]
        return self._stream(cmd, log, env=env, position=position)

    def uninstall(self, names) -> None:
        subprocess.run([*self.installer_cmd("uninstall"), *([] if self.m.installer == "uv" else ["-y"]), *names],
                       capture_output=True)

    def _stream(self, cmd, log: Path, env=None, position=0) -> int:
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PIP_CONSTRAINT"] = str(self.constraints)
        bar = _progress(log.stem, self.quiet, position)
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
            for line in proc.stdout:
                f.write(line)
                bar(line)
            rc = proc.wait()
        bar(None)
        return rc

    def torch_moved(self) -> str | None:
        code = "import json\nfrom importlib import metadata as m\nout={}\nfor n in %r:\n try: out[n]=m.version(n)\n except Exception: pass\nprint(json.dumps(out))" % (PINNED,)
        out = _run([sys.executable, "-c", code])
        now = json.loads(out) if out else {}
        moved = [f"{k} {v} -> {now.get(k)}" for k, v in self.m.pinned.items() if now.get(k) != v]
        return "; ".join(moved) or None

    def installed_now(self) -> set[str]:
        out = _run([sys.executable, "-m", "pip", "list", "--format=json"])
        try:
            return {d["name"].lower() for d in json.loads(out or "[]")}
        except ValueError:
            return set()

    def run_all(self, steps: list[Step]) -> None:
        """Wheels one by one, then every build at once (each compile is mostly one long nvcc unit)."""
        for s in steps:
            if s.action == "wheel":
                self._guarded([s])
        builds = [s for s in steps if s.action == "build"]
        if builds:
            self._guarded(builds)

    def _guarded(self, group: list[Step]) -> None:
        before = self.installed_now()
        if len(group) == 1:
            self._one(group[0], 0)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(group)) as ex:
                list(ex.map(self._one, group, range(len(group))))
        moved = self.torch_moved()
        if moved:
            new = sorted(self.installed_now() - before)
            if new:
                self.uninstall(new)
            for s in group:
                s.status, s.detail = "failed", f"torch moved ({moved}); removed {', '.join(new) or 'nothing'}"

    def _one(self, s: Step, position: int) -> None:
        log = self.log_dir / f"{s.kernel}.log"
        log.write_text("")
        print(f"== {s.kernel}: {s.action} ({s.reason}); log {log}", flush=True)
        t0 = time.time()
        if s.action == "wheel" and s.wheel:
            rc = self.install_prebuilt(s.wheel, log, position)
        elif s.action == "wheel" and s.hashed:
            rc = self.install_hashed(s, log, position)
        elif s.action == "wheel":
            rc = self.pip(s.pip_args, log, position=position)
        else:
            rc = self.build(s, log, position)
        s.seconds = time.time() - t0
        if rc != 0:
            s.status = "failed"
            what = "build" if s.action == "build" else "pip"
            s.detail = f"{what} failed (exit {rc}) after {s.seconds:.0f} s; {likely_cause(log.read_text())}; log: {log}"
            if not self.quiet:
                print(f"--- last lines of {log} ---\n" + "\n".join(log.read_text().splitlines()[-25:]), flush=True)
        else:
            s.status, s.detail = "installed", f"{s.seconds:.0f} s"
        print(f"== {s.kernel}: {s.status} {s.detail}", flush=True)

    def install_hashed(self, s: Step, log: Path, position=0) -> int:
        """A step's pinned distributions, from files whose sha256 is listed, without resolving dependencies."""
        req = self.log_dir / f"{s.kernel}-requirements.txt"
        req.write_text("".join(line + "\n" for line in s.hashed))
        return self.pip(["--no-deps", "--only-binary=:all:", "--require-hashes", "-r", str(req)], log, position=position)

    def roll_back_unusable(self, steps: list[Step], rows: list[dict]) -> None:
        """A wheel that installed but whose backends cannot run here (built for another torch) is removed."""
        by_name = {r["backend"]: r for r in rows}
        for s in steps:
            if s.action != "wheel" or s.status != "installed" or s.kernel not in KERNELS:
                continue
            names = KERNELS[s.kernel].backends
            mine = [by_name[n] for n in names if n in by_name]
            if mine and not any(r["status"] == "ok" for r in mine):
                self.uninstall([d.split("==")[0] for d in s.dists] or [KERNELS[s.kernel].pip_name.split("==")[0]])
                why = mine[0]["detail"]
                s.status, s.detail = "removed", f"installed but cannot run here ({why}); uninstalled"

    def install_prebuilt(self, w: PrebuiltWheel, log: Path, position=0) -> int:
        dest = self.log_dir / "downloads" / w.filename
        try:
            download(w.url, dest, sha256=w.sha256)
        except DownloadError as e:
            with open(log, "a") as f:
                f.write(f"download failed: {e}\n")
            return 1
        # --no-deps: these wheels name torch as a dependency; the torch that is here is the one they were picked for
        return self.pip(["--no-deps", str(dest)], log, position=position)

    def build(self, s: Step, log: Path, position=0) -> int:
        work = Path(tempfile.mkdtemp(prefix=f"pa-build-{s.kernel}-"))
        src = fetch_pinned(s.pin, work / "src", log) if s.pin else fetch_source(s.source, work / "src", log)
        if src is None:
            return 1
        root = src / s.subdir if s.subdir else src
        with open(log, "a") as f:
            for fix in s.fixes:
                ok = fix.apply(root)
                f.write(f"fix {fix.name}: {'applied' if ok else 'not needed (pattern absent)'}\n")
        return self.pip(["--no-build-isolation", "--no-deps", "-v", str(root)], log, env=s.env, position=position)


class DownloadError(Exception):
    pass


def download(url: str, dest: Path, *, sha256: str | None = None, mirror: str | None = None) -> Path:
    """Every download of this script goes through here. With a mirror folder (``--mirror`` or
    ``PATCH_ATTENTION_MIRROR``) the file is taken from ``<mirror>/<file name>`` instead of the network.
    A given sha256 is checked; a mismatch deletes the file and raises."""
    mirror = mirror or os.environ.get("PATCH_ATTENTION_MIRROR")
    name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        if mirror:
            src = Path(mirror) / name
            if not src.is_file():
                raise DownloadError(f"{name} is not in the mirror folder {mirror}")
            shutil.copyfile(src, tmp)
        else:
            req = urllib.request.Request(url, headers={"User-Agent": "patch-attention-install"})
            with urllib.request.urlopen(req, timeout=60) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DownloadError(f"cannot download {url}: {e}") from e
    if sha256:
        got = file_sha256(tmp)
        if got != sha256:
            tmp.unlink(missing_ok=True)
            raise DownloadError(f"sha256 mismatch for {name}: expected {sha256}, got {got} (file replaced upstream?)")
    tmp.replace(dest)
    return dest


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path, skip=()) -> str:
    """sha256 over (path, sha256 of content) of every file under ``root``, paths sorted as strings; files under
    a ``skip`` prefix are left out. The same for a git checkout, a GitHub archive or a trimmed copy of it."""
    h = hashlib.sha256()
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    for rel in rels:
        if rel.startswith(tuple(skip)) or rel.startswith(".git/"):
            continue
        h.update(rel.encode() + b"\0" + file_sha256(root / rel).encode() + b"\n")
    return h.hexdigest()


def fetch_pinned(pin: Pin, dest: Path, log: Path) -> Path | None:
    """The pinned commit's archive, unpacked into ``dest`` and checked against ``pin.tree_sha256``."""
    archive = dest.parent / f"{pin.repo.replace('/', '-')}-{pin.commit}.tar.gz"
    with open(log, "a") as f:
        try:
            download(pin.url, archive)
        except DownloadError as e:
            f.write(f"{e}\n")
            return None
        root = fetch_source(str(archive), dest, log)
        got = tree_digest(root, pin.skip) if root else None
        if got != pin.tree_sha256:
            f.write(f"source tree sha256 mismatch for {pin.repo}@{pin.commit}: expected {pin.tree_sha256}, got {got}\n")
            return None
        f.write(f"source {pin.repo}@{pin.commit}: tree sha256 {got} matches the pin\n")
    return root


def fetch_source(source: str, dest: Path, log: Path) -> Path | None:
    """Copy a local source tree (or archive), or clone a git URL, into ``dest``."""
    p = Path(os.path.expanduser(source))
    if p.exists():
        if p.is_dir():
            shutil.copytree(p, dest, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "assets"))
            return dest
        shutil.unpack_archive(str(p), str(dest))
        kids = [c for c in dest.iterdir() if c.is_dir()]
        return kids[0] if len(kids) == 1 and not (dest / "setup.py").exists() else dest
    if re.match(r"^(https?|git|ssh)://|^git@", source):
        with open(log, "a") as f:
            rc = subprocess.run(["git", "clone", "--depth", "1", source, str(dest)], stdout=f, stderr=subprocess.STDOUT).returncode
        return dest if rc == 0 else None
    with open(log, "a") as f:
        f.write(f"source {source!r} is neither a path nor a git URL\n")
    return None


CAUSES = (  # first match wins: a missing network explains "no matching distribution" too
    (r"Temporary failure in name resolution|Network is unreachable|Failed to establish a new connection|Could not resolve host"
     r"|cannot download .*(Errno|urlopen)",
     "no network: use --mirror DIR for pinned sources and wheels, --find-links DIR --no-index for PyPI wheels"),
    (r"redefinition of .*__terminate", "GCC >= 13 with CUDA 13 and '-include cassert' (the sparge-cassert-gcc13 fix)"),
    (r"nvcc.*not found|No CUDA runtime is found|CUDA_HOME environment variable is not set", "no CUDA toolkit: install it or set CUDA_HOME"),
    (r"The detected CUDA version \(.*\) mismatches", "nvcc and torch's CUDA differ: install the toolkit matching torch"),
    (r"Killed|out of memory|std::bad_alloc", "the compiler ran out of memory: set MAX_JOBS lower"),
    (r"No matching distribution|Could not find a version", "no wheel for this Python/torch/platform"),
    (r"Cannot install .* because these package versions have conflicting|ResolutionImpossible", "it would need another torch (the pins refused it)"),
    (r"unsupported GNU version", "host compiler too new for this nvcc: set CC/CXX to an older gcc"),
    (r"source .* is neither a path nor a git URL", "the source given is neither a local path nor a git URL"),
    (r"sha256 mismatch|DO NOT MATCH THE HASHES", "a download does not match its pinned hash: refused (see the log for both hashes)"),
    (r"is not in the mirror folder", "the --mirror folder lacks a file (its name is in the log)"),
)


def likely_cause(text: str) -> str:
    for pat, cause in CAUSES:
        if re.search(pat, text):
            return "likely cause: " + cause
    return "see the log"


NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")
HEARTBEAT_S = 15.0  # a captured log (ComfyUI Manager runs install.py without a terminal) gets a line at least this often


class Heartbeat:
    """Plain progress lines for a log that is not a terminal: every ``interval`` seconds while a step runs, what it is
    at (ninja's ``[i/n]`` and the file it compiles, or pip's last line), however long the compiler stays silent."""

    def __init__(self, name: str, interval: float | None = None, out=None, clock=time.monotonic):
        import threading

        self.name, self.out, self.clock = name, out or sys.stdout, clock
        self.interval = HEARTBEAT_S if interval is None else interval
        self.t0 = clock()
        self.step = self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def line(self) -> str:
        s = int(self.clock() - self.t0)
        took = f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"
        if self.step:
            i, n, what = self.step
            at = f"compiling {i} of {n}" + (f" ({what})" if what else "")
        elif self.last:
            at = "last output: " + (self.last if len(self.last) <= 100 else self.last[:97] + "...")
        else:
            at = "started"
        return f"  {self.name}: {took}, {at}"

    def _run(self):
        while not self._stop.wait(self.interval):
            print(self.line(), file=self.out, flush=True)

    def __call__(self, line):
        if line is None:
            self._stop.set()
            self._thread.join()
            return
        line = line.strip()
        if not line:
            return
        mt = NINJA_STEP.match(line)
        if mt:
            src = re.search(r"-c\s+(\S+\.(?:cu|cpp|cc|c))\b", line)
            self.step = (int(mt.group(1)), int(mt.group(2)), os.path.basename(src.group(1)) if src else "")
        self.last = line


def _progress(name: str, quiet: bool, position: int = 0):
    """What a running step reports: in a terminal a tqdm bar fed with ninja's ``[i/n]`` lines; in a captured log
    (no terminal) a plain line at least every HEARTBEAT_S seconds (:class:`Heartbeat`)."""
    if quiet:
        return lambda line: None
    if not sys.stdout.isatty():
        return Heartbeat(name)
    try:
        from tqdm import tqdm
    except ImportError:
        return Heartbeat(name)
    bar = tqdm(desc=name, unit="step", leave=True, dynamic_ncols=True, position=position, mininterval=2)

    def feed(line):
        if line is None:
            bar.close()
            return
        mt = NINJA_STEP.match(line)
        if mt:
            bar.total = int(mt.group(2))
            bar.n = int(mt.group(1))
            bar.refresh()

    return feed


# ============================================================ verification

VERIFY_CODE = r"""
import json, sys
sys.path.insert(0, {root!r})
import torch
from attention import REGISTRY, AttentionConfig, attention
rows = []
dev = torch.device("cuda")
q, k, v = (torch.randn(1, 256, 4 * 64, device=dev, dtype=torch.float16) for _ in range(3))
ref = attention(q.float(), k.float(), v.float(), 4, config=AttentionConfig(backend="sdpa"))
for b in REGISTRY.backends():
    av = b.availability()
    row = {{"backend": b.name, "family": b.family, "version": av.version, "installed": av.ok}}
    if av.ok:
        cfg = AttentionConfig(backend=b.name, allow_fallback=False)
        try:
            out = attention(q, k, v, 4, config=cfg)
            cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
            acc = b.accuracy_class  # the backend's declared class (random inputs: topk keeps no bound on them)
            bound = min(acc.min_cos, 0.99)
            row.update(status="ok" if cos >= bound else "WRONG",
                       detail=f"cos {{cos:.5f}} vs SDPA ({{acc.name}}" + (f": >= {{bound}})" if bound > -1 else ": no bound)"))
        except Exception as e:
            row.update(status="unusable", detail=f"{{type(e).__name__}}: {{str(e).splitlines()[0][:120]}}")
    else:
        row.update(status="absent", detail=av.reason[:120])
    rows.append(row)
try:  # what yunchang (xDiT, raylight) imports whenever SpargeAttn is installed
    import importlib.util
    if importlib.util.find_spec("spas_sage_attn") is not None:
        import spas_sage_attn.autotune  # noqa: F401
        rows.append({{"backend": "spas_sage_attn.autotune", "family": "neighbour", "version": "", "installed": True,
                     "status": "ok", "detail": "imports (yunchang needs it)"}})
except Exception as e:
    rows.append({{"backend": "spas_sage_attn.autotune", "family": "neighbour", "version": "", "installed": True,
                 "status": "broken", "detail": f"{{type(e).__name__}}: {{e}} (breaks `import yunchang`)"}})
print("JSON:" + json.dumps(rows))
"""


def verify() -> list[dict]:
    out = _run([sys.executable, "-c", VERIFY_CODE.format(root=str(HERE))])
    for line in (out or "").splitlines():
        if line.startswith("JSON:"):
            return json.loads(line[5:])
    return []


# ============================================================ main

def parse(argv=None):
    p = argparse.ArgumentParser(description="Install the attention kernels this GPU can run (torch stays as it is).")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--yes", "-y", action="store_true", help="no questions (ComfyUI Manager runs it so)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--only", default="", help="comma-separated kernels: " + ", ".join(KERNELS))
    p.add_argument("--skip", default="", help="comma-separated kernels not to install")
    p.add_argument("--with", dest="with_", default="", help="add optional wheels: " + ", ".join(CAPS.optional_set()))
    p.add_argument("--sage-source", help="SageAttention source: a local path, archive or git URL")
    p.add_argument("--sparge-source", help="SpargeAttn source: a local path, archive or git URL")
    p.add_argument("--force", action="store_true", help="reinstall what is already there")
    p.add_argument("--no-verify", action="store_true", help="skip the GPU check after installing")
    p.add_argument("--log-dir", default=str(HERE / ".build" / "logs"))
    p.add_argument("--find-links", action="append", default=[], help="passed to pip (offline wheels)")
    p.add_argument("--no-index", action="store_true", help="passed to pip")
    p.add_argument("--mirror", help="take pinned sources and prebuilt wheels from this folder (by file name), not the network")
    p.add_argument("--sources", action="store_true", help="print where each kernel comes from (pins, wheel indexes) and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.sources:
        print(render_sources())
        return 0
    if a.mirror:
        os.environ["PATCH_ATTENTION_MIRROR"] = os.path.abspath(a.mirror)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    only = split(a.only)
    named = set(only) | set(split(a.with_))  # kernels the user asked for by name
    if a.with_:
        only = (only or list(CAPS.default_set())) + split(a.with_)
    m = detect()
    sources = {}
    if a.sage_source:
        sources["sageattention"] = sources["sageattn3"] = a.sage_source
    if a.sparge_source:
        sources["spas_sage_attn"] = a.sparge_source
    steps = plan(m, only=only, skip=split(a.skip), sources=sources, force=a.force)
    todo = [s for s in steps if s.action in ("build", "wheel")]
    if a.json and a.dry_run:
        print(json.dumps({"machine": m.to_json(), "plan": [_step_json(s) for s in steps]}, indent=1, default=str))
        return 0
    print(render_plan(m, steps), flush=True)
    # Exit non-zero only for what the user asked for by name (--only/--with/--*-source): a default run that cannot add
    # a kernel leaves the pack working on SDPA.
    asked = named | set(sources)
    ready = {s.kernel for s in steps if s.action in ("ok", "build", "wheel")}
    # --sage-source asks for SageAttention 2 (its tree also holds SageAttention3, built only where a GPU takes it)
    refused = sorted((named | {k for k, v in (("sageattention", a.sage_source), ("spas_sage_attn", a.sparge_source)) if v})
                     - ready)
    if refused and not a.dry_run:
        print(f"cannot install what was asked for: {', '.join(refused)} (the plan above says why)")
    if a.dry_run:
        return 0
    if not todo:
        return 1 if refused else 0
    if not a.yes and sys.stdin.isatty():
        if input("go ahead? [y/N] ").strip().lower() not in ("y", "yes"):
            return 1
    pip_extra = [f"--find-links={x}" for x in a.find_links] + (["--no-index"] if a.no_index else [])
    inst = Installer(m, Path(a.log_dir), pip_extra=pip_extra, quiet=a.json)
    inst.run_all(todo)
    rows = [] if a.no_verify else verify()
    inst.roll_back_unusable(todo, rows)
    failed = [s for s in todo if s.status != "installed"]
    if a.json:
        print(json.dumps({"plan": [_step_json(s) for s in steps], "verify": rows}, indent=1, default=str))
    else:
        print("\nkernel            status     detail")
        for s in steps:
            print(f"  {s.kernel:<16} {s.status if s.action in ('build', 'wheel') else s.action:<10} {s.detail or s.reason}")
        if rows:
            print("\nbackend                 version          status     detail")
            for r in rows:
                print(f"  {r['backend']:<22} {r['version'] or '-':<16} {r['status']:<10} {r['detail']}")
    if failed and not asked:
        print("some kernels could not be installed; the pack still works with what is there (see above)")
    return 1 if refused or any(s.kernel in asked for s in failed) else 0


def _step_json(s: Step) -> dict:
    d = dataclasses.asdict(s)
    d["fixes"] = [f.name for f in s.fixes]
    d["wheel"] = {"file": s.wheel.filename, "url": s.wheel.url, "sha256": s.wheel.sha256} if s.wheel else None
    d["pin"] = {"repo": s.pin.repo, "commit": s.pin.commit, "tree_sha256": s.pin.tree_sha256} if s.pin else None
    return d


def render_sources() -> str:
    lines = ["pinned sources (built where a CUDA toolkit can):"]
    for key, p in PINS.items():
        lines.append(f"  {key:<16} {p.repo}@{p.commit}  tree sha256 {p.tree_sha256[:16]}...  verified {p.verified}")
    lines.append("\nwheel indexes:")
    for ix in WHEEL_INDEXES:
        lines.append(f"  {ix.name} ({ix.platforms}) {ix.url}\n      covers: {ix.covers}\n      used: {ix.used}")
    lines.append(f"\nprebuilt wheels ({PREBUILT_VERIFIED}):")
    for w in PREBUILT_WHEELS:
        lines.append(f"  {w.kernel:<16} {w.filename}")
    lines.append(f"\nFlashAttention-4, pinned PyPI wheels, --no-deps ({FA4_VERIFIED}):")
    lines.append("  always:      " + ", ".join(f"{d.name}=={d.version}" for d in FA4_SET))
    lines.append("  by CUDA:     " + ", ".join(f"{d.name}=={d.version} (CUDA {c})" for c, d in FA4_LIBS.items()))
    lines.append("  if missing:  " + ", ".join(f"{d.name}=={d.version}" for d in (*FA4_IF_MISSING, *CUDA_BINDINGS.values(),
                                                                             CUDA_PATHFINDER)))
    lines.append("\nTriton per torch: " + ", ".join(f"{a}.{b}->{c}.{d}" for (a, b), (c, d) in TRITON_FOR_TORCH.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
