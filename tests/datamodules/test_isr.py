"""ISR's converter: rendered 3D-FRONT views (image + box JSON) -> OVD JSONL the project's reader loads; every defect
names the view file and what to fix."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from core.records import DataError
from datamodules.d3 import ovd_row_question
from datamodules.isr import convert, main, normalise_category
from datamodules.rec import RECDataModule, load_sample, read_jsonl

# two rendered views of one scene and one of another, as a render pipeline leaves them (sub-folders per scene)
VIEWS = {
    "scene_a/0000": {
        "scene": "a",
        "room": "LivingRoom-1",
        "view": 0,
        "objects": [
            {"category": "Dining_Chair", "bbox": [10, 20, 30, 50], "instance": 3},
            {"category": "dining chair", "bbox": [40, 22, 58, 50], "instance": 4},
            {"category": "Coffee Table", "bbox": [5, 60, 70, 79], "model_id": "jid-1", "visible_fraction": 0.9},
            {"category": "lamp", "bbox": [78, 0, 80, 10]},  # a 2-px sliver at the frame's edge
        ],
    },
    "scene_a/0001": {"width": 96, "height": 80, "objects": [{"category": "sofa", "bbox": [0, 0, 96, 80]}]},
    "scene_b/0000": {"objects": [{"category": "bed", "bbox": [12.5, 8.25, 60, 70]}]},
}


def _render(root, views=VIEWS, size=(96, 80), suffix=".png"):
    for stem, obj in views.items():
        path = root / stem
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (120, 100, 80)).save(path.with_suffix(suffix))
        path.with_suffix(".json").write_text(json.dumps(obj))
    return root


def test_converted_jsonl_loads_through_the_ovd_reader_with_the_right_boxes_and_categories(tmp_path):
    root = _render(tmp_path / "renders")
    out = tmp_path / "isr_train.jsonl"
    counts = convert(root, out)
    # scene_a/0000 gives "dining chair" (2 boxes) and "coffee table"; the lamp sliver (2 px wide) is left out
    assert counts == {"views": 3, "lines": 4, "boxes": 5, "dropped_small": 1, "empty_views": 0}
    samples = {s.sample_id: s for s in (load_sample(r) for r in read_jsonl(out, image_root=root))}
    assert sorted(samples) == [
        "isr-scene_a-0000-coffee_table",
        "isr-scene_a-0000-dining_chair",
        "isr-scene_a-0001-sofa",
        "isr-scene_b-0000-bed",
    ]
    chairs = samples["isr-scene_a-0000-dining_chair"]
    assert chairs.task == "ovd" and chairs.query == ovd_row_question(["dining chair"])  # VLM-R1's question, as D3's
    assert chairs.boxes == [[10.0, 20.0, 30.0, 50.0], [40.0, 22.0, 58.0, 50.0]]  # both instances, one query
    assert chairs.size == (96, 80) and chairs.image_path == str(root / "scene_a/0000.png")
    assert chairs.meta["room"] == "LivingRoom-1" and chairs.meta["categories"] == ["dining chair"]
    assert samples["isr-scene_b-0000-bed"].boxes == [[12.5, 8.25, 60.0, 70.0]]
    assert samples["isr-scene_a-0001-sofa"].boxes == [[0.0, 0.0, 96.0, 80.0]]  # a box up to the frame's edge is in


def test_a_perfect_answer_to_a_converted_sample_earns_the_full_ovd_reward(tmp_path):
    from core.rewards import ovd_reward

    root = _render(tmp_path / "renders")
    convert(root, tmp_path / "isr.jsonl")
    chairs = next(r for r in read_jsonl(tmp_path / "isr.jsonl", root) if r.meta["categories"] == ["dining chair"])
    perfect = f"<answer>{json.dumps(chairs.boxes)}</answer>"
    extra = f"<answer>{json.dumps([*chairs.boxes, [5, 60, 70, 79]])}</answer>"  # the table boxed too
    # both chairs exactly: mAP 1, s_ovd 1; one box too many: s_ovd = 2/3 (the table is not what was asked)
    assert ovd_reward([perfect, extra], [chairs.boxes] * 2) == pytest.approx([1.0, 2 / 3])


def test_splits_share_one_image_root(tmp_path, monkeypatch):
    renders = tmp_path / "renders"
    _render(renders / "train", {"s1/0000": VIEWS["scene_b/0000"]})
    _render(renders / "val", {"s2/0000": VIEWS["scene_b/0000"]})
    for split in ("train", "val"):
        convert(renders / split, tmp_path / f"isr_{split}.jsonl", image_root=renders)
    dm = RECDataModule(data_root=str(tmp_path), image_root=str(renders), train_files=["isr_train.jsonl"])
    dm.val_files = {"isr_val": "isr_val.jsonl"}
    dm.setup("fit")
    assert [s.image_path for s in dm.train_samples()] == [str(renders / "train/s1/0000.png")]
    assert dm.eval_sets["val"]["isr_val"][0].sample_id == "isr-val-s2-0000-bed"
    monkeypatch.chdir(tmp_path)  # a relative render folder under an absolute image root
    convert("renders/train", tmp_path / "rel.jsonl", image_root=renders)
    assert (tmp_path / "rel.jsonl").read_text() == (tmp_path / "isr_train.jsonl").read_text()
    with pytest.raises(DataError, match="lies outside the image root"):
        convert(renders / "train", tmp_path / "x.jsonl", image_root=renders / "val")


def test_group_view_writes_one_line_per_view_listing_its_categories(tmp_path):
    root = _render(tmp_path / "renders", {"s/0": VIEWS["scene_a/0000"]})
    convert(root, tmp_path / "isr.jsonl", group="view", min_side=0)
    (s,) = [load_sample(r) for r in read_jsonl(tmp_path / "isr.jsonl", root)]
    assert s.query == ovd_row_question(["coffee table", "dining chair", "lamp"]) and len(s.boxes) == 4
    assert s.meta["categories"] == ["coffee table", "dining chair", "lamp"]
    # the gpt turn labels each box with its category (VLM-R1's answer), in the solution's order
    (row,) = [json.loads(x) for x in (tmp_path / "isr.jsonl").read_text().splitlines()]
    answer = json.loads(row["conversations"][1]["value"].removeprefix("```json\n").removesuffix("\n```"))
    assert [a["bbox_2d"] for a in answer] == row["solution"] == s.boxes
    assert [a["label"] for a in answer] == ["lamp", "dining chair", "dining chair", "coffee table"]


def test_the_seeded_draw_is_the_data_modules(tmp_path):
    views = {f"s/{i:04d}": {"objects": [{"category": "chair", "bbox": [i, 1, i + 10, 11]}]} for i in range(12)}
    root = _render(tmp_path / "renders", views)
    convert(root, tmp_path / "isr_train.jsonl")
    ids = []
    for _ in range(2):
        dm = RECDataModule(data_root=str(tmp_path), image_root=str(root), train_files=["isr_train.jsonl"])
        dm.max_train_samples, dm.seed = 5, 3
        dm.setup("fit")
        ids.append([r.sample_id for r in dm.train_records()])
    assert ids[0] == ids[1] and len(set(ids[0])) == 5  # the same 5 of 12 every time, drawn (not the first five)
    assert ids[0] != [f"isr-s-{i:04d}-chair" for i in range(5)]


@pytest.mark.parametrize(
    "view, prepare, message",
    [
        ({"objects": [{"category": "chair", "bbox": [1, 1, 9, 9]}]}, "no_image", "no image beside it"),
        ({"image": "gone.png", "objects": []}, None, "gone.png does not exist"),
        ({"objects": [{"category": "chair", "bbox": [50, 10, 120, 40]}]}, None, "lies outside the 96x80 image"),
        ({"objects": [{"category": "chair", "bbox": [-3, 10, 20, 40]}]}, None, "lies outside the 96x80 image"),
        ({"objects": [{"category": "chair", "bbox": [10, 10, 5, 40]}]}, None, "x2 = x + w"),
        ({"objects": [{"category": "chair", "bbox": [1, 2, 3]}]}, None, "4 numbers in image pixels"),
        (
            {"objects": [{"category": "chair", "bbox": [1, 1, 9, 9], "colour": "red"}]},
            None,
            "unknown field(s) ['colour']",
        ),
        ({"objects": [], "cam_pose": [0, 0, 1]}, None, "unknown field(s) ['cam_pose']"),
        ({"objects": [{"bbox": [1, 1, 9, 9]}]}, None, "needs a 'category' name"),
        ({"boxes": []}, None, "unknown field(s) ['boxes']"),
        ({"scene": "a"}, None, "missing 'objects'"),
        ({"width": 640, "objects": []}, None, "'width' is 640 but the image 0000.png is 96x80"),
        ("{not json", None, "not valid JSON"),
    ],
)
def test_bad_input_names_the_view_file_and_what_to_fix(tmp_path, view, prepare, message):
    root = _render(tmp_path / "renders", {"good/0000": VIEWS["scene_b/0000"], "bad/0000": {"objects": []}})
    bad = root / "bad/0000.json"
    bad.write_text(view if isinstance(view, str) else json.dumps(view))
    if prepare == "no_image":
        (root / "bad/0000.png").unlink()
    with pytest.raises(DataError) as err:
        convert(root, tmp_path / "out.jsonl")
    assert str(bad) in str(err.value) and message in str(err.value)
    assert not (tmp_path / "out.jsonl").exists()  # nothing is written from a render folder with a defect


def test_cli_converts_and_reports_a_defect_in_one_line(tmp_path, capsys):
    root = _render(tmp_path / "renders")
    assert main([str(root), str(tmp_path / "isr.jsonl")]) == 0
    assert "4 samples, 5 boxes from 3 views" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "x.jsonl")]) == 2
    assert "no such render folder" in capsys.readouterr().err


def test_category_names_become_queries():
    assert normalise_category("  Dining_Chair ") == "dining chair"
    assert normalise_category("Pendant   Lamp") == "pendant lamp"
