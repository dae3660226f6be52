"""bench/cycle_reuse.py runs end to end on a tiny model and counts the work each side does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


@pytest.mark.parametrize("engine", ["fast", "hf_shared"])
def test_cycle_reuse_bench_runs_and_counts_prefills(tiny_model_dir, tmp_path, engine):
    """Both reuse paths: the fast engine (Qwen2.5-VL) and hf_shared (any Qwen-VL; it counts its prefills, which the
    bench checks against the expected B + B x N)."""
    import cycle_reuse

    out = tmp_path / "reuse.json"
    argv = ["--model", str(tiny_model_dir), "--engine", engine, "--samples", "2", "--n", "2", "--k", "3"]
    argv += ["--tokens", "3", "--repeats", "1"]
    assert cycle_reuse.main([*argv, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completions_per_step"] == 2 * (2 + 2 * 3)
    assert r["prefills"] == {"nested": 2 + 2 * 2, "independent": 16}  # one per prompt vs one per completion
    assert r["image_encodings"] == {"nested": 2, "independent": 16}  # once per sample (the vision cache) vs per row
    assert r["nested_median_s"] > 0 and r["independent_median_s"] > 0
