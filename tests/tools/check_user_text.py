"""Fail on development-process wording in what a user reads.

    python tests/tools/check_user_text.py [ROOT]

What a user reads is about the pack, its measurements and how to use it. This check scans README.md, docs/*.md
(not docs/data/, which holds raw run output), the example workflows' notes and group titles, and the strings of the
pack's Python code (node names, tooltips, descriptions, messages; docstrings and comments are for developers and are
not scanned), and reports every line that speaks of how the work was done: issues, sessions, passes, uploads,
machines lent or withheld, and the like. ``.ci/run`` runs it; ``tests/test_user_text.py`` tests it.

A word that is legitimately about the product (a link to an upstream bug report, say) goes in ``ALLOWED``.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (pattern, why): case-insensitive, matched per line
WORDS = [
    (r"\bissues?\b", "an issue is where work was asked for; say what the user gets or can do"),
    (r"\bupload(s|ed)?\b", "what fit an upload is about how a run was made, not about the pack"),
    (r"\bwithheld\b|\blent\b", "which machines were lent is not something a user can act on"),
    (r"\bsessions?\b", "a work session is not the user's; for ComfyUI's own, say 'after a restart'"),
    (r"\b(first|second|third|fourth|fifth|earlier|previous|next|later|last)\s+pass(es)?\b"
     r"|\bthis\s+pass\b(?!\s+(the|through|its|their|a|an)\b)",
     "numbered passes of work: give the date or the data file instead"),
    (r"\bwork(ing)? periods?\b", "a work period is not something a user can act on"),
    (r"\bthe lead\b|\bbriefs?\b|\bhelpers? (branch|session)\b", "who worked on it is not about the pack"),
    (r"\bpull requests?\b|\bPR\s?#?\d+\b|\btickets?\b|\bsprints?\b", "development-process vocabulary"),
    (r"\bGPU (time|hours?|budget) (ran out|was spent|was used up|left)\b", "the project's GPU budget is not the user's"),
]
_WORDS = [(re.compile(p, re.IGNORECASE), why) for p, why in WORDS]

# Spans that may contain such a word because they are about the product, as regexes over one line.
ALLOWED = [
    r"https?://github\.com/[\w.-]+/[\w.-]+/issues/\d+",  # a link to an upstream bug report
    r"\bknown issues?\b",  # a product's list of known problems
]
_ALLOWED = [re.compile(p, re.IGNORECASE) for p in ALLOWED]

PYTHON = ["attention/**/*.py", "nodes/*.py", "install.py", "bench_e2e.py", "__init__.py"]


def _findings(text: str, where: str, first_line: int = 1):
    out = []
    for i, line in enumerate(text.splitlines()):
        spans = [m.span() for a in _ALLOWED for m in a.finditer(line)]
        for rx, why in _WORDS:
            for m in rx.finditer(line):
                if any(a <= m.start() and m.end() <= b for a, b in spans):
                    continue
                out.append((where, first_line + i, m.group(0), why))
    return out


def _python_strings(path: str):
    """(line, text) of every string constant in the file that is not a docstring."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def _workflow_texts(path: str):
    with open(path, encoding="utf-8") as f:
        wf = json.load(f)
    for g in wf.get("groups", []):
        yield g.get("title", "")
    for n in wf.get("nodes", []):
        if n.get("type") == "Note":
            yield from (v for v in n.get("widgets_values", []) if isinstance(v, str))


def check(root: str = ROOT):
    """Every finding as (file, line, word, why); file relative to ``root``."""
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    found = []
    pages = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    for p in pages:
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                found += _findings(f.read(), rel(p))
    for p in sorted(glob.glob(os.path.join(root, "workflows", "*.json"))):
        for text in _workflow_texts(p):
            found += [(w, 0, word, why) for w, _, word, why in _findings(text, rel(p))]
    for pattern in PYTHON:
        for p in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            for line, text in _python_strings(p):
                found += _findings(text, rel(p), line)
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else ROOT
    found = check(root)
    for where, line, word, why in found:
        print(f"{where}:{line}: {word!r}: {why}" if line else f"{where}: {word!r}: {why}")
    if found:
        print(f"check_user_text: {len(found)} line(s) with development-process wording in what users read "
              "(README.md, docs/*.md, workflow notes, strings in the pack's code); reword them, or add a product use "
              "to ALLOWED in tests/tools/check_user_text.py")
        return 1
    print("check_user_text: no development-process wording in README.md, docs/, workflow notes or the pack's strings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
