"""What the CLI checks of ``--ckpt_path`` and of checkpoint files before Lightning touches them: a damaged or missing
checkpoint stops in one line naming the newest intact one (`intact_checkpoint`, ``--resume_intact``); a missing one
lists the checkpoints that exist (not the path that is missing); resuming a run that has already reached its
``max_epochs`` / ``max_steps`` says so in one line (the fit then ends at once, as Lightning's does: programs that
resume a fit whose end was cut short rely on it); single-file saves write beside the checkpoint and a fit removes what
killed saves of this machine left (`checkpoint_temps`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities import rank_zero_info

from cli.errors import fail
from core.checkpoint_files import candidates, damage, newest_intact, remove_stale_temps
from lightning_modules.checkpoints import use_beside_temp

SHOWN = 5
"""At most this many checkpoints are named in one message."""


def existing_checkpoints(missing: str | Path, run: str, run_root: str = "outputs") -> tuple[str, list[Path]]:
    """(where, checkpoints) to name for a ``--ckpt_path`` that does not exist: those of its own folder, else those of
    the run's folder (``outputs/<run>/checkpoints``), else every run's ``last.ckpt`` under ``run_root``, newest
    first."""
    own = Path(missing).parent
    found = candidates(own)
    if found:
        return str(own), found
    run_dir = Path(run_root) / run / "checkpoints"
    found = candidates(run_dir)
    if found:
        return str(run_dir), found
    lasts = [p for p in Path(run_root).glob("**/checkpoints/last*.ckpt") if p.is_file()]
    return f"{run_root}/", sorted(lasts, key=lambda p: p.stat().st_mtime, reverse=True)


def missing_checkpoint_line(ckpt: str, run: str, run_root: str = "outputs") -> str:
    """The one line for a ``--ckpt_path`` that is not there: the checkpoints that exist, or that none does yet."""
    where, found = existing_checkpoints(ckpt, run, run_root)
    head = f"--ckpt_path {ckpt}: no such file (nor a distributed checkpoint folder with a meta.pt)"
    if not found:
        return (
            f"{head}; no run under {run_root}/ has written a checkpoint yet: train first "
            "(python train.py fit --config CONFIG writes <run folder>/checkpoints/last.ckpt)"
        )
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    names = ", ".join(str(p) for p in found[:SHOWN])
    return f"{head}; the checkpoints in {where} (newest first): {names}{more}"


def finished_run_line(ckpt: str, state: dict[str, Any], trainer: Any) -> str | None:
    """One line when the fit ``state`` (a checkpoint's ``epoch``, ``global_step`` and loops) has already reached the
    trainer config's ``max_steps`` or ``max_epochs``, so that resuming it would train nothing; else None."""
    steps = int(state.get("global_step") or 0)
    progress = (((state.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress") or {}).get("current") or {}
    epochs = int(progress.get("completed", state.get("epoch") or 0))
    max_steps = trainer.get("max_steps") if trainer is not None else None
    max_epochs = trainer.get("max_epochs") if trainer is not None else None
    if max_epochs is None and max_steps in (None, -1):
        max_epochs = 1000  # Lightning's default
    reached = None
    if max_steps not in (None, -1) and steps >= max_steps:
        reached = f"--trainer.max_steps {max_steps} (it has trained {steps} steps)"
    elif max_epochs not in (None, -1) and epochs >= max_epochs:
        reached = f"--trainer.max_epochs {max_epochs} (it has trained {epochs} epochs)"
    if reached is None:
        return None
    flag = reached.split(" (")[0].rsplit(" ", 1)[0]
    return (
        f"--ckpt_path {ckpt}: that run is finished, it reached {reached}: this fit trains nothing; raise "
        f"{flag} to train further, or evaluate it with `python train.py test --config CONFIG --ckpt_path {ckpt}`"
    )


def checkpoint_temps(trainer: L.Trainer, clean: bool) -> None:
    """Single-file saves write their temporary file beside the checkpoint (`BesideCheckpointIO`, not ``/tmp``), and
    with ``clean`` (a fit: the subcommand that saves) what a killed save of this machine left in the checkpoint
    folders is removed now, in one line (`remove_stale_temps`)."""
    use_beside_temp(trainer.strategy)
    if not clean or rank_zero_only.rank != 0:  # the launcher's rank (the strategy's is set at fit)
        return
    for folder in dict.fromkeys(cb.dirpath for cb in trainer.checkpoint_callbacks if cb.dirpath):
        if removed := remove_stale_temps(Path(folder)):
            mb = sum(size for _, size in removed) / 2**20
            names = ", ".join(p.name for p, _ in removed)
            what = f"{len(removed)} partial checkpoint file(s) ({mb:.1f} MB) that killed saves left"
            rank_zero_info(f"removed {what} in {folder}: {names}")


def intact_checkpoint(ckpt: str, *, use_intact: bool = False, run: str = "run", run_root: str = "outputs") -> str:
    """``ckpt`` when it is intact (core/checkpoint_files.py: its structure, and every record's or shard's
    checksum, read once, without loading a tensor). A damaged one (truncated, bytes changed, shards missing) or a
    missing one (a save killed between two renames leaves a complete staging folder) stops with one line naming the
    newest intact checkpoint in its folder; with ``use_intact`` (``--resume_intact``) that one is used.

    Every rank of a multi-process run checks here (Lightning's launcher and torchrun start each with the command line).
    With ``use_intact`` every rank reads the bytes: the answer is the checkpoint to load, and ranks that checked
    differently (rank 0 the bytes, the others the structure) resumed from different checkpoints after one changed
    byte. Without it only rank 0 reads them (a multi-GB checkpoint read once, not once per rank): the answer is
    ``ckpt`` or a stop, and a damage that only the bytes show stops rank 0 and so the run (Lightning's launcher starts
    the other ranks after this check; torchrun ends them when one fails), so no rank loads another checkpoint."""
    path = Path(ckpt)
    contents = use_intact or rank_zero_only.rank == 0
    reason = damage(path, contents)
    if reason is None:
        return ckpt
    intact = newest_intact(path.parent, skip=path, contents=contents)
    if reason == "missing":
        if intact is None:
            fail(missing_checkpoint_line(ckpt, run, run_root))  # the checkpoints that exist (cli/resume_checks.py)
        what = f"--ckpt_path {ckpt}: no such file or folder"
    else:
        what = f"--ckpt_path {ckpt} is damaged: {reason}"
    if intact is None:
        fail(f"{what}; no intact checkpoint beside it in {path.parent}: pass another --ckpt_path or none")
    if not use_intact:
        fail(
            f"{what}; the newest intact checkpoint there is {intact}: pass --ckpt_path {shlex.quote(str(intact))} "
            "(or --resume_intact true to use it)"
        )
    if rank_zero_only.rank == 0:
        print(f"warning: {what}; using the newest intact checkpoint {intact} (--resume_intact)", file=sys.stderr)
    return str(intact)
