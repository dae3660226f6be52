"""V-STaR (Cheng et al. 2025): what / when / where of a video question, asked in two chain orders; mAM and mLGM.

The Generalized CycleGRPO seed reports V-STaR's mAM / mLGM for its spatio-temporal setting (paper 004, Table 7) and
has no code for it; the definitions here are those of V-STaR's public ``eval.py`` and ``inference_demo.py``
(github.com/V-STaR-Bench/V-STaR), re-written.

**Data.** The public annotation file (``V_STaR_test.json``): a JSON list of items with ``vid``, ``domain``, ``fps``,
``width``, ``height``, ``frame_count``, ``question`` / ``answer`` (what), ``temporal_question`` / ``timestamps``
``[start, end]`` seconds (when), ``spatial_question`` (chain 1) / ``spatial_question_2`` (chain 2) and ``bboxes``
(where: the object's box on annotated frames, in the video's pixels; either ``{"timestamp", "frame_index", "xmin",
"ymin", "xmax", "ymax"}`` entries, as ``eval.py`` reads them, or ``{"<timestamp>_<frame>": {"xmin", ...}}``, as the
data README writes them). `read_vstar` reads both; a defect raises ``DataError`` naming the file and item.

**Questions** (`VSTAR_PROMPTS`; ``vstar``: the benchmark's own, re-phrased; ``toy``: the toy video checkpoint's
"When:" / "Track:" prompts). Every item is asked five questions, each with the clip:

- *what*: the question;
- chain 1 (what -> when -> where): *when* (the temporal question: start and end in seconds), then *where* (the spatial
  question, with the ground-truth time range given: a box per whole second of it, as JSON ``{"<second>": box}``);
- chain 2 (what -> where -> when): *where_2* (the second spatial question, no time given: one box per relevant
  second), then *when_2* (the temporal question, with the ground-truth boxes given).

As in V-STaR, the later link of a chain is given the ground truth of the earlier one, not the model's own answer.

**Scores** (per item, then means over items):

- *what*: a judge LLM rates the answer against the reference from 0 to 3 (V-STaR's ``eval.py``: Qwen2.5-72B;
  `VSTAR_JUDGE_PROMPT`); a reply that is not one of 0-3 counts as rating 0 and wrong; ``acc`` = fraction rated >= 2.
  Without a judge (``--judge-url`` unset) the answer is rated 3 when it equals the reference after lower-casing and
  dropping punctuation and articles, else 0 (``what_scorer: exact`` in the results: not the benchmark's number);
- *when*: tIoU of the answer's interval with ``timestamps`` (V-STaR reads an answer as an interval only when it holds
  exactly two numbers; otherwise tIoU 0); ``when`` = mean tIoU, ``when_r1@{0.3,0.5,0.7}`` = fraction above;
- *where*: for each ground-truth box, the best IoU of the answer's boxes at that timestamp (0 when the answer has no
  box there), averaged over the item's boxes (``eval.py``'s per-item mIoU; timestamps are matched as numbers, where
  ``eval.py`` matches the string of the timestamp with the answer's key); ``where`` = mean over items;
- per chain c: ``AM_c = (acc + when_c + where_c) / 3`` and ``LGM_c = -(log(1 - acc) + log(1 - when_c) +
  log(1 - where_c)) / 3``; ``mAM = (AM_1 + AM_2) / 2`` and ``mLGM = (LGM_1 + LGM_2) / 2``. LGM is unbounded as a
  score reaches 1 (``eval.py`` fails there with a math domain error); we clip ``1 - x`` at ``1e-6``.

Boxes answered in the model's input frame are scaled to the video's ``width`` x ``height`` (``inference_demo.py``
denormalises the same way). Results also hold the scores per ``domain`` and per duration (``Short`` < 60 s,
``Medium`` < 180 s, ``Long``), as ``eval.py`` prints them.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.records import DataError, jsonl_objects
from core.regions import NO_TARGET, AnchorSpace
from core.regions.boxes import box_iou
from evals.bench_files import predictions_path, require_predictions, write_results
from evals.video_inputs import answer_part, greedy_video_answers, load_clip

__all__ = [
    "CHAIN_KEYS",
    "VSTAR_JUDGE_PROMPT",
    "VSTAR_PROMPTS",
    "VStarItem",
    "exact_rating",
    "parse_interval",
    "parse_rating",
    "parse_timed_boxes",
    "evaluate_vstar",
    "read_vstar",
    "read_vstar_predictions",
    "score_vstar_item",
    "spatial_miou",
    "summarize_vstar",
    "temporal_iou",
    "vstar_questions",
]

CHAIN_KEYS = ("what", "when", "where", "where_2", "when_2")
"""The five questions asked per item, in the order they are asked."""

LGM_EPS = 1e-6
"""``1 - x`` is clipped at this in LGM's logarithms (a perfect score would give an infinite LGM)."""

Box = tuple[float, float, float, float]


@dataclass
class VStarItem:
    """One V-STaR question (module docstring): ``boxes`` are ``(timestamp, (x1, y1, x2, y2))`` in video pixels."""

    sample_id: str
    vid: str
    domain: str
    fps: float
    width: int
    height: int
    frame_count: int
    question: str
    answer: str
    temporal_question: str
    timestamps: tuple[float, float]
    spatial_question: str
    spatial_question_2: str
    boxes: list[tuple[float, Box]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return round(self.frame_count / self.fps, 2)

    @property
    def duration_class(self) -> str:
        return "Short" if self.duration < 60 else "Medium" if self.duration < 180 else "Long"


_REQUIRED = ("vid", "fps", "width", "height", "frame_count", "question", "answer", "temporal_question", "timestamps")
_REQUIRED += ("spatial_question", "bboxes")
_CORNERS = ("xmin", "ymin", "xmax", "ymax")


def _boxes(raw: Any, where: str) -> list[tuple[float, Box]]:
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'bboxes' must be a non-empty list of boxes on annotated frames")
    out = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise DataError(f"{where}: a 'bboxes' entry is an object, got {entry!r}")
        if "timestamp" in entry:  # eval.py's layout
            pairs = [(entry["timestamp"], entry)]
        else:  # the data README's layout: {"<timestamp>_<frame>": {xmin, ...}}
            pairs = [(str(k).split("_")[0], v) for k, v in entry.items()]
        for t, box in pairs:
            try:
                out.append((float(t), tuple(float(box[k]) for k in _CORNERS)))
            except (KeyError, TypeError, ValueError):
                raise DataError(
                    f"{where}: a box needs a numeric timestamp and {', '.join(_CORNERS)}, got {entry!r}"
                ) from None
    return sorted(out, key=lambda tb: tb[0])


def read_vstar(path: str | Path, max_samples: int | None = None) -> list[VStarItem]:
    """The items of V-STaR's annotation JSON (module docstring), in file order; id ``<vid>#<index>``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (V-STaR's annotation JSON, e.g. V_STaR_test.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: V-STaR's annotation file is a JSON list of items, got a {type(data).__name__}")
    items = []
    for i, obj in enumerate(data[:max_samples] if max_samples else data):
        where = f"{path}: item {i}"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: an item is an object, got {type(obj).__name__}")
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise DataError(f"{where}: missing {missing} (V-STaR's annotation fields; see data/README.md there)")
        try:
            start, end = (float(v) for v in obj["timestamps"])
            fps, width, height, frames = (
                float(obj["fps"]),
                int(obj["width"]),
                int(obj["height"]),
                int(obj["frame_count"]),
            )
        except (TypeError, ValueError):
            raise DataError(
                f"{where}: timestamps must be [start, end] and fps/width/height/frame_count numbers"
            ) from None
        if not (0 <= start <= end and fps > 0 and width > 0 and height > 0 and frames > 0):
            raise DataError(f"{where}: timestamps {obj['timestamps']} or fps/size/frame_count out of range")
        items.append(
            VStarItem(
                sample_id=f"{obj['vid']}#{i}",
                vid=str(obj["vid"]),
                domain=str(obj.get("domain") or "unknown"),
                fps=fps,
                width=width,
                height=height,
                frame_count=frames,
                question=str(obj["question"]),
                answer=str(obj["answer"]),
                temporal_question=str(obj["temporal_question"]),
                timestamps=(start, end),
                spatial_question=str(obj["spatial_question"]),
                spatial_question_2=str(obj.get("spatial_question_2") or obj["spatial_question"]),
                boxes=_boxes(obj["bboxes"], where),
                source=where,
            )
        )
    if not items:
        raise DataError(f"{path}: no items")
    return items


# --- the questions -----------------------------------------------------------------------------------------------

VSTAR_PROMPTS: dict[str, dict[str, str]] = {
    "vstar": {
        "what": "Answer the question about the video: {question}\n(If the answer is a person, you do not need to "
        "identify the person.)",
        "when": "This video is {duration} seconds long. Answer the question about the video: {temporal_question}\n"
        "Output the start and end moment timestamps.",
        "where": "Answer the question about the video: {spatial_question} with bounding boxes in [x1, y1, x2, y2] "
        "format. For each whole second in {time_range} (boundaries included), output the object's box as JSON whose "
        'keys are the seconds (strings) and whose values are the boxes, e.g. {{"{first_second}": [x1, y1, x2, y2], '
        "...}}.",
        "where_2": "Answer the question about the video: {spatial_question_2} with bounding boxes in [x1, y1, x2, y2] "
        "format. Output {n_boxes} box(es), one for each whole second related to the question (decide which seconds "
        'are), as JSON whose keys are the seconds (strings), e.g. {{"0": [x1, y1, x2, y2], ...}}.',
        "when_2": "This video is {duration} seconds long with a resolution of {width}x{height} (width x height). "
        "Answer the question about the video: {temporal_question}\nThe key object of the question is in these "
        "{n_boxes} bounding boxes, times not given: {boxes}. Output the start and end moment timestamps.",
    },
    "toy": {  # the toy video checkpoint's prompts (docs/cycle_grpo.md, "The video stage"); it was never taught QA
        "what": "{question}",
        "when": "When: {temporal_question}",
        "where": "Track: {spatial_question}",
        "where_2": "Track: {spatial_question_2}",
        "when_2": "When: {temporal_question}",
    },
}


def vstar_questions(item: VStarItem, prompts: str = "vstar") -> dict[str, str]:
    """The five questions (`CHAIN_KEYS`) asked about ``item`` under prompt set ``prompts``."""
    if prompts not in VSTAR_PROMPTS:
        raise ValueError(f"--prompts must be one of {sorted(VSTAR_PROMPTS)}, got {prompts!r}")
    start, end = item.timestamps
    seconds = list(range(math.ceil(start), math.floor(end) + 1))
    fields = {
        "question": item.question,
        "temporal_question": item.temporal_question,
        "spatial_question": item.spatial_question,
        "spatial_question_2": item.spatial_question_2,
        "duration": item.duration,
        "width": item.width,
        "height": item.height,
        "time_range": seconds,
        "first_second": seconds[0] if seconds else math.floor(start),
        "n_boxes": len(item.boxes),
        "boxes": [[round(v) for v in box] for _, box in item.boxes],
    }
    return {k: VSTAR_PROMPTS[prompts][k].format(**fields) for k in CHAIN_KEYS}


# --- reading answers ---------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def _answer(text: str) -> str:
    return answer_part(text)


def parse_interval(text: str | None) -> tuple[float, float] | None:
    """``(start, end)`` when the answer (its ``<answer>`` part if tagged) holds exactly two numbers, else None
    (V-STaR's ``extract_timestamps``)."""
    if not text:
        return None
    found = _NUMBER.findall(_answer(text))
    return (float(found[0]), float(found[1])) if len(found) == 2 else None


def _as_box(value: Any) -> Box | None:
    if isinstance(value, list | tuple) and len(value) == 1:  # [[x1, y1, x2, y2]]
        value = value[0]
    if isinstance(value, list | tuple) and len(value) == 4 and all(isinstance(v, int | float) for v in value):
        return tuple(float(v) for v in value)
    return None


def _json_boxes(text: str) -> dict[float, list[Box]] | None:
    match = re.search(r"\{[\s\S]*\}|\[[\s\S]*\]", text)
    if match is None:
        return None
    try:
        obj = json.loads(match.group(0).replace("'", '"'))
    except json.JSONDecodeError:
        return None
    if isinstance(obj, list) and all(isinstance(o, dict) for o in obj):  # [{"3": box}, {"4": box}]
        obj = {k: v for o in obj for k, v in o.items()}
    if isinstance(obj, list):  # [[t, box], ...]
        obj = {str(o[0]): o[1] for o in obj if isinstance(o, list | tuple) and len(o) == 2}
    if not isinstance(obj, dict):
        return None
    out: dict[float, list[Box]] = defaultdict(list)
    for key, value in obj.items():
        t = _NUMBER.search(str(key))
        boxes = [_as_box(value)] if _as_box(value) else [_as_box(v) for v in value] if isinstance(value, list) else []
        for box in boxes:
            if t is not None and box is not None:
                out[float(t.group(0))].append(box)
    return dict(out) or None


def parse_timed_boxes(
    text: str | None, input_wh: tuple[float, float] | None = None, size: tuple[float, float] | None = None
) -> dict[float, list[Box]]:
    """The answer's boxes by timestamp: V-STaR's JSON ``{"<second>": [x1, y1, x2, y2], ...}`` (or a list of such
    objects, or of ``[t, box]`` pairs), else anchors as ``core.regions.AnchorSpace`` reads them (``1.0s: [..]; ..``,
    the toy checkpoint's). Boxes are scaled from the model-input frame ``input_wh`` to the video's ``size`` (both
    (width, height); no scaling when either is None). ``{}`` for an answer without boxes."""
    if not text:
        return {}
    body = _answer(text)
    found = _json_boxes(body)
    if found is None:
        anchors = AnchorSpace().parse(body)
        found = defaultdict(list)
        if anchors is not None and anchors is not NO_TARGET:
            for t, box in anchors:
                found[float(t)].append(tuple(box))
    sx = sy = 1.0
    if input_wh is not None and size is not None:
        sx, sy = size[0] / input_wh[0], size[1] / input_wh[1]
    return {t: [(b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy) for b in bs] for t, bs in sorted(found.items())}


# --- scores ------------------------------------------------------------------------------------------------------


def temporal_iou(gt: Sequence[float], pred: Sequence[float] | None) -> float:
    """V-STaR's tIoU of one interval: ``max(0, min(ends) - max(starts)) / (max(ends) - min(starts))``; 0 for no
    interval or an empty hull."""
    if pred is None or len(pred) != 2:
        return 0.0
    (gs, ge), (ps, pe) = gt, pred
    inter = max(0.0, min(ge, pe) - max(gs, ps))
    union = max(ge, pe) - min(gs, ps)
    return inter / union if union > 0 else 0.0


def spatial_miou(gt: Sequence[tuple[float, Sequence[float]]], pred: dict[float, list[Box]]) -> float:
    """Mean over the ground-truth boxes of the best IoU of the answer's boxes at the same timestamp (0 without
    one there); 0 for an answer without boxes."""
    if not pred or not gt:
        return 0.0
    by_time = {round(t, 3): bs for t, bs in pred.items()}
    return sum(max((box_iou(box, b) for b in by_time.get(round(t, 3), [])), default=0.0) for t, box in gt) / len(gt)


_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _norm(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", re.sub(r"[^\w\s]", " ", text.lower())).split())


def exact_rating(answer: str | None, reference: str) -> int:
    """The no-judge *what* rating: 3 when the answer (its ``<answer>`` part) equals the reference after
    lower-casing and dropping punctuation and articles, else 0."""
    return 3 if answer is not None and _norm(_answer(answer)) == _norm(reference) else 0


def parse_rating(reply: str | None) -> int:
    """The judge's 0-3 rating: the reply's leading integer when it is 0, 1, 2 or 3; -1 otherwise (a failed call,
    chatter): ``eval.py`` keeps -1 and counts it as rating 0, not correct."""
    if reply is None:
        return -1
    m = re.match(r"\s*(?:rating\s*[:=]?\s*)?([0-3])\b", reply, re.IGNORECASE)
    return int(m.group(1)) if m else -1


VSTAR_JUDGE_PROMPT = (
    "You are grading a candidate answer to a question about a video against the correct (groundtruth) answer, by "
    "semantic similarity only, ignoring grammar. Rate 0 (no similarity: entirely incorrect), 1 (low similarity: "
    "largely incorrect), 2 (high similarity: largely correct) or 3 (complete similarity: entirely correct). "
    "Reply with the single integer 0, 1, 2 or 3.\n"
    "Question: {question}\nGroundtruth answer: {answer}\nCandidate answer: {candidate}\nYour response: "
)
"""The *what* judge's prompt: V-STaR's 0-3 rubric (its system prompt and user template in one user turn)."""


def _lgm(*xs: float) -> float:
    return -sum(math.log(max(1.0 - x, LGM_EPS)) for x in xs) / len(xs)


def _group_scores(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    n = len(rows)
    ratings = [r["rating"] for r in rows]
    acc = sum(1 for v in ratings if v >= 2) / n
    out: dict[str, float] = {"n": n, "acc": acc, "avg_rating": sum(max(v, 0) for v in ratings) / n}
    for chain, when, where in ((1, "when_iou", "where_iou"), (2, "when_2_iou", "where_2_iou")):
        t = sum(r[when] for r in rows) / n
        v = sum(r[where] for r in rows) / n
        sfx = "" if chain == 1 else "_2"
        out[f"when{sfx}"], out[f"where{sfx}"] = t, v
        for m in (0.3, 0.5, 0.7):
            out[f"when{sfx}_r1@{m:g}"] = sum(1 for r in rows if r[when] >= m) / n
        out[f"AM{chain}"] = (acc + t + v) / 3
        out[f"LGM{chain}"] = _lgm(acc, t, v)
    out["mAM"] = (out["AM1"] + out["AM2"]) / 2
    out["mLGM"] = (out["LGM1"] + out["LGM2"]) / 2
    return out


def summarize_vstar(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The scores of scored rows (each with ``rating``, ``when_iou``, ``where_iou``, ``where_2_iou``,
    ``when_2_iou``, ``domain``, ``duration_class``): overall (module docstring), ``by_domain`` and
    ``by_duration``."""
    if not rows:
        raise ValueError("summarize_vstar: no scored items")
    out: dict[str, Any] = _group_scores(rows)
    for key, name in (("domain", "by_domain"), ("duration_class", "by_duration")):
        groups: dict[str, list] = defaultdict(list)
        for r in rows:
            groups[r[key]].append(r)
        out[name] = {g: _group_scores(rs) for g, rs in sorted(groups.items())}
    return out


# --- a run: ask or read the answers, score, write ------------------------------------------------------------------


def _as_text(value: Any) -> str | None:
    """A V-STaR result field as answer text: strings as they are, parsed lists / dicts as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def read_vstar_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Answers by item id from our ``<stem>.predictions.jsonl`` files (``{"id", "completions": {what, when, where,
    where_2, when_2}, "input_wh"}``) or V-STaR's own result JSON (the annotation list with ``answer_vqa``,
    ``answer_temporal``, ``answer_spatial``, ``answer_spatial_2``, ``answer_temporal_2`` added, boxes already in
    video pixels; ids ``<vid>#<index>`` as `read_vstar` numbers them). A second answer for one id is an error."""
    out: dict[str, dict[str, Any]] = {}

    def add(key: str, entry: dict[str, Any], where: str) -> None:
        if key in out:
            raise DataError(f"{where}: a second prediction for {key!r} (the first: {out[key]['where']})")
        out[key] = {**entry, "where": where}

    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such predictions file (--predictions)")
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8-sig"))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: V-STaR's result file is a JSON list of items")
            fields = ("answer_vqa", "answer_temporal", "answer_spatial", "answer_spatial_2", "answer_temporal_2")
            for i, obj in enumerate(data):
                comps = {k: _as_text(obj.get(f)) for k, f in zip(CHAIN_KEYS, fields)}
                add(f"{obj.get('vid')}#{i}", {"completions": comps, "input_wh": None}, f"{path}: item {i}")
            continue
        for obj, where in jsonl_objects(path):
            if "id" not in obj or not isinstance(obj.get("completions"), dict):
                raise DataError(f"{where}: a V-STaR prediction is {{'id', 'completions': {{{', '.join(CHAIN_KEYS)}}}}}")
            add(str(obj["id"]), {"completions": obj["completions"], "input_wh": obj.get("input_wh")}, where)
    if not out:
        raise DataError(f"{paths}: no predictions in the file(s)")
    return out


def score_vstar_item(item: VStarItem, completions: dict[str, str | None], input_wh: Any, rating: int) -> dict:
    """One item's row of the predictions file: its answers, how they read and their scores."""
    size = (item.width, item.height)
    wh = tuple(input_wh) if input_wh else None
    when, when_2 = parse_interval(completions.get("when")), parse_interval(completions.get("when_2"))
    where = parse_timed_boxes(completions.get("where"), wh, size)
    where_2 = parse_timed_boxes(completions.get("where_2"), wh, size)
    return {
        "id": item.sample_id,
        "vid": item.vid,
        "domain": item.domain,
        "duration_class": item.duration_class,
        "completions": {k: completions.get(k) for k in CHAIN_KEYS},
        "input_wh": list(wh) if wh else None,
        "when": when,
        "when_2": when_2,
        "where": {f"{t:g}": [list(b) for b in bs] for t, bs in where.items()},
        "where_2": {f"{t:g}": [list(b) for b in bs] for t, bs in where_2.items()},
        "rating": rating,
        "when_iou": temporal_iou(item.timestamps, when),
        "where_iou": spatial_miou(item.boxes, where),
        "where_2_iou": spatial_miou(item.boxes, where_2),
        "when_2_iou": temporal_iou(item.timestamps, when_2),
    }


def _ratings(items: Sequence[VStarItem], answers: Sequence[str | None], judge: Any) -> list[int]:
    """The *what* ratings: the judge's (one request per answered item) or `exact_rating` without a judge."""
    if judge is None:
        return [exact_rating(a, it.answer) for it, a in zip(items, answers)]
    asked = [i for i, a in enumerate(answers) if a and _answer(a)]
    prompts = [
        VSTAR_JUDGE_PROMPT.format(question=items[i].question, answer=items[i].answer, candidate=_answer(answers[i]))
        for i in asked
    ]
    replies = dict(zip(asked, judge.complete(prompts)))
    return [parse_rating(replies[i]) if i in replies else 0 for i in range(len(items))]


def evaluate_vstar(
    items: Sequence[VStarItem],
    out: str | Path,
    *,
    model: Any = None,
    processor: Any = None,
    videos: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    judge: Any = None,
    prompts: str = "vstar",
    fps: float = 1.0,
    max_frames: int = 64,
    max_pixels: int = 448 * 448,
    max_new_tokens: int = 256,
    batch_size: int = 4,
    info: dict[str, Any] | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Score ``items``: asked of the policy (``model``, ``processor``; clips from ``videos``, a `VideoIndex`),
    greedily, ``batch_size`` clips per generate call and question, or read from ``predictions``
    (`read_vstar_predictions`). *What* is rated by ``judge`` (a ``JudgeClient``) or by exact match. Writes every
    item's row (`score_vstar_item`) to ``<out stem>.predictions.jsonl`` and the results (`summarize_vstar`,
    ``info``) to ``out``; returns the results."""
    import time

    if (model is None) == (predictions is None):
        raise ValueError("evaluate_vstar: give the policy (model, processor, videos) or predictions, one")
    t0 = time.perf_counter()
    answers: dict[str, dict[str, str | None]] = {}
    input_wh: dict[str, Any] = {}
    if predictions is not None:
        require_predictions(
            (it.sample_id for it in items), predictions, "items have no prediction",
            "the predictions must hold one entry per item of this annotation file",
        )  # fmt: skip
        for it in items:
            answers[it.sample_id] = predictions[it.sample_id]["completions"]
            input_wh[it.sample_id] = predictions[it.sample_id].get("input_wh")
    else:
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            clips = [
                load_clip(videos.path(it.vid, it.source), fps, it.fps, max_frames=max_frames, max_pixels=max_pixels)
                for it in batch
            ]
            questions = [vstar_questions(it, prompts) for it in batch]
            for it in batch:
                answers[it.sample_id] = {}
            for key in CHAIN_KEYS:
                texts, whs = greedy_video_answers(model, processor, [q[key] for q in questions], clips, max_new_tokens)
                for it, text, wh in zip(batch, texts, whs):
                    answers[it.sample_id][key] = text
                    input_wh[it.sample_id] = list(wh)
            if log is not None:
                log(f"{min(start + batch_size, len(items))}/{len(items)}")
    ratings = _ratings(items, [answers[it.sample_id].get("what") for it in items], judge)
    rows = [score_vstar_item(it, answers[it.sample_id], input_wh[it.sample_id], r) for it, r in zip(items, ratings)]
    pred_path = predictions_path(out)
    with pred_path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    results = {
        "benchmark": "vstar",
        "n": len(items),
        "what_scorer": "judge" if judge is not None else "exact",
        "metrics": summarize_vstar(rows),
        "predictions": str(pred_path),
        "seconds": round(time.perf_counter() - t0, 2),
        **(info or {}),
    }
    return write_results(out, results, (it.sample_id for it in items), predictions)
