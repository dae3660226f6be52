"""One run's curves (`Run`) and the local metrics file they are read from (``read_metrics_jsonl``).

``callbacks.logging.MetricsJSONL`` writes the file (docs/analysis.md has the format); the W&B sources
(`runner.wandb_runs`) give the same `Run`, and `runner.analysis` loads many of them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd


@dataclass
class Run:
    """One run's curves. ``train`` has a row per logged step (``step``, ``epoch``, ``train/*``); ``val`` / ``test`` a
    row per evaluation (``step``, ``epoch``, ``stage``, ``val/<set>/<metric>``)."""

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    train: pd.DataFrame = field(default_factory=pd.DataFrame)
    val: pd.DataFrame = field(default_factory=pd.DataFrame)
    test: pd.DataFrame = field(default_factory=pd.DataFrame)
    epochs: pd.DataFrame = field(default_factory=pd.DataFrame)
    """A row per training epoch (``epoch``, ``step``, what callbacks logged at its end: ``synth/*``,
    ``synth/level/*``); empty for runs logged before the format had it."""
    source: str = ""
    run_id: str | None = None
    label: str = ""
    """Legend text: ``name``, made unique by ``disambiguate``."""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    def hparam(self, key: str, default: Any = None) -> Any:
        """A hyper-parameter by name, also when stored flat with a prefix (``model.init_args.<key>``, W&B sweeps) or
        nested (``{"model": {"init_args": {...}}}``)."""
        return find_key(self.hparams, key, default)

    @property
    def beta(self) -> float | None:
        """The smoothing beta: from the hparams (``diversity_beta``), else from the name (``beta0.7``, ``beta=0.7``)."""
        value = self.hparam("diversity_beta")
        if value is not None:
            return float(value)
        m = re.search(r"(?:beta|β)[=_-]?(\d*\.?\d+)", self.name)
        return float(m.group(1)) if m else None

    def eval_sets(self, kind: str = "val") -> list[str]:
        frame = self.val if kind == "val" else self.test
        sets = []
        for col in frame.columns:
            parts = col.split("/")
            if len(parts) == 3 and parts[0] == kind and parts[1] not in sets:
                sets.append(parts[1])
        return sets


def find_key(tree: Any, key: str, default: Any = None) -> Any:
    if not isinstance(tree, Mapping):
        return default
    if key in tree:
        return tree[key]
    for k, v in tree.items():
        if isinstance(k, str) and k.endswith("." + key):
            return v.get("value", v) if isinstance(v, Mapping) else v  # W&B API config values may be {"value": x}
    for v in tree.values():
        found = find_key(v, key, None)
        if found is not None:
            return found
    return default


def _frame(rows: list[dict[str, Any]], dedupe: Sequence[str] = ("step",)) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame(columns=["step", "epoch"])
    df = pd.DataFrame(rows).drop(columns=["event"], errors="ignore")
    for col in df.columns:
        if col not in ("stage", "run"):
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if dedupe and all(c in df for c in dedupe):
        df = df.drop_duplicates(list(dedupe), keep="last")
    return df.sort_values("step", kind="stable").reset_index(drop=True) if "step" in df else df.reset_index(drop=True)


@dataclass
class _Builder:
    name: str
    hparams: dict[str, Any]
    run_id: str | None
    rows: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"train": [], "val": [], "test": [], "epoch": []}
    )

    def truncate(self, step: int) -> None:
        """A resume from the checkpoint at ``step``: what the crashed segment logged after it is superseded."""
        for kind in ("train", "val", "epoch"):
            self.rows[kind] = [r for r in self.rows[kind] if (r.get("step") or 0) <= step]


def read_metrics_jsonl(path: str | os.PathLike, name: str | None = None) -> list[Run]:
    """The runs in one ``MetricsJSONL`` file (docs/analysis.md has the format).

    A ``start`` line of a fresh fit begins a new run; a resumed fit continues the run with the same ``run_id`` (else
    the last run) and drops that run's rows after the resumed step; ``validate`` / ``test`` starts attach to the current
    run. Rows before any ``start`` line, and a torn last line (a crash mid-write), are tolerated. ``name`` overrides the
    run name when the file holds one run.
    """
    path = Path(path)
    runs: list[_Builder] = []
    cur: _Builder | None = None
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn write
            event = row.get("event")
            if event == "start":
                fresh = row.get("stage") == "fit" and not row.get("resumed")
                if cur is None or fresh:
                    cur = _Builder(
                        row.get("run") or path.parent.name, dict(row.get("hparams") or {}), row.get("run_id")
                    )
                    runs.append(cur)
                elif row.get("resumed"):
                    same = [b for b in runs if row.get("run_id") and b.run_id == row.get("run_id")]
                    cur = same[-1] if same else cur
                    cur.truncate(int(row.get("step") or 0))
            elif event in ("train", "val", "test", "epoch"):
                if cur is None:
                    cur = _Builder(path.parent.name, {}, None)
                    runs.append(cur)
                cur.rows[event].append(row)
    out = [
        Run(
            name=b.name,
            hparams=b.hparams,
            train=_frame(b.rows["train"]),
            val=_frame(b.rows["val"], ()),
            test=_frame(b.rows["test"], ()),
            epochs=_frame(b.rows["epoch"], ("epoch",)),
            source=str(path),
            run_id=b.run_id,
        )
        for b in runs
    ]
    if name and len(out) == 1:
        out[0].name = out[0].label = name
    return out
