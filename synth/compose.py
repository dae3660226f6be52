"""Canvas geometry, exact paste-back of the foreground, and the audit of every result.

Coordinates: a box is ``[x1, y1, x2, y2]`` in pixels with pixel ``(i, j)`` covering ``[j, j+1) x [i, i+1)``, the
convention of COCO / RefCOCO and VLM-R1. The input image (``src_w x src_h``) is resized by ``scale`` to
``img_w x img_h`` and placed at ``(off_x, off_y)`` on a canvas of ``canvas_w x canvas_h``; every box follows the same
map ``x' = x * img_w / src_w + off_x`` (and likewise for y), so a box stays on its object exactly. With ``scale = 1``
(the default) the foreground is the input's own pixels, bit for bit.

Pure numpy / PIL: no torch, safe to import in the HTTP process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

Box = Sequence[float]


@dataclass(frozen=True)
class CanvasGeometry:
    """Where the (resized) input image sits on the output canvas. All sizes in pixels."""

    src_w: int
    src_h: int
    img_w: int
    """Width of the input after resizing by ``scale`` (``src_w`` when ``scale == 1``)."""
    img_h: int
    canvas_w: int
    canvas_h: int
    off_x: int
    """Left edge of the placed image on the canvas."""
    off_y: int

    @classmethod
    def from_params(
        cls,
        src_w: int,
        src_h: int,
        scale: float = 1.0,
        extend: float = 0.0,
        width: int | None = None,
        height: int | None = None,
        offset_x: int | None = None,
        offset_y: int | None = None,
    ) -> CanvasGeometry:
        """Resolve canvas parameters (see ``synth.api.CanvasParams``) against an input of ``src_w x src_h``.

        The canvas is ``width x height`` when given, else the resized image grown by ``extend`` (a fraction of its
        size, split evenly around it unless offsets are given). The image must fit inside the canvas: outpainting
        extends an image, it never crops one. Raises ``ValueError`` naming the parameter at fault.
        """
        if src_w < 1 or src_h < 1:
            raise ValueError(f"image must be at least 1 x 1 pixels, got {src_w} x {src_h}")
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"canvas.scale must be a positive number, got {scale}")
        if not (extend >= 0 and math.isfinite(extend)):
            raise ValueError(f"canvas.extend must be >= 0, got {extend}")
        img_w, img_h = max(1, round(src_w * scale)), max(1, round(src_h * scale))
        canvas_w = width if width is not None else img_w + round(img_w * extend)
        canvas_h = height if height is not None else img_h + round(img_h * extend)
        if canvas_w < img_w or canvas_h < img_h:
            raise ValueError(
                f"canvas {canvas_w} x {canvas_h} is smaller than the resized image {img_w} x {img_h}: "
                "canvas.width / canvas.height must be at least the image size times canvas.scale"
            )
        off_x = offset_x if offset_x is not None else (canvas_w - img_w) // 2
        off_y = offset_y if offset_y is not None else (canvas_h - img_h) // 2
        if not (0 <= off_x <= canvas_w - img_w):
            raise ValueError(
                f"canvas.offset_x must be in [0, {canvas_w - img_w}] so the image stays on the canvas, got {off_x}"
            )
        if not (0 <= off_y <= canvas_h - img_h):
            raise ValueError(
                f"canvas.offset_y must be in [0, {canvas_h - img_h}] so the image stays on the canvas, got {off_y}"
            )
        return cls(src_w, src_h, img_w, img_h, canvas_w, canvas_h, off_x, off_y)

    @property
    def is_identity(self) -> bool:
        return (self.img_w, self.img_h, self.canvas_w, self.canvas_h) == (
            self.src_w,
            self.src_h,
            self.src_w,
            self.src_h,
        )

    def transform_box(self, box: Box) -> list[float]:
        """Map a box from input pixels to canvas pixels (same scale and offset as the image)."""
        sx, sy = self.img_w / self.src_w, self.img_h / self.src_h
        x1, y1, x2, y2 = (float(v) for v in box)
        return [x1 * sx + self.off_x, y1 * sy + self.off_y, x2 * sx + self.off_x, y2 * sy + self.off_y]

    def image_region(self) -> tuple[slice, slice]:
        """(rows, cols) slices of the canvas covered by the placed image."""
        return slice(self.off_y, self.off_y + self.img_h), slice(self.off_x, self.off_x + self.img_w)


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """uint8 ``[H, W, 3]`` view of an image in RGB (other modes are converted first)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)


def place_image(image: Image.Image, geom: CanvasGeometry, fill: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """The canvas ``[canvas_h, canvas_w, 3]`` with the resized input placed on it; the extension is ``fill``."""
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    if (geom.img_w, geom.img_h) != (geom.src_w, geom.src_h):
        rgb = rgb.resize((geom.img_w, geom.img_h), Image.Resampling.LANCZOS)
    canvas = np.empty((geom.canvas_h, geom.canvas_w, 3), dtype=np.uint8)
    canvas[...] = np.asarray(fill, dtype=np.uint8)
    rows, cols = geom.image_region()
    canvas[rows, cols] = np.asarray(rgb, dtype=np.uint8)
    return canvas


def box_pixel_bounds(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """Integer pixel bounds ``(c0, r0, c1, r1)`` (half-open) of every pixel a box touches, clipped to the image.

    A pixel that the box covers only partly counts as inside: the kept foreground errs on the side of keeping more.
    """
    x1, y1, x2, y2 = box
    c0, r0 = max(0, math.floor(x1)), max(0, math.floor(y1))
    c1, r1 = min(width, math.ceil(x2)), min(height, math.ceil(y2))
    return c0, r0, max(c0, c1), max(r0, r1)


def boxes_mask(boxes: Sequence[Box], width: int, height: int) -> np.ndarray:
    """bool ``[height, width]``: True on every pixel touched by any box."""
    mask = np.zeros((height, width), dtype=bool)
    for box in boxes:
        c0, r0, c1, r1 = box_pixel_bounds(box, width, height)
        mask[r0:r1, c0:c1] = True
    return mask


def mask_to_canvas(mask: np.ndarray, geom: CanvasGeometry) -> np.ndarray:
    """Place an image-sized bool mask (``[img_h, img_w]``) on the canvas; False on the extension."""
    out = np.zeros((geom.canvas_h, geom.canvas_w), dtype=bool)
    rows, cols = geom.image_region()
    out[rows, cols] = mask
    return out


def paste_back(painted: np.ndarray, reference: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``painted`` with the ``keep`` pixels replaced by ``reference``'s, exactly. All arrays canvas-sized."""
    if painted.shape != reference.shape or painted.shape[:2] != keep.shape:
        raise ValueError(f"shape mismatch: painted {painted.shape}, reference {reference.shape}, keep {keep.shape}")
    out = np.array(painted, dtype=np.uint8, copy=True)
    out[keep] = reference[keep]
    return out


@dataclass(frozen=True)
class Audit:
    """Outcome of :func:`audit_result`; ``passed`` only when every check holds."""

    passed: bool
    foreground_pixels: int
    mismatched_pixels: int
    boxes_inside: bool
    boxes_nonempty: bool
    size_ok: bool
    message: str


def audit_result(
    output: np.ndarray,
    reference: np.ndarray,
    keep: np.ndarray,
    boxes: Sequence[Box],
    canvas_w: int,
    canvas_h: int,
) -> Audit:
    """Check a finished image: canvas-sized, foreground bit-identical to the reference, every box inside and non-empty."""
    problems = []
    size_ok = output.shape == (canvas_h, canvas_w, 3) and output.dtype == np.uint8
    if not size_ok:
        problems.append(f"output is {output.shape} {output.dtype}, expected ({canvas_h}, {canvas_w}, 3) uint8")
    n_fg = int(keep.sum())
    mismatched = n_fg
    if size_ok and reference.shape == output.shape and keep.shape == output.shape[:2]:
        mismatched = int(np.any(output[keep] != reference[keep], axis=-1).sum())
    if mismatched:
        problems.append(f"{mismatched} of {n_fg} foreground pixels differ from the input")
    inside = all(0 <= b[0] and 0 <= b[1] and b[2] <= canvas_w and b[3] <= canvas_h for b in boxes)
    if not inside:
        problems.append(f"a box leaves the {canvas_w} x {canvas_h} canvas: {[list(b) for b in boxes]}")
    nonempty = len(boxes) > 0 and all(b[2] > b[0] and b[3] > b[1] for b in boxes)
    if not nonempty:
        problems.append("no boxes, or an empty box")
    passed = size_ok and mismatched == 0 and inside and nonempty
    return Audit(passed, n_fg, mismatched, inside, nonempty, size_ok, "ok" if passed else "; ".join(problems))
