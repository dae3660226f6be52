"""D3's converter: the release layout (tests/data/d3: d3_images/ and d3_pkl/ as the archives extract) -> the OVD JSONL
that configs/ovd_3b.yaml reads; every defect is one error naming the file and what to do."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from core.records import DataError
from datamodules.d3 import convert, main, ovd_row_question
from datamodules.rec import load_sample, read_jsonl
from datamodules.synthetic import SyntheticDataModule

D3 = Path(__file__).parents[1] / "data" / "d3"
IMAGES, PKL = D3 / "d3_images", D3 / "d3_pkl"


def test_release_converts_to_jsonl_the_ovd_config_reads(tmp_path):
    counts = convert(IMAGES, PKL, tmp_path)
    # 5 images x their group's descriptions = 13 pairs; 7 have a box (tests/data/d3/make_fixture.py), 6 are negatives
    assert counts == {
        "images": 5, "lines": 7, "boxes": 8, "negatives": 6, "clipped": 1, "dropped": 0,
        "splits": {"train": 5, "val": 1, "test": 1},
    }  # fmt: skip
    # configs/ovd_3b.yaml's data section: data_root the converter's folder, image_root D3's images
    dm = SyntheticDataModule(
        data_root=str(tmp_path),
        image_root=str(IMAGES),
        train_files=["d3_train.jsonl"],
        val_files={"d3_val": "d3_val.jsonl"},
        test_files={"d3_test": "d3_test.jsonl"},
    )
    dm.setup(None)
    samples = {s.sample_id: s for s in dm.train_samples()}
    for kind, name in (("val", "d3_val"), ("test", "d3_test")):
        samples.update({s.sample_id: s for s in dm.eval_sets[kind][name]})
    assert sorted(samples) == ["d3-10-1", "d3-10-2", "d3-11-2", "d3-12-3", "d3-20-4", "d3-20-5", "d3-21-4"]
    dogs = samples["d3-10-1"]
    assert dogs.task == "ovd" and dogs.size == (64, 48)
    assert dogs.boxes == [[4.0, 10.0, 24.0, 40.0], [40.0, 30.0, 64.0, 48.0]]  # [[x, y, w, h]] -> xyxy, both dogs
    assert dogs.query == ovd_row_question(["a dog not being held by a leash"])  # the row's question, <image> removed
    assert dogs.meta["absence"] is True and dogs.meta["group"] == "outdoor dog"
    assert samples["d3-12-3"].boxes == [[50.0, 20.0, 64.0, 30.0]]  # 6 px past the edge: cut to the image
    assert samples["d3-20-5"].query.startswith("Please carefully check the image and detect the following objects: "
                                               "[\"equestrian rider's helmet\"]. Output the bbox")  # fmt: skip


def test_split_keeps_each_image_in_one_split_and_is_seeded(tmp_path):
    def split_of(out, seed):
        convert(IMAGES, PKL, out, val=0.34, test=0.34, seed=seed)
        return {s: {r.image_path.name for r in read_jsonl(out / f"d3_{s}.jsonl", IMAGES)}
                if (out / f"d3_{s}.jsonl").read_text() else set() for s in ("train", "val", "test")}  # fmt: skip

    a, b = split_of(tmp_path / "a", 0), split_of(tmp_path / "b", 0)
    assert a == b and not (a["train"] & a["val"]) and not (a["train"] & a["test"]) and not (a["val"] & a["test"])
    # the 3-image group gives one image to each split; the 2-image group stays in train
    assert {"001_20.jpg", "002_21.jpg"} <= a["train"] and len(a["val"]) == len(a["test"]) == 1


def test_a_perfect_answer_earns_the_full_ovd_reward(tmp_path):
    from core.rewards import ovd_reward

    convert(IMAGES, PKL, tmp_path)
    row = json.loads(next(x for x in (tmp_path / "d3_train.jsonl").read_text().splitlines() if '"d3-10-1"' in x))
    gt = load_sample(next(r for r in read_jsonl(tmp_path / "d3_train.jsonl", IMAGES) if r.sample_id == "d3-10-1")).boxes
    vlm_r1_answer = "<think>two dogs</think><answer>" + row["conversations"][1]["value"] + "</answer>"  # bbox_2d JSON
    assert ovd_reward([vlm_r1_answer, f"<answer>{json.dumps(gt)}</answer>"], [gt] * 2) == pytest.approx([1.0, 1.0])


def _copy(tmp_path) -> tuple[Path, Path]:
    shutil.copytree(D3, tmp_path / "d3", ignore=shutil.ignore_patterns("*.py"))
    return tmp_path / "d3" / "d3_images", tmp_path / "d3" / "d3_pkl"


def _edit(pkl: Path, name: str, fn) -> Path:
    path = pkl / name
    path.write_bytes(pickle.dumps(fn(pickle.loads(path.read_bytes()))))
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


class _Foreign:  # a class no D3 pickle holds
    pass


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda im, pk: (pk / "groups.pkl").unlink() or pk / "groups.pkl", "missing; D3_PKL must be the folder"),
        (lambda im, pk: (im / "equestrian/002_21.jpg").unlink() or im / "equestrian/002_21.jpg", "missing (image 21"),
        (lambda im, pk: _edit(pk, "images.pkl", lambda d: list(d.values())), "expected a dict of id -> record"),
        (
            lambda im, pk: _edit(pk, "annotations.pkl", lambda d: {**d, 104: {**d[104], "bbox": [1, 2]}}),
            "'bbox' [1, 2]",
        ),
        (lambda im, pk: _edit(pk, "sentences.pkl", lambda d: {**d, 1: {"id": 1}}), "record 1 has no 'raw_sent'"),
        (lambda im, pk: _edit(pk, "groups.pkl", lambda d: {**d, 1: {**d[1], "inner_sent_id": [1, 9]}}), "sentence 9"),
        (lambda im, pk: _edit(pk, "annotations.pkl", lambda d: {**d, 100: _Foreign()}), "holds a pickled"),
        (lambda im, pk: _write(pk / "images.pkl", b"{not a pickle"), "not a readable pickle"),
    ],
)
def test_bad_release_gives_one_error_naming_the_file(tmp_path, damage, message):
    images, pkl = _copy(tmp_path)
    bad = damage(images, pkl)
    with pytest.raises(DataError) as err:
        convert(images, pkl, tmp_path / "out")
    assert str(bad) in str(err.value) and message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing is written from a release with a defect


def test_cli_converts_and_reports_a_wrong_folder_in_one_line(tmp_path, capsys):
    assert main([str(IMAGES), str(PKL), str(tmp_path / "out")]) == 0
    assert "7 samples (5 train, 1 val, 1 test), 8 boxes from 5 images" in capsys.readouterr().out
    assert main([str(IMAGES), str(D3 / "d3_json"), str(tmp_path / "x")]) == 2  # the evaluation JSON's folder
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "d3_json: no such folder; pass the folder d3_pkl.zip extracts to" in err


def test_trust_pickles_builds_what_the_allow_list_refuses(tmp_path):
    images, pkl = _copy(tmp_path)
    _edit(pkl, "annotations.pkl", lambda d: {**d, 100: _Foreign()})
    with pytest.raises(DataError, match="--trust-pickles"):
        convert(images, pkl, tmp_path / "out")
    with pytest.raises(DataError, match="expected a dict of id -> record"):  # built, then refused as a record
        convert(images, pkl, tmp_path / "out", trust_pickles=True)
