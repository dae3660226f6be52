"""``bench/e2e_gpu.py --smoke``: the GPU harness's own code paths on the CPU with tiny architectures (slow: ~3 min).

It builds the random-weight checkpoints, composes a paper config as ``train.py`` does, overrides only paths and
lengths, runs ``train.py fit`` in a subprocess with the SDXL server (tiny pipeline loaded from disk) and reads the
figures back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


@pytest.mark.slow
def test_harness_smoke_runs_a_config_with_synthesis(tmp_path):
    from bench.e2e_gpu import main

    out = tmp_path / "e2e.json"
    r = main(["--smoke", "--work", str(tmp_path / "work"), "--runs", "rec_3b_1gpu:async", "--out", str(out)])
    fit = r["fit"]["rec_3b_1gpu:async"]
    assert fit["rc"] == 0, fit.get("log_tail")
    assert fit["steps"] >= 2 and fit["median_step_s"] > 0
    assert fit["swaps"] > 0 and fit["failures"] == 0
    changed = " ".join(fit["overridden"])
    for key in ("model.model_name_or_path", "data.data_root", "trainer.max_epochs"):
        assert key in changed  # the synthesis mode is listed only when the run's differs from the config's (async here)
    assert "model.group_size" not in changed and "optimizer" not in changed  # only paths and lengths


@pytest.mark.slow
def test_harness_smoke_builds_qwen3_vl_and_runs_the_cycle_config(tmp_path):
    """``--arch qwen3vl-4b`` (CycleGRPO's ``cycle_4b.yaml``): the Qwen3-VL builder at the tiny size, the hf engines."""
    from bench.e2e_gpu import main

    r = main(["--smoke", "--arch", "qwen3vl-4b", "--work", str(tmp_path / "w"), "--runs", "cycle_4b:off"])
    assert r["calls"][-1]["builds"]["qwen"]["arch"] == "qwen3vl-tiny"
    fit = r["fit"]["cycle_4b:off"]
    assert fit["rc"] == 0, fit.get("log_tail")
    assert fit["steps"] >= 2 and fit["median_step_s"] > 0
