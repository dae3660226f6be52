"""JudgeClient against a real local OpenAI-compatible server (tests/judge_server.py: FastAPI + uvicorn in a thread),
a slow route and a closed port. Every test asserts its wall time, so a hang shows up as a failure, not a stuck run."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lightning_modules.judge import (  # noqa: E402
    JudgeClient,
    JudgeConfig,
    JudgeUnavailable,
    judge_caption_reward,
    parse_score,
)
from tests.judge_server import free_port, running_judge_server  # noqa: E402

SLOW_S = 1.5  # the slow route sleeps this long; the tests' timeouts are well below it


@pytest.fixture(scope="module")
def server():
    with running_judge_server(slow_s=SLOW_S) as judge:
        yield judge.url, judge.state


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
    # the two caption prompts are in flight together, so either may be recorded last
    caption_bodies = state.requests[-2:]
    assert all(body["model"] == "toy-judge" for body in caption_bodies)
    assert any("a blue sphere" in body["messages"][0]["content"] for body in caption_bodies)
    assert state.auth[-1] == "Bearer sk-secret"


def test_unparseable_reply_gives_failure_value(server):
    base, _ = server
    with _client(base + "/chatty/v1", failure_value=-1.0) as client:
        assert judge_caption_reward(client, ["a cube"], ["a cube"]) == [-1.0]


def test_concurrency_is_bounded(server):
    base, state = server
    state.reset_counts()
    with _client(base + "/v1", max_concurrency=3) as client:
        t0 = time.monotonic()
        scores = client.score([f"p{i}" for i in range(12)])
        elapsed = time.monotonic() - t0
    assert scores == [7.0] * 12
    assert state.max_in_flight <= 3
    assert state.max_in_flight >= 2  # it does run in parallel: 12 x 0.05 s serially would be 0.6 s
    assert elapsed < 5


def test_down_endpoint_gives_failure_value_fast():
    down = f"http://127.0.0.1:{free_port()}/v1"  # bound, then closed: connection refused
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


def test_scripted_route_and_models_listing(server):
    base, state = server
    state.script = lambda prompt: "Score: 3" if "cube" in prompt else "Score: 10"
    with _client(base + "/scripted/v1") as client:
        assert client.score(["a cube", "a cat"], scale=10) == [pytest.approx(0.3), 1.0]
    models = httpx.get(base + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["toy-judge"]
