"""The paper's REC data (after VLM-R1): RefCOCO, RefCOCO+ and RefCOCOg training files together, a seeded random draw
over their union, the drawn ids written to the run folder; and the max_pixels cap on extended canvases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
from PIL import Image

from core.records import DataError
from datamodules.rec import RECDataModule, load_sample, read_jsonl
from datamodules.synthetic import SyntheticDataModule

FIXTURES = Path(__file__).parents[1] / "data" / "vlmr1_rec"
FILES = ["refcoco_train.jsonl", "refcocop_train.jsonl", "refcocog_train.jsonl"]


def _drawn(seed: int, n: int = 9) -> list[str]:
    dm = RECDataModule(data_root=str(FIXTURES), train_files=FILES, max_train_samples=n, seed=seed)
    dm.setup("fit")
    return [r.sample_id for r in dm.train_records()]


def test_the_union_is_drawn_with_the_seed_and_every_file_contributes():
    a, b, c = _drawn(0), _drawn(0), _drawn(1)
    assert a == b and len(a) == 9 == len(set(a))
    assert set(a) != set(c)
    for seed in range(5):  # 9 of 18 lines: every file is in the draw
        ids = _drawn(seed)
        assert {i.split("-")[0].split(":")[0] for i in ids if not i.endswith("shared-0")} <= {
            "refcoco",
            "refcoco+",
            "refcocog",
        }
    everything = _drawn(0, n=100)  # no cap reached: the whole union, 18 ids, unique though two files repeat one
    assert len(everything) == 18 == len(set(everything))
    assert {"shared-0", "refcocop_train:shared-0", "refcocog_train:shared-0"} <= set(everything)
    prefixes = {i.split("-")[0] for i in _drawn(3)}
    assert {"refcoco", "refcoco+", "refcocog"} <= prefixes


def test_an_example_in_two_files_is_read_once(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(FIXTURES / FILES[0], tmp_path / name)
    dm = RECDataModule(data_root=str(tmp_path), train_files=["a.jsonl", "b.jsonl"])
    dm.setup("fit")
    assert [r.sample_id for r in dm.train_records()] == [r.sample_id for r in read_jsonl(FIXTURES / FILES[0])]


def test_the_drawn_ids_are_written_to_the_run_folder(tmp_path):
    dm = SyntheticDataModule(data_root=str(FIXTURES), train_files=FILES, max_train_samples=9, seed=7)
    dm.trainer = L.Trainer(default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False)
    dm.setup("fit")
    doc = json.loads((tmp_path / "data" / "train_sample_ids.json").read_text())
    assert doc["ids"] == [r.sample_id for r in dm.train_records()] and doc["seed"] == 7 and doc["num_samples"] == 9
    assert list(doc["per_file"]) == FILES
    assert sum(v["count"] for v in doc["per_file"].values()) == 9
    assert all(v["count"] > 0 for v in doc["per_file"].values())
    assert len(dm.pool) == 9  # the pool accepts the union (ids unique)


def test_max_pixels_downscales_large_images_and_their_boxes(tmp_path):
    Image.new("RGB", (1920, 1440), "white").save(tmp_path / "big.png")
    Image.new("RGB", (640, 480), "white").save(tmp_path / "small.png")
    lines = [
        {"id": "big", "image": "big.png", "problem": "the box", "solution": [192, 144, 960, 720]},
        {"id": "small", "image": "small.png", "problem": "the box", "solution": [64, 48, 320, 240]},
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    big, small = read_jsonl(tmp_path / "t.jsonl")
    cap = 1280 * 28 * 28
    s = load_sample(big, cap)
    assert s.image.width * s.image.height <= cap and s.image.width / s.image.height == pytest.approx(4 / 3, rel=0.01)
    assert s.boxes[0] == pytest.approx(
        [0.1 * s.image.width, 0.1 * s.image.height, 0.5 * s.image.width, 0.5 * s.image.height]
    )
    t = load_sample(small, cap)  # under the cap: untouched
    assert t.image.size == (640, 480) and t.boxes == [[64, 48, 320, 240]]
    with pytest.raises(DataError, match="max_pixels"):
        RECDataModule(max_pixels=100)
