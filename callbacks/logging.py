"""Run logging: the local metrics file the analysis notebook reads, a W&B logger that goes offline by itself, and a
gallery of rollouts with ground-truth and predicted boxes.

* ``MetricsJSONL``: one JSON object per line, flushed at every write, appended across resumes. The format is the
  notebook's contract (``runner.runs.read_metrics_jsonl``) and is documented in docs/analysis.md.
* ``OfflineAwareWandbLogger``: ``lightning.pytorch.loggers.WandbLogger`` that runs offline unless W&B can really be
  reached (an API key in the environment, ``WANDB_MODE=online`` or a sweep agent), and finishes its run when the
  trainer is done so that a second fit in the same process gets its own run.
* ``RolloutGallery``: at validation end, greedy answers on a fixed handful of validation samples drawn over the image
  (GT green, prediction red), written as PNGs under ``<default_root_dir>/gallery/`` and sent to every logger that has
  ``log_image`` (W&B). Optionally, every n training steps, the G sampled boxes of one training prompt: the picture of
  diversity (or of its collapse, when all G boxes coincide).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from PIL import Image, ImageDraw

from callbacks.gallery import GT_COLOUR, LINE_H, PRED_COLOUR, colour_key, draw_boxes, wrap
from core import rewards
from lightning_modules.evaluation.evaluator import greedy_answers
from lightning_modules.grpo.outputs import StepOutput

# ---------------------------------------------------------------------------------------------------------------------
# The local metrics file
# ---------------------------------------------------------------------------------------------------------------------

METRICS_FORMAT_VERSION = 1


def _fn(trainer: L.Trainer) -> str:
    """The trainer's entry point as a plain string: ``fit``, ``validate``, ``test`` or ``predict``."""
    fn = trainer.state.fn
    return str(getattr(fn, "value", fn))


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON: tensors to numbers / lists, non-finite floats to ``None``, unknown objects to str."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return json_safe(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


def run_identity(trainer: L.Trainer, name: str | None = None) -> tuple[str, str | None]:
    """(run name, W&B run id or None): ``name`` if given, else the CLI's run name (``trainer.run_name``), else the W&B
    run's name when a W&B logger is attached, else the last folder of ``default_root_dir``."""
    run_id = None
    name = name or getattr(trainer, "run_name", None)
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            exp = lg.experiment
            run_id = getattr(exp, "id", None)
            name = name or getattr(exp, "name", None) or None
    return name or Path(trainer.default_root_dir).resolve().name, run_id


class MetricsJSONL(Callback):
    """Append the run's metrics to a JSONL file: one line per training step and per validation / test epoch.

    Lines (each a JSON object with an ``event`` key; non-finite numbers are written as ``null``):

    * ``start``: when fit / validate / test begins (after a checkpoint is restored): ``run``, ``run_id``, ``stage``,
      ``resumed`` (fit from a checkpoint), ``step``, ``epoch``, ``hparams`` (the module's), ``time``, ``format``.
    * ``train``: every ``every_n_steps`` optimizer steps: ``step`` (optimizer steps done, 1 after the first),
      ``epoch``, ``batch_idx``, ``time`` (unix), ``elapsed`` (seconds since this process's ``start``), and every
      ``train/*`` metric the module logged.
    * ``val`` / ``test``: at the end of each validation / test run (sanity checks excluded): ``step``, ``epoch``,
      ``stage`` and every ``val/*`` / ``test/*`` metric (``val/<set>/acc50``, ``val/<set>/miou``, OVD ``map``, ...).
    * ``epoch``: once per training epoch, what callbacks logged at its end (every namespaced metric outside
      ``train/``, ``val/`` and ``test/``: ``synth/*``, ``synth/level/*``), when there is any: ``step``, ``epoch``
      and the values. Lightning reduces a callback's epoch-end logs after every ``on_train_epoch_end`` hook, so the
      row is written at the next epoch's start, or when training ends.
    * ``end``: when the trainer tears down: ``step``, ``status`` (``finished``, ``failed`` with ``error``, or
      ``interrupted``: written at once after a Ctrl-C, with the ``checkpoint`` it saved or null).

    A resumed fit appends to the same file; readers keep the rows of earlier segments up to the resumed step
    (``runner.runs.read_metrics_jsonl``). Only global rank 0 writes.

    Args:
        path: the file; default ``<dirpath>/<filename>``.
        dirpath: folder of the file; default the trainer's ``default_root_dir``.
        filename: file name inside ``dirpath``.
        run_name: name of the run in the file (the notebook's legend); default the W&B run's name when a W&B logger
            is attached, else the last folder of ``default_root_dir``.
        every_n_steps: write a ``train`` line every n optimizer steps (GRPO steps are expensive: default every step).
    """

    def __init__(
        self,
        path: str | None = None,
        dirpath: str | None = None,
        filename: str = "metrics.jsonl",
        run_name: str | None = None,
        every_n_steps: int = 1,
    ):
        if every_n_steps < 1:
            raise ValueError(f"MetricsJSONL every_n_steps must be >= 1, got {every_n_steps}")
        self.path = Path(path) if path else None
        self.dirpath = dirpath
        self.filename = filename
        self.run_name = run_name
        self.every_n_steps = every_n_steps
        self._fh = None
        self._t0: float | None = None
        self._started: str | None = None
        self._last_train_step: int | None = None
        self._error: str | None = None
        self._epoch_pending: int | None = None
        """The training epoch whose end-of-epoch row is still to be written."""

    def __getstate__(self) -> dict[str, Any]:  # picklable for spawn launchers: the handle reopens on first write
        state = dict(self.__dict__)
        state["_fh"] = None
        return state

    def resolve_path(self, trainer: L.Trainer) -> Path:
        if self.path is not None:
            return self.path
        return Path(self.dirpath or trainer.default_root_dir) / self.filename

    # ---------------------------------------------------------------------------------------------- writing
    def _write(self, trainer: L.Trainer, row: dict[str, Any]) -> None:
        if self._fh is None:
            path = self.resolve_path(trainer)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a", encoding="utf-8")
        self._fh.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
        self._fh.flush()

    @staticmethod
    def _metrics(trainer: L.Trainer, prefix: str) -> dict[str, Any]:
        out = {}
        for k, v in trainer.callback_metrics.items():
            if k.startswith(prefix):
                out[k] = json_safe(v)
        return out

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._started == stage or not trainer.is_global_zero:
            return
        self._started = stage
        self._t0 = time.time()
        name, run_id = run_identity(trainer, self.run_name)
        self._write(
            trainer,
            {
                "event": "start",
                "format": METRICS_FORMAT_VERSION,
                "run": name,
                "run_id": run_id,
                "stage": stage,
                "resumed": stage == "fit" and trainer.ckpt_path is not None,
                "ckpt_path": trainer.ckpt_path,
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "time": self._t0,
                "hparams": dict(pl_module.hparams),
            },
        )

    # ---------------------------------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module, "fit")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and _fn(trainer) == "validate":
            self._start(trainer, pl_module, "validate")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module, "test")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_pending = trainer.current_epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_epoch(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_epoch(trainer)

    def _write_epoch(self, trainer: L.Trainer) -> None:
        epoch, self._epoch_pending = self._epoch_pending, None
        if epoch is None or not trainer.is_global_zero:
            return
        values = {
            k: json_safe(v)
            for k, v in trainer.callback_metrics.items()
            if "/" in k and not k.startswith(("train/", "val/", "test/"))  # no progress-bar aliases ("iou")
        }
        if values:
            row = {"event": "epoch", "step": trainer.global_step, "epoch": epoch, "time": time.time(), **values}
            self._write(trainer, row)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last_train_step or step % self.every_n_steps:
            return  # (the same step again: gradient accumulation in automatic optimization)
        self._last_train_step = step
        now = time.time()
        self._write(
            trainer,
            {
                "event": "train",
                "step": step,
                "epoch": trainer.current_epoch,
                "batch_idx": batch_idx,
                "time": now,
                "elapsed": now - (self._t0 or now),
                **self._metrics(trainer, "train/"),
            },
        )

    def _eval_end(self, trainer: L.Trainer, pl_module: L.LightningModule, kind: str) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        self._start(trainer, pl_module, _fn(trainer))
        now = time.time()
        self._write(
            trainer,
            {
                "event": kind,
                "stage": _fn(trainer),
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "time": now,
                "elapsed": now - (self._t0 or now),
                **self._metrics(trainer, f"{kind}/"),
            },
        )

    # on_*_end, not on_*_epoch_end: Lightning reduces the epoch metrics (and the module logs mAP) after the callbacks'
    # epoch-end hooks, so only here does callback_metrics hold this evaluation's values.
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end(trainer, pl_module, "val")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end(trainer, pl_module, "test")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):  # Ctrl-C: Lightning exits without the teardown hooks
            self._end(trainer, _fn(trainer), "interrupted")
            return
        self._error = f"{type(exception).__name__}: {exception}"[:500]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning tears callbacks down while its status still reads "running": say how the stage really ended
        status = str(getattr(trainer.state.status, "value", trainer.state.status))
        status = "interrupted" if status == "interrupted" else "failed" if self._error else "finished"
        self._end(trainer, stage, status)

    def _end(self, trainer: L.Trainer, stage: str, status: str) -> None:
        """The ``end`` line (``checkpoint``: what a Ctrl-C saved, `cli.run_folder.RunEnd`), once per stage."""
        if self._fh is not None:
            row = {"event": "end", "stage": stage, "step": trainer.global_step, "status": status}
            if status == "interrupted":
                row["checkpoint"] = getattr(trainer, "interrupt_checkpoint", None)
            self._write(trainer, {**row, "error": self._error, "time": time.time()})
            self._fh.close()
            self._fh = None
        self._started = None
        self._last_train_step = None
        self._error = None
        self._epoch_pending = None


# ---------------------------------------------------------------------------------------------------------------------
# W&B
# ---------------------------------------------------------------------------------------------------------------------


def wandb_should_be_offline(env: Mapping[str, str] | None = None) -> bool:
    """Whether W&B must run offline, from the environment only.

    ``WANDB_MODE`` offline / dryrun -> offline; ``WANDB_MODE=online`` -> online; a sweep agent's run
    (``WANDB_SWEEP_ID``) -> online (it has to report to the sweep); else online iff ``WANDB_API_KEY`` is set. A key
    stored by ``wandb login`` (netrc) is not looked for: set ``offline: false`` or ``WANDB_MODE=online`` to use it.
    """
    env = os.environ if env is None else env
    mode = env.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun"):
        return True
    if mode == "online" or env.get("WANDB_SWEEP_ID"):
        return False
    return not env.get("WANDB_API_KEY")


class OfflineAwareWandbLogger(WandbLogger):
    """``WandbLogger`` that picks offline mode by itself when W&B cannot be reached (``wandb_should_be_offline``).

    Offline runs land in ``<save_dir>/wandb/offline-run-*`` and upload later with ``wandb sync <dir>``. Unlike
    ``WandbLogger(offline=True)`` it does not set ``WANDB_MODE`` in the process environment (it passes ``mode`` to
    ``wandb.init``), so other runs in the process are not silently forced offline.

    Args:
        name: display name of the run.
        save_dir: folder under which ``wandb/`` is created.
        project: W&B project (ignored by W&B inside a sweep, which fixes its own).
        tags: run tags, e.g. ``[syn-grpo, tiny]``.
        group: W&B run group (e.g. one per ablation).
        notes: free text attached to the run.
        offline: ``None`` decides from the environment; ``True`` / ``False`` force.
        finish_on_end: finish the W&B run when the trainer finalizes its loggers (end of fit / validate / test); a
            later use of the logger resumes the same run id.
        log_model: upload checkpoints as artifacts (needs online mode).
        **kwargs: passed to ``WandbLogger`` / ``wandb.init``.
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str = ".",
        project: str = "syn-grpo",
        tags: list[str] | None = None,
        group: str | None = None,
        notes: str | None = None,
        offline: bool | None = None,
        finish_on_end: bool = True,
        log_model: bool | str = False,
        **kwargs: Any,
    ):
        # LightningCLI (jsonargparse) follows **kwargs down to wandb.init's signature and passes every one of its
        # parameters, None included: a None must not override the defaults set here or WandbLogger's resume="allow".
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        self.offline = wandb_should_be_offline() if offline is None else bool(offline)
        if self.offline and log_model:
            raise ValueError(
                "--trainer.logger.init_args.log_model needs online W&B; set WANDB_API_KEY (or offline: "
                "false) or turn log_model off"
            )
        if self.offline and os.environ.get("WANDB_MODE", "").lower() != "disabled":
            kwargs.setdefault("mode", "offline")
        for key, value in (("tags", tags), ("group", group), ("notes", notes)):
            if value is not None:
                kwargs[key] = list(value) if key == "tags" else value
        super().__init__(name=name, save_dir=save_dir, project=project, offline=False, log_model=log_model, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # W&B warns that the setting has no effect
            self._wandb_init.pop("anonymous", None)
        self.finish_on_end = finish_on_end
        self.run_config: dict[str, Any] = {}
        """The run's full resolved config (set by ``cli.run_config.RunConfigCallback``), logged as the W&B config."""

    @property
    def experiment(self):
        # Lightning creates every logger's experiment at the start of setup, before the model loads and before a
        # checkpoint is restored: hold W&B back until its first real use (the hyper-parameters, after both), so that a
        # model that fails to load leaves no empty run and a resumed fit can continue its W&B run (``resume_run``).
        if self._experiment is None and _called_from_lightning_setup():
            raise AttributeError("the W&B run starts after the model loads")
        return WandbLogger.experiment.fget(self)

    def resume_run(self, run_id: str) -> None:
        """Continue the W&B run ``run_id`` (a resumed fit) instead of starting a new one; only before the run starts."""
        if self._experiment is None:
            self._wandb_init.update(id=run_id, resume="allow")

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The module's hyper-parameters, flat (W&B's columns), plus the run's full resolved config (trainer, data,
        optimizer, callbacks: synthesis settings, seed) nested under its own keys."""
        from lightning.fabric.utilities.logger import _convert_params

        super().log_hyperparams({**self.run_config, **_convert_params(params)})

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if not self.finish_on_end or self._experiment is None or not hasattr(self._experiment, "finish"):
            return
        run_id = getattr(self._experiment, "id", None)
        self._experiment.finish(exit_code=0 if status in ("success", "finished") else 1)
        if run_id:
            self._wandb_init["id"] = run_id  # a later .experiment resumes this run instead of starting another
        self._experiment = None


def _called_from_lightning_setup() -> bool:
    """Whether the caller is Lightning's ``_call_setup_hook`` (the loop that only triggers experiment creation)."""
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "_call_setup_hook":
            return True
    return False


def wandb_logger(
    project: str = "syn-grpo",
    name: str | None = None,
    tags: Sequence[str] | None = None,
    save_dir: str = ".",
    **kwargs: Any,
) -> OfflineAwareWandbLogger:
    """Build the project's W&B logger from Python (configs use ``class_path: callbacks.logging.OfflineAwareWandbLogger``)."""
    return OfflineAwareWandbLogger(
        name=name, save_dir=save_dir, project=project, tags=list(tags) if tags is not None else None, **kwargs
    )


# ---------------------------------------------------------------------------------------------------------------------
# Rollout gallery
# ---------------------------------------------------------------------------------------------------------------------

_GROUP_COLOURS = [
    (230, 0, 0),
    (0, 90, 230),
    (230, 140, 0),
    (160, 0, 200),
    (0, 170, 170),
    (120, 80, 0),
    (255, 0, 140),
    (90, 90, 90),
]


def _rec_score(boxes, gt_boxes) -> str:
    """A gallery caption's score of a REC answer: the IoU of its first box, or what it says about a no-target query
    (``gt_boxes`` empty: any box is a false alarm)."""
    if not gt_boxes:
        return "no target: false alarm" if boxes else "no target: no box"
    return f"IoU {rewards.iou(boxes[0], gt_boxes[0]):.2f}" if boxes else "no box"


def gallery_key(n_sets: int, colours: Sequence[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], str]]:
    """The colour key of a panel of ``n_sets`` predicted box sets: ground truth, then ``prediction`` (one set) or every
    colour with the completion it marks (``#0``, ``#1``, ..., as the panel's lines number them; past the last colour
    they repeat, which the key says)."""
    key = [(GT_COLOUR, "ground truth")]
    if n_sets <= 1:
        return key + [(colours[0], "prediction")]
    shown = min(n_sets, len(colours))
    key += [(colours[k], f"#{k}") for k in range(shown)]
    if n_sets > shown:
        key[-1] = (colours[shown - 1], f"#{shown - 1} (then the colours repeat: #{shown} is #0's)")
    return key


def gallery_panel(
    image: Image.Image,
    gt_boxes: Sequence[Sequence[float]],
    pred_boxes: Sequence[Sequence[Sequence[float]]],
    lines: Sequence[str],
    min_side: int = 256,
    colours: Sequence[tuple[int, int, int]] | None = None,
) -> Image.Image:
    """One picture: ``image`` with GT boxes (green) and predicted box sets (one colour per set), text lines below.

    ``pred_boxes[k]`` is the k-th set of predicted boxes (one set for a greedy answer, G sets for a group). Small images
    are enlarged (nearest) so that ``min(w, h) >= min_side``; boxes are in the original image's pixels.
    """
    scale = max(1.0, min_side / max(1, min(image.size)))
    size = (round(image.width * scale), round(image.height * scale))
    img = image.convert("RGB").resize(size, Image.NEAREST) if scale != 1.0 else image.convert("RGB")

    def sc(boxes):
        return [[float(v) * scale for v in b] for b in boxes]

    colours = list(colours or ([PRED_COLOUR] if len(pred_boxes) <= 1 else _GROUP_COLOURS))
    layers = [(sc(gt_boxes), GT_COLOUR, 3)] + [(sc(b), colours[k % len(colours)], 2) for k, b in enumerate(pred_boxes)]
    for boxes, _, width in layers:  # a dark halo first, so boxes stay visible on any background
        img = draw_boxes(
            img, [[b[0] - 1, b[1] - 1, b[2] + 1, b[3] + 1] for b in boxes], colour=(0, 0, 0), width=width + 2
        )
    for boxes, colour, width in layers:
        img = draw_boxes(img, boxes, colour=colour, width=width)
    wrapped: list[str] = []
    for line in lines:
        wrapped += wrap(str(line), img.width - 6, max_lines=3)
    key = gallery_key(len(pred_boxes), colours)
    panel = Image.new("RGB", (img.width, img.height + LINE_H * (len(wrapped) + 1) + 8), (255, 255, 255))
    panel.paste(img, (0, 0))
    draw = ImageDraw.Draw(panel)
    for i, line in enumerate(wrapped):
        draw.text((3, img.height + 3 + LINE_H * i), line, fill=(0, 0, 0))
    colour_key(draw, (3, img.height + 5 + LINE_H * len(wrapped)), key)
    return panel


def _log_images(trainer: L.Trainer, key: str, images: list[Image.Image], captions: list[str]) -> None:
    for lg in trainer.loggers:
        log_image = getattr(lg, "log_image", None)
        if callable(log_image):
            log_image(key=key, images=images, step=trainer.global_step, caption=captions)


class RolloutGallery(Callback):
    """Pictures of what the policy answers, with GT (green) and predicted (red / one colour per completion) boxes.

    At each validation end (``every_n_epochs``; sanity checks excluded) the policy answers greedily, as in evaluation,
    on the first ``num_samples`` samples of one validation set (always the same samples, so epochs compare). With
    ``train_every_n_steps > 0``, every n training steps the G completions of the first prompt of the batch
    (the step's `StepOutput`: ``completions`` and ``boxes``) are drawn over that prompt's image. PNGs go to ``<default_root_dir>/<dirname>/``
    (``val_e<epoch>_s<step>_<k>.png``, ``train_s<step>.png``) and to every logger with ``log_image`` (W&B:
    ``val/gallery``, ``train/rollouts``). Only global rank 0 draws; it needs a module with ``policy``, ``processor``
    and the GRPO hparams (``prompt_template``, ``max_new_tokens``).

    Args:
        num_samples: validation samples in the gallery.
        set_name: validation set to draw from (default: the first).
        every_n_epochs: draw at every n-th validation of a fit (validate / test stages always draw).
        max_new_tokens: answer length limit (default: the module's).
        train_every_n_steps: training-rollout pictures every n steps; 0 disables.
        dirname: folder under ``default_root_dir``.
        on_test: also draw at test end (from the first test set).
    """

    def __init__(
        self,
        num_samples: int = 4,
        set_name: str | None = None,
        every_n_epochs: int = 1,
        max_new_tokens: int | None = None,
        train_every_n_steps: int = 0,
        dirname: str = "gallery",
        on_test: bool = False,
    ):
        if num_samples < 1:
            raise ValueError(f"RolloutGallery num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.set_name = set_name
        self.every_n_epochs = max(1, every_n_epochs)
        self.max_new_tokens = max_new_tokens
        self.train_every_n_steps = train_every_n_steps
        self.dirname = dirname
        self.on_test = on_test
        self._samples: dict[str, list] = {}
        self._warned = False
        self.written: list[Path] = []
        """PNG files written by this callback (newest last)."""

    def _out_dir(self, trainer: L.Trainer) -> Path:
        out = Path(trainer.default_root_dir) / self.dirname
        out.mkdir(parents=True, exist_ok=True)
        return out

    def _usable(self, pl_module: L.LightningModule) -> bool:
        ok = getattr(pl_module, "policy", None) is not None and getattr(pl_module, "processor", None) is not None
        if not ok and not self._warned:
            rank_zero_warn("RolloutGallery: the module has no policy / processor; no gallery is drawn")
            self._warned = True
        return ok

    def _fixed_samples(self, trainer: L.Trainer, kind: str) -> list:
        if kind in self._samples:
            return self._samples[kind]
        sets = getattr(getattr(trainer, "datamodule", None), "eval_sets", {}).get(kind, {})
        if not sets:
            self._samples[kind] = []
            return []
        name = self.set_name if self.set_name in sets else next(iter(sets))
        ds = sets[name]
        self._samples[kind] = [ds[i] for i in range(min(self.num_samples, len(ds)))]
        return self._samples[kind]

    @torch.no_grad()
    def _draw_eval(self, trainer: L.Trainer, pl_module: L.LightningModule, kind: str) -> None:
        samples = self._fixed_samples(trainer, kind)
        if not samples or not self._usable(pl_module):
            return
        hp = pl_module.hparams  # GRPOModule's groups, or SFTModule's own keys
        sampling, evaluation = hp.get("sampling") or {}, hp.get("evaluation") or {}
        template = evaluation.get("prompt_template") or sampling.get("prompt_template") or hp.get("prompt_template")
        template = template or "syn_grpo"
        template = template if isinstance(template, str) else list(template)[0]  # SFT: a list of templates
        answers, _ = greedy_answers(
            pl_module.policy,
            pl_module.processor,
            samples,
            template=template,
            max_new_tokens=self.max_new_tokens or sampling.get("max_new_tokens") or 128,
            engine=(hp.get("engines") or {}).get("rollout_engine", "hf"),
        )
        out = self._out_dir(trainer)
        panels, captions = [], []
        for k, (s, a) in enumerate(zip(samples, answers)):
            boxes = a.boxes
            if s.task == "rec":
                score = _rec_score(boxes, s.boxes)
            else:
                score = f"{len(boxes)} boxes / {len(s.boxes)} GT"
            caption = f"{s.sample_id} | {s.query} | {score}"
            panel = gallery_panel(s.image, s.boxes, [boxes], [caption, a.text])
            path = out / f"{kind}_e{trainer.current_epoch:03d}_s{trainer.global_step:06d}_{k}.png"
            panel.save(path)
            self.written.append(path)
            panels.append(panel)
            captions.append(f"{caption} | {a.text[:200]}")
        _log_images(trainer, f"{kind}/gallery", panels, captions)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        if _fn(trainer) == "fit" and trainer.current_epoch % self.every_n_epochs:
            return
        self._draw_eval(trainer, pl_module, "val")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.on_test and trainer.is_global_zero:
            self._draw_eval(trainer, pl_module, "test")

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        n, out = self.train_every_n_steps, StepOutput.of(outputs)
        if n <= 0 or not trainer.is_global_zero or trainer.global_step % n or not (out and out.completions and batch):
            return
        first = out.rows_of(0)  # every row of the batch's first sample
        s = batch[0]
        sets, lines = [], [f"{s.sample_id} | {s.query} | step {trainer.global_step}, G={len(first)}"]
        lines.append(
            "#i: completion i (its box in the key's colour); v: its <diversity> score; its score; its description"
        )
        for i, (text, boxes) in enumerate((out.completions[r], out.boxes[r]) for r in first):  # original pixels
            p = rewards.parse_completion(text)
            sets.append(boxes)
            score = _rec_score(boxes, s.boxes) if s.task == "rec" else "no box"
            lines.append(f"#{i} v={p.diversity} {score}: {p.description or ''}")
        panel = gallery_panel(s.image, s.boxes, sets, lines)
        path = self._out_dir(trainer) / f"train_s{trainer.global_step:06d}.png"
        panel.save(path)
        self.written.append(path)
        _log_images(trainer, "train/rollouts", [panel], [lines[0]])
