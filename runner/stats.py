"""The study's intervals, as plain functions of numpy arrays (tests/study/test_study.py checks them by hand).

Two kinds of 95% interval, both stated in every table the study writes:

- **t over seeds** (``t_interval``): the mean of a method's per-seed scores (each the mean over the test scenes) +-
  ``t(0.975, n - 1) * s / sqrt(n)``, ``s`` the sample standard deviation of the n seeds. It covers the spread that
  training seeds cause; the test scenes are held fixed. It needs n >= 2.
- **paired bootstrap over scenes and seeds** (``paired_bootstrap``): for a difference A - B (Syn-GRPO - GRPO,
  a method - Original). Each replicate draws the test scenes with replacement (the same draw for A and B: the methods
  answered the same scenes) and the seeds with replacement (the same draw for both when they ran the same seeds;
  a method with one run, Original, keeps it), and takes mean(A) - mean(B) over the drawn seeds x scenes; the interval
  is the 2.5th and 97.5th percentile of the replicates. It covers both sources of noise: which scenes were drawn and
  which seeds ran.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# t(0.975, df) for df = 1..30 (two-sided 95%), from the t distribution's quantile function (scipy.stats.t.ppf;
# tests/study/test_study.py compares them to scipy where it is installed).
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


class Interval(NamedTuple):
    """A point estimate and its 95% interval ``[lo, hi]``; ``n`` is the number of seeds (t) or replicates
    (bootstrap) behind it, ``kind`` says which (``t``, ``bootstrap``, ``none``)."""

    mean: float
    lo: float
    hi: float
    n: int
    kind: str

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0


def t_quantile_975(df: int) -> float:
    """The 97.5th percentile of Student's t with ``df`` degrees of freedom (table up to 30, then a Cornish-Fisher
    expansion around the normal's 1.959964, within 1e-4 of the exact value for df > 30)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 seeds (df >= 1), got df = {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963985
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values) -> Interval:
    """Mean of ``values`` (one score per seed) and its 95% t interval; a single value gives ``kind="none"`` with
    ``lo = hi = mean`` (no spread to estimate)."""
    v = np.asarray(values, dtype=np.float64).ravel()  # [n seeds]
    if v.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(v.mean())
    if v.size == 1:
        return Interval(mean, mean, mean, 1, "none")
    half = t_quantile_975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return Interval(mean, mean - half, mean + half, int(v.size), "t")


def _weights(rng: np.random.Generator, n: int, replicates: int) -> np.ndarray:
    """How often each of ``n`` items is drawn in each replicate of a resample with replacement: ``[R, n]``."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=replicates).astype(np.float64)


def paired_bootstrap(
    a, b, replicates: int = 2000, seed: int = 0, paired_seeds: bool | None = None
) -> tuple[Interval, np.ndarray]:
    """95% percentile interval of ``mean(a) - mean(b)``, resampling scenes (columns, paired) and seeds (rows).

    ``a``: ``[seeds_a, scenes]``, ``b``: ``[seeds_b, scenes]`` per-scene scores on the same scenes in the same order.
    ``paired_seeds``: draw the same seed rows for both (default: when both have the same number of rows > 1). A side
    with one row keeps it in every replicate. Returns the interval (``mean`` is the observed difference) and the
    ``[replicates]`` differences.
    """
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))  # [Sa, J]
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))  # [Sb, J]
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must score the same scenes: {a.shape[1]} vs {b.shape[1]} columns")
    (sa, j), sb = a.shape, b.shape[0]
    if paired_seeds is None:
        paired_seeds = sa == sb and sa > 1
    if paired_seeds and sa != sb:
        raise ValueError(f"paired seeds need the same number of runs on both sides, got {sa} and {sb}")
    rng = np.random.default_rng(seed)
    wj = _weights(rng, j, replicates)  # [R, J] scene draw counts, shared by a and b
    wa = _weights(rng, sa, replicates)  # [R, Sa]
    wb = wa if paired_seeds else _weights(rng, sb, replicates)  # [R, Sb]
    mean_a = np.einsum("rs,sj,rj->r", wa, a, wj) / (sa * j)  # [R]
    mean_b = np.einsum("rs,sj,rj->r", wb, b, wj) / (sb * j)  # [R]
    diffs = mean_a - mean_b  # [R]
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return Interval(float(a.mean() - b.mean()), float(lo), float(hi), int(replicates), "bootstrap"), diffs


def bootstrap_mean(a, replicates: int = 2000, seed: int = 0) -> Interval:
    """95% percentile interval of ``mean(a)`` (``[seeds, scenes]``), resampling scenes and seeds: for a method with
    one run (Original), where a t interval over seeds does not exist."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    interval, _ = paired_bootstrap(a, np.zeros((1, a.shape[1])), replicates, seed, paired_seeds=False)
    return interval
