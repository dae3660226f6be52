"""Tests for core/objective.py.

Hand-worked numbers (with the reason in a comment), then agreement with small re-derivations of the peers' public
formulas: TRL's GRPOTrainer (advantages with scale_rewards, _compute_loss for loss_type grpo / bnpo / dr_grpo / dapo,
low / high clip fractions) and verl's core_algos (compute_grpo_outcome_advantage, agg_loss, compute_policy_loss with
clip_ratio_c, kl_penalty low_var_kl). The references are written here from the formulas, independently of the code
under test.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from core.objective import (
    Groups,
    advantages_by_group,
    aggregate,
    group_convergence,
    kl_penalty,
    masked_mean,
    policy_loss,
    selective_log_softmax,
    token_entropy,
    zero_variance_groups,
)

LN2 = math.log(2.0)


def ids(n: int, G: int) -> list[int]:
    """Group ids of n rows in contiguous groups of G (B prompts x G completions)."""
    return [i // G for i in range(n)]


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# ---------------------------------------------------------------------------------------------------------------------
# Reference re-derivations (peers' public formulas)
# ---------------------------------------------------------------------------------------------------------------------


def trl_advantages(rewards: torch.Tensor, G: int, scale_rewards: str) -> torch.Tensor:
    """TRL GRPOTrainer: rewards minus the group mean; divide by (std + 1e-4), std of the group or of the batch."""
    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    if scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = rewards.view(-1, G).std(dim=1).repeat_interleave(G)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv


def trl_loss(logp, old, ref, adv, mask, *, eps_low, eps_high, beta, loss_type, max_completion_length):
    """TRL GRPOTrainer._compute_loss (token-level importance sampling, k3 KL added per token)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "dapo":  # normaliser = tokens in the (global) batch; one process here
        loss = (per_token_loss * mask).sum() / mask.sum()
    else:
        raise ValueError(loss_type)
    low = ((coef_1 < 1 - eps_low) & (a < 0)).float()
    high = ((coef_1 > 1 + eps_high) & (a > 0)).float()
    return loss, (low * mask).sum() / mask.sum(), (high * mask).sum() / mask.sum()


def verl_grpo_advantage(scores: torch.Tensor, index: list, epsilon: float = 1e-6, norm_by_std: bool = True):
    """verl compute_grpo_outcome_advantage: a dict of groups by prompt index, unbiased std, (s - mean) / (std + eps)."""
    groups = defaultdict(list)
    for i, idx in enumerate(index):
        groups[idx].append(scores[i])
    mean, std = {}, {}
    for idx, vals in groups.items():
        t = torch.stack(vals)
        mean[idx], std[idx] = (t.mean(), t.std()) if len(vals) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
    out = scores.clone()
    for i, idx in enumerate(index):
        out[i] = (scores[i] - mean[idx]) / (std[idx] + epsilon) if norm_by_std else scores[i] - mean[idx]
    return out


def verl_agg_loss(loss_mat, loss_mask, mode):
    """verl agg_loss (single data-parallel rank). seq-mean-token-sum-norm = mean over sequences of the token sum
    divided by the response length (current verl; older verl divided the *total* sum by the length only)."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * loss_mask).sum(-1) / loss_mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return ((loss_mat * loss_mask).sum(-1) / loss_mask.shape[-1]).mean()
    raise ValueError(mode)


def verl_policy_loss(old, logp, adv, mask, clip_low, clip_high, clip_ratio_c, mode):
    """verl compute_policy_loss (vanilla, dual-clip): returns loss, pg_clipfrac, pg_clipfrac_lower."""
    log_ratio = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped1 = torch.maximum(pg1, pg2)
    clipfrac = ((pg2 > pg1).float() * mask).sum() / mask.sum()
    pg3 = -adv * clip_ratio_c
    clipped2 = torch.min(pg3, clipped1)
    clipfrac_lower = ((clipped1 > pg3).float() * (adv < 0).float() * mask).sum() / mask.sum()
    losses = torch.where(adv < 0, clipped2, clipped1)
    return verl_agg_loss(losses, mask, mode), clipfrac, clipfrac_lower


def verl_low_var_kl(logprob, ref_logprob):
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def random_batch(seed=0, N=6, T=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g) * 3
    old = logp + (torch.rand(N, T, generator=g) - 0.5) * 2 * spread
    ref = logp + (torch.rand(N, T, generator=g) - 0.5) * 2 * spread
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(N, generator=g)
    return logp, old, ref, adv, mask


# ---------------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------------


def test_group_advantages_hand_worked():
    # Group [1, 0, 0, 0]: mean 0.25, centred [0.75, -0.25, -0.25, -0.25]; unbiased var = (0.5625 + 3 * 0.0625) / 3 =
    # 0.25, std 0.5, so with eps 0 the advantages are exactly [1.5, -0.5, -0.5, -0.5].
    adv = advantages_by_group(torch.tensor([1.0, 0.0, 0.0, 0.0]), ids(4, 4), eps=0.0)
    assert close(adv, [1.5, -0.5, -0.5, -0.5], 1e-6)
    # With TRL's eps 1e-4 the denominator is 0.5001.
    adv = advantages_by_group(torch.tensor([1.0, 0.0, 0.0, 0.0]), ids(4, 4))
    assert close(adv, [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001], 1e-6)


def test_group_advantages_three_scalings_hand_worked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # none: just centred; the constant second group is 0.
    assert close(advantages_by_group(rewards, ids(8, 4), scale="none"), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], 1e-7)
    # batch: divide by the unbiased std of all 8 rewards. Mean 9/8; squared deviations 0.015625 + 3 * 1.265625 +
    # 4 * 0.765625 = 6.875; / 7 -> var 0.98214, std 0.99103.
    batch_std = math.sqrt(6.875 / 7)
    expected = [v / (batch_std + 1e-4) for v in (0.75, -0.25, -0.25, -0.25)] + [0.0] * 4
    assert close(advantages_by_group(rewards, ids(8, 4), scale="batch"), expected, 1e-6)
    # group: the first group's own std is 0.5 (see above).
    expected = [v / 0.5001 for v in (0.75, -0.25, -0.25, -0.25)] + [0.0] * 4
    assert close(advantages_by_group(rewards, ids(8, 4), scale="group"), expected, 1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl(scale):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(5 * 6, generator=g) * 3  # B = 5 prompts, G = 6, no constant group
    assert close(advantages_by_group(rewards, ids(30, 6), scale=scale), trl_advantages(rewards, 6, scale), 1e-6)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_match_verl(norm_by_std):
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(4 * 5, generator=g)
    rewards[5:10] = 1.0  # one constant group: verl gives 0 / (0 + eps) = 0 too
    index = [i // 5 for i in range(20)]
    ours = advantages_by_group(rewards, index, scale="group" if norm_by_std else "none", eps=1e-6)
    assert close(ours, verl_grpo_advantage(rewards, index, 1e-6, norm_by_std), 1e-5)


def test_zero_variance_group_is_exactly_zero():
    # 0.1 is not exact in binary: mean([0.1] * 6) - 0.1 need not be 0.0, so the code forces it.
    rewards = torch.tensor([0.1] * 6 + [1.0, 0.0, 1.0, 0.0, 1.0, 0.0] + [0.7] * 6)
    for scale in ("group", "batch", "none"):
        for eps in (1e-4, 0.0):
            adv = advantages_by_group(rewards, ids(18, 6), scale=scale, eps=eps)
            assert torch.equal(adv[:6], torch.zeros(6)) and torch.equal(adv[12:], torch.zeros(6))
            assert torch.isfinite(adv).all() and (adv[6:12] != 0).all()
    assert zero_variance_groups(rewards, ids(18, 6)).tolist() == [True, False, True]
    # A batch where every group is constant: advantages all 0 and the loss finite (only the KL term remains).
    adv = advantages_by_group(torch.ones(12), ids(12, 6), eps=0.0)
    assert torch.equal(adv, torch.zeros(12))
    logp, old, ref, _, mask = random_batch(N=12)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    assert torch.isfinite(loss) and close(stats["pg_loss"], 0.0)


def test_group_advantages_validation_names_the_flag():
    with pytest.raises(ValueError, match="--model.sampling.group_size"):  # groups of one row: no baseline
        advantages_by_group(torch.ones(6), ids(6, 1))
    with pytest.raises(ValueError, match="7 rewards but 6 group ids"):
        advantages_by_group(torch.ones(7), ids(6, 6))
    with pytest.raises(ValueError, match="--model.optimisation.advantage_scale"):
        advantages_by_group(torch.ones(6), ids(6, 6), scale="global")


def test_groups_by_index_of_any_size_give_the_contiguous_numbers():
    """Contiguous runs of one size are the [B, G] layout (``size`` G); interleaved or unequal groups (CycleGRPO's N
    captions beside N x K groundings) are not, and are normalised group by group to the same values."""
    assert Groups.of(ids(6, 3)).size == 3
    assert Groups.of([0, 1, 0, 1]).size is None and Groups.of([0, 0, 1, 1, 1]).size is None
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g)
    contiguous = advantages_by_group(rewards, ids(12, 4))
    perm = torch.randperm(12, generator=g)
    shuffled = advantages_by_group(rewards[perm], torch.tensor(ids(12, 4))[perm])
    assert close(shuffled, contiguous[perm], 1e-6)
    # groups of 2 and 3 rows: each its own mean and std; a constant group exactly 0
    adv = advantages_by_group(torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0]), [0, 0, 1, 1, 1], eps=0.0)
    assert close(adv, [1 / math.sqrt(0.5) / 2, -1 / math.sqrt(0.5) / 2, 0, 0, 0], 1e-6)
    assert zero_variance_groups(torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0]), [0, 0, 1, 1, 1]).tolist() == [False, True]


# ---------------------------------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_worked():
    # Policy gives the token p = 1/2, the reference 1/4: ref - logp = -ln 2.
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert close(kl_penalty(logp, ref, "k1"), [LN2])  # logp - ref = ln 2
    assert close(kl_penalty(logp, ref, "k2"), [0.5 * LN2**2])  # 0.2402
    assert close(kl_penalty(logp, ref, "k3"), [0.5 + LN2 - 1])  # exp(-ln 2) + ln 2 - 1 = 0.1931
    assert close(kl_penalty(logp, ref, "abs"), [LN2])
    # k3 clamps: ref - logp = 30 is clamped to 20 and exp(20) - 21 ~ 4.9e8 to 10; ref - logp = -30 -> 20 - 1 = 19 -> 10.
    assert close(kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([30.0, -30.0]), "k3"), [10.0, 10.0])
    # k3 is never negative and is 0 at equality.
    assert close(kl_penalty(torch.zeros(3), torch.zeros(3), "k3"), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="--model.kl.estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_k3_matches_verl_low_var_kl():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(50, generator=g) * 40  # wide range so the clamps bind
    ref = -torch.rand(50, generator=g) * 40
    assert close(kl_penalty(logp, ref, "k3"), verl_low_var_kl(logp, ref), 1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation and the policy loss
# ---------------------------------------------------------------------------------------------------------------------


def test_aggregations_hand_worked():
    loss_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert close(aggregate(loss_tok, mask, "token-mean"), 2.5)  # (1 + 2 + 3 + 4) / 4 tokens
    assert close(aggregate(loss_tok, mask, "seq-mean-token-mean"), 3.0)  # (mean 2 + mean 4) / 2 sequences
    assert close(aggregate(loss_tok, mask, "seq-mean-token-sum-norm"), 10 / 6)  # 10 / (N=2 * T=3)
    assert close(aggregate(loss_tok, mask, "seq-mean-token-sum-norm", max_length=5), 1.0)  # 10 / (2 * 5)
    # An all-padding sequence contributes 0 to seq-mean-token-mean but still counts (TRL clamps its length to 1).
    assert close(aggregate(loss_tok, torch.tensor([[1, 1, 1], [0, 0, 0]]), "seq-mean-token-mean"), 1.0)
    assert close(masked_mean(loss_tok, torch.zeros(2, 3)), 0.0)
    with pytest.raises(ValueError, match="--model.optimisation.aggregation"):
        aggregate(loss_tok, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_matches_verl(mode):
    g = torch.Generator().manual_seed(4)
    loss_tok = torch.randn(5, 8, generator=g)
    mask = (torch.arange(8)[None] < torch.tensor([[8], [3], [1], [5], [7]])).float()
    assert close(aggregate(loss_tok, mask, mode), verl_agg_loss(loss_tok, mask, mode), 1e-6)


def test_policy_loss_clip_high_hand_worked():
    # logp - old = 1 for every token, so the ratio is e = 2.718 > 1.2. With A = +1 the clipped term is 1.2 * A and
    # the pessimistic max(-e * A, -1.2 * A) is -1.2 for every token: loss -1.2, every token high-clipped.
    logp, old, mask = torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    loss, stats = policy_loss(logp, old, torch.ones(2), mask)
    assert close(loss, -1.2)
    assert close(stats["clip_frac_high"], 1.0) and close(stats["clip_frac_low"], 0.0)
    assert close(stats["ratio_mean"], math.e) and close(stats["kl"], 0.0)
    # Asymmetric clip (DAPO clip-higher 0.28): the bound becomes 1.28.
    loss, _ = policy_loss(logp, old, torch.ones(2), mask, clip_high=0.28)
    assert close(loss, -1.28)
    # With A = -1 the ratio is *not* bounded above: max(e, 1.2) = e. Nothing is "clipped" for the sign of A.
    loss, stats = policy_loss(logp, old, -torch.ones(2), mask)
    assert close(loss, math.e)
    assert close(stats["clip_frac_high"], 0.0) and close(stats["clip_frac_low"], 0.0)


def test_policy_loss_clip_low_hand_worked():
    # Ratio e^-1 = 0.368 < 0.8. With A = -1: max(0.368, 0.8) = 0.8 (clip binds, low side); with A = +1:
    # max(-0.368, -0.8) = -0.368 (no clip: lowering the probability of a good token is never rewarded past the bound).
    logp, old, mask = -torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0, 1.0]), mask)
    assert close(loss, (0.8 - math.exp(-1)) / 2)  # token-mean over 3 + 3 tokens
    assert close(stats["clip_frac_low"], 0.5) and close(stats["clip_frac_high"], 0.0)


def test_policy_loss_dual_clip_hand_worked():
    # logp - old = 2: ratio e^2 = 7.389. For A = -1 the PPO loss is max(7.389, 1.2) = 7.389; dual clip c = 3 caps it at
    # -A * c = 3. For A = +1 dual clip does nothing: -1.2.
    logp, old, mask = 2 * torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0, 1.0]), mask, dual_clip=3.0)
    assert close(loss, (3.0 - 1.2) / 2)
    assert close(stats["dual_clip_frac"], 0.5) and close(stats["clip_frac_high"], 0.5)
    # Below the cap (ratio e = 2.718 < 3) the dual clip does not bind.
    loss, stats = policy_loss(torch.ones(1, 2), torch.zeros(1, 2), -torch.ones(1), torch.ones(1, 2), dual_clip=3.0)
    assert close(loss, math.e) and close(stats["dual_clip_frac"], 0.0)
    with pytest.raises(ValueError, match="--model.optimisation.dual_clip"):
        policy_loss(logp, old, torch.ones(2), mask, dual_clip=1.0)


def test_policy_loss_gradient_on_policy():
    # One optimiser step per rollout: old = logp.detach(), the ratio is 1 (no clip binds), and d loss / d logp_it is
    # -A_i / (number of masked tokens) for token-mean: the plain policy gradient.
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert close(logp.grad, [[-0.5, -0.5, -0.5], [0.25, 0.0, 0.0]])


def test_policy_loss_kl_term_hand_worked():
    # Ratio 1 and A = 0: only the KL remains. logp = ln 1/2, ref = ln 1/4 -> k3 = 0.1931 per token, times kl_coef 0.5.
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    loss, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_coef=0.5)
    assert close(loss, 0.5 * (0.5 + LN2 - 1)) and close(stats["kl"], 0.5 + LN2 - 1)
    # kl_coef 0 with a reference: logged, not added.
    loss, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_coef=0.0)
    assert close(loss, 0.0) and close(stats["kl"], 0.5 + LN2 - 1)


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [
        ("grpo", "seq-mean-token-mean"),
        ("bnpo", "token-mean"),
        ("dapo", "token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
    ],
)
@pytest.mark.parametrize(("eps_low", "eps_high", "beta"), [(0.2, 0.2, 0.04), (0.2, 0.28, 0.0)])
def test_policy_loss_matches_trl(loss_type, aggregation, eps_low, eps_high, beta):
    logp, old, ref, adv, mask = random_batch(seed=5)
    expected, low, high = trl_loss(
        logp, old, ref, adv, mask, eps_low=eps_low, eps_high=eps_high, beta=beta, loss_type=loss_type,
        max_completion_length=10,
    )  # fmt: skip
    loss, stats = policy_loss(
        logp, old, adv, mask, clip_low=eps_low, clip_high=eps_high, ref_logp=ref, kl_coef=beta,
        aggregation=aggregation, max_length=10,
    )  # fmt: skip
    assert close(loss, expected, 1e-6)
    assert close(stats["clip_frac_low"], low) and close(stats["clip_frac_high"], high)
    assert 0 < float(stats["clip_frac_low"] + stats["clip_frac_high"]) < 1  # the case exercises both sides


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_matches_verl_dual_clip(mode):
    logp, old, _, adv, mask = random_batch(seed=7, spread=2.5)  # wide ratios so clip_ratio_c = 3 binds
    expected, clipfrac, clipfrac_lower = verl_policy_loss(old, logp, adv[:, None], mask, 0.2, 0.28, 3.0, mode)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation=mode)
    assert close(loss, expected, 1e-6)
    assert close(stats["dual_clip_frac"], clipfrac_lower) and float(clipfrac_lower) > 0
    # verl's pg_clipfrac counts a token when the clipped term wins; for A != 0 that is our low + high fractions.
    assert close(stats["clip_frac_low"] + stats["clip_frac_high"], clipfrac)


def test_policy_loss_padding_may_hold_inf():
    # Pad tokens can get -inf log-probs; they are masked out and must not turn the loss or its gradient into NaN.
    logp, old, ref, adv, mask = random_batch(seed=8)
    expected, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    pad = mask == 0
    assert pad.any()
    leaf = logp.masked_fill(pad, float("-inf")).requires_grad_(True)
    loss, stats = policy_loss(
        leaf, old.masked_fill(pad, float("-inf")), adv, mask, ref_logp=ref.masked_fill(pad, float("nan")), kl_coef=0.1
    )
    loss.backward()
    assert close(loss, expected) and torch.isfinite(leaf.grad).all() and (leaf.grad[pad] == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


def test_policy_loss_accepts_bool_mask_and_token_advantages():
    logp, old, ref, adv, mask = random_batch(seed=7)
    a, _ = policy_loss(logp, old, adv, mask.bool())
    b, _ = policy_loss(logp, old, adv[:, None].expand_as(logp), mask)
    assert close(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# Chunked log-softmax and entropy
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 4096])
def test_selective_log_softmax_matches_torch(dtype, tol, chunk_size):
    g = torch.Generator().manual_seed(8)
    full = (torch.randn(3, 8, 50, generator=g) * 4).to(dtype)
    full[0, 0, :10] = float("-inf")  # masked vocabulary entries must not produce NaN
    base = full.clone().requires_grad_(True)
    logits = base[:, :-1]  # non-contiguous, like out.logits[:, :-1]
    ids = torch.randint(10, 50, (3, 7), generator=g)
    ours = selective_log_softmax(logits, ids, chunk_size=chunk_size)
    # Reference: the textbook full log-softmax in float32 (what the chunks avoid materialising).
    ref = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    assert ours.dtype == torch.float32 and ours.shape == (3, 7)
    assert close(ours, ref, tol)
    w = torch.randn(3, 7, generator=g)
    (g_ours,) = torch.autograd.grad((ours * w).sum(), base)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), base)
    assert g_ours.dtype == dtype
    # bf16 gradients are rounded to bf16 in both paths (3 significant digits)
    assert close(g_ours.float(), g_ref.float(), 1e-5 if dtype == torch.float32 else 2e-2)


def test_selective_log_softmax_gradcheck_float64():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: selective_log_softmax(z, ids, chunk_size=2), (x,))


def test_token_entropy_matches_reference_and_masks():
    g = torch.Generator().manual_seed(10)
    base = (torch.randn(2, 5, 30, generator=g) * 2).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ent = token_entropy(base, mask, chunk_size=3)
    p = torch.softmax(base, dim=-1)
    ref = -(p * torch.log_softmax(base, dim=-1)).sum(-1) * mask
    assert close(ent, ref, 1e-5) and torch.equal(ent[0, 3:], torch.zeros(2))
    (g_ours,) = torch.autograd.grad(ent.sum(), base)
    (g_ref,) = torch.autograd.grad(ref.sum(), base)
    assert close(g_ours, g_ref, 1e-5)
    # Uniform logits over V: the entropy is ln V (maximal).
    assert close(token_entropy(torch.zeros(1, 2, 16)), [[math.log(16)] * 2])
    x = torch.randn(1, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: token_entropy(z, chunk_size=2), (x,))


def test_group_convergence_says_which_way_groups_tie():
    """Three groups of 2 (IoU rewards): both right, both wrong, mixed; uneven groups go through the same path."""
    iou = torch.tensor([0.9, 0.5, 0.1, 0.0, 0.7, 0.2])
    assert group_convergence(iou, [0, 0, 1, 1, 2, 2]) == pytest.approx((1 / 3, 1 / 3))
    assert group_convergence(iou, [0, 0, 0, 1, 1, 1], threshold=0.05) == (0.5, 0.0)  # 0.0 < 0.05: group 1 is mixed
    assert group_convergence(torch.tensor([1.0, 1.0, 0.0]), [0, 0, 1]) == (0.5, 0.5)
