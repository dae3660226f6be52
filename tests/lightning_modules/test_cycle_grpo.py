"""CycleGRPO as a method plug-in: the cycle rewards and the two-level advantages worked by hand, the concatenation of
the two rollout levels, and the ablation modes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_methods import Sample  # the same stand-in sample (tests/lightning_modules is on sys.path)

from core.rollout import Rollout, concat_rollouts


def _hp():
    return SimpleNamespace(prompt_template="toy", advantage_scale="group", advantage_eps=0.0)


def _rollout(texts, group_ids, input_wh=(100, 100)):
    """A stand-in rollout of ``texts`` (one row each) with the given group ids, every row's input ``input_wh``."""
    n = len(texts)
    z = torch.zeros(n, 1, dtype=torch.long)
    return Rollout(
        z,
        z + 1,
        z,
        z + 1,
        torch.zeros(0, 1),
        torch.zeros(n, 3, dtype=torch.long),
        texts,
        [input_wh] * n,
        group_size=1,
        group_ids=torch.tensor(group_ids),
    )


def test_cycle_rewards_by_hand():
    # B = 1, N = 2 captions, K = 2 groundings each; GT region [0, 0, 10, 10] (input = original pixels)
    texts = [
        "<answer>the red circle</answer>",  # caption 0: clean, Phi_cap 0
        "<answer>at [1, 2, 3, 4]</answer>",  # caption 1: a leak (-1), nothing left after stripping (-1)
        "<answer>[0, 0, 10, 10]</answer>",  # caption 0, grounding 0: IoU 1
        "<answer>[0, 0, 10, 5]</answer>",  # caption 0, grounding 1: IoU 0.5
        "???",  # caption 1, grounding 0: unreadable: s 0, Phi_loc -1
        "<answer>[0, 0, 10, 10]</answer>",  # caption 1, grounding 1: IoU 1
    ]
    m = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "alpha": 1.0})
    batch = [Sample("s0", "q", [[0, 0, 10, 10]])]
    ro = _rollout(texts, [0, 0, 1, 1, 2, 2])  # captions of sample 0 | groundings of caption 0 | of caption 1
    s = m.score(batch, ro)
    # r_cap_i = mean_k s_ik + Phi_cap: 0.75 + 0, 0.5 - 2; r_loc_ik = s_ik + Phi_loc
    assert s.total.tolist() == [0.75, -1.5, 1.0, 0.5, -1.0, 1.0]
    assert s.parts["consistency"].tolist() == [0.75, 0.5, 1.0, 0.5, 0.0, 1.0]
    assert m.sample_index(batch, ro) == [0] * 6
    # two-level groups (eps 0): each pair is normalised apart: +-1/sqrt(2) around its own mean
    adv = m.advantages(s, ro)
    h = 2**-0.5
    assert torch.allclose(adv, torch.tensor([h, -h, h, -h, -h, h]))
    # the ablations zero the other direction's advantages
    cap = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "mode": "caption"})
    assert cap.advantages(cap.score(batch, ro), ro)[2:].abs().sum() == 0
    loc = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2, "mode": "localization"})
    assert loc.advantages(loc.score(batch, ro), ro)[:2].abs().sum() == 0


def test_concat_rollouts_pads_prompts_left_and_completions_right():
    a = Rollout(
        torch.tensor([[5, 6]]),
        torch.tensor([[1, 1]]),
        torch.tensor([[7]]),
        torch.tensor([[1]]),
        torch.zeros(4, 2),
        torch.tensor([[1, 2, 2]]),
        ["x"],
        [(28, 28)],
        group_size=1,
        group_ids=torch.tensor([0]),
    )
    b = Rollout(
        torch.tensor([[9]] * 2),
        torch.tensor([[1]] * 2),
        torch.tensor([[3, 4, 0]] * 2),
        torch.tensor([[1, 1, 0]] * 2),
        torch.zeros(8, 2),
        torch.tensor([[1, 2, 2]] * 2),
        ["y", "z"],
        [(28, 28)] * 2,
        group_size=2,
        group_ids=torch.tensor([4, 4]),
        parent_ids=[0, 0],
    )
    c = concat_rollouts([a, b], pad_token_id=0)
    assert c.prompt_ids.tolist() == [[5, 6], [0, 9], [0, 9]] and c.prompt_mask.tolist() == [[1, 1], [0, 1], [0, 1]]
    assert c.completion_ids.tolist() == [[7, 0, 0], [3, 4, 0], [3, 4, 0]]
    assert c.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert c.pixel_values.shape == (12, 2) and c.texts == ["x", "y", "z"] and c.group_size == 1
    assert c.group_ids.tolist() == [0, 4, 4] and c.parent_ids == [None, 0, 0]


def test_model_input_wh_is_the_processors_resize_without_encoding():
    from pathlib import Path

    from PIL import Image
    from transformers import AutoProcessor

    from lightning_modules.models.qwen_vl import model_input_size, model_input_wh

    toy = Path(__file__).resolve().parents[2] / "checkpoints/toy-qwen2.5-vl"
    ip = AutoProcessor.from_pretrained(toy).image_processor
    for w, h in [(224, 224), (640, 480), (100, 300), (1000, 37)]:
        grid = ip(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"]
        assert model_input_wh(ip, w, h) == model_input_size(grid, ip.patch_size)[0]


def test_image_lookalikes_are_the_scenes_objects_sharing_shape_or_colour():
    from lightning_modules.methods.cycle_rewards import image_lookalikes

    objects = [
        {"role": "target", "shape": "circle", "colour": "red", "box": [0, 0, 10, 10]},
        {"role": "distractor", "shape": "circle", "colour": "blue", "box": [20, 0, 30, 10]},  # same shape
        {"role": "foreground", "shape": "square", "colour": "red", "box": [40, 0, 50, 10]},  # same colour
        {"role": "distractor", "shape": "square", "colour": "green", "box": [60, 0, 70, 10]},  # neither
    ]
    sample = SimpleNamespace(meta={"objects": objects})
    assert image_lookalikes(sample) == [(20.0, 0.0, 30.0, 10.0), (40.0, 0.0, 50.0, 10.0)]
    assert image_lookalikes(SimpleNamespace(meta={})) == []  # real data without a scene: own region only


def test_no_target_images_score_gres_metrics_and_are_refused_by_the_grpo_reward():
    """A REC eval set holding no-target queries adds gIoU / cIoU / N-acc / T-acc (worked by hand); its no-target
    queries leave Acc@0.5 alone; CycleGRPO grounds a no-target image from its query in a group of its own, rewarded
    for the rejection; the GRPO accuracy reward refuses it and says where it trains."""
    import pytest

    from core import rewards
    from datamodules.rec import GroundingDataset, Record
    from lightning_modules.evaluation.evaluator import Answer, Evaluator
    from lightning_modules.methods.base import RewardContext
    from lightning_modules.methods.grpo import accuracy_reward

    samples = [
        Sample("a", "the small red circle", [[0, 0, 50, 50]]),
        Sample("b", "the large blue star", []),
        Sample("c", "the large red square", []),
    ]
    records = [Record(s.sample_id, None, s.query, s.boxes, "rec", "", {}) for s in samples]
    dm = SimpleNamespace(eval_sets={"val": {"nt": GroundingDataset(records)}}, eval_names=lambda kind: ["nt"])
    trainer = SimpleNamespace(datamodule=dm)
    ev = Evaluator()
    ev.build(trainer, "fit")
    texts = ["<answer>[0, 0, 50, 25]</answer>", "<answer>no target</answer>", "<answer>[0, 0, 10, 10]</answer>"]
    answers = []
    for t in texts:
        p = rewards.parse_completion(t)
        answers.append(Answer(t, p, [list(b) for b in p.boxes], (100, 100)))
    logs = ev.update("val", "nt", samples, answers, format="think_answer")
    assert float(logs["val/nt/acc50"].compute()) == 1.0  # the one target sample (IoU 0.5)
    out = ev.detection(trainer, "val")
    # IoU: 0.5, 1 (rejected), 0 (false alarm) -> giou 0.5; cIoU = (1250 + 0 + 0) / (2500 + 0 + 100)
    assert out["val/nt/giou"] == pytest.approx(0.5)
    assert out["val/nt/ciou"] == pytest.approx(1250 / 2600)
    assert out["val/nt/n_acc"] == 0.5 and out["val/nt/t_acc"] == 1.0
    assert "val/nt/giou" not in ev.detection(trainer, "val")  # reset

    m = build_test_method("cycle_grpo", _hp(), {"n_captions": 2, "k_groundings": 2})
    batch = [samples[1], samples[0]]
    assert m.layout(batch) == ([1], [0])
    ro = _rollout(["c0", "c1"] + [texts[0]] * 4 + [texts[1], texts[2]], [0, 0, 2, 2, 3, 3, 4, 4])
    assert m.sample_index(batch, ro) == [1] * 6 + [0, 0]
    s = m.score(batch, ro)
    assert s.parts["consistency"].tolist()[-2:] == [1.0, 0.0]

    ctx = RewardContext([samples[1]], ["x"], [rewards.parse_completion("x")], [(100, 100)], 1)
    with pytest.raises(ValueError, match="no-target query.*CycleGRPO"):
        accuracy_reward(ctx)


def test_prediction_summaries_score_no_target_queries_by_their_rejection():
    from callbacks.predictions import summarize

    rows = [
        {"task": "rec", "rewards": {"accuracy": 0.5}, "format_ok": True, "boxes": [], "answered": True},
        {"task": "rec", "rewards": {"accuracy": 1.0}, "format_ok": True, "boxes": [], "no_target": True},
        {"task": "rec", "rewards": {"accuracy": 0.0}, "format_ok": False, "boxes": [[0, 0, 1, 1]], "no_target": True},
    ]
    assert summarize(rows) == {"acc50": 1.0, "miou": 0.5, "n_acc": 0.5, "t_acc": 1.0, "format": 2 / 3}
    assert summarize(rows[:1]) == {"acc50": 1.0, "miou": 0.5, "format": 1.0}  # no no-target query: as before
