"""Many logged runs at once: the logic behind notebooks/collapse_curves.ipynb, the sweep's results and the study.

It runs after training (not a callback), in the notebook, the sweep and the study, and reads what ``callbacks.logging``
writes. Sources of runs (all become `runner.runs.Run`):

* the local metrics file of ``callbacks.logging.MetricsJSONL`` (`runner.runs.read_metrics_jsonl`); one file may hold
  several runs (e.g. a sweep whose runs share ``default_root_dir``) and resumed segments;
* a W&B offline run directory (``wandb/offline-run-*``), read straight from its ``.wandb`` log without syncing
  (`runner.wandb_runs.load_wandb_offline`);
* a W&B run through the public API (`runner.wandb_runs.load_wandb_api`), only when ``WANDB_API_KEY`` is set.

Here: ``load_runs`` (every run an entry of ``RUNS`` names), unique labels, the summary and beta tables. The figures
are in `runner.figures`.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from runner.runs import Run, read_metrics_jsonl
from runner.wandb_runs import load_wandb_api, load_wandb_offline

COLLAPSE_KEYS: dict[str, str] = {
    "train/entropy": "token entropy",
    "train/diversity/gt": "ground-truth diversity V(q)",
    "train/diversity/smoothed": "smoothed diversity V~(q)",
    "train/zero_variance_frac": "fraction of zero-variance groups",
}
"""Metric -> panel title of the collapse figure (entropy and diversity collapse)."""


def split_spec(spec: str | Sequence[str] | None) -> list[str]:
    """``RUNS`` as given in the environment: entries separated by commas, newlines or ``os.pathsep``."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = re.split(rf"[,\n{re.escape(os.pathsep)}]", spec)
    return [s.strip() for s in spec if s and s.strip()]


def load_runs(spec: str | Sequence[str] | None, wandb_api: Any = None) -> list[Run]:
    """Load every run named by ``spec``: metrics JSONL files, folders (searched for ``metrics*.jsonl`` and W&B
    offline run directories), glob patterns, and ``wandb:<entity>/<project>/<run_id>`` (API). ``label=<entry>``
    names the run(s) of an entry. Labels are made unique (``disambiguate``)."""
    runs: list[Run] = []
    api_paths: list[tuple[str | None, str]] = []
    for entry in split_spec(spec):
        label = None
        if "=" in entry and not entry.startswith("wandb:"):
            label, entry = entry.split("=", 1)
        if entry.startswith("wandb:"):
            api_paths.append((label, entry[len("wandb:") :]))
            continue
        for path in sorted(glob.glob(os.path.expanduser(entry))) or [entry]:
            p = Path(path)
            found: list[Run] = []
            if p.is_dir() and list(p.glob("run-*.wandb")):
                found = [load_wandb_offline(p)]
            elif p.is_dir():
                for f in sorted(p.rglob("metrics*.jsonl")):
                    found += read_metrics_jsonl(f)
                for d in sorted(p.rglob("offline-run-*")) if not found else []:
                    found.append(load_wandb_offline(d))
            elif p.is_file():
                found = read_metrics_jsonl(p)
            else:
                print(f"no run at {entry}")
            if label:
                for i, r in enumerate(found):
                    r.name = r.label = label if len(found) == 1 else f"{label}-{i}"
            runs += found
    for label, p in api_paths:
        for r in load_wandb_api([p], api=wandb_api):
            r.name = r.label = label or r.name
            runs.append(r)
    return disambiguate(runs)


def disambiguate(runs: list[Run]) -> list[Run]:
    """Give runs that share a name a unique label: the hparams that differ among them (``syn-grpo beta=0.3``), or an
    index when none does."""
    by_name: dict[str, list[Run]] = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    for name, group in by_name.items():
        if len(group) == 1:
            group[0].label = name
            continue
        keys = sorted({k for r in group for k in r.hparams})
        differ = [
            k
            for k in keys
            if len({json.dumps(r.hparams.get(k), sort_keys=True, default=str) for r in group}) > 1 and "path" not in k
        ]
        for i, r in enumerate(group):
            extra = " ".join(f"{k}={r.hparams.get(k)}" for k in differ[:2])
            r.label = f"{name} {extra}" if extra else f"{name} #{i + 1}"
    return runs


def ema(values: pd.Series, alpha: float) -> pd.Series:
    """Exponential moving average (TensorBoard-style ``smoothing`` = alpha in [0, 1); 0 returns the values)."""
    if not alpha:
        return values
    return values.ewm(alpha=1.0 - alpha, adjust=True, ignore_na=True).mean()


def final_eval(run: Run, metric: str = "acc50", kind: str = "val") -> dict[str, float]:
    """``{set: value}`` of the last evaluation row that has the metric, per set."""
    frame = run.val if kind == "val" else run.test
    out = {}
    for s in run.eval_sets(kind):
        col = f"{kind}/{s}/{metric}"
        if col in frame:
            vals = frame[col].dropna()
            if len(vals):
                out[s] = float(vals.iloc[-1])
    return out


def summary_table(runs: Sequence[Run], metric: str = "acc50") -> pd.DataFrame:
    """One row per run: beta, steps logged, last entropy / GT diversity / zero-variance fraction, final ``metric`` per
    validation set."""
    rows = []
    for r in runs:
        row: dict[str, Any] = {
            "run": r.label,
            "beta": r.beta,
            "steps": int(r.train["step"].max()) if "step" in r.train and len(r.train) else 0,
        }
        for key in COLLAPSE_KEYS:
            if key in r.train and r.train[key].notna().any():
                row[key] = float(r.train[key].dropna().iloc[-1])
        for s, v in final_eval(r, metric).items():
            row[f"val/{s}/{metric}"] = v
        rows.append(row)
    return pd.DataFrame(rows)


def method_plugin(r: Run) -> str:
    """The run's method plug-in by module name: ``syn_grpo`` for ``model.init_args.method`` =
    ``{class_path: lightning_modules.methods.syn_grpo.SynGRPO, ...}`` (today's hparams), or the older flat string
    (``method: grpo``); ``syn_grpo`` when the run logged none (the default method)."""
    method = r.hparam("method", "syn_grpo")
    if isinstance(method, Mapping):
        module = str(method.get("class_path", "")).rpartition(".")[0]
        return module.rpartition(".")[2] or "syn_grpo"
    return str(method)


def beta_table(
    runs: Sequence[Run], metric: str = "acc50", include: Callable[[Run], bool] | None = None
) -> pd.DataFrame:
    """Final validation ``metric`` per (run, set) against the smoothing beta: the paper's beta ablation.

    By default only Syn-GRPO runs count (``method: syn_grpo`` with ``diversity_weight != 0``: a GRPO baseline also carries a
    ``diversity_beta`` hparam that it never uses)."""

    def default_include(r: Run) -> bool:
        if method_plugin(r) != "syn_grpo":  # a GRPO-method baseline: no diversity reward
            return False
        return float(r.hparam("diversity_weight", 1.0) or 0.0) != 0.0

    include = include or default_include
    rows = [
        {"run": r.label, "beta": r.beta, "set": s, metric: v}
        for r in runs
        if r.beta is not None and include(r)
        for s, v in final_eval(r, metric).items()
    ]
    return pd.DataFrame(rows, columns=["run", "beta", "set", metric])
