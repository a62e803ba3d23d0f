"""Make the archive of a pinned upstream commit and print the tree digest install.py checks.

    python tests/tools/pin_source.py GIT_DIR COMMIT --skip assets/ --skip example/ --out .src

Writes OUT/<commit>.tar.gz (the name install.py asks a --mirror folder for) without the skipped folders,
and prints ``tree_sha256`` for ``PINS`` in install.py. GIT_DIR is any clone of the upstream repository.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _install_module():
    sys.path.insert(0, str(ROOT))
    import install  # install.py at the repository root

    return install


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("git_dir")
    p.add_argument("commit")
    p.add_argument("--skip", action="append", default=[], help="a folder prefix the build never reads, e.g. assets/")
    p.add_argument("--out", default=".src")
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "-C", a.git_dir, "rev-parse", a.commit], capture_output=True, text=True, check=True).stdout.strip()
    excludes = [f":(exclude){s.rstrip('/')}" for s in a.skip]
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "src.tar"
        subprocess.run(["git", "-C", a.git_dir, "archive", "--format=tar", f"--prefix=src-{commit}/", "-o", str(tar), commit, "--", ".", *excludes],
                       check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        root = Path(tmp) / f"src-{commit}"
        digest = _install_module().tree_digest(root, tuple(a.skip))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / f"{commit}.tar.gz", "w:gz") as t:
            t.add(root, arcname=root.name)
    print(f"commit      {commit}\ntree_sha256 {digest}\narchive     {out / (commit + '.tar.gz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
