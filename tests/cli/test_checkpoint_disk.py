"""Checkpoints sized for the disk: the size of one checkpoint from the parameter counts, how many files a policy keeps
at once, the line at the start of training, and the refusal before the first step when they do not fit."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoints import _args  # the tiny config's fit, checkpoint every step (tests/cli is on sys.path)
from torch import nn

import callbacks.checkpoint_disk as disk
from callbacks.checkpoint_disk import checkpoint_size, files_at_peak
from cli.main import EXIT_CODES, main
from lightning_modules.models.precision import MasterWeightOptimizer
from train import cli_main


def test_one_checkpoint_is_weights_masters_and_moments():
    """A bf16 Linear of 64 x 64 + 64 under fp32 masters: 2 B weights + 4 B masters + 8 B AdamW moments per parameter
    (18 B on the GPU less the 4 B fp32 gradient, which a checkpoint does not hold)."""
    lin = nn.Linear(64, 64).to(torch.bfloat16)
    n = 64 * 64 + 64
    opt = MasterWeightOptimizer(lin.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    size = checkpoint_size(lin, [opt])
    assert (size.weights, size.masters, size.optimizer, size.full) == (2 * n, 4 * n, 8 * n, 14 * n)
    plain = checkpoint_size(lin, [torch.optim.AdamW(lin.parameters(), lr=1e-3)])  # master_weights none: bf16 moments
    assert (plain.masters, plain.optimizer) == (0, 4 * n)


def _trainer(steps: int) -> SimpleNamespace:
    return SimpleNamespace(estimated_stepping_batches=steps, max_epochs=None)


@pytest.mark.parametrize(
    ("init", "files"),
    [
        # the paper configs today: every 50-step save of a 500-step run, last.ckpt, and last's temporary file
        ({"save_top_k": -1, "every_n_train_steps": 50, "save_last": True}, 12),
        # the newest two by step: two kept + last.ckpt + one being written
        ({"save_top_k": 2, "monitor": "step", "mode": "max", "every_n_train_steps": 50, "save_last": True}, 4),
        ({"save_top_k": 3, "monitor": "step", "mode": "max", "every_n_train_steps": 50, "save_last": "link"}, 4),
        ({"save_top_k": 0, "every_n_train_steps": 4, "save_last": True}, 2),  # tiny.yaml: last.ckpt only
        ({"save_top_k": 0, "save_last": False}, 0),
        # a link needs a kept file to point at: with none, Lightning writes last.ckpt in full
        ({"save_top_k": 0, "every_n_train_steps": 4, "save_last": "link"}, 2),
    ],
)
def test_files_on_disk_at_once(init, files):
    assert files_at_peak(ModelCheckpoint(**init), _trainer(500))[0] == files


def test_a_run_that_saves_once_into_an_empty_folder_holds_one_checkpoint():
    """bench/fsdp_resume.py's killed run (N 3, max_steps 5): last.ckpt at step 3, one save; beside nothing in a new
    folder (one 3B FSDP2 checkpoint, 43.1 GiB, fits a 64 GiB disk), beside the previous run's last.ckpt in a used one;
    at N 2 its max_steps 4 holds a second save, written beside the first."""
    cb = ModelCheckpoint(save_top_k=0, every_n_train_steps=3, save_last=True)
    assert files_at_peak(cb, _trainer(5), fresh=True) == (1, "save_top_k 0 + last.ckpt")
    assert files_at_peak(cb, _trainer(5), fresh=False)[0] == 2
    two = ModelCheckpoint(save_top_k=0, every_n_train_steps=2, save_last=True)
    assert files_at_peak(two, _trainer(4), fresh=True)[0] == 2  # the second save is written beside the first


def test_every_save_of_an_endless_run_is_unbounded():
    n, what = files_at_peak(ModelCheckpoint(save_top_k=-1, every_n_train_steps=50), _trainer(float("inf")))
    assert n is None and "unbounded" in what


def test_fit_prints_the_size_and_the_estimate_matches_the_file(tiny_model_dir, rec_dir, tmp_path, capsys):
    out = tmp_path / "run"
    cli = cli_main(_args(tiny_model_dir, rec_dir, out, "--trainer.max_steps", "1"))  # tiny.yaml: last.ckpt only
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoints: one full checkpoint"))
    # one step, no interval reached: last.ckpt once, at the end, into a new folder (nothing beside it)
    assert "save_top_k 0 + last.ckpt (full" in line and f"free in {out}/checkpoints" in line
    size = checkpoint_size(cli.model, cli.trainer.optimizers).full
    written = (out / "checkpoints" / "last.ckpt").stat().st_size
    assert 0.9 < written / size < 1.15, (written, size)  # the rest: hyper-parameters, loop and callback state


def test_fit_that_cannot_keep_its_checkpoints_is_refused_before_the_first_step(
    tiny_model_dir, rec_dir, tmp_path, capsys, monkeypatch
):
    """Every step's checkpoint kept over 8 steps on a disk with 1 MiB free: one line naming save_top_k, exit 2, no
    step trained and nothing saved."""
    out = tmp_path / "run"
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * 2**30, 0, 2**20))
    flags = ("--callbacks.checkpoint.init_args.save_top_k", "-1")
    trained = []
    monkeypatch.setattr("lightning_modules.grpo.GRPOModule.training_step", lambda *a: trained.append(a))
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_model_dir, rec_dir, out, "--trainer.max_steps", "8", *flags))
    assert e.value.code == EXIT_CODES["config"]
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --callbacks.checkpoint.init_args.save_top_k: the checkpoints need ")
    assert "save_top_k -1 keeps every save: 8 + last.ckpt + one being written" in err and "0.0 GiB free" in err
    assert not trained and not list(Path(out).rglob("*.ckpt"))
