"""The `Rollout` record: what one rollout produced (prompt and completion ids, masks, the visual inputs, group ids),
passed from the rollout engine to the rewards, the advantages and the update engine; and row operations on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class Rollout:
    """What one rollout produced for ``B`` prompts x ``G`` completions (rows grouped by prompt).

    Shapes: ``prompt_ids`` / ``prompt_mask`` [B*G, P] (left-padded), ``completion_ids`` / ``completion_mask``
    [B*G, T] (right-padded; mask is 1 up to and including EOS), ``pixel_values`` [sum of patches, D] for the B*G rows,
    ``image_grid_thw`` [B*G, 3], ``texts`` B*G decoded completions, ``input_wh`` B*G frames of the boxes the model writes (model-input sizes, or
    (1000, 1000) for a model of relative coordinates: `box_frame`),
    ``prompt_mm_types`` [B*G, P] the processor's ``mm_token_type_ids`` (1 on image tokens): without them the forward
    falls back to 1-D positions and the training log-probs would not be those of the rollout's mRoPE positions.
    Video rollouts keep their clips in the same two fields (``pixel_values`` = the processor's
    ``pixel_values_videos``, ``image_grid_thw`` = its ``video_grid_thw``) and set ``second_per_grid_ts`` [B*G], the
    seconds per temporal patch that temporal mRoPE needs; `rows` hands the model the video keys.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    texts: list[str]
    input_wh: list[tuple[int, int]]
    prompt_mm_types: torch.Tensor | None = None
    group_size: int = 1
    """Completions per prompt in this rollout (rows ``i*G .. i*G+G-1`` share prompt ``i``)."""
    group_ids: torch.Tensor | None = None
    """[N] the advantage group of each row (a method's plan decides; GRPO: one group per prompt)."""
    parent_ids: list[int | None] | None = None
    """Per row, the row of an earlier rollout it continues (nested rollouts), else ``None``."""
    second_per_grid_ts: torch.Tensor | None = None
    """[B*G] seconds per temporal patch of each row's video; ``None`` for image rollouts."""
    samples: list[Any] | None = None
    """The samples the rows answer, one per group, when the method's rollout replaced some of the batch's (EvolvedGRPO's
    in-step evolution: a converged group re-rolled on an edited version); the module then scores, updates and reports
    against these. ``None``: the batch's own samples."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the method's rollout measured on the way (e.g. the first try's accuracies before a re-roll), for its logs."""

    @property
    def is_video(self) -> bool:
        return self.second_per_grid_ts is not None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def patch_offsets(self) -> torch.Tensor:
        """[B*G + 1] start of each row's patches inside ``pixel_values``."""
        counts = self.image_grid_thw.prod(dim=-1)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def row_pixels(self, idx: Sequence[int]) -> torch.Tensor:
        """The patches of rows ``idx``, in that order ([sum of their patches, D])."""
        offsets = self.patch_offsets()
        return torch.cat([self.pixel_values[offsets[i] : offsets[i + 1]] for i in idx])

    def rows(self, index: Sequence[int] | slice) -> dict[str, torch.Tensor]:
        """Model inputs (ids, mask, pixels, grid) for a subset of rows: a micro-batch."""
        idx = list(range(self.prompt_ids.shape[0]))[index] if isinstance(index, slice) else list(index)
        pixels = self.row_pixels(idx)
        out = {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx]}
        if self.is_video:
            out.update(
                pixel_values_videos=pixels,
                video_grid_thw=self.image_grid_thw[idx],
                second_per_grid_ts=self.second_per_grid_ts[idx],
            )
        else:
            out.update(pixel_values=pixels, image_grid_thw=self.image_grid_thw[idx])
        if self.prompt_mm_types is not None:
            types = torch.cat([self.prompt_mm_types, torch.zeros_like(self.completion_ids)], dim=1)
            out["mm_token_type_ids"] = types[idx]
        return out


def take_rows(ro: Rollout, index: Sequence[int], group_size: int | None = None) -> Rollout:
    """The rows ``index`` of a rollout, in that order (their pixels, group ids and parent ids with them), as a rollout
    of ``group_size`` completions per prompt (default: the input's)."""
    idx = list(index)
    return replace(
        ro,
        prompt_ids=ro.prompt_ids[idx],
        prompt_mask=ro.prompt_mask[idx],
        completion_ids=ro.completion_ids[idx],
        completion_mask=ro.completion_mask[idx],
        pixel_values=ro.row_pixels(idx),
        image_grid_thw=ro.image_grid_thw[idx],
        texts=[ro.texts[i] for i in idx],
        input_wh=[ro.input_wh[i] for i in idx],
        prompt_mm_types=None if ro.prompt_mm_types is None else ro.prompt_mm_types[idx],
        group_size=ro.group_size if group_size is None else group_size,
        group_ids=None if ro.group_ids is None else ro.group_ids[idx],
        parent_ids=None if ro.parent_ids is None else [ro.parent_ids[i] for i in idx],
        second_per_grid_ts=None if ro.second_per_grid_ts is None else ro.second_per_grid_ts[idx],
        info=dict(ro.info),
    )


def concat_rollouts(parts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """One `Rollout` of the rows of several (a nested method's levels): prompts left-padded to the longest prompt,
    completions right-padded to the longest completion; group ids and parent ids travel with their rows. The result's
    ``group_size`` is 1 (its rows no longer come in equal groups of one prompt)."""

    def left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    if len({r.is_video for r in parts}) > 1:
        raise ValueError("concat_rollouts: the rollouts mix image and video rows; one rollout holds one kind")
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)
    mm = [r.prompt_mm_types for r in parts]
    return Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids, P, pad_token_id) for r in parts]),
        prompt_mask=torch.cat([left(r.prompt_mask, P, 0) for r in parts]),
        completion_ids=torch.cat([right(r.completion_ids, T, pad_token_id) for r in parts]),
        completion_mask=torch.cat([right(r.completion_mask, T, 0) for r in parts]),
        pixel_values=torch.cat([r.pixel_values for r in parts]),
        image_grid_thw=torch.cat([r.image_grid_thw for r in parts]),
        texts=[t for r in parts for t in r.texts],
        input_wh=[wh for r in parts for wh in r.input_wh],
        prompt_mm_types=None if any(m is None for m in mm) else torch.cat([left(m, P, 0) for m in mm]),
        group_size=1,
        group_ids=torch.cat([r.group_ids for r in parts]),
        parent_ids=[p for r in parts for p in (r.parent_ids or [None] * len(r.texts))],
        second_per_grid_ts=torch.cat([r.second_per_grid_ts for r in parts]) if parts[0].is_video else None,
    )


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """[N, T] int mask: 1 up to and including the first EOS of each row, 0 after it."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    # positions strictly after the first EOS: cumulative count of EOS before this position > 0
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after).long()
