"""The video grounding data module: the toy video world exported, read back as `VideoSample`s, no-target clips kept
out of CycleGRPO's training set, defects named with their file and line."""

from __future__ import annotations

import json

import pytest

from core.records import DataError
from core.regions import NO_TARGET
from datamodules.toy_video import make_clip
from datamodules.video import ToyVideoSpec, VideoGroundingDataModule, read_video_jsonl


def test_toy_video_world_through_the_data_module(tmp_path):
    dm = VideoGroundingDataModule(
        data_root=str(tmp_path),
        train_files=["train_video.jsonl"],
        val_files={"toy_video_val": "val_video.jsonl"},
        batch_size=2,
        toy=ToyVideoSpec(splits={"train": 12, "val": 12}),
    )
    dm.prepare_data()
    dm.setup("fit")
    train = [dm.train_set[i] for i in range(len(dm.train_set))]
    val = [dm.eval_sets["val"]["toy_video_val"][i] for i in range(12)]
    assert len(train) == 12 and not all(s.intervals for s in train)  # no-target queries train (grounding groups)
    only = VideoGroundingDataModule(
        data_root=str(tmp_path), train_files=["train_video.jsonl"], toy=None, train_no_target=False
    )
    only.setup("fit")  # the clips with a target alone (how the earlier studies trained)
    assert len(only.train_set) == sum(bool(make_clip("train", i, 0)["solution"]) for i in range(12))
    assert all(r.raw["solution"] for r in only.train_set.records)
    nt = [s for s in val if not s.intervals]
    assert nt and all(s.region("interval") is NO_TARGET and s.region("anchor") is NO_TARGET for s in nt)
    s, clip = val[0], make_clip("val", 0, 0)
    assert s.query == clip["meta"]["query"] and s.duration == 8.0 and s.size == (112, 112)
    assert s.region("interval") == tuple(tuple(x) for x in clip["solution"]) or not clip["solution"]
    assert len(s.clip.frames) == 16 and s.clip.fps == 2.0 and s.image is s.clip
    assert len(next(iter(dm.train_dataloader()))) == 2


def test_defects_name_file_and_line(tmp_path):
    path = tmp_path / "bad_video.jsonl"
    path.write_text(json.dumps({"video": "x.npz", "solution": []}) + "\n")
    with pytest.raises(DataError, match=r"bad_video.jsonl:1: missing \['fps', 'conversations'\]"):
        read_video_jsonl(path)
    with pytest.raises(DataError, match="no such data file"):
        read_video_jsonl(tmp_path / "none.jsonl")
