"""The mask tokenizer interface: ``(image, mask, box) -> (c1, c2)`` and ``((c1, c2), image) -> mask``.

A mask tokenizer is what makes a segmentation mask two tokens of the policy's vocabulary (CycleGRPO, paper 002: the
VQ-SAM2 "SAMTok" tokenizer). Its contract here:

- ``encode(image, mask, box=None) -> (c1, c2)``: raw per-codebook indices, each in ``0..codebook_size - 1``
  (``core.regions.mask_tokens.format_mask`` writes them as text, offsetting the second by 256). ``box`` is the
  prompt box ``(x1, y1, x2, y2)`` in pixels (``x1 <= x < x2``); None takes the mask's tight box, as the released
  tokenizer is always given one.
- ``decode((c1, c2), image) -> bool [H, W]`` on the image's pixels. Decoding takes no box: the two codes say which
  object (roughly where, what shape) and the image says where its edges are, as SAM 2's decoder does.
- ``encode_batch`` / ``decode_batch``: the same over lists (one forward for the batch).

Images are uint8 ``[H, W, 3]`` numpy arrays or PIL images; masks bool ``[H, W]`` of the same size. Implementations:
``ToyMaskTokenizer`` (toy.py, trained here in minutes) and ``VQSam2MaskTokenizer`` (vq_sam2.py, the released
architecture on transformers' SAM 2). Both satisfy ``core.regions.masks.MaskCodec``, which is all the mask region
space needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Codes", "MaskTokenizer", "as_image", "as_mask", "tight_box"]

Codes = tuple[int, int]


def as_image(image: Any) -> np.ndarray:
    """uint8 ``[H, W, 3]`` from a PIL image or an array (grey images are repeated to RGB)."""
    arr = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"a mask tokenizer takes RGB images [H, W, 3], got shape {arr.shape}")
    return arr.astype(np.uint8, copy=False)


def as_mask(mask: Any, shape: tuple[int, int]) -> np.ndarray:
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != shape:
        raise ValueError(f"the mask must be a bool [H, W] = {list(shape)} array like its image, got {mask.shape}")
    return mask


def tight_box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    """``(x1, y1, x2, y2)`` of the mask's pixels (exclusive ends), None for an empty mask."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if rows.size == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


class MaskTokenizer(ABC):
    """Two codes per mask (module docstring). Subclasses implement the batched forms."""

    num_codebooks: int = 2
    codebook_size: int = 256

    def encode(self, image: Any, mask: Any, box: Sequence[float] | None = None) -> Codes:
        """The two raw codes of ``mask`` on ``image`` (prompted with ``box``, default the mask's tight box)."""
        return self.encode_batch([image], [mask], [box])[0]

    def decode(self, codes: Sequence[int], image: Any) -> np.ndarray:
        """The bool ``[H, W]`` mask that ``codes`` stand for on ``image``."""
        return self.decode_batch([codes], [image])[0]

    @abstractmethod
    def encode_batch(
        self, images: Sequence[Any], masks: Sequence[Any], boxes: Sequence[Sequence[float] | None] | None = None
    ) -> list[Codes]: ...

    @abstractmethod
    def decode_batch(self, codes: Sequence[Sequence[int]], images: Sequence[Any]) -> list[np.ndarray]: ...

    def check_codes(self, codes: Sequence[int]) -> tuple[int, ...]:
        """``codes`` as ints, each in ``[0, codebook_size)``; raises ValueError naming the bad one."""
        out = tuple(int(c) for c in codes)
        if len(out) != self.num_codebooks or not all(0 <= c < self.codebook_size for c in out):
            raise ValueError(
                f"a mask is {self.num_codebooks} codes, each in [0, {self.codebook_size}) (raw, no text offset); "
                f"got {tuple(codes)!r}"
            )
        return out
