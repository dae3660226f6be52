"""Run logging end to end: a tiny GRPO fit with the offline-aware W&B logger, the metrics JSONL, the rollout gallery
and the results table; plus the pieces on their own (offline decision, the JSONL reader's resume rules, the table)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import yaml

from callbacks.logging import MetricsJSONL, OfflineAwareWandbLogger, json_safe, wandb_should_be_offline
from callbacks.results import ResultsTable, collect_results, markdown_table, paper_row
from runner.analysis import load_runs
from runner.runs import read_metrics_jsonl
from runner.wandb_runs import iter_wandb_records, load_wandb_offline, read_wandb_offline, wandb_run_complete
from train import cli_main

CURVE_KEYS = (
    "train/reward/total",
    "train/reward/accuracy",
    "train/reward/format",
    "train/reward/diversity",
    "train/entropy",
    "train/diversity/gt",
    "train/diversity/smoothed",
    "train/diversity/global_avg",
    "train/zero_variance_frac",
    "train/kl",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/iou",
    "train/acc50",
)


def tiny_fit_config(
    path: Path, model_dir: Path, data_root: Path, out: Path, *, loggers: list, callbacks: list, epochs: int = 2
) -> Path:
    """A 1-batch-per-epoch GRPO fit on the tiny model: ``epochs`` training steps, a validation after each."""
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": epochs,
            "limit_train_batches": 1,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "default_root_dir": str(out),
            "logger": loggers or False,
            "callbacks": callbacks,
        },
        "model": {
            "class_path": "lightning_modules.grpo.GRPOModule",
            "init_args": {
                "policy": {"model_name_or_path": str(model_dir), "dtype": "fp32"},
                "sampling": {"prompt_template": "toy", "group_size": 3, "max_new_tokens": 12},
                "engines": {"micro_batch_size": 6},
                "kl": {"coef": 0.04},
                "method": {
                    "class_path": "lightning_modules.methods.syn_grpo.SynGRPO",
                    "init_args": {"diversity_beta": 0.5},
                },
            },
        },
        "data": {
            "class_path": "datamodules.rec.RECDataModule",
            "init_args": {
                "data_root": str(data_root),
                "train_files": ["train.jsonl"],
                "val_files": {"rec_val": "val.jsonl"},
                "batch_size": 2,
                "eval_batch_size": 4,
            },
        },
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture()
def quiet_wandb(tmp_path, monkeypatch):
    """No API key and no WANDB_MODE (so the logger must decide offline by itself); W&B's own files stay in tmp."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def test_tiny_fit_writes_wandb_offline_run_metrics_jsonl_and_gallery(tiny_model_dir, rec_dir, tmp_path, quiet_wandb):
    out = tmp_path / "run"
    cfg = tiny_fit_config(
        tmp_path / "fit.yaml",
        tiny_model_dir,
        rec_dir,
        out,
        loggers=[
            {
                "class_path": "callbacks.logging.OfflineAwareWandbLogger",
                "init_args": {"save_dir": str(out), "name": "syn-grpo-tiny", "tags": ["test"]},
            }
        ],
        callbacks=[
            {"class_path": "callbacks.logging.MetricsJSONL"},
            {
                "class_path": "callbacks.logging.RolloutGallery",
                "init_args": {"num_samples": 2, "train_every_n_steps": 1},
            },
            {"class_path": "callbacks.results.ResultsTable", "init_args": {"during_fit": True}},
            {"class_path": "callbacks.completions.CompletionsTable", "init_args": {"every_n_steps": 2}},
        ],
    )
    cli = cli_main(["fit", "--config", str(cfg)])
    trainer = cli.trainer
    assert trainer.global_step == 2
    assert isinstance(trainer.logger, OfflineAwareWandbLogger) and trainer.logger.offline

    # --- W&B offline run: curves, hparams and images
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, list((out / "wandb").iterdir()) if (out / "wandb").exists() else "no wandb dir"
    deadline = time.monotonic() + 30
    while not wandb_run_complete(run_dirs[0]) and time.monotonic() < deadline:
        time.sleep(0.2)  # the W&B service may still be flushing the run log after finish()
    rows, config, name = read_wandb_offline(run_dirs[0])
    log = next(run_dirs[0].glob("run-*.wandb"))  # the log read while it is written: a torn last chunk ends it
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / log.name).write_bytes(log.read_bytes()[:-3])
    assert not wandb_run_complete(tmp_path / "torn") and any(iter_wandb_records(tmp_path / "torn" / log.name))
    assert name == "syn-grpo-tiny"
    assert config["method"]["init_args"]["diversity_beta"] == 0.5
    # the full resolved config, not only the module's hparams: trainer, data, seed, callbacks, optimizer
    assert config["trainer"]["max_epochs"] == 2 and config["data"]["init_args"]["batch_size"] == 2
    assert config["seed_everything"] == 0 and "optimizer" in config["model"]["init_args"]
    keys = {k for r in rows for k in r}
    for key in (*CURVE_KEYS, "val/rec_val/acc50", "val/rec_val/miou"):
        assert key in keys, key
    assert sum("train/entropy" in r for r in rows) == 2  # one point per training step
    assert {"val/gallery/_type", "train/rollouts/_type", "train/completions/_type"} <= keys
    # the completions table: at step 1 and 2 (every 2), one row per completion of the first 2 prompts (G = 3)
    comp = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in comp] == [1] * 6 + [2] * 6
    assert {"completion", "boxes", "gt_boxes", "total", "accuracy", "format", "diversity"} <= set(comp[0])
    media = sorted((run_dirs[0] / "files/media/images").rglob("*.png"))
    assert len([m for m in media if "gallery" in m.name]) == 2 * 2  # 2 samples x 2 validations
    assert all(m.stat().st_size > 0 for m in media)

    # --- gallery PNGs under default_root_dir
    pngs = sorted((out / "gallery").glob("*.png"))
    assert len([p for p in pngs if p.name.startswith("val_e000_")]) == 2
    assert len([p for p in pngs if p.name.startswith("train_s")]) == 2
    assert all(p.stat().st_size > 0 for p in pngs)

    # --- metrics JSONL: one line per training step and per validation, between start and end
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["start", "train", "val", "train", "val", "end"]
    assert lines[-1]["status"] == "finished" and lines[-1]["error"] is None
    start = lines[0]
    assert start["run"] == "syn-grpo-tiny" and start["stage"] == "fit" and not start["resumed"]
    assert start["hparams"]["method"]["init_args"]["diversity_beta"] == 0.5
    train = [r for r in lines if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and [r["epoch"] for r in train] == [0, 1]
    for key in CURVE_KEYS:
        assert all(key in r for r in train), key
    last_logged = trainer.callback_metrics  # holds the last step's values
    assert train[-1]["train/entropy"] == pytest.approx(float(last_logged["train/entropy"]))
    val = [r for r in lines if r["event"] == "val"]
    assert [(r["step"], r["epoch"]) for r in val] == [(1, 0), (2, 1)]
    assert all(0.0 <= r["val/rec_val/acc50"] <= 1.0 and "val/rec_val/miou" in r for r in val)

    # --- the same curves through both readers
    (run,) = read_metrics_jsonl(out / "metrics.jsonl")
    wb = load_wandb_offline(run_dirs[0])
    assert run.beta == 0.5 == wb.beta
    assert run.train["step"].tolist() == wb.train["step"].tolist() == [1, 2]  # one step axis for both sources
    assert run.train["train/entropy"].tolist() == pytest.approx(wb.train["train/entropy"].tolist(), rel=1e-6)
    assert run.val["step"].tolist() == wb.val["step"].tolist()
    assert run.val["val/rec_val/acc50"].tolist() == pytest.approx(wb.val["val/rec_val/acc50"].tolist())
    assert [r.label for r in load_runs([str(out)])] == ["syn-grpo-tiny"]

    # --- results table written after each validation of the fit
    md = (out / "results/val.md").read_text()
    assert "rec_val" in md and "Acc@0.5" in md
    assert (out / "results/val.csv").read_text().splitlines()[0].startswith("set,acc50,miou")


def test_offline_decision_from_the_environment():
    assert wandb_should_be_offline({})
    assert not wandb_should_be_offline({"WANDB_API_KEY": "x"})
    assert wandb_should_be_offline({"WANDB_API_KEY": "x", "WANDB_MODE": "offline"})
    assert not wandb_should_be_offline({"WANDB_MODE": "online"})
    assert not wandb_should_be_offline({"WANDB_SWEEP_ID": "abc"})  # a sweep agent's run must report to the sweep


def test_offline_logger_does_not_touch_the_process_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    lg = OfflineAwareWandbLogger(save_dir=str(tmp_path), project="p", tags=["a"])
    assert lg.offline and lg._wandb_init["mode"] == "offline" and lg._wandb_init["tags"] == ["a"]
    assert "WANDB_MODE" not in os.environ  # WandbLogger(offline=True) would have set it
    with pytest.raises(ValueError, match="log_model"):
        OfflineAwareWandbLogger(save_dir=str(tmp_path), offline=True, log_model=True)


def test_json_safe_writes_strict_json():
    row = json_safe({"a": torch.tensor(0.5), "b": float("nan"), "c": [torch.tensor([1, 2])], "d": Path("x")})
    assert row == {"a": 0.5, "b": None, "c": [[1, 2]], "d": "x"}
    json.dumps(row, allow_nan=False)
    with pytest.raises(ValueError, match="every_n_steps"):
        MetricsJSONL(every_n_steps=0)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "train", "ste')  # torn last line
    return path


def test_reader_splits_runs_and_applies_resumes(tmp_path):
    def start(run, step=0, resumed=False, run_id=None, beta=0.7, stage="fit"):
        return {
            "event": "start",
            "run": run,
            "run_id": run_id,
            "stage": stage,
            "resumed": resumed,
            "step": step,
            "hparams": {"diversity_beta": beta, "diversity_weight": 1.0},
        }

    def train(step, ent):
        return {"event": "train", "step": step, "epoch": 0, "train/entropy": ent}

    rows = [
        start("a", run_id="r1"),
        train(1, 1.0),
        train(2, 0.9),
        train(3, 0.8),
        train(4, 0.7),
        {"event": "val", "step": 4, "epoch": 0, "stage": "fit", "val/x/acc50": 0.2},
        train(5, 0.6),
        train(6, 0.5),  # crash after step 6; the checkpoint was at step 4
        start("a", step=4, resumed=True, run_id="r1"),
        train(5, 0.65),
        train(6, 0.55),
        {"event": "val", "step": 6, "epoch": 1, "stage": "fit", "val/x/acc50": 0.4},
        start("a", run_id="r2", beta=0.3),
        train(1, 2.0),
        start("a", stage="validate", beta=0.3),
        {"event": "val", "step": 1, "epoch": 0, "stage": "validate", "val/x/acc50": 0.1},
    ]
    runs = load_runs([str(_write_jsonl(tmp_path / "metrics.jsonl", rows))])
    assert len(runs) == 2
    a, b = runs
    assert a.train["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert a.train["train/entropy"].tolist() == [1.0, 0.9, 0.8, 0.7, 0.65, 0.55]  # the resumed segment wins
    assert a.val["val/x/acc50"].tolist() == [0.2, 0.4]
    assert b.train["step"].tolist() == [1] and b.val["val/x/acc50"].tolist() == [0.1]
    assert (a.beta, b.beta) == (0.7, 0.3)
    assert {a.label, b.label} == {"a diversity_beta=0.7", "a diversity_beta=0.3"}  # same name: labels say what differs


def test_results_table_layouts(tmp_path, capsys):
    metrics = {
        "test/refcoco_val/acc50": torch.tensor(0.625),
        "test/refcoco_val/miou": torch.tensor(0.5512),
        "test/refcoco_val/format": 1.0,
        "test/d3/map": 0.12,
        "test/d3/map_50": 0.3,
        "test/d3/gp": 0.5,
        "test/d3/gr": float("nan"),
        "test/d3/format": 0.9,
        "val/other/acc50": 0.1,
        "train/reward/total": 2.0,
    }
    res = collect_results(metrics, "test")
    assert list(res) == ["refcoco_val", "d3"] and res["refcoco_val"]["acc50"] == pytest.approx(0.625)
    table = markdown_table(res)
    head, sep, row1, row2 = table.splitlines()
    assert head.split("|")[1:-1] == [c.center(len(c)) for c in head.split("|")[1:-1]]
    assert [c.strip() for c in head.split("|")[1:-1]] == [
        "set",
        "Acc@0.5",
        "mIoU",
        "mAP",
        "mAP@50",
        "GP",
        "GR",
        "format",
    ]
    assert [c.strip() for c in row1.split("|")[1:-1]] == ["refcoco_val", "62.5", "55.1", "-", "-", "-", "-", "100.0"]
    assert [c.strip() for c in row2.split("|")[1:-1]] == ["d3", "-", "-", "12.0", "30.0", "50.0", "nan", "90.0"]
    assert paper_row(res, "Syn-GRPO", ["acc50", "map"]).splitlines()[2] == "| Syn-GRPO | 62.5 | 12.0 |"
    # clips: CycleGRPO's temporal metrics, and the video SFT stage's sets qualified by their region space
    clips = {"val/toy_video_val/interval/tiou": 0.25, "val/toy_video_val/anchor/st": 0.5, "val/v/r1@0.5": 1.0}
    clips["val/a/b/c/tiou"] = 1.0  # two qualifiers: not a table key
    res_v = collect_results(clips, "val")
    assert res_v == {
        "toy_video_val/interval": {"tiou": 0.25},
        "toy_video_val/anchor": {"st": 0.5},
        "v": {"r1@0.5": 1.0},
    }
    assert [c.strip() for c in markdown_table(res_v).splitlines()[0].split("|")[1:-1]] == [
        "set",
        "tIoU",
        "R1@0.5",
        "st",
    ]

    class _State:
        fn = "test"

    class _Trainer:  # what ResultsTable reads from a trainer
        sanity_checking = False
        is_global_zero = True
        state = _State()
        callback_metrics = metrics
        default_root_dir = str(tmp_path / "eval")
        global_step = 7
        current_epoch = 1
        loggers: list = []

    ResultsTable().on_test_end(_Trainer(), None)
    printed = capsys.readouterr().out
    assert "refcoco_val" in printed and "62.5" in printed
    assert (tmp_path / "eval/results/test.csv").read_text().splitlines()[1].startswith("refcoco_val,0.625")
    assert (
        "| method | refcoco_val Acc@0.5 | d3 mAP | d3 GP | d3 GR |" in (tmp_path / "eval/results/test.md").read_text()
    )


def test_resumed_fit_continues_its_wandb_run(tiny_model_dir, rec_dir, tmp_path, quiet_wandb):
    """The W&B run id travels in the checkpoint (cli.run_config.RunConfigCallback): a fit resumed from it logs into the same
    run, and the run starts only after the model loaded (a bad model path leaves no W&B run at all)."""
    out = tmp_path / "run"
    loggers = [{"class_path": "callbacks.logging.OfflineAwareWandbLogger", "init_args": {"finish_on_end": True}}]
    ckpt_dir = str(out / "checkpoints")
    ckpt = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"save_last": True, "dirpath": ckpt_dir},
        }
    ]
    cfg = tiny_fit_config(
        tmp_path / "fit.yaml", tiny_model_dir, rec_dir, out, loggers=loggers, callbacks=ckpt, epochs=1
    )
    first = cli_main(["fit", "--config", str(cfg), "--trainer.enable_checkpointing", "true"])
    run_id = first.trainer.logger._wandb_init.get("id")
    assert run_id and (out / "checkpoints/last.ckpt").is_file()
    second = cli_main(
        [
            "fit",
            "--config",
            str(cfg),
            "--trainer.enable_checkpointing",
            "true",
            "--trainer.max_epochs",
            "2",
            "--ckpt_path",
            str(out / "checkpoints/last.ckpt"),
        ]
    )
    assert second.trainer.global_step == 2
    assert second.trainer.logger._wandb_init.get("id") == run_id
    runs = sorted((out / "wandb").glob("offline-run-*"))  # one folder per segment (W&B adds -1 within one second)
    assert len(runs) == 2 and all(run_id in p.name for p in runs), [p.name for p in runs]

    broken = tmp_path / "broken-model"  # a config.json that from_pretrained cannot use: fails in configure_model
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    bad = tmp_path / "bad"
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises; what matters is what is left behind
        cli_main(
            ["fit", "--config", str(cfg), "--trainer.default_root_dir", str(bad), "--trainer.logger.init_args.save_dir"]
            + [str(bad), "--model.init_args.policy.model_name_or_path", str(broken)]
        )
    assert not (bad / "wandb").exists()


def test_metrics_jsonl_records_what_callbacks_log_at_epoch_end(tmp_path):
    """A callback's epoch-end logs (the synthesis callback's ``synth/*``, ``synth/level/*``) reach metrics.jsonl as one
    ``epoch`` row per epoch, which the reader serves as ``Run.epochs``."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Levels(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pl_module.log_dict({"synth/level/mean": float(trainer.current_epoch) + 0.5, "synth/swaps": 2.0})

    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Levels(), MetricsJSONL()],
    )
    torch.manual_seed(0)
    trainer.fit(BoringModel())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["event"] == "epoch"]
    assert [(r["epoch"], r["synth/level/mean"], r["synth/swaps"]) for r in epochs] == [
        (0, 0.5, 2.0),
        (1, 1.5, 2.0),
        (2, 2.5, 2.0),
    ]
    (run,) = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert run.epochs["synth/level/mean"].tolist() == [0.5, 1.5, 2.5] and run.epochs["epoch"].tolist() == [0, 1, 2]


def test_gallery_scores_a_no_target_query_without_a_box_to_compare():
    from callbacks.logging import _rec_score

    assert _rec_score([[0, 0, 10, 10]], [[0, 0, 10, 20]]) == "IoU 0.50"
    assert _rec_score([], [[0, 0, 10, 20]]) == "no box"
    assert _rec_score([[0, 0, 10, 10]], []) == "no target: false alarm"
    assert _rec_score([], []) == "no target: no box"


def test_a_group_panel_s_key_names_every_colour_it_draws():
    from callbacks.logging import _GROUP_COLOURS, GT_COLOUR, gallery_key

    six = gallery_key(6, _GROUP_COLOURS)  # G = 6: ground truth and #0 ... #5, each in its box's colour
    assert six == [(GT_COLOUR, "ground truth")] + [(_GROUP_COLOURS[k], f"#{k}") for k in range(6)]
    assert gallery_key(1, _GROUP_COLOURS)[1][1] == "prediction"
    assert "then the colours repeat" in gallery_key(len(_GROUP_COLOURS) + 2, _GROUP_COLOURS)[-1][1]


def test_gallery_text_wraps_between_words_and_lineage_labels_say_which_epoch_trains_on_a_version():
    from callbacks.gallery import version_label, wrap

    lines = wrap("a striped blue and white background with many small green triangles", 120, max_lines=10)
    assert all(len(line) <= 20 for line in lines) and " ".join(lines).split() == (
        "a striped blue and white background with many small green triangles".split()
    )
    assert wrap("one two three four five six seven eight nine ten", 60, max_lines=2)[-1].endswith("...")
    # a version painted from epoch 0's descriptions is swapped in at its end, stored with epoch 1: the first to train
    # on it; the swap at the last epoch's end (a 3-epoch run: epochs 0-2) makes one no epoch trains on
    assert version_label(0, 0) == "original (from epoch 0)" and version_label(1, 1) == "v1 (from epoch 1)"
    assert version_label(2, 2, max_epochs=3) == "v2 (from epoch 2)"
    assert version_label(3, 3, max_epochs=3) == "v3 (after the last epoch)"
