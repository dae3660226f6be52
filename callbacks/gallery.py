"""Drawing helpers for galleries: boxes on images, and a sample's lineage as one strip (original -> epoch 1 -> ...)."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw

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


def lineage_strip(versions, query: str = "", tile: int = 224) -> Image.Image:
    """One row: every version of a sample (``datamodules.synthetic.Version``) with its boxes, captioned.

    Caption under each tile: ``v<k> e<epoch>`` and the start of the description that made it.
    """
    caption_h = 28
    strip = Image.new("RGB", (tile * len(versions), tile + caption_h + 14), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    draw.text((4, tile + caption_h), query[:80], fill=(0, 0, 0))
    for i, v in enumerate(versions):
        with Image.open(v.image_path) as im:
            img = draw_boxes(im, v.boxes)
        scale = tile / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
        strip.paste(img, (i * tile, 0))
        label = "original" if v.version == 0 else f"v{v.version} (epoch {v.epoch})"
        draw.text((i * tile + 4, tile + 2), label, fill=(0, 0, 0))
        if v.description:
            draw.text((i * tile + 4, tile + 14), v.description[:36], fill=(80, 80, 80))
    return strip
