"""The GRPO objective as pure tensor functions (no Lightning, no I/O).

Shapes: ``N`` completions (rows) in advantage groups named by index (`Groups`: ``B`` prompts x ``G`` completions in
plain GRPO, groups of other sizes in nested methods), ``T`` completion tokens (right padded), ``V`` vocabulary size.

Where this departs from the textbook (and from the peers it stays comparable with; see docs/objective.md):

- Advantages are group-centred rewards, optionally divided by the *unbiased* std of the group (``scale="group"``, TRL's
  default and verl's ``grpo``), of the whole batch (``"batch"``), or not at all (``"none"``, Dr. GRPO). The epsilon in
  the denominator defaults to TRL's 1e-4 (verl uses 1e-6).
- A group whose rewards are all equal carries no learning signal: its advantages are forced to exactly 0 (the centred
  value is not always exactly 0 in floating point, e.g. ``mean([0.1] * 6) != 0.1`` in float32), so those completions
  only feel the KL term.
- The surrogate is PPO's clipped ratio with asymmetric bounds ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher)
  and optional dual clip for negative advantages (verl's ``clip_ratio_c``). The log-ratio is clamped to [-20, 20]
  before ``exp`` like verl, so one wild token cannot produce ``inf``.
- The KL to the frozen reference is added *per token* to the loss (not to the reward), k3 estimator by default, with
  verl's ``low_var_kl`` clamps.
- Aggregation is a named choice: ``token-mean`` (TRL ``dapo`` / ``bnpo`` on one process, verl ``token-mean``),
  ``seq-mean-token-mean`` (TRL ``grpo``), ``seq-mean-token-sum-norm`` (TRL ``dr_grpo``: divide by ``N * max_length``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "SCALES",
    "Groups",
    "LossCount",
    "advantages_by_group",
    "aggregate",
    "group_convergence",
    "group_reward_stats",
    "kl_penalty",
    "loss_count",
    "masked_mean",
    "policy_loss",
    "selective_log_softmax",
    "side_row_weights",
    "token_entropy",
    "zero_variance_groups",
]

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# (sequence, token) rows of the [N, T, V] logits upcast to float32 at once by the chunked softmax helpers. 512 rows
# of a 152k-token vocabulary (Qwen2.5-VL) is ~300 MiB in float32: small next to the logits themselves.
DEFAULT_CHUNK_SIZE = 512


@dataclass(frozen=True)
class Groups:
    """A step's advantage groups by index, the one representation of groups (verl's ``index`` array): rows with the
    same id form a group, of any size and in any order (GRPO: the G completions of a prompt; CycleGRPO: the N captions
    of a sample and, apart, the K groundings under each caption, two groupings that never mix).

    Shapes: ``ids`` [N] long. ``size`` is G when the ids are contiguous runs of one size (a plain rollout's [B, G]
    layout): the reductions then take one [B, G] view of the rows (the textbook's numbers, one kernel) instead of a
    loop over the groups."""

    ids: torch.Tensor
    """[N] each row's group."""
    size: int | None
    """G for contiguous groups of one size, else None."""

    @classmethod
    def of(cls, group_ids: torch.Tensor | Sequence[int] | Groups, device: torch.device | None = None) -> Groups:
        """The groups of ``group_ids`` ([N] ids, or groups already built)."""
        if isinstance(group_ids, Groups):
            return group_ids
        ids = torch.as_tensor(group_ids, device=device).reshape(-1)
        runs, counts = torch.unique_consecutive(ids, return_counts=True)
        uniform = ids.numel() > 0 and runs.numel() == torch.unique(ids).numel() and bool((counts == counts[0]).all())
        return cls(ids, int(counts[0]) if uniform else None)

    def members(self) -> list[torch.Tensor]:
        """Per group (in id order), the indices of its rows."""
        return [(self.ids == g).nonzero().squeeze(1) for g in torch.unique(self.ids)]


def _rows(rewards: torch.Tensor | Sequence[float], groups: Groups) -> torch.Tensor:
    """The rewards as a detached float [N] tensor, checked against the groups."""
    r = torch.as_tensor(rewards).detach()
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if r.numel() == 0 or r.numel() != groups.ids.numel():
        raise ValueError(f"{r.numel()} rewards but {groups.ids.numel()} group ids (one per row, at least one row)")
    return r if r.is_floating_point() else r.float()


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | Groups) -> torch.Tensor:
    """Which groups have all-equal rewards (and hence zero advantage): rewards [N] -> bool [number of groups], in id
    order. Useful for logging the fraction of zero-variance groups."""
    groups = Groups.of(group_ids)
    r = _rows(rewards, groups)
    if groups.size is not None:
        grouped = r.view(-1, groups.size)  # [B, G]
        return (grouped == grouped[:, :1]).all(dim=1)  # [B]
    return torch.tensor([bool((r[i] == r[i][0]).all()) for i in groups.members()])


def _contiguous_advantages(r: torch.Tensor, G: int, scale: str, eps: float) -> torch.Tensor:
    """`advantages_by_group` over contiguous groups of G rows, as one [B, G] view."""
    grouped = r.view(-1, G)  # [B, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [B, G]
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [B, 1]
    centred = centred.masked_fill(constant, 0.0)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)  # std [B, 1]
    elif scale == "batch":
        centred = centred / (r.std() + eps)  # scalar std over all B*G rewards
    # 0 / (0 + eps) is 0, but eps may be 0: keep the promise "constant group -> exactly 0" without dividing 0 by 0.
    centred = centred.masked_fill(constant, 0.0)
    return centred.reshape(-1)


def advantages_by_group(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int] | Groups,
    scale: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative advantages over any grouping (`Groups`): rows with the same id are normalised together.

    Args:
        rewards: [N] total reward per completion.
        group_ids: [N] each row's group (a method's plan names them; two-level groups are one call per grouping, or
            one call on ids that never mix). Every group needs at least 2 rows.
        scale: ``group`` -> (r - group mean) / (group std + eps); ``batch`` -> (r - group mean) / (batch std + eps);
            ``none`` -> r - group mean. Stds are unbiased (``torch.std`` default), as in TRL and verl.
        eps: added to the std (TRL 1e-4, verl 1e-6).

    Returns:
        [N] advantages (float32 or the input float dtype), detached. Groups with all-equal rewards get exactly 0.
    """
    if scale not in SCALES:
        raise ValueError(f"--model.optimisation.advantage_scale must be one of {'|'.join(SCALES)}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"advantage eps must be >= 0, got {eps!r}")
    r = torch.as_tensor(rewards).detach()
    groups = Groups.of(group_ids, device=r.device)
    r = _rows(r, groups)
    if groups.size is not None and groups.size >= 2:
        return _contiguous_advantages(r, groups.size, scale, eps)
    out = torch.zeros_like(r)
    batch_std = r.std()
    for idx in groups.members():
        if idx.numel() < 2:
            g = int(groups.ids[idx[0]])
            raise ValueError(
                f"group {g} has {idx.numel()} row(s); a group needs >= 2 (--model.sampling.group_size >= 2 for "
                "group-normalised advantages)"
            )
        sub = r[idx]
        if bool((sub == sub[0]).all()):
            continue
        centred = sub - sub.mean()
        if scale == "group":
            centred = centred / (sub.std() + eps)
        elif scale == "batch":
            centred = centred / (batch_std + eps)
        out[idx] = centred
    return out


def group_reward_stats(rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | Groups) -> tuple[float, float]:
    """(mean within-group std of the rewards, fraction of groups whose rewards are all equal) over any grouping."""
    groups = Groups.of(group_ids)
    r = torch.as_tensor(rewards).detach().float()
    G = groups.size
    if G is not None and G >= 2:
        return float(r.view(-1, G).std(dim=1).mean()), float(zero_variance_groups(r, groups).float().mean())
    stds, constant = [], []
    for idx in groups.members():
        sub = r[idx]
        stds.append(float(sub.std()) if sub.numel() > 1 else 0.0)
        constant.append(bool((sub == sub[0]).all()))
    return sum(stds) / len(stds), sum(constant) / len(constant)


def group_convergence(
    values: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | Groups, threshold: float = 0.5
) -> tuple[float, float]:
    """(fraction of groups whose values are all >= ``threshold``, fraction whose values are all below it): which way
    the groups of an outcome reward converge (all answers right, all wrong) when they tie."""
    groups = Groups.of(group_ids)
    v = torch.as_tensor(values).detach().float().reshape(-1)
    if groups.size is not None:  # contiguous equal-size groups (every GRPO step): one reduction per side
        lo, hi = v.view(-1, groups.size).amin(1), v.view(-1, groups.size).amax(1)
    else:
        members = groups.members()
        lo = torch.stack([v[i].min() for i in members])
        hi = torch.stack([v[i].max() for i in members])
    return float((lo >= threshold).float().mean()), float((hi < threshold).float().mean())


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs (Schulman's k1 / k2 / k3).

    Args:
        logp, ref_logp: [N, T] log-probs of the sampled tokens under the policy and the frozen reference.
        estimator: ``k1`` = logp - ref; ``k2`` = 0.5 (logp - ref)^2; ``k3`` = exp(ref - logp) - (ref - logp) - 1
            (unbiased, non-negative, low variance; ref - logp clamped to [-20, 20] and the result to [-10, 10] like
            verl's ``low_var_kl``); ``abs`` = |logp - ref|.

    Returns:
        [N, T] per-token penalty (differentiable in ``logp``).
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()
    if estimator == "k3":
        log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    if estimator == "abs":
        return (logp - ref_logp).abs()
    raise ValueError(f"--model.kl.estimator must be one of {'|'.join(KL_ESTIMATORS)}, got {estimator!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (same shape); 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(
    loss_tok: torch.Tensor, mask: torch.Tensor, aggregation: str = "token-mean", max_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_tok: [N, T] per-token loss.
        mask: [N, T] 1 for completion tokens that count, 0 for padding (bool or float).
        aggregation: ``token-mean``: sum over masked tokens / number of masked tokens (long completions weigh more);
            ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (every completion
            weighs the same; a sequence with no tokens contributes 0 but still counts, as in TRL);
            ``seq-mean-token-sum-norm``: sum over masked tokens / (N * max_length) (Dr. GRPO: a constant normaliser,
            no length bias).
        max_length: the constant of ``seq-mean-token-sum-norm`` (the generation budget); defaults to T.

    Returns:
        scalar tensor.
    """
    if loss_tok.dim() != 2 or mask.shape != loss_tok.shape:
        raise ValueError(f"loss_tok and mask must both be [N, T], got {tuple(loss_tok.shape)} and {tuple(mask.shape)}")
    m = mask.to(loss_tok.dtype)
    loss_tok = torch.where(mask != 0, loss_tok, 0.0)  # a NaN / inf in padding must not leak into the sum
    if aggregation == "token-mean":
        return (loss_tok * m).sum() / m.sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        per_seq = (loss_tok * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # [N]
        return per_seq.mean()
    if aggregation == "seq-mean-token-sum-norm":
        length = loss_tok.shape[1] if max_length is None else max_length
        if length < 1:
            raise ValueError(f"--model.sampling.max_new_tokens must be >= 1 for seq-mean-token-sum-norm, got {length}")
        return (loss_tok * m).sum() / (loss_tok.shape[0] * length)
    raise ValueError(f"--model.optimisation.aggregation must be one of {'|'.join(AGGREGATIONS)}, got {aggregation!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    max_length: int | None = None,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate GRPO loss with an optional per-token KL penalty.

    Args:
        logp: [N, T] log-probs of the sampled tokens under the current policy (carries the gradient).
        old_logp: [N, T] the same under the policy that sampled them (detached; equals ``logp.detach()`` when each
            rollout batch gets a single optimiser step, which makes the ratio 1 but keeps the gradient).
        advantages: [N] one advantage per completion (or [N, T] per token).
        mask: [N, T] completion-token mask.
        clip_low, clip_high: ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: verl's ``clip_ratio_c`` (> 1, e.g. 3.0): for A < 0 the loss is capped at -A * c, so a token whose
            ratio exploded cannot dominate. None disables it.
        ref_logp: [N, T] log-probs under the frozen reference model, or None.
        kl_coef: weight of the KL term (used only when ``ref_logp`` is given and ``kl_coef > 0``).
        kl_estimator: see :func:`kl_penalty`.
        aggregation, max_length: see :func:`aggregate`.
        row_weights: [N] or None: each row's per-token loss (surrogate and KL) is multiplied by its weight before
            aggregation (`side_row_weights`: a method whose rows form sides with losses of their own). None (every
            method but CycleGRPO) leaves the loss untouched; the statistics are never weighted.

    Returns:
        ``(loss, stats)``: scalar loss; ``stats`` holds detached scalars ``kl`` (masked token mean, 0 without a
        reference), ``clip_frac_low`` (ratio < 1 - clip_low with A < 0: the clip that binds for negative
        advantages), ``clip_frac_high`` (ratio > 1 + clip_high with A > 0), ``dual_clip_frac`` (A < 0 and the
        dual-clip cap binds), ``ratio_mean`` and ``pg_loss`` (the surrogate alone, aggregated).
    """
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must be [N, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if not (0.0 <= clip_low < 1.0):
        raise ValueError(f"--model.optimisation.clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0.0:
        raise ValueError(f"--model.optimisation.clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(
            f"--model.optimisation.dual_clip must be > 1 (verl's clip_ratio_c, e.g. 3.0) or null, got {dual_clip}"
        )
    if not kl_coef >= 0.0:
        raise ValueError(f"--model.kl.coef must be >= 0, got {kl_coef}")

    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages must have N={logp.shape[0]} entries, got {advantages.shape[0]}")
        adv = advantages[:, None]  # [N, 1]
    elif advantages.shape == logp.shape:
        adv = advantages  # [N, T]
    else:
        raise ValueError(f"advantages must be [N] or [N, T], got {tuple(advantages.shape)}")
    adv = adv.detach().to(logp.dtype)
    m = mask.to(logp.dtype)
    # Padding positions may hold anything (-inf log-probs of pad tokens): zero them *before* any arithmetic, since
    # masking afterwards by multiplication would turn a NaN into a NaN gradient.
    valid = mask != 0
    logp = torch.where(valid, logp, 0.0)
    old_logp = torch.where(valid, old_logp.detach(), 0.0)
    if ref_logp is not None:
        ref_logp = torch.where(valid, ref_logp.detach(), 0.0)

    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    pg_unclipped = -adv * ratio  # [N, T]
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    pg_tok = torch.maximum(pg_unclipped, pg_clipped)  # pessimistic bound, [N, T]
    negative = adv < 0  # [N, 1] or [N, T]
    if dual_clip is not None:
        cap = -adv * dual_clip  # [N, 1]; positive where A < 0
        dual_bound = negative & (pg_tok > cap)
        pg_tok = torch.where(negative, torch.minimum(pg_tok, cap), pg_tok)
    else:
        dual_bound = torch.zeros_like(pg_tok, dtype=torch.bool)

    loss_tok = pg_tok
    if ref_logp is not None:
        kl_tok = kl_penalty(logp, ref_logp, kl_estimator)  # [N, T]
        if kl_coef > 0:
            loss_tok = loss_tok + kl_coef * kl_tok
        kl_stat = masked_mean(kl_tok.detach(), m)
    else:
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"--model.kl.estimator must be one of {'|'.join(KL_ESTIMATORS)}, got {kl_estimator!r}")
        kl_stat = logp.new_zeros(())

    if row_weights is not None:
        if row_weights.shape != logp.shape[:1]:
            raise ValueError(f"row_weights must be [N] = [{logp.shape[0]}], got {tuple(row_weights.shape)}")
        loss_tok = loss_tok * row_weights.to(loss_tok.dtype)[:, None]
    loss = aggregate(loss_tok, m, aggregation, max_length)
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "kl": kl_stat,
            "clip_frac_low": masked_mean(((r < 1.0 - clip_low) & negative).to(m.dtype), m),
            "clip_frac_high": masked_mean(((r > 1.0 + clip_high) & (adv > 0)).to(m.dtype), m),
            "dual_clip_frac": masked_mean(dual_bound.expand_as(r).to(m.dtype), m),
            "ratio_mean": masked_mean(r, m),
            "pg_loss": aggregate(pg_tok.detach(), m, aggregation, max_length),
        }
    return loss, stats


@dataclass(frozen=True)
class LossCount:
    """What a step's loss is normalised by, computed once per step (`loss_count`) and passed down to the loss of its
    micro-batches and to the side weights, as verl's ``agg_loss`` takes its normaliser as an argument.

    DDP and FSDP2 average the ranks' gradients, so each rank divides by the ranks' *mean* count, not its own: the
    averaged gradient is then the aggregation over the global batch, whatever each rank holds (one process: its own
    count). The count is of tokens under ``token-mean``, of rows otherwise."""

    per_row: torch.Tensor
    """[N] what each row adds to the count: its completion tokens under ``token-mean``, 1 otherwise."""
    local: torch.Tensor
    """This rank's count (at least 1): what a micro-batch's share of the logged statistics is relative to."""
    denom: torch.Tensor
    """The ranks' mean of ``local``: what the step's loss divides by."""

    def share(self, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """What rows ``rows`` add to the count."""
        return self.per_row[rows].sum()


def loss_count(
    mask: torch.Tensor, aggregation: str, rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> LossCount:
    """The step's `LossCount` from its completion mask [N, T] (float) and ``--model.optimisation.aggregation``;
    ``rank_mean``: the mean over the ranks of a tensor (the module's all-reduce), None on one process."""
    if aggregation == "token-mean":
        per_row = mask.sum(1)  # [N]
    else:
        per_row = torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)  # [N]
    local = per_row.sum().clamp(min=1)
    return LossCount(per_row, local, rank_mean(local) if rank_mean is not None else local)


def side_row_weights(
    count: LossCount,
    side_ids: torch.Tensor,
    side_weights: Sequence[float],
    rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Row weights that turn one aggregation over all rows into ``sum_s w_s * L_s``, each side's loss ``L_s`` an
    aggregation over its own rows across the ranks (CycleGRPO: caption rows and grounding rows, paper 004's equal-
    weight objective).

    The step's loss divides each rank's sum over (weighted) row losses by ``count.denom``, the ranks' mean count (of
    tokens under token-mean, of rows otherwise), and DDP averages the ranks' gradients. Weighting row r of side s by
    ``w_s * denom / c_s``, with ``c_s`` the ranks' mean count of side s, gives ``sum_s w_s * (sum of side s's row
    losses over all ranks) / (its count over all ranks)``: side s's global mean, weighted ``w_s``, whatever each
    rank holds of it.

    Args:
        count: the step's `LossCount` (``per_row`` [N]: what each row adds to the count on this rank).
        side_ids: [N] long, each row's side in ``0 .. S-1``.
        side_weights: [S] the sides' weights ``w_s`` (>= 0; a side of weight 0 adds nothing, KL included).
        rank_mean: the mean over the ranks of an [S] tensor (the step's own reduction); None on one process.

    Returns:
        [N] float32 weights (0 for the rows of a side of weight 0).
    """
    row_counts = count.per_row
    w = torch.as_tensor(side_weights, dtype=torch.float32, device=row_counts.device)  # [S]
    ids = side_ids.to(row_counts.device).long()
    if ids.shape != row_counts.shape:
        raise ValueError(f"side_ids {tuple(ids.shape)} and row_counts {tuple(row_counts.shape)} must both be [N]")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.numel()):
        raise ValueError(f"side ids must lie in [0, {w.numel()}) (one weight per side), got {ids.unique().tolist()}")
    local = torch.zeros_like(w).index_add_(0, ids, row_counts.detach().float())  # [S] this rank's count per side
    counts = rank_mean(local) if rank_mean is not None else local  # [S] the ranks' mean count per side
    counts = counts.float()
    # a side with no rows anywhere has no row to weigh: any positive divisor will do
    scale = count.denom.detach().float().to(w.device) / torch.where(counts > 0, counts, torch.ones_like(counts))  # [S]
    return (w * scale)[ids]  # [N]


def _upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half / bfloat16 / float32 logits, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _blocks(shape: torch.Size, chunk_size: int) -> list[tuple[slice, slice]]:
    """(sequence slice, token slice) blocks of about ``chunk_size`` rows covering an [N, T, ...] tensor.

    Indexing blocks (rather than flattening to [N*T, V]) keeps every chunk a view even when the logits are a
    non-contiguous slice such as ``out.logits[:, :-1]``, so the full tensor is never copied.
    """
    n, t = shape[0], shape[1]
    if t == 0 or n == 0:
        return []
    if t >= chunk_size:
        return [(slice(i, i + 1), slice(j, j + chunk_size)) for i in range(n) for j in range(0, t, chunk_size)]
    per = max(1, chunk_size // t)
    return [(slice(i, i + per), slice(0, t)) for i in range(0, n, per)]


def _save_blockwise(ctx, logits, extra, lse, chunk_size: int, block_grad, n_inputs: int) -> None:
    """What `_blockwise_backward` needs: the logits, one [N, T] tensor of the function's own, the logsumexp [N, T]."""
    ctx.save_for_backward(logits, extra, lse)
    ctx.chunk_size, ctx.block_grad, ctx.n_inputs = chunk_size, block_grad, n_inputs


def _blockwise_backward(ctx, grad_out: torch.Tensor):
    """d loss / d logits one block of rows at a time in float32: ``ctx.block_grad(logp [n, t, V], g [n, t, 1],
    extra [n, t])`` gives a block's gradient, so no float32 [N, T, V] tensor exists."""
    logits, extra, lse = ctx.saved_tensors
    grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)  # [N, T, V]
    g = grad_out.to(lse.dtype)  # [N, T]
    for ns, ts in _blocks(logits.shape[:-1], ctx.chunk_size):
        logp = logits[ns, ts].to(lse.dtype) - lse[ns, ts, None]  # [n, t, V]
        grad[ns, ts] = ctx.block_grad(logp, g[ns, ts, None], extra[ns, ts]).to(grad.dtype)
    return (grad,) + (None,) * (ctx.n_inputs - 1)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[ids] computed block by block in float32, with a blockwise backward.

    Saves only the input logits (already alive in the caller) and the per-token logsumexp [N, T], so neither the
    forward nor the backward materialises a float32 [N, T, V] tensor.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out = torch.empty(ids.shape, dtype=_upcast_dtype(logits.dtype), device=logits.device)  # [N, T]
        lse = torch.empty_like(out)  # [N, T]
        for ns, ts in _blocks(ids.shape, chunk_size):
            chunk = logits[ns, ts].to(out.dtype)  # [n, t, V]
            chunk_lse = torch.logsumexp(chunk, dim=-1)  # [n, t]
            lse[ns, ts] = chunk_lse
            out[ns, ts] = chunk.gather(-1, ids[ns, ts, None]).squeeze(-1) - chunk_lse
        _save_blockwise(ctx, logits, ids, lse, chunk_size, _SelectiveLogSoftmax.block_grad, n_inputs=3)
        return out

    @staticmethod
    def block_grad(logp: torch.Tensor, g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # d logp(id) / d logits = onehot(id) - softmax(logits)
        chunk_grad = -g * torch.exp(logp)
        return chunk_grad.scatter_add_(-1, ids[..., None], g)

    backward = staticmethod(torch.autograd.function.once_differentiable(_blockwise_backward))


def selective_log_softmax(
    logits: torch.Tensor, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Log-probabilities of ``ids`` under ``logits`` without a full-vocabulary float32 log-softmax.

    Args:
        logits: [N, T, V] (any float dtype; bf16 is upcast one chunk at a time).
        ids: [N, T] token ids (int64).
        chunk_size: about how many (sequence, token) rows of logits are upcast at once.

    Returns:
        [N, T] float32 log-probs (float64 for float64 logits); differentiable w.r.t. ``logits`` (first order) with a chunked backward.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits [N, T, V] and ids [N, T] disagree: {tuple(logits.shape)} vs {tuple(ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _SelectiveLogSoftmax.apply(logits, ids.long(), int(chunk_size))


class _TokenEntropy(torch.autograd.Function):
    """Per-token entropy, block by block in float32, with a blockwise backward.

    dH/dz_v = -p_v (log p_v + H), so the backward needs only the logits and the saved [N, T] entropy and logsumexp.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        ent = torch.zeros(logits.shape[:-1], dtype=_upcast_dtype(logits.dtype), device=logits.device)  # [N, T]
        lse = torch.zeros_like(ent)  # [N, T]
        for ns, ts in _blocks(logits.shape, chunk_size):
            chunk = logits[ns, ts].to(ent.dtype)  # [n, t, V]
            chunk_lse = torch.logsumexp(chunk, dim=-1, keepdim=True)  # [n, t, 1]
            # entr(p) = -p log p with entr(0) = 0, so masked-out vocabulary entries (-inf logits) give no NaN.
            ent[ns, ts] = torch.special.entr(torch.exp(chunk - chunk_lse)).sum(dim=-1)
            lse[ns, ts] = chunk_lse.squeeze(-1)
        _save_blockwise(ctx, logits, ent, lse, chunk_size, _TokenEntropy.block_grad, n_inputs=2)
        return ent

    @staticmethod
    def block_grad(logp: torch.Tensor, g: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        probs = torch.exp(logp)
        # p * logp is 0 where p is 0 (a -inf logit): keep it so, not NaN
        term = torch.where(probs > 0, probs * (logp + ent[..., None]), torch.zeros_like(probs))
        return -g * term

    backward = staticmethod(torch.autograd.function.once_differentiable(_blockwise_backward))


def token_entropy(
    logits: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Per-token entropy of the predictive distribution.

    H = -sum_v p_v log p_v with p = softmax(z), computed one block of rows at a time in float32. Differentiable
    (first order) w.r.t. ``logits`` with a blockwise backward, so an entropy bonus never materialises a float32
    [N, T, V] tensor either; pass ``logits.detach()`` (or call under ``torch.no_grad()``) for logging.

    Args:
        logits: [N, T, V].
        mask: optional [N, T]; entries where ``mask == 0`` are set to 0 (reduce with :func:`masked_mean` or
            :func:`aggregate` for a scalar).
        chunk_size: about how many (sequence, token) rows of logits are upcast at once.

    Returns:
        [N, T] float32 entropies in nats (float64 for float64 logits), zero where masked out.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V], got {tuple(logits.shape)}")
    ent = _TokenEntropy.apply(logits, int(chunk_size))
    if mask is not None:
        ent = ent * (mask != 0).to(ent.dtype)
    return ent
