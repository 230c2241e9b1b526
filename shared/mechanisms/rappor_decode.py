"""Decoding RAPPOR statistics against candidate strings (server side; imports scipy lazily).

The model. With t_jb the debiased count of Bloom bit b in cohort j (``Rappor.bloom_counts``),
N_j the reports of cohort j, A_{jb,v} = 1 when candidate v sets bit b in cohort j, and
x_v the share of all reports whose value is v (cohorts are assigned independently of
values, so cohort j holds about N_j x_v of them),

    t_jb = N_j sum_v A_{jb,v} x_v + e_jb,
    Var[e_jb] = N_j s0 + T_jb (s1 - s0),   s0 = p*(1-p*)/(q*-p*)^2,  s1 = q*(1-q*)/(q*-p*)^2.

Rows are whitened by the variance at T_jb = 0: y_jb = t_jb / sqrt(N_j s0) and
X_{jb,v} = sqrt(N_j / s0) A_{jb,v}, so that y = X x + e with Var[e_jb] = omega_jb =
1 + (T_jb / N_j)(s1 - s0) / s0, which is 1 wherever no candidate sits and exactly 1 when
p* + q* = 1. X is sparse (at most h ones per cohort block per candidate) and is never
formed densely over all candidates.

Strings outside the candidates are not noise-free zeros: each sets every Bloom bit with
probability rho = 1 - (1 - 1/k)^h (its hash bytes are uniform), so mass u spread over
many of them adds about N_j u rho to every t_jb. An extra non-negative column, the
*background*, models it (``background=True``, the default); without it that mass leaks
into the candidates, a little into each.

1. **Selection** (``selection="auto"``: when C > m k / 4, or ``"lasso"``): non-negative
   LASSO, min 1/2 ||y - X x||^2 + lam sum_v ||X_v|| x_v over x >= 0, with
   lam = max(1, z_crit - 2). The penalty is in units of each candidate's noise: a null
   candidate enters only if its correlation with the residual exceeds lam standard
   deviations, and a candidate at the detection threshold z_crit enters with probability
   about Phi(2) = 0.977. Solved by a working-set method: the non-negative quadratic
   program on the working set (the background always in it, unpenalized), then the
   KKT conditions of every candidate from one sparse product, adding the worst
   violators until none is left. Each quadratic program (``nonnegative_qp``) runs
   accelerated projected gradient, warm-started, to KKT conditions within 1e-7
   standard errors, then is polished to the exact solution of the equations on its
   positive set (Lawson-Hanson NNLS if that fails). Deterministic: no
   cross-validation, no random restarts.
2. **Fit**: min ||y - X_S x||^2 over the selected S (and the background column, see
   ``_Problem``) with x >= 0 and the candidates' sum at most 1 (NNLS; if the sum
   exceeds 1, the Lagrange multiplier of the sum is found by Newton steps on the
   piecewise-linear sum, safeguarded by bisection).
3. **Standard errors** on the support P = {x_v > 0}, where the constrained solution is
   the least-squares fit on P: Cov = G^-1 (X_P' Omega X_P) G^-1, G = X_P' X_P, Omega at
   the fitted T_jb. A candidate outside P gets the standard error it would have if
   added to P (at frequency 0): 1 / (||X_v||^2 - X_v' X_P G^-1 X_P' X_v).
4. **Detection**: z_v = x_v / std_v against the one-sided null x_v = 0, p_v = 1 - Phi(z_v).
   Benjamini-Hochberg at false discovery rate alpha (``correction="bh"``, the default,
   alpha = 0.2): the expected share of false strings among the detected is at most alpha.
   Or Bonferroni over all C candidates (``"bonferroni"``): detected when z_v > z_crit =
   Phi^-1(1 - alpha / C), so the probability of any false positive is at most about
   alpha (the selection threshold is below z_crit, so selecting first does not add
   false positives). Or no correction (``"none"``: each candidate tested at level alpha,
   so about alpha C
   false positives among C absent candidates; the reference decoder's rule, a mean
   above 2 standard deviations, is ``"none"`` at alpha = 1 - Phi(2) = 0.0228).
5. **Mass**: explained = sum_v x_v with std sqrt(1' Cov 1); unexplained = 1 - explained
   (every report holds some string: that share belongs to strings outside the
   candidates), of which the background column takes ``background_mass``. The
   residual chi-square sum r_jb^2 / omega_jb on m k - |P| degrees of freedom tests
   whether the candidates explain the Bloom counts.
6. **Smallest detectable frequency**: z_crit times each candidate's standard error at
   frequency 0 is the frequency at which it is detected with probability 1/2; the
   estimate reports these thresholds and their median.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from shared.mechanisms.rappor_common import (
    BloomDecodable,
    RapporEstimate,
    distinct_per_row,
    factorize_strings,
)
from shared.statistics import CountStatistics

#: Selection runs (``"auto"``) when the candidates outnumber this share of the m k rows.
LASSO_WHEN_CANDIDATES_EXCEED = 0.25
#: The LASSO threshold sits this many standard errors below the detection threshold.
SELECTION_MARGIN = 2.0
#: Candidates added to the LASSO working set per round, at most.
WORKING_SET_STEP = 256
#: Relative ridge added to Gram matrices before factorizing (guards exact collinearity).
RIDGE = 1e-12
#: Candidates per block when computing standard errors of the excluded candidates.
STD_BLOCK = 2048
#: Optimality of the quadratic programs: KKT conditions hold to this many standard errors.
KKT_TOLERANCE = 1e-7
#: Iterations of accelerated projected gradient before the exact fallback.
FISTA_ITERATIONS = 20_000


def decode(
    mech: BloomDecodable,
    stats: CountStatistics,
    candidates: Sequence[str],
    *,
    alpha: float,
    correction: str,
    selection: str = "auto",
    background: bool = True,
) -> RapporEstimate:
    """Frequencies of the candidate strings, with standard errors and detection (module doc)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if correction not in ("bonferroni", "bh", "none"):
        raise ValueError(f"correction must be 'bonferroni', 'bh' or 'none', got {correction!r}")
    if selection not in ("auto", "lasso", "none"):
        raise ValueError(f"selection must be 'auto', 'lasso' or 'none', got {selection!r}")
    distinct, codes = factorize_strings(candidates, "candidate")
    if not distinct:
        raise ValueError("give at least one candidate string")
    if len(distinct) != codes.size:
        first = int(np.flatnonzero(np.bincount(codes) > 1)[0])
        raise ValueError(f"candidate {distinct[first]!r} is listed more than once")
    problem = _Problem(mech, stats, distinct, background)
    count = len(distinct)
    z_crit = NormalDist().inv_cdf(1 - (alpha if correction == "none" else alpha / count))

    use_lasso = selection == "lasso" or (
        selection == "auto" and count > LASSO_WHEN_CANDIDATES_EXCEED * problem.rows
    )
    if use_lasso:
        selected = problem.lasso_support(max(1.0, z_crit - SELECTION_MARGIN))
    else:
        selected = np.arange(count)
    columns = np.concatenate([selected, problem.extra])
    coefficients = np.zeros(problem.columns)
    coefficients[columns] = problem.constrained_fit(columns)
    frequencies = coefficients[:count]

    support = np.flatnonzero(coefficients > 0)
    all_std, all_at_zero, covariance = problem.standard_errors(coefficients, support)
    std, std_at_zero = all_std[:count], all_at_zero[:count]
    in_candidates = support < count
    explained_covariance = covariance[np.ix_(in_candidates, in_candidates)]
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, frequencies / std, 0.0)
    p_values = _norm_sf(z)
    if correction != "bh":
        detected = p_values <= (alpha if correction == "none" else alpha / count)
        z_threshold = z_crit
    else:
        detected = _benjamini_hochberg(p_values, alpha)
        level = alpha * max(1, int(detected.sum())) / count
        z_threshold = NormalDist().inv_cdf(1 - level)
    detected &= frequencies > 0
    thresholds = z_threshold * std_at_zero
    finite = thresholds[np.isfinite(thresholds)]
    explained = float(frequencies.sum())
    residual = problem.residual_chi2(coefficients, support)
    return RapporEstimate(
        frequencies=frequencies,
        std=std,
        n=stats.n,
        candidates=tuple(distinct),
        detected=detected,
        p_values=p_values,
        selected=np.isin(np.arange(count), selected),
        detection_thresholds=thresholds,
        explained_mass=explained,
        explained_mass_std=float(math.sqrt(max(0.0, explained_covariance.sum()))),
        unexplained_mass=1.0 - explained,
        background_mass=float(coefficients[count:].sum()),
        smallest_detectable_frequency=float(np.median(finite)) if finite.size else math.inf,
        alpha=alpha,
        correction=correction,
        residual_chi2=residual,
        residual_dof=problem.rows - support.size,
    )


class _Problem:
    """The whitened sparse regression y = X x + e of one decode.

    Columns 0..C-1 are the candidates; with ``background``, column C is the uniform
    background: a string outside the candidates sets each Bloom bit with probability
    rho = 1 - (1 - 1/k)^h (its h hash bytes are uniform), so mass u spread over many
    such strings adds about N_j u rho to every t_jb.
    """

    def __init__(
        self, mech: BloomDecodable, stats: CountStatistics, candidates: list[str], background: bool
    ) -> None:
        from scipy import sparse

        counts = mech.bloom_counts(stats)
        live = np.flatnonzero(counts.reports > 0)  # cohorts without reports say nothing
        k, h = mech.num_bits, mech.num_hashes
        reports = counts.reports[live]
        s0 = mech.noise_per_report
        q_star, p_star = mech.q_star, mech.p_star
        self.excess = (q_star * (1 - q_star) - p_star * (1 - p_star)) / (
            p_star * (1 - p_star)
        )  # (s1 - s0) / s0
        self.rows = live.size * k
        self.scale = np.repeat(np.sqrt(reports / s0), k)  # row weight sqrt(N_j / s0)
        self.y = (counts.counts[live] / np.sqrt(reports * s0)[:, None]).reshape(-1)
        bits = mech.candidate_bits(candidates)[:, live, :]  # (C, L, h)
        cells = bits + (np.arange(live.size) * k)[None, :, None]
        cells = distinct_per_row(cells.reshape(-1, h)).reshape(len(candidates), -1)
        columns = np.broadcast_to(np.arange(len(candidates))[:, None], cells.shape)
        keep = cells >= 0
        rows, cols, data = cells[keep], columns[keep], self.scale[cells[keep]]
        count = len(candidates)
        self.extra = np.arange(count, count + int(background))  # the background column
        self.columns = count + self.extra.size
        if background:
            rho = 1.0 - (1.0 - 1.0 / k) ** h
            rows = np.concatenate([rows, np.arange(self.rows)])
            cols = np.concatenate([cols, np.full(self.rows, count)])
            data = np.concatenate([data, self.scale * rho])
        self.x = sparse.csc_matrix((data, (rows, cols)), shape=(self.rows, self.columns))
        self.xt = self.x.T.tocsr()
        self.norms_sq = np.asarray(self.x.power(2).sum(axis=0)).reshape(-1)
        self.xty = self.xt @ self.y

    def gram(self, columns: np.ndarray) -> np.ndarray:
        block = self.x[:, columns]
        return np.asarray((block.T @ block).toarray())

    def lasso_support(self, lam: float) -> np.ndarray:
        """Candidates with a positive coefficient in the non-negative LASSO at level ``lam``.

        Working set: start from the strongest KKT violators at x = 0, solve the
        non-negative quadratic program on the set, recompute every candidate's
        correlation with the residual (one sparse product), add the worst violators,
        and repeat until no candidate violates its KKT condition.
        """
        penalty = lam * np.sqrt(self.norms_sq)
        penalty[self.extra] = 0.0  # the background is not selected: it is always in
        working = self.extra.copy()
        coef = np.zeros(working.size)
        if working.size:
            coef = nonnegative_qp(self.gram(working), self.xty[working])
        residual = self.y - self.x[:, working] @ coef
        for _ in range(10_000):  # each round adds at least one candidate: terminates
            violation = (self.xt @ residual - penalty) / np.sqrt(self.norms_sq)
            violation[working] = -np.inf
            worst = np.flatnonzero(violation > KKT_TOLERANCE)
            if not worst.size:
                break
            worst = worst[np.argsort(-violation[worst], kind="stable")[:WORKING_SET_STEP]]
            keep = (coef > 0) | np.isin(working, self.extra)
            working = np.concatenate([working[keep], worst])
            start = np.concatenate([coef[keep], np.zeros(worst.size)])
            order = np.argsort(working, kind="stable")
            working, start = working[order], start[order]
            target = self.xty[working] - penalty[working]
            coef = nonnegative_qp(self.gram(working), target, start)
            residual = self.y - self.x[:, working] @ coef
        chosen = working[coef > 0]
        return chosen[~np.isin(chosen, self.extra)]

    def constrained_fit(self, columns: np.ndarray) -> np.ndarray:
        """min ||y - X_S x||^2 over x >= 0 with the candidates' sum at most 1.

        (The background, a nuisance column, is only non-negative.)
        """
        if columns.size == 0:
            return np.zeros(0)
        gram, target = self.gram(columns), self.xty[columns]
        counted = (~np.isin(columns, self.extra)).astype(np.float64)  # the sum's weights
        coef = nonnegative_qp(gram, target)
        if counted @ coef <= 1.0:
            return coef
        # The sum binds: find mu >= 0 with e'x(mu) = 1, x(mu) the solution for
        # (G, b - mu e). e'x(mu) is continuous, piecewise linear and non-increasing in
        # mu; Newton steps on the current piece, kept inside a bracket by bisection.
        low, high = 0.0, float(max(target.max(), 0.0)) + 1.0
        mu = 0.0
        for _ in range(200):
            total = float(counted @ coef)
            if abs(total - 1.0) <= 1e-12:
                break
            if total > 1.0:
                low = mu
            else:
                high = mu
            free = coef > 0
            # Least squares, not solve: candidates whose Bloom bits coincide in every cohort
            # that has reports give equal columns, and the block is then singular.
            direction = np.linalg.lstsq(gram[np.ix_(free, free)], counted[free], rcond=None)[0]
            slope = float(counted[free] @ direction)
            step = mu + (total - 1.0) / slope if slope > 0 else math.nan
            mu = step if low < step < high else (low + high) / 2
            coef = nonnegative_qp(gram, target - mu * counted, coef)
            if high - low <= 1e-15 * max(1.0, high):
                break
        total = float(counted @ coef)
        if total > 1.0:  # within rounding of the bracket: rescale the candidates onto the sum
            coef = np.where(counted > 0, coef / total, coef)
        return coef

    def standard_errors(
        self, frequencies: np.ndarray, support: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(std, std at frequency 0, covariance on the support) for every candidate."""
        from scipy import linalg

        count = frequencies.size  # every column, the background included
        std = np.empty(count)
        at_zero = np.empty(count)
        others = np.setdiff1d(np.arange(count), support)
        if support.size == 0:
            at_zero[:] = 1.0 / np.sqrt(self.norms_sq)
            std[:] = at_zero
            return std, at_zero, np.zeros((0, 0))
        block = self.x[:, support]
        gram = self.gram(support)
        factor = linalg.cho_factor(
            gram + RIDGE * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
        )
        inverse = linalg.cho_solve(factor, np.eye(support.size))
        fitted_share = np.clip((block @ frequencies[support]) / self.scale, 0.0, 1.0)
        omega = 1.0 + fitted_share * self.excess
        middle = np.asarray((block.T @ block.multiply(omega[:, None])).toarray())
        covariance = inverse @ middle @ inverse
        std[support] = np.sqrt(np.clip(np.diag(covariance), 0.0, None))
        at_zero[support] = np.sqrt(np.clip(np.diag(inverse), 0.0, None))
        for start in range(0, others.size, STD_BLOCK):
            chunk = others[start : start + STD_BLOCK]
            cross = np.asarray((self.xt[chunk] @ block).toarray())  # (chunk, |P|)
            explained = np.einsum("ij,ij->i", cross, linalg.cho_solve(factor, cross.T).T)
            remaining = self.norms_sq[chunk] - explained
            with np.errstate(divide="ignore"):
                at_zero[chunk] = np.where(
                    remaining > 1e-9 * self.norms_sq[chunk], 1.0 / np.sqrt(remaining), np.inf
                )
        std[others] = at_zero[others]
        return std, at_zero, covariance

    def residual_chi2(self, frequencies: np.ndarray, support: np.ndarray) -> float:
        fitted = self.x[:, support] @ frequencies[support] if support.size else 0.0
        share = np.clip(np.asarray(fitted) / self.scale, 0.0, 1.0)
        omega = 1.0 + share * self.excess
        return float((((self.y - fitted) ** 2) / omega).sum())


def nonnegative_qp(
    gram: np.ndarray, target: np.ndarray, start: np.ndarray | None = None
) -> np.ndarray:
    """argmin_{x >= 0} 1/2 x' G x - b' x for positive definite G (a Gram matrix).

    Accelerated projected gradient (FISTA with adaptive restart, step 1/L with L the
    largest row sum of G, an upper bound on its largest eigenvalue since G >= 0
    entrywise) until every KKT condition holds to ``KKT_TOLERANCE`` standard errors
    (each gradient entry divided by sqrt(G_vv)); then polished to the exact solution
    by solving the equations on the positive set, kept if it is still feasible and
    optimal, else refined by Lawson-Hanson NNLS (``scipy.optimize.nnls``).
    Deterministic, warm-startable.
    """
    size = target.size
    if size == 0:
        return np.zeros(0)
    scale = np.sqrt(np.diag(gram))
    lipschitz = float(np.abs(gram).sum(axis=1).max())
    x = np.zeros(size) if start is None else np.maximum(start, 0.0)
    momentum, previous, t = x.copy(), x.copy(), 1.0
    for iteration in range(FISTA_ITERATIONS):
        gradient = gram @ momentum - target
        x = np.maximum(momentum - gradient / lipschitz, 0.0)
        if np.dot(momentum - x, x - previous) > 0:  # restart when momentum points uphill
            t, momentum = 1.0, x.copy()
        else:
            t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
            momentum = x + (t - 1) / t_next * (x - previous)
            t = t_next
        previous = x
        if iteration % 10 == 9 and _kkt_violation(gram, target, x, scale) <= KKT_TOLERANCE:
            break
    positive = np.flatnonzero(x > 0)
    polished = np.zeros(size)
    if positive.size:
        from scipy import linalg

        block = gram[np.ix_(positive, positive)]
        try:
            with warnings.catch_warnings():  # ill-conditioned: leave it to the NNLS below
                warnings.simplefilter("error", linalg.LinAlgWarning)
                polished[positive] = linalg.solve(block, target[positive], assume_a="pos")
        except (linalg.LinAlgError, linalg.LinAlgWarning, ValueError):
            polished[positive] = -1.0
    if np.all(polished[positive] > 0) and (
        _kkt_violation(gram, target, polished, scale) <= KKT_TOLERANCE
    ):
        return polished
    return _nnls_exact(gram, target)


def _kkt_violation(gram: np.ndarray, target: np.ndarray, x: np.ndarray, scale: np.ndarray) -> float:
    """Largest KKT violation in standard-error units: |grad| where x > 0, -grad where x = 0."""
    gradient = (gram @ x - target) / scale
    return float(np.max(np.where(x > 0, np.abs(gradient), -gradient)))


def _nnls_exact(gram: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The same problem by Lawson-Hanson NNLS on the Cholesky factor of G.

    With G = R'R and c = R'^-1 b, ||R x - c||^2 = x' G x - 2 b' x + const, so
    ``scipy.optimize.nnls(R, c)`` solves it exactly (up to a 1e-12 relative ridge on G).
    """
    from scipy import linalg, optimize

    size = target.size
    ridge = RIDGE * max(float(np.trace(gram)) / size, 1e-300)
    upper = linalg.cholesky(gram + ridge * np.eye(size), lower=False)
    rhs = linalg.solve_triangular(upper, target, trans="T", lower=False)
    coef, _ = optimize.nnls(upper, rhs, maxiter=50 * size + 100)
    return np.asarray(coef)


def _norm_sf(z: np.ndarray) -> np.ndarray:
    from scipy import stats

    return np.asarray(stats.norm.sf(z))


def _benjamini_hochberg(p_values: np.ndarray, alpha: float) -> np.ndarray:
    """Reject the k smallest p-values, k the largest i with p_(i) <= i alpha / C."""
    count = p_values.size
    order = np.argsort(p_values, kind="stable")
    passing = np.flatnonzero(p_values[order] <= alpha * np.arange(1, count + 1) / count)
    detected = np.zeros(count, dtype=bool)
    if passing.size:
        detected[order[: passing[-1] + 1]] = True
    return detected


__all__ = ["decode", "nonnegative_qp"]
