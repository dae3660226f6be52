"""The data server's API: the pydantic models that the HTTP server and ``synth.client`` both use.

Training talks to synthesis only through these models (docs/data_server.md). A job is identified by the
client-chosen ``job_id`` (e.g. ``f"{sample_id}@e{epoch}"``): resubmitting the same request is a no-op that returns
the existing job, so a trainer that crashed and resumed never duplicates work or loses a sample. Boxes are
``[x1, y1, x2, y2]`` in pixels of the input image (COCO / VLM-R1 convention); the result's boxes are in pixels of the
output canvas.

Clients and their jobs: every request carries a bearer token, and the token says who the caller is.

- A **client token** is ``<client_id>.<mac>``, the client id bound to it by ``mac = HMAC-SHA256(secret,
  "synth-client:" + client_id)`` (:func:`client_token`). A client sees only its own jobs: a job is keyed by
  (client id, ``job_id``), so another client's ``job_id`` is simply unknown to it (404), its list holds only its own
  jobs, and two clients may use the same ``job_id`` without meeting. A trainer derives its client id from its run
  (``callbacks.synthesis``), so after a resume it presents the same identity and its pending jobs are still its own.
- The **admin token** is the server's secret itself (``$SYNTH_TOKEN`` or ``token_file``). The admin sees every
  client's jobs: ``GET /jobs`` lists all of them (each status names its ``client``), and ``?client=<id>`` on any
  endpoint acts in that client's name. Without ``?client=``, the admin's own submissions are client ``admin``.

Endpoints (all need ``Authorization: Bearer <token>``; each also takes ``?client=<id>``, the admin's only):

- ``POST /jobs`` body :class:`JobRequest` -> 202 :class:`JobStatus` (200 when the job already existed)
- ``GET /jobs/{job_id}`` -> :class:`JobStatus`; ``?include_image=true`` adds the output PNG as base64
- ``GET /jobs/{job_id}/image`` -> the output PNG
- ``GET /jobs?state=done&state=failed&since=<cursor>&limit=<n>`` -> :class:`JobList`
- ``POST /jobs/{job_id}/ack`` or ``DELETE /jobs/{job_id}`` -> :class:`Ack` (the server forgets the job)
- ``GET /health`` -> :class:`Health`
- ``GET /openapi.json``, ``/docs``, ``/redoc``: the schema and its viewers (config ``docs``)

Every error answer is an :class:`ErrorBody`. Bodies are JSON (``Content-Type: application/json``, else 415) read
strictly: no coercion (``true`` is not a number, ``"10"`` is not an integer). Query parameters are strings parsed as
documented: integers as plain decimal digits, booleans as ``true`` or ``false``.

A job either repaints the image's background after ``description`` (Syn-GRPO) or, with ``edit`` (:class:`VisualEdit`),
edits it (EvolvedGRPO's visual edits: toy-world scene edits, or inpainting of regions on real images); both keep the
boxes' foreground, audited on the file as written (docs/data_server.md, "Visual edit jobs"). An ``instruction`` edit
(EvolvedGRPO's image edits) edits the whole image after a free-text instruction and is the one job that may have no
boxes: its audit then checks the whole file against the edited image (docs/data_server.md, "Instruction edit jobs").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

API_VERSION = "1"

MAX_DESCRIPTION_CHARS = 4000
"""Longest ``JobRequest.description``; a client cuts longer text (the policy may write more: OVD allows 512 tokens)."""

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@:+=-]{0,127}$"
"""Job ids name output files, so they are restricted to a safe character set (no slashes), 1 to 128 characters."""


CLIENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Client ids name the client's output folder, so they are restricted to a safe character set, 1 to 64 characters."""

ADMIN_CLIENT = "admin"
"""The client id of jobs the admin submits without ``?client=``. Reserved: no client token names it (one made by hand
with the secret is refused when used), so no client reads or acknowledges the admin's own jobs."""


def _client_mac(secret: str, client_id: str) -> str:
    return hmac.new(secret.encode(), f"synth-client:{client_id}".encode(), hashlib.sha256).hexdigest()


def client_token(secret: str, client_id: str) -> str:
    """The bearer token of client ``client_id`` on a server whose secret (admin token) is ``secret``.

    ``python -m synth.server token CLIENT_ID`` prints it, so an operator can hand a client its own token without the
    secret; a trainer that holds the secret derives its own."""
    if not re.fullmatch(CLIENT_ID_PATTERN, client_id):
        raise ValueError(f"client id {client_id!r} must match {CLIENT_ID_PATTERN} (letters, digits, '.', '_', '-')")
    if client_id == ADMIN_CLIENT:
        raise ValueError(
            f"client id {ADMIN_CLIENT!r} is reserved for the admin's own jobs: choose another id "
            "(the admin uses the server's secret itself)"
        )
    return f"{client_id}.{_client_mac(secret, client_id)}"


def verify_client_token(secret: str, token: str) -> str | None:
    """The client id a client token names, when its MAC is right under ``secret``; else None."""
    client_id, dot, mac = token.rpartition(".")
    if not dot or not re.fullmatch(CLIENT_ID_PATTERN, client_id) or client_id == ADMIN_CLIENT:
        return None
    return client_id if hmac.compare_digest(mac.encode(), _client_mac(secret, client_id).encode()) else None


def is_client_token(token: str) -> bool:
    """True when ``token`` has the shape of a client token (``<client_id>.<64 hex digits>``)."""
    client_id, dot, mac = token.rpartition(".")
    return bool(dot) and re.fullmatch(CLIENT_ID_PATTERN, client_id) is not None and re.fullmatch(r"[0-9a-f]{64}", mac)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _field_error(model: str, loc: tuple[str | int, ...], kind: str, message: str, value: Any) -> ValidationError:
    """A validation error of a model-level check, located at the field it is about (a 422's ``errors[].field``)."""
    error = PydanticCustomError(kind, message)  # type: ignore[arg-type]  # message has no {placeholders}
    return ValidationError.from_exception_data(model, [InitErrorDetails(type=error, loc=loc, input=value)])


class ImageRef(_Model):
    """The input image: a path readable by the server, or the encoded file itself. Exactly one of the two."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["path"], "properties": {"path": {"type": "string", "minLength": 1}}},
                {"required": ["data_b64"], "properties": {"data_b64": {"type": "string"}}},
            ]
        },
    )

    path: str | None = None
    """Absolute, or relative to the server's first root; must resolve under one of the server's ``roots``."""
    data_b64: str | None = None
    """Base64 of an encoded image file (PNG, JPEG, ...), for trainers that do not share a filesystem with the server."""

    @model_validator(mode="after")
    def _one_of(self) -> ImageRef:
        if (self.path is None) == (self.data_b64 is None):
            raise ValueError("give exactly one of image.path and image.data_b64")
        if self.path is not None and not self.path.strip():
            raise ValueError("image.path is empty")
        if self.path is not None and "\x00" in self.path:
            raise ValueError("image.path contains a NUL byte, which no file name can hold: send the path as written")
        return self

    def decoded(self) -> bytes:
        """The bytes of ``data_b64`` (raises ValueError on bad base64)."""
        try:
            return base64.b64decode(self.data_b64 or "", validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"image.data_b64 is not valid base64: {e}") from e

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageRef:
        return cls(data_b64=base64.b64encode(data).decode("ascii"))


class CanvasParams(_Model):
    """Where the input goes on the output canvas (outpainting extends the canvas; boxes follow the same map).

    The input is resized by ``scale``, then placed at (``offset_x``, ``offset_y``) on a canvas of ``width x height``
    (default: the resized image grown by ``extend`` of its size, centred). Boxes map as
    ``x' = x * scale + offset_x`` (exactly: ``x * img_w / src_w + offset_x``). The defaults leave the image as it is.
    """

    scale: float = Field(1.0, gt=0, le=8)
    """Resize factor of the input. 1 keeps the foreground bit-identical to the input."""
    extend: float = Field(0.0, ge=0, le=4)
    """Extra canvas as a fraction of the resized image's width and height (0.5: a canvas 1.5 x as wide and high)."""
    width: int | None = Field(None, ge=1)
    """Canvas width in pixels (overrides ``extend``); at least the resized image's width."""
    height: int | None = Field(None, ge=1)
    """Canvas height in pixels (overrides ``extend``); at least the resized image's height."""
    offset_x: int | None = Field(None, ge=0)
    """Left edge of the image on the canvas; default centred."""
    offset_y: int | None = Field(None, ge=0)
    """Top edge of the image on the canvas; default centred."""


TOY_EDIT_KINDS = ("lookalikes", "clutter", "occlude", "declutter", "isolate", "zoom")
"""Visual edits of a toy-world scene (``core.toy.edits.execute_job``): re-rendered from the scene, exact labels."""
INSTRUCTION_KIND = "instruction"
"""A free-text edit instruction (EvolvedGRPO's ``edit_instruction``): toy math scenes run ``core.toy_math.edits``, real
images an instruction image-edit painter (``synth.painters.InstructionEditPainter``)."""
EDIT_KINDS = TOY_EDIT_KINDS + ("inpaint", INSTRUCTION_KIND)
MAX_INSTRUCTION_CHARS = 1000
"""Longest ``params.instruction`` (the seed's instructions are one sentence plus a fixed safety suffix)."""


class EditStep(_Model):
    """One visual edit (EvolvedGRPO's visual instruction evolution, docs/evolved_grpo.md).

    - a toy kind (``TOY_EDIT_KINDS``): ``params`` as ``datamodules.edit_plans.plan_visual_edit`` writes them (``zoom``
      maps the boxes: the result's ``boxes`` are where the request's boxes land);
    - ``inpaint`` (real images): ``params = {"description": str, "regions": [[x1, y1, x2, y2], ...]}``: the server's
      painter repaints the regions (input pixels) after the description of the distractors to add there; the boxes'
      foreground is kept as in any job;
    - ``instruction``: ``params = {"instruction": str}`` (1 to ``MAX_INSTRUCTION_CHARS`` characters, nothing else):
      the whole image is edited after the instruction (docs/data_server.md, "Instruction edit jobs").
    """

    kind: Literal["lookalikes", "clutter", "occlude", "declutter", "isolate", "zoom", "inpaint", "instruction"]
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _inpaint_params(self) -> EditStep:
        if self.kind == INSTRUCTION_KIND:
            extra = sorted(set(self.params) - {"instruction"})
            if extra:
                msg = f"an instruction edit takes only params.instruction; unknown params.{extra[0]}"
                raise _field_error("EditStep", ("params", extra[0]), "extra_forbidden", msg, self.params[extra[0]])
            text = self.params.get("instruction")
            if not isinstance(text, str) or not text.strip() or len(text) > MAX_INSTRUCTION_CHARS:
                msg = (
                    f"an instruction edit needs params.instruction, a non-blank string of at most "
                    f"{MAX_INSTRUCTION_CHARS} characters"
                )
                raise _field_error("EditStep", ("params", "instruction"), "instruction_invalid", msg, text)
            return self
        if self.kind != "inpaint":
            return self
        desc, regions = self.params.get("description"), self.params.get("regions")
        if not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION_CHARS:
            raise ValueError(f"an inpaint edit needs params.description, a string of at most {MAX_DESCRIPTION_CHARS}")
        if not isinstance(regions, list) or not regions:
            raise ValueError("an inpaint edit needs params.regions, a non-empty list of [x1, y1, x2, y2] boxes")
        for i, b in enumerate(regions):
            ok = isinstance(b, list) and len(b) == 4 and all(isinstance(v, int | float) and math.isfinite(v) for v in b)
            if not ok or b[2] <= b[0] or b[3] <= b[1]:
                raise ValueError(f"params.regions[{i}] = {b!r} must be a non-empty box [x1, y1, x2, y2]")
        return self


class VisualEdit(_Model):
    """Edit the image instead of repainting its background: ``steps`` run in order on the input image. Toy steps need
    ``scene`` (the scene's ``meta`` as ``datamodules.toy`` writes it, describing the input image exactly); the result
    then carries the edited scene. The target's foreground (the request's ``boxes``) is never touched: the audit
    checks it on the file as written."""

    steps: list[EditStep] = Field(min_length=1, max_length=8)
    scene: dict[str, Any] | None = None
    toy_math: dict[str, Any] | None = None
    """For an instruction edit of a toy visual-math image: the row's ``meta`` (``scene``, ``query``, ``follow_ups``,
    as ``datamodules.toy_math`` writes it; the problem's answer must survive the edit) or its bare ``scene`` (every
    count and value must). The result's ``scene`` is the same form, edited."""

    @model_validator(mode="after")
    def _scene_for_toy_steps(self) -> VisualEdit:
        instruction = [s.kind == INSTRUCTION_KIND for s in self.steps]
        if any(instruction):
            if len(self.steps) != 1:
                raise ValueError("an instruction edit is one step per job (chain clauses inside the instruction)")
            if self.scene is not None:
                raise ValueError("an instruction edit takes edit.toy_math (a toy math row's meta), not edit.scene")
            if self.toy_math is not None:
                inner = self.toy_math.get("scene", self.toy_math)
                if not isinstance(inner, dict) or inner.get("kind") not in ("shapes", "bars"):
                    msg = "edit.toy_math must be a toy math row's meta or its scene (kind shapes or bars)"
                    raise _field_error("VisualEdit", ("toy_math",), "toy_math_invalid", msg, self.toy_math)
                if "scene" in self.toy_math and not isinstance(self.toy_math.get("query"), dict):
                    msg = "edit.toy_math (a row's meta) needs its query, to re-derive the answer"
                    raise _field_error("VisualEdit", ("toy_math", "query"), "toy_math_invalid", msg, None)
            return self
        if self.toy_math is not None:
            msg = "edit.toy_math goes with an instruction edit step only"
            raise _field_error("VisualEdit", ("toy_math",), "toy_math_invalid", msg, self.toy_math)
        toy = [s.kind in TOY_EDIT_KINDS for s in self.steps]
        if any(toy) and self.scene is None:
            raise ValueError(f"toy edit steps ({TOY_EDIT_KINDS}) need edit.scene, the toy scene's meta")
        if not any(toy) and len(self.steps) != 1:
            raise ValueError("an inpaint edit is one step per job: send the others as their own jobs")
        if any(toy) and not all(toy):
            raise ValueError("an edit mixes toy steps and inpaint steps: send them as two jobs")
        return self

    @property
    def is_toy(self) -> bool:
        return self.steps[0].kind in TOY_EDIT_KINDS

    @property
    def is_instruction(self) -> bool:
        return self.steps[0].kind == INSTRUCTION_KIND


class JobRequest(_Model):
    """A synthesis job: repaint everything but the boxes' foreground of ``image`` after ``description``, or, with
    ``edit``, edit the image (visual instruction evolution) keeping the boxes' foreground."""

    job_id: str = Field(pattern=JOB_ID_PATTERN)
    """Chosen by the client, unique per intended result (e.g. ``sample_id@e3``): the idempotency key."""
    sample_id: str = Field(min_length=1, max_length=256)
    """The sample this image belongs to (never changes across image versions)."""
    image: ImageRef
    boxes: list[Annotated[list[float], Field(min_length=4, max_length=4)]] = Field(max_length=256)
    """Ground-truth boxes ``[x1, y1, x2, y2]`` in input pixels, x2 > x1 and y2 > y1, inside the image (up to the
    server's ``box_tolerance_px``); their contents are kept. At least one, except for an instruction edit, which may
    have none (math images; its audit is then on the whole file: docs/data_server.md, "Instruction edit jobs")."""
    description: str = Field(max_length=MAX_DESCRIPTION_CHARS)
    """What the new image should show (the policy's ``<description>``); may be empty."""
    seed: int = Field(0, ge=0, lt=2**63)
    canvas: CanvasParams = Field(default_factory=CanvasParams)
    return_bytes: bool = False
    """Include the output PNG (base64) in the job's result, for trainers without the shared filesystem."""
    edit: VisualEdit | None = None
    """A visual edit instead of a repaint (``description`` is then unused); the canvas must stay the image's."""

    @model_validator(mode="after")
    def _edit_canvas_and_boxes(self) -> JobRequest:
        if self.edit is not None and self.canvas != CanvasParams():
            raise ValueError("an edit job keeps the image's canvas: leave canvas at its defaults")
        instruction = self.edit is not None and self.edit.is_instruction
        if not self.boxes and not instruction:
            msg = "boxes must hold at least one box; only an instruction edit job may have none"
            raise _field_error("JobRequest", ("boxes",), "too_short", msg, self.boxes)
        if instruction and self.edit.toy_math is not None and self.boxes:
            msg = "boxes must be empty for a toy math instruction edit (a math image has no boxes)"
            raise _field_error("JobRequest", ("boxes",), "boxes_not_empty", msg, self.boxes)
        return self

    @field_validator("boxes")
    @classmethod
    def _boxes(cls, boxes: list[list[float]]) -> list[list[float]]:
        for i, b in enumerate(boxes):
            if len(b) != 4:
                raise ValueError(f"boxes[{i}] must have 4 numbers [x1, y1, x2, y2], got {len(b)}")
            if not all(math.isfinite(v) for v in b):
                raise ValueError(f"boxes[{i}] has a non-finite coordinate: {b}")
            if b[2] <= b[0] or b[3] <= b[1]:
                raise ValueError(f"boxes[{i}] = {b} is empty: need x2 > x1 and y2 > y1")
        return boxes

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: two requests with the same ``job_id`` must have the same fingerprint."""
        return hashlib.sha256(self.model_dump_json().encode("utf-8")).hexdigest()


class JobState(str, Enum):
    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


class AuditResult(_Model):
    """Checks on the finished image, made on the file as written. ``passed`` only when all hold."""

    passed: bool
    foreground_pixels: int
    """Pixels kept from the input (inside the boxes)."""
    mismatched_pixels: int
    """Kept pixels that differ from the input; 0 on a passed audit."""
    boxes_inside: bool
    boxes_nonempty: bool
    size_ok: bool
    message: str


class Timings(_Model):
    """Unix times and durations (seconds) of a job."""

    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_s: float | None = None
    run_s: float | None = None
    """Wall time of the attempt that finished, in the worker (mask + paint + compose + write + audit)."""
    paint_s: float | None = None
    """The painter's share of ``run_s`` (of the whole batch when jobs were painted together)."""


class JobResult(_Model):
    output_path: str
    """Absolute path of the output PNG on the server's filesystem (written atomically; never an input file)."""
    width: int
    height: int
    boxes: list[list[float]]
    """The request's boxes on the output canvas."""
    audit: AuditResult
    painter: str
    foreground: str
    """Foreground masker used."""
    batch_size: int = 1
    """How many jobs were painted in the same batch."""
    image_b64: str | None = None
    """The output PNG, when the request asked for ``return_bytes`` (or the GET for ``include_image``)."""
    scene: dict[str, Any] | None = None
    """The edited toy scene (its meta: objects, description, occluders, edits), for a job with toy edit steps; for a
    toy math instruction edit, ``edit.toy_math`` edited (the same form as sent)."""


class JobStatus(_Model):
    job_id: str
    client: str
    """The client the job belongs to (see the module docstring)."""
    sample_id: str
    state: JobState
    attempts: int = 0
    """Attempts started so far (a worker crash or timeout costs one; the server retries up to its limit)."""
    cursor: int = 0
    """Change counter: increases every time this job changes state; see :class:`JobList`."""
    result: JobResult | None = None
    error: str | None = None
    timings: Timings


class JobList(_Model):
    jobs: list[JobStatus]
    cursor: int
    """Pass as ``since`` to the next list call to get only jobs that changed after this one."""
    server_id: str
    """Changes when the server restarts (its job table is in memory): cursors of another ``server_id`` mean nothing,
    and jobs submitted to it are gone (``AsyncSubmitter`` resubmits them)."""


class Ack(_Model):
    job_id: str
    acknowledged: bool
    """False when the job was not known (already acknowledged, or never submitted)."""
    cancelled: bool = False
    """True when the job had not finished (queued or running): it will not run, or its result is discarded and no
    file is written; the ``job_id`` is free again."""


class WorkerInfo(_Model):
    index: int
    device: str
    pid: int | None
    alive: bool
    ready: bool
    busy: list[str]
    """Jobs the worker is painting now (a job cancelled while running stays here until its worker finishes)."""
    restarts: int
    error: str | None = None
    """Why the worker could not start (painter failed to load), if it could not."""


class Health(_Model):
    server_id: str
    """See :attr:`JobList.server_id`."""
    status: str
    """``ok`` (all workers ready), ``starting``, ``degraded`` (some workers down) or ``failed`` (no worker can start)."""
    version: str = API_VERSION
    painter: str
    foreground: str
    workers: list[WorkerInfo]
    queue_depth: int
    queue_capacity: int
    counts: dict[str, int]
    """Jobs held, by state: the caller's own (a client token, or the admin with ``?client=``), or every client's (the
    admin). ``queue_depth`` and ``queue_capacity`` are the server's, which every client needs for back-pressure."""
    uptime_s: float


class FieldError(_Model):
    """One invalid field of a request."""

    field: str
    """Where: the field path joined with dots (``boxes.0``, ``image.data_b64``, ``query.limit``), or ``body``."""
    message: str
    type: str | None = None
    """pydantic's error type (``missing``, ``string_pattern_mismatch``, ...), when the error came from validation."""


class ErrorBody(_Model):
    """Body of every 4xx / 5xx answer."""

    detail: str
    """What went wrong and, where it helps, how to fix it."""
    errors: list[FieldError] | None = None
    """Per-field validation errors: ``{"field": "boxes.0", "message": ...}``."""
