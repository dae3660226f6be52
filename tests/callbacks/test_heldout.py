"""`make train`'s held-out summary (callbacks/heldout.py, configs/overlays/heldout_summary.yaml): a real fit step of the
embedded default with the overlay, on a few scenes of the fixed splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from callbacks.heldout import HeldOutSummary

ROOT = Path(__file__).resolve().parents[2]


def test_fit_prints_and_writes_start_and_final(tmp_path):
    cmd = [
        sys.executable,
        "train.py",
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--config",
        "configs/overlays/heldout_summary.yaml",
        "--callbacks.heldout.init_args.scenes=4",
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        "--trainer.limit_val_batches=0",
        "--callbacks.synthesis.init_args.mode=off",
        "--callbacks.gallery=null",
        "--callbacks.completions=null",
        f"--trainer.default_root_dir={tmp_path}/run",
        f"--data.init_args.data_root={tmp_path}/data",
        "--data.init_args.batch_size=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy Acc@0.5 at the start: val" in out.stdout
    line = next(
        x for x in out.stdout.splitlines() if x.startswith("held-out greedy Acc@0.5 (4 toy scenes each of val + ood")
    )
    record = json.loads((tmp_path / "run" / "results" / "heldout.json").read_text())
    assert set(record["start"]) == set(record["final"]) == {"val", "ood"} and record["step"] == 1
    for split in ("val", "ood"):
        assert record["start"][split] in {0, 0.25, 0.5, 0.75, 1.0}  # 4 scenes: a share of them
        assert f"{split} {100 * record['start'][split]:.1f} -> {100 * record['final'][split]:.1f}" in line


def test_resume_keeps_the_runs_start_and_bad_settings_say_where():
    cb = HeldOutSummary(scenes=4)
    cb.start = {"val": 0.5, "ood": 0.25}
    resumed = HeldOutSummary(scenes=4)
    resumed.load_state_dict(cb.state_dict())
    assert resumed.start == {"val": 0.5, "ood": 0.25}
    other = HeldOutSummary(scenes=8)  # other splits: the saved start is not theirs
    other.load_state_dict(cb.state_dict())
    assert other.start is None
    with pytest.raises(ValueError, match="--callbacks.heldout.init_args.splits"):
        HeldOutSummary(splits=("nope",))
    with pytest.raises(ValueError, match="scenes and batch_size"):
        HeldOutSummary(scenes=0)
