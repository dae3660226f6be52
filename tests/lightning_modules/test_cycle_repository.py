"""CycleGRPO's ``reward_composition: repository``: the public repository's rewards as its code runs them
(devinxzhang/CycleGRPO at 586e970), values written out by hand from that code, next to what ``released`` (the same
formulas on the project's parse) gives. The cases: a mask-span answer to a no-target row, a lower-case "no target",
ground-truth codes whose span decodes to an empty mask, and out-of-range spans."""

from __future__ import annotations

import pytest
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _rollout
from test_cycle_masks import _Codec, _hp, _method, _toy_sample, tokenizer_dir  # noqa: F401 (the fixture)

from core.regions.mask_rewards import (
    mask_token_consistency,
    released_no_target_reward,
    repository_grounding_reward,
    repository_no_mask_repeat,
    repository_no_target_reward,
    repository_span_match,
    repository_token_consistency,
)
from core.regions.mask_tokens import format_mask, parse_masks

M = format_mask((0, 7))  # <|mt_start|><|mt_0000|><|mt_0263|><|mt_end|>
SWAPPED = "<|mt_start|><|mt_0300|><|mt_0017|><|mt_end|>"  # codes in each other's codebook range
LOW_SECOND = "<|mt_start|><|mt_0000|><|mt_0017|><|mt_end|>"  # the second code below 256


def test_no_target_rows_score_as_no_target_check_bbox():
    # text2mask.py 1131-1144: no_target_check_bbox(response, "No target.") (206-230) + non_repeat_reward (897-908)
    assert repository_no_target_reward(f"<answer>{M}</answer>") == pytest.approx(0.2 + 1)  # no box, no phrase
    assert released_no_target_reward(f"<answer>{M}</answer>", True) == 0 + 1  # the project: a region
    assert repository_no_target_reward("<answer>no target</answer>") == pytest.approx(0.2 + 1)  # "No target." in
    assert released_no_target_reward("<answer>no target</answer>", False) == 1 + 1  # case-free
    assert repository_no_target_reward("<think>none</think><answer>No target.</answer>") == 1 + 1
    assert repository_no_target_reward("No target. [1, 2, 3, 4]") == 0 + 1  # the bbox regex wins
    assert repository_no_target_reward("No target" + M * 4) == pytest.approx(0.2 + 0)  # a span 4 times: no_repeat 0


def test_token_consistency_compares_span_strings():
    # fsdp_workers.py 1430-1470: compute_mask_token_accuracy_by_grading and mask_token_accuracy_reward on the whole
    # response and the ground-truth text; regex <|mt_start|><|mt_\d{4}|><|mt_\d{4}|><|mt_end|>
    assert repository_span_match(M, M) == 1.0
    assert repository_span_match(LOW_SECOND, M) == 0.4  # start and first code equal as text
    assert repository_span_match(SWAPPED, M) == 0.0
    gt = f"<think>\n\n</think><answer>{M}</answer>"
    assert repository_token_consistency(f"<answer>{M}</answer>", gt) == 1.0
    # out-of-range spans count: 1 (exact) + 0 (swapped) over max(2, 1)
    assert repository_token_consistency(f"{M}{SWAPPED}", gt) == 0.5
    assert mask_token_consistency(parse_masks(f"{M}{SWAPPED}"), [(0, 7)]) == 1.0  # the project drops it
    assert repository_token_consistency(LOW_SECOND, gt) == 0.4  # the project reads no span here
    assert parse_masks(LOW_SECOND) == []
    assert repository_token_consistency(f"{M}{M}", gt) == 0.5  # unique 1.0 over max(2, 1)
    assert repository_token_consistency("<|mt_start|> <|mt_0000|><|mt_0263|><|mt_end|>", gt) == 0.0  # no spaces
    assert repository_token_consistency("no target", "No target.") == 1.0  # no span on either side
    # seg_overall = 10 * mask_token_accuracy * iou_scores + non_repeat_reward + mask_token_format_reward
    # (text2mask.py 1327-1347); both last terms count out-of-range spans too
    assert repository_grounding_reward(0.4, 0.5, LOW_SECOND) == pytest.approx(2.0 + 1 + 1)
    assert repository_no_mask_repeat(SWAPPED * 4) == 0.0


def test_cycle_grpo_repository_composition_by_hand(tokenizer_dir):  # noqa: F811
    class EmptyFirst(_Codec):  # every mask encodes to (0, 7), and code 0 decodes to nothing
        def encode(self, image, mask, box=None):
            return 0, 7

    s, nt = _toy_sample(0), _toy_sample(1, no_target=True)
    texts = [
        "<answer>the large purple circle</answer>",  # caption 0
        "<answer>the circle</answer>",  # caption 1
        f"<answer>{M}</answer>",  # c0 g0: the ground truth's codes, which decode to nothing: s 1.0
        f"<answer>{M}{SWAPPED}</answer>",  # c0 g1: 1 / max(2, 1) = 0.5
        f"<answer>{LOW_SECOND}</answer>",  # c1 g0: 0.4
        "<answer>no target</answer>",  # c1 g1: 0
        f"<answer>{format_mask((5, 9))}</answer>",  # the no-target query: a mask span
        "<answer>no target</answer>",  # ... lower case
    ]
    ro = _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4])
    repo = _method(tokenizer_dir, EmptyFirst(), reward_composition="repository")
    assert repo.regions.region_text(None, s) == M
    scores = repo.score([s, nt], ro)
    # captions (text2mask.py 1255-1276): (gm_non_repeat 1 + 10 * mean) * clean + clean, means 0.75 and 0.2;
    # groundings: 10 * s * mean + non_repeat 1 + format (a span by the regex); no-target rows 0.2 + 1
    expected = [1 + 7.5 + 1, 1 + 2.0 + 1, 7.5 + 2, 3.75 + 2, 0.8 + 2, 0 + 1 + 0, 1.2, 1.2]
    assert scores.total.tolist() == pytest.approx(expected)
    assert scores.parts["consistency"].tolist() == pytest.approx([0.75, 0.2, 1.0, 0.5, 0.4, 0.0, 0.0, 0.0])
    released = _method(tokenizer_dir, EmptyFirst(), reward_composition="released").score([s, nt], ro)
    assert released.parts["consistency"][2:6].tolist() == [0.0] * 4  # decoded first: every span reads as nothing
    assert released.total[6:].tolist() == pytest.approx([1.0, 2.0])
    # a released row whose codes decode to nothing stays a cycled target under the repository's reading
    row = _toy_sample(0)
    row.meta = {**row.meta, "mask_codes": [[0, 7]]}
    row.boxes = []
    assert repo.layout([row, nt]) == ([0], [1])
    assert _method(tokenizer_dir, EmptyFirst()).layout([row, nt]) == ([], [0, 1])
    with pytest.raises(ValueError, match="repository.*region_space mask"):
        build_test_method("cycle_grpo", _hp(), {"reward_composition": "repository"})
    with pytest.raises(ValueError, match="repository.*mask_reward tokens"):
        _method(tokenizer_dir, reward_composition="repository", mask_reward="iou")
