"""Fake-report detection by co-supported itemsets (``shared.fake_detection``).

Honest windows must flag nothing; the maximal gain attack (MGA, Cao, Jia and Gong, USENIX
Security 2021) must be found, its fakes flagged and its frequency gain cut. The forged
reports are crafted here as the paper describes (OUE: the r target bits plus random bits up
to an honest-looking count of ones; OLH: hash functions that map every target to one
bucket, reporting that bucket). Statistical checks use fixed seeds and state their
false-failure rates; exact quantities are checked by enumeration.
"""

from __future__ import annotations

import itertools
import math
from typing import cast

import numpy as np
import pytest

from shared.fake_detection import (
    detect_fake_reports,
    greedy_clique,
    least_flagging_itemset,
    mean_triple_collision,
    olh_flag_bounds,
    triple_collision,
)
from shared.mechanisms import make_mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.mechanisms.unary import UnaryEncoding
from shared.schemas import MechanismSpec

D, EPSILON, TARGETS, BETA = 1024, 1.0, 10, 0.05


def mechanism(
    name: str, d: int = D, epsilon: float = EPSILON, **fields: float
) -> CategoricalMechanism:
    spec = {"mechanism": name, "epsilon": epsilon, "domain_size": d} | fields
    return cast(CategoricalMechanism, make_mechanism(MechanismSpec.model_validate(spec)))


def zipf_values(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """Zipf(1.1) over 0..d-1 with item 0 the most frequent: popular items in arithmetic
    progression, the hardest case for OLH's affine hash family (module docstring)."""
    weights = 1.0 / np.arange(1, d + 1) ** 1.1
    return rng.choice(d, size=n, p=weights / weights.sum())


def mga_unary(
    mech: UnaryEncoding, targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """Cao et al.'s MGA on a unary encoding: the target bits, plus l = round(p + (d - 1) q) - r
    other bits chosen uniformly, so the count of ones is the honest mean."""
    d = mech.domain_size
    extra = round(mech.p + (d - 1) * mech.q) - targets.size
    others = np.setdiff1d(np.arange(d), targets)
    keys = rng.random((m, others.size))
    chosen = others[np.argpartition(keys, extra - 1, axis=1)[:, :extra]]
    bits = np.zeros((m, d), dtype=bool)
    bits[:, targets] = True
    bits[np.arange(m)[:, None], chosen] = True
    return np.packbits(bits, axis=1)


def mga_olh(
    mech: OptimizedLocalHashing, targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """Cao et al.'s MGA on OLH: every fake reports (a, b, y) with H_{a,b} mapping the most
    targets into the bucket y, (a, b) uniform among such hashes (at d = 1024 the family has
    none for all 10 random targets: the best reach 9)."""
    prime, g = mech.prime, mech.buckets
    a, b = np.divmod(np.arange((prime - 1) * prime, dtype=np.int64), prime)
    a += 1
    hashed = mech.hash(a[:, None], b[:, None], targets[None, :])
    per_bucket = (hashed[:, :, None] == np.arange(g)).sum(axis=1)
    best = per_bucket.max(axis=1)
    chosen = np.flatnonzero(best == best.max())
    pick = rng.choice(chosen, size=m)
    return np.stack([a[pick], b[pick], per_bucket[pick].argmax(axis=1)], axis=1)


def forged(
    mech: CategoricalMechanism, targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    if isinstance(mech, OptimizedLocalHashing):
        return mga_olh(mech, targets, m, rng)
    assert isinstance(mech, UnaryEncoding)
    return mga_unary(mech, targets, m, rng)


def target_gain(
    mech: CategoricalMechanism, reports: np.ndarray, targets: np.ndarray, truth: np.ndarray
) -> float:
    """sum_t (f~_t - f_t): the estimate's excess on the targets over the honest truth."""
    estimate = mech.estimate(mech.aggregate(reports)).frequencies
    return float(np.sum(estimate[targets] - truth[targets]))


# --- exact pieces ----------------------------------------------------------------------------


@pytest.mark.parametrize(("prime", "buckets"), [(11, 3), (13, 4), (17, 5)])
def test_triple_collision_matches_enumeration(prime: int, buckets: int) -> None:
    """tau(lambda) equals the share of every (a, b) with a u + b, a v + b, a w + b equal mod g."""
    a, b = np.divmod(np.arange((prime - 1) * prime), prime)
    a += 1
    u, v = 2, 7
    lambdas = np.arange(prime)
    w = (u + lambdas * (v - u)) % prime
    hashed = lambda x: (a[:, None] * x + b[:, None]) % prime % buckets  # noqa: E731
    equal = (hashed(np.array([u])) == hashed(np.array([v]))) & (hashed(np.array([u])) == hashed(w))
    np.testing.assert_allclose(triple_collision(prime, buckets, lambdas), equal.mean(axis=0))
    rest = triple_collision(prime, buckets, lambdas[2:])
    assert mean_triple_collision(prime, buckets) == pytest.approx(rest.mean(), rel=1e-12)


def testolh_flag_bounds_cover_every_value_exactly_enumerated() -> None:
    """b[s] >= max_w P(an honest report of w supports >= s items of T), the probability
    computed exactly over every hash (a, b) and bucket y of a small family (P = 37, g = 3)."""
    mech = mechanism("olh", d=37, epsilon=math.log(2.0))
    assert isinstance(mech, OptimizedLocalHashing)
    prime, g = mech.prime, mech.buckets
    own, other = mech.bucket_probabilities
    itemset = np.array([1, 2, 3, 5, 8, 13, 21])
    bounds = olh_flag_bounds(mech, itemset)
    a, b = np.divmod(np.arange((prime - 1) * prime), prime)
    a += 1
    hashed = mech.hash(a[:, None], b[:, None], itemset[None, :])  # (H, k)
    counts = (hashed[:, :, None] == np.arange(g)).sum(axis=1)  # c_h(y): (H, g)
    for w in range(mech.domain_size):
        h_w = mech.hash(a, b, np.array(w))
        law = np.where(np.arange(g)[None, :] == h_w[:, None], own, other)  # P(y | w): (H, g)
        for at_least in range(itemset.size + 2):
            exact = float(np.mean(np.sum(law * (counts >= at_least), axis=1)))
            assert exact <= bounds[at_least] + 1e-12


def test_least_flagging_itemset_is_the_least_size_within_the_share() -> None:
    for name in ("oue", "olh", "sue"):
        mech = mechanism(name)
        k0 = least_flagging_itemset(mech.p, mech.q, 1e-3)
        assert mech.p * mech.q ** (k0 - 1) <= 1e-3
        assert k0 == 2 or mech.p * mech.q ** (k0 - 2) > 1e-3
    assert least_flagging_itemset(mechanism("oue").p, mechanism("oue").q, 1e-3) == 6
    assert least_flagging_itemset(mechanism("olh").p, mechanism("olh").q, 1e-3) == 6


def test_greedy_clique_follows_the_heaviest_edges() -> None:
    # a 4-clique {0, 1, 2, 3} with heavy edges and a lighter triangle {3, 4, 5}
    weights = np.zeros((6, 6))
    for i, j in itertools.combinations(range(4), 2):
        weights[i, j] = weights[j, i] = 10.0
    for i, j in itertools.combinations((3, 4, 5), 2):
        weights[i, j] = weights[j, i] = 7.0
    np.testing.assert_array_equal(greedy_clique(weights > 0, weights), [0, 1, 2, 3])
    assert greedy_clique(np.zeros((3, 3), dtype=bool), np.zeros((3, 3))).size == 0


def test_mechanisms_whose_reports_support_one_item_are_refused() -> None:
    mech = mechanism("grr", d=8)
    with pytest.raises(ValueError, match="'grr'"):
        detect_fake_reports(
            mech, mech.encode(np.zeros(10, dtype=np.int64), rng=np.random.default_rng(0))
        )


# --- honest windows ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "n"),
    [
        ("oue", 20_000),
        ("olh", 20_000),
        ("sue", 20_000),
        ("losue", 5_000),
        pytest.param("oue", 100_000, marks=pytest.mark.slow),
        pytest.param("olh", 100_000, marks=pytest.mark.slow),
    ],
)
def test_honest_reports_flag_nothing(name: str, n: int) -> None:
    """An honest window shows an itemset with probability at most alpha = 1e-6 (Bonferroni
    over the K (K - 1) / 2 candidate pairs, normal approximation): that is this test's
    false-failure rate. Even then reports would be flagged only past k0 = 6 items, with an
    expected honest share <= 1e-3."""
    mech = mechanism(name, d=128, epsilon_report=0.5) if name == "losue" else mechanism(name)
    rng = np.random.default_rng(2900 + n)
    values = zipf_values(n, mech.domain_size, rng)
    detection = detect_fake_reports(mech, mech.encode(values, rng=rng))
    assert detection.itemset.size == 0
    assert not detection.flagged.any()
    assert detection.p_value > 1e-6


# --- the maximal gain attack -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "n", "d"),
    [
        ("oue", 20_000, D),
        ("olh", 20_000, 256),
        pytest.param("olh", 20_000, D, marks=pytest.mark.slow),
        pytest.param("oue", 100_000, D, marks=pytest.mark.slow),
        pytest.param("olh", 100_000, D, marks=pytest.mark.slow),
    ],
)
def test_mga_itemset_is_found_and_its_gain_cut(name: str, n: int, d: int) -> None:
    """MGA at beta = 5%, r = 10, d = 1024 (and 256, fast), epsilon 1: the itemset is the targets
    (OLH: holds
    the targets among the candidates, and more: the fakes' few hashes co-support other items
    too), >= 95% of the fakes are flagged, the honest reports flagged stay within the stated
    bound, and the gain of the estimate from the unflagged reports is at most half the
    undefended gain.

    False-failure rates: a target pair's z is about sqrt(n) beta (1 - q)^2 / (m (1 - m)) > 15 at
    n = 2 10^4 against z* = 6.1, so missing a target has a normal tail below 1e-20; every fake
    supports all (OUE) or 9 (OLH, the best hashes of the family) of the 10 targets and most
    of the collateral items, far past the flagging count s; the defended gain's noise (sd ~
    0.05 at n = 2 10^4) is far below the margin between half the undefended gain (> 0.5) and
    what is left (no fakes).
    """
    mech = mechanism(name, d=d)
    rng = np.random.default_rng(29_000 + n + d)
    values = zipf_values(n, d, rng)
    truth = np.bincount(values, minlength=d) / n
    targets = np.sort(rng.choice(d, size=TARGETS, replace=False))
    fakes = round(BETA * n / (1 - BETA))
    reports = np.concatenate([mech.encode(values, rng=rng), forged(mech, targets, fakes, rng)])
    is_fake = np.arange(reports.shape[0]) >= n

    detection = detect_fake_reports(mech, reports)
    if name == "oue":
        np.testing.assert_array_equal(detection.itemset, targets)
    else:  # the fakes' few hashes co-support other items too (module docstring, OLH)
        ranked = np.argsort(-mech.aggregate(reports).counts)[:64]
        assert np.isin(np.intersect1d(targets, ranked), detection.itemset).all()
    assert detection.p_value < 1e-6
    assert detection.flagged[is_fake].mean() >= 0.95
    # honest flagged ~ at most Binomial(n, b[s]): mean + 6 sd + 6 fails with probability < 1e-6
    mean = detection.expected_honest_flagged
    assert detection.flagged[~is_fake].sum() <= mean + 6 * math.sqrt(mean) + 6

    undefended = target_gain(mech, reports, targets, truth)
    defended = target_gain(mech, reports[~detection.flagged], targets, truth)
    assert undefended > 1.0
    assert abs(defended) <= 0.5 * undefended
