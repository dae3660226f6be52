"""CycleGRPO on video (paper 004): the temporal (Eq. 14 + invalid-interval gate) and spatio-temporal (Eq. 15 +
temporal-proximity shaping) rewards worked by hand, the nested rollout's prompts on a clip, and the validation
metrics, with a tiny random Qwen2.5-VL (the conftest factory)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from PIL import Image
from test_cycle_grpo import _rollout  # the stand-in rollout (tests/lightning_modules is on sys.path)
from test_methods import Sample  # the image stand-in sample

from core.video import VideoClip
from datamodules.rec import Sample as RecSample
from datamodules.toy_video import make_clip
from datamodules.video import VideoSample
from lightning_modules.engines.base import build_rollout_engine
from lightning_modules.models.loading import load_policy


def _hp(template: str = "toy"):
    return SimpleNamespace(
        prompt_template=template,
        advantage_scale="group",
        advantage_eps=0.0,
        eval_prompt_template=None,
        max_new_tokens=8,
    )


def _sample(intervals=(), anchors=(), duration=8.0) -> VideoSample:
    frames = [Image.new("RGB", (100, 100))] * 2
    return VideoSample(
        "v0", VideoClip(frames, 2.0), "the second time the circle moves", list(intervals), list(anchors), duration
    )


def test_temporal_rewards_by_hand():
    texts = [
        "<answer>the second time the circle moves</answer>",  # caption 0: clean (ordinals are content)
        "<answer>from 2 to 4 seconds</answer>",  # caption 1: a leak (-1), nothing left after stripping (-1)
        "<answer>[2.0, 4.0]</answer>",  # tIoU 1
        "<answer>[3.0, 4.0], [5.0, 4.0]</answer>",  # tIoU 0.5, one invalid interval (end <= start): gate 0.5
        "<answer>no target</answer>",  # a miss: 0
        "<answer>[2.0, 4.0], [9.0, 10.0]</answer>",  # tIoU 1, [9, 10] starts after the 8 s clip: gate 0.5
    ]
    m = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "region_space": "interval"})
    batch = [_sample(intervals=[(2.0, 4.0)])]
    ro = _rollout(texts, [0, 0, 1, 1, 2, 2])
    s = m.score(batch, ro)
    # r_cap uses the ungated s: mean(1, 0.5), mean(0, 1) - 2; r_loc = gate * s + Phi
    assert s.total.tolist() == [0.75, -1.5, 1.0, 0.25, 0.0, 0.5]
    assert s.extras["gate"] == [1.0, 0.5, 1.0, 0.5]
    assert m.train_logs(s, ro)["train/cycle/gate"] == 0.75


def test_spatio_temporal_rewards_by_hand():
    a, b = (0.0, 0.0, 10.0, 10.0), (10.0, 0.0, 20.0, 10.0)  # IoU(a, b) = 0
    texts = [
        "<answer>the small circle moves left</answer>",  # clean
        "<answer>the circle at 1.5s</answer>",  # leak: -1 ("the circle" remains)
        # groundings written in a 200 x 200 model input: halved into the 100 x 100 frame
        "<answer>1.0s: [0, 0, 20, 20]; 1.5s: [20, 0, 40, 20]</answer>",  # S = 1, proximity 1
        "<answer>3.0s: [0, 0, 20, 20]</answer>",  # 1.5 s and 2 s away (> tau): S = 0, proximity 0
        "<answer>1.5s: [0, 0, 20, 20]</answer>",  # matches the 1.0 s anchor (0.5 s <= tau): S = 1 / 2
        "garbage",  # unreadable: S 0, Phi -1
    ]
    m = build_test_method(
        "cycle_grpo",
        _hp(),
        {"n_captions": 2, "k_groundings": 2, "region_space": "anchor", "tau": 0.5, "proximity_weight": 0.5},
    )
    batch = [_sample(anchors=[(1.0, a), (1.5, b)])]
    s = m.score(batch, _rollout(texts, [0, 0, 1, 1, 2, 2], input_wh=(200, 200)))
    # proximity of the 1.5 s answer: GT side (0.5 + 1) / 2, answer side 1 -> 0.875, x 0.5 = 0.4375
    assert s.parts["consistency"].tolist() == [0.5, 0.25, 1.0, 0.0, 0.5, 0.0]
    assert s.total.tolist() == [0.5, -0.75, 1.5, 0.0, 0.9375, -1.0]


def test_no_target_samples_are_grounding_groups_rewarded_for_rejecting():
    """A query without a target is not cycled: it is grounded K times from its own query, one more grounding group
    after the cycle's, rewarded alpha for "no target" and 0 for any interval; the ablation modes treat it as a
    grounding."""
    texts = [
        "<answer>the second time the circle moves</answer>",  # caption of the target sample (N = 2)
        "<answer>the circle moves</answer>",
        "<answer>[2.0, 4.0]</answer>",  # its groundings (K = 2 per caption): tIoU 1, 0, 1, 1
        "<answer>no target</answer>",
        "<answer>[2.0, 4.0]</answer>",
        "<answer>[2.0, 4.0]</answer>",
        "<answer>no target</answer>",  # the no-target sample's groundings: a rejection (1), a false alarm (0)
        "<answer>[2.0, 4.0]</answer>",
    ]
    m = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "region_space": "interval"})
    batch = [_sample(), _sample(intervals=[(2.0, 4.0)])]  # the no-target sample first: the layout is by kind
    assert m.layout(batch) == ([1], [0])
    ro = _rollout(texts, [1, 1, 2, 2, 3, 3, 4, 4])
    assert m.sample_index(batch, ro) == [1, 1, 1, 1, 1, 1, 0, 0]
    s = m.score(batch, ro)
    assert s.total.tolist() == [0.5, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert s.parts["consistency"].tolist()[-2:] == [1.0, 0.0]
    logs = m.train_logs(s, ro)
    assert logs["train/cycle/no_target_acc"] == 0.5 and logs["train/cycle/no_target_reward"] == 0.5
    assert logs["train/cycle/consistency"] == 0.75  # the cycle's groundings only
    adv = m.advantages(s, ro)
    assert adv[-2] > 0 > adv[-1] and adv[-2] == -adv[-1]  # its own group: (r - mean) / std over its two rows
    for mode, trained in (("caption", False), ("localization", True), ("cycle", True)):
        mm = build_test_method(
            "cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "region_space": "interval", "mode": mode}
        )
        assert bool(mm.advantages(mm.score(batch, ro), ro)[-2:].abs().sum() > 0) == trained
    wide = build_test_method(  # a no-target group of its own size (N x K: as many grounding rows as a cycled sample)
        "cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "region_space": "interval", "no_target_groundings": 4}
    )
    ro4 = _rollout(texts + texts[-2:], [1, 1, 2, 2, 3, 3, 4, 4, 4, 4])
    assert wide.sample_index(batch, ro4) == [1] * 6 + [0] * 4
    assert wide.score(batch, ro4).total.tolist()[-4:] == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="no_target_groundings must be >= 2"):
        build_test_method("cycle_grpo", _hp(), {"region_space": "interval", "no_target_groundings": 1})
    only = m.score([batch[0]], _rollout(texts[-2:], [1, 1]))  # a step of no-target samples only
    logs = m.train_logs(only, ro)
    assert only.total.tolist() == [1.0, 0.0] and logs["train/cycle/no_target_acc"] == 0.5
    assert math.isnan(logs["train/cycle/caption_reward"])  # nan, not the last step's value
    assert math.isnan(
        m.train_logs(m.score(batch[1:], _rollout(texts[:6], [1, 1, 2, 2, 3, 3])), ro)["train/cycle/no_target_acc"]
    )


def test_region_space_must_match_the_samples():
    m = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "region_space": "interval"})
    with pytest.raises(ValueError, match="needs video samples"):
        m.rollout(SimpleNamespace(processor=None), [Sample("s0", "q", [[0, 0, 10, 10]])])
    with pytest.raises(ValueError, match="'box' \\(images\\) or 'interval' / 'anchor'"):
        build_test_method("cycle_grpo", _hp(), {"region_space": "moments"})


@pytest.fixture(scope="module")
def module(tiny_model_dir):
    model, processor = load_policy(str(tiny_model_dir), dtype="fp32")
    calls = []

    def generate(requests, sampling=None):
        from lightning_modules.engines.base import Sampling

        calls.append(list(requests))
        return build_rollout_engine("fast").generate(model, processor, requests, sampling or Sampling(max_new_tokens=8))

    return SimpleNamespace(
        policy=model,
        processor=processor,
        generate=generate,
        calls=calls,
        hparams=_hp(),
        rollout_engine=build_rollout_engine("fast"),
        device=torch.device("cpu"),
    )


def _toy_samples(n: int = 2) -> list[VideoSample]:
    out = []
    for i in range(n):
        c = make_clip("val", i, 0, num_frames=12)
        out.append(
            VideoSample(
                c["id"],
                VideoClip(c["frames"], c["fps"]),
                c["meta"]["query"],
                [tuple(x) for x in c["solution"]],
                [(t, tuple(bx)) for t, bx in c["anchors"]],
                c["duration"],
                [tuple(x) for x in c["lookalikes"]],
                meta=c["meta"],
            )
        )
    return out


@pytest.mark.parametrize("space", ["interval", "anchor"])
def test_video_rollout_prompts_and_two_level_groups(module, space):
    torch.manual_seed(0)
    m = build_test_method(
        "cycle_grpo",
        module.hparams,
        {"n_captions": 2, "k_groundings": 3, "region_space": space, "caption_template": "toy_caption"},
    )
    batch = [s for s in _toy_samples(3) if s.intervals][:2]
    module.calls.clear()
    ro = m.rollout(module, batch)
    caps, grounds = module.calls
    assert ro.is_video and len(ro.texts) == 2 * 2 + 2 * 2 * 3
    assert ro.group_ids.tolist() == [0, 0, 1, 1] + [2] * 3 + [3] * 3 + [4] * 3 + [5] * 3
    region = m.regions.space.serialize(batch[0].region(space))  # frames are 112 px at their native size: same pixels
    assert caps[0].prompt.count("<|video_pad|>") == 1 and f"Describe: {region}" in caps[0].prompt
    assert caps[0].image is batch[0].clip and grounds[3].image is batch[1].clip
    assert [r.parent_id for r in grounds] == [0, 1, 2, 3]
    assert all("<|video_pad|>" in r.prompt for r in grounds)
    scores = m.score(batch, ro)
    assert scores.total.shape == (len(ro.texts),)


@pytest.mark.parametrize("space", ["interval", "anchor"])
def test_no_target_clips_are_grounded_from_their_query(module, space):
    """On the tiny model and toy clips: the caption call holds only the clips with a target; the grounding call holds
    their captions' groundings and then the no-target clip's own query, K rows in its own group, no parent."""
    torch.manual_seed(0)
    m = build_test_method("cycle_grpo", module.hparams, {"n_captions": 2, "k_groundings": 2, "region_space": space})
    clips = _toy_samples(12)
    target = next(s for s in clips if s.intervals)
    none = next(s for s in clips if not s.intervals)
    module.calls.clear()
    ro = m.rollout(module, [none, target])
    caps, grounds = module.calls
    assert [r.image for r in caps] == [target.clip]
    assert [r.group_id for r in grounds] == [2, 3, 4] and [r.parent_id for r in grounds] == [0, 1, None]
    assert none.query in grounds[-1].prompt and grounds[-1].image is none.clip and grounds[-1].n == 2
    assert len(ro.texts) == 2 + 2 * 2 + 2 and ro.group_ids.tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    scores = m.score([none, target], ro)
    assert scores.total.shape == (8,) and "train/cycle/no_target_acc" in m.train_logs(scores, ro)
    module.calls.clear()
    ro = m.rollout(module, [none])  # no target in the step: one call, the grounding group alone
    assert len(module.calls) == 1 and len(ro.texts) == 2 and ro.group_ids.tolist() == [1, 1]
    wide = (
        build_test_method(  # N x K rows per no-target clip: a grounding call of its own, after the cycle's, same rows
            "cycle_grpo",
            module.hparams,
            {"n_captions": 2, "k_groundings": 2, "region_space": space, "no_target_groundings": 4},
        )
    )
    module.calls.clear()
    ro = wide.rollout(module, [none, target, none])
    caps, grounds, own = module.calls
    assert [r.n for r in caps] == [2] and [r.n for r in grounds] == [2, 2] and [r.n for r in own] == [4, 4]
    assert [r.group_id for r in own] == [5, 6] and all(r.image is none.clip for r in own)
    assert (
        len(ro.texts) == 2 + 2 * 2 + 2 * 4 and ro.group_ids.tolist() == [1] * 2 + [3] * 2 + [4] * 2 + [5] * 4 + [6] * 4
    )
    assert wide.sample_index([none, target, none], ro) == [1] * 6 + [0] * 4 + [2] * 4
    assert wide.score([none, target, none], ro).total.shape == (14,)


@pytest.mark.parametrize(
    "space,keys",
    [
        (
            "interval",
            {"tiou", "r1@0.3", "r1@0.5", "r1@0.7", "ciou", "t_acc", "locatability", "confusion", "cycle_acc50"},
        ),
        ("anchor", {"when", "where", "st", "ciou", "t_acc", "locatability", "confusion", "cycle_acc50"}),
    ],
)
def test_validation_logs_the_video_metrics(module, space, keys):
    m = build_test_method("cycle_grpo", module.hparams, {"n_captions": 2, "k_groundings": 2, "region_space": space})
    samples = _toy_samples(2)
    assert m.evaluate(module, "val", "toy_video_val", samples[:1])
    assert m.evaluate(module, "val", "toy_video_val", samples[1:])
    logs = m.eval_logs("val")
    assert {k.rsplit("/", 1)[1] for k in logs} >= keys and all(k.startswith("val/toy_video_val/") for k in logs)
    assert all(0.0 <= v <= 1.0 for v in logs.values())
    assert m.eval_logs("val") == {}  # reset after logging
    image = build_test_method("cycle_grpo", module.hparams, {"n_captions": 2, "k_groundings": 2})
    still = RecSample("s0", Image.new("RGB", (112, 112)), "the red square", [[0, 0, 10, 10]])
    assert not image.evaluate(module, "val", "x", [still])  # grounding: the module's evaluator; captions: locatability
    assert set(image.eval_logs("val")) == {"val/x/locatability", "val/x/confusion"}


def test_lookalike_regions_are_the_actors_other_moves_in_either_space():
    """By hand on a toy clip: each other move of the actor is one interval, and in the anchor space its (time, box)
    on each of its frames, the boxes the clip was drawn with; the target's own anchors are of the same form."""
    s = next(x for x in _toy_samples(6) if len(x.lookalikes) >= 1 and x.intervals)
    fps, boxes = s.meta["fps"], s.meta["objects"][0]["boxes"]
    assert s.lookalike_regions("interval") == [((a, b),) for a, b in s.lookalikes]
    anchors = s.lookalike_regions("anchor")
    assert len(anchors) == len(s.lookalikes)
    moves = [  # the actor's other moves, from the clip's events (frames), not from the seconds
        ev for i, ev in enumerate(s.meta["events"])
        if ev["type"] == "move" and ev["object"] == 0 and i != s.meta["target_event"]
    ]  # fmt: skip
    assert len(moves) == len(anchors)
    for ev, region in zip(moves, anchors):
        frames = list(range(ev["start_frame"], ev["end_frame"] + 1))
        assert [t for t, _ in region] == [f / fps for f in frames]
        assert [list(box) for _, box in region] == [list(map(float, boxes[f])) for f in frames]
    own = s.region("anchor")
    assert [list(box) for _, box in own] == [list(map(float, boxes[round(t * fps)])) for t, _ in own]
    assert (
        VideoSample("x", s.clip, "q", s.intervals, s.anchors, s.duration, s.lookalikes).lookalike_regions("anchor")
        == []
    )  # no per-frame boxes in the record: no look-alikes
    with pytest.raises(ValueError, match="interval and anchor"):
        s.lookalike_regions("box")
