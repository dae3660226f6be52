"""REC / OVD JSONL reader: VLM-R1's format loads; every defect names the file and line."""

from __future__ import annotations

import json

import pytest
from conftest import write_rec_jsonl

from core.records import DataError
from datamodules.rec import RECDataModule, collate_samples, load_sample, read_jsonl


def test_reads_vlm_r1_lines_with_images(tmp_path):
    path = write_rec_jsonl(tmp_path, 3)
    recs = read_jsonl(path)
    assert [r.sample_id for r in recs] == ["s0", "s1", "s2"]
    s = load_sample(recs[0])
    assert s.query == "the red rectangle" and s.task == "rec"
    assert s.boxes == [[8.0, 10.0, 48.0, 40.0]] and s.size == (112, 112)
    assert collate_samples([s, s]) == [s, s]


def _write(tmp_path, obj_or_text) -> str:
    p = tmp_path / "bad.jsonl"
    good = {
        "id": "a",
        "image": "images/0.png",
        "solution": [1, 1, 5, 5],
        "conversations": [{"from": "human", "value": "<image>x"}],
    }
    line = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    p.write_text(json.dumps(good) + "\n" + line + "\n")
    return str(p)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ({"image": "images/0.png", "conversations": [{"from": "human", "value": "x"}]}, "missing 'solution'"),
        ({"solution": [1, 1, 5, 5], "conversations": [{"from": "human", "value": "x"}]}, "missing 'image'"),
        ({"image": "i.png", "solution": [5, 5, 5, 9], "conversations": [{"from": "human", "value": "x"}]}, "empty box"),
        ({"image": "i.png", "solution": [1, 2, 3], "conversations": [{"from": "human", "value": "x"}]}, "4 numbers"),
        ({"image": "i.png", "solution": [1, 1, 5, 5]}, "no query"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, bad)
    with pytest.raises(DataError, match=message) as exc:
        read_jsonl(path)
    assert f"{path}:2" in str(exc.value)


def test_missing_image_and_out_of_image_box(tmp_path):
    write_rec_jsonl(tmp_path, 1)
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"image": "images/nope.png", "solution": [1, 1, 5, 5], "problem": "x"}) + "\n"
    )
    with pytest.raises(DataError, match="not found.*--data.image_root"):
        load_sample(read_jsonl(tmp_path / "m.jsonl")[0])
    (tmp_path / "o.jsonl").write_text(
        json.dumps({"image": "images/0.png", "solution": [10, 10, 500, 50], "problem": "x"}) + "\n"
    )
    with pytest.raises(DataError, match=r"o.jsonl:1.*outside the 112x112 image"):
        load_sample(read_jsonl(tmp_path / "o.jsonl")[0])


def test_ovd_solution_is_a_list_of_boxes(tmp_path):
    write_rec_jsonl(tmp_path, 1)
    (tmp_path / "ovd.jsonl").write_text(
        json.dumps(
            {
                "image": "images/0.png",
                "solution": [[1, 1, 5, 5], {"bbox_2d": [6, 6, 9, 9]}],
                "problem": "every red",
                "task": "ovd",
            }
        )
        + "\n"
    )
    s = load_sample(read_jsonl(tmp_path / "ovd.jsonl")[0])
    assert s.task == "ovd" and s.boxes == [[1, 1, 5, 5], [6, 6, 9, 9]]


def test_datamodule_named_eval_sets(rec_dir):
    dm = RECDataModule(data_root=str(rec_dir), train_files=["train.jsonl"], val_files={"a": "val.jsonl"}, batch_size=3)
    dm.setup("fit")
    assert len(dm.train_set) == 8 and dm.eval_names("val") == ["a"]
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 3 and batch[0].image.mode == "RGB"
    with pytest.raises(DataError, match="no such data file"):
        RECDataModule(data_root=str(rec_dir), train_files=["missing.jsonl"]).setup("fit")


def test_toy_mix_without_rendered_train_split_is_refused(tmp_path):
    """The exported train.jsonl is one split: a mix (or evolve) there would be ignored, so the data module says so."""
    from datamodules.rec import ToySpec

    with pytest.raises(DataError, match="render_train=true"):
        RECDataModule(data_root=str(tmp_path), toy=ToySpec(splits={"train": 8}, mix={"crowded": 0.5}))
    with pytest.raises(DataError, match="toy.evolve"):
        RECDataModule(data_root=str(tmp_path), toy=ToySpec(splits={"train": 8}, evolve=0.5))
    RECDataModule(data_root=str(tmp_path), toy=ToySpec(splits={"train": 8}, mix={"crowded": 0.5}, render_train=True))
