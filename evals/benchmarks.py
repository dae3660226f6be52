"""Referring-segmentation benchmarks of CycleGRPO: GRES (gRefCOCO) and GroundingSuite, answered as mask tokens.

`predict_masks` runs the policy greedily over `Sample` s through the project's one greedy path
(`evaluator.greedy_answers`) and reads each completion as the released evaluation does: every well-formed mask-token
span of the **whole** completion is decoded on the sample's image by the mask tokenizer and the union is the predicted
mask; a completion with no span, or whose spans decode to nothing, predicts the empty mask (a rejection). The
released scripts (``evaluation/gres/qwen3vl_gres_eval.py``, ``evaluation/groundingsuite/qwen3vl_groundingsuite_infer
.py``) do the same, except that they patch a span with one code (the second code set to the codebook's padding row)
where we skip malformed spans (``core.regions.mask_tokens.parse_masks``); each prediction keeps how it was read
(``answer``: ``region``; ``empty``: spans that decode to nothing; ``no_target``: an explicit "no target";
``unreadable`` otherwise) so the rate of unreadable answers is visible.

Scores, as the released scorers define them:

- **GRES** (`GresScorer`): ``giou`` = mean per-expression IoU, a no-target expression scoring 1 for an empty
  prediction and 0 otherwise; ``ciou`` = cumulative intersection / cumulative union over all expressions (a false
  alarm adds its mask to the union); ``n_acc`` = TP / (TP + FN) over no-target expressions (TP: the prediction is
  empty); ``t_acc`` = TN / (TN + FP) over expressions with a target (TN: the prediction is not empty). These are
  `cycle_metrics.RegionGroundingMetrics` on pixel masks with an empty prediction as ``NO_TARGET``: one definition
  for training-time validation and the benchmark.
- **GroundingSuite** (`GroundingSuiteScorer`): ``giou`` = mean mask IoU (``inter / union``, 0 when both are empty)
  overall and per ``class_id`` (``class_giou``, ``class_counts``).

Results are fractions in [0, 1] (the released scripts print percentages).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.records import DataError, jsonl_objects
from core.regions import NO_TARGET, MaskSpace
from core.regions.coco_masks import rle_decode, rle_encode
from datamodules.gres import load_seg_sample
from evals.bench_files import predictions_path, require_predictions, write_results
from lightning_modules.evaluation.cycle_metrics import RegionGroundingMetrics
from lightning_modules.evaluation.evaluator import greedy_answers
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer
from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer

__all__ = [
    "SCORERS",
    "GresScorer",
    "GroundingSuiteScorer",
    "MaskPrediction",
    "evaluate_benchmark",
    "load_mask_tokenizer",
    "predict_masks",
    "read_predictions",
    "read_completion",
]


@dataclass
class MaskPrediction:
    """One expression's prediction: the completion (None when scored from a mask alone), how it read, the decoded
    code pairs and the predicted pixel mask (bool ``[H, W]`` of the image; all False for a rejection)."""

    sample_id: str
    completion: str | None
    answer: str
    codes: list[tuple[int, int]]
    mask: np.ndarray


class _ScoringOnly:
    """A stand-in codec: `RegionGroundingMetrics` needs a token-mode `MaskSpace` to compare pixel masks of any size;
    scoring never encodes or decodes."""

    def encode(self, image, mask, box=None):  # pragma: no cover - never called
        raise RuntimeError("benchmarks: the scoring space does not encode")

    def decode(self, codes, image):  # pragma: no cover - never called
        raise RuntimeError("benchmarks: the scoring space does not decode")


def load_mask_tokenizer(path: str | Path, sam2: str | Path | None = None, device: str | None = None):
    """The mask tokenizer that decodes the policy's spans: a toy tokenizer folder (``config.json`` +
    ``model.safetensors``), or, with ``sam2`` (Meta's ``.pt`` or a transformers SAM 2 folder), the release's
    VQ-SAM2 state file (``mask_tokenizer_256x2.pth``), on ``device`` (the commands' ``--device``; default cuda when
    available, as the policy; the toy tokenizer runs on the CPU)."""
    path = Path(path)
    if sam2 is not None:
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return VQSam2MaskTokenizer.from_files(sam2, path, device=device)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--mask-tokenizer {str(path)!r}: no toy mask tokenizer there (config.json + model.safetensors; build one "
            "with `python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer`), and no --sam2 given for a "
            "released VQ-SAM2 state file"
        )

    return ToyMaskTokenizer.load(path)


def read_completion(text: str, image: Any, space: MaskSpace) -> tuple[str, list[tuple[int, int]], np.ndarray]:
    """``(answer, codes, mask)`` of one completion on its image (module docstring); ``space`` is a token-mode
    `MaskSpace` (``MaskSpace(codec=tokenizer)``)."""
    bound = space.for_image(image)
    h, w = bound.image.shape[:2]
    empty = np.zeros((h, w), dtype=bool)
    codes = bound.codes(text)
    region = bound.parse(text)
    if codes:
        mask = empty if region is None or region is NO_TARGET else np.asarray(region, dtype=bool)
        return ("region" if mask.any() else "empty"), codes, mask
    return ("no_target" if region is NO_TARGET else "unreadable"), [], empty


def predict_masks(
    model,
    processor,
    samples: Sequence[Any],
    tokenizer: Any,
    *,
    template: str,
    max_new_tokens: int,
    batch_size: int = 8,
    engine: str = "hf",
    progress: Any = None,
) -> list[MaskPrediction]:
    """Greedy mask predictions of ``model`` for ``samples`` (`Sample` s: image, query), ``batch_size`` at a time,
    prompted with ``template`` (``core.prompts.PROMPT_TEMPLATES``); ``progress(done, total)``
    is called after each batch."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    space = MaskSpace(codec=tokenizer)
    out: list[MaskPrediction] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        answers, _ = greedy_answers(
            model, processor, batch, template=template, max_new_tokens=max_new_tokens, engine=engine
        )
        for s, a in zip(batch, answers):
            answer, codes, mask = read_completion(a.text, s.image, space)
            out.append(MaskPrediction(s.sample_id, a.text, answer, codes, mask))
        if progress is not None:
            progress(len(out), len(samples))
    return out


class GresScorer:
    """GRES's scores, one expression at a time (module docstring): ``update(gt, pred) -> IoU`` with bool pixel masks
    (an all-False ground truth is a no-target expression, an all-False prediction a rejection), ``compute()`` ->
    ``giou``, ``ciou``, ``n_acc``, ``t_acc`` (nan when nothing was counted)."""

    def __init__(self) -> None:
        self.space = MaskSpace(codec=_ScoringOnly())
        self.metric = RegionGroundingMetrics(self.space)

    def update(self, gt: np.ndarray, pred: np.ndarray, **_: Any) -> float:
        gt, pred = np.asarray(gt, dtype=bool), np.asarray(pred, dtype=bool)
        if gt.shape != pred.shape:
            raise ValueError(f"predicted mask {list(pred.shape)} vs ground truth {list(gt.shape)}")
        g, p = self.space.normalize(gt), self.space.normalize(pred)  # empty -> NO_TARGET
        self.metric.update([g], [p])
        return self.space.consistency(g, p)

    def compute(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.metric.compute().items()}


class GroundingSuiteScorer:
    """GroundingSuite's mask mode: ``update(gt, pred, class_id=...) -> IoU`` (``inter / union``, 0 when both are
    empty); ``compute()`` -> ``giou`` (mean IoU), ``class_giou`` and ``class_counts`` per ``class_id``."""

    def __init__(self) -> None:
        self.per: dict[str, list[float]] = defaultdict(list)

    def update(self, gt: np.ndarray, pred: np.ndarray, class_id: Any = None, **_: Any) -> float:
        gt, pred = np.asarray(gt, dtype=bool), np.asarray(pred, dtype=bool)
        if gt.shape != pred.shape:
            raise ValueError(f"predicted mask {list(pred.shape)} vs ground truth {list(gt.shape)}")
        union = np.count_nonzero(gt | pred)
        iou = float(np.count_nonzero(gt & pred) / union) if union else 0.0
        self.per[str(class_id)].append(iou)
        return iou

    def compute(self) -> dict[str, Any]:
        keys = sorted(self.per, key=lambda k: (0, int(k), k) if k.lstrip("-").isdigit() else (1, 0, k))
        every = [v for k in keys for v in self.per[k]]
        return {
            "giou": float(np.mean(every)) if every else float("nan"),
            "class_giou": {k: float(np.mean(self.per[k])) for k in keys},
            "class_counts": {k: len(self.per[k]) for k in keys},
        }


SCORERS = {"gres": GresScorer, "groundingsuite": GroundingSuiteScorer}


def read_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Predictions JSONL file(s) (e.g. one per shard) by sample id. A line is ``{"id", "mask": RLE}`` (scored as it
    is), ``{"id", "completion"}`` (decoded by the mask tokenizer on the image), or the released GroundingSuite
    script's ``{"idx", "predicted_segmentation": RLE}`` (id ``gsuite-<idx>``); `evaluate_benchmark` writes the first
    two together. A second line for one id, in any file, is an error."""
    out: dict[str, dict[str, Any]] = {}
    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such predictions file (--predictions)")
        for obj, where in jsonl_objects(path):
            if "id" not in obj and "idx" in obj:
                obj = {"id": f"gsuite-{obj['idx']}", "mask": obj.get("predicted_segmentation"), **obj}
            if "id" not in obj or not ("mask" in obj or "completion" in obj):
                raise DataError(f"{where}: a prediction is {{'id', 'mask': RLE}} or {{'id', 'completion': text}}")
            key = str(obj["id"])
            if key in out:
                raise DataError(f"{where}: a second prediction for {key!r} (the first: {out[key]['where']})")
            out[key] = {**obj, "where": where}
    if not out:
        raise DataError(f"{paths}: no predictions in the file(s)")
    return out


def _from_file(rec: Any, line: dict[str, Any], space: MaskSpace | None) -> MaskPrediction:
    """One line of a predictions file as a prediction: its RLE ``mask`` as it is, else its ``completion`` decoded
    on the record's image (``space``: the token-mode space of the mask tokenizer)."""
    if line.get("mask") is not None:
        try:
            mask = rle_decode(line["mask"])
        except ValueError as err:
            raise DataError(f"{line['where']}: bad 'mask' ({err})") from None
        codes = [(int(c[0]), int(c[1])) for c in line.get("codes") or []]
        return MaskPrediction(rec.sample_id, line.get("completion"), line.get("answer", "mask"), codes, mask)
    if space is None:
        raise DataError(f"{line['where']}: a completion without a mask needs --mask-tokenizer to decode its spans")
    answer, codes, mask = read_completion(str(line["completion"]), load_seg_sample(rec).image, space)
    return MaskPrediction(rec.sample_id, line["completion"], answer, codes, mask)


def evaluate_benchmark(
    benchmark: str,
    records: Sequence[Any],
    out: str | Path,
    *,
    model: Any = None,
    processor: Any = None,
    tokenizer: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    template: str = "gres",
    max_new_tokens: int = 128,
    batch_size: int = 8,
    engine: str = "hf",
    info: dict[str, Any] | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Score ``records`` (``datamodules.gres.SegRecord``) of ``benchmark`` (``gres`` / ``groundingsuite``): from
    the policy ``model`` greedily, or from ``predictions`` (`read_predictions`; a completion without a mask needs
    ``tokenizer``). Writes every sample's prediction to ``<out stem>.predictions.jsonl`` (id, query, completion,
    answer, codes, mask as COCO RLE, IoU) and the results to ``out`` (JSON: metrics, answer counts, ``info``);
    returns the results. One batch of images and masks is in memory at a time."""
    import json
    import time

    if benchmark not in SCORERS:
        raise ValueError(f"unknown benchmark {benchmark!r}; choose one of {tuple(SCORERS)}")
    if (model is None) == (predictions is None):
        raise ValueError("evaluate_benchmark: give the policy (model, processor) or predictions, not both")
    if predictions is not None:
        require_predictions(
            (r.sample_id for r in records), predictions, "samples have no prediction",
            "the predictions file must hold one line per sample id of this benchmark and split",
        )  # fmt: skip
    space = MaskSpace(codec=tokenizer) if tokenizer is not None else None
    scorer = SCORERS[benchmark]()
    answers: dict[str, int] = defaultdict(int)
    pred_path = predictions_path(out)
    t0 = time.perf_counter()
    with pred_path.open("w", encoding="utf-8") as fh:
        for start in range(0, len(records), batch_size):
            recs = records[start : start + batch_size]
            if model is not None:
                samples = [load_seg_sample(r) for r in recs]
                preds = predict_masks(
                    model,
                    processor,
                    samples,
                    tokenizer,
                    template=template,
                    max_new_tokens=max_new_tokens,
                    batch_size=len(samples),
                    engine=engine,
                )
            else:
                preds = [_from_file(r, predictions[r.sample_id], space) for r in recs]
            for r, p in zip(recs, preds):
                try:
                    iou = scorer.update(r.mask(), p.mask, class_id=r.meta.get("class_id"))
                except ValueError as err:
                    raise DataError(f"{r.source}: {err}") from None
                answers[p.answer] += 1
                row = {
                    "id": r.sample_id,
                    "query": r.query,
                    "no_target": r.no_target,
                    "completion": p.completion,
                    "answer": p.answer,
                    "codes": [list(c) for c in p.codes],
                    "mask": rle_encode(p.mask),
                    "iou": iou,
                }
                if "class_id" in r.meta:
                    row["class_id"] = r.meta["class_id"]
                fh.write(json.dumps(row) + "\n")
            if log is not None:
                log(f"{min(start + batch_size, len(records))}/{len(records)}")
    results = {
        "benchmark": benchmark,
        "n": len(records),
        "metrics": scorer.compute(),
        "answers": dict(sorted(answers.items())),
        "predictions": str(pred_path),
        "seconds": round(time.perf_counter() - t0, 2),
        **(info or {}),
    }
    return write_results(out, results, (r.sample_id for r in records), predictions)
