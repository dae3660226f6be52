"""Two CPU ranks (gloo): the smoother's batch average and the data pool are the same on every rank after a swap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_share_pool_and_smoother(tiny_model_dir, rec_dir, tmp_path):
    offline = rec_dir / "offline.jsonl"
    offline.write_text(
        "".join(json.dumps({"sample_id": f"s{i}", "description": "a striped blue background"}) + "\n" for i in range(8))
    )
    probe = tmp_path / "probe"
    synthesis = json.dumps(
        {
            "class_path": "callbacks.synthesis.SynthesisCallback",
            "init_args": {
                "mode": "sync",
                "offline_descriptions": str(offline),
                "poll_interval": 0.05,
                "gallery_samples": 0,
            },
        }
    )
    rank_probe = json.dumps({"class_path": "ddp_probe.RankProbe", "init_args": {"out_dir": str(probe)}})
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "fit",
        "--config",
        str(REPO / "configs/tiny.yaml"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_epochs",
        "2",
        "--trainer.logger",
        "false",
        "--callbacks.synthesis",  # the named callbacks of tiny.yaml: replace one, add one, drop the rest
        synthesis,
        "--callbacks.probe",
        rank_probe,
        "--callbacks.gallery",
        "null",
        "--callbacks.completions",
        "null",
        "--callbacks.checkpoint",
        "null",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--model.init_args.policy.model_name_or_path",
        str(tiny_model_dir),
        "--model.init_args.sampling.max_new_tokens",
        "4",
        "--model.init_args.sampling.group_size",
        "2",
        "--model.init_args.kl.coef",
        "0.0",
        "--data.init_args.data_root",
        str(rec_dir),
        "--data.init_args.toy",
        "null",
        "--data.init_args.train_files",
        "[train.jsonl]",
        "--data.init_args.val_files",
        "{}",
        "--data.init_args.batch_size",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["lineage"] == ranks[1]["lineage"], "ranks disagree on the data pool"
    assert sum(len(v) > 1 for v in ranks[0]["lineage"].values()) == 8  # every sample evolved (sync mode)
    assert ranks[0]["smoother"] == ranks[1]["smoother"], "ranks disagree on the all-reduced diversity average"
