import json
from importlib import import_module

import torch
from pack import load

bench = import_module(load().__name__ + ".measure.bench")
structured_qkv = import_module(load().__name__ + ".measure.inputs").structured_qkv


def test_structured_inputs_have_locality_and_key_bias():
    q, k, v = structured_qkv(1, 2, 1024, 1024, 64, seed=1, kind="image")
    assert q.shape == (1, 2, 1024, 64) and k.shape == v.shape == (1, 2, 1024, 64)
    near = torch.nn.functional.cosine_similarity(q[0, 0, :-1], q[0, 0, 1:], dim=-1).mean()
    far = torch.nn.functional.cosine_similarity(q[0, 0, :512], q[0, 0, 512:], dim=-1).mean()
    assert near > 0.5 > far.abs()
    # the channel bias: K's mean over tokens is far from zero relative to Q's
    assert k.mean(dim=2).abs().mean() > 3 * q.mean(dim=2).abs().mean()
    qi, _, _ = structured_qkv(1, 2, 1024, 1024, 64, seed=1, kind="iid")
    near_iid = torch.nn.functional.cosine_similarity(qi[0, 0, :-1], qi[0, 0, 1:], dim=-1).mean()
    assert near_iid.abs() < 0.1


def test_video_grid_and_cross_lengths():
    q, k, v = structured_qkv(1, 1, 4 * 8 * 8, 77, 32, kind="video", grid=(4, 8, 8), dtype=torch.bfloat16)
    assert q.shape == (1, 1, 256, 32) and k.shape == (1, 1, 77, 32) and q.dtype == torch.bfloat16


def test_bench_renders_tables_from_json(tmp_path, capsys):
    rows = [
        {"backend": "sdpa", "shape": "flux", "ms": 0.43, "cos": 1.0, "rel_l1": 0.001, "peak_mib": 10, "speedup_vs_sdpa": 1.0},
        {"backend": "sage_fp8_sm90", "shape": "flux", "ms": 0.54, "cos": 0.9998, "rel_l1": 0.02, "peak_mib": 12,
         "speedup_vs_sdpa": 0.796, "direct_ms": 0.53, "wrapper_pct": 1.9},
        {"backend": "sparge", "shape": "flux", "refused": "head dim 40 unsupported"},
        {"backend": "auto", "shape": "flux", "ms": 0.44, "cos": 1.0, "rel_l1": 0.001, "peak_mib": 10,
         "speedup_vs_sdpa": 0.977, "auto_choice": "sdpa", "auto_report": "sdpa [sdpa 0.43 ms]"},
    ]
    meta = {"gpu": "X", "torch": "t", "dtype": "bf16", "date": "d", "reps": 3}
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"meta": meta, "rows": rows}))
    md = tmp_path / "r.md"
    assert bench.main(["--from-json", str(p), "--md", str(md)]) == 0
    text = md.read_text()
    assert "| sage_fp8_sm90 | 0.540 ms ×0.80 |" in text
    assert "| auto | 0.440 ms ×0.98 → sdpa |" in text
    assert "sparge @ flux: head dim 40 unsupported" in text
    assert "(+1.9 %)" in text


def test_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        return
    assert bench.main(["--preset", "flux"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
