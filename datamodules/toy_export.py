"""Writing the toy worlds' exports: atomic files, idempotent exports with manifests, only into folders they own.

The toy worlds write only into a folder they own: an empty (or new) folder, or one with their marker file.

Every toy export (``datamodules.toy``, ``toy_math``, ``toy_video``: the images, clips and JSONL files of a split, and
the offline descriptions) calls :func:`claim` before it writes. A folder that holds anything else, a user's
``train.jsonl`` or pictures, stops the export with one line that names the folder, a few of its files and what to do,
before any file is written: pointing ``--data.init_args.data_root`` at one's own data with a toy config must not
replace that data with the toy world.

A folder a toy export filled before the marker existed (every ``*.jsonl`` in it has the export's
``*.jsonl.manifest.json`` beside it) is taken as the toy world's and gets the marker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MARKER = ".toy-world"
"""The file that marks a folder as written by the toy exports (and theirs to rewrite)."""


class ForeignFolderError(ValueError):
    """A toy export was pointed at a folder holding files it did not write."""


def foreign_files(folder: str | Path) -> list[str]:
    """The entries of ``folder`` no toy export wrote (empty for a missing or empty folder, or a marked one)."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / MARKER).is_file():
        return []
    entries = sorted(folder.iterdir())
    manifests = {p.name[: -len(".manifest.json")] for p in entries if p.name.endswith(".jsonl.manifest.json")}

    def toy_made(p: Path) -> bool:
        if p.name.startswith(".") and ".tmp" in p.name:  # an export's temporary file
            return True
        if p.name.endswith(".jsonl.manifest.json") or p.name in manifests:
            return True
        if p.name.endswith("_offline_descriptions.jsonl"):  # beside the split it describes
            return p.name.replace("_offline_descriptions", "") in manifests
        return bool(manifests) and p.is_dir() and p.name in ("images", "videos")

    return [p.name for p in entries if not toy_made(p)]


def check(folder: str | Path, flag: str = "--data.init_args.data_root") -> None:
    """Raise :class:`ForeignFolderError` (one line) when ``folder`` holds files that are not the toy world's."""
    foreign = foreign_files(folder)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ForeignFolderError(
            f"{flag} {folder}: the toy world is written only into an empty folder or one it made (marked "
            f"{MARKER}), and this one holds other files ({shown}), which it would overwrite; point {flag} at a new "
            "folder, or, to train on your own files there, drop the toy section (--data.init_args.toy null)"
        )


def claim(folder: str | Path, flag: str = "--data.init_args.data_root") -> Path:
    """``folder``, created and marked as the toy world's, after :func:`check`; call it before writing there."""
    folder = Path(folder)
    check(folder, flag)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER
    if not marker.is_file():
        marker.write_text("Written by the project's toy world exports (datamodules/toy_export.py), which rewrite it.\n")
    return folder


# --- writing ---------------------------------------------------------------------------------------------------------


def atomic_write(path: Path, write) -> None:
    """``write(tmp)`` to a temporary name beside ``path`` (same suffix, so writers that infer the format from it work),
    then rename it over ``path``: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def reusable(path: Path, manifest: Path, params: dict[str, Any], file_key: str = "image") -> bool:
    """An export at ``path`` made with ``params`` (its manifest) whose every line's ``file_key`` file exists."""
    if not (path.exists() and manifest.exists()):
        return False
    try:
        if json.loads(manifest.read_text()) != params:
            return False
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return False
    return len(lines) == params["n"] and all((path.parent / rec[file_key]).exists() for rec in lines)


def export_rows(path: Path, params: dict[str, Any], rows, *, ensure_ascii: bool = True) -> Path:
    """Write an image dataset's export: ``rows`` (an iterable of dicts, each with ``id`` and a PIL ``image``) as
    PNGs under ``path.parent/images/`` and one JSON line per row at ``path`` (``id`` and the relative ``image``
    first, then the row's other keys), then a manifest of ``params``. Idempotent: with the same ``params`` and every
    file present it returns at once (``rows`` is not consumed). Every file is written to a temp name and renamed; the
    manifest goes last."""
    manifest = path.with_name(path.name + ".manifest.json")
    if reusable(path, manifest, params):
        return path
    (claim(path.parent) / "images").mkdir(exist_ok=True)  # a folder of other files stops it here
    manifest.unlink(missing_ok=True)
    lines = []
    for row in rows:
        rest = dict(row)
        rel, image = f"images/{rest.pop('id')}.png", rest.pop("image")
        atomic_write(path.parent / rel, lambda p, im=image: im.save(p, format="PNG"))
        lines.append(json.dumps({"id": row["id"], "image": rel, **rest}, ensure_ascii=ensure_ascii) + "\n")
    atomic_write(path, lambda p: p.write_text("".join(lines)))
    atomic_write(manifest, lambda p: p.write_text(json.dumps(params, indent=1) + "\n"))
    return path
