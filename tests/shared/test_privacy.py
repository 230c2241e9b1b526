"""Exact privacy tests: every mechanism's epsilon is checked by enumeration, and is tight.

For every mechanism in the registry (``shared.mechanisms.MECHANISMS``, plus ``auto``)
and several (epsilon, domain) settings, ``transition_matrix`` gives the exact output
distribution.
The tests assert that

* every row is a distribution (sums, or integrates, to 1);
* the largest likelihood ratio ``max_y max_{x, x'} P[y | x] / P[y | x']`` is at most
  e^epsilon and at least e^epsilon up to float rounding: the bound is tight (for a
  memoized mechanism, one report's ratio is e^epsilon_report and its permanent
  response's, ``permanent_matrix``, e^epsilon: the bound over any number of reports of
  one value);
* in OpenDP's terms, ``check(d_in, d_out)`` holds at ``d_out = epsilon`` and fails at
  ``d_out = epsilon - 1e-6``: epsilon is the smallest privacy loss the mechanism
  satisfies, not merely an upper bound on it.

A last group encodes 2 * 10^5 copies of one value with a seeded generator and tests
the empirical output frequencies against the matrix row (chi-square or binomial,
alpha = 1e-6), so the matrix the privacy proof relies on is the one the sampler
actually draws from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import MECHANISMS, make_mechanism
from shared.mechanisms.memoized import ChainedReport
from shared.mechanisms.spec import spec_models
from shared.schemas import (
    ATTRIBUTE_MECHANISMS,
    CATEGORICAL_MECHANISMS,
    STRING_MECHANISMS,
    MechanismSpec,
)

#: Relative slack on the ratio bound: the matrices hold the realized probabilities
#: (53-bit thresholds T / 2^53, see tests/adversarial/test_realized_epsilon.py for the
#: exact rational check up to epsilon 20), and their entries are products of at most
#: 2^k doubles' worth of rounding (~1e-14), so 1e-12 tells rounding from a real excess,
#: such as the 1.8e-8 that floor-rounded thresholds realized at epsilon 20.
RATIO_RTOL = 1e-12
#: The gap below epsilon at which the privacy check must fail (tightness).
BELOW = 1e-6
#: Significance of every goodness-of-fit assertion: a correct sampler fails one
#: such assertion with probability 1e-6 (seeds are fixed, so a pass is stable).
ALPHA = 1e-6
#: Copies of one value encoded for the goodness-of-fit tests.
SAMPLES = 200_000
#: Least expected count of a chi-square cell (rarer cells are pooled).
MIN_EXPECTED = 100.0

EPSILONS = (0.5, 1.0, 2.3, 5.0)
#: Small enough to enumerate every output: 2^d for unary encodings, (P-1) P g for OLH.
CATEGORICAL_DOMAINS = (2, 3, 5, 6)
NUMERIC_RANGES = ((-3.7, 11.2), (0.0, 1.0))
#: Extra spec fields per numeric mechanism (a small laplace grid keeps matrices small).
NUMERIC_EXTRAS: dict[str, tuple[dict[str, Any], ...]] = {
    "laplace": ({"grid_steps": 4}, {"grid_steps": 8}, {"grid_steps": 16}),
    "piecewise": ({"grid_steps": 1}, {"grid_steps": 5}, {"grid_steps": 16}, {}),
    "onebitmean": ({"grid_steps": 1}, {"grid_steps": 5}, {"flip_probability": 0.2}, {}),
    "hh": (
        {"buckets": 4, "branching": 2},
        {"buckets": 8, "branching": 2},
        {"buckets": 9, "branching": 3},
    ),
    "sw": ({"buckets": 2}, {"buckets": 5}, {"buckets": 16}),
    "lhh": (
        {"buckets": 4, "branching": 2},
        {"buckets": 8, "branching": 2},
        {"buckets": 9, "branching": 3},
    ),
}
#: Extra spec fields per categorical mechanism.
CATEGORICAL_EXTRAS: dict[str, tuple[dict[str, Any], ...]] = {
    "dbitflip": ({}, {"bits_per_device": 2}),
}

CHAINED_MECHANISMS = frozenset(
    name for name, model in spec_models().items() if issubclass(model, ChainedReport)
)


def memo_fields(name: str, epsilon: float) -> dict[str, Any]:
    """What a chained memoized mechanism adds: one report reveals half the lifetime bound."""
    return {"epsilon_report": epsilon / 2} if name in CHAINED_MECHANISMS else {}


#: String mechanisms (rappor) carry no epsilon: their (k, h, f, p, q) imply epsilon_one.
#: k >= 2h, where two values' Bloom filters can be disjoint and the bound is tight
#: (test_rappor_privacy.py covers k < 2h); small k, so all 2^k reports enumerate.
STRING_CASES: dict[str, tuple[dict[str, Any], ...]] = {
    "rappor": tuple(
        {"num_bits": k, "num_hashes": h, "num_cohorts": 4, "f": f, "p": p, "q": q}
        for k, h, f, p, q in (
            (2, 1, 0.5, 0.25, 0.75),
            (4, 2, 0.5, 0.25, 0.75),  # Chrome's p, q, f
            (8, 2, 0.45, 0.39, 0.61),  # the reference regression tests' eps_1 ~ 1
            (6, 3, 0.3, 0.1, 0.8),
            (5, 2, 0.0, 0.3, 0.6),  # no permanent response
            (6, 2, 0.5, 0.5, 0.75),  # asymmetric p, q (UMA RAPPOR type)
            (4, 1, 0.9, 0.0, 1.0),  # deterministic IRR
        )
    ),
}
STRING_CASES["cms"] = tuple(
    {"epsilon": eps, "sketch_width": m, "sketch_depth": k}
    for eps, m, k in ((0.5, 3, 2), (2.3, 4, 2), (5.0, 2, 3), (1.0, 5, 1))
)
STRING_CASES["hcms"] = tuple(
    {"epsilon": eps, "sketch_width": m, "sketch_depth": k}
    for eps, m, k in ((0.5, 4, 2), (2.3, 2, 3), (5.0, 8, 2), (1.0, 16, 1))
)
STRING_CASES["pem"] = tuple({"epsilon": eps, "max_length": 1} for eps in (0.5, 1.0, 1.8))
STRING_CASES["sfp"] = tuple(
    {"epsilon": eps, "max_length": length, "sketch_width": m, "sketch_depth": k}
    for eps, length, m, k in ((0.5, 1, 2, 1), (2.3, 2, 2, 2), (5.0, 3, 4, 1))
)
#: Multi-attribute protocols (spl, smp, rsfd): their whole report's law is enumerated from
#: their views' in tests/shared/test_multidim_privacy.py.
#: Every wire name a spec may carry: the registry plus ``auto``.
NAMES = (*sorted(set(MECHANISMS) - ATTRIBUTE_MECHANISMS), "auto")


def privacy_specs() -> Iterator[Any]:
    """One pytest param per (mechanism, epsilon, domain or range) setting."""
    for name in NAMES:
        if name in STRING_MECHANISMS:
            for fields in STRING_CASES[name]:
                spec = MechanismSpec.model_validate({"mechanism": name, **fields})
                label = "-".join(f"{key}{value}" for key, value in fields.items())
                yield pytest.param(spec, id=f"{name}-{label}")
            continue
        for epsilon in EPSILONS:
            if name in CATEGORICAL_MECHANISMS:
                for d in CATEGORICAL_DOMAINS:
                    for extra in CATEGORICAL_EXTRAS.get(name, ({},)):
                        fields = {"domain_size": d, **memo_fields(name, epsilon), **extra}
                        spec = MechanismSpec.model_validate(
                            {"mechanism": name, "epsilon": epsilon, **fields}
                        )
                        suffix = "".join(f"-{k}{v}" for k, v in extra.items())
                        yield pytest.param(spec, id=f"{name}-eps{epsilon}-d{d}{suffix}")
            else:
                for lower, upper in NUMERIC_RANGES:
                    for extra in NUMERIC_EXTRAS.get(name, ({},)):
                        spec = MechanismSpec.model_validate(
                            {
                                "mechanism": name,
                                "epsilon": epsilon,
                                "lower": lower,
                                "upper": upper,
                                **memo_fields(name, epsilon),
                                **extra,
                            }
                        )
                        suffix = "".join(f"-{k}{v}" for k, v in extra.items())
                        yield pytest.param(
                            spec, id=f"{name}-eps{epsilon}-[{lower},{upper}]{suffix}"
                        )


PRIVACY_SPECS = list(privacy_specs())


def build(**fields: Any) -> Any:
    """The mechanism a spec's fields describe (typed Any: tests reach subclass attributes)."""
    return make_mechanism(MechanismSpec.model_validate(fields))


def numeric_inputs(lower: float, upper: float) -> np.ndarray:
    """Both ends, a regular grid, off-grid values and values outside [lower, upper]."""
    width = upper - lower
    return np.concatenate(
        [
            [lower, upper],
            np.linspace(lower, upper, 17),
            lower + width * np.array([1e-9, 0.01, 0.3141592653589793, 0.5 + 1e-9, 0.999]),
            [lower - 1.0, lower - 1e6, upper + 0.5, upper + 1e6],
        ]
    )


def matrix_of(mech: Any) -> np.ndarray:
    """The exact transition matrix: over all categories (or all Bloom filters of strings),
    or over ``numeric_inputs``."""
    if mech.spec.kind in ("categorical", "string"):
        return np.asarray(mech.transition_matrix())
    return np.asarray(mech.transition_matrix(numeric_inputs(mech.lower, mech.upper)))


def max_likelihood_ratio(matrix: np.ndarray) -> float:
    """``max_y max_{x, x'} P[y | x] / P[y | x']`` over rows x and columns y (inf if unbounded)."""
    assert np.all(matrix >= 0), "transition probabilities must be non-negative"
    top = matrix.max(axis=0)
    bottom = matrix.min(axis=0)
    if np.any((bottom == 0) & (top > 0)):
        return math.inf
    live = top > 0
    return float((top[live] / bottom[live]).max())


def check(matrix: np.ndarray, d_out: float) -> bool:
    """Like OpenDP's ``Measurement.check(d_in, d_out)`` for one changed value: is the
    mechanism ``d_out``-LDP, i.e. is every likelihood ratio at most e^d_out?"""
    return max_likelihood_ratio(matrix) <= math.exp(d_out) * (1 + RATIO_RTOL)


def delivered_epsilon(mech: Any) -> float:
    """The epsilon a mechanism actually delivers (laplace rounds it down to 2^-20)."""
    return float(getattr(mech, "effective_epsilon", mech.epsilon))


def row_totals(mech: Any, matrix: np.ndarray) -> np.ndarray:
    """Total probability of each row, accounting for outputs the matrix leaves out."""
    name = mech.name
    finite = ("categorical", "string", "distribution")  # every output in the matrix
    if mech.spec.kind in finite or name in ("duchi", "piecewise", "onebitmean"):
        return matrix.sum(axis=1)
    if name == "laplace":
        # Columns are m = -1..K+1. Both mixture components are centred in 0..K, so below
        # -1 (above K+1) each P[m | x] shrinks by e^-g per step: the tail m <= -1 sums to
        # P[-1 | x] / (1 - e^-g), with g = effective_epsilon / K.
        g = delivered_epsilon(mech) / mech.grid_steps
        tails = (matrix[:, 0] + matrix[:, -1]) / -math.expm1(-g)
        return matrix[:, 1:-1].sum(axis=1) + tails
    raise AssertionError(f"no normalization rule for the numeric mechanism {name!r}: add one")


# ---------------------------------------------------------------------------------------
# Exact epsilon, by enumeration
# ---------------------------------------------------------------------------------------


def test_registry_is_covered() -> None:
    """Every registered mechanism gets privacy cases (guards the parametrization itself)."""
    covered = {param.values[0].mechanism for param in PRIVACY_SPECS} | ATTRIBUTE_MECHANISMS
    assert covered == set(MECHANISMS) | {"auto"}
    assert ATTRIBUTE_MECHANISMS == {"spl", "smp", "rsfd"}


@pytest.mark.parametrize("spec", PRIVACY_SPECS)
def test_rows_are_distributions(spec: MechanismSpec) -> None:
    mech: Any = make_mechanism(spec)
    matrix = matrix_of(mech)
    assert np.all(matrix >= 0)
    if spec.is_categorical:
        assert matrix.shape[0] == spec.domain_size
    if spec.mechanism in ("cms", "hcms"):  # every tuple of columns, by every report
        m, k = spec.sketch_width, spec.sketch_depth
        assert m is not None and k is not None
        assert matrix.shape == (m**k, k * (2**m if spec.mechanism == "cms" else 2 * m))
    elif spec.mechanism == "rappor":  # every Bloom filter with 1..h of k bits set, by every report
        k, h = spec.num_bits, spec.num_hashes
        assert k is not None and h is not None
        assert matrix.shape == (sum(math.comb(k, size) for size in range(1, h + 1)), 2**k)
    np.testing.assert_allclose(row_totals(mech, matrix), 1.0, rtol=1e-12, atol=0)


def report_epsilon(spec: MechanismSpec) -> float:
    """What one report promises: epsilon, or a memoized mechanism's epsilon_report."""
    return spec.report_epsilon


@pytest.mark.parametrize("spec", PRIVACY_SPECS)
def test_likelihood_ratio_is_exactly_epsilon(spec: MechanismSpec) -> None:
    mech: Any = make_mechanism(spec)
    ratio = max_likelihood_ratio(matrix_of(mech))
    epsilon = report_epsilon(spec)
    delivered = float(getattr(mech, "effective_epsilon", epsilon))
    assert delivered <= epsilon
    assert epsilon - delivered < 2**-20
    assert ratio <= math.exp(epsilon) * (1 + RATIO_RTOL)
    # Tight: the worst pair of inputs reaches the bound the mechanism delivers.
    assert ratio <= math.exp(delivered) * (1 + RATIO_RTOL)
    assert ratio >= math.exp(delivered) * (1 - RATIO_RTOL)
    if not hasattr(mech, "effective_epsilon"):
        assert ratio >= math.exp(epsilon) * (1 - RATIO_RTOL)


@pytest.mark.parametrize("spec", PRIVACY_SPECS)
def test_privacy_check_holds_at_epsilon_and_fails_just_below(spec: MechanismSpec) -> None:
    """check(d_in, epsilon) passes and check(d_in, epsilon - 1e-6) fails, as in OpenDP's tests."""
    matrix = matrix_of(make_mechanism(spec))
    assert check(matrix, report_epsilon(spec))
    assert not check(matrix, report_epsilon(spec) - BELOW)


@pytest.mark.parametrize("spec", [param for param in PRIVACY_SPECS if param.values[0].is_memoized])
def test_permanent_response_is_exactly_the_lifetime_epsilon(spec: MechanismSpec) -> None:
    """Any number of reports of one value are post-processing of the permanent response,
    whose exact law (``permanent_matrix``) is epsilon-LDP, and tightly so."""
    mech: Any = make_mechanism(spec)
    matrix = np.asarray(mech.permanent_matrix())
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12, atol=0)
    assert check(matrix, spec.epsilon)
    assert not check(matrix, spec.epsilon - BELOW)


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("grid_steps", (4, 8, 16, 1024))
def test_laplace_effective_epsilon(epsilon: float, grid_steps: int) -> None:
    """The sampler's rational epsilon is floor(eps 2^20) / 2^20: at most eps, within 2^-20."""
    mech = build(mechanism="laplace", epsilon=epsilon, lower=0.0, upper=1.0, grid_steps=grid_steps)
    expected = math.floor(epsilon * 2**20) / 2**20
    assert mech.effective_epsilon == expected
    assert 0 <= epsilon - expected < 2**-20
    if epsilon in (0.5, 1.0, 5.0):  # dyadic with few bits: delivered exactly
        assert expected == epsilon


def smallest_prime_at_least(n: int) -> int:
    """The least prime >= n (trial division; n is tiny here)."""
    candidate = max(n, 2)
    while any(candidate % k == 0 for k in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("d", CATEGORICAL_DOMAINS)
def test_olh_is_private_for_every_hash_function(epsilon: float, d: int) -> None:
    """Per hash (a, b) the bucket report is eps-LDP, tight whenever the hash separates inputs.

    Columns come in blocks of g buckets, one block per (a, b), a = 1..P-1 outer, b = 0..P-1
    inner; the block times (P - 1) P is P[y | v, a, b]. The bucket with probability p must be
    the documented hash ((a v + b) mod P) mod g.
    """
    mech = build(mechanism="olh", epsilon=epsilon, domain_size=d)
    prime = smallest_prime_at_least(d)
    g = round(math.exp(epsilon)) + 1
    hashes = (prime - 1) * prime
    matrix = mech.transition_matrix()
    assert matrix.shape == (d, hashes * g)
    blocks = matrix.reshape(d, hashes, g) * hashes  # P[y | v, (a, b)]
    np.testing.assert_allclose(blocks.sum(axis=2), 1.0, rtol=1e-12, atol=0)

    a, b = (
        axis.ravel() for axis in np.meshgrid(np.arange(1, prime), np.arange(prime), indexing="ij")
    )
    hashed = ((a[:, None] * np.arange(d)[None, :] + b[:, None]) % prime) % g  # (hashes, d)
    np.testing.assert_array_equal(blocks.argmax(axis=2), hashed.T)

    ratios = (blocks.max(axis=0) / blocks.min(axis=0)).max(axis=1)  # one per hash
    bound = math.exp(epsilon)
    assert np.all(ratios <= bound * (1 + RATIO_RTOL))
    separates = hashed.min(axis=1) != hashed.max(axis=1)
    assert separates.any()
    assert np.all(ratios[separates] >= bound * (1 - RATIO_RTOL))
    assert np.all(ratios[~separates] == 1.0)


# ---------------------------------------------------------------------------------------
# The sampler draws from the matrix
# ---------------------------------------------------------------------------------------


def assert_fits(observed: np.ndarray, probabilities: np.ndarray) -> None:
    """Pearson chi-square of observed counts against exact cell probabilities, at ALPHA.

    The rarest cells are pooled until the pooled cell expects at least 100 counts, and
    every other cell must too, so the chi-square approximation of the statistic's null
    distribution is accurate out to this alpha.
    """
    assert probabilities.sum() == pytest.approx(1.0, rel=1e-12)
    total = int(observed.sum())
    expected = total * probabilities
    order = np.argsort(expected)
    rare = int(np.count_nonzero(expected < MIN_EXPECTED))  # pool every small cell, and
    enough = int(np.searchsorted(np.cumsum(expected[order]), MIN_EXPECTED)) + 1  # enough mass
    pooled = order[: max(rare, enough)]
    if pooled.size > 1:
        keep = np.setdiff1d(np.arange(expected.size), pooled)
        observed = np.append(observed[keep], observed[pooled].sum())
        expected = np.append(expected[keep], expected[pooled].sum())
    assert expected.size >= 2
    assert expected.min() >= MIN_EXPECTED, "cells too small for the chi-square approximation"
    result = stats.chisquare(observed, expected * total / expected.sum())
    assert result.pvalue > ALPHA, f"chi-square p = {result.pvalue:.3g}"


def seeded(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    ("name", "epsilon", "d", "value"),
    [("grr", 1.0, 5, 3), ("grr", 2.3, 2, 0), ("hr", 1.0, 5, 2), ("hr", 2.3, 6, 5)],
)
def test_index_reports_match_matrix(name: str, epsilon: float, d: int, value: int) -> None:
    mech = build(mechanism=name, epsilon=epsilon, domain_size=d)
    matrix = mech.transition_matrix()
    reports = mech.encode(np.full(SAMPLES, value), rng=seeded(11 + value))
    observed = np.bincount(reports, minlength=matrix.shape[1])
    assert observed.size == matrix.shape[1]
    assert_fits(observed, matrix[value])


@pytest.mark.parametrize(("epsilon", "d", "value"), [(1.0, 3, 1), (2.3, 6, 4)])
def test_olh_reports_match_matrix(epsilon: float, d: int, value: int) -> None:
    """The joint (a, b, y) against the matrix row, and P[y = H_{a,b}(v)] = p."""
    mech = build(mechanism="olh", epsilon=epsilon, domain_size=d)
    prime = smallest_prime_at_least(d)
    g = round(math.exp(epsilon)) + 1
    matrix = mech.transition_matrix()
    reports = mech.encode(np.full(SAMPLES, value), rng=seeded(23))
    a, b, y = reports.T
    column = ((a - 1) * prime + b) * g + y
    assert_fits(np.bincount(column, minlength=matrix.shape[1]), matrix[value])

    hits = int(np.count_nonzero(y == ((a * value + b) % prime) % g))
    p = math.exp(epsilon) / (math.exp(epsilon) + g - 1)
    assert stats.binomtest(hits, SAMPLES, p).pvalue > ALPHA


@pytest.mark.parametrize("name", ["sue", "oue"])
@pytest.mark.parametrize(("epsilon", "value"), [(1.0, 2), (5.0, 0)])
def test_unary_joint_output_matches_matrix(name: str, epsilon: float, value: int) -> None:
    """With d = 4 all 16 bit vectors enumerate: this also tests the bits' independence."""
    d = 4
    mech = build(mechanism=name, epsilon=epsilon, domain_size=d)
    matrix = mech.transition_matrix()
    reports = mech.encode(np.full(SAMPLES, value), rng=seeded(31))
    bits = np.unpackbits(reports, axis=1, count=d).astype(np.int64)
    index = bits @ (1 << np.arange(d))  # column o of the matrix has bit j = category j
    assert_fits(np.bincount(index, minlength=2**d), matrix[value])


@pytest.mark.parametrize("name", ["sue", "oue"])
@pytest.mark.parametrize("epsilon", [0.5, 2.3])
def test_unary_bit_frequencies(name: str, epsilon: float) -> None:
    """Bit v is 1 with probability p, every other bit with q (d = 37: five bytes, padding)."""
    d, value = 37, 20
    mech = build(mechanism=name, epsilon=epsilon, domain_size=d)
    if name == "sue":
        p = math.exp(epsilon / 2) / (math.exp(epsilon / 2) + 1)
        q = 1 / (math.exp(epsilon / 2) + 1)
    else:
        p, q = 0.5, 1 / (math.exp(epsilon) + 1)
    reports = mech.encode(np.full(SAMPLES, value), rng=seeded(37))
    assert reports.shape == (SAMPLES, 5)
    assert not np.any(reports[:, -1] & np.uint8(0b111)), "padding bits must stay 0"
    ones = np.unpackbits(reports, axis=1, count=d).sum(axis=0, dtype=np.int64)
    # 37 binomial tests at 1e-6 each: false-failure rate at most 3.7e-5 for the test.
    for bit in range(d):  # one assertion per bit of a 37-bit vector
        expected = p if bit == value else q
        assert stats.binomtest(int(ones[bit]), SAMPLES, expected).pvalue > ALPHA, bit


@pytest.mark.parametrize("fraction", [0.0, 0.3141592653589793, 1.0, 1.7])
def test_duchi_signs_match_matrix(fraction: float) -> None:
    lower, upper = -3.7, 11.2
    mech = build(mechanism="duchi", epsilon=1.0, lower=lower, upper=upper)
    value = lower + fraction * (upper - lower)  # 1.7: outside the range, clipped to upper
    row = mech.transition_matrix(np.array([value]))[0]
    signs = mech.encode(np.full(SAMPLES, value), rng=seeded(41))
    observed = np.array([np.count_nonzero(signs == -1), np.count_nonzero(signs == 1)])
    assert observed.sum() == SAMPLES
    assert_fits(observed, row)


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_laplace_indices_match_matrix(fraction: float) -> None:
    """Grid indices -1..K+1 against the matrix, the two geometric tails pooled in end cells."""
    mech = build(mechanism="laplace", epsilon=2.0, lower=0.0, upper=1.0, grid_steps=4)
    value = fraction + 0.0123 * (0 < fraction < 1)  # off the grid inside the range
    row = mech.transition_matrix(np.array([value]))[0]
    g = 2.0 / 4
    probabilities = row.copy()
    probabilities[[0, -1]] /= -math.expm1(-g)  # P[m <= -1] and P[m >= K + 1]
    indices = mech.encode(np.full(SAMPLES, value), rng=seeded(43))
    observed = np.bincount(np.clip(indices, -1, 5) + 1, minlength=7)
    assert_fits(observed, probabilities)


@pytest.mark.parametrize("fraction", [0.0, 0.62, 1.0])
def test_piecewise_cells_match_matrix(fraction: float) -> None:
    """Cell indices 0..M-1 against the matrix row (off-grid input: both rounded indices)."""
    mech = build(mechanism="piecewise", epsilon=2.3, lower=-1.0, upper=3.0, grid_steps=16)
    value = -1.0 + fraction * 4.0
    row = mech.transition_matrix(np.array([value]))[0]
    cells = mech.encode(np.full(SAMPLES, value), rng=seeded(47))
    assert_fits(np.bincount(cells, minlength=mech.cells), row)
