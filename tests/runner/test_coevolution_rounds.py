"""``python -m cli.coevolve``: EvolvedGRPO's rounds on a few toy math rows, on the CPU, with the toy checkpoint as A
and Q (runner/coevolution_rounds.py, docs/evolved_coevolution.md, "The rounds").

The toy checkpoint never writes Q's JSON, so every row is kept (gate ``malformed``): these tests check the machinery
(stages, files, lineage, metrics, resumption, determinism), not learning. Its rewards are 0, so its GRPO steps leave
the weights as they were; the resume test adds an entropy bonus (`LEARNING`) so that A_1 and Q_1 differ from A_0, Q_0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from cli.coevolve import main
from core.coevolution import split_image_rows
from core.question_rewards import score_image_edit, score_text_edit
from datamodules.reasoning import ReasoningDataModule, load_reasoning_sample, read_rows, write_jsonl
from datamodules.sft_math import edit_instruction_target
from datamodules.toy_math import export_split
from runner.coevolution_config import RoundsConfig, RoundsError
from runner.coevolution_edits import (
    EditSettings,
    _RecordingJudge,
    build_next_dataset,
    edit_stats,
    lineage_record,
    next_row,
    read_jsonl_rows,
)
from runner.coevolution_rounds import STOP_ENV, Rounds, StopRequested

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "checkpoints/toy-qwen2.5-vl"
STAGES = ("answer_fit", "answer_export", "answer_eval", "question_fit", "question_export", "edit")
LEARNING = {"model.init_args.optimisation.entropy_coef": 0.1, "model.init_args.optimizer.init_args.lr": 1e-3}
"""A and Q keys under which the toy checkpoint's weights move (with all rewards 0 its GRPO gradient is 0)."""


def write_config(tmp: Path, **over) -> Path:
    """configs/coevolve/tiny.yaml shrunk: 4 rows of D_1 (2 fit steps of 2 rows), 2 + 2 held-out rows, chunks of 2."""
    cfg = yaml.safe_load((REPO / "configs/coevolve/tiny.yaml").read_text())
    toy_root = tmp / "toy_math"
    small = {"data.init_args.toy": None, "data.init_args.data_root": str(toy_root), "data.init_args.batch_size": 2}
    cfg.update(
        rounds=1,
        answer_config=str(REPO / cfg["answer_config"]),
        question_config=str(REPO / cfg["question_config"]),
        answer_model=str(TOY),
        question_model=str(TOY),
        toy={"data_root": str(toy_root), "splits": {"train": 4, "val": 2, "ood": 2}, "seed": 0},
        dataset=str(toy_root / "train.jsonl"),
        max_rows=4,
        eval_files={"toy_math_val": str(toy_root / "val.jsonl"), "toy_math_ood": str(toy_root / "ood.jsonl")},
        answer_args={**cfg["answer_args"], **small, "model.init_args.sampling.max_new_tokens": 16},
        question_args={
            **cfg["question_args"],
            **small,
            "model.init_args.sampling.max_new_tokens": 16,
            "model.init_args.method.init_args.answer_max_new_tokens": 16,
        },  # fmt: skip
        edits={**cfg["edits"], "max_new_tokens": 16, "chunk": 2},
        launcher="inprocess",
    )
    cfg.update(over)
    path = tmp / "coevolve.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_learning_config(tmp: Path, **over) -> Path:
    """`write_config` with `LEARNING` in A's and Q's keys: a round whose weights move."""
    base = yaml.safe_load(write_config(tmp).read_text())
    return write_config(tmp, **{k: {**base[k], **LEARNING} for k in ("answer_args", "question_args")}, **over)


def stages(out: Path) -> dict:
    return json.loads((out / "state.json").read_text())["stages"]


@pytest.mark.slow
def test_one_round_killed_in_the_edit_stage_resumes_per_row(tmp_path, monkeypatch):
    """One round end to end, stopped after D_2's first chunk; the same command finishes it without re-running a
    finished stage or row, and the rows it writes are the rows an uninterrupted build writes."""
    monkeypatch.chdir(tmp_path)
    config, out = write_learning_config(tmp_path), tmp_path / "run"
    monkeypatch.setenv(STOP_ENV, "round_1/edit:rows2")
    monkeypatch.setenv("COEVOLVE_STOP_HOW", "raise")
    with pytest.raises(StopRequested):
        main(["--config", str(config), "--out", str(out)])
    st = stages(out)
    assert all(st[f"round_1/{s}"].get("done") for s in STAGES[:-1]) and not st["round_1/edit"].get("done")
    assert (
        len(read_jsonl_rows(out / "round_2/dataset.jsonl.partial")) == 2
        and not (out / "round_2/dataset.jsonl").exists()
    )
    monkeypatch.delenv(STOP_ENV)
    summary = main(["--config", str(config), "--out", str(out)])
    after = stages(out)
    for s in STAGES[:-1]:  # finished before the stop: not started again
        assert after[f"round_1/{s}"] == st[f"round_1/{s}"], s
    assert len(after["round_1/edit"]["starts"]) == 2 and after["round_1/edit"]["done"]

    # the files of a round
    r1 = out / "round_1"
    assert (r1 / "answer/hf/config.json").is_file() and (r1 / "question/hf/config.json").is_file()

    w0 = load_file(TOY / "model.safetensors")
    for role in ("answer", "question"):  # the round's weights moved: the resume and the build use A_1, Q_1, not A_0
        w1 = load_file(r1 / role / "hf/model.safetensors")
        assert any(not torch.equal(w1[k], w0[k]) for k in w0 if k in w1), role
    assert (r1 / "answer/final.ckpt").is_file() and (r1 / "answer/checkpoints/last.ckpt").is_file()
    d1, d2 = read_jsonl_rows(r1 / "dataset.jsonl"), read_jsonl_rows(out / "round_2/dataset.jsonl")
    assert (
        [r["id"] for r in d2]
        == [r["id"] for r in d1]
        == [r.sample_id for r in read_rows(tmp_path / "toy_math/train.jsonl")]
    )
    for row in d2:  # the toy checkpoint writes no JSON: every row kept, with this round's record
        root, rec = row["lineage"]
        assert root["outcome"] == "root" and root["round"] == 1
        assert (
            rec["round"] == 2 and rec["from_round"] == 1 and rec["outcome"] == "kept" and rec["reason"] == "malformed"
        )
        assert rec["question_model"] == str(r1 / "question/hf") and rec["answer_model"] == str(r1 / "answer/hf")
        assert isinstance(rec["q_output"], str) and rec["kind"] in ("text", "image")
        assert (
            {"votes", "label"} <= set(rec)
            if rec["kind"] == "text"
            else {"edit_job", "edited_image", "clip"} <= set(rec)
        )
    # the seed's partition, drawn anew: Q_1's fit split D_1's 4 rows with seed 2025 + 1 (RoundRows), D_2's build with
    # 2025 + 2, each exactly image_row_count(4) = 1 image row (the fixed draw gives rows 0 and 2 here)
    ids = [r["id"] for r in d1]
    q_steps = [json.loads(x) for x in (r1 / "question/metrics.jsonl").read_text().splitlines()]
    q_steps = [x for x in q_steps if x.get("event") == "train"]
    assert len(q_steps) == 2 and sum(x["train/q/image_frac"] for x in q_steps) * 2 == 1  # 2 rows a step
    assert [row["lineage"][1]["kind"] == "image" for row in d2] == [i in split_image_rows(ids, 2027) for i in ids]
    assert split_image_rows(ids, 2027) == {ids[3]} and split_image_rows(ids, 2026) == {ids[1]}
    dm = ReasoningDataModule(data_root=str(out / "round_2"), train_files=["dataset.jsonl"], batch_size=2)
    dm.setup("fit")  # D_2 is what A_2's fit reads
    assert [s.sample_id for s in next(iter(dm.train_dataloader()))] and len(dm.train_set) == 4

    # per-round metrics and the summary
    metrics = json.loads((r1 / "metrics.json").read_text())
    assert set(metrics["answer_eval"]) == {
        f"test/toy_math_{s}/{m}" for s in ("val", "ood") for m in ("accuracy", "format")
    }
    edits = metrics["question_edits"]
    assert edits["rows"] == 4 and edits["replaced"] == 0 and edits["valid_edit_rate"] == 0.0
    assert edits["reasons"] == {"malformed": 4} and sum(k["rows"] for k in edits["by_kind"].values()) == 4
    assert summary["per_round"][0]["answer_eval"] == metrics["answer_eval"]
    assert json.loads((out / "summary.json").read_text())["final_dataset"] == str(out / "round_2/dataset.jsonl")

    # determinism: an uninterrupted build of D_2 from the same models writes the same rows
    fresh = build_next_dataset(
        r1 / "dataset.jsonl", out / "round_2/fresh.jsonl", round_k=1, question_model=str(r1 / "question/hf"),
        answer_model=str(r1 / "answer/hf"),
        judge_args=Rounds(RoundsConfig.from_yaml(config), out)._judge_args(str(r1 / "answer/hf"), out / "round_2/images"),
        settings=EditSettings(**{**yaml.safe_load(config.read_text())["edits"]}), seed=1,
    )  # fmt: skip
    assert read_jsonl_rows(out / "round_2/fresh.jsonl") == d2 and fresh == edits

    # a third run: nothing left to do, nothing re-run
    main(["--config", str(config), "--out", str(out)])
    assert stages(out) == after


def test_replaced_rows_get_the_composed_problem_and_label_or_the_edited_image_and_scene(tmp_path):
    """The rows a Q that writes valid JSON produces (the toy checkpoint never does): a text edit past the gate gets
    the composed problem and the vote's label, an image edit the edited image and its toy scene; a gated one stays."""

    src = export_split(tmp_path / "toy", "train", 3, seed=0)
    raws, samples = read_jsonl_rows(src), [load_reasoning_sample(r) for r in read_rows(src)]
    out_dir = tmp_path / "round_2"
    out_dir.mkdir()
    models = {"question": "Q1", "answer": "A1"}
    box = lambda a: f"<think>count</think> \\boxed{{{a}}}"  # noqa: E731
    x = samples[0].answer
    # text: 3 of 5 votes say x + 2, A then answers the composed problem right 1 time in 5 (base rate 4 / 5): harder
    votes = [str(int(x) + 2)] * 3 + ["1", None]
    text = score_text_edit('{"follow_up_problem": "What is x + 2?"}', votes, [box(int(x) + 2)] + [box(0)] * 4)
    assert text.valid and text.label == str(int(x) + 2)
    ev = {"votes": votes, "row_id": samples[0].sample_id}
    rec = lineage_record(1, "text", "raw", text, ev, True, 0.8, models)
    row = next_row(raws[0], samples[0], "text", text, ev, rec, out_dir)
    assert row["problem"].startswith(samples[0].problem) and row["problem"].endswith("What is x + 2?")
    assert row["answer"] == str(int(x) + 2) and row["id"] == raws[0]["id"]
    assert rec["outcome"] == "replaced" and rec["votes"] == votes and rec["label"] == row["answer"] and rec["harder"]
    # image: the edited file and the toy scene the editor returned; problem and answer kept
    edited = tmp_path / "edits/x.png"
    edited.parent.mkdir()
    samples[1].image.save(edited)
    scene = {**raws[1]["meta"]["scene"], "background": [250, 240, 220]}
    image = score_image_edit('{"edit_instruction": "make the background cream"}', 0.9, [box(samples[1].answer)] * 5,
                             samples[1].answer)  # fmt: skip
    ev = {"edited_image": str(edited), "clip": 0.9, "scene": {**raws[1]["meta"], "scene": scene}, "row_id": "r"}
    rec = lineage_record(1, "image", "raw", image, ev, False, 1.0, models)
    row = next_row(raws[1], samples[1], "image", image, ev, rec, out_dir)
    assert (out_dir / row["image"]).resolve() == edited.resolve() and row["meta"]["scene"] == scene
    assert (row["problem"], row["answer"]) == (raws[1]["problem"], raws[1]["answer"])
    assert rec["edit_job"].startswith("r@ie-") and rec["clip"] == 0.9 and not rec["harder"]
    # a gated edit (no answer has 2 votes) keeps the row
    gated = score_text_edit('{"follow_up_problem": "What is 2x?"}', ["1", "2", "3", None, None], [])
    rec = lineage_record(1, "text", "raw", gated, {"votes": []}, False, None, models)
    kept = next_row(raws[2], samples[2], "text", gated, {}, rec, out_dir)
    assert (kept["problem"], kept["answer"], rec["reason"]) == (raws[2]["problem"], raws[2]["answer"], "few_votes")
    rows = [{**r, "lineage": [{"round": 2, **lr}]} for r, lr in zip([row, row, kept], [
        {"outcome": "replaced", "harder": True, "kind": "text", "reason": "ok"},
        {"outcome": "replaced", "harder": False, "kind": "image", "reason": "ok"},
        {"outcome": "kept", "harder": False, "kind": "text", "reason": "few_votes"}])]  # fmt: skip
    stats = edit_stats(rows, 2)
    assert stats["valid_edit_rate"] == 2 / 3 and stats["harder_edit_rate"] == 1 / 3 and stats["harder_of_valid"] == 0.5
    assert stats["reasons"] == {"few_votes": 1, "ok": 2} and stats["by_kind"]["text"] == {
        "rows": 2,
        "replaced": 1,
        "harder": 1,
    }


def test_image_edits_through_the_real_editor_carry_the_edited_scene_into_the_next_round(tmp_path):
    """The edit stage's judge with the real toy editor (a local procedural data server), a tiny random CLIP and the toy
    checkpoint as A: the lineage gets the job, image and CLIP similarity, and the row the edited scene, so a second
    edit of the edited row (the next round) is accepted by the toy editor, which checks that the meta describes the
    image it edits."""

    torch.manual_seed(0)
    CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=8)).save_pretrained(tmp_path / "clip")  # fmt: skip
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        tmp_path / "clip"
    )
    src = export_split(tmp_path / "toy", "train", 1, seed=0)
    host = SimpleNamespace(device=torch.device("cpu"), rollout_engine=None)
    judge = _RecordingJudge(answer_model=str(TOY), answer_max_new_tokens=8, answer_dtype="fp32", image_share=1.0,
                            image_editor={"output_dir": str(tmp_path / "edits"), "timeout_s": 60},
                            clip_model=str(tmp_path / "clip"))  # fmt: skip
    rows, models = read_jsonl_rows(src), {"question": "Q1", "answer": "A1"}
    try:
        for k, instruction in enumerate(["Add some noise to the background.", "Make the background cream."], 1):
            out = tmp_path / f"round_{k + 1}"
            sample = load_reasoning_sample(read_rows(src)[0])
            q_out = json.dumps({"edit_instruction": instruction})
            info = judge.judge(host, [sample], [q_out])
            score = info["question_scores"][0]
            assert score.valid, score  # round 2's edit needs round 1's edited scene in the row's meta
            ev = {**judge.evidence[f"{sample.sample_id}\x00{instruction}"], "row_id": sample.sample_id}
            rec = lineage_record(k, "image", q_out, score, ev, info["harder"][0], info["base_p_answer"][0], models)
            row = next_row(rows[0], sample, "image", score, ev, rec, out)
            assert (
                Path(ev["edited_image"]).is_file()
                and 0.2 <= ev["clip"] <= 1.0
                and rec["edit_job"] in ev["edited_image"]
            )
            assert row["meta"]["scene"] == ev["scene"]["scene"] != rows[0]["meta"]["scene"]
            rows, src = [row], write_jsonl(out / "dataset.jsonl", [row])
    finally:
        judge._editor.close()
    assert [r["reason"] for r in rows[0]["lineage"]] == ["ok", "ok"]


def test_a_toy_rounds_image_rows_reach_ok_through_the_shipped_toy_editor_and_similarity(tmp_path):
    """The edit stage's judge as the rounds build it from configs/coevolve/tiny.yaml, whose Q config wires the
    procedural toy-math editor and the toy similarity (image_similarity: toy), on D_k = 20 toy rows: the partition
    for round k + 1 takes exactly int(0.1 * 20 + 0.5) = 2 image rows (EvolvedGRPO@2dffc532 build_round_k.sh: seed
    2025 + target_round). Q's image outputs are what the toy math checkpoint's Q learns to write
    (`datamodules.sft_math.edit_instruction_target`, an instruction of the toy grammar that keeps the answer); the
    toy checkpoint is A. Each image row is edited, compared with its source and reaches ``ok``."""

    src = export_split(tmp_path / "toy", "train", 20, seed=0)
    raws, samples = read_jsonl_rows(src), [load_reasoning_sample(r) for r in read_rows(src)]
    args = Rounds(RoundsConfig.from_yaml(write_config(tmp_path)), tmp_path / "run")._judge_args(
        str(TOY), tmp_path / "run/round_3/images"
    )
    assert args["image_similarity"] == "toy" and args["image_editor"]["output_dir"].endswith("round_3/images")
    judge = _RecordingJudge(**{**args, "answer_max_new_tokens": 8, "answer_dtype": "fp32", "partition_round": 3})
    judge.use_rows([s.sample_id for s in samples])  # as build_next_dataset does for D_2 -> D_3
    image = [(s, r) for s, r in zip(samples, raws) if judge.kind_of(s) == "image"]
    assert {s.sample_id for s, _ in image} == split_image_rows([s.sample_id for s in samples], 2028) and len(image) == 2
    rng = np.random.default_rng(0)
    texts = [edit_instruction_target(r["meta"], rng) for _, r in image]
    host, models = SimpleNamespace(device=torch.device("cpu"), rollout_engine=None), {"question": "Q", "answer": "A"}
    try:
        info = judge.judge(host, [s for s, _ in image], texts)
    finally:
        judge._editor.close()
    rows = []
    for (s, raw), text, score, harder in zip(image, texts, info["question_scores"], info["harder"]):
        assert score.gate == "ok" and 0.2 <= score.p_step <= 1.0 and score.label == s.answer, (text, score)
        ev = {**judge.evidence[f"{s.sample_id}\x00{score.output.text}"], "row_id": s.sample_id}
        rec = lineage_record(2, "image", text, score, ev, harder, None, models)
        rows.append(next_row(raw, s, "image", score, ev, rec, tmp_path / "run/round_3"))
        assert rec["clip"] == score.p_step and Path(rec["edited_image"]).is_file()  # the toy similarity's value
    assert edit_stats(rows, 3)["reasons"] == {"ok": 2}


def test_a_run_folder_refuses_another_config_and_a_config_names_its_unknown_key(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "coevolve.yaml").write_text(yaml.safe_dump({"seed": 5}))
    cfg = RoundsConfig.from_yaml(write_config(tmp_path))
    with pytest.raises(RoundsError, match="started with another config"):
        Rounds(cfg, out).run()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(write_config(tmp_path).read_text()), "round": 2}))
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(bad), "--out", str(tmp_path / "run2")])
    assert exc.value.code == 2 and "unknown key(s) ['round']" in capsys.readouterr().err


def test_shipped_rounds_configs_read():
    paths = sorted((REPO / "configs/coevolve").glob("*.yaml")) + sorted((REPO / "experiments/coevolve").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:  # the product's rounds configs and the studies' (experiments/coevolve/)
        cfg = RoundsConfig.from_yaml(path)
        assert cfg.rounds >= 1 and Path(cfg.answer_config).is_file() and Path(cfg.question_config).is_file()


@pytest.mark.slow
def test_killed_mid_fit_in_a_subprocess_resumes_to_the_uninterrupted_result(tmp_path):
    """The command in a process of its own, train.py in processes of their own (launcher subprocess), killed in A's
    fit of round 1 after its first step, then in D_2's build; started again, it finishes with the datasets and metrics
    of an uninterrupted (in-process) run, and the stages finished before a kill were not run again. The weights move
    (`LEARNING`): the resumed A_1 and Q_1 are the uninterrupted run's, bit for bit (the fit resumes from last.ckpt
    with its RNG state)."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli.coevolve", "--config", str(write_learning_config(run_dir, launcher="subprocess"))]
    cmd += ["--out", str(run_dir / "out")]
    for stop in ("round_1/answer_fit:step2", "round_1/edit:rows2"):
        proc = subprocess.run(cmd, cwd=REPO, env={**env, STOP_ENV: stop}, capture_output=True, text=True)
        assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        if stop.endswith("step2"):
            assert (run_dir / "out/round_1/answer/checkpoints/last.ckpt").is_file()
            assert not (run_dir / "out/round_1/answer/final.ckpt").exists()
        before = stages(run_dir / "out")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = stages(run_dir / "out")
    fit = after["round_1/answer_fit"]
    assert len(fit["starts"]) == 2 and fit["result"]["resumed_from"].endswith("last.ckpt")
    for s in STAGES[:-1]:
        assert after[f"round_1/{s}"] == before[f"round_1/{s}"], s
    main(["--config", str(write_learning_config(ref_dir)), "--out", str(ref_dir / "out")])

    w0 = load_file(TOY / "model.safetensors")
    for role in ("answer", "question"):
        ours, ref = (load_file(d / "out/round_1" / role / "hf/model.safetensors") for d in (run_dir, ref_dir))
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref), role
        assert any(not torch.equal(ref[k], w0[k]) for k in w0 if k in ref), role  # and they moved
    for name in ("round_1/dataset.jsonl", "round_2/dataset.jsonl"):
        ours, ref = read_jsonl_rows(run_dir / "out" / name), read_jsonl_rows(ref_dir / "out" / name)
        strip = lambda rows, root: json.loads(json.dumps(rows).replace(str(root), "<tmp>"))  # noqa: E731
        assert strip(ours, run_dir) == strip(ref, ref_dir), name
    m = [json.loads((d / "out/round_1/metrics.json").read_text()) for d in (run_dir, ref_dir)]
    assert m[0]["answer_eval"] == m[1]["answer_eval"] and m[0]["question_edits"] == m[1]["question_edits"]


@pytest.mark.slow
def test_a_round_with_fsdp2_fits_exports_a_sharded_final_checkpoint(tmp_path, monkeypatch):
    """The paper configs' strategy (FSDP2, here on one CPU process): the final checkpoint is a distributed checkpoint
    folder, the export reads it, A's evaluation gathers the sharded policy."""
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    for key in ("answer_args", "question_args"):
        cfg[key].update({"trainer.strategy": "fsdp2", "trainer.precision": "32-true"})
    config.write_text(yaml.safe_dump(cfg))
    main(["--config", str(config), "--out", str(tmp_path / "run")])
    r1 = tmp_path / "run/round_1"
    assert (r1 / "answer/final.ckpt/meta.pt").is_file() and (r1 / "question/final.ckpt/meta.pt").is_file()
    assert (r1 / "answer/hf/model.safetensors").is_file()
    assert json.loads((r1 / "metrics.json").read_text())["question_edits"]["rows"] == 4


@pytest.mark.slow
def test_the_plain_baseline_trains_the_answer_model_on_d1_every_round_and_no_question_generator(tmp_path, monkeypatch):
    """``mode: plain`` (the study's baseline, the same answer-model updates): A_k continues A_{k-1} on D_1 each round;
    no Q stage runs and no dataset is edited."""
    monkeypatch.chdir(tmp_path)
    config, out = write_config(tmp_path, rounds=2, mode="plain"), tmp_path / "run"
    summary = main(["--config", str(config), "--out", str(out)])
    st = stages(out)
    assert sorted(st) == sorted(["round_1/dataset"] + [f"round_{k}/{s}" for k in (1, 2) for s in STAGES[:3]])
    assert summary["mode"] == "plain" and summary["question_model"] is None and summary["final_dataset"] is None
    assert [r["round"] for r in summary["per_round"]] == [1, 2] and summary["per_round"][0]["valid_edit_rate"] is None
    assert all(r["answer_eval"] for r in summary["per_round"]) and not (out / "round_2" / "dataset.jsonl").exists()
    round_2 = json.loads((out / "round_2" / "metrics.json").read_text())
    assert round_2["dataset"].endswith("round_1/dataset.jsonl")
    assert round_2["answer_model"] != json.loads((out / "round_1" / "metrics.json").read_text())["answer_model"]
    with pytest.raises(RoundsError, match="mode must be coevolve or plain"):
        RoundsConfig.from_yaml(write_config(tmp_path, mode="nope"))
