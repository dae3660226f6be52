"""A callback the multi-process tests add on the command line: each rank writes what it holds when training starts
(after a resume: what it restored) and at the end of fit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L


class RankProbe(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def _write(self, trainer, pl_module, name: str) -> None:
        pool = trainer.datamodule.pool
        state = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "lineage": {sid: [v.image_path for v in pool.lineage(sid)] for sid in pool.order},
            "smoother": pl_module.smoother.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"{name}{trainer.global_rank}.json").write_text(json.dumps(state))

    def on_train_start(self, trainer, pl_module):
        self._write(trainer, pl_module, "start_rank")

    def on_fit_end(self, trainer, pl_module):
        self._write(trainer, pl_module, "rank")
