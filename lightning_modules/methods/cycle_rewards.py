"""CycleGRPO's text helpers, its two reward compositions and its loss sides (`methods/cycle_grpo.py` uses them).

**Reward compositions** (``--model.method.init_args.reward_composition``; docs/cycle_grpo.md has them side by side):

- ``seed`` (default), papers 002 / 004: ``r_cap_i = alpha * mean_k s_ik + Phi_cap``, ``r_loc_ik = alpha * gate_ik *
  s_ik + Phi_loc + shaping_ik``, a no-target grounding ``alpha * S(NO_TARGET, answer) + Phi_loc``
  (``core/regions/checks.py``);
- ``released``, the public repository's ``text2mask.py``: ``r_cap_i = (no_repeat_3gram + 10 * mean_k s_ik) * clean +
  clean``, ``r_loc_ik = 10 * s_ik * mean_k' s_ik' + no_mask_repeat + has_region``, a no-target grounding
  ``no_target_reward + no_mask_repeat`` (``core/regions/mask_rewards.py``). Images only (its video branches differ).
  Read through the project's parse: a case-free "no target", codes from well-formed in-range spans, decoded regions;
- ``repository``, the same formulas as the repository's code runs them (``repository_rows``; ``region_space: mask``):
  ``s`` compares span strings (``fsdp_workers.py``: out-of-range spans counted, nothing decoded), a no-target row
  earns ``no_target_check_bbox`` (exact "No target.", a mask span 0.2) ``+ non_repeat_reward``, each on the whole
  response.

**Loss sides** (paper 004, step 7: "the two task losses accumulated with equal weight"; the repository's
``cap_grad_weight = seg_grad_weight = 0.5``). The caption rows and the grounding rows (the cycle's and the no-target
queries') are two sides; each side's loss (surrogate and KL) is a token mean over its own rows across the ranks, and
``J = lambda_cap * J_cap + lambda_loc * J_loc`` (`objective.side_row_weights` turns this into per-row weights).
The Tables 10-11 ablations train one side with weight 1 and give the other weight 0: no surrogate and no KL from its
rows (the repository's captioner-only / segmenter-only runs update on one side's batch, unweighted).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from core.regions import has_mask_token_leak, strip_leaks
from core.regions.mask_rewards import (
    released_caption_reward,
    released_grounding_reward,
    released_no_target_reward,
    repository_grounding_reward,
    repository_no_mask_repeat,
    repository_no_target_check,
    repository_no_target_reward,
    repository_token_consistency,
)

__all__ = [
    "COMPOSITIONS",
    "MAX_CAPTION_CHARS",
    "MODES",
    "caption_text",
    "check_side_weights",
    "image_lookalikes",
    "loss_side_weights",
    "raw_caption",
    "released_cycle_rewards",
    "released_no_target_rewards",
    "repository_rows",
    "side_ids",
]

_ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_TAG_RE = re.compile(r"</?[a-z_]+>")
MAX_CAPTION_CHARS = 300
COMPOSITIONS = ("seed", "released", "repository")
MODES = ("cycle", "caption", "localization")
CAPTION_SIDE, LOCALIZATION_SIDE = 0, 1


def raw_caption(completion: str) -> str:
    """The caption a completion writes: its ``<answer>`` part when it has one, else the text, without tags."""
    m = _ANSWER_RE.search(completion)
    return _TAG_RE.sub(" ", m.group(1) if m else completion).strip()


def caption_text(completion: str) -> str:
    """What the grounding prompt may see: the caption with explicit coordinates (and mask tokens) stripped, at most
    ``MAX_CAPTION_CHARS``."""
    return strip_leaks(raw_caption(completion))[:MAX_CAPTION_CHARS].strip()


def image_lookalikes(sample) -> list[tuple[float, ...]]:
    """The boxes (original pixels) of the scene's other objects that share the target's shape or colour: what a
    caption naming only the kind would also fit. From the toy world's ``meta.objects``; none for data without them."""
    objects = (getattr(sample, "meta", None) or {}).get("objects") or []
    target = next((o for o in objects if o.get("role") == "target"), None)
    if target is None:
        return []
    return [
        tuple(float(v) for v in o["box"])
        for o in objects
        if o is not target and (o.get("shape") == target.get("shape") or o.get("colour") == target.get("colour"))
    ]


def released_cycle_rewards(
    s: Sequence[Sequence[float]],
    captions: Sequence[str],
    answers: Sequence[Sequence[str]],
    has_region: Sequence[Sequence[bool]],
) -> tuple[list[float], list[list[float]]]:
    """The released composition of one step's cycle: ``s [N][K]`` consistencies, the N captions (their answer text),
    the N x K grounding answers and whether each holds a region -> ``(r_cap [N], r_loc [N][K])``."""
    r_cap, r_loc = [], []
    for s_i, caption, answers_i, regions_i in zip(s, captions, answers, has_region, strict=True):
        mean = sum(float(v) for v in s_i) / len(s_i)
        r_cap.append(released_caption_reward(mean, caption))
        r_loc.append([released_grounding_reward(v, mean, a, h) for v, a, h in zip(s_i, answers_i, regions_i)])
    return r_cap, r_loc


def released_no_target_rewards(answers: Sequence[str], has_region: Sequence[bool]) -> list[float]:
    """The released composition of a no-target query's groundings (``has_region``: the answer parses to a region);
    an answer that writes any mask token also answered a region (the repository's ``no_target_check``)."""
    return [released_no_target_reward(a, h or has_mask_token_leak(a)) for a, h in zip(answers, has_region, strict=True)]


def repository_rows(texts: Sequence[str], gt_texts: Sequence[str], n: int, k: int, k0: int) -> tuple[list, ...]:
    """The ``repository`` composition of one step from its texts alone (nothing decoded): ``texts`` in the step's
    row layout (``len(gt_texts) * n`` captions, their ``k`` groundings each, then ``k0`` groundings per no-target
    query), ``gt_texts`` each cycled sample's ground-truth spans -> ``(cyc, nt, r_cap, r_loc, r_nt)``; ``cyc`` / ``nt``
    rows are ``(s, phi, gate, shaping)`` lists as `CycleGRPO.score` logs them: ``s`` the span-string consistency (a
    no-target row: 1 for the exact phrase without a box), ``phi`` ``no_mask_repeat - 1``, gate 1, shaping 0."""
    n_cap = len(gt_texts) * n
    first = n_cap * (1 + k)
    caps = texts[:n_cap]
    s = [
        [repository_token_consistency(texts[n_cap + i * k + j], gt_texts[i // n]) for j in range(k)]
        for i in range(n_cap)
    ]
    means = [sum(row) / k for row in s]
    r_cap = [released_caption_reward(m, t) for m, t in zip(means, caps)]  # on the whole response, think part too
    r_loc = [
        [repository_grounding_reward(v, means[i], texts[n_cap + i * k + j]) for j, v in enumerate(s[i])]
        for i in range(n_cap)
    ]

    def row(s_row: list[float], rows: Sequence[str]) -> tuple[list, ...]:
        return s_row, [repository_no_mask_repeat(t) - 1.0 for t in rows], [1.0] * len(rows), [0.0] * len(rows)

    cyc = [row(s[i], texts[n_cap + i * k : n_cap + (i + 1) * k]) for i in range(n_cap)]
    nt_texts = [texts[u : u + k0] for u in range(first, len(texts), k0)]
    nt = [row([float(repository_no_target_check(t) == 1.0) for t in ts], ts) for ts in nt_texts]
    r_nt = [[repository_no_target_reward(t) for t in ts] for ts in nt_texts]
    return cyc, nt, r_cap, r_loc, r_nt


def check_side_weights(lambda_cap: float, lambda_loc: float, mode: str) -> None:
    """Clear errors for the two loss weights (finite, >= 0; the full cycle needs one of them > 0)."""
    for name, v in (("lambda_cap", lambda_cap), ("lambda_loc", lambda_loc)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"--model.method.init_args.{name} must be a finite number >= 0 (the weight of that side's token-mean "
                f"loss; default 0.5), got {v!r}"
            )
    if mode == "cycle" and lambda_cap + lambda_loc <= 0:
        raise ValueError(
            "--model.method.init_args.lambda_cap and lambda_loc are both 0: nothing would train; give one a positive "
            "weight, or use --model.method.init_args.mode caption / localization for a one-sided ablation"
        )


def loss_side_weights(mode: str, lambda_cap: float, lambda_loc: float) -> tuple[float, float]:
    """(caption side, grounding side) weights of the loss: ``(lambda_cap, lambda_loc)`` for the full cycle, ``(1, 0)``
    for the caption-only ablation, ``(0, 1)`` for the localization-only one."""
    if mode == "caption":
        return 1.0, 0.0
    if mode == "localization":
        return 0.0, 1.0
    return float(lambda_cap), float(lambda_loc)


def side_ids(n_rows: int, n_captions: int) -> torch.Tensor:
    """[n_rows] long: ``CAPTION_SIDE`` (0) for the first ``n_captions`` rows (the step's captions), else
    ``LOCALIZATION_SIDE`` (1) (the cycle's groundings, then the no-target queries' groundings)."""
    ids = torch.full((n_rows,), LOCALIZATION_SIDE, dtype=torch.long)
    ids[:n_captions] = CAPTION_SIDE
    return ids
