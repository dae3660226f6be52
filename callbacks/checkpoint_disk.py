"""Checkpoints sized for the disk: one line at the start of training with the size of one checkpoint and the free disk,
and a refusal before the first step when the checkpoints a run keeps cannot fit.

Why: one full checkpoint of the 3B recipe (bf16 weights, fp32 masters, AdamW moments) is ~49 GiB, and the paper configs
kept every 50-step checkpoint (``save_top_k: -1``): a user's run ended in ``OSError: [Errno 28] No space left on
device`` hours in, with ~45 GB free. The size is known before the first step from the parameter counts and dtypes.

What one checkpoint holds (`checkpoint_size`): the module's ``state_dict`` (the policy; the frozen reference is not in
it), the fp32 masters of the low-precision trainable parameters (`MasterWeightOptimizer` and `OffloadedAdamW` write
them), and the optimizer state (AdamW: two moments per stepped element, three with amsgrad). How many sit on disk at
once (`files_at_peak`), per ``ModelCheckpoint``: the kept ones (``save_top_k``; ``-1`` keeps every save of the run),
``last.ckpt`` (a copy with ``save_last: true``, a link with ``save_last: link``) and one being written (a new top-k file
exists before the oldest is removed; ``last.ckpt`` is written to a temporary file beside it and renamed).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_modules.models.offload import GIB, OffloadedAdamW
from lightning_modules.models.precision import MasterWeightOptimizer, optimizer_tensors


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint, by part."""

    weights: int
    masters: int
    optimizer: int

    @property
    def full(self) -> int:
        return self.weights + self.masters + self.optimizer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor's numel is the full tensor's: the shards of all ranks together


def _moments_per_element(optimizer: torch.optim.Optimizer) -> int:
    """State tensors of the parameter's size that ``optimizer`` keeps per stepped tensor."""
    inner = getattr(optimizer, "inner", optimizer)
    groups = inner.param_groups
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return 3 if any(g.get("amsgrad") for g in groups) else 2
    if isinstance(inner, torch.optim.SGD):
        return 1 if any(g.get("momentum") for g in groups) else 0
    return 2  # an optimizer this estimate does not know: assumed Adam-like


def checkpoint_size(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> CheckpointSize:
    """One full checkpoint of ``module`` and its ``optimizers``, from the tensors' sizes (nothing is written)."""
    seen: set[tuple[int, int]] = set()
    weights = 0
    for t in module.state_dict().values():
        if not isinstance(t, torch.Tensor):
            continue
        if type(t).__name__ != "DTensor" and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen:  # tied weights are saved once
                continue
            seen.add(key)
        weights += _nbytes(t)
    masters = optimizer = 0
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # LightningOptimizer
        if isinstance(opt, MasterWeightOptimizer | OffloadedAdamW):
            masters += 4 * sum(p.numel() for p in module.parameters() if p.requires_grad and p.dtype != torch.float32)
        optimizer += _moments_per_element(opt) * sum(_nbytes(t) for t in optimizer_tensors(opt))
    return CheckpointSize(weights, masters, optimizer)


def _saves_in_run(cb: ModelCheckpoint, trainer: L.Trainer) -> int | None:
    """How many times ``cb`` saves over the whole run (None: unbounded or unknown)."""
    every_steps, every_epochs = cb._every_n_train_steps, cb._every_n_epochs
    if every_steps:
        steps = trainer.estimated_stepping_batches
        return int(steps // every_steps) if math.isfinite(steps) else None
    if every_epochs and trainer.max_epochs is not None and trainer.max_epochs > 0:
        return trainer.max_epochs // every_epochs
    return None


def files_at_peak(cb: ModelCheckpoint, trainer: L.Trainer, fresh: bool = False) -> tuple[int | None, str]:
    """(the most checkpoint files of ``cb`` on disk at once, None when unbounded; what they are, in words).
    ``fresh``: the folder holds no checkpoint yet, so a run that saves at most once writes beside nothing."""
    k = cb.save_top_k
    kept: int | None
    saves = _saves_in_run(cb, trainer)
    if k == -1:
        kept = saves
        what = f"save_top_k -1 keeps every save: {kept if kept is not None else 'an unbounded number'}"
    else:
        kept = k if saves is None else min(k, saves)
        what = f"save_top_k {k}"
    # save_last: link links last.ckpt to the newest kept file; with save_top_k 0 there is none, and Lightning writes a
    # full last.ckpt instead
    last = 1 if cb.save_last is True or (cb.save_last == "link" and k == 0) else 0
    if cb.save_last is True:
        what += " + last.ckpt"
    elif cb.save_last == "link":
        what += " + last.ckpt (a full file: save_top_k 0 keeps none to link to)" if k == 0 else " + last.ckpt (a link)"
    if kept is None:
        return None, what
    writing = 1 if kept + last > 0 and not (fresh and saves is not None and saves <= 1) else 0
    return kept + last + writing, what + (" + one being written" if writing else "")


def _free_bytes(folder: Path) -> int:
    """Free bytes of the disk that will hold ``folder`` (its nearest existing parent)."""
    p = folder.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


class CheckpointDisk(Callback):
    """Prints the size of one checkpoint and the free disk at the start of training, and refuses to train (one
    ``ValueError`` line naming ``save_top_k``) when the checkpoints the run keeps at once do not fit (module docstring).
    The CLI adds it to every trainer; it does nothing without a ``ModelCheckpoint``."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        if not checkpoints:
            return
        size = checkpoint_size(pl_module, list(trainer.optimizers))
        for folder in dict.fromkeys(Path(cb.dirpath) for cb in checkpoints):
            mine = [cb for cb in checkpoints if Path(cb.dirpath) == folder]
            self._check(trainer, folder, mine, size)

    def _check(self, trainer: L.Trainer, folder: Path, cbs: list[ModelCheckpoint], size: CheckpointSize) -> None:
        need, parts, unbounded = 0, [], False
        fresh = not folder.is_dir() or not any(p.name.endswith(".ckpt") for p in folder.iterdir())
        for cb in cbs:
            files, what = files_at_peak(cb, trainer, fresh)
            each = size.weights if cb.save_weights_only else size.full
            kind = "weights-only" if cb.save_weights_only else "full"
            parts.append(f"{what} ({kind}, {_gib(each)} each)")
            if files is None:
                unbounded = True
            else:
                need += files * each
        existing = sum(p.stat().st_size for p in folder.glob("*.ckpt") if p.is_file()) if folder.is_dir() else 0
        available = _free_bytes(folder) + existing  # the files there now are among those the run rotates
        line = (
            f"checkpoints: one full checkpoint ~{_gib(size.full)} (weights {_gib(size.weights)}, fp32 masters "
            f"{_gib(size.masters)}, optimizer state {_gib(size.optimizer)}); on disk at once: {'; '.join(parts)}"
            f"{' = ' + _gib(need) if not unbounded else ''}; {_gib(available)} free in {folder}"
        )
        if trainer.is_global_zero:
            print(line, flush=True)
        if need > available:
            raise ValueError(
                f"--callbacks.checkpoint.init_args.save_top_k: the checkpoints need {_gib(need)} in {folder} "
                f"({'; '.join(parts)}) but it has {_gib(available)} free: keep fewer (save_top_k 2 with monitor: step "
                "and mode: max keeps the newest two; save_last: link writes no copy for last.ckpt), free space, or "
                "point --trainer.default_root_dir at a larger disk"
            )
