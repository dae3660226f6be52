"""Checkpoints that survive a kill mid-write, and the check that tells an intact checkpoint from a damaged one.

Why: Lightning writes a single-file checkpoint atomically (a temporary file renamed into place), but a distributed
checkpoint (``--trainer.strategy fsdp2``: a folder of DCP shards, their index ``.metadata`` and the trainer state
``meta.pt``) was rewritten in place, so a kill during its save (minutes for a 7B run with fp32 masters) left new shards
beside old metadata. `FSDP2Strategy` now writes each save into a staging folder beside the checkpoint
(``<name>.partial-<id>``) and `switch` puts it in place only once it is complete: the previous checkpoint stays whole
until then. A kill leaves a staging folder that the next save of that name removes.

`damage` says why a checkpoint is not intact without loading its tensors; `newest_intact` finds the one to resume from
instead (``--resume_intact``, cli/main.py).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import zipfile
from pathlib import Path

import torch

STAGING = ".partial-"
"""``last.ckpt.partial-<id>``: a distributed checkpoint being written (complete only once it replaced ``last.ckpt``)."""
ASIDE = ".old-"
"""``last.ckpt.old-<id>``: the previous checkpoint moved aside where an atomic exchange is unsupported."""


def staging_path(final: Path, token: str) -> Path:
    return final.with_name(f"{final.name}{STAGING}{token}")


def leftovers(final: Path) -> list[Path]:
    """The staging and set-aside copies of ``final`` that a save left behind (killed, or not yet cleaned up)."""
    parent = final.parent
    if not parent.is_dir():
        return []
    prefixes = (final.name + STAGING, final.name + ASIDE)
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink(missing_ok=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``, glibc >= 2.28). ``False`` where the C
    library, the kernel or the filesystem (e.g. NFS) does not support it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def switch(staging: Path, final: Path) -> None:
    """Put the complete ``staging`` in ``final``'s place, then remove the previous checkpoint and every other leftover
    of ``final``. With an atomic exchange ``final`` is always a whole checkpoint; without one (rename the old aside,
    rename the new in) a kill between the two renames leaves no ``final`` but a complete staging folder, which
    `newest_intact` offers."""
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif not exchange(staging, final):  # with the exchange the previous checkpoint is now at the staging name
        os.rename(final, final.with_name(final.name + ASIDE + staging.name.rsplit(STAGING, 1)[1]))
        os.rename(staging, final)
    for p in leftovers(final):
        remove(p)
    try:  # the renames reach the disk before the run goes on (a crash of the machine, not only of the process)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Integrity
# ---------------------------------------------------------------------------------------------------------------------


def damage(path: str | Path) -> str | None:
    """Why ``path`` is not an intact checkpoint (a few words), or ``None`` when it is.

    A file (``torch.save``'s zip archive): its central directory (at the end: a truncated file has none) and its
    ``data.pkl`` (read, so its CRC is checked) -- not the tensors. A distributed checkpoint folder: ``.metadata``
    readable, every shard file it names present and at least as long as the last byte it needs there, ``meta.pt``
    loadable."""
    p = Path(path)
    if p.is_dir():
        return _folder_damage(p)
    if p.is_file():
        return _file_damage(p)
    return "missing"


def _file_damage(p: Path) -> str | None:
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
            pkl = next((n for n in names if n == "data.pkl" or n.endswith("/data.pkl")), None)
            if pkl is None:
                return "no data.pkl in the archive"
            z.read(pkl)
    except zipfile.BadZipFile:
        return f"truncated or not a torch.save archive ({p.stat().st_size} bytes, no zip directory)"
    except (OSError, EOFError, ValueError, zipfile.LargeZipFile) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def _folder_damage(p: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    if not (p / ".metadata").is_file():
        return "no .metadata (the index of the shards)"
    if not (p / "meta.pt").is_file():
        return "no meta.pt (the trainer state)"
    try:
        md = FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is damage
        return f".metadata unreadable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        f = p / rel
        if not f.is_file():
            return f"shard {rel} missing"
        if (size := f.stat().st_size) < end:
            return f"shard {rel} truncated ({size} of {end} bytes)"
    try:
        torch.load(p / "meta.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        return f"meta.pt unreadable ({type(e).__name__})"
    return None


def _written_at(p: Path) -> float:
    """When ``p`` was completed: a folder's ``meta.pt`` is its last file."""
    for f in (p / "meta.pt", p / ".metadata", p):
        if f.exists():
            return f.stat().st_mtime
    return 0.0


def candidates(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, newest first: ``*.ckpt`` files and folders with a ``meta.pt`` or ``.metadata``
    (a staging folder included: complete, it may hold the newest state after a kill between two renames)."""
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if (p.is_file() and p.name.endswith(".ckpt"))
        or (p.is_dir() and any((p / n).is_file() for n in ("meta.pt", ".metadata")))
    ]
    return sorted(found, key=_written_at, reverse=True)


def newest_intact(folder: Path, skip: Path | None = None) -> Path | None:
    """The newest checkpoint in ``folder`` that `damage` finds nothing wrong with (``skip`` aside)."""
    for p in candidates(folder):
        if skip is not None and p.resolve() == skip.resolve():
            continue
        if damage(p) is None:
            return p
    return None
