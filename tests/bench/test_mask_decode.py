"""bench/mask_decode.py runs on a tiny random VQ-SAM2 on the CPU and reports both decode paths (its --fit mode runs a
train.py fit, seconds on a CPU with --quick: docs/cycle_grpo.md, "The mask tokenizer's device")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


def test_mask_decode_bench_reports_both_paths(tmp_path):
    import mask_decode

    out = tmp_path / "decode.json"
    argv = ["--size", "tiny", "--device", "cpu", "--images", "2", "--codes", "3", "--image-size", "24", "32"]
    assert mask_decode.main([*argv, "--batch-size", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["decodes"], r["device"], r["equal_masks"]) == (6, "cpu", True)
    assert r["one_by_one_per_s"] > 0 and r["batched_per_s"] > 0 and r["speedup"] > 0
