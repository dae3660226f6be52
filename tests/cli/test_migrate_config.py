"""``python -m cli.migrate_config`` (`cli.flat_flags`): a config of the flat GRPOModule arguments becomes one of the
typed groups that parses, keeps its comments and values, and an SFT config moves only its policy keys; a checkpoint of
the flat arguments is read in the groups; nothing else in the product knows the flat names."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from cli.flat_flags import checkpoint_init_args, main, migrate_flag, migrate_init_args, migrate_text
from train import cli_main

REPO = Path(__file__).resolve().parents[2]

FLAT = """\
# a run of before the typed groups
name: old_run
model:
  class_path: lightning_modules.grpo.GRPOModule
  init_args:
    model_name_or_path: checkpoints/toy-qwen2.5-vl
    dtype: fp32
    method: grpo             # the plain GRPO plug-in
    prompt_template: toy
    group_size: 4            # G
    max_new_tokens: 96
    micro_batch_size: 12
    kl_coef: 0.02
    format: think_answer
    diversity_beta: 0.5
    optimizer:
      class_path: torch.optim.AdamW
      init_args: {lr: 2.0e-5, weight_decay: 0.0}
data:
  class_path: datamodules.synthetic.SyntheticDataModule
"""


def _printed(*configs: Path) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main(["fit", *[a for c in configs for a in ("--config", str(c))], "--print_config"])
    return yaml.safe_load(buf.getvalue())


def test_a_flat_config_migrates_to_the_groups_and_keeps_its_values_and_comments(tmp_path):
    new, notes = migrate_text(FLAT, "old.yaml")
    assert "old.yaml: kl_coef -> kl.coef" in notes
    assert "# the plain GRPO plug-in" in new and "group_size: 4            # G" in new and "# a run of" in new
    model = yaml.safe_load(new)["model"]["init_args"]
    assert model["policy"] == {"model_name_or_path": "checkpoints/toy-qwen2.5-vl", "dtype": "fp32"}
    assert model["sampling"] == {"prompt_template": "toy", "group_size": 4, "max_new_tokens": 96}
    assert model["kl"] == {"coef": 0.02} and model["engines"] == {"micro_batch_size": 12}
    assert model["method"] == {
        "class_path": "lightning_modules.methods.grpo.GRPO",
        "init_args": {"format": "think_answer", "diversity_beta": 0.5},
    }
    assert model["optimizer"]["init_args"]["lr"] == 2.0e-5
    # the migrated file is a config this version runs: on top of tiny.yaml (its data), the same values
    path = tmp_path / "old.yaml"
    path.write_text(FLAT)
    assert main([str(path), "--check"]) == 1 and path.read_text() == FLAT  # --check writes nothing
    assert main([str(path)]) == 0 and main([str(path), "--check"]) == 0  # rewritten; then nothing left to move
    cfg = _printed(REPO / "configs/tiny.yaml", path)["model"]["init_args"]
    assert cfg["kl"]["coef"] == 0.02 and cfg["sampling"]["group_size"] == 4
    assert cfg["method"]["class_path"].endswith("GRPO") and cfg["method"]["init_args"]["diversity_beta"] == 0.5


def test_flags_and_mappings_migrate_and_a_method_key_it_does_not_take_is_dropped():
    assert migrate_flag("--model.init_args.kl_coef=0.1") == "--model.init_args.kl.coef=0.1"
    assert migrate_flag("--model.diversity_beta") == "--model.method.init_args.diversity_beta"
    assert migrate_flag("model.init_args.rollout_engine") == "model.init_args.engines.rollout_engine"
    assert migrate_flag("--trainer.max_steps=3") == "--trainer.max_steps=3"
    cycle = migrate_init_args({"method": "cycle_grpo", "method_args": {"n_captions": 3}, "diversity_beta": 0.7})
    assert cycle["method"] == {
        "class_path": "lightning_modules.methods.cycle_grpo.CycleGRPO",
        "init_args": {"n_captions": 3},
    }
    grouped = {"kl": {"coef": 0.1}}
    assert migrate_init_args(grouped) == grouped  # already in groups: unchanged
    sft = migrate_init_args({"model_name_or_path": "x", "dtype": "fp32", "prompt_template": "toy"}, sft=True)
    assert sft == {"policy": {"model_name_or_path": "x", "dtype": "fp32"}, "prompt_template": "toy"}


def test_every_shipped_config_is_already_migrated():
    paths = sorted((REPO / "configs").rglob("*.yaml")) + sorted((REPO / "experiments").rglob("*.yaml"))
    for path in paths:
        text = path.read_text()
        assert migrate_text(text, str(path))[0] == text, f"{path} still has flat GRPOModule arguments"


def test_the_command_s_entry_point_and_a_checkpoint_s_hyperparameters(tmp_path, monkeypatch, capsys):
    """``python -m cli.migrate_config`` runs `cli.flat_flags.main`; a checkpoint's hyperparameters are translated by
    its module's class path (an SFTModule's policy keys alone move), and grouped ones pass as they are."""
    path = tmp_path / "old.yaml"
    path.write_text(FLAT)
    monkeypatch.setattr(sys, "argv", ["python -m cli.migrate_config", "--check", str(path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("cli.migrate_config", run_name="__main__")
    assert exc.value.code == 1 and "1 of 1 file(s) would change" in capsys.readouterr().out
    flat = {"model_name_or_path": "x", "kl_coef": 0.1, "prompt_template": "toy"}
    grpo = checkpoint_init_args("lightning_modules.grpo.GRPOModule", flat)
    assert grpo["policy"] == {"model_name_or_path": "x"} and grpo["kl"] == {"coef": 0.1}
    assert grpo["sampling"] == {"prompt_template": "toy"} and grpo["method"]["class_path"].endswith("SynGRPO")
    sft = checkpoint_init_args("lightning_modules.sft.SFTModule", {"model_name_or_path": "x", "prompt_template": "toy"})
    assert sft == {"policy": {"model_name_or_path": "x"}, "prompt_template": "toy"}
    grouped = {"policy": {"model_name_or_path": "x"}, "kl": {"coef": 0.1}}
    assert checkpoint_init_args("lightning_modules.grpo.GRPOModule", grouped) == grouped


def test_only_cli_flat_flags_knows_the_flat_arguments():
    """The flat arguments' table and readers live in one module; the product reaches them only through it (the CLI's
    checkpoint and error paths, the export, the migrate command)."""
    importers = set()
    for package in ("core", "synth", "datamodules", "lightning_modules", "callbacks", "cli"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if path.name != "flat_flags.py":
                assert "MOVED: dict" not in text and "def flat_hparams" not in text, path
            if "cli.flat_flags import" in text:
                importers.add(str(path.relative_to(REPO)))
    assert importers == {"cli/main.py", "cli/export.py", "cli/migrate_config.py"}
