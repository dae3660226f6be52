"""The run's config: a copy saved in the run folder (never over an earlier one), handed to W&B as the run's config,
and the W&B run id kept in checkpoints so that a resumed fit logs into the same W&B run (docs/outputs.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch.cli import SaveConfigCallback


class RunConfigCallback(SaveConfigCallback):
    """Saves the resolved config in the run folder, never over an earlier one (:meth:`config_name`), hands it to every
    logger that takes a ``run_config`` (W&B logs it as the run's config), and keeps the W&B run id in checkpoints so
    that a resumed fit continues the same W&B run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("overwrite", True)
        super().__init__(*args, **kwargs)
        self._trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        resolved = _plain(self.parser.dump(self.config, skip_none=False, format="yaml"))
        for lg in trainer.loggers:
            if hasattr(lg, "run_config"):
                lg.run_config = resolved

    # The copy is written once the model has loaded and the stage starts (not at setup): a launch that fails before
    # (a model path without weights, a data error) writes no config-N.yaml into a run folder.
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "fit")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "validate")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "predict")

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir  # broadcasts the directory: every rank calls it
            name = (
                self.config_name(log_dir, stage, resumed=bool(self.config.get("ckpt_path")))
                if trainer.is_global_zero
                else None
            )
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)

    @staticmethod
    def config_name(log_dir: str | os.PathLike | None, stage: Any, resumed: bool = False) -> str:
        """The config copy's file name: ``config.yaml`` for a fit, ``config-resume.yaml`` for a resumed fit,
        ``config-<stage>.yaml`` for validate / test / predict; ``-2``, ``-3``, ... when that file exists already, so
        a resume, an evaluation or a second launch never overwrites the config of the run before it."""
        stage = str(getattr(stage, "value", stage))  # Lightning passes a TrainerFn
        base = "config" if stage == "fit" and not resumed else "config-resume" if stage == "fit" else f"config-{stage}"
        folder = Path(log_dir or ".")
        name, k = f"{base}.yaml", 1
        while (folder / name).exists():
            k += 1
            name = f"{base}-{k}.yaml"
        return name

    def state_dict(self) -> dict[str, Any]:
        ids = [_wandb_id(lg) for lg in (self._trainer.loggers if self._trainer is not None else [])]
        return {"wandb_run_id": next((i for i in ids if i), None)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        run_id = state_dict.get("wandb_run_id")
        trainer = self._trainer
        if not run_id or trainer is None or str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
            return  # validate / test of a checkpoint log to a run of their own (W&B steps must not go back)
        for lg in trainer.loggers:
            if hasattr(lg, "resume_run"):
                lg.resume_run(run_id)


def _wandb_id(logger: Any) -> str | None:
    exp = getattr(logger, "_experiment", None)
    init = getattr(logger, "_wandb_init", None)
    if exp is not None and getattr(exp, "id", None):
        return exp.id
    return init.get("id") if isinstance(init, dict) else None


def _plain(dumped: str) -> dict[str, Any]:
    return yaml.safe_load(dumped) or {}
