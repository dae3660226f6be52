"""Offline sweeps: ``python -m runner.sweep configs/sweeps/beta.yaml -j 2`` runs a W&B sweep file's grid without a W&B
server.

The same YAML drives ``wandb sweep`` / ``wandb agent`` when online (unchanged). Here every grid point runs as its own
``train.py`` process (`runner.points.run_points`), ``-j N`` at a time, in its own run folder ``<out>/<point>/``
(``--trainer.default_root_dir``) under its own run name (``<sweep name>-<point>``), with W&B offline. At the end the
points' final validation metrics are collected (``results.csv``: one row per point, its parameters, exit status and
``val/<set>/<metric>``), and the notebook reads them all with ``RUNS=<out>`` (each point's ``metrics.jsonl``, labelled
by its run name).

``python -m runner.sweep configs/sweeps/beta.yaml -j 2 [--only PATTERN] [--out DIR] [--dry-run] [-- extra train.py
flags]``.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from core.config_files import load_config
from runner.analysis import final_eval
from runner.points import Point, run_points
from runner.runs import read_metrics_jsonl


class SweepError(ValueError):
    """A sweep file the offline runner cannot run; the message names the file and the fix."""


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


def collect(points: list[Point], out: Path, metric: str | None = None):
    """``results.csv`` in ``out``: one row per point (its parameters, exit status, seconds, final ``val/*/<metric>``
    of each validation set, last training step); returns the pandas frame."""
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m runner.sweep",
        description="Run a W&B sweep file's grid offline: one train.py process per point, each in its own folder.",
        epilog="Flags after -- go to every point's train.py (e.g. -- --trainer.max_epochs 1).",
        allow_abbrev=False,
    )
    ap.add_argument("sweep", help="a sweep file, e.g. configs/sweeps/beta.yaml")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="points run at the same time (default 1)")
    ap.add_argument("--out", default=None, help="output folder (default outputs/sweeps/<sweep name>)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    ap.add_argument("--online", action="store_true", help="let W&B go online (default: WANDB_MODE=offline)")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only the points whose name matches (shell pattern, repeatable), e.g. --only 'diversity_beta=0.[15]'; "
        "--dry-run lists the names",
    )
    args = ap.parse_args(argv)
    try:
        sweep, points, out = plan(args.sweep, args.out, extra)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.only:
        chosen = [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in args.only)]
        if not chosen:
            names = ", ".join(p.name for p in points)
            print(
                f"error: --only {' '.join(args.only)} matches no point of {args.sweep}; its points: {names}",
                file=sys.stderr,
            )
            return 2
        points = chosen
    if args.dry_run:
        for p in points:
            print(" ".join(p.argv))
        return 0
    env = {"WANDB_RUN_GROUP": str(sweep.get("name") or "sweep")}
    if not args.online:
        env["WANDB_MODE"] = "offline"
    print(f"{len(points)} point(s) of {args.sweep}, {args.jobs} at a time -> {out}/", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(
        json.dumps({"sweep": args.sweep, "points": [{"name": p.name, "argv": p.argv} for p in points]}, indent=2)
    )
    run_points(points, args.jobs, env)
    metric = str(sweep.get("metric", {}).get("name", "")).rsplit("/", 1)[-1] or None
    frame = collect(points, out, metric)
    print(frame.to_string(index=False))
    print(
        f"\nresults: {out / 'results.csv'}; curves: RUNS={out} .venv/bin/jupyter nbconvert --to notebook --execute "
        f"notebooks/collapse_curves.ipynb --output-dir {out}"
    )
    failed = [p for p in points if p.returncode]
    for p in failed:
        print(f"error: point {p.name} exited with {p.returncode}; its output is in {p.log}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
