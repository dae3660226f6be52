"""A user's error is one line with one exit status per class (2 a flag or config, 3 a data file, 4 a model that cannot
be loaded), ``--debug`` shows the traceback, and a run folder's config copies never overwrite each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.errors import EXIT_CODES
from cli.main import main
from cli.run_config import RunConfigCallback

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/tiny.yaml")
TOY = str(REPO / "checkpoints/toy-qwen2.5-vl")


def _one_line(args: list[str], capsys, code: int) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: "), err
    return err


def test_a_type_error_names_the_flag_the_type_and_the_value(capsys):
    err = _one_line(
        ["fit", "--config", TINY, "--model.init_args.sampling.group_size", "abc"], capsys, EXIT_CODES["config"]
    )
    assert "--model.init_args.sampling.group_size: expected an int, got 'abc'" in err and "--model.help" in err


def _bad_data(tmp_path: Path) -> list[str]:
    (tmp_path / "train.jsonl").write_text('{"image": "x.png", "problem": "q"}\n')
    return [
        "fit",
        "--config",
        str(REPO / "configs/rec_3b_1gpu.yaml"),
        "--model.init_args.policy.model_name_or_path",
        TOY,
        "--data.init_args.data_root",
        str(tmp_path),
        "--data.init_args.train_files",
        "[train.jsonl]",
        "--trainer.accelerator",
        "cpu",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
    ]


def test_a_data_error_is_one_line_with_file_and_line_and_its_own_status(tmp_path, capsys):
    err = _one_line(_bad_data(tmp_path), capsys, EXIT_CODES["data"])
    assert f"{tmp_path / 'train.jsonl'}:1: missing 'solution'" in err and "--debug" in err


def test_a_model_that_cannot_be_loaded_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    hub = ["fit", "--config", TINY, "--model.init_args.policy.model_name_or_path", "Qwen/Qwen2.5-VL-7B-Instruct"]
    hub += ["--trainer.default_root_dir", str(tmp_path / "run")]
    err = _one_line(hub, capsys, EXIT_CODES["model"])
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in err and "local" in err
    with pytest.raises(OSError, match="could not load"):
        main([*hub, "--debug"])


def test_config_copies_never_overwrite_each_other(tmp_path):
    name = RunConfigCallback.config_name
    assert name(tmp_path, "fit") == "config.yaml"
    (tmp_path / "config.yaml").touch()
    assert name(tmp_path, "fit") == "config-2.yaml"  # a second launch in the same folder
    assert name(tmp_path, "fit", resumed=True) == "config-resume.yaml"
    (tmp_path / "config-resume.yaml").touch()
    assert name(tmp_path, "fit", resumed=True) == "config-resume-2.yaml"

    class TrainerFn:  # what Lightning passes: an enum whose str() is 'TrainerFn.TESTING'
        value = "test"

    assert name(tmp_path, TrainerFn()) == "config-test.yaml"
