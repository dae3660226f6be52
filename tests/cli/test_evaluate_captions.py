"""``python -m cli.evaluate dlc-bench``: a tiny DLC-Bench folder written here (2 images, 3 regions, a few questions),
the scores worked by hand from hand-written captions and a scripted judge (tests/judge_server.py), the toy checkpoint
end to end with an untrained tiny mask tokenizer and the product's toy judge server, and the judge's failure policies
(cli/evaluate_captions.py, evals/dlc_bench.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cli.evaluate import main  # noqa: E402
from core.regions.coco_masks import rle_encode  # noqa: E402
from evals.dlc_bench import parse_choice, read_dlc_bench, recognition_question  # noqa: E402
from tests.cli.test_evaluate import TOY, tiny_mask_tokenizer  # noqa: E402
from tests.judge_server import free_port, running_judge_server, running_toy_judge  # noqa: E402

# key -> (class name, questions); choices are [text, score] as in qa.json
QA = {
    "101": ("cat", [
        ("What colour is the cat?", [["black", 1], ["white", 0]], "positive"),
        ("What does it wear?", [["a red collar", 1], ["a hat", -1]], "positive"),
        ("Is it sleeping?", [["yes, sleeping", -1], ["not mentioned", 1]], "negative"),
    ]),
    "102": ("apple", [
        ("What colour is it?", [["green", 1], ["red", 0]], "positive"),
        ("Is it described as green?", [["green", -1], ["not green", 0]], "negative"),
    ]),
    "201": ("cups", [
        ("What colour are they?", [["white", 1], ["black", 0]], "positive"),
        ("How many are there?", [["three", 1], ["two", 0.5]], "positive"),
    ]),
}  # fmt: skip
CAPTIONS = {"101": "a black cat with a red collar", "102": "a green pear", "201": "two white cups"}


def write_dlc_fixture(root: Path) -> Path:
    """DLC-Bench's annotations folder in miniature: annotations.json (COCO: a polygon and an RLE region on one image,
    a polygon on the other), qa.json, class_names.json and images/."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {1: (32, 24), 2: (40, 30)}
    for i, (w, h) in sizes.items():
        (root / "images").mkdir(exist_ok=True)
        arr = np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / "images" / f"img{i}.jpg")
    rle_mask = np.zeros((24, 32), dtype=bool)
    rle_mask[12:20, 16:28] = True
    rle = rle_encode(rle_mask)
    anns = [
        {"id": 101, "image_id": 1, "segmentation": [[2, 2, 12, 2, 12, 10, 2, 10]], "category_id": 1},
        {"id": 102, "image_id": 1, "segmentation": rle, "category_id": 1},
        {"id": 201, "image_id": 2, "segmentation": [[5, 5, 30, 5, 30, 25, 5, 25]], "category_id": 1},
    ]
    images = [{"id": i, "file_name": f"img{i}.jpg", "width": w, "height": h} for i, (w, h) in sizes.items()]
    coco = {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "object"}]}
    (root / "annotations.json").write_text(json.dumps(coco))
    qa = {k: [{"question": q, "choices": c, "type": t} for q, c, t in qs] for k, (_, qs) in QA.items()}
    (root / "qa.json").write_text(json.dumps(qa))
    (root / "class_names.json").write_text(json.dumps({k: name for k, (name, _) in QA.items()}))
    return root


def scripted_judge(prompt: str) -> str:
    """A rule-based text-only judge: recognition is Yes when the class name is in the description; a question is
    answered with the first choice whose text is in the description, else an unreadable reply."""
    description = prompt.split("The description is:\n")[1].split("\n\nFrom the description")[0]
    lines = prompt.split("one of the choices:\n")[1].split("\n")
    question, choices = lines[0], [re.sub(r"^[A-E]\. ", "", line) for line in lines[1:]]
    if question.startswith("Is it likely"):
        name = re.search(r"(?:is an? |are )(.+?) or ", question).group(1)
        return "Yes" if name in description else "No"
    return next((c for c in choices if c in description), "I cannot tell")


@pytest.fixture(scope="module")
def dlc(tmp_path_factory):
    root = tmp_path_factory.mktemp("dlc")
    return {"data": write_dlc_fixture(root / "annotations"), "tok": tiny_mask_tokenizer(root / "tok")}


@pytest.fixture(scope="module")
def judge():
    with running_judge_server(script=scripted_judge) as server:
        yield server


def test_parse_choice_follows_the_release_rules():
    bw = ["black", "white"]
    assert parse_choice("black", bw) == 0 and parse_choice("B", bw) == 1 and parse_choice("b. white", bw) == 1
    assert parse_choice("The answer is black.", bw) == 0  # one choice inside the reply
    assert parse_choice("black and white", bw) == 1  # several: the one that starts last
    assert parse_choice("A.", ["x", "y"]) == 0 and parse_choice("whi", bw) == 1  # a letter; inside a choice
    assert parse_choice("nothing", bw) is None and parse_choice(None, bw) is None
    assert "are cups or objects" in recognition_question("cups")["question"]  # plural
    assert "is an apple or an object" in recognition_question("apple")["question"]


def test_scores_by_hand_from_the_release_cache(dlc, judge, tmp_path, capsys):
    cache = tmp_path / "release_cache.json"  # the release's model_outputs/<name>.json: {annotation id: caption}
    cache.write_text(json.dumps(CAPTIONS))
    out = tmp_path / "dlc.json"
    flags = ["--data", str(dlc["data"]), "--judge-url", judge.url + "/scripted/v1", "--batch-size", "2"]
    assert main(["dlc-bench", *flags, "--predictions", str(cache), "--out", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    # 101: recognised; black 1, a red collar 1; sleeping: unreadable -> 0      pos 1,   neg 0
    # 102: "a green pear" is not an apple -> scores capped at 0: green 1 -> 0; negative green -1 stays -1
    #                                                                         pos 0,   neg -1
    # 201: recognised (plural); white 1, two 0.5; no negatives                 pos 0.75, neg None
    assert m["pos"] == pytest.approx((1 + 0 + 0.75) / 3) and m["neg"] == pytest.approx(-0.5)
    assert m["avg"] == pytest.approx(((1 + 0 + 0.75) / 3 - 0.5) / 2)
    assert (m["regions"], m["regions_with_negatives"], m["recognition_wrong"], m["judge_failures"]) == (3, 2, 1, 0)
    rows = [json.loads(line) for line in (tmp_path / "dlc.predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["101", "102", "201"] and rows[1]["recognition"]["reply"] == "No"
    assert "pos 0.583, neg -0.500" in capsys.readouterr().out
    # our own predictions file judged again: the same captions, the same scores
    again = tmp_path / "again.json"
    preds = tmp_path / "dlc.predictions.jsonl"
    assert main(["dlc-bench", *flags, "--predictions", str(preds), "--out", str(again)]) == 0
    assert json.loads(again.read_text())["metrics"] == m


def test_toy_policy_and_toy_judge_end_to_end(dlc, tmp_path):
    out = tmp_path / "dlc.json"
    with running_toy_judge(max_tokens=4) as url:
        code = main([
            "dlc-bench", "--data", str(dlc["data"]), "--policy", TOY, "--mask-tokenizer", str(dlc["tok"]),
            "--judge-url", url, "--judge-max-tokens", "4", "--max-new-tokens", "8", "--batch-size", "3",
            "--device", "cpu", "--out", str(out),
        ])  # fmt: skip
    assert code == 0
    res = json.loads(out.read_text())
    m = res["metrics"]
    assert res["n"] == 3 and m["regions"] == 3 and m["judge_failures"] == 0  # the toy judge answered every question
    assert -1.0 <= m["pos"] <= 1.0 and -1.0 <= m["neg"] <= 1.0  # whatever the toy says: a number, never a crash
    rows = [json.loads(line) for line in Path(res["predictions"]).read_text().splitlines()]
    assert all(len(r["codes"]) == 2 and isinstance(r["caption"], str) for r in rows)  # one mask-token span each
    assert [len(r["questions"]) for r in rows] == [3, 2, 2]


def test_down_judge_value_scores_zero_and_raise_exits_4_with_one_line(dlc, tmp_path, capsys):
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps(CAPTIONS))
    down = f"http://127.0.0.1:{free_port()}/v1"  # bound, then closed: connection refused
    flags = ["--data", str(dlc["data"]), "--predictions", str(cache), "--judge-url", down, "--judge-timeout", "0.5"]
    assert main(["dlc-bench", *flags, "--out", str(tmp_path / "v.json")]) == 0
    m = json.loads((tmp_path / "v.json").read_text())["metrics"]
    assert m["judge_failures"] == 10 and m["recognition_unread"] == 3 and (m["pos"], m["neg"]) == (0.0, 0.0)
    capsys.readouterr()  # the value run's progress lines
    with pytest.raises(SystemExit) as info:
        main(["dlc-bench", *flags, "--judge-on-failure", "raise", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 4 and "\n" not in err and "--judge-on-failure value" in err


def test_data_defects_name_the_file_and_key(dlc, tmp_path, capsys):
    bad = write_dlc_fixture(tmp_path / "bad")
    qa = json.loads((bad / "qa.json").read_text())
    qa["999"] = qa["101"]
    (bad / "qa.json").write_text(json.dumps(qa))
    with pytest.raises(SystemExit) as info:
        main(["dlc-bench", "--data", str(bad), "--predictions", "x.json", "--judge-url", "http://x/v1", "--out", "o"])
    assert info.value.code == 3 and "qa.json key 999: no annotation" in capsys.readouterr().err
    assert [r.key for r in read_dlc_bench(dlc["data"], max_samples=2)] == ["101", "102"]
    with pytest.raises(SystemExit) as info:
        main(["dlc-bench", "--data", str(dlc["data"]), "--predictions", "x.json", "--out", "o"])
    assert info.value.code == 2 and "--judge-url" in capsys.readouterr().err
