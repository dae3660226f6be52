"""The command line explains itself: one-line errors that name the flag (and file) and the fix, no abbreviations,
short class names, named callbacks that overlays patch, and one folder and one name per run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from jsonargparse import Namespace

from cli.errors import explain
from cli.main import main, merge_callback_entry, merge_named_callbacks, run_name
from cli.path_checks import check_paths, looks_local
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/tiny.yaml")


def _error(args: list[str], capsys, code: int = 2) -> str:
    """The stderr of a command line that must fail with exit status ``code`` (2: a flag or config), as one line."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_unknown_flag_is_one_line_with_did_you_mean(capsys):
    err = _error(["fit", "--config", TINY, "--trainer.max_epoch", "1"], capsys)
    assert "--trainer.max_epoch" in err and "did you mean --trainer.max_epochs?" in err


def test_flags_are_never_abbreviated(capsys):
    err = _error(["fit", "--config", TINY, "--trainer.max_step", "3"], capsys)  # not silently --trainer.max_steps
    assert "unknown flag --trainer.max_step" in err and "--trainer.max_steps" in err


def test_unknown_model_flag_suggests_the_module_argument(capsys):
    err = _error(["fit", "--config", TINY, "--model.method.init_args.diversity_betta", "0.5"], capsys)
    assert "did you mean --model.init_args.method.init_args.diversity_beta?" in err
    err = _error(["fit", "--config", TINY, "--model.kl.coeff", "0.5"], capsys)  # a typed group's key
    assert "unknown flag --model.kl.coeff (did you mean --model.kl.coef?)" in err


def test_a_flag_of_the_flat_arguments_names_where_it_moved(capsys):
    err = _error(["fit", "--config", TINY, "--model.init_args.kl_coef", "0.1"], capsys)
    assert "unknown flag --model.init_args.kl_coef (it moved to --model.init_args.kl.coef" in err
    assert "python -m cli.migrate_config" in err


def test_bad_choice_names_the_flag_and_the_choices(capsys):
    err = _error(["fit", "--config", TINY, "--model.init_args.optimisation.aggregation", "token_mean"], capsys)
    assert (
        "--model.init_args.optimisation.aggregation" in err and "token-mean" in err and "seq-mean-token-sum-norm" in err
    )


def test_missing_model_path_names_the_flag_before_anything_starts(capsys, tmp_path):
    err = _error(
        ["fit", "--config", TINY, "--model.init_args.policy.model_name_or_path", str(tmp_path / "nope")], capsys, 4
    )
    assert "--model.init_args.policy.model_name_or_path" in err and "config.json" in err
    assert not (tmp_path / "nope").exists()


def test_placeholder_data_path_points_at_the_config_line(capsys):
    err = _error(["fit", "--config", str(REPO / "configs/rec_3b_1gpu.yaml")], capsys, 4)
    # the model path is checked first: the placeholder in the paper config names its file and line
    assert "model_name_or_path /path/to/Qwen2.5-VL-3B-Instruct" in err and "configs/rec_3b_1gpu.yaml:" in err


def test_a_missing_checkpoint_lists_the_checkpoints_that_exist(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/ of this folder
    gone = "outputs/tiny/checkpoints/last.ckpt"
    err = _error(["test", "--config", TINY, "--ckpt_path", gone], capsys)
    assert f"--ckpt_path {gone}: no such file" in err and "no run under outputs/ has written a checkpoint yet" in err
    (tmp_path / "outputs/tiny/checkpoints").mkdir(parents=True)
    (tmp_path / "outputs/tiny/checkpoints/epoch=0-step=3.ckpt").write_bytes(b"")
    err = _error(["test", "--config", TINY, "--ckpt_path", str(tmp_path / "elsewhere/last.ckpt")], capsys)
    assert err.endswith(
        "the checkpoints in outputs/tiny/checkpoints (newest first): outputs/tiny/checkpoints/epoch=0-step=3.ckpt"
    )


def test_a_missing_local_model_folder_names_the_config_line_and_exits_4(capsys, tmp_path, monkeypatch):
    """A path that starts with ``./`` is a folder here, not a hub id, whether or not it exists."""
    monkeypatch.chdir(REPO)
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(
        "model:\n  init_args:\n    policy:\n      model_name_or_path: ./checkpoints/toy-qwen2.5-vl-missing\n"
    )
    err = _error(["fit", "--config", TINY, "--config", str(cfg)], capsys, 4)
    assert "./checkpoints/toy-qwen2.5-vl-missing: no model there" in err and f"edit {cfg}:4 and point it" in err


def test_a_hub_id_is_no_local_path_even_beside_a_folder_of_its_organisation(capsys, tmp_path, monkeypatch):
    """``Qwen/X`` is a hub id where the working directory has a ``Qwen/`` folder (of other models), as long as
    ``Qwen/X`` itself is not there; a path is local when it exists, starts with ``/``, ``./``, ``../`` or ``~``, or
    has more than one slash (no hub id has)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen/Qwen2.5-VL-3B-Instruct").mkdir(parents=True)
    assert not looks_local("Qwen/Qwen2.5-VL-7B-Instruct") and not looks_local("Qwen2.5-VL-7B-Instruct")
    assert looks_local("Qwen/Qwen2.5-VL-3B-Instruct")  # the folder itself is here
    for local in ("/models/x", "./Qwen/X", "../Qwen/X", "~/Qwen/X", "outputs/run/export"):
        assert looks_local(local), local
    policy = {"model_name_or_path": "Qwen/Qwen2.5-VL-7B-Instruct"}
    check_paths(Namespace(model=Namespace(init_args=Namespace(policy=policy))))  # no stop: the hub's to answer
    policy = {"model_name_or_path": "./Qwen/Qwen2.5-VL-7B-Instruct"}
    with pytest.raises(SystemExit) as exc:
        check_paths(Namespace(model=Namespace(init_args=Namespace(policy=policy))))
    assert exc.value.code == 4 and "./Qwen/Qwen2.5-VL-7B-Instruct: no model there" in capsys.readouterr().err


def test_a_missing_data_folder_exits_3(capsys, tmp_path):
    args = ["fit", "--config", TINY, "--data.init_args.toy", "null", "--data.init_args.data_root", str(tmp_path / "x")]
    assert "--data.init_args.data_root" in _error(args, capsys, 3)


def test_a_mistake_inside_a_config_file_names_the_file_the_line_and_a_did_you_mean(capsys, tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("trainer:\n  max_epochs: 1\nmodel:\n  init_args:\n    kl: {coeff: 0.1}\n")
    err = _error(["fit", "--config", TINY, "--config", str(cfg)], capsys)
    assert err.startswith(f"error: {cfg}:5: unknown key coeff under model.init_args.kl (did you mean coef?)")
    cfg.write_text("trainer:\n  max_epoch: 1\n")
    err = _error(["fit", "--config", TINY, "--config", str(cfg)], capsys)
    assert err.startswith(f"error: {cfg}:2: unknown key trainer.max_epoch (did you mean max_epochs?)")


def test_resuming_a_finished_run_says_so():
    from cli.resume_checks import finished_run_line

    state = {"epoch": 3, "global_step": 36, "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}}}
    line = finished_run_line("last.ckpt", state, {"max_epochs": 3, "max_steps": -1})
    assert "that run is finished, it reached --trainer.max_epochs 3 (it has trained 3 epochs)" in line
    assert "raise --trainer.max_epochs to train further" in line
    assert "--trainer.max_steps 36" in finished_run_line("last.ckpt", state, {"max_epochs": 9, "max_steps": 36})
    assert finished_run_line("last.ckpt", state, {"max_epochs": 6, "max_steps": -1}) is None  # a resume trains on


def test_module_value_errors_are_one_line(capsys, tmp_path):
    # a run folder of its own: a checkout where `make train` already wrote outputs/tiny/ gives the same line
    run = ["--trainer.default_root_dir", str(tmp_path / "run")]
    err = _error(["fit", "--config", TINY, *run, "--model.init_args.sampling.group_size", "1"], capsys)
    assert "--model.sampling.group_size must be >= 2" in err


def test_short_class_names_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--model.help", "GRPOModule"])
    assert exc.value.code in (None, 0)
    out = capsys.readouterr().out
    assert "--model.optimisation.aggregation {token-mean,seq-mean-token-mean,seq-mean-token-sum-norm}" in out
    cli = cli_main(["--config", TINY, "--model", "GRPOModule", "--data", "SyntheticDataModule"], run=False)
    assert type(cli.model).__name__ == "GRPOModule"


def test_a_method_s_help_lists_flags_that_can_be_pasted(capsys):
    """``--model.method.help SynGRPO`` works with or without a config and lists full flags; one of them, pasted after
    the config, parses."""
    for args in (
        ["fit", "--model.method.help", "SynGRPO"],
        ["fit", "--config", TINY, "--model.method.help", "SynGRPO"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "  --model.method.diversity_beta DIVERSITY_BETA" in out and "\n  --method." not in out
    cfg = _print_config(["fit", "--config", TINY, "--model.method", "SynGRPO", "--model.method.diversity_beta", "0.3"])
    assert cfg["model"]["init_args"]["method"]["init_args"]["diversity_beta"] == 0.3
    err = _error(["fit", "--model.method.help", "Nope"], capsys)
    assert "no such method; choose one of SynGRPO (syn_grpo), GRPO (grpo)" in err


def test_fit_help_shows_one_example_command_per_line(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    lines = capsys.readouterr().out.splitlines()
    examples = [ln for ln in lines if ln.startswith("  python train.py ")]
    assert len(examples) >= 4 and all(ln.count("python train.py") == 1 for ln in examples)


def test_explain_keeps_unknown_messages():
    assert explain("something else\nhappened", []) == "something else happened"


def _print_config(args: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main([*args, "--print_config"])
    return yaml.safe_load(buf.getvalue())


def test_named_callbacks_merge_by_name():
    assert merge_callback_entry({"class_path": "A", "init_args": {"x": 1, "y": 2}}, {"init_args": {"y": 3}}) == {
        "class_path": "A",
        "init_args": {"x": 1, "y": 3},
    }
    assert merge_callback_entry({"class_path": "A", "init_args": {"x": 1}}, {"class_path": "B"}) == {"class_path": "B"}
    assert merge_callback_entry({"class_path": "A"}, None) is None
    assert merge_named_callbacks(["fit", "--config", TINY]) == ["fit", "--config", TINY]  # one config: as given
    cfg = _print_config(
        ["fit", "--config", TINY, "--config", str(REPO / "configs/baselines/grpo.yaml"), "--callbacks.gallery", "null"]
    )
    named = cfg["callbacks"]
    assert named["synthesis"]["init_args"]["mode"] == "off" and named["synthesis"]["init_args"]["gallery_samples"] == 4
    assert named["gallery"] is None and named["metrics"] and named["results"] and named["progress"]
    assert cfg["name"] == "tiny" and cfg["method"] == "grpo"
    # an overlay that adds a callback before one that patches another (make train's summary, then a baseline)
    heldout = str(REPO / "configs/overlays/heldout_summary.yaml")
    cfg = _print_config(
        ["fit", "--config", TINY, "--config", heldout, "--config", str(REPO / "configs/baselines/grpo.yaml")]
    )
    named = cfg["callbacks"]
    assert named["heldout"]["init_args"]["scenes"] == 512 and named["synthesis"]["init_args"]["mode"] == "off"
    assert (
        named["checkpoint"]["class_path"].endswith("ModelCheckpoint")
        and named["checkpoint"]["init_args"]["every_n_epochs"] == 1
    )


def test_one_folder_and_one_name_per_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # outside the repository, the configs' relative model path names no folder: one line
    err = _error(["fit", "--config", TINY, "--trainer.max_steps", "1"], capsys, 4)  # a model that cannot load
    assert "relative to the working directory" in err and str(REPO / "checkpoints/toy-qwen2.5-vl") in err
    model = ["--model.init_args.policy.model_name_or_path", str(REPO / "checkpoints/toy-qwen2.5-vl")]
    overlay = str(REPO / "configs/baselines/syn_grpo_wo_rdiv.yaml")
    cli = cli_main(["--config", TINY, "--config", overlay, *model], run=False)
    t = cli.trainer
    assert t.default_root_dir == "outputs/tiny-syn_grpo_wo_rdiv" and t.run_name == "tiny-syn_grpo_wo_rdiv"
    ckpt = t.checkpoint_callback
    assert Path(ckpt.dirpath) == tmp_path / "outputs/tiny-syn_grpo_wo_rdiv/checkpoints"
    wb = t.loggers[0]
    assert wb.save_dir == "outputs/tiny-syn_grpo_wo_rdiv" and wb._wandb_init["name"] == "tiny-syn_grpo_wo_rdiv"
    assert wb._wandb_init["group"] == "tiny" and "syn_grpo_wo_rdiv" in wb._wandb_init["tags"]
    # --trainer.default_root_dir moves every output
    cli = cli_main(["--config", TINY, "--trainer.default_root_dir", str(tmp_path / "elsewhere"), *model], run=False)
    assert Path(cli.trainer.checkpoint_callback.dirpath) == tmp_path / "elsewhere/checkpoints"
    assert cli.trainer.loggers[0].save_dir == str(tmp_path / "elsewhere")
    assert run_name("tiny", None) == "tiny" and run_name(None, "sft") == "run-sft"


def test_a_callback_in_trainer_callbacks_replaces_the_named_one_of_its_class():
    spec = '[{"class_path": "callbacks.synthesis.SynthesisCallback", "init_args": {"mode": "off"}}]'
    cli = cli_main(["--config", TINY, "--trainer.callbacks", spec], run=False)
    synth = [c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback"]
    assert len(synth) == 1 and synth[0].mode == "off"
    assert any(type(c).__name__ == "MetricsJSONL" for c in cli.trainer.callbacks)  # the other named ones stay
