"""pytest plugin for tests/run.py (``-p run_plugin``): each test's outcome, its tier markers and a skip's reason, one JSON
line per test, appended to the file in $PA_RUN_RESULTS (nothing without it)."""

import json
import os

MARKERS = ("comfyui", "server")


def pytest_runtest_logreport(report):
    path = os.environ.get("PA_RUN_RESULTS")
    # a test's outcome is its call's, or its set-up's where that skipped or failed (then it has no call)
    if not path or not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    record = {"test": report.nodeid, "outcome": report.outcome, "reason": reason,
              "markers": [m for m in MARKERS if m in report.keywords]}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
