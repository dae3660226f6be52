"""CycleGRPO's real-data readers: GRES / gRefCOCO and GroundingSuite (exact masks from polygons and COCO RLE) and the
released RL parquet (datamodules/gres.py, core/regions/coco_masks.py, datamodules/cycle_parquet.py). Every fixture is
written here: a few PNGs, a grefs json, a COCO instances json, a GroundingSuite JSONL, parquet files in the release's
schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.records import DataError
from core.regions.coco_masks import polygons_to_mask, rle_decode, rle_encode
from core.regions.mask_tokens import format_mask
from datamodules.cycle_parquet import read_cycle_parquet, row_sample
from datamodules.gres import load_seg_sample, read_gres, read_groundingsuite

# --- fixtures --------------------------------------------------------------------------------------------------------


def _png(path: Path, w: int, h: int, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)


def _rect(x1: int, y1: int, x2: int, y2: int) -> list[float]:
    return [x1, y1, x2, y1, x2, y2, x1, y2]


def write_gres_fixture(root: Path) -> dict[str, Path]:
    """Two images (40x30, 32x32) and four refs: val has a polygon target, a two-object target (polygon + compressed
    RLE) and a no-target ref; testA has one ref whose target is an uncompressed RLE. Masks are rectangles, so each
    expected mask is known pixel for pixel."""
    _png(root / "train2014" / "a.png", 40, 30, 0)
    _png(root / "train2014" / "b.png", 32, 32, 1)
    crowd = np.zeros((32, 32), dtype=bool)
    crowd[4:10, 20:30] = True
    crowd_counts = rle_encode(crowd)  # compressed string
    flat = crowd.T.reshape(-1)
    bounds = np.concatenate([[0], np.flatnonzero(flat[1:] != flat[:-1]) + 1, [flat.size]])
    uncompressed = {"size": [32, 32], "counts": [int(c) for c in np.diff(bounds)]}
    instances = {
        "images": [
            {"id": 1, "file_name": "a.png", "height": 30, "width": 40},
            {"id": 2, "file_name": "b.png", "height": 32, "width": 32},
        ],
        "annotations": [
            {"id": 10, "image_id": 1, "segmentation": [_rect(2, 3, 12, 9)], "bbox": [2, 3, 10, 6], "category_id": 1},
            {"id": 11, "image_id": 1, "segmentation": [_rect(20, 10, 30, 20)], "bbox": [20, 10, 10, 10]},
            {"id": 12, "image_id": 2, "segmentation": crowd_counts, "bbox": [20, 4, 10, 6], "iscrowd": 1},
            {"id": 13, "image_id": 2, "segmentation": uncompressed, "bbox": [20, 4, 10, 6], "iscrowd": 1},
        ],
        "categories": [{"id": 1, "name": "thing"}],
    }
    sent = lambda i, text: {"sent_id": i, "sent": text, "raw": text, "tokens": text.split()}  # noqa: E731
    refs = [
        {
            "ref_id": 0,
            "image_id": 1,
            "ann_id": [10],
            "split": "val",
            "category_id": 1,
            "no_target": False,
            "sentences": [sent(100, "The Left Box "), sent(101, "small box")],
        },  # fmt: skip
        {
            "ref_id": 1,
            "image_id": 1,
            "ann_id": [11, 10],
            "split": "val",
            "category_id": [1, 1],
            "no_target": False,
            "sentences": [sent(102, "both boxes")],
        },  # fmt: skip
        {
            "ref_id": 2,
            "image_id": 2,
            "ann_id": [-1],
            "split": "val",
            "category_id": [],
            "no_target": True,
            "sentences": [sent(103, "the purple giraffe")],
        },  # fmt: skip
        {
            "ref_id": 3,
            "image_id": 2,
            "ann_id": [13, 12],
            "split": "testA",
            "category_id": 1,
            "no_target": False,
            "sentences": [sent(104, "the crowd")],
        },  # fmt: skip
    ]
    (root / "grefs(unc).json").write_text(json.dumps(refs))
    (root / "instances.json").write_text(json.dumps(instances))
    return {"grefs": root / "grefs(unc).json", "instances": root / "instances.json", "images": root / "train2014"}


def write_groundingsuite_fixture(root: Path) -> Path:
    """Three GroundingSuite-Eval lines on two images, classes 0, 0 and 2."""
    _png(root / "images" / "c.png", 24, 20, 2)
    _png(root / "images" / "d.png", 16, 16, 3)
    lines = []
    for idx, (img, (h, w), box, cls) in enumerate(
        [
            ("c.png", (20, 24), (2, 2, 10, 8), 0),
            ("c.png", (20, 24), (12, 4, 22, 18), 0),
            ("d.png", (16, 16), (0, 0, 8, 8), 2),
        ]
    ):
        m = np.zeros((h, w), dtype=bool)
        m[box[1] : box[3], box[0] : box[2]] = True
        lines.append({"idx": idx, "image_path": f"images/{img}", "caption": f"object {idx}", "label": "thing",
                      "class_id": cls, "box": list(box), "segmentation": rle_encode(m)})  # fmt: skip
    path = root / "GroundingSuite-Eval.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# --- COCO masks ------------------------------------------------------------------------------------------------------


def test_rle_round_trips_and_matches_pycocotools():
    mask_utils = pytest.importorskip("pycocotools.mask")
    rng = np.random.default_rng(0)
    for _ in range(40):
        h, w = (int(v) for v in rng.integers(1, 30, 2))
        m = rng.random((h, w)) < rng.random()
        ours = rle_encode(m)
        theirs = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
        assert ours["counts"] == theirs["counts"].decode() and ours["size"] == [h, w]
        assert (rle_decode(ours) == m).all()
        assert (mask_utils.decode({"size": [h, w], "counts": ours["counts"]}) == m).all()


def test_uncompressed_rle_is_column_major():
    # 3 x 2 mask: column 0 = [0, 1, 1], column 1 = [1, 0, 0]: runs 1 bg, 3 fg (down col 0 then top of col 1), 2 bg
    m = rle_decode({"size": [3, 2], "counts": [1, 3, 2]})
    assert m.tolist() == [[False, True], [True, False], [True, False]]
    with pytest.raises(ValueError, match="sum to 5"):
        rle_decode({"size": [3, 2], "counts": [1, 3, 1]})
    with pytest.raises(ValueError, match="RLE alphabet"):
        rle_decode({"size": [3, 2], "counts": "1~"})


def test_polygons_fill_pixel_centres_and_agree_with_coco():
    # integer rectangle: exactly the pixels x1 <= x < x2, y1 <= y < y2; a ring of 2 points is dropped
    m = polygons_to_mask([_rect(2, 3, 12, 9), [1, 1, 5, 5]], 30, 40)
    want = np.zeros((30, 40), dtype=bool)
    want[3:9, 2:12] = True
    assert (m == want).all()
    mask_utils = pytest.importorskip("pycocotools.mask")
    rng = np.random.default_rng(1)
    ious = []
    for _ in range(10):  # convex octagons with fractional corners
        ang = np.sort(rng.uniform(0, 2 * np.pi, 8))
        pts = np.stack([20 + 14 * np.cos(ang), 16 + 12 * np.sin(ang)], 1).reshape(-1).tolist()
        coco = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([pts], 32, 40))).astype(bool)
        ours = polygons_to_mask([pts], 32, 40)
        ious.append((ours & coco).sum() / (ours | coco).sum())
        # every pixel on which we differ lies on COCO's outline (its 3 x 3 neighbourhood is not all one value)
        pad = np.pad(coco, 1, mode="edge")
        shifts = [pad[1 + dy : 33 + dy, 1 + dx : 41 + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        outline = np.any([sh != coco for sh in shifts], axis=0)
        assert not ((ours ^ coco) & ~outline).any()
    assert np.mean(ious) >= 0.97


# --- GRES ------------------------------------------------------------------------------------------------------------


def test_gres_reads_targets_multi_targets_and_no_target(tmp_path):
    f = write_gres_fixture(tmp_path)
    recs = read_gres(f["grefs"], f["instances"], f["images"], "val")
    assert [r.query for r in recs] == ["the left box", "small box", "both boxes", "the purple giraffe"]
    assert [r.sample_id for r in recs][:2] == ["gres-val-0-100", "gres-val-0-101"]
    single, multi, none = recs[0], recs[2], recs[3]
    assert single.mask().sum() == 60 and single.boxes == [[2.0, 3.0, 12.0, 9.0]]
    assert multi.mask().sum() == 60 + 100 and multi.meta["n_targets"] == 2  # the union of both objects
    assert none.no_target and not none.mask().any() and none.boxes == []
    s = load_seg_sample(multi)
    assert s.boxes == [[2.0, 3.0, 30.0, 20.0]] and s.meta["target_boxes"] == multi.boxes  # one box: the union
    assert load_seg_sample(none).boxes == [] and load_seg_sample(none).meta["no_target"]
    test_a = read_gres(f["grefs"], f["instances"], f["images"], "testA")
    assert len(test_a) == 1 and test_a[0].mask().sum() == 60  # compressed and uncompressed RLE of one region


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda refs, inst: refs[0].update(ann_id=[99]), "ann_id 99 is not in"),
        (lambda refs, inst: refs[0].update(image_id=7), "image_id 7 is not in"),
        (lambda refs, inst: refs[0].pop("sentences"), "missing 'sentences'"),
        (lambda refs, inst: refs[2].update(ann_id=[10]) or refs[2].update(no_target=True), "marked no_target"),
        (lambda refs, inst: inst["annotations"][0].update(segmentation=[[1, 2, 3, 4]]), "no polygon of 3"),
    ],
)
def test_gres_defects_name_file_and_ref(tmp_path, patch, message):
    f = write_gres_fixture(tmp_path)
    refs, inst = json.loads(f["grefs"].read_text()), json.loads(f["instances"].read_text())
    patch(refs, inst)
    f["grefs"].write_text(json.dumps(refs))
    f["instances"].write_text(json.dumps(inst))
    with pytest.raises(DataError, match=message):
        read_gres(f["grefs"], f["instances"], f["images"], "val")


def test_gres_split_and_image_errors(tmp_path):
    f = write_gres_fixture(tmp_path)
    with pytest.raises(DataError, match=r"no ref of split 'testB'.*'testA', 'val'"):
        read_gres(f["grefs"], f["instances"], f["images"], "testB")
    recs = read_gres(f["grefs"], f["instances"], tmp_path / "elsewhere", "val")
    with pytest.raises(DataError, match="not found; set --image-root"):
        load_seg_sample(recs[0])
    _png(f["images"] / "a.png", 20, 20)  # not the annotated size
    with pytest.raises(DataError, match="is 20x20, the annotation says 40x30"):
        load_seg_sample(read_gres(f["grefs"], f["instances"], f["images"], "val")[0])


# --- GroundingSuite --------------------------------------------------------------------------------------------------


def test_groundingsuite_reads_lines(tmp_path):
    recs = read_groundingsuite(write_groundingsuite_fixture(tmp_path))
    assert [r.sample_id for r in recs] == ["gsuite-0", "gsuite-1", "gsuite-2"]
    assert [r.meta["class_id"] for r in recs] == [0, 0, 2] and recs[1].query == "object 1"
    assert recs[1].mask().sum() == 10 * 14 and recs[1].boxes == [[12.0, 4.0, 22.0, 18.0]]
    assert load_seg_sample(recs[2]).size == (16, 16)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"idx": 0, "image_path": "x.png"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing \['caption', 'class_id', 'segmentation'\]"):
        read_groundingsuite(bad)


# --- the released RL parquet -----------------------------------------------------------------------------------------

SPAN_A, SPAN_B, SPAN_Z = format_mask((17, 44)), format_mask((3, 250)), format_mask((9, 9))


def _dw_prompt(spans: list[str], zoom: str | None = None) -> str:
    text = "<image>\nCould you please give me a detailed description of the following regions? " + ", and ".join(spans)
    text += ". Please respond with interleaved segmentation masks for the corresponding parts of the answer."
    return text + (f" Zoom in on {spans[0]} with the perspective as <image>, {zoom}." if zoom else "")


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def release_rows(root: Path, embedded: bool = False) -> list[dict]:
    """A denseworld_multiple row with a zoom-in crop (paths, one with the release's ./ prefix), a one-target row and
    a gres_no_target row, in the prepare scripts' columns; ``embedded``: every image as HF's {"bytes", "path"}."""
    _png(root / "img" / "e.png", 24, 24, 4)
    _png(root / "img" / "crop.png", 12, 12, 5)
    _png(root / "img" / "f.png", 28, 20, 6)

    def im(rel: str):
        return {"bytes": (root / rel).read_bytes(), "path": None} if embedded else rel

    null = {"cap_answer": None, "seg_problem": None, "masks": None}
    return [
        {
            "images": [im("./img/e.png"), im("img/crop.png")],
            "cap_problem": _dw_prompt([SPAN_A, SPAN_B], SPAN_Z),
            "seg_answer": f"<answer>{SPAN_A}, {SPAN_B}</answer>",
            "source": "denseworld_multiple",
            **null,
        },  # fmt: skip
        {
            "images": [im("img/f.png")],
            "cap_problem": _dw_prompt([SPAN_B]),
            "seg_answer": f"<answer>{SPAN_B}</answer>",
            "source": "denseworld_multiple",
            **null,
        },  # fmt: skip
        {
            "images": [im("img/e.png")],
            "cap_problem": "<image>\nPlease segment the green zebra in this image.",
            "seg_answer": "<answer>No target.</answer>",
            "source": "gres_no_target",
            **null,
        },  # fmt: skip
    ]


def test_parquet_rows_become_records(tmp_path):
    path = write_parquet(tmp_path / "rl.parquet", release_rows(tmp_path))
    dw, one, nt = read_cycle_parquet(path, tmp_path)
    assert dw.codes == [(17, 44), (3, 250)] and not dw.no_target and len(dw.images) == 2 and dw.query == ""
    assert one.codes == [(3, 250)] and one.images == [tmp_path / "img" / "f.png"]
    # a no-target row's cap_problem is its whole question: asked as it is (meta["row_question"], no template around
    # it); a region row's captioning prompt names the kept target (tests/datamodules/test_golden_prompts.py)
    assert nt.no_target and nt.codes == [] and nt.query == "Please segment the green zebra in this image."
    assert row_sample(nt).meta["row_question"] == nt.query and "row_caption_question" not in row_sample(nt).meta
    s = row_sample(dw, target=1)
    assert s.size == (24, 24) and s.meta["mask_codes"] == [(3, 250)] and s.meta["n_images"] == 2 and s.boxes == []
    assert (
        s.meta["row_caption_question"]
        == (f"Could you please give me a detailed description of the following region? {SPAN_B}.")
        and "row_question" not in s.meta
    )
    assert row_sample(one).size == (28, 20) and row_sample(nt).meta["no_target"]
    assert [r.sample_id for r in read_cycle_parquet(path, tmp_path, max_samples=2)] == ["rl-0", "rl-1"]
    # the same rows with the images embedded as HF datasets writes an Image feature: the same samples
    emb = read_cycle_parquet(write_parquet(tmp_path / "emb.parquet", release_rows(tmp_path, embedded=True)))
    assert isinstance(emb[0].images[1], bytes) and emb[0].codes == dw.codes
    assert np.array_equal(np.asarray(row_sample(emb[1]).image), np.asarray(row_sample(one).image))


def test_parquet_sample_gets_its_box_from_the_tokenizer(tmp_path):
    class Square:  # decodes every code pair to a fixed square: the box follows from the decoded mask
        def decode(self, codes, image):
            m = np.zeros((image.size[1], image.size[0]), dtype=bool)
            m[2 + codes[0] % 3 : 9, 4:11] = True
            return m

    rows = read_cycle_parquet(write_parquet(tmp_path / "rl.parquet", release_rows(tmp_path)), tmp_path)
    assert row_sample(rows[0], codec=Square()).boxes == [[4.0, 2.0, 11.0, 9.0]]  # (17 % 3 = 2, 3 % 3 = 0): union


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda rows: [r.pop("source") for r in rows], r"missing column\(s\) \['source'\]"),
        (lambda rows: rows[1].update(source="tg_grounding"), "row 1: unknown source 'tg_grounding'"),
        (lambda rows: rows[2].update(seg_answer=f"<answer>{SPAN_A}</answer>"), "row 2: a gres_no_target row"),
        (lambda rows: rows[0].update(seg_answer="<answer></answer>"), "row 0: a denseworld_multiple row's"),
        (lambda rows: rows[1].update(cap_problem="<image>\nDescribe."), r"row 1: the answer's span .* not in"),
        (lambda rows: rows[0].update(images=["img/missing.png"]), "row 0 image #0: image .*missing.png not found"),
    ],
)
def test_parquet_defects_name_file_and_row(tmp_path, edit, message):
    rows = release_rows(tmp_path)
    edit(rows)
    with pytest.raises(DataError, match=message):
        read_cycle_parquet(write_parquet(tmp_path / "bad.parquet", rows), tmp_path)


def test_parquet_bad_embedded_image_names_the_row(tmp_path):
    rows = release_rows(tmp_path, embedded=True)
    rows[1]["images"] = [{"bytes": b"not a png", "path": None}]
    row = read_cycle_parquet(write_parquet(tmp_path / "rl.parquet", rows), tmp_path)[1]
    with pytest.raises(DataError, match=r"rl.parquet row 1: image #0 \(embedded bytes\) cannot be read"):
        row_sample(row)
