"""The page's pure parts in Node.js, without a browser: web/report_view.js (a report's pipe tables found and sized) and
web/search_rank.js (the node search's name ranks, as frontend 1.49 computes them). The browser tier
(tests/test_browser.py) checks the same code on the nodes and in the node search; this runs where Node.js is
installed and skips with the reason elsewhere."""

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = shutil.which("node")


def run_js(body: str, *args):
    """``body`` run as an ES module with report_view.js and search_rank.js imported and ``args`` as ``ARGS``; what it
    passes to ``out()`` comes back."""
    if NODE is None:
        pytest.skip("Node.js is not installed")
    web = os.path.join(ROOT, "web")
    script = (f"import * as view from {json.dumps('file://' + os.path.join(web, 'report_view.js'))};\n"
              f"import * as rank from {json.dumps('file://' + os.path.join(web, 'search_rank.js'))};\n"
              f"const ARGS = {json.dumps(list(args))};\n"
              "const out = (x) => process.stdout.write(JSON.stringify(x));\n" + body)
    r = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


BENCH = """CPU · torch 2.14.1 · bf16 · per-call ms = median over 5 rounds.

Shapes: `1,2,256,64` = 1,2,256,64

| backend | 1,2,256,64 |
|---|---|
| sdpa | 31.199 ms ×1.00 |
| auto | 13.388 ms ×2.33 → sdpa |

Accuracy (cos / rel-L1):

| backend | 1,2,256,64 |
|---|---|
| sdpa | 1.0000 / 0.001 |
"""


def test_a_report_s_pipe_tables_become_tables_and_the_rest_stays_text():
    blocks = run_js("out(view.reportBlocks(ARGS[0]))", BENCH)
    assert [b["type"] for b in blocks] == ["text", "table", "text", "table"]
    assert blocks[0]["text"] == ("CPU · torch 2.14.1 · bf16 · per-call ms = median over 5 rounds.\n\n"
                                 "Shapes: `1,2,256,64` = 1,2,256,64")
    assert blocks[1] == {"type": "table", "head": ["backend", "1,2,256,64"],
                         "rows": [["sdpa", "31.199 ms ×1.00"], ["auto", "13.388 ms ×2.33 → sdpa"]]}
    assert blocks[2]["text"] == "Accuracy (cos / rel-L1):"
    assert blocks[3]["rows"] == [["sdpa", "1.0000 / 0.001"]]


def test_spacing_escaped_pipes_short_rows_and_lines_that_only_look_like_tables():
    info = "no CUDA GPU\n\n[      yes] sdpa\n[      yes] sdpa_math"
    text = ("| not a table: no separator row |\n\n| a | b \\| c |\n|:---|---:|\n| 1 |\n| 2 | 3 | 4 |\nafter")
    got = run_js("out([view.reportBlocks(ARGS[0]), view.reportBlocks(ARGS[1]), view.reportBlocks('')])", info, text)
    assert got[0] == [{"type": "text", "text": info}]  # the columns' spacing kept
    assert got[1] == [
        {"type": "text", "text": "| not a table: no separator row |"},
        {"type": "table", "head": ["a", "b | c", ""], "rows": [["1", "", ""], ["2", "3", "4"]]},
        {"type": "text", "text": "after"},
    ]
    assert got[2] == []


def test_a_report_s_size_follows_its_widest_line_or_table():
    sizes = run_js("out(ARGS.map((t) => view.reportSize(t)))", "ab\ncd", "a" * 100, BENCH,
                   BENCH.replace("sdpa |", "s" * 60 + " |"))
    short, long_line, bench, wide = sizes
    assert long_line[0] == pytest.approx(100 * 7.2, abs=1) and short[1] == long_line[1] + 15
    assert bench[1] > 10 * 15 and wide[0] > bench[0] and wide[1] == bench[1]


TABLE = "| backend | 1,2,256,64 |\n|---|---|\n| sdpa | 31.199 ms ×1.00 |"


def test_a_long_line_counts_the_lines_it_wraps_to_at_the_node_s_width():
    """A line longer than the box is wide (the Context Parallel node's note on four GPUs) wraps at its spaces: the box's
    height counts every line it takes, or its end is cut off; a word longer than a line is broken; tables never wrap."""
    note = "Flux.1/Flux.2: each step of 4,297 tokens or more split over 2 of the 4 GPUs, " * 4  # 308 characters
    got = run_js("out([ARGS[0].map(([l, n]) => view.wrappedLines(l, n)), view.reportSize(ARGS[1]),"
                 " view.reportSize(ARGS[1], 100 * view.CHAR_PX), view.reportSize(ARGS[2], 100 * view.CHAR_PX),"
                 " view.reportSize(ARGS[3], 10 * view.CHAR_PX)])",
                 [["abc def", 10], ["abc def", 5], ["abc def", 3], ["abcdefgh", 3], ["", 5], ["a" * 10, 0]],
                 note, "ab\ncd", TABLE)
    lines, unwrapped, wrapped, short, table = got
    assert lines == [1, 2, 2, 3, 1, 1]
    assert unwrapped[1] == 15 + 6 and wrapped[1] == 4 * 15 + 6  # 308 characters at 100 a line: 4 lines, at its spaces
    assert wrapped[0] == unwrapped[0] and short[1] == 2 * 15 + 6
    assert table == run_js("out(view.reportSize(ARGS[0]))", TABLE)


# frontend 1.49's own cases for its name ranks (its FuseSearch.calcAuxSingle), and the words of this pack's search
CASES = [("load image", "Load Image", 0), ("load", "Load Image", 1), ("image", "LoadImage", 2), ("cast", "broadcast", 3),
         ("batch latent", "LatentBatch", 4), ("ten bat", "LatentBatch", 5), ("vae", "KSampler", 9),
         ("sageattention", "sageattention", 0), ("sparge", "SpargeAttn Settings", 1), ("flash attention", "Patch Attention", 9)]


def test_search_ranks_names_as_frontend_1_49_does():
    got = run_js("out(ARGS.map(([q, name]) => rank.nameRank(q, name)))", *[[q, n] for q, n, _ in CASES])
    assert [g[0] for g in got] == [tier for _, _, tier in CASES]
    assert got[1] == [1, 0, len("load image")]  # the start of the name: no position, then the shorter name first
    assert run_js("out([rank.byRank([1, 0, 6], [1, 0, 19]), rank.byRank([2, 0, 0], [1, 5, 5])])") == [-13, 1]
