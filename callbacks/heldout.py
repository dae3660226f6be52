"""The toy run's held-out summary: greedy Acc@0.5 of the policy before and after training on the toy yardstick's
fixed splits, among the lines the run ends with (`summary_lines`, printed by `cli.run_folder.end_lines` after the
loggers' output; `make train` adds it through ``configs/overlays/heldout_summary.yaml``)::

    held-out greedy Acc@0.5 (512 toy scenes each of val + ood, seed 0; 95% CI: Wilson per figure, paired bootstrap
    over the scenes for the change):
      val 43.9 [39.6, 48.3] -> 41.0 [36.8, 45.3]  change -2.9 [-6.1, +0.3]
      ood 13.9 [11.2, 17.2] -> 14.3 [11.5, 17.6]  change +0.4 [-2.1, +2.9]

The splits and the metric are ``bench/toy_yardstick.py``'s primary ones (experiments/toy_yardstick.md): the toy
world's ``val`` and ``ood`` splits at seed 0, ``scenes`` each (512), greedy decoding through the module's own
evaluation path (its evaluation prompt and length limit), Acc@0.5 = the first answered box at IoU >= 0.5 with the
target. No training, validation cap or tuning reads more than their first 64 scenes (the tiny configs validate on
those): these are other figures than the validation table's, which says on how many samples it is. The starting
figure (and each scene's hit, for the paired interval) is measured at the fit's start and kept in the checkpoint, so
a resumed run reports the start of the whole run. A measurement prints a line per split as it goes (about 20 s a
split on one CPU thread). Both figures go to ``<run folder>/results/heldout.json`` and the loggers (``heldout/...``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
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
        self.start_hits: dict[str, list[int]] | None = None
        self.final: dict[str, float] | None = None
        self.lines: list[str] = []

    # ---------------------------------------------------------------------------------------------- measure
    def _folder(self, trainer: L.Trainer) -> Path:
        return Path(trainer.default_root_dir) / "heldout_data"

    @torch.no_grad()
    def measure(self, trainer: L.Trainer, module: L.LightningModule, when: str = "") -> dict[str, list[int]]:
        """``{split: [hit of each scene]}`` (greedy Acc@0.5) of the module's policy now; a line per split as it
        goes, and a running count on a terminal."""
        folder = self._folder(trainer)
        was_training = module.training
        module.eval()
        out: dict[str, list[int]] = {}
        tty = sys.stdout.isatty()
        print(f"held-out greedy Acc@0.5{when}: {len(self.splits)} x {self.scenes} toy scenes ...", flush=True)
        try:
            for split in self.splits:
                t0 = time.time()
                path = toy.export_jsonl(folder, split, self.scenes, seed=self.seed)
                samples = [load_sample(r) for r in read_jsonl(path)]
                hits: list[int] = []
                for i in range(0, len(samples), self.batch_size):
                    batch = samples[i : i + self.batch_size]
                    for s, a in zip(batch, module.greedy(batch)):
                        hits.append(int(bool(a.boxes and s.boxes and iou(a.boxes[0], s.boxes[0]) >= 0.5)))
                    if tty:
                        print(f"\r  {split}: {len(hits)}/{len(samples)} scenes", end="", flush=True)
                out[split] = hits
                lo, hi = wilson(sum(hits), len(hits))
                done = f"  {split} {100 * sum(hits) / len(hits):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
                print(("\r" if tty else "") + f"{done} ({len(hits)} scenes, {time.time() - t0:.0f} s)", flush=True)
        finally:
            module.train(was_training)
        return out

    def _usable(self, trainer: L.Trainer, module: L.LightningModule) -> bool:
        if trainer.world_size > 1:  # one process evaluates the whole policy; a sharded run uses `train.py test`
            if trainer.is_global_zero:
                print("held-out summary skipped: it runs on one process (use train.py test with the held-out overlay)")
            return False
        if not hasattr(module, "greedy"):
            print(f"held-out summary skipped: {type(module).__name__} has no greedy(batch) to read the scenes with")
            return False
        return True

    # ------------------------------------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start is None and self._usable(trainer, pl_module):
            self.start_hits = self.measure(trainer, pl_module, " at the start")
            self.start = {s: sum(h) / len(h) for s, h in self.start_hits.items()}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start is None or not self._usable(trainer, pl_module):
            return
        final_hits = self.measure(trainer, pl_module, " at the end")
        self.final = {s: sum(h) / len(h) for s, h in final_hits.items()}
        intervals = {s: self._intervals(s, final_hits[s]) for s in self.splits}
        self.lines = [f"held-out greedy Acc@0.5 ({self._what()}; 95% CI: {CI_NOTE}):"]
        for s in self.splits:
            ci = intervals[s]
            change = f"{100 * (self.final[s] - self.start[s]):+.1f}"
            if ci["change"] is not None:
                change += f" [{100 * ci['change'][0]:+.1f}, {100 * ci['change'][1]:+.1f}]"
            self.lines.append(
                f"  {s} {100 * self.start[s]:.1f} {_pct(ci['start'])} -> {100 * self.final[s]:.1f} "
                f"{_pct(ci['final'])}  change {change}"
            )
        record = {
            "what": self._what(),
            "metric": "greedy Acc@0.5",
            "start": self.start,
            "final": self.final,
            "ci95": {"method": CI_NOTE, **intervals},
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

    def _intervals(self, split: str, final: list[int]) -> dict[str, list[float] | None]:
        """Wilson intervals of both figures; the change's paired bootstrap when the start's hits are known (a
        checkpoint of an earlier version kept only the figure)."""
        n = len(final)
        start_hits = (self.start_hits or {}).get(split)
        start = wilson(round(self.start[split] * n), n)
        paired = start_hits is not None and len(start_hits) == n
        return {
            "start": list(start),
            "final": list(wilson(sum(final), n)),
            "change": list(paired_change(start_hits, final)) if paired else None,
        }

    def summary_lines(self) -> list[str]:
        """The held-out lines again, for the lines a run ends with (`cli.run_folder.end_lines`)."""
        return list(self.lines)

    def _what(self) -> str:
        return f"{self.scenes} toy scenes each of {' + '.join(self.splits)}, seed {self.seed}"

    def _fmt(self, figures: dict[str, float]) -> str:
        return "  ".join(f"{s} {100 * v:.1f}" for s, v in figures.items())

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        settings = [self.scenes, list(self.splits), self.seed]
        return {"start": self.start, "start_hits": self.start_hits, "settings": settings}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("settings") == [self.scenes, list(self.splits), self.seed]:
            self.start = state_dict.get("start")
            self.start_hits = state_dict.get("start_hits")


CI_NOTE = "Wilson per figure, paired bootstrap over the scenes for the change"


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a share ``hits / n`` (95% at ``z`` 1.96): sound at 0 and 1, unlike the normal one."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_change(start: list[int], final: list[int], replicates: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``mean(final) - mean(start)`` over the same scenes, resampled together."""
    diff = np.asarray(final, dtype=np.float64) - np.asarray(start, dtype=np.float64)  # [scenes]
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(replicates, len(diff)))].mean(axis=1)  # [replicates]
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def _pct(interval: list[float]) -> str:
    return f"[{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"
