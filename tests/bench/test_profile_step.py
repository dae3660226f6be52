"""``bench/profile_step.py`` (slow: ~25 s): two profiled steps of configs/tiny.yaml on the CPU write a Chrome trace and the top costs
with their share of the step (the module's spans and torch's ops)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


@pytest.mark.slow  # ~25 s on 2 cores: the tiny toy world is generated and two steps profiled
def test_two_profiled_steps_of_tiny_write_a_trace_and_the_top_costs(tiny_model_dir, tmp_path, capsys):
    from bench.profile_step import main

    out = tmp_path / "profile.json"
    flags = [
        "--model.init_args.policy.model_name_or_path", str(tiny_model_dir),
        "--model.init_args.sampling.max_new_tokens", "8", "--model.init_args.sampling.group_size", "2",
        "--data.init_args.data_root", str(tmp_path / "toy"), "--data.init_args.batch_size", "2",
        "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--callbacks.synthesis", "null", "--callbacks.gallery", "null",
        "--callbacks.completions", "null", "--callbacks.checkpoint", "null",
    ]  # fmt: skip
    r = main(
        ["--config", str(REPO / "configs/tiny.yaml"), "--steps", "2", "--warmup", "0", "--out", str(out), "--", *flags]
    )
    assert json.loads(out.read_text()) == r
    assert r["steps"] == 2 and r["device"] == "cpu" and r["mean_step_s"] > 0
    spans = {s["name"] for s in r["spans"]}
    assert {"train/time/rollout_s", "train/time/update_s", "train/time/optimizer_s"} <= spans
    assert 0.5 < sum(s["share"] for s in r["spans"]) <= 1.01  # the spans cover the step (the rest: logging, hooks)
    assert r["ops"] and r["ops_by"] == "self CPU time" and all(0 <= o["share"] < 1 for o in r["ops"])
    assert any(o["op"].startswith("aten::") for o in r["ops"])
    trace = json.loads(Path(r["trace"]).read_text())
    assert trace["traceEvents"]
    assert "steps profiled" in capsys.readouterr().out
