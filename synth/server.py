"""The data server: an HTTP front (FastAPI + uvicorn) over one painter process per device.

    python -m synth.server --config configs/synth/procedural.yaml [--port 0 --port-file PATH] [--set key=value ...]
    python -m synth.server token CLIENT_ID [--config ...]     # print a client's own token (needs the secret)

The HTTP process validates requests, keeps the job table (``synth.job_table``, run by ``synth.jobs.JobManager``) and
hands jobs to worker processes (``synth.worker``); it never imports torch or a diffusers pipeline. Guarantees
(docs/data_server.md has the full note):

- Jobs belong to a client: each client's token names it, and it sees, fetches, cancels and acknowledges only its
  own jobs; the admin token (the server's secret) sees all (``synth.api``, "Clients and their jobs").
- Idempotent jobs: ``POST /jobs`` with a known ``job_id`` returns that job (same body) or 409 (different body).
- Bounded: at most ``max_queued`` queued jobs (429 beyond) and ``max_jobs_held`` held ones; bodies up to
  ``max_request_bytes`` (413).
- Nothing lost to a crash: a job whose worker dies or times out is retried (alone) up to ``max_attempts`` times, then
  failed with the reason; the worker is restarted; other jobs are untouched.
- Outputs are written atomically, audited on disk before they appear, and never over an input; results stay until
  the client acknowledges them (``POST /jobs/{id}/ack`` or ``DELETE /jobs/{id}``).
- Files only from the roots: inputs are regular files inside the roots (no link out of them), and only the very file
  the server wrote is served (``synth.inputs``).
- Strict requests: JSON bodies without coercion, known query parameters only; every status code the server answers
  with is declared in its OpenAPI schema.
"""

import argparse
import contextlib
import hmac
import logging
import os
import re
import socket
import sys
import threading
import time
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from synth.api import (
    ADMIN_CLIENT,
    API_VERSION,
    CLIENT_ID_PATTERN,
    JOB_ID_PATTERN,
    Ack,
    ErrorBody,
    Health,
    JobList,
    JobRequest,
    JobState,
    JobStatus,
    client_token,
    verify_client_token,
)
from synth.config import ServerConfig, load_config
from synth.inputs import ApiError, prepare_input, validation_errors
from synth.jobs import JobManager

log = logging.getLogger("synth.server")

API_DOC = (
    "Repaints the background of training images after a description and keeps the boxes' foreground exactly. "
    "Every endpoint needs `Authorization: Bearer <token>`: a client's own token (it sees only its own jobs) or the "
    "admin token (every job; `?client=` acts in a client's name). Every error answer is an `ErrorBody`. "
    "See docs/data_server.md."
)


# --- the HTTP app --------------------------------------------------------------------------------------------------


def _error_responses(*codes: int) -> dict[int, dict]:
    """OpenAPI ``responses`` entries for error answers, all with the :class:`ErrorBody` shape."""
    what = {
        400: "The body is not JSON, or image.path cannot be used",
        401: "Missing or wrong bearer token",
        403: "``?client=`` from a client token (the admin's only), or image.path outside the server's roots, a hard "
        "link, or another client's output",
        404: "No such job of this client (never submitted, acknowledged, or another client's), or no such route",
        405: "The method is not allowed on this path: ``Allow`` lists the ones that are",
        409: "The job_id exists with a different request, or the job has no image yet",
        410: "The job's output file is no longer on disk as the server wrote it",
        413: "The body or the image is too large",
        415: "The body is not ``application/json``",
        422: "A field is invalid (``errors`` says which): also what a schema cannot express, such as a box outside "
        "the decoded image, an undecodable image or a canvas above the server's pixel cap",
        429: "Queue full or too many jobs held: retry after ``Retry-After`` seconds",
        503: "No worker can start",
    }
    out: dict[int, dict] = {}
    for code in codes:
        out[code] = {"model": ErrorBody, "description": what[code]}
        if code == 429:
            out[code]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        if code == 401:
            out[code]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        if code == 405:
            out[code]["headers"] = {"Allow": {"schema": {"type": "string"}, "description": "the allowed methods"}}
    return out


def _is_sequence(annotation: Any) -> bool:
    """``list[X]``, ``list[X] | None``, ...: a query parameter that may repeat."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return True
    return any(_is_sequence(a) for a in typing.get_args(annotation)) if origin is not None else False


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the client its token names, or the admin (the server's secret)."""

    client: str
    admin: bool


_INT = re.compile(r"^[0-9]{1,19}$")


def _strict_query_value(annotation: Any, value: str) -> str | None:
    """Why a query string does not parse as documented (integers: decimal digits; booleans: true / false), or None."""
    kinds = {a for a in (annotation, *typing.get_args(annotation)) if a in (int, bool)}
    if bool in kinds and value not in ("true", "false"):
        return f"{value!r} is not a boolean: write true or false"
    if int in kinds and not _INT.match(value):
        return f"{value!r} is not a non-negative integer written in decimal digits"
    return None


def _allowed_methods(app: Any, path: str) -> list[str]:
    """The methods of the routes whose path matches ``path`` (a 405's ``Allow``)."""
    from starlette.routing import Match

    scope = {"type": "http", "path": path, "method": "", "root_path": ""}
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


def _docs_enabled(cfg: ServerConfig) -> bool:
    return cfg.docs if cfg.docs is not None else _is_loopback(cfg.host)


def create_app(cfg: ServerConfig, token: str | None, manager: JobManager | None = None):
    """The FastAPI app. ``token`` None disables auth (only allowed on loopback; checked in ``main``).

    Every route, the schema and its viewers included, sits behind the bearer token (the app-wide dependency); the
    viewers exist only when ``cfg.docs`` allows (default: on a loopback host). The OpenAPI schema declares the
    request body of ``POST /jobs``, every error answer as :class:`ErrorBody`, and the bearer scheme.

    (This module has no ``from __future__ import annotations``: FastAPI reads the handlers' annotations at run time.)
    """
    from fastapi import Depends, FastAPI, Query, Request
    from fastapi import Path as PathParam
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    manager = manager or JobManager(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        manager.start()
        try:
            yield
        finally:
            await run_in_threadpool(manager.stop)

    async def auth(request: Request) -> None:
        """Who is calling: the admin (the secret itself, or no auth on loopback) or the client its token names."""
        if token is None:
            request.state.caller = Caller(ADMIN_CLIENT, admin=True)
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        given = given.strip()
        if scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode()):
            request.state.caller = Caller(ADMIN_CLIENT, admin=True)
            return
        client = verify_client_token(token, given) if scheme.lower() == "bearer" else None
        if client is None:
            raise ApiError(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with your client token "
                f"(python -m synth.server token CLIENT_ID) or the server's secret (from ${cfg.token_env} or token_file)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        request.state.caller = Caller(client, admin=False)

    def namespace(request: Request, client: str | None) -> str:
        """The client whose jobs a request acts on: the caller's own, or ``?client=`` for the admin."""
        caller: Caller = request.state.caller
        if client is None or client == caller.client:
            return caller.client
        if not caller.admin:
            raise ApiError(403, f"?client={client} acts in another client's name, which only the admin token may do")
        return client

    async def known_query(request: Request) -> None:
        """Unknown query parameters are a 422, as unknown body fields are: a typo (``?stat=done``) never passes."""
        route = request.scope.get("route")
        dependant = getattr(route, "dependant", None)
        if dependant is None or not request.query_params:
            return
        params = list(dependant.query_params)
        for d in dependant.dependencies:
            params += d.query_params
        known = {p.alias for p in params}
        for p in params:  # a scalar given twice (?since=1&since=2): which one was meant is a guess, so refuse
            values = request.query_params.getlist(p.alias)
            if len(values) > 1 and not _is_sequence(p.field_info.annotation):
                msg = f"query parameter {p.alias!r} takes one value, got {len(values)}"
                raise ApiError(422, msg, [{"field": f"query.{p.alias}", "message": msg}])
            for v in values:  # strings parsed as documented, not as Python would ("1_0" is not 10, "yes" not true)
                msg = _strict_query_value(p.field_info.annotation, v)
                if msg:
                    raise ApiError(
                        422, f"query parameter {p.alias!r}: {msg}", [{"field": f"query.{p.alias}", "message": msg}]
                    )
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            errors = [{"field": f"query.{k}", "message": "unknown query parameter"} for k in unknown]
            raise ApiError(
                422,
                f"unknown query parameter(s) {unknown} for {request.method} {route.path}: "
                f"this endpoint takes {sorted(known) or 'none'}",
                errors,
            )

    # The built-in /openapi.json, /docs and /redoc bypass app-wide dependencies: they are added below, behind auth.
    app = FastAPI(
        title="Syn-GRPO data server",
        version=API_VERSION,
        lifespan=lifespan,
        dependencies=[Depends(auth), Depends(known_query)],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.manager = manager
    client_param = Query(
        None,
        pattern=CLIENT_ID_PATTERN,
        description="Act on this client's jobs: the admin token only (a client token acts on its own jobs)",
    )

    def error_response(status: int, detail: str, errors=None, headers=None) -> JSONResponse:
        body = ErrorBody(detail=detail, errors=errors).model_dump(exclude_none=True)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.detail, e.errors, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = [
            {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"], "type": err["type"]}
            for err in e.errors()
        ]
        return error_response(
            422, "invalid request: " + "; ".join(f"{x['field']}: {x['message']}" for x in errors), errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        headers = dict(getattr(e, "headers", None) or {})
        if e.status_code == 405:  # Starlette names the first matching route's methods only: name every route's
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
            headers["Allow"] = ", ".join(_allowed_methods(app, request.url.path))
        return error_response(e.status_code, str(e.detail), headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: still an ErrorBody, and the traceback in the log
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(e).__name__}); the server log has the traceback")

    async def read_body(request: Request) -> bytes:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(
                415, f"the body must be JSON sent as Content-Type: application/json, got {media or 'none'!r}"
            )
        limit = cfg.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body is {length} bytes, above the server's max_request_bytes ({limit})")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"request body exceeds the server's max_request_bytes ({limit})")
            chunks.append(chunk)
        return b"".join(chunks)

    # The body is read by hand (to stop reading at max_request_bytes and to tell bad JSON (400) from bad fields
    # (422)), so FastAPI does not see it: the schema is declared here.
    job_request_body = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobRequest"}}},
        }
    }

    @app.post(
        "/jobs",
        response_model=JobStatus,
        status_code=202,
        openapi_extra=job_request_body,
        responses={
            200: {"model": JobStatus, "description": "A job with this job_id and the same body exists: that job"},
            **_error_responses(400, 401, 403, 409, 413, 415, 422, 429, 503),
        },
    )
    async def submit(request: Request, client: str | None = client_param):
        owner = namespace(request, client)
        body = await read_body(request)
        try:
            req = JobRequest.model_validate_json(body, strict=True)
        except ValidationError as e:
            errors = validation_errors(e)
            if any(err["type"] == "json_invalid" for err in errors):
                raise ApiError(400, f"request body is not valid JSON: {errors[0]['message']}") from e
            detail = "invalid job request: " + "; ".join(f"{x['field']}: {x['message']}" for x in errors)
            raise ApiError(422, detail, errors) from e
        fingerprint = req.fingerprint()
        existing = manager.lookup(owner, req.job_id, fingerprint)
        if existing is not None:
            return JSONResponse(existing.model_dump(mode="json"), status_code=200)
        inp = await run_in_threadpool(prepare_input, req, cfg, owner)
        status, created = manager.submit(owner, req, fingerprint, inp)
        return JSONResponse(status.model_dump(mode="json"), status_code=202 if created else 200)

    job_id_param = PathParam(pattern=JOB_ID_PATTERN, description="The client-chosen id of the job")

    @app.get("/jobs/{job_id}", response_model=JobStatus, responses=_error_responses(401, 403, 404, 405, 410, 422))
    async def get_job(
        request: Request,
        job_id: str = job_id_param,
        include_image: bool = Query(False, description="Add the output PNG as base64: `true` or `false`"),
        client: str | None = client_param,
    ):
        return await run_in_threadpool(manager.get, namespace(request, client), job_id, include_image)

    @app.get(
        "/jobs/{job_id}/image",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}, "description": "PNG"},
            **_error_responses(401, 403, 404, 405, 409, 410, 422),
        },
    )
    async def get_image(request: Request, job_id: str = job_id_param, client: str | None = client_param):
        # open first (only the file the server wrote, never a link): the open handle outlives a removal, so the
        # answer is the whole file or a 410, never a 500
        fh = await run_in_threadpool(manager.open_output, namespace(request, client), job_id)
        size = os.fstat(fh.fileno()).st_size

        def chunks():
            with fh:
                while block := fh.read(1 << 20):
                    yield block

        return StreamingResponse(chunks(), media_type="image/png", headers={"Content-Length": str(size)})

    @app.get("/jobs", response_model=JobList, responses=_error_responses(401, 403, 405, 422))
    async def list_jobs(
        request: Request,
        state: list[JobState] | None = Query(None),
        since: int = Query(0, ge=0, le=2**62),
        limit: int = Query(1000, ge=1, le=10000),
        client: str | None = client_param,
    ):
        caller: Caller = request.state.caller
        owner = None if caller.admin and client is None else namespace(request, client)  # the admin: every client
        return manager.list(owner, state, since, limit)

    @app.post("/jobs/{job_id}/ack", response_model=Ack, responses=_error_responses(401, 403, 404, 405, 422))
    async def ack(request: Request, job_id: str = job_id_param, client: str | None = client_param):
        return manager.ack(namespace(request, client), job_id)

    @app.delete("/jobs/{job_id}", response_model=Ack, responses=_error_responses(401, 403, 404, 405, 422))
    async def delete(request: Request, job_id: str = job_id_param, client: str | None = client_param):
        return manager.ack(namespace(request, client), job_id)

    @app.get("/health", response_model=Health, responses=_error_responses(401, 403, 405, 422))
    async def health(request: Request, client: str | None = client_param):
        caller: Caller = request.state.caller
        return manager.health(None if caller.admin and client is None else namespace(request, client))

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=API_DOC,
                routes=app.routes,
                separate_input_output_schemas=False,
            )
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            body = JobRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas["JobRequest"] = body
            for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape: never sent here
                schemas.pop(name, None)
            components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
            if token is not None:
                schema["security"] = [{"bearerAuth": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    if _docs_enabled(cfg):

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_json():
            return JSONResponse(openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs():
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

        @app.get("/redoc", include_in_schema=False)
        async def redoc():
            return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    return app


# --- command line ----------------------------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def token_main(argv: list[str]) -> int:
    """``python -m synth.server token CLIENT_ID``: print the client's own token, made from the server's secret."""
    parser = argparse.ArgumentParser(
        prog="python -m synth.server token",
        description="Print the bearer token of one client (it sees only its own jobs), made from the server's secret "
        "($SYNTH_TOKEN or the config's token_env / token_file). Hand it to the client instead of the secret.",
    )
    parser.add_argument("client_id", help=f"the client's id ({CLIENT_ID_PATTERN})")
    parser.add_argument("--config", help="the server's YAML config (where its secret comes from)")
    args = parser.parse_args(argv)
    try:
        secret = load_config(args.config).read_token()
        if not secret:
            raise ValueError("no secret: set $SYNTH_TOKEN (or the config's token_env / token_file)")
        print(client_token(secret, args.client_id))
    except (OSError, ValueError, ValidationError) as e:
        print(f"synth.server token: {e}", file=sys.stderr)
        return 2
    return 0


EXIT_NO_WORKER = 4
"""``python -m synth.server``'s exit status when no worker ever started (missing weights, a bad device): 4, the
project's status for a model that cannot be loaded (docs/outputs.md, "Exit status"); 2 is a bad config or flag."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["token"]:
        return token_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m synth.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (configs/synth/procedural.yaml, sdxl.yaml, ...)")
    parser.add_argument("--host", help="override host")
    parser.add_argument("--port", type=int, help="override port; 0 picks a free one")
    parser.add_argument("--port-file", help="write the port actually bound to this file (for --port 0)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, value read as YAML), e.g. --set roots=[data]",
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone (set by LocalServer)")
    args = parser.parse_args(argv)

    overrides = list(args.set)
    if args.host is not None:
        overrides.append(f"host={args.host}")
    if args.port is not None:
        overrides.append(f"port={args.port}")
    try:
        cfg = load_config(args.config, overrides)
        token = cfg.read_token()
    except (OSError, ValueError, ValidationError) as e:
        print(f"synth.server: bad config: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.auth and not token:
        print(
            f"synth.server: no token: set ${cfg.token_env} or token_file in the config "
            "(or auth: false on a loopback host)",
            file=sys.stderr,
        )
        return 2
    if not cfg.auth:
        if not _is_loopback(cfg.host):
            print("synth.server: auth: false is only allowed on a loopback host", file=sys.stderr)
            return 2
        token = None

    import uvicorn

    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so; without it, keep-alive
    # requests wait ~40 ms each for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(512)
    port = sock.getsockname()[1]

    manager = JobManager(cfg)
    app = create_app(cfg, token, manager)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            manager.begin_shutdown()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, log_level=cfg.log_level.lower(), access_log=False, lifespan="on"))
    never_started: list[str] = []

    def stop_never_started(reason: str) -> None:  # serving with no worker would only answer 503
        never_started.append(reason)
        server.should_exit = True

    manager.on_never_started = stop_never_started

    if args.parent_pid:

        def watch_parent() -> None:
            while not server.should_exit:
                if os.getppid() != args.parent_pid:
                    log.warning("parent process %d is gone: shutting down", args.parent_pid)
                    server.should_exit = True
                time.sleep(1.0)

        threading.Thread(target=watch_parent, name="synth-parent-watch", daemon=True).start()

    host = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    if args.port_file:
        _write_atomic(args.port_file, f"{port}\n")
    print(
        f"synth.server listening on http://{host}:{port} (painter={cfg.painter.name}, "
        f"foreground={cfg.foreground.name}, workers={cfg.devices}, output_dir={cfg.resolved_output_dir()})",
        flush=True,
    )
    server.run(sockets=[sock])
    if never_started:
        print(
            f"synth.server: exiting, the workers cannot start: {never_started[0]} (fix the painter / foreground "
            f"paths or the devices in {args.config or 'the config'} and start again)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_NO_WORKER
    return 0


if __name__ == "__main__":
    sys.exit(main())
