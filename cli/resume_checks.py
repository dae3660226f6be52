"""What ``--ckpt_path`` mistakes say: a missing checkpoint lists the checkpoints that exist (not the path that is
missing), and resuming a run that has already reached its ``max_epochs`` / ``max_steps`` says so in one line (the fit
then ends at once, as Lightning's does: programs that resume a fit whose end was cut short rely on it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHOWN = 5
"""At most this many checkpoints are named in one message."""


def existing_checkpoints(missing: str | Path, run: str, run_root: str = "outputs") -> tuple[str, list[Path]]:
    """(where, checkpoints) to name for a ``--ckpt_path`` that does not exist: those of its own folder, else those of
    the run's folder (``outputs/<run>/checkpoints``), else every run's ``last.ckpt`` under ``run_root``, newest first."""
    from lightning_modules.checkpoints import candidates

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
