"""The collapse curves and the other figures of the notebook (notebooks/collapse_curves.ipynb), from `Run` objects.

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (no backend needed); ``save_figure`` writes PNGs.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from runner.analysis import COLLAPSE_KEYS, beta_table, ema
from runner.runs import Run

EVOLUTION_KEYS: dict[str, str] = {
    "train/level/mean": "difficulty level of the batch (EvolvedGRPO)",
    "train/diversity/zero_frac": "zero-variance fraction (accuracy rewards)",
    "train/level/sub_frac": "fraction in a sub-problem version",
    "train/level/prefix_credit": "prefix credit on multi-step questions",
    "train/zero_variance_frac": "zero-variance fraction (total reward, the trained groups)",
    "train/level/reroll/frac": "groups re-generated in the step (in-step evolution)",
}
"""Metric -> panel title of the instruction-evolution figure, per training step (EvolvedGRPO vs GRPO)."""

EPOCH_LEVEL_KEYS: dict[str, str] = {
    "synth/level/mean": "mean difficulty level of the pool",
    "synth/level/sub_frac": "pool fraction in a sub-problem version",
}
"""Metric -> panel title of the per-epoch levels (the synthesis callback's ``synth/level/*``, ``Run.epochs``)."""

REWARD_KEYS: dict[str, str] = {
    "train/reward/accuracy": "R_acc",
    "train/reward/format": "R_format",
    "train/reward/diversity": "R_diversity",
    "train/kl": "KL to reference",
}


def reward_keys(runs: Sequence[Run]) -> dict[str, str]:
    """``REWARD_KEYS`` with the accuracy panel titled by the runs' task: IoU (REC), s_ovd x mAP (OVD), or both."""
    tasks = {str(r.hparam("task", "rec")) for r in runs} or {"rec"}
    what = {"rec": "IoU", "ovd": "s_ovd x mAP"}
    title = "R_acc (" + " / ".join(what.get(t, t) for t in sorted(tasks)) + ")"
    return {k: (title if k == "train/reward/accuracy" else v) for k, v in REWARD_KEYS.items()}


def _palette(n: int) -> Callable[[int], Any]:
    """Distinct colours for ``n`` lines: tab10 up to 10, tab20 up to 20 (a study's 11 rows would repeat tab10's
    first colour), then cycling."""
    size = 10 if n <= 10 else 20
    cmap = colormaps[f"tab{size}"]
    return lambda i: cmap(i % size)


def _colours(runs: Sequence[Run]) -> dict[str, Any]:
    colour = _palette(len(runs))
    return {r.label: colour(i) for i, r in enumerate(runs)}


def _grid(n: int, ncols: int = 2, size: tuple[float, float] = (5.0, 3.4)) -> tuple[Figure, list[Any]]:
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def plot_curves(
    runs: Sequence[Run],
    keys: Mapping[str, str] = COLLAPSE_KEYS,
    smooth: float = 0.0,
    title: str = "Entropy and diversity collapse",
) -> Figure:
    """One panel per metric of ``keys`` against the training step, one line per run (smoothed when ``smooth`` > 0,
    with the raw curve faint behind)."""
    fig, axes = _grid(len(keys))
    colours = _colours(runs)
    for ax, (key, label) in zip(axes, keys.items()):
        for r in runs:
            if key not in r.train or not r.train[key].notna().any():
                continue
            df = r.train[["step", key]].dropna()
            c = colours[r.label]
            if smooth:
                ax.plot(df["step"], df[key], color=c, alpha=0.25, linewidth=0.8)
            ax.plot(
                df["step"],
                ema(df[key], smooth),
                color=c,
                label=r.label,
                marker="o" if len(df) < 20 else None,
                markersize=3,
            )
        _style_step_axis(ax, label, key)
    return _finish_figure(fig, axes, title)


def _style_step_axis(ax, label: str, key: str) -> None:
    """A curve panel: title, integer steps on x, the metric's name on y, a light grid."""
    ax.set_title(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)


def _finish_figure(fig, axes, title: str):
    """One legend below the panels (each label once) and the title."""
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines() if not h.get_label().startswith("_")}
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(4, len(handles)))
    fig.suptitle(title)
    return fig


def plot_collapse(runs: Sequence[Run], smooth: float = 0.0) -> Figure:
    """Entropy, GT diversity, smoothed diversity and the zero-variance fraction vs step (GRPO vs Syn-GRPO ...)."""
    return plot_curves(runs, COLLAPSE_KEYS, smooth, "Entropy and diversity collapse")


_SEED_SUFFIX = re.compile(r"[-_ ]?seed[=_-]?\d+$")


def method_of(run: Run) -> str:
    """The method a run belongs to: its name without a trailing seed (``grpo-seed2`` -> ``grpo``; a study names its
    runs ``<row>-seed<s>``, docs/study.md)."""
    return _SEED_SUFFIX.sub("", run.name) or run.name


def _last(table: pd.DataFrame, x: str) -> int:
    """The last step (or epoch) a run's table reaches; 0 for an empty one."""
    return int(table[x].max()) if x in table and len(table) and table[x].notna().any() else 0


def plot_collapse_by_method(
    runs: Sequence[Run],
    keys: Mapping[str, str] = COLLAPSE_KEYS,
    smooth: float = 0.0,
    method: Callable = method_of,
    title: str = "Entropy and diversity collapse per method (mean over seeds, band: min-max)",
    frame: str = "train",
) -> Figure:
    """The collapse curves per method: the mean over a method's runs (seeds) at each step, with the band between the
    lowest and the highest run; a method with one run is its curve. Methods come from ``method(run)``. ``frame``:
    ``train`` (per step) or ``epochs`` (the per-epoch rows of callbacks' logs, by epoch).

    Runs are averaged only with runs of the same length: a method whose runs ran to different last steps (a longer
    budget, an interrupted seed) gets one curve per length, labelled with it, so a mean never changes the runs it is
    made of along the curve; within a group, a step is plotted only where every run of the group has a value."""
    x = "step" if frame == "train" else "epoch"
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(method(r), []).append(r)
    groups: dict[str, list[Run]] = {}
    for name, members in by_method.items():
        lengths = {_last(getattr(r, frame), x): [] for r in members}
        for r in members:
            lengths[_last(getattr(r, frame), x)].append(r)
        for n, group in lengths.items():
            groups[name if len(lengths) == 1 else f"{name}, {n} {x}s"] = group
    fig, axes = _grid(len(keys))
    colour = _palette(len(groups))
    for ax, (key, label) in zip(axes, keys.items()):
        for i, (name, group) in enumerate(groups.items()):
            tables = [getattr(r, frame) for r in group]
            frames = [t[[x, key]].dropna() for t in tables if key in t and t[key].notna().any()]
            if not frames:
                continue
            both = pd.concat([f.assign(_run=j) for j, f in enumerate(frames)])
            stats = both.groupby(x)[key].agg(["mean", "min", "max", "count"]).reset_index()
            stats = stats[stats["count"] == len(frames)]  # only steps that every run of the group has
            c = colour(i)
            ax.plot(
                stats[x],
                ema(stats["mean"], smooth),
                color=c,
                label=f"{name} (n={len(frames)})",
                marker="o" if len(stats) < 20 else None,
                markersize=3,
            )
            if len(frames) > 1:
                ax.fill_between(stats[x], stats["min"], stats["max"], color=c, alpha=0.15, linewidth=0)
        _style_step_axis(ax, label, key)
        ax.set_xlabel(x)
    return _finish_figure(fig, axes, title)


def plot_evolution_by_method(runs: Sequence[Run], smooth: float = 0.0) -> list[Figure]:
    """EvolvedGRPO against GRPO: per step, the batch's difficulty level and the zero-variance fraction of the
    accuracy rewards (``EVOLUTION_KEYS``), and per epoch, the pool's level (``EPOCH_LEVEL_KEYS``); per method, mean
    over seeds with the min-max band. A method that logs no level (GRPO) draws only the zero-variance panel."""
    title = "Instruction evolution per method (mean over seeds, band: min-max)"
    per_step = plot_collapse_by_method(runs, EVOLUTION_KEYS, smooth, title=title)
    per_epoch = plot_collapse_by_method(
        runs, EPOCH_LEVEL_KEYS, title="Difficulty level of the pool by epoch", frame="epochs"
    )
    return [per_step, per_epoch]


def plot_accuracy(runs: Sequence[Run], metric: str = "acc50", kind: str = "val") -> Figure:
    """Validation ``metric`` against the training step, one panel per set, one line per run (every evaluation of the
    fit; a run evaluated once, e.g. one epoch or ``validate`` only, shows one marked point on a readable axis)."""
    sets: list[str] = []
    for r in runs:
        sets += [s for s in r.eval_sets(kind) if s not in sets]
    fig, axes = _grid(max(1, len(sets)))
    colours = _colours(runs)
    for ax, s in zip(axes, sets or ["(no evaluation logged)"]):
        col = f"{kind}/{s}/{metric}"
        for r in runs:
            frame = r.val if kind == "val" else r.test
            if col not in frame or not frame[col].notna().any():
                continue
            df = frame
            if "stage" in df and (df["stage"] == "fit").any():
                df = df[df["stage"] == "fit"]
            df = df[["step", col]].dropna().groupby("step", as_index=False).last()
            ax.plot(df["step"], df[col], marker="o", color=colours[r.label], label=r.label)
        ax.set_title(f"{s}: {metric}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(x=0.1, y=0.1)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.suptitle(f"{kind} {metric} per validation")
    return fig


def plot_beta_ablation(runs: Sequence[Run], metric: str = "acc50") -> Figure:
    """Final validation ``metric`` against the smoothing beta, one line per set (mean over runs with the same beta,
    runs as dots): the paper's beta ablation (0.1 ... 0.9, best 0.7)."""
    table = beta_table(runs, metric)
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.subplots()
    if table.empty:
        ax.text(0.5, 0.5, "no Syn-GRPO run with a diversity_beta", ha="center", va="center", transform=ax.transAxes)
    for s, df in table.groupby("set", sort=False):
        mean = df.groupby("beta", as_index=False)[metric].mean().sort_values("beta")
        line = ax.plot(mean["beta"], mean[metric], marker="o", label=s)[0]
        ax.scatter(df["beta"], df[metric], color=line.get_color(), alpha=0.4, s=12)
    ax.set_xlabel("smoothing beta")
    ax.set_ylabel(f"final val {metric}")
    ax.set_title("beta ablation")
    ax.grid(alpha=0.3)
    if not table.empty:
        ax.legend(fontsize="small")
    return fig


def save_figure(fig: Figure, out_dir: str | os.PathLike, name: str, dpi: int = 110) -> Path:
    """Write ``fig`` as ``<out_dir>/<name>.png`` and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # legends outside the axes stay in the picture
    return path
