"""The data server under fuzzing: its OpenAPI schema is complete and behind the token, schemathesis over that schema
and hypothesis bodies with real images never get a 5xx. A real ``python -m synth.server`` on 127.0.0.1.

Bounded: ~1,000 schemathesis requests and 150 bodies, ~15 s on 2 busy cores; ``bench/fuzz_server.py`` sends > 20,000.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from PIL import Image

from synth.client import LocalServer
from synth.config import ServerConfig
from synth.fuzz import fuzz_bodies, fuzz_schema
from synth.server import create_app

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-data")
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(40, 30), (64, 48), (23, 71)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
    out = tmp_path_factory.mktemp("fuzz-out")
    with LocalServer(roots=[root], output_dir=out, startup_timeout=60) as s:
        s.image_paths = [str(root / "0.png"), "1.png", str(root / "2.png")]
        yield s


def test_schema_declares_the_body_every_error_and_the_bearer_scheme(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {server.token}"}).json()
    body = schema["paths"]["/jobs"]["post"]["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobRequest"
    }
    components = schema["components"]["schemas"]
    assert {"JobRequest", "ImageRef", "CanvasParams", "ErrorBody", "FieldError"} <= set(components)
    assert "HTTPValidationError" not in components  # FastAPI's 422 shape, which this server never sends
    assert schema["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    assert schema["security"] == [{"bearerAuth": []}]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "401" in op["responses"], (method, path)
            for code, resp in op["responses"].items():
                if code.startswith(("4", "5")):
                    assert resp["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorBody"
                    }, (method, path, code)
    assert set(schema["paths"]["/jobs"]["post"]["responses"]) >= {"200", "202", "400", "403", "409", "413", "422"}


def test_docs_and_schema_need_the_token(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and "bearer token" in r.json()["detail"], path
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {server.token}"}).status_code == 200


def test_docs_are_off_by_default_on_a_non_loopback_host():
    def paths(cfg: ServerConfig) -> set[str]:
        return {getattr(r, "path", "") for r in create_app(cfg, "t").routes}

    assert {"/openapi.json", "/docs", "/redoc"} <= paths(ServerConfig(host="127.0.0.1"))
    assert not {"/openapi.json", "/docs", "/redoc"} & paths(ServerConfig(host="0.0.0.0"))
    assert "/docs" in paths(ServerConfig(host="0.0.0.0", docs=True))
    assert "/docs" not in paths(ServerConfig(host="127.0.0.1", docs=False))


def test_unknown_or_repeated_query_parameters_are_422(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as http:
        r = http.get("/jobs", params={"stat": "done"})
        assert r.status_code == 422 and "stat" in r.json()["detail"] and "state" in r.json()["detail"]
        assert http.get("/jobs", params={"state": "done"}).status_code == 200
        r = http.get("/jobs", params=[("since", "0"), ("since", "5")])  # a scalar twice: which was meant?
        assert r.status_code == 422 and "takes one value, got 2" in r.json()["detail"]
        assert http.get("/jobs", params=[("state", "done"), ("state", "failed")]).status_code == 200  # a list may


@pytest.mark.slow  # ~11 s: 60 examples per operation and generation mode (the schema checks above and the hypothesis bodies below run by default)
def test_schemathesis_over_the_schema_finds_no_server_error_and_no_undocumented_answer(server):
    report = fuzz_schema(server.url, server.token, max_examples=60, seed=13)
    print(report.as_dict())
    assert report.requests >= 7 * 2 * 30  # every operation, both generation modes
    assert report.n_server_errors == 0, report.server_errors[:10]
    assert report.nonconforming == [], sorted(set(report.nonconforming))[:10]


def test_hypothesis_bodies_with_real_images_never_get_a_5xx(server):
    report = fuzz_bodies(server.url, server.token, server.image_paths, max_examples=150, seed=13)
    print(report.as_dict())
    assert report.n_server_errors == 0, report.server_errors[:10]
    assert report.nonconforming == [], report.nonconforming[:10]
    # how many of 150 generated bodies are valid varies with Hypothesis's example database (18-26 seen): >= 10 shows
    # that the strategy still reaches the painter
    assert report.by_status.get(202, 0) >= 10, "too few valid bodies: the strategy no longer reaches the painter"
    # invalid bodies are refused (422: schema, 400: a valid body the server cannot use); which of the two a run of 150
    # examples reaches depends on Hypothesis's example database, so require the refusals, not both kinds
    assert report.by_status.get(422, 0) + report.by_status.get(400, 0) >= 20
    assert report.jobs_done >= 10 and report.jobs_unfinished == 0 and report.audits_failed == 0
    with server.client() as c:
        assert c.health().status == "ok"
