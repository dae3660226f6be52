"""CycleGRPO with ``region_space: mask`` (lightning_modules/methods/cycle_masks.py): the tokenizer argument's errors,
the ground truth (the toy scene's exact mask), the captioning prompt's span, and the mask consistencies worked by hand
on a stand-in codec whose decoded masks are known. configs/overlays/cycle_tiny_mask.yaml runs real fit steps in
tests/cli/test_config_runs.py (an untrained tiny tokenizer swapped in)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _rollout

from core.records import Sample
from core.regions import NO_TARGET, region_space
from core.regions.checks import caption_phi, localization_phi
from core.regions.mask_rewards import mask_iou
from core.regions.mask_tokens import format_mask
from core.toy.masks import target_mask
from datamodules.toy import make_scene
from lightning_modules.methods.cycle_rewards import caption_text
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer, ToyVQConfig, ToyVQNet


def _hp():
    return SimpleNamespace(prompt_template="toy", advantage_scale="group", advantage_eps=0.0)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    torch.manual_seed(0)
    return ToyMaskTokenizer(ToyVQNet(ToyVQConfig(crop=16, width=8, latent=16))).save(tmp_path_factory.mktemp("mt"))


def _toy_sample(index: int = 0, no_target: bool = False) -> Sample:
    rec = make_scene("val", index, 0)
    boxes = [] if no_target else [[float(v) for v in rec["solution"]]]
    return Sample(f"s{index}", rec["image"], rec["meta"]["query"], boxes, meta=rec["meta"])


class _Codec:
    """Encodes every mask as (5, 7); decodes (c1, c2) to a 40 x 40 square at (4 * c1, 4 * c2), and code 0 to
    nothing."""

    def encode(self, image, mask, box=None):
        return 5, 7

    def decode(self, codes, image):
        out = np.zeros(np.asarray(image).shape[:2], dtype=bool)
        if codes[0]:
            out[4 * codes[1] : 4 * codes[1] + 40, 4 * codes[0] : 4 * codes[0] + 40] = True
        return out


def _method(tokenizer_dir, codec=None, **args):
    m = build_test_method(
        "cycle_grpo",
        _hp(),
        {"n_captions": 2, "k_groundings": 2, "region_space": "mask", "mask_tokenizer": str(tokenizer_dir), **args},
    )
    if codec is not None:  # the stand-in codec: decoded masks known by hand
        m.masks.codec = codec
        m.regions.space = m.masks.space = region_space("mask", codec=codec)
    return m


def test_mask_space_needs_its_tokenizer(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"init_args\.mask_tokenizer.*cli\.mask_tokenizer --out"):
        build_test_method("cycle_grpo", _hp(), {"region_space": "mask"})
    with pytest.raises(FileNotFoundError, match=r"init_args\.mask_tokenizer.*cli\.mask_tokenizer --out"):
        build_test_method("cycle_grpo", _hp(), {"region_space": "mask", "mask_tokenizer": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="region_space mask only"):
        build_test_method("cycle_grpo", _hp(), {"region_space": "box", "mask_tokenizer": str(tokenizer_dir)})
    with pytest.raises(ValueError, match="mask_reward"):
        _method(tokenizer_dir, mask_reward="dice")
    with pytest.raises(ValueError, match="mask_tokens true"):  # a policy loaded without the 514 tokens
        _method(tokenizer_dir).masks.check_processor(SimpleNamespace(tokenizer=SimpleNamespace(get_vocab=dict)))


def test_the_ground_truth_is_the_exact_mask_and_the_prompt_shows_its_span(tokenizer_dir):
    m = _method(tokenizer_dir)
    s, nt = _toy_sample(0), _toy_sample(1, no_target=True)
    r = m.regions
    gt = r.gt_region(s)
    assert np.array_equal(gt, target_mask(s.meta)) and r.space_for(s) is r.space_for(s)  # one bound space
    assert r.gt_region(nt) is NO_TARGET and m.layout([s, nt]) == ([0], [1])
    tok = ToyMaskTokenizer.load(tokenizer_dir)
    assert r.region_text(None, s) == format_mask(tok.encode(s.image, gt))  # the real tokenizer's two codes
    assert r.region_text(None, nt) == "no target"
    assert caption_text(f"<answer>the {r.region_text(None, s)} circle</answer>") == "the circle"  # no leak downstream
    # a perfect grounding (the span itself) decodes to what the tokenizer makes of the mask
    pred = r.predicted_region(s, f"<answer>{r.region_text(None, s)}</answer>", (224, 224))
    decoded = tok.decode(tok.encode(s.image, gt), s.image)
    assert (pred is NO_TARGET) if not decoded.any() else np.array_equal(pred, decoded)


@pytest.mark.parametrize("mask_reward", ["tokens", "iou"])
def test_mask_cycle_rewards_by_hand(tokenizer_dir, mask_reward):
    m = _method(tokenizer_dir, _Codec(), mask_reward=mask_reward)
    s, nt = _toy_sample(0), _toy_sample(1, no_target=True)
    gt = target_mask(s.meta)
    span = m.regions.region_text(None, s)
    assert span == format_mask((5, 7))
    texts = [
        "<answer>the large purple circle</answer>",  # caption 0: clean
        f"<answer>here {span}</answer>",  # caption 1: writes the mask's tokens (a leak)
        f"<answer>{span}</answer>",  # caption 0, grounding 0: the ground truth's codes
        f"<answer>{format_mask((5, 9))}</answer>",  # caption 0, grounding 1: the first code only
        "???",  # caption 1, grounding 0: unreadable: s 0, Phi_loc -1
        "<answer>no target</answer>",  # caption 1, grounding 1: a rejection of a present target: 0
        "<answer>no target</answer>",  # the no-target query, grounding 0: 1
        f"<answer>{span}</answer>",  # ... grounding 1: a region: 0
    ]
    ro = _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4])
    scores = m.score([s, nt], ro)
    if mask_reward == "tokens":
        s00, s01 = 1.0, 0.4
    else:  # the decoded squares against the exact mask
        s00 = mask_iou(_Codec().decode((5, 7), s.image), gt)
        s01 = mask_iou(_Codec().decode((5, 9), s.image), gt)
    assert scores.parts["consistency"].tolist() == pytest.approx([(s00 + s01) / 2, 0.0, s00, s01, 0, 0, 1, 0])
    phi_cap = [caption_phi("the large purple circle"), caption_phi(f"here {span}")]
    assert phi_cap[1] <= -1.0  # the mask-token leak
    phi_loc = [localization_phi(t, m.regions.space_for(s)) for t in texts[2:]]
    assert phi_loc[2] == -1.0 and phi_loc[0] == phi_loc[1] == phi_loc[3] == 0.0
    expected = [(s00 + s01) / 2 + phi_cap[0], phi_cap[1], s00, s01, -1.0, 0.0, 1.0, 0.0]
    assert scores.total.tolist() == pytest.approx(expected)
    # the cycle's evaluation compares pixel masks: the own mask and the look-alikes' exact masks
    targets, owns, lookalikes = m.evaluation.cycle_targets([s, nt])
    assert targets == [s] and np.array_equal(owns[0], gt) and all(x.shape == gt.shape for x in lookalikes[0])


def test_mask_groundings_are_scored_as_gres_in_predict_records(tokenizer_dir):
    """`predict`'s record of a mask grounding (what the study bootstraps): GRES's per-sample IoU of the decoded mask,
    1 for the rejection of a no-target query, 0 for an unreadable answer; ``rejected`` / ``answered`` as N-acc /
    T-acc count them."""
    m = _method(tokenizer_dir, _Codec())
    s, nt = _toy_sample(0), _toy_sample(1, no_target=True)

    def record(sample, text):
        r = m.regions
        return m.records.clip_record(sample, text, r.gt_region(sample), r.predicted_region(sample, text, (224, 224)))

    codes = (max(1, int(s.boxes[0][0]) // 4), int(s.boxes[0][1]) // 4)  # a square from the target's corner
    hit = record(s, f"<answer>{format_mask(codes)}</answer>")
    want = mask_iou(_Codec().decode(codes, s.image), target_mask(s.meta))
    assert 0.0 < want < 1.0
    assert hit["rewards"]["accuracy"] == pytest.approx(want) and hit["scores"]["iou"] == pytest.approx(want)
    assert (hit["task"], hit["answered"], hit["rejected"], hit["no_target"], hit["format_ok"]) == (
        "rec", True, False, False, True,
    )  # fmt: skip
    rejection = record(nt, "<answer>no target</answer>")
    assert rejection["rewards"]["accuracy"] == 1.0 and rejection["rejected"] and rejection["no_target"]
    false_alarm = record(nt, f"<answer>{format_mask((5, 7))}</answer>")
    assert false_alarm["rewards"]["accuracy"] == 0.0 and not false_alarm["rejected"] and false_alarm["answered"]
    junk = record(s, "???")
    assert junk["rewards"]["accuracy"] == 0.0 and not junk["format_ok"] and not junk["answered"]
