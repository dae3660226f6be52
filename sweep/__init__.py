"""Offline sweeps: ``python -m sweep configs/sweeps/beta.yaml -j 2`` runs a W&B sweep file's grid without a W&B server.

The same YAML drives ``wandb sweep`` / ``wandb agent`` when online (unchanged). Here every grid point runs as its own
``train.py`` process, ``-j N`` at a time, in its own run folder ``<out>/<point>/`` (``--trainer.default_root_dir``)
under its own run name (``<sweep name>-<point>``), with W&B offline. At the end the points' final validation metrics
are collected (``results.csv``: one row per point, its parameters, exit status and ``val/<set>/<metric>``), and the
notebook reads them all with ``RUNS=<out>`` (each point's ``metrics.jsonl``, labelled by its run name).

``run_points`` is the engine: a list of ``Point`` (a name and a ``train.py`` command line) run with a bounded number of
processes and collected. A study (several methods x seeds) is a list of points too.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config_files import load_config

REPO = Path(__file__).resolve().parents[1]


class SweepError(ValueError):
    """A sweep file the offline runner cannot run; the message names the file and the fix."""


@dataclass
class Point:
    """One run of a sweep: its name (the folder under the sweep's output) and its parameters and command."""

    name: str
    params: dict[str, Any]
    argv: list[str]
    folder: Path | None = None
    returncode: int | None = None
    seconds: float | None = None
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    then: Point | None = None
    """A point to start as soon as this one exits with 0 (a study's evaluation after its training run)."""
    log_name: str = "train.log"
    """The file in ``folder`` that receives the command's output."""


def load_sweep(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file; the sweeps are in configs/sweeps/")
    sweep = load_config(path)
    for key in ("program", "parameters", "command"):
        if key not in sweep:
            raise SweepError(f"{path}: the sweep has no '{key}:' (a W&B sweep file needs program, parameters, command)")
    if sweep.get("method", "grid") != "grid":
        raise SweepError(
            f"{path}: method '{sweep['method']}' needs W&B's server to choose points; the offline runner runs grids "
            "(set method: grid with 'values:' lists), or run `wandb sweep` + `wandb agent` online"
        )
    return sweep


def grid(sweep: Mapping[str, Any], where: str = "sweep") -> list[dict[str, Any]]:
    """Every combination of the parameters' ``values`` (a constant ``value`` counts as one), in file order."""
    names, choices = [], []
    for name, spec in sweep["parameters"].items():
        if not isinstance(spec, Mapping) or not ("values" in spec or "value" in spec):
            raise SweepError(f"{where}: parameter {name} needs 'values: [...]' (or a constant 'value:') for a grid")
        names.append(name)
        choices.append(list(spec["values"]) if "values" in spec else [spec["value"]])
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def point_name(params: Mapping[str, Any]) -> str:
    """``diversity_beta=0.1`` (the last part of each dotted parameter name), joined by ``,``; safe as a folder name."""
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in params.items()]
    return ",".join(parts).replace("/", "_").replace(" ", "") or "default"


def render_command(sweep: Mapping[str, Any], params: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """The command ``wandb agent`` would run for ``params`` (W&B's macros: ``${env}`` dropped here, ``${interpreter}``
    -> this Python, ``${program}``, ``${args}`` -> ``--name=value``, ``${args_no_hyphens}`` -> ``name=value``)."""
    macros = {
        "env": [],
        "interpreter": [python],
        "program": [str(sweep["program"])],
        "args": [f"--{k}={_cli_value(v)}" for k, v in params.items()],
        "args_no_hyphens": [f"{k}={_cli_value(v)}" for k, v in params.items()],
        "args_no_boolean_flags": [f"--{k}={_cli_value(v)}" for k, v in params.items()],
    }
    argv: list[str] = []
    for tok in sweep["command"]:
        tok = str(tok)
        argv += macros.get(tok[2:-1], [tok]) if tok.startswith("${") and tok.endswith("}") else [tok]
    return argv


def _cli_value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, list | dict | bool) or v is None else str(v)


def plan(
    path: str | Path, out: str | Path | None = None, extra: Sequence[str] = (), python: str = sys.executable
) -> tuple[dict[str, Any], list[Point], Path]:
    """(sweep, its points with their command lines, the output folder ``outputs/sweeps/<sweep name>``)."""
    sweep = load_sweep(path)
    sname = str(sweep.get("name") or Path(path).stem)
    out = Path(out) if out else Path("outputs/sweeps") / sname
    points = []
    for params in grid(sweep, str(path)):
        name = point_name(params)
        folder = out / name
        argv = render_command(sweep, params, python) + [
            f"--name={sname}-{name}",
            f"--trainer.default_root_dir={folder}",
            *extra,
        ]
        points.append(Point(name=name, params=params, argv=argv, folder=folder))
    return sweep, points, out


def run_points(
    points: list[Point],
    jobs: int = 1,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
    on_done: Callable[[Point], None] | None = None,
    status_every: float = 60.0,
) -> None:
    """Run every point's command (``jobs`` at a time) in the repository root, each with its output in
    ``<folder>/<log_name>`` (``train.log``); fills ``returncode``, ``seconds`` and ``log``. A point's ``then`` starts
    (before the points still pending) once the point exits with 0; ``on_done(point)`` is called as each one exits.
    Unless ``quiet``, every ``status_every`` seconds one ``[run  ]`` line per running point says where it is
    (:func:`progress`), so a sweep of long fits is never silent between its ``[start]`` and ``[done ]`` lines."""
    env = {**os.environ, **(env or {})}
    pending = list(points)
    running: list[tuple[Point, subprocess.Popen, float, Any]] = []
    last_status = time.monotonic()
    while pending or running:
        while pending and len(running) < max(1, jobs):
            p = pending.pop(0)
            assert p.folder is not None
            p.folder.mkdir(parents=True, exist_ok=True)
            p.log = p.folder / p.log_name
            fh = p.log.open("w", encoding="utf-8")
            fh.write("$ " + " ".join(p.argv) + "\n")
            fh.flush()
            proc = subprocess.Popen(p.argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
            running.append((p, proc, time.monotonic(), fh))
            if not quiet:
                print(f"[start] {p.name}", flush=True)
        time.sleep(0.2)
        still = []
        for p, proc, t0, fh in running:
            rc = proc.poll()
            if rc is None:
                still.append((p, proc, t0, fh))
                continue
            fh.close()
            p.returncode, p.seconds = rc, time.monotonic() - t0
            if not quiet:
                status = "ok" if rc == 0 else f"FAILED (exit {rc}; see {p.log})"
                print(f"[done ] {p.name}: {status} in {p.seconds:.0f} s", flush=True)
            if on_done is not None:
                on_done(p)
            if rc == 0 and p.then is not None:
                pending.insert(0, p.then)
        running = still
        if not quiet and running and time.monotonic() - last_status >= status_every:
            last_status = time.monotonic()
            for p, _, t0, _ in running:
                print(f"[run  ] {p.name}: {(last_status - t0) / 60:.0f} min, {progress(p)}", flush=True)


def progress(p: Point) -> str:
    """Where a running point is: the step and epoch of the last line of its ``metrics.jsonl`` (with its newest
    validation figure), else the last line of its log, else ``starting``."""
    row = _last_line(p.folder / "metrics.jsonl") if p.folder is not None else ""
    try:
        rec = json.loads(row) if row else None
    except json.JSONDecodeError:
        rec = None
    if isinstance(rec, dict) and "step" in rec:
        val = next((f", {k} {v:.3g}" for k, v in rec.items() if k.startswith("val/") and isinstance(v, float)), "")
        return f"step {rec['step']}" + (f", epoch {rec['epoch']}" if "epoch" in rec else "") + val
    line = _last_line(p.log) if p.log is not None else ""
    return line[-120:] if line else "starting"


def _last_line(path: Path, tail: int = 8192) -> str:
    """The last non-empty line (a progress bar's last ``\\r`` frame) of ``path``'s last ``tail`` bytes, or ``""``."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def collect(points: list[Point], out: Path, metric: str | None = None):
    """``results.csv`` in ``out``: one row per point (its parameters, exit status, seconds, final ``val/*/<metric>``
    of each validation set, last training step); returns the pandas frame."""
    import pandas as pd

    from analysis import final_eval, read_metrics_jsonl

    rows = []
    for p in points:
        row: dict[str, Any] = {"point": p.name, **p.params, "returncode": p.returncode, "seconds": p.seconds}
        metrics = (p.folder / "metrics.jsonl") if p.folder else None
        if metrics is not None and metrics.is_file():
            for run in read_metrics_jsonl(metrics)[-1:]:
                row["steps"] = int(run.train["step"].max()) if len(run.train) else 0
                for m in [metric] if metric else ["acc50", "miou", "map"]:
                    for s, v in final_eval(run, m).items():
                        row[f"val/{s}/{m}"] = v
        rows.append(row)
    frame = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "results.csv", index=False)
    return frame
