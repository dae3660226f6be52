"""``python -m runner.study``: the intervals (numbers worked by hand), the plan of Table 1 on the toy world, sharding, merging
and resuming without training, and (slow) the smoke study end to end through real ``train.py`` processes."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from cli.toy_checkpoints import missing_checkpoint_message
from runner import analysis, figures
from runner.points import Point, run_points
from runner.stats import bootstrap_mean, paired_bootstrap, t_interval, t_quantile_975
from runner.study import main as study_main
from runner.study_file import StudyError, load_study
from runner.study_plan import parse_shard, plan, prepare_data, shard
from runner.study_records import read_evaluation
from runner.study_report import _scene_matrix
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
TABLE1 = REPO / "experiments/study/table1_toy.yaml"
SMOKE = REPO / "experiments/study/smoke.yaml"


# ---------------------------------------------------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------------------------------------------------


def test_t_interval_by_hand():
    # 1, 2, 3: mean 2, s = 1, s / sqrt(3) = 0.577350; t(0.975, 2) = 4.302653 -> half width 2.484138
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv.kind == "t" and iv.n == 3 and iv.mean == pytest.approx(2.0)
    assert (iv.lo, iv.hi) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-5)
    # two seeds 0.30, 0.34: s = 0.028284, se = 0.02, t(0.975, 1) = 12.706205 -> 0.32 +- 0.254124
    iv = t_interval([0.30, 0.34])
    assert (iv.lo, iv.hi) == pytest.approx((0.32 - 0.254124, 0.32 + 0.254124), abs=1e-5)
    # one run: no spread to estimate
    assert t_interval([0.5]) == (0.5, 0.5, 0.5, 1, "none")
    with pytest.raises(ValueError, match="at least 2 seeds"):
        t_quantile_975(0)


def test_t_quantiles_match_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in [*range(1, 31), 31, 40, 60, 120, 1000]:
        assert t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-4), df


def test_bootstrap_of_a_constant_difference_is_that_constant():
    rng = np.random.default_rng(1)
    b = rng.uniform(size=(3, 50))  # 3 seeds x 50 scenes
    iv, diffs = paired_bootstrap(b + 0.1, b, replicates=300)
    # paired seeds and scenes: every replicate draws the same cells on both sides, so A - B is 0.1 in all of them
    assert iv.mean == pytest.approx(0.1) and np.allclose(diffs, 0.1) and iv.excludes_zero
    # unpaired seeds: the seed draws differ, so the seed-to-seed spread of b enters the interval
    iv_u, _ = paired_bootstrap(b + 0.1, b, replicates=300, paired_seeds=False)
    assert iv_u.hi - iv_u.lo > 0.01


def test_bootstrap_of_two_scenes_by_hand():
    # One run each, two scenes: A scores 1 on scene 0 and 0 on scene 1, B scores 0 on both. A replicate draws two
    # scenes with replacement: (0, 0) with probability 1/4 -> difference 1, (1, 1) 1/4 -> 0, mixed 1/2 -> 0.5.
    iv, diffs = paired_bootstrap([[1.0, 0.0]], [[0.0, 0.0]], replicates=4000, seed=3)
    freq = {v: float(np.mean(diffs == v)) for v in (0.0, 0.5, 1.0)}
    assert freq[0.0] == pytest.approx(0.25, abs=0.03) and freq[1.0] == pytest.approx(0.25, abs=0.03)
    assert freq[0.5] == pytest.approx(0.5, abs=0.03)
    assert (iv.mean, iv.lo, iv.hi) == (0.5, 0.0, 1.0) and not iv.excludes_zero
    # the same numbers through bootstrap_mean (a one-run method's interval, Original's)
    assert tuple(bootstrap_mean([[1.0, 0.0]], replicates=4000, seed=3))[:3] == (0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="same scenes"):
        paired_bootstrap([[1.0, 0.0]], [[0.0, 0.0, 0.0]])


# ---------------------------------------------------------------------------------------------------------------------
# The plan of Table 1
# ---------------------------------------------------------------------------------------------------------------------


def test_table1_plans_every_row_times_three_seeds_and_the_beta_ablation(tmp_path):
    study = load_study(TABLE1)
    labels = [r.label for r in study.rows if r.ablation is None]
    assert labels == [
        "Original", "Original, VLM-R1 prompt", "SFT", "GRPO", "+ Entropy Loss", "+ Entropy Adv.", "GRPO + Offline Generation",
        "Syn-GRPO w/o R_div", "Syn-GRPO",
    ]  # fmt: skip
    assert len(study.seeds) >= 3 and all(n >= 1000 for n in study.test_splits.values())
    assert set(study.test_splits) >= {"test_id", "test_ood_texture", "test_ood_crowded"}
    runs, data_root = plan(study, tmp_path / "out")
    betas = sorted({r.row.name for r in runs if r.row.ablation == "beta"})
    assert betas == [f"syn_grpo[diversity_beta={b}]" for b in (0.1, 0.3, 0.5, 0.9)]
    assert len(runs) == 2 + (7 + 4) * len(study.seeds) and len({r.key for r in runs}) == len(runs)
    for r in runs:
        ev = r.evaluate.argv
        assert ev[1:3] == ["train.py", "predict"] and "experiments/study/heldout.yaml" in ev
        assert f"--data.init_args.data_root={data_root}" in ev
        if r.row.name.startswith("original"):
            assert r.train is None and not any(
                a.startswith(("--ckpt_path", "--model.init_args.model_name")) for a in ev
            )
            continue
        tr = r.train.argv
        assert tr[1:3] == ["train.py", "fit"] and f"--seed_everything={r.seed}" in tr
        assert f"--trainer.default_root_dir={r.work}" in tr and f"--data.init_args.data_root={data_root}" in tr
        if r.row.name == "sft":  # trained by SFTModule, evaluated by the GRPO module through its exported policy
            assert r.export is not None and f"--model.init_args.policy.model_name_or_path={r.work / 'export'}" in ev
        else:
            assert r.export is None and f"--ckpt_path={r.work / 'checkpoints/last.ckpt'}" in ev
        if r.row.ablation == "beta":
            assert any(a.startswith("--model.init_args.method.init_args.diversity_beta=") for a in tr)
        if r.row.name == "offline_generation":
            assert (
                f"--callbacks.synthesis.init_args.offline_descriptions={data_root}/train_offline_descriptions.jsonl"
                in tr
            )


def _print_config(argv: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli_main([*argv, "--print_config"])
    assert exc.value.code in (None, 0), f"the CLI rejected {' '.join(argv)}"
    return yaml.safe_load(buf.getvalue())


EVOLVED = [
    REPO / f"experiments/study/evolved_toy{s}.yaml"
    for s in ("", "_revisit", "_binary", "_stepback", "_isolate", "_zoom")
]


CROWDED = REPO / "experiments/study/cycle_ablation_toy_crowded.yaml"
IMAGE_PREDICT = REPO / "experiments/study/cycle_ablation_toy_predict.yaml"


SLOW_ROWS = {"evolved_toy_revisit", "evolved_toy_binary", "evolved_toy_stepback", "evolved_toy_isolate"}
"""Study files that change a few arguments of a default one (evolved_toy's pool, reward and strategy switches; the
zoom file checks the same switches): checked in ``make test-slow``."""


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=[pytest.mark.slow] if p.stem in SLOW_ROWS else [])
        for p in [TABLE1, *EVOLVED, CROWDED, IMAGE_PREDICT]
    ],
    ids=lambda p: p.stem,
)
def test_the_cli_accepts_one_run_of_every_row(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    study = load_study(path)
    runs, data_root = plan(study, tmp_path / "out")
    seen = set()
    for r in runs:
        if r.row.name in seen:
            continue
        seen.add(r.row.name)
        if r.train is not None:
            cfg = _print_config(r.train.argv[2:])
            assert cfg["seed_everything"] == r.seed and cfg["trainer"]["default_root_dir"] == str(r.work)
            if path in EVOLVED:  # the two methods differ only in the method and the data evolution
                model, synth = cfg["model"]["init_args"], cfg["callbacks"]["synthesis"]["init_args"]
                method = "grpo.GRPO" if r.row.name == "grpo" else "evolved_grpo.EvolvedGRPO"
                assert model["method"]["class_path"] == f"lightning_modules.methods.{method}" and (
                    synth["mode"] == "off"
                ) == (r.row.name == "grpo")
                back = {"evolved_back2": 2, "evolved_back3": 3}.get(r.row.name, 1)  # the step-back rule's rows
                assert synth["strategy_args"].get("step_back_after", 1) == back and synth["strategy_args"]["seed"] == 0
                subs = 2 if r.row.name in ("evolved_isolate", "evolved_zoom") else 1  # the isolate and zoom rows
                assert synth["strategy_args"].get("sub_levels", 1) == subs
                easier = "zoom" if r.row.name == "evolved_zoom" else "isolate"
                assert synth["strategy_args"].get("easier", "isolate") == easier
            if path == CROWDED:  # about half of the training scenes drawn from the crowded split, rendered on access
                toy = cfg["data"]["init_args"]["toy"]
                assert toy["render_train"] is True and toy["mix"] == {"crowded": 0.5}
            if path in EVOLVED and path.stem != "evolved_toy":  # a small pool, seen 12 times
                assert cfg["data"]["init_args"]["toy"]["splits"]["train"] == 16 and cfg["trainer"]["max_epochs"] == 12
                binary = path.stem not in ("evolved_toy", "evolved_toy_revisit")  # R_acc 1 / 0
                assert cfg["model"]["init_args"]["method"]["init_args"]["accuracy_threshold"] == (
                    0.5 if binary else None
                )
        ev = [a for a in r.evaluate.argv[2:] if not a.startswith(("--ckpt_path", "--model.init_args.model_name"))]
        cfg = _print_config(ev)
        data = cfg["data"]["init_args"]
        assert data["test_files"] == {s: f"{s}.jsonl" for s in study.test_splits}
        assert data["toy"]["splits"] == study.test_splits and data["max_eval_samples"] is None
        assert data["data_root"] == str(data_root)
    assert len(seen) == len(study.rows)


VIDEO_ABLATION = REPO / "experiments/study/cycle_ablation_toy_temporal.yaml"
VIDEO_ABLATIONS = {
    VIDEO_ABLATION: "interval",
    REPO / "experiments/study/cycle_ablation_toy_st.yaml": "anchor",
    REPO / "experiments/study/cycle_ablation_toy_temporal_5seeds.yaml": "interval",
    REPO / "experiments/study/cycle_ablation_toy_temporal_no_target.yaml": "interval",
    REPO / "experiments/study/cycle_ablation_toy_temporal_no_target_nk.yaml": "interval",
}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=[pytest.mark.slow] if p.stem.endswith(("_5seeds", "_no_target_nk")) else [])
        for p in VIDEO_ABLATIONS
    ],  # the 5-seed and N/K files repeat another file's rows with more seeds / other N, K: make test-slow
    ids=lambda p: p.stem,
)
def test_a_video_study_plans_cycle_runs_on_the_toy_video_world(path, tmp_path, monkeypatch):
    """``world: video``: the rows train cycle_tiny_temporal.yaml / cycle_tiny_st.yaml in their ablation mode; every
    evaluation reads the held-out ``test`` clips (``test_video.jsonl``, all of them); ``prepare_data`` exports the
    clips once."""

    monkeypatch.chdir(REPO)
    study = load_study(path)
    clips, seeds = (200, 5) if path.stem.endswith(("_5seeds", "_no_target", "_no_target_nk")) else (100, 3)
    assert study.world == "video" and study.test_splits == {"test": clips}
    runs, data_root = plan(study, tmp_path / "out")
    assert len(runs) == 1 + 3 * seeds
    modes = {}
    for r in runs:
        if r.train is not None and r.row.name not in modes:
            cfg = _print_config(r.train.argv[2:])
            modes[r.row.name] = cfg["model"]["init_args"]["method"]["init_args"]["mode"]
            assert cfg["model"]["init_args"]["method"]["init_args"]["region_space"] == VIDEO_ABLATIONS[path]
            assert cfg["trainer"]["limit_val_batches"] == 0
    assert modes == {"caption_only": "caption", "localization_only": "localization", "cycle": "cycle"}
    ev = [a for a in runs[0].evaluate.argv[2:] if not a.startswith("--ckpt_path")]
    data = _print_config(ev)["data"]
    assert data["class_path"].endswith("VideoGroundingDataModule")
    assert data["init_args"]["test_files"] == {"test": "test_video.jsonl"}
    assert data["init_args"]["toy"]["splits"] == {"test": clips} and data["init_args"]["max_eval_samples"] is None
    small = [
        a.replace(f'{{"test": {clips}}}', '{"test": 2}') if a.startswith("--data.init_args.toy.splits") else a
        for a in runs[0].evaluate.argv
    ]
    runs[0].evaluate.argv[:] = small
    prepare_data(runs[:2], resolve=_print_config)  # the evaluation-only row, then the first training run (24 clips)
    lines = (data_root / "test_video.jsonl").read_text().splitlines()
    assert len(lines) == 2 and (data_root / "train_video.jsonl").is_file()  # the first training run's clips too


@pytest.mark.parametrize(
    "patch,match",
    [({"world": "audio"}, "world must be one of"), ({"test_splits": {"test_id": 10}}, "the video world's splits")],
)
def test_video_study_errors_name_the_key(tmp_path, patch, match):
    raw = {**yaml.safe_load(VIDEO_ABLATION.read_text()), **patch}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyError, match=match):
        load_study(path)


def test_shards_cover_every_run_once_and_are_fixed():
    study = load_study(TABLE1)
    runs, _ = plan(study, "out")
    parts = [shard(runs, i, 3) for i in (1, 2, 3)]
    keys = [r.key for p in parts for r in p]
    assert sorted(keys) == sorted(r.key for r in runs) and len(set(keys)) == len(keys)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [r.key for r in shard(plan(study, "elsewhere")[0], 2, 3)] == [r.key for r in parts[1]]
    assert parse_shard("2/3") == (2, 3) and parse_shard(None) == (1, 1)
    for bad in ("3", "0/3", "4/3", "a/b"):
        with pytest.raises(StudyError, match="--shard"):
            parse_shard(bad)


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"colour": 1}, "unknown key"),
        ({"test_splits": {"val": 100}}, "read by training or validation"),
        ({"test_splits": {"test_nope": 100}}, "splits are"),
        ({"seeds": []}, "seeds must be"),
        ({"evaluator": "validate"}, "evaluator must be"),
        ({"reference": "nope"}, "no row named 'nope'"),
    ],
)
def test_study_file_errors_name_the_key(tmp_path, patch, match):
    raw = {**yaml.safe_load(SMOKE.read_text()), **patch}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyError, match=match):
        load_study(path)


def test_a_row_may_not_change_the_shared_toy_data(tmp_path):
    raw = yaml.safe_load(SMOKE.read_text())
    raw["rows"][1]["overrides"] = ["--data.init_args.toy.splits.train=400"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyError, match="study's 'overrides:'"):
        load_study(path)


# ---------------------------------------------------------------------------------------------------------------------
# Merging and resuming, on hand-made records (no training)
# ---------------------------------------------------------------------------------------------------------------------


def _fake_record(out: Path, row: str, label: str, seed, ious: dict[str, list[float]]) -> None:
    """A run record as ``study.write_record`` writes it: run.json and per-scene scores."""
    folder = out / "runs" / row / (f"seed{seed}" if seed is not None else "single")
    folder.mkdir(parents=True)
    scenes = [
        {"set": s, "sample_id": f"toy-{s}-{i:06d}", "task": "rec", "iou": v, "format_ok": True}
        for s, vals in ious.items()
        for i, v in enumerate(vals)
    ]
    pd.DataFrame(scenes).to_csv(folder / "scenes.csv", index=False)
    metrics = {
        s: {"acc50": float(np.mean(np.array(v) >= 0.5)), "miou": float(np.mean(v)), "format": 1.0}
        for s, v in ious.items()
    }
    info = {"row": row, "label": label, "ablation": None, "seed": seed, "metrics": metrics, "seconds": {"eval": 1.0}}
    (folder / "run.json").write_text(json.dumps(info))


def test_merge_of_two_shards_builds_the_table_by_hand(tmp_path, capsys):
    a, b = tmp_path / "shard1", tmp_path / "shard2"
    four = {"test_id": [0.0, 0.2, 0.6, 0.8], "test_ood_crowded": [0.1, 0.1, 0.1, 0.1]}
    _fake_record(a, "original", "Original", None, four)
    _fake_record(a, "grpo", "GRPO", 0, {k: [v + 0.1 for v in vals] for k, vals in four.items()})
    _fake_record(b, "grpo", "GRPO", 1, {k: [v + 0.3 for v in vals] for k, vals in four.items()})
    _fake_record(b, "syn_grpo", "Syn-GRPO", 0, four)  # syn_grpo seed 1 is missing
    results = tmp_path / "results"
    assert study_main(["merge", str(SMOKE), str(a), str(b), "--results", str(results)]) == 0
    table = pd.read_csv(results / "table.csv").set_index(["row", "set", "metric"])
    # GRPO on test_id: seed means 0.5 and 0.7 -> 0.6 +- 12.706205 * 0.141421 / sqrt(2) = 0.6 +- 1.270620
    g = table.loc[("grpo", "test_id", "miou")]
    assert g["seeds"] == 2 and g["interval"] == "t" and g["mean"] == pytest.approx(0.6)
    assert (g["lo"], g["hi"]) == pytest.approx((0.6 - 1.270620, 0.6 + 1.270620), abs=1e-5)
    o = table.loc[("original", "test_ood_crowded", "miou")]  # one run, every scene 0.1: the bootstrap is [0.1, 0.1]
    assert o["interval"] == "bootstrap" and (o["mean"], o["lo"], o["hi"]) == pytest.approx((0.1, 0.1, 0.1))
    diffs = pd.read_csv(results / "differences.csv").set_index(["label", "set", "metric"])
    # GRPO - Original: every scene +0.1 (seed 0) or +0.3 (seed 1): the replicates lie between 0.1 and 0.3
    d = diffs.loc[("GRPO - Original", "test_ood_crowded", "miou")]
    assert d["diff"] == pytest.approx(0.2) and 0.1 - 1e-9 <= d["lo"] <= d["hi"] <= 0.3 + 1e-9 and d["excludes_zero"]
    assert ("Syn-GRPO - GRPO", "test_id", "miou") in diffs.index
    md = (results / "table.md").read_text()
    assert "t interval over seeds" in md and "paired bootstrap over scenes and seeds" in md
    assert "Missing runs" in md and "syn_grpo/seed1" in md
    assert "| GRPO | 2 | 60.0 [-67.1, 187.1] |" in md


def test_training_curves_by_hand(tmp_path, capsys):
    """``python -m runner.study training``: per run the mean of a curve over its steps, the t interval over seeds, thirds,
    and seed-paired differences; lines that are no training step are skipped, a cut line too."""
    out = tmp_path / "out"

    def curve(row, seed, values):
        path = out / "runs" / row / f"seed{seed}" / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": i, "train/reward/total": 1.0, "train/zero_variance_frac": v})
                 for i, v in enumerate(values)]  # fmt: skip
        path.write_text("\n".join([json.dumps({"epoch": 0, "synth/level/mean": 1.0}), *lines, '{"step": 9, "tr']))

    curve("grpo", 0, [0.3, 0.3, 0.0])  # mean 0.2; thirds 0.3 / 0.3 / 0.0
    curve("grpo", 1, [0.6, 0.3, 0.3])  # mean 0.4
    curve("syn_grpo", 0, [0.1, 0.1, 0.1])
    curve("syn_grpo", 1, [0.1, 0.1, 0.1])
    results = tmp_path / "results"
    args = ["training", str(SMOKE), str(out), "--results", str(results), "--key", "train/zero_variance_frac"]
    assert study_main(args) == 0
    table = pd.read_csv(results / "training.csv").set_index("row")
    g = table.loc["GRPO"]  # 0.3 +- 12.706205 * 0.141421 / sqrt(2)
    assert g["seeds"] == 2 and g["mean"] == pytest.approx(0.3) and g["hi"] == pytest.approx(0.3 + 1.270620, abs=1e-5)
    assert (g["third1"], g["third2"], g["third3"]) == pytest.approx((0.45, 0.3, 0.15))
    d = table.loc["Syn-GRPO - GRPO"]  # per seed -0.1 and -0.3
    assert bool(d["difference"]) and d["mean"] == pytest.approx(-0.2)
    assert "| GRPO | 2 | 30.0 [-97.1, 157.1] | 45.0 / 30.0 / 15.0 |" in (results / "training.md").read_text()
    assert study_main(["training", str(SMOKE), str(tmp_path / "empty")]) == 2
    assert "no training curves" in capsys.readouterr().err


def test_merge_without_records_says_what_to_pass(tmp_path, capsys):
    assert study_main(["merge", str(SMOKE), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--out folders" in err


def test_a_recorded_run_is_skipped(tmp_path, capsys):
    out = tmp_path / "out"
    _fake_record(out, "grpo", "GRPO", 0, {"test_id": [0.5]})
    assert study_main([str(SMOKE), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "# grpo/seed0 (done)" in text and "# grpo/seed1 (to run)" in text and "# original/single (to run)" in text
    assert study_main([str(SMOKE), "--out", str(out), "--dry-run", "--shard", "2/2"]) == 0
    assert capsys.readouterr().out.count("# ") == 2  # runs 2 and 4 of 5: grpo/seed0, syn_grpo/seed0


def _dry_run_fits_and_evaluations(tmp_path, capsys, flags: list[str]) -> tuple[list[str], list[str]]:
    """The smoke study's ``--dry-run`` command lines with ``flags``: (fits, evaluations), both non-empty."""
    assert study_main([str(SMOKE), "--out", str(tmp_path / "out"), "--dry-run", *flags]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    fits = [line for line in lines if " fit " in line]
    evals = [line for line in lines if " predict " in line or " test " in line]
    assert fits and evals
    return fits, evals


def test_eval_flags_of_a_call_reach_every_evaluation_and_no_fit(tmp_path, capsys):
    """``--eval-flag`` says where this call's evaluations run (the device's GPU); fits and the plan stay the same."""
    flags = ["--eval-flag=--trainer.accelerator=gpu", "--eval-flag=--data.init_args.eval_batch_size=128"]
    fits, evals = _dry_run_fits_and_evaluations(tmp_path, capsys, flags)
    assert all("--trainer.accelerator=gpu" in line and "eval_batch_size=128" in line for line in evals)
    assert not any("--trainer.accelerator=gpu" in line for line in fits)


def test_fit_flags_of_a_call_reach_every_fit_last_and_no_evaluation(tmp_path, capsys):
    """``--fit-flag`` says where this call's fits run; it comes after the rows' overrides, so it wins over them."""
    flags = ["--fit-flag=--trainer.accelerator=gpu", "--fit-flag=--model.init_args.engines.rollout_engine=fast"]
    fits, evals = _dry_run_fits_and_evaluations(tmp_path, capsys, flags)
    for line in fits:
        assert "--trainer.accelerator=gpu --model.init_args.engines.rollout_engine=fast --seed_everything=" in line
    assert not any("rollout_engine=fast" in line or "accelerator=gpu" in line for line in evals)


def test_run_points_starts_then_only_after_success_and_reports_each_exit(tmp_path):
    def point(name: str, code: str) -> Point:
        return Point(name, {}, [sys.executable, "-c", code], folder=tmp_path / name)

    ok, bad = point("ok", "print('fit')"), point("bad", "raise SystemExit(3)")
    ok.then = point("ok-eval", "print('eval')")
    ok.then.log_name = "eval.log"
    bad.then = point("never", "print('no')")
    done: list[tuple[str, int]] = []
    run_points([ok, bad], jobs=2, quiet=True, on_done=lambda p: done.append((p.name, p.returncode)))
    assert sorted(done) == [("bad", 3), ("ok", 0), ("ok-eval", 0)]
    assert (tmp_path / "ok-eval/eval.log").read_text().rstrip().endswith("eval")
    assert bad.then.returncode is None and not (tmp_path / "never").exists()


def test_read_evaluation_of_predict_and_of_test(tmp_path):
    pred = tmp_path / "p/predictions"
    pred.mkdir(parents=True)
    (pred / "summary.json").write_text(json.dumps({"test_id": {"acc50": 0.5, "miou": 0.45, "format": 1.0}}))
    rows = [
        {"sample_id": f"s{i}", "task": "rec", "rewards": {"accuracy": v}, "format_ok": True}
        for i, v in enumerate([0.3, 0.6])
    ]
    (pred / "test_id.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    per_set, scenes = read_evaluation(tmp_path / "p", "predict")
    assert per_set["test_id"]["miou"] == 0.45 and scenes["iou"].tolist() == [0.3, 0.6]
    res = tmp_path / "t/results"
    res.mkdir(parents=True)
    (res / "test.csv").write_text("set,acc50,miou,format\ntest_id,0.5,0.45,1.0\n")
    per_set, scenes = read_evaluation(tmp_path / "t", "test")
    assert per_set == {"test_id": {"acc50": 0.5, "miou": 0.45, "format": 1.0}} and scenes is None
    with pytest.raises(FileNotFoundError, match="eval.log"):
        read_evaluation(tmp_path / "nothing", "predict")


def test_image_queries_without_a_target_count_in_n_acc_not_in_miou(tmp_path):
    """An image set with no-target queries (test_nt): acc50 / miou over the queries with a target, as the set's summary
    (`callbacks.predictions.summarize`) computes them; the rejections are n_acc's, the answered targets t_acc's."""
    pred = tmp_path / "p/predictions"
    pred.mkdir(parents=True)
    (pred / "summary.json").write_text(json.dumps({"test_nt": {"miou": 0.4, "n_acc": 0.5}}))
    rows = [
        {"sample_id": "t0", "task": "rec", "rewards": {"accuracy": 0.6}, "format_ok": True, "no_target": False,
         "rejected": False, "answered": True},
        {"sample_id": "t1", "task": "rec", "rewards": {"accuracy": 0.2}, "format_ok": True, "no_target": False,
         "rejected": False, "answered": True},
        {"sample_id": "n0", "task": "rec", "rewards": {"accuracy": 1.0}, "format_ok": True, "no_target": True,
         "rejected": True, "answered": False},
        {"sample_id": "n1", "task": "rec", "rewards": {"accuracy": 0.0}, "format_ok": True, "no_target": True,
         "rejected": False, "answered": True},
    ]  # fmt: skip
    (pred / "test_nt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, scenes = read_evaluation(tmp_path / "p", "predict")
    rec = [{"scenes": scenes}]
    assert _scene_matrix(rec, "test_nt", "miou").tolist() == [[0.6, 0.2]]  # the summary's miou is their mean
    assert _scene_matrix(rec, "test_nt", "n_acc").tolist() == [[1.0, 0.0]]
    assert _scene_matrix(rec, "test_nt", "t_acc").tolist() == [[1.0, 1.0]]


def test_clip_records_give_per_clip_metrics_and_skip_clips_without_a_caption(tmp_path):
    """CycleGRPO's clip records (``predict``): tIoU / R1 per clip from the consistency, locatability / confusion per
    caption; a no-target clip has no caption, so it leaves the locatability matrix (the same clips for every run)."""
    pred = tmp_path / "p/predictions"
    pred.mkdir(parents=True)
    (pred / "summary.json").write_text(json.dumps({"test": {"tiou": 0.5, "locatability": 0.5}}))
    cycles = [{"located": True, "confused": False}, {"located": False, "confused": True}, None]
    rows = [
        {"sample_id": f"c{i}", "task": "video", "rewards": {"accuracy": v}, "format_ok": True, "scores": {"tiou": v},
         "cycle": c}
        for i, (v, c) in enumerate(zip([0.6, 0.4, 1.0], cycles))
    ]  # fmt: skip
    (pred / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, scenes = read_evaluation(tmp_path / "p", "predict")
    scenes.to_csv(tmp_path / "scenes.csv", index=False)  # what write_record stores, and load_records reads back
    scenes = pd.read_csv(tmp_path / "scenes.csv")
    rec = [{"scenes": scenes}, {"scenes": scenes}]
    assert _scene_matrix(rec, "test", "tiou").tolist() == [[0.6, 0.4, 1.0]] * 2
    assert _scene_matrix(rec, "test", "r1@0.5").tolist() == [[1.0, 0.0, 1.0]] * 2
    assert _scene_matrix(rec, "test", "locatability").tolist() == [[1.0, 0.0]] * 2  # c2: no target, no caption
    assert _scene_matrix(rec, "test", "confusion").tolist() == [[0.0, 1.0]] * 2
    assert _scene_matrix(rec, "test", "when") is None  # an interval clip has no when / where score
    assert _scene_matrix(rec, "test", "st") is None  # nor an Eq. 15 score: tIoU is not reported as st


# ---------------------------------------------------------------------------------------------------------------------
# The smoke study through real train.py processes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smoke_study_end_to_end(tmp_path):
    """Original + GRPO + Syn-GRPO x 2 seeds: 4 fits and 5 held-out evaluations, the table, then a second call that
    finds every run done, and the notebook's loader reading the runs per method."""
    out, results = tmp_path / "out", tmp_path / "results"
    cmd = [sys.executable, "-m", "runner.study", str(SMOKE), "-j", "1", "--out", str(out), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load_study(SMOKE)
    for r in plan(study, out)[0]:
        rec = json.loads((r.record / "run.json").read_text())
        assert set(rec["metrics"]) == set(study.test_splits), r.key
        scenes = pd.read_csv(r.record / "scenes.csv")
        assert len(scenes) == sum(study.test_splits.values()) and scenes["iou"].between(0, 1).all()
        for s in study.test_splits:  # the record is the evaluator's own summary, recomputed from its scenes
            assert rec["metrics"][s]["miou"] == pytest.approx(scenes[scenes["set"] == s]["iou"].mean())
        assert (r.record / "metrics.jsonl").is_file() == (r.train is not None)
    table = pd.read_csv(results / "table.csv")
    assert set(table["row"]) == {"original", "grpo", "syn_grpo"}
    assert table[table["row"] == "grpo"]["seeds"].eq(2).all() and table["lo"].le(table["mean"]).all()
    diffs = pd.read_csv(results / "differences.csv")
    assert {"GRPO - Original", "Syn-GRPO - Original", "Syn-GRPO - GRPO"} <= set(diffs["label"])
    assert "| Syn-GRPO - GRPO |" in (results / "table.md").read_text()

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "(5 done before)" in again.stdout and "[start]" not in again.stdout

    runs = analysis.load_runs(str(out / "runs"))
    assert sorted(figures.method_of(r) for r in runs) == ["grpo", "grpo", "syn_grpo", "syn_grpo"]
    fig = figures.plot_collapse_by_method(runs)
    assert figures.save_figure(fig, tmp_path / "fig", "collapse_by_method").stat().st_size > 1000


def test_a_study_of_eleven_methods_gets_eleven_colours():
    """Table 1's study has 11 methods: tab10 gave the 11th GRPO's colour; every line of up to 20 has its own."""
    for n in (3, 11, 20):
        colour = figures._palette(n)
        assert len({colour(i) for i in range(n)}) == n


# Each study's own fit command line of one row, two real steps. The default suite runs the rows whose overrides take a
# path no other test takes (the crowded mix, the step-back rule, the doubled clips, in-step evolution, the no-target
# group size); the others are `slow` (`make test-slow`; the long runs' batch, ~50 s): their command lines are parsed in
# the default suite (test_the_cli_accepts_one_run_of_every_row), and experiments/ is not the product (issue 39).
@pytest.mark.slow  # two real fit steps per study row, ~6-40 s each: CI runs them (make test-slow)
@pytest.mark.parametrize(
    "path,row",
    [
        pytest.param(*(CROWDED, "cycle"), id="crowded"),
        pytest.param(*(REPO / "experiments/study/evolved_toy_stepback.yaml", "evolved_back2"), id="stepback"),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_st.yaml", "cycle"), id="st", marks=pytest.mark.slow
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_isolate.yaml", "evolved_isolate"),
            id="isolate",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_zoom.yaml", "evolved_zoom"), id="zoom", marks=pytest.mark.slow
        ),
        pytest.param(*(REPO / "experiments/study/evolved_toy_in_step.yaml", "evolved_in_step"), id="in_step"),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_in_step.yaml", "grpo_resample"),
            id="resample",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_temporal_5seeds.yaml", "localization_only"),
            id="temporal_5seeds",
            marks=pytest.mark.slow,
        ),
        pytest.param(*(REPO / "experiments/study/cycle_ablation_toy_temporal_long.yaml", "cycle"), id="temporal_long"),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_temporal_no_target.yaml", "cycle"),
            id="temporal_no_target",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_temporal_no_target_nk.yaml", "localization_only"),
            id="temporal_no_target_nk",
        ),
        pytest.param(*(IMAGE_PREDICT, "caption_only"), id="predict", marks=pytest.mark.slow),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop.yaml", "evolved_in_step"),
            id="multihop",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_anchors.yaml", "grpo_resample"),
            id="multihop_anchors",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_chains.yaml", "evolved_in_step"),
            id="multihop_chains",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_chains_gentle.yaml", "evolved_lr5e6"),
            id="multihop_chains_gentle",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_chains_pool192.yaml", "evolved_in_step"),
            id="multihop_chains_pool192",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_chains_long.yaml", "evolved_in_step"),
            id="multihop_chains_long",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/evolved_toy_multihop_anchors_long.yaml", "grpo"),
            id="multihop_anchors_long",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_long.yaml", "cycle"), id="cycle_long", marks=pytest.mark.slow
        ),
        pytest.param(
            *(REPO / "experiments/study/cycle_ablation_toy_temporal_long_gpu.yaml", "cycle"),
            id="temporal_long_gpu",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_row_of_each_new_study_fits_real_steps(path, row, tmp_path, monkeypatch):
    """The study's own fit command line of one row (its overrides: the crowded mix, the step-back rule, the anchor
    space), two real optimizer steps with validation off, through train.py's CLI in process."""
    monkeypatch.chdir(REPO)
    study = load_study(path)
    runs, _ = plan(study, tmp_path / "out")
    run = next(r for r in runs if r.row.name == row and r.train is not None)
    argv = list(run.train.argv)
    start = [a.split("=", 1)[1] for a in argv if a.startswith("--model.init_args.policy.model_name_or_path=")]
    if start and missing_checkpoint_message(start[-1]):
        # a toy checkpoint git does not keep (built by its make target): the row's command line runs from the kept
        # checkpoint of the same family (the same architecture and format); this test checks that it runs, not its
        # numbers
        kept = (
            "checkpoints/toy-qwen2.5-vl-cycle-video" if "cycle" in start[-1] else "checkpoints/toy-qwen2.5-vl-evolved"
        )
        argv.append(f"--model.init_args.policy.model_name_or_path={kept}")
    prepare_data(
        [run], evaluation=False, resolve=_print_config
    )  # the training splits only: the fit reads no test split
    extra = []
    # the _long studies' steps of 16 questions x 6 (8 scenes x 12) run on the device's GPU; here 4 per step
    if path.stem in (
        "evolved_toy_multihop_chains_long",
        "evolved_toy_multihop_anchors_long",
        "cycle_ablation_toy_long",
    ):
        batch = 16 if path.stem.startswith("evolved") else 8
        assert f"--data.init_args.batch_size={batch}" in run.train.argv
        extra = ["--data.init_args.batch_size=4"]
    cli = cli_main([*argv[2:], "--trainer.max_steps=2", "--trainer.limit_val_batches=0", *extra])
    assert cli.trainer.global_step == 2
    assert any(k.startswith("train/") for k in cli.trainer.logged_metrics)
    if row == "evolved_back2":  # the rule the row varies reached the strategy
        synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
        assert synth.strategy.levels.back_after == 2
    if path.stem == "cycle_ablation_toy_temporal_long":  # twice the base config's training clips reached the data
        assert len(cli.datamodule.train_set) > 24  # the clips of 48 with a target (the base config: 22 of 24)
        assert all(r.raw["solution"] for r in cli.datamodule.train_set.records)  # as recorded: only clips with a target
    if path.stem == "cycle_ablation_toy_long":  # 640 fresh training scenes
        assert len(cli.datamodule.train_set) == 640
    if path.stem == "cycle_ablation_toy_temporal_long_gpu":  # 256 fresh clips, the no-target ones in groups of N x K
        assert len(cli.datamodule.train_set) == 256 and cli.model.method.K0 == 16
    if path.stem.startswith("cycle_ablation_toy_temporal_no_target"):  # all 48 clips, the no-target ones included
        assert len(cli.datamodule.train_set) == 48 and not all(
            r.raw["solution"] for r in cli.datamodule.train_set.records
        )
        nk = 16 if path.stem.endswith("_nk") else 4  # the no-target group's size reached the method
        assert cli.model.method.K0 == nk
    if row == "evolved_lr5e6":  # the gentler learning rate reached the optimizer, the in-step rule the method
        assert cli.trainer.optimizers[0].defaults["lr"] == 5.0e-6 and cli.model.method.reroll == "evolve"
    if row in ("evolved_in_step", "grpo_resample"):  # the in-step rule reached the method
        assert cli.model.method.reroll == ("evolve" if row == "evolved_in_step" else "resample")
        assert "train/level/reroll/frac" in cli.trainer.logged_metrics
    if path.stem.startswith("evolved_toy_multihop"):  # a pool of multi-step questions
        assert {r.meta["level"] for r in cli.datamodule.train_set.records} == {3, 5}
        pool = {"_pool192": 192, "_long": 1280}
        assert len(cli.datamodule.train_set) == next((n for k, n in pool.items() if path.stem.endswith(k)), 96)
        rest = path.stem.removeprefix("evolved_toy_multihop")
        stage = "evolved-chains-anchor" if rest.startswith("_chains") else "evolved-anchors" if rest else "evolved-long"
        assert start[-1].endswith(stage)  # the study starts from its stage (here perhaps swapped: see above)
    if path.stem == "evolved_toy_multihop":  # its ladder: the questions' own sub-problems
        synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
        assert synth.strategy.levels.max_level == 0 and cli.model.method.rule.max_level == 0
    if row in ("evolved_isolate", "evolved_zoom"):
        synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
        assert synth.strategy.levels.sub_levels == 2
        assert synth.strategy.easier == row.removeprefix("evolved_")
