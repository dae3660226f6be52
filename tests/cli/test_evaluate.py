"""``python -m cli.evaluate gres | groundingsuite``: the scores by hand, the toy checkpoint end to end on tiny GRES
fixtures with an untrained tiny mask tokenizer, and the predictions-file mode (our own files and the released
GroundingSuite script's) (cli/evaluate.py, evals/benchmarks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cli.evaluate import main
from core.regions.coco_masks import rle_decode, rle_encode
from core.regions.mask_tokens import format_mask
from datamodules.gres import load_seg_sample, read_gres
from evals.benchmarks import GresScorer, GroundingSuiteScorer
from tests.datamodules.test_cycle_data import write_gres_fixture, write_groundingsuite_fixture

TOY = "checkpoints/toy-qwen2.5-vl"


def tiny_mask_tokenizer(out: Path) -> Path:
    """An untrained tiny toy mask tokenizer in ``out`` (as tests/cli/test_config_runs.py builds it)."""
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer, ToyVQConfig, ToyVQNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = ToyVQNet(ToyVQConfig(crop=16, width=8, latent=16))
    return ToyMaskTokenizer(net).save(out)


def _box_mask(h: int, w: int, y1: int, y2: int, x1: int, x2: int) -> np.ndarray:
    m = np.zeros((h, w), dtype=bool)
    m[y1:y2, x1:x2] = True
    return m


def test_gres_scores_by_hand():
    # target 4x4 = 16 px, prediction 4x2 inside it: I 8, U 16, IoU 0.5 (T-acc: answered)
    # target 16 px, empty prediction: IoU 0, the union gains 16 (T-acc: not answered)
    # no target, empty prediction: IoU 1, N-acc TP, nothing cumulated
    # no target, 6 px false alarm: IoU 0, N-acc FN, the union gains 6
    s = GresScorer()
    t, e = _box_mask(8, 8, 0, 4, 0, 4), np.zeros((8, 8), dtype=bool)
    ious = [
        s.update(t, _box_mask(8, 8, 0, 4, 0, 2)),
        s.update(t, e),
        s.update(e, e),
        s.update(e, _box_mask(8, 8, 5, 7, 5, 8)),
    ]
    assert ious == [0.5, 0.0, 1.0, 0.0]
    got = s.compute()
    assert got["giou"] == pytest.approx(1.5 / 4) and got["ciou"] == pytest.approx(8 / (16 + 16 + 6))
    assert got["n_acc"] == 0.5 and got["t_acc"] == 0.5
    with pytest.raises(ValueError, match=r"predicted mask \[4, 4\] vs ground truth \[8, 8\]"):
        s.update(t, np.zeros((4, 4), dtype=bool))


def test_groundingsuite_scores_by_hand():
    s = GroundingSuiteScorer()
    t = _box_mask(6, 6, 0, 2, 0, 2)
    s.update(t, t, class_id=3)
    s.update(t, _box_mask(6, 6, 0, 1, 0, 2), class_id=3)  # half of it: 0.5
    s.update(t, np.zeros((6, 6), dtype=bool), class_id=10)
    got = s.compute()
    assert got["giou"] == pytest.approx(0.5) and got["class_giou"] == {"3": 0.75, "10": 0.0}
    assert list(got["class_counts"]) == ["3", "10"]  # numeric order, not text order


@pytest.fixture(scope="module")
def gres(tmp_path_factory):
    root = tmp_path_factory.mktemp("gres")
    f = write_gres_fixture(root)
    f["tok"] = tiny_mask_tokenizer(root / "tok")
    f["flags"] = ["--grefs", str(f["grefs"]), "--instances", str(f["instances"]), "--image-root", str(f["images"])]
    return f


def test_gres_with_the_toy_policy_end_to_end(gres, tmp_path, capsys):
    out = tmp_path / "gres_val.json"
    flags = ["--policy", TOY, "--mask-tokenizer", str(gres["tok"]), "--template", "toy", "--max-new-tokens", "8"]
    assert main(["gres", *gres["flags"], *flags, "--device", "cpu", "--batch-size", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 4 and res["split"] == "val" and res["template"] == "toy"
    assert set(res["metrics"]) == {"giou", "ciou", "n_acc", "t_acc"} and sum(res["answers"].values()) == 4
    lines = [json.loads(x) for x in Path(res["predictions"]).read_text().splitlines()]
    assert [x["id"] for x in lines] == ["gres-val-0-100", "gres-val-0-101", "gres-val-1-102", "gres-val-2-103"]
    assert all(x["completion"] for x in lines) and [x["no_target"] for x in lines] == [False, False, False, True]
    # the toy policy was never taught mask tokens: it answers boxes, i.e. no mask (a rejection under GRES's rules)
    assert res["answers"] == {"unreadable": 4} and res["metrics"]["t_acc"] == 0.0 and res["metrics"]["n_acc"] == 1.0
    assert res["metrics"]["giou"] == pytest.approx(0.25)  # only the no-target expression scores (1 of 4)
    assert "gres: 4 samples" in capsys.readouterr().out
    # its predictions file scores again to the same numbers, without the policy
    again = tmp_path / "again.json"
    assert main(["gres", *gres["flags"], "--predictions", res["predictions"], "--out", str(again)]) == 0
    assert json.loads(again.read_text())["metrics"] == res["metrics"]


def test_gres_predictions_with_mask_tokens_are_decoded(gres, tmp_path):
    """Completions that write spans: each decodes on its image with the mask tokenizer, the union is the mask."""
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    tok = ToyMaskTokenizer.load(gres["tok"])
    recs = read_gres(gres["grefs"], gres["instances"], gres["images"], "val")
    samples = [load_seg_sample(r) for r in recs]
    codes = [tok.encode(np.asarray(s.image), r.mask()) for s, r in zip(samples[:3], recs[:3])]
    completions = [
        f"<answer>{format_mask(codes[0])}</answer>",
        "<answer>no target</answer>",  # a miss
        f"{format_mask(codes[2])} and {format_mask(codes[0])}",  # two spans, no tags: the union of both
        f"<answer>{format_mask(codes[1])}</answer>",  # a false alarm on the no-target expression
    ]
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps({"id": r.sample_id, "completion": c}) + "\n" for r, c in zip(recs, completions)))
    out = tmp_path / "scored.json"
    assert (
        main(
            [
                "gres",
                *gres["flags"],
                "--predictions",
                str(path),
                "--mask-tokenizer",
                str(gres["tok"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    lines = [json.loads(x) for x in Path(res["predictions"]).read_text().splitlines()]
    assert [x["answer"] for x in lines][:2] == ["region", "no_target"] and lines[2]["codes"] == [
        list(codes[2]),
        list(codes[0]),
    ]
    img = [np.asarray(s.image) for s in samples]
    dec0 = tok.decode(codes[0], img[0])
    assert (rle_decode(lines[0]["mask"]) == dec0).all()
    assert (rle_decode(lines[2]["mask"]) == (tok.decode(codes[2], img[2]) | dec0)).all()
    # the scores are GRES's on these masks, by the scorer
    s = GresScorer()
    want = [s.update(r.mask(), rle_decode(x["mask"])) for r, x in zip(recs, lines)]
    assert [x["iou"] for x in lines] == want and lines[1]["iou"] == 0.0
    assert res["metrics"] == s.compute()
    assert res["metrics"]["n_acc"] == (1.0 if lines[3]["answer"] == "empty" else 0.0)  # a span decoding to nothing


def test_groundingsuite_scores_the_released_prediction_format(tmp_path):
    data = write_groundingsuite_fixture(tmp_path)
    gts = [rle_decode(json.loads(x)["segmentation"]) for x in data.read_text().splitlines()]
    half = gts[1].copy()
    half[:11] = False  # rows 4..10 of rows 4..17: 7 of 14 rows
    preds = [gts[0], half, np.zeros_like(gts[2])]
    path = tmp_path / "groundingsuite_pred.jsonl"  # what the release's infer script merges
    path.write_text("".join(json.dumps({"idx": i, "image_path": "x", "predicted_box": [0, 0, 0, 0],
                                        "predicted_segmentation": rle_encode(p), "class_id": c}) + "\n"
                            for i, (p, c) in enumerate(zip(preds, [0, 0, 2]))))  # fmt: skip
    out = tmp_path / "gs.json"
    assert main(["groundingsuite", "--data", str(data), "--predictions", str(path), "--out", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["class_giou"] == {"0": 0.75, "2": 0.0} and m["giou"] == pytest.approx(0.5)
    assert m["class_counts"] == {"0": 2, "2": 1}


def test_errors_exit_with_one_line(gres, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--out", out])
    assert e.value.code == 2 and "give --policy (run the policy) or --predictions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--policy", TOY, "--out", out])
    assert e.value.code == 2 and "needs --mask-tokenizer" in capsys.readouterr().err
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"id": "gres-val-0-100", "mask": rle_encode(np.zeros((30, 40), bool))}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--predictions", str(path), "--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 3 and "3 of 4 samples have no prediction (first: 'gres-val-0-101')" in err
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--split", "testB", "--predictions", str(path), "--out", out])
    assert e.value.code == 3 and "no ref of split 'testB'" in capsys.readouterr().err


def test_groundingsuite_with_the_toy_policy(gres, tmp_path):
    data = write_groundingsuite_fixture(tmp_path)
    out = tmp_path / "gs.json"
    flags = ["--policy", TOY, "--mask-tokenizer", str(gres["tok"]), "--max-new-tokens", "4", "--max-samples", "2"]
    assert main(["groundingsuite", "--data", str(data), *flags, "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["template"] == "groundingsuite" and res["max_new_tokens"] == 4  # the release's question by default
    assert res["n"] == 2 and res["metrics"]["class_counts"] == {"0": 2}
    assert res["metrics"]["giou"] == 0.0  # no mask tokens written: empty masks against real targets


def test_predictions_decoded_by_a_vq_sam2_tokenizer_in_the_released_layout(gres, tmp_path):
    """``--mask-tokenizer <release .pth> --sam2 <SAM 2>``: a tiny random VQ-SAM2 written in the released layout
    decodes the completions' spans (the real weights are not here)."""
    from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer, VQSam2Net, released_state_dict
    from tests.lightning_modules.test_mask_tokenizer import _tiny_sam2_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = VQSam2Net(_tiny_sam2_config())
        with torch.no_grad():
            net.quantizer.embed.normal_()
            net.quantizer.initted.fill_(True)
    torch.save(released_state_dict(net), tmp_path / "mask_tokenizer_256x2.pth")
    net.sam.save_pretrained(tmp_path / "sam2-hf")
    recs = read_gres(gres["grefs"], gres["instances"], gres["images"], "val")
    path = tmp_path / "preds.jsonl"
    spans = [format_mask((i, 255 - i)) for i in range(len(recs))]
    path.write_text("".join(json.dumps({"id": r.sample_id, "completion": s}) + "\n" for r, s in zip(recs, spans)))
    out = tmp_path / "scored.json"
    tok_flags = ["--mask-tokenizer", str(tmp_path / "mask_tokenizer_256x2.pth"), "--sam2", str(tmp_path / "sam2-hf")]
    assert main(["gres", *gres["flags"], "--predictions", str(path), *tok_flags, "--out", str(out)]) == 0
    lines = [json.loads(x) for x in Path(json.loads(out.read_text())["predictions"]).read_text().splitlines()]
    tok = VQSam2MaskTokenizer.from_files(tmp_path / "sam2-hf", tmp_path / "mask_tokenizer_256x2.pth")
    for r, x, i in zip(recs, lines, range(len(recs))):
        assert x["codes"] == [[i, 255 - i]]
        want = tok.decode((i, 255 - i), np.asarray(load_seg_sample(r).image))
        assert (rle_decode(x["mask"]) == want).all() and x["answer"] == ("region" if want.any() else "empty")


def test_shards_merge_into_the_whole_split(gres, tmp_path, capsys):
    """``--shard I/N`` runs every N-th expression (one GPU's share); the shards' predictions files score together."""
    flags = ["--policy", TOY, "--mask-tokenizer", str(gres["tok"]), "--template", "toy", "--max-new-tokens", "4"]
    files = []
    for i in range(2):
        out = tmp_path / f"gres_{i}.json"
        assert main(["gres", *gres["flags"], *flags, "--device", "cpu", "--shard", f"{i}/2", "--out", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["n"] == 2 and res["shard"] == f"{i}/2"
        files.append(res["predictions"])
    ids = [json.loads(x)["id"] for f in files for x in Path(f).read_text().splitlines()]
    assert sorted(ids) == sorted(r.sample_id for r in read_gres(gres["grefs"], gres["instances"], gres["images"]))
    merged = tmp_path / "gres.json"
    assert main(["gres", *gres["flags"], "--predictions", *files, "--out", str(merged)]) == 0
    res = json.loads(merged.read_text())
    assert res["n"] == 4 and res["metrics"]["giou"] == pytest.approx(0.25) and res["metrics"]["n_acc"] == 1.0
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--predictions", files[0], files[0], "--out", str(merged)])
    assert e.value.code == 3 and "a second prediction for" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["gres", *gres["flags"], "--predictions", files[0], "--shard", "2/2", "--out", str(merged)])
    assert e.value.code == 2 and "need 0 <= I < N" in capsys.readouterr().err
