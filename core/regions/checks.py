"""Reference-free checks (the papers' Phi) and the cycle rewards, as plain functions.

Paper 004, step (5): ``r_cap_i = alpha * mean_k s_ik + Phi_cap`` and ``r_loc_ik = alpha * s_ik + Phi_loc``, where Phi
holds only checks that need no reference caption: coordinate / timestamp leakage, repetition, a valid serialization;
the temporal instance adds a multiplicative gate on the number of invalid intervals and the spatio-temporal one a
temporal-proximity shaping term. The papers give neither the weights nor the forms; ours (docs/decisions.md):

- Phi is a sum of **penalties** (<= 0), so a clean caption or answer earns exactly ``alpha * s``;
- leakage: a caption that writes coordinates, a mask band or a timestamp gets ``-leak_weight`` once (not per leak:
  one leak already breaks the cycle) and is **stripped** (``strip_leaks``) before it enters the grounding prompt, so
  the grounder can never copy the answer out of the caption;
- repetition: ``-repetition_weight * repetition_rate`` (the fraction of repeated word 3-grams);
- an empty caption (after stripping) or an unreadable grounding answer gets ``-format_weight``;
- temporal gate: ``gamma ** n_invalid`` multiplies the consistency term of ``r_loc`` only (multiplying the whole
  reward would also shrink the penalties, i.e. reward invalid intervals on a penalised answer);
- spatio-temporal shaping: ``+proximity_weight * temporal_proximity`` on ``r_loc``, the one term that is not a
  penalty: it is what gives "right object, time off by more than tau" a gradient, since Eq. 15 scores it 0.

Leakage detection is a list of patterns, not a proof: the paper notes that rules cannot enumerate every implicit
shortcut. It catches numeric lists in brackets, ``x=``/``y1:`` coordinates, pixel amounts, mask bands, mask tokens
(``<|mt_start|>``, ``<|mt_0017|>``, ``<|mt_end|>``: any of them, well-formed span or not, ``core/regions/mask_tokens.py``),
frame numbers, clock times, and seconds (``3 s``, ``at 2.5 seconds``, ``from 2 to 4 seconds``, ``1.5-3.0s``). Counts and
ordinals in words ("three circles", "the second time") are content and stay.

Mask-token answers have one more check, the released repository's: ``mask_token_repetition`` (a span written more
than 3 times: a degenerate answer that loops on one mask).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from core.regions.base import NO_TARGET, RegionSpace
from core.regions.mask_tokens import parse_masks

__all__ = [
    "caption_phi",
    "cycle_rewards",
    "find_leaks",
    "has_leak",
    "has_mask_token_leak",
    "invalid_interval_gate",
    "localization_phi",
    "localization_reward",
    "caption_reward",
    "mask_token_repetition",
    "repetition_rate",
    "strip_leaks",
    "temporal_proximity",
]

# a decimal inside leak patterns: bounded, never starting inside another number (linear scans, as regions.base.NUM)
_U = r"(?<![\d.])[-+]?(?:\d{1,16}(?:\.\d{0,16})?|\.\d{1,16})(?!\d)"
_SEC = r"(?:s|sec|secs|second|seconds)\b"
_PREP = r"(?:(?:at|from|between|around|about|until|till|by|after|before|near|in|on|to|during)\s+)?"
_D = r"(?<!\d)\d{1,6}(?!\d)"
_BAND = rf"{_D}(?:\s*-\s*{_D})?\s*:\s*{_D}(?:\.\d{{1,6}})?(?:\s*-\s*{_D})?(?:\s*,\s*{_D}(?:\s*-\s*{_D})?)*(?::{_D}(?:\.\d{{1,6}})?)?"
_MASK_TOKEN = r"<\|mt_(?:start|end|\d{1,6})\|>"
_MASK_TOKEN_RE = re.compile(_MASK_TOKEN)
_LEAK_PATTERNS = [
    # [12, 40, 96, 120], (0.3, 0.5), {1, 2}: two or more numbers in brackets
    rf"{_PREP}[\[({{]\s*{_U}\s*(?:[,;\s]\s*{_U}\s*)+[\])}}]",
    # "bbox_2d": / box: keys left behind by JSON
    r"[\"']?(?:bbox_2d|bbox|box_2d|bounding[_ ]box)[\"']?\s*[:=]?",
    # x=12, y1: 40, w = 30
    rf"\b(?:x|y|x1|y1|x2|y2|w|h|cx|cy|width|height)\s*[=:]\s*{_U}",
    # 34 px, 12 pixels
    rf"{_PREP}{_U}\s*(?:px|pixels?)\b",
    # mask bands 3-5:4-9,12 (also catches clock times 00:03 and 0:03.5)
    rf"{_PREP}\b{_BAND}(?:\s*;\s*{_BAND})*",
    # from 2 to 4 seconds, 1.5-3.0 s, between 2 and 4 sec
    rf"{_PREP}{_U}\s*(?:{_SEC})?\s*(?:-|–|—|to|and|until|till)\s*{_U}\s*{_SEC}",
    # 2.5 s, at 3 seconds, 120 ms
    rf"{_PREP}{_U}\s*(?:{_SEC}|ms\b|milliseconds?\b)",
    # frame 12, frames 3-5, frame #4, t=3
    rf"{_PREP}\bframes?\s*#?\s*\d+(?:\s*(?:-|to|and)\s*\d+)?",
    rf"{_PREP}\bt\s*=\s*{_U}",
    # mask tokens, any of the 514 (a caption that writes the answer's codes: core/regions/mask_tokens.py)
    _MASK_TOKEN,
    # Open-o3-Video's time tags: at<t>2.5</t>s
    rf"{_PREP}(?:\bat\s*)?<(?:t|time)>\s*{_U}\s*</(?:t|time)>\s*(?:{_SEC})?",
    # (words alone, "left", "top", "second", are content and never leaks)
]
_LEAK_RE = re.compile("|".join(f"(?:{p})" for p in _LEAK_PATTERNS), re.IGNORECASE)
_WORD_RE = re.compile(r"[a-z0-9']+")
_MAX_CHARS = 20_000


def find_leaks(caption: str) -> list[tuple[int, int]]:
    """``(start, end)`` character spans of every coordinate / timestamp the caption writes, left to right."""
    if not isinstance(caption, str):
        return []
    return [m.span() for m in _LEAK_RE.finditer(caption[:_MAX_CHARS]) if m.end() > m.start()]


def has_leak(caption: str) -> bool:
    return bool(find_leaks(caption))


def has_mask_token_leak(text: str) -> bool:
    """Whether ``text`` writes any mask token (``<|mt_start|>``, ``<|mt_end|>``, ``<|mt_NNNN|>``), well-formed span or
    not: in a caption it is the answer's code (a leak, counted by ``has_leak`` and removed by ``strip_leaks``); the
    released repository's no-target reward also reads any mask token as "answered a region"."""
    return isinstance(text, str) and _MASK_TOKEN_RE.search(text[:_MAX_CHARS]) is not None


def mask_token_repetition(text: str, max_repeats: int = 3) -> bool:
    """Whether one well-formed mask-token span occurs more than ``max_repeats`` times in ``text`` (the released
    repository's ``non_repeat_reward`` is 0 exactly then). Malformed spans are not counted; a text without spans
    never repeats."""
    if max_repeats < 1:
        raise ValueError(f"max_repeats must be >= 1, got {max_repeats}")
    if not isinstance(text, str):
        return False
    counts: dict[tuple[int, int], int] = {}
    for codes in parse_masks(text[:_MAX_CHARS]):
        counts[codes] = counts.get(codes, 0) + 1
        if counts[codes] > max_repeats:
            return True
    return False


def strip_leaks(caption: str) -> str:
    """The caption with every leak removed (a preposition that introduced it goes with it), whitespace collapsed
    and spaces before punctuation dropped: the text that may enter the grounding prompt."""
    if not isinstance(caption, str):
        return ""
    caption = caption[:_MAX_CHARS]
    out = _LEAK_RE.sub(" ", caption)
    out = re.sub(r"<(box|bbox|t|time|quad)>\s*</\1>\s*s?", " ", out, flags=re.IGNORECASE)  # tags the leak emptied
    out = re.sub(r"\s+", " ", out)
    out = re.sub(r"\s+([,.;:!?)])", r"\1", out)
    out = re.sub(r"([(\[])\s+", r"\1", out)
    out = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", out)  # ", ," left where a list was
    return out.strip(" ,;:")


def repetition_rate(text: str, n: int = 3) -> float:
    """Fraction of word ``n``-grams that repeat an earlier one (0 for text shorter than ``n`` words).

    "a red circle a red circle a red circle": 7 trigrams, 3 distinct -> 4 / 7.
    """
    if not isinstance(text, str):
        return 0.0
    words = _WORD_RE.findall(text[:_MAX_CHARS].lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def caption_phi(
    caption: str,
    leak_weight: float = 1.0,
    repetition_weight: float = 0.5,
    format_weight: float = 1.0,
    max_words: int = 64,
) -> float:
    """Phi_cap <= 0: ``-leak_weight * [leak] - repetition_weight * repetition_rate - format_weight * [empty after
    stripping or longer than max_words]``."""
    stripped = strip_leaks(caption)
    n_words = len(_WORD_RE.findall(stripped.lower()))
    bad_format = n_words == 0 or n_words > max_words
    return -(leak_weight * float(has_leak(caption)) + repetition_weight * repetition_rate(caption)) - (
        format_weight * float(bad_format)
    )


def localization_phi(
    answer: str,
    space: RegionSpace,
    format_weight: float = 1.0,
    repetition_weight: float = 0.0,
    mask_repetition_weight: float = 1.0,
) -> float:
    """Phi_loc <= 0: ``-format_weight`` when ``space.parse(answer)`` reads nothing (a no-target answer is a valid
    serialization), ``-repetition_weight * repetition_rate`` (off by default: serializations repeat by nature),
    ``-mask_repetition_weight`` when a mask-token span is written more than 3 times (``mask_token_repetition``; an
    answer without mask tokens never pays it)."""
    unreadable = space.parse(answer) is None
    looped = mask_repetition_weight * float(mask_token_repetition(answer)) if mask_repetition_weight else 0.0
    return -(format_weight * float(unreadable)) - repetition_weight * repetition_rate(answer) - looped


def invalid_interval_gate(n_invalid: int, gamma: float = 0.5) -> float:
    """The temporal gate ``gamma ** n_invalid`` in (0, 1]: each invalid interval (``IntervalSpace.n_invalid``)
    multiplies the consistency term of ``r_loc`` by ``gamma``."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"the invalid-interval gate's gamma must lie in [0, 1], got {gamma}")
    if n_invalid < 0:
        raise ValueError(f"n_invalid counts intervals and must be >= 0, got {n_invalid}")
    return float(gamma**n_invalid)


def temporal_proximity(gt: Any, pred: Any, tau: float = 3.0) -> float:
    """How close in time two anchor sets are, in [0, 1], boxes ignored: the mean of ``max(0, 1 - d / (2 tau))`` over
    the ground truth's anchors (d = time to the nearest predicted anchor) and over the predicted ones (to the nearest
    ground-truth anchor), averaged over both directions so that spraying anchors over the clip does not pay.

    The ramp reaches 0 at ``2 tau``: a prediction just outside Eq. 15's gate still gets half the credit and a
    direction to improve. 1 for two no-target regions, 0 when exactly one side is no target or unreadable.
    """
    if pred is None:
        return 0.0
    if gt is NO_TARGET or pred is NO_TARGET or not gt or not pred:
        return 1.0 if (gt is NO_TARGET or not gt) and (pred is NO_TARGET or not pred) else 0.0
    tg, tp = [float(t) for t, _ in gt], [float(t) for t, _ in pred]
    span = 2.0 * tau if tau > 0 else 1e-9

    def side(a: list[float], b: list[float]) -> float:
        return sum(max(0.0, 1.0 - min(abs(x - y) for y in b) / span) for x in a) / len(a)

    return 0.5 * (side(tg, tp) + side(tp, tg))


# --- reward assembly -------------------------------------------------------------------------------------------------


def caption_reward(s_ik: Sequence[float], phi_cap: float, alpha: float = 1.0) -> float:
    """``r_cap_i = alpha * mean_k s_ik + Phi_cap`` for one caption from its K groundings' consistencies."""
    if len(s_ik) == 0:
        raise ValueError("caption_reward needs the consistencies of the caption's K >= 1 groundings, got none")
    return alpha * sum(float(s) for s in s_ik) / len(s_ik) + phi_cap


def localization_reward(s_ik: float, phi_loc: float, alpha: float = 1.0, gate: float = 1.0, shaping: float = 0.0):
    """``r_loc_ik = alpha * gate * s_ik + Phi_loc + shaping`` (gate: temporal; shaping: spatio-temporal proximity,
    already weighted)."""
    return alpha * gate * float(s_ik) + phi_loc + shaping


def cycle_rewards(
    s: Sequence[Sequence[float]],
    phi_cap: Sequence[float],
    phi_loc: Sequence[Sequence[float]],
    alpha: float = 1.0,
    gate: Sequence[Sequence[float]] | None = None,
    shaping: Sequence[Sequence[float]] | None = None,
) -> tuple[list[float], list[list[float]]]:
    """Both reward levels of one sample: ``s [N][K]`` consistencies -> ``(r_cap [N], r_loc [N][K])``.

    The caption reward uses the ungated consistencies: the gate judges how the grounder wrote its answer, not whether
    the caption was locatable (invalid intervals already add nothing to the overlap).
    """
    n = len(s)
    if len(phi_cap) != n or len(phi_loc) != n:
        raise ValueError(
            f"s, phi_cap and phi_loc need one row per caption (N = {n}), got {len(phi_cap)}, {len(phi_loc)}"
        )
    r_cap, r_loc = [], []
    for i in range(n):
        k = len(s[i])
        if len(phi_loc[i]) != k:
            raise ValueError(f"caption {i}: {k} consistencies but {len(phi_loc[i])} Phi_loc values")
        g = gate[i] if gate is not None else [1.0] * k
        sh = shaping[i] if shaping is not None else [0.0] * k
        r_cap.append(caption_reward(s[i], phi_cap[i], alpha))
        r_loc.append([localization_reward(s[i][j], phi_loc[i][j], alpha, g[j], sh[j]) for j in range(k)])
    return r_cap, r_loc
