"""Confidence bounds that turn an auditor's counts into a lower bound on epsilon.

Two inputs and an event (LDP-Auditor: Arcolezi and Gambs, "Revealing the True Cost of
Locally Differentially Private Protocols: An Auditing Perspective", PETS 2024; the
method of Jagielski, Ullman and Oprea, "Auditing Differentially Private Machine
Learning: How Private is Private SGD?", NeurIPS 2020). Every (eps, delta)-DP mechanism M
satisfies, for any two inputs v0, v1 and any event S fixed before the trials,

    P[M(v0) in S] <= e^eps P[M(v1) in S] + delta,
    so   eps >= ln((P[M(v0) in S] - delta) / P[M(v1) in S]).

With k0 of n0 trials of v0 and k1 of n1 trials of v1 landing in S, the one-sided
Clopper-Pearson bounds (Clopper and Pearson, Biometrika 1934), each at level alpha / 2,

    p0_low  = B^-1(alpha / 2; k0, n0 - k0 + 1)      (0 when k0 = 0),
    p1_high = B^-1(1 - alpha / 2; k1 + 1, n1 - k1)  (1 when k1 = n1),

B^-1 the beta quantile, give ``epsilon_lower_bound`` = max(0, ln((p0_low - delta) / p1_high)).
Both intervals hold together with probability at least 1 - alpha (union bound), and then
the bound is at most the true eps: a mechanism that keeps its promise is reported above it
with probability at most alpha, whatever the sample sizes. The bound is a statement about
the code that produced the trials, not about the mechanism's paper.

Planning (``planned_trials``). Where the mechanism's own law gives p0 = P[S | v0] and
p1 = P[S | v1], the audit can be sized before it runs: the bound at n trials each, with
the counts at their beta / 2 quantiles against the auditor (k0 low, k1 high), is a value
the real bound exceeds with probability at least 1 - beta; ``planned_trials`` is the
least n (power-of-two search, then bisection) at which that value reaches a target.

Threshold events (``best_threshold``). For a real-valued score (a projection of a model
update on a canary), S = {score >= t}; the t that maximizes the bound on a calibration
sample, drawn apart from the audit sample, is then used once on the audit sample. Choosing
t on the audit sample itself would make the bound the maximum of many, no longer a
(1 - alpha)-confidence bound.

One run (``one_run_lower_bound``; Steinke, Nasr and Jagielski, "Privacy Auditing with One
(1) Training Run", NeurIPS 2023, their main theorem for (eps, delta)-DP). m canaries, each
included independently with probability 1/2 (S_i uniform on {-1, +1}), one run of the
algorithm, then r guesses of S_i (the others abstain), v of them right. If the algorithm
is (eps, delta)-DP with respect to each canary, then with W ~ Binomial(r, s),
s = e^eps / (e^eps + 1) (the accuracy of eps-randomized response),

    P[V >= v] <= P[W >= v] + 2 m delta max_{i = 1..v} P[v > W >= v - i] / i  =: beta(eps, v).

An eps with beta(eps, v) <= alpha is rejected at level alpha; the lower bound is the end
of the run of rejected epsilons that starts at 0 (``one_run_lower_bound``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import stats

__all__ = [
    "ThresholdEvent",
    "best_threshold",
    "clopper_pearson_high",
    "clopper_pearson_low",
    "epsilon_lower_bound",
    "guaranteed_bound",
    "one_run_lower_bound",
    "one_run_p_value",
    "planned_trials",
]

#: Largest epsilon the one-run bound considers, and the step of its scan.
ONE_RUN_MAX_EPSILON = 50.0
ONE_RUN_STEP = 0.01


def clopper_pearson_low(
    successes: npt.ArrayLike, trials: npt.ArrayLike, alpha: float
) -> np.ndarray:
    """One-sided lower (1 - alpha)-confidence bound on a binomial probability:
    B^-1(alpha; k, n - k + 1), 0 when k = 0."""
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = stats.beta.ppf(alpha, k, n - k + 1)
    return np.where(k <= 0, 0.0, bound)


def clopper_pearson_high(
    successes: npt.ArrayLike, trials: npt.ArrayLike, alpha: float
) -> np.ndarray:
    """One-sided upper (1 - alpha)-confidence bound: B^-1(1 - alpha; k + 1, n - k), 1 when k = n."""
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = stats.beta.isf(alpha, k + 1, n - k)
    return np.where(k >= n, 1.0, bound)


def _check_level(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"the confidence parameter alpha must lie in (0, 1), got {alpha!r}")


def epsilon_lower_bound(
    hits0: npt.ArrayLike,
    trials0: npt.ArrayLike,
    hits1: npt.ArrayLike,
    trials1: npt.ArrayLike,
    alpha: float,
    delta: float = 0.0,
) -> np.ndarray:
    """max(0, ln((p0_low - delta) / p1_high)) with one-sided Clopper-Pearson bounds at
    alpha / 2 each (module docstring): exceeds the true epsilon with probability <= alpha."""
    _check_level(alpha)
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta!r}")
    low = clopper_pearson_low(hits0, trials0, alpha / 2) - delta
    high = clopper_pearson_high(hits1, trials1, alpha / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.log(np.where(low > 0, low, 1.0) / high)
    return np.where(low > 0, np.maximum(bound, 0.0), 0.0)


def guaranteed_bound(
    trials: npt.ArrayLike, p0: float, p1: float, alpha: float, beta: float
) -> np.ndarray:
    """The bound at ``trials`` per input with the counts at their beta / 2 quantiles against
    the auditor: the real bound is at least this with probability >= 1 - beta."""
    n = np.asarray(trials, dtype=np.float64)
    low_hits = stats.binom.ppf(beta / 2, n, p0)
    high_hits = stats.binom.isf(beta / 2, n, p1)
    return epsilon_lower_bound(low_hits, n, high_hits, n, alpha)


def planned_trials(
    p0: float, p1: float, target: float, alpha: float, beta: float, limit: int
) -> int | None:
    """The least n (to within 1%) at which ``guaranteed_bound`` reaches ``target``, or None
    when even ``limit`` trials do not (the event's probabilities are too small)."""
    if not (0.0 <= p1 < p0 <= 1.0):
        raise ValueError(f"planning needs 0 <= p1 < p0 <= 1, got p0={p0!r}, p1={p1!r}")

    def reaches(n: int) -> bool:
        return bool(guaranteed_bound(n, p0, p1, alpha, beta) >= target)

    high = 64
    while not reaches(high):
        if high >= limit:
            return None
        high = min(2 * high, limit)
    low = high // 2
    while high - low > max(1, low // 100):
        middle = (low + high) // 2
        if reaches(middle):
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class ThresholdEvent:
    """S = {score >= threshold}, chosen on a calibration sample; ``bound`` is what it gave there."""

    threshold: float
    bound: float


def best_threshold(
    scores0: np.ndarray, scores1: np.ndarray, alpha: float, delta: float = 0.0
) -> ThresholdEvent:
    """The threshold t maximizing the bound of S = {score >= t} with ``scores0`` (from v0,
    expected higher) against ``scores1``, over every distinct calibration score."""
    ordered0 = np.sort(np.asarray(scores0, dtype=np.float64))
    ordered1 = np.sort(np.asarray(scores1, dtype=np.float64))
    candidates = np.unique(np.concatenate([ordered0, ordered1]))
    hits0 = ordered0.size - np.searchsorted(ordered0, candidates, side="left")
    hits1 = ordered1.size - np.searchsorted(ordered1, candidates, side="left")
    bounds = epsilon_lower_bound(hits0, ordered0.size, hits1, ordered1.size, alpha, delta)
    best = int(np.argmax(bounds))
    return ThresholdEvent(float(candidates[best]), float(bounds[best]))


def one_run_p_value(
    canaries: int, guesses: int, correct: int, epsilon: npt.ArrayLike, delta: float
) -> np.ndarray:
    """beta(eps, v) of Steinke et al.'s bound (module docstring), capped at 1, for each
    epsilon given."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}"
        )
    accuracy = 1.0 / (1.0 + np.exp(-np.asarray(epsilon, dtype=np.float64)))
    tail = stats.binom.sf(correct - 1, guesses, accuracy)
    if delta == 0.0 or correct == 0:
        return np.minimum(tail, 1.0)
    # P[v > W >= v - i] for i = 1..v: cumulative sums of the pmf at v - 1, v - 2, ..., 0.
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, accuracy[..., None])
    spread = np.max(np.cumsum(below, axis=-1) / np.arange(1, correct + 1), axis=-1)
    return np.minimum(tail + 2.0 * canaries * delta * spread, 1.0)


def one_run_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, alpha: float
) -> float:
    """The end of the first run of rejected epsilons from 0: the largest eps with
    ``one_run_p_value`` <= alpha at every epsilon up to it (0 if it is above alpha at 0).

    If the algorithm is eps*-DP and the bound exceeds eps*, then eps* itself was rejected,
    which happens with probability at most alpha (the theorem at eps*), whether or not the
    p-value grows with eps. Scanned on a grid of ``ONE_RUN_STEP``, then bisected to 1e-6
    within the step where it first exceeds alpha."""
    _check_level(alpha)
    grid = np.arange(0.0, ONE_RUN_MAX_EPSILON + ONE_RUN_STEP / 2, ONE_RUN_STEP)
    exceeds = np.flatnonzero(one_run_p_value(canaries, guesses, correct, grid, delta) > alpha)
    if exceeds.size == 0:
        return float(grid[-1])
    if exceeds[0] == 0:
        return 0.0
    low, high = float(grid[exceeds[0] - 1]), float(grid[exceeds[0]])
    while high - low > 1e-6:
        middle = (low + high) / 2
        if one_run_p_value(canaries, guesses, correct, middle, delta) <= alpha:
            low = middle
        else:
            high = middle
    return low
