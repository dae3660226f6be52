"""The study's table: per-run metrics, mean and 95% interval per method and test split, paired differences.

Reads the light records of ``study`` (``<out>/runs/<row>/<seed>/run.json`` + ``scenes.csv``) from any number of
folders (one per shard) and writes, into the results folder:

- ``runs.csv``: one line per run and test split (row, seed, metrics, seconds);
- ``table.csv``: one line per (method, split, metric): seeds, mean, 95% interval and which interval (`runner.stats`);
- ``differences.csv``: per (A - B, split, metric): the observed difference and its paired-bootstrap interval;
- ``table.md``: the same as tables, percentages, with the intervals stated above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.stats import Interval, bootstrap_mean, paired_bootstrap, t_interval
from runner.study_file import Study
from runner.study_plan import plan
from runner.study_records import load_records

SCENE_METRICS: dict[str, tuple[str, float | None]] = {
    "acc50": ("iou", 0.5),
    "miou": ("iou", None),
    "format": ("format_ok", None),
    "tiou": ("tiou", None),
    "r1@0.3": ("tiou", 0.3),
    "r1@0.5": ("tiou", 0.5),
    "r1@0.7": ("tiou", 0.7),
    "st": ("st", None),
    "when": ("when", None),
    "where": ("where", None),
    "locatability": ("located", None),
    "confusion": ("confused", None),
    "n_acc": ("rejected", None),
    "t_acc": ("answered", None),
    "prefix_credit": ("prefix", None),
    "step1_acc50": ("step1", None),
}
"""Metric -> (``scenes.csv`` column, threshold): the per-scene score whose mean over scenes is the metric, the column
itself or the indicator ``column >= threshold``. REC: ``iou`` is the predicted box's IoU, 0 if none; clips: ``tiou``
or ``st`` (Eq. 15), ``when`` / ``where``; CycleGRPO's cycle: ``located`` / ``confused``; GRES's ``n_acc`` /
``t_acc``: ``rejected`` on the clips without a target, ``answered`` on those with one; multi-step REC questions
``prefix_credit`` / ``step1_acc50``: ``prefix`` and ``step1`` (``evaluation.step_scores``). A value is nan where the
scene has none (a clip of the other region space; a scene without a target has no caption to locate): such scenes
leave the matrix, the same scenes for every run since they depend on the ground truth only."""

LABELS = {"acc50": "Acc@0.5", "miou": "mIoU", "format": "format"}


def _scene_scores(records: list[dict[str, Any]], split: str, metric: str) -> tuple[np.ndarray, list[str]] | None:
    """(``[seeds, scenes]`` per-scene scores of one method on ``split``, nan where a scene has none; the scenes'
    sample ids, sorted); None when a run has no per-scene answers (``evaluator: test``, or a ``scenes.csv`` from
    before the metric's column) or the runs did not answer the same scenes."""
    if metric not in SCENE_METRICS:
        return None
    column, threshold = SCENE_METRICS[metric]
    rows, ids = [], None
    for rec in records:
        f = rec.get("scenes")
        if f is None or column not in f:
            return None
        f = f[f["set"] == split].sort_values("sample_id")
        if ids is None:
            ids = f["sample_id"].tolist()
        elif f["sample_id"].tolist() != ids:
            return None
        v = f[column].astype(float).to_numpy()
        rows.append(v if threshold is None else np.where(np.isnan(v), np.nan, (v >= threshold).astype(float)))
    return (np.stack(rows), ids) if rows and ids else None


def _scene_matrix(records: list[dict[str, Any]], split: str, metric: str) -> np.ndarray | None:
    """`_scene_scores`' matrix without the scenes that have no value; None when nothing is left."""
    got = _scene_scores(records, split, metric)
    if got is None:
        return None
    keep = ~np.isnan(got[0]).any(axis=0)
    return got[0][:, keep] if keep.any() else None


def _paired_matrices(
    a: list[dict[str, Any]], b: list[dict[str, Any]], split: str, metric: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Two methods' per-scene matrices over the same scenes in the same order (the scenes both have a value for);
    None when either has no per-scene answers or they answered different scenes."""
    sa, sb = _scene_scores(a, split, metric), _scene_scores(b, split, metric)
    if sa is None or sb is None or sa[1] != sb[1]:
        return None
    keep = ~(np.isnan(sa[0]).any(axis=0) | np.isnan(sb[0]).any(axis=0))
    return (sa[0][:, keep], sb[0][:, keep]) if keep.any() else None


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
                va, vb = _seed_values(by_row[a], s, m), _seed_values(by_row[b], s, m)
                if not va or not vb:  # a metric the runs do not report (another region space's)
                    continue
                pair = _paired_matrices(by_row[a], by_row[b], s, m)
                if pair is None:  # per-seed means only: seeds resampled
                    pair = np.array(va)[:, None], np.array(vb)[:, None]
                ma, mb = pair
                paired = ma.shape[0] == mb.shape[0] > 1 and [r["seed"] for r in by_row[a]] == [
                    r["seed"] for r in by_row[b]
                ]
                iv, _ = paired_bootstrap(ma, mb, study.replicates, paired_seeds=paired)
                diffs.append(
                    {"a": a, "b": b, "label": f"{study.row(a).label} - {study.row(b).label}", "set": s, "metric": m,
                     "seeds_a": ma.shape[0], "seeds_b": mb.shape[0], "scenes": ma.shape[1], "paired_seeds": paired,
                     "diff": iv.mean, "lo": iv.lo, "hi": iv.hi, "excludes_zero": iv.excludes_zero and iv.hi > iv.lo}
                )  # fmt: skip
    return pd.DataFrame(runs), pd.DataFrame(table), pd.DataFrame(diffs)


def _differences_text(study: Study, diffs: pd.DataFrame) -> str:
    """How the differences were resampled: over scenes and seeds where the runs wrote per-scene answers, over seeds
    only where they wrote per-set metrics (``evaluator: test``)."""
    per_scene = bool(len(diffs)) and bool((diffs["scenes"] > 1).any())
    per_seed = bool(len(diffs)) and bool((diffs["scenes"] == 1).any())
    reps = f"{study.replicates} replicates"
    text = {
        (True, False): "Differences use a **paired bootstrap over scenes and seeds** "
        f"({reps}; the same scenes for both sides, the same seeds when both ran the same seeds; percentile interval).",
        (False, True): "Differences use a **bootstrap over seeds only** "
        f"({reps}; the runs reported per-set metrics, `evaluator: test`: coarse with 3 seeds; percentile interval).",
        (True, True): "Differences use a **paired bootstrap over scenes and seeds** where both runs wrote per-scene "
        f"answers, over seeds only elsewhere (the `scenes` column of differences.csv; {reps}; percentile interval).",
        (False, False): "",
    }[(per_scene, per_seed)]
    return text + " `*`: the interval excludes 0 (an interval of zero width, no spread to estimate, is not starred)."


def _cell(mean: float, lo: float, hi: float) -> str:
    return f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def markdown(study: Study, table: pd.DataFrame, diffs: pd.DataFrame, missing: Sequence[str]) -> str:
    """``table.md``: what was run and how the intervals are made, then one table per metric and the differences."""
    video = study.world == "video"
    unit = "clips" if video else "scenes"
    heldout = "experiments/study/heldout_video.yaml" if video else "experiments/study/heldout.yaml"
    splits = ", ".join(f"`{s}` ({n} {unit})" for s, n in study.test_splits.items())
    lines = [
        f"# Study `{study.name}` ({study.path})",
        "",
        f"Held-out test splits: {splits}. Evaluator: `train.py {study.evaluator}` (greedy) on each run's final "
        f"checkpoint (`{heldout}`); Original is the starting checkpoint, evaluated the same way. "
        f"Seeds: {study.seeds}. Percentages.",
        "",
        "Intervals (95%): a method's cell is the mean over seeds of its per-seed score with a **t interval over "
        "seeds** (mean +- t(0.975, n-1) s / sqrt(n)); a row with one run (Original) gets a **bootstrap over scenes** "
        "instead "
        "(none with per-set metrics only). " + _differences_text(study, diffs),
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
        over = (
            "scenes and seeds"
            if len(diffs) and (diffs["scenes"] > 1).all()
            else "seeds"
            if (len(diffs) and (diffs["scenes"] == 1).all())
            else "scenes and seeds, or seeds only"
        )
        lines += [f"## Differences (paired bootstrap over {over})", ""]
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
