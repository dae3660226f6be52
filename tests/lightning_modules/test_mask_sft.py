"""The mask-token co-SFT examples (methods/cycle_masks.MaskSFT), literally: what each kind's prompt shows and what
its target is, on toy scenes (spans: the tiny untrained toy tokenizer's codes of the exact target mask), a no-target
scene, and a parquet row without an expression."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoProcessor

from core.regions.mask_tokens import format_mask
from core.toy.masks import target_mask
from datamodules.cycle_seg import CycleSegDataModule, export_toy_parquet
from datamodules.toy import ToySceneDataset
from lightning_modules.methods.cycle_masks import MaskSFT, MaskSFTSpec, detailed_caption
from tests.cli.test_config_runs import TOY_CKPT, tiny_mask_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_mask_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(TOY_CKPT, local_files_only=True)


@pytest.fixture(scope="module")
def scenes():
    ds = ToySceneDataset("train", 40, 0, 224, "rec", mix={"train_nt": 0.5})
    return [ds[i] for i in range(len(ds))]


def _sft(tok_dir: Path, kind: str) -> MaskSFT:
    return MaskSFT(MaskSFTSpec(mask_tokenizer=str(tok_dir), mix={kind: 1.0}))


def test_segment_and_brief_caption_targets(tok_dir, processor, scenes):
    s = next(x for x in scenes if x.boxes)
    seg = _sft(tok_dir, "segment")
    span = format_mask(seg.regions.codec.encode(s.image, target_mask(s.meta), None))
    prompt, target, kind = seg.example(processor, s)
    assert kind == "segment" and target == f"<answer>{span}</answer>"
    assert f"Find: {s.query}" in prompt and "<|mt_" not in prompt
    prompt, target, kind = _sft(tok_dir, "brief").example(processor, s)
    assert kind == "brief" and f"Describe: {span}" in prompt and target == f"<answer>{s.query}</answer>"


def test_detailed_caption_names_the_target_in_words():
    meta = {
        "width": 224,
        "height": 224,
        "objects": [
            {"role": "target", "size": "large", "colour": "purple", "shape": "circle", "box": [56, 135, 100, 179]},
            {"role": "distractor", "size": "small", "colour": "red", "shape": "circle", "box": [0, 0, 20, 20]},
            {"role": "distractor", "size": "small", "colour": "red", "shape": "star", "box": [150, 0, 170, 20]},
        ],
    }

    class S:  # a sample's meta is all detailed_caption reads
        pass

    s = S()
    s.meta = meta
    # centre (78, 157) of 224 x 224: column 0.35 (middle third), row 0.70 (lower third); two circles in the scene
    assert (
        detailed_caption(s)
        == "the large purple circle in the lower centre of the image, one of two circles in the scene"
    )
    s.meta = {"detailed_caption": "a long one"}
    assert detailed_caption(s) == "a long one"
    s.meta = {}
    assert detailed_caption(s) is None


def test_no_target_scene_is_the_rejection_whatever_the_mix(tok_dir, processor, scenes):
    s = next(x for x in scenes if not x.boxes)
    prompt, target, kind = _sft(tok_dir, "brief").example(processor, s)
    assert kind == "no_target" and target == "<answer>No target.</answer>" and f"Find: {s.query}" in prompt


def test_kinds_follow_the_mix_by_id(tok_dir, scenes):
    sft = MaskSFT(MaskSFTSpec(mask_tokenizer=str(tok_dir), mix={"brief": 0.5, "segment": 0.5}))
    kinds = [sft.kind(s) for s in scenes if s.boxes]
    assert set(kinds) == {"brief", "segment"} and kinds == [sft.kind(s) for s in scenes if s.boxes]
    with pytest.raises(ValueError, match="mask_sft.mix"):
        MaskSFT(MaskSFTSpec(mix={"boxes": 1.0}))


def test_a_parquet_region_row_has_no_expression_to_teach(tmp_path, tok_dir, processor):
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

    path = export_toy_parquet(tmp_path / "rl.parquet", ToyMaskTokenizer.load(tok_dir), n=4)
    dm = CycleSegDataModule(data_root=str(tmp_path), parquet_files=[path.name])
    dm.setup("fit")
    with pytest.raises(ValueError, match="train the cold start on GRES"):
        _sft(tok_dir, "segment").example(processor, dm.train_set[0])
    _, target, kind = _sft(tok_dir, "segment").example(processor, dm.train_set[3])  # its gres_no_target row
    assert (kind, target) == ("no_target", "<answer>No target.</answer>")
