"""What every benchmark command (`python -m cli.evaluate ...`) does with its files, in one place: a predictions file
must answer every item, the per-item lines go to ``<out stem>.predictions.jsonl``, and the results JSON records how
many lines of a scored predictions file matched no item of this run (another split, another shard)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from core.records import DataError

__all__ = ["predictions_path", "require_predictions", "write_results"]


def require_predictions(ids: Iterable[str], predictions: Collection[str], what: str, hint: str) -> None:
    """A ``DataError`` naming how many of ``ids`` (``what``: "samples", "images", ...) ``predictions`` lacks and the
    first one, then ``hint`` (what the file must hold)."""
    ids = list(ids)
    missing = [k for k in ids if k not in predictions]
    if missing:
        raise DataError(f"{len(missing)} of {len(ids)} {what} (first: {missing[0]!r}); {hint}")


def predictions_path(out: str | Path) -> Path:
    """``<out stem>.predictions.jsonl`` beside the results file ``out`` (its folder created)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(out.stem + ".predictions.jsonl")


def write_results(
    out: str | Path, results: dict[str, Any], ids: Iterable[str] | None = None, predictions: Any = None
) -> dict[str, Any]:
    """Write ``results`` to ``out`` as indented JSON and return it; when a predictions file was scored
    (``predictions``), add ``unmatched_predictions``: its entries that are none of this run's ``ids``."""
    if predictions is not None and ids is not None:
        ids = set(ids)
        results["unmatched_predictions"] = sum(1 for k in predictions if k not in ids)
    Path(out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results
