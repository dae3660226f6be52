"""DOVE (paper 004): does a caption of one occurrence of a repeated event single that occurrence out? TEC and N/M.

The Generalized CycleGRPO seed introduces DOVE for temporal captioning: *contrast groups* of repeated events of the
same query in one video (the same action, several times); the policy captions each target occurrence given its
interval, and a text-only judge LLM (the seed: Qwen2.5-72B) answers private, frozen probes of three kinds from the
caption alone: **Order** (which of the repetitions it is, what came before or after), **State** (the state of the
actors and objects during it) and **Outcome** (what it ends with). The seed reports **TEC** (the macro average over
the three probe types of the probe accuracy, "evidence coverage") and **N/M** (the share of probes the judge finds
not mentioned in the caption; lower is better; 75.1% -> 50.7% in the seed). The seed has no code for DOVE and its
release format is not available here, so this module reads the minimal JSON below and defines the judge's question;
both are ours (docs/cycle_grpo.md, "V-STaR and DOVE").

**Data** (JSONL, one contrast group a line; `read_dove`)::

    {"group_id": "g0", "video": "<vid>", "query": "the large circle moves", "fps": 2.0,
     "occurrences": [{"id": "g0-1", "interval": [2.0, 4.0],
                      "probes": [{"type": "order", "question": "Which time does it move here?",
                                  "options": ["the first", "the second", "the third"], "answer": 1}, ...]}, ...]}

``video`` is a video id found under ``--video-root`` (``<vid>.mp4``, or a toy ``<vid>.npz``); ``fps`` (optional) is
the video's native frame rate; ``interval`` is the occurrence in seconds; ``type`` is ``order``, ``state`` or
``outcome``; ``options`` are the probe's choices and ``answer`` the index (or the letter) of the right one.

**Scoring.** The judge gets the caption (its ``<answer>`` part), the probe and its options lettered A, B, ... and
replies with one letter, or ``N/M`` when the caption does not say (`DOVE_JUDGE_PROMPT`, `read_choice`). A probe is
correct when the letter is the answer's; ``N/M`` counts toward N/M and is wrong; a reply with neither (or a failed
judge call under ``--judge-on-failure value``) is wrong and counted as ``unreadable``. ``tec_by_type[t]`` = correct /
probes of type t; ``tec`` = their mean over the types present (macro); ``nm`` = N/M replies / probes. With
``bootstrap > 0`` the contrast groups are resampled with replacement that many times (seed 0) and ``tec_ci95`` is the
2.5 / 97.5 percentile of TEC (the seed reports a paired bootstrap by video group of the *difference* between two
systems; this is one system's interval).
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.prompts import PROMPT_TEMPLATES
from core.records import DataError, jsonl_objects
from core.regions import IntervalSpace
from evals.bench_files import predictions_path, require_predictions, write_results
from evals.video_inputs import answer_part, greedy_video_answers, load_clip

__all__ = [
    "DOVE_JUDGE_PROMPT",
    "PROBE_TYPES",
    "DoveGroup",
    "Occurrence",
    "Probe",
    "evaluate_dove",
    "judge_prompt",
    "read_choice",
    "read_dove",
    "read_dove_predictions",
    "summarize_dove",
]

PROBE_TYPES = ("order", "state", "outcome")
LETTERS = "ABCDEFGHIJ"


@dataclass
class Probe:
    type: str
    question: str
    options: list[str]
    answer: int
    """Index of the right option."""


@dataclass
class Occurrence:
    occurrence_id: str
    interval: tuple[float, float]
    probes: list[Probe]


@dataclass
class DoveGroup:
    """One contrast group: repeated occurrences of ``query`` in one video."""

    group_id: str
    video: str
    query: str
    fps: float | None
    occurrences: list[Occurrence]
    source: str


def _probe(obj: Any, where: str) -> Probe:
    if not isinstance(obj, dict) or not {"type", "question", "options", "answer"} <= obj.keys():
        raise DataError(f"{where}: a probe is {{'type', 'question', 'options', 'answer'}}, got {obj!r}")
    kind = str(obj["type"]).lower()
    options = obj["options"]
    if kind not in PROBE_TYPES:
        raise DataError(f"{where}: probe type {obj['type']!r} is not one of {PROBE_TYPES}")
    if not isinstance(options, list) or not 2 <= len(options) <= len(LETTERS):
        raise DataError(f"{where}: a probe's options are a list of 2 to {len(LETTERS)} choices")
    answer = obj["answer"]
    if isinstance(answer, str) and len(answer) == 1 and answer.upper() in LETTERS:
        answer = LETTERS.index(answer.upper())
    if not isinstance(answer, int) or not 0 <= answer < len(options):
        raise DataError(f"{where}: a probe's answer is an option index 0..{len(options) - 1} or its letter")
    return Probe(kind, str(obj["question"]), [str(o) for o in options], answer)


def read_dove(path: str | Path, max_samples: int | None = None) -> list[DoveGroup]:
    """The contrast groups of a DOVE JSONL file (module docstring); ``max_samples``: only the first N groups."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (DOVE contrast groups as JSONL)")
    groups, seen = [], set()
    for obj, where in jsonl_objects(path):
        if max_samples is not None and len(groups) >= max_samples:
            break
        missing = [k for k in ("group_id", "video", "occurrences") if k not in obj]
        if missing:
            raise DataError(f"{where}: missing {missing}; a DOVE line is one contrast group (module docstring)")
        occs = []
        for k, occ in enumerate(obj["occurrences"] or []):
            at = f"{where}: occurrence {k}"
            try:
                start, end = (float(v) for v in occ["interval"])
                oid, raw_probes = str(occ["id"]), list(occ["probes"])
            except (KeyError, TypeError, ValueError):
                raise DataError(f"{at}: an occurrence is {{'id', 'interval': [start, end], 'probes': [...]}}") from None
            probes = [_probe(p, f"{at}, probe {j}") for j, p in enumerate(raw_probes)]
            if not 0 <= start < end:
                raise DataError(f"{at}: interval {occ['interval']} is not [start, end] with 0 <= start < end")
            if oid in seen:
                raise DataError(f"{at}: occurrence id {oid!r} appears twice")
            seen.add(oid)
            occs.append(Occurrence(oid, (start, end), probes))
        if not occs:
            raise DataError(f"{where}: a contrast group needs at least one occurrence")
        fps = float(obj["fps"]) if obj.get("fps") else None
        groups.append(DoveGroup(str(obj["group_id"]), str(obj["video"]), str(obj.get("query", "")), fps, occs, where))
    if not groups:
        raise DataError(f"{path}: no contrast groups")
    return groups


DOVE_JUDGE_PROMPT = (
    "Below is a description of one moment of a video, and a multiple-choice question about that moment. Answer it "
    "using only the description; do not guess. If the description does not say enough to answer, reply N/M.\n"
    "Description: {caption}\n"
    "Question: {question}\n"
    "{options}\n"
    "Reply with the letter of one option, or N/M."
)
"""The text-only judge's prompt for one probe (ours: the seed's prompt is not public)."""


def judge_prompt(caption: str, probe: Probe) -> str:
    options = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(probe.options))
    return DOVE_JUDGE_PROMPT.format(caption=caption, question=probe.question, options=options)


_NM = re.compile(r"\bN\s*/\s*M\b|\bnot\s+mentioned\b", re.IGNORECASE)
_LETTER = re.compile(r"(?:^|[\s(\"'*])([A-J])(?=$|[\s).:,\"'*])")


def read_choice(reply: str | None, n_options: int) -> int | str | None:
    """The judge's reply as an option index, ``"nm"`` (not mentioned) or None (no reply, or neither): N/M wins
    when the reply names it; otherwise the first standalone capital letter among the options' letters."""
    if reply is None:
        return None
    if _NM.search(reply):
        return "nm"
    for m in _LETTER.finditer(reply.strip()):
        idx = LETTERS.index(m.group(1))
        if idx < n_options:
            return idx
    return None


def summarize_dove(rows: Sequence[dict[str, Any]], bootstrap: int = 0) -> dict[str, Any]:
    """TEC per probe type and macro, N/M and the unreadable rate of judged probe rows (each with ``group``, ``type``,
    ``choice``, ``correct``); a bootstrap 95% interval of TEC over contrast groups when ``bootstrap > 0``."""
    if not rows:
        raise ValueError("summarize_dove: no probes")

    def tec(rs: Sequence[dict[str, Any]]) -> tuple[float, dict[str, float]]:
        by: dict[str, list[bool]] = defaultdict(list)
        for r in rs:
            by[r["type"]].append(r["correct"])
        per = {t: sum(by[t]) / len(by[t]) for t in PROBE_TYPES if by[t]}
        return sum(per.values()) / len(per), per

    macro, per = tec(rows)
    out: dict[str, Any] = {
        "tec": macro,
        "tec_by_type": per,
        "probes_by_type": {t: sum(1 for r in rows if r["type"] == t) for t in PROBE_TYPES},
        "nm": sum(1 for r in rows if r["choice"] == "nm") / len(rows),
        "unreadable": sum(1 for r in rows if r["choice"] is None) / len(rows),
        "n_probes": len(rows),
    }
    if bootstrap > 0:
        by_group: dict[str, list] = defaultdict(list)
        for r in rows:
            by_group[r["group"]].append(r)
        keys, rng, values = sorted(by_group), random.Random(0), []
        for _ in range(bootstrap):
            values.append(tec([r for k in rng.choices(keys, k=len(keys)) for r in by_group[k]])[0])
        values.sort()
        out["tec_ci95"] = [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]
        out["bootstrap"] = bootstrap
    return out


def read_dove_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Captions by occurrence id from ``<stem>.predictions.jsonl`` files (``{"id", "caption"}`` lines, one per
    occurrence, as `evaluate_dove` writes them); a second caption for one id is an error."""
    out: dict[str, dict[str, Any]] = {}
    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such predictions file (--predictions)")
        for obj, where in jsonl_objects(path):
            if "id" not in obj or not isinstance(obj.get("caption"), str | None):
                raise DataError(f"{where}: a DOVE prediction is {{'id': occurrence id, 'caption': text}}")
            key = str(obj["id"])
            if key in out:
                raise DataError(f"{where}: a second caption for {key!r} (the first: {out[key]['where']})")
            out[key] = {"caption": obj["caption"], "where": where}
    if not out:
        raise DataError(f"{paths}: no predictions in the file(s)")
    return out


def _captions(groups, model, processor, videos, template, fps, max_frames, max_pixels, max_new_tokens, batch, log):
    """The policy's caption of every occurrence (its interval written as the captioning prompt's region), greedily."""
    space, out, done = IntervalSpace(), {}, 0
    total = sum(len(g.occurrences) for g in groups)
    for start in range(0, len(groups), batch):
        chunk = groups[start : start + batch]
        clips = {
            g.group_id: load_clip(
                videos.path(g.video, g.source), fps, g.fps, max_frames=max_frames, max_pixels=max_pixels
            )
            for g in chunk
        }
        occs = [(g, o) for g in chunk for o in g.occurrences]
        questions = [PROMPT_TEMPLATES[template]["rec"].format(query=space.serialize([o.interval])) for _, o in occs]
        texts, _ = greedy_video_answers(
            model, processor, questions, [clips[g.group_id] for g, _ in occs], max_new_tokens
        )
        for (_, o), text in zip(occs, texts):
            out[o.occurrence_id] = text
        done += len(occs)
        if log is not None:
            log(f"{done}/{total} occurrences captioned")
    return out


def evaluate_dove(
    groups: Sequence[DoveGroup],
    out: str | Path,
    *,
    judge: Any,
    model: Any = None,
    processor: Any = None,
    videos: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    caption_template: str = "video_caption",
    fps: float = 1.0,
    max_frames: int = 64,
    max_pixels: int = 448 * 448,
    max_new_tokens: int = 128,
    batch_size: int = 4,
    bootstrap: int = 0,
    info: dict[str, Any] | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Caption every occurrence of ``groups`` with the policy (``batch_size`` groups' clips per generate call) or
    take the captions from ``predictions`` (`read_dove_predictions`), have ``judge`` (a ``JudgeClient``) answer
    every probe from its caption, and score (`summarize_dove`). Writes one line per occurrence (caption, each
    probe's reply, choice and correctness) to ``<out stem>.predictions.jsonl`` and the results to ``out``."""
    import time

    if (model is None) == (predictions is None):
        raise ValueError("evaluate_dove: give the policy (model, processor, videos) or predictions, one")
    t0 = time.perf_counter()
    if predictions is not None:
        occ_ids = [o.occurrence_id for g in groups for o in g.occurrences]
        require_predictions(
            occ_ids, predictions, "occurrences have no caption",
            "the predictions must hold one line per occurrence id of this file",
        )  # fmt: skip
        captions = {k: predictions[k]["caption"] for k in occ_ids}
    else:
        captions = _captions(
            groups, model, processor, videos, caption_template, fps, max_frames, max_pixels, max_new_tokens,
            batch_size, log,
        )  # fmt: skip
    asked = [(g, o, p) for g in groups for o in g.occurrences for p in o.probes]
    if not asked:
        raise DataError("the DOVE file's occurrences hold no probes: nothing for the judge to answer")
    replies = judge.complete([judge_prompt(answer_part(captions[o.occurrence_id] or ""), p) for _, o, p in asked])
    rows, per_occ = [], defaultdict(list)
    for (g, o, p), reply in zip(asked, replies):
        choice = read_choice(reply, len(p.options))
        row = {"group": g.group_id, "type": p.type, "choice": choice, "correct": choice == p.answer}
        rows.append(row)
        per_occ[o.occurrence_id].append({"type": p.type, "reply": reply, "choice": choice, "correct": row["correct"]})
    pred_path = predictions_path(out)
    with pred_path.open("w", encoding="utf-8") as fh:
        for g in groups:
            for o in g.occurrences:
                line = {"id": o.occurrence_id, "group": g.group_id, "interval": list(o.interval)}
                line.update(caption=captions[o.occurrence_id], probes=per_occ[o.occurrence_id])
                fh.write(json.dumps(line) + "\n")
    results = {
        "benchmark": "dove",
        "n_groups": len(groups),
        "n_occurrences": sum(len(g.occurrences) for g in groups),
        "metrics": summarize_dove(rows, bootstrap),
        "predictions": str(pred_path),
        "seconds": round(time.perf_counter() - t0, 2),
        **(info or {}),
    }
    return write_results(out, results)
