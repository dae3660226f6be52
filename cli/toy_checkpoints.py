"""The toy checkpoints: which ``make`` target builds each one and how long it takes.

Git keeps three of them (``KEPT``); the others are built locally (and ignored by git, .gitignore). A config whose
``model_name_or_path`` is one of the others fails with one line naming the command that builds it
(``missing_checkpoint_message``, called by ``cli.main``'s path check). Durations: the Makefile's comments,
docs/toy_model.md and docs/cycle_grpo.md (the measured builds).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Build(NamedTuple):
    make: str
    """The make command that builds the checkpoint, from the kept ones (the stages before it first)."""
    takes: str
    """How long it took, and where."""


KEPT = ("toy-qwen2.5-vl", "toy-qwen2.5-vl-cycle-video", "toy-qwen2.5-vl-evolved")
"""The checkpoints in git (docs/decisions.md, "Three toy checkpoints in git")."""

_LONG = "make toy-model-evolved-long"
BUILDS: dict[str, Build] = {
    "toy-qwen2.5-vl": Build(
        "make toy-model",
        "about 16 min on one H200 (stages 1-3) + 18 min of one CPU core (stage 4); hours on 2 CPU cores",
    ),
    "toy-qwen2.5-vl-cycle": Build("make toy-model-cycle", "about 29 min of one CPU core, fp32"),
    "toy-qwen2.5-vl-cycle-video": Build(
        "make toy-model-cycle toy-model-cycle-video", "about 1 h 50 min of one CPU core, fp32"
    ),
    "toy-qwen2.5-vl-cycle-mask": Build(
        "make toy-model-cycle-mask", "about 65 min of one CPU core, fp32 (estimated from a 400-step probe)"
    ),
    "toy-qwen2.5-vl-evolved": Build("make toy-model-evolved", "about 44 min of one CPU core, fp32"),
    "toy-qwen2.5-vl-evolved-long": Build(f"{_LONG} TOY_PRECISION=32", "about 4 min on one H200, fp32"),
    "toy-qwen2.5-vl-evolved-anchors": Build(
        f"{_LONG} toy-model-evolved-anchors TOY_PRECISION=32", "about 8 min on one H200, fp32"
    ),
    "toy-qwen2.5-vl-evolved-named": Build(
        f"{_LONG} toy-model-evolved-named TOY_PRECISION=32", "about 8 min on one H200, fp32"
    ),
    "toy-qwen2.5-vl-evolved-chains-anchor": Build(
        f"{_LONG} toy-model-evolved-anchors toy-model-evolved-chains-anchor TOY_PRECISION=32",
        "about 13 min on one H200, fp32",
    ),
    "toy-qwen2.5-vl-evolved-chains": Build(
        f"{_LONG} toy-model-evolved-anchors toy-model-evolved-chains TOY_PRECISION=32",
        "about 13 min on one H200, fp32",
    ),
    "toy-qwen2.5-vl-math": Build("make toy-model-math TOY_PRECISION=32", "about 80 min of one CPU core, fp32"),
}


def missing_checkpoint_message(path: str | Path) -> str | None:
    """One line for a toy checkpoint folder (``checkpoints/<name>``) that has no model: whether git keeps it, the
    command that builds it and how long that takes; None for any other path, or one that holds a model."""
    flag = "--model.init_args.policy.model_name_or_path"
    p = Path(str(path)).expanduser()
    build = BUILDS.get(p.name)
    if build is None or p.parent.name != "checkpoints" or (p / "config.json").is_file():
        return None
    if not p.is_absolute() and (REPO / p / "config.json").is_file():  # the configs' paths are relative to the repo
        return (
            f"{flag} {path} is relative to the working directory ({Path.cwd()}), "
            f"which has no such folder: run from the repository root ({REPO}) or pass the flag with {REPO / p}"
        )
    where = "is missing" if p.name in KEPT else "is not in git"
    return f"{flag} {path} {where}: build it with `{build.make}` ({build.takes})"
