"""A study's runs (`Run`: a (row, seed)'s training, export and evaluation points) and their command lines, the shards,
and the toy data rendered once before the runs start (docs/study.md).

Every (row, seed) is a ``train.py fit`` process, then, when it exits with 0, one evaluation of its final checkpoint by
the evaluator every run shares (``train.py predict`` with experiments/study/heldout.yaml, or ``test``); a row with
``eval_configs`` exports its policy first. ``--shard i/n`` takes every n-th run: a fixed subset.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from datamodules.rec import RECDataModule, ToySpec
from datamodules.video import ToyVideoSpec, VideoGroundingDataModule
from runner.points import Point
from runner.study_file import REPO, Row, Study, StudyError

HELDOUT = "experiments/study/heldout.yaml"
HELDOUT_VIDEO = "experiments/study/heldout_video.yaml"
LAST_CKPT = "checkpoints/last.ckpt"


@dataclass
class Run:
    """One (row, seed) of a study: its training point (None for an evaluation-only row) and its evaluation point."""

    row: Row
    seed: int | None
    key: str
    """``<row>/seed<s>`` (``<row>/single`` for an evaluation-only row): the folder under ``runs/`` and ``work/``."""
    work: Path
    record: Path
    """The light record's folder, ``<out>/runs/<key>``."""
    train: Point | None
    evaluate: Point
    export: Point | None = None
    """``train.py export`` of the final checkpoint, between training and evaluation (rows with ``eval_configs``)."""

    @property
    def done(self) -> bool:
        return (self.record / "run.json").is_file()

    @property
    def trained(self) -> bool:
        return self.train is None or ((self.work / "TRAINED").is_file() and (self.work / LAST_CKPT).is_file())


def _fill(flags: Sequence[str], **values: Any) -> list[str]:
    """``{data_root}``, ``{seed}``, ``{out}`` in a flag -> their values."""
    out = []
    for f in flags:
        for k, v in values.items():
            f = f.replace("{" + k + "}", str(v))
        out.append(f)
    return out


def eval_flags(study: Study, data_root: Path) -> list[str]:
    """What makes ``train.py test / predict`` the study's evaluator: the held-out overlay, the scene counts of this
    study, the shared data folder, no logger."""
    video = study.world == "video"
    flags = ["--config", HELDOUT_VIDEO if video else HELDOUT]
    flags += [
        "--data.init_args.toy.splits=" + json.dumps(study.test_splits),
        "--data.init_args.test_files="
        + json.dumps({s: f"{s}_video.jsonl" if video else f"{s}.jsonl" for s in study.test_splits}),
        f"--data.init_args.data_root={data_root}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
    ]
    return flags


def plan(
    study: Study, out: str | Path, work: str | Path | None = None, python: str = sys.executable
) -> tuple[list[Run], Path]:
    """Every run of the study with its command lines, in a fixed order (rows in file order, then seeds); returns the
    runs and the shared data folder (``<work>/data``)."""
    out = Path(out)
    work = Path(work) if work else out / "work"
    data_root = work / "data"
    runs = []
    for row in study.rows:
        for seed in study.seeds if row.train else [None]:
            key = f"{row.name}/seed{seed}" if seed is not None else f"{row.name}/single"
            folder, record = work / key, out / "runs" / key
            values = {"data_root": data_root, "seed": seed if seed is not None else 0, "out": out}
            configs = [c for cfg in [study.base, *row.configs] for c in ("--config", cfg)]
            train = None
            if row.train:
                argv = [python, "train.py", "fit", *configs]
                argv += _fill([*study.overrides, *row.overrides, *study.fit_flags], **values)
                argv += [
                    f"--seed_everything={seed}",
                    f"--data.init_args.seed={seed}",
                    f"--data.init_args.data_root={data_root}",
                    f"--name={row.name}-seed{seed}",
                    "--method=null",
                    f"--trainer.default_root_dir={folder}",
                ]
                train = Point(name=f"{key} fit", params={"row": row.name, "seed": seed}, argv=argv, folder=folder)
            eval_configs = row.configs if row.eval_configs is None else row.eval_configs
            argv = [python, "train.py", study.evaluator, "--config", study.base]
            argv += [c for cfg in eval_configs for c in ("--config", cfg)]
            argv += eval_flags(study, data_root) + _fill(study.eval_overrides, **values)
            argv += [f"--name={row.name}", "--method=null", f"--trainer.default_root_dir={folder / 'eval'}"]
            export = None
            if row.train and row.eval_configs is not None:
                export = Point(
                    name=f"{key} export",
                    params={"row": row.name, "seed": seed},
                    argv=[python, "train.py", "export", *configs, f"--ckpt_path={folder / LAST_CKPT}"]
                    + [f"--out={folder / 'export'}", f"--trainer.default_root_dir={folder}", "--trainer.logger=false"],
                    folder=folder,
                    log_name="export.log",
                )
                argv.append(f"--model.init_args.policy.model_name_or_path={folder / 'export'}")
            elif row.train:
                argv.append(f"--ckpt_path={folder / LAST_CKPT}")
            evaluate = Point(
                name=f"{key} {study.evaluator}",
                params={"row": row.name, "seed": seed},
                argv=argv,
                folder=folder,
                log_name="eval.log",
            )
            if export is not None:
                export.then = evaluate
            runs.append(Run(row, seed, key, folder, record, train, evaluate, export))
    return runs, data_root


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3): the second of three shards (1-based)."""
    if text is None:
        return 1, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise StudyError(f"--shard takes i/n (e.g. --shard 2/3: the second of 3 shards), got {text!r}") from None
    if not 1 <= i <= n:
        raise StudyError(f"--shard {text}: i must lie in 1..n")
    return i, n


def shard(runs: Sequence[Run], i: int, n: int) -> list[Run]:
    """Every n-th run starting at the i-th (1-based): a fixed subset that depends only on the study file, so the n
    shards cover every run exactly once whoever runs them, in any order."""
    return [r for k, r in enumerate(runs) if k % n == i - 1]


def resolved_config(argv: Sequence[str], python: str = sys.executable) -> dict[str, Any]:
    """The config ``train.py`` would run for ``argv`` (``[subcommand, flags...]``), from its ``--print_config``, in a
    process of its own: the runner drives ``train.py`` through its command line and never imports the CLI above it."""
    proc = subprocess.run(
        [python, str(REPO / "train.py"), *argv, "--print_config"], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise StudyError(f"train.py rejected the command line {' '.join(argv)}; run it to see why")
    return yaml.safe_load(proc.stdout)


def prepare_data(
    runs: Sequence[Run], evaluation: bool = True, resolve: Callable[[list[str]], dict[str, Any]] = resolved_config
) -> None:
    """Render the toy data of the runs once, before their processes start: the first training run's splits and (with
    ``evaluation``) the first evaluation's test splits, through the data module's own ``prepare_data`` (same files,
    same manifests), so ``-j N`` processes find them instead of all rendering them at once. Strips ``--ckpt_path``
    (not read here). ``resolve(argv)`` gives the config ``train.py`` composes for a command line (`resolved_config`;
    a test passes the CLI in its own process)."""
    seen: set[str] = set()
    first_eval = runs[0].evaluate if runs and evaluation else None
    for point in [next((r.train for r in runs if r.train is not None), None), first_eval]:
        if point is None:
            continue
        argv = [a for a in point.argv[2:] if not a.startswith(("--ckpt_path", "--model.init_args.model_name"))]
        resolved = resolve(argv)["data"]
        data = resolved["init_args"]
        if data.get("toy") is None or json.dumps(data["toy"], sort_keys=True) in seen:
            continue
        seen.add(json.dumps(data["toy"], sort_keys=True))
        if resolved.get("class_path", "").endswith("VideoGroundingDataModule"):
            VideoGroundingDataModule(data_root=data["data_root"], toy=ToyVideoSpec(**data["toy"])).prepare_data()
        else:
            RECDataModule(data_root=data["data_root"], toy=ToySpec(**data["toy"])).prepare_data()
