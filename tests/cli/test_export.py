"""``train.py export`` then ``from_pretrained`` then ``train.py predict`` reproduces ``train.py test`` of the checkpoint.

One short GRPO fit of the embedded toy checkpoint on a few toy scenes writes ``last.ckpt``; the test metrics of that
checkpoint are the reference. The exported HF directory loads with ``from_pretrained`` (the same weights), tests to
the same metrics through ``--model.init_args.policy.model_name_or_path``, and ``predict`` writes the same answers as JSONL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from train import cli_main

REPO = Path(__file__).resolve().parents[2]
TOY_CKPT = REPO / "checkpoints/toy-qwen2.5-vl"


@pytest.fixture(scope="module")
def toy_rec(tmp_path_factory) -> Path:
    from datamodules.toy import export_jsonl

    root = tmp_path_factory.mktemp("toy_rec")
    export_jsonl(root, "train", 4, seed=0, task="rec")
    export_jsonl(root, "val", 6, seed=1, task="rec")
    return root


def _config(tmp: Path, data: Path) -> Path:
    cfg = {
        "name": "export-test",
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp / "run"),
            "logger": False,
        },
        "callbacks": {
            "checkpoint": {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"save_last": True},
            },
            "results": {"class_path": "callbacks.results.ResultsTable"},
            "predictions": {"class_path": "callbacks.predictions.PredictionsJSONL"},
        },
        "model": {
            "class_path": "GRPOModule",
            "init_args": {
                "policy": {"model_name_or_path": str(TOY_CKPT), "dtype": "fp32"},
                "sampling": {"prompt_template": "toy", "group_size": 2, "max_new_tokens": 96},
                "engines": {"micro_batch_size": 4},
                "kl": {"coef": 0.04},
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}},
            },
        },
        "data": {
            "class_path": "RECDataModule",
            "init_args": {
                "data_root": str(data),
                "train_files": ["train.jsonl"],
                "test_files": {"toy_val": "val.jsonl"},
                "batch_size": 2,
                "eval_batch_size": 6,
            },
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_export_from_pretrained_predict_reproduce_the_checkpoint(toy_rec, tmp_path):
    from transformers import AutoModelForImageTextToText

    cfg = str(_config(tmp_path, toy_rec))
    fit = cli_main(["fit", "--config", cfg])
    ckpt = tmp_path / "run/checkpoints/last.ckpt"
    assert fit.trainer.global_step == 1 and ckpt.is_file()

    test = cli_main(["test", "--config", cfg, "--ckpt_path", str(ckpt)])
    assert test.model.reference is None  # evaluating a checkpoint never builds the frozen reference
    # each stage keeps its own config copy: the test stage never overwrites the fit's
    assert (tmp_path / "run/config.yaml").is_file() and (tmp_path / "run/config-test.yaml").is_file()
    ref = {k: float(v) for k, v in test.trainer.callback_metrics.items() if k.startswith("test/toy_val/")}
    assert set(ref) >= {"test/toy_val/acc50", "test/toy_val/miou", "test/toy_val/format"}

    out = tmp_path / "hf"
    saved = str(tmp_path / "run/config.yaml")  # the run's own saved config, as it is (it names fit's weights_only)
    exp = cli_main(["export", "--config", saved, "--ckpt_path", str(ckpt), "--out", str(out)])
    assert exp.model.reference is None
    for name in ("config.json", "model.safetensors", "generation_config.json", "prompt_template.json", "README.md"):
        assert (out / name).is_file(), name
        assert (out / name).stat().st_mode & 0o044 == 0o044, f"{name} is not readable by group and others"
    assert json.loads((out / "prompt_template.json").read_text())["name"] == "toy"
    assert json.loads((out / "generation_config.json").read_text())["do_sample"] is False

    loaded = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, state[f"policy.{name}"]), name

    hf = ["--model.init_args.policy.model_name_or_path", str(out)]
    again = cli_main(["test", "--config", cfg, *hf])
    got = {k: float(v) for k, v in again.trainer.callback_metrics.items() if k.startswith("test/toy_val/")}
    assert got == pytest.approx(ref)

    cli_main(["predict", "--config", cfg, *hf])
    rows = [json.loads(line) for line in (tmp_path / "run/predictions/toy_val.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {"completion", "boxes", "rewards", "sample_id"} <= set(rows[0])
    summary = json.loads((tmp_path / "run/predictions/summary.json").read_text())["toy_val"]
    assert summary["acc50"] == pytest.approx(ref["test/toy_val/acc50"])
    assert summary["miou"] == pytest.approx(ref["test/toy_val/miou"], abs=1e-5)
    assert summary["format"] == pytest.approx(ref["test/toy_val/format"])


@pytest.mark.parametrize(
    "config,splits,sets",
    [
        ("cycle_tiny.yaml", {"test_id": 6}, ["test_id"]),
        ("cycle_tiny_temporal.yaml", {"test": 8}, ["test"]),
        ("cycle_tiny_st.yaml", {"test": 6}, ["test"]),
    ],
    ids=["boxes", "intervals", "anchors"],
)
def test_cycle_predict_records_reproduce_its_test_metrics(config, splits, sets, tmp_path, monkeypatch):
    """CycleGRPO's ``predict`` records (per sample: the grounding's consistency, per-clip scores, the cycle's
    located / confused) average to the metrics ``train.py test`` logs for the same checkpoint: what lets a study
    bootstrap its video and locatability columns over samples (study.report.SCENE_METRICS)."""
    monkeypatch.chdir(REPO)
    video = config != "cycle_tiny.yaml"
    files = {s: f"{s}_video.jsonl" if video else f"{s}.jsonl" for s in sets}
    args = [
        "--config",
        f"configs/{config}",
        f"--data.init_args.toy.splits={json.dumps(splits)}",
        f"--data.init_args.test_files={json.dumps(files)}",
        "--data.init_args.max_eval_samples=null",
        f"--data.init_args.data_root={tmp_path / 'data'}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--model.init_args.sampling.max_new_tokens=48",
    ]
    test = cli_main(["test", *args])
    cli_main(["predict", *args])
    for s in sets:
        ref = {
            k.rsplit("/", 1)[1]: float(v)
            for k, v in test.trainer.callback_metrics.items()
            if k.startswith(f"test/{s}/")
        }
        summary = json.loads((tmp_path / "run/predictions/summary.json").read_text())[s]
        shared = set(ref) & set(summary)
        want = {"locatability", "confusion"} | (
            {"acc50", "miou"} if not video else {"tiou", "r1@0.5", "t_acc"} if "temporal" in config else {"st", "when"}
        )
        assert want <= shared, (sorted(ref), sorted(summary))
        for k in shared:
            assert summary[k] == pytest.approx(ref[k], abs=1e-5), k
        rows = [json.loads(line) for line in (tmp_path / f"run/predictions/{s}.jsonl").read_text().splitlines()]
        assert len(rows) == splits[s]
        assert sum(r.get("cycle") is not None for r in rows) >= 1
