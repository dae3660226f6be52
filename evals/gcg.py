"""GCG, grounded conversation generation (GLaMM's GranD-f benchmark), as CycleGRPO's released evaluation asks it and
GLaMM's ``eval/gcg/evaluate.py`` scores it.

**Data** (`read_gcg`). GranD-f's evaluation annotations, one pair per split in one folder: ``{split}_gcg_coco_
caption_gt.json`` (COCO captions: ``images`` ``[{"id", "file_name"?, "height"?, "width"?}]``, ``annotations``
``[{"image_id", "caption", "labels": [phrase, ...]}]``) and ``{split}_gcg_coco_mask_gt.json`` (COCO instances:
``annotations`` ``[{"image_id", "segmentation": RLE | polygons}]``, one mask per grounded phrase, in the phrases'
order). Images are ``<image id>.jpg`` (or the ``file_name`` given) under ``GranDf_HA_images/val_test``. One
`GcgRecord` per image of the caption file, in its order (the first caption of an image is its caption, as GLaMM's
scorer takes it); mask annotations of images outside the caption file are not read.

**Asking** (`predict_gcg`). The released script asks every image greedily, 512 new tokens, ``GCG_QUESTION`` ("Could
you please give me a brief description of the image? Please respond with interleaved segmentation masks for the
corresponding parts of the answer."). Its answer is read as the release writes its per-image file: the caption is the
completion with every ``<...>`` tag removed and whitespace collapsed; the phrases are the texts inside
``<|object_ref_start|>...<|object_ref_end|>``; every well-formed mask-token span, in order, is one predicted mask,
decoded on the image by the mask tokenizer. (The release patches a span that has one code; we skip malformed spans, as
`benchmarks.py` does, so a policy writing them scores lower here.)

**Scores** (`GcgScorer`), GLaMM's definitions:

- ``ap50``: COCO mask AP at IoU 0.5 (``COCOeval(..., "segm")``, ``stats[1]``), every predicted mask a detection of
  the one category with score 1.0: per image, detections in order, each matched to the unmatched ground-truth mask of
  highest IoU >= 0.5 (ties to the later one, as COCO's loop does), at most 100 per image; then all detections in image
  id order (COCO sorts the ids; equal scores keep that order), precision made monotone, read at 101 recall points and
  averaged. Ground-truth ``iscrowd`` / ``category_id`` are not read: every mask of an image counts (GranD-f's masks are
  all of category 1 and not crowds).
- ``miou``: per image, greedy one-to-one pairs of highest IoU while it is > 0, the mean of the paired IoUs (0 when no
  pair); then the mean over images. Unpaired masks on either side cost nothing, as in GLaMM.
- ``recall``: per image, pairs of (ground-truth mask, predicted mask) taken greedily by IoU while the best remaining
  pair has IoU >= 0.5 *and* its phrases' text similarity >= 0.5 (the first pair failing either stops the image, as
  GLaMM's loop ``break`` s), over all ground-truth phrases. The similarity is the cosine of mean-pooled BERT states
  (GLaMM: ``bert-base-uncased``): give a local BERT folder (``text_similarity=BertSimilarity(path)``,
  ``--text-encoder``); without one ``recall`` is null and ``recall_iou`` (the same matching, IoU alone: an upper
  bound) is what there is. A pair whose mask has no phrase at its index voids the image's matches, as GLaMM's
  ``IndexError`` there does.
- ``cider`` (CIDEr-D, the COCO toolkit's "CIDEr") against the one reference caption: `caption_metrics`. ``meteor``
  is null: it needs the COCO toolkit's Java jar (not here); ``<stem>.captions.json`` is the COCO result file for it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.records import DataError, jsonl_objects
from core.regions import MaskSpace
from core.regions.coco_masks import rle_decode, rle_encode, segmentation_to_mask
from evals.bench_files import predictions_path, require_predictions, write_results
from evals.caption_metrics import cider_d
from evals.region_benchmarks import greedy_texts, open_image

__all__ = [
    "GCG_MAX_NEW_TOKENS",
    "GCG_QUESTION",
    "BertSimilarity",
    "GcgPrediction",
    "GcgRecord",
    "GcgScorer",
    "coco_ap50",
    "evaluate_gcg",
    "glamm_miou",
    "glamm_recall",
    "predict_gcg",
    "read_gcg",
    "read_gcg_completion",
    "read_gcg_predictions",
]

GCG_QUESTION = (
    "Could you please give me a brief description of the image? Please respond with interleaved segmentation masks "
    "for the corresponding parts of the answer."
)
GCG_MAX_NEW_TOKENS = 512


@dataclass
class GcgRecord:
    """One GranD-f image: its reference caption, grounded phrases and their masks (decoded on demand)."""

    sample_id: str
    image_path: Path
    caption: str
    labels: list[str]
    segmentations: list[Any]
    size: tuple[int, int] | None  # (width, height) when the annotation gives it
    source: str
    order: Any = None  # the raw image id: COCO sorts images by it

    def masks(self, size: tuple[int, int]) -> list[np.ndarray]:
        """bool ``[h, w]`` per grounded phrase on an image of ``size`` (width, height)."""
        out = []
        for i, seg in enumerate(self.segmentations):
            try:
                out.append(segmentation_to_mask(seg, size[1], size[0]))
            except ValueError as err:
                raise DataError(f"{self.source}: mask {i} of image {self.sample_id!r}: {err}") from None
        return out


def _json(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: no such file (--annotations is the folder of GranD-f's {path.name})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None


def read_gcg(
    annotations: str | Path, image_root: str | Path, split: str = "val", *, max_samples: int | None = None
) -> list[GcgRecord]:
    """The `GcgRecord` s of ``split`` (``val`` / ``test``) from GranD-f's annotation folder (module docstring)."""
    if split not in ("val", "test"):
        raise DataError(f"--split {split!r}: GranD-f's GCG evaluation has the splits val and test")
    root, image_root = Path(annotations), Path(image_root)
    cap_path, mask_path = root / f"{split}_gcg_coco_caption_gt.json", root / f"{split}_gcg_coco_mask_gt.json"
    caps, masks = _json(cap_path), _json(mask_path)
    for path, obj in ((cap_path, caps), (mask_path, masks)):
        if not isinstance(obj, dict) or not isinstance(obj.get("annotations"), list):
            raise DataError(f"{path}: a COCO file is an object with an 'annotations' list")
    if not isinstance(caps.get("images"), list):
        raise DataError(f"{cap_path}: no 'images' list (GranD-f's caption file lists its images)")
    captions: dict[str, dict] = {}
    for i, ann in enumerate(caps["annotations"]):
        where = f"{cap_path}: annotations[{i}]"
        if not isinstance(ann, dict) or "image_id" not in ann or not isinstance(ann.get("caption"), str):
            raise DataError(f"{where}: a caption annotation is {{'image_id', 'caption': str, 'labels': [str]}}")
        labels = ann.get("labels", [])
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise DataError(f"{where}: 'labels' must be a list of phrases (strings), got {str(labels)[:80]!r}")
        captions.setdefault(str(ann["image_id"]), {**ann, "where": where})
    segs: dict[str, list[Any]] = {}
    for i, ann in enumerate(masks["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or "segmentation" not in ann:
            raise DataError(f"{mask_path}: annotations[{i}]: a mask annotation is {{'image_id', 'segmentation'}}")
        segs.setdefault(str(ann["image_id"]), []).append(ann["segmentation"])
    out = []
    for i, img in enumerate(caps["images"]):
        if not isinstance(img, dict) or "id" not in img:
            raise DataError(f"{cap_path}: images[{i}] has no 'id'")
        key = str(img["id"])
        if key not in captions:
            raise DataError(f"{cap_path}: image {key!r} (images[{i}]) has no caption annotation")
        size = (int(img["width"]), int(img["height"])) if "width" in img and "height" in img else None
        ann = captions[key]
        out.append(
            GcgRecord(
                sample_id=key,
                image_path=image_root / img.get("file_name", f"{key}.jpg"),
                caption=ann["caption"],
                labels=list(ann.get("labels", [])),
                segmentations=segs.get(key, []),
                size=size,
                source=ann["where"],
                order=img["id"],
            )
        )
        if max_samples is not None and len(out) >= max_samples:
            break
    if not out:
        raise DataError(f"{cap_path}: no images")
    return out


# --- reading an answer -----------------------------------------------------------------------------------------------

_REF = re.compile(r"<\|object_ref_start\|>(.*?)<\|object_ref_end\|>", re.S)
_TAG = re.compile(r"<.*?>")


def read_gcg_completion(text: str) -> tuple[str, list[str]]:
    """``(caption, phrases)`` of a completion as the released script writes them (module docstring)."""
    text = text.replace("<think>\n\n</think>\n\n", "").replace("<s>", "").replace("\n", "").replace("  ", " ")
    text = text.split("ASSISTANT: ")[-1]
    phrases = [p.strip() for p in _REF.findall(text)]
    caption = " ".join(_TAG.sub("", text).split()).strip("'").strip()
    return caption, phrases


@dataclass
class GcgPrediction:
    """One image's answer: the completion (None when read from a file of masks), caption, phrases, decoded codes
    and one bool ``[h, w]`` mask per span."""

    sample_id: str
    completion: str | None
    caption: str
    phrases: list[str]
    codes: list[tuple[int, int]]
    masks: list[np.ndarray] = field(default_factory=list)


def _from_completion(sample_id: str, text: str, image: Any, tokenizer: Any) -> GcgPrediction:
    caption, phrases = read_gcg_completion(text)
    bound = MaskSpace(codec=tokenizer).for_image(image)
    codes = bound.codes(text)
    return GcgPrediction(sample_id, text, caption, phrases, codes, [np.asarray(bound.decode(c), bool) for c in codes])


def predict_gcg(
    model, processor, records: Sequence[GcgRecord], images: Sequence[Any], tokenizer: Any, *, max_new_tokens: int,
    question: str = GCG_QUESTION, engine: Any = "hf",
) -> list[GcgPrediction]:  # fmt: skip
    """Greedy GCG answers of ``model`` for ``records`` (their opened ``images``), read and decoded."""
    texts = greedy_texts(
        model, processor, images, [question] * len(records), max_new_tokens=max_new_tokens, engine=engine
    )
    return [_from_completion(r.sample_id, t, im, tokenizer) for r, t, im in zip(records, texts, images)]


def read_gcg_predictions(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Predictions by image id from JSONL files (ours: ``{"id", "completion"}``, decoded by the mask tokenizer, or
    ``{"id", "caption", "phrases", "masks": [RLE]}``, scored as they are) and/or folders of the released script's
    per-image files (``<image id>.json``: ``{"image_id", "caption", "phrases", "pred_masks": [RLE]}``, optionally
    nested one level under a key, as GLaMM's scorer accepts). A second prediction for an image is an error."""
    out: dict[str, dict[str, Any]] = {}

    def add(obj: Any, key: Any, where: str) -> None:
        if not isinstance(obj, dict) or key is None or not ("completion" in obj or "masks" in obj):
            raise DataError(
                f"{where}: a GCG prediction is {{'id', 'completion'}} or {{'id', 'caption', 'phrases', 'masks'}} "
                "(the release's files: {'image_id', 'caption', 'phrases', 'pred_masks'})"
            )
        if str(key) in out:
            raise DataError(
                f"{where}: a second prediction for image {str(key)!r} (the first: {out[str(key)]['where']})"
            )
        out[str(key)] = {**obj, "where": where}

    for path in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(path)
        if path.is_dir():
            for f in sorted(path.glob("*.json")):
                try:
                    obj = json.loads(f.read_text(encoding="utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise DataError(f"{f}: not valid JSON ({err})") from None
                if isinstance(obj, dict) and "caption" not in obj and len(obj) == 1:
                    obj = next(iter(obj.values()))  # GLaMM's nested form
                if isinstance(obj, dict) and "pred_masks" in obj:
                    obj = {**obj, "masks": obj["pred_masks"]}
                add(obj, obj.get("image_id", f.stem) if isinstance(obj, dict) else None, str(f))
        elif path.is_file():
            for obj, where in jsonl_objects(path):
                add(obj, obj.get("id") if isinstance(obj, dict) else None, where)
        else:
            raise DataError(f"{path}: no such predictions file or folder (--predictions)")
    if not out:
        raise DataError(f"{paths}: no predictions in the file(s)")
    return out


def _from_file(rec: GcgRecord, line: dict[str, Any], image: Any, tokenizer: Any) -> GcgPrediction:
    if line.get("masks") is not None:
        try:
            masks = [rle_decode(m) for m in line["masks"]]
        except (ValueError, TypeError) as err:
            raise DataError(f"{line['where']}: bad mask in 'masks' ({err})") from None
        codes = [(int(c[0]), int(c[1])) for c in line.get("codes") or []]
        caption, phrases = str(line.get("caption", "")), [str(p) for p in line.get("phrases", [])]
        return GcgPrediction(rec.sample_id, line.get("completion"), caption, phrases, codes, masks)
    if tokenizer is None:
        raise DataError(f"{line['where']}: a completion without masks needs --mask-tokenizer to decode its spans")
    return _from_completion(rec.sample_id, str(line["completion"]), image, tokenizer)


# --- scores ----------------------------------------------------------------------------------------------------------


def _iou_matrix(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> np.ndarray:
    """``[len(a), len(b)]`` mask IoUs (0 for two empty masks), intersections as one product of the flattened masks
    (float32 counts are exact below 2^24 pixels, far above GranD-f's images)."""
    if not len(a) or not len(b):
        return np.zeros((len(a), len(b)))
    shapes = {np.shape(m) for m in (*a, *b)}
    if len(shapes) > 1:
        raise ValueError(f"masks of different sizes: {sorted(list(s) for s in shapes)}")
    x = np.stack([np.asarray(m, dtype=bool).reshape(-1) for m in a]).astype(np.float32)
    y = np.stack([np.asarray(m, dtype=bool).reshape(-1) for m in b]).astype(np.float32)
    inter = (x @ y.T).astype(np.float64)
    union = x.sum(1, dtype=np.float64)[:, None] + y.sum(1, dtype=np.float64)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def glamm_miou(pred: Sequence[np.ndarray], gt: Sequence[np.ndarray]) -> float:
    """One image's mIoU as GLaMM's ``compute_miou``: greedy one-to-one pairs of highest IoU while > 0, their mean."""
    ious = _iou_matrix(pred, gt)
    paired = []
    while ious.size and ious.max() > 0:
        i, j = np.unravel_index(np.argmax(ious), ious.shape)
        paired.append(ious[i, j])
        ious = np.delete(np.delete(ious, i, axis=0), j, axis=1)
    return float(np.mean(paired)) if paired else 0.0


def glamm_recall(
    gt: Sequence[np.ndarray], gt_labels: Sequence[str], pred: Sequence[np.ndarray], pred_labels: Sequence[str],
    similarity: Callable[[str, str], float] | None, iou_threshold: float = 0.5, text_threshold: float = 0.5,
) -> int:  # fmt: skip
    """One image's matched ground-truth phrases as GLaMM's ``find_best_matches`` (module docstring); ``similarity``
    None matches on IoU alone."""
    ious = _iou_matrix(gt, pred)
    sims = np.ones((len(gt_labels), len(pred_labels)))
    if similarity is not None:
        for a, b in np.ndindex(sims.shape):
            sims[a, b] = similarity(gt_labels[a], pred_labels[b])
    matched = 0
    while ious.size:
        i, j = np.unravel_index(np.argmax(ious), ious.shape)
        if i >= sims.shape[0] or j >= sims.shape[1]:
            return 0  # GLaMM: an IndexError, caught per image, drops the image's matches
        if ious[i, j] < iou_threshold or sims[i, j] < text_threshold:
            break
        matched += 1
        ious[i, :] = ious[:, j] = 0
        sims[i, :] = sims[:, j] = 0
    return matched


def coco_ap50(images: Sequence[tuple[Any, int, Sequence[bool]]]) -> float:
    """COCO's AP at IoU 0.5 from per-image ``(sort key, ground-truth count, match flag per detection in order)``,
    every detection scored 1.0 (module docstring); nan without ground truth."""
    flags = [f for _, _, fl in sorted(images, key=lambda t: t[0]) for f in fl[:100]]
    n_gt = sum(n for _, n, _ in images)
    if n_gt == 0:
        return float("nan")
    tp = np.cumsum(np.asarray(flags, dtype=bool))
    fp = np.cumsum(~np.asarray(flags, dtype=bool))
    if not len(tp):
        return 0.0
    recall = tp / n_gt
    precision = np.maximum.accumulate((tp / (tp + fp + np.spacing(1)))[::-1])[::-1]
    idx = np.searchsorted(recall, np.linspace(0.0, 1.0, 101), side="left")
    q = np.where(idx < len(precision), precision[np.minimum(idx, len(precision) - 1)], 0.0)
    return float(q.mean())


def _ap_flags(gt: Sequence[np.ndarray], pred: Sequence[np.ndarray], threshold: float = 0.5) -> list[bool]:
    """Whether each detection (in order, at most 100) matches a ground-truth mask, as COCO's ``evaluateImg``."""
    ious = _iou_matrix(pred[:100], gt)
    taken = np.zeros(len(gt), dtype=bool)
    flags = []
    for d in range(ious.shape[0]):
        best, m = min(threshold, 1 - 1e-10), -1
        for g in range(len(gt)):
            if taken[g] or ious[d, g] < best:
                continue
            best, m = ious[d, g], g
        if m >= 0:
            taken[m] = True
        flags.append(m >= 0)
    return flags


class BertSimilarity:
    """GLaMM's phrase similarity: cosine of the mean last hidden state (special tokens included, 512 tokens at most)
    of a BERT model loaded from a local folder (``bert-base-uncased`` for GLaMM's figures)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"--text-encoder {str(path)!r}: not a folder (a local BERT, e.g. bert-base-uncased)"
            )
        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.cache: dict[str, np.ndarray] = {}

    def embed(self, text: str) -> np.ndarray:
        import torch

        if text not in self.cache:
            inputs = self.tokenizer(text, return_tensors="pt", max_length=512, truncation=True)
            with torch.no_grad():
                self.cache[text] = self.model(**inputs).last_hidden_state[0].mean(0).double().numpy()
        return self.cache[text]

    def __call__(self, a: str, b: str) -> float:
        x, y = self.embed(a), self.embed(b)
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-12))


class GcgScorer:
    """GCG's scores, one image at a time (module docstring): ``update(...)`` returns the image's own numbers,
    ``compute()`` the benchmark's."""

    def __init__(self, similarity: Callable[[str, str], float] | None = None) -> None:
        self.similarity = similarity
        self.ap: list[tuple[Any, int, list[bool]]] = []
        self.mious: list[float] = []
        self.matched = self.matched_iou = self.positives = self.n_pred = 0
        self.captions: dict[str, str] = {}
        self.references: dict[str, list[str]] = {}

    def update(
        self, rec: GcgRecord, gt: Sequence[np.ndarray], pred: GcgPrediction, shape: tuple[int, int]
    ) -> dict[str, Any]:
        """Score one image (``shape``: its ``(h, w)``); returns its mIoU and match counts."""
        for i, m in enumerate(pred.masks):
            if m.shape != tuple(shape):
                raise ValueError(f"predicted mask {i} is {list(m.shape)}, the image {list(shape)}")
        flags = _ap_flags(gt, pred.masks)
        self.ap.append((rec.order if rec.order is not None else rec.sample_id, len(gt), flags))
        miou = glamm_miou(pred.masks, gt)
        self.mious.append(miou)
        self.positives += len(rec.labels)
        matched_iou = glamm_recall(gt, rec.labels, pred.masks, pred.phrases, None)
        self.matched_iou += matched_iou
        row = {"miou": miou, "ap_matches": sum(flags), "recall_iou_matches": matched_iou}
        if self.similarity is not None:
            row["recall_matches"] = glamm_recall(gt, rec.labels, pred.masks, pred.phrases, self.similarity)
            self.matched += row["recall_matches"]
        self.n_pred += len(pred.masks)
        self.captions[rec.sample_id] = pred.caption
        self.references[rec.sample_id] = [rec.caption]
        return row

    def compute(self) -> dict[str, Any]:
        cider, _ = cider_d(self.captions, self.references)
        positives = self.positives or float("nan")
        return {
            "ap50": coco_ap50(self.ap),
            "miou": float(np.mean(self.mious)) if self.mious else float("nan"),
            "recall": self.matched / positives if self.similarity is not None else None,
            "recall_iou": self.matched_iou / positives,
            "cider": cider,
            "meteor": None,
            "n_gt_masks": sum(n for _, n, _ in self.ap),
            "n_pred_masks": self.n_pred,
        }


# --- the benchmark ---------------------------------------------------------------------------------------------------


def evaluate_gcg(
    records: Sequence[GcgRecord],
    out: str | Path,
    *,
    model: Any = None,
    processor: Any = None,
    tokenizer: Any = None,
    predictions: dict[str, dict[str, Any]] | None = None,
    similarity: Callable[[str, str], float] | None = None,
    question: str = GCG_QUESTION,
    max_new_tokens: int = GCG_MAX_NEW_TOKENS,
    batch_size: int = 8,
    engine: Any = "hf",
    info: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Score ``records`` from the policy (``model``, ``processor``, mask ``tokenizer``) or ``predictions``
    (`read_gcg_predictions`). Writes ``<out stem>.predictions.jsonl`` (per image: id, completion, caption, phrases,
    codes, masks as COCO RLE, its mIoU and match counts), ``<out stem>.captions.json`` (COCO caption results, for
    METEOR elsewhere) and the results to ``out``; returns the results."""
    if (model is None) == (predictions is None):
        raise ValueError("evaluate_gcg: give the policy (model, processor) or predictions, not both")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if predictions is not None:
        require_predictions(
            (r.sample_id for r in records), predictions, "images have no prediction",
            "the predictions must hold one per image of this split",
        )  # fmt: skip
    scorer = GcgScorer(similarity)
    pred_path = predictions_path(out)
    cap_path = pred_path.with_name(Path(out).stem + ".captions.json")
    coco_captions = []
    t0 = time.perf_counter()
    with pred_path.open("w", encoding="utf-8") as fh:
        for start in range(0, len(records), batch_size):
            recs = records[start : start + batch_size]
            images = [open_image(r.image_path, r.source, r.size) for r in recs]
            if model is not None:
                preds = predict_gcg(
                    model, processor, recs, images, tokenizer, max_new_tokens=max_new_tokens, question=question,
                    engine=engine,
                )  # fmt: skip
            else:
                preds = [_from_file(r, predictions[r.sample_id], im, tokenizer) for r, im in zip(recs, images)]
            for r, im, p in zip(recs, images, preds):
                try:
                    row = scorer.update(r, r.masks(im.size), p, (im.size[1], im.size[0]))
                except ValueError as err:
                    raise DataError(f"{r.source}: image {r.sample_id!r}: {err}") from None
                line = {"id": r.sample_id, "completion": p.completion, "caption": p.caption, "phrases": p.phrases}
                line.update(codes=[list(c) for c in p.codes], masks=[rle_encode(m) for m in p.masks], **row)
                fh.write(json.dumps(line) + "\n")
                coco_captions.append({"image_id": r.order, "caption": p.caption, "labels": p.phrases})
            if log is not None:
                log(f"{min(start + batch_size, len(records))}/{len(records)}")
    cap_path.write_text(json.dumps(coco_captions) + "\n", encoding="utf-8")
    results = {
        "benchmark": "gcg",
        "n": len(records),
        "metrics": scorer.compute(),
        "predictions": str(pred_path),
        "captions": str(cap_path),
        "seconds": round(time.perf_counter() - t0, 2),
        "question": question,
        "text_encoder": getattr(similarity, "path", None) if similarity is not None else None,
        **(info or {}),
    }
    return write_results(out, results, (r.sample_id for r in records), predictions)
