"""`make train`'s held-out summary (callbacks/heldout.py, configs/overlays/heldout_summary.yaml): a real fit step of the
embedded default with the overlay, on a few scenes of the fixed splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from callbacks.heldout import CI_NOTE, HeldOutSummary, wilson

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
    assert "held-out greedy Acc@0.5 at the start: 2 x 4 toy scenes ..." in out.stdout  # progress as it measures
    lines = out.stdout.splitlines()
    at = lines.index("held-out greedy Acc@0.5 (4 toy scenes each of val + ood, seed 0; 95% CI: " + CI_NOTE + "):")
    record = json.loads((tmp_path / "run" / "results" / "heldout.json").read_text())
    assert set(record["start"]) == set(record["final"]) == {"val", "ood"} and record["step"] == 1
    for split, line in zip(("val", "ood"), lines[at + 1 : at + 3]):
        assert record["start"][split] in {0, 0.25, 0.5, 0.75, 1.0}  # 4 scenes: a share of them
        start, final, ci = record["start"][split], record["final"][split], record["ci95"][split]
        lo, hi = ci["final"]
        assert lo <= final <= hi and ci["change"][0] <= final - start <= ci["change"][1]
        assert line.startswith(f"  {split} {100 * start:.1f} [") and f"-> {100 * final:.1f} [{100 * lo:.1f}, " in line
    # the run ends with its result lines, then its folder and checkpoint, after everything else
    tail = lines[-5:]
    assert tail[0] == lines[at] and tail[3] == f"run tiny (fit) finished at step 1; run folder: {tmp_path}/run/"
    assert tail[4] == f"checkpoint: {tmp_path}/run/checkpoints/last.ckpt"


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
    lo, hi = wilson(0, 4)  # Wilson: 0 of 4 still leaves room above 0 (the normal interval would be [0, 0])
    assert lo == 0.0 and 0.45 < hi < 0.5
