"""``python -m cli.evaluate vstar | dove``: the toy video checkpoint end to end on two-clip V-STaR and one-group DOVE
fixtures made from the toy video world, DOVE judged by a real local OpenAI-compatible server (tests/judge_server.py)
running a rule-based text-only judge, the predictions-file mode, shards, and the exit codes of the common mistakes
(cli/evaluate_video.py, evals/vstar.py, dove.py)."""

from __future__ import annotations

import json
import re

import pytest

from cli.evaluate import main
from evals.vstar import CHAIN_KEYS, parse_interval, spatial_miou, temporal_iou
from tests.evals.video_bench_fixtures import write_dove_fixture, write_vstar_fixture

TOY_VIDEO = "checkpoints/toy-qwen2.5-vl-cycle-video"


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_vstar_toy_policy_end_to_end_then_rescored(tmp_path):
    data, videos, clips = write_vstar_fixture(tmp_path)
    out = tmp_path / "res" / "vstar.json"
    flags = ["vstar", "--data", str(data), "--out"]
    run = flags[:-1] + ["--video-root", str(videos), "--policy", TOY_VIDEO, "--prompts", "toy", "--fps", "2"]
    assert main(run + ["--max-new-tokens", "64", "--out", str(out)]) == 0
    res, rows = json.loads(out.read_text()), _lines(tmp_path / "res" / "vstar.predictions.jsonl")
    assert res["n"] == 2 and res["what_scorer"] == "exact" and res["prompts"] == "toy" and res["device"] == "cpu"
    for row, clip in zip(rows, clips):
        # all five questions answered, on the clip's 112 x 112 frames (so boxes need no scaling)
        assert sorted(row["completions"]) == sorted(CHAIN_KEYS) and all(row["completions"].values())
        assert row["input_wh"] == [112, 112]
        # each row's scores are the scorers' on its own answers
        gt = [(t, tuple(b)) for t, b in clip["anchors"]]
        assert row["when_iou"] == temporal_iou(clip["solution"][0], parse_interval(row["completions"]["when"]))
        where = {float(t): [tuple(b) for b in bs] for t, bs in row["where"].items()}
        assert row["where_iou"] == spatial_miou(gt, where)
    # the chain's "when" is what the toy checkpoint answers under its own temporal prompt through CycleGRPO's prompt
    # path (build_prompt_text, toy_temporal): the benchmark asks what the method's validation asks
    from core.video import VideoClip
    from datamodules.toy_video import load_frames
    from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
    from lightning_modules.models.loading import load_policy
    from lightning_modules.models.prompts import build_prompt_text

    model, processor = load_policy(TOY_VIDEO, dtype="fp32")
    prompt = build_prompt_text(processor, clips[0]["meta"]["query"], template="toy_temporal", video=True)
    request = RolloutRequest(prompt, VideoClip(load_frames(clips[0]), 2.0), 1, 0)
    ro = build_rollout_engine("hf").generate(model, processor, [request], Sampling(max_new_tokens=64, greedy=True))
    assert rows[0]["completions"]["when"] == ro.texts[0]
    # scoring the predictions file again gives the same numbers; a shard scores its share
    again = tmp_path / "again.json"
    pred = str(tmp_path / "res" / "vstar.predictions.jsonl")
    assert main(flags + [str(again), "--predictions", pred]) == 0
    assert json.loads(again.read_text())["metrics"] == res["metrics"]
    assert main(flags + [str(again), "--predictions", pred, "--shard", "1/2"]) == 0
    shard = json.loads(again.read_text())
    assert shard["n"] == 1 and shard["unmatched_predictions"] == 1 and shard["metrics"]["when"] == rows[1]["when_iou"]


def test_vstar_flag_and_data_mistakes(tmp_path, capsys):
    data, videos, _ = write_vstar_fixture(tmp_path)
    out = str(tmp_path / "r.json")
    base = ["vstar", "--data", str(data), "--out", out]
    cases = [
        (base, 2, "give --policy (run the policy) or --predictions (score a file), one"),
        (base + ["--policy", TOY_VIDEO], 2, "--policy needs --video-root"),
        (base + ["--predictions", "x.jsonl", "--prompts", "nope"], 2, "--prompts 'nope': one of ['toy', 'vstar']"),
        (["vstar", "--data", str(tmp_path / "none.json"), "--out", out, "--predictions", "x"], 2, "no such file"),
        (base + ["--predictions", str(tmp_path / "missing.jsonl")], 3, "no such predictions file"),
    ]
    for argv, code, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == code and message in capsys.readouterr().err
    (videos / f"{json.loads(data.read_text())[1]['vid']}.npz").unlink()
    with pytest.raises(SystemExit) as exc:
        main(base + ["--policy", TOY_VIDEO, "--video-root", str(videos), "--prompts", "toy", "--fps", "2"])
    assert (
        exc.value.code == 3
        and "item 1: video 'toyvid-val-000003' not found under --video-root" in capsys.readouterr().err
    )


def toy_judge(prompt: str) -> str:
    """A text-only judge for the toy world: the letter of the first option whose words the description names, else
    N/M ("the second" is named by "the second time ...", "down" by "moves down")."""
    description = prompt.split("Description: ", 1)[1].split("\nQuestion:", 1)[0].lower()
    for letter, option in re.findall(r"^([A-J])\. (.+)$", prompt, re.MULTILINE):
        if re.search(rf"\b{re.escape(option.lower().removeprefix('the '))}\b", description):
            return letter
    return "N/M"


def test_dove_toy_policy_with_a_judge_server(tmp_path, capsys):
    pytest.importorskip("fastapi")
    from tests.judge_server import running_judge_server

    data, videos, groups = write_dove_fixture(tmp_path)
    out, pred = tmp_path / "dove.json", tmp_path / "dove.predictions.jsonl"
    base = ["dove", "--data", str(data), "--out", str(out)]
    policy = ["--video-root", str(videos), "--policy", TOY_VIDEO, "--caption-template", "toy_caption", "--fps", "2"]
    with running_judge_server(script=toy_judge) as judge:
        url = judge.url + "/scripted/v1"
        assert main(base + policy + ["--judge-url", url, "--judge-model", "toy-judge", "--bootstrap", "50"]) == 0
        res, lines = json.loads(out.read_text()), _lines(pred)
        n_probes = sum(len(o["probes"]) for g in groups for o in g["occurrences"])
        # one text-only request per probe, with the caption of its occurrence and nothing visual
        assert len(judge.state.requests) == n_probes == res["metrics"]["n_probes"]
        assert all(isinstance(b["messages"][-1]["content"], str) for b in judge.state.requests)
        assert {b["model"] for b in judge.state.requests} == {"toy-judge"}
        # TEC by hand from the captions: the toy judge's choice per probe, right when it is the probe's answer
        by_type: dict[str, list[bool]] = {}
        nm = 0
        for occ, line in zip(groups[0]["occurrences"], lines):
            assert line["id"] == occ["id"] and line["caption"]
            for probe, judged in zip(occ["probes"], line["probes"]):
                caption = line["caption"].split("<answer>")[-1].split("</answer>")[0].strip()
                opts = "\n".join(f"{'ABCD'[i]}. {o}" for i, o in enumerate(probe["options"]))
                reply = toy_judge(f"Description: {caption}\nQuestion: q\n{opts}\n")
                assert judged["reply"] == reply
                nm += reply == "N/M"
                by_type.setdefault(probe["type"], []).append(reply != "N/M" and "ABCD".index(reply) == probe["answer"])
        tec = {t: sum(v) / len(v) for t, v in by_type.items()}
        m = res["metrics"]
        assert m["tec_by_type"] == tec and m["tec"] == pytest.approx(sum(tec.values()) / 3)
        assert m["nm"] == nm / n_probes and len(m["tec_ci95"]) == 2
        # the captions file scores again without the policy
        again = tmp_path / "again.json"
        argv = ["dove", "--data", str(data), "--out", str(again), "--predictions", str(pred), "--judge-url", url]
        assert main(argv) == 0
        assert json.loads(again.read_text())["metrics"]["tec_by_type"] == tec
        # a judge that answers 503: stop with one line under raise; every probe unreadable under value
        broken = ["--judge-url", judge.url + "/broken/v1", "--predictions", str(pred)]
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main(
                ["dove", "--data", str(data), "--out", str(tmp_path / "b.json"), *broken, "--judge-on-failure", "raise"]
            )
        err = capsys.readouterr().err
        assert exc.value.code == 4 and len(err.splitlines()) == 1
        assert "JudgeUnavailable" in err and "HTTP 503" in err and "pass --judge-on-failure value" in err
        assert main(["dove", "--data", str(data), "--out", str(tmp_path / "v.json"), *broken]) == 0
        m = json.loads((tmp_path / "v.json").read_text())["metrics"]
        assert m["tec"] == 0.0 and m["unreadable"] == 1.0
    with pytest.raises(SystemExit) as exc:  # no judge, no DOVE
        main(base + ["--predictions", str(pred)])
    assert exc.value.code == 2 and "needs --judge-url" in capsys.readouterr().err
