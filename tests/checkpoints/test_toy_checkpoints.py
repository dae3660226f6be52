"""Git keeps three toy checkpoints; a config that starts from another one fails with one line naming the ``make``
command that builds it and how long it takes (``cli.toy_checkpoints``); the tiny run keeps its last checkpoint only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli.toy_checkpoints import BUILDS, KEPT, missing_checkpoint_message
from core.config_files import load_config

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _model_path(config: Path) -> str | None:
    model = load_config(config).get("model") or {}
    init = model.get("init_args") or {}
    return (init.get("policy") or init).get("model_name_or_path")


def test_git_keeps_the_three_toy_checkpoints_and_no_other_weights():
    proc = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"the tests run in a git checkout of the project: {proc.stderr}"
    folders = {
        str(Path(f).parent)
        for f in proc.stdout.split()
        if f.endswith(WEIGHTS) and not f.startswith(("experiments/", "tests/"))
    }
    assert folders == {f"checkpoints/{k}" for k in KEPT}


def test_every_make_target_of_the_table_exists_and_every_stage_is_in_it():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    for name, build in BUILDS.items():
        words = build.make.split()
        assert words[0] == "make" and build.takes.startswith("about "), name
        assert {w for w in words[1:] if "=" not in w} <= targets, (name, build.make)
    stages = [
        yaml.safe_load(p.read_text())["model"].get("init_args", {}) for p in (REPO / "configs").glob("toy_sft*.yaml")
    ]
    exports = {Path(a["export_dir"]).name for a in stages if str(a.get("export_dir")).startswith("checkpoints/")}
    assert exports - {"toy-qwen2.5-vl"} and exports <= set(BUILDS), exports - set(BUILDS)


BUILT_FIRST = {"evolved_answer_tiny.yaml", "evolved_question_tiny.yaml"}
"""Configs that start from a built checkpoint (the toy math stage, `make toy-model-math`): from the base one their
rewards are 0 (docs/toy_model.md); a clone without it gets the one-line build message."""


def test_product_configs_start_from_a_kept_checkpoint():
    """The configs people run (not the SFT stages that build the other checkpoints) need nothing but a clone, except
    ``BUILT_FIRST``, whose checkpoint has a make target."""
    for config in sorted((REPO / "configs").glob("*.yaml")):
        path = _model_path(config)
        if "_stage" in config.stem or not path or not str(path).startswith("checkpoints/"):
            continue
        assert Path(path).name in (BUILDS if config.name in BUILT_FIRST else KEPT), f"{config.name}: {path}"
    assert _model_path(REPO / "configs/cycle_tiny.yaml") == "checkpoints/toy-qwen2.5-vl-cycle-video"


def test_the_message_names_the_build_of_a_missing_toy_checkpoint(tmp_path):
    assert missing_checkpoint_message(REPO / "checkpoints/toy-qwen2.5-vl") is None  # there: no message
    assert missing_checkpoint_message(tmp_path / "my-model") is None  # not a toy checkpoint
    assert missing_checkpoint_message("Qwen/Qwen2.5-VL-3B-Instruct") is None
    assert missing_checkpoint_message("checkpoints/toy-qwen2.5-vl-evolved-anchors-nope") is None
    gone = tmp_path / "checkpoints/toy-qwen2.5-vl-evolved-anchors"
    msg = missing_checkpoint_message(gone)
    assert msg == (
        f"--model.init_args.policy.model_name_or_path {gone} is not in git: build it with "
        "`make toy-model-evolved-long toy-model-evolved-anchors TOY_PRECISION=32` (about 8 min on one H200, fp32)"
    )
    kept = missing_checkpoint_message(tmp_path / "checkpoints/toy-qwen2.5-vl-cycle-video")
    assert kept is not None and " is missing: build it with `make toy-model-cycle toy-model-cycle-video`" in kept
    assert "\n" not in msg and "\n" not in kept


@pytest.mark.slow  # the same line through a train.py subprocess (~9 s); the check itself runs by default above
def test_fit_from_a_checkpoint_git_does_not_keep_fails_with_one_line(tmp_path, monkeypatch):
    """The SFT stage that builds evolved-chains-anchor starts from evolved-anchors, which git does not keep: run from a
    folder without it (a fresh clone), ``train.py fit`` stops before loading anything, with the one line."""
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "fit",
        "--config",
        str(REPO / "configs/toy_sft.yaml"),
        "--config",
        str(REPO / "configs/toy_sft_stage_evolved_chains_anchor.yaml"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-2000:]  # a model that cannot be loaded (docs/outputs.md, Exit status)
    last = proc.stderr.strip().splitlines()[-1]
    monkeypatch.chdir(tmp_path)  # where the relative path is missing
    assert last == "error: " + missing_checkpoint_message("checkpoints/toy-qwen2.5-vl-evolved-anchors")
    assert "Traceback" not in proc.stderr


def test_the_tiny_runs_keep_their_last_checkpoint_only():
    """configs/tiny.yaml and the other tiny configs: last.ckpt, rewritten every N steps (resume from it), no
    per-step files (a default tiny fit wrote 264 MB of them; 27 MB now)."""
    for name in ("tiny", "tiny_ovd", "cycle_tiny", "cycle_tiny_st", "cycle_tiny_temporal", "evolved_tiny"):
        cb = load_config(REPO / f"configs/{name}.yaml")["callbacks"]["checkpoint"]["init_args"]
        assert cb["save_last"] is True and cb["save_top_k"] == 0 and cb["every_n_train_steps"] > 0, name
