"""``python -m cli.evaluate gcg | gar-bench``: tiny GranD-f and GAR-Bench fixtures written here, the toy checkpoint end
to end with an untrained tiny mask tokenizer, hand-written completions decoded, the released scripts' outputs and our
own predictions files scored again, a tiny random BERT as the recall's text encoder, and the errors
(cli/evaluate_regions.py, evals/{gcg,gar_bench}.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli.evaluate import main
from core.regions.coco_masks import rle_decode, rle_encode
from core.regions.mask_tokens import format_mask
from evals.gar_bench import gar_question, read_gar_vqa, region_spans
from evals.gcg import read_gcg
from tests.cli.test_evaluate import TOY, tiny_mask_tokenizer


def _image(path: Path, w: int, h: int, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)


def _box(h: int, w: int, x1: int, y1: int, x2: int, y2: int) -> np.ndarray:
    m = np.zeros((h, w), dtype=bool)
    m[y1:y2, x1:x2] = True
    return m


GCG_IMAGES = {  # image id -> (w, h, caption, [(phrase, box)])
    "sa_2": (32, 32, "Two dogs on grass.", [("Two dogs", (2, 2, 12, 12))]),
    "sa_1": (40, 30, "A man riding a horse.", [("A man", (2, 3, 12, 9)), ("a horse", (20, 10, 30, 20))]),
}


def write_gcg_fixture(root: Path) -> dict[str, Path]:
    """GranD-f's val layout: two images (ids ``sa_2``, ``sa_1``: the caption file's order is not COCO's id order),
    three grounded phrases, masks as compressed RLE."""
    caps, masks = {"images": [], "annotations": []}, {"images": [], "annotations": [], "categories": [{"id": 1}]}
    for i, (key, (w, h, caption, phrases)) in enumerate(GCG_IMAGES.items()):
        _image(root / "images" / f"{key}.jpg", w, h, i)
        caps["images"].append({"id": key, "file_name": f"{key}.jpg", "height": h, "width": w})
        masks["images"].append({"id": key, "height": h, "width": w})
        caps["annotations"].append({"id": i, "image_id": key, "caption": caption, "labels": [p for p, _ in phrases]})
        for _, box in phrases:
            masks["annotations"].append({"id": len(masks["annotations"]), "image_id": key, "category_id": 1,
                                         "segmentation": rle_encode(_box(h, w, *box)), "iscrowd": 0})  # fmt: skip
    (root / "ann").mkdir(parents=True, exist_ok=True)
    (root / "ann" / "val_gcg_coco_caption_gt.json").write_text(json.dumps(caps))
    (root / "ann" / "val_gcg_coco_mask_gt.json").write_text(json.dumps(masks))
    return {"flags": ["--annotations", str(root / "ann"), "--image-root", str(root / "images")], "root": root}


def write_gar_fixture(root: Path) -> Path:
    """GAR-Bench VQA: three questions on two images, one with two regions; categories color and relation."""
    _image(root / "images" / "vqa_0.png", 40, 30, 3)
    _image(root / "images" / "vqa_1.png", 32, 32, 4)
    a, b = rle_encode(_box(30, 40, 2, 3, 14, 12)), rle_encode(_box(30, 40, 20, 10, 34, 24))
    items = [
        {"image": "images/vqa_0.png", "question": "What color is <Prompt0>?", "choices": ["(A) red", "(B) blue"],
         "answer": "A", "type": "color", "mask_rles": [a]},
        {"image": "images/vqa_0.png", "question": "Is <Prompt0> left of <Prompt1>?", "choices": ["(A) no", "(B) yes"],
         "answer": "B", "type": "relation", "mask_rles": [a, b]},
        {"image": "images/vqa_1.png", "question": "What color is <Prompt0>?", "choices": ["(A) red", "(B) green"],
         "answer": "B", "type": "color", "mask_rles": [rle_encode(_box(32, 32, 4, 4, 20, 20))]},
    ]  # fmt: skip
    path = root / "GAR-Bench-VQA.json"
    path.write_text(json.dumps(items))
    return path


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    root = tmp_path_factory.mktemp("regions")
    gcg, gar = write_gcg_fixture(root / "gcg"), write_gar_fixture(root / "gar")
    return {"gcg": gcg, "gar": gar, "tok": tiny_mask_tokenizer(root / "tok")}


def test_gcg_with_the_toy_policy_then_its_predictions_again(fx, tmp_path, capsys):
    out = tmp_path / "gcg.json"
    flags = ["--policy", TOY, "--mask-tokenizer", str(fx["tok"]), "--max-new-tokens", "6", "--device", "cpu"]
    assert main(["gcg", *fx["gcg"]["flags"], *flags, "--batch-size", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 2 and res["split"] == "val" and res["max_new_tokens"] == 6
    assert res["question"].startswith("Could you please give me a brief description of the image?")
    m = res["metrics"]
    assert m["n_gt_masks"] == 3 and m["meteor"] is None and m["recall"] is None  # no --text-encoder
    lines = [json.loads(x) for x in Path(res["predictions"]).read_text().splitlines()]
    assert [x["id"] for x in lines] == ["sa_2", "sa_1"] and all(x["completion"] for x in lines)
    # the toy policy was never taught mask tokens: no masks, so no detection, pair or match
    assert m["n_pred_masks"] == 0 and m["ap50"] == 0.0 and m["miou"] == 0.0 and m["recall_iou"] == 0.0
    caps = json.loads(Path(res["captions"]).read_text())
    assert [c["image_id"] for c in caps] == ["sa_2", "sa_1"] and caps[0]["caption"] == lines[0]["caption"]
    assert "gcg val: 2 images" in capsys.readouterr().out
    again = tmp_path / "again.json"
    assert main(["gcg", *fx["gcg"]["flags"], "--predictions", res["predictions"], "--out", str(again)]) == 0
    assert json.loads(again.read_text())["metrics"] == m


def test_gcg_completions_with_spans_are_decoded(fx, tmp_path):
    """Hand-written completions: phrases from the object-ref tags, one mask per span decoded by the tokenizer."""
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    tok = ToyMaskTokenizer.load(fx["tok"])
    img = np.asarray(Image.open(fx["gcg"]["root"] / "images" / "sa_1.jpg").convert("RGB"))
    c1, c2 = tok.encode(img, _box(30, 40, 2, 3, 12, 9)), tok.encode(img, _box(30, 40, 20, 10, 30, 20))
    ref = "<|object_ref_start|>{}<|object_ref_end|>{}"
    completions = {
        "sa_1": ref.format("A man", format_mask(c1)) + " riding " + ref.format("a horse", format_mask(c2)) + ".",
        "sa_2": "Two dogs on grass.<|im_end|>",  # no span: no mask
    }
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps({"id": k, "completion": v}) + "\n" for k, v in completions.items()))
    out = tmp_path / "gcg.json"
    flags = ["--predictions", str(path), "--mask-tokenizer", str(fx["tok"])]
    assert main(["gcg", *fx["gcg"]["flags"], *flags, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    lines = {x["id"]: x for x in map(json.loads, Path(res["predictions"]).read_text().splitlines())}
    assert lines["sa_1"]["caption"] == "A man riding a horse." and lines["sa_1"]["phrases"] == ["A man", "a horse"]
    assert lines["sa_1"]["codes"] == [list(c1), list(c2)] and lines["sa_2"]["masks"] == []
    assert (rle_decode(lines["sa_1"]["masks"][1]) == tok.decode(c2, img)).all()
    assert lines["sa_2"]["caption"] == "Two dogs on grass." and res["metrics"]["n_pred_masks"] == 2


def _tiny_bert(path: Path) -> Path:
    """A 1-layer BERT saved as a local folder (the real one is not here) whose similarities are known: every weight
    zero but the LayerNorm scales, so a token's last state is LayerNorm(its word embedding); each content word embeds
    as its own one-hot vector, ``[CLS]``, ``[SEP]`` and "a" as zeros. A phrase's mean-pooled state is then its content
    words' centred one-hots: the cosine of two different single words is -1/15, of a phrase with itself 1."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "man", "horse", "two", "dogs", "cat"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    cfg = BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    model = BertModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "LayerNorm.weight" in name else 0.0)
        for i in range(6, len(words)):
            model.embeddings.word_embeddings.weight[i, i] = 1.0
    model.save_pretrained(path)
    return path


def test_gcg_scores_the_released_per_image_files(fx, tmp_path, capsys):
    """The release's output folder (``<image id>.json``: caption, phrases, pred_masks) with the exact masks and
    captions: AP50, mIoU and recall are 1; CIDEr-D of a caption equal to its reference with no n-gram shared across
    the two images is 10. A swapped phrase fails the text check only with a text encoder."""
    folder = tmp_path / "release"
    folder.mkdir()
    for key, (w, h, caption, phrases) in GCG_IMAGES.items():
        obj = {"image_id": key, "caption": caption, "phrases": [p for p, _ in phrases],
               "pred_masks": [rle_encode(_box(h, w, *b)) for _, b in phrases]}  # fmt: skip
        if key == "sa_1":
            obj["phrases"] = ["a horse", "A man"]  # wrong order: mask 0 is "a horse"
        (folder / f"{key}.json").write_text(json.dumps({key: obj} if key == "sa_2" else obj))  # GLaMM's nested form too
    out = tmp_path / "release.json"
    assert main(["gcg", *fx["gcg"]["flags"], "--predictions", str(folder), "--out", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["ap50"] == pytest.approx(1.0) and m["miou"] == 1.0 and m["recall_iou"] == 1.0
    assert m["cider"] == pytest.approx(10.0) and m["recall"] is None
    bert = _tiny_bert(tmp_path / "bert")
    assert main(["gcg", *fx["gcg"]["flags"], "--predictions", str(folder), "--text-encoder", str(bert),
                 "--out", str(out)]) == 0  # fmt: skip
    m = json.loads(out.read_text())["metrics"]
    # "Two dogs" matches itself (cosine 1). On sa_1 the best pair (IoU 1) pairs "A man" with "a horse" (cosine -1/15):
    # GLaMM's loop stops there, though the masks match, so recall is 1 of 3 phrases
    from evals.gcg import BertSimilarity

    sim = BertSimilarity(bert)
    assert sim("Two dogs", "two dogs") == pytest.approx(1.0) and sim("A man", "a horse") == pytest.approx(-1 / 15)
    assert m["recall"] == pytest.approx(1 / 3) and m["recall_iou"] == 1.0


def test_gar_bench_with_the_toy_policy_then_the_released_output(fx, tmp_path, capsys):
    out = tmp_path / "gar.json"
    flags = ["--policy", TOY, "--mask-tokenizer", str(fx["tok"]), "--max-new-tokens", "4", "--device", "cpu"]
    assert main(["gar-bench", "--data", str(fx["gar"]), *flags, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 3 and res["metrics"]["type_counts"] == {"color": 2, "relation": 1}
    lines = [json.loads(x) for x in Path(res["predictions"]).read_text().splitlines()]
    assert [x["id"] for x in lines] == ["gar-0", "gar-1", "gar-2"] and [len(x["codes"]) for x in lines] == [1, 2, 1]
    assert res["metrics"]["correct"] == sum(x["correct"] for x in lines)
    # the regions are the tokenizer's codes of the masks, written into the question as spans
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    recs = read_gar_vqa(fx["gar"])
    image = Image.open(recs[1].image_path).convert("RGB")
    spans, codes = region_spans(recs[1], image, ToyMaskTokenizer.load(fx["tok"]))
    assert [list(c) for c in codes] == lines[1]["codes"]
    assert gar_question(recs[1], spans).startswith(f"Question: Is {format_mask(codes[0])} left of {spans[1]}?")
    assert "gar-bench: 3 questions" in capsys.readouterr().out
    # the release's output file: the benchmark's items with model_output, scored by exact match after cleaning
    items = json.loads(fx["gar"].read_text())
    for item, answer in zip(items, ["A.", "<think>\n\n</think>\n\nb", "A"]):
        item["model_output"] = answer
    release = tmp_path / "release.json"
    release.write_text(json.dumps(items))
    assert main(["gar-bench", "--data", str(fx["gar"]), "--predictions", str(release), "--out", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["accuracy"] == pytest.approx(2 / 3) and m["type_accuracy"] == {"color": 0.5, "relation": 1.0}
    again = tmp_path / "again.json"  # and our own predictions file, sharded and merged
    files = []
    for i in range(2):
        shard = tmp_path / f"gar_{i}.json"
        assert main(["gar-bench", "--data", str(fx["gar"]), "--predictions", str(release), "--shard", f"{i}/2",
                     "--out", str(shard)]) == 0  # fmt: skip
        files.append(json.loads(shard.read_text())["predictions"])
    assert main(["gar-bench", "--data", str(fx["gar"]), "--predictions", *files, "--out", str(again)]) == 0
    assert json.loads(again.read_text())["metrics"] == m


def test_errors_exit_with_one_line(fx, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit) as e:
        main(["gcg", *fx["gcg"]["flags"], "--out", out])
    assert e.value.code == 2 and "give --policy (run the policy) or --predictions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["gar-bench", "--data", str(fx["gar"]), "--policy", TOY, "--out", out])
    assert e.value.code == 2 and "needs --mask-tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["gcg", *fx["gcg"]["flags"], "--split", "train", "--predictions", out, "--out", out])
    assert e.value.code == 3 and "GranD-f's GCG evaluation has the splits val and test" in capsys.readouterr().err
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"id": "sa_1", "caption": "x", "phrases": [], "masks": []}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["gcg", *fx["gcg"]["flags"], "--predictions", str(one), "--out", out])
    assert e.value.code == 3 and "1 of 2 images have no prediction (first: 'sa_2')" in capsys.readouterr().err
    wrong = tmp_path / "wrong.jsonl"  # a mask of the wrong size
    five = rle_encode(np.ones((5, 5), bool))
    wrong.write_text(
        "".join(json.dumps({"id": k, "caption": "x", "phrases": ["x"], "masks": [five]}) + "\n" for k in GCG_IMAGES)
    )
    with pytest.raises(SystemExit) as e:
        main(["gcg", *fx["gcg"]["flags"], "--predictions", str(wrong), "--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 3 and "image 'sa_2'" in err and "predicted mask 0 is [5, 5], the image [32, 32]" in err
    bad = json.loads(fx["gar"].read_text())
    bad[1]["question"] = "Is <Prompt0> left of <Prompt2>?"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(SystemExit) as e:
        main(
            [
                "gar-bench",
                "--data",
                str(path),
                "--image-root",
                str(fx["gar"].parent),
                "--predictions",
                out,
                "--out",
                out,
            ]
        )
    assert e.value.code == 3 and "item 1: the question names <Prompt2> but there are 2 masks" in capsys.readouterr().err


def test_gcg_reader_names_the_defect(fx, tmp_path):
    from core.records import DataError

    recs = read_gcg(fx["gcg"]["root"] / "ann", fx["gcg"]["root"] / "images", "val", max_samples=1)
    assert [r.sample_id for r in recs] == ["sa_2"] and recs[0].labels == ["Two dogs"]
    caps = json.loads((fx["gcg"]["root"] / "ann" / "val_gcg_coco_caption_gt.json").read_text())
    caps["annotations"][1]["labels"] = "A man"
    (tmp_path / "val_gcg_coco_caption_gt.json").write_text(json.dumps(caps))
    (tmp_path / "val_gcg_coco_mask_gt.json").write_text("{}")
    with pytest.raises(DataError, match="val_gcg_coco_mask_gt.json: a COCO file is an object with an 'annotations'"):
        read_gcg(tmp_path, tmp_path)
    (tmp_path / "val_gcg_coco_mask_gt.json").write_text('{"annotations": []}')
    with pytest.raises(DataError, match=r"annotations\[1\]: 'labels' must be a list of phrases"):
        read_gcg(tmp_path, tmp_path)
