"""Request checks in the HTTP process: an input image is a regular file inside the server's roots, an output is
the very file the server wrote. PIL reads only image headers here; the worker decodes.

Files are read only from the roots and written only inside ``output_dir``, and no symbolic link is followed below
either, at any level (:mod:`synth.beneath`): ``image.path`` is normalised as text (``..`` may not climb out of a
root), matched against a root, then opened one folder at a time from a descriptor of that root with ``O_NOFOLLOW``,
so a folder swapped for a link while the request is checked fails the open instead of leading outside. The opened
file must be a regular file with one link (a hard link inside a root could name a file that lives outside it;
``allow_hard_links: true`` in the config accepts them). The worker opens it again the same way and checks that it is
still that file (device and inode). Outputs are served only when the file at the output path is the one the server
itself published (same device, inode, size, modification and change time, a regular file), again reached without
following a link (docs/data_server.md, "Files and roots").
"""

import io
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from pydantic import ValidationError

from synth.api import JobRequest
from synth.beneath import LinkError, open_beneath, opened_dir, relative_parts
from synth.compose import CanvasGeometry
from synth.config import ServerConfig


class ApiError(Exception):
    """An error answer: HTTP status, a message that says what to fix, optional per-field errors."""

    def __init__(self, status: int, detail: str, errors: list[dict] | None = None, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.errors, self.headers = status, detail, errors, headers


def validation_errors(e: ValidationError) -> list[dict]:
    """Pydantic errors as ``{"field": "boxes.0", "message": ...}`` (the field path joined with dots)."""
    return [
        {"field": ".".join(str(p) for p in err["loc"]) or "body", "message": err["msg"], "type": err["type"]}
        for err in e.errors(include_url=False)
    ]


@dataclass
class PreparedInput:
    image_path: str | None
    image_bytes: bytes | None
    width: int
    height: int
    boxes: list[list[float]]
    """The request's boxes clipped to the image (they may stick out by at most ``box_tolerance_px``)."""
    output_path: str
    image_identity: tuple[int, int] | None = None
    """(device, inode) of ``image_path`` when it was checked; the worker reads only that file."""
    image_root: str | None = None
    image_parts: tuple[str, ...] | None = None
    """The root ``image_path`` lies in and its components below it: the worker walks them without following links."""


@dataclass
class _CheckedPath:
    root: Path
    parts: tuple[str, ...]
    identity: tuple[int, int]
    fh: io.BufferedReader

    @property
    def path(self) -> str:
        return str(self.root.joinpath(*self.parts))


def _locate(path: str, cfg: ServerConfig) -> tuple[Path, tuple[str, ...]]:
    """The root ``path`` lies in and its components below it, as text (``..`` resolved lexically), or an ApiError."""
    roots = cfg.resolved_roots()
    if not roots:
        raise ApiError(
            403,
            "this server has no roots configured, so it reads no files: send image.data_b64, "
            "or start the server with roots: [<dir>] in its config",
        )
    if "\x00" in path:
        raise ApiError(400, f"image.path {path!r} cannot be resolved on the server: it contains a NUL byte")
    p = Path(path) if os.path.isabs(path) else roots[0] / path
    norm = os.path.normpath(p)
    for real_root, given in zip(roots, cfg.roots):  # the root as configured may itself sit behind a link
        for base in (real_root, Path(os.path.abspath(given))):
            parts = relative_parts(norm, base)
            if parts is not None:
                return real_root, tuple(parts)
    raise ApiError(
        403,
        f"image.path {path!r} is {norm!r}, outside the server's roots {[str(r) for r in roots]}: "
        "put the image under a root or add its directory to roots in the server config",
    )


def _check_image_path(path: str, cfg: ServerConfig, own_output_dir: Path) -> _CheckedPath:
    """``image.path`` opened inside a root with no link followed: the open file and its (device, inode)."""
    root, parts = _locate(path, cfg)
    where = root.joinpath(*parts)
    out_dir = cfg.resolved_output_dir()
    if where.is_relative_to(out_dir) and not where.is_relative_to(own_output_dir):
        raise ApiError(403, f"image.path {path!r} is another client's output: a client reads only its own outputs")
    try:
        fd = open_beneath(root, parts)
    except LinkError as e:
        raise ApiError(
            403,
            f"image.path {path!r} passes through a symbolic link or a non-folder ({e.component!r}) below the root "
            f"{str(root)!r}: the server follows no links under its roots; pass the file's real path",
        ) from None
    except FileNotFoundError:
        raise ApiError(400, f"image.path {path!r} does not exist on the server (looked at {str(where)!r})") from None
    except IsADirectoryError:
        raise ApiError(400, f"image.path {path!r} is not a file on the server (looked at {str(where)!r})") from None
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent, ...: the client's path is unusable, not a server fault
        raise ApiError(400, f"image.path {path!r} cannot be read on the server: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ApiError(400, f"image.path {path!r} is not a file on the server (looked at {str(where)!r})")
        if st.st_nlink > 1 and not cfg.allow_hard_links:
            raise ApiError(
                403,
                f"image.path {path!r} is a file with {st.st_nlink} hard links, and a hard link can bring a file from "
                "outside the roots into them: copy the image, or set allow_hard_links: true in the server config",
            )
        os.set_blocking(fd, True)
        return _CheckedPath(root, parts, (st.st_dev, st.st_ino), os.fdopen(fd, "rb"))
    except BaseException:
        os.close(fd)
        raise


def open_input(root: str, parts: Sequence[str], identity: tuple[int, int] | None) -> io.BufferedReader:
    """Open an input image checked by :func:`prepare_input`, walking from its root without following a link, and only
    if it is still that file (``identity``: its device and inode when checked); raises OSError otherwise (the job
    fails with it)."""
    fd = open_beneath(root, parts)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (identity is not None and (st.st_dev, st.st_ino) != tuple(identity)):
            path = os.path.join(root, *parts)
            raise OSError(f"{path!r} changed after the server checked it (another file or a link is there now)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What names one written file: device and inode, and its size, modification and change time (an inode number is
    reused once a file is removed, so a new file put in its place may carry the old number; a file rewritten in place
    with its modification time set back still has a new change time, which no user call can set)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def open_output(output_dir: str | os.PathLike, path: str, identity: Sequence[int]) -> io.BufferedReader:
    """Open an output the server published (``identity``: :func:`file_identity` of what it wrote), walking from
    ``output_dir`` without following a link; raises OSError when the file at ``path`` is gone or is not that file."""
    parts = relative_parts(path, output_dir)
    if not parts:
        raise OSError(f"{path!r} is not below the output folder {str(output_dir)!r}")
    fd = open_beneath(output_dir, parts)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or file_identity(st) != tuple(identity):
            raise OSError(f"{path!r} is no longer the file the server wrote")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _image_size(source: Any, what: str, cfg: ServerConfig) -> tuple[int, int]:
    try:
        with Image.open(source) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        raise ApiError(413, f"{what} is too large to decode: {e}") from e
    except Exception as e:
        raise ApiError(422, f"{what} is not a readable image: {type(e).__name__}: {e}") from e
    if w * h > cfg.max_image_pixels:
        raise ApiError(
            413, f"{what} is {w} x {h} = {w * h} pixels, above the server's max_image_pixels ({cfg.max_image_pixels})"
        )
    return w, h


def client_output_dir(cfg: ServerConfig, client: str) -> Path:
    """Where a client's outputs go: ``<output_dir>/<client>/`` (client ids are safe file names)."""
    return cfg.resolved_output_dir() / client


def make_client_output_dir(cfg: ServerConfig, client: str) -> None:
    """Create ``<output_dir>/<client>/`` below ``output_dir`` without following a link; a link or a file in its place
    is an ApiError (409): the server never writes through one."""
    try:
        with opened_dir(cfg.resolved_output_dir(), [client], create=True):
            pass
    except (LinkError, FileExistsError):
        where = client_output_dir(cfg, client)
        raise ApiError(
            409,
            f"the output folder of client {client!r} on the server ({str(where)!r}) is a symbolic link or a file: the "
            "server writes no output through one; the operator must remove it",
        ) from None


def prepare_input(req: JobRequest, cfg: ServerConfig, client: str) -> PreparedInput:
    """Check a request of ``client`` against the server's limits and its image; raise ApiError with a clear message."""
    out_dir = client_output_dir(cfg, client)
    output_path = str(out_dir / f"{req.job_id}.png")
    identity, image_root, image_parts = None, None, None
    if req.image.path is not None:
        checked, image_bytes = _check_image_path(req.image.path, cfg, out_dir), None
        image_path, identity, image_root, image_parts = checked.path, checked.identity, str(checked.root), checked.parts
        with checked.fh as fh:
            if image_path == output_path:
                raise ApiError(
                    422,
                    f"image.path {req.image.path!r} is this job's own output file; "
                    "the server never overwrites an input: choose another job_id",
                )
            try:
                w, h = _image_size(fh, f"image.path {req.image.path!r}", cfg)
            except OSError as e:
                raise ApiError(400, f"image.path {req.image.path!r} cannot be read on the server: {e}") from e
    else:
        try:
            image_bytes = req.image.decoded()
        except ValueError as e:
            raise ApiError(422, str(e), [{"field": "image.data_b64", "message": str(e)}]) from e
        image_path = None
        w, h = _image_size(io.BytesIO(image_bytes), "image.data_b64", cfg)
    scene = req.edit.scene if req.edit is not None else None
    if scene is not None and (scene.get("width"), scene.get("height")) != (w, h):
        msg = (
            f"edit.scene is a {scene.get('width')} x {scene.get('height')} scene but the image is {w} x {h}: "
            "send the scene that describes this image"
        )
        raise ApiError(422, msg, [{"field": "edit.scene", "message": msg}])
    tol = cfg.box_tolerance_px
    boxes = []
    for i, b in enumerate(req.boxes):
        x1, y1, x2, y2 = b
        if x1 < -tol or y1 < -tol or x2 > w + tol or y2 > h + tol:
            msg = f"boxes[{i}] = {b} lies outside the {w} x {h} image (by more than box_tolerance_px = {tol})"
            raise ApiError(422, msg, [{"field": f"boxes.{i}", "message": msg}])
        c = [max(0.0, x1), max(0.0, y1), min(float(w), x2), min(float(h), y2)]
        if c[2] <= c[0] or c[3] <= c[1]:
            msg = f"boxes[{i}] = {b} is empty once clipped to the {w} x {h} image"
            raise ApiError(422, msg, [{"field": f"boxes.{i}", "message": msg}])
        boxes.append(c)
    try:
        geom = CanvasGeometry.from_params(w, h, **req.canvas.model_dump())
    except ValueError as e:
        raise ApiError(422, str(e), [{"field": "canvas", "message": str(e)}]) from e
    if geom.canvas_w * geom.canvas_h > cfg.max_canvas_pixels:
        msg = (
            f"the canvas would be {geom.canvas_w} x {geom.canvas_h} pixels, above the server's max_canvas_pixels "
            f"({cfg.max_canvas_pixels}): lower canvas.scale / canvas.extend"
        )
        raise ApiError(422, msg, [{"field": "canvas", "message": msg}])
    make_client_output_dir(cfg, client)
    return PreparedInput(image_path, image_bytes, w, h, boxes, output_path, identity, image_root, image_parts)
