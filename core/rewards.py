"""Rewards for Syn-GRPO: pure functions over completion strings (no Lightning, no I/O).

A completion is expected to read (tag names configurable through :class:`Tags`)::

    <think>...</think><diversity>0.xx</diversity><description>...</description><answer>[x1, y1, x2, y2]</answer>

Reward functions follow open-r1: ``fn(completions: list[str], **kw) -> list[float]``, one value per completion, and
they never raise on model output (broken JSON, truncation, repetition, refusals all give a number). Completions may be
plain strings or TRL conversational completions (``[{"role": "assistant", "content": ...}]``). Per-completion keyword
arguments (``gt_boxes``, ``input_wh``, ``orig_wh``) are lists aligned with ``completions`` (TRL repeats dataset columns
per completion); a single value is broadcast.

Box conventions: Qwen2.5-VL answers in absolute pixels of the *resized* model input; ground truth is in original
pixels, so answers are rescaled by ``(orig_w / input_w, orig_h / input_h)`` before comparison (as VLM-R1 does). Boxes
are read only from inside the answer part of a tagged completion ("a box in the wrong tag" earns nothing);
:func:`extract_boxes` reads untagged text (Qwen's demo outputs, untuned baselines). Numbers are taken as written: no
guessing of normalised [0, 1] or Qwen2-VL 0-1000 coordinates, and parenthesised tuples ``(x1, y1, x2, y2)`` are not
boxes (they are ambiguous with Qwen2-VL's corner pairs and with x, y, w, h). The box parsing and geometry
(``extract_boxes``, ``iou``, ``rescale_box``) live in ``core.boxes``, shared with the data side; they are re-exported
here.

The diversity machinery (ground-truth diversity, the EMA smoother, the reward forms) is described in
docs/diversity_reward.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.boxes import _NUMBER, Box, _finite_box, extract_boxes, iou, rescale_box

__all__ = [
    "ACCURACY_REWARDS",
    "DIVERSITY_REWARD_FORMS",
    "DiversitySmoother",
    "ParsedCompletion",
    "Tags",
    "diversity_reward",
    "extract_boxes",
    "format_reward",
    "ground_truth_diversity",
    "iou",
    "ovd_reward",
    "parse_completion",
    "rec_accuracy_reward",
    "rescale_box",
]

# ---------------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------------

_SPACE = re.compile(r"\s*")  # str.isspace() characters (re's Unicode \s is the same set)
_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


@dataclass(frozen=True)
class Tags:
    """Names of the four XML-like tags of a completion, in the order they must appear."""

    think: str = "think"
    """Reasoning trace."""
    diversity: str = "diversity"
    """Predicted diversity of the sample, a number in [0, 1]."""
    description: str = "description"
    """Description of a new image for the data server."""
    answer: str = "answer"
    """Final answer: one box (REC) or several (OVD)."""

    def __post_init__(self) -> None:
        names = self.names
        for name in names:
            if not isinstance(name, str) or not _TAG_NAME.fullmatch(name):
                raise ValueError(f"--model.tags: tag names must be identifiers like 'answer', got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"--model.tags: the four tag names must differ, got {names}")

    @property
    def names(self) -> tuple[str, str, str, str]:
        return (self.think, self.diversity, self.description, self.answer)


@dataclass(frozen=True)
class ParsedCompletion:
    """What could be read from one completion.

    ``format_ok`` is True iff the text is exactly the four parts in order (only whitespace around and between them,
    no tag nested in another part), the diversity is a number, the description is non-empty and the answer holds at
    least one box. The other fields are read leniently (an unclosed last part runs to the next tag or the end of the
    text), so a truncated completion still yields its box.
    """

    think: str | None = None
    """Reasoning text (stripped), None when there is no think part."""
    diversity: float | None = None
    """Predicted diversity clipped to [0, 1]; None when absent or not a finite number."""
    description: str | None = None
    """New-image description (stripped); None when absent or empty."""
    boxes: list[Box] = field(default_factory=list)
    """Boxes [x1, y1, x2, y2] (floats, finite, as written) read from the answer part, in order."""
    format_ok: bool = False
    parts_present: int = 0
    """How many of the four parts are present and valid (0-4), for partial format credit."""


def _parse_unit_float(text: str | None) -> float | None:
    if text is None:
        return None
    s = text.strip()
    if not _NUMBER.fullmatch(s):
        return None
    try:
        x = float(s)
    except (ValueError, OverflowError):
        return None
    if not math.isfinite(x):
        return None
    return min(max(x, 0.0), 1.0)


def _section(text: str, name: str, tags: Tags, start: int = 0) -> tuple[str | None, bool, int]:
    """Content of the first ``<name>`` part at or after ``start``: (content, closed, end index).

    An unclosed part runs to the next opening tag of another part, or to the end of the text.
    """
    open_tag, close_tag = f"<{name}>", f"</{name}>"
    o = text.find(open_tag, start)
    if o < 0:
        return None, False, start
    begin = o + len(open_tag)
    c = text.find(close_tag, begin)
    if c >= 0:
        return text[begin:c], True, c + len(close_tag)
    stops = [i for i in (text.find(f"<{other}>", begin) for other in tags.names if other != name) if i >= 0]
    end = min(stops) if stops else len(text)
    return text[begin:end], False, end


def _strict_parts(text: str, tags: Tags, names: Sequence[str] | None = None) -> list[str] | None:
    """The contents if ``text`` is exactly <t1>..</t1> <t2>..</t2> ... with only whitespace around, else None.

    ``names``: the tags that must appear, in order (default: all four of ``tags``).
    """
    markers = [m for name in tags.names for m in (f"<{name}>", f"</{name}>")]
    pos, parts = 0, []
    for name in names or tags.names:
        pos = _SPACE.match(text, pos).end()
        open_tag, close_tag = f"<{name}>", f"</{name}>"
        if not text.startswith(open_tag, pos):
            return None
        pos += len(open_tag)
        close = text.find(close_tag, pos)
        if close < 0:
            return None
        content = text[pos:close]
        if any(m in content for m in markers):
            return None
        parts.append(content)
        pos = close + len(close_tag)
    if text[pos:].strip():
        return None
    return parts


_MAX_MESSAGES = 1_000_000
"""Strings, messages and lists :func:`_as_text` visits in one completion (a TRL completion has one message)."""
MAX_COMPLETION_CHARS = 2**20
"""Characters of a completion the rewards read: its first 1 MiB, far above any ``max_new_tokens`` (8,192 tokens are
~40,000 characters). A runaway or adversarial completion costs no more than this to score: a 10 MB string of 1M boxes
took 5-60 s to parse whole (``max_pred_boxes`` applies only after parsing)."""


def _message_text(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        content = item.get("content")
        return content if isinstance(content, str) else ""
    return None


def _as_text(completion: Any) -> str:
    """A completion as text, at most its first ``MAX_COMPLETION_CHARS`` characters: a string, or the content of a TRL
    conversational completion.

    Nested lists and tuples of messages are read depth first, in order, with an explicit stack, so any depth is fine
    (no RecursionError); a list that contains itself is not entered again, and reading stops after
    ``_MAX_MESSAGES`` items or ``MAX_COMPLETION_CHARS`` characters. Other types (None, numbers, bytes, tensors, ...)
    read as "".
    """
    text = _message_text(completion)
    if text is not None:
        return text[:MAX_COMPLETION_CHARS]
    if not isinstance(completion, (list, tuple)):
        return ""
    pieces: list[str] = []
    chars = budget = 0
    # Lists being read, outermost first, and the next index in each (no iterator objects: a deep stack of them makes
    # the garbage collector's passes quadratic).
    seqs, positions = [completion], [0]
    open_ids = {id(completion)}  # a list met again while it is being read is a cycle: not entered
    while seqs and budget < _MAX_MESSAGES and chars < MAX_COMPLETION_CHARS:
        seq, i = seqs[-1], positions[-1]
        if i >= len(seq):
            open_ids.discard(id(seqs.pop()))
            positions.pop()
            continue
        positions[-1] = i + 1
        item = seq[i]
        budget += 1
        text = _message_text(item)
        if text is not None:
            pieces.append(text[: MAX_COMPLETION_CHARS - chars])
            chars += len(pieces[-1])
        elif isinstance(item, (list, tuple)) and id(item) not in open_ids:
            seqs.append(item)
            positions.append(0)
            open_ids.add(id(item))
    return "".join(pieces)


def parse_completion(text: str, tags: Tags = Tags()) -> ParsedCompletion:  # noqa: B008 - frozen, immutable default
    """Read the four parts of a completion; never raises (anything unreadable is None / empty)."""
    text = _as_text(text)
    think, think_closed, after_think = _section(text, tags.think, tags)
    # Later parts are looked for after the reasoning, so a tag *mentioned* while thinking is not taken as an answer.
    rest = after_think if think_closed else 0
    div_text, div_closed, _ = _section(text, tags.diversity, tags, rest)
    desc_text, desc_closed, _ = _section(text, tags.description, tags, rest)
    answer_text, answer_closed, _ = _section(text, tags.answer, tags, rest)

    diversity = _parse_unit_float(div_text)
    description = desc_text.strip() if desc_text is not None else None
    description = description or None
    boxes = extract_boxes(answer_text) if answer_text is not None else []

    present = [
        think is not None and think_closed,
        diversity is not None and div_closed,
        description is not None and desc_closed,
        bool(boxes) and answer_closed,
    ]
    format_ok = all(present) and _strict_parts(text, tags) is not None
    return ParsedCompletion(
        think=think.strip() if think is not None else None,
        diversity=diversity,
        description=description,
        boxes=boxes,
        format_ok=format_ok,
        parts_present=sum(present),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------------------------------


def _is_pair(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x)


def _per_completion_wh(value: Any, n: int, name: str) -> list[Any]:
    """None, one (w, h) pair for all, or one pair (or None) per completion."""
    if value is None:
        return [None] * n
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if _is_pair(value):
        return [value] * n
    if isinstance(value, (list, tuple)) and len(value) == n and all(v is None or _is_pair(v) for v in value):
        return list(value)
    raise ValueError(f"{name} must be None, one (w, h) pair, or {n} pairs (one per completion); got {value!r}")


def _is_box_like(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 4 and all(isinstance(v, (int, float)) for v in x)


def _per_completion_boxes(value: Any, n: int, nested: bool) -> list[Any]:
    """Ground truth per completion; one box (REC) or one list of boxes (OVD) is broadcast to every completion."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"gt_boxes must be a list, got {type(value).__name__}")
    if nested and (len(value) == 0 or all(_is_box_like(b) for b in value)):
        return [list(value)] * n
    if not nested and _is_box_like(value):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"gt_boxes has {len(value)} entries for {n} completions")
    return list(value)


def _to_original(box: Box, input_wh: Any, orig_wh: Any) -> Box:
    if input_wh is None or orig_wh is None:
        return box
    return rescale_box(box, input_wh, orig_wh)


def rec_accuracy_reward(
    completions: list[Any],
    gt_boxes: Any,
    input_wh: Any = None,
    orig_wh: Any = None,
    tags: Tags = Tags(),  # noqa: B008 - frozen, immutable default
    **kwargs: Any,
) -> list[float]:
    """REC accuracy: IoU in [0, 1] of the FIRST answer box (rescaled to original pixels) with the GT box.

    Args:
        completions: N completion texts.
        gt_boxes: N GT boxes [x1, y1, x2, y2] in original pixels (or one box for all; None entries score 0).
        input_wh, orig_wh: (w, h) of the model input and of the original image, per completion or one for all; when
            either is None the answer is compared as written.
    """
    n = len(completions)
    gts = _per_completion_boxes(gt_boxes, n, nested=False)
    in_wh = _per_completion_wh(input_wh, n, "input_wh")
    or_wh = _per_completion_wh(orig_wh, n, "orig_wh")
    out = []
    for text, gt, iw, ow in zip(completions, gts, in_wh, or_wh):
        boxes = parse_completion(text, tags).boxes
        if not boxes or gt is None:
            out.append(0.0)
            continue
        out.append(iou(_to_original(boxes[0], iw, ow), gt))
    return out


FORMATS = {
    "syn_grpo": ("think", "diversity", "description", "answer"),
    "think_answer": ("think", "answer"),
}
"""Named formats: which tags (by ``Tags`` field) a well-formed completion has, in order. ``think_answer`` is
VLM-R1's format, used by the GRPO baselines."""


def format_reward(
    completions: list[Any],
    tags: Tags = Tags(),  # noqa: B008 - frozen, immutable default
    partial: bool = False,
    format: str = "syn_grpo",
    parsed: Sequence[ParsedCompletion] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 when the completion has all parts of ``format``, in order, well formed; else 0.0.

    With ``partial=True`` a malformed completion earns the fraction of the four parts that are present and valid.
    ``parsed``: the completions' ``parse_completion`` results, when the caller has them (``syn_grpo`` reads its
    verdict from them instead of parsing again).
    """
    if format not in FORMATS:
        raise ValueError(f"--model.method.init_args.format must be one of {sorted(FORMATS)}, got {format!r}")
    if format != "syn_grpo":
        names = [getattr(tags, f) for f in FORMATS[format]]
        out = []
        for text in completions:
            text = _as_text(text)
            parts = _strict_parts(text, tags, names)
            ok = parts is not None and bool(extract_boxes(parts[-1]))
            out.append(1.0 if ok else 0.0)
        return out
    if parsed is None:
        parsed = [parse_completion(text, tags) for text in completions]
    elif len(parsed) != len(completions):
        raise ValueError(f"format_reward: {len(parsed)} parsed completions for {len(completions)} completions")
    return [1.0 if p.format_ok else (p.parts_present / 4.0 if partial else 0.0) for p in parsed]


_MAP_METRIC_CLASS = None


def _map_metric():
    """A fresh torchmetrics MeanAveragePrecision on the faster_coco_eval backend (import cached: it takes seconds)."""
    global _MAP_METRIC_CLASS
    if _MAP_METRIC_CLASS is None:
        from torchmetrics.detection import MeanAveragePrecision

        _MAP_METRIC_CLASS = MeanAveragePrecision
    return _MAP_METRIC_CLASS(iou_type="bbox", backend="faster_coco_eval")


MAX_PRED_BOXES = 100
"""Predicted boxes an OVD completion is scored on: COCO mAP's maxDets (the metric ignores lower-ranked ones)."""


def ovd_reward(
    completions: list[Any],
    gt_boxes: Any,
    *,
    map_key: str = "map",
    max_pred_boxes: int = MAX_PRED_BOXES,
    input_wh: Any = None,
    orig_wh: Any = None,
    tags: Tags = Tags(),  # noqa: B008 - frozen, immutable default
    **kwargs: Any,
) -> list[float]:
    """OVD accuracy: ``s_ovd * mAP`` in [0, 1], with ``s_ovd = min(N_gt / N_pred, 1)`` (0 without predictions).

    mAP is COCO's (``map_key="map"``: IoU 0.50:0.95; ``"map_50"`` for IoU 0.5) computed by torchmetrics'
    ``MeanAveragePrecision(backend="faster_coco_eval")`` over the single image, all boxes one class. Predictions are
    scored in the order written (first box highest), so the model's order is its ranking. Only the first
    ``max_pred_boxes`` go to the metric: COCO's mAP keeps the 100 best-ranked detections (maxDets) anyway, so the value
    is unchanged, and a runaway completion with thousands of boxes costs no more than one with 100. ``N_pred`` in
    ``s_ovd`` still counts every box written.

    Args:
        gt_boxes: per completion, the list of GT boxes in original pixels (or one list of boxes for all).
        input_wh, orig_wh: as in :func:`rec_accuracy_reward`.
    """
    n = len(completions)
    gts = _per_completion_boxes(gt_boxes, n, nested=True)
    in_wh = _per_completion_wh(input_wh, n, "input_wh")
    or_wh = _per_completion_wh(orig_wh, n, "orig_wh")
    metric = None
    out = []
    for text, gt, iw, ow in zip(completions, gts, in_wh, or_wh):
        preds = parse_completion(text, tags).boxes
        finite = []  # the first max_pred_boxes predictions still finite in original pixels (the rest is not read)
        for box in preds:
            box = _to_original(box, iw, ow)
            if all(math.isfinite(v) for v in box):
                finite.append(box)
                if len(finite) == max_pred_boxes:
                    break
        gt_list = [b for b in (gt or []) if _finite_box(b) is not None]
        if not preds or not gt_list:
            out.append(0.0)
            continue
        s_ovd = min(len(gt_list) / len(preds), 1.0)
        if not finite:
            out.append(0.0)
            continue
        if metric is None:
            metric = _map_metric()
        metric.reset()
        finite = finite[:max_pred_boxes]
        k = len(finite)
        metric.update(
            [
                {
                    "boxes": torch.tensor(finite, dtype=torch.float32),
                    "scores": torch.arange(k, 0, -1, dtype=torch.float32) / k,
                    "labels": torch.zeros(k, dtype=torch.long),
                }
            ],
            [
                {
                    "boxes": torch.tensor(gt_list, dtype=torch.float32).reshape(-1, 4),
                    "labels": torch.zeros(len(gt_list), dtype=torch.long),
                }
            ],
        )
        m_ap = float(metric.compute()[map_key])
        m_ap = min(max(m_ap, 0.0), 1.0) if math.isfinite(m_ap) else 0.0  # -1 means "no GT": never negative
        out.append(s_ovd * m_ap)
    return out


ACCURACY_REWARDS: dict[str, Callable[..., list[float]]] = {"iou": rec_accuracy_reward, "ovd": ovd_reward}


# ---------------------------------------------------------------------------------------------------------------------
# Diversity (docs/diversity_reward.md)
# ---------------------------------------------------------------------------------------------------------------------


def ground_truth_diversity(acc: torch.Tensor | Sequence[float], group_size: int) -> torch.Tensor:
    """V(q) = population variance of the group's accuracy rewards / (1/4), clipped to [0, 1].

    Args:
        acc: [B*G] accuracy rewards in [0, 1] (the G completions of a prompt consecutive).
        group_size: G.

    Returns:
        [B] float32. 1/4 is the largest variance of values in [0, 1] (half at 0, half at 1).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"--model.sampling.group_size must be an int >= 2 for ground-truth diversity, got {group_size!r}"
        )
    a = torch.as_tensor(acc, dtype=torch.float32).detach().reshape(-1)
    if a.numel() == 0 or a.numel() % group_size:
        raise ValueError(
            f"acc has {a.numel()} entries, not a positive multiple of --model.sampling.group_size={group_size}"
        )
    a = torch.nan_to_num(a, nan=0.0, posinf=1.0, neginf=0.0)
    var = a.view(-1, group_size).var(dim=1, unbiased=False)  # [B]
    return (var / 0.25).clamp(0.0, 1.0)


def _linear(v: float, t: float) -> float:
    return 1.0 - abs(v - t)


def _squared(v: float, t: float) -> float:
    return 1.0 - (v - t) ** 2


_GAUSSIAN_SIGMA = 0.1


def _gaussian(v: float, t: float) -> float:
    return math.exp(-((v - t) ** 2) / (2.0 * _GAUSSIAN_SIGMA**2))


DIVERSITY_REWARD_FORMS: dict[str, Callable[[float, float], float]] = {
    "linear": _linear,
    "squared": _squared,
    "gaussian": _gaussian,
}
"""R_diversity(v, V~) forms, all in [0, 1] for v, V~ in [0, 1]. ``linear`` is the default (docs/diversity_reward.md)."""


def diversity_reward(
    pred: Sequence[float | None], target: torch.Tensor | Sequence[float], form: str = "linear", **kwargs: Any
) -> list[float]:
    """Reward for predicting the (smoothed) ground-truth diversity, in [0, 1].

    Args:
        pred: N predicted diversities (``ParsedCompletion.diversity``); None (unreadable) earns 0.
        target: N targets V~(q), the smoothed diversity of each completion's prompt (repeat each prompt's value G
            times).
        form: a key of :data:`DIVERSITY_REWARD_FORMS`.
    """
    if form not in DIVERSITY_REWARD_FORMS:
        raise ValueError(
            f"--model.method.init_args.diversity_reward_form must be one of {'|'.join(DIVERSITY_REWARD_FORMS)}, got {form!r}"
        )
    fn = DIVERSITY_REWARD_FORMS[form]
    targets = target.detach().reshape(-1).tolist() if isinstance(target, torch.Tensor) else list(target)
    if len(targets) != len(pred):
        raise ValueError(f"diversity_reward: {len(pred)} predictions but {len(targets)} targets")
    out = []
    for v, t in zip(pred, targets):
        if v is None or not math.isfinite(float(v)):
            out.append(0.0)
            continue
        v = min(max(float(v), 0.0), 1.0)
        t = min(max(float(t), 0.0), 1.0) if math.isfinite(float(t)) else 0.0
        out.append(min(max(fn(v, t), 0.0), 1.0))
    return out


class DiversitySmoother:
    """EMA calibration of the ground-truth diversity against diversity drift (paper Sec. "diversity smoothing").

    Per step k, with V [B] the ground-truth diversities of the step's prompts::

        batch_avg_k  = mean of V over the global batch (all ranks)
        global_avg_k = beta * global_avg_{k-1} + (1 - beta) * batch_avg_k      (global_avg_1 = batch_avg_1)
        V~           = clip(V * global_avg_k / batch_avg_k, 0, 1)

    Guard: when ``batch_avg_k <= eps`` (every group had zero variance) V is returned unchanged (all zeros) and the EMA
    is *not* updated: such a batch carries no scale to calibrate against (see docs/diversity_reward.md).

    Attributes for logging: ``batch_avg``, ``global_avg`` (None before the first informative batch), ``steps``
    (calls), ``skipped`` (guarded calls).
    """

    def __init__(self, beta: float = 0.7, eps: float = 1e-8, distributed: bool = True) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 <= beta < 1.0):
            raise ValueError(f"--model.method.init_args.diversity_beta must be in [0, 1) (paper: 0.7), got {beta!r}")
        if not eps >= 0:
            raise ValueError(f"diversity smoother eps must be >= 0, got {eps!r}")
        self.beta = float(beta)
        self.eps = float(eps)
        self.distributed = distributed
        self.batch_avg: float | None = None
        self.global_avg: float | None = None
        self.steps = 0
        self.skipped = 0

    def _global_mean(self, v: torch.Tensor) -> float:
        totals = torch.stack([v.sum().double(), torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device)])
        if self.distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.SUM)
        total, count = totals.tolist()
        return total / count if count > 0 else 0.0

    def update(self, v: torch.Tensor) -> torch.Tensor:
        """V [B] -> V~ [B] (same dtype and device), updating the moving average."""
        v = torch.as_tensor(v).detach()
        vf = torch.nan_to_num(v.float().reshape(-1), nan=0.0).clamp(0.0, 1.0)
        batch_avg = self._global_mean(vf)
        self.steps += 1
        self.batch_avg = batch_avg
        if batch_avg <= self.eps:
            self.skipped += 1
            return vf.view(v.shape).to(v.dtype if v.is_floating_point() else torch.float32)
        if self.global_avg is None:
            self.global_avg = batch_avg
        else:
            self.global_avg = self.beta * self.global_avg + (1.0 - self.beta) * batch_avg
        smoothed = (vf * (self.global_avg / batch_avg)).clamp(0.0, 1.0)
        return smoothed.view(v.shape).to(v.dtype if v.is_floating_point() else torch.float32)

    __call__ = update

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers, safe in a Lightning checkpoint."""
        return {
            "beta": self.beta,
            "batch_avg": self.batch_avg,
            "global_avg": self.global_avg,
            "steps": self.steps,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the moving average; ``beta`` stays the configured one (a resumed run may change it)."""
        self.batch_avg = None if state.get("batch_avg") is None else float(state["batch_avg"])
        self.global_avg = None if state.get("global_avg") is None else float(state["global_avg"])
        self.steps = int(state.get("steps", 0))
        self.skipped = int(state.get("skipped", 0))
