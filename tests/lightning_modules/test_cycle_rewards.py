"""CycleGRPO's rewards as the released repository scores them (core/regions/mask_rewards.py), the mask-token checks
(core/regions/checks.py) and the two reward compositions through `CycleGRPO.score`, one literal case per behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _hp, _rollout
from test_methods import Sample

from core.regions import (
    BoxSpace,
    caption_phi,
    find_leaks,
    has_leak,
    has_mask_token_leak,
    localization_phi,
    mask_token_repetition,
    strip_leaks,
)
from core.regions.mask_rewards import (
    decoded_mask_iou,
    mask_consistency,
    mask_iou,
    mask_token_consistency,
    mask_token_match,
    no_target_reward,
    released_caption_reward,
    released_clean,
    released_grounding_reward,
    released_no_repeat_3gram,
    released_no_target_reward,
)
from core.regions.mask_tokens import format_mask

M17 = format_mask((17, 44))  # <|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>


# --- mask-token consistency ------------------------------------------------------------------------------------------


def test_one_mask_scores_1_for_both_codes_04_for_the_first_only_else_0():
    assert mask_token_match((17, 44), (17, 44)) == 1.0
    assert mask_token_match((17, 9), (17, 44)) == 0.4  # the coarse code right, the residual wrong
    assert mask_token_match((16, 44), (17, 44)) == 0.0  # the second code alone earns nothing


def test_several_masks_sum_each_distinct_predictions_best_match_over_the_larger_count():
    gt = [(1, 1), (2, 2)]
    # (1, 1) exact -> 1; (2, 9) first code of (2, 2) -> 0.4; (3, 3) nothing -> 0; / max(3, 2)
    assert mask_token_consistency([(1, 1), (2, 9), (3, 3)], gt) == pytest.approx(1.4 / 3)
    assert mask_token_consistency([(1, 1)], gt) == 0.5  # one target missed: / max(1, 2)
    # a right mask written twice counts once over two predictions (the repository's unique spans)
    assert mask_token_consistency([(1, 1), (1, 1)], [(1, 1)]) == 0.5
    assert mask_token_consistency([], []) == 1.0  # no mask on either side
    assert mask_token_consistency([], [(1, 1)]) == 0.0 and mask_token_consistency([(1, 1)], []) == 0.0


def test_decoded_mask_iou_matches_decoded_masks_one_to_one():
    def decode(codes):  # any tokenizer: here code (a, b) -> a 4 x 4 mask with the first a cells of the first row on
        m = np.zeros((4, 4), dtype=bool)
        m.flat[: codes[0]] = True
        return m

    gt = [decode((4, 0)), decode((2, 0))]
    # (4, x) matches the first target exactly (IoU 1); (1, x) vs the second: 1 / 2; / max(2, 2)
    assert decoded_mask_iou([(1, 5), (4, 9)], gt, decode) == pytest.approx((1.0 + 0.5) / 2)
    assert decoded_mask_iou([(4, 0)], gt, decode) == pytest.approx(1.0 / 2)  # one target unmatched
    assert decoded_mask_iou([], [], decode) == 1.0 and decoded_mask_iou([(4, 0)], [], decode) == 0.0
    # either consistency through one entry point (paper 004 allows both); the targets' exact masks or their codes
    assert mask_consistency([(1, 5), (4, 9)], [(4, 0), (2, 0)], "iou", decode=decode) == pytest.approx(0.75)
    assert mask_consistency([(4, 9)], [], "iou", decode=decode, gt_masks=gt) == pytest.approx(0.5)
    assert mask_consistency([(4, 9)], [(4, 0)]) == 0.4  # tokens: the first code only
    with pytest.raises(ValueError, match="decode"):
        mask_consistency([(4, 9)], [(4, 0)], "iou")
    assert mask_iou(np.zeros((2, 2)), np.zeros((2, 2))) == 0.0
    with pytest.raises(ValueError, match="shape"):
        mask_iou(np.zeros((2, 2)), np.zeros((3, 3)))


# --- no target -------------------------------------------------------------------------------------------------------


def test_no_target_reward_is_1_for_the_phrase_02_without_it_0_for_a_region():
    assert no_target_reward("No target.", has_region=False) == 1.0
    assert no_target_reward("<answer>no target</answer>", has_region=False) == 1.0  # case and period free
    assert no_target_reward("I cannot tell.", has_region=False) == 0.2
    assert no_target_reward(f"No target. {M17}", has_region=True) == 0.0  # a region wins over the phrase
    assert no_target_reward(None, has_region=False) == 0.2  # type: ignore[arg-type]


# --- the mask-token checks beside the leak checks --------------------------------------------------------------------


def test_mask_token_leak_is_a_leak_and_is_stripped():
    caption = f"the red cup {M17} on the left"
    assert has_mask_token_leak(caption) and has_leak(caption)
    assert len(find_leaks(caption)) == 4  # each of the four tokens
    assert strip_leaks(caption) == "the red cup on the left"
    assert has_mask_token_leak("<|mt_start|> broken") and not has_mask_token_leak("mt_0017 is a code")
    assert caption_phi(caption) == -1.0  # the leak, once
    assert not has_leak("the red cup on the left")


def test_mask_token_repetition_is_a_span_written_more_than_3_times():
    assert not mask_token_repetition(M17 * 3)
    assert mask_token_repetition(M17 * 4)
    assert not mask_token_repetition(M17 * 2 + format_mask((1, 2)) * 2)  # 2 + 2 of two different masks
    assert not mask_token_repetition("<|mt_start|><|mt_0017|><|mt_end|>" * 5)  # malformed spans are not counted
    box = BoxSpace()
    assert localization_phi(M17 * 4 + " [0, 0, 5, 5]", box) == -1.0  # readable box, looped mask span
    assert localization_phi("[0, 0, 5, 5]", box) == 0.0  # a box answer never pays it


# --- the released composition ----------------------------------------------------------------------------------------


def test_released_caption_reward():
    assert released_clean("a red cup") == 1.0
    assert released_clean("a red cup at [1, 2, 3, 4]") == 0.0 and released_clean("红色的杯子") == 0.0
    assert released_no_repeat_3gram("the red cup, the red cup") == 1.0  # "the red cup" twice: allowed
    assert released_no_repeat_3gram("the red cup the red cup the red cup") == 0.0  # three times
    # (no_repeat + 10 * mean_s) * clean + clean
    assert released_caption_reward(0.5, "a red cup") == pytest.approx((1 + 5.0) * 1 + 1)
    assert released_caption_reward(0.5, "a red cup [1, 2, 3, 4]") == 0.0  # the box zeroes everything
    assert released_caption_reward(0.5, "the red cup " * 3) == pytest.approx(0 + 5.0 + 1)


def test_released_grounding_and_no_target_rewards():
    # 10 * s * mean_s + no_mask_repeat + has_region
    assert released_grounding_reward(1.0, 0.5, M17, True) == pytest.approx(5.0 + 1 + 1)
    assert released_grounding_reward(1.0, 0.5, M17 * 4, True) == pytest.approx(5.0 + 0 + 1)
    assert released_grounding_reward(0.0, 0.5, "nothing", False) == 1.0
    assert released_no_target_reward("No target.", False) == 2.0
    assert released_no_target_reward("hmm", False) == pytest.approx(1.2)
    assert released_no_target_reward(M17 * 4, True) == 0.0
    from lightning_modules.methods.cycle_rewards import released_no_target_rewards

    # any mask token, even a broken span, answers a region (the repository's no_target_check): 0 + no_mask_repeat 1
    assert released_no_target_rewards(["No target. <|mt_start|><|mt_0017|>", "No target."], [False, False]) == [
        1.0,
        2.0,
    ]


def test_cycle_grpo_scores_with_either_composition():
    # B = 1, N = 2, K = 2; GT box [0, 0, 10, 10] (input = original pixels)
    texts = [
        "<answer>the red circle</answer>",
        "<answer>at [1, 2, 3, 4]</answer>",  # a box in the caption: clean 0
        "<answer>[0, 0, 10, 10]</answer>",  # IoU 1
        "<answer>[0, 0, 10, 5]</answer>",  # IoU 0.5
        "???",  # unreadable: IoU 0, no region
        "<answer>[0, 0, 10, 10]</answer>",  # IoU 1
    ]
    batch = [Sample("s0", "q", [[0, 0, 10, 10]])]
    ro = _rollout(texts, [0, 0, 1, 1, 2, 2])
    args = {"n_captions": 2, "k_groundings": 2}
    seed = build_test_method("cycle_grpo", _hp(), args).score(batch, ro)
    assert seed.total.tolist() == [0.75, -1.5, 1.0, 0.5, -1.0, 1.0]  # test_cycle_grpo's hand-worked seed rewards
    rel = build_test_method("cycle_grpo", _hp(), {**args, "reward_composition": "released"}).score(batch, ro)
    # captions: (1 + 10 * 0.75) + 1 = 9.5; clean 0 -> 0. Groundings: 10 * s * mean_s + 1 (no loop) + has_region
    expected = [9.5, 0.0, 10 * 0.75 + 2, 10 * 0.5 * 0.75 + 2, 0 + 1 + 0, 10 * 0.5 + 2]
    assert rel.total.tolist() == pytest.approx(expected)
    assert torch.equal(rel.parts["consistency"], seed.parts["consistency"])  # the same s; only the totals differ
    # no-target queries: seed alpha * [no target] + Phi_loc; released: 1 / 0.2 / 0 + no_mask_repeat
    nt_batch = [Sample("n0", "the blue star", [])]
    nt_ro = _rollout(["<answer>No target.</answer>", "<answer>[0, 0, 5, 5]</answer>"], [1, 1])
    args = {"n_captions": 2, "k_groundings": 2, "reward_composition": "released"}
    assert build_test_method("cycle_grpo", _hp(), args).score(nt_batch, nt_ro).total.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="reward_composition"):
        build_test_method("cycle_grpo", _hp(), {"reward_composition": "repo"})
    with pytest.raises(ValueError, match="reward_composition released.*video"):
        build_test_method("cycle_grpo", _hp(), {"reward_composition": "released", "region_space": "interval"})
