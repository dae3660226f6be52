"""A study run's light record (``<out>/runs/<row>/seed<s>/``): written from its heavy run folder once the run is done,
read back for the table and the notebook (docs/study.md).

``run.json`` (written last: its presence marks the run as done), ``scenes.csv`` (one line per test scene: set, sample
id, IoU, format; ``predict`` only), ``metrics.jsonl`` (the training curves) and the logs.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from runner.points import Point
from runner.study_file import Study
from runner.study_plan import Run

SCENE_COLUMNS = [
    "set",
    "sample_id",
    "task",
    "iou",
    "format_ok",
    "tiou",
    "st",
    "when",
    "where",
    "located",
    "confused",
    "rejected",
    "answered",
    "prefix",
    "step1",
]
"""``scenes.csv``'s columns (``tiou`` .. ``confused``: nan where a record has no such value)."""


def read_evaluation(eval_dir: str | Path, evaluator: str = "predict") -> tuple[dict[str, dict[str, float]], Any]:
    """(``{set: {metric: value}}``, per-scene frame or None) of one evaluation folder (its ``default_root_dir``).

    ``predict``: ``predictions/summary.json`` and ``predictions/<set>.jsonl`` (frame columns ``SCENE_COLUMNS``);
    ``test``: ``results/test.csv`` (no per-scene frame)."""
    eval_dir = Path(eval_dir)
    if evaluator == "test":
        path = eval_dir / "results/test.csv"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the test run wrote no results table; see {eval_dir.parent}/eval.log")
        frame = pd.read_csv(path)
        per_set = {
            str(r["set"]): {k: float(v) for k, v in r.items() if k != "set" and pd.notna(v)}
            for _, r in frame.iterrows()
        }
        return per_set, None
    summary = eval_dir / "predictions/summary.json"
    if not summary.is_file():
        raise FileNotFoundError(f"{summary}: the predict run wrote no summary; see {eval_dir.parent}/eval.log")
    per_set = json.loads(summary.read_text())
    rows = []
    for name in per_set:
        for line in (eval_dir / "predictions" / f"{name}.jsonl").read_text().splitlines():
            r = json.loads(line)
            cycle, scores = r.get("cycle") or {}, r.get("scores") or {}
            rows.append(
                {
                    "set": name,
                    "sample_id": r["sample_id"],
                    "task": r["task"],
                    # an image query without a target scores its rejection (n_acc), not an IoU: left out of
                    # acc50 / miou as `callbacks.predictions.summarize` leaves it (clips keep it: tIoU's table)
                    "iou": math.nan if r.get("no_target") and r["task"] != "video" else float(r["rewards"]["accuracy"]),
                    "format_ok": bool(r["format_ok"]),
                    **{k: float(scores.get(k, math.nan)) for k in ("tiou", "st", "when", "where")},
                    "located": float(cycle["located"]) if cycle else math.nan,
                    "confused": float(cycle["confused"]) if cycle else math.nan,
                    "rejected": float(r["rejected"]) if "rejected" in r and r.get("no_target") else math.nan,
                    "answered": float(r["answered"]) if "answered" in r and not r.get("no_target") else math.nan,
                    "prefix": float(r["steps"]["prefix_credit"]) if r.get("steps") else math.nan,
                    "step1": float(r["steps"]["step1"]) if r.get("steps") else math.nan,
                }
            )
    return per_set, pd.DataFrame(rows, columns=SCENE_COLUMNS)


def load_records(folders: Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """``{key: run.json + {"scenes": frame or None, "folder": path}}`` of every finished run under ``folders``
    (``<folder>/runs/<row>/<seed>/run.json``); the first folder that has a key wins."""
    records: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("runs/*/*/run.json")):
            key = f"{path.parent.parent.name}/{path.parent.name}"
            if key in records:
                continue
            rec = json.loads(path.read_text())
            scenes = path.parent / "scenes.csv"
            rec["scenes"] = pd.read_csv(scenes) if scenes.is_file() else None
            rec["folder"] = str(path.parent)
            records[key] = rec
    return records


def mark_trained(point: Point) -> None:
    """``on_done`` of a training point: a marker that the fit exited with 0, so a resumed study evaluates its
    checkpoint instead of training again."""
    if point.returncode == 0 and point.folder is not None and point.log_name == "train.log":
        (point.folder / "TRAINED").write_text(json.dumps({"seconds": point.seconds}) + "\n")


def write_record(run: Run, study: Study) -> dict[str, Any]:
    """Copy what the table and the notebook need from the run's (heavy) folder into ``<out>/runs/<key>/``:
    ``scenes.csv`` (per test scene: set, sample id, IoU, format; ``predict`` only), ``metrics.jsonl`` (the training
    curves), the logs, and ``run.json`` (written last: its presence marks the run as done)."""
    rec = run.record
    rec.mkdir(parents=True, exist_ok=True)
    per_set, scenes = read_evaluation(run.work / "eval", study.evaluator)
    if scenes is not None:
        scenes.to_csv(rec / "scenes.csv", index=False)
    for name in ("metrics.jsonl", "train.log", "export.log", "eval.log", "config.yaml"):
        if (run.work / name).is_file():
            shutil.copy2(run.work / name, rec / name)
    seconds = {}
    if (run.work / "TRAINED").is_file():
        seconds["train"] = json.loads((run.work / "TRAINED").read_text()).get("seconds")
    seconds["eval"] = run.evaluate.seconds
    info = {
        "study": study.name,
        "row": run.row.name,
        "label": run.row.label,
        "ablation": run.row.ablation,
        "seed": run.seed,
        "evaluator": study.evaluator,
        "test_splits": study.test_splits,
        "metrics": per_set,
        "seconds": seconds,
        "train_argv": run.train.argv if run.train else None,
        "eval_argv": run.evaluate.argv,
    }
    (rec / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    return info
