"""tests/run.py without running the suite: which releases it finds (prepared folders and COMFYUI_PATH), how it runs
pytest on each (stubbed), and its last lines: which real-ComfyUI tiers ran per release, and for one that did not, why
and the command that runs it. The pytest plugin that records each test is run for real on a small test file."""

import json
import os
import subprocess
import sys

import pytest
import run

HERE = os.path.dirname(os.path.abspath(__file__))


def fake_comfyui(path, version):
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, "main.py"), "w").close()
    with open(os.path.join(path, "comfyui_version.py"), "w") as f:
        f.write(f'# generated\n__version__ = "{version}"\n')
    return str(path)


@pytest.fixture
def prepared(tmp_path):
    """.build/comfyui as tests/setup_env.sh leaves it: two releases (the newer with its own pins), its downloads, and a
    folder that holds no ComfyUI."""
    base = tmp_path / "comfyui"
    fake_comfyui(base / "0.3.64" / "ComfyUI", "0.3.64")
    fake_comfyui(base / "0.33.0" / "ComfyUI", "0.33.0")
    (base / "0.33.0" / "site").mkdir()
    (base / "downloads").mkdir()
    (base / "0.40.0").mkdir()
    return str(base)


def test_releases_are_the_prepared_ones_and_comfyui_path_oldest_first(prepared, tmp_path):
    found = run.releases(prepared)
    assert [(r.version, os.path.relpath(r.comfyui, prepared), r.site and os.path.relpath(r.site, prepared))
            for r in found] == [("0.3.64", "0.3.64/ComfyUI", None), ("0.33.0", "0.33.0/ComfyUI", "0.33.0/site")]
    # a ComfyUI of its own version is tested too, in version order; one of a prepared version takes that one's place
    # and keeps its pins; the same tree reached through another path is not tested twice
    mine = fake_comfyui(tmp_path / "mine", "0.10.2")
    assert [r.version for r in run.releases(prepared, mine)] == ["0.3.64", "0.10.2", "0.33.0"]
    same = fake_comfyui(tmp_path / "other", "0.33.0")
    assert [(r.version, r.comfyui, r.site) for r in run.releases(prepared, same)][-1] == \
        ("0.33.0", same, os.path.join(prepared, "0.33.0", "site"))
    os.symlink(os.path.join(prepared, "0.3.64", "ComfyUI"), tmp_path / "link")
    assert [r.comfyui for r in run.releases(prepared, str(tmp_path / "link"))][0] == str(tmp_path / "link")
    assert len(run.releases(prepared, str(tmp_path / "link"))) == 2
    assert run.releases(str(tmp_path / "none")) == [] and run.tree_version(str(tmp_path)) == "unknown"


def rec(test, outcome="passed", reason="", markers=("comfyui",)):
    return {"test": test, "outcome": outcome, "reason": reason, "markers": list(markers)}


CHROMIUM = "Chromium and its driver are not installed (apt-get install chromium chromium-driver)"
NO_COMFY = "no ComfyUI found: set COMFYUI_PATH to a ComfyUI checkout (v0.3.64+)"


def test_the_summary_says_which_tiers_ran_and_how_to_run_the_others():
    everything = [rec("test_dispatch.py::test_a", markers=()), rec("test_zoo.py::test_b"),
                  rec("test_zoo.py::test_c", "skipped", "flux: configuration x is not in this ComfyUI"),
                  rec("test_comfyui_server.py::test_d", markers=("comfyui", "server")),
                  rec("test_browser.py::test_e", markers=("comfyui", "server"))]
    no_browser = [rec("test_zoo.py::test_b"), rec("test_comfyui_server.py::test_d", markers=("comfyui", "server")),
                  rec("test_browser.py::test_js", markers=("comfyui", "server")),  # needs no browser
                  *[rec(f"test_browser.py::test_{i}", "skipped", CHROMIUM, ("comfyui", "server")) for i in range(3)]]
    lines = run.summary([("0.3.64", True, 0, everything), ("0.33.0", False, 1, no_browser)])
    assert lines[1] == "=== Summary: the real-ComfyUI tiers ==="
    assert lines[2:6] == [
        "ComfyUI 0.3.64: pytest exit status 0; the tests that need no ComfyUI: 1 passed",
        # a release's own skips (a family it lacks) are counted, with no command: nothing here undoes them
        "  ran     in-process (loader, sampling, compile): 1 passed, 1 skipped",
        "  ran     server: 1 passed",
        "  ran     browser: 1 passed",
    ]
    assert lines[6:] == [
        "ComfyUI 0.33.0: pytest exit status 1",
        "  ran     in-process (loader, sampling, compile): 1 passed",
        "  ran     server: 1 passed",
        "  partly  browser: 1 passed, 3 skipped",
        f"    3 skipped: {CHROMIUM}",
        "    to run them: apt-get install chromium chromium-driver (as root), then "
        "python tests/run.py --release 0.33.0 -- tests/test_browser.py",
    ]
    # a tier wholly skipped, one not selected, a run that stopped before any test
    lines = run.summary([("0.33.0", False, 0, [rec("test_zoo.py::t", "skipped", "selenium is not installed "
                                                                                 "(pip install selenium)",
                                                   ("comfyui", "server"))]),
                         ("0.40.0", False, 2, [])])
    assert lines[3:] == [
        "  not run in-process (loader, sampling, compile): none of its tests was selected",
        "  skipped server: 1 skipped",
        "    1 skipped: selenium is not installed (pip install selenium)",
        "    to run them: pip install selenium, then python tests/run.py --release 0.33.0 -- tests/test_comfyui_server.py",
        "  not run browser: none of its tests was selected",
        "ComfyUI 0.40.0: pytest exit status 2",
        "  no test results (pytest stopped before running any: its output above says why)",
    ]


def test_without_any_comfyui_the_summary_says_so_once_and_how_to_get_one():
    records = [rec("test_dispatch.py::a", markers=()), rec("test_browser.py::js", markers=("comfyui", "server")),
               *[rec(f"test_zoo.py::{i}", "skipped", NO_COMFY) for i in range(4)],
               rec("test_browser.py::b", "skipped", NO_COMFY, ("comfyui", "server"))]
    lines = run.summary([(None, True, 0, records)])
    assert lines[2:4] == ["No ComfyUI: pytest exit status 0; the tests that need no ComfyUI: 1 passed",
                          f"  skipped every real-ComfyUI tier (5 tests: in-process, server, browser): {NO_COMFY}"]
    assert lines[4].startswith("    to run them: COMFYUI_PATH=/path/to/ComfyUI bash tests/setup_env.sh && "
                               ". .venv/bin/activate && python tests/run.py")
    assert "COMFYUI_TGZ=" in lines[4] and "downloads ComfyUI 0.3.64 and 0.33.0" in lines[4]


def test_main_runs_each_release_in_its_own_pytest_and_ends_with_the_summary(prepared, tmp_path, monkeypatch, capsys):
    calls = []

    def fake_pytest(args, env):
        calls.append((args, env.get("COMFYUI_PATH"), env.get("PYTHONPATH", "")))
        browser = "0.33.0" in env["COMFYUI_PATH"]
        return (1 if browser else 0), [rec("test_zoo.py::a"), rec("test_browser.py::b", "skipped" if browser else "passed",
                                                                   CHROMIUM if browser else "", ("comfyui", "server"))]

    monkeypatch.setattr(run, "run_pytest", fake_pytest)
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as run.py passes it on to a release without a site folder
    monkeypatch.setattr(run, "enclosing_comfyui", lambda: None)
    assert run.main(["--comfy-dir", prepared]) == 1  # the first failing run's status
    (a0, p0, s0), (a1, p1, s1) = calls
    assert a0 == [os.path.join(run.ROOT, "tests")] and p0.endswith(os.path.join("0.3.64", "ComfyUI"))
    assert a1 == [os.path.join(run.ROOT, "tests"), "-m", "comfyui"] and s1.startswith(os.path.join(prepared, "0.33.0", "site"))
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["  skipped browser: 1 skipped", f"    1 skipped: {CHROMIUM}",
                        "    to run them: apt-get install chromium chromium-driver (as root), then "
                        "python tests/run.py --release 0.33.0 -- tests/test_browser.py"]
    # COMFYUI_PATH at a ComfyUI of its own: tested as a release; paths after -- run instead of tests/
    calls.clear()
    monkeypatch.setenv("COMFYUI_PATH", fake_comfyui(tmp_path / "mine", "0.3.70"))
    assert run.main(["--comfy-dir", prepared, "--release", "0.3.70", "--", "tests/test_browser.py", "-k", "x"]) == 0
    assert calls == [(["tests/test_browser.py", "-k", "x"], os.path.join(str(tmp_path), "mine"), "")]
    with pytest.raises(SystemExit, match="no prepared ComfyUI 9.9"):
        run.main(["--comfy-dir", prepared, "--release", "9.9"])


def test_the_plugin_records_outcomes_markers_and_skip_reasons(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.comfyui\n"
        "def test_ok(): pass\n"
        "def test_no(): assert False\n"
        "@pytest.fixture\n"
        "def needs(): pytest.skip('no ComfyUI found: set COMFYUI_PATH')\n"
        "def test_skipped_in_setup(needs): pass\n"
        "@pytest.mark.server\n"
        "def test_skipped_in_call(): pytest.skip('Chromium and its driver are not installed')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    comfyui: x\n    server: y\n")
    out = tmp_path / "results.jsonl"
    env = dict(os.environ, PA_RUN_RESULTS=str(out), PYTHONPATH=HERE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "run_plugin", "-p", "no:cacheprovider",
                        str(tmp_path / "test_sample.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    got = {x["test"].split("::")[1]: x for x in map(json.loads, out.read_text().splitlines())}
    assert {k: (v["outcome"], v["markers"], v["reason"]) for k, v in got.items()} == {
        "test_ok": ("passed", ["comfyui"], ""), "test_no": ("failed", ["comfyui"], ""),
        "test_skipped_in_setup": ("skipped", ["comfyui"], "no ComfyUI found: set COMFYUI_PATH"),
        "test_skipped_in_call": ("skipped", ["comfyui", "server"], "Chromium and its driver are not installed")}
    assert run.tier_of(got["test_skipped_in_call"]) == "server" and run.tier_of(rec("x.py::y", markers=())) is None
