"""A job's output file, from the worker's temp file to the published PNG (the HTTP process's side of writing).

A worker writes ``.<output name>.<job uid>.tmp`` beside the output; the server renames it into place only if it is
still the file the worker wrote and audited (:func:`publish`), reaching the client's folder from ``output_dir``
without following a link (``synth/beneath.py``), and removes a temp file the same way when a job is cancelled or its
worker dies (:func:`unlink_below`). At start-up it removes the temp files a killed run left (:func:`sweep_temp_files`).
"""

import logging
import os
import re
import stat
from pathlib import Path

from synth.beneath import LinkError, open_file, opened_dir, relative_parts
from synth.inputs import file_identity

log = logging.getLogger("synth.server")

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
"""Worker temp files in a client's output folder: ``.<output name>.<job uid>.tmp``. One server per ``output_dir``: at
start-up it removes every such file (a worker killed mid-write leaves one; the server killed with workers mid-write
does too)."""


def temp_path(output_path: str, uid: str) -> str:
    """Where a job's worker writes before the server publishes the file as ``output_path``."""
    head, name = os.path.split(output_path)
    return os.path.join(head, f".{name}.{uid}.tmp")


def unlink_below(output_dir: Path, path: str | None) -> bool:
    """Remove a file the server or a worker wrote below ``output_dir``, reaching it without following a link; whether
    a file was removed (not when a link stood on the way, or the file was gone or could not be removed)."""
    parts = relative_parts(path, output_dir) if path else None
    if not parts:
        return False
    try:
        with opened_dir(output_dir, parts[:-1]) as d:
            os.unlink(parts[-1], dir_fd=d)
    except (FileNotFoundError, LinkError, PermissionError):
        return False
    return True


def publish(output_dir: Path, tmp_path: str, output_path: str, written: tuple[int, ...] | None) -> tuple[int, ...]:
    """Rename a worker's audited temp file over ``output_path`` inside the client's folder, reached from
    ``output_dir`` without following a link, only if it is still the file the worker wrote and audited (``written``:
    its :func:`synth.inputs.file_identity` once written: a file put in its place has another change time, an inode
    number reused or not) with one link; returns the published file's identity (taken after the rename, which sets
    its change time)."""
    parts, tmp_parts = relative_parts(output_path, output_dir), relative_parts(tmp_path, output_dir)
    if not parts or tmp_parts is None or tmp_parts[:-1] != parts[:-1]:
        raise OSError(f"{output_path!r} and its temp file are not in one folder below {str(output_dir)!r}")
    with opened_dir(output_dir, parts[:-1]) as d:
        fd = open_file(d, tmp_parts[-1])
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or file_identity(st) != tuple(written or ()):
                raise OSError(f"{tmp_path!r} is not the file the worker wrote and audited (replaced or linked)")
            os.replace(tmp_parts[-1], parts[-1], src_dir_fd=d, dst_dir_fd=d)
            return file_identity(os.fstat(fd))
        finally:
            os.close(fd)


def sweep_temp_files(output_dir: Path) -> int:
    """Remove worker temp files left in ``output_dir`` and its client folders by a run that was killed mid-write;
    returns how many."""
    n = 0
    folders = [output_dir]
    folders += [Path(e.path) for e in os.scandir(output_dir) if e.is_dir(follow_symlinks=False)]
    for folder in folders:
        for entry in os.scandir(folder):
            if TEMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                n += unlink_below(output_dir, entry.path)
    if n:
        log.warning("removed %d temp files left in %s by an earlier run", n, output_dir)
    return n
