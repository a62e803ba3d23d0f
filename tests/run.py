"""Run the tests against each ComfyUI release that tests/setup_env.sh prepared (``.build/comfyui/<version>/ComfyUI``:
unpacked archives, or a link to the ComfyUI that COMFYUI_PATH named), and against COMFYUI_PATH's when it is set here.

    python tests/run.py                    # every tier on the oldest release, the real-ComfyUI tiers on each newer one
    python tests/run.py --release 0.33.0   # every tier on that release only
    python tests/run.py -- -k compile      # anything after -- goes to pytest
    python tests/run.py --release 0.33.0 -- tests/test_browser.py   # paths after -- run instead of tests/

Each release runs in its own pytest process (a process imports one ComfyUI), with COMFYUI_PATH at its tree and the
packages it pins differently (``<version>/site``) first on its path.  The tiers that need no ComfyUI run once, with the
oldest.  pytest's header names the release each run uses; the exit status is the first failing run's.  The last lines
say which real-ComfyUI tiers ran on each release and, for a tier that did not, why and the command that runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Release:
    version: str
    comfyui: str  # the ComfyUI tree
    site: str | None = None  # what this release pins differently from the venv


def version_key(version: str) -> list:
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"[.\-]", version)]


def tree_version(comfyui: str) -> str:
    """A ComfyUI tree's version, from its comfyui_version.py ("unknown" without one)."""
    try:
        with open(os.path.join(comfyui, "comfyui_version.py")) as f:
            return re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read()).group(1)
    except (OSError, AttributeError):
        return "unknown"


def releases(base: str, comfyui_path: str | None = None) -> list[Release]:
    """Every prepared release under ``base``, and the ComfyUI at ``comfyui_path`` (COMFYUI_PATH), oldest first. A
    prepared release that is the same tree, or of the same version, gives way to ``comfyui_path`` (keeping its site
    folder: the same version pins the same packages)."""
    out = {}
    if os.path.isdir(base):
        for v in os.listdir(base):
            tree = os.path.join(base, v, "ComfyUI")
            if os.path.exists(os.path.join(tree, "main.py")):
                site = os.path.join(base, v, "site")
                out[v] = Release(v, tree, site if os.path.isdir(site) else None)
    if comfyui_path and os.path.exists(os.path.join(comfyui_path, "main.py")):
        v = tree_version(comfyui_path)
        same = [k for k, r in out.items() if os.path.realpath(r.comfyui) == os.path.realpath(comfyui_path)]
        for k in same:
            del out[k]
        out[v] = Release(v, comfyui_path, out[v].site if v in out else None)
    return sorted(out.values(), key=lambda r: version_key(r.version))


def enclosing_comfyui() -> str | None:
    """The ComfyUI this pack is cloned into (``ComfyUI/custom_nodes/<pack>``), as tests/comfyui_support.py finds it."""
    parent = os.path.dirname(ROOT)
    base = os.path.dirname(parent)
    if os.path.basename(parent) == "custom_nodes" and os.path.exists(os.path.join(base, "main.py")):
        return base
    return None


# The real-ComfyUI tiers (tests marked ``comfyui``), as the summary names them, and what runs one tier alone.
TIERS = [
    ("in-process (loader, sampling, compile)", ["-m", "comfyui and not server"]),
    ("server", ["tests/test_comfyui_server.py"]),
    ("browser", ["tests/test_browser.py"]),
]


def tier_of(record: dict) -> str | None:
    if "comfyui" not in record["markers"]:
        return None
    if "server" not in record["markers"]:
        return TIERS[0][0]
    return TIERS[2][0] if os.path.basename(record["test"].split("::")[0]) == "test_browser.py" else TIERS[1][0]


NO_COMFYUI = "no ComfyUI found"
SETUP = ("COMFYUI_PATH=/path/to/ComfyUI bash tests/setup_env.sh && . .venv/bin/activate && python tests/run.py\n"
         "    (or COMFYUI_TGZ=\"v0.3.64.tar.gz v0.33.0.tar.gz\" for GitHub's release archives; where github.com "
         "answers, bash tests/setup_env.sh downloads ComfyUI 0.3.64 and 0.33.0 itself)")
# Skips this machine can undo (the words of the skip reason -> what to install before the tier's command). Any other
# skip is the release's (a node or model family it lacks): counted, and listed by pytest's own summary above.
MACHINE_SKIPS = {
    "selenium": "pip install selenium, then ",
    "Chromium": "apt-get install chromium chromium-driver (as root), then ",
}


def count(records: list) -> str:
    n = {k: sum(r["outcome"] == k for r in records) for k in ("passed", "failed", "skipped")}
    return ", ".join(f"{v} {k}" for k, v in n.items() if v) or "no tests"


def tier_lines(tier: str, release: str, mine: list) -> list[str]:
    """What one real-ComfyUI tier did on one release: ran, partly (some tests skipped for something this machine
    lacks) or skipped; for the skips this machine can undo, why and the command that runs the tier."""
    if not mine:
        return [f"  not run {tier}: none of its tests was selected"]
    undo = [r for r in mine if r["outcome"] == "skipped" and any(w in r["reason"] for w in (NO_COMFYUI, *MACHINE_SKIPS))]
    if all(r["outcome"] == "skipped" for r in mine):
        state = "skipped"
    else:
        state = "partly " if undo else "ran    "
    lines = [f"  {state} {tier}: {count(mine)}"]
    if undo:
        reasons = sorted({r["reason"] for r in undo}, key=lambda x: -sum(r["reason"] == x for r in undo))
        first = next((hint for w, hint in MACHINE_SKIPS.items() if any(w in x for x in reasons)), "")
        cmd = SETUP if any(NO_COMFYUI in x for x in reasons) else \
            first + f"python tests/run.py --release {release} -- {shlex.join(dict(TIERS)[tier])}"
        lines += [f"    {len(undo)} skipped: {'; '.join(reasons)}", f"    to run them: {cmd}"]
    return lines


def summary(runs: list) -> list[str]:
    """The last lines: for each pytest run (release or None, every tier or not, exit status, result records) which
    real-ComfyUI tiers ran, and for each that did not, why and the command that runs it."""
    lines = ["", "=== Summary: the real-ComfyUI tiers ==="]
    for release, every_tier, rc, records in runs:
        head = f"{f'ComfyUI {release}' if release else 'No ComfyUI'}: pytest exit status {rc}"
        if every_tier:
            head += f"; the tests that need no ComfyUI: {count([r for r in records if tier_of(r) is None])}"
        lines.append(head)
        if not records:
            lines.append("  no test results (pytest stopped before running any: its output above says why)")
        elif release is None:  # every real-ComfyUI tier skipped for the one reason: said once
            mine = [r for r in records if tier_of(r) is not None and r["outcome"] == "skipped"]
            reasons = sorted({r["reason"] for r in mine if r["reason"]})
            lines += [f"  skipped every real-ComfyUI tier ({len(mine)} tests: in-process, server, browser): "
                      f"{'; '.join(reasons)}", f"    to run them: {SETUP}"] if mine else []
        else:
            for tier, _ in TIERS:
                lines += tier_lines(tier, release, [r for r in records if tier_of(r) == tier])
    return lines


def read_records(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def run_pytest(args: list, env: dict) -> tuple[int, list]:
    """pytest in its own process, with run_plugin.py writing each test's outcome, markers and skip reason."""
    fd, path = tempfile.mkstemp(prefix="pa-tests-", suffix=".jsonl")
    os.close(fd)
    env = dict(env, PA_RUN_RESULTS=path,
               PYTHONPATH=os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p))
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "run_plugin", *args], cwd=ROOT, env=env)
        return rc, read_records(path)
    finally:
        os.remove(path)


def targets(extra: list) -> tuple[list, list]:
    """pytest's arguments: tests/ unless paths come after --, then the rest of them."""
    paths = [a for a in extra if not a.startswith("-") and os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
    return ([] if paths else [os.path.join(ROOT, "tests")]), extra


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
    given = os.environ.get("COMFYUI_PATH")
    if given and not os.path.exists(os.path.join(given, "main.py")):
        print(f"tests/run.py: COMFYUI_PATH={given} holds no ComfyUI (no main.py): left out", file=sys.stderr)
    found = releases(a.comfy_dir, given or enclosing_comfyui())
    if a.release:
        unknown = set(a.release) - {r.version for r in found}
        if unknown:
            sys.exit(f"tests/run.py: no prepared ComfyUI {', '.join(sorted(unknown))} in {a.comfy_dir} "
                     f"(have: {', '.join(r.version for r in found) or 'none'}); run bash tests/setup_env.sh")
        found = [r for r in found if r.version in a.release]
    base_env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    kitchen_sol = os.path.join(ROOT, ".build", "kitchen-sol")  # comfy-kitchen 0.2.40 for the Sol-Attn contract test
    if os.path.isdir(kitchen_sol):
        base_env.setdefault("PA_KITCHEN_SOL", kitchen_sol)
    where, extra = targets(extra)
    runs = []
    if not found:  # no ComfyUI: the tiers that need none, the others skipped with the reason
        rc, records = run_pytest([*where, *extra], base_env)
        runs.append((None, True, rc, records))
    for i, r in enumerate(found):
        env = dict(base_env, COMFYUI_PATH=r.comfyui)
        if r.site:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (r.site, os.environ.get("PYTHONPATH", "")) if p)
        marks = [] if i == 0 or a.release else ["-m", "comfyui"]
        print(f"\n=== ComfyUI {r.version}: {'every tier' if not marks else 'the real-ComfyUI tiers'} ===", flush=True)
        rc, records = run_pytest([*where, *marks, *extra], env)
        print(f"=== ComfyUI {r.version}: pytest exit status {rc} ===", flush=True)
        runs.append((r.version, not marks, rc, records))
    print("\n".join(summary(runs)), flush=True)
    return next((rc for _, _, rc, _ in runs if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
