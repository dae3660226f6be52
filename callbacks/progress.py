"""The progress bar of a run: the figures that tell whether GRPO is learning or collapsing, under short names.

Lightning's bar shows what the module marks ``prog_bar`` plus the logger's version (the W&B run id). ``RunProgressBar``
shows a fixed selection of logged metrics instead: reward, IoU, KL, entropy, ground-truth diversity and the main
validation metric (the first validation set's Acc@0.5, or mAP for OVD), once it exists.
"""

from __future__ import annotations

import re
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

DEFAULT_METRICS: dict[str, str] = {
    "reward": "train/reward/total",
    "iou": "train/iou",
    "kl": "train/kl",
    "ent": "train/entropy",
    "div": "train/diversity/gt",
    "loss": "train/loss",
}
"""Bar label -> logged metric; a metric not logged (yet) is left out."""

_MAIN_VAL = re.compile(r"^val/(?P<set>[^/]+)/(?P<metric>acc50|map)$")


def main_val_metric(metrics: dict[str, Any]) -> tuple[str, float] | None:
    """(label, value) of the first validation set's Acc@0.5 (REC) or mAP (OVD), e.g. ``("val toy_val acc50", 0.4)``."""
    for key, value in metrics.items():
        m = _MAIN_VAL.match(key)
        if m:
            return f"val {m['set']} {m['metric']}", float(value)
    return None


class RunProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` showing ``metrics`` (label -> logged key) and the main validation metric, without the
    logger's version number.

    Args:
        metrics: bar label -> logged metric key (``DEFAULT_METRICS``: reward, iou, kl, ent, div, loss).
        refresh_rate: update the bar every n batches.
        leave: keep the finished epoch's bar on screen.
        digits: significant digits shown.
    """

    def __init__(
        self,
        metrics: dict[str, str] | None = None,
        refresh_rate: int = 1,
        leave: bool = False,
        digits: int = 3,
    ):
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.metrics = dict(DEFAULT_METRICS if metrics is None else metrics)
        self.digits = digits

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict]:
        logged = trainer.callback_metrics
        out: dict[str, Any] = {}
        for label, key in self.metrics.items():
            if key in logged:
                out[label] = f"{float(logged[key]):.{self.digits}g}"
        main = main_val_metric(dict(logged))
        if main is not None:
            out[main[0]] = f"{main[1]:.{self.digits}g}"
        return out
