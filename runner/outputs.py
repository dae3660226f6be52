"""Where the notebook's outputs go (``notebooks/collapse_curves.ipynb``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from runner.analysis import split_spec


def figures_dir(spec: str | Sequence[str] | None, fallback: str = "outputs/figures") -> str:
    """Where the notebook writes its figures when ``OUT`` is not set: ``figures/`` in the folder the local ``RUNS``
    entries share (``RUNS=outputs/sweeps/beta`` -> ``outputs/sweeps/beta/figures``, the folder the README's
    ``--output-dir`` names; a metrics file counts as its folder), else ``fallback``."""
    folders = []
    for entry in split_spec(spec):
        entry = entry.split("=", 1)[1] if "=" in entry and not entry.startswith("wandb:") else entry
        if entry.startswith("wandb:") or any(c in entry for c in "*?["):
            continue
        p = Path(os.path.expanduser(entry))
        folders.append(p.parent if p.suffix == ".jsonl" else p)
    if not folders:
        return fallback
    common = Path(os.path.commonpath([str(f) for f in folders]))
    return fallback if str(common) in ("", ".", "/") else str(common / "figures")
