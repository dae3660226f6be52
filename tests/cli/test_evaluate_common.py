"""The helpers every ``python -m cli.evaluate`` sub-command shares (cli/evaluate_common.py): the ``--shard`` parser and
slice, the shared flags on a real sub-parser and their one-line errors, the results' ``info`` block and the judge
wrapper's exit 4. The benchmarks' own tests (tests/cli/test_evaluate*.py) run them end to end."""

from __future__ import annotations

import argparse

import pytest

from cli.evaluate_common import (
    NEEDS_MASK_TOKENIZER,
    add_judge_flags,
    add_run_flags,
    check_run_flags,
    parse_shard,
    run_info,
    take_shard,
    with_judge,
)
from lightning_modules.judge import JudgeUnavailable


def _parser(mask_tokenizer: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_run_flags(p, unit="item", mask_tokenizer=mask_tokenizer)
    add_judge_flags(p, url_help="judge URL", failure_help="value or raise", tunable=True)
    return p


def _exit(capsys, fn, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        fn(*args)
    return e.value.code, capsys.readouterr().err


def test_shard_parses_and_slices_every_nth_from_the_ith(capsys):
    assert parse_shard("3/8") == (3, 8)
    assert list(take_shard(list(range(7)), (1, 3))) == [1, 4]  # items 1, 1 + 3 (7 is past the end)
    assert take_shard([0, 1], None) == [0, 1]
    code, err = _exit(capsys, parse_shard, "8/8")
    assert code == 2 and "--shard 8/8: need 0 <= I < N" in err
    code, err = _exit(capsys, parse_shard, "half")
    assert code == 2 and "--shard takes I/N" in err


def test_shared_flags_and_their_checks(capsys):
    p = _parser()
    ok = p.parse_args(["--out", "r.json", "--policy", "CKPT", "--mask-tokenizer", "TOK", "--shard", "1/2"])
    assert check_run_flags(ok, "gcg", NEEDS_MASK_TOKENIZER) == (1, 2)
    assert (ok.batch_size, ok.max_new_tokens, ok.judge_concurrency, ok.judge_on_failure) == (8, None, 8, "value")
    mistakes = [
        (["--out", "r.json"], "cli.evaluate gcg: give --policy (run the policy) or --predictions (score a file), one"),
        (["--out", "r.json", "--policy", "C", "--predictions", "p.jsonl"], "give --policy"),
        (["--out", "r.json", "--policy", "C"], "cli.evaluate gcg --policy needs --mask-tokenizer for the mask tokens"),
        (["--out", "r.json", "--predictions", "p.jsonl", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--out", "r.json", "--predictions", "p.jsonl", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ]
    for argv, message in mistakes:
        code, err = _exit(capsys, check_run_flags, p.parse_args(argv), "gcg", NEEDS_MASK_TOKENIZER)
        assert code == 2 and message in err and err.count("\n") == 1, argv


def test_info_records_the_run_and_has_a_mask_tokenizer_only_where_the_benchmark_does():
    args = _parser().parse_args(["--out", "r.json", "--predictions", "a.jsonl", "b.jsonl", "--shard", "0/2"])
    info = run_info(args, "python -m cli.evaluate gcg ...", 1024, split="val")
    assert list(info) == ["split", "policy", "mask_tokenizer", "max_new_tokens", "shard", "scored_files", "command"]
    assert info["scored_files"] == ["a.jsonl", "b.jsonl"] and info["shard"] == "0/2" and info["max_new_tokens"] == 1024
    video = _parser(mask_tokenizer=False).parse_args(["--out", "r.json", "--policy", "CKPT"])
    assert "mask_tokenizer" not in run_info(video, "cmd", 256) and not hasattr(video, "sam2")


def test_an_unreachable_judge_under_raise_exits_4_with_the_flag_to_pass(capsys):
    def run(judge):
        raise JudgeUnavailable("http://127.0.0.1:9/v1 HTTP 503; start the judge server or set judge.on_failure: value")

    code, err = _exit(capsys, with_judge, None, run)
    assert code == 4 and err.count("\n") == 1 and "HTTP 503" in err and "pass --judge-on-failure value" in err
    assert with_judge(None, lambda judge: judge is None) is True
