"""GAR-Bench VQA (Grasp Any Region's multiple-choice questions about regions), as CycleGRPO's released evaluation asks
it (``evaluation/gar/qwen3vl_gar_vqa_infer.py``) and scores it (``evaluation/gar/gar_vqa_metrics.py``).

**Data** (`read_gar_vqa`). ``GAR-Bench-VQA.json``: a list of ``{"image", "question", "choices": [str], "answer",
"type", "mask_rles": [RLE]}``; ``image`` is relative to the benchmark's annotation folder (``--image-root``, default
the file's folder); the question names region ``i`` as ``<Prompt{i}>`` and ``mask_rles[i]`` is its mask. One
`GarRecord` per item, id ``gar-<index in the file>``; ``type`` is the category scored apart (color, texture/pattern,
mirror, ordering, material, shape, relation).

**Asking** (`gar_question`). Each region mask is encoded by the mask tokenizer on its image (prompted with the mask's
tight box, the release's ``masks_to_boxes``) into one mask-token span, which replaces ``<Prompt{i}>`` in::

    Question: {question}
    Options:
    {choice 1}
    ...
    Answer with the correct option's letter directly.

(a ``<Prompt{i}>`` with no mask stays as written, as in the release). Greedy, 1024 new tokens by default.

**Scores** (`GarScorer`). Exact match, case-insensitive, after the release's cleaning: an empty ``<think>`` block
removed, whitespace stripped, one trailing ``.`` dropped (``"D."`` matches ``"D"``); we also drop the chat end tokens
(``<|im_end|>``, ``<|endoftext|>``) the release's decoding skips. ``accuracy`` overall and ``type_accuracy`` /
``type_counts`` per category, fractions in [0, 1] (the release prints percentages). An answer that says more than the
letter ("A. red") is wrong, as in the release.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.records import DataError, jsonl_objects
from core.regions.coco_masks import segmentation_to_mask
from core.regions.mask_tokens import format_mask
from evals.bench_files import predictions_path, require_predictions, write_results
from evals.region_benchmarks import greedy_texts, open_image

__all__ = [
    "GAR_MAX_NEW_TOKENS",
    "GarRecord",
    "GarScorer",
    "clean_answer",
    "evaluate_gar",
    "gar_question",
    "read_gar_predictions",
    "read_gar_vqa",
    "region_spans",
]

GAR_MAX_NEW_TOKENS = 1024
_PROMPT = re.compile(r"<Prompt(\d+)>")
_THINK = re.compile(r"<think>\n\n</think>\n\n", re.IGNORECASE)


@dataclass
class GarRecord:
    """One GAR-Bench VQA item (image not opened yet)."""

    sample_id: str
    image_path: Path
    question: str
    choices: list[str]
    answer: str
    type: str
    mask_rles: list[Any]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def read_gar_vqa(
    path: str | Path, image_root: str | Path | None = None, *, max_samples: int | None = None
) -> list[GarRecord]:
    """The `GarRecord` s of a GAR-Bench VQA file (module docstring); a defect raises ``DataError`` naming the item."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (--data is GAR-Bench-VQA.json)")
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(items, list) or not items:
        raise DataError(f"{path}: GAR-Bench VQA is a non-empty JSON list of questions")
    root = Path(image_root) if image_root is not None else path.parent
    out = []
    for i, item in enumerate(items[:max_samples] if max_samples is not None else items):
        where = f"{path}: item {i}"
        if not isinstance(item, dict):
            raise DataError(f"{where}: an item is an object, got {type(item).__name__}")
        for key, kind in (("image", str), ("question", str), ("answer", str), ("type", str), ("choices", list)):
            if not isinstance(item.get(key), kind):
                raise DataError(f"{where}: '{key}' must be a {kind.__name__}, got {str(item.get(key))[:60]!r}")
        if not all(isinstance(c, str) for c in item["choices"]):
            raise DataError(f"{where}: 'choices' must be a list of strings")
        rles = item.get("mask_rles", [])
        if not isinstance(rles, list):
            raise DataError(f"{where}: 'mask_rles' must be a list of COCO RLE masks")
        wanted = {int(n) for n in _PROMPT.findall(item["question"])}
        if any(n >= len(rles) for n in wanted):
            raise DataError(f"{where}: the question names <Prompt{max(wanted)}> but there are {len(rles)} masks")
        out.append(
            GarRecord(
                f"gar-{i}",
                root / item["image"],
                item["question"],
                list(item["choices"]),
                item["answer"],
                item["type"],
                rles,
                where,
            )  # fmt: skip
        )
    return out


def region_spans(rec: GarRecord, image: Any, tokenizer: Any) -> tuple[list[str], list[tuple[int, int]]]:
    """The mask-token span and codes of each region of ``rec`` on its opened ``image``."""
    import numpy as np

    arr = np.asarray(image)
    spans, codes = [], []
    for i, rle in enumerate(rec.mask_rles):
        try:
            mask = segmentation_to_mask(rle, arr.shape[0], arr.shape[1])
            if not mask.any():
                raise ValueError("the mask is empty")
            c = tuple(int(v) for v in tokenizer.encode(arr, mask))
        except ValueError as err:
            raise DataError(f"{rec.source}: mask_rles[{i}]: {err}") from None
        codes.append(c)
        spans.append(format_mask(c))
    return spans, codes


def gar_question(rec: GarRecord, spans: Sequence[str]) -> str:
    """The release's question text for ``rec`` with ``<Prompt{i}>`` replaced by ``spans[i]`` (module docstring)."""
    text = f"Question: {rec.question}\nOptions:" + "".join(f"\n{c}" for c in rec.choices)
    text += "\nAnswer with the correct option's letter directly."
    return _PROMPT.sub(lambda m: spans[int(m.group(1))] if int(m.group(1)) < len(spans) else m.group(0), text)


def clean_answer(text: str) -> str:
    """The release's cleaning before the exact match (module docstring), lower-cased."""
    text = _THINK.sub("", text.replace("<|im_end|>", "").replace("<|endoftext|>", "")).strip()
    if text.endswith("."):
        text = text[:-1].strip()
    return text.lower()


class GarScorer:
    """Accuracy overall and per ``type``: ``update(type, output, answer) -> correct``, ``compute()``."""

    def __init__(self) -> None:
        self.per: dict[str, list[bool]] = defaultdict(list)

    def update(self, kind: str, output: str, answer: str) -> bool:
        ok = clean_answer(output) == clean_answer(answer)
        self.per[kind].append(ok)
        return ok

    def compute(self) -> dict[str, Any]:
        every = [v for vs in self.per.values() for v in vs]
        return {
            "accuracy": sum(every) / len(every) if every else float("nan"),
            "correct": sum(every),
            "type_accuracy": {k: sum(v) / len(v) for k, v in sorted(self.per.items())},
            "type_counts": {k: len(v) for k, v in sorted(self.per.items())},
        }


def read_gar_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Answers by id: JSONL lines ``{"id", "completion"}`` (what `evaluate_gar` writes), or the release's output
    JSON (the benchmark's list with ``model_output`` added; item ``i`` is ``gar-<i>``). A second answer for an id is
    an error."""
    out: dict[str, dict[str, Any]] = {}

    def add(key: Any, text: Any, where: str) -> None:
        if key is None or not isinstance(text, str):
            raise DataError(
                f"{where}: a GAR-Bench answer is {{'id', 'completion': str}} (or the release's 'model_output')"
            )
        if str(key) in out:
            raise DataError(f"{where}: a second answer for {str(key)!r} (the first: {out[str(key)]['where']})")
        out[str(key)] = {"completion": text, "where": where}

    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such predictions file (--predictions)")
        if path.suffix == ".json":
            try:
                items = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise DataError(f"{path}: not valid JSON ({err})") from None
            if not isinstance(items, list):
                raise DataError(f"{path}: the release's output is a JSON list of items with 'model_output'")
            for i, item in enumerate(items):
                add(f"gar-{i}", item.get("model_output") if isinstance(item, dict) else None, f"{path}: item {i}")
        else:
            for obj, where in jsonl_objects(path):
                obj = obj if isinstance(obj, dict) else {}
                add(obj.get("id"), obj.get("completion", obj.get("model_output")), where)
    if not out:
        raise DataError(f"{paths}: no answers in the file(s)")
    return out


def evaluate_gar(
    records: Sequence[GarRecord],
    out: str | Path,
    *,
    model: Any = None,
    processor: Any = None,
    tokenizer: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    max_new_tokens: int = GAR_MAX_NEW_TOKENS,
    batch_size: int = 8,
    engine: Any = "hf",
    info: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Score ``records`` from the policy (``model``, ``processor`` and the mask ``tokenizer`` that writes the
    regions) or from ``predictions`` (`read_gar_predictions`). Writes ``<out stem>.predictions.jsonl`` (id, type,
    question, the regions' codes, completion, answer, correct) and the results to ``out``; returns the results."""
    if (model is None) == (predictions is None):
        raise ValueError("evaluate_gar: give the policy (model, processor) or predictions, not both")
    if model is not None and tokenizer is None:
        raise ValueError("evaluate_gar: the policy's questions need the mask tokenizer to write the regions")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if predictions is not None:
        require_predictions(
            (r.sample_id for r in records), predictions, "questions have no answer",
            "the predictions must hold one per question of the benchmark file",
        )  # fmt: skip
    scorer = GarScorer()
    pred_path = predictions_path(out)
    t0 = time.perf_counter()
    with pred_path.open("w", encoding="utf-8") as fh:
        for start in range(0, len(records), batch_size):
            recs = records[start : start + batch_size]
            codes: list[list[tuple[int, int]]] = [[] for _ in recs]
            if model is not None:
                images, questions = [], []
                for k, r in enumerate(recs):
                    images.append(open_image(r.image_path, r.source))
                    spans, codes[k] = region_spans(r, images[-1], tokenizer)
                    questions.append(gar_question(r, spans))
                texts = greedy_texts(model, processor, images, questions, max_new_tokens=max_new_tokens, engine=engine)
            else:
                texts = [predictions[r.sample_id]["completion"] for r in recs]
            for r, c, text in zip(recs, codes, texts):
                ok = scorer.update(r.type, text, r.answer)
                row = {"id": r.sample_id, "type": r.type, "question": r.question, "codes": [list(x) for x in c]}
                fh.write(json.dumps({**row, "completion": text, "answer": r.answer, "correct": ok}) + "\n")
            if log is not None:
                log(f"{min(start + batch_size, len(records))}/{len(records)}")
    results = {
        "benchmark": "gar-bench",
        "n": len(records),
        "metrics": scorer.compute(),
        "predictions": str(pred_path),
        "seconds": round(time.perf_counter() - t0, 2),
        **(info or {}),
    }
    return write_results(out, results, (r.sample_id for r in records), predictions)
