"""The completions table: what the policy wrote, its boxes and its rewards, every n training steps (TRL logs the same).

Fed by what ``GRPOModule.training_step`` returns (its `StepOutput`: ``completions``, ``boxes`` in original pixels,
``rewards`` per part, each row's sample), so nothing is generated or parsed twice. Rows go to

* W&B as the table ``train/completions`` (one row per completion; the image with its boxes drawn as W&B boxes: GT and
  this completion's prediction), through ``WandbLogger.log_table``;
* ``<run folder>/completions.jsonl`` (one JSON object per completion, no image), readable offline with pandas.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from callbacks.logging import json_safe
from lightning_modules.grpo.outputs import StepOutput

COLUMNS = [
    "step",
    "sample_id",
    "query",
    "k",
    "completion",
    "boxes",
    "gt_boxes",
    "total",
    "accuracy",
    "format",
    "diversity",
]


def wandb_boxes(gt: list[list[float]], pred: list[list[float]], size: tuple[int, int]) -> dict[str, Any]:
    """W&B ``boxes`` argument of ``wandb.Image``: ground truth and prediction, pixel coordinates."""

    def group(boxes: list[list[float]], class_id: int, caption: str) -> dict[str, Any]:
        w, h = size
        data = []
        for b in boxes:
            x1, y1, x2, y2 = (float(v) for v in b)
            x1, x2 = sorted((min(max(x1, 0.0), w), min(max(x2, 0.0), w)))
            y1, y2 = sorted((min(max(y1, 0.0), h), min(max(y2, 0.0), h)))
            pos = {"minX": x1, "minY": y1, "maxX": x2, "maxY": y2}
            data.append({"position": pos, "domain": "pixel", "class_id": class_id, "box_caption": caption})
        return {"box_data": data, "class_labels": {0: "ground truth", 1: "prediction"}}

    return {"ground_truth": group(gt, 0, "gt"), "predictions": group(pred, 1, "pred")}


class CompletionsTable(Callback):
    """Log the completions of the first ``max_prompts`` prompts of a training batch every ``every_n_steps`` steps.

    Args:
        every_n_steps: log at optimizer steps that are multiples of n (and at step 1).
        max_prompts: prompts per logged step (each brings its G completions).
        jsonl: also append the rows (without images) to ``<run folder>/completions.jsonl``.
        images: attach the image with W&B boxes to each W&B row.
    """

    def __init__(self, every_n_steps: int = 50, max_prompts: int = 2, jsonl: bool = True, images: bool = True):
        if every_n_steps < 1:
            raise ValueError(
                f"--callbacks.completions.init_args.every_n_steps must be >= 1, got {every_n_steps}; "
                "remove the callback (completions: null) to switch it off"
            )
        self.every_n_steps = every_n_steps
        self.max_prompts = max_prompts
        self.jsonl = jsonl
        self.images = images
        self.logged_steps: list[int] = []

    def rows(self, step: int, out: StepOutput) -> list[dict[str, Any]]:
        """One row per completion of the first ``max_prompts`` samples the step's rows answer."""
        out_rows = []
        for b, s in enumerate(out.samples[: self.max_prompts]):  # the versions the rows answer (a method may re-roll)
            for k, i in enumerate(out.rows_of(b)):
                out_rows.append(
                    {
                        "step": step,
                        "sample_id": s.sample_id,
                        "query": s.query,
                        "k": k,
                        "completion": out.completions[i],
                        "boxes": [[round(float(v), 1) for v in box] for box in out.boxes[i]],
                        "gt_boxes": [[float(v) for v in box] for box in s.boxes],
                        **{
                            part: out.rewards[part][i]
                            for part in ("total", "accuracy", "format", "diversity")
                            if part in out.rewards
                        },
                    }
                )
        return out_rows

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        step, out = trainer.global_step, StepOutput.of(outputs)
        if not trainer.is_global_zero or out is None:
            return
        if step != 1 and step % self.every_n_steps:
            return
        rows = self.rows(step, out)
        if not rows:
            return
        self.logged_steps.append(step)
        if self.jsonl:
            path = Path(trainer.default_root_dir) / "completions.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as fh:
                for r in rows:
                    fh.write(json.dumps(json_safe(r)) + "\n")
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if loggers:
            self._log_wandb(loggers, step, rows, batch)

    def _log_wandb(self, loggers: list[WandbLogger], step: int, rows: list[dict[str, Any]], batch: list) -> None:
        import wandb

        images = {s.sample_id: s for s in batch[: self.max_prompts]}
        columns = COLUMNS + (["image"] if self.images else [])
        data = []
        for r in rows:
            cells = [json.dumps(r.get(c)) if c in ("boxes", "gt_boxes") else r.get(c) for c in COLUMNS]
            if self.images:
                s = images[r["sample_id"]]
                cells.append(wandb.Image(s.image, boxes=wandb_boxes(s.boxes, r["boxes"], s.size)))
            data.append(cells)
        for lg in loggers:
            lg.log_table(key="train/completions", columns=columns, data=data, step=step)
