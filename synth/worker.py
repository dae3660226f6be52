"""The worker process: owns one painter on one device and turns work items into audited files.

The HTTP process starts one of these per configured device (``multiprocessing`` spawn, so CUDA is initialised only
here) and talks to it over a private pipe:

- worker -> server: ``("ready", pid)`` once the painter is loaded, or ``("error", message)`` if it cannot be;
  then ``("done", [result, ...])`` for every batch.
- server -> worker: a list of work items (plain dicts, see :func:`run_batch`), or ``None`` to exit.

A job that fails on its own (unreadable image, painter exception, failed audit) comes back as a failed result; the
worker keeps going. A crash (segfault, OOM kill, ``os.kill``) ends the process: the server sees the pipe close,
restarts the worker and retries the batch's jobs. The worker exits when the server's end of the pipe closes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Executor, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from PIL import Image

from core.toy.edits import ZOOM_KIND, execute_job, zoom_array, zoom_box
from core.toy.scene import foreground_mask
from core.toy_math.edits import edit_problem, render
from synth.beneath import open_file, opened_dir, relative_parts, unlink_quietly
from synth.compose import (
    Audit,
    CanvasGeometry,
    audit_result,
    boxes_mask,
    mask_to_canvas,
    paste_back,
    place_image,
)
from synth.foreground import build_masker, keep_mask, keep_masks, load_masker
from synth.inputs import file_identity, open_input
from synth.painters import PaintJob, build_painter


def _limit_threads(n: int | None) -> None:
    if n is None:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)


def worker_main(
    index: int,
    device: str,
    painter_cfg: dict[str, Any],
    foreground_cfg: dict[str, Any],
    threads: int | None,
    conn: Connection,
) -> None:
    """Entry point of a worker process (must stay importable without side effects: it is spawned)."""
    # Ctrl-C reaches the whole process group: let the server shut its workers down in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _limit_threads(threads)
    try:
        if threads is not None:
            import cv2

            cv2.setNumThreads(threads)
        painter = build_painter(**{"device": device, **painter_cfg})  # painter.device in the config wins
        painter.load()
        fg_cfg = dict(foreground_cfg)
        if fg_cfg.get("name") in ("ben2", "sam2") and fg_cfg.get("device") is None:
            fg_cfg["device"] = device  # the model maskers run on the worker's device unless the config names one
        masker = load_masker(build_masker(**fg_cfg))  # weights load now: a missing folder fails the start
        if threads is not None and "torch" in sys.modules:  # after the masker: it may be what imported torch
            sys.modules["torch"].set_num_threads(threads)  # oversubscribed CPU threads spin: 20x slower here
    except BaseException as e:  # report why, then exit: the server decides whether to try again
        _send(conn, ("error", f"worker {index} on {device} could not start: {type(e).__name__}: {e}"))
        conn.close()
        return
    if not _send(conn, ("ready", os.getpid())):
        return
    # image decoding and the per-job finishing work (paste-back, PNG encode, fsync, re-read, audit) release the GIL:
    # run them across the worker's threads, so the GPU waits ~1/threads as long between batches
    pool = ThreadPoolExecutor(max_workers=max(1, threads or 1), thread_name_prefix="synth-io")
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):
            break  # the server is gone
        if items is None:
            break
        if not _send(conn, ("done", run_batch(painter, masker, items, pool=pool))):
            break
    pool.shutdown(wait=False)
    conn.close()


def _send(conn: Connection, msg: Any) -> bool:
    """Send to the server; False when it is gone, so an orphaned worker exits quietly (no BrokenPipe traceback; its
    temp files are swept at the next server start)."""
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, OSError):
        return False
    return True


def _audit_dict(a: Audit) -> dict[str, Any]:
    return dict(
        passed=a.passed,
        foreground_pixels=a.foreground_pixels,
        mismatched_pixels=a.mismatched_pixels,
        boxes_inside=a.boxes_inside,
        boxes_nonempty=a.boxes_nonempty,
        size_ok=a.size_ok,
        message=a.message,
    )


def _load_image(item: dict[str, Any]) -> Image.Image:
    """The job's input, decoded: its bytes, or the checked file opened without following a link."""
    if item.get("image_bytes") is not None:
        source = contextlib.nullcontext(io.BytesIO(item["image_bytes"]))
    else:
        source = open_input(item["image_root"], item["image_parts"], item.get("image_identity"))
    with source as fh:
        image = Image.open(fh)
        image.load()
    return image


def _try_load(item: dict[str, Any]) -> Image.Image | Exception:
    try:
        return _load_image(item)
    except Exception as e:  # reported per job below
        return e


def run_batch(painter, masker, items: list[dict[str, Any]], pool: Executor | None = None) -> list[dict[str, Any]]:
    """Mask, paint, paste back, write and audit a batch of work items.

    Each item: ``uid, job_id, image_path | image_bytes, boxes`` (input pixels, already clipped to the image),
    ``description, seed, canvas`` (CanvasParams as a dict), ``output_path`` and ``tmp_path`` (where to write; the
    server publishes it as ``output_path``). Each result: ``uid, ok, error, result`` (a ``JobResult`` dict),
    ``tmp_path`` (when written) and the timings ``run_s, paint_s``.
    """
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    prepared: list[tuple[dict[str, Any], PaintJob, np.ndarray, list[list[float]], CanvasGeometry]] = []
    mapper = pool.map if pool is not None else map
    loaded = list(mapper(_try_load, items))
    staged: list[tuple[dict[str, Any], CanvasGeometry, np.ndarray, list[list[float]]]] = []
    for item, image in zip(items, loaded):
        edit = item.get("edit")
        if edit is not None and edit.get("scene") is not None:  # toy edits: rendered from the scene, no painter
            results[item["uid"]] = _toy_edit(item, image, masker)
            continue
        if edit is not None and edit.get("toy_math") is not None:  # toy math instruction edits: the same, no painter
            results[item["uid"]] = _toy_math_edit(item, image, masker)
            continue
        try:
            if isinstance(image, Exception):
                raise image
            geom = CanvasGeometry.from_params(image.width, image.height, **item["canvas"])
            canvas = place_image(image, geom)
            sx, sy = geom.img_w / geom.src_w, geom.img_h / geom.src_h
            img_boxes = [[b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy] for b in item["boxes"]]
            staged.append((item, geom, canvas, img_boxes))
        except Exception as e:
            results[item["uid"]] = _failure(item, f"could not prepare the job: {type(e).__name__}: {e}")
    for (item, geom, canvas, _), fg in zip(staged, _foregrounds(masker, staged)):
        edit = item.get("edit")
        try:
            if isinstance(fg, Exception):
                raise fg
            keep = mask_to_canvas(fg, geom)
            known = mask_to_canvas(np.ones((geom.img_h, geom.img_w), dtype=bool), geom)
            out_boxes = [geom.transform_box(b) for b in item["boxes"]]
            description = item["description"]
            if _is_instruction(item):  # the painter edits the whole image; the boxes' foreground (if any) is kept
                description = edit["steps"][0]["params"]["instruction"]
            elif edit is not None:  # inpaint (real images): only the regions are painted, around the kept foreground
                params = edit["steps"][0]["params"]
                keep = keep | ~boxes_mask(params["regions"], geom.canvas_w, geom.canvas_h)
                description = params["description"]
            job = PaintJob(item["job_id"], canvas, keep, known, description, int(item["seed"]))
            prepared.append((item, job, canvas, out_boxes, geom))
        except Exception as e:
            results[item["uid"]] = _failure(item, f"could not prepare the job: {type(e).__name__}: {e}")
    paint_s = 0.0
    painted: list[np.ndarray] = []
    if prepared:
        t_paint = time.perf_counter()
        kept, painted = [], []
        for group in (
            [p for p in prepared if not _is_instruction(p[0])],
            [p for p in prepared if _is_instruction(p[0])],
        ):
            if not group:
                continue
            try:
                images = _paint_group(painter, group)
            except Exception as e:
                msg = f"painter {painter.name!r} failed: {type(e).__name__}: {e}"
                for item, *_ in group:
                    results[item["uid"]] = _failure(item, msg, detail=traceback.format_exc(limit=5))
                continue
            kept += group
            painted += images
        prepared = kept
        paint_s = time.perf_counter() - t_paint

    def finish(args) -> dict[str, Any]:
        (item, job, canvas, out_boxes, geom), image = args
        try:
            return _finish(item, job, canvas, out_boxes, geom, image, painter, masker, len(prepared))
        except Exception as e:
            return _failure(item, f"could not write the result: {type(e).__name__}: {e}")

    for (item, *_), res in zip(prepared, mapper(finish, zip(prepared, painted))):
        results[item["uid"]] = res
    run_s = time.perf_counter() - t0
    out = []
    for item in items:
        r = results[item["uid"]]
        r.update(run_s=run_s, paint_s=paint_s)
        out.append(r)
    return out


def _is_instruction(item: dict[str, Any]) -> bool:
    edit = item.get("edit")
    return edit is not None and edit["steps"][0]["kind"] == "instruction"


def _foregrounds(masker, staged: list) -> list[np.ndarray | Exception]:
    """The kept foreground of every staged job (``(item, geometry, canvas, boxes in image pixels)``), on its image's
    pixels: the whole batch's images in one masker call when the masker batches (SAM 2: one forward per box count),
    retried image by image when that call fails, so a failure costs only the job whose image fails. A box-less
    instruction edit keeps nothing, and no masker is asked about no boxes."""
    out: list[np.ndarray | Exception] = [np.zeros((g.img_h, g.img_w), dtype=bool) for _, g, _, _ in staged]
    need = [i for i, (_, _, _, boxes) in enumerate(staged) if boxes]
    crops = [staged[i][2][staged[i][1].image_region()] for i in need]
    try:
        for i, mask in zip(need, keep_masks(masker, crops, [staged[i][3] for i in need])):
            out[i] = mask
    except Exception:
        for i, crop in zip(need, crops):
            try:
                out[i] = keep_mask(masker, crop, staged[i][3])
            except Exception as e:  # this job fails, as "could not prepare the job"
                out[i] = e
    return out


def _paint_group(painter, group: list) -> list[np.ndarray]:
    """Paint a group of prepared jobs: repaint / inpaint jobs with ``paint``, instruction edits with ``edit_images``."""
    jobs = [p[1] for p in group]
    if _is_instruction(group[0][0]):
        if not hasattr(painter, "edit_images"):
            raise RuntimeError(
                "it cannot follow edit instructions on real images: configure an instruction painter "
                "(configs/synth/qwen_image_edit.yaml), or send a toy math image with edit.toy_math"
            )
        images = painter.edit_images(jobs)
    else:
        images = painter.paint(jobs)
    if len(images) != len(jobs):
        raise RuntimeError(f"painter returned {len(images)} images for {len(jobs)} jobs")
    return images


def _failure(item: dict[str, Any], error: str, detail: str | None = None) -> dict[str, Any]:
    return dict(uid=item["uid"], job_id=item["job_id"], ok=False, error=error, detail=detail, result=None)


def _toy_edit(item: dict[str, Any], image: Image.Image | Exception, masker) -> dict[str, Any]:
    """A toy-world visual edit: ``core.toy.edits.execute_job`` for each step, from the request's scene. No paste
    back: the render itself must leave the target's foreground (its shape's pixels) as in the input, which the audit
    checks, so a scene that does not describe the image, or an edit that would touch the target, fails the job.
    A ``zoom`` step maps the boxes, and the audit's reference and foreground with them (``core.toy.edits.zoom_array``: the
    input's pixels repeated): the target's pixels must be the input's wherever the input's shape maps onto the
    re-drawn shape (the larger drawing adds edge pixels of its own, which are checked against the shape's colour)."""
    try:
        if isinstance(image, Exception):
            raise image
        reference = np.asarray(image.convert("RGB"), dtype=np.uint8)
        scene = item["edit"]["scene"]
        keep = foreground_mask(scene, item["boxes"])
        boxes = [list(b) for b in item["boxes"]]
        edited, zoomed = None, False
        for step in item["edit"]["steps"]:
            edited, scene = execute_job(scene, {"kind": step["kind"], "params": step["params"]})
            if step["kind"] == ZOOM_KIND:
                factor, origin = step["params"]["factor"], step["params"]["origin"]
                reference, keep = zoom_array(reference, factor, origin), zoom_array(keep, factor, origin)
                boxes = [zoom_box(b, factor, origin) for b in boxes]
                zoomed = True
        final = np.asarray(edited.convert("RGB"), dtype=np.uint8)
        if zoomed:
            drawn = foreground_mask(scene, boxes)
            for b in boxes:  # each kept shape is drawn in one colour: the input's (checked on keep & drawn below)
                shape = drawn & foreground_mask(scene, [b])
                inner = final[shape & keep]
                if not len(inner) or (final[shape] != inner[0]).any():
                    raise ValueError(f"the zoomed object at {b} is not drawn in the one colour of its input pixels")
            keep = keep & drawn
    except Exception as e:
        return _failure(item, f"could not run the edit: {type(e).__name__}: {e}")
    h, w = reference.shape[:2]
    try:
        return _write_audited(item, final, reference, keep, boxes, w, h, "toy-edit", masker, 1, scene)
    except Exception as e:
        return _failure(item, f"could not write the result: {type(e).__name__}: {e}")


def _toy_math_edit(item: dict[str, Any], image: Image.Image | Exception, masker) -> dict[str, Any]:
    """A toy math instruction edit (``core.toy_math.edits``): the input must be the render of ``edit.toy_math``'s
    scene; the instruction is executed on the scene, the problem's answer re-derived (an answer-changing or unknown
    instruction fails the job, so the caller keeps its row), and the edited scene re-rendered. No boxes: the audit
    checks the file as written against that render, pixel for pixel."""
    try:
        if isinstance(image, Exception):
            raise image
        given = np.asarray(image.convert("RGB"), dtype=np.uint8)
        problem = item["edit"]["toy_math"]
        expected = np.asarray(render(problem.get("scene", problem)), dtype=np.uint8)
        if expected.shape != given.shape or (expected != given).any():
            differ = (
                "its size differs"
                if expected.shape != given.shape
                else f"{int((expected != given).any(-1).sum())} pixels differ"
            )
            raise ValueError(
                f"edit.toy_math does not describe the input image ({differ}): send the meta of this image's row"
            )
        edited = edit_problem(problem, item["edit"]["steps"][0]["params"]["instruction"], seed=int(item["seed"]))
        final = np.asarray(render(edited.get("scene", edited)).convert("RGB"), dtype=np.uint8)
    except Exception as e:
        return _failure(item, f"could not run the instruction edit: {type(e).__name__}: {e}")
    h, w = final.shape[:2]
    try:
        return _write_audited(item, final, final, np.zeros((h, w), bool), [], w, h, "toy-math-edit", masker, 1, edited)
    except Exception as e:
        return _failure(item, f"could not write the result: {type(e).__name__}: {e}")


def _whole_image_audit(on_disk: np.ndarray, expected: np.ndarray, width: int, height: int) -> Audit:
    """The audit of a box-less (instruction edit) job: the file as written decodes to the image the edit produced,
    at the input's size. There is no foreground to keep and no box to check (``boxes_*`` hold vacuously)."""
    size_ok = on_disk.shape == (height, width, 3) and on_disk.dtype == np.uint8
    mismatched = int((on_disk != expected).any(-1).sum()) if size_ok and on_disk.shape == expected.shape else -1
    passed = size_ok and mismatched == 0
    msg = "ok (no boxes: the file is the edited image)" if passed else (
        f"output is {on_disk.shape}, expected ({height}, {width}, 3)" if not size_ok
        else f"{mismatched} pixels of the file differ from the edited image")  # fmt: skip
    return Audit(passed, 0, max(mismatched, 0), True, True, size_ok, msg)


def _finish(item, job: PaintJob, canvas, out_boxes, geom: CanvasGeometry, image, painter, masker, batch_size):
    image = np.asarray(image, dtype=np.uint8)
    if image.shape != canvas.shape:
        return _failure(item, f"painter returned a {image.shape} image for a {canvas.shape} canvas")
    final = paste_back(image, canvas, job.keep)
    return _write_audited(
        item, final, canvas, job.keep, out_boxes, geom.canvas_w, geom.canvas_h, painter.name, masker, batch_size
    )


def _write_audited(
    item, final, reference, keep, out_boxes, width: int, height: int, painter_name: str, masker, batch_size: int,
    scene: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    # A temp file next to the output (the path the server chose), read back and audited. The server renames it over
    # the output (os.replace is atomic on POSIX) only if the job is still wanted when the result arrives, so a job
    # cancelled while it ran can never replace a newer job's file; a reader never sees a partial or unaudited file.
    # Both are written below output_dir without following a link (synth.beneath): the client's folder is opened one
    # component at a time from a descriptor of output_dir, and the temp file is created, read back and removed
    # relative to it, so a link put in the folder's place is never written through.
    out_path, tmp = item["output_path"], item["tmp_path"]
    folder = relative_parts(os.path.dirname(out_path), item["output_dir"])
    if folder is None:
        return _failure(item, f"the output {out_path!r} is not below the server's output_dir {item['output_dir']!r}")
    out_name, tmp_name = os.path.basename(out_path), os.path.basename(tmp)
    with opened_dir(item["output_dir"], folder, create=True) as d:
        identity = item.get("image_identity")
        if identity is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(out_name, dir_fd=d, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == tuple(identity):
                    return _failure(item, f"refusing to overwrite the input image {item['image_path']}")
        written = False
        try:
            unlink_quietly(d, tmp_name)  # a killed earlier attempt's; the name is this job's own
            with os.fdopen(open_file(d, tmp_name, os.O_RDWR | os.O_CREAT | os.O_EXCL), "w+b") as f:
                Image.fromarray(final, "RGB").save(f, format="PNG", compress_level=1)
                f.flush()
                if item.get("fsync"):
                    os.fsync(f.fileno())
                tmp_identity = file_identity(os.fstat(f.fileno()))  # what the server may publish, and nothing else
                f.seek(0)
                with Image.open(f) as on_file:
                    on_disk = np.asarray(on_file.convert("RGB"), dtype=np.uint8)
            if out_boxes:
                audit = audit_result(on_disk, reference, keep, out_boxes, width, height)
            else:  # a box-less instruction edit: the whole file is checked against what the edit produced
                audit = _whole_image_audit(on_disk, final, width, height)
            if not audit.passed:
                return dict(_failure(item, f"audit failed: {audit.message}"), audit=_audit_dict(audit))
            written = True
        finally:
            if not written:
                unlink_quietly(d, tmp_name)
    result = dict(
        output_path=out_path,
        width=width,
        height=height,
        boxes=[list(b) for b in out_boxes],
        audit=_audit_dict(audit),
        painter=painter_name,
        foreground="scene" if scene is not None else getattr(masker, "name", type(masker).__name__),
        batch_size=batch_size,
        scene=scene,
    )
    return dict(
        uid=item["uid"], job_id=item["job_id"], ok=True, error=None, detail=None, result=result, tmp_path=tmp,
        tmp_identity=tmp_identity,
    )  # fmt: skip
