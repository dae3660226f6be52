"""The evaluation table: every ``val/<set>/<metric>`` (or ``test/...``) of a run, one row per set, as in the paper.

``python train.py test --config ... --ckpt_path ...`` with ``ResultsTable`` in the callbacks prints::

    | set       | Acc@0.5 | mIoU | mAP | mAP@50 | GP | GR | format |
    | toy_val   |    62.5 | 55.1 |   - |      - |  - |  - |   98.4 |
    | toy_ood   |    40.6 | 37.9 |   - |      - |  - |  - |   96.9 |

(percentages) and writes ``<default_root_dir>/<dirname>/<stage>.md`` (that table and the paper's one-row layout: the
run as a row, one column per set and metric, as Table 1 / 2 line up methods) and ``<stage>.csv`` (one row per set,
raw fractions in [0, 1]).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from callbacks.logging import run_identity

METRIC_LABELS = {
    "acc50": "Acc@0.5",
    "miou": "mIoU",
    "map": "mAP",
    "map_50": "mAP@50",
    "gp": "GP",
    "gr": "GR",
    "format": "format",
    "locatability": "locatability",  # CycleGRPO: captions that ground back to their own region (cycle_metrics)
    "confusion": "confusion",  # ... that ground onto a look-alike instead
    "tiou": "tIoU",  # temporal grounding (CycleGRPO on clips, cycle_metrics)
    "r1@0.3": "R1@0.3",
    "r1@0.5": "R1@0.5",
    "r1@0.7": "R1@0.7",
    "when": "when",  # spatio-temporal grounding: time, box and both (paper 004)
    "where": "where",
    "st": "st",
    "ciou": "cIoU",
    "n_acc": "N-acc",  # no-target queries answered "no target"
    "t_acc": "T-acc",  # queries with a target not answered "no target"
}
"""Metric key -> column header, in the order the table shows them."""

_KEY = re.compile(r"^(?P<kind>val|test)/(?P<set>[^/]+(?:/[^/]+)?)/(?P<metric>[^/]+)$")
"""``<kind>/<set>/<metric>``; a set may carry one qualifier (``val/toy_video_val/interval/tiou``: the video SFT stage
grounds the same clips in two region spaces), which becomes part of the row's name."""


def collect_results(
    metrics: Mapping[str, Any], kind: str = "test", columns: Sequence[str] = tuple(METRIC_LABELS)
) -> dict[str, dict[str, float]]:
    """``{set: {metric: value}}`` from flat keys ``<kind>/<set>/<metric>`` (sets in first-seen order)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        m = _KEY.match(key)
        if m is None or m["kind"] != kind or m["metric"] not in columns:
            continue
        v = float(value.item() if hasattr(value, "item") else value)
        out.setdefault(m["set"], {})[m["metric"]] = v
    return out


def _present(results: Mapping[str, Mapping[str, float]], columns: Sequence[str]) -> list[str]:
    return [c for c in columns if any(c in row for row in results.values())]


def _fmt(v: float | None, scale: float, decimals: int) -> str:
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    return f"{v * scale:.{decimals}f}"


def markdown_table(
    results: Mapping[str, Mapping[str, float]],
    columns: Sequence[str] = tuple(METRIC_LABELS),
    scale: float = 100.0,
    decimals: int = 1,
) -> str:
    """Rows = sets, columns = the metrics any set has; values times ``scale``; missing = ``-``."""
    cols = _present(results, columns)
    head = ["set"] + [METRIC_LABELS.get(c, c) for c in cols]
    rows = [[name] + [_fmt(r.get(c), scale, decimals) for c in cols] for name, r in results.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return (
            "| "
            + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def paper_row(
    results: Mapping[str, Mapping[str, float]],
    method: str,
    columns: Sequence[str] = ("acc50",),
    scale: float = 100.0,
    decimals: int = 1,
) -> str:
    """The paper's layout: one row for the run (``method``), one column per (set, metric); stack rows of several runs
    to get Table 1 (REC: Acc@0.5 per set) or Table 2 (OVD: mAP, GP, GR per set)."""
    cells = [(name, c) for name, r in results.items() for c in columns if c in r]
    head = ["method"] + [f"{name} {METRIC_LABELS.get(c, c)}" for name, c in cells]
    row = [method] + [_fmt(results[name][c], scale, decimals) for name, c in cells]
    sep = ["---"] + ["---:"] * len(cells)
    return "\n".join("| " + " | ".join(r) + " |" for r in (head, sep, row))


def write_csv(results: Mapping[str, Mapping[str, float]], path: Path, columns: Sequence[str] = tuple(METRIC_LABELS)):
    cols = _present(results, columns)
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["set", *cols])
        for name, r in results.items():
            w.writerow([name] + [r.get(c, "") for c in cols])


def _print(trainer: L.Trainer, text: str) -> None:
    """Print through the progress bar when there is one (tqdm keeps its bar below the text)."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and hasattr(bar, "print"):
        bar.print(text)
    else:
        print(text, flush=True)


def _samples(trainer: L.Trainer, kind: str) -> str:
    """`` on N samples per set`` (the sets' sizes after ``max_eval_samples``), or ``""`` when a loader has no size."""
    loaders = getattr(trainer, f"{kind}_dataloaders", None)
    loaders = list(loaders) if isinstance(loaders, list | tuple) else [loaders] if loaders is not None else []
    try:
        sizes = sorted({len(dl.dataset) for dl in loaders})
    except (TypeError, AttributeError):
        return ""
    if not sizes:
        return ""
    return f" on {sizes[0]} samples per set" if len(sizes) == 1 else f" on {sizes[0]}-{sizes[-1]} samples per set"


class ResultsTable(Callback):
    """Print and save the per-set evaluation table at the end of ``validate`` / ``test`` (Table 1 / 2 protocol).

    Args:
        dirname: folder under ``default_root_dir`` for ``<stage>.md`` / ``<stage>.csv``.
        columns: metric keys, in order (``acc50``, ``miou``, ``map``, ``map_50``, ``gp``, ``gr``, ``format``).
        paper_columns: metrics of the one-row paper layout (REC ``[acc50]``; OVD ``[map, gp, gr]``).
        during_fit: also write ``val.md`` / ``val.csv`` and print the per-set table after every validation of a fit.
        method: row name in the paper layout (default: the W&B run name, else the last folder of
            ``default_root_dir``).
        scale: multiply values in the printed / markdown tables (100: percentages, as the paper).
        decimals: decimals shown.
    """

    def __init__(
        self,
        dirname: str = "results",
        columns: Sequence[str] = tuple(METRIC_LABELS),
        paper_columns: Sequence[str] = ("acc50", "map", "gp", "gr"),
        during_fit: bool = True,
        method: str | None = None,
        scale: float = 100.0,
        decimals: int = 1,
    ):
        self.dirname = dirname
        self.columns = list(columns)
        self.paper_columns = list(paper_columns)
        self.during_fit = during_fit
        self.method = method
        self.scale = scale
        self.decimals = decimals
        self.last: dict[str, dict[str, float]] = {}
        """The last table, ``{set: {metric: value}}``."""
        self._last_line: str | None = None

    def render(self, results: Mapping[str, Mapping[str, float]], method: str) -> str:
        return "\n\n".join(
            [
                markdown_table(results, self.columns, self.scale, self.decimals),
                paper_row(results, method, self.paper_columns, self.scale, self.decimals),
            ]
        )

    def _report(self, trainer: L.Trainer, kind: str) -> None:
        fn = str(getattr(trainer.state.fn, "value", trainer.state.fn))
        if trainer.sanity_checking or not trainer.is_global_zero or (fn == "fit" and not self.during_fit):
            return
        results = collect_results(trainer.callback_metrics, kind, self.columns)
        if not results:
            return
        self.last = results
        method = self.method or run_identity(trainer)[0]
        text = self.render(results, method)
        out = Path(trainer.default_root_dir) / self.dirname
        out.mkdir(parents=True, exist_ok=True)
        title = f"# {kind} results: {method} (step {trainer.global_step}, epoch {trainer.current_epoch})"
        (out / f"{kind}.md").write_text(f"{title}\n\n{text}\n", encoding="utf-8")
        write_csv(results, out / f"{kind}.csv", self.columns)
        scale_note = " (percent)" if self.scale == 100.0 else ""
        on = _samples(trainer, kind)  # which figures these are: a validation cap is not a held-out split
        if fn == "fit":  # one compact table per validation, above the progress bar
            table = markdown_table(results, self.columns, self.scale, self.decimals)
            _print(trainer, f"{kind} results{scale_note} at step {trainer.global_step}{on}: {method}\n{table}")
        else:
            _print(trainer, f"\n{kind} results{scale_note}{on}: {method}\n{text}\nwritten to {out / (kind + '.md')}\n")
        metric = next((c for c in self.paper_columns if any(c in r for r in results.values())), None)
        figures = ", ".join(
            f"{name} {_fmt(r.get(metric), self.scale, self.decimals)}" for name, r in results.items() if metric
        )
        label = METRIC_LABELS.get(metric or "", metric)
        self._last_line = f"{kind} {label} at step {trainer.global_step}{on}: {figures} ({out / (kind + '.md')})"

    def summary_lines(self) -> list[str]:
        """The run's last table in one line, for the lines a run ends with (`cli.run_folder.end_lines`)."""
        return [self._last_line] if self._last_line else []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "val")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "test")
