"""The toy run's held-out summary: greedy Acc@0.5 of the policy before and after training on the toy yardstick's
fixed splits, printed when the fit ends (`make train` adds it through ``configs/overlays/heldout_summary.yaml``)::

    held-out greedy Acc@0.5 (512 toy scenes each of val + ood, seed 0): val 43.9 -> 41.0 (-2.9)  ood 13.9 -> 14.3 (+0.4)

The splits and the metric are ``bench/toy_yardstick.py``'s primary ones (experiments/toy_yardstick.md): the toy
world's ``val`` and ``ood`` splits at seed 0, ``scenes`` each (512), greedy decoding through the module's own
evaluation path (its evaluation prompt and length limit), Acc@0.5 = the first answered box at IoU >= 0.5 with the
target. No training, validation cap or tuning reads more than their first 64 scenes (the tiny configs validate on
those). The starting figure is measured at the fit's start and kept in the checkpoint, so a resumed run reports the
start of the whole run. Both figures go to ``<run folder>/results/heldout.json`` and the loggers (``heldout/...``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from core.boxes import iou
from datamodules import toy
from datamodules.rec import load_sample, read_jsonl


class HeldOutSummary(Callback):
    """Greedy Acc@0.5 on fixed held-out toy splits at the start and the end of ``fit``.

    Args:
        scenes: scenes per split (512: the yardstick's; a test may use a few).
        splits: toy splits to read (``val``: in-domain, ``ood``: textured backgrounds and crowded look-alikes).
        seed: the splits' toy seed (0, as the yardstick's and the tiny configs' validation).
        batch_size: scenes per greedy batch.
    """

    def __init__(
        self, scenes: int = 512, splits: tuple[str, ...] = ("val", "ood"), seed: int = 0, batch_size: int = 32
    ):
        if scenes < 1 or batch_size < 1:
            raise ValueError(
                f"--callbacks.heldout.init_args: scenes and batch_size must be >= 1, got {scenes} and {batch_size}"
            )
        unknown = [s for s in splits if s not in toy.SPLITS]
        if unknown:
            raise ValueError(
                f"--callbacks.heldout.init_args.splits: unknown toy splits {unknown}; choose from {tuple(toy.SPLITS)}"
            )
        self.scenes, self.splits, self.seed, self.batch_size = scenes, tuple(splits), seed, batch_size
        self.start: dict[str, float] | None = None
        self.final: dict[str, float] | None = None

    # ---------------------------------------------------------------------------------------------- measure
    def _folder(self, trainer: L.Trainer) -> Path:
        return Path(trainer.default_root_dir) / "heldout_data"

    @torch.no_grad()
    def measure(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, float]:
        """``{split: greedy Acc@0.5}`` of the module's policy now."""
        folder = self._folder(trainer)
        was_training = module.training
        module.eval()
        out = {}
        try:
            for split in self.splits:
                path = toy.export_jsonl(folder, split, self.scenes, seed=self.seed)
                samples = [load_sample(r) for r in read_jsonl(path)]
                hits = 0
                for i in range(0, len(samples), self.batch_size):
                    batch = samples[i : i + self.batch_size]
                    for s, a in zip(batch, module._greedy(batch)):
                        hits += bool(a.boxes and s.boxes and iou(a.boxes[0], s.boxes[0]) >= 0.5)
                out[split] = hits / len(samples)
        finally:
            module.train(was_training)
        return out

    def _usable(self, trainer: L.Trainer, module: L.LightningModule) -> bool:
        if trainer.world_size > 1:  # one process evaluates the whole policy; a sharded run uses `train.py test`
            if trainer.is_global_zero:
                print("held-out summary skipped: it runs on one process (use train.py test with the held-out overlay)")
            return False
        return hasattr(module, "_greedy")

    # ------------------------------------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start is None and self._usable(trainer, pl_module):
            t0 = time.time()
            self.start = self.measure(trainer, pl_module)
            print(f"held-out greedy Acc@0.5 at the start: {self._fmt(self.start)} ({time.time() - t0:.0f} s)")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start is None or not self._usable(trainer, pl_module):
            return
        self.final = self.measure(trainer, pl_module)
        parts = "  ".join(
            f"{s} {100 * self.start[s]:.1f} -> {100 * self.final[s]:.1f} ({100 * (self.final[s] - self.start[s]):+.1f})"
            for s in self.splits
        )
        print(f"held-out greedy Acc@0.5 ({self._what()}): {parts}")
        record = {
            "what": self._what(),
            "metric": "greedy Acc@0.5",
            "start": self.start,
            "final": self.final,
            "step": trainer.global_step,
        }
        out = Path(trainer.default_root_dir) / "results" / "heldout.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    f"heldout/{s}/acc50_{k}": v[s]
                    for k, v in (("start", self.start), ("final", self.final))
                    for s in self.splits
                },
                step=trainer.global_step,
            )

    def _what(self) -> str:
        return f"{self.scenes} toy scenes each of {' + '.join(self.splits)}, seed {self.seed}"

    def _fmt(self, figures: dict[str, float]) -> str:
        return "  ".join(f"{s} {100 * v:.1f}" for s, v in figures.items())

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"start": self.start, "settings": [self.scenes, list(self.splits), self.seed]}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("settings") == [self.scenes, list(self.splits), self.seed]:
            self.start = state_dict.get("start")
