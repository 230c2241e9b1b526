"""Detecting fake reports by the items they support together (server side).

Cao, Jia and Gong ("Data Poisoning Attacks to Local Differential Privacy Protocols", USENIX
Security 2021, countermeasures) observe that under the maximal gain attack (MGA) against a
protocol whose report supports several items (OUE, OLH), every fake report supports the
same r target items, while an honest report supports a given set of items together only
by chance; so the targets form a frequent itemset of the reports, and the reports that
support all of it are the fakes. This module finds that itemset and flags those reports,
with a false-alarm rate and an honest loss it states.

Notation. Report i *supports* item v when B_iv = 1 (a unary encoding: bit v is set; OLH:
H_{a_i, b_i}(v) = y_i). With f_v the frequency of v among honest devices and p, q the
mechanism's realized support probabilities (``CategoricalMechanism``), an honest report
supports v with probability m_v = q + f_v (p - q).

Honest co-support. For items u != v, an honest report of value w supports both with
probability p q (w = u or w = v) or q^2 (otherwise): the bits of a unary encoding are
independent given w, and for OLH the same holds when the hash is modelled as a random
function into g buckets (then q = 1/g: the Carter-Wegman family of ``olh`` is exactly
pairwise independent, up to its mod-P-mod-g bias, not three-wise). So

    pi_uv = P(B_u = B_v = 1) = q^2 + (f_u + f_v) q (p - q) = m_u m_v - f_u f_v (p - q)^2,

and the covariance of B_u and B_v is -f_u f_v (p - q)^2 <= 0: honest supports of two items
are never positively correlated. MGA makes the targets' supports strongly positively
correlated (a fake report supports all of them).

OLH's affine family is not three-wise independent: for w = u + lambda (v - u) mod P, the
chance tau(lambda) that u, v and w share a bucket is about twice its mean at lambda = 2 or
-1 (u, v, w in arithmetic progression; ``triple_collision`` computes it exactly), so honest
reports of a frequent w co-support such u and v: measured, z ~ 7.8 for items 2 and 4 under
Zipf(1.1) with item 0 the most frequent (n = 10^5, d = 1024, epsilon 1), a false alarm. The
test therefore subtracts the honest covariance this adds, kappa_uv = (p_b - q_b) sum_w f_w
(tau(lambda_uvw) - tau_bar) over the frequent candidates w (``_olh_three_wise_excess``,
estimated frequencies); for unary encodings kappa = 0.

Test of a pair. With G = B^T B the co-support counts of the candidates and m^_v the
observed support rates, D_uv = G_uv - n m^_u m^_v - n kappa_uv is n times the sample
covariance beyond the honest one, and

    z_uv = D_uv / sqrt(n m^_u (1 - m^_u) m^_v (1 - m^_v)) = sqrt(n) phi_uv,

phi the phi coefficient of the 2x2 table of B_u and B_v (Pearson's chi-square of that
table is n phi^2 = z^2). Under zero covariance z_uv is asymptotically N(0, 1); an honest
pair's covariance is <= 0, so P(z_uv >= z) <= 1 - Phi(z) asymptotically: the one-sided test
is conservative. The K candidates (the K most supported items, from the aggregate) give
M = K (K - 1) / 2 pairs; a pair is *in excess* when z_uv >= z* = Phi^-1(1 - alpha / M)
(Bonferroni), so an honest window shows any excess pair with probability at most alpha,
up to the normal approximation (its relative error at z* ~ 6 is a few tens of percent
for n = 10^5: Edgeworth, a third-moment term over sqrt(n)). ``Detection.p_value`` is the
Bonferroni p-value of the strongest pair, min(1, M (1 - Phi(max z))): how unlikely the
most co-supported pair is under honest reports.

Itemset. The excess pairs form a graph on the candidates; the itemset T is a clique grown
greedily: start from the pair of largest z, then repeatedly add the candidate adjacent to
every member with the largest sum of z to the members, until none is adjacent to all. The
greedy clique need not be the largest (finding that is NP-hard), but MGA's targets are a
clique of r items whose pairs all carry z far above z*, and the greedy walk follows them.

Flagging. A report is flagged when it supports at least s of the k = |T| items, s the least
count whose bound b[s] on P(an honest report supports >= s items of T) is at most
``max_honest_share`` (default 10^-3); the expected number of honest reports flagged is at
most n b[s] (``Detection.expected_honest_flagged``). The bounds are per family:

* unary encodings: an honest report of value w supports S = 1{own bit} + Bin(k - 1, q)
  (w in T, own bit with probability p) or S = Bin(k, q) items of T, so b[s] is the larger
  of the two tails (``unary_flag_bounds``; a mixture over values is at most its worst
  component). For r = 10 targets at epsilon 1, OUE flags reports supporting >= 9 of them
  (b[9] = 9.7e-5).
* OLH: from the hash family itself (``olh_flag_bounds``), not from a random-hash model: an
  itemset found under MGA holds, beside the targets, the items that the attackers' few
  best hashes (at d = 1024 none maps 10 random targets to one bucket; the best reach 9)
  map with them, and honest reports with similar hashes support many of these.

Reports are flagged only when |T| >= k0, the least k >= 2 with p q^(k - 1) <= the share (an
honest report supports all of k items with probability at most p q^(k - 1) under the
binomial law): k0 = 6 for OUE and OLH at epsilon 1. A smaller itemset, or one where no s <= k
qualifies, is still returned with its p-value (the window looks attacked) but nothing is
flagged. No excess pair: empty itemset, nothing flagged.

Rounds. Fakes need not all support one itemset (under the affine family, MGA's best
hashes fall in groups that map different items with the targets), so detection peels:
each round runs the above on the reports not yet flagged, until a round flags nothing (at
most ``max_rounds``). Under honest reports the first round fires with probability at most
alpha and nothing further runs; an honest report is flagged with probability at most the
sum of the rounds' b[s] (union bound; each round's bound holds for its itemset taken as
given, the itemset being fixed by many reports, not by one).

Cost: one aggregate (to rank candidates), then an (n, K) boolean matrix and one (K, K)
product: O(n K) beside the aggregate, all numpy; for OLH also O(P min(P, K^3)) for the
three-wise correction and, once an itemset is found, O(P^2 k) (capped) for its bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, cast

import numpy as np

from shared.mechanisms.base import Mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.olh import OptimizedLocalHashing, inverse_mod
from shared.mechanisms.unary import UnaryEncoding

#: Largest expected share of honest reports flagged: fixes the least itemset size k0.
DEFAULT_MAX_HONEST_SHARE = 1e-3


@dataclass(frozen=True)
class ItemsetRound:
    """One round of the detection: the itemset found among the reports still unflagged.

    ``itemset``: the items supported together beyond chance (sorted; empty if none).
    ``p_value``: the Bonferroni p-value of the round's most co-supported candidate pair
    under honest reports, min(1, M (1 - Phi(max z))).
    ``min_supported``: s, how many items of ``itemset`` a report of the round supports at
    least to be flagged (0 when the round flags nothing).
    ``honest_share_bound``: b[s], the most an honest report is flagged with in the round
    (0 when it flags nothing).
    ``flagged``: how many reports the round flagged.
    """

    itemset: np.ndarray
    p_value: float
    min_supported: int
    honest_share_bound: float
    flagged: int


@dataclass(frozen=True)
class Detection:
    """What ``detect_fake_reports`` found in a batch of reports.

    ``flagged``: one bool per report, True when some round flagged it.
    ``rounds``: the rounds run (the last flags nothing, unless ``max_rounds`` stopped it).
    ``threshold``: z*, the z every pair of a round's itemset reaches (Bonferroni at alpha).
    ``min_itemset``: k0, the least itemset size at which reports are flagged.
    """

    flagged: np.ndarray
    rounds: tuple[ItemsetRound, ...]
    threshold: float
    min_itemset: int

    @property
    def itemset(self) -> np.ndarray:
        """The union of the flagging rounds' itemsets, or else the first round's itemset."""
        flagging = [found.itemset for found in self.rounds if found.flagged]
        if not flagging:
            return self.rounds[0].itemset if self.rounds else np.zeros(0, np.int64)
        return np.unique(np.concatenate(flagging))

    @property
    def p_value(self) -> float:
        """The first round's p-value: how unlikely the window's strongest co-support is under
        honest reports (the later rounds run only once the first has fired)."""
        return self.rounds[0].p_value if self.rounds else 1.0

    @property
    def honest_share_bound(self) -> float:
        """sum over rounds of b[s]: the most an honest report is flagged with (union bound)."""
        return math.fsum(found.honest_share_bound for found in self.rounds)

    @property
    def expected_honest_flagged(self) -> float:
        """The bound n sum b[s] on the expected number of honest reports flagged."""
        return self.honest_share_bound * self.flagged.size


SupportMatrix = Callable[[Any, np.ndarray, np.ndarray], np.ndarray]
HonestCovariance = Callable[[Any, np.ndarray, np.ndarray], np.ndarray]
FlagBounds = Callable[[Any, np.ndarray], np.ndarray]

#: Most (lambda, delta) cells ``_olh_three_wise_excess`` evaluates (its cost bound).
_TRIPLE_BUDGET = 1 << 27
#: Cells per chunk of that evaluation (memory bound: a few int64 arrays of this size).
_TRIPLE_CHUNK = 1 << 21
#: Most (hash, item) evaluations ``olh_flag_bounds`` makes: every hash of the family
#: within it, a uniform sample of hashes beyond.
_HASH_BUDGET = 1 << 26


def _unary_support(mechanism: UnaryEncoding, reports: np.ndarray, items: np.ndarray) -> np.ndarray:
    """B_iv = bit v of report i: bit ``7 - v % 8`` of byte ``v // 8`` (packbits layout)."""
    shifts = (7 - (items & 7)).astype(np.uint8)
    return ((reports[:, items >> 3] >> shifts) & 1).astype(bool)


def _independent_bits(
    mechanism: UnaryEncoding, items: np.ndarray, frequencies: np.ndarray
) -> np.ndarray:
    """A unary encoding's bits are independent given the value: honest covariance
    -f_u f_v (p - q)^2 <= 0, taken as 0 (the conservative side of the one-sided test)."""
    return np.zeros((items.size, items.size))


def _olh_support(
    mechanism: OptimizedLocalHashing, reports: np.ndarray, items: np.ndarray
) -> np.ndarray:
    """B_iv = [H_{a_i, b_i}(v) = y_i], every (report, item) pair at once."""
    a, b, y = reports.T
    return mechanism.hash(a[:, None], b[:, None], items[None, :]) == y[:, None]


def triple_collision(prime: int, buckets: int, lambdas: np.ndarray) -> np.ndarray:
    """tau(lambda) = P(X_u, X_v, X_w all equal mod g) over the family H_{a,b}(x) = ((a x + b)
    mod P) mod g, for w = u + lambda (v - u) mod P (u != v).

    (X_u, X_v) = (a u + b, a v + b) mod P is uniform over the P (P - 1) ordered pairs of
    distinct residues, and X_w = X_u + lambda delta mod P with delta = X_v - X_u mod P. For
    fixed delta and e = lambda delta mod P, (x + delta) mod P - x is delta when x < P - delta
    and delta - P otherwise (likewise for e), so the x in [0, P) meeting both congruences
    are counted interval by interval in O(1), and tau(lambda) = sum_delta N(delta, e) /
    (P (P - 1)): O(P) per lambda, exact.
    """
    lambdas = np.asarray(lambdas, dtype=np.int64)
    out = np.empty(lambdas.size)
    delta = np.arange(1, prime, dtype=np.int64)[None, :]
    s = prime - delta
    delta_fits = delta % buckets == 0  # x < P - delta: x + delta
    wrap_fits = (delta - prime) % buckets == 0  # x >= P - delta: x + delta - P
    rows = max(1, _TRIPLE_CHUNK // prime)
    for start in range(0, lambdas.size, rows):
        e = lambdas[start : start + rows, None] * delta % prime
        t = prime - e
        e_fits, e_wrap_fits = e % buckets == 0, (e - prime) % buckets == 0
        count = (
            (delta_fits & e_fits) * np.minimum(s, t)
            + (wrap_fits & e_wrap_fits) * (prime - np.maximum(s, t))
            + (wrap_fits & e_fits) * np.maximum(t - s, 0)
            + (delta_fits & e_wrap_fits) * np.maximum(s - t, 0)
        )
        out[start : start + rows] = count.sum(axis=1)
    return out / (prime * (prime - 1))


def _olh_three_wise_excess(
    mechanism: OptimizedLocalHashing, items: np.ndarray, frequencies: np.ndarray
) -> np.ndarray:
    """Honest covariance of B_u and B_v that the affine hash family adds, per candidate pair.

    The family is pairwise but not three-wise independent: for u != v and another value w,
    with p_b, q_b the realized P(y = H(w)) and P(y = each other bucket),

        P(B_u = B_v = 1 | w) = c q_b + (p_b - q_b) tau(lambda_uvw),
        lambda_uvw = (w - u) / (v - u) mod P,

    and tau (``triple_collision``) is far from its mean tau_bar over lambda not in {0, 1}
    for a few lambda (tau(2) = tau(-1) ~ 2 tau_bar at P = 1031, g = 4: w, u, v in
    arithmetic progression), which makes honest reports of a frequent w co-support u and v.
    The excess is (p_b - q_b) sum_w f_w (tau(lambda_uvw) - tau_bar), summed over the J most
    frequent candidates w (not u, v; f clipped to [0, 1]), J = K when the P tau evaluations
    of every distinct lambda fit ``_TRIPLE_BUDGET`` cells, fewer otherwise (other values are
    taken at tau_bar).
    """
    prime, k = mechanism.prime, items.size
    p_b, q_b = mechanism.bucket_probabilities
    weights = np.clip(frequencies, 0.0, 1.0)
    per_w = max(1, _TRIPLE_BUDGET // (prime * max(1, k * (k - 1) // 2)))
    if per_w >= k or prime * prime <= _TRIPLE_BUDGET:
        witnesses = np.arange(k)
    else:
        witnesses = np.argsort(-weights)[:per_w]
    u, v, w = items[:, None, None], items[None, :, None], items[None, None, witnesses]
    lam = (w - u) % prime * inverse_mod((v - u) % prime, prime) % prime
    distinct, where = np.unique(lam, return_inverse=True)
    tau = triple_collision(prime, mechanism.buckets, distinct)[where.reshape(-1)].reshape(lam.shape)
    tau_bar = mean_triple_collision(prime, mechanism.buckets)
    own = (witnesses[None, None, :] == np.arange(k)[:, None, None]) | (
        witnesses[None, None, :] == np.arange(k)[None, :, None]
    )
    excess = np.where(own, 0.0, tau - tau_bar) @ weights[witnesses]
    excess = (p_b - q_b) * excess
    np.fill_diagonal(excess, 0.0)
    return excess


def mean_triple_collision(prime: int, buckets: int) -> float:
    """tau_bar, the mean of tau(lambda) over lambda not in {0, 1} (w not u nor v).

    As lambda runs over Z_P, X_u + lambda delta runs over every residue, so
    sum_lambda tau(lambda) = E[[X_u = X_v mod g] m_(X_u mod g)] = sum_r m_r^2 (m_r - 1) /
    (P (P - 1)), m_r = #{x < P : x mod g = r}; tau(0) = tau(1) = c, the collision
    probability sum_r m_r (m_r - 1) / (P (P - 1)).
    """
    sizes = np.full(buckets, prime // buckets, dtype=np.float64)
    sizes[: prime % buckets] += 1
    pairs = prime * (prime - 1)
    collision = float(np.sum(sizes * (sizes - 1))) / pairs
    total = float(np.sum(sizes * sizes * (sizes - 1))) / pairs
    return (total - 2 * collision) / (prime - 2)


def _binomial_tail(trials: int, q: float, at_least: int) -> float:
    """P(Binomial(trials, q) >= at_least), by the exact sum (trials is an itemset's size)."""
    return math.fsum(
        math.comb(trials, j) * q**j * (1 - q) ** (trials - j)
        for j in range(max(at_least, 0), trials + 1)
    )


def unary_flag_bounds(p: float, q: float, size: int) -> np.ndarray:
    """b[s], s = 0..k + 1: the most an honest report of a unary encoding supports at least s
    of k given items with, max(p P(Bin(k - 1, q) >= s - 1) + (1 - p) P(Bin(k - 1, q) >= s),
    P(Bin(k, q) >= s)) (bits independent given the value; exact for the worst value)."""
    bounds = [
        max(
            p * _binomial_tail(size - 1, q, at_least - 1)
            + (1 - p) * _binomial_tail(size - 1, q, at_least),
            _binomial_tail(size, q, at_least),
        )
        for at_least in range(size + 2)
    ]
    return np.array(bounds)


def _unary_flag_bounds(mechanism: UnaryEncoding, itemset: np.ndarray) -> np.ndarray:
    return unary_flag_bounds(mechanism.p, mechanism.q, itemset.size)


def olh_flag_bounds(mechanism: OptimizedLocalHashing, itemset: np.ndarray) -> np.ndarray:
    """b[s], s = 0..k + 1, for OLH, from the hash family itself (no random-hash model).

    For a hash h let c_h(y) be how many items of T it maps to bucket y and N_s(h) the number
    of buckets with c_h(y) >= s. An honest report of value w reports y with probability
    q_b + (p_b - q_b) [y = H(w)], so it supports at least s items of T with probability
    E_h[q_b N_s(h) + (p_b - q_b) [c_h(H_h(w)) >= s]] <= q_b E_h[N_s] + (p_b - q_b) P_h(N_s >= 1)
    =: b[s], over h = (a, b) uniform in the family. Every hash is evaluated when (P - 1) P k
    fits ``_HASH_BUDGET``; beyond, the hashes of a uniform sample of multipliers a (drawn by
    a generator seeded with the itemset, so the figure is reproducible) with every b, which
    estimates both expectations without bias. Per multiplier the residues a v mod P of T are
    computed once; adding b stays below 2P, so one lookup table gives ((a v + b) mod P) mod g.
    """
    prime, g, size = mechanism.prime, mechanism.buckets, itemset.size
    p_b, q_b = mechanism.bucket_probabilities
    multipliers = np.arange(1, prime, dtype=np.int64)
    fits = max(1, _HASH_BUDGET // (prime * size))
    if fits < multipliers.size:
        sampler = np.random.default_rng([prime, *itemset.tolist()])
        multipliers = sampler.choice(multipliers, size=fits, replace=False)
    residues = multipliers[:, None] * itemset[None, :] % prime  # (A, k): a v mod P
    bucket_of = np.arange(2 * prime, dtype=np.int64) % prime % g
    shifts = np.arange(prime, dtype=np.int64)[None, :, None]  # every b
    per_block = max(1, _TRIPLE_CHUNK // (prime * size))
    buckets_at = np.zeros(size + 2)  # histogram of c_h(y) over every (h, y)
    fullest_at = np.zeros(size + 2)  # histogram of max_y c_h(y) over every h
    for start in range(0, multipliers.size, per_block):
        block = residues[start : start + per_block]
        hashes = block.shape[0] * prime
        cells = bucket_of[block[:, None, :] + shifts] + g * np.arange(hashes).reshape(-1, prime, 1)
        counts = np.bincount(cells.ravel(), minlength=hashes * g)
        buckets_at += np.bincount(counts, minlength=size + 2)
        fullest_at += np.bincount(counts.reshape(hashes, g).max(axis=1), minlength=size + 2)
    total = multipliers.size * prime
    at_least = lambda histogram: histogram[::-1].cumsum()[::-1] / total  # noqa: E731
    return q_b * at_least(buckets_at) + (p_b - q_b) * at_least(fullest_at)


#: Per family: how its reports support items, the honest covariance of two items' supports
#: beyond what the one-sided test already allows for, and the bounds b[s] on an honest
#: report supporting s items of an itemset. A subclass (the ``lue`` family of unary
#: encodings) uses its base's entry.
_FAMILIES: dict[type, tuple[SupportMatrix, HonestCovariance, FlagBounds]] = {
    UnaryEncoding: (_unary_support, _independent_bits, _unary_flag_bounds),
    OptimizedLocalHashing: (_olh_support, _olh_three_wise_excess, olh_flag_bounds),
}


def _family_of(mechanism: Mechanism[Any]) -> tuple[SupportMatrix, HonestCovariance, FlagBounds]:
    for cls in type(mechanism).__mro__:
        if cls in _FAMILIES:
            return _FAMILIES[cls]
    raise ValueError(
        f"fake-report detection needs reports that support several items (unary encodings "
        f"sue, oue, lsue, loue, losue, or olh); {mechanism.name!r} reports support one"
    )


def least_flagging_itemset(p: float, q: float, max_honest_share: float) -> int:
    """k0: the least k >= 2 with b_k = p q^(k - 1) <= ``max_honest_share``."""
    if not 0.0 < max_honest_share < 1.0:
        raise ValueError(f"max_honest_share must lie in (0, 1), got {max_honest_share}")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must lie in (0, 1), got {q}")
    needed = math.log(max_honest_share / p) / math.log(q) + 1.0
    k = max(2, math.ceil(needed - 1e-12))
    while p * q ** (k - 1) > max_honest_share:  # guard the rounding of the logarithms
        k += 1
    return k


def pair_scores(support: np.ndarray, honest_covariance: np.ndarray) -> np.ndarray:
    """z_uv = (G_uv - n m^_u m^_v - n kappa_uv) / sqrt(n m^_u (1 - m^_u) m^_v (1 - m^_v)) for
    the columns of an (n, K) boolean support matrix, kappa the (K, K) honest covariance the
    family adds; 0 on the diagonal and where a column is constant."""
    n = support.shape[0]
    columns = support.astype(np.float64)
    rates = columns.mean(axis=0)
    co_support = columns.T @ columns
    spread = np.sqrt(rates * (1.0 - rates))
    scale = math.sqrt(n) * np.outer(spread, spread)
    excess = co_support - n * (np.outer(rates, rates) + honest_covariance)
    z = np.divide(excess, scale, out=np.zeros_like(excess), where=scale > 0)
    np.fill_diagonal(z, 0.0)
    return z


def greedy_clique(adjacent: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A clique of the graph ``adjacent`` (symmetric bool, false diagonal) grown from its
    heaviest edge by adding, while any vertex is adjacent to every member, the one with the
    largest summed weight to the members. Empty when the graph has no edge."""
    if not adjacent.any():
        return np.zeros(0, dtype=np.int64)
    masked = np.where(adjacent, weights, -np.inf)
    first, second = np.unravel_index(int(np.argmax(masked)), masked.shape)
    members = [int(first), int(second)]
    joinable = adjacent[first] & adjacent[second]
    pull = weights[first] + weights[second]
    while joinable.any():
        best = int(np.argmax(np.where(joinable, pull, -np.inf)))
        members.append(best)
        joinable &= adjacent[best]
        pull = pull + weights[best]
    return np.array(sorted(members), dtype=np.int64)


def detect_fake_reports(
    mechanism: Mechanism[Any],
    reports: np.ndarray,
    *,
    candidates: int = 64,
    alpha: float = 1e-6,
    max_honest_share: float = DEFAULT_MAX_HONEST_SHARE,
    max_rounds: int = 4,
) -> Detection:
    """Find the itemsets the reports support together beyond chance and flag their supporters.

    Round by round (at most ``max_rounds``): find an itemset among the reports not yet
    flagged and flag its supporters, until a round flags nothing. Several rounds peel groups
    of fakes that support different itemsets (OLH's MGA: each group of the attackers' hashes
    maps other items with the targets). Under honest reports the first round finds nothing
    with probability >= 1 - alpha, and nothing further runs.

    ``candidates``: K, the most supported items tested pairwise; ``alpha``: the honest
    false-alarm rate of a round (Bonferroni over K (K - 1) / 2 pairs); ``max_honest_share``:
    the bound on the expected share of honest reports a round flags, which sets the least
    itemset size k0 and the count s (module docstring). ValueError for a mechanism whose
    reports support one item.
    """
    family = _family_of(mechanism)
    oracle = cast(CategoricalMechanism, mechanism)  # every family in the table is one
    if candidates < 2:
        raise ValueError(f"candidates must be at least 2, got {candidates}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
    reports = oracle.check_reports(reports)
    min_itemset = least_flagging_itemset(oracle.p, oracle.q, max_honest_share)
    k = min(candidates, oracle.domain_size)
    threshold = -NormalDist().inv_cdf(alpha / (k * (k - 1) // 2))
    flagged = np.zeros(reports.shape[0], dtype=bool)
    rounds: list[ItemsetRound] = []
    while len(rounds) < max_rounds and not flagged.all():
        remaining = np.flatnonzero(~flagged)
        found, hits = _detection_round(
            oracle, reports[remaining], family, k, threshold, min_itemset, max_honest_share
        )
        rounds.append(found)
        if not found.flagged:
            break
        flagged[remaining[hits]] = True
    return Detection(flagged, tuple(rounds), threshold, min_itemset)


def _detection_round(
    oracle: CategoricalMechanism,
    reports: np.ndarray,
    family: tuple[SupportMatrix, HonestCovariance, FlagBounds],
    k: int,
    threshold: float,
    min_itemset: int,
    max_honest_share: float,
) -> tuple[ItemsetRound, np.ndarray]:
    """One round: candidates, pair scores, the greedy clique, and its flagged supporters."""
    support_matrix, honest_covariance, flag_bounds = family
    stats = oracle.aggregate(reports)
    items = np.sort(np.argpartition(-oracle.support_counts(stats), k - 1)[:k]).astype(np.int64)
    support = support_matrix(oracle, reports, items)
    frequencies = oracle.estimate(stats).frequencies[items]
    z = pair_scores(support, honest_covariance(oracle, items, frequencies))
    p_value = min(1.0, k * (k - 1) // 2 * 0.5 * math.erfc(float(z.max()) / math.sqrt(2.0)))
    clique = greedy_clique(z >= threshold, z)
    nothing = np.zeros(reports.shape[0], dtype=bool)
    if clique.size < min_itemset:
        return ItemsetRound(items[clique], p_value, 0, 0.0, 0), nothing
    bounds = flag_bounds(oracle, items[clique])
    at_least = int(np.argmax(bounds <= max_honest_share))  # b[k + 1] = 0 always qualifies
    if at_least > clique.size:
        return ItemsetRound(items[clique], p_value, 0, 0.0, 0), nothing
    hits = support[:, clique].sum(axis=1) >= at_least
    bound = float(bounds[at_least])
    return ItemsetRound(items[clique], p_value, at_least, bound, int(hits.sum())), hits
