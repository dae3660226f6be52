"""JudgeClient against a real local OpenAI-compatible server (FastAPI + uvicorn in a thread), a slow route and a
closed port. Every test asserts its wall time, so a hang shows up as a failure, not a stuck run."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from lightning_modules.judge import (  # noqa: E402
    JudgeClient,
    JudgeConfig,
    JudgeUnavailable,
    judge_caption_reward,
    parse_score,
)

SLOW_S = 1.5  # the slow route sleeps this long; the tests' timeouts are well below it


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict] = []
        self.auth: list[str | None] = []


def _app(state: _State):
    app = fastapi.FastAPI()

    async def _serve(request: fastapi.Request, delay: float, content: str):
        body = await request.json()
        with state.lock:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.requests.append(body)
            state.auth.append(request.headers.get("authorization"))
        try:
            await asyncio.sleep(delay)
        finally:
            with state.lock:
                state.in_flight -= 1
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}

    @app.post("/v1/chat/completions")
    async def fast(request: fastapi.Request):
        return await _serve(request, 0.05, "Score: 7")

    @app.post("/slow/v1/chat/completions")
    async def slow(request: fastapi.Request):
        return await _serve(request, SLOW_S, "Score: 9")

    @app.post("/chatty/v1/chat/completions")
    async def chatty(request: fastapi.Request):
        return await _serve(request, 0.0, "I cannot grade this.")

    @app.post("/broken/v1/chat/completions")
    async def broken():
        raise fastapi.HTTPException(status_code=503, detail="overloaded")

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    state = _State()
    port = _free_port()
    config = uvicorn.Config(_app(state), host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "local judge server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=5)


def _client(base_url: str, **kw) -> JudgeClient:
    return JudgeClient(JudgeConfig(base_url=base_url, model="toy-judge", trust_env=False, **kw))


def test_parse_score_literals():
    assert parse_score("Score: 7") == 7.0
    assert parse_score("Score: 7", scale=10) == pytest.approx(0.7)
    assert parse_score("out of 10, score = 12", scale=10) == 1.0  # after "score", clipped to [0, 1]
    assert parse_score("8/10") == 8.0  # no "score": the first number
    assert parse_score("no number here") is None


def test_scores_from_a_live_server(server, monkeypatch):
    base, state = server
    monkeypatch.setenv("TOY_JUDGE_KEY", "sk-secret")
    client = _client(base + "/v1", api_key_env="TOY_JUDGE_KEY")
    assert "sk-secret" not in repr(client) and "sk-secret" not in repr(client.config)
    with client:
        assert client.score(["a", "b"]) == [7.0, 7.0]
        assert client.complete(["c"]) == ["Score: 7"]
        rewards = judge_caption_reward(client, ["a red cube", "a cat"], ["a small red cube", "a blue sphere"])
    assert rewards == [pytest.approx(0.7), pytest.approx(0.7)]  # the fixed reply "Score: 7" -> 7 / 10
    last = state.requests[-1]
    assert last["model"] == "toy-judge" and "a blue sphere" in last["messages"][0]["content"]
    assert state.auth[-1] == "Bearer sk-secret"


def test_unparseable_reply_gives_failure_value(server):
    base, _ = server
    with _client(base + "/chatty/v1", failure_value=-1.0) as client:
        assert judge_caption_reward(client, ["a cube"], ["a cube"]) == [-1.0]


def test_concurrency_is_bounded(server):
    base, state = server
    with state.lock:
        state.max_in_flight = 0
    with _client(base + "/v1", max_concurrency=3) as client:
        t0 = time.monotonic()
        scores = client.score([f"p{i}" for i in range(12)])
        elapsed = time.monotonic() - t0
    assert scores == [7.0] * 12
    assert state.max_in_flight <= 3
    assert state.max_in_flight >= 2  # it does run in parallel: 12 x 0.05 s serially would be 0.6 s
    assert elapsed < 5


def test_down_endpoint_gives_failure_value_fast():
    down = f"http://127.0.0.1:{_free_port()}/v1"  # bound, then closed: connection refused
    with _client(down, timeout_s=0.5, retries=2, backoff_s=0.05, failure_value=0.0) as client:
        t0 = time.monotonic()
        scores = client.score(["a", "b", "c"])
        elapsed = time.monotonic() - t0
    assert scores == [0.0, 0.0, 0.0]
    assert elapsed < client.config.worst_case_s() + 0.5  # refused at once: the backoffs only (0.05 + 0.1 s)


def test_server_error_gives_failure_value_after_retries(server):
    base, _ = server
    with _client(base + "/broken/v1", retries=1, backoff_s=0.01, failure_value=0.25) as client:
        assert client.score(["a"]) == [0.25]


def test_slow_endpoint_with_value_policy(server):
    base, _ = server
    with _client(base + "/slow/v1", timeout_s=0.3, retries=0, failure_value=0.0) as client:
        t0 = time.monotonic()
        assert judge_caption_reward(client, ["a"], ["b"]) == [0.0]
        assert time.monotonic() - t0 < 0.3 + 0.5


def test_slow_endpoint_with_raise_policy_stops_with_one_line(server):
    base, _ = server
    cfg = JudgeConfig(
        base_url=base + "/slow/v1", timeout_s=0.3, retries=1, backoff_s=0.05, on_failure="raise", trust_env=False
    )
    bound = cfg.worst_case_s()  # 0.3 * 2 + 0.05 s
    with JudgeClient(cfg) as client:
        t0 = time.monotonic()
        with pytest.raises(JudgeUnavailable) as info:
            client.score(["a", "b"])
        elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"JudgeUnavailable: {base}/slow/v1 did not answer within 0.3 s after 1 retries")
    assert "on_failure: value" in message
    assert elapsed < bound + 0.5, f"took {elapsed:.2f} s, bound {bound:.2f} s"


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="judge.on_failure"):
        JudgeConfig(on_failure="ignore")
    with pytest.raises(ValueError, match="judge.max_concurrency"):
        JudgeConfig(max_concurrency=0)
