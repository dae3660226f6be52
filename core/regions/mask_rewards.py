"""CycleGRPO's rewards as the released repository scores them (``projects/rl/reward_function/text2mask.py``), as plain
functions. Pure Python / numpy; a mask tokenizer enters only as a ``decode`` callable.

**Consistency of mask-token answers** (``mask_token_consistency``). Each mask is two codes of two residual codebooks
(``core/regions/mask_tokens.py``); a predicted mask against a ground-truth one scores

    1.0  both codes equal          0.4  only the first (coarse) code equal          0  otherwise

(the repository's grading also has a 0.8 branch, "all but the end token equal", which its span regex makes
unreachable). Several masks: ``sum over the distinct predicted masks of each one's best score / max(#pred, #gt)``,
where the counts include repeats, so writing a right mask twice for one target halves the score rather than doubling
it; no mask on either side: 1.0; masks on one side only: 0. Paper 004 allows the decoded-mask IoU instead
(``decoded_mask_iou``: each code pair decoded by any tokenizer, a one-to-one maximum-IoU matching, ``sum of matched
IoUs / max(#pred, #gt)``, as the repository's ``mask_accuracy_reward``).

**No target** (``no_target_reward``, the repository's ``no_target_check``): 1.0 for an answer with no region that
says "No target.", 0.2 for an answer with no region that does not, 0 for an answer with a region. The repository
matches ``"No target."`` case-sensitively; here the phrase is matched case-insensitively and the period is optional,
because the project's canonical no-target text is ``no target`` (``regions.NO_TARGET_TEXT``).

**The released composition** (``released_caption_reward``, ``released_grounding_reward``,
``released_no_target_reward``; ``--model.method.init_args.reward_composition released``) next to the seed's default
``alpha * s + Phi`` (``regions.checks.cycle_rewards``); docs/cycle_grpo.md has the two side by side:

    r_cap_i  = (no_repeat_3gram(C_i) + 10 * mean_k s_ik) * clean(C_i) + clean(C_i)
    r_loc_ik = 10 * s_ik * mean_k' s_ik' + no_mask_repeat(answer_ik) + has_region(answer_ik)
    r_nt_k   = no_target_reward(answer_k) + no_mask_repeat(answer_k)

``clean``: 1 unless the caption writes a ``[a, b, c, d]`` box of integers or a CJK character; ``no_repeat_3gram``: 1
unless some word 3-gram occurs more than twice; ``no_mask_repeat``: 1 unless a mask-token span occurs more than 3
times; ``has_region``: the answer holds a readable region (the repository: at least one well-formed mask span). Note
``r_loc``'s product: the repository multiplies a grounding's own consistency by its caption's mean consistency (the
segmentation rows carry the caption's mean as ``iou_scores``), so a grounding of a caption that seldom grounds back
earns less for the same answer.

**The repository's live code, as it runs** (``repository_*``; ``reward_composition: repository``). The same formulas,
read the way the repository's code reads text rather than through the project's parse:

- token consistency (``repository_token_consistency``, its ``verl/workers/fsdp_workers.py`` ~1430-1470) compares
  *span strings*: every ``<|mt_start|><|mt_DDDD|><|mt_DDDD|><|mt_end|>`` (no whitespace, any four digits, so a span
  whose codes lie in the wrong codebook's range is counted in ``max(#pred, #gt)`` and matched as text) of the whole
  response against those of the ground-truth text; nothing is decoded, so the ground truth's own codes score 1.0 even
  where they decode to an empty mask (the project's ``mask_token_consistency`` reads codes with ``parse_masks``,
  which drops out-of-range spans, and the method scores an answer whose spans decode to nothing as a rejection);
- a no-target row (``repository_no_target_reward``: ``text2mask.py`` ~1131-1144 calls ``no_target_check_bbox``,
  ~206) earns 0 for an integer ``[a, b, c, d]`` box, 1.0 when the response contains ``"No target."`` exactly (case
  and period), else 0.2, plus ``non_repeat_reward`` (~897): a mask-span answer scores 0.2 + 1 = 1.2 (the project's
  ``released``: 0 + 1) and a lower-case ``no target`` 1.2 (``released``: 1 + 1);
- ``has_region`` (``mask_token_format_reward``, ~572) and ``no_mask_repeat`` count the same regex's spans.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from core.regions.anchors import max_weight_matching
from core.regions.checks import mask_token_repetition

__all__ = [
    "FIRST_CODE_CREDIT",
    "MASK_CONSISTENCIES",
    "NO_TARGET_PARTIAL",
    "RELEASED_IOU_WEIGHT",
    "decoded_mask_iou",
    "mask_consistency",
    "mask_iou",
    "mask_token_consistency",
    "mask_token_match",
    "no_target_reward",
    "released_caption_reward",
    "released_clean",
    "released_grounding_reward",
    "released_no_repeat_3gram",
    "released_no_target_reward",
    "repository_grounding_reward",
    "repository_has_region",
    "repository_no_mask_repeat",
    "repository_no_target_check",
    "repository_no_target_reward",
    "repository_span_match",
    "repository_spans",
    "repository_token_consistency",
]

FIRST_CODE_CREDIT = 0.4
"""The score of a predicted mask whose first (coarse) code matches and whose second does not."""
RELEASED_IOU_WEIGHT = 10.0
"""The weight of the consistency in the released repository's caption and grounding rewards."""
NO_TARGET_PARTIAL = 0.2
"""The repository's reward for an answer that gives no region without saying "No target."."""

_NO_TARGET_PHRASE = re.compile(r"\bno target\b", re.IGNORECASE)
_INT_BOX = re.compile(r"\[\d+,\s*\d+,\s*\d+,\s*\d+\]")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_MAX_CHARS = 20_000

Codes = tuple[int, int]


def mask_token_match(pred: Codes, gt: Codes) -> float:
    """One predicted mask against one ground-truth mask, by codes: 1.0 both equal, 0.4 the first only, else 0."""
    if tuple(pred) == tuple(gt):
        return 1.0
    return FIRST_CODE_CREDIT if pred[0] == gt[0] else 0.0


def mask_token_consistency(pred: Sequence[Codes], gt: Sequence[Codes]) -> float:
    """The repository's mask-token accuracy of an answer's masks ``pred`` against the target's ``gt`` (raw codes,
    ``parse_masks``' output): ``sum over distinct pred of max_g match / max(len(pred), len(gt))``; both empty: 1.0.

    ``[(17, 44)]`` vs ``[(17, 44)]``: 1.0; vs ``[(17, 9)]``: 0.4; ``[(17, 44), (17, 44)]`` vs ``[(17, 44)]``: 1 / 2.
    """
    pred, gt = [tuple(p) for p in pred], [tuple(g) for g in gt]
    if not pred and not gt:
        return 1.0
    if not pred or not gt:
        return 0.0
    total = sum(max(mask_token_match(p, g) for g in gt) for p in dict.fromkeys(pred))
    return total / max(len(pred), len(gt))


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two bool masks of one shape (0 when both are empty)."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"mask IoU needs masks of one shape, got {a.shape} and {b.shape}")
    union = int(np.logical_or(a, b).sum())
    return int(np.logical_and(a, b).sum()) / union if union else 0.0


def decoded_mask_iou(
    pred: Sequence[Codes], gt_masks: Sequence[np.ndarray], decode: Callable[[Codes], np.ndarray]
) -> float:
    """The decoded-mask consistency: each predicted code pair decoded (``decode(codes) -> bool [H, W]``, any
    tokenizer), matched one-to-one to the ground-truth masks by maximum total IoU; ``sum of matched IoUs /
    max(#pred, #gt)``. Both empty: 1.0; one side empty: 0."""
    if not pred and not gt_masks:
        return 1.0
    if not pred or not gt_masks:
        return 0.0
    decoded = [np.asarray(decode(tuple(p)), dtype=bool) for p in pred]
    ious = [[mask_iou(g, d) for d in decoded] for g in gt_masks]  # [gt, pred]
    matched = sum(ious[i][j] for i, j in max_weight_matching(ious))
    return matched / max(len(pred), len(gt_masks))


MASK_CONSISTENCIES = ("tokens", "iou")


def mask_consistency(
    pred: Sequence[Codes],
    gt: Sequence[Codes],
    mode: str = "tokens",
    decode: Callable[[Codes], np.ndarray] | None = None,
    gt_masks: Sequence[np.ndarray] | None = None,
) -> float:
    """The consistency of an answer's masks with the target's, either way paper 004 allows: ``tokens``
    (`mask_token_consistency` on the codes) or ``iou`` (`decoded_mask_iou`: ``pred`` decoded by ``decode`` against
    ``gt_masks``, the exact masks when known, else ``gt`` decoded too)."""
    if mode == "tokens":
        return mask_token_consistency(pred, gt)
    if mode != "iou":
        raise ValueError(f"mask consistency must be one of {MASK_CONSISTENCIES}, got {mode!r}")
    if decode is None:
        raise ValueError("mask consistency 'iou' decodes the predicted codes: pass decode=<tokenizer's codes -> mask>")
    masks = list(gt_masks) if gt_masks is not None else [decode(tuple(g)) for g in gt]
    return decoded_mask_iou(pred, masks, decode)


def no_target_reward(answer: str, has_region: bool) -> float:
    """A no-target query's answer: 0 when it gives a region, else 1.0 when it says "No target." (case-insensitive,
    period optional) and 0.2 when it does not."""
    if has_region:
        return 0.0
    said = isinstance(answer, str) and _NO_TARGET_PHRASE.search(answer[:_MAX_CHARS]) is not None
    return 1.0 if said else NO_TARGET_PARTIAL


# --- the released repository's composition ---------------------------------------------------------------------------


def released_clean(caption: str) -> float:
    """1.0 unless the caption writes a ``[a, b, c, d]`` box of integers or a CJK character (the repository's
    ``cap_no_bbox_no_chinese_check``)."""
    text = caption[:_MAX_CHARS] if isinstance(caption, str) else ""
    return 0.0 if _INT_BOX.search(text) or _CJK.search(text) else 1.0


def released_no_repeat_3gram(caption: str) -> float:
    """1.0 unless some word 3-gram occurs more than twice (lower-cased, punctuation as space; the repository's
    ``gm_non_repeat_reward``); texts under 3 words pass."""
    words = re.sub(r"[^\w\s]", " ", str(caption)[:_MAX_CHARS].lower()).split()
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 2):
        gram = tuple(words[i : i + 3])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] > 2:
            return 0.0
    return 1.0


def released_caption_reward(mean_s: float, caption: str, weight: float = RELEASED_IOU_WEIGHT) -> float:
    """``(no_repeat_3gram + weight * mean_s) * clean + clean``: a box or CJK in the caption zeroes all of it."""
    clean = released_clean(caption)
    return (released_no_repeat_3gram(caption) + weight * float(mean_s)) * clean + clean


def released_grounding_reward(
    s: float, mean_s: float, answer: str, has_region: bool, weight: float = RELEASED_IOU_WEIGHT
) -> float:
    """``weight * s * mean_s + no_mask_repeat + has_region``: the grounding's consistency times its caption's mean
    consistency over the caption's K groundings, a point for not looping on a mask span, a point for a region."""
    no_repeat = 0.0 if mask_token_repetition(answer) else 1.0
    return weight * float(s) * float(mean_s) + no_repeat + float(bool(has_region))


def released_no_target_reward(answer: str, has_region: bool) -> float:
    """``no_target_reward + no_mask_repeat`` for a grounding of a no-target query."""
    return no_target_reward(answer, has_region) + (0.0 if mask_token_repetition(answer) else 1.0)


# --- the repository's live code, as it runs (module docstring) -------------------------------------------------------

REPOSITORY_NO_TARGET = "No target."
"""The ground truth ``text2mask.py`` gives a ``gres_no_target`` row (~1132), matched as a substring, case and period."""
_REPO_SPAN = re.compile(r"<\|mt_start\|><\|mt_\d{4}\|><\|mt_\d{4}\|><\|mt_end\|>")
_REPO_TOKEN = re.compile(r"<\|[^|]*\|>")


def repository_spans(text: str) -> list[str]:
    """Every mask-token span of ``text`` as the repository's regex finds it: no whitespace inside, any four digits."""
    return _REPO_SPAN.findall(text[:_MAX_CHARS]) if isinstance(text, str) else []


def repository_span_match(pred: str, gt: str) -> float:
    """One span string against another (``compute_mask_token_accuracy_by_grading``): 1.0 equal; 0.8 all tokens but
    the last equal (unreachable for two whole spans, kept as written); 0.4 the start and first code equal; else 0."""
    a, g = _REPO_TOKEN.findall(pred), _REPO_TOKEN.findall(gt)
    if pred == gt:
        return 1.0
    if "".join(a[:-1]) == "".join(g[:-1]):
        return 0.8
    return FIRST_CODE_CREDIT if "".join(a[:-2]) == "".join(g[:-2]) else 0.0


def repository_token_consistency(response: str, ground_truth: str) -> float:
    """``fsdp_workers.py``'s ``mask_token_accuracy_reward``: ``sum over the distinct predicted spans of the best
    match among the distinct ground-truth spans / max(#pred, #gt)`` (counts with repeats); none on either side 1.0,
    on one side 0."""
    pred, gt = repository_spans(response), repository_spans(ground_truth)
    if not pred and not gt:
        return 1.0
    if not pred or not gt:
        return 0.0
    unique_gt = list(dict.fromkeys(gt))
    total = sum(max(repository_span_match(p, g) for g in unique_gt) for p in dict.fromkeys(pred))
    return total / max(len(pred), len(gt))


def repository_has_region(response: str) -> float:
    """1.0 when ``response`` holds a span by the repository's regex (``mask_token_format_reward``)."""
    return 1.0 if repository_spans(response) else 0.0


def repository_no_mask_repeat(response: str) -> float:
    """``non_repeat_reward``: 0 when some span string occurs more than 3 times in ``response``, else 1."""
    if not isinstance(response, str):
        return 0.0
    text = response[:_MAX_CHARS]
    return 0.0 if any(text.count(span) > 3 for span in repository_spans(text)) else 1.0


def repository_no_target_check(response: str) -> float:
    """``no_target_check_bbox(response, "No target.")``: 0 for an integer ``[a, b, c, d]`` box, 1.0 when the exact
    phrase is in the response, 0.2 otherwise (a mask span is no box: 0.2)."""
    text = response[:_MAX_CHARS] if isinstance(response, str) else ""
    return 0.0 if _INT_BOX.search(text) else 1.0 if REPOSITORY_NO_TARGET in text else NO_TARGET_PARTIAL


def repository_no_target_reward(response: str) -> float:
    """A ``gres_no_target`` row: ``no_target_check_bbox + non_repeat_reward`` on the whole response."""
    return repository_no_target_check(response) + repository_no_mask_repeat(response)


def repository_grounding_reward(s: float, mean_s: float, response: str, weight: float = RELEASED_IOU_WEIGHT) -> float:
    """``10 * s * mean_s + non_repeat_reward + mask_token_format_reward`` on the whole response."""
    return weight * float(s) * float(mean_s) + repository_no_mask_repeat(response) + repository_has_region(response)
