"""Run the tests against each ComfyUI release that tests/setup_env.sh prepared (``.build/comfyui/<version>/ComfyUI``).

    python tests/run.py                    # every tier on the oldest release, the real-ComfyUI tiers on each newer one
    python tests/run.py --release 0.33.0   # every tier on that release only
    python tests/run.py -- -k compile      # anything after -- goes to pytest

Each release runs in its own pytest process (a process imports one ComfyUI), with COMFYUI_PATH at its tree and the
packages it pins differently (``<version>/site``) first on its path.  The tiers that need no ComfyUI run once, with the
oldest.  pytest's header names the release each run uses; the exit status is the first failing run's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def releases(base: str) -> list[tuple[str, str]]:
    """(version, folder) of every prepared release, oldest first."""
    out = []
    if os.path.isdir(base):
        for v in os.listdir(base):
            if os.path.exists(os.path.join(base, v, "ComfyUI", "main.py")):
                out.append((v, os.path.join(base, v)))

    def key(item):
        return [int(x) if x.isdigit() else x for x in re.split(r"[.\-]", item[0])]

    return sorted(out, key=key)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", action="append", help="run on this release only (repeatable)")
    ap.add_argument("--comfy-dir", default=os.path.join(ROOT, ".build", "comfyui"))
    a = ap.parse_args(argv)
    found = releases(a.comfy_dir)
    if a.release:
        unknown = set(a.release) - {v for v, _ in found}
        if unknown:
            sys.exit(f"tests/run.py: no prepared ComfyUI {', '.join(sorted(unknown))} in {a.comfy_dir} "
                     f"(have: {', '.join(v for v, _ in found) or 'none'}); run bash tests/setup_env.sh")
        found = [(v, d) for v, d in found if v in a.release]
    base_env = dict(os.environ)
    kitchen_sol = os.path.join(ROOT, ".build", "kitchen-sol")  # comfy-kitchen 0.2.40 for the Sol-Attn contract test
    if os.path.isdir(kitchen_sol):
        base_env.setdefault("PA_KITCHEN_SOL", kitchen_sol)
    if not found:  # no ComfyUI: the tiers that need none, the others skipped with the reason
        return subprocess.call([sys.executable, "-m", "pytest", os.path.join(ROOT, "tests"), *extra], cwd=ROOT,
                               env=base_env)
    status = 0
    for i, (version, folder) in enumerate(found):
        env = dict(base_env, COMFYUI_PATH=os.path.join(folder, "ComfyUI"))
        site = os.path.join(folder, "site")
        if os.path.isdir(site):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
        marks = [] if i == 0 or a.release else ["-m", "comfyui"]
        print(f"\n=== ComfyUI {version}: {'every tier' if not marks else 'the real-ComfyUI tiers'} ===", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", os.path.join(ROOT, "tests"), *marks, *extra], cwd=ROOT,
                             env=env)
        print(f"=== ComfyUI {version}: pytest exit status {rc} ===", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
