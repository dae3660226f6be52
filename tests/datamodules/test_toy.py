"""The toy world: reproducible scenes, unique queries, tight boxes, a loadable JSONL, a harder OOD split."""

import json
import re
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from core.toy import grammar
from datamodules import sft_targets, toy


@pytest.fixture(scope="module")
def scenes():
    return {split: toy.generate_split(split, 150, seed=0) for split in ("train", "ood")}


def _triple(o):
    return (o["size"], o["colour"], o["shape"])


def test_same_seed_same_bytes_and_prefix_stable():
    a = toy.generate_split("val", 6, seed=3)
    b = toy.generate_split("val", 4, seed=3)  # n records are a prefix of n + k
    for ra, rb in zip(a, b):
        assert ra["image"].tobytes() == rb["image"].tobytes()
        assert {k: v for k, v in ra.items() if k != "image"} == {k: v for k, v in rb.items() if k != "image"}
    c = toy.generate_split("val", 4, seed=4)
    assert all(ra["image"].tobytes() != rc["image"].tobytes() for ra, rc in zip(a, c))
    train = toy.generate_split("train", 4, seed=3)  # splits never share scenes
    assert all(ra["image"].tobytes() != rt["image"].tobytes() for ra, rt in zip(a, train))


@pytest.mark.parametrize("split", ["train", "ood"])
def test_query_names_exactly_one_object(scenes, split):
    for rec in scenes[split]:
        objects = rec["meta"]["objects"]
        target = objects[0]
        assert target["role"] == "target" and sum(o["role"] == "target" for o in objects) == 1
        assert rec["conversations"][0]["value"] == "<image>the {} {} {}".format(*_triple(target))
        assert Counter(_triple(o) for o in objects)[_triple(target)] == 1
        assert rec["solution"] == target["box"]


def test_boxes_are_tight_to_the_drawn_target(scenes):
    checked = 0
    for rec in scenes["train"]:
        if grammar.parse_description(rec["meta"]["description"]).background != "plain":
            continue
        img = np.asarray(rec["image"])
        target, *others = rec["meta"]["objects"]
        x1, y1, x2, y2 = target["box"]
        assert 0 <= x1 < x2 <= rec["width"] and 0 <= y1 < y2 <= rec["height"]
        # the target is drawn exactly: its mask's pixels hold its colour and the mask fills the box
        mask = grammar.shape_mask(target["shape"], x2 - x1, y2 - y1)
        assert (img[y1:y2, x1:x2][mask] == grammar.COLOURS[target["colour"]]).all()
        # every pixel of the target's colour outside the boxes of same-coloured objects lies in the target's box
        hit = (img == grammar.COLOURS[target["colour"]]).all(-1)
        for o in others:
            if o["colour"] == target["colour"]:
                ox1, oy1, ox2, oy2 = o["box"]
                hit[oy1:oy2, ox1:ox2] = False
        hit[y1:y2, x1:x2] = False
        assert not hit.any()
        checked += 1
    assert checked > 20


def test_ood_is_harder_than_train(scenes):
    def others(split):
        return np.mean([len(r["meta"]["objects"]) - 1 for r in scenes[split]])

    assert others("ood") > others("train") + 2
    assert all(1 <= len(r["meta"]["objects"]) - 1 <= 3 for r in scenes["train"])
    for split, kinds in (("train", grammar.PLAIN_BACKGROUNDS), ("ood", grammar.TEXTURED_BACKGROUNDS)):
        assert {grammar.parse_description(r["meta"]["description"]).background for r in scenes[split]} == set(kinds)
    # OOD's other objects all share one or two attributes with the target
    for rec in scenes["ood"]:
        target, *rest = rec["meta"]["objects"]
        assert all(1 <= sum(o[a] == target[a] for a in ("size", "colour", "shape")) <= 2 for o in rest)
    train_d = [r["meta"]["difficulty"] for r in scenes["train"]]
    ood_d = [r["meta"]["difficulty"] for r in scenes["ood"]]
    assert all(0 <= v <= 1 for v in train_d + ood_d)
    assert np.mean(ood_d) > np.mean(train_d) + 0.2


def test_scene_repaints_around_the_target():
    # the data server's move: keep the target box, paint a new description everywhere else
    rec = toy.generate_split("train", 1, seed=0)[0]
    x1, y1, x2, y2 = rec["solution"]
    keep = np.zeros((rec["height"], rec["width"]), bool)
    keep[y1:y2, x1:x2] = True
    new = grammar.render(rec["image"], keep, "a dotted black and yellow background with many small gray stars", 5)
    assert np.array_equal(np.asarray(new)[y1:y2, x1:x2], np.asarray(rec["image"])[y1:y2, x1:x2])


def test_ovd_solution_is_every_object_of_the_colour():
    for rec in toy.generate_split("ood", 30, seed=1, task="ovd") + toy.generate_split("train", 30, seed=1, task="ovd"):
        colour = re.fullmatch(r"<image>every (\w+) shape", rec["conversations"][0]["value"]).group(1)
        objects = rec["meta"]["objects"]
        boxes = [o["box"] for o in objects if o["colour"] == colour]
        assert all(o["role"] == "target" for o in objects if o["colour"] == colour)
        assert rec["task"] == "ovd" and 1 <= len(boxes) <= 3
        assert sorted(rec["solution"]) == sorted(boxes)
        assert json.loads(rec["conversations"][1]["value"]) == rec["solution"]


def test_export_jsonl_loads_and_is_idempotent(tmp_path):
    path = toy.export_jsonl(tmp_path / "a", "train", 5, seed=2)
    assert path == tmp_path / "a" / "train.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 5
    for rec in lines:
        assert {"id", "image", "conversations", "solution", "task", "width", "height", "meta"} <= rec.keys()
        assert rec["conversations"][0]["from"] == "human" and rec["conversations"][0]["value"].startswith("<image>")
        with Image.open(path.parent / rec["image"]) as im:
            assert im.size == (rec["width"], rec["height"]) and im.mode == "RGB"
        assert json.loads(rec["conversations"][1]["value"]) == rec["solution"]
    # same parameters: nothing is rewritten; other parameters: regenerated
    stamp = path.stat().st_mtime_ns
    assert toy.export_jsonl(tmp_path / "a", "train", 5, seed=2) == path and path.stat().st_mtime_ns == stamp
    toy.export_jsonl(tmp_path / "a", "train", 3, seed=2)
    assert len(path.read_text().splitlines()) == 3
    # same seed, another folder: identical bytes
    again = toy.export_jsonl(tmp_path / "b", "train", 3, seed=2)
    assert again.read_bytes() == path.read_bytes()
    for rec in lines[:3]:
        assert (tmp_path / "b" / rec["image"]).read_bytes() == (tmp_path / "a" / rec["image"]).read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))


def test_export_reads_with_the_rec_reader(tmp_path):
    rec_reader = pytest.importorskip("datamodules.rec")
    path = toy.export_jsonl(tmp_path, "ood", 3, seed=0, task="ovd")
    assert path.name == "ood_ovd.jsonl"
    records = rec_reader.read_jsonl(path)
    sample = rec_reader.load_sample(records[0])
    assert sample.task == "ovd" and sample.query.startswith("every ") and sample.image.size == (224, 224)


def test_sft_target_format_and_scaling():
    rec = toy.generate_split("train", 1, seed=0)[0]
    text = sft_targets.sft_target(rec, (448, 336))
    m = re.fullmatch(
        r"<think>(.+)</think><diversity>(\d\.\d\d)</diversity><description>(.+)</description>"
        r"<answer>(\[.+\])</answer>",
        text,
    )
    assert m, text
    assert m.group(1).startswith(f"The query asks for {rec['meta']['query']}.")
    assert float(m.group(2)) == pytest.approx(rec["meta"]["difficulty"], abs=0.005)
    assert grammar.parse_description(m.group(3)) is not None
    x1, y1, x2, y2 = rec["solution"]
    assert json.loads(m.group(4)) == [round(x1 * 2), round(y1 * 1.5 + 1e-9), round(x2 * 2), round(y2 * 1.5 + 1e-9)]
    assert sft_targets.sft_target(rec, (448, 336)) == text  # the description is seeded by the record
    ovd = toy.generate_split("train", 1, seed=0, task="ovd")[0]
    answer = json.loads(re.search(r"<answer>(.+)</answer>", sft_targets.sft_target(ovd, (224, 224))).group(1))
    assert answer == ovd["solution"]


def test_cli(tmp_path, capsys):
    paths = toy.main(["--out", str(tmp_path), "--splits", "train:2", "ood:2", "--seed", "1", "--size", "96"])
    assert [p.name for p in paths] == ["train.jsonl", "ood.jsonl"]
    assert capsys.readouterr().out.split() == [str(p) for p in paths]
    with pytest.raises(SystemExit):
        toy.main(["--out", str(tmp_path), "--splits", "test:2"])


def test_errors_name_the_flag():
    with pytest.raises(ValueError, match="--task"):
        toy.generate_split("train", 1, seed=0, task="seg")
    with pytest.raises(ValueError, match="unknown split"):
        toy.generate_split("test", 1, seed=0)


def test_sft_target_from_a_sample_like_dict():
    # lightning_modules.sft builds this dict from a core.records.Sample: float boxes, a "query" key, no turns
    rec = toy.generate_split("ood", 1, seed=0)[0]
    sample_like = {
        "id": rec["id"],
        "solution": [float(v) for v in rec["solution"]],
        "task": "rec",
        "meta": rec["meta"],
        "width": 224,
        "height": 224,
        "query": rec["meta"]["query"],
    }
    assert sft_targets.sft_target(sample_like, (224, 224)) == sft_targets.sft_target(rec, (224, 224))
    bare = {"id": "x", "solution": [1.0, 2.0, 3.0, 4.0], "width": 10, "height": 10, "query": "the dog"}
    assert sft_targets.sft_target(bare, (20, 20)).endswith("<answer>[2, 4, 6, 8]</answer>")


def test_rendered_train_split_equals_the_exported_one(tmp_path):
    """``ToySceneDataset`` (render on access) yields the samples the exported JSONL reads back as."""
    from datamodules.rec import RECDataModule, ToySpec, load_sample, read_jsonl
    from datamodules.toy import ToySceneDataset

    path = toy.export_jsonl(tmp_path, "train", 4, seed=3)
    exported = [load_sample(r) for r in read_jsonl(path)]
    rendered = ToySceneDataset("train", 4, seed=3)
    for a, b in zip(exported, [rendered[i] for i in range(4)]):
        assert (a.sample_id, a.query, a.boxes, a.meta) == (b.sample_id, b.query, b.boxes, b.meta)
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    with pytest.raises(IndexError):
        rendered[4]
    dm = RECDataModule(data_root=str(tmp_path / "dm"), toy=ToySpec(splits={"train": 5}, render_train=True))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 5 and not (tmp_path / "dm" / "train.jsonl").exists()
    assert len(list(dm.train_samples(3))) == 3


def test_mix_draws_fixed_fractions_from_the_sft_splits():
    from datamodules.toy import ToySceneDataset

    ds = ToySceneDataset("train", 4000, seed=0, mix={"varied": 0.5, "solo": 0.1})
    counts = Counter(ds.split_of(i) for i in range(4000))
    assert abs(counts["varied"] / 4000 - 0.5) < 0.03 and abs(counts["solo"] / 4000 - 0.1) < 0.02
    solo = next(i for i in range(50) if ds.split_of(i) == "solo")
    assert [o["role"] for o in ds[solo].meta["objects"]] == ["target"]
    assert ds[solo].sample_id.startswith("toy-solo-") and ds.split_of(solo) == ToySceneDataset(
        "train", 4000, seed=0, mix={"varied": 0.5, "solo": 0.1}
    ).split_of(solo)
    with pytest.raises(ValueError, match="mix"):
        ToySceneDataset("train", 10, seed=0, mix={"nope": 0.1})
    with pytest.raises(ValueError, match="sum"):
        ToySceneDataset("train", 10, seed=0, mix={"varied": 0.8, "solo": 0.4})


# --- held-out test splits (docs/study.md) ----------------------------------------------------------------------------

# sha256 (first 16 hex digits) of the PNG bytes and the JSON of the other keys of scenes 0-2 at seed 0, recorded before
# the test splits were added: adding splits must not change a single existing scene (runs, checkpoints and their
# metrics stay comparable).
EXISTING_SCENES = {
    ("rec", "train"): ["4ff2547a472c1d7a", "d28115198f4bcbb4", "2b270480a658e102"],
    ("rec", "val"): ["134c35c3d00342e7", "30c116cc5c80b4ca", "83bed055c1c305fb"],
    ("rec", "ood"): ["e1b1de4501ad0f20", "76c4049c8f225127", "f20386bb355bd6d7"],
    ("ovd", "train"): ["7ba08bc9bdfdf0fd", "9d23cc0e4e077bb8", "c2444a6186297cb4"],
    ("ovd", "val"): ["2378b4c7a5904d88", "04210206ed2c3170", "a7a39ca2ac30e6e8"],
    ("ovd", "ood"): ["3c2999007ff1890a", "7785e5f721cba089", "081b64d10c2a6d09"],
}


def _scene_hash(rec) -> str:
    import hashlib
    import io

    buf = io.BytesIO()
    rec["image"].save(buf, format="PNG")
    h = hashlib.sha256(buf.getvalue())
    h.update(json.dumps({k: v for k, v in rec.items() if k != "image"}, sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("task,split", sorted(EXISTING_SCENES))
def test_existing_splits_are_byte_identical(task, split):
    assert [_scene_hash(toy.make_scene(split, i, 0, task=task)) for i in range(3)] == EXISTING_SCENES[(task, split)]


def test_test_splits_are_held_out_and_of_their_kind():
    codes = [spec.code for spec in toy.SPLITS.values() if not spec.ask_anchor]
    assert len(set(codes)) == len(codes), "every split needs its own code (it seeds its scenes)"
    # but an anchor split asks another split's questions' first steps on that split's scenes: it shares its code
    mirrored = {spec.code: spec.text_levels for spec in toy.SPLITS.values() if spec.text_levels and not spec.ask_anchor}
    assert all(mirrored[s.code] == s.text_levels for s in toy.SPLITS.values() if s.ask_anchor)
    assert set(toy.TEST_SPLITS) <= set(toy.SPLITS)
    seen = {toy.make_scene(s, i, 0)["image"].tobytes() for s in ("train", "val", "ood") for i in range(40)}
    n = 40
    for split in toy.TEST_SPLITS:
        recs = toy.generate_split(split, n, seed=0)
        assert not seen & {r["image"].tobytes() for r in recs}, split
        kinds = {r["meta"]["description"].split()[1] for r in recs}  # "a <texture> ... background ..."
        others = np.mean([sum(o["role"] != "target" for o in r["meta"]["objects"]) for r in recs])
        textured = kinds <= set(grammar.TEXTURED_BACKGROUNDS)
        plain = kinds <= set(grammar.PLAIN_BACKGROUNDS)
        if split == "test_id":
            assert plain and others < 3.5, (kinds, others)
        elif split == "test_ood_texture":
            assert textured and others < 3.5, (kinds, others)
        elif split == "test_ood_crowded":
            assert plain and others > 4, (kinds, others)
        elif split == "test_multihop":
            assert plain and others < 4.5, (kinds, others)  # test_id's drawing; scenes with room for relations kept
        else:
            assert textured and others > 4, (kinds, others)


def test_the_multihop_split_asks_exact_multi_step_questions_about_the_target():
    from core.toy import query as toy_query
    from core.toy import scene as toy_scene

    recs = toy.generate_split("test_multihop", 24, seed=0)
    assert [r["meta"]["level"] for r in recs] == [3, 5] * 12
    for r in recs:
        meta, query = r["meta"], r["meta"]["query"]
        np_ = toy_query.parse_query(query)
        assert np_.hops() == (1 if meta["level"] == 3 else 2), query
        t = toy_scene.target_index(meta)
        assert toy_query.resolve(np_, meta) == [t] and toy_query.query_problem(meta, np_) is None, query
        assert r["solution"] == meta["objects"][t]["box"] and r["conversations"][0]["value"] == f"<image>{query}"
        assert len(toy_query.decompose(meta, query)) == np_.hops() + 1  # anchor, (middle,) target: the prefix reward's
    again = toy.make_scene("test_multihop", 5, 0)
    assert again["meta"]["query"] == recs[5]["meta"]["query"] and again["image"].tobytes() == recs[5]["image"].tobytes()
    with pytest.raises(ValueError, match="REC questions"):
        toy.make_scene("test_multihop", 0, 0, task="ovd")


def test_a_test_split_of_1000_scenes_exports_and_is_cached(tmp_path):
    import time

    path = toy.export_jsonl(tmp_path, "test_id", 1000, seed=0)
    assert len(path.read_text().splitlines()) == 1000
    t0 = time.monotonic()
    assert toy.export_jsonl(tmp_path, "test_id", 1000, seed=0) == path  # the manifest: no second render
    assert time.monotonic() - t0 < 2.0


def test_the_crowded_training_split_is_test_ood_crowded_drawing_on_its_own_scenes():
    recs = toy.generate_split("crowded", 20, seed=0)
    held = {r["image"].tobytes() for r in toy.generate_split("test_ood_crowded", 20, seed=0)}
    assert not held & {r["image"].tobytes() for r in recs}  # its own code: never a held-out scene
    for r in recs:
        meta = r["meta"]
        target = next(o for o in meta["objects"] if o["role"] == "target")
        others = [o for o in meta["objects"] if o["role"] != "target"]
        assert meta["description"].split()[1] in grammar.PLAIN_BACKGROUNDS and len(others) >= 3
        assert all(1 <= sum(o[a] == target[a] for a in ("size", "colour", "shape")) <= 2 for o in others)
    assert toy.make_scene("crowded", 3, 0)["image"].tobytes() == recs[3]["image"].tobytes()
    assert "crowded" not in toy.TEST_SPLITS


def test_no_target_splits_name_a_near_miss_that_no_object_has(tmp_path):
    """train_nt / val_nt: a quarter of the queries name nothing in the scene (solution []), a near miss of the former
    target (one attribute changed); the rest are train / val queries with one target; the exported lines read back
    with the REC reader (boxes []) and the SFT target answers "no target", never a box."""
    from datamodules.rec import read_jsonl

    recs = toy.generate_split("train_nt", 200, seed=0)
    absent = [r for r in recs if not r["solution"]]
    assert 30 <= len(absent) <= 70  # 25% of 200, drawn per index
    for r in absent:
        meta = r["meta"]
        asked = tuple(meta["query"].split()[1:])
        assert meta["no_target"] and r["conversations"][1]["value"] == "[]"
        assert asked not in {_triple(o) for o in meta["objects"]}
        assert not any(o["role"] == "target" for o in meta["objects"])
        assert asked[1:] not in {_triple(o)[1:] for o in meta["objects"]}  # no object of that colour and shape
        assert sum(a != b for a, b in zip(asked, _triple(r["meta"]["objects"][0]))) == 1  # the former target, one off
        target = sft_targets.sft_target(r, (224, 224), grounded_think=True)
        assert target.endswith("<answer>no target</answer>") and "It is not in the image." in target
        assert not re.search(r"\[\d", target)
    for r in recs:
        if r["solution"]:
            objs = [_triple(o) for o in r["meta"]["objects"]]
            assert objs.count(tuple(r["meta"]["query"].split()[1:])) == 1
    assert toy.make_scene("train_nt", 7, 0)["meta"]["query"] == recs[7]["meta"]["query"]  # per index, reproducible
    path = toy.export_jsonl(tmp_path, "val_nt", 24, seed=0)
    read = read_jsonl(path)
    assert {len(r.boxes) for r in read} == {0, 1} and all((not r.boxes) == bool(r.meta.get("no_target")) for r in read)
    data = toy.ToySceneDataset("train", 400, seed=0, mix={"train_nt": 0.4})
    samples = [data[i] for i in range(60)]
    assert any(not s.boxes for s in samples) and all(bool(s.meta.get("no_target")) == (not s.boxes) for s in samples)


def test_short_splits_ask_the_target_by_its_shortest_exact_descriptor():
    """train_short / test_short: scenes drawn as train / test_id on codes of their own, the target asked by the fewest
    of (size, colour, shape) that single it out ("the yellow shape": a multi-step question's anchor form), exact."""
    from core.toy.query import parse_query, resolve
    from core.toy.scene import target_index

    recs = toy.generate_split("train_short", 120, seed=0)
    lengths = Counter(len(r["meta"]["query"].split()) for r in recs)
    assert lengths[2] + lengths[3] >= 110  # one or two attributes: "the cross", "the yellow shape", "the small star"
    for r in recs:
        meta, query = r["meta"], r["meta"]["query"]
        assert resolve(parse_query(query), meta) == [target_index(meta)], query
        assert r["conversations"][0]["value"] == f"<image>{query}"
        t = meta["objects"][target_index(meta)]
        if len(query.split()) == 2:  # one attribute suffices: no shorter one exists, and it is the target's
            assert query.split()[1] in (t["size"], t["colour"], t["shape"])
    assert any(r["meta"]["query"].endswith(" shape") for r in recs)
    assert toy.make_scene("train_short", 5, 0)["meta"]["query"] == recs[5]["meta"]["query"]
    shorts = {r["id"]: r["meta"]["query"] for r in toy.generate_split("test_short", 40, seed=0)}
    assert len(shorts) == 40 and not set(shorts) & {r["id"] for r in recs}


@pytest.mark.parametrize("split", ["test_multihop", "train_multihop"])
def test_the_anchor_split_asks_the_multihop_splits_first_step_on_the_same_scenes(split):
    """test_multihop_anchor (train_multihop_anchor): test_multihop's (train_multihop's) images, each asked its
    question's first step alone (the anchor becomes the one target; the question is kept in meta), so the two splits
    score (train) the anchor alone and inside the chain."""
    from core.toy.query import decompose, parse_query, resolve
    from core.toy.scene import target_index

    hard = toy.generate_split(split, 12, seed=0)
    alone = toy.generate_split(f"{split}_anchor", 12, seed=0)
    for h, a in zip(hard, alone):
        assert np.array_equal(np.asarray(h["image"]), np.asarray(a["image"]))
        first = decompose(h["meta"], h["meta"]["query"])[0]
        assert a["meta"]["query"] == first.query and a["solution"] == first.box
        assert a["meta"]["question"] == h["meta"]["query"] and a["id"] != h["id"]
        assert resolve(parse_query(first.query), a["meta"]) == [target_index(a["meta"])]
        assert a["conversations"][0]["value"] == f"<image>{first.query}"


def test_the_bind_split_gives_every_other_object_the_targets_size_and_keeps_the_query_exact():
    recs = toy.generate_split("bind", 24, seed=0)
    train = {r["image"].tobytes() for r in toy.generate_split("train", 24, seed=0)}
    assert not train & {r["image"].tobytes() for r in recs}
    for rec in recs:
        target, *others = rec["meta"]["objects"]
        assert target["role"] == "target" and others, rec["id"]
        assert {o["size"] for o in others} == {target["size"]}, rec["id"]
        triple = (target["size"], target["colour"], target["shape"])
        assert all((o["size"], o["colour"], o["shape"]) != triple for o in others), rec["id"]
    assert "bind" not in toy.TEST_SPLITS
    held = toy.generate_split("val_bind", 8, seed=0)
    assert not {r["image"].tobytes() for r in held} & {r["image"].tobytes() for r in recs[:8]}


@pytest.mark.parametrize("split", ["base", "base_varied", "base_solo", "val_base"])
def test_base_splits_ask_one_unique_attribute_and_share_nothing_with_rl(split):
    """The toy base's SFT splits (docs/toy_model.md, "A base that has not seen the RL task"): the target asked by one attribute only it wears,
    never the triple RL asks, on scenes of codes no other split uses."""
    from core.toy.query import parse_query, resolve
    from core.toy.scene import target_index

    recs = toy.generate_split(split, 60, seed=0)
    kinds = Counter()
    for r in recs:
        meta, query = r["meta"], r["meta"]["query"]
        desc = parse_query(query).desc
        named = [a for a in ("size", "colour", "shape") if getattr(desc, a) is not None]
        assert len(named) == 1, query
        kinds[named[0]] += 1
        assert resolve(parse_query(query), meta) == [target_index(meta)], query
        assert r["conversations"][0]["value"] == f"<image>{query}"
    assert set(kinds) == {"size", "colour", "shape"}, kinds
    codes = [s.code for s in toy.SPLITS.values()]
    assert codes.count(toy.SPLITS[split].code) == 1
    assert toy.make_scene(split, 7, 0)["meta"]["query"] == recs[7]["meta"]["query"]
