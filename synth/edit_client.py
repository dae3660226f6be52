"""Instruction image edits through the data server: EvolvedGRPO's image-edit rows, one call per batch of rows.

In EvolvedGRPO the question generator answers an image-edit row with ``{"edit_instruction": "..."}``, an image-edit
model applies it to the row's image, and the row keeps its problem and answer; any failure keeps the previous row.
:class:`InstructionEditor` sends each edit as an instruction edit job (``synth.api``: ``edit.steps = [{"kind":
"instruction", "params": {"instruction": ...}}]``, no boxes, the toy math meta as ``edit.toy_math``) and returns one
:class:`EditOutcome` per edit, in order: the edited image's path (and the edited scene for a toy math row), or the
reason it failed. It never raises on a failed job (unknown or answer-changing instruction, unreadable image, server
refusal, timeout): the caller keeps the row.

Job ids are derived from (row id, instruction, seed) alone, so a round that crashed and resubmits the same edits gets
the same jobs back (the server's idempotency: a finished job is returned, not run again, until acknowledged).

Typical use::

    with InstructionEditor() as editor:                     # no URL: a LocalServer (procedural, toy math edits)
        outcomes = editor.edit([InstructionEdit(row["id"], image_path, text, seed, scene=row["meta"]) ...])
    for row, out in zip(rows, outcomes):
        if out.error is None: row = {**row, "image": out.path, "meta": out.scene or row["meta"]}

CLI (one edit, the outcome printed as JSON; exit code 1 when it failed)::

    python -m synth.edit_client data/toy_math/images/x.png "make the background cream" --meta row.json
    python -m synth.edit_client photo.jpg "make it snow" --server-config configs/synth/qwen_image_edit.yaml
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from synth.api import INSTRUCTION_KIND, JobRequest, JobState, JobStatus, is_client_token
from synth.client import DEFAULT_CONFIG, LocalServer, SynthClient, SynthError

log = logging.getLogger("synth.edit_client")

CLIENT_ID = "instruction-edits"
"""The client id an editor uses on a server whose secret it holds (its jobs are apart from a trainer's)."""


@dataclass(frozen=True)
class InstructionEdit:
    """One image edit to make."""

    row_id: str
    """The row whose image is edited (enters the job id; becomes the job's ``sample_id``)."""
    image: str
    """Path of the row's current image, readable here (its bytes are sent, so the server needs no shared folder)."""
    instruction: str
    """The generator's ``edit_instruction``, 1 to ``synth.api.MAX_INSTRUCTION_CHARS`` characters."""
    seed: int
    """The edit's seed (enters the job id): the same seed gives the same pixels."""
    scene: dict | None = None
    """For a toy math row: its ``meta`` (``scene``, ``query``, ``follow_ups``; the answer must survive the edit) or
    its bare scene. None for a real image (the server then needs an instruction painter)."""


@dataclass(frozen=True)
class EditOutcome:
    """What became of one edit: ``path`` (and ``scene``) when it worked, else ``error``."""

    path: str | None
    """The edited PNG (written atomically; never the input file)."""
    scene: dict | None
    """The edited toy math meta (or scene), in the form the edit gave; None for a real image or a failure."""
    error: str | None
    """Why the edit failed (the row is then kept as it was); None on success."""


def job_id_for(row_id: str, instruction: str, seed: int) -> str:
    """The job id of an edit: a readable prefix of the row id and a hash of (row id, instruction, seed)."""
    digest = hashlib.sha256(f"{row_id}\x00{instruction}\x00{int(seed)}".encode()).hexdigest()[:24]
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", row_id)[:80].lstrip("._-") or "row"
    return f"{prefix}@ie-{digest}"


class InstructionEditor:
    """Submit instruction edits to a data server and collect their outcomes.

    Args:
        url: the server's base URL; its token comes from ``$SYNTH_TOKEN`` (the server's secret: the editor then acts
            as client ``instruction-edits``; or a client token, used as is). None: start a :class:`LocalServer` from
            ``server_config`` for the editor's lifetime.
        server_config: YAML of the local server (default ``configs/synth/procedural.yaml``: toy math edits on the
            CPU; ``configs/synth/qwen_image_edit.yaml`` edits real images on a GPU).
        server_overrides: more config keys for the local server (dotted keys, e.g. ``{"painter.steps": 2}``).
        output_dir: where the edited images go: the local server's ``output_dir`` (files under
            ``<output_dir>/admin/``); with a ``url``, each result is downloaded to ``<output_dir>/<job_id>.png``.
            None: the server's own output folder (the config's, relative to the repository).
        timeout_s: how long :meth:`edit` waits for a batch; unfinished jobs then fail (and are cancelled).
    """

    def __init__(
        self,
        url: str | None = None,
        server_config: str | None = None,
        server_overrides: dict | None = None,
        output_dir: str | None = None,
        timeout_s: float = 120.0,
    ):
        if timeout_s <= 0:
            raise ValueError(f"InstructionEditor timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.download_dir = timeout_s, None
        self.server: LocalServer | None = None
        if url is None:
            self.server = LocalServer(
                config=server_config or DEFAULT_CONFIG, roots=[], output_dir=output_dir, overrides=server_overrides
            )
            self.server.start()
            self.client = self.server.client()
        else:
            if server_config is not None or server_overrides:
                raise ValueError("InstructionEditor: server_config / server_overrides configure a local server; "
                                 "with url the server is already configured")  # fmt: skip
            token = os.environ.get("SYNTH_TOKEN") or None
            client_id = None if token is None or is_client_token(token) else CLIENT_ID
            self.client = SynthClient(url, token, client_id=client_id)
            self.download_dir = Path(output_dir) if output_dir is not None else None

    def __enter__(self) -> InstructionEditor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the local server, if this editor started one (its files stay)."""
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -- edits ----------------------------------------------------------------------------------------------------

    def request(self, edit: InstructionEdit) -> JobRequest:
        """The job of ``edit`` (raises ValueError / ValidationError on a bad edit or an unreadable image)."""
        data = Path(edit.image).read_bytes()
        return JobRequest.model_validate(
            {
                "job_id": job_id_for(edit.row_id, edit.instruction, edit.seed),
                "sample_id": edit.row_id[:256] or "row",
                "image": {"data_b64": base64.b64encode(data).decode("ascii")},
                "boxes": [],
                "description": "",
                "seed": int(edit.seed),
                "edit": {
                    "steps": [{"kind": INSTRUCTION_KIND, "params": {"instruction": edit.instruction}}],
                    "toy_math": edit.scene,
                },
            }
        )

    def edit(self, edits: Sequence[InstructionEdit]) -> list[EditOutcome]:
        """One outcome per edit, in order. Never raises on a failed job: its outcome carries the error."""
        outcomes: list[EditOutcome | None] = [None] * len(edits)
        submitted: dict[str, list[int]] = {}  # job id -> indices (the same edit twice is one job)
        for i, e in enumerate(edits):
            try:
                req = self.request(e)
            except (OSError, ValueError, ValidationError) as err:
                outcomes[i] = EditOutcome(None, None, f"could not build the job: {_short(err)}")
                continue
            if req.job_id in submitted:
                submitted[req.job_id].append(i)
                continue
            try:
                self.client.submit(req)
            except (SynthError, ConnectionError) as err:
                outcomes[i] = EditOutcome(None, None, f"the server refused the job: {_short(err)}")
                continue
            submitted[req.job_id] = [i]
        finished = self._wait(list(submitted))
        for job_id, idx in submitted.items():
            outcome = self._outcome(job_id, finished.get(job_id))
            for i in idx:
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _wait(self, job_ids: list[str]) -> dict[str, JobStatus]:
        if not job_ids:
            return {}
        try:
            return self.client.wait(job_ids, timeout=self.timeout_s)
        except TimeoutError:
            found = {}
            for job_id in job_ids:  # collect what did finish
                try:
                    status = self.client.get(job_id)
                except (SynthError, ConnectionError):
                    continue
                if status.state in (JobState.done, JobState.failed):
                    found[job_id] = status
            return found
        except (SynthError, ConnectionError) as err:
            log.warning("instruction edits: could not wait for %d jobs: %s", len(job_ids), err)
            return {}

    def _outcome(self, job_id: str, status: JobStatus | None) -> EditOutcome:
        if status is None:
            self._ack(job_id)  # cancel it: a resubmission runs it again
            return EditOutcome(None, None, f"job {job_id} did not finish within timeout_s = {self.timeout_s}")
        if status.state == JobState.failed or status.result is None:
            self._ack(job_id)
            return EditOutcome(None, None, status.error or f"job {job_id} failed")
        path = status.result.output_path
        if self.download_dir is not None:
            try:
                path = self._download(job_id)
            except (SynthError, ConnectionError, OSError) as err:
                return EditOutcome(None, None, f"could not download the result of job {job_id}: {_short(err)}")
        self._ack(job_id)
        return EditOutcome(path, status.result.scene, None)

    def _download(self, job_id: str) -> str:
        self.download_dir.mkdir(parents=True, exist_ok=True)
        target = self.download_dir / f"{job_id}.png"
        data = self.client.image(job_id)
        fd, tmp = tempfile.mkstemp(dir=self.download_dir, prefix=f".{job_id}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return str(target)

    def _ack(self, job_id: str) -> None:
        try:
            self.client.ack(job_id)
        except (SynthError, ConnectionError) as err:  # the server forgets it later, or never: only memory
            log.warning("could not acknowledge job %s: %s", job_id, err)


def _short(err: Any, limit: int = 600) -> str:
    text = f"{type(err).__name__}: {err}" if not isinstance(err, SynthError) else str(err)
    return text if len(text) <= limit else text[:limit] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m synth.edit_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("image", help="the image to edit")
    parser.add_argument("instruction", help="the edit instruction")
    parser.add_argument("--meta", help="JSON file: a toy math row (its meta is used) or its meta")
    parser.add_argument("--row-id", default=None, help="row id (default: the image's file name)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running server ($SYNTH_TOKEN); default: start a local one")
    parser.add_argument("--server-config", default=None, help="the local server's YAML (default: procedural)")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    scene = None
    if args.meta:
        loaded = json.loads(Path(args.meta).read_text(encoding="utf-8"))
        scene = loaded.get("meta", loaded) if isinstance(loaded, dict) else None
        if not isinstance(scene, dict):
            parser.error(f"--meta {args.meta}: expected a JSON object (a toy math row or its meta)")
    edit = InstructionEdit(args.row_id or Path(args.image).name, args.image, args.instruction, args.seed, scene)
    with InstructionEditor(args.url, args.server_config, output_dir=args.output_dir) as editor:
        (outcome,) = editor.edit([edit])
    print(json.dumps({"path": outcome.path, "scene": outcome.scene, "error": outcome.error}, ensure_ascii=False))
    return 0 if outcome.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
