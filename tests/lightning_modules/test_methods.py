"""Methods as plug-ins: reward assembly, advantage grouping, Syn-GRPO's selection, and a new method added in one
file's worth of code and run by `GRPOModule` unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from method_util import build_test_method, text_rollout  # tests/lightning_modules is on sys.path under pytest
from PIL import Image
from test_grpo import _args  # the tiny GRPO run's flags (tests/lightning_modules is on sys.path under pytest)

from core import objective
from lightning_modules.methods.base import METHODS, Method, RewardTerm, register_method


@dataclass
class Sample:
    sample_id: str
    query: str
    boxes: list
    size: tuple = (100, 100)
    task: str = "rec"
    image: Image.Image | None = None
    meta: dict = field(default_factory=dict)


def _hp(**kw):
    base = dict(
        task="rec",
        prompt_template="toy",
        group_size=2,
        accuracy_weight=1.0,
        format="syn_grpo",
        format_weight=1.0,
        diversity_weight=1.0,
        diversity_reward_form="linear",
        diversity_beta=0.7,
        description_selection="diversity",
        advantage_scale="group",
        advantage_eps=1e-4,
        selection_seed=0,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _completion(box, diversity=0.5, description="a beach"):
    return (
        f"<think>look</think><diversity>{diversity}</diversity><description>{description}</description>"
        f"<answer>{box}</answer>"
    )


def _rollout(texts, group_size):
    return text_rollout(texts, group_size)


def test_syn_grpo_reward_is_the_weighted_sum_of_its_terms_by_hand():
    # one sample, G = 2: the first completion hits the box (IoU 1), the second misses (IoU 0); both well formed.
    # V(q) = var([1, 0]) / 0.25 = 1; the EMA's first value is V itself, so R_div = 1 - |0.5 - 1| = 0.5 for both.
    batch = [Sample("s0", "the red square", [[0, 0, 10, 10]])]
    ro = _rollout([_completion("[0, 0, 10, 10]"), _completion("[50, 50, 60, 60]")], 2)
    m = build_test_method("syn_grpo", _hp(accuracy_weight=2.0, format_weight=1.0, diversity_weight=0.5))
    s = m.score(batch, ro)
    assert s.parts["accuracy"].tolist() == [1.0, 0.0]
    assert s.parts["format"].tolist() == [1.0, 1.0]
    assert s.parts["diversity"].tolist() == [0.5, 0.5]
    assert s.total.tolist() == [2 * 1 + 1 + 0.5 * 0.5, 0 + 1 + 0.5 * 0.5]  # 3.25, 1.25
    assert s.extras["gt_diversity"].tolist() == [1.0]
    # the plain GRPO method: accuracy + format only, no diversity term and no evolution requests
    g = build_test_method("grpo", _hp(accuracy_weight=2.0))
    sg = g.score(batch, ro)
    assert set(sg.parts) == {"accuracy", "format", "total"} and sg.total.tolist() == [3.0, 1.0]
    assert g.evolution(batch, ro, sg, step=0, epoch=0) == []


@pytest.mark.parametrize("method", ["grpo", "syn_grpo", "evolved_grpo"])
def test_accuracy_threshold_makes_the_accuracy_reward_binary(method):
    # IoU of [0, 0, 10, 10] with [0, 0, 10, 6] is 0.6, with [0, 0, 10, 4] 0.4: 0.6 / 0.4 as IoU, 1 / 0 at t = 0.5
    batch = [Sample("s0", "the red square", [[0, 0, 10, 10]])]
    ro = _rollout([_completion("[0, 0, 10, 6]"), _completion("[0, 0, 10, 4]")], 2)
    iou = build_test_method(method, _hp()).score(batch, ro).parts["accuracy"]
    assert iou.tolist() == pytest.approx([0.6, 0.4])
    binary = build_test_method(method, _hp(accuracy_threshold=0.5)).score(batch, ro).parts["accuracy"]
    assert binary.tolist() == [1.0, 0.0]


def test_selection_takes_the_highest_diversity_reward_among_parsed_descriptions():
    batch = [Sample("a", "q", [[0, 0, 10, 10]]), Sample("b", "q", [[0, 0, 10, 10]])]
    texts = [
        _completion("[0, 0, 10, 10]", 0.9, "far"),  # R_div 1 - |0.9 - 1| = 0.9
        _completion("[50, 50, 60, 60]", 1.0, "best"),  # R_div 1.0: chosen for sample a
        _completion("[0, 0, 10, 10]", 0.2, ""),  # no description: never chosen
        _completion("[0, 0, 10, 10]", 0.0, "only"),  # sample b: V = 0, R_div 1 - |0 - 0| = 1
    ]
    ro = _rollout(texts, 2)
    m = build_test_method("syn_grpo", _hp())
    s = m.score(batch, ro)
    sel = m.evolution(batch, ro, s, step=3, epoch=1)
    assert [(x.sample_id, x.description, x.index) for x in sel] == [("a", "best", 1), ("b", "only", 1)]
    assert sel[0].step == 3 and sel[0].epoch == 1 and sel[0].gt_diversity == 1.0
    none = build_test_method("syn_grpo", _hp(description_selection="none"))
    assert none.evolution(batch, ro, none.score(batch, ro), step=0, epoch=0) == []
    # random selection is reproducible from the seed, and its RNG state round-trips through the checkpoint
    r1, r2 = (build_test_method("syn_grpo", _hp(description_selection="random", selection_seed=5)) for _ in range(2))
    r2.load_state_dict(r1.state_dict())
    picks = [r1.evolution(batch, ro, s, step=0, epoch=0)[0].index for _ in range(8)]
    assert picks == [r2.evolution(batch, ro, s, step=0, epoch=0)[0].index for _ in range(8)]


def test_two_level_groups_never_mix_and_contiguous_groups_match_interleaved_ones():
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.5, 1.5])
    # contiguous groups of 2 (the [B, G] path) and the same groups interleaved: the same numbers
    perm = [0, 2, 4, 1, 3, 5]
    contiguous = objective.advantages_by_group(r, [0, 0, 1, 1, 2, 2])
    assert torch.allclose(objective.advantages_by_group(r[perm], [0, 1, 2, 0, 1, 2]), contiguous[perm])
    # interleaved ids (a caption group {0, 2, 4} and a grounding group {1, 3, 5}): normalised apart
    a = objective.advantages_by_group(r, [7, 9, 7, 9, 7, 9], eps=0.0)
    cap = torch.tensor([1.0, 2.0, 0.5])  # mean 7/6, unbiased std sqrt(7/12)
    assert torch.allclose(a[[0, 2, 4]], (cap - cap.mean()) / cap.std())
    loc = torch.tensor([0.0, 2.0, 1.5])
    assert torch.allclose(a[[1, 3, 5]], (loc - loc.mean()) / loc.std())
    # a constant group is exactly 0; a group of one row has no baseline
    assert objective.advantages_by_group(torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1, 1])[:2].tolist() == [
        0,
        0,
    ]
    with pytest.raises(ValueError, match="group 3 has 1 row"):
        objective.advantages_by_group(torch.tensor([1.0, 0.0, 1.0]), [0, 0, 3])


def test_unknown_method_and_bad_method_args_are_clear_errors():
    with pytest.raises(ValueError, match="neither a registered method"):
        build_test_method("cycle", _hp())
    with pytest.raises(ValueError, match="init_args .* do not fit method 'grpo'"):
        build_test_method("grpo", _hp(), {"n_captions": 4})


@register_method("short_answers_test")
class ShortAnswers(Method):
    """A method in a dozen lines: reward short completions, one group per prompt (GRPOModule runs it unchanged)."""

    def __init__(self, target_chars: int = 20):
        super().__init__()
        self.target_chars = target_chars

    def reward_terms(self):
        return [RewardTerm("short", 1.0, lambda ctx: [-abs(len(t) - self.target_chars) / 100 for t in ctx.texts])]


def test_a_new_method_runs_through_grpo_module(tiny_model_dir, rec_dir, tmp_path):
    from train import cli_main

    assert "short_answers_test" in METHODS
    extra = ["--model.init_args.method", "ShortAnswers", "--model.init_args.method.init_args.target_chars", "8"]
    cli = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path / "run",
                "--trainer.max_steps",
                "1",
                "--trainer.limit_val_batches",
                "0",
                *extra,
            ),
        ]
    )
    assert cli.trainer.global_step == 1
    assert isinstance(cli.model.method, ShortAnswers) and cli.model.method.target_chars == 8
    logged = cli.trainer.logged_metrics
    assert "train/reward/short" in logged and "train/reward/accuracy" not in logged
