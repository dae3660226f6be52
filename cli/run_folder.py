"""One run, one folder, and a run that ends by saying where everything is (docs/outputs.md, "One run, one folder").

* **A new fit never writes into another run's folder.** When ``outputs/<run name>/`` holds a run already (a config
  copy, ``metrics.jsonl``, a checkpoint or a W&B run), a new fit takes the next free ``outputs/<run name>-v1/``,
  ``-v2``, ... and that name (W&B run, metrics file, results row), the way ``ModelCheckpoint`` versions a file name
  that is taken (``last-v1.ckpt``); one line says so.
* **A resume continues its own run.** ``--ckpt_path <run folder>/checkpoints/<file>`` (fit, validate, test, predict,
  export) works in that run folder, so ``--ckpt_path outputs/tiny-v1/checkpoints/last.ckpt`` resumes ``tiny-v1``.
* **A folder given with ``--trainer.default_root_dir`` is used as given.** The programs that chain fits on purpose
  (sweeps, studies, co-evolution rounds) name their stage folders and resume with ``--ckpt_path`` or start over there;
  a new fit in such a folder says in one line that it adds to the run there, and its ``last.ckpt`` replaces the
  earlier one, so ``last.ckpt`` is always the newest checkpoint of the newest run.
* **Ctrl-C** during a fit saves ``<checkpoints>/last.ckpt`` (or says why it cannot), records the interruption in
  ``metrics.jsonl`` and prints the exact resume command; **every run ends** with its result lines, the run folder
  and the checkpoint, after the loggers' own output (:func:`end_lines`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

FOLDER_ENV = "SYN_GRPO_RUN_FOLDER"
"""The folder rank 0 chose, for the processes a launcher starts after it (they must not choose again: by then the
folder may hold this run)."""


def holds_run(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds (part of) a run: a config copy, ``metrics.jsonl``, a checkpoint or a W&B run. A
    folder with only a launcher's log (a sweep's ``train.log``) or what a failed launch left before the model loaded
    does not."""
    f = Path(folder)
    if not f.is_dir():
        return False
    if any(f.glob("config*.yaml")) or (f / "metrics.jsonl").is_file():
        return True
    return any((f / d).is_dir() and any((f / d).iterdir()) for d in ("checkpoints", "wandb"))


def next_free(folder: Path) -> Path:
    """``<folder>-v1``, ``-v2``, ...: the first that holds no run."""
    k = 1
    while holds_run(candidate := folder.with_name(f"{folder.name}-v{k}")):
        k += 1
    return candidate


def checkpoint_run_folder(ckpt: str | None, root: str = "outputs") -> Path | None:
    """The run folder of a checkpoint in ``<run folder>/checkpoints/`` (a file, or a distributed checkpoint's folder):
    one below ``root`` or one a run wrote (a config copy, ``metrics.jsonl``). None for a checkpoint elsewhere (a
    user's own ``~/checkpoints/`` is no run folder: the fit must not write its outputs beside it) and for Lightning's
    ``last`` / ``best`` / ``hpc`` / ``registry``."""
    if not ckpt or ckpt in ("last", "best", "hpc", "registry"):
        return None
    parent = Path(ckpt).parent
    if parent.name != "checkpoints":
        return None
    folder = parent.parent
    wrote = any(folder.glob("config*.yaml")) or (folder / "metrics.jsonl").is_file()
    return folder if wrote or folder.resolve().is_relative_to(Path(root).resolve()) else None


def choose_run_folder(
    stage: str | None, name: str, given: str | None, ckpt: str | None, root: str = "outputs"
) -> tuple[str, str, str | None]:
    """(run folder, run name, the line to print or None) for a ``stage`` (``fit``, ``test``, ...) of the run ``name``
    with ``--trainer.default_root_dir`` ``given`` and ``--ckpt_path`` ``ckpt`` (module docstring)."""
    if os.environ.get(FOLDER_ENV) and (os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("RANK", "0") != "0"):
        chosen = Path(os.environ[FOLDER_ENV])  # a process a launcher started after rank 0 chose
        return str(chosen), chosen.name if chosen.name.startswith(f"{name}-v") else name, None
    if given:
        note = None
        if stage == "fit" and not ckpt and holds_run(given):
            note = (
                f"note: {given} (--trainer.default_root_dir) holds a run already; this new fit adds to it and its "
                f"checkpoints/last.ckpt becomes this run's (resume the earlier one with --ckpt_path, or pass "
                "another folder)"
            )
        return str(given), name, note
    own = checkpoint_run_folder(ckpt, root)
    if own is not None:  # a resume or an evaluation of a run continues in that run's folder
        versioned = re.fullmatch(rf"{re.escape(name)}-v\d+", own.name) is not None
        return str(own), own.name if versioned else name, None
    folder = Path(root) / name
    special = ckpt in ("last", "best", "hpc", "registry")  # Lightning's names: a checkpoint of this folder's run
    if stage == "fit" and not special and holds_run(folder):
        new = next_free(folder)
        note = (
            f"{folder}/ holds a run already: this fit is the run {new.name} in {new}/ (to continue the earlier one, "
            f"pass --ckpt_path {folder}/checkpoints/last.ckpt)"
        )
        return str(new), new.name, note
    return str(folder), name, None


def remember_folder(folder: str) -> None:
    """Hand the chosen folder to the processes a launcher starts after this one (:data:`FOLDER_ENV`)."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0":
        os.environ[FOLDER_ENV] = folder


# ---------------------------------------------------------------------------------------------------------------------
# Interrupt and end
# ---------------------------------------------------------------------------------------------------------------------


def resume_command(argv: list[str], ckpt: str | Path) -> str:
    """``python train.py fit <argv without --ckpt_path> --ckpt_path <ckpt>``."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok == "--ckpt_path":
            skip = True
            continue
        if tok.startswith("--ckpt_path="):
            continue
        out.append(tok)
    if out and not out[0].startswith("-"):  # the subcommand
        out = out[1:]
    return shlex.join(["python", "train.py", "fit", *out, "--ckpt_path", str(ckpt)])


def _last_path(trainer: L.Trainer) -> Path | None:
    """``<checkpoint dirpath>/last.ckpt``, relative to the working directory when it is below it (as typed)."""
    cb = trainer.checkpoint_callback
    dirpath = getattr(cb, "dirpath", None)
    if cb is None or dirpath is None:
        return None
    path = Path(dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


class RunEnd(Callback):
    """Ctrl-C in a fit saves ``last.ckpt`` (or says why it cannot); the CLI adds it to every trainer, first, so the
    checkpoint exists before ``MetricsJSONL`` records the interruption. What it saved is kept for :func:`end_lines`.

    Lightning catches ``KeyboardInterrupt`` around the stage and calls ``on_exception`` without the ``teardown`` hooks
    (the CLI then exits with status 130): this is the one place left to save. It saves only a state worth keeping: a
    fit that completed at least one step in this process (an interrupt while a resume is still loading would replace
    the good ``last.ckpt`` with an untrained one), and never in the middle of an optimizer step (some parameters or
    moments updated, the step not counted: a resume would replay half a step); then the newest checkpoint there stays
    the one to resume."""

    def __init__(self) -> None:
        self.interrupted = False
        self.saved: Path | None = None
        self.not_saved: str | None = None
        self._steps_done = 0
        self._in_step = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self._in_step = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._in_step = False
        self._steps_done += 1

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt):
            return
        self.interrupted = True
        fn = str(getattr(trainer.state.fn, "value", trainer.state.fn))
        path = _last_path(trainer)
        if fn != "fit":
            self.not_saved = f"{fn} keeps no training state"
        elif path is None:
            self.not_saved = "this fit has no checkpoint callback (--trainer.enable_checkpointing false)"
        elif trainer.world_size > 1:
            self.not_saved = (
                f"a save needs all {trainer.world_size} processes, which Ctrl-C stops one by one; the newest periodic "
                "checkpoint is in " + str(path.parent)
            )
        elif self._steps_done == 0:
            self.not_saved = (
                f"no step was completed since this process started; the checkpoints in {path.parent} are unchanged"
            )
        elif self._in_step:
            self.not_saved = (
                "the interrupt came in the middle of an optimizer step, whose state would not resume exactly; the "
                f"newest checkpoint in {path.parent} is unchanged"
            )
        else:
            try:
                trainer.save_checkpoint(path, weights_only=False)  # the full state: a resume continues from it
                self.saved = path
            except Exception as e:  # noqa: BLE001 (any failure is reported, the interrupt goes on)
                self.not_saved = f"saving {path} failed: {type(e).__name__}: {e}"[:300]
        trainer.interrupt_checkpoint = str(self.saved) if self.saved else None


def end_lines(trainer: L.Trainer, argv: list[str], interrupted: bool = False) -> list[str]:
    """The lines a run ends with: each callback's ``summary_lines()`` (the results table, the held-out line), the run
    folder, the checkpoint, and after a Ctrl-C what was saved and the command that resumes it."""
    fn = str(getattr(trainer.state.fn, "value", trainer.state.fn))
    run = getattr(trainer, "run_name", None) or Path(trainer.default_root_dir).name
    lines: list[str] = []
    for cb in trainer.callbacks:
        lines += list(getattr(cb, "summary_lines", lambda: [])() or [])
    end = next((cb for cb in trainer.callbacks if isinstance(cb, RunEnd)), None)
    interrupted = interrupted or bool(end and end.interrupted)
    how = "interrupted" if interrupted else "finished"
    lines.append(f"run {run} ({fn}) {how} at step {trainer.global_step}; run folder: {trainer.default_root_dir}/")
    last = _last_path(trainer)
    if interrupted and end is not None and end.saved is not None:
        lines.append(f"checkpoint (saved at the interrupt): {end.saved}")
        lines.append(f"resume with: {resume_command(argv, end.saved)}")
    elif interrupted and fn == "fit":
        lines.append(f"no checkpoint saved at the interrupt: {end.not_saved if end else 'no RunEnd callback'}")
        if last is not None and last.exists():
            lines.append(f"resume from the newest periodic one with: {resume_command(argv, last)}")
    elif fn == "fit":
        lines.append(f"checkpoint: {last}" if last is not None and last.exists() else "checkpoint: none saved")
    return lines


def print_end(trainer: L.Trainer | None, argv: list[str], interrupted: bool = False) -> None:
    """Print :func:`end_lines` on rank 0, to stdout, after everything the loggers printed."""
    if trainer is None or not trainer.is_global_zero:
        return
    sys.stderr.flush()
    print("\n" + "\n".join(end_lines(trainer, argv, interrupted)), flush=True)
