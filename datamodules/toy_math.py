"""The toy visual-math world's splits, written as reasoning rows ``{id, image, problem, answer}`` (read back by
``datamodules.reasoning.read_rows``): EvolvedGRPO's embedded default, checkable end to end.

Splits (seeded by ``(seed, split code, index)``; a split of n rows is a prefix of a split of n + k):

- ``train`` / ``val``: 3-8 shapes, or charts of 3-4 bars valued 1-6; one-step problems.
- ``ood``: 9-14 shapes, or charts of 5-6 bars valued 1-9; half the numeric problems already carry one or two
  follow-ups (the composed form the co-evolution rounds make), so the held-out set asks longer chains on busier images.

The kind cycles with the index over ``core.toy_math.KINDS`` (each kind one sixth of a split). Each row keeps its
scene and structured problem in ``meta`` (``scene``, ``query``, ``follow_ups``), so :func:`row_answer` recomputes
the exact answer of any row, an edited one included (:func:`follow_up_row`).

CLI: ``python -m datamodules.toy_math --out data/toy_math --splits train:512 val:128 ood:128 --seed 0``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.toy_math import KINDS, ToyProblem, exact_answer, follow_up, make_query, make_scene, random_follow_up, render
from core.toy_math.follow_up import FollowUp
from core.toy_math.world import SCENE_OF
from datamodules.toy import split_counts
from datamodules.toy_export import export_rows

TOY_MATH_VERSION = 1
"""Bump when the generator's output changes, so exported splits with a stale manifest are regenerated."""


@dataclass(frozen=True)
class MathSplit:
    """How one split's scenes and problems are drawn."""

    code: int
    """Enters the seed, so splits never share scenes."""
    objects: tuple[int, int]
    """Shapes in a shapes scene (inclusive)."""
    bars: tuple[int, int]
    """Bars in a chart (inclusive)."""
    max_value: int
    """Largest bar value (and the chart's number of grid lines)."""
    follow_share: float = 0.0
    """Share of numeric problems composed with one or two follow-ups."""


SPLITS: dict[str, MathSplit] = {
    "train": MathSplit(0, (3, 8), (3, 4), 6),
    "val": MathSplit(1, (3, 8), (3, 4), 6),
    "ood": MathSplit(2, (9, 14), (5, 6), 9, follow_share=0.5),
}


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    return np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split].code, index, 43]))


def _check(split: str, size: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown toy math split {split!r}; choose one of {tuple(SPLITS)}")
    if size < 96:
        raise ValueError(f"--size must be >= 96 pixels for the shapes to stay countable, got {size}")


def row_id(split: str, index: int, seed: int) -> str:
    return f"toymath-{split}-s{seed}-{index:06d}"


def make_problem(split: str, index: int, seed: int, size: int = 224) -> tuple[dict[str, Any], ToyProblem]:
    """The scene and problem of row ``index`` of ``split``."""
    _check(split, size)
    spec, rng = SPLITS[split], _rng(seed, split, index)
    kind = KINDS[index % len(KINDS)]
    scene = make_scene(rng, SCENE_OF[kind], size, spec.objects, spec.bars, spec.max_value)
    problem = ToyProblem.base(scene, make_query(rng, kind, scene))
    if isinstance(problem.answer, int) and rng.random() < spec.follow_share:
        for _ in range(int(rng.integers(1, 3))):
            problem = follow_up(problem, random_follow_up(rng))
    return scene, problem


def _row(rid: str, image: Any, scene: dict[str, Any], problem: ToyProblem, split: str) -> dict[str, Any]:
    return {
        "id": rid,
        "image": image,
        "problem": problem.text,
        "answer": str(problem.answer),
        "meta": {"split": split, "scene": scene, **problem.to_meta()},
    }


def make_row(split: str, index: int, seed: int, size: int = 224) -> dict[str, Any]:
    """One row with ``image`` a PIL image and ``meta`` the scene and structured problem."""
    scene, problem = make_problem(split, index, seed, size)
    return _row(row_id(split, index, seed), render(scene), scene, problem, split)


def iter_split(split: str, n: int, seed: int, size: int = 224) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield make_row(split, i, seed, size)


def row_answer(row: dict[str, Any]) -> str:
    """A row's exact answer recomputed from its ``meta`` (scene, query, follow-ups): the check of any toy row."""
    meta = row["meta"]
    return str(exact_answer(meta["scene"], meta))


def follow_up_row(row: dict[str, Any], op: FollowUp | str) -> dict[str, Any]:
    """A text edit of a toy row: the same id and image, the problem followed up by ``op`` (a :class:`FollowUp` or a
    follow-up text in the toy grammar) and its exact answer. Raises ValueError as ``core.toy_math.follow_up``."""
    meta = row["meta"]
    base = ToyProblem(meta["query"], row["problem"], exact_answer(meta["scene"], meta),
                      tuple(FollowUp(f["op"], f["k"]) for f in meta.get("follow_ups", [])))  # fmt: skip
    edited = follow_up(base, op)
    return {**row, "problem": edited.text, "answer": str(edited.answer), "meta": {**meta, **edited.to_meta()}}


def split_path(out_dir: str | Path, split: str) -> Path:
    return Path(out_dir) / f"{split}.jsonl"


def export_split(out_dir: str | Path, split: str, n: int, seed: int, size: int = 224) -> Path:
    """Write ``n`` rows of ``split`` as PNGs under ``out_dir/images/`` and ``out_dir/{split}.jsonl`` (image paths
    relative to ``out_dir``); returns the JSONL path. Idempotent: a manifest beside the JSONL records the parameters,
    and a call with the same parameters whose files all exist returns at once."""
    _check(split, size)
    params = {"generator": "datamodules.toy_math", "version": TOY_MATH_VERSION, "split": split, "n": n,
              "seed": seed, "size": size}  # fmt: skip
    return export_rows(split_path(Path(out_dir), split), params, iter_split(split, n, seed, size), ensure_ascii=False)


@dataclass
class ToyMathSpec:
    """Generate the toy visual-math world into a data folder before reading it (the embedded default)."""

    splits: dict[str, int] = field(default_factory=lambda: {"train": 64, "val": 32, "ood": 32})
    """Split name -> number of rows."""
    seed: int = 0
    size: int = 224

    def export(self, out_dir: str | Path) -> dict[str, Path]:
        return {s: export_split(out_dir, s, n, self.seed, self.size) for s, n in self.splits.items()}


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m datamodules.toy_math", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/toy_math"), help="output folder (images/, *.jsonl)")
    parser.add_argument("--splits", nargs="+", default=["train:512", "val:128", "ood:128"], help="split:count pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=224, help="square image side in pixels")
    args = parser.parse_args(argv)
    paths = []
    for split, count in split_counts(parser, args.splits, SPLITS):
        paths.append(export_split(args.out, split, count, args.seed, args.size))
        print(paths[-1])
    return paths


if __name__ == "__main__":
    main()
