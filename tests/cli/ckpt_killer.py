"""Test-only helpers for tests/cli/test_checkpoints.py: a `FSDP2Strategy` that SIGKILLs its own process in the middle of
one save (the shards and ``.metadata`` written, ``meta.pt`` half written), and a callback that records the step a fit
starts from."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from unittest import mock

import lightning as L
import torch

from lightning_modules.models.fsdp import FSDP2Strategy


class KillMidSave(FSDP2Strategy):
    """Dies while writing the staging folder of ``name`` at ``kill_at_step``."""

    def __init__(self, kill_at_step: int, name: str = "last.ckpt", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kill_at_step, self.name = kill_at_step, name

    def _write_staging(self, checkpoint, staging, storage_options=None) -> None:
        if not (staging.name.startswith(self.name + ".") and checkpoint.get("global_step") == self.kill_at_step):
            return super()._write_staging(checkpoint, staging, storage_options)

        real_save = torch.save

        def dying_save(obj, f, *args, **kwargs):  # ModelParallelStrategy writes meta.pt last, with torch.save
            if not (isinstance(f, (str, os.PathLike)) and Path(f).name == "meta.pt"):
                return real_save(obj, f, *args, **kwargs)  # DCP's own (non-tensor values of the shards)
            Path(f).write_bytes(b"PK\x03\x04" + b"\0" * 60)  # the first bytes of a zip archive, then nothing
            os.kill(os.getpid(), signal.SIGKILL)

        with mock.patch("torch.save", dying_save):
            super()._write_staging(checkpoint, staging, storage_options)


class StartStep(L.Callback):
    """Writes ``{"start": <global_step at on_train_start>, "end": <at fit end>}`` to ``out``."""

    def __init__(self, out: str) -> None:
        self.out, self.start = out, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = trainer.global_step

    def on_fit_end(self, trainer, pl_module) -> None:
        Path(self.out).write_text(json.dumps({"start": self.start, "end": trainer.global_step}))
