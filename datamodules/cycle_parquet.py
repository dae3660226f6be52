"""Reader of CycleGRPO's released RL parquet files (``projects/rl/datasets/prepare_*_rl_dataset.py``).

The released RL data are HF-datasets parquet files, one row per image, with the columns the prepare scripts write
(``Dataset.from_list(...).to_parquet``) and ``verl/utils/dataset.py`` reads:

==============  ==============================================================================================
column          value
==============  ==============================================================================================
``images``      list: the image, then (``denseworld_multiple``) one zoom-in crop per small target; each a path
                (relative to ``image_root``; the release strips a leading ``./``), HF's ``{"bytes", "path"}``
                or raw bytes
``cap_problem`` the captioning prompt: ``<image>\\nCould you please give me a detailed description of the following
                regions? <span>, <span>, and <span>. Please respond with ...`` (+ ``Zoom in on <span> with the
                perspective as <image>, <crop span>.``); a no-target row: the referring question
``seg_answer``  ``<answer><span>, <span></answer>`` (the targets' mask tokens, in the prompt's order) or
                ``<answer>No target.</answer>``
``source``      ``denseworld_multiple`` (region rows) or ``gres_no_target`` (no-target rows)
``cap_answer``, ``seg_problem``, ``masks``: written as null by both scripts (read when present)
==============  ==============================================================================================

A row becomes a `CycleRow`: the image(s), the targets' code pairs (``core.regions.mask_tokens``; the first codes of
``seg_answer``, which the prompt must also list), or no target and the expression (``cap_problem`` without
``<image>``). `row_sample` makes the project's `Sample` of it: the main image, the expression (no-target rows) or
``""`` (a region row is captioned, not asked), no boxes (decoding the codes needs the mask tokenizer and the image:
``meta["mask_codes"]`` carries them), ``meta["no_target"]``, and ``meta["reference_caption"]`` (a row's non-empty
``cap_answer``, the repository's reference for its LLM-judged caption reward, when all of the row's targets are
kept). The release trains on one target per row, drawn at random each time a row is read, with the zoom-in crops
dropped (``sample_single_target_from_multi_target(..., max_targets=1)``); `row_sample(row, target=i)` picks target
``i`` the same way.

The row's own prompts, as the repository shows them (``verl/utils/dataset.py``, with the release script's
``non_thinking.jinja``, which only trims): ``meta["row_caption_question"]``, a region row's captioning prompt for
the kept targets (`caption_question`: ``sample_single_target_from_multi_target`` rewrites ``cap_problem``'s first
sentence to name those targets and drops the rest), and ``meta["row_question"]``, a no-target row's question (its
``cap_problem``, asked as it is). `CycleGRPO` asks them as they are, with no template (docs/cycle_grpo.md, "The
released prompts").

Strict: a missing column, an unknown source, a row whose answer has no span (or, for ``gres_no_target``, is not
"No target."), a span that the prompt does not show, or a missing / unreadable image raises ``DataError`` naming the
file and row.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from core.records import DataError, Sample
from core.regions.mask_tokens import format_mask, parse_masks
from core.toy.masks import mask_box

__all__ = [
    "REQUIRED_COLUMNS",
    "SOURCES",
    "CycleRow",
    "caption_question",
    "load_row_image",
    "read_cycle_parquet",
    "row_sample",
]

REQUIRED_COLUMNS = ("images", "cap_problem", "seg_answer", "source")
SOURCES = ("denseworld_multiple", "gres_no_target")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The first sentence of a region row's captioning prompt, as the repository finds it (``sample_single_target_from_
# multi_target``): the release's "Could you please give me ... regions? <spans>." (+ "Please respond with ...", up to a
# zoom-in or the end), or "Provide a detailed description of this region <span>."
_REGIONS_SENTENCE_RE = re.compile(
    r"Could you please give me a detailed description of the following regions?\?\s*.*?\s*"
    r"\.\s*(?:Please respond with interleaved segmentation masks.*?)?(?=\s*(?:Zoom in|$))",
    re.DOTALL,
)
_REGION_SENTENCE_RE = re.compile(r"Provide a detailed description of this region\s*.*?\s*\.$", re.DOTALL)
_NO_TARGET_RE = re.compile(r"^\s*no target\.?\s*$", re.IGNORECASE)


@dataclass
class CycleRow:
    """One parquet row. ``codes``: the targets' raw code pairs (``[]`` for no target); ``images``: paths or bytes,
    the main image first; ``where``: ``file row N`` for errors."""

    sample_id: str
    images: list[Path | bytes]
    source: str
    cap_problem: str
    seg_answer: str
    codes: list[tuple[int, int]]
    query: str
    where: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def no_target(self) -> bool:
        return not self.codes


def _image_ref(value: Any, root: Path, where: str) -> Path | bytes:
    if isinstance(value, dict):  # HF datasets' Image feature: {"bytes": b"...", "path": "..."}
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str) and value:
        path = root / (value[2:] if value.startswith("./") else value)
        if not path.is_file():
            raise DataError(f"{where}: image {path} not found; set the image root to the folder the paths start from")
        return path
    raise DataError(f"{where}: an image must be a path, bytes or {{'bytes', 'path'}}, got {str(value)[:60]!r}")


def _row(rec: dict[str, Any], root: Path, where: str, sample_id: str) -> CycleRow:
    source = rec["source"]
    if source not in SOURCES:
        raise DataError(f"{where}: unknown source {source!r}; this reader knows {SOURCES}")
    images = rec["images"]
    if isinstance(images, str | bytes | dict):
        images = [images]
    if not images:
        raise DataError(f"{where}: 'images' is empty")
    images = [_image_ref(v, root, f"{where} image #{i}") for i, v in enumerate(images)]
    cap, ans = rec["cap_problem"], rec["seg_answer"]
    if not isinstance(cap, str) or not isinstance(ans, str):
        raise DataError(f"{where}: 'cap_problem' and 'seg_answer' must be strings")
    m = _ANSWER_RE.search(ans)
    inner = m.group(1) if m else ans
    codes = parse_masks(inner)
    if source == "gres_no_target":
        if codes or not _NO_TARGET_RE.match(inner):
            raise DataError(f"{where}: a gres_no_target row answers 'No target.', got {ans[:80]!r}")
        query = cap.replace("<image>", "").strip()
        if not query:
            raise DataError(f"{where}: a no-target row needs its expression in 'cap_problem'")
    else:
        if not codes:
            raise DataError(f"{where}: a {source} row's seg_answer holds no mask-token span, got {ans[:80]!r}")
        missing = [format_mask(c) for c in codes if format_mask(c) not in cap]
        if missing:
            raise DataError(f"{where}: the answer's span {missing[0]} is not in cap_problem (the region to caption)")
        query = ""
    extra = {k: rec[k] for k in ("cap_answer", "seg_problem", "masks") if rec.get(k) is not None}
    return CycleRow(sample_id, images, source, cap, ans, codes, query, where, extra)


def read_cycle_parquet(
    path: str | Path, image_root: str | Path | None = None, *, max_samples: int | None = None
) -> list[CycleRow]:
    """The rows of one released RL parquet file (images not decoded; paths checked)."""
    import pyarrow.parquet as pq

    path = Path(path)
    root = Path(image_root) if image_root is not None else Path(".")
    if not path.is_file():
        raise DataError(f"{path}: no such parquet file")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; the released RL parquet has {list(REQUIRED_COLUMNS)} "
            f"(+ cap_answer, seg_problem, masks); found {table.column_names}"
        )
    rows = table.slice(0, max_samples).to_pylist() if max_samples is not None else table.to_pylist()
    if not rows:
        raise DataError(f"{path}: no rows")
    return [_row(rec, root, f"{path} row {i}", f"{path.stem}-{i}") for i, rec in enumerate(rows)]


def caption_question(row: CycleRow, codes: list[tuple[int, int]]) -> str | None:
    """The captioning prompt the repository shows for ``row`` with its targets ``codes`` kept (one, as it trains, or
    all): "Could you please give me a detailed description of the following region? <span>." ("regions", spans
    ``, ``-joined, for several); None for a row whose prompt has no such first sentence (the repository keeps that
    prompt whole, with its extra images, which a `Sample` cannot show)."""
    if not codes or not (_REGIONS_SENTENCE_RE.search(row.cap_problem) or _REGION_SENTENCE_RE.search(row.cap_problem)):
        return None
    word = "region" if len(codes) == 1 else "regions"
    spans = ", ".join(format_mask(tuple(c)) for c in codes)
    return f"Could you please give me a detailed description of the following {word}? {spans}."


def load_row_image(row: CycleRow, index: int = 0) -> Image.Image:
    """Image ``index`` of the row (0: the main image), RGB; ``DataError`` naming the row when it cannot be read."""
    ref = row.images[index]
    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
            return im.convert("RGB")
    except OSError as err:
        what = "embedded bytes" if isinstance(ref, bytes) else str(ref)
        raise DataError(f"{row.where}: image #{index} ({what}) cannot be read ({err})") from None


def row_sample(row: CycleRow, target: int | None = None, codec: Any = None) -> Sample:
    """The row as a `Sample` (module docstring): main image, no boxes, ``meta``: ``mask_codes`` (all targets, or
    only ``target``), ``no_target``, ``source``, ``cap_problem``, ``seg_answer``, ``n_images``. With a mask tokenizer
    ``codec`` (``decode(codes, image) -> bool [H, W]``), a region row gets one box: the tight box of its targets'
    decoded union (``DataError`` when they decode to nothing), so it reads as a REC sample with a target."""
    codes = list(row.codes)
    if target is not None:
        if not 0 <= target < len(codes):
            raise IndexError(f"{row.where}: target {target} of a row with {len(codes)} target(s)")
        codes = [codes[target]]
    meta = {
        "mask_codes": codes,
        "no_target": row.no_target,
        "source": row.source,
        "cap_problem": row.cap_problem,
        "seg_answer": row.seg_answer,
        "n_images": len(row.images),
        **row.extra,
    }
    if row.no_target:
        meta["row_question"] = row.query  # cap_problem without <image>: the row's own question, asked as it is
    elif (question := caption_question(row, codes)) is not None:
        meta["row_caption_question"] = question
    cap_answer = row.extra.get("cap_answer")
    if isinstance(cap_answer, str) and cap_answer.strip() and len(codes) == len(row.codes):
        # the reference caption of CycleGRPO's optional judge reward (methods/cycle_judge.py); a row drawn down to
        # one of several targets has none (the repository splits cap_answer per target by heuristics; not ported)
        meta["reference_caption"] = cap_answer.strip()
    image_path = None if isinstance(row.images[0], bytes) else str(row.images[0])
    image = load_row_image(row)
    boxes: list[list[float]] = []
    if codec is not None and codes:
        import numpy as np

        union = np.zeros((image.size[1], image.size[0]), dtype=bool)
        for pair in codes:
            union |= np.asarray(codec.decode(pair, image), dtype=bool)
        box = mask_box(union)
        if box is None:
            raise DataError(
                f"{row.where}: the target's mask tokens {codes} decode to an empty mask with this tokenizer"
            )
        boxes = [[float(v) for v in box]]
    return Sample(row.sample_id, image, row.query, boxes, "rec", image_path, row.where, meta)
