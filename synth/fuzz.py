"""Fuzz a running data server: schemathesis over the server's own OpenAPI schema, and hypothesis job bodies that
carry real images. Used by ``tests/synth/test_synth_fuzz.py`` (a bounded run) and ``bench/fuzz_server.py`` (>= 20,000
requests). Needs the ``dev`` extras (schemathesis, hypothesis); the server itself never imports this module.

Every request goes to the given URL only (a loopback server in the tests and the bench). A response >= 500 is a
server error (the figure that must be 0); a response the schema does not describe (an undeclared status code, a
body of another shape, another content type) is a conformance failure.
"""

from __future__ import annotations

import base64
import collections
import io
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from synth.api import client_token

CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
)
"""The schemathesis checks applied to every response (``positive_data_acceptance`` is left out: a valid-looking body
names image files that do not exist on the server, so its 4xx is right)."""


FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"})
"""Headers removed from generated cases: they frame the HTTP message, so a bad value is answered by the HTTP layer
(uvicorn's plain-text 400) before the app sees the request, which no OpenAPI schema describes."""


@dataclass
class FuzzReport:
    """What a fuzz run sent and got back."""

    requests: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_operation: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    """One line per response >= 500: the request (method, path, body head) and the answer."""
    nonconforming: list[str] = field(default_factory=list)
    """One line per response that a schemathesis check rejected (other than a server error)."""
    seconds: float = 0.0
    jobs_done: int = 0
    jobs_failed: int = 0
    """Accepted jobs that failed in the worker (an unreadable image, say): reported with a reason, never a 5xx."""
    audits_failed: int = 0
    """Done jobs whose foreground audit did not pass (must be 0: a failed audit is a failed job)."""
    jobs_unfinished: int = 0

    @property
    def n_server_errors(self) -> int:
        return sum(n for code, n in self.by_status.items() if code >= 500)

    def merge(self, other: FuzzReport) -> None:
        self.requests += other.requests
        self.by_status.update(other.by_status)
        self.by_operation.update(other.by_operation)
        self.server_errors += other.server_errors
        self.nonconforming += other.nonconforming
        self.seconds += other.seconds
        self.jobs_done += other.jobs_done
        self.jobs_failed += other.jobs_failed
        self.audits_failed += other.audits_failed
        self.jobs_unfinished += other.jobs_unfinished

    def as_dict(self, max_lines: int = 50) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "server_errors": self.n_server_errors,
            "nonconforming": len(self.nonconforming),
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_operation": dict(sorted(self.by_operation.items())),
            "seconds": round(self.seconds, 1),
            "jobs": {
                "done": self.jobs_done,
                "failed": self.jobs_failed,
                "audits_failed": self.audits_failed,
                "unfinished": self.jobs_unfinished,
            },
            "server_error_examples": self.server_errors[:max_lines],
            "nonconforming_examples": sorted(set(self.nonconforming))[:max_lines],
        }


def _describe(method: str, path: str, body: Any, status: int, text: str) -> str:
    head = repr(body)[:200] if body is not None else ""
    return f"{method} {path} {head} -> {status} {text[:200]!r}"


def fuzz_schema(
    url: str,
    token: str | None,
    max_examples: int = 50,
    modes: tuple[str, ...] = ("positive", "negative"),
    seed: int = 0,
    checks: tuple[str, ...] = CHECK_NAMES,
) -> FuzzReport:
    """Every operation of the server's ``/openapi.json``, ``max_examples`` cases per operation and generation mode."""
    import schemathesis
    import schemathesis.checks as st_checks
    from schemathesis import GenerationMode
    from schemathesis.config import SchemathesisConfig

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    raw = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).raise_for_status().json()
    # The token through schemathesis' auth config, so negative cases that leave it out really go without it.
    config = SchemathesisConfig.from_dict({"auth": {"openapi": {"bearerAuth": {"bearer": token}}}} if token else {})
    schema = schemathesis.openapi.from_dict(raw, config=config)
    check_fns = [getattr(st_checks, name) for name in checks]
    report = FuzzReport()
    t0 = time.perf_counter()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in modes:
            strategy = op.as_strategy(generation_mode=GenerationMode(mode))
            label = f"{op.method.upper()} {op.path}"
            _fuzz_operation(report, strategy, label, mode, url, check_fns, max_examples, seed)
    report.seconds = time.perf_counter() - t0
    return report


def _settings(max_examples: int):
    import hypothesis

    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )


def _fuzz_operation(report, strategy, label, mode, url, check_fns, max_examples, seed) -> None:
    import hypothesis
    from schemathesis.core.failures import Failure, FailureGroup

    @_settings(max_examples)
    @hypothesis.seed(seed)
    @hypothesis.given(case=strategy)
    def run(case) -> None:
        if case.headers:  # framing headers never reach the app: uvicorn answers a bad Content-Length with its own 400
            for key in [k for k in case.headers if k.lower() in FRAMING_HEADERS]:
                del case.headers[key]
        response = case.call(base_url=url, timeout=30)
        report.requests += 1
        report.by_status[response.status_code] += 1
        report.by_operation[label] += 1
        if response.status_code >= 500:
            report.server_errors.append(
                _describe(case.method, case.formatted_path, case.body, response.status_code, response.text)
            )
        try:
            case.validate_response(response, checks=check_fns)
        except (FailureGroup, Failure) as e:  # one line per failed check
            for failure in getattr(e, "exceptions", [e]):
                title = getattr(failure, "title", type(failure).__name__)
                if "Server error" not in title:
                    query = {k: v for k, v in (case.query or {}).items()}
                    status = response.status_code
                    shown = {
                        k: "[redacted]" if k.lower() == "authorization" else v for k, v in (case.headers or {}).items()
                    }
                    where = f"{case.formatted_path!r:.80}, query {query!r:.80}, headers {shown!r:.80}"
                    report.nonconforming.append(f"{label} [{mode}]: {title} ({status}, {where})")

    run()


def _image_bytes(draw, st, rng: random.Random) -> bytes:
    """A real encoded image (PNG, JPEG, GIF, BMP, WebP) of a drawn size and mode, or such a file cut short."""
    import numpy as np
    from PIL import Image

    w = draw(st.integers(1, 96))
    h = draw(st.integers(1, 96))
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P", "1", "I;16"]))
    fmt = draw(st.sampled_from(["PNG", "JPEG", "GIF", "BMP", "WEBP"]))
    pixels = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    try:
        image = image.convert(mode)
        buf = io.BytesIO()
        image.save(buf, format=fmt)
    except (OSError, ValueError, KeyError):  # a mode the format cannot hold: PNG holds every one
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="PNG")
    data = buf.getvalue()
    if rng.random() < 0.05:
        data = data[: rng.randrange(len(data) + 1)]  # cut short
    return data


def job_bodies(image_paths: list[str]):
    """A hypothesis strategy of ``POST /jobs`` bodies: mostly valid JSON with real images (inline bytes, or paths
    under the server's roots, outside them, or nowhere), boxes in and out of the image, odd canvases and texts."""
    from hypothesis import strategies as st

    finite = st.floats(-50, 200, allow_nan=False)
    number = st.one_of(finite, st.integers(-10, 200), st.sampled_from([float("nan"), float("inf"), 1e308, -0.0]))

    @st.composite
    def body(draw) -> dict[str, Any]:
        # Hypothesis favours boundary values (an integers(0, 19) draw is 0 far more often than 1 in 20), so the odds
        # of each hostile variant come from a seeded Random: a body is then fully valid about half the time.
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))

        def pick(valid, hostile, p: float = 0.08):
            return draw(hostile if rng.random() < p else valid)

        def box() -> list:
            if rng.random() < 0.9:
                x1, y1 = draw(st.floats(0, 20)), draw(st.floats(0, 20))
                return [x1, y1, x1 + draw(st.floats(1, 15)), y1 + draw(st.floats(1, 15))]
            return draw(st.lists(number, min_size=0, max_size=6))

        if rng.random() < 0.5:
            image = {"data_b64": base64.b64encode(_image_bytes(draw, st, rng)).decode("ascii")}
        else:
            hostile = st.one_of(
                st.sampled_from(["../../etc/passwd", "/etc/hostname", "missing.png", "", ".", "a\\b.png", "x" * 300]),
                st.text(max_size=40),
            )
            image = {"path": pick(st.sampled_from(image_paths), hostile, 0.2)}
        if rng.random() < 0.03:
            image = draw(st.sampled_from([{}, {"path": "a.png", "data_b64": ""}, {"data_b64": "!!"}, {"path": None}]))
        canvas = {}
        if rng.random() < 0.3:
            canvas["scale"] = pick(st.floats(0.5, 2.0), st.floats(-1, 9, allow_nan=False))
        if rng.random() < 0.3:
            canvas["extend"] = pick(st.floats(0, 1.0), st.floats(-1, 5, allow_nan=False))
        for key, hi in (("width", 400), ("height", 400), ("offset_x", 100), ("offset_y", 100)):
            if rng.random() < 0.1:
                canvas[key] = draw(st.integers(-2, hi))
        n_boxes = 1 + int(rng.random() < 0.3) if rng.random() > 0.03 else draw(st.sampled_from([0, 257]))
        out = {
            "job_id": pick(st.from_regex(r"\Afz[A-Za-z0-9._@:+=-]{1,20}\Z"), st.text(max_size=20), 0.05),
            "sample_id": pick(st.text(min_size=1, max_size=30), st.text(max_size=300), 0.05),
            "image": image,
            "boxes": [box() for _ in range(n_boxes)],
            "description": pick(st.text(max_size=200), st.text(min_size=3995, max_size=4005), 0.05),
            "seed": pick(st.integers(0, 2**31), st.integers(-(2**70), 2**70), 0.05),
            "canvas": canvas,
        }
        if rng.random() < 0.1:
            out["return_bytes"] = draw(st.one_of(st.booleans(), st.integers()))
        if rng.random() < 0.03:
            out.pop(rng.choice(sorted(out)))  # a missing field
        if rng.random() < 0.03:
            out["unknown_field"] = 1
        return out

    return body()


def fuzz_bodies(
    url: str, token: str | None, image_paths: list[str], max_examples: int = 100, seed: int = 0, timeout: float = 120
) -> FuzzReport:
    """``max_examples`` hypothesis bodies posted to ``POST /jobs``; the accepted jobs are then waited for (up to
    ``timeout`` seconds), their outcome counted (``jobs_done``, ``jobs_failed``, ``audits_failed``) and acknowledged."""
    import hypothesis

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    report = FuzzReport()
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:

        @_settings(max_examples)
        @hypothesis.seed(seed)
        @hypothesis.given(body=job_bodies(image_paths))
        def run(body) -> None:
            import json

            content = json.dumps(body, allow_nan=True).encode()
            r = http.post("/jobs", content=content, headers={"Content-Type": "application/json"})
            report.requests += 1
            report.by_status[r.status_code] += 1
            report.by_operation["POST /jobs (bodies)"] += 1
            if r.status_code >= 500:
                report.server_errors.append(_describe("POST", "/jobs", body, r.status_code, r.text))
            elif r.status_code >= 400:
                try:
                    err = r.json()
                    ok = isinstance(err.get("detail"), str) and err["detail"]
                except ValueError:
                    ok = False
                if not ok:
                    report.nonconforming.append(f"POST /jobs (bodies): {r.status_code} without an ErrorBody")
            else:
                accepted.add(body["job_id"])

        accepted: set[str] = set()
        run()
        report.merge(_finish_jobs(http, accepted, timeout))
    report.seconds = time.perf_counter() - t0
    return report


def _finish_jobs(http: httpx.Client, job_ids: set[str], timeout: float) -> FuzzReport:
    """Wait for the accepted jobs, count how they ended, acknowledge them."""
    report = FuzzReport()
    finished: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(finished) < len(job_ids) and time.monotonic() < deadline:
        r = http.get("/jobs", params=[("state", "done"), ("state", "failed"), ("limit", 10000)])
        report.requests += 1
        report.by_status[r.status_code] += 1
        report.by_operation["GET /jobs (bodies)"] += 1
        for job in r.json().get("jobs", []):
            if job["job_id"] in job_ids:
                finished[job["job_id"]] = job
        time.sleep(0.1)
    for job in finished.values():
        if job["state"] == "done":
            report.jobs_done += 1
            report.audits_failed += not job["result"]["audit"]["passed"]
        else:
            report.jobs_failed += 1
    report.jobs_unfinished = len(job_ids) - len(finished)
    for job_id in job_ids:
        r = http.post(f"/jobs/{job_id}/ack")
        report.requests += 1
        report.by_status[r.status_code] += 1
        report.by_operation["POST /jobs/{job_id}/ack (bodies)"] += 1
    return report


@dataclass
class IsolationReport:
    """Two clients fuzzing one server at once: did either touch the other's jobs?"""

    kept: dict[str, int] = field(default_factory=dict)
    """Per client: its marked jobs still held by the server at the end (all of them, unless another client touched
    them; a client never acknowledges its marked jobs before the count)."""
    touched: dict[str, int] = field(default_factory=dict)
    """Per client: its marked jobs that vanished, or that another client could read, fetch or acknowledge (must be 0)."""
    foreign_in_list: int = 0
    """Jobs of another client in a client's own ``GET /jobs`` (must be 0)."""
    probes: int = 0
    """Requests one client sent for the other's job ids: each ``GET`` (status, image) must be a 404, each ``ack`` and
    ``DELETE`` a no-op (``acknowledged: false``)."""


def _mark_jobs(http: httpx.Client, name: str, image_path: str, n: int, report: FuzzReport) -> list[str]:
    """Submit ``n`` valid jobs with ids that the fuzzers never generate (``mark-<client>-<i>``)."""
    import json

    ids = []
    for i in range(n):
        body = {
            "job_id": f"mark-{name}-{i}",
            "sample_id": f"mark-{i}",
            "image": {"path": image_path},
            "boxes": [[1, 1, 8, 8]],
            "description": "a marked job",
            "seed": i,
        }
        r = http.post("/jobs", content=json.dumps(body), headers={"Content-Type": "application/json"})
        report.requests += 1
        report.by_status[r.status_code] += 1
        if r.status_code in (200, 202):
            ids.append(body["job_id"])
    return ids


def _probe_other(http: httpx.Client, other_ids: list[str], report: FuzzReport) -> tuple[int, int]:
    """Try to read, fetch and acknowledge another client's jobs; returns (probes sent, probes that reached a job)."""
    probes = touched = 0
    for job_id in other_ids:
        for method, path in (
            ("GET", f"/jobs/{job_id}"),
            ("GET", f"/jobs/{job_id}/image"),
            ("POST", f"/jobs/{job_id}/ack"),
            ("DELETE", f"/jobs/{job_id}"),
        ):
            r = http.request(method, path)
            report.requests += 1
            report.by_status[r.status_code] += 1
            probes += 1
            if method == "GET":
                touched += r.status_code != 404
            else:  # acknowledging a job one does not hold is a no-op answered 200 {"acknowledged": false}
                touched += r.status_code != 200 or r.json().get("acknowledged") is not False
    return probes, touched


def _client_run(
    url: str, token: str, other_ids: list[str], image_paths: list[str], max_examples: int, seeds: tuple, bodies: int
) -> tuple[FuzzReport, int, int]:
    """One client's share of :func:`fuzz_clients`, in its own process (Hypothesis is not thread-safe)."""
    report = FuzzReport()
    probes = touched = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        for seed in seeds:
            p, t = _probe_other(http, other_ids, report)
            probes, touched = probes + p, touched + t
            report.merge(fuzz_schema(url, token, max_examples=max_examples, seed=seed))
        if bodies:
            report.merge(fuzz_bodies(url, token, image_paths, max_examples=bodies, seed=seeds[0]))
        p, t = _probe_other(http, other_ids, report)
    return report, probes + p, touched + t


def fuzz_clients(
    url: str,
    secret: str,
    image_paths: list[str],
    clients: tuple[str, str] = ("fuzz-a", "fuzz-b"),
    max_examples: int = 50,
    seeds: tuple[int, ...] = (0,),
    bodies: int = 100,
    marked: int = 8,
) -> tuple[dict[str, FuzzReport], IsolationReport]:
    """Two clients, each with its own token and process, fuzz one server at the same time (schemathesis over every
    operation in both generation modes, then hypothesis bodies with real images), each holding ``marked`` jobs that it
    never acknowledges before the end; meanwhile each tries to read, fetch and acknowledge the other's marked jobs.
    The isolation report counts every marked job that was touched or vanished (the goal: 0)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    iso = IsolationReport()
    reports = {name: FuzzReport() for name in clients}
    tokens = {name: client_token(secret, name) for name in clients}
    marks: dict[str, list[str]] = {}
    for name in clients:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens[name]}"}, timeout=60) as http:
            marks[name] = _mark_jobs(http, name, image_paths[0], marked, reports[name])
    a, b = clients
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        futures = {
            name: pool.submit(
                _client_run, url, tokens[name], marks[other], image_paths, max_examples, tuple(seeds), bodies
            )
            for name, other in ((a, b), (b, a))
        }
        for name, other in ((a, b), (b, a)):
            report, probes, touched = futures[name].result()
            reports[name].merge(report)
            iso.probes += probes
            iso.touched[other] = iso.touched.get(other, 0) + touched
    for name in clients:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens[name]}"}, timeout=60) as http:
            r = http.get("/jobs", params={"limit": 10000})
            reports[name].requests += 1
            held = r.json()["jobs"]
            iso.foreign_in_list += sum(j["client"] != name for j in held)
            ids = {j["job_id"] for j in held}
            iso.kept[name] = sum(j in ids for j in marks[name])
            iso.touched[name] = iso.touched.get(name, 0) + sum(j not in ids for j in marks[name])
            for job_id in marks[name]:
                http.post(f"/jobs/{job_id}/ack")
    return reports, iso
