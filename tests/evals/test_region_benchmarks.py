"""GCG's and GAR-Bench's scores by hand (evals/{gcg,gar_bench,caption_metrics}.py): the PTB-like
tokenizer, CIDEr-D, COCO AP50 (also against pycocotools' COCOeval), GLaMM's mIoU and recall with their quirks, and
the GAR-Bench question and exact match."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from core.regions.coco_masks import rle_encode
from evals.caption_metrics import cider_d, ptb_tokenize
from evals.gar_bench import GarRecord, GarScorer, clean_answer, gar_question
from evals.gcg import (
    _ap_flags,
    coco_ap50,
    glamm_miou,
    glamm_recall,
    read_gcg_completion,
)


def cols(a: int, b: int, h: int = 4, w: int = 10) -> np.ndarray:
    """Full-height columns ``a:b`` of an ``h x w`` image: IoUs are ratios of column counts."""
    m = np.zeros((h, w), dtype=bool)
    m[:, a:b] = True
    return m


def test_ptb_tokenize_drops_punctuation_and_splits_clitics():
    assert ptb_tokenize("A man's T-shirt, (red).") == ["a", "man", "'s", "t-shirt", "red"]
    assert ptb_tokenize('He doesn\'t see "3.5" cats; e.g. two...') == [
        "he", "does", "n't", "see", "3.5", "cats", "e.g", "two",
    ]  # fmt: skip


def test_cider_d_by_hand():
    # two images, one reference each. df: "a" 2, every other n-gram 1; idf = log 2 - log df: "a" 0, the rest log 2.
    # image 1 (candidate = reference "a cat"): unigram and bigram cosines 1, no 3- or 4-grams, equal bigram lengths:
    #   (1 + 1 + 0 + 0) / 4 * 10 = 5. image 2 ("a bird" vs "a dog"): only "a" is shared and its weight is 0: 0.
    corpus, per = cider_d({"1": "A cat.", "2": "a bird"}, {"1": ["a cat"], "2": ["a dog"]})
    assert per == {"1": pytest.approx(5.0), "2": 0.0} and corpus == pytest.approx(2.5)
    # "a cat cat" vs "a cat": unigram cosine (2 log2 * log2 clipped to log2 * log2) / (2 log2 * log2) = 1/2, bigram
    # cosine log2^2 / (sqrt2 log2 * log2) = 1/sqrt2, no trigram in the reference: 0; lengths 2 vs 1 bigrams: the
    # penalty exp(-1 / (2 * 6^2))
    _, per = cider_d({"1": "a cat cat", "2": "a dog"}, {"1": ["a cat"], "2": ["a dog"]})
    assert per["1"] == pytest.approx((0.5 + 2**-0.5) / 4 * np.exp(-1 / 72) * 10) and per["2"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="have no reference"):
        cider_d({"1": "x"}, {})


def test_coco_ap50_by_hand_and_against_pycocotools():
    # image "a": two targets; its detections hit the first (IoU 1) then miss (IoU 0). image "b": one target, hit at
    # IoU 0.6. COCO orders images by id, so the detections read T F T: recall 1/3 1/3 2/3, precision 1 .5 .67 ->
    # monotone 1 .67 .67. Recall points 0..0.33 (34) read 1, 0.34..0.66 (33) read 2/3, the rest 0: AP = 56 / 101.
    gt = {"a": [cols(0, 2), cols(5, 7)], "b": [cols(0, 5)]}
    pred = {"a": [cols(0, 2), cols(8, 10)], "b": [cols(0, 3)]}
    images = [(k, len(gt[k]), _ap_flags(gt[k], pred[k])) for k in ("b", "a")]  # given out of order
    assert dict((k, f) for k, _, f in images) == {"a": [True, False], "b": [True]}
    assert coco_ap50(images) == pytest.approx(56 / 101)
    assert coco_ap50([("a", 2, []), ("b", 1, [])]) == 0.0 and np.isnan(coco_ap50([("a", 0, [True])]))

    coco_mod = pytest.importorskip("pycocotools.coco")
    cocoeval = pytest.importorskip("pycocotools.cocoeval")
    anns, dts = [], []
    for k in ("a", "b"):
        for m in gt[k]:
            anns.append({"id": len(anns) + 1, "image_id": k, "category_id": 1, "segmentation": rle_encode(m),
                         "area": int(m.sum()), "bbox": [0, 0, 1, 1], "iscrowd": 0})  # fmt: skip
        dts += [{"image_id": k, "category_id": 1, "segmentation": rle_encode(m), "score": 1.0} for m in pred[k]]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = coco_mod.COCO()
        coco.dataset = {
            "images": [{"id": k, "height": 4, "width": 10} for k in "ab"],
            "annotations": anns,
            "categories": [{"id": 1}],
        }
        coco.createIndex()
        ev = cocoeval.COCOeval(coco, coco.loadRes(dts), "segm")
        ev.params.catIds = [1]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert coco_ap50(images) == pytest.approx(ev.stats[1])


def test_ap_matching_takes_the_best_free_target():
    # one detection overlapping two targets takes the higher IoU (0.8 > 0.6); a second identical one takes the other
    gt = [cols(0, 5), cols(1, 6)]
    flags = _ap_flags(gt, [cols(1, 5), cols(1, 5), cols(1, 5)])
    assert flags == [True, True, False]


def test_glamm_miou_pairs_greedily_and_ignores_the_unpaired():
    # IoUs: p2-g1 0.75 (paired first), p1-g1 0.5 (g1 taken), p1-g2 0 (not > 0): mean of [0.75] = 0.75
    gt = [cols(0, 4), cols(6, 10)]
    assert glamm_miou([cols(0, 2), cols(1, 4)], gt) == pytest.approx(0.75)
    assert glamm_miou([], gt) == 0.0 and glamm_miou([cols(0, 4), cols(6, 10)], gt) == 1.0


def test_glamm_recall_needs_iou_and_phrase_and_stops_at_the_first_failure():
    same = lambda a, b: float(a == b)  # noqa: E731
    gt, labels = [cols(0, 4), cols(6, 10)], ["a man", "a horse"]
    assert glamm_recall(gt, labels, [cols(0, 4), cols(6, 9)], ["a man", "a horse"], same) == 2
    # the best-IoU pair (g1, p1: IoU 1) has the wrong phrase: GLaMM's loop breaks, though (g2, p2) would match
    assert glamm_recall(gt, labels, [cols(0, 4), cols(6, 9)], ["a dog", "a horse"], same) == 0
    assert glamm_recall(gt, labels, [cols(0, 4), cols(6, 9)], ["a dog", "a horse"], None) == 2  # IoU alone
    assert glamm_recall(gt, labels, [cols(0, 1), cols(6, 10)], ["a man", "a horse"], same) == 1  # IoU 0.25 < 0.5
    # a best pair whose mask has no phrase at its index voids the image (GLaMM's IndexError, caught per image)
    assert glamm_recall(gt, labels, [cols(6, 9), cols(0, 4)], ["a horse"], same) == 0


def test_gcg_completion_reads_as_the_release_writes_it():
    text = (
        "<think>\n\n</think>\n\n<|object_ref_start|>A man<|object_ref_end|><|mt_start|><|mt_0001|><|mt_0300|>"
        "<|mt_end|> rides\n <|object_ref_start|> a horse <|object_ref_end|><|mt_start|><|mt_0002|><|mt_0301|>"
        "<|mt_end|>.<|im_end|>"
    )
    assert read_gcg_completion(text) == ("A man rides a horse .", ["A man", "a horse"])


def _gar(question: str, choices: list[str], answer: str = "A") -> GarRecord:
    return GarRecord("gar-0", None, question, choices, answer, "color", [], "x: item 0")


def test_gar_question_and_exact_match():
    rec = _gar("Is <Prompt0> left of <Prompt1>? Not <Prompt2>.", ["(A) yes", "(B) no"])
    assert gar_question(rec, ["<R0>", "<R1>"]) == (
        "Question: Is <R0> left of <R1>? Not <Prompt2>.\nOptions:\n(A) yes\n(B) no\n"
        "Answer with the correct option's letter directly."
    )
    assert clean_answer("<think>\n\n</think>\n\nB.<|im_end|>") == "b" and clean_answer(" a ") == "a"
    s = GarScorer()
    assert [s.update("color", "A.", "A"), s.update("color", "A. red", "A"), s.update("shape", "b", "B")] == [
        True, False, True,
    ]  # fmt: skip
    got = s.compute()
    assert got["accuracy"] == pytest.approx(2 / 3) and got["correct"] == 2
    assert got["type_accuracy"] == {"color": 0.5, "shape": 1.0} and got["type_counts"] == {"color": 2, "shape": 1}
