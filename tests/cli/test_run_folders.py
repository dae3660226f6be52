"""One run, one folder: two fits with the same name, a fit after an interrupted one and a resume never change each
other's files; Ctrl-C saves a checkpoint, records the interruption and prints the resume command; a run ends by
naming its folder and checkpoint (cli/run_folder.py, docs/outputs.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import yaml
from conftest import write_rec_jsonl
from lightning.pytorch.callbacks import Callback

from cli.main import main
from cli.run_folder import choose_run_folder, holds_run, resume_command
from train import cli_main


class InterruptAt(Callback):
    """Raises KeyboardInterrupt (what Ctrl-C raises) after optimizer step ``step``."""

    def __init__(self, step: int = 1):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise KeyboardInterrupt


def _config(tmp_path: Path, model_dir: Path, data_root: Path) -> Path:
    """A 2-step GRPO fit of the tiny model named ``t``: its folder is derived (``outputs/t``), a checkpoint a step."""
    cfg = {
        "name": "t",
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "logger": False,
        },
        "callbacks": {
            "checkpoint": {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"save_last": True, "every_n_train_steps": 1, "save_top_k": 0},
            },
            "metrics": {"class_path": "callbacks.logging.MetricsJSONL"},
        },
        "model": {
            "class_path": "lightning_modules.grpo.GRPOModule",
            "init_args": {
                "policy": {"model_name_or_path": str(model_dir), "dtype": "fp32"},
                "sampling": {"prompt_template": "toy", "group_size": 2, "max_new_tokens": 4},
                "engines": {"micro_batch_size": 4},
                "kl": {"coef": 0.0},
            },
        },
        "data": {
            "class_path": "datamodules.rec.RECDataModule",
            "init_args": {
                "data_root": str(data_root),
                "train_files": ["train.jsonl"],
                "val_files": {},
                "batch_size": 2,
            },
        },
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _model(path: Path) -> list[str]:
    return ["--model.init_args.policy.model_name_or_path", str(path)]


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_runs_never_mix_and_a_resume_continues_its_own_run(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """A finished fit, the same fit interrupted by Ctrl-C, a third one, then the interrupted one resumed."""
    write_rec_jsonl(tmp_path / "data", 4)
    config = str(_config(tmp_path, tiny_model_dir, tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    first, second, third = (Path("outputs") / n for n in ("t", "t-v1", "t-v2"))

    cli_main(["fit", "--config", config])
    out = capsys.readouterr()
    assert f"run folder: {first}/" in out.out and f"checkpoint: {first}/checkpoints/last.ckpt" in out.out
    finished = _files(first)
    assert "checkpoints/last.ckpt" in finished and "config.yaml" in finished

    # a launch into that folder that fails as the model loads (a config.json without weights) writes nothing there
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_model_dir / "config.json", broken)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", config, "--trainer.default_root_dir", str(first), *_model(broken)])
    assert exc.value.code == 4 and _files(first) == finished
    capsys.readouterr()

    # the same fit again, stopped by Ctrl-C after one step: its own folder, a checkpoint, the interruption recorded
    interrupt = json.dumps({"class_path": "test_run_folders.InterruptAt", "init_args": {"step": 1}})
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT once it has caught one
    try:
        with pytest.raises(SystemExit) as exc:
            cli_main(["fit", "--config", config, "--callbacks.interrupt", interrupt])
    finally:
        signal.signal(signal.SIGINT, handler)
    assert exc.value.code == 130  # Ctrl-C's status, not 1 (a bug)
    out = capsys.readouterr()
    assert f"{first}/ holds a run already: this fit is the run t-v1 in {second}/" in out.err
    ckpt = second / "checkpoints/last.ckpt"
    assert ckpt.is_file() and f"checkpoint (saved at the interrupt): {ckpt}" in out.out
    resume = [
        "python",
        "train.py",
        "fit",
        "--config",
        config,
        "--callbacks.interrupt",
        interrupt,
        "--ckpt_path",
        str(ckpt),
    ]
    assert f"resume with: {shlex.join(resume)}" in out.out
    assert out.out.rindex("resume with:") > out.out.rindex("run t-v1 (fit) interrupted at step 1")
    end = _events(second)[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["step"] == 1
    assert end["checkpoint"] == str(ckpt)
    interrupted = _files(second)

    # a fit after the interrupted one: a third folder
    cli_main(["fit", "--config", config, "--trainer.max_steps", "1"])
    assert (third / "checkpoints/last.ckpt").is_file() and "t-v2" in capsys.readouterr().err

    # the resume continues the interrupted run in its folder, from its step; no other run's file changes
    cli_main(["fit", "--config", config, "--ckpt_path", str(ckpt)])
    out = capsys.readouterr()
    assert f"run t-v1 (fit) finished at step 2; run folder: {second}/" in out.out and "holds a run" not in out.err
    starts = [e for e in _events(second) if e["event"] == "start"]
    assert [e["resumed"] for e in starts] == [False, True] and starts[1]["step"] == 1 and starts[1]["run"] == "t-v1"
    assert _files(first) == finished
    assert (second / "config-resume.yaml").is_file() and not (first / "config-resume.yaml").exists()
    assert _events(second)[-1]["status"] == "finished" and _events(second)[-1]["step"] == 2
    resumed = _files(second)
    assert all(resumed[k] == v for k, v in interrupted.items() if k != "checkpoints/last.ckpt" and k != "metrics.jsonl")
    assert sorted(p.name for p in Path("outputs").iterdir()) == ["t", "t-v1", "t-v2"]


def test_the_folder_rules(tmp_path):
    """The rules without a fit: a derived folder is versioned, a checkpoint's run folder is kept, a given folder is
    used as given (with a note when it holds a run)."""
    run = tmp_path / "outputs/x"
    (run / "checkpoints").mkdir(parents=True)
    assert not holds_run(run)  # an empty checkpoints/ (a failed launch) is no run
    (run / "checkpoints/last.ckpt").write_bytes(b"")
    assert holds_run(run)
    root = str(tmp_path / "outputs")
    assert choose_run_folder("fit", "x", None, None, root)[:2] == (f"{root}/x-v1", "x-v1")
    assert choose_run_folder("test", "x", None, None, root)[:2] == (f"{root}/x", "x")  # only a fit opens a run
    assert choose_run_folder("fit", "x", None, "last", root)[:2] == (f"{root}/x", "x")  # Lightning's newest last*.ckpt
    ckpt = f"{root}/x-v3/checkpoints/last.ckpt"
    Path(ckpt).parent.mkdir(parents=True)
    Path(ckpt).write_bytes(b"")
    assert choose_run_folder("fit", "x", None, ckpt, root) == (f"{root}/x-v3", "x-v3", None)
    # a user's own checkpoints/ folder is no run folder: the fit does not write its outputs beside it
    mine = tmp_path / "home/checkpoints/pretrained.ckpt"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"")
    assert choose_run_folder("fit", "x", None, str(mine), root)[:2] == (f"{root}/x-v1", "x-v1")
    folder, name, note = choose_run_folder("fit", "x", str(run), None, root)
    assert (folder, name) == (str(run), "x") and "holds a run already" in note
    argv = ["fit", "--config", "c.yaml", "--ckpt_path", "old", "--ckpt_path=older", "--trainer.max_steps", "3"]
    assert resume_command(argv, "o/x/checkpoints/last.ckpt") == (
        "python train.py fit --config c.yaml --trainer.max_steps 3 --ckpt_path o/x/checkpoints/last.ckpt"
    )


def _user_folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    user = tmp_path / "mine"
    (user / "images").mkdir(parents=True)
    (user / "train.jsonl").write_text('{"id": "a", "image": "images/a.png"}\n')
    (user / "images/a.png").write_bytes(b"my picture")
    return user, _files(user)


def test_no_writer_of_user_facing_paths_overwrites_a_users_folder(tmp_path, capsys):
    """Every toy export (images, clips, math rows, offline descriptions), `train.py export --out` and a toy config
    pointed at one's own data stop with one line before writing; a folder they made (or an empty one) is theirs."""
    from cli.export import check_out
    from datamodules import toy, toy_math, toy_video
    from datamodules.toy_export import MARKER, ForeignFolderError

    user, before = _user_folder(tmp_path)
    writers = {
        "toy": lambda d: toy.export_jsonl(d, "val", 2, seed=0, size=64),
        "toy offline descriptions": lambda d: toy.export_offline_descriptions(d, "train"),
        "toy_math": lambda d: toy_math.export_split(d, "val", 2, seed=0),
        "toy_video": lambda d: toy_video.export_jsonl(d, "val", 1, seed=0, size=84, num_frames=12),
    }
    for what, write in writers.items():
        with pytest.raises(ForeignFolderError, match="holds other files \\(images, train.jsonl\\)"):
            write(user)
        assert _files(user) == before, what
    with pytest.raises(ValueError, match="--out .*holds files no export wrote"):
        check_out(user)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "configs/tiny.yaml", "--data.init_args.data_root", str(user)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--data.init_args.toy null" in err
    assert _files(user) == before

    ours = tmp_path / "toy"
    toy.export_jsonl(ours, "val", 2, seed=0, size=64)  # a new folder: marked, then rewritten at will
    assert (ours / MARKER).is_file()
    (ours / MARKER).unlink()  # a folder filled before the marker existed: every JSONL has its manifest
    toy.export_jsonl(ours, "ood", 2, seed=0, size=64)
    assert (ours / MARKER).is_file() and (ours / "ood.jsonl").is_file()


def test_ctrl_c_before_a_step_or_inside_an_optimizer_step_keeps_the_newest_checkpoint(tmp_path):
    """An interrupt while a resume is still being set up, or in the middle of an optimizer step, saves nothing: the
    run's ``last.ckpt`` stays the one to resume (a save there would replace it with an untrained or half-stepped
    state)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from cli.run_folder import RunEnd

    last = tmp_path / "checkpoints" / "last.ckpt"

    def fit(model, steps, ckpt=None) -> RunEnd:
        end = RunEnd()
        trainer = L.Trainer(
            default_root_dir=tmp_path, max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
            callbacks=[end, ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)],
        )  # fmt: skip
        with contextlib.suppress(SystemExit):
            trainer.fit(model, ckpt_path=ckpt)
        return end

    fit(BoringModel(), 5)
    assert torch.load(last, weights_only=False)["global_step"] == 5

    class InterruptedWhileResuming(BoringModel):
        def configure_optimizers(self):
            raise KeyboardInterrupt

    class InterruptedInsideTheStep(BoringModel):
        def on_before_optimizer_step(self, optimizer):
            if self.trainer.global_step == 6:
                raise KeyboardInterrupt

    for model in (InterruptedWhileResuming(), InterruptedInsideTheStep()):
        end = fit(model, 20, ckpt=str(last))
        assert end.interrupted and end.saved is None and "unchanged" in end.not_saved, end.not_saved
        assert torch.load(last, weights_only=False)["global_step"] == 5
