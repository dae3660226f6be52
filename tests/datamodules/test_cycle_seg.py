"""CycleGRPO's real-data loader (datamodules/cycle_seg.py) and the mask method's ground truth from it
(methods/cycle_masks.py): one target drawn per read, seeded by epoch and resumable; no-target rows; GRES's exact
masks. Fixtures are written here: toy scenes in the released parquet's schema (masks encoded by the tiny untrained
toy tokenizer) and tests/datamodules/test_cycle_data.py's GRES files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from core.regions import NO_TARGET
from core.regions.mask_tokens import format_mask
from datamodules.cycle_parquet import read_cycle_parquet
from datamodules.cycle_seg import CycleSegDataModule, GresFiles, draw_target, export_toy_parquet
from lightning_modules.methods.cycle_masks import MaskRegions, gt_pixel_mask
from tests.cli.test_config_runs import tiny_mask_tokenizer
from tests.datamodules.test_cycle_data import write_gres_fixture


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_mask_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def parquet(tmp_path_factory, tok_dir) -> Path:
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    return export_toy_parquet(tmp_path_factory.mktemp("rl") / "rl.parquet", ToyMaskTokenizer.load(tok_dir), n=8)


def test_toy_parquet_has_the_released_schema(parquet):
    rows = read_cycle_parquet(parquet, parquet.parent)  # the strict reader: spans shown in the prompt, images found
    assert [r.source for r in rows] == ["denseworld_multiple"] * 3 + ["gres_no_target"] + [
        "denseworld_multiple"
    ] * 3 + ["gres_no_target"]
    assert [len(r.codes) for r in rows] == [1, 2, 1, 0, 1, 2, 1, 0]  # odd rows: two targets
    assert rows[3].query.startswith("Please segment the ") and rows[3].seg_answer == "<answer>No target.</answer>"


def test_one_target_per_read_seeded_by_epoch(parquet):
    dm = CycleSegDataModule(data_root=str(parquet.parent), parquet_files=[parquet.name], seed=3)
    dm.setup("fit")
    ds, row = dm.train_set, dm.train_set.rows[1]
    picks = [ds[(e, 1)].meta["mask_codes"] for e in range(16)]
    assert all(len(p) == 1 and p[0] in row.codes for p in picks)  # one target of the row's two
    assert {p[0] for p in picks} == set(row.codes)  # epochs draw both
    assert ds[(5, 1)].meta["mask_codes"] == picks[5]  # the draw depends on (seed, epoch, index) only
    assert [draw_target(row, 3, e, 1) for e in range(16)] == [row.codes.index(p[0]) for p in picks]
    nt = ds[(0, 3)]
    assert nt.boxes == [] and nt.meta["mask_codes"] == [] and nt.meta["no_target"] and nt.query


def test_loader_resumes_mid_epoch_with_the_same_targets(parquet):
    def loader():
        dm = CycleSegDataModule(data_root=str(parquet.parent), parquet_files=[parquet.name], batch_size=3, seed=1)
        dm.setup("fit")
        return dm.train_dataloader()

    def ids(batch):
        return [(s.sample_id, s.meta["mask_codes"]) for s in batch]

    full = loader()
    full.sampler.set_epoch(1)
    batches = [ids(b) for b in full]
    state = dict(full.state_dict(), batches=1)  # a checkpoint written after the epoch's first batch
    again = loader()
    again.load_state_dict(state)
    again.sampler.set_epoch(1)
    assert [ids(b) for b in again] == batches[1:]
    assert sorted(i for b in batches for i, _ in b) == sorted(f"rl-{i}" for i in range(8))


def test_mask_regions_read_the_rows_codes_and_no_target(parquet, tok_dir):
    dm = CycleSegDataModule(data_root=str(parquet.parent), parquet_files=[parquet.name])
    dm.setup("fit")
    masks = MaskRegions(str(tok_dir))
    s = dm.train_set[(0, 0)]
    (codes,) = s.meta["mask_codes"]
    assert masks.region_text(s) == format_mask(codes)  # the row's own span, not a re-encoding of its decoded mask
    assert masks.gt_codes(s) == [codes]
    decoded = masks.codec.decode(codes, s.image)
    assert np.array_equal(masks.gt(s), decoded) and decoded.any()
    assert masks.consistency(s, masks.gt(s), decoded, f"<answer>{format_mask(codes)}</answer>") == 1.0
    assert masks.gt(dm.train_set[(0, 3)]) is NO_TARGET
    with pytest.raises(ValueError, match="needs the mask tokenizer"):
        gt_pixel_mask(s)


def test_gres_records_carry_exact_masks(tmp_path, tok_dir):
    f = write_gres_fixture(tmp_path)
    gres = GresFiles(grefs=str(f["grefs"]), instances=str(f["instances"]), image_root=str(f["images"]), split="val")
    dm = CycleSegDataModule(data_root=str(tmp_path), gres=gres, gres_val_split="testA", max_eval_samples=4)
    dm.setup("fit")
    samples = [dm.train_set[i] for i in range(len(dm.train_set))]
    assert [s.query for s in samples] == ["the left box", "small box", "both boxes", "the purple giraffe"]
    left = samples[0]
    assert left.meta["mask"].sum() == 10 * 6 and left.boxes == [[2.0, 3.0, 12.0, 9.0]]
    assert np.array_equal(gt_pixel_mask(left), left.meta["mask"])  # the exact mask, not the box
    assert gt_pixel_mask(samples[2]).sum() == 60 + 100  # a two-object target: the union
    giraffe = samples[3]
    assert giraffe.boxes == [] and "mask" not in giraffe.meta and MaskRegions(str(tok_dir)).gt(giraffe) is NO_TARGET
    (crowd,) = [dm.eval_sets["val"]["gres_testA"][i] for i in range(1)]
    assert crowd.meta["mask"].sum() == 60


def test_the_method_loads_the_released_vq_sam2_folder(tmp_path, parquet):
    """``mask_tokenizer: <folder>`` with the release's ``mask_tokenizer_256x2.pth`` beside a SAM 2 folder (a tiny
    random VQ-SAM2 written in the released layout; the real weights are not here) gives the method that tokenizer,
    and a row's codes decode with it into the ground truth."""
    import torch

    from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer, VQSam2Net, released_state_dict
    from tests.lightning_modules.test_mask_tokenizer import _tiny_sam2_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = VQSam2Net(_tiny_sam2_config())
        with torch.no_grad():
            net.quantizer.embed.normal_()
            net.quantizer.initted.fill_(True)
    torch.save(released_state_dict(net), tmp_path / "mask_tokenizer_256x2.pth")
    with pytest.raises(FileNotFoundError, match="one SAM 2"):
        MaskRegions(str(tmp_path))
    net.sam.save_pretrained(tmp_path / "sam2")
    masks = MaskRegions(str(tmp_path))
    assert isinstance(masks.codec, VQSam2MaskTokenizer)
    dm = CycleSegDataModule(data_root=str(parquet.parent), parquet_files=[parquet.name])
    dm.setup("fit")
    s = dm.train_set[(0, 0)]
    want = masks.codec.decode(s.meta["mask_codes"][0], np.asarray(s.image))
    assert np.array_equal(gt_pixel_mask(s, decode=masks.bound(s).decode), want)
