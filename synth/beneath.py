"""Files opened beneath a directory without following a link at any level.

The data server reads inputs only inside its roots and writes outputs only inside ``output_dir``. A check on a path
string (``realpath``, then ``open``) races with a client that swaps a folder on the way for a symbolic link between the
two: ``O_NOFOLLOW`` guards only the last component. Here every access starts from a descriptor of the trusted
directory (a root, or ``output_dir``: the operator's config, whose own path may contain links) and walks one component
at a time with ``openat(..., O_NOFOLLOW | O_DIRECTORY)``, so a link anywhere below it fails the call (``ELOOP`` /
``ENOTDIR``) instead of being followed, and every check afterwards uses the opened descriptor, never the path again.

Both processes use it: the HTTP process checks an input and renames a finished output into place, the worker reads the
input and writes the temp file; each opens its own descriptors (docs/data_server.md, "Files and roots").
"""

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class LinkError(OSError):
    """A component below the trusted directory is a symbolic link (or not a folder where one is needed)."""

    def __init__(self, component: str, where: str):
        super().__init__(errno.ELOOP, f"{component!r} under {where!r} is a symbolic link or not a folder")
        self.component = component


def relative_parts(path: str | os.PathLike, base: str | os.PathLike) -> list[str] | None:
    """The components of ``path`` below ``base``, compared as text (``path`` already normalised, no ``..``), or
    None when ``path`` is not below ``base``; ``[]`` for ``base`` itself."""
    p, b = Path(path), Path(base)
    if p == b:
        return []
    return list(p.relative_to(b).parts) if p.is_relative_to(b) else None


@contextlib.contextmanager
def opened_dir(base: str | os.PathLike, parts: Sequence[str] = (), create: bool = False) -> Iterator[int]:
    """A descriptor of the folder ``base/parts...``, reached without following a link below ``base`` (``create``:
    make missing folders, mode 0o755). Raises :class:`LinkError` when a component is a link or a file."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise ValueError(f"{part!r} is not a plain path component")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkError(part, str(base)) from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def open_file(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """``name`` in the folder ``dir_fd`` opened without following a link (``O_NONBLOCK`` too when reading, so a FIFO
    put in a file's place cannot hang the caller). Raises :class:`LinkError` for a link."""
    if not (flags & (os.O_WRONLY | os.O_RDWR)):
        flags |= getattr(os, "O_NONBLOCK", 0)
    try:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkError(name, f"<folder fd {dir_fd}>") from None
        raise


def open_beneath(base: str | os.PathLike, parts: Sequence[str], flags: int = os.O_RDONLY) -> int:
    """The file ``base/parts...`` opened with no link followed below ``base``; the caller closes the descriptor."""
    if not parts:
        raise IsADirectoryError(errno.EISDIR, f"{str(base)!r} is a folder, not a file")
    with opened_dir(base, parts[:-1]) as d:
        return open_file(d, parts[-1], flags)


def unlink_quietly(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the folder ``dir_fd`` (never through a link: ``unlinkat`` removes the entry itself)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
