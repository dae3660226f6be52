"""CycleGRPO's optional reference-based caption reward against a real local judge server (tests/judge_server.py):
the reward worked by hand, rows without a reference left alone, and both failure policies on a down endpoint."""

from __future__ import annotations

import math
import time

import pytest
import torch
from method_util import build_test_method, text_rollout  # tests/lightning_modules is on sys.path under pytest
from test_methods import Sample

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lightning_modules.judge import JudgeClient, JudgeConfig, JudgeUnavailable, judge_caption_verdict, parse_verdict  # noqa: E402
from tests.judge_server import free_port, running_judge_server  # noqa: E402

TEXTS = [
    "<answer>the red circle</answer>",  # caption 0: clean, Phi_cap 0
    "<answer>at [1, 2, 3, 4]</answer>",  # caption 1: a leak (-1), nothing left after stripping (-1)
    "<answer>[0, 0, 10, 10]</answer>",  # caption 0, grounding 0: IoU 1
    "<answer>[0, 0, 10, 5]</answer>",  # caption 0, grounding 1: IoU 0.5
    "???",  # caption 1, grounding 0: unreadable: s 0, Phi_loc -1
    "<answer>[0, 0, 10, 10]</answer>",  # caption 1, grounding 1: IoU 1
]
WITHOUT_JUDGE = [0.75, -1.5, 1.0, 0.5, -1.0, 1.0]  # tests/lightning_modules/test_cycle_grpo.py, worked there


def _verdict(prompt: str) -> str:
    # the judge says true exactly for a caption naming the red circle
    caption = prompt.split("Model caption:")[1]
    return "true" if "red circle" in caption else "false"


@pytest.fixture(scope="module")
def judge():
    with running_judge_server(script=_verdict) as server:
        yield server


def _method(base_url: str, **judge):
    cfg = {"base_url": base_url, "model": "toy-judge", "trust_env": False, **judge}
    args = {"n_captions": 2, "k_groundings": 2, "alpha": 1.0, "judge": cfg, "judge_weight": 0.5}
    return build_test_method("cycle_grpo", {"prompt_template": "toy", "advantage_eps": 0.0}, args)


def _ro():
    ro = text_rollout(TEXTS, 1)
    ro.group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    return ro


def test_judge_reward_is_added_to_caption_rows_with_a_reference(judge):
    m = _method(judge.url + "/scripted/v1")
    batch = [Sample("s0", "q", [[0, 0, 10, 10]], meta={"reference_caption": "a small red circle"})]
    n_before = len(judge.state.requests)
    s = m.score(batch, _ro())
    # r_cap += 0.5 * verdict: caption 0 "the red circle" -> true (+0.5), caption 1 "at [1, 2, 3, 4]" -> false (+0)
    assert s.total.tolist() == [1.25, -1.5, 1.0, 0.5, -1.0, 1.0]
    asked = judge.state.requests[n_before:]
    assert len(asked) == 2  # one request per caption row, none for the groundings
    assert all("a small red circle" in body["messages"][0]["content"] for body in asked)
    assert m.train_logs(s, _ro())["train/cycle/judge_reward"] == 0.5


def test_rows_without_a_reference_are_not_judged(judge):
    m = _method(judge.url + "/scripted/v1")
    n_before = len(judge.state.requests)
    s = m.score([Sample("s0", "q", [[0, 0, 10, 10]])], _ro())
    assert s.total.tolist() == WITHOUT_JUDGE
    assert len(judge.state.requests) == n_before
    assert math.isnan(m.train_logs(s, _ro())["train/cycle/judge_reward"])
    plain = build_test_method("cycle_grpo", {"prompt_template": "toy"}, {"n_captions": 2, "k_groundings": 2})
    batch = [Sample("s0", "q", [[0, 0, 10, 10]], meta={"reference_caption": "a small red circle"})]
    assert plain.judge is None  # off by default: a reference alone asks nothing
    assert "train/cycle/judge_reward" not in plain.train_logs(plain.score(batch, _ro()), _ro())


def test_down_judge_scores_the_failure_value_or_stops_with_one_line():
    down = f"http://127.0.0.1:{free_port()}/v1"  # bound, then closed: connection refused
    batch = [Sample("s0", "q", [[0, 0, 10, 10]], meta={"reference_caption": "a small red circle"})]
    quick = {"timeout_s": 0.5, "retries": 1, "backoff_s": 0.05}
    m = _method(down, on_failure="value", failure_value=0.0, **quick)
    t0 = time.monotonic()
    assert m.score(batch, _ro()).total.tolist() == WITHOUT_JUDGE  # + 0.5 * 0.0 on both captions
    assert time.monotonic() - t0 < 5
    m = _method(down, on_failure="raise", **quick)
    with pytest.raises(JudgeUnavailable) as info:
        m.score(batch, _ro())
    assert "\n" not in str(info.value) and "judge.on_failure: value" in str(info.value)


def test_verdict_parsing_and_empty_captions(judge):
    assert parse_verdict("true") is True and parse_verdict(" False.") is False
    assert parse_verdict("true or false") is None and parse_verdict("yes") is None
    with JudgeClient(JudgeConfig(base_url=judge.url + "/scripted/v1", trust_env=False, failure_value=-1)) as client:
        n_before = len(judge.state.requests)
        assert judge_caption_verdict(client, ["", "the red circle"], ["a red circle", "a red circle"]) == [0.0, 1.0]
        assert len(judge.state.requests) == n_before + 1  # the empty caption scores 0 without a request
        judge.state.script = lambda prompt: "maybe"
        try:
            assert judge_caption_verdict(client, ["a cube"], ["a cube"]) == [-1.0]  # no verdict: failure value
        finally:
            judge.state.script = _verdict


def test_parquet_cap_answer_is_the_reference_caption(tmp_path):
    from datamodules.cycle_parquet import read_cycle_parquet, row_sample
    from tests.datamodules.test_cycle_data import release_rows, write_parquet

    rows = release_rows(tmp_path)
    rows[0]["cap_answer"] = "Two cats on a sofa."  # two targets
    rows[1]["cap_answer"] = " A grey cat. "  # one target
    dw, one, _ = read_cycle_parquet(write_parquet(tmp_path / "rl.parquet", rows), tmp_path)
    assert row_sample(one).meta["reference_caption"] == "A grey cat."
    assert row_sample(one, target=0).meta["reference_caption"] == "A grey cat."
    assert row_sample(dw).meta["reference_caption"] == "Two cats on a sofa."
    assert "reference_caption" not in row_sample(dw, target=1).meta  # one of two targets: the caption covers both


def test_train_py_reports_an_unavailable_judge_in_one_line():
    from cli.main import EXIT_CODES, error_class

    # train.py fit with judge.on_failure: raise and no judge ends with `error: JudgeUnavailable: ...` and exit 4
    assert EXIT_CODES[error_class(JudgeUnavailable("http://x/v1 did not answer"))] == 4
