"""What the study's rows did while training: per row, the mean of a ``train/*`` curve over a run's steps, with a 95% t
interval over seeds, per third of training, and the seed-paired differences of the study's comparisons.

    python -m runner.study training experiments/study/evolved_toy_in_step.yaml OUT [OUT ...] [--key train/zero_variance_frac ...]

Reads ``<out>/runs/<row>/seed<s>/metrics.jsonl`` (the records a study writes, `runner.study_records.write_record`) and writes
``training.md`` and ``training.csv`` into the results folder. The held-out table (`runner.study_report`) says where the
rows end; this says how they trained: the zero-variance fraction (groups that give no gradient), which way tied
groups converge, EvolvedGRPO's levels, and the sampled rewards (whether the policy improved on its training questions
at all: a row whose accuracy reward stays flat over the thirds learned nothing a held-out split could show). A
difference ``a - b`` pairs the runs of one seed (same data order) and takes the t interval of the per-seed
differences.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from runner.stats import t_interval
from runner.study_file import Study

KEYS = (
    "train/zero_variance_frac",
    "train/all_wrong_frac",
    "train/all_correct_frac",
    "train/level/reroll/frac",
    "train/level/reroll/mixed",
    "train/level/mean",
    "train/reward/accuracy",
    "train/cycle/caption_reward",
    "train/cycle/grounding_reward",
)
"""Curves read by default (a row that does not log one leaves its cell empty)."""


def run_curves(folders: Sequence[str | Path]) -> dict[tuple[str, int], list[dict]]:
    """``{(row, seed): the run's training rows}`` of every ``runs/<row>/seed<s>/metrics.jsonl`` under ``folders``
    (the first folder that has a run wins); a row is a training step's line (it has ``train/reward/total``)."""
    out: dict[tuple[str, int], list[dict]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("runs/*/seed*/metrics.jsonl")):
            key = (path.parent.parent.name, int(path.parent.name.removeprefix("seed")))
            if key in out:
                continue
            steps = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a killed run
                    continue
                if "train/reward/total" in rec:
                    steps.append(rec)
            out[key] = steps
    return out


def _means(steps: list[dict], key: str) -> tuple[float, list[float]] | None:
    """(mean over the run's steps, means over its thirds) of ``key``; None when the run never logged it."""
    idx = [i for i, r in enumerate(steps) if key in r]
    if not idx:
        return None
    vals = np.array([float(steps[i][key]) for i in idx])
    parts = [p for p in np.array_split(vals, 3) if p.size]
    return float(vals.mean()), [float(p.mean()) for p in parts]


def training_table(study: Study, folders: Sequence[str | Path], keys: Sequence[str] = KEYS) -> pd.DataFrame:
    """One line per (key, row or difference): seeds, mean and 95% t interval over seeds of the per-run mean (for a
    difference: of the per-seed differences), and the mean per third of training."""
    curves = run_curves(folders)
    lines = []
    per_seed: dict[tuple[str, str], dict[int, float]] = {}
    for key in keys:
        for row in study.rows:
            if row.train is False:
                continue
            runs = {s: _means(steps, key) for (r, s), steps in curves.items() if r == row.name}
            runs = {s: m for s, m in runs.items() if m is not None}
            if not runs:
                continue
            per_seed[(key, row.name)] = {s: m[0] for s, m in runs.items()}
            ci = t_interval([m[0] for m in runs.values()])
            thirds = np.mean([m[1] for m in runs.values() if len(m[1]) == 3], axis=0) if runs else []
            lines.append(_line(key, row.label or row.name, len(runs), ci, thirds))
        for a, b in study.compare:
            sa, sb = per_seed.get((key, a)), per_seed.get((key, b))
            if not sa or not sb:
                continue
            seeds = sorted(set(sa) & set(sb))
            if not seeds:
                continue
            ci = t_interval([sa[s] - sb[s] for s in seeds])
            label = f"{study.row(a).label or a} - {study.row(b).label or b}"
            lines.append(_line(key, label, len(seeds), ci, [], difference=True))
    return pd.DataFrame(lines)


def _line(key, label, n, ci, thirds, difference: bool = False) -> dict:
    return {
        "key": key,
        "row": label,
        "difference": difference,
        "seeds": n,
        "mean": ci.mean,
        "lo": ci.lo,
        "hi": ci.hi,
        "interval": ci.kind,
        **{f"third{i + 1}": float(v) for i, v in enumerate(thirds)},
    }


def markdown(study: Study, table: pd.DataFrame) -> str:
    """The table as markdown, fractions in percent (level means as they are)."""
    out = [
        f"# Training curves of study `{study.name}` ({study.path})",
        "",
        "Per row: the mean of the curve over a run's steps, then the mean over seeds with a 95% t interval over "
        "seeds; thirds: the mean over seeds of each third of training. Differences pair the runs of one seed. "
        "Fractions in percent.",
    ]
    for key, part in table.groupby("key", sort=False):
        scale, fmt = (1.0, ".2f") if key.endswith("/mean") else (100.0, ".1f")
        out += ["", f"## `{key}`", "", "| row | seeds | mean [95%] | thirds |", "| --- | ---: | ---: | --- |"]
        for r in part.itertuples():
            thirds = [getattr(r, f"third{i}", float("nan")) for i in (1, 2, 3)]
            third = " / ".join(f"{scale * v:{fmt}}" for v in thirds if v == v) if not r.difference else ""
            star = " *" if r.difference and (r.lo > 0 or r.hi < 0) else ""
            cell = f"{scale * r.mean:{fmt}} [{scale * r.lo:{fmt}}, {scale * r.hi:{fmt}}]{star}"
            out.append(f"| {r.row} | {r.seeds} | {cell} | {third} |")
    return "\n".join(out)


def write(study: Study, folders: Sequence[str | Path], results: str | Path, keys: Sequence[str] = KEYS) -> Path:
    """``training.csv`` and ``training.md`` of the study's runs in ``folders`` into ``results``; returns the .md."""
    table = training_table(study, folders, keys)
    if table.empty:
        raise ValueError(
            f"no training curves under {', '.join(map(str, folders))}: expected runs/<row>/seed<s>/metrics.jsonl "
            "(a study's --out folder, or its records.tgz unpacked)"
        )
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    table.to_csv(results / "training.csv", index=False)
    md = results / "training.md"
    md.write_text(markdown(study, table) + "\n", encoding="utf-8")
    return md
