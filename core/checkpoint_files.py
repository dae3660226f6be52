"""Checkpoint files that survive a kill mid-write, and the check that tells an intact checkpoint from a damaged one.

Why: Lightning writes a single-file checkpoint atomically (a temporary file renamed into place), but a distributed
checkpoint (``--trainer.strategy fsdp2``: a folder of DCP shards, their index ``.metadata`` and the trainer state
``meta.pt``) was rewritten in place, so a kill during its save (minutes for a 7B run with fp32 masters) left new shards
beside old metadata. `FSDP2Strategy` now writes each save into a staging folder beside the checkpoint
(``<name>.partial-<id>``) and `switch` puts it in place only once it is complete: the previous checkpoint stays whole
until then. A kill leaves a staging folder that the next save of that name removes. Single-file saves write their
temporary file beside the checkpoint (`temp_path`; ``lightning_modules/checkpoints.py``'s `BesideCheckpointIO`).

`damage` says why a checkpoint is not intact without loading its tensors; `newest_intact` finds the one to resume from
instead (``--resume_intact``, cli/main.py). Changed bytes are found by checksums read in one streamed pass (~1 GB/s):
a file's zip records carry their CRC-32 (not when saved with ``torch.serialization.set_crc32_options(False)``: then
its structure is checked only); a distributed checkpoint's shards carry none of their own, so the save writes the
CRC-32 of every file into ``checksums.json`` (`MANIFEST`) as its last file.

Plain file operations, torch's zip format and DCP's metadata: no Lightning, so the checks run before a fit
(cli/resume_checks.py) and in bench/ as well as inside the save.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import socket
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from core.processes import pid_alive

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
    fsync_dir(final.parent)  # the renames reach the disk before the run goes on (a machine crash too)


# ---------------------------------------------------------------------------------------------------------------------
# Single files: the temporary file beside the checkpoint
# ---------------------------------------------------------------------------------------------------------------------

TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>[0-9]+)\.tmp$")
"""``.last.ckpt.<host>.<pid>.tmp``: a single-file checkpoint being written by process ``pid`` of the machine ``host``
(`host`), beside its final name. The host: on a filesystem that several machines share, a pid says nothing of another
machine's processes."""


def host() -> str:
    """This machine's name as a temp name carries it: ``socket.gethostname()`` with every character but
    ``[A-Za-z0-9-]`` as ``-`` (``node1.cluster`` -> ``node1-cluster``)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "-"


def temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{host()}.{os.getpid()}.tmp")


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def remove_stale_temps(folder: Path) -> list[tuple[Path, int]]:
    """Remove the temporary files of single-file saves in ``folder`` (`TEMP`) that a process of this machine wrote and
    that is gone, or is this one (a container restarted under the same pid: nothing of this process is being saved
    before its first save); returns them with their sizes. Called at the start of a fit (cli/main.py). Kept: a file of
    a live process (another run saving into the same folder), every file of another machine (a shared filesystem:
    whether its process lives cannot be told from here), and every name but ``.<name>.<host>.<pid>.tmp`` with this
    machine's `host` (``.notes.2024.tmp`` is a user's)."""
    if not folder.is_dir():
        return []
    removed, here = [], host()
    for p in sorted(folder.iterdir()):
        m = TEMP.match(p.name)
        if m is None or m["host"] != here or not p.is_file() or p.is_symlink():
            continue
        pid = int(m["pid"])
        if pid != os.getpid() and pid_alive(pid):
            continue
        size = p.stat().st_size
        p.unlink(missing_ok=True)
        removed.append((p, size))
    return removed


# ---------------------------------------------------------------------------------------------------------------------
# Integrity
# ---------------------------------------------------------------------------------------------------------------------


CHUNK = 4 * 2**20
"""Bytes read at a time when checksumming (a multi-GB checkpoint is streamed, never held in memory)."""
MANIFEST = "checksums.json"
"""In a distributed checkpoint folder: the size and CRC-32 of every other file there, written at save
(`write_manifest`) and compared by `damage` (DCP itself keeps no checksum of its shards)."""


def crc32(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of the file at ``path``, read in ``CHUNK``s."""
    crc = size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def checksums(folder: Path, names: list[str]) -> dict[str, list]:
    """``{name: [size, "crc32 in hex"]}`` of the files ``names`` in ``folder`` (one rank's share of a save)."""
    out = {}
    for name in names:
        size, crc = crc32(folder / name)
        out[name] = [size, f"{crc:08x}"]
    return out


def write_manifest(folder: Path, sums: dict[str, list]) -> None:
    """``folder/MANIFEST`` with ``sums`` (`checksums` of every other file in the folder), written whole (a temporary
    file renamed) and synced: the last file of a distributed save."""
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"algorithm": "crc32", "files": dict(sorted(sums.items()))}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def damage(path: str | Path, contents: bool = True) -> str | None:
    """Why ``path`` is not an intact checkpoint (what is wrong, in a few words), or ``None`` when it is.

    A file (``torch.save``'s zip archive): its central directory (at the end: a truncated file has none) as zipfile
    and torch's own reader read it, a ``data.pkl`` in it, each directory entry agreeing with its record's header and
    data descriptor, and the CRC-32 of every record (``data.pkl`` and each tensor's bytes, streamed: one read of the
    file). A distributed checkpoint folder: ``.metadata`` readable, every shard file it names present and at least as
    long as the last byte it needs there, ``meta.pt`` loadable, and every file's size and CRC-32 as `MANIFEST` recorded
    them at save (a folder saved before the manifest existed gets the other checks only).

    ``contents=False`` skips reading the tensors' bytes (the records' CRCs but ``data.pkl``'s, the manifest's CRCs).
    What it finds ``contents=True`` finds too, so it serves only where a damage that the bytes alone show changes
    nothing for this process (cli/resume_checks.py `intact_checkpoint`: the ranks other than 0, when a damaged
    checkpoint stops the run). Where the answer picks the checkpoint to load (``--resume_intact``), every rank must
    read the bytes: ranks that checked differently would resume from different checkpoints.

    A record whose CRC-32 is 0 both in the zip directory and in its own header or data descriptor has no checksum
    (``torch.serialization.set_crc32_options(False)`` saves every record so): its bytes are read (a truncated record is
    found) but not compared; a CRC zeroed in only one of the two places is damage."""
    p = Path(path)
    if p.is_dir():
        return _folder_damage(p, contents)
    if p.is_file():
        return _file_damage(p, contents)
    return "missing"


def _file_damage(p: Path, contents: bool) -> str | None:
    try:
        z = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        size = p.stat().st_size
        return (
            f"truncated, its end overwritten, or not a torch.save archive ({size} bytes, no zip directory at the end)"
        )
    except OSError as e:
        return f"unreadable ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a damaged directory raises NotImplementedError, ValueError, ...
        return f"its zip directory is damaged ({type(e).__name__}: {e})"
    with z:
        infos = z.infolist()
        pkl = next((i for i in infos if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")), None)
        if pkl is None:
            return "no data.pkl in the archive"
        with open(p, "rb") as raw:
            for info in infos:
                try:
                    why = _entry_damage(raw, info)
                except Exception as e:  # noqa: BLE001 - an offset or size no file has
                    why = f"has a damaged zip directory entry ({type(e).__name__}: {e})"
                if why is not None:
                    return f"record {info.filename} {why}"
        for info in infos if contents else [pkl]:
            if (why := _record_damage(z, info, checked=info.CRC != 0)) is not None:  # 0: none recorded (see above)
                return f"record {info.filename} {why}"
    try:  # torch reads the directory with its own zip reader (miniz), stricter than zipfile on some fields
        torch._C.PyTorchFileReader(str(p))
    except Exception as e:  # noqa: BLE001
        return f"its zip directory is damaged (torch's reader: {str(e).split('. ')[0]})"
    return None


_DOS_FOLDER = 0x10
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ZIP64 = 0xFFFFFFFF


def _entry_damage(raw: Any, info: zipfile.ZipInfo) -> str | None:
    """Whether the zip directory's entry of a record agrees with the record's own header and data descriptor (a few
    bytes each). zipfile compares only the names, and a record whose directory entry says 0 bytes with CRC 0 reads
    back "intact"; torch's reader (miniz) trusts the entry's sizes and flags, and takes a record whose attributes carry
    the DOS folder bit for a folder (it reads as empty)."""
    if info.external_attr & _DOS_FOLDER and not info.filename.endswith("/"):
        return "is marked as a folder in the zip directory (its entry is damaged)"
    raw.seek(info.header_offset)
    head = raw.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        return "has a damaged header (no local header where the zip directory points)"
    _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if (flags, method) != (info.flag_bits, info.compress_type):
        return "disagrees with its zip directory entry (flags or compression method): one of them is damaged"
    if flags & 0x08:  # CRC and sizes follow the data (torch's writer): [signature] CRC, sizes of 4 or 8 bytes
        raw.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len + info.compress_size)
        tail = raw.read(24)
        tail = tail[4:] if tail[:4] == b"PK\x07\x08" else tail
        sizes = (info.compress_size, info.file_size)
        ok = tail[:4] == struct.pack("<I", info.CRC) and (
            tail[4:20] == struct.pack("<QQ", *sizes)
            or (max(sizes) < _ZIP64 and tail[4:12] == struct.pack("<II", *sizes))
        )
    else:
        ok = crc == info.CRC and (csize == _ZIP64 or (csize, usize) == (info.compress_size, info.file_size))
    if not ok:
        return "disagrees with its zip directory entry (CRC or size): one of them is damaged"
    return None


def _record_damage(z: zipfile.ZipFile, info: zipfile.ZipInfo, checked: bool = True) -> str | None:
    """Why one record of ``z`` does not read back as saved: zipfile checks its local header and, at its end, its
    CRC-32 (with ``checked``; without, for a record saved with no checksum, only that all its bytes are there).
    `_entry_damage` has found the directory's CRC equal to the record's own, so a CRC of 0 there is 0 in both."""
    try:
        with z.open(info) as f:
            if not checked:
                f._expected_crc = None  # zipfile's own "no CRC to compare" (what it sets for a ZipInfo without one)
            while f.read(CHUNK):
                pass
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            return "fails its CRC-32 check: its bytes changed after the save (a disk error, a damaged copy)"
        return f"has a damaged header ({e})"
    except Exception as e:  # noqa: BLE001 - OSError, EOFError, zlib.error, NotImplementedError (a changed method), ...
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def _folder_damage(p: Path, contents: bool) -> str | None:
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
    if (why := _manifest_damage(p, contents)) is not None:
        return why
    try:
        torch.load(p / "meta.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        return f"meta.pt unreadable ({type(e).__name__})"
    return None


def _manifest_damage(p: Path, contents: bool) -> str | None:
    """Every file `MANIFEST` lists has the size and (with ``contents``) the CRC-32 recorded at save."""
    if not (p / MANIFEST).is_file():
        return None  # saved before manifests: the structural checks only
    try:
        files = json.loads((p / MANIFEST).read_text())["files"]
        expected = {str(name): (int(size), str(crc)) for name, (size, crc) in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if any(Path(name).name != name or name in (".", "..") for name in expected):
        return f"{MANIFEST} damaged (it names a file outside the folder)"
    for name, (size, crc) in sorted(expected.items()):
        f = p / name
        if not f.is_file():
            return f"{name} missing (listed in {MANIFEST})"
        if (actual := f.stat().st_size) != size:
            return f"{name} is {actual} bytes, {size} when saved"
        if contents and f"{crc32(f)[1]:08x}" != crc:
            return f"{name} fails its CRC-32 check: its bytes changed after the save (a disk error, a damaged copy)"
    return None


def _written_at(p: Path) -> float:
    """When ``p`` was completed: a folder's ``meta.pt`` is its last file."""
    for f in (p / "meta.pt", p / ".metadata", p):
        if f.exists():
            return f.stat().st_mtime
    return 0.0


def candidates(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, newest first (the same time: by name, so that every rank walks them in one
    order): ``*.ckpt`` files and folders with a ``meta.pt`` or ``.metadata`` (a staging folder included: complete, it
    may hold the newest state after a kill between two renames)."""
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if (p.is_file() and p.name.endswith(".ckpt"))
        or (p.is_dir() and any((p / n).is_file() for n in ("meta.pt", ".metadata")))
    ]
    return sorted(found, key=lambda p: (_written_at(p), p.name), reverse=True)  # the name: one order on every rank


def newest_intact(folder: Path, skip: Path | None = None, contents: bool = True) -> Path | None:
    """The newest checkpoint in ``folder`` that `damage` finds nothing wrong with (``skip`` aside)."""
    for p in candidates(folder):
        if skip is not None and p.resolve() == skip.resolve():
            continue
        if damage(p, contents) is None:
            return p
    return None
