"""The product's OpenAI-compatible judge server (``python -m cli.judge_server``) over the toy checkpoint, answered
by the real :class:`JudgeClient`: the request / response contract, not the quality of the toy model's replies."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lightning_modules.judge import JudgeClient, JudgeConfig, judge_caption_reward  # noqa: E402
from tests.judge_server import running_toy_judge  # noqa: E402


@pytest.fixture(scope="module")
def toy_judge():
    with running_toy_judge(max_tokens=8) as url:
        yield url


def test_chat_completion_contract(toy_judge):
    body = {"model": "judge", "messages": [{"role": "user", "content": "Score this: a red cube"}], "max_tokens": 5}
    reply = httpx.post(toy_judge + "/chat/completions", json=body, timeout=30, trust_env=False).json()
    assert reply["object"] == "chat.completion" and reply["model"] == "judge"
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = reply["usage"]
    assert 1 <= usage["completion_tokens"] <= 5  # max_tokens is honoured
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = httpx.post(toy_judge + "/chat/completions", json=body, timeout=30, trust_env=False).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]  # greedy: reproducible
    listed = httpx.get(toy_judge + "/models", trust_env=False).json()
    assert [m["id"] for m in listed["data"]] == ["judge"]


def test_refusals_are_client_errors(toy_judge):
    def post(**kw):
        body = {"model": "judge", "messages": [{"role": "user", "content": "hi"}], **kw}
        return httpx.post(toy_judge + "/chat/completions", json=body, timeout=30, trust_env=False)

    assert post(model="gpt-4o").status_code == 404  # as vLLM answers an unknown model
    assert post(n=2).status_code == 400
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "hi"}]
    assert post(messages=[{"role": "user", "content": image}]).status_code == 400
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "cube"}]
    assert post(messages=[{"role": "user", "content": parts}], max_tokens=2).status_code == 200


def test_judge_client_scores_toy_replies_without_raising(toy_judge):
    config = JudgeConfig(base_url=toy_judge, model="judge", trust_env=False, timeout_s=20, on_failure="raise")
    with JudgeClient(config) as client:
        t0 = time.monotonic()
        texts = client.complete(["Rate: a cube", "Rate: a cat", "Rate: a dog"])
        rewards = judge_caption_reward(client, ["a red cube", "a cat"], ["a small red cube", "a blue sphere"])
    assert all(isinstance(t, str) for t in texts)
    # whatever the toy says, the reward is a number in [0, 1] or the failure value (no number in the reply)
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert time.monotonic() - t0 < 30


def test_cli_missing_checkpoint_exits_2(tmp_path, capsys):
    from cli.judge_server import main

    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path / "nowhere")])
    assert info.value.code == 2
    assert "no config.json" in capsys.readouterr().err
