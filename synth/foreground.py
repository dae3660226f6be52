"""Foreground masks inside the ground-truth boxes: what the painter must leave alone.

A masker maps ``(image uint8 [H, W, 3], boxes)`` to a bool ``[H, W]`` mask, True on kept pixels. Whatever a backend
returns is intersected with the boxes, so nothing outside a box is ever kept, and the server pastes the kept pixels back
exactly after painting (``synth.compose``). Backends, picked by name in the server config (``foreground.name``):

- ``box``: every pixel a box touches (the default; labels stay valid whatever the painter does).
- ``grabcut``: OpenCV GrabCut seeded by each box (no weights). Falls back to the whole box when GrabCut degenerates:
  a box too small, too close to the full image to leave background samples, or a result covering less than
  ``min_fraction`` or more than ``max_fraction`` of the box.
- ``sam2``: SAM 2 through transformers' ``Sam2Model``, prompted with the boxes, from a local weights folder; see
  :class:`Sam2Masker` (the default of ``configs/synth/sdxl.yaml``).
- ``ben2``: the BEN2 segmentation model (the paper's choice), loaded from files copied by hand; see :class:`Ben2Masker`.

Register another backend with ``@register_masker("name")``; the worker process builds it with ``build_masker`` and
then calls its ``load()``, when it has one, before it reports ready (so a masker's constructor only checks its
arguments, and missing weights fail the worker's start, not its first job).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from synth.compose import Box, box_pixel_bounds, boxes_mask


class ForegroundMasker(Protocol):
    name: str

    def __call__(self, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
        """bool ``[H, W]`` mask of the pixels to keep, inside the boxes."""
        ...


MASKERS: dict[str, Callable[..., ForegroundMasker]] = {}


def register_masker(name: str):
    def deco(cls):
        MASKERS[name] = cls
        cls.name = name
        return cls

    return deco


def build_masker(name: str = "box", **kwargs: Any) -> ForegroundMasker:
    """Build a registered masker by name; ``kwargs`` are its constructor arguments (the rest of the config block)."""
    if name not in MASKERS:
        raise ValueError(f"foreground.name must be one of {sorted(MASKERS)}, got {name!r}")
    return MASKERS[name](**kwargs)


def load_masker(masker: ForegroundMasker) -> ForegroundMasker:
    """Load the masker's weights now, when it has any (a ``load()`` method); returns the masker."""
    load = getattr(masker, "load", None)
    if callable(load):
        load()
    return masker


def keep_masks(
    masker: ForegroundMasker, images: Sequence[np.ndarray], boxes: Sequence[Sequence[Box]]
) -> list[np.ndarray]:
    """`keep_mask` of several images: in one call (``mask_many``) for a masker that batches, else one by one."""
    many = getattr(masker, "mask_many", None)
    masks = many(images, boxes) if callable(many) else [masker(im, bs) for im, bs in zip(images, boxes)]
    return [_inside(masker, m, im, bs) for m, im, bs in zip(masks, images, boxes)]


def keep_mask(masker: ForegroundMasker, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
    """The masker's mask, forced to bool and to lie inside the boxes."""
    return _inside(masker, masker(image, boxes), image, boxes)


def _inside(masker: ForegroundMasker, mask: Any, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
    h, w = image.shape[:2]
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (h, w):
        raise ValueError(f"masker {masker.name!r} returned a {mask.shape} mask for a {h} x {w} image")
    return mask & boxes_mask(boxes, w, h)


@register_masker("box")
class BoxMasker:
    """Keep every pixel that a box touches."""

    def __call__(self, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
        return boxes_mask(boxes, image.shape[1], image.shape[0])


@register_masker("grabcut")
class GrabCutMasker:
    """OpenCV GrabCut per box, initialised with the box as the probable foreground.

    Args:
        iterations: GrabCut iterations per box.
        margin: context around the box given to GrabCut, as a fraction of the box size (background samples come from it).
        min_side: boxes with a side shorter than this many pixels are kept whole.
        min_fraction: a result covering less than this fraction of its box falls back to the whole box.
        max_fraction: likewise for a result covering more (GrabCut found no background).
        dilate: grow the result by this many pixels (still clipped to the box) to keep the object's edge.
    """

    def __init__(
        self,
        iterations: int = 3,
        margin: float = 0.25,
        min_side: int = 8,
        min_fraction: float = 0.05,
        max_fraction: float = 0.98,
        dilate: int = 1,
    ):
        self.iterations, self.margin, self.min_side = iterations, margin, min_side
        self.min_fraction, self.max_fraction, self.dilate = min_fraction, max_fraction, dilate
        self.fallbacks = 0
        """How many boxes fell back to the whole box (for logs and tests)."""

    def __call__(self, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
        h, w = image.shape[:2]
        out = np.zeros((h, w), dtype=bool)
        for box in boxes:
            c0, r0, c1, r1 = box_pixel_bounds(box, w, h)
            m = self._one(image, c0, r0, c1, r1)
            if m is None:
                self.fallbacks += 1
                out[r0:r1, c0:c1] = True
            else:
                out |= m
        return out

    def _one(self, image: np.ndarray, c0: int, r0: int, c1: int, r1: int) -> np.ndarray | None:
        import cv2

        bw, bh = c1 - c0, r1 - r0
        if bw < self.min_side or bh < self.min_side:
            return None
        h, w = image.shape[:2]
        mx, my = max(2, round(bw * self.margin)), max(2, round(bh * self.margin))
        x0, y0, x1, y1 = max(0, c0 - mx), max(0, r0 - my), min(w, c1 + mx), min(h, r1 + my)
        if (c0 - x0) + (x1 - c1) < 2 and (r0 - y0) + (y1 - r1) < 2:
            return None  # the box fills the image: no background samples for GrabCut
        crop = np.ascontiguousarray(image[y0:y1, x0:x1])
        gc = np.zeros(crop.shape[:2], dtype=np.uint8)
        rect = (c0 - x0, r0 - y0, bw, bh)
        bgd, fgd = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
        try:
            cv2.setRNGSeed(0)
            cv2.grabCut(crop, gc, rect, bgd, fgd, self.iterations, cv2.GC_INIT_WITH_RECT)
        except cv2.error:
            return None
        fg = (gc == cv2.GC_FGD) | (gc == cv2.GC_PR_FGD)
        if self.dilate > 0 and fg.any():
            k = 2 * self.dilate + 1
            fg = cv2.dilate(fg.astype(np.uint8), np.ones((k, k), np.uint8)) > 0
        inside = np.zeros_like(fg)
        inside[r0 - y0 : r1 - y0, c0 - x0 : c1 - x0] = True
        fg &= inside
        frac = fg.sum() / float(bw * bh)
        if not (self.min_fraction <= frac <= self.max_fraction):
            return None
        out = np.zeros((h, w), dtype=bool)
        out[y0:y1, x0:x1] = fg
        return out


@register_masker("sam2")
class Sam2Masker:
    """SAM 2 (Meta, 2024) through transformers' ``Sam2Model`` / ``Sam2Processor``, prompted with the job's boxes.

    All boxes of an image go through one forward (one image encoding, one box prompt each); each box's best mask
    (``multimask_output=False``) is clipped to its box, and the image's mask is their union. A box whose mask covers
    less than ``min_fraction`` of it (SAM found nothing there) is kept whole, as GrabCut's fallback does: the labelled
    object must never be repainted.

    Weights are read from a local folder only (``from_pretrained(path, local_files_only=True)``); get them on a machine
    with internet, ``huggingface-cli download facebook/sam2.1-hiera-large --local-dir <dir>``, and set
    ``foreground.path: <dir>`` in the server config. The model loads in ``load()`` (the worker calls it at start).

    Args:
        path: folder holding ``config.json``, the weights and the processor config of a transformers SAM 2 checkpoint.
        device: torch device; the worker fills in its own device when this is None.
        dtype: ``float32``, ``bfloat16`` or ``float16``; None: ``bfloat16`` on CUDA, ``float32`` elsewhere.
        threshold: logit above which a pixel is foreground (0: SAM's own threshold).
        min_fraction: a box's mask covering less than this fraction of the box falls back to the whole box.
        dilate: grow each box's mask by this many pixels (still clipped to its box) to keep the object's edge, as
            GrabCut's ``dilate`` does (SAM's masks are upsampled from 1/4 of the model's input: edges are soft).
    """

    DTYPES = ("float32", "bfloat16", "float16")

    def __init__(
        self,
        path: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        threshold: float = 0.0,
        min_fraction: float = 0.02,
        dilate: int = 1,
    ):
        if dtype is not None and dtype not in self.DTYPES:
            raise ValueError(f"foreground.dtype must be one of {list(self.DTYPES)} or null, got {dtype!r}")
        if not 0.0 <= min_fraction < 1.0:
            raise ValueError(f"foreground.min_fraction must be in [0, 1), got {min_fraction}")
        self.path, self.device, self.dtype = path, device, dtype
        if dilate < 0:
            raise ValueError(f"foreground.dilate must be >= 0, got {dilate}")
        self.threshold, self.min_fraction, self.dilate = threshold, min_fraction, dilate
        self.fallbacks = 0
        """How many boxes fell back to the whole box (for logs and tests)."""
        self._model = self._processor = None

    def check_files(self) -> None:
        """Raise one clear error when ``path`` is no SAM 2 weights folder."""
        if not self.path or not os.path.isfile(os.path.join(self.path, "config.json")):
            raise FileNotFoundError(
                f"SAM 2 weights not found: no config.json in foreground.path={self.path!r}; on a machine with internet "
                "run `huggingface-cli download facebook/sam2.1-hiera-large --local-dir <dir>`, copy <dir> here and set "
                "foreground.path: <dir> in the server config (or use foreground.name: grabcut / box, which need no "
                "weights)"
            )

    def load(self) -> None:
        if self._model is not None:
            return
        self.check_files()
        import torch
        from transformers import Sam2Model, Sam2Processor

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        self._torch_dtype = getattr(torch, dtype)
        self._device = device
        self._processor = Sam2Processor.from_pretrained(self.path, local_files_only=True)
        model = Sam2Model.from_pretrained(self.path, local_files_only=True, dtype=self._torch_dtype)
        self._model = model.to(device).eval()

    def __call__(self, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
        return self.mask_many([image], [boxes])[0]

    def mask_many(self, images: Sequence[np.ndarray], boxes: Sequence[Sequence[Box]]) -> list[np.ndarray]:
        """The masks of several images: images with the same number of boxes share one forward (a server batch's
        jobs are masked together, not one by one); masks are upsampled on the model's device."""
        self.load()
        outs = [np.zeros(im.shape[:2], dtype=bool) for im in images]
        bounds = []
        for im, bs in zip(images, boxes):
            h, w = im.shape[:2]
            bounds.append([b for b in (box_pixel_bounds(x, w, h) for x in bs) if b[2] > b[0] and b[3] > b[1]])
        groups: dict[int, list[int]] = {}
        for i, bb in enumerate(bounds):
            if bb:
                groups.setdefault(len(bb), []).append(i)
        for idx in groups.values():
            masks = self._forward([images[i] for i in idx], [bounds[i] for i in idx])
            for i, m in zip(idx, masks):
                self._clip_to_boxes(outs[i], m, bounds[i])
        return outs

    def _forward(self, images: list[np.ndarray], bounds: list[list[tuple[int, int, int, int]]]) -> list[np.ndarray]:
        """bool ``[boxes, H, W]`` per image: one forward for images with equally many boxes. The processor's resize and
        normalisation run here, on the model's device (on the CPU they took longer than the forward itself)."""
        import torch

        inputs, sizes = self._inputs(images, bounds)
        with torch.inference_mode():
            pred = self._model(**inputs, multimask_output=False).pred_masks
            masks = self._processor.post_process_masks(list(pred.float()), sizes, mask_threshold=self.threshold)
        return [m[:, 0].cpu().numpy() for m in masks]

    def _inputs(self, images: list[np.ndarray], bounds: list[list[tuple[int, int, int, int]]]):
        """``Sam2Processor``'s inputs, computed on the model's device: each image resized to the processor's square
        input (bilinear, antialiased), scaled to [0, 1] and normalised by its mean / std, and the box prompts mapped
        into that frame; plus the original sizes its ``post_process_masks`` takes."""
        import torch
        import torch.nn.functional as F

        ip = self._processor.image_processor
        side = (int(ip.size["height"]), int(ip.size["width"]))
        mean = torch.tensor(ip.image_mean, device=self._device).view(1, 3, 1, 1)
        std = torch.tensor(ip.image_std, device=self._device).view(1, 3, 1, 1)
        pixels, boxes = [], []
        for im, bb in zip(images, bounds):
            h, w = im.shape[:2]
            x = torch.from_numpy(np.ascontiguousarray(im[..., :3])).to(self._device).permute(2, 0, 1)[None].float()
            pixels.append(F.interpolate(x, size=side, mode="bilinear", align_corners=False, antialias=True))
            sx, sy = side[1] / w, side[0] / h
            boxes.append([[c0 * sx, r0 * sy, c1 * sx, r1 * sy] for c0, r0, c1, r1 in bb])
        x = ((torch.cat(pixels) * float(ip.rescale_factor) - mean) / std).to(self._torch_dtype)
        prompts = torch.tensor(boxes, device=self._device, dtype=self._torch_dtype)
        sizes = torch.tensor([im.shape[:2] for im in images])
        return {"pixel_values": x, "input_boxes": prompts}, sizes

    def _clip_to_boxes(self, out: np.ndarray, masks: np.ndarray, bounds: list[tuple[int, int, int, int]]) -> None:
        for m, (c0, r0, c1, r1) in zip(masks, bounds):
            inside = m[r0:r1, c0:c1]
            if inside.sum() < self.min_fraction * inside.size:
                self.fallbacks += 1
                out[r0:r1, c0:c1] = True
            else:
                if self.dilate > 0:
                    import cv2

                    k = 2 * self.dilate + 1
                    inside = cv2.dilate(inside.astype(np.uint8), np.ones((k, k), np.uint8)) > 0
                out[r0:r1, c0:c1] |= inside


@register_masker("ben2")
class Ben2Masker:
    """BEN2 (Background Erase Network, Prama LLC) run on each box's crop, thresholded, clipped to the box.

    BEN2's code is not on PyPI. Put the two files from https://huggingface.co/PramaLLC/BEN2 on the server machine:
    ``BEN2.py`` into ``code_dir`` and ``BEN2_Base.pth`` at ``checkpoint`` (config keys ``foreground.code_dir`` and
    ``foreground.checkpoint``). The model loads on first use in the worker process, on the worker's device.

    Args:
        checkpoint: path of ``BEN2_Base.pth``.
        code_dir: directory holding ``BEN2.py`` (defines ``BEN_Base`` with ``loadcheckpoints`` and ``inference``).
        threshold: alpha above which a pixel is foreground, in [0, 1].
        margin: context around each box given to the model, as a fraction of the box size.
        device: torch device; the worker fills in its own device when this is None.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        code_dir: str | None = None,
        threshold: float = 0.5,
        margin: float = 0.1,
        device: str | None = None,
    ):
        self.checkpoint, self.code_dir = checkpoint, code_dir
        self.threshold, self.margin, self.device = threshold, margin, device
        self._model = None
        self._check_files()

    def _check_files(self) -> None:
        hint = (
            "download BEN2.py and BEN2_Base.pth from https://huggingface.co/PramaLLC/BEN2, then set "
            "foreground.code_dir to the directory holding BEN2.py and foreground.checkpoint to the .pth file "
            "in the server config (or use foreground.name: box / grabcut, which need no weights)"
        )
        if not self.checkpoint or not os.path.isfile(self.checkpoint):
            raise FileNotFoundError(f"BEN2 checkpoint not found at foreground.checkpoint={self.checkpoint!r}: {hint}")
        if not self.code_dir or not os.path.isfile(os.path.join(self.code_dir, "BEN2.py")):
            raise FileNotFoundError(f"BEN2 code not found: no BEN2.py in foreground.code_dir={self.code_dir!r}: {hint}")

    def _load(self):
        import torch

        spec = importlib.util.spec_from_file_location("BEN2", os.path.join(self.code_dir, "BEN2.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("BEN2", module)
        spec.loader.exec_module(module)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = module.BEN_Base().to(device).eval()
        model.loadcheckpoints(self.checkpoint)
        return model

    def __call__(self, image: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
        from PIL import Image

        if self._model is None:
            self._model = self._load()
        h, w = image.shape[:2]
        out = np.zeros((h, w), dtype=bool)
        for box in boxes:
            c0, r0, c1, r1 = box_pixel_bounds(box, w, h)
            mx, my = round((c1 - c0) * self.margin), round((r1 - r0) * self.margin)
            x0, y0, x1, y1 = max(0, c0 - mx), max(0, r0 - my), min(w, c1 + mx), min(h, r1 + my)
            if x1 - x0 < 2 or y1 - y0 < 2:
                out[r0:r1, c0:c1] = True
                continue
            rgba = self._model.inference(Image.fromarray(image[y0:y1, x0:x1]))
            alpha = np.asarray(rgba.convert("RGBA").resize((x1 - x0, y1 - y0)))[..., 3] / 255.0
            fg = np.zeros((h, w), dtype=bool)
            fg[y0:y1, x0:x1] = alpha > self.threshold
            out |= fg
        return out
