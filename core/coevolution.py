"""EvolvedGRPO's co-evolution edits, the parts both the data side and the trainer need: which rows get an image edit
and which a text edit (the seed's per-round partition, `split_image_rows`, or a fixed one, `edit_kind`), the question
generator's two answer keys, and how a follow-up is composed into a new problem (docs/evolved_coevolution.md).

A text edit turns problem P with answer x into::

    P

    Let x be the answer to the preceding problem. Then answer this question in terms of x:
    <follow-up>

The old problem is kept verbatim and the follow-up is appended behind a fixed bridge (as the seed does), so the new
problem contains the old one as its first step: a prefix that is checkable on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Literal

__all__ = [
    "BRIDGE",
    "EDIT_KEYS",
    "EditKind",
    "compose_follow_up",
    "edit_kind",
    "edit_draw",
    "image_row_count",
    "split_image_rows",
]

EditKind = Literal["text", "image"]

EDIT_KEYS: dict[str, str] = {"text": "follow_up_problem", "image": "edit_instruction"}
"""The one JSON key the question generator answers with, per edit kind."""

BRIDGE = "Let x be the answer to the preceding problem. Then answer this question in terms of x:"
"""The fixed text between the old problem and the follow-up."""


def compose_follow_up(previous_problem: str, follow_up: str) -> str:
    """``previous_problem``, a blank line, :data:`BRIDGE`, a line break and ``follow_up`` (both stripped).

    Raises ValueError when either is empty: the question generator's output is validated before it gets here.
    """
    previous, follow = str(previous_problem).strip(), str(follow_up).strip()
    if not previous or not follow:
        raise ValueError("compose_follow_up needs a non-empty previous problem and follow-up")
    return f"{previous}\n\n{BRIDGE}\n{follow}"


def edit_draw(row_id: str, seed: int = 2025) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, row_id)``: the first 8 bytes of sha256("{seed}:{row_id}")."""
    digest = hashlib.sha256(f"{int(seed)}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def edit_kind(row_id: str, seed: int = 2025, image_share: float = 0.1) -> EditKind:
    """``"image"`` when the row's :func:`edit_draw` is below ``image_share``, else ``"text"``: the fixed partition
    (``QuestionGenerator(partition="fixed")``; the default is the seed's per-round :func:`split_image_rows`).

    Decided by the row id alone (never by the question generator, never by the other rows), so a row keeps its kind in
    every round as long as its id is kept (the rounds keep the root row's id: the dataset is one row per root row) and
    adding or dropping rows moves no other row. The share is ``image_share`` in expectation, not exactly.
    """
    if not 0.0 <= image_share <= 1.0:
        raise ValueError(f"image_share must be in [0, 1] (the seed: 0.1), got {image_share!r}")
    return "image" if edit_draw(row_id, seed) < image_share else "text"


def image_row_count(n: int, image_share: float = 0.1) -> int:
    """How many of a round's ``n`` rows get an image edit: ``int(n * image_share + 0.5)``, and for a share strictly
    between 0 and 1 at least one row and at most ``n - 1`` (so none of a single row). As the seed's
    ``split_rows_for_augmentation`` (SHENZHEBEI/EvolvedGRPO@2dffc532, ``data_augmentation/augment_dataset.py``); a
    share of 0 or 1 (outside the seed's range) gives none or all."""
    if not 0.0 <= image_share <= 1.0:
        raise ValueError(f"image_share must be in [0, 1] (the seed: 0.1), got {image_share!r}")
    if n <= 0 or image_share in (0.0, 1.0):
        return n if image_share == 1.0 else 0
    return min(max(int(n * image_share + 0.5), 1), n - 1)


def split_image_rows(row_ids: Iterable[str], seed: int, image_share: float = 0.1) -> frozenset[str]:
    """The ids of a round's image-edit rows, exactly :func:`image_row_count` of them: the rows ranked by
    ``(sha256("{seed}:{id}").hexdigest(), id)``, the first ones taken (the seed's ranking; ids must be unique).

    The seed draws a new partition every round: its rounds pass ``seed = 2025 + k`` (Q_k's training rows on D_k:
    ``train_question_generator_8gpu.sh``, ``--seed $((2025 + SOURCE_ROUND))``; the build of D_{k+1} from D_k:
    ``build_round_k.sh``, ``round_partition_seed=$((PARTITION_SEED + target_round))`` with ``target_round = k + 1``).
    """
    ids = [str(i) for i in row_ids]
    if len(set(ids)) != len(ids):
        raise ValueError("split_image_rows needs unique row ids")
    ranked = sorted(ids, key=lambda i: (hashlib.sha256(f"{int(seed)}:{i}".encode()).hexdigest(), i))
    return frozenset(ranked[: image_row_count(len(ids), image_share)])
