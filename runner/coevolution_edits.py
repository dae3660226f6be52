"""EvolvedGRPO's D_{k+1}: every row of D_k edited once by the question generator Q_k, judged by the answer model A_k.

One pass over D_k's rows, in order, in chunks of ``chunk`` rows (the unit of resumption):

1. Q_k writes one output per row, sampled (the seed's ``augment_dataset.py generate``: temperature 0.4, top-p 0.95,
   one attempt), from the prompt it trained on (`question_generator.question_prompt` of the row's kind: by default
   the seed's partition of D_k's rows for round k + 1, exactly ``int(0.1 n + 0.5)`` image rows drawn with seed
   ``2025 + k + 1`` as the seed's ``build_round_k.sh``, `core.coevolution.split_image_rows`);
2. the outputs are judged exactly as Q's reward judges them (`QuestionGenerator.judge`): the JSON gate; for a text
   edit A_k's 5 votes on the composed problem told x (the winner, with >= 2 votes, is the new label), for an image
   edit the editor (`synth.edit_client.InstructionEditor`) and CLIP; then A_k's success rate on the edited row and
   on the unedited row (the harder-edit rate);
3. a row past the gate is replaced (text: the composed problem and the vote's label; image: the edited image, the
   problem and answer kept); any failure keeps the previous row, so |D_{k+1}| = |D_k|. The row id is the root id.

Every row of D_{k+1} carries ``lineage``: its D_k lineage plus one record of this round (`lineage_record`). Rows are
appended to ``<dataset>.partial`` after each chunk (flushed, fsynced); a resumed build skips the chunks whose rows are
all there, and each chunk reseeds torch from (seed, round, chunk index), so a build resumed after a kill writes the
rows an uninterrupted one writes. The finished file is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from core.coevolution import compose_follow_up
from core.records import jsonl_objects
from datamodules.reasoning import load_reasoning_sample, read_rows
from lightning_modules.methods.question_generator import AnswerModel, QuestionGenerator, question_prompt
from synth.edit_client import InstructionEditor, job_id_for

__all__ = ["EditSettings", "build_next_dataset", "edit_stats", "lineage_record", "next_row", "read_jsonl_rows"]


@dataclass
class EditSettings:
    """How Q_k writes its edits of D_k (the seed's ``generate`` defaults) and how the build runs."""

    temperature: float = 0.4
    """Q's sampling temperature when it edits D_k (the seed's agent: 0.4; Q trains at 1.0)."""
    top_p: float = 0.95
    max_new_tokens: int = 384
    """The length limit of Q's output (the seed's 384)."""
    chunk: int = 32
    """Rows per chunk: the unit the build writes and resumes by."""
    dtype: str = "auto"
    """Q's weights' dtype (A's is the Q config's ``answer_dtype``)."""
    device: str = "auto"
    """``auto``: CUDA when present, else the CPU."""
    engine: str | None = None
    """The rollout engine Q samples through (a registered name; null: ``hf``)."""


def read_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, in order (blank lines skipped; a bad line is a `DataError` naming it)."""
    return [obj for obj, _ in jsonl_objects(path)]


def _chunk_seed(seed: int, round_k: int, chunk: int) -> int:
    return int(hashlib.sha256(f"coevolve:{seed}:{round_k}:{chunk}".encode()).hexdigest()[:12], 16)


def _done_rows(partial: Path) -> list[dict[str, Any]]:
    """The rows a killed build wrote; a torn last line (killed mid-write) is cut off the file."""
    if not partial.is_file():
        return []
    rows, good = [], 0
    with partial.open("rb") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
            good += len(line)
    if good != partial.stat().st_size:
        with partial.open("r+b") as f:
            f.truncate(good)
    return rows


def _append(partial: Path, rows: list[dict[str, Any]]) -> None:
    with partial.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


class _RecordingEditor:
    """An `InstructionEditor` that keeps each successful edit's returned scene by its output path (a toy math row's
    edited ``meta``: the next round's toy edits must describe the edited image, not the root one)."""

    def __init__(self, editor: Any) -> None:
        self.editor, self.scenes = editor, {}

    def edit(self, edits):
        outcomes = self.editor.edit(edits)
        for out in outcomes:
            if out.path is not None and out.scene is not None:
                self.scenes[str(out.path)] = out.scene
        return outcomes

    def close(self) -> None:
        self.editor.close()


class _RecordingJudge(QuestionGenerator):
    """`QuestionGenerator`'s judge, keeping each judged candidate's votes, edited image (and toy scene) and CLIP
    similarity: the lineage's evidence (the reward keeps only the score)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.evidence: dict[str, dict[str, Any]] = {}

    def _edit_images(self, images, device) -> None:
        if self._editor is None:
            self._editor = _RecordingEditor(InstructionEditor(**dict(self.image_editor or {})))
            weakref.finalize(self, self._editor.close)
        super()._edit_images(images, device)

    def _judge_pending(self, module, pending) -> None:
        super()._judge_pending(module, pending)
        scenes = getattr(self._editor, "scenes", {})
        for p in pending.values():
            self.evidence[f"{p.sample.sample_id}\x00{p.text}"] = {
                "votes": p.votes,
                "edited_image": p.edited_path,
                "clip": p.clip,
                "scene": scenes.get(str(p.edited_path)) if p.edited_path else None,
            }


def lineage_record(
    round_k: int, kind: str, q_output: str, score: Any, evidence: dict[str, Any], harder: bool, base: float | None,
    models: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """This round's lineage record of a row: where it came from, what Q wrote, what A said, and whether it was
    replaced (``outcome``) and why (``reason``: ``ok`` or the gate, `question_generator.GATES`)."""
    edit = score.output.text if score.output is not None else None
    rec: dict[str, Any] = {
        "round": round_k + 1,
        "from_round": round_k,
        "kind": kind,
        "question_model": models["question"],
        "answer_model": models["answer"],
        "q_output": q_output,
        "edit": edit,
        "outcome": "replaced" if score.valid else "kept",
        "reason": score.gate,
        "p_step": score.p_step,
        "p_answer": score.p_answer,
        "base_p_answer": base,
        "harder": bool(harder),
    }
    if kind == "text":
        rec.update(votes=evidence.get("votes"), label=score.label)
    else:
        seed = int(hashlib.sha256(f"{evidence.get('row_id')}:{edit}".encode()).hexdigest()[:8], 16)
        rec.update(
            edit_job=job_id_for(evidence["row_id"], edit, seed) if edit else None,
            edited_image=evidence.get("edited_image"),
            clip=evidence.get("clip"),
        )
    return rec


def next_row(
    raw: dict[str, Any], sample: Any, kind: str, score: Any, evidence: dict[str, Any], record: dict[str, Any],
    out_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """D_{k+1}'s row from D_k's (``raw``, as read; ``sample`` its loaded form) and its judged edit: a text edit past
    the gate gets the composed problem and the vote's label, an image edit the edited image (a toy row also its
    edited scene), anything else stays; the image path is made relative to ``out_dir``; ``record`` is appended to
    the row's lineage."""
    row = {**raw, "image": _image_field(sample.image_path, raw.get("image"), out_dir)}
    if score.valid and kind == "text":
        row.update(problem=compose_follow_up(sample.problem, score.output.text), answer=str(score.label))
    elif score.valid:
        row["image"] = _image_field(evidence["edited_image"], None, out_dir)
        edited = evidence.get("scene")
        if isinstance(row.get("meta"), dict) and isinstance(edited, dict) and isinstance(edited.get("scene"), dict):
            row["meta"] = {**row["meta"], "scene": edited["scene"]}
    row["lineage"] = [*(raw.get("lineage") or []), record]
    return row


def _image_field(image_path: str | None, raw: Any, out_dir: Path) -> Any:
    """A row's image as the new file (in ``out_dir``) refers to it: a path relative to ``out_dir``."""
    if image_path is None:
        return raw  # an embedded image (parquet bytes) stays as it was
    return os.path.relpath(Path(image_path).resolve(), out_dir.resolve())


def build_next_dataset(
    src: Path,
    dst: Path,
    *,
    round_k: int,
    question_model: str,
    answer_model: str,
    judge_args: dict[str, Any],
    settings: EditSettings,
    seed: int,
    on_rows: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write D_{k+1} (``dst``) from D_k (``src``) with Q_k (``question_model``) and A_k (``answer_model``); returns
    the round's edit statistics (`edit_stats`). ``judge_args``: `QuestionGenerator`'s arguments (A's sampling, the
    editor, CLIP, the partition). ``on_rows(n)`` is called after each chunk with the rows written so far."""
    raw_rows = read_jsonl_rows(src)
    records = read_rows(src)
    if len(raw_rows) != len(records):
        raise ValueError(f"{src}: {len(raw_rows)} JSON lines but {len(records)} rows read")
    partial = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    written = _done_rows(partial)
    if [r["id"] for r in written] != [r["id"] for r in raw_rows[: len(written)]]:
        raise ValueError(f"{partial}: its rows are not D_k's first rows in order; delete it to rebuild this round")
    device = torch.device(
        settings.device if settings.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    q = judge = None
    models = {"question": str(question_model), "answer": str(answer_model)}
    n_chunk = max(1, settings.chunk)
    for c, start in enumerate(range(0, len(records), n_chunk)):
        if start + n_chunk <= len(written) or len(written) == len(records):
            continue  # every row of this chunk is written
        if q is None:
            q = AnswerModel(question_model, engine=settings.engine, votes=1, temperature=settings.temperature,
                            top_p=settings.top_p, max_new_tokens=settings.max_new_tokens,
                            dtype=settings.dtype).load(device)  # fmt: skip
            judge = _RecordingJudge(**{**judge_args, "answer_model": str(answer_model), "partition_round": round_k + 1})
            judge.use_rows([r.sample_id for r in records])  # the partition splits all of D_k, not a chunk
        torch.manual_seed(_chunk_seed(seed, round_k, c))
        chunk = [load_reasoning_sample(r) for r in records[start : start + n_chunk]]
        kinds = [judge.kind_of(s) for s in chunk]
        texts = [
            c_[0] for c_ in q.sample([(s.image, question_prompt(s.problem, s.answer, k)) for s, k in zip(chunk, kinds)])
        ]
        info = judge.judge(SimpleNamespace(device=device, rollout_engine=None), chunk, texts)
        bases = iter(info["base_p_answer"])
        out = []
        for s, raw, kind, text, score, harder in zip(
            chunk, raw_rows[start : start + n_chunk], kinds, texts, info["question_scores"], info["harder"]
        ):
            base = next(bases) if score.valid else None
            edit = score.output.text if score.output is not None else ""
            evidence = {**judge.evidence.get(f"{s.sample_id}\x00{edit}", {}), "row_id": s.sample_id}
            rec = lineage_record(round_k, kind, text, score, evidence, harder, base, models)
            out.append(next_row(raw, s, kind, score, evidence, rec, dst.parent))
        _append(partial, out)
        written += out
        if on_rows is not None:
            on_rows(len(written))
    if len(written) != len(raw_rows):
        raise RuntimeError(f"{partial}: {len(written)} rows written of {len(raw_rows)}")
    os.replace(partial, dst)
    return edit_stats(written, round_k + 1)


def edit_stats(rows: list[dict[str, Any]], new_round: int) -> dict[str, Any]:
    """Q_k's edit statistics over D_{k+1}'s lineage records of round ``new_round``: the valid-edit rate (rows
    replaced), the harder-edit rate (valid edits whose ``p_answer`` is below A's success rate on the unedited row),
    counts by edit kind and by reason."""
    recs = [next(r for r in row["lineage"] if r.get("round") == new_round) for row in rows]
    n = max(len(recs), 1)
    valid = [r for r in recs if r["outcome"] == "replaced"]
    by_kind: dict[str, dict[str, int]] = {}
    for r in recs:
        k = by_kind.setdefault(r["kind"], {"rows": 0, "replaced": 0, "harder": 0})
        k["rows"] += 1
        k["replaced"] += r["outcome"] == "replaced"
        k["harder"] += bool(r["harder"])
    return {
        "rows": len(recs),
        "replaced": len(valid),
        "valid_edit_rate": len(valid) / n,
        "harder_edit_rate": sum(bool(r["harder"]) for r in recs) / n,
        "harder_of_valid": sum(bool(r["harder"]) for r in valid) / len(valid) if valid else None,
        "by_kind": by_kind,
        "reasons": dict(sorted(Counter(r["reason"] for r in recs).items())),
    }
