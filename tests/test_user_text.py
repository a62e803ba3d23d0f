"""What a user reads holds no development-process wording (tests/tools/check_user_text.py, run by .ci/run)."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("check_user_text", os.path.join(ROOT, "tests", "tools", "check_user_text.py"))
check_user_text = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_user_text)


def test_readme_docs_notes_and_strings_of_this_pack_pass():
    assert check_user_text.check(ROOT) == []


def _tree(tmp_path):
    (tmp_path / "docs" / "data").mkdir(parents=True)
    (tmp_path / "workflows").mkdir()
    (tmp_path / "nodes").mkdir()
    (tmp_path / "README.md").write_text(
        "# Pack\n\nSee the issue's table.\nUpstream bug: https://github.com/comfyanonymous/ComfyUI/issues/9773 (NaN).\n"
        "auto keeps the fastest kernel that passes its gate.\n")
    (tmp_path / "docs" / "e2e.md").write_text("Measured in the third pass.\nThe 2-GPU run: no two-GPU machine was lent.\n"
                                              "A second session starts with the decisions.\n")
    (tmp_path / "docs" / "data" / "raw.md").write_text("session 6 output, kept as it was printed\n")
    wf = {"groups": [{"title": "Sample"}], "nodes": [{"type": "Note", "widgets_values": ["The wheel did not fit the upload."]},
                                                     {"type": "KSampler", "widgets_values": ["issue"]}]}
    (tmp_path / "workflows" / "a.json").write_text(json.dumps(wf))
    (tmp_path / "nodes" / "n.py").write_text(
        '"""Module docstring: the issue that asked for this."""\n\n'
        'def f():\n    """A docstring may say session."""\n    # a comment may say pass 3\n'
        '    raise ValueError("the GPU machines were withheld")\n\nTOOLTIP = "Run it once per model."\n')
    return tmp_path


def test_each_kind_of_text_is_checked_and_only_prose(tmp_path):
    found = check_user_text.check(str(_tree(tmp_path)))
    got = sorted((where, line, word.lower()) for where, line, word, _ in found)
    assert got == [
        ("README.md", 3, "issue"),  # the issue link on line 4 is allowed; "passes its gate" (line 5) is a verb
        ("docs/e2e.md", 1, "third pass"),
        ("docs/e2e.md", 2, "lent"),
        ("docs/e2e.md", 3, "session"),
        ("nodes/n.py", 6, "withheld"),  # a message; the docstrings and the comment are not scanned
        ("workflows/a.json", 0, "upload"),  # a note; another node's widget value is not a note
    ]


def test_the_command_fails_with_the_lines_and_passes_on_clean_text(tmp_path, capsys):
    root = _tree(tmp_path)
    assert check_user_text.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "docs/e2e.md:2: 'lent'" in out and "6 line(s)" in out
    for p in ("README.md", "docs/e2e.md"):
        (root / p).write_text("What to pick, per GPU.\n")
    (root / "workflows" / "a.json").write_text(json.dumps({"nodes": []}))
    (root / "nodes" / "n.py").write_text('MSG = "no CUDA GPU: nothing to benchmark"\n')
    assert check_user_text.main([str(root)]) == 0
