"""The reasoning rows' reader (datamodules/reasoning.py): JSON, JSONL and parquet fixtures made in tmp_path, embedded
image bytes, and an error naming the file and line / row for each defect."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from core.math_prompts import ANSWER_FORMAT, answer_prompt
from core.records import DataError
from datamodules.reasoning import ReasoningDataset, load_reasoning_sample, read_rows, write_jsonl


def _png(path, colour=(200, 30, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), colour).save(path)


def _png_bytes(colour=(30, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


ROWS = [
    {"id": "a", "image": "images/a.png", "problem": "<image>How many red shapes?", "answer": "3"},
    {"id": 7, "image": ["images/b.png"], "problem": "AB = 3; find BC.", "answer": 1.5, "source": "mmk12"},
]


@pytest.fixture
def folder(tmp_path):
    _png(tmp_path / "images" / "a.png")
    _png(tmp_path / "images" / "b.png", (0, 0, 255))
    return tmp_path


def _check(records, folder):
    assert [r.sample_id for r in records] == ["a", "7"]  # ids as text
    assert [r.answer for r in records] == ["3", "1.5"]  # a number answer kept as its text
    assert records[0].problem == "<image>How many red shapes?"
    assert records[1].meta == {"source": "mmk12"}  # other keys kept
    samples = list(ReasoningDataset(records))
    assert samples[1].image.size == (16, 12) and samples[1].image.getpixel((0, 0)) == (0, 0, 255)
    assert samples[0].image_path == str(folder / "images" / "a.png")
    assert samples[0].prompt == f"How many red shapes? {ANSWER_FORMAT}"  # <image> removed, the format appended


def test_jsonl(folder):
    path = write_jsonl(folder / "rows.jsonl", ROWS)
    assert path.read_text().splitlines()[0].startswith('{"id": "a", "image"')
    _check(read_rows(path), folder)


def test_json_list_and_data_object(folder):
    (folder / "rows.json").write_text(json.dumps(ROWS))
    _check(read_rows(folder / "rows.json"), folder)
    (folder / "data.json").write_text(json.dumps({"data": ROWS}))
    _check(read_rows(folder / "data.json"), folder)


def test_parquet_with_paths_and_embedded_bytes(folder):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame(
        {
            "id": ["p0", "p1", "p2"],
            "image": [
                {"bytes": _png_bytes(), "path": "x.png"},  # Hugging Face datasets' Image feature
                {"bytes": None, "path": "images/a.png"},  # a path only
                {"bytes": _png_bytes((1, 2, 3)), "path": None},
            ],
            "problem": ["P0", "P1", "P2"],
            "answer": [4, 5, 6],  # int64 column
        }
    )
    frame.to_parquet(folder / "rows.parquet")
    records = read_rows(folder / "rows.parquet")
    assert [r.answer for r in records] == ["4", "5", "6"]
    assert records[0].image_bytes is not None and records[1].image_path == folder / "images" / "a.png"
    samples = [load_reasoning_sample(r) for r in records]
    assert samples[0].image.getpixel((0, 0)) == (30, 200, 30)
    assert samples[2].image.getpixel((0, 0)) == (1, 2, 3) and samples[2].image_path is None
    assert samples[1].image.size == (16, 12)


def test_image_root_and_max_samples(folder, tmp_path_factory):
    other = tmp_path_factory.mktemp("rows")
    path = write_jsonl(other / "rows.jsonl", ROWS)
    records = read_rows(path, image_root=folder, max_samples=1)
    assert len(records) == 1 and load_reasoning_sample(records[0]).image.size == (16, 12)


def test_answer_prompt():
    assert answer_prompt("  What is 2 + 3?\n") == (
        "What is 2 + 3? You FIRST think about the reasoning process as an internal monologue and then provide the "
        "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE "
        "put in \\boxed{}."
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "x", "image": "images/a.png", "problem": "P"}', "missing 'answer'"),
        ('{"id": "x", "image": "images/a.png", "problem": "  ", "answer": "1"}', "'problem' must be a non-empty"),
        ('{"id": "x", "problem": "P", "answer": "1"}', "missing 'image'"),
        ('{"id": "x", "image": ["a.png", "b.png"], "problem": "P", "answer": "1"}', "one image a row, got 2"),
        ('{"id": "x", "image": "images/a.png", "problem": "P", "answer": true}', "missing 'answer'"),
        ('{"id": "x", "image": "images/a.png", "problem": "P", "answer": ["1"]}', "'answer' must be a non-empty"),
        ('{"id": "x", "image": "images/a.png", "problem": "P", "answer": "1"', "not valid JSON"),
        ('["id", "image"]', "expected an object"),
        ('{"id": "a", "image": "images/a.png", "problem": "P", "answer": "1"}', "duplicate id 'a'"),
    ],
)
def test_bad_jsonl_rows_name_the_file_and_line(folder, line, message):
    path = folder / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + line + "\n")
    with pytest.raises(DataError, match=message) as err:
        read_rows(path)
    assert f"{path}:3" in str(err.value)  # the blank line 2 is skipped but counted


def test_bad_json_rows_name_the_row(folder):
    path = folder / "bad.json"
    path.write_text(json.dumps([ROWS[0], {"id": "b", "image": "images/b.png", "answer": "2"}]))
    with pytest.raises(DataError, match=r"bad.json\[row 1\]: missing 'problem'"):
        read_rows(path)
    path.write_text('[{"id": "a",\n  "image": }]')
    with pytest.raises(DataError, match=r"bad.json:2: not valid JSON"):
        read_rows(path)
    path.write_text('{"id": "a"}')
    with pytest.raises(DataError, match="expected a JSON list"):
        read_rows(path)


def test_bad_files_and_images(folder):
    with pytest.raises(DataError, match="no such data file"):
        read_rows(folder / "missing.jsonl")
    (folder / "rows.csv").write_text("id,image\n")
    with pytest.raises(DataError, match="unknown format '.csv'"):
        read_rows(folder / "rows.csv")
    (folder / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        read_rows(folder / "empty.jsonl")
    (folder / "latin1.jsonl").write_bytes(b'{"id": "caf\xe9"}\n')
    with pytest.raises(DataError, match="latin1.jsonl:1: not UTF-8"):
        read_rows(folder / "latin1.jsonl")
    rows = [dict(ROWS[0], id="m", image="images/missing.png"), dict(ROWS[0], id="n", image="images/broken.png")]
    (folder / "images" / "broken.png").write_bytes(b"not a png")
    records = read_rows(write_jsonl(folder / "imgs.jsonl", rows))
    with pytest.raises(DataError, match=r"imgs.jsonl:1: image .*missing.png not found"):
        load_reasoning_sample(records[0])
    with pytest.raises(DataError, match=r"imgs.jsonl:2: the image cannot be read"):
        load_reasoning_sample(records[1])
    (folder / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(DataError, match="bad.parquet: not a readable parquet file"):
        read_rows(folder / "bad.parquet")


def test_parquet_missing_columns(folder):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"id": ["a"], "problem": ["P"]}).to_parquet(folder / "cols.parquet")
    with pytest.raises(DataError, match=r"cols.parquet: parquet columns \['image', 'answer'\] missing"):
        read_rows(folder / "cols.parquet")


def test_data_module_on_the_toy_math_world(tmp_path):
    from datamodules.reasoning import ReasoningDataModule, ReasoningSample
    from datamodules.toy_math import ToyMathSpec

    dm = ReasoningDataModule(data_root=str(tmp_path), toy=ToyMathSpec(splits={"train": 6, "val": 3, "ood": 2}),
                             batch_size=4, eval_batch_size=2)  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_files == ["train.jsonl"] and dm.eval_names("val") == ["toy_math_val", "toy_math_ood"]
    batches = list(dm.train_dataloader())
    assert [len(b) for b in batches] == [4, 2] and isinstance(batches[0][0], ReasoningSample)
    assert sorted(s.sample_id for b in batches for s in b) == [f"toymath-train-s0-{i:06d}" for i in range(6)]
    assert [s.sample_id for s in next(iter(dm.train_dataloader()))] == [s.sample_id for s in batches[0]]  # seeded
    val, ood = dm.val_dataloader()
    assert [len(b) for b in val] == [2, 1] and len(list(ood)) == 1
    assert next(iter(val))[0].prompt.endswith(ANSWER_FORMAT)
    # resumable mid-epoch (a killed co-evolution fit resumes from last.ckpt): after the first batch of epoch 1 the
    # loader's checkpointed state gives a new loader the rest of that epoch, not epoch 1 from its start again
    full = dm.train_dataloader()
    full.sampler.set_epoch(1)
    epoch_1 = [[s.sample_id for s in b] for b in full]
    again = dm.train_dataloader()
    again.load_state_dict({**full.state_dict(), "batches": 1})
    again.sampler.set_epoch(1)
    assert [[s.sample_id for s in b] for b in again] == epoch_1[1:] and epoch_1 != [
        [s.sample_id for s in b] for b in batches
    ]


def test_data_module_files_and_errors(folder):
    from datamodules.reasoning import ReasoningDataModule

    write_jsonl(folder / "a.jsonl", ROWS)
    write_jsonl(folder / "b.jsonl", [dict(ROWS[0], problem="another problem")])  # id "a" again
    dm = ReasoningDataModule(data_root=str(folder), train_files=["a.jsonl"], test_files={"mmk": "a.jsonl"})
    dm.setup("test")
    assert dm.train_set is None and dm.eval_names("test") == ["mmk"]
    with pytest.raises(DataError, match="no training data"):
        dm.train_dataloader()
    dm.setup("fit")
    assert len(dm.train_set) == 2
    clash = ReasoningDataModule(data_root=str(folder), train_files=["a.jsonl", "b.jsonl"])
    with pytest.raises(DataError, match=r"b.jsonl:1: id 'a' also at .*a.jsonl:1"):
        clash.setup("fit")
