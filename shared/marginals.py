"""Consistent one-way and 2-way marginals from unbiased per-view estimates.

A multi-attribute report (``shared.mechanisms.multidim``) gives one unbiased frequency
vector f_v per view (a declared pair, d1 x d2 cells, or one attribute) with its covariance
Sigma_v, held as diagonal plus low rank (``ViewCovariance``: never a dense D x D matrix).

Consistency (after CALM, Zhang, Wang, Li, He, Chen, CCS 2018, Section 4.4), all linear:

1. every view is made to sum to 1: N f = f + (1 - sum f) / D (N = I - 1 1^T / D on the
   centred part; E[sum f] = 1 so it stays unbiased);
2. an attribute A covered by declared pairs u gets the one-way estimate
   F_A = sum_u w_u P_A N f_u, P_A the projection on A (sum over the other attribute), with
   fixed weights w_u proportional to 1 / (mean planning variance of P_A N f_u), summing to
   1 (data-independent weights keep it linear, hence unbiased);
3. pair v = (A, B) is shifted to match: f'_v = N f_v + (F_A - P_A N f_v) 1^T / d2 +
   1 (F_B - P_B N f_v)^T / d1, whose row sums are F_A and column sums F_B exactly.

Every output is then r^T N f_v plus sums of projections of other views. Its variance is
the sum of each view's own term, computed exactly from Sigma_v by ``row_variances`` (for
rows s_ab = gamma e_ab + alpha R_a + beta C_b, R_a the cells of row a, C_b of column b, and
r = N s: r^T Sigma r = sum_c r_c^2 diag_c + sum_k w_k (phi_k . r)^2, O(D) per factor),
plus the covariances BETWEEN views (``ViewDependence``). With X_j a device's value in view
j (a one-hot over its cells) and r, t functionals on views j != l:

* ``spl``: the views are drawn independently given the population: no cross term;
* ``smp``: given the reports per view m_j, the devices' assignment to views is a uniformly
  random partition of the n; the LDP noise is independent across devices, so only the
  group shares G_j (E[f_j | assignment]) covary, and two disjoint groups' means of one
  device-level quantity (simple random sampling) have
  Cov(r^T G_j, t^T G_l) = -Cov_pop(r(X_j), t(X_l)) / (n - 1), the population covariance
  with divisor n (within a view the same argument gives rho Sigma / m,
  ``sampling_covariance``). N only subtracts a constant from r (G_j sums to 1), which a
  covariance ignores;
* ``rsfd``: every device reports every view, truly in its sampled view s (uniform over k)
  and fake elsewhere, the reports independent given s. A device's report statistic X'_j has
  E[X'_j | s] = phi_j + [s = j] (rho_j(x) - phi_j) (rho_j the true report's expectation at
  its value x, phi_j the fake's), so Cov(X'_j, X'_l) = -(1/k^2) d_j d_l^T, d = rho - phi.
  GRR: d_j = (p - q)(e_x - 1/D); OUE-z: d_j = (p - q) e_x; with f_j = (C_j / n - q') / (p' - q')
  and p' - q' = (p - q) / k for both, Cov(f_j, f_l) = -(1/n) E_pop[(e_Xj - c_j)(e_Xl - c_l)^T]
  (c = 1/D under GRR, 0 under OUE), and through N (which maps the constant vector to 0):
  Cov(r^T N f_j, t^T N f_l) = -(1/n) E_pop[(r(X_j) - rbar)(t(X_l) - tbar)], rbar the mean of
  r over view j's cells (NOT the population mean: a raw second moment).

The population moments are plugged in from the estimate (each pair's Norm-Sub joint g, the
distribution its own sampling term uses): with F, G the margins of pair v = (A, B),
E[1(A=a) 1(A=a)] = F_a, E[1(A=a) 1(B=b)] = g_ab, E[s_ab 1(A=a)] = (gamma + beta) g_ab +
alpha F_a, E[s_ab 1(B=b)] = (gamma + alpha) g_ab + beta G_b. Every cross term of the
consistent outputs is one of these (below), so the whole variance stays O(D r).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ViewCovariance:
    """Sigma = diag(diagonal) + factors diag(weights) factors^T (D x D, never built)."""

    diagonal: np.ndarray
    factors: np.ndarray
    weights: np.ndarray

    def plus(self, diagonal: np.ndarray, factor: np.ndarray, weight: float) -> ViewCovariance:
        """Sigma + diag(diagonal) + weight factor factor^T."""
        return ViewCovariance(
            self.diagonal + diagonal,
            np.column_stack([self.factors, factor]),
            np.append(self.weights, weight),
        )

    def dense(self) -> np.ndarray:
        """The matrix itself (for tests on small domains)."""
        return np.diag(self.diagonal) + (self.factors * self.weights) @ self.factors.T


def frequency_covariance(
    p: float, q: float, frequencies: np.ndarray, m: float, single_report: bool
) -> ViewCovariance:
    """Cov of f = (C / m - q) / (p - q) over m devices whose shares are ``frequencies`` g.

    ``single_report`` (GRR-like: each report is one category a, P(a | x) = q + (p - q)[x = a]):
    C is a sum of independent categorical draws, so with delta = p - q, pi = q + delta g,
    Cov[f] = (diag(pi / delta^2 - g) - (pi / delta)(pi / delta)^T + g g^T) / m.
    Otherwise (unary bits, independent given the value): Cov[f] =
    diag(q (1 - q) + g (p (1 - p) - q (1 - q))) / (m delta^2) (Wang et al. 2017).
    """
    g = np.asarray(frequencies, dtype=np.float64)
    delta = p - q
    if single_report:
        scaled = (q + delta * g) / delta
        return ViewCovariance(
            (scaled / delta - g) / m, np.column_stack([scaled, g]), np.array([-1.0 / m, 1.0 / m])
        )
    diagonal = (q * (1 - q) + g * (p * (1 - p) - q * (1 - q))) / (m * delta**2)
    return ViewCovariance(diagonal, np.zeros((g.size, 0)), np.zeros(0))


def sampling_covariance(frequencies: np.ndarray, m: float, n: float) -> tuple[np.ndarray, float]:
    """The share among m devices drawn without replacement from n, around the share G
    among all n: Cov = rho (diag G - G G^T) / m, rho = (n - m) / (n - 1) (finite
    population). Returns (diagonal, weight of G G^T)."""
    rho = (n - m) / (n - 1) if n > 1 else 0.0
    return rho * frequencies / m, -rho / m


def norm_sub(frequencies: np.ndarray) -> np.ndarray:
    """The closest distribution in the Norm-Sub sense (Wang et al., NDSS 2020): max(f - t, 0)
    with t such that the result sums to 1 (all-equal when nothing is positive)."""
    f = np.asarray(frequencies, dtype=np.float64).ravel()
    if f.size == 0:
        return f
    ordered = np.sort(f)[::-1]
    cumulative = np.cumsum(ordered) - 1.0
    k = np.arange(1, f.size + 1)
    fits = ordered - cumulative / k > 0
    if not fits.any():
        return np.full(f.shape, 1.0 / f.size)
    last = int(np.flatnonzero(fits)[-1])
    return np.maximum(f - cumulative[last] / (last + 1), 0.0)


def fit_margins(
    joint: np.ndarray, rows: np.ndarray, columns: np.ndarray, rounds: int = 200
) -> np.ndarray:
    """A valid joint with the given row and column margins (both distributions), by
    iterative proportional fitting from ``joint`` mixed with 1e-3 of the product of the
    margins (so that every cell the margins allow has mass and the fit can reach them)."""
    start = 0.999 * joint + 0.001 * np.outer(rows, columns)
    fitted = start / start.sum()
    for _ in range(rounds):
        row_sums = fitted.sum(axis=1)
        fitted = (
            fitted * np.divide(rows, row_sums, out=np.zeros_like(rows), where=row_sums > 0)[:, None]
        )
        column_sums = fitted.sum(axis=0)
        fitted = fitted * np.divide(
            columns, column_sums, out=np.zeros_like(columns), where=column_sums > 0
        )
    return fitted / fitted.sum()


def row_variances(
    cov: ViewCovariance, shape: tuple[int, int], gamma: float, alpha: float, beta: float
) -> np.ndarray:
    """Var[r_ab^T f] for every cell (a, b) of a d1 x d2 view, r_ab = N s_ab,
    s_ab = gamma e_ab + alpha R_a + beta C_b (see the module docstring). O(D r)."""
    d1, d2 = shape
    size = d1 * d2
    diagonal = cov.diagonal.reshape(shape)
    rows, columns, total = (
        diagonal.sum(axis=1)[:, None],
        diagonal.sum(axis=0)[None, :],
        (diagonal.sum()),
    )
    sigma = (gamma + alpha * d2 + beta * d1) / size
    squares = (
        diagonal * (gamma + alpha + beta) ** 2
        + alpha**2 * (rows - diagonal)
        + beta**2 * (columns - diagonal)
    )
    linear = gamma * diagonal + alpha * rows + beta * columns
    variance = squares - 2 * sigma * linear + sigma**2 * total
    for factor, weight in zip(cov.factors.T, cov.weights, strict=True):
        phi = factor.reshape(shape)
        dot = (
            gamma * phi
            + alpha * phi.sum(axis=1)[:, None]
            + beta * phi.sum(axis=0)[None, :]
            - sigma * phi.sum()
        )
        variance = variance + weight * dot**2
    return np.asarray(variance)


def pair_output_variance(
    cov: ViewCovariance,
    others: list[np.ndarray],
    alpha: float,
    beta: float,
    k_a: float,
    k_b: float,
) -> np.ndarray:
    """Var of e_ab + alpha R_a + beta C_b on a pair's own normalized view, plus k_a (k_b)
    times the weighted projections of the other views covering its first (second)
    attribute, whose variances (weights squared included) are ``others``."""
    shape = (others[0].size, others[1].size)
    return (
        row_variances(cov, shape, 1.0, alpha, beta)
        + k_a**2 * others[0][:, None]
        + k_b**2 * others[1][None, :]
    )


def normalize(frequencies: np.ndarray) -> np.ndarray:
    """N f = f + (1 - sum f) / D."""
    return frequencies + (1.0 - frequencies.sum()) / frequencies.size


@dataclass(frozen=True)
class ViewDependence:
    """Covariance between two distinct views' normalized estimates (module docstring):
    Cov(r^T N f_j, t^T N f_l) = scale * (E_pop[r(X_j) t(X_l)] - centred part), where the
    centred part is E[r] E[t] (``raw`` False: a population covariance, ``smp``) or
    rbar E[t] + tbar E[r] - rbar tbar (``raw`` True: about the functionals' cell averages,
    ``rsfd``). ``spl``: scale 0."""

    scale: float
    raw: bool

    def term(
        self,
        joint: np.ndarray,
        mean_r: np.ndarray,
        mean_t: np.ndarray,
        centre_r: np.ndarray | float,
        centre_t: np.ndarray | float,
    ) -> np.ndarray:
        """scale * the centred moment, from E[r t] (``joint``), E[r], E[t] and the cell
        averages of r and t."""
        if self.raw:
            centred = joint - centre_r * mean_t - centre_t * mean_r + centre_r * centre_t
        else:
            centred = joint - mean_r * mean_t
        return np.asarray(self.scale * centred)


#: Views independent given the population (``spl``).
INDEPENDENT = ViewDependence(0.0, raw=False)


@dataclass(frozen=True)
class PairView:
    """A declared pair's unbiased view: frequencies (d1, d2), covariances (observed, for
    std; planning, for the weights), the plug-in joint distribution g (d1, d2) of the
    cross-view terms, and the attributes (positions) it covers. A view without reports
    has NaN frequencies: it is left out of every combination."""

    columns: tuple[int, int]
    frequencies: np.ndarray
    cov: ViewCovariance
    planning: ViewCovariance
    distribution: np.ndarray

    @property
    def has_reports(self) -> bool:
        return bool(np.all(np.isfinite(self.frequencies)))


@dataclass(frozen=True)
class Consistent:
    """Consistent estimates: one-way per covered attribute (frequency, variance) and per
    pair (cells, variances, and the variances needed for conditionals)."""

    one_way: dict[int, tuple[np.ndarray, np.ndarray]]
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def cross_view_variance(
    dependence: ViewDependence,
    joint: np.ndarray,
    coefficients: tuple[float, float, float],
    kappa: tuple[float, float],
    others: tuple[tuple[float, float], tuple[float, float]],
) -> np.ndarray:
    """The cross-view part of Var[(N s_ab)^T f_v + k_A sum_u w_u R_a^T N f_u +
    k_B sum_u' w_u' C_b^T N f_u'] for every cell of pair v = (A, B) (plug-in joint g), with
    s_ab = gamma e_ab + alpha R_a + beta C_b, the sums over the other views covering A (B),
    ``others`` = ((W_A, S_A), (W_B, S_B)): their weights' sum and sum of squares.

    2 k_A W_A X(s, R_a) + 2 k_B W_B X(s, C_b) + k_A^2 (W_A^2 - S_A) X(R_a, R_a)
    + k_B^2 (W_B^2 - S_B) X(C_b, C_b) + 2 k_A k_B W_A W_B X(R_a, C_b), X the
    ``ViewDependence`` term of two distinct views (the pairs w_u w_u' with u != u';
    a view other than v covering both A and B would be v itself)."""
    gamma, alpha, beta = coefficients
    k_a, k_b = kappa
    (w_a, s_a), (w_b, s_b) = others
    d1, d2 = joint.shape
    rows, columns = joint.sum(axis=1)[:, None], joint.sum(axis=0)[None, :]
    sigma = (gamma + alpha * d2 + beta * d1) / (d1 * d2)
    mean_s = gamma * joint + alpha * rows + beta * columns
    with_row = dependence.term((gamma + beta) * joint + alpha * rows, mean_s, rows, sigma, 1 / d1)
    with_column = dependence.term(
        (gamma + alpha) * joint + beta * columns, mean_s, columns, sigma, 1 / d2
    )
    row_row = dependence.term(rows, rows, rows, 1 / d1, 1 / d1)
    column_column = dependence.term(columns, columns, columns, 1 / d2, 1 / d2)
    row_column = dependence.term(joint, rows, columns, 1 / d1, 1 / d2)
    return np.asarray(
        2 * k_a * w_a * with_row
        + 2 * k_b * w_b * with_column
        + k_a**2 * (w_a**2 - s_a) * row_row
        + k_b**2 * (w_b**2 - s_b) * column_column
        + 2 * k_a * k_b * w_a * w_b * row_column
    )


def make_consistent(pairs: list[PairView], dependence: ViewDependence = INDEPENDENT) -> Consistent:
    """CALM-style consistency over the declared pairs (module docstring, steps 1-3), over
    the pairs that have reports (the weights renormalized over them).

    For pair v = (A, B), every linear output is gamma e_ab + alpha R_a + beta C_b on v's own
    normalized view plus kappa_A w_uA P_A N f_u (and kappa_B for B) over the other pairs u
    covering A (B); its variance is ``row_variances`` on v plus sum_u (kappa w_u)^2 Var[P N f_u]
    plus the cross-view terms (``cross_view_variance``). A one-way F_A = sum_u w_u P_A N f_u
    has variance sum_u w_u^2 Var[P_A N f_u] + (1 - sum_u w_u^2) X(R_a, R_a), X at the
    weighted mean of the views' plug-in margins. Returned per pair: cells f', Var f', and
    Var[f' + F_A] (so Cov[f'_ab, F_A(a)] = (Var[f' + F_A] - Var f' - Var F_A) / 2), and the
    same for B. An attribute whose every pair is without reports, and a pair without
    reports, answer NaN (frequencies and variances).
    """
    normalized = [normalize(view.frequencies) for view in pairs]
    covering: dict[int, list[tuple[int, int]]] = {}
    sizes: dict[int, int] = {}
    for index, view in enumerate(pairs):
        for axis, column in enumerate(view.columns):
            sizes[column] = view.frequencies.shape[axis]
            views = covering.setdefault(column, [])
            if view.has_reports:
                views.append((index, axis))

    def projection_variance(index: int, axis: int, cov: ViewCovariance) -> np.ndarray:
        shape = pairs[index].frequencies.shape
        variances = row_variances(cov, shape, 0.0, float(axis == 0), float(axis == 1))
        return variances[:, 0] if axis == 0 else variances[0, :]

    weights: dict[tuple[int, int], float] = {}
    one_way: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    projected: dict[tuple[int, int], np.ndarray] = {}
    for column, views in covering.items():
        if not views:
            nothing = np.full(sizes[column], np.nan)
            one_way[column] = (nothing, nothing)
            continue
        inverse = np.array(
            [1.0 / projection_variance(i, axis, pairs[i].planning).mean() for i, axis in views]
        )
        shares = inverse / inverse.sum()
        estimate = np.zeros(sizes[column])
        variance = np.zeros(sizes[column])
        margin = np.zeros(sizes[column])
        for (i, axis), share in zip(views, shares, strict=True):
            weights[(i, axis)] = float(share)
            projected[(i, axis)] = projection_variance(i, axis, pairs[i].cov)
            estimate = estimate + share * normalized[i].sum(axis=1 - axis)
            variance = variance + share**2 * projected[(i, axis)]
            margin = margin + share * pairs[i].distribution.sum(axis=1 - axis)
        centre = 1.0 / sizes[column]
        cross = dependence.term(margin, margin, margin, centre, centre)
        one_way[column] = (estimate, variance + (1.0 - float(np.sum(shares**2))) * cross)

    results = []
    for index, view in enumerate(pairs):
        d1, d2 = view.frequencies.shape
        if not view.has_reports:
            nothing = np.full((d1, d2), np.nan)
            results.append((nothing, nothing, nothing, nothing))
            continue
        first, second = view.columns
        base = normalized[index]
        cells = (
            base
            + (one_way[first][0] - base.sum(axis=1))[:, None] / d2
            + (one_way[second][0] - base.sum(axis=0))[None, :] / d1
        )
        w_a, w_b = weights[(index, 0)], weights[(index, 1)]
        alpha, beta = (w_a - 1) / d2, (w_b - 1) / d1

        others = [np.zeros(d1), np.zeros(d2)]
        squares = [0.0, 0.0]
        for (i, axis), share in weights.items():
            column = pairs[i].columns[axis]
            if i != index and column in view.columns:
                side = view.columns.index(column)
                others[side] = others[side] + share**2 * projected[(i, axis)]
                squares[side] += share**2
        spread = ((1.0 - w_a, squares[0]), (1.0 - w_b, squares[1]))

        # cells f'; f' + F_A (first attribute); f' + F_B: (alpha, beta, kappa_A, kappa_B)
        outputs = [
            (alpha, beta, 1 / d2, 1 / d1),
            (alpha + w_a, beta, 1 / d2 + 1, 1 / d1),
            (alpha, beta + w_b, 1 / d2, 1 / d1 + 1),
        ]
        variances = [
            pair_output_variance(view.cov, others, a, b, k_a, k_b)
            + cross_view_variance(dependence, view.distribution, (1.0, a, b), (k_a, k_b), spread)
            for a, b, k_a, k_b in outputs
        ]
        results.append((cells, variances[0], variances[1], variances[2]))
    return Consistent(one_way, results)


def conditional_shares(
    joint: np.ndarray,
    joint_variance: np.ndarray,
    margin: np.ndarray,
    margin_variance: np.ndarray,
    sum_variance: np.ndarray,
    axis: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Share s = f_ab / F(a) (``axis`` 0: given the row; 1: given the column) and its
    delta-method std: Var s ~ (Var f - 2 s Cov[f, F] + s^2 Var F) / F^2 with
    Cov[f, F] = (Var[f + F] - Var f - Var F) / 2. NaN where F <= 0."""
    expand = (slice(None), None) if axis == 0 else (None, slice(None))
    denominator = margin[expand]
    denominator_variance = margin_variance[expand]
    positive = denominator > 0
    safe = np.where(positive, denominator, 1.0)
    share = joint / safe
    covariance = (sum_variance - joint_variance - denominator_variance) / 2
    variance = (joint_variance - 2 * share * covariance + share**2 * denominator_variance) / safe**2
    std = np.sqrt(np.maximum(variance, 0.0))
    return np.where(positive, share, np.nan), np.where(positive, std, np.nan)
