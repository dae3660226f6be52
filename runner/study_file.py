"""Study files: Table 1's rows x seeds (+ ablations), trained and evaluated on held-out test splits, with intervals.

``python -m runner.study experiments/study/table1_toy.yaml -j 2`` (docs/study.md). A study file lists **rows** (a method: the
``train.py`` configs and flags it trains with) and **seeds**; an **ablation** adds rows that vary one parameter of a
row (a W&B sweep file's grid, e.g. configs/sweeps/beta.yaml). Every (row, seed) is one **run**: a ``train.py fit``
process, then, when it exits with 0, one evaluation of its final checkpoint by the one evaluator every run shares:

    python train.py predict --config <the row's configs> --config experiments/study/heldout.yaml --ckpt_path <last.ckpt>

on the held-out test splits of the toy world (``datamodules.toy.TEST_SPLITS``, never read by training or tuning).
``predict`` answers greedily exactly as ``train.py test`` does (the same ``_greedy`` path; tests/cli/test_export.py
checks that they give the same metrics) and also writes each scene's answer and IoU, which the paired bootstrap over
scenes needs (``evaluator: test`` runs ``train.py test`` instead: per-set metrics only, the bootstrap then resamples
seeds only). A row with ``train: false`` (Original, the starting checkpoint) is evaluated without a checkpoint, once.

The runs are `runner.points.Point` command lines run by `runner.points.run_points` (``-j`` processes at a time; the evaluation is
each training point's ``then``). ``--shard i/n`` runs every n-th run (a fixed subset, so n calls, e.g. n device calls of
10 minutes, cover the grid); a run whose evaluation record exists is skipped (resumable), and ``merge`` builds the
table from the records of every shard (`runner.study_report`).

Layout: heavy run folders (checkpoints, synthesized images) under ``--work`` (default ``<out>/work``); the light
record of each finished run under ``<out>/runs/<row>/seed<s>/`` (``run.json``, ``scenes.csv``: one line per test
scene, ``metrics.jsonl``: the training curves, the logs), which is what comes back from a device call and what the
notebook reads.

Here: the study file (`load_study`: a `Study` and its rows, `Row`, ablations expanded); the runs and their command
lines in `runner.study_plan`, their records in `runner.study_records`, the table in `runner.study_report`, the command
in `runner.study`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from datamodules import toy, toy_video
from runner.sweep import grid, load_sweep, point_name

REPO = Path(__file__).resolve().parents[1]
EVALUATORS = ("predict", "test")
WORLDS = ("image", "video")


class StudyError(ValueError):
    """A study file or command line the runner cannot use; the message names the file or flag and the fix."""


@dataclass
class Row:
    """One method of the table."""

    name: str
    """Folder and key (``grpo``, ``syn_grpo[diversity_beta=0.1]``)."""
    label: str
    """What the table shows (``GRPO``)."""
    configs: list[str] = field(default_factory=list)
    """Configs after the study's ``base`` (overlays from configs/baselines/)."""
    overrides: list[str] = field(default_factory=list)
    """``train.py`` flags after the study's ``overrides``."""
    eval_configs: list[str] | None = None
    """Configs the evaluation uses instead of ``configs`` (SFT: its policy is evaluated by the GRPO module). The
    trained policy then goes through ``train.py export`` and is evaluated as ``model_name_or_path``: with
    ``--ckpt_path``, Lightning's CLI would restore the checkpoint's own module class and hyper-parameters."""
    train: bool = True
    """False: evaluation only, of the starting checkpoint (Original), once whatever the seeds."""
    ablation: str | None = None
    """The ablation the row belongs to (None: a row of the table itself)."""


@dataclass
class Study:
    """A parsed study file (``load_study``)."""

    name: str
    path: Path
    base: str
    seeds: list[int]
    rows: list[Row]
    test_splits: dict[str, int]
    world: str = "image"
    """The toy world of the runs: ``image`` (``datamodules/toy.py``, the REC configs) or ``video`` (the toy video world,
    ``datamodules/toy_video.py``: configs on ``VideoGroundingDataModule``, CycleGRPO's temporal / spatio-temporal)."""
    overrides: list[str] = field(default_factory=list)
    eval_overrides: list[str] = field(default_factory=list)
    fit_flags: list[str] = field(default_factory=list)
    """``train.py fit`` flags of one call (``python -m runner.study --fit-flag``), after every override: where the fits run
    (the device's GPU, a faster rollout engine). Never read from the study file: the file says what is measured, the
    call where it runs."""
    evaluator: str = "predict"
    reference: str | None = None
    """Row every other row is compared with (``method - Original``)."""
    compare: list[tuple[str, str]] = field(default_factory=list)
    """More paired differences (``[syn_grpo, grpo]``: Syn-GRPO - GRPO)."""
    metrics: list[str] = field(default_factory=lambda: ["acc50", "miou"])
    replicates: int = 2000
    """Bootstrap replicates."""

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise StudyError(f"{self.path}: no row named {name!r}; the rows are {[r.name for r in self.rows]}")


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
        raise StudyError(f"{where} must be a list of strings (train.py flags or config paths), got {value!r}")
    return [str(v) for v in value]


def _config_paths(paths: list[str], where: str) -> list[str]:
    for p in paths:
        if not (REPO / p).is_file() and not Path(p).is_file():
            raise StudyError(f"{where}: no such config {p}; paths are relative to the repository root")
    return paths


def load_study(path: str | Path) -> Study:
    """Read and check a study file (experiments/study/*.yaml); every error names the file, the key and the fix."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"{path}: no such study file; the studies are in experiments/study/")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    known = {
        "name", "base", "seeds", "rows", "ablations", "test_splits", "world", "overrides", "eval_overrides", "evaluator",
        "reference", "compare", "metrics", "replicates",
    }  # fmt: skip
    unknown = sorted(set(raw) - known)
    if unknown:
        raise StudyError(f"{path}: unknown key(s) {unknown}; a study file has {sorted(known)}")
    for key in ("base", "rows", "test_splits"):
        if key not in raw:
            raise StudyError(f"{path}: the study has no '{key}:' (see experiments/study/table1_toy.yaml)")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise StudyError(f"{path}: seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"{path}: seeds repeat: {seeds}")
    evaluator = raw.get("evaluator", "predict")
    if evaluator not in EVALUATORS:
        raise StudyError(f"{path}: evaluator must be one of {EVALUATORS}, got {evaluator!r}")
    splits = raw["test_splits"]
    world = raw.get("world", "image")
    if world not in WORLDS:
        raise StudyError(f"{path}: world must be one of {WORLDS}, got {world!r}")
    world_splits = toy_video.SPLITS if world == "video" else toy.SPLITS
    example = "{test: 200}" if world == "video" else "{test_id: 1000}"
    if not isinstance(splits, Mapping) or not splits:
        raise StudyError(f"{path}: test_splits must map a toy split to its number of scenes, e.g. {example}")
    for s, n in splits.items():
        if s not in world_splits or not isinstance(n, int) or n < 1:
            raise StudyError(
                f"{path}: test_splits: {s}: {n!r}; the {world} world's splits are {tuple(world_splits)} (held out: "
                f"{'test' if world == 'video' else 'test_*'}), counts >= 1"
            )
        if not s.startswith("test"):
            raise StudyError(
                f"{path}: test_splits: {s} is read by training or validation; use the held-out test split(s)"
            )

    base = str(raw["base"])
    _config_paths([base], f"{path}: base")
    rows: list[Row] = []
    for i, spec in enumerate(raw["rows"] or []):
        where = f"{path}: rows[{i}]"
        if not isinstance(spec, Mapping) or "name" not in spec:
            raise StudyError(f"{where} needs a 'name:' (and label, configs, overrides, eval_configs, train)")
        extra = sorted(set(spec) - {"name", "label", "configs", "overrides", "eval_configs", "train"})
        if extra:
            raise StudyError(f"{where}: unknown key(s) {extra}")
        name = str(spec["name"])
        if not name.replace("_", "").replace("-", "").isalnum():
            raise StudyError(f"{where}: name {name!r} must be letters, digits, '_' or '-' (it names folders)")
        rows.append(
            Row(
                name=name,
                label=str(spec.get("label", name)),
                configs=_config_paths(_strings(spec.get("configs"), f"{where}.configs"), where),
                overrides=_strings(spec.get("overrides"), f"{where}.overrides"),
                eval_configs=(
                    _config_paths(_strings(spec["eval_configs"], f"{where}.eval_configs"), where)
                    if spec.get("eval_configs") is not None
                    else None
                ),
                train=bool(spec.get("train", True)),
            )
        )
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise StudyError(f"{path}: row names repeat: {names}")
    for r in rows:
        if any(".toy." in o or o.startswith("--data.init_args.data_root") for o in r.overrides):
            raise StudyError(
                f"{path}: row {r.name} changes the toy data ({r.overrides}); every run of a study shares one data "
                "folder, so set the toy splits in the study's 'overrides:' (all rows train on the same scenes)"
            )
    study = Study(
        name=str(raw.get("name") or path.stem),
        path=path,
        base=base,
        seeds=list(seeds),
        rows=rows,
        test_splits=dict(splits),
        world=world,
        overrides=_strings(raw.get("overrides"), f"{path}: overrides"),
        eval_overrides=_strings(raw.get("eval_overrides"), f"{path}: eval_overrides"),
        evaluator=evaluator,
        reference=raw.get("reference"),
        compare=[tuple(c) for c in raw.get("compare") or []],
        metrics=_strings(raw.get("metrics"), f"{path}: metrics") or ["acc50", "miou"],
        replicates=int(raw.get("replicates", 2000)),
    )
    for i, spec in enumerate(raw.get("ablations") or []):
        study.rows += _ablation_rows(study, spec, f"{path}: ablations[{i}]")
    for name in [study.reference] if study.reference else []:
        study.row(name)
    for pair in study.compare:
        if len(pair) != 2:
            raise StudyError(f"{path}: compare entries are pairs [a, b] (a - b), got {list(pair)}")
        study.row(pair[0]), study.row(pair[1])
    return study


def _ablation_rows(study: Study, spec: Any, where: str) -> list[Row]:
    """Rows that vary a row's parameters over a sweep file's grid (``{row, sweep, skip}``), or over ``values:``
    (``{row, parameter, values}``)."""
    if not isinstance(spec, Mapping) or "row" not in spec:
        raise StudyError(f"{where} needs 'row:' (the row to vary) and 'sweep:' or 'parameter:' + 'values:'")
    base = study.row(str(spec["row"]))
    if "sweep" in spec:
        points = grid(load_sweep(REPO / spec["sweep"] if not Path(spec["sweep"]).is_file() else spec["sweep"]), where)
    elif "parameter" in spec and "values" in spec:
        points = [{str(spec["parameter"]): v} for v in spec["values"]]
    else:
        raise StudyError(f"{where}: give 'sweep: configs/sweeps/<file>.yaml' or 'parameter:' + 'values:'")
    skip = list(spec.get("skip") or [])
    name = str(spec.get("name", "ablation"))
    rows = []
    for params in points:
        if any(v in skip for v in params.values()):
            continue
        pname = point_name(params)
        rows.append(
            Row(
                name=f"{base.name}[{pname}]",
                label=f"{base.label}, {pname.replace('diversity_beta', 'beta')}",
                configs=list(base.configs),
                overrides=[*base.overrides, *(f"--{k}={v}" for k, v in params.items())],
                eval_configs=base.eval_configs,
                train=base.train,
                ablation=name,
            )
        )
    return rows
