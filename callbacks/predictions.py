"""``train.py predict``: the policy's greedy answers as JSONL, one file per test set, and their metrics.

Each line (``GRPOModule.predict_step``): ``sample_id``, ``task``, ``query``, ``completion`` (the text), ``boxes``
(parsed, original pixels), ``gt_boxes``, ``format_ok`` and ``rewards`` (``accuracy``: IoU for REC, ``s_ovd * mAP``
for OVD; ``format``). At the end the REC sets' Acc@0.5 / mIoU and every set's format rate are printed and written to
``summary.json``: the same numbers ``train.py test`` reports for the same model (tests/cli/test_export.py checks it).
A method may write its own records (``Method.predict``): CycleGRPO's clips carry their region answers, per-clip
``scores`` and, like its image records, the ``cycle`` of each target (caption, located, confused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
from lightning.pytorch.callbacks import BasePredictionWriter

from callbacks.logging import json_safe


class PredictionsJSONL(BasePredictionWriter):
    """Write ``predict_step``'s dicts as ``<default_root_dir>/<dirname>/<set>.jsonl`` (global rank 0 of each batch's
    process writes its own rows; one process in practice).

    Args:
        dirname: folder under the run folder.
    """

    def __init__(self, dirname: str = "predictions"):
        super().__init__(write_interval="batch")
        self.dirname = dirname
        self.paths: dict[str, Path] = {}
        """Set name -> the file written in this predict run."""
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def _set_name(self, trainer: L.Trainer, dataloader_idx: int) -> str:
        dm = getattr(trainer, "datamodule", None)
        names = dm.eval_names("test") if dm is not None and hasattr(dm, "eval_names") else []
        return names[dataloader_idx] if dataloader_idx < len(names) else f"set{dataloader_idx}"

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.paths, self._rows = {}, {}

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if not prediction:
            return
        name = self._set_name(trainer, dataloader_idx)
        path = self.paths.get(name)
        if path is None:
            path = Path(trainer.default_root_dir) / self.dirname / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("", encoding="utf-8")
            self.paths[name] = path
        with path.open("a", encoding="utf-8") as fh:
            for row in prediction:
                fh.write(json.dumps(json_safe(row)) + "\n")
        self._rows.setdefault(name, []).extend(prediction)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._rows or not trainer.is_global_zero:
            return
        summary = {name: summarize(rows) for name, rows in self._rows.items()}
        out = Path(trainer.default_root_dir) / self.dirname
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        table = pd.DataFrame(summary).T.mul(100).round(1)
        print(f"\npredictions (percent), written to {out}/\n{table.to_string()}\n", flush=True)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Metrics of one set's predictions: REC ``acc50`` (IoU >= 0.5) and ``miou``, OVD mean ``s_ovd * mAP``
    (``ovd_reward``), and ``format`` (the rate of well-formed answers), all in [0, 1]. CycleGRPO's records
    (`CycleGRPO.predict`) add its ``test`` metrics: clips ``tiou`` / ``r1@{0.3,0.5,0.7}`` (intervals) or ``when`` /
    ``where`` / ``st`` (anchors), ``n_acc`` / ``t_acc``, ``cycle_acc50``; REC sets with no-target queries ``n_acc``
    / ``t_acc`` (their ``acc50`` / ``miou`` over the queries with a target); REC sets of multi-step questions
    ``prefix_credit`` / ``step1_acc50`` (the ``<step>`` boxes against the question's chain); both worlds ``locatability`` /
    ``confusion`` over the samples with a target (``cycle``). Not rebuilt: the clips' ``ciou`` (a ratio of sums over
    the set)."""
    out = _summarize_boxes([r for r in rows if r["task"] != "video"])
    video = [r for r in rows if r["task"] == "video"]
    if video:
        scores = pd.DataFrame([r["scores"] for r in video])
        for k in scores.columns:
            out[k] = float(scores[k].mean())
        if "tiou" in scores:
            for t in (0.3, 0.5, 0.7):
                out[f"r1@{t:g}"] = float((scores["tiou"] >= t).mean())
        nt = [r["rejected"] for r in video if r["no_target"]]
        tg = [r["answered"] for r in video if not r["no_target"]]
        if nt:
            out["n_acc"] = sum(nt) / len(nt)
        if tg:
            out["t_acc"] = sum(tg) / len(tg)
        out["format"] = sum(bool(r["format_ok"]) for r in video) / len(video)
    cycles = [r["cycle"] for r in rows if r.get("cycle")]
    if cycles:
        out["locatability"] = sum(bool(c["located"]) for c in cycles) / len(cycles)
        out["confusion"] = sum(bool(c["confused"]) for c in cycles) / len(cycles)
    clip_cycles = [r["cycle"] for r in video if r.get("cycle")]
    if clip_cycles:  # the clips' cycle_acc50: back onto its own moment at consistency >= 0.5, look-alikes aside
        out["cycle_acc50"] = sum(c["own"] >= 0.5 for c in clip_cycles) / len(clip_cycles)
    return out


def _summarize_boxes(rows: list[dict[str, Any]]) -> dict[str, float]:
    if not rows:
        return {}
    frame = pd.DataFrame(
        [
            {
                "task": r["task"],
                "acc": r["rewards"]["accuracy"],
                "fmt": r["format_ok"],
                "nt": bool(r.get("no_target")),
                "answered": bool(r.get("answered", r.get("boxes"))),
            }
            for r in rows
        ]
    )
    out: dict[str, float] = {}
    rec = frame[(frame["task"] == "rec") & ~frame["nt"]]  # no-target queries: n_acc alone, as the evaluator does
    if len(rec):
        out["acc50"] = float((rec["acc"] >= 0.5).mean())
        out["miou"] = float(rec["acc"].mean())
    nt = frame[(frame["task"] == "rec") & frame["nt"]]
    if len(nt):  # their accuracy is the rejection (GRPOModule.rec_predictions)
        out["n_acc"] = float(nt["acc"].mean())
        if len(rec):
            out["t_acc"] = float(rec["answered"].mean())
    ovd = frame[frame["task"] == "ovd"]
    if len(ovd):
        out["ovd_reward"] = float(ovd["acc"].mean())
    math_rows = frame[frame["task"] == "math"]  # EvolvedGRPO's answer model (MathAnswer.predict): boxed accuracy
    if len(math_rows):
        out["accuracy"] = float(math_rows["acc"].mean())
    steps = [r["steps"] for r in rows if r.get("steps")]
    if steps:  # multi-step questions (`evaluation.evaluator.step_scores`): are the written steps grounded?
        out["prefix_credit"] = sum(st["prefix_credit"] for st in steps) / len(steps)
        out["step1_acc50"] = sum(bool(st["step1"]) for st in steps) / len(steps)
    out["format"] = float(frame["fmt"].mean())
    return out
