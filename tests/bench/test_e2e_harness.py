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
    for key in ("model.policy.model_name_or_path", "data.data_root", "trainer.max_epochs"):
        assert key in changed  # the synthesis mode is listed only when the run's differs from the config's (async here)
    assert "model.sampling.group_size" not in changed and "optimizer" not in changed  # only paths and lengths


@pytest.mark.slow
def test_harness_smoke_builds_qwen3_vl_and_runs_the_cycle_config(tmp_path):
    """``--arch qwen3vl-4b`` (CycleGRPO's ``cycle_4b.yaml``): the Qwen3-VL builder at the tiny size, the config's fast
    rollout and packed update engines (DeepStack)."""
    from bench.e2e_gpu import main

    runs = "cycle_4b:off,cycle_4b+cycle_4b_parquet:off"
    r = main(["--smoke", "--arch", "qwen3vl-4b", "--work", str(tmp_path / "w"), "--runs", runs])
    assert r["calls"][-1]["builds"]["qwen"]["arch"] == "qwen3vl-tiny"
    fit = r["fit"]["cycle_4b:off"]
    assert fit["rc"] == 0, fit.get("log_tail")
    assert fit["steps"] >= 2 and fit["median_step_s"] > 0
    # the released parquet with masks: a random VQ-SAM2 in the release's layout, toy rows encoded by it, and the
    # tokenizer's share of the steps read back from metrics.jsonl (issue 55 item 3)
    masks = r["fit"]["cycle_4b+cycle_4b_parquet:off"]
    assert masks["rc"] == 0, masks.get("log_tail")
    changed = " ".join(masks["overridden"])
    assert "data.parquet_files" in changed and "model.method.mask_tokenizer" in changed
    assert masks["mask_steps"] >= 1 and masks["mask_decodes_per_step"] >= 1  # the ground truths' spans, at least
    assert 0 < masks["mask_decode_share"] < 1


@pytest.mark.slow
def test_server_variants_run_sam2_and_the_extended_canvas_beside_the_plain_server(tmp_path):
    """``--server 64 --server-variants plain,sam2_extend`` (issue 41's GPU figure, here on the tiny pipeline): both
    servers answer every job through the API; the paper one segments with SAM 2 and paints larger canvases."""
    from bench.e2e_gpu import main

    r = main(["--smoke", "--work", str(tmp_path / "w"), "--server", "64", "--server-variants", "plain,sam2_extend"])
    plain, paper = r["server"]["64/plain"], r["server"]["64/sam2_extend"]
    assert plain["ok"] == plain["jobs"] == paper["ok"] and plain["audit_passed"] == paper["audit_passed"] == 4
    assert (plain["foreground"], paper["foreground"]) == ("box", "sam2")
    assert paper["mean_output_pixels"] > plain["mean_output_pixels"] == 64 * 48


def test_run_overlays_come_from_baselines_or_overlays():
    """``--runs config+overlay``: an overlay is a baseline or one of configs/overlays/ (``cycle_4b+hf_engines`` is the
    transformers-engine comparison of docs/cycle_grpo.md); composed as ``train.py --config A --config B``."""
    from bench.e2e_gpu import _overlay_path, compose

    assert _overlay_path("grpo") == REPO / "configs/baselines/grpo.yaml"
    assert _overlay_path("hf_engines") == REPO / "configs/overlays/hf_engines.yaml"
    with pytest.raises(SystemExit, match="no overlay 'nope' in configs/baselines/ or configs/overlays/"):
        _overlay_path("nope")
    base = compose([REPO / "configs/cycle_4b.yaml"])["model"]["init_args"]
    both = compose([REPO / "configs/cycle_4b.yaml", _overlay_path("hf_engines")])["model"]["init_args"]
    base, both = base["engines"], both["engines"]
    assert (base["rollout_engine"], base["update_engine"]) == ("fast", "packed")
    assert (both["rollout_engine"], both["update_engine"]) == ("hf_shared", "hf")
