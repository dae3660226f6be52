"""The co-evolution rounds' config (``configs/coevolve/*.yaml``, `RoundsConfig`) and the one reader of a ``train.py``
config the rounds do themselves (`config_method_args`: the question config's method arguments judge the edit stage).
The rounds: `runner.coevolution_rounds`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from core.config_files import load_config
from runner.coevolution_edits import EditSettings

__all__ = ["RoundsConfig", "RoundsError", "config_method_args"]


class RoundsError(ValueError):
    """A mistake in the rounds' config or run folder; the message names the key (file) or path and the fix."""


@dataclass
class RoundsConfig:
    """The rounds' YAML (``configs/coevolve/*.yaml``); relative paths are relative to the working directory."""

    answer_config: str
    """``train.py`` config of A's GRPO (``math_answer``), e.g. configs/evolved_answer_tiny.yaml."""
    question_config: str
    """``train.py`` config of Q's GRPO (``question_generator``); its method arguments also judge the edits."""
    dataset: str
    """D_1: reasoning rows (JSONL, JSON or parquet; `datamodules.reasoning.read_rows`)."""
    answer_model: str
    """A_0, the HF folder A_1 starts from."""
    question_model: str
    """Q_0, the HF folder Q_1 starts from."""
    rounds: int = 5
    seed: int = 0
    """Fits use seed + 3100 + k (A) and seed + 4100 + k (Q) (the seed's per-round seeds); the edits seed + k."""
    eval_files: dict[str, str] = field(default_factory=dict)
    """A's held-out sets, name -> file; empty: the answer config's ``data.test_files``."""
    toy: dict[str, Any] | None = None
    """``{data_root, splits, seed}``: write the toy visual-math world first (`datamodules.toy_math.ToyMathSpec`)."""
    max_rows: int | None = None
    """Use only D_1's first rows."""
    answer_args: dict[str, Any] = field(default_factory=dict)
    """More ``train.py`` keys for A's fits and evaluation, dotted (``trainer.limit_train_batches: 2``)."""
    question_args: dict[str, Any] = field(default_factory=dict)
    """More keys for Q's fits; ``model.init_args.method.init_args.*`` ones also apply to the edit stage's judge."""
    edits: EditSettings = field(default_factory=EditSettings)
    prune_checkpoints: bool = False
    """Delete a fit's checkpoints (``checkpoints/``, ``final.ckpt``) once its export is written (a 7B round's
    checkpoints hold hundreds of GB; the export is what later stages read)."""
    mode: str = "coevolve"
    """``coevolve``: the rounds above. ``plain``: the study's baseline, plain GRPO with the same answer-model updates:
    A_k starts from A_{k-1} and trains one epoch on D_1 every round; no Q is trained and no dataset is edited."""
    launcher: str = "subprocess"
    """``subprocess``: each ``train.py`` call is a process of its own (its memory returned when it ends);
    ``inprocess``: ``train.cli_main`` in this process (no import per stage: the tests)."""

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RoundsConfig:
        """Read ``path``; unknown or missing keys raise `RoundsError` naming the file and the key."""
        data = load_config(path)  # its compose: parts merged in (core/config_files.py)
        data.update(overrides or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RoundsError(f"{path}: unknown key(s) {unknown}; the keys are {sorted(known)}")
        edits = data.pop("edits", None) or {}
        bad = sorted(set(edits) - {f.name for f in fields(EditSettings)})
        if bad:
            raise RoundsError(f"{path}: unknown key(s) {bad} under edits; see runner/coevolution_edits.py")
        try:
            cfg = cls(**data, edits=EditSettings(**edits))
        except TypeError as e:
            raise RoundsError(f"{path}: {e} (the required keys: answer_config, question_config, dataset, "
                              "answer_model, question_model)") from None  # fmt: skip
        if cfg.rounds < 1:
            raise RoundsError(f"{path}: rounds must be >= 1, got {cfg.rounds}")
        if cfg.mode not in ("coevolve", "plain"):
            raise RoundsError(f"{path}: mode must be coevolve or plain, got {cfg.mode!r}")
        if cfg.launcher not in ("subprocess", "inprocess"):
            raise RoundsError(f"{path}: launcher must be subprocess or inprocess, got {cfg.launcher!r}")
        for key in ("answer_config", "question_config"):
            if not Path(getattr(cfg, key)).is_file():
                raise RoundsError(f"{path}: {key} {getattr(cfg, key)}: no such file")
        return cfg


def config_method_args(path: str | Path) -> dict[str, Any]:
    """The method arguments (``model.init_args.method.init_args``) of the ``train.py`` config at ``path``, read from
    its raw YAML."""
    cfg = load_config(path)  # a composed config: its parts merged in
    method = ((cfg.get("model") or {}).get("init_args") or {}).get("method") or {}
    return dict(method.get("init_args") or {})
