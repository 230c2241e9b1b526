"""Refusal rules of the bit-vector mechanisms (``shared.integrity``): exact, minimal, enforced.

Each ones-count rule is recomputed here from the mechanism's realized 53-bit thresholds and
the law its module docstring states (the count of ones of an honest report, at its
stochastically largest and smallest over every input and device state), in exact rational
arithmetic at small sizes: the bounds must be the exact ones (U the least count whose upper
tail is at most 2^-41, L the largest whose lower tail is), and ``false_refusal`` the exact
sum of the two tails to 1e-9 relative. At d = 1024 scipy's binomial law stands in for
the exact one (1e-6 relative). Then the rules are enforced: forged reports are refused
with the rule's index, honest encodes never are (each honest report is refused with
probability below 2^-40, so 10^4 of them with probability below 10^-8). Mechanisms that
state "none" are checked for the reason they give: every output is likely (above 2^-40)
under some input. No test here is statistical beyond that.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Any, Literal

import numpy as np
import pytest
from scipy import stats

from shared.integrity import FALSE_REFUSAL_BOUND, ReportRefusedError
from shared.mechanisms import DeviceContext, make_mechanism
from shared.memo import SimulatedMemo
from shared.randomness import BITS53
from shared.schemas import MechanismSpec

#: Each side of a rule may refuse an honest report with probability at most this.
SIDE = Fraction(1, 2**41)
#: An exact law: ((trials, threshold T), ...), a sum of Binomial(trials, T / 2^53).
ThresholdLaw = tuple[tuple[int, int], ...]


def build(**spec: Any) -> Any:
    return make_mechanism(MechanismSpec(**spec))


def exact_law(law: ThresholdLaw) -> list[Fraction]:
    """P(X = x) exactly for a sum of independent Binomial(n, T / 2^53)."""
    pmf = [Fraction(1)]
    for trials, threshold in law:
        scale = BITS53**trials
        term = [
            Fraction(comb(trials, k) * threshold**k * (BITS53 - threshold) ** (trials - k), scale)
            for k in range(trials + 1)
        ]
        out = [Fraction(0)] * (len(pmf) + trials)
        for i, a in enumerate(pmf):
            for j, b in enumerate(term):
                out[i + j] += a * b
        pmf = out
    return pmf


def exact_bounds(
    largest: list[Fraction], smallest: list[Fraction], side: Fraction = SIDE
) -> tuple[int, int, Fraction, Fraction]:
    """(L, U, P(X < L), P(X > U)): U least with the largest law's P(X > U) <= ``side``
    (2^-41), L largest with the smallest law's P(X < L) <= ``side``."""
    bits = len(largest) - 1
    high, tail = bits, Fraction(0)
    while high > 0 and tail + largest[high] <= side:
        tail += largest[high]
        high -= 1
    low, head = 0, Fraction(0)
    while low < bits and head + smallest[low] <= side:
        head += smallest[low]
        low += 1
    return low, high, head, tail


def laws_from_thresholds(mech: Any) -> tuple[ThresholdLaw, ThresholdLaw]:
    """The docstrings' extreme honest laws, from the realized thresholds."""
    name = mech.spec.mechanism
    if name in ("oue", "sue"):
        p, q = mech.thresholds
        d = mech.spec.domain_size
        law: ThresholdLaw = ((1, p), (d - 1, q))
        return law, law
    if name in ("cms", "sfp"):
        flip = (mech if name == "cms" else mech.sketch).flip_threshold
        m = mech.spec.sketch_width
        law = ((1, BITS53 - flip), (m - 1, flip))
        return law, law
    if name in ("lsue", "loue", "losue"):
        p2, q2 = mech.instantaneous_thresholds
        d = mech.spec.domain_size
        return ((d, p2),), ((d, q2),)
    if name == "rappor":
        flip, p, q = mech.thresholds
        k, h = mech.num_bits, mech.num_hashes
        if flip > 0:
            return ((k, q),), ((k, p),)
        most = min(h, k)
        return ((most, q), (k - most, p)), ((1, q), (k - 1, p))
    if name == "dbitflip":
        p, q = mech.thresholds
        s, d = mech.bits_per_device, mech.spec.domain_size
        sampled: ThresholdLaw = ((1, p), (s - 1, q))
        return sampled, (((s, q),) if s < d else sampled)
    raise AssertionError(name)


SMALL_SPECS = [
    dict(mechanism="oue", epsilon=1.0, domain_size=40),
    dict(mechanism="oue", epsilon=1.0, domain_size=80),
    dict(mechanism="oue", epsilon=4.0, domain_size=16),
    dict(mechanism="sue", epsilon=1.0, domain_size=80),
    dict(mechanism="sue", epsilon=4.0, domain_size=16),
    dict(mechanism="lsue", epsilon=2.0, epsilon_report=1.0, domain_size=200),
    dict(mechanism="loue", epsilon=2.0, epsilon_report=1.0, domain_size=200),
    dict(mechanism="losue", epsilon=2.0, epsilon_report=1.0, domain_size=200),
    dict(mechanism="cms", epsilon=2.0, sketch_width=64, sketch_depth=2),
    dict(mechanism="sfp", epsilon=2.0, sketch_width=64, sketch_depth=2, max_length=4),
    dict(mechanism="rappor", num_bits=64, num_hashes=2, num_cohorts=2, f=0.5, p=0.5, q=0.75),
    dict(mechanism="rappor", num_bits=64, num_hashes=4, num_cohorts=2, f=0.0, p=0.25, q=0.75),
    dict(mechanism="dbitflip", epsilon=1.0, domain_size=80, bits_per_device=64),
    dict(mechanism="dbitflip", epsilon=2.0, domain_size=64, bits_per_device=64),
]


@pytest.mark.parametrize("spec", SMALL_SPECS, ids=lambda s: f"{s['mechanism']}")
def test_rule_is_the_exact_minimal_one(spec: dict[str, Any]) -> None:
    mech = build(**spec)
    largest, smallest = (exact_law(law) for law in laws_from_thresholds(mech))
    assert sum(largest) == 1 and sum(smallest) == 1
    low, high, head, tail = exact_bounds(largest, smallest)
    bounds = mech.ones_count_bounds
    assert (bounds.low, bounds.high) == (low, high)
    assert low > 0 or high < len(largest) - 1, "every case here has a rule"
    # minimality: one count further in on either side would break 2^-41
    if high < len(largest) - 1:
        assert tail + largest[high] > SIDE
    if low > 0:
        assert head + smallest[low] > SIDE
    (rule,) = mech.refusal_rules()
    assert rule.name == f"{spec['mechanism']}.ones_count"
    exact = head + tail
    assert rule.false_refusal == pytest.approx(float(exact), rel=1e-9)
    assert exact <= Fraction(FALSE_REFUSAL_BOUND) and rule.false_refusal <= FALSE_REFUSAL_BOUND
    assert f"of the {len(largest) - 1} bits set" in rule.description


@pytest.mark.parametrize(
    "spec",
    [
        dict(mechanism="oue", epsilon=1.0, domain_size=8),
        dict(mechanism="sue", epsilon=1.0, domain_size=24),
        dict(mechanism="losue", epsilon=2.0, epsilon_report=1.0, domain_size=64),
        dict(mechanism="rappor", num_bits=32, num_hashes=2, num_cohorts=2, f=0.5, p=0.5, q=0.75),
        dict(mechanism="dbitflip", epsilon=1.0, domain_size=64, bits_per_device=8),
    ],
    ids=lambda s: f"{s['mechanism']}",
)
def test_no_rule_when_every_count_is_likely(spec: dict[str, Any]) -> None:
    """Where even the extreme counts are above 2^-41, there is no rule (and no refusal)."""
    mech = build(**spec)
    largest, smallest = (exact_law(law) for law in laws_from_thresholds(mech))
    low, high, _, _ = exact_bounds(largest, smallest)
    bits = len(largest) - 1
    assert (low, high) == (0, bits)
    assert smallest[0] > SIDE and largest[bits] > SIDE
    assert mech.refusal_rules() == ()


LARGE_SPECS = [
    dict(mechanism="oue", epsilon=1.0, domain_size=1024),
    dict(mechanism="sue", epsilon=1.0, domain_size=1024),
    dict(mechanism="lsue", epsilon=2.0, epsilon_report=1.0, domain_size=1024),
    dict(mechanism="loue", epsilon=2.0, epsilon_report=1.0, domain_size=1024),
    dict(mechanism="losue", epsilon=2.0, epsilon_report=1.0, domain_size=1024),
    dict(mechanism="cms", epsilon=2.0, sketch_width=1024, sketch_depth=4),
    dict(mechanism="rappor", num_bits=1024, num_hashes=2, num_cohorts=4, f=0.5, p=0.5, q=0.75),
    dict(mechanism="dbitflip", epsilon=1.0, domain_size=2048, bits_per_device=1024),
]


@pytest.mark.parametrize("spec", LARGE_SPECS, ids=lambda s: f"{s['mechanism']}")
def test_rule_matches_scipy_at_d_1024(spec: dict[str, Any]) -> None:
    mech = build(**spec)

    def scipy_law(law: ThresholdLaw) -> np.ndarray:
        pmf = np.ones(1)
        for trials, threshold in law:
            term = stats.binom.pmf(np.arange(trials + 1), trials, threshold / BITS53)
            pmf = np.convolve(pmf, term)
        return pmf

    largest, smallest = (scipy_law(law) for law in laws_from_thresholds(mech))
    bounds = mech.ones_count_bounds
    upper = largest[bounds.high + 1 :].sum()
    lower = smallest[: bounds.low].sum()
    assert upper <= 2.0**-41 < upper + largest[bounds.high]
    assert lower <= 2.0**-41 < lower + smallest[bounds.low]
    (rule,) = mech.refusal_rules()
    assert rule.false_refusal == pytest.approx(upper + lower, rel=1e-6)


# --- enforcement ------------------------------------------------------------------------


def honest_reports(mech: Any, n: int, seed: int) -> np.ndarray:
    """n honest reports of varied inputs."""
    rng = np.random.default_rng(seed)
    name = mech.spec.mechanism
    if name == "rappor":
        values = [f"v{i}" for i in rng.integers(0, 50, n)]
        secrets = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        return mech.encode(values, rng, DeviceContext(secrets=secrets))
    if name in ("cms", "sfp"):
        return mech.encode([f"s{i}" for i in rng.integers(0, 50, n)], rng)
    if name in ("lsue", "loue", "losue"):  # memoized: n devices, each its own permanent bits
        memo = SimulatedMemo(np.arange(n), seed=seed)
        categories = rng.integers(0, mech.spec.domain_size, n)
        return mech.encode(categories, rng, DeviceContext(memo=memo))
    return mech.encode(rng.integers(0, mech.spec.domain_size, n), rng)


def forged(mech: Any, honest: np.ndarray, fill: int) -> np.ndarray:
    """A copy of the honest reports whose bits are all ``fill`` (0 or 1)."""
    reports = honest.copy()
    rows = reports if reports.dtype.names is None else reports["bits"]
    bits = mech.ones_count_bounds.bits
    if rows.dtype == np.bool_:
        rows[:] = bool(fill)
        return reports
    order: Literal["little", "big"] = "little" if mech.spec.mechanism == "rappor" else "big"
    rows[:] = np.packbits(np.full(bits, fill, dtype=bool), bitorder=order)
    return reports


@pytest.mark.parametrize("spec", LARGE_SPECS, ids=lambda s: f"{s['mechanism']}")
def test_honest_reports_pass_and_forged_ones_are_refused(spec: dict[str, Any]) -> None:
    mech = build(**spec)
    n = 10_000 if spec["mechanism"] == "oue" else 1_000
    honest = mech.check_reports(honest_reports(mech, n, seed=29))
    assert (mech.refusals(honest) == -1).all()  # P(any refused) < n 2^-40 < 1e-8
    assert mech.first_refusal(honest) is None
    bounds = mech.ones_count_bounds
    for fill, refused in ((1, bounds.high < bounds.bits), (0, bounds.low > 0)):
        codes = mech.refusals(forged(mech, honest[:5], fill))
        assert (codes == (0 if refused else -1)).all(), fill


def test_oue_refusal_names_the_rule_and_the_count() -> None:
    mech = build(mechanism="oue", epsilon=1.0, domain_size=1024)
    honest = honest_reports(mech, 100, seed=3)
    reports = honest.copy()
    reports[37] = np.packbits(np.ones(1024, dtype=bool))
    reports[60] = 0
    codes = mech.refusals(reports)
    assert codes.dtype == np.int8
    assert np.flatnonzero(codes >= 0).tolist() == [37, 60]
    assert mech.refusal_detail(reports[37]) == "1024 of the 1024 bits set"
    assert mech.refusal_detail(reports[60]) == "0 of the 1024 bits set"
    error = mech.first_refusal(reports)
    assert isinstance(error, ReportRefusedError)
    assert error.report == 37 and error.rule.name == "oue.ones_count"
    assert "'oue.ones_count'" in str(error) and "1024 of the 1024 bits set" in str(error)
    assert "more than 380 or fewer than 179 of the 1024 bits set" in str(error)


def test_rappor_and_dbitflip_details_count_their_bits() -> None:
    rappor = build(
        mechanism="rappor", num_bits=256, num_hashes=2, num_cohorts=4, f=0.5, p=0.5, q=0.75
    )
    reports = forged(rappor, honest_reports(rappor, 3, seed=5), 1)
    assert rappor.refusal_detail(reports[1]) == "256 of the 256 bits set"
    dbitflip = build(mechanism="dbitflip", epsilon=1.0, domain_size=80, bits_per_device=64)
    reports = forged(dbitflip, honest_reports(dbitflip, 3, seed=5), 1)
    assert dbitflip.refusal_detail(reports[0]) == "64 of the 64 bits set"
    assert (dbitflip.refusals(reports) == 0).all()


def test_lhh_refuses_at_unary_levels_with_the_levels_rule() -> None:
    mech = build(
        mechanism="lhh",
        epsilon=4.0,
        epsilon_report=2.0,
        lower=0.0,
        upper=1.0,
        buckets=4096,
        branching=8,
    )
    names = [rule.name for rule in mech.refusal_rules()]
    assert names == ["lhh.level3.ones_count", "lhh.level4.ones_count"]
    for level, rule in zip((3, 4), mech.refusal_rules(), strict=True):
        (inner,) = mech.oracle(level).refusal_rules()
        assert inner.name == "losue.ones_count"
        assert rule.description == f"at level {level}: {inner.description}"
        assert rule.false_refusal == inner.false_refusal
    rng = np.random.default_rng(8)
    reports = mech.check_reports(mech.encode(rng.random(2000), rng))
    assert (mech.refusals(reports) == -1).all()
    levels = reports["level"]
    at3, at4, at1 = (int(np.flatnonzero(levels == level)[0]) for level in (3, 4, 1))
    reports["bits"][at3, :64] = 255
    reports["bits"][at4] = 255
    codes = mech.refusals(reports)
    assert (codes[at3], codes[at4], codes[at1]) == (0, 1, -1)
    assert mech.refusal_detail(reports[at4]) == "level 4: 4096 of the 4096 bits set"
    error = mech.first_refusal(reports)
    assert error is not None and error.rule.name in names


def multidim(protocol: str, epsilon: float) -> Any:
    """Two OUE views (64 and 80 cells) and a numeric one."""
    return make_mechanism(
        MechanismSpec.model_validate(
            {
                "mechanism": protocol,
                "epsilon": epsilon,
                "oracle": "oue",
                "attributes": [
                    {"name": "a", "domain_size": 64},
                    {"name": "b", "domain_size": 80},
                    {"name": "c", "lower": 0, "upper": 1},
                ],
                "pairs": None,
            }
        )
    )


@pytest.mark.parametrize(
    ("protocol", "epsilon"), [("spl", 1.0), ("smp", 1.0), ("rsfd", 1.0), ("rsfd", 0.3)]
)
def test_multidim_view_rules_are_exact_and_share_the_bound(protocol: str, epsilon: float) -> None:
    """Each OUE view's rule is the unary one on its bits (``rsfd``: the fake view's
    Binomial(D, q) as the smallest law); where a report carries both views, each side gets
    2^-41 / 2 so that their union stays within 2^-40."""
    mech = multidim(protocol, epsilon)
    share = 1 if protocol == "smp" else 2
    rules = mech.refusal_rules()
    assert [rule.name for rule in rules] == [
        f"{protocol}.view0.ones_count",
        f"{protocol}.view1.ones_count",
    ]
    for (v, bounds, rule), cells in zip(mech._view_rules, (64, 80), strict=True):
        p, q = mech.views[v].inner.thresholds
        true = exact_law(((1, p), (cells - 1, q)))
        smallest = exact_law(((cells, q),)) if protocol == "rsfd" else true
        low, high, head, tail = exact_bounds(true, smallest, SIDE / share)
        assert (bounds.low, bounds.high) == (low, high)
        assert rule.false_refusal == pytest.approx(float(head + tail), rel=1e-9)
    assert sum(rule.false_refusal for rule in rules) <= FALSE_REFUSAL_BOUND * (
        2 if protocol == "smp" else 1
    )


@pytest.mark.parametrize("protocol", ["spl", "smp", "rsfd"])
def test_multidim_refuses_a_forged_view_and_names_it(protocol: str) -> None:
    mech = multidim(protocol, 1.0)
    rng = np.random.default_rng(12)
    rows = np.column_stack([rng.integers(0, 64, 3000), rng.integers(0, 80, 3000), rng.random(3000)])
    reports = mech.check_reports(mech.encode(rows, rng))
    assert (mech.refusals(reports) == -1).all()
    # view 1's bits all set: bytes 8..17 (spl, rsfd) or 1..10 of a view-1 report (smp)
    row = int(np.flatnonzero(reports[:, 0] == 1)[0]) if protocol == "smp" else 5
    start = 1 if protocol == "smp" else 8
    reports[row, start : start + 10] = 255
    codes = mech.refusals(reports)
    assert np.flatnonzero(codes >= 0).tolist() == [row] and codes[row] == 1
    assert mech.refusal_detail(reports[row]) == "view (1): 80 of the 80 bits set"
    error = mech.first_refusal(reports)
    assert error is not None and error.rule.name == f"{protocol}.view1.ones_count"


# --- mechanisms without rules -----------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        dict(mechanism="grr", epsilon=1.0, domain_size=5),
        dict(mechanism="grr", epsilon=20.0, domain_size=64),
        dict(mechanism="hr", epsilon=1.0, domain_size=2),
        dict(mechanism="hr", epsilon=20.0, domain_size=2),
        dict(mechanism="hr", epsilon=20.0, domain_size=3),
        dict(mechanism="hr", epsilon=20.0, domain_size=100),
        dict(mechanism="lgrr", epsilon=20.0, epsilon_report=10.0, domain_size=16),
        dict(mechanism="duchi", epsilon=20.0, lower=0.0, upper=1.0),
        dict(mechanism="piecewise", epsilon=20.0, lower=0.0, upper=1.0, grid_steps=64),
        dict(mechanism="sw", epsilon=20.0, lower=0.0, upper=1.0, buckets=64),
        dict(mechanism="oue", epsilon=1.0, domain_size=8),
    ],
    ids=lambda s: f"{s['mechanism']}-{s['epsilon']}",
)
def test_every_output_is_likely_under_some_input(spec: dict[str, Any]) -> None:
    """The stated reason for "none": each output's largest probability over the inputs is
    above 2^-40, so every nonempty set of outputs is, for that input."""
    mech = build(**spec)
    if mech.kind == "numeric":  # rows: inputs across the range (grid points and between)
        matrix = mech.transition_matrix(np.linspace(0.0, 1.0, 257))
    else:
        matrix = mech.transition_matrix()
    assert matrix.max(axis=0).min() > FALSE_REFUSAL_BOUND
    assert mech.refusal_rules() == ()


def test_hcms_refuses_sign_minus_at_coefficient_zero_only_when_that_rare() -> None:
    """Every string sends (J, 0, -1) with probability exactly q / (k m): the only output
    unlikely under every input; the rule exists exactly when that is at most 2^-40."""
    small = build(mechanism="hcms", epsilon=20.0, sketch_width=4, sketch_depth=2)
    matrix = small.transition_matrix()
    zero_minus = np.array([j * 8 + 0 for j in range(2)])  # column j 2m + 2 l + bit
    others = np.setdiff1d(np.arange(matrix.shape[1]), zero_minus)
    np.testing.assert_allclose(matrix[:, zero_minus], small.q / 8, rtol=1e-12)
    assert matrix[:, others].max(axis=0).min() >= small.p / 8 > FALSE_REFUSAL_BOUND
    for epsilon, width, depth, exists in [
        (2.0, 64, 2, False),
        (12.4, 4096, 1024, False),
        (12.6, 4096, 1024, True),
        (20.0, 1024, 16, True),
    ]:
        mech = build(mechanism="hcms", epsilon=epsilon, sketch_width=width, sketch_depth=depth)
        chance = Fraction(BITS53 - mech.keep_threshold, 2 * BITS53 * width * depth)
        assert (chance <= Fraction(FALSE_REFUSAL_BOUND)) == exists
        rules = mech.refusal_rules()
        assert [rule.name for rule in rules] == (["hcms.zero_coefficient"] if exists else [])
        if exists:
            assert rules[0].false_refusal == float(chance)
    mech = build(mechanism="hcms", epsilon=20.0, sketch_width=1024, sketch_depth=16)
    rng = np.random.default_rng(6)
    reports = mech.encode(["a", "b"] * 5000, rng)
    assert (mech.refusals(reports) == -1).all()
    reports[17] = (3, 0, 0)
    reports[18] = (3, 5, 0)
    assert np.flatnonzero(mech.refusals(reports) >= 0).tolist() == [17]
    assert mech.refusal_detail(reports[17]) == "row 3, coefficient 0, sign -1"


@pytest.mark.parametrize(
    "spec",
    [
        dict(mechanism="olh", epsilon=4.0, domain_size=64),
        dict(mechanism="hcms", epsilon=2.0, sketch_width=64, sketch_depth=2),
        dict(mechanism="onebitmean", epsilon=1.0, lower=0.0, upper=1.0),
        dict(mechanism="auto", epsilon=4.0, domain_size=8),
    ],
    ids=lambda s: s["mechanism"],
)
def test_mechanisms_without_rules_refuse_nothing(spec: dict[str, Any]) -> None:
    mech = build(**spec)
    assert mech.refusal_rules() == ()
    values: Any = {"categorical": np.zeros(10, dtype=np.int64), "string": ["a"] * 10}.get(
        mech.kind, np.full(10, 0.5)
    )
    reports = mech.encode(values, np.random.default_rng(1))
    assert (mech.refusals(reports) == -1).all()


@pytest.mark.parametrize(
    ("epsilon", "d", "resolved"), [(0.5, 1024, "oue"), (1.0, 1024, "olh"), (4.0, 8, "grr")]
)
def test_auto_takes_the_rules_of_the_mechanism_it_resolves_to(
    epsilon: float, d: int, resolved: str
) -> None:
    mech = build(mechanism="auto", epsilon=epsilon, domain_size=d)
    concrete = build(mechanism=resolved, epsilon=epsilon, domain_size=d)
    assert mech.spec.mechanism == resolved
    assert mech.refusal_rules() == concrete.refusal_rules()
