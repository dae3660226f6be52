"""The study's table: per-run metrics, mean and 95% interval per method and test split, paired differences.

Reads the light records of ``study`` (``<out>/runs/<row>/<seed>/run.json`` + ``scenes.csv``) from any number of
folders (one per shard) and writes, into the results folder:

- ``runs.csv``: one line per run and test split (row, seed, metrics, seconds);
- ``table.csv``: one line per (method, split, metric): seeds, mean, 95% interval and which interval (``study.stats``);
- ``differences.csv``: per (A - B, split, metric): the observed difference and its paired-bootstrap interval;
- ``table.md``: the same as tables, percentages, with the intervals stated above them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from study import Study, plan
from study.stats import Interval, bootstrap_mean, paired_bootstrap, t_interval

SCENE_METRICS = {
    "acc50": lambda f: (f["iou"] >= 0.5).astype(float),
    "miou": lambda f: f["iou"].astype(float),
    "format": lambda f: f["format_ok"].astype(float),
    "tiou": lambda f: f["iou"].astype(float),
    "r1@0.3": lambda f: (f["iou"] >= 0.3).astype(float),
    "r1@0.5": lambda f: (f["iou"] >= 0.5).astype(float),
    "r1@0.7": lambda f: (f["iou"] >= 0.7).astype(float),
    "st": lambda f: f["iou"].astype(float),
    "when": lambda f: f["when"].astype(float),
    "where": lambda f: f["where"].astype(float),
    "locatability": lambda f: f["located"].astype(float),
    "confusion": lambda f: f["confused"].astype(float),
}
"""Per-scene score whose mean over scenes is the metric (REC: ``iou`` is the predicted box's IoU, 0 if none; clips:
the space's consistency, tIoU or Eq. 15). ``located`` / ``confused`` (CycleGRPO's cycle) are nan on a scene without a
target, which has no caption: those scenes leave the matrix (they are the same scenes for every run)."""

LABELS = {"acc50": "Acc@0.5", "miou": "mIoU", "format": "format"}


def read_evaluation(eval_dir: str | Path, evaluator: str = "predict") -> tuple[dict[str, dict[str, float]], Any]:
    """(``{set: {metric: value}}``, per-scene frame or None) of one evaluation folder (its ``default_root_dir``).

    ``predict``: ``predictions/summary.json`` and ``predictions/<set>.jsonl`` (frame columns ``set, sample_id, task,
    iou, format_ok``); ``test``: ``results/test.csv`` (no per-scene frame)."""
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
            cycle = r.get("cycle") or {}
            scores = r.get("scores") or {}
            rows.append(
                {
                    "set": name,
                    "sample_id": r["sample_id"],
                    "task": r["task"],
                    "iou": float(r["rewards"]["accuracy"]),
                    "format_ok": bool(r["format_ok"]),
                    "when": float(scores.get("when", math.nan)),
                    "where": float(scores.get("where", math.nan)),
                    "located": float(cycle["located"]) if cycle else math.nan,
                    "confused": float(cycle["confused"]) if cycle else math.nan,
                }
            )
    return per_set, pd.DataFrame(rows, columns=SCENE_COLUMNS)


SCENE_COLUMNS = ["set", "sample_id", "task", "iou", "format_ok", "when", "where", "located", "confused"]
"""``scenes.csv``'s columns (``when`` .. ``confused``: nan where a record has no such value)."""


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


def _scene_matrix(records: list[dict[str, Any]], split: str, metric: str) -> np.ndarray | None:
    """``[seeds, scenes]`` per-scene scores of one method on ``split``, scenes in sample-id order; None when a run has
    no per-scene answers (``evaluator: test``) or the runs did not answer the same scenes."""
    rows, ids = [], None
    for rec in records:
        f = rec.get("scenes")
        if f is None or metric not in SCENE_METRICS:
            return None
        f = f[f["set"] == split].sort_values("sample_id")
        if ids is None:
            ids = f["sample_id"].tolist()
        elif f["sample_id"].tolist() != ids:
            return None
        if metric in ("locatability", "confusion", "when", "where") and metric_column(metric) not in f:
            return None  # an older scenes.csv, from before the column
        rows.append(SCENE_METRICS[metric](f).to_numpy())
    if not rows or not ids:
        return None
    mat = np.stack(rows)
    defined = ~np.isnan(mat).any(axis=0)  # a scene without a target has no caption to locate
    return mat[:, defined] if defined.any() else None


def metric_column(metric: str) -> str:
    """The ``scenes.csv`` column a per-scene metric reads."""
    return {"locatability": "located", "confusion": "confused"}.get(metric, metric)


def _seed_values(records: list[dict[str, Any]], split: str, metric: str) -> list[float]:
    return [float(r["metrics"][split][metric]) for r in records if metric in r["metrics"].get(split, {})]


def build_tables(study: Study, records: dict[str, dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs, table, differences) frames of the study from its run records (see the module docstring)."""
    by_row: dict[str, list[dict[str, Any]]] = {r.name: [] for r in study.rows}
    for key in sorted(records, key=lambda k: (k.split("/")[0], records[k].get("seed") or 0)):
        rec = records[key]
        if rec["row"] in by_row:
            by_row[rec["row"]].append(rec)
    splits = list(study.test_splits)
    runs = [
        {"row": rec["row"], "label": rec["label"], "seed": rec["seed"], "set": s, **rec["metrics"].get(s, {}),
         "train_s": rec["seconds"].get("train"), "eval_s": rec["seconds"].get("eval")}
        for recs in by_row.values() for rec in recs for s in splits
    ]  # fmt: skip
    table = []
    for row in study.rows:
        recs = by_row[row.name]
        for s in splits:
            for m in study.metrics:
                vals = _seed_values(recs, s, m)
                if not vals:
                    continue
                iv: Interval = t_interval(vals)
                if iv.kind == "none":  # one run (Original): the bootstrap over scenes instead
                    mat = _scene_matrix(recs, s, m)
                    if mat is not None:
                        iv = bootstrap_mean(mat, study.replicates)._replace(mean=iv.mean, n=1)
                table.append(
                    {"row": row.name, "label": row.label, "ablation": row.ablation, "set": s, "metric": m,
                     "seeds": len(vals), "mean": iv.mean, "lo": iv.lo, "hi": iv.hi, "interval": iv.kind}
                )  # fmt: skip
    pairs = [(r.name, study.reference) for r in study.rows if study.reference and r.name != study.reference]
    pairs += [p for p in study.compare if p not in pairs]
    diffs = []
    for a, b in pairs:
        if not by_row.get(a) or not by_row.get(b):
            continue
        for s in splits:
            for m in study.metrics:
                ma, mb = _scene_matrix(by_row[a], s, m), _scene_matrix(by_row[b], s, m)
                if ma is None or mb is None or ma.shape[1] != mb.shape[1]:  # per-seed means only: seeds resampled
                    ma = np.array(_seed_values(by_row[a], s, m))[:, None]
                    mb = np.array(_seed_values(by_row[b], s, m))[:, None]
                    if not ma.size or not mb.size:
                        continue
                paired = ma.shape[0] == mb.shape[0] > 1 and [r["seed"] for r in by_row[a]] == [
                    r["seed"] for r in by_row[b]
                ]
                iv, _ = paired_bootstrap(ma, mb, study.replicates, paired_seeds=paired)
                diffs.append(
                    {"a": a, "b": b, "label": f"{study.row(a).label} - {study.row(b).label}", "set": s, "metric": m,
                     "seeds_a": ma.shape[0], "seeds_b": mb.shape[0], "scenes": ma.shape[1], "paired_seeds": paired,
                     "diff": iv.mean, "lo": iv.lo, "hi": iv.hi, "excludes_zero": iv.excludes_zero}
                )  # fmt: skip
    return pd.DataFrame(runs), pd.DataFrame(table), pd.DataFrame(diffs)


def _cell(mean: float, lo: float, hi: float) -> str:
    return f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def markdown(study: Study, table: pd.DataFrame, diffs: pd.DataFrame, missing: Sequence[str]) -> str:
    """``table.md``: what was run and how the intervals are made, then one table per metric and the differences."""
    video = study.world == "video"
    unit = "clips" if video else "scenes"
    heldout = "configs/study/heldout_video.yaml" if video else "configs/study/heldout.yaml"
    splits = ", ".join(f"`{s}` ({n} {unit})" for s, n in study.test_splits.items())
    lines = [
        f"# Study `{study.name}` ({study.path})",
        "",
        f"Held-out test splits: {splits}. Evaluator: `train.py {study.evaluator}` (greedy) on each run's final "
        f"checkpoint (`{heldout}`); Original is the starting checkpoint, evaluated the same way. "
        f"Seeds: {study.seeds}. Percentages.",
        "",
        "Intervals (95%): a method's cell is the mean over seeds of its per-seed score with a **t interval over seeds** "
        "(mean +- t(0.975, n-1) s / sqrt(n)); a row with one run (Original) gets a **bootstrap over scenes** instead. "
        "Differences use a **paired bootstrap over scenes and seeds** "
        f"({study.replicates} replicates; the same scenes for both sides, the same seeds when both ran the same "
        "seeds; percentile interval). `*`: the interval excludes 0.",
        "",
    ]
    if missing:
        lines += [f"**Missing runs** (not in the table): {', '.join(missing)}", ""]
    for m in study.metrics:
        t = table[table["metric"] == m] if len(table) else table
        if not len(t):
            continue
        lines += [f"## {LABELS.get(m, m)}", ""]
        head = ["method", "seeds", *study.test_splits]
        lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
        for row in study.rows:
            cells = t[t["row"] == row.name]
            if not len(cells):
                continue
            by_set = {r["set"]: _cell(r["mean"], r["lo"], r["hi"]) for _, r in cells.iterrows()}
            seeds = int(cells["seeds"].max())
            lines.append(
                "| " + " | ".join([row.label, str(seeds), *(by_set.get(s, "-") for s in study.test_splits)]) + " |"
            )
        lines.append("")
    if len(diffs):
        lines += ["## Differences (paired bootstrap over scenes and seeds)", ""]
        for m in study.metrics:
            d = diffs[diffs["metric"] == m]
            if not len(d):
                continue
            lines += [f"### {LABELS.get(m, m)}", ""]
            head = ["difference", *study.test_splits]
            lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
            for label, g in d.groupby("label", sort=False):
                by_set = {
                    r["set"]: ("+" if r["diff"] >= 0 else "") + _cell(r["diff"], r["lo"], r["hi"])
                    + (" *" if r["excludes_zero"] else "")
                    for _, r in g.iterrows()
                }  # fmt: skip
                lines.append("| " + " | ".join([label, *(by_set.get(s, "-") for s in study.test_splits)]) + " |")
            lines.append("")
    return "\n".join(lines)


def merge(study: Study, folders: Sequence[str | Path], results: str | Path, out: str | Path | None = None) -> Path:
    """Build the study's tables from the run records in ``folders`` (shards' ``--out`` folders) into ``results``;
    returns the markdown table's path. Runs of the plan with no record are listed as missing."""
    records = load_records(folders)
    planned, _ = plan(study, out or Path(folders[0]))
    missing = [r.key for r in planned if r.key not in records]
    runs, table, diffs = build_tables(study, records)
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    runs.to_csv(results / "runs.csv", index=False)
    table.to_csv(results / "table.csv", index=False)
    diffs.to_csv(results / "differences.csv", index=False)
    md = results / "table.md"
    md.write_text(markdown(study, table, diffs, missing) + "\n", encoding="utf-8")
    return md
