"""DLC-Bench (Describe Anything's detailed localized captioning benchmark), as CycleGRPO's released evaluation runs
it: the policy captions each masked region (``evaluation/dlc_bench/inference.py``), a text-only LLM judge answers the
benchmark's questions from the caption alone (``evaluation/dlc_bench/eval_llama_without_image.py``, Llama-3.1-8B
served by vLLM, ``serve_judge.sh``).

**Data** (`read_dlc_bench`), the benchmark's ``annotations/`` folder:

- ``annotations.json``: COCO format; ``images`` (``id``, ``file_name``, ``height``, ``width``) under
  ``<folder>/images/``, ``annotations`` (``id``, ``image_id``, ``segmentation``: polygons or RLE) - one region each;
- ``qa.json``: ``{annotation id: [{"question", "choices": [[text, score], ...], "type": "positive" | "negative"}]}``;
- ``class_names.json``: ``{annotation id: class name}``.

One `DlcRecord` per key of ``qa.json`` (the release scores those keys); a key without its annotation or class name, or
a question without choices or with an unknown type, is a ``DataError`` naming the file and key.

**Captioning** (`caption_question`). The region's mask is encoded by the mask tokenizer on its image into one
mask-token span, and the policy is asked ``Given a detailed description of this region <span>.`` after the image,
greedily (1024 new tokens by default). The release adds a zoom-in crop and its span as a second image when the
region's box covers under 30 % of the image; that multi-image prompt is not ported (a named gap: small regions are
captioned from the whole image only).

**Judging** (`judge_record`). Before the benchmark's questions the release asks a recognition question built from the
class name ("is it likely that the object in the description is a <class> or an object of a similar type?", Yes /
No); every question is one judge request holding the caption and the question with lettered choices, answered
greedily. `parse_choice` reads a reply as the release does: the exact choice, ``<letter>. <choice>`` or the bare
letter; else a choice that occurs in the reply (the last-starting one, the longest on a tie); else ``<letter>.``;
else the longest choice that contains the reply; else nothing (scores 0). The release uses ``inflect`` for the
plural and the article of the class name; here a plural is a name ending in ``s`` but not ``ss`` / ``us`` / ``is``
(and a few irregular plurals), and the article is ``an`` before a vowel (a named approximation: ``an hour``).

**Scores** (`DlcScorer`), as the release computes them: a question scores its chosen choice's score (0 when no
choice is read); when the recognition answer is No, every score of the region is capped at 0 (``min(0, s)``). Per
region ``score_pos`` = mean over its positive questions, ``score_neg`` = mean over its negative questions (None
without any). ``pos`` = mean of ``score_pos`` over regions, ``neg`` = mean of ``score_neg`` over the regions that have
negatives, ``avg`` = (pos + neg) / 2. One departure: the release stops with an error when the recognition reply
names neither Yes nor No; here it counts as No (``recognition_unread`` counts them), so a noisy judge gives a number.
A failed judge call (``--judge-on-failure value``) reads as no choice; under ``raise`` the run stops with one line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.records import DataError, jsonl_objects
from core.regions.coco_masks import segmentation_to_mask
from core.regions.mask_tokens import format_mask
from evals.bench_files import predictions_path, require_predictions, write_results
from evals.region_benchmarks import greedy_texts, open_image

__all__ = [
    "DLC_MAX_NEW_TOKENS",
    "DlcRecord",
    "DlcScorer",
    "caption_question",
    "evaluate_dlc",
    "judge_prompt",
    "judge_record",
    "parse_choice",
    "read_dlc_bench",
    "read_dlc_predictions",
    "recognition_question",
]

DLC_MAX_NEW_TOKENS = 1024
QUESTION_TYPES = ("positive", "negative")
LETTERS = "ABCDE"
_IRREGULAR_PLURALS = {"people", "men", "women", "children", "mice", "geese", "feet", "teeth"}


@dataclass
class DlcRecord:
    """One region: its annotation id (``key``), image, segmentation, class name and questions (each
    ``{"question", "choices": [(text, score)], "type"}``); ``source`` names the files for errors."""

    key: str
    image_path: Path
    height: int
    width: int
    segmentation: Any
    class_name: str
    questions: list[dict[str, Any]]
    source: str


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: no such file (DLC-Bench's annotations folder holds annotations.json, qa.json, "
                        "class_names.json and images/)")  # fmt: skip
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None


def _questions(items: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: a region's questions are a non-empty list")
    out = []
    for i, q in enumerate(items):
        w = f"{where} question {i}"
        if not isinstance(q, dict) or not isinstance(q.get("question"), str):
            raise DataError(f"{w}: a question is {{'question', 'choices': [[text, score]], 'type'}}")
        if q.get("type") not in QUESTION_TYPES:
            raise DataError(f"{w}: type must be one of {QUESTION_TYPES}, got {q.get('type')!r}")
        choices = q.get("choices")
        ok = isinstance(choices, list) and 0 < len(choices) <= len(LETTERS)
        ok = ok and all(isinstance(c, list | tuple) and len(c) == 2 and isinstance(c[1], int | float) for c in choices)
        if not ok:
            raise DataError(f"{w}: choices must be 1-{len(LETTERS)} pairs [text, score], got {str(choices)[:80]}")
        out.append({"question": q["question"], "choices": [(str(t), float(s)) for t, s in choices], "type": q["type"]})
    return out


def read_dlc_bench(
    folder: str | Path, image_root: str | Path | None = None, *, max_samples: int | None = None
) -> list[DlcRecord]:
    """The regions of DLC-Bench's ``folder`` (module docstring), in ``qa.json``'s order; images under
    ``image_root`` (default ``<folder>/images``), not opened."""
    folder = Path(folder)
    root = Path(image_root) if image_root is not None else folder / "images"
    coco = _load_json(folder / "annotations.json")
    qa = _load_json(folder / "qa.json")
    names = _load_json(folder / "class_names.json")
    if not isinstance(coco, dict) or not isinstance(qa, dict) or not isinstance(names, dict):
        raise DataError(f"{folder}: annotations.json, qa.json and class_names.json must each hold a JSON object")
    images = {im["id"]: im for im in coco.get("images") or []}
    anns = {str(a["id"]): a for a in coco.get("annotations") or []}
    out = []
    for key, items in qa.items():
        where = f"{folder / 'qa.json'} key {key}"
        ann = anns.get(str(key))
        if ann is None:
            raise DataError(f"{where}: no annotation with this id in annotations.json")
        im = images.get(ann.get("image_id"))
        if im is None:
            raise DataError(f"{where}: its annotation's image_id {ann.get('image_id')!r} is not in annotations.json")
        if not isinstance(names.get(str(key)), str):
            raise DataError(f"{where}: no class name for this key in class_names.json")
        out.append(
            DlcRecord(
                str(key),
                root / im["file_name"],
                int(im["height"]),
                int(im["width"]),
                ann.get("segmentation"),
                names[str(key)],
                _questions(items, where),
                where,
            )  # fmt: skip
        )
        if max_samples is not None and len(out) >= max_samples:
            break
    if not out:
        raise DataError(f"{folder / 'qa.json'}: no regions")
    return out


def caption_question(span: str) -> str:
    """The release's captioning question for a region written as mask-token ``span`` (no zoom-in)."""
    return f"Given a detailed description of this region {span}."


def region_span(rec: DlcRecord, image: Any, tokenizer: Any) -> tuple[str, tuple[int, int]]:
    """The mask-token span and codes of ``rec``'s region on its opened ``image``."""
    import numpy as np

    arr = np.asarray(image)
    try:
        mask = segmentation_to_mask(rec.segmentation, arr.shape[0], arr.shape[1])
        if not mask.any():
            raise ValueError("the mask is empty")
        codes = tuple(int(v) for v in tokenizer.encode(arr, mask))
    except ValueError as err:
        raise DataError(f"{rec.source}: segmentation: {err}") from None
    return format_mask(codes), codes


def _is_plural(name: str) -> bool:
    last = name.strip().lower().split()[-1] if name.strip() else ""
    if last in _IRREGULAR_PLURALS:
        return True
    return last.endswith("s") and not last.endswith(("ss", "us", "is"))


def recognition_question(class_name: str) -> dict[str, Any]:
    """The question asked first: is the described object the region's class (or of a similar type)?"""
    if _is_plural(class_name):
        text = f"Is it likely that the objects in the description are {class_name} or objects of a similar type?"
    else:
        article = "an" if class_name.strip()[:1].lower() in "aeiou" else "a"
        text = f"Is it likely that the object in the description is {article} {class_name} or an object of a similar"
        text += " type?"
    text += " Again, it does not have to be an exact match."
    return {"question": text, "choices": [("Yes", 1.0), ("No", 0.0)], "type": "recognition"}


def judge_prompt(caption: str, question: dict[str, Any]) -> str:
    """One judge request: the caption, then the question with its choices lettered A, B, ..."""
    lettered = "\n".join(f"{LETTERS[i]}. {text}" for i, (text, _) in enumerate(question["choices"]))
    return (
        "Answer the multiple-choice question using only the text description of an object in an image. Rules:\n"
        "1. Output exactly one of the choices and nothing else: no reasoning, no corrections, do not repeat the "
        "question.\n"
        "2. The description does not have to match a choice word for word: pick the closest choice.\n\n"
        f"The description is:\n{caption}\n\n"
        f"From the description above, answer the following question with one of the choices:\n"
        f"{question['question']}\n{lettered}"
    )


def parse_choice(reply: str | None, choices: Sequence[str]) -> int | None:
    """The index of the choice a judge ``reply`` names (the release's rules, module docstring), or None."""
    if reply is None:
        return None
    pred = reply.strip().lower()
    if not pred:
        return None
    found = []
    for i, choice in enumerate(c.strip().lower() for c in choices):
        letter = LETTERS[i].lower()
        if pred in (choice, f"{letter}. {choice}", letter):
            return i
        if choice and choice in pred:
            found.append((i, pred.index(choice), len(choice)))
    if len(found) == 1:
        return found[0][0]
    if len(pred) > 1 and pred[0] in LETTERS.lower()[: len(choices)] and pred[1] == ".":
        return LETTERS.lower().index(pred[0])
    if found:
        last = max(pos for _, pos, _ in found)
        return max((f for f in found if f[1] == last), key=lambda f: f[2])[0]
    inside = [(i, len(c)) for i, c in enumerate(c.strip().lower() for c in choices) if pred in c]
    if inside:
        return max(inside, key=lambda t: t[1])[0]
    if pred[0] in LETTERS.lower()[: len(choices)] and (len(pred) == 1 or pred[1] == "\n"):
        return LETTERS.lower().index(pred[0])
    return None


def judge_record(rec: DlcRecord, caption: str, replies: Sequence[str | None]) -> dict[str, Any]:
    """Score one region from the judge's ``replies`` to ``[recognition, *rec.questions]`` (in that order)."""
    asked = [recognition_question(rec.class_name), *rec.questions]
    if len(replies) != len(asked):
        raise ValueError(f"judge_record: {len(replies)} replies for {len(asked)} questions of {rec.key}")
    picks = [parse_choice(r, [t for t, _ in q["choices"]]) for r, q in zip(replies, asked)]
    recognized = picks[0] == 0
    details, pos, neg = [], [], []
    for q, reply, pick in zip(asked[1:], replies[1:], picks[1:]):
        score = q["choices"][pick][1] if pick is not None else 0.0
        if not recognized:
            score = min(0.0, score)
        (pos if q["type"] == "positive" else neg).append(score)
        details.append({"question": q["question"], "type": q["type"], "reply": reply, "pick": pick, "score": score})
    return {
        "id": rec.key,
        "class_name": rec.class_name,
        "caption": caption,
        "recognition": {"reply": replies[0], "pick": picks[0], "correct": recognized},
        "score_pos": sum(pos) / len(pos) if pos else None,
        "score_neg": sum(neg) / len(neg) if neg else None,
        "questions": details,
        "judge_failures": sum(r is None for r in replies),
    }


class DlcScorer:
    """Running DLC-Bench scores (module docstring): ``pos``, ``neg``, ``avg``, with the counts behind them."""

    def __init__(self) -> None:
        self.pos: list[float] = []
        self.neg: list[float] = []
        self.n = self.unrecognized = self.unread = self.failures = 0

    def update(self, judged: dict[str, Any]) -> None:
        self.n += 1
        if judged["score_pos"] is not None:
            self.pos.append(judged["score_pos"])
        if judged["score_neg"] is not None:
            self.neg.append(judged["score_neg"])
        self.unrecognized += not judged["recognition"]["correct"]
        self.unread += judged["recognition"]["pick"] is None
        self.failures += judged["judge_failures"]

    def compute(self) -> dict[str, Any]:
        pos = sum(self.pos) / len(self.pos) if self.pos else None
        neg = sum(self.neg) / len(self.neg) if self.neg else None
        avg = (pos + neg) / 2 if pos is not None and neg is not None else None
        return {
            "pos": pos,
            "neg": neg,
            "avg": avg,
            "regions": self.n,
            "regions_with_negatives": len(self.neg),
            "recognition_wrong": self.unrecognized,
            "recognition_unread": self.unread,
            "judge_failures": self.failures,
        }


def read_dlc_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Captions by region id: the release's cache JSON (``{annotation id: caption}``, ``model_outputs/<name>.json``)
    or JSONL lines ``{"id", "caption"}`` (what `evaluate_dlc` writes). A second caption for an id is an error."""
    out: dict[str, dict[str, Any]] = {}

    def add(key: Any, text: Any, where: str) -> None:
        if key is None or not isinstance(text, str):
            raise DataError(f"{where}: a DLC-Bench prediction is {{'id', 'caption': str}} (or the release's cache)")
        if str(key) in out:
            raise DataError(f"{where}: a second caption for {str(key)!r} (the first: {out[str(key)]['where']})")
        out[str(key)] = {"caption": text, "where": where}

    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such predictions file (--predictions)")
        if path.suffix == ".json":
            cache = _load_json(path)
            if not isinstance(cache, dict):
                raise DataError(f"{path}: the release's cache is a JSON object {{annotation id: caption}}")
            for key, text in cache.items():
                add(key, text, f"{path}: key {key}")
        else:
            for obj, where in jsonl_objects(path):
                obj = obj if isinstance(obj, dict) else {}
                add(obj.get("id"), obj.get("caption"), where)
    if not out:
        raise DataError(f"{paths}: no captions in the file(s)")
    return out


def evaluate_dlc(
    records: Sequence[DlcRecord],
    out: str | Path,
    judge: Any,
    *,
    model: Any = None,
    processor: Any = None,
    tokenizer: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    max_new_tokens: int = DLC_MAX_NEW_TOKENS,
    batch_size: int = 8,
    engine: Any = "hf",
    info: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Caption ``records`` with the policy (``model``, ``processor`` and the mask ``tokenizer`` that writes the
    regions) or take the captions from ``predictions`` (`read_dlc_predictions`), judge them with ``judge`` (a
    `JudgeClient`), and score. Writes ``<out stem>.predictions.jsonl`` (id, class name, codes, caption, the judge's
    replies and scores) and the results to ``out``; returns the results."""
    if (model is None) == (predictions is None):
        raise ValueError("evaluate_dlc: give the policy (model, processor) or predictions, not both")
    if model is not None and tokenizer is None:
        raise ValueError("evaluate_dlc: the policy's questions need the mask tokenizer to write the regions")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if predictions is not None:
        require_predictions(
            (r.key for r in records), predictions, "regions have no caption",
            "the predictions must hold one caption per key of qa.json",
        )  # fmt: skip
    scorer = DlcScorer()
    pred_path = predictions_path(out)
    t0 = time.perf_counter()
    with pred_path.open("w", encoding="utf-8") as fh:
        for start in range(0, len(records), batch_size):
            recs = records[start : start + batch_size]
            codes: list[list[int]] = [[] for _ in recs]
            if model is not None:
                images, questions = [], []
                for k, r in enumerate(recs):
                    images.append(open_image(r.image_path, r.source, (r.width, r.height)))
                    span, c = region_span(r, images[-1], tokenizer)
                    codes[k] = list(c)
                    questions.append(caption_question(span))
                texts = greedy_texts(model, processor, images, questions, max_new_tokens=max_new_tokens, engine=engine)
                captions = [_clean(t) for t in texts]
            else:
                captions = [predictions[r.key]["caption"] for r in recs]
            asked = [[recognition_question(r.class_name), *r.questions] for r in recs]
            prompts = [judge_prompt(c, q) for c, qs in zip(captions, asked) for q in qs]
            replies = judge.complete(prompts)  # every question of the batch at once, max_concurrency in flight
            at = 0
            for r, c, caption, qs in zip(recs, codes, captions, asked):
                judged = judge_record(r, caption, replies[at : at + len(qs)])
                at += len(qs)
                scorer.update(judged)
                fh.write(json.dumps({**judged, "codes": c}) + "\n")
            if log is not None:
                log(f"{min(start + batch_size, len(records))}/{len(records)}")
    results = {
        "benchmark": "dlc-bench",
        "n": len(records),
        "metrics": scorer.compute(),
        "predictions": str(pred_path),
        "seconds": round(time.perf_counter() - t0, 2),
        **(info or {}),
    }
    return write_results(out, results, (r.key for r in records), predictions)


def _clean(text: str) -> str:
    """A caption as the release keeps it: the chat end token dropped, whitespace stripped."""
    return text.replace("<|im_end|>", "").replace("<|endoftext|>", "").strip()
