"""CycleGRPO's equal-weight objective (paper 004 step 7; the repository's cap_grad_weight = seg_grad_weight = 0.5):
each side's loss a token mean over its own rows across the ranks, ``lambda_cap * J_cap + lambda_loc * J_loc``; the
ablations drop a side, KL included. Weights stated by hand for N = 2, K = 2."""

from __future__ import annotations

import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _hp, _rollout
from test_methods import Sample

from core import objective
from lightning_modules.grpo.args import KLArgs, OptimArgs
from lightning_modules.grpo.step import StepLoss

# One sample, N = 2 captions of 4 tokens each (8 caption tokens), N x K = 4 groundings of 1 token each (4 tokens):
# 12 tokens. One token mean over all rows gives the caption side 8 / 12 = 2/3 of the weight. Equal weight:
#   w_cap = 0.5 * 12 / 8 = 0.75,  w_loc = 0.5 * 12 / 4 = 1.5   (row weights on the per-token loss, / 12 tokens)
# so the loss is 0.75 / 12 * sum_cap + 1.5 / 12 * sum_loc = 0.5 * sum_cap / 8 + 0.5 * sum_loc / 4.
LENGTHS = [4, 4, 1, 1, 1, 1]
SIDES = torch.tensor([0, 0, 1, 1, 1, 1])


def _mask(lengths):
    T = max(lengths)
    return torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])  # [N, T]


TOKENS = objective.loss_count(_mask(LENGTHS), "token-mean")  # per row 4, 4, 1, 1, 1, 1; 12 in all


def test_the_count_is_computed_once_of_tokens_or_rows():
    """The step's normaliser: tokens under token-mean, rows otherwise; a micro-batch's share is its rows' part."""
    assert TOKENS.per_row.tolist() == LENGTHS and float(TOKENS.local) == float(TOKENS.denom) == 12.0
    assert float(TOKENS.share([0, 2])) == 5.0
    rows = objective.loss_count(_mask(LENGTHS), "seq-mean-token-mean")
    assert rows.per_row.tolist() == [1.0] * 6 and float(rows.denom) == 6.0 and float(rows.share([0, 2])) == 2.0
    # two ranks: the denominator is the ranks' mean count, the local count this rank's own
    two = objective.loss_count(_mask(LENGTHS), "token-mean", rank_mean=lambda local: (local + 4.0) / 2)
    assert float(two.local) == 12.0 and float(two.denom) == 8.0


def test_side_weights_by_hand():
    w = objective.side_row_weights(TOKENS, SIDES, (0.5, 0.5))
    assert w.tolist() == [0.75, 0.75, 1.5, 1.5, 1.5, 1.5]
    # the caption-only ablation: the captions' own token mean, the groundings dropped
    w = objective.side_row_weights(TOKENS, SIDES, (1.0, 0.0))
    assert w.tolist() == [1.5, 1.5, 0.0, 0.0, 0.0, 0.0]  # 1 * 12 / 8
    # rows counted instead of tokens (seq-mean-token-mean): 2 caption rows, 4 grounding rows, 6 rows
    rows = objective.loss_count(_mask(LENGTHS), "seq-mean-token-mean")
    w = objective.side_row_weights(rows, SIDES, (0.5, 0.5))
    assert w.tolist() == [1.5, 1.5, 0.75, 0.75, 0.75, 0.75]  # 0.5 * 6 / 2, 0.5 * 6 / 4
    with pytest.raises(ValueError, match="side ids"):
        objective.side_row_weights(TOKENS, SIDES + 1, (0.5, 0.5))


def test_equal_weight_loss_by_hand_with_kl_and_micro_batches():
    """ratio 1 (old = logp), so the surrogate per token is -A: captions A = 1, groundings A = 2; the KL per token
    (k1: logp - ref) is 0.1 on captions and 0.3 on groundings, kl_coef 1."""
    mask = _mask(LENGTHS)
    adv = torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    logp = torch.zeros(6, 4, requires_grad=True)
    ref = -torch.tensor([0.1, 0.1, 0.3, 0.3, 0.3, 0.3])[:, None].expand(6, 4)  # logp - ref = 0.1 / 0.3
    optim, kl = OptimArgs(), KLArgs(coef=1.0, estimator="k1")

    def step_loss(weights, micro=((0, 1, 2), (3, 4, 5))):
        loss = StepLoss(
            optim, kl, 4, adv=adv, mask=mask, count=TOKENS, old_logp=None, ref_logp=ref, row_weights=weights
        )
        return sum(loss(logp[list(r)], torch.zeros(len(r), 4), list(r)) for r in micro)

    # one token mean (before): (8 * (-1 + 0.1) + 4 * (-2 + 0.3)) / 12 = -14 / 12
    assert float(step_loss(None)) == pytest.approx(-14 / 12)
    # equal weight: 0.5 * (-1 + 0.1) + 0.5 * (-2 + 0.3) = -1.3, whatever the micro-batches
    w = objective.side_row_weights(TOKENS, SIDES, (0.5, 0.5))
    assert float(step_loss(w)) == pytest.approx(-1.3)
    assert float(step_loss(w, micro=((0,), (1, 2, 3, 4, 5)))) == pytest.approx(-1.3)
    # caption only: -1 + 0.1, no surrogate and no KL from the groundings; localization only: -2 + 0.3
    assert float(step_loss(objective.side_row_weights(TOKENS, SIDES, (1.0, 0.0)))) == pytest.approx(-0.9)
    loc = step_loss(objective.side_row_weights(TOKENS, SIDES, (0.0, 1.0)))
    assert float(loc) == pytest.approx(-1.7)
    loc.backward()
    assert logp.grad[:2].abs().sum() == 0 and logp.grad[2:].abs().sum() > 0  # the dropped captions get no gradient


def test_no_row_weights_leave_the_loss_as_it_was():
    """Every method but CycleGRPO passes no row weights: the same numbers, bit for bit (and weights of 1 change
    nothing either)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 4, generator=g)
    old, ref, adv = logp + 0.1 * torch.randn(6, 4, generator=g), logp - 0.2, torch.randn(6, generator=g)
    kw = dict(ref_logp=ref, kl_coef=0.04, dual_clip=3.0)
    plain, _ = objective.policy_loss(logp, old, adv, _mask(LENGTHS), **kw)
    ones, _ = objective.policy_loss(logp, old, adv, _mask(LENGTHS), row_weights=torch.ones(6), **kw)
    assert torch.equal(plain, ones)


def test_each_side_is_normalised_over_all_ranks():
    """Two ranks: rank 0 holds the two captions and one grounding, rank 1 three groundings (the same 6 rows). The
    step divides by the ranks' mean token count and DDP averages the ranks' losses: the average must equal the
    one-process equal-weight loss, although each rank holds a different share of each side."""
    mask, rows = _mask(LENGTHS), ([0, 1, 2], [3, 4, 5])
    per_row = mask.sum(1)
    row_loss = torch.tensor([-1.0, -1.0, -2.0, -2.0, -2.0, -2.0])  # per-token loss of each row
    locals_ = [torch.zeros(2).index_add_(0, SIDES[r], per_row[r]) for r in rows]  # [S] counts per rank

    def rank_mean(_local):  # the all-reduce mean, as the module's _rank_mean does it
        return (locals_[0] + locals_[1]) / 2

    denom = (per_row[rows[0]].sum() + per_row[rows[1]].sum()) / 2  # the ranks' mean token count: 6
    losses = []
    for r in rows:
        count = objective.LossCount(per_row[r], per_row[r].sum(), denom)  # this rank's rows, the ranks' mean count
        w = objective.side_row_weights(count, SIDES[r], (0.5, 0.5), rank_mean)
        losses.append(float((w * row_loss[r] * per_row[r]).sum() / denom))
    assert sum(losses) / 2 == pytest.approx(0.5 * -1.0 + 0.5 * -2.0)


def test_cycle_grpo_declares_its_sides_and_checks_the_weights():
    texts = ["c0", "c1"] + ["<answer>[0, 0, 10, 10]</answer>"] * 4 + ["<answer>no target</answer>"] * 2
    batch = [Sample("s0", "q", [[0, 0, 10, 10]]), Sample("n0", "the blue star", [])]
    ro = _rollout(texts, [0, 0, 2, 2, 3, 3, 4, 4])
    args = {"n_captions": 2, "k_groundings": 2}
    for extra, weights in [
        ({}, (0.5, 0.5)),
        ({"lambda_cap": 0.25, "lambda_loc": 0.75}, (0.25, 0.75)),
        ({"mode": "caption"}, (1.0, 0.0)),
        ({"mode": "localization"}, (0.0, 1.0)),
    ]:
        m = build_test_method("cycle_grpo", _hp(), {**args, **extra})
        ids, w = m.loss_sides(m.score(batch, ro), ro)
        assert ids.tolist() == [0, 0, 1, 1, 1, 1, 1, 1] and w == weights  # no-target groundings: grounding side
    for bad in ({"lambda_cap": -0.1}, {"lambda_loc": float("nan")}, {"lambda_cap": 0.0, "lambda_loc": 0.0}):
        with pytest.raises(ValueError, match="--model.method.init_args.lambda_"):
            build_test_method("cycle_grpo", _hp(), {**args, **bad})
    # every other method keeps one token mean over all its rows
    assert build_test_method("grpo", _hp()).loss_sides(None, ro) is None


def test_the_released_and_the_seed_nk_are_both_expressible():
    """configs/cycle_4b.yaml is the seed's N = K = 6; the released script's N = 8, K = 6 is one flag."""
    import contextlib
    import io
    from pathlib import Path

    import yaml

    from train import cli_main

    cfg = Path(__file__).resolve().parents[2] / "configs/cycle_4b.yaml"

    def nk(*flags):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
            cli_main(["fit", "--config", str(cfg), *flags, "--print_config"])
        a = yaml.safe_load(buf.getvalue())["model"]["init_args"]["method"]["init_args"]
        return a["n_captions"], a["k_groundings"], a["lambda_cap"], a["lambda_loc"]

    assert nk() == (6, 6, 0.5, 0.5)
    assert nk("--model.method.init_args.n_captions", "8") == (8, 6, 0.5, 0.5)
