"""Lightning's checkpoint writer with its temporary file beside the checkpoint (`BesideCheckpointIO`).

The file mechanics it uses (the temporary file's name, the folder's sync) and the distributed checkpoint's staging,
switch and integrity checks are plain file operations, in ``core/checkpoint_files.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from core.checkpoint_files import fsync_dir, temp_path


class BesideCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with the temporary file beside the checkpoint (`temp_path`), not in the
    system temp folder.

    Why: Lightning's atomic save serialises the whole checkpoint into memory, then fsspec writes it to a file made by
    ``tempfile.mkstemp()`` (``/tmp``) and moves it in. A kill mid-write left that file in ``/tmp`` for good
    (gigabytes per kill at model size), and where ``/tmp`` is another filesystem the "move" is a second full copy,
    not a rename. Here ``torch.save`` streams into ``.<name>.<host>.<pid>.tmp`` in the checkpoint's folder (no copy in
    memory), syncs it and renames it over ``<name>``; a later fit on that machine removes what a killed save left
    (`remove_stale_temps`).
    Paths with a scheme (``s3://...``) keep Lightning's save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(final)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)


def use_beside_temp(strategy: Any) -> None:
    """Give ``strategy`` a `BesideCheckpointIO` where it would use Lightning's plain ``TorchCheckpointIO`` (a
    ``CheckpointIO`` given through ``--trainer.plugins`` is kept)."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = BesideCheckpointIO()
