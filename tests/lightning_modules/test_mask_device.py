"""The mask tokenizer's device and batching (issue 55 item 3, the CPU parts): VQ-SAM2 runs where it is told (the
configured device, else the policy's), a batched decode equals one-by-one decodes exactly while encoding each image
once, and a CycleGRPO step decodes each distinct code pair of a sample once, counted on a tiny random VQ-SAM2."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _rollout
from test_cycle_masks import _hp, _toy_sample
from test_mask_tokenizer import tiny_vq_sam2  # noqa: F401 (the fixture)

from core.regions.mask_tokens import format_mask
from lightning_modules.methods.cycle_masks import MaskRegions
from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer, released_state_dict


@pytest.fixture(scope="module")
def released_dir(tiny_vq_sam2, tmp_path_factory):  # noqa: F811
    """A folder in the release's layout: mask_tokenizer_256x2.pth beside a transformers SAM 2 folder."""
    out = tmp_path_factory.mktemp("vq")
    torch.save(released_state_dict(tiny_vq_sam2), out / "mask_tokenizer_256x2.pth")
    tiny_vq_sam2.sam.save_pretrained(out / "sam2")
    return out


def _devices(tok: VQSam2MaskTokenizer) -> set[str]:
    return {p.device.type for p in tok.net.parameters()} | {b.device.type for b in tok.net.buffers()}


def test_the_tokenizer_runs_on_the_configured_device_else_the_policys(released_dir):
    pinned = MaskRegions(str(released_dir), device="cpu")
    assert pinned.codec.device == torch.device("cpu") and _devices(pinned.codec) == {"cpu"}
    pinned.place(torch.device("meta"))  # a configured device wins over the policy's
    assert _devices(pinned.codec) == {"cpu"}
    follows = MaskRegions(str(released_dir))
    follows.place(torch.device("meta"))  # no device configured: the policy's ("meta" stands in for an accelerator)
    assert follows.codec.device == torch.device("meta") and _devices(follows.codec) == {"meta"}
    with pytest.raises(ValueError, match="mask_device is read by region_space mask only"):
        build_test_method("cycle_grpo", _hp(), {"mask_device": "cpu"})


def test_batched_decode_equals_one_by_one_and_encodes_each_image_once(tiny_vq_sam2):  # noqa: F811
    tok = VQSam2MaskTokenizer(copy.deepcopy(tiny_vq_sam2), threshold=-1.0, batch_size=4)  # ~ the logits' median
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8), rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)]
    codes = [tuple(int(c) for c in rng.integers(0, 256, 2)) for _ in range(10)]
    batched = tok.decode_batch(codes, [images[i % 2] for i in range(10)])
    assert (tok.n_images, tok.n_decoded) == (2, 10)  # one image encoding per image, two decoder calls of <= 4 each
    single = [tok.decode(c, images[i % 2]) for i, c in enumerate(codes)]
    assert (tok.n_images, tok.n_decoded) == (12, 20)
    assert all(np.array_equal(a, b) for a, b in zip(batched, single))
    assert 0 < sum(m.mean() for m in batched) / 10 < 1  # neither empty nor full: the comparison means something
    with pytest.raises(ValueError, match="one image per code pair"):
        tok.decode_batch(codes, images)


def test_a_step_decodes_each_distinct_code_pair_of_a_sample_once(released_dir):
    m = build_test_method(
        "cycle_grpo",
        _hp(),
        {"n_captions": 2, "k_groundings": 2, "region_space": "mask", "mask_tokenizer": str(released_dir)},
    )
    tok = m.masks.codec
    s, nt = _toy_sample(0), _toy_sample(1, no_target=True)
    a, b, c = format_mask((1, 2)), format_mask((3, 4)), format_mask((5, 6))
    texts = [
        "<answer>the circle</answer>",
        "<answer>the square</answer>",
        f"<answer>{a}</answer>",  # caption 0's groundings: a, a + b
        f"<answer>{a}{b}</answer>",
        f"<answer>{b}</answer>",  # caption 1's: b again, nothing
        "<answer>no target</answer>",
        f"<answer>{a}</answer>",  # the no-target sample's: a and c on another image
        f"<answer>{c}{c}</answer>",
    ]
    m.masks.mark()  # what the rollout does at a step's start: the step's tokenizer figures count from here
    scores = m.score([s, nt], _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4]))
    assert len(scores.total) == 8
    # s's image: a, b; nt's image: a, c -> 4 code pairs, 2 image encodings, where one by one would decode 7 spans
    assert (tok.n_decoded, tok.n_images) == (4, 2)
    logs = m.train_logs(scores, _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4]))
    assert logs["train/cycle/mask_decodes"] == 4 and logs["train/cycle/mask_decode_s"] > 0
    m.score([s, nt], _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4]))  # the same samples again: all cached
    assert tok.n_decoded == 4
