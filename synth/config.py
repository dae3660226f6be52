"""Server configuration: one YAML file (``configs/synth/*.yaml``) parsed into :class:`ServerConfig`.

Relative paths in the file (``roots``, ``output_dir``, ``token_file``) are relative to the directory the server is
started from. ``--set key.sub=value`` on the command line overrides any key (the value is read as YAML).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.config_files import load_config as load_config_file


class BlockConfig(BaseModel):
    """A ``{name: ..., **kwargs}`` block: the registry name and the constructor arguments."""

    model_config = ConfigDict(extra="allow")
    name: str

    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; anything else exposes the server to the network (token still needed)."""
    port: int = Field(8765, ge=0, le=65535)
    """TCP port; 0 picks a free one (see ``--port-file``)."""
    auth: bool = True
    """Require ``Authorization: Bearer <token>``. Turning it off is allowed only on a loopback host."""
    docs: bool | None = None
    """Serve ``/openapi.json``, ``/docs`` and ``/redoc`` (behind the token, like every endpoint). None: on for a
    loopback host, off otherwise (the schema tells a scanner every field there is)."""
    token_env: str = "SYNTH_TOKEN"
    """Environment variable holding the server's secret, the admin token (wins over ``token_file``). Clients use
    their own tokens derived from it (``synth.api.client_token``; ``python -m synth.server token CLIENT_ID``)."""
    token_file: str | None = None
    """File whose first line is the secret."""
    roots: list[str] = Field(default_factory=list)
    """Directories the server may read input images from (``image.path`` must resolve inside one)."""
    allow_hard_links: bool = False
    """Read input files that have more than one hard link. Off by default: a hard link inside a root can name a file
    that lives outside every root, and the server reads only files of its roots."""
    output_dir: str = "outputs/synth"
    """Where results are written (``<output_dir>/<job_id>.png``); created if missing."""
    fsync_outputs: bool = False
    """fsync each output before its rename: survives a power cut, costs ~3 ms a job. Atomicity needs no fsync."""
    devices: list[str] = Field(default_factory=lambda: ["cpu"])
    """One worker process per entry (``cpu``, ``cuda:0``, ...). Repeat ``cpu`` for several CPU workers."""
    threads_per_worker: int | None = 1
    """OMP / MKL / OpenCV threads in each worker (None: the libraries' defaults)."""
    batch_size: int = Field(1, ge=1)
    """Most jobs handed to a worker at once (the painter batches them)."""
    batch_window_s: float = Field(0.0, ge=0.0, le=10.0)
    """An idle worker waits up to this long for a full batch: jobs arrive one HTTP request at a time, and without a
    window the first of a burst is painted alone (one wasted pipeline call per burst)."""
    max_queued: int = Field(1024, ge=1)
    """Queued (not yet running) jobs before ``POST /jobs`` answers 429."""
    max_jobs_held: int = Field(100_000, ge=1)
    """Jobs held in memory (any state, until acknowledged) before ``POST /jobs`` answers 429."""
    job_timeout_s: float = Field(300.0, gt=0)
    """Per job (a batch of n gets n times this); past it the worker is killed and the job retried."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Time a worker may take to load its painter."""
    max_attempts: int = Field(3, ge=1)
    """Attempts per job when workers crash or time out; then the job is failed."""
    max_restarts: int = Field(5, ge=0)
    """Consecutive failed worker starts (painter does not load) before that worker is given up."""
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest request body (413 above)."""
    max_image_pixels: int = Field(50_000_000, ge=1)
    """Largest input image, in pixels (413 above)."""
    max_canvas_pixels: int = Field(4096 * 4096, ge=1)
    """Largest output canvas, in pixels (422 above)."""
    box_tolerance_px: float = Field(1.0, ge=0)
    """Boxes may stick out of the image by this much (they are clipped); further out is a 422."""
    log_level: str = "info"
    painter: BlockConfig = Field(default_factory=lambda: BlockConfig(name="procedural"))
    """``name`` (procedural | diffusers | module:Class) and the painter's arguments (see ``synth.painters``)."""
    foreground: BlockConfig = Field(default_factory=lambda: BlockConfig(name="box"))
    """``name`` (box | grabcut | sam2 | ben2) and the masker's arguments (see ``synth.foreground``); sam2 and ben2 run
    on the worker's device unless ``device`` is given."""

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("devices must list at least one device (e.g. [cpu] or [cuda:0])")
        for d in v:
            if not (d == "cpu" or d == "cuda" or d.startswith("cuda:") or d == "mps"):
                raise ValueError(f"devices: {d!r} is not cpu, cuda, cuda:N or mps")
        return v

    def resolved_roots(self) -> list[Path]:
        return [Path(os.path.realpath(r)) for r in self.roots]

    def resolved_output_dir(self) -> Path:
        return Path(os.path.realpath(self.output_dir))

    def read_token(self) -> str | None:
        """The token from ``token_env``, else from ``token_file``, else None."""
        token = os.environ.get(self.token_env, "").strip()
        if token:
            return token
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().splitlines()[0].strip()
            except (OSError, IndexError) as e:
                raise ValueError(f"token_file {self.token_file!r} is unreadable or empty: {e}") from e
            return token or None
        return None


def _set_dotted(cfg: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = cfg
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {key}: {p!r} is not a mapping")
    node[parts[-1]] = value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> ServerConfig:
    """Read a YAML config and apply ``key.sub=value`` overrides (values parsed as YAML)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = load_config_file(path)  # a composed file's parts merged in (core/config_files.py)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the config must be a mapping, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    return ServerConfig.model_validate(raw)
