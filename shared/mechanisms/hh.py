"""Hierarchical histogram (``hh``): a distribution over buckets from a tree of frequency oracles.

Cormode, Kulkarni, Srivastava, "Answering Range Queries Under Local Differential Privacy",
VLDB 2019 (the tree, level sampling, the range decomposition); Hay, Rastogi, Miklau, Suciu,
"Boosting the Accuracy of Differentially Private Histograms Through Consistency", VLDB 2010
(constrained inference on the tree).

Tree. D = B^h buckets (``buckets``, ``branching`` B) are the leaves of a B-ary tree; level
l = 1..h has B^l nodes and node v of level l covers the leaves [v B^(h-l), (v+1) B^(h-l)).
The root (level 0) is the whole range, whose fraction is exactly 1: it is not reported.

Device. A value's leaf is its bucket (``DistributionSpec.bucket_of``); the device draws a
level l exactly uniformly on 1..h, independently of the value, and reports its level-l node
leaf // B^(h-l) through level l's frequency oracle at the FULL epsilon. For any output
(l, y) the likelihood ratio of two values is that of level l's oracle, at most e^eps
(the level's 1/h cancels), so the report is eps-LDP, and tightly (the leaf level separates
every pair of buckets). Level l's oracle is GRR or OLH over B^l items, whichever has the
lower planning variance ``variance(1)`` at (eps, B^l) (GRR when it ties). Not OUE: its
variance equals OLH's to within a hair while a report is B^l bits instead of three
integers; not HR: its variance is never the lowest (``shared.mechanisms.auto`` picks from
the same figures).

Sampling levels against splitting the budget. Splitting eps over the h levels (every
device reports every level at eps / h) gives each node Var = V(eps / h) / n, with V the
per-user oracle variance; sampling gives V(eps) / n_l plus the sampling of users, with
n_l ~ n / h, i.e. about (h V(eps) + (h - 1) f (1 - f)) / n. As V(eps) ~ 4 / eps^2 for
small eps (V(eps / h) ~ 4 h^2 / eps^2: sampling wins by about h) and V decays like e^-eps
for large eps, sampling is the better design (``sampling_versus_split``). At B = 4, summed
over the levels with the sampling term at its worst (f = 1/2), splitting's variance is
4.2, 4.4, 4.6, 3.3 times sampling's at eps = 0.5, 1, 2, 4 for D = 256, and 5.2, 5.5, 5.9,
4.2 times for D = 1024.

Report: int64 rows (level, a, b, value). A GRR level reports (l, 0, 0, y); an OLH level
(l, a, b, y) with OLH's hash (a, b) and bucket y. Payload ``{"level", "a", "b", "value"}``.

Statistics: one ``CountStatistics``: level 1's oracle statistics (B counts), then level
2's (B^2), ..., level h's, then the h report counts n_1..n_h; n = n_1 + ... + n_h.

Estimate (server). Level l's oracle gives unbiased fractions y_v of its n_l reporters.
Given n_l, the level-l reporters are a simple random sample of the n users, so y_v is
unbiased for the users' node fraction x_v. A level with n_l = 0 carries no information
(weight 0); no report at all is an error.

Consistency (weighted least squares on the tree, Hay et al. generalized to per-level
weights). With tau^2_l = level l's node variance at uniform data (f = B^-l: the oracle's
variance at n_l plus the sampling term f (1 - f) (n - n_l) / (n_l (n - 1))), a function of
the public n_l only (so the weights are constants given the level counts, and the
estimate is linear and unbiased), precisions w_l = 1 / tau^2_l (0 for an empty level) and
W_h = w_h, W_l = w_l + W_(l+1) / B:

    bottom-up  z_v = alpha_l y_v + (1 - alpha_l) sum_children z_c,  alpha_l = w_l / W_l,
    top-down   u_root = 1,  u_c = z_c + (u_parent - sum_siblings z_s) / B.

z_v is the inverse-variance combination of the node's own estimate and its children's
sum; the top-down step spreads the parent's residual equally over siblings of equal
typical variance. The tests check that u equals the constrained weighted least-squares
solution (weights 1 / tau^2_l, sum of leaves = 1). The consistent leaves sum to exactly 1;
the CDF at edge k is the sum of the leaves below k. If the leaf level (and perhaps some
levels above it) has no report, the tree does not identify the leaves below the deepest
reported level: the minimum-norm solution splits each such node's estimate equally over
its leaves (unbiased only at that level's edges; it happens with probability
(1 - 1/h)^n).

Variance of F^_j - F^_i. The estimate is c^T y for a coefficient vector c on the node
estimates (the range's prefix weights through the linear consistency map), so its
variance is c^T Cov(y) c. Given the level counts, with x_v the true node fractions:

* the oracle noise of one level, averaged over its reporters: for GRR (a user at node u
  reports y with probability pi_u(y) = q + (p - q) [y = u]) the multinomial
  sum_u x_u (diag(pi_u) - pi_u pi_u^T) / (n_l (p - q)^2), exactly; for OLH the diagonal
  V_oracle(x_v, n_l) (its supports of two items from one report, correlated through the
  shared hash, are taken as independent, as in OLH's fast path);
* the sampling of users over levels (disjoint simple random samples):
  Cov(x-bar_l, x-bar_l') = A_l (diag x - x x^T) A_l'^T times (n - n_l) / (n_l (n - 1)) on a
  level and - 1 / (n - 1) across levels.

Expanding, c^T Cov c = sum_v c_v^2 omega_v - sum_l (a_l S_l^2 + b_l S_l M_l + g_l M_l^2)
- F (1 - F) / (n - 1), with per-node weights omega_v = V_oracle(x_v) + x_v g_l (+ (q^2 +
2 q (p - q) x_v) / (n_l (p - q)^2) on a GRR level), a_l = q^2 / (n_l (p - q)^2) and
b_l = 2 q (p - q) / (n_l (p - q)^2) on GRR levels (else 0), g_l = n / (n_l (n - 1)),
S_l = sum of level l's c, M_l = sum_v x_v c_v, F the range's fraction; the cross-level
sampling terms collapse to F (1 - F) because the coefficients, lifted to the leaves and
summed over levels, are the range's indicator (plus a constant) for an unbiased tree
estimate. S_l and M_l of every range are differences of prefix sums of the consistency
map's response to 1 and to x at level l (``TreeRangeVariance``); the quadratic term is
``ConsistentTree.range_variance``:

Errors: let eps_v = y_v - x_v, s_v = z_v - x_v (subtree error) and e_v = u_v - x_v. Then
s_v = alpha_l eps_v + (1 - alpha_l) sum_children s_c and e_c = d_c + e_parent / B with
d_c = s_c - mean of s over c's sibling group (e_root = 0). The prefix [0, k) is, at each
level l, the first d_l children of k's level-(l-1) ancestor (d_l the l-th base-B digit of
k), so F^_k - F_k = sum_l sum_(j < d_l) e_(child j), and unrolling e along the path gives,
per sibling group G_l on k's path, coefficients beta_t - phi_(l-1) on s_t, with
beta_t = 1 before the path child, phi_l (the fraction of the path child's leaves below k)
on it and 0 after it. The path child's s is expanded into alpha eps + (1 - alpha) times
its children's s: its coefficient is carried into every member of the next group. With
independent eps of variances omega, off-path members' s are independent of everything
else on the path, with variances T_v = alpha_l^2 omega_v + (1 - alpha_l)^2
sum_children T_c (bottom-up), summed within each group by prefix sums. A range [i, j)
shares the groups of both paths down to the level where they part, where its
coefficients are the differences, then follows two independent carried chains. O(h) per
range, O(D h) for the whole CDF. The tests compare the quadratic term with the explicit
linear map, and the whole with c^T Cov c built from scratch, on small trees (1e-12
relative).

The variance is evaluated at the consistent node fractions clipped to [0, 1]. Measured
with real reports (R = 1500 runs, n = 3000, levels GRR then OLH): the empirical variance
of the CDF is 0.90..1.10 of the formula over the edges (mean 0.98..1.03), within the runs'
own noise, so OLH's neglected correlations do not show.

Raw ranges (``raw_range``: Cormode et al.'s estimate, no consistency): [i, j) is cut into
its minimal set of tree nodes (at most 2 (B - 1) per level) and the raw node estimates are
summed. Conditioning on the level counts n_l, level l's part over its m nodes A is
(C_A / n_l - m q) / (p - q) with C_A = sum_(v in A) C_v. For GRR C_A counts reports that
land in A, a sum of independent Bernoullis with P = p + (m - 1) q (value in A) or m q
(not), so its variance is exact:

    (x_A P1 (1 - P1) + (1 - x_A) P0 (1 - P0)) / (n_l (p - q)^2),

the sum of the per-node variances for OLH (its supports of distinct items treated as
uncorrelated: the items' supports from one report are correlated through the hash's
structure, a (v + 1) + b = (a v + b) + a. Measured with real reports, R = 1500, the
formula was conservative: the empirical variance of a range spanning 2 OLH levels was
0.81..0.86 of it, of one spanning 1 OLH level 0.97). The sampling of users
over levels adds, exactly,

    sum_l x_l (1 - x_l) (n - n_l) / (n_l (n - 1)) + sum_(l != l') x_l x_l' / (n - 1)

(the parts are disjoint, so the level samples' fractions covary by + x_l x_l' / (n - 1)).

Planning variance ``variance(n)``: the largest variance of one bucket's consistent fraction
(the whole formula above) at uniform data with n / h reports per level, computed at a
large n0 and scaled as n0 / n.

Refusal rules: none (``shared.integrity``). The level is drawn independently of the value,
and each level's oracle has none: ``grr``'s every output is the likeliest for some node,
and ``olh``'s sets below 2^-40 for every input are only sets of particular hash functions
(their modules say why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from shared.distributions import DistributionEstimate, monotone_fractions
from shared.mechanisms.abilities import FRESH, DeviceContext, DistributionValues
from shared.mechanisms.base import (
    INTEGER,
    Mechanism,
    check_integer_field,
    check_integer_rows,
    payload_shape,
)
from shared.mechanisms.categorical import CategoricalMechanism, check_true_counts
from shared.mechanisms.grr import CountedIndices, GeneralizedRandomizedResponse, GrrSpec
from shared.mechanisms.olh import OlhSpec, OptimizedLocalHashing
from shared.mechanisms.registry import register
from shared.mechanisms.spec import MAX_BUCKETS, DistributionSpec, fill_in
from shared.randomness import Rng, as_source
from shared.statistics import CountStatistics

DEFAULT_BRANCHING = 4
#: Without ``buckets``, the tree has the fewest leaves >= this (a power of the branching).
DEFAULT_MIN_BUCKETS = 256
#: The payload's fields, in the report's column order.
FIELDS = ("level", "a", "b", "value")


class HhSpec(DistributionSpec):
    """``{"mechanism": "hh", "epsilon": 1.0, "lower": 0, "upper": 100}``; ``branching``
    defaults to 4 and ``buckets`` to the smallest power of it >= 256 (both are filled in,
    so the published spec states them); ``buckets`` must be branching^h, h >= 1."""

    mechanism: Literal["hh"]
    branching: int | None = Field(
        default=None, ge=2, le=16, description="Children per tree node (B; default 4)."
    )

    @model_validator(mode="after")
    def _buckets_are_a_power_of_branching(self) -> HhSpec:
        if self.branching is None:
            fill_in(self, "branching", DEFAULT_BRANCHING)
        branching = self.tree_branching
        if self.buckets is None:
            fill_in(self, "buckets", branching ** tree_height(branching, DEFAULT_MIN_BUCKETS))
        powers = [branching**h for h in range(1, tree_height(branching, MAX_BUCKETS + 1))]
        if self.buckets not in powers:
            listed = ", ".join(str(power) for power in powers if power <= MAX_BUCKETS)
            raise ValueError(
                f"buckets must be a power of branching ({branching}): {listed}; got {self.buckets}"
            )
        return self

    @property
    def tree_branching(self) -> int:
        """B (filled in by validation)."""
        assert self.branching is not None, "validation fills in branching"
        return self.branching


def tree_height(branching: int, at_least: int) -> int:
    """The least h >= 1 with branching^h >= at_least."""
    height = 1
    while branching**height < at_least:
        height += 1
    return height


def level_oracle(epsilon: float, domain_size: int) -> CategoricalMechanism:
    """GRR or OLH over ``domain_size`` items at ``epsilon``, whichever has the lower
    planning variance ``variance(1)`` (GRR on a tie: smaller reports)."""
    grr = GeneralizedRandomizedResponse(
        GrrSpec(mechanism="grr", epsilon=epsilon, domain_size=domain_size)
    )
    olh = OptimizedLocalHashing(OlhSpec(mechanism="olh", epsilon=epsilon, domain_size=domain_size))
    return grr if grr.variance(1) <= olh.variance(1) else olh


def oracle_variance(oracle: CategoricalMechanism, fraction: np.ndarray, n: float) -> np.ndarray:
    """The frequency-oracle variance q (1 - q) / (n (p - q)^2) + f (1 - p - q) / (n (p - q))
    (``shared.mechanisms.categorical``) at the fractions f."""
    p, q = oracle.p, oracle.q
    return (q * (1 - q) / (p - q) ** 2 + fraction * (1 - p - q) / (p - q)) / n


def sampling_variance(fraction: np.ndarray, n: float, n_level: float) -> np.ndarray:
    """f (1 - f) (n - n_l) / (n_l (n - 1)): the variance of the fraction f of a simple random
    sample of n_l of n users (0 when n_l = n)."""
    if n_level >= n:
        return np.zeros_like(fraction)
    return fraction * (1 - fraction) * (n - n_level) / (n_level * (n - 1))


@dataclass(frozen=True)
class ConsistentTree:
    """The consistent (weighted least-squares) estimator on a B-ary tree of height h, and
    the variance of its ranges when the node estimates are independent (module
    docstring; ``TreeRangeVariance`` adds their covariances).

    ``alpha[l]``: the bottom-up weight of level l's own estimate (index 0 unused);
    ``sigma2[l]``: the variances of level l's node estimates (index 0: the root, unused).
    """

    branching: int
    alpha: np.ndarray
    sigma2: tuple[np.ndarray, ...]

    @property
    def height(self) -> int:
        return len(self.sigma2) - 1

    @staticmethod
    def weights(typical_variance: np.ndarray, branching: int) -> np.ndarray:
        """alpha_l = w_l / W_l from per-level typical variances tau^2_l (index 1..h; inf or
        nan for a level without reports): W_h = w_h, W_l = w_l + W_(l+1) / B."""
        precision = np.where(np.isfinite(typical_variance), 1.0 / typical_variance, 0.0)
        height = precision.size - 1
        alpha = np.zeros(height + 1)
        below = 0.0
        for level in range(height, 0, -1):
            total = precision[level] + below / branching
            alpha[level] = precision[level] / total if total > 0 else 0.0
            below = total
        return alpha

    def consistent(self, observed: list[np.ndarray], root: float = 1.0) -> list[np.ndarray]:
        """u at every level (index 0: the root, ``root``) from the node estimates y (index
        1..h); ``root = 0`` gives the estimator's linear part."""
        b, h = self.branching, self.height
        z: list[np.ndarray] = [np.ones(1)] * (h + 1)
        z[h] = self.alpha[h] * observed[h]
        for level in range(h - 1, 0, -1):
            children = z[level + 1].reshape(-1, b).sum(axis=1)
            z[level] = self.alpha[level] * observed[level] + (1 - self.alpha[level]) * children
        u = [np.full(1, root)]
        for level in range(1, h + 1):
            residual = u[level - 1] - z[level].reshape(-1, b).sum(axis=1)
            u.append(z[level] + np.repeat(residual / b, b))
        return u

    @cached_property
    def _subtree(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """Per level: T_v (variance of the subtree error), the exclusive prefix sums of T
        within each sibling group, and each group's total."""
        b, h = self.branching, self.height
        subtree: list[np.ndarray] = [np.zeros(1)] * (h + 1)
        subtree[h] = self.alpha[h] ** 2 * self.sigma2[h]
        for level in range(h - 1, 0, -1):
            children = subtree[level + 1].reshape(-1, b).sum(axis=1)
            own = self.alpha[level] ** 2 * self.sigma2[level]
            subtree[level] = own + (1 - self.alpha[level]) ** 2 * children
        before: list[np.ndarray] = [np.zeros(1)]
        totals: list[np.ndarray] = [np.zeros(1)]
        for level in range(1, h + 1):
            groups = subtree[level].reshape(-1, b)
            before.append((np.cumsum(groups, axis=1) - groups).ravel())
            totals.append(groups.sum(axis=1))
        return subtree, before, totals

    def range_variance(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """Var[F^_high - F^_low] for edge indices 0 <= low <= high <= D (same shape)."""
        b, h = self.branching, self.height
        leaves = b**h
        low_in, high_in = np.asarray(low, dtype=np.int64), np.asarray(high, dtype=np.int64)
        shape = np.broadcast_shapes(low_in.shape, high_in.shape)
        lo, hi = np.broadcast_to(low_in, shape).ravel(), np.broadcast_to(high_in, shape).ravel()
        if lo.size and (lo.min() < 0 or hi.max() > leaves or np.any(lo > hi)):
            raise ValueError(f"edge indices must satisfy 0 <= low <= high <= {leaves}")
        # F^_D = 1 exactly, so Var[F^_D - F^_i] = Var[F^_i - F^_0].
        at_end = hi == leaves
        i = np.where(at_end, 0, lo)
        j = np.minimum(np.where(at_end, lo, hi), leaves - 1)
        empty = lo == hi
        subtree, before, totals = self._subtree

        def ancestor(k: np.ndarray, level: int) -> np.ndarray:
            return k // b ** (h - level)

        def fraction(k: np.ndarray, level: int) -> np.ndarray:
            """phi_l: the share of k's level-l ancestor's leaves that lie below k."""
            width = b ** (h - level)
            return (k % width) / width

        shared_levels = sum(
            (ancestor(i, level) == ancestor(j, level)).astype(np.int64) for level in range(1, h + 1)
        )
        variance = np.zeros(i.size)
        carry_shared = np.zeros(i.size)
        carry = {"i": np.zeros(i.size), "j": np.zeros(i.size)}
        for level in range(1, h + 1):
            alpha, sigma2 = self.alpha[level], self.sigma2[level]
            t, pre, tot = subtree[level], before[level], totals[level]
            node_i, node_j = ancestor(i, level), ancestor(j, level)
            parent_share = {"i": fraction(i, level - 1), "j": fraction(j, level - 1)}
            share = {"i": fraction(i, level), "j": fraction(j, level)}
            # Levels whose group both paths share, with the same path child: differences.
            common = level <= shared_levels
            off = parent_share["i"] - parent_share["j"] + carry_shared
            on = share["j"] - share["i"] + off
            term = off**2 * (tot[node_i // b] - t[node_i]) + (alpha * on) ** 2 * sigma2[node_i]
            variance += np.where(common, term, 0.0)
            carry_shared = np.where(common, (1 - alpha) * on, carry_shared)
            # The level where the paths part: one group, two path children.
            split = level == shared_levels + 1
            kappa = off
            on_i = 1 - share["i"] + kappa
            on_j = share["j"] + kappa
            between = pre[node_j] - pre[node_i] - t[node_i]
            after = tot[node_j // b] - pre[node_j] - t[node_j]
            term = (
                kappa**2 * (pre[node_i] + after)
                + (1 + kappa) ** 2 * between
                + (alpha * on_i) ** 2 * sigma2[node_i]
                + (alpha * on_j) ** 2 * sigma2[node_j]
            )
            variance += np.where(split, term, 0.0)
            # Below the split: two independent chains (i's with its sign flipped).
            deeper = level > shared_levels + 1
            for name, node in (("i", node_i), ("j", node_j)):
                c = carry[name]
                first = 1 - parent_share[name] + c
                last = c - parent_share[name]
                on_path = share[name] - parent_share[name] + c
                rest = tot[node // b] - pre[node] - t[node]
                term = first**2 * pre[node] + last**2 * rest + (alpha * on_path) ** 2 * sigma2[node]
                variance += np.where(deeper, term, 0.0)
                carry[name] = np.where(deeper, (1 - alpha) * on_path, carry[name])
            carry["i"] = np.where(split, -(1 - alpha) * on_i, carry["i"])
            carry["j"] = np.where(split, (1 - alpha) * on_j, carry["j"])
        return np.where(empty, 0.0, variance).reshape(shape)


@dataclass(frozen=True)
class TreeRangeVariance:
    """Var[F^_j - F^_i] of the consistent estimator with the node estimates' covariance
    (module docstring): with c the coefficients of the range on the node estimates,

        sum_v c_v^2 omega_v - sum_l (a_l S_l^2 + b_l S_l M_l + g_l M_l^2) - F (1 - F) / (n - 1),

    S_l = sum of level l's c, M_l = sum of x_v c_v, F the range's fraction. ``quadratic``
    evaluates the first sum (weights omega), ``linear[l - 1]`` holds the prefix sums over
    the leaves of the estimator's linear response to 1 and to x at level l (so S_l and M_l
    of [i, j) are differences), ``coefficients[l - 1]`` = (a_l, b_l, g_l), ``cdf`` the
    plug-in F at the edges, ``finite`` = 1 / (n - 1) (0 for n = 1).
    """

    quadratic: ConsistentTree
    linear: np.ndarray
    coefficients: np.ndarray
    cdf: np.ndarray
    finite: float

    def __call__(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        variance = self.quadratic.range_variance(low, high)
        low, high = np.asarray(low), np.asarray(high)
        for (ones, xs), (a, b, g) in zip(self.linear, self.coefficients, strict=True):
            total = ones[high] - ones[low]
            weighted = xs[high] - xs[low]
            variance = variance - (a * total**2 + b * total * weighted + g * weighted**2)
        share = np.clip(self.cdf[high] - self.cdf[low], 0.0, 1.0)
        return variance - self.finite * share * (1 - share)


@register
class HierarchicalHistogram(Mechanism[CountStatistics]):
    name = "hh"
    spec_model = HhSpec
    payload_schema = payload_shape(
        "HierarchyPayload",
        "hh: the tree level (1..h) and that level's oracle report: a and b are OLH's hash "
        "(0 for a GRR level), value the reported item or bucket.",
        level=INTEGER,
        a=INTEGER,
        b=INTEGER,
        value=INTEGER,
    )
    provides: ClassVar[tuple[type, ...]] = (DistributionValues,)
    spec: HhSpec

    def __init__(self, spec: HhSpec) -> None:
        super().__init__(spec)
        self.lower: float = spec.lower
        self.upper: float = spec.upper
        self.branching: int = spec.tree_branching
        self.buckets: int = spec.bucket_count
        self.height: int = tree_height(self.branching, self.buckets)
        #: Level l's oracle at index l - 1.
        self.oracles: tuple[CategoricalMechanism, ...] = tuple(
            self.build_oracle(self.branching**level) for level in range(1, self.height + 1)
        )
        sizes = [self.branching**level for level in range(1, self.height + 1)]
        #: Where level l's counts start in the statistics (index l - 1), and where the
        #: level report counts start (the last entry).
        self.offsets: tuple[int, ...] = tuple(int(x) for x in np.cumsum([0, *sizes]))

    def edges(self) -> np.ndarray:
        return self.spec.edges()

    def oracle(self, level: int) -> CategoricalMechanism:
        """Level ``level``'s (1..h) frequency oracle."""
        return self.oracles[level - 1]

    def hashed_oracle(self, level: int) -> OptimizedLocalHashing | None:
        """Level ``level``'s oracle when it is OLH (its reports carry a hash), else None."""
        oracle = self.oracle(level)
        return oracle if isinstance(oracle, OptimizedLocalHashing) else None

    def uses_hash(self, level: int) -> bool:
        return self.hashed_oracle(level) is not None

    def build_oracle(self, nodes: int) -> CategoricalMechanism:
        """The frequency oracle of a level of ``nodes`` nodes (``level_oracle``)."""
        return level_oracle(self.epsilon, nodes)

    def multinomial(self, level: int) -> bool:
        """Whether a level's report is one index, kept or drawn uniformly (GRR; ``lhh``'s
        lgrr), so that its node estimates covary as a multinomial's; otherwise (OLH, unary
        encodings) each node's support is taken as independent of the others'."""
        return isinstance(self.oracle(level), CountedIndices)

    # --- device ------------------------------------------------------------------------

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """(level, a, b, value) per value: a uniform level, the value's node there, reported
        through that level's oracle (module docstring)."""
        leaves = self.spec.bucket_of(values)
        source = as_source(rng)
        levels = 1 + source.integers(self.height, leaves.size)
        reports = np.zeros((leaves.size, 4), dtype=np.int64)
        reports[:, 0] = levels
        for level in range(1, self.height + 1):
            rows = np.flatnonzero(levels == level)
            if not rows.size:
                continue
            nodes = leaves[rows] // self.branching ** (self.height - level)
            response = self.oracle(level).encode(nodes, rng)
            if self.uses_hash(level):
                reports[rows, 1:] = response
            else:
                reports[rows, 3] = response
        return reports

    # --- reports and statistics --------------------------------------------------------

    def _field_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per level (row l - 1) the least and largest a, b, value its oracle accepts (OLH:
        1..P-1, 0..P-1, 0..g-1; GRR: 0, 0, 0..d-1)."""
        low = np.zeros((self.height, 3), dtype=np.int64)
        high = np.zeros((self.height, 3), dtype=np.int64)
        for level in range(1, self.height + 1):
            oracle = self.oracle(level)
            if isinstance(oracle, OptimizedLocalHashing):
                low[level - 1] = (1, 0, 0)
                high[level - 1] = (oracle.prime - 1, oracle.prime - 1, oracle.buckets - 1)
            else:
                high[level - 1, 2] = oracle.domain_size - 1
        return low, high

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        """int64 rows (level, a, b, value), each within its level's oracle's bounds; the
        first bad report is named (its level's oracle checks its rows again in
        ``aggregate``)."""
        wide = [np.iinfo(np.int64).min] * 4, [np.iinfo(np.int64).max] * 4
        array = check_integer_rows(reports, "hh", FIELDS, *wide)  # the shape and type
        if not array.size:
            return array
        low, high = self._field_bounds()
        level = array[:, 0]
        known = (level >= 1) & (level <= self.height)
        rows = np.clip(level, 1, self.height) - 1
        bad = np.zeros(array.shape, dtype=bool)
        bad[:, 0] = ~known
        bad[:, 1:] = known[:, None] & ((array[:, 1:] < low[rows]) | (array[:, 1:] > high[rows]))
        if bad.any():
            row = int(np.flatnonzero(bad.any(axis=1))[0])
            field = int(np.flatnonzero(bad[row])[0])
            if field == 0:
                raise ValueError(f"report {row}: level = {level[row]} is outside 1..{self.height}")
            at = int(level[row])
            raise ValueError(
                f"report {row}: {FIELDS[field]} = {array[row, field]} is outside "
                f"{low[at - 1, field - 1]}..{high[at - 1, field - 1]} for level {at} "
                f"({self.oracle(at).name} over {self.branching**at} nodes)"
            )
        return array

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.offsets[-1] + self.height)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Each level's reports through its oracle's ``aggregate``, concatenated, then the
        level report counts."""
        reports = self.check_reports(reports)
        order = np.argsort(reports[:, 0], kind="stable")
        grouped = reports[order]
        per_level = np.bincount(grouped[:, 0], minlength=self.height + 1)[1:]
        starts = np.concatenate([[0], np.cumsum(per_level)])
        parts = []
        for level in range(1, self.height + 1):
            rows = grouped[starts[level - 1] : starts[level]]
            oracle = self.oracle(level)
            oracle_reports = rows[:, 1:] if self.uses_hash(level) else rows[:, 3]
            parts.append(oracle.aggregate(oracle_reports).counts)
        return CountStatistics(reports.shape[0], np.concatenate([*parts, per_level]))

    def level_counts(self, stats: CountStatistics) -> np.ndarray:
        """n_1..n_h, checked to sum to n."""
        counts = stats.counts[self.offsets[-1] :]
        if counts.size != self.height or int(counts.sum()) != stats.n:
            raise ValueError(
                f"statistics must end with {self.height} level counts summing to n = {stats.n}"
            )
        return counts

    def level_statistics(self, stats: CountStatistics, level: int, n_level: int) -> CountStatistics:
        """Level ``level``'s oracle statistics."""
        start, stop = self.offsets[level - 1], self.offsets[level]
        return CountStatistics(n_level, stats.counts[start:stop])

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [
            dict(zip(FIELDS, map(int, row), strict=True)) for row in self.check_reports(reports)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        columns = [check_integer_field(payloads, field) for field in FIELDS]
        return self.check_reports(np.stack(columns, axis=1).reshape(len(payloads), 4))

    # --- estimation --------------------------------------------------------------------

    def level_estimates(self, stats: CountStatistics) -> tuple[np.ndarray, list[np.ndarray]]:
        """(n_l, y): the level report counts and each level's unbiased node fractions
        (index 0: the root, 1; zeros for a level without reports)."""
        if stats.length != self.offsets[-1] + self.height:
            raise ValueError(
                f"statistics have {stats.length} counts, hh keeps {self.offsets[-1] + self.height}"
            )
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        counts = self.level_counts(stats)
        observed: list[np.ndarray] = [np.ones(1)]
        for level in range(1, self.height + 1):
            n_level = int(counts[level - 1])
            if n_level == 0:
                observed.append(np.zeros(self.branching**level))
                continue
            level_stats = self.level_statistics(stats, level, n_level)
            observed.append(self.oracle(level).estimate(level_stats).frequencies)
        return counts, observed

    def typical_variances(self, counts: np.ndarray, n: float) -> np.ndarray:
        """tau^2_l: level l's node variance at uniform data, from the public n_l (index
        1..h; inf for a level without reports)."""
        typical = np.full(self.height + 1, np.inf)
        for level in range(1, self.height + 1):
            n_level = float(counts[level - 1])
            if n_level > 0:
                uniform = np.array([1.0 / self.branching**level])
                typical[level] = float(
                    oracle_variance(self.oracle(level), uniform, n_level)[0]
                    + sampling_variance(uniform, n, n_level)[0]
                )
        return typical

    def consistent_tree(self, counts: np.ndarray, n: float) -> ConsistentTree:
        """The consistency weights for these level counts (node variances left at 0)."""
        alpha = ConsistentTree.weights(self.typical_variances(counts, n), self.branching)
        zeros = tuple(np.zeros(self.branching**level) for level in range(self.height + 1))
        return ConsistentTree(self.branching, alpha, zeros)

    def variance_model(
        self, tree: ConsistentTree, counts: np.ndarray, n: float, fractions: list[np.ndarray]
    ) -> TreeRangeVariance:
        """Var[F^_j - F^_i] of the consistent estimator (``TreeRangeVariance``) when level l's
        node fractions are ``fractions[l]`` (index 1..h)."""
        height = self.height
        node_weights: list[np.ndarray] = [np.zeros(1)]
        coefficients = np.zeros((height, 3))
        finite = 1.0 / (n - 1) if n > 1 else 0.0
        for level in range(1, height + 1):
            x, n_level = fractions[level], float(counts[level - 1])
            if n_level <= 0:
                node_weights.append(np.zeros_like(x))
                continue
            oracle = self.oracle(level)
            weight = oracle_variance(oracle, x, n_level) + x * n * finite / n_level
            if self.multinomial(level):
                p, q = oracle.p, oracle.q
                scale = n_level * (p - q) ** 2
                weight = weight + (q * q + 2 * q * (p - q) * x) / scale
                coefficients[level - 1, :2] = (q * q / scale, 2 * q * (p - q) / scale)
            coefficients[level - 1, 2] = n * finite / n_level
            node_weights.append(weight)
        quadratic = ConsistentTree(self.branching, tree.alpha, tuple(node_weights))
        linear = np.zeros((height, 2, self.buckets + 1))
        for level in range(1, height + 1):
            for row, values in enumerate((np.ones_like(fractions[level]), fractions[level])):
                observed = [np.zeros(self.branching**k) for k in range(height + 1)]
                observed[level] = values
                leaves = tree.consistent(observed, root=0.0)[-1]
                linear[level - 1, row, 1:] = np.cumsum(leaves)
        cdf = np.concatenate([[0.0], np.cumsum(fractions[height])])
        return TreeRangeVariance(quadratic, linear, coefficients, cdf, finite)

    def estimate(self, stats: CountStatistics) -> DistributionEstimate:
        """The consistent CDF at the edges, its range variances (``variance_model`` at the
        consistent node fractions clipped to [0, 1]), and the isotonic regression of the
        CDF as the valid distribution (module docstring)."""
        counts, observed = self.level_estimates(stats)
        tree = self.consistent_tree(counts, stats.n)
        consistent = tree.consistent(observed)
        cdf = np.concatenate([[0.0], np.cumsum(consistent[-1])])
        cdf[-1] = 1.0
        fractions = [np.clip(level, 0.0, 1.0) for level in consistent]
        model = self.variance_model(tree, counts, stats.n, fractions)
        every = np.arange(self.buckets + 1)
        variance = np.maximum(model(np.zeros_like(every), every), 0.0)
        return DistributionEstimate(
            edges=self.edges(),
            scale=self.spec.scale or "linear",
            n=stats.n,
            cdf=cdf,
            range_variance=model,
            postprocessed=monotone_fractions(cdf, variance),
            method="consistency+isotonic",
        )

    def decompose(self, low: int, high: int) -> list[tuple[int, int, int]]:
        """The minimal cover of leaves [low, high) by tree nodes, as (level, first, stop):
        level's nodes first..stop-1 (at most 2 (B - 1) nodes per level; the whole range
        is the root, level 0)."""
        if not 0 <= low < high <= self.buckets:
            raise ValueError(f"a range needs edge indices 0 <= low < high <= {self.buckets}")
        b, runs = self.branching, []
        for level in range(self.height, 0, -1):
            up, down = -(-low // b) * b, high // b * b
            if up > down:  # within one parent: take the nodes themselves
                runs.append((level, low, high))
                break
            runs += [(level, low, up), (level, down, high)]
            low, high = up // b, down // b
            if low >= high:
                break
        else:
            runs.append((0, 0, 1))  # the whole range: the root, exactly 1
        return [run for run in runs if run[1] < run[2]]

    def raw_range(self, stats: CountStatistics, low: int, high: int) -> tuple[float, float]:
        """Cormode et al.'s range estimate without consistency: the sum of the raw node
        estimates over the minimal decomposition of [low, high), and its variance given
        the level counts (module docstring), at the estimated parts clipped to [0, 1]."""
        counts, observed = self.level_estimates(stats)
        parts: dict[int, float] = {}
        for level, first, stop in self.decompose(low, high):
            if level and counts[level - 1] == 0:
                raise ValueError(f"level {level} has no reports: the raw range is undefined")
            part = 1.0 if level == 0 else float(observed[level][first:stop].sum())
            parts[level] = parts.get(level, 0.0) + part
        fractions = {level: min(max(value, 0.0), 1.0) for level, value in parts.items()}
        return sum(parts.values()), self.raw_variance(counts, low, high, fractions)

    def node_counts(self, low: int, high: int) -> dict[int, int]:
        """m_l: how many level-l nodes the decomposition of [low, high) takes."""
        out: dict[int, int] = {}
        for level, first, stop in self.decompose(low, high):
            out[level] = out.get(level, 0) + stop - first
        return out

    def raw_variance(
        self, counts: np.ndarray, low: int, high: int, fractions: dict[int, float]
    ) -> float:
        """Var of ``raw_range``'s estimate given the level counts, at the parts' fractions
        x_l (per level of the decomposition): oracle noise (exact for GRR levels) plus the
        sampling of users over levels (module docstring)."""
        n = int(counts.sum())
        total = 0.0
        for level, m in self.node_counts(low, high).items():
            if level == 0:
                continue
            x, n_level, oracle = fractions[level], int(counts[level - 1]), self.oracle(level)
            p, q = oracle.p, oracle.q
            if not self.multinomial(level):
                total += m * float(oracle_variance(oracle, np.array([x / m]), n_level)[0])
            else:
                inside, outside = p + (m - 1) * q, m * q
                noise = x * inside * (1 - inside) + (1 - x) * outside * (1 - outside)
                total += noise / (n_level * (p - q) ** 2)
            total += float(sampling_variance(np.array([x]), n, n_level)[0])
        if n > 1:
            shares = [x for level, x in fractions.items() if level]
            total += (sum(shares) ** 2 - sum(s * s for s in shares)) / (n - 1)
        return total

    # --- simulation, law, planning -----------------------------------------------------

    def simulate_statistics(self, buckets: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """The statistics of ``buckets[k]`` users in bucket k: each bucket's users split
        over the levels (multinomial, uniform), summed into node counts per level, and each
        level's oracle statistics drawn by its own fast path (GRR exact; OLH exact per
        item, items independent). O(D h) whatever n."""
        counts = check_true_counts(buckets, self.buckets, rng)
        split = rng.multinomial(counts, np.full(self.height, 1.0 / self.height))  # (D, h)
        parts = []
        for level in range(1, self.height + 1):
            nodes = split[:, level - 1].reshape(self.branching**level, -1).sum(axis=1)
            parts.append(self.oracle(level).simulate_statistics(nodes, rng).counts)
        per_level = split.sum(axis=0)
        return CountStatistics(int(counts.sum()), np.concatenate([*parts, per_level]))

    def transition_matrix(self, values: np.ndarray | None = None) -> np.ndarray:
        """P[output | bucket]: rows the D buckets (or the buckets of ``values``), columns
        every (level, oracle output), level 1's first: (1/h) times the row of the value's
        node in the level's ``transition_matrix`` (the oracles' realized probabilities)."""
        leaves = np.arange(self.buckets) if values is None else self.spec.bucket_of(values)
        return self.level_law(lambda oracle: oracle.transition_matrix(), leaves)

    def level_law(self, law: Callable[[Any], np.ndarray], leaves: np.ndarray) -> np.ndarray:
        """Rows the ``leaves``, columns every (level, output), level 1's first: (1/h) times
        the row of the leaf's node in ``law(level oracle)``."""
        blocks = []
        for level in range(1, self.height + 1):
            matrix = np.asarray(law(self.oracle(level)))
            nodes = leaves // self.branching ** (self.height - level)
            blocks.append(matrix[nodes] / self.height)
        return np.concatenate(blocks, axis=1)

    @cached_property
    def _planning_variance(self) -> tuple[float, float]:
        """(n0, the largest bucket variance at n0 users): uniform data, n0 / h per level."""
        n0 = float(self.height << 20)
        counts = np.full(self.height, n0 / self.height)
        tree = self.consistent_tree(counts, n0)
        uniform = [np.full(self.branching**k, self.branching**-k) for k in range(self.height + 1)]
        model = self.variance_model(tree, counts, n0, uniform)
        every = np.arange(self.buckets)
        return n0, float(model(every, every + 1).max())

    def variance(self, n: int) -> float:
        """The largest variance of one bucket's consistent fraction at uniform data with
        n / h reports per level (planning; scaled from a large n0 as 1 / n)."""
        n0, variance = self._planning_variance
        return variance * n0 / n


def sampling_versus_split(epsilon: float, branching: int, buckets: int) -> tuple[float, float]:
    """(sampling, split): the per-user variance of one node, summed over the levels, with
    level sampling (h V_l(eps) + (h - 1) / 4, the sampling term at its worst f = 1/2) and
    with the budget split (V_l(eps / h)); V_l the chosen oracle's per-user variance at
    (eps, B^l)."""
    height = tree_height(branching, buckets)
    sampling = split = 0.0
    for level in range(1, height + 1):
        size = branching**level
        sampling += height * level_oracle(epsilon, size).variance(1) + (height - 1) / 4
        split += level_oracle(epsilon / height, size).variance(1)
    return sampling, split
