"""The tensor maths the evaluation metrics are built from (docs/metrics.md): pairwise and paired box IoU that is never
NaN, predicted boxes normalised to a tensor, greedy one-to-one matching (OVD's GP / GR), and the ground-truth diversity
of groups of accuracy rewards. Pure functions, tensors in, tensors out; the ``torchmetrics`` classes that accumulate
and sync them are ``lightning_modules/evaluation/metrics.py``.

Boxes are ``[x1, y1, x2, y2]`` in one pixel frame, continuous coordinates; a box that is degenerate (``x2 <= x1`` or
``y2 <= y1``) or has a non-finite coordinate has IoU 0 with everything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchvision.ops import box_iou as _tv_box_iou

__all__ = ["BoxLike", "as_box_tensor", "greedy_match", "group_diversity", "paired_box_iou", "safe_box_iou"]

BoxLike = Sequence[float] | Tensor | None


def _valid_boxes(boxes: Tensor) -> Tensor:
    """[N, 4] -> [N] bool: finite and of positive width and height."""
    finite = torch.isfinite(boxes).all(dim=-1)
    return finite & (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])


def _as_float(boxes: Tensor) -> Tensor:
    return boxes if boxes.is_floating_point() else boxes.float()


def safe_box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise IoU ``[N, 4] x [M, 4] -> [N, M]`` via ``torchvision.ops.box_iou``, never NaN.

    torchvision divides by the union, which is 0 for two identical zero-area boxes (NaN) and meaningless for inverted
    boxes (negative areas). Invalid boxes (degenerate or non-finite) are zeroed before the call and their rows /
    columns set to 0 after it; between two valid boxes the union is > 0, so no NaN can appear.
    """
    boxes1, boxes2 = _as_float(boxes1.reshape(-1, 4)), _as_float(boxes2.reshape(-1, 4))
    valid1, valid2 = _valid_boxes(boxes1), _valid_boxes(boxes2)
    unit = boxes1.new_tensor([0.0, 0.0, 1.0, 1.0])  # placeholder with area 1, its IoU is masked out below
    iou = _tv_box_iou(torch.where(valid1[:, None], boxes1, unit), torch.where(valid2[:, None], boxes2, unit))
    return iou * (valid1[:, None] & valid2[None, :])  # [N, M]


def paired_box_iou(pred: Tensor, target: Tensor) -> Tensor:
    """IoU of matched pairs ``[N, 4], [N, 4] -> [N]`` (the diagonal of ``safe_box_iou``).

    O(N^2) memory, which is nothing at a batch's size (B * G <= a few hundred rows).
    """
    if pred.shape != target.shape:
        raise ValueError(
            f"pred and target boxes must have the same shape, got {tuple(pred.shape)} and {tuple(target.shape)}"
        )
    return safe_box_iou(pred, target).diagonal()


def as_box_tensor(boxes: Tensor | Sequence[BoxLike], device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Normalise predicted boxes to ``(boxes [N, 4] float, parsed [N] bool)``.

    Accepts a ``[N, 4]`` tensor (a row with a NaN marks an unparseable answer) or a list whose items are ``None``
    (unparseable answer), a 4-element tensor, or a sequence of 4 numbers. Unparseable rows become zeros, which
    ``safe_box_iou`` treats as degenerate, so they score IoU 0.
    """
    if isinstance(boxes, Tensor):
        boxes = _as_float(boxes).to(device) if device is not None else _as_float(boxes)
        if boxes.ndim != 2 or boxes.shape[-1] != 4:
            raise ValueError(f"boxes must have shape [N, 4], got {tuple(boxes.shape)}")
        parsed = ~torch.isnan(boxes).any(dim=-1)
        return torch.nan_to_num(boxes, nan=0.0), parsed
    rows, parsed = [], []
    for i, box in enumerate(boxes):
        if box is None:
            rows.append([0.0, 0.0, 0.0, 0.0])
            parsed.append(False)
            continue
        values = box.detach().reshape(-1).tolist() if isinstance(box, Tensor) else [float(v) for v in box]
        if len(values) != 4:
            raise ValueError(f"box {i} must have 4 coordinates [x1, y1, x2, y2] or be None, got {values}")
        rows.append(values)
        parsed.append(True)
    out = torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, 4)
    return out, torch.tensor(parsed, dtype=torch.bool, device=device)


def greedy_match(iou: Tensor, threshold: float = 0.5) -> list[tuple[int, int]]:
    """One-to-one greedy matching on an IoU matrix ``[P, G]`` -> list of (pred index, gt index).

    Repeatedly take the globally highest remaining IoU, keep the pair if it is ``>= threshold``, and remove its row
    and column. Ties go to the lowest pred index, then the lowest gt index (``argmax`` returns the first maximum in
    row-major order). Greedy, not optimal: a prediction may take a GT that a second prediction needed (see tests).
    Pairs that must not match (e.g. different labels) should be set to a negative value by the caller.
    """
    if iou.ndim != 2:
        raise ValueError(f"iou must be a [P, G] matrix, got shape {tuple(iou.shape)}")
    work = iou.detach().clone().float()
    pairs: list[tuple[int, int]] = []
    for _ in range(min(work.shape)):
        flat = int(torch.argmax(work))
        p, g = divmod(flat, work.shape[1])
        if not work[p, g] >= threshold:
            break
        pairs.append((p, g))
        work[p, :] = -1.0
        work[:, g] = -1.0
    return pairs


def group_diversity(acc_rewards: Tensor, group_size: int) -> Tensor:
    """Ground-truth diversity per prompt ``V(q) = Var_pop(R_acc of its G completions) / (1/4)`` -> ``[B]`` float64.

    ``acc_rewards`` is ``[B * G]`` laid out prompt-major (the G completions of prompt b are rows b*G ... b*G+G-1,
    as ``repeat_interleave`` / TRL produce them) or already ``[B, G]``. 1/4 is the largest population variance of
    values in [0, 1], so V(q) is in [0, 1] for accuracy rewards in [0, 1].
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    r = acc_rewards.detach().to(torch.float64)
    if r.ndim == 2 and r.shape[1] == group_size:
        groups = r  # [B, G]
    elif r.ndim == 1 and r.numel() % group_size == 0:
        groups = r.reshape(-1, group_size)  # [B, G]
    else:
        raise ValueError(
            f"acc_rewards must be [B * G] or [B, G] with G = group_size = {group_size}, got {tuple(r.shape)}"
        )
    return groups.var(dim=1, unbiased=False) / 0.25  # [B]
