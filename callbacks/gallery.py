"""Drawing helpers for galleries: boxes on images, text wrapped at word boundaries, a colour key, and a sample's
lineage as one strip (original -> the version trained from epoch 1 -> ...)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from PIL import Image, ImageDraw

CHAR_W, LINE_H = 6, 12
"""PIL's default bitmap font: about 6 pixels a character, 12 a line."""

GT_COLOUR = (0, 200, 0)
PRED_COLOUR = (230, 0, 0)


def draw_boxes(image: Image.Image, boxes: Sequence[Sequence[float]], colour=GT_COLOUR, width: int = 2) -> Image.Image:
    """A copy of ``image`` with ``boxes`` ([x1, y1, x2, y2], pixels) outlined."""
    out = image.convert("RGB").copy()
    draw = ImageDraw.Draw(out)
    for b in boxes:
        x1, y1, x2, y2 = (float(v) for v in b)
        draw.rectangle([x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)], outline=colour, width=width)
    return out


def wrap(text: str, width_px: int, max_lines: int = 3) -> list[str]:
    """``text`` in lines that fit ``width_px`` pixels, broken between words (a word longer than a line is cut); at
    most ``max_lines``, the last ending in '...' when text was left out."""
    chars = max(8, width_px // CHAR_W)
    lines = textwrap.wrap(" ".join(str(text).split()), chars, break_long_words=True) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: chars - 3].rstrip() + "..."
    return lines


def colour_key(draw: ImageDraw.ImageDraw, xy: tuple[int, int], entries: Sequence[tuple[tuple[int, int, int], str]]):
    """A one-line key at ``xy``: a filled swatch of each colour followed by its meaning."""
    x, y = xy
    for colour, meaning in entries:
        draw.rectangle([x, y + 2, x + 9, y + 10], fill=colour, outline=(0, 0, 0))
        draw.text((x + 13, y), meaning, fill=(0, 0, 0))
        x += 13 + CHAR_W * len(meaning) + 12


def version_label(version: int, epoch: int, max_epochs: int | None = None) -> str:
    """What a lineage tile says. ``epoch`` is the version's (``datamodules.synthetic.Version.epoch``): the first
    (0-based, Lightning's) epoch that trains on it, since a version painted from epoch e's descriptions is swapped in
    at e's end. The swap at the last epoch's end makes a version no epoch of this run trains on: it says so."""
    if version == 0:
        return "original (from epoch 0)"
    if max_epochs is not None and max_epochs > 0 and epoch >= max_epochs:
        return f"v{version} (after the last epoch)"
    return f"v{version} (from epoch {epoch})"


def lineage_strip(versions, query: str = "", tile: int = 224, max_epochs: int | None = None) -> Image.Image:
    """One row: every version of a sample (``datamodules.synthetic.Version``) with its boxes, captioned.

    Under each tile: which epoch first trains on it (:func:`version_label`) and the description that made it, wrapped
    at word boundaries; under the row, the question and the colour key.
    """
    desc_lines = 3
    caption_h = LINE_H * (1 + desc_lines) + 4
    footer = wrap(f"question: {query}", tile * len(versions) - 8, max_lines=2)
    height = tile + caption_h + LINE_H * (len(footer) + 1) + 8
    strip = Image.new("RGB", (tile * len(versions), height), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    for i, v in enumerate(versions):
        with Image.open(v.image_path) as im:
            img = draw_boxes(im, v.boxes)
        scale = tile / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
        strip.paste(img, (i * tile, 0))
        draw.text((i * tile + 4, tile + 2), version_label(v.version, v.epoch, max_epochs), fill=(0, 0, 0))
        if v.description:
            for k, line in enumerate(wrap(v.description, tile - 8, desc_lines)):
                draw.text((i * tile + 4, tile + 2 + LINE_H * (k + 1)), line, fill=(80, 80, 80))
    y = tile + caption_h
    for k, line in enumerate(footer):
        draw.text((4, y + LINE_H * k), line, fill=(0, 0, 0))
    colour_key(draw, (4, y + LINE_H * len(footer) + 2), [(GT_COLOUR, "ground-truth boxes (foreground kept)")])
    return strip
