"""CycleGRPO's mask regions (``--model.method.init_args.region_space mask``): regions written as mask tokens.

A region is a bool pixel mask of the sample's image and its text is one mask-token span per object,
``<|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>`` (docs/mask_tokens.md), encoded and decoded by a mask tokenizer
loaded once from ``--model.method.init_args.mask_tokenizer`` (a toy tokenizer folder: ``config.json`` +
``model.safetensors``; rebuild it with ``python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer``).

Per sample (`MaskRegions`, cached by the sample object for the step):

- one ``space.for_image(sample.image)``: the token-mode space bound to its image, shared by the captioning prompt,
  the N captions' N x K groundings and the no-target groundings (its decode cache holds the codes they repeat);
- the ground truth, first found of: the sample's exact mask (``meta["mask"]``: GRES records,
  ``datamodules/cycle_seg.py``); its target's mask tokens (``meta["mask_codes"]``: the released RL parquet's rows,
  decoded on the image; ``[]`` is no target); the toy world's exact visible target mask
  (``core.toy.masks.target_mask(meta)``, resized to the sample's image when a data module downscaled it); the filled
  rectangles of its boxes; a sample without any of these (a no-target query) is ``NO_TARGET``;
- the captioning prompt shows the ground truth's span: the row's own codes when ``meta["mask_codes"]`` holds them
  (the parquet's prompt and answer are those codes, so the token reward compares against them, not a re-encoding of
  their decoded mask), else the tokenizer's two codes of the mask, prompted with its tight box;
- a grounding's region is the union of the decoded spans of its answer part (``raw_caption``); captions lose their
  mask tokens before they are grounded (``caption_text``; a caption that writes one pays the leak in ``Phi_cap``);
- consistency ``s`` (``mask_reward``, ``core.regions.mask_rewards.mask_consistency``): ``tokens`` (default, the
  released repository's): 1.0 when the answer's codes equal the ground truth's, 0.4 when only the first does, 0
  otherwise (several spans: the best match of each / max(#pred, #gt)); ``iou`` (paper 004's alternative): the
  decoded spans matched one-to-one to the exact mask by IoU, ``sum / max(#pred, 1)``. An answer with no readable
  span, or a no-target query, scores with the region spaces' no-target table (1 for "no target" against no target,
  0 otherwise), so junk never counts as a rejection.

The ceiling of ``iou`` is the tokenizer's round-trip IoU (0.942 for the toy tokenizer, experiments/mask_tokenizer.md):
a perfect grounder writes the ground truth's own codes, which decode to an approximation of the exact mask.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.regions import NO_TARGET, MaskSpace, region_space
from core.regions.mask_rewards import MASK_CONSISTENCIES, mask_consistency
from core.regions.mask_tokens import format_mask
from lightning_modules.methods.cycle_rewards import raw_caption

__all__ = ["MASK_REWARDS", "REBUILD", "MaskRegions", "gt_pixel_mask", "load_mask_codec", "lookalike_masks"]

MASK_REWARDS = MASK_CONSISTENCIES
"""``--model.method.init_args.mask_reward``: ``tokens`` (code match 1 / 0.4 / 0) or ``iou`` (decoded mask IoU)."""
REBUILD = "python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer"
_FLAG = "--model.method.init_args.mask_tokenizer"


def load_mask_codec(path: str | None):
    """The mask tokenizer of ``region_space: mask`` from its folder (the toy tokenizer's format), with errors that
    name the flag and the rebuild command."""
    if not path:
        raise ValueError(
            f"--model.method.init_args.region_space mask writes regions as mask tokens and needs a mask tokenizer: set "
            f"{_FLAG} to its folder (e.g. checkpoints/toy-mask-tokenizer, built by `{REBUILD}`)"
        )
    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{_FLAG} {str(path)!r}: no mask tokenizer there (config.json + model.safetensors); build the toy one "
            f"with `{REBUILD}` (seeded, about 4 minutes on one CPU core)"
        )
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    return ToyMaskTokenizer.load(folder)


def _fit(mask: np.ndarray, w: int, h: int) -> np.ndarray:
    """``mask`` at the sample's image size (a data module that downscaled the image: nearest, as labels resize)."""
    if mask.shape != (h, w):
        mask = np.asarray(Image.fromarray(mask).resize((w, h), Image.NEAREST), dtype=bool)
    return mask


def gt_pixel_mask(sample, decode: Callable[[tuple[int, int]], np.ndarray] | None = None) -> np.ndarray:
    """``sample``'s ground-truth target as a bool ``[H, W]`` mask of its image (module docstring): ``meta["mask"]``
    (an exact mask), else the union of ``meta["mask_codes"]`` decoded by ``decode`` (codes -> mask on this image),
    else the toy scene's exact visible target mask when ``meta`` holds its objects, else its boxes filled; all False
    without any (no target)."""
    w, h = sample.size
    meta = getattr(sample, "meta", None) or {}
    if meta.get("mask") is not None:
        return _fit(np.asarray(meta["mask"], dtype=bool), w, h)
    if meta.get("mask_codes") is not None:
        union = np.zeros((h, w), dtype=bool)
        if meta["mask_codes"] and decode is None:
            raise ValueError(
                f"{getattr(sample, 'source', sample.sample_id)}: the sample's target is given as mask tokens "
                "(meta['mask_codes']); decoding them needs the mask tokenizer: gt_pixel_mask(sample, decode=...)"
            )
        for pair in meta["mask_codes"]:
            union |= _fit(np.asarray(decode(tuple(pair)), dtype=bool), w, h)
        return union
    if not len(sample.boxes):
        return np.zeros((h, w), dtype=bool)
    if meta.get("objects") and "height" in meta and "width" in meta:
        from core.toy.masks import target_mask

        mask = _fit(target_mask(meta), w, h)
        if mask.any():
            return mask
    mask = np.zeros((h, w), dtype=bool)
    for x1, y1, x2, y2 in sample.boxes:
        xa, ya = max(int(round(float(x1))), 0), max(int(round(float(y1))), 0)
        mask[ya : max(int(round(float(y2))), ya + 1), xa : max(int(round(float(x2))), xa + 1)] = True
    return mask


def lookalike_masks(sample) -> list[np.ndarray]:
    """The exact visible masks of the scene's other objects sharing the target's shape or colour (as
    ``cycle_rewards.image_lookalikes`` picks their boxes); none for data without ``meta.objects``."""
    meta = getattr(sample, "meta", None) or {}
    objects = meta.get("objects") or []
    target = next((o for o in objects if o.get("role") == "target"), None)
    if target is None or "height" not in meta:
        return []
    from core.toy.masks import object_masks

    picked = [
        i
        for i, o in enumerate(objects)
        if o is not target and (o.get("shape") == target.get("shape") or o.get("colour") == target.get("colour"))
    ]
    if not picked:
        return []
    masks = object_masks(meta)
    w, h = sample.size
    out = []
    for i in picked:
        m = masks[i]
        if m.shape != (h, w):
            m = np.asarray(Image.fromarray(m).resize((w, h), Image.NEAREST), dtype=bool)
        out.append(m)
    return out


class _Entry:
    __slots__ = ("codes", "gt", "sample", "space")

    def __init__(self, sample, space: MaskSpace):
        self.sample, self.space = sample, space
        self.gt: Any = None
        self.codes: list[tuple[int, int]] | None = None


class MaskRegions:
    """The mask tokenizer, the token-mode space and, per sample, its bound space, ground truth and ground-truth codes
    (module docstring)."""

    CACHE = 64
    """Samples whose bound space (and its decoded masks) is kept; emptied when full, so a long run holds at most this
    many (a step's or an eval batch's samples; a larger batch only recomputes)."""

    def __init__(self, mask_tokenizer: str | None, mask_reward: str = "tokens"):
        if mask_reward not in MASK_REWARDS:
            raise ValueError(
                f"--model.method.init_args.mask_reward must be one of {MASK_REWARDS} (tokens: code match 1 / 0.4 / 0; "
                f"iou: decoded mask IoU), got {mask_reward!r}"
            )
        self.reward = mask_reward
        self.codec = load_mask_codec(mask_tokenizer)
        self.space: MaskSpace = region_space("mask", codec=self.codec)
        self._cache: dict[int, _Entry] = {}
        self._checked: set[int] = set()

    def check_processor(self, processor) -> None:
        """Raise (once per processor) when the policy's tokenizer lacks the mask tokens."""
        if id(processor) not in self._checked:
            from lightning_modules.models.mask_tokenizer.vocab import mask_token_ids

            mask_token_ids(processor)  # names --model.policy.mask_tokens true
            self._checked.add(id(processor))

    def _entry(self, sample) -> _Entry:
        entry = self._cache.get(id(sample))
        if entry is None or entry.sample is not sample:  # the entry holds the sample, so its id is not reused
            if len(self._cache) >= self.CACHE:
                self._cache.clear()
            entry = self._cache[id(sample)] = _Entry(sample, self.space.for_image(sample.image))
        return entry

    def bound(self, sample) -> MaskSpace:
        """The token-mode space bound to ``sample``'s image (one per sample)."""
        return self._entry(sample).space

    def gt(self, sample) -> Any:
        """The ground-truth region: a read-only bool pixel mask, or ``NO_TARGET``."""
        entry = self._entry(sample)
        if entry.gt is None:
            entry.gt = entry.space.normalize(gt_pixel_mask(sample, decode=entry.space.decode))
        return entry.gt

    def gt_codes(self, sample) -> list[tuple[int, int]]:
        """The ground truth's code pairs (``[]`` for no target)."""
        entry = self._entry(sample)
        if entry.codes is None:
            entry.codes = entry.space.codes(self.region_text(sample))
        return entry.codes

    def region_text(self, sample) -> str:
        """The ground truth as the captioning prompt shows it (and a perfect grounding writes it): its span; the
        sample's own spans when ``meta["mask_codes"]`` gives them (``, ``-separated, as the released prompts list
        several)."""
        codes = (getattr(sample, "meta", None) or {}).get("mask_codes")
        if codes:
            return ", ".join(format_mask(tuple(c)) for c in codes)
        return self.bound(sample).serialize(self.gt(sample))

    def predicted(self, sample, text: str) -> Any:
        """The region a grounding answers: the union of its answer part's decoded spans, ``NO_TARGET``, or None."""
        return self.bound(sample).parse(raw_caption(text))

    def consistency(self, sample, gt: Any, pred: Any, text: str) -> float:
        """``s`` of a grounding ``text`` (its region ``pred``, from `predicted`) against ``gt`` (the sample's ground
        truth, or ``NO_TARGET`` for a no-target query): the mask consistency ``mask_reward`` when both hold masks,
        else the no-target table."""
        space = self.bound(sample)
        if gt is NO_TARGET or pred is None or pred is NO_TARGET:
            return space.consistency(gt, pred)
        pred_codes = space.codes(raw_caption(text))
        return mask_consistency(pred_codes, self.gt_codes(sample), self.reward, decode=space.decode, gt_masks=[gt])
