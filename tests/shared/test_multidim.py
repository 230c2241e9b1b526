"""Multi-attribute protocols ``spl``, ``smp``, ``rsfd``: spec, rows, wire form, the fast
path's law, unbiasedness and stated variances, consistency and post-processing.

Statistical assertions use ``tests.distribution_checks`` (false-failure rate ALPHA per
assertion, Bonferroni over the quantities checked)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from pydantic import ValidationError

from shared.attributes import CategoricalAttribute, NumericAttribute
from shared.marginals import (
    INDEPENDENT,
    PairView,
    ViewCovariance,
    ViewDependence,
    make_consistent,
    normalize,
)
from shared.mechanisms import MechanismSpec, as_attributes, make_mechanism
from shared.mechanisms.multidim import MultiAttributeMechanism, resolve_protocol
from shared.statistics import CountStatistics
from tests.distribution_checks import (
    ALPHA,
    assert_same_law,
    normal_bound,
    variance_ratio_bounds,
)

ATTRIBUTES: list[dict[str, Any]] = [
    {"name": "theme", "domain_size": 3, "labels": ["light", "dark", "auto"]},
    {"name": "font", "domain_size": 4},
    {"name": "size", "domain_size": 3},
    {"name": "minutes", "lower": 0, "upper": 10},
    {"name": "lang", "domain_size": 3},
]
PAIRS = [["theme", "font"], ["font", "size"]]
PROTOCOLS = ("spl", "smp", "rsfd")


def spec_json(protocol: str = "smp", **changes: Any) -> dict[str, Any]:
    return {
        "mechanism": protocol,
        "epsilon": 3.0,
        "attributes": ATTRIBUTES,
        "pairs": PAIRS,
    } | changes


def build(protocol: str = "smp", **changes: Any) -> MultiAttributeMechanism:
    spec = MechanismSpec.model_validate(spec_json(protocol, **changes))
    return cast(MultiAttributeMechanism, make_mechanism(spec))


def population(n: int, seed: int = 5) -> np.ndarray:
    """Correlated rows: font depends on theme."""
    rng = np.random.default_rng(seed)
    theme = rng.integers(0, 3, n)
    font = (theme + rng.integers(0, 2, n)) % 4
    size = rng.integers(0, 3, n)
    minutes = rng.uniform(0, 10, n)
    lang = rng.choice(3, n, p=[0.6, 0.3, 0.1])
    return np.column_stack([theme, font, size, minutes, lang]).astype(np.float64)


# --- spec -------------------------------------------------------------------------------


def test_spec_fills_in_the_oracle_and_round_trips() -> None:
    spec = MechanismSpec.model_validate(spec_json())
    wire = spec.model_dump(mode="json")
    assert wire["oracle"] == "auto"
    assert wire["attributes"][3] == {"name": "minutes", "lower": 0.0, "upper": 10.0}
    assert wire["pairs"] == PAIRS
    assert MechanismSpec.model_validate(wire) == spec
    assert spec.kind == "attributes"
    assert [view.columns for view in spec.views] == [(0, 1), (1, 2), (3,), (4,)]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attributes": ATTRIBUTES[:1]}, "at least 2"),
        ({"attributes": [*ATTRIBUTES, ATTRIBUTES[0]]}, "repeated: ['theme']"),
        ({"pairs": [["theme", "nope"]]}, "pairs[0]: no attribute 'nope'"),
        ({"pairs": [["theme", "minutes"]]}, "pairs[0]: 'minutes' is numeric"),
        ({"pairs": [["theme", "font"], ["font", "theme"]]}, "pairs[1]: ('font', 'theme')"),
        ({"pairs": [["theme", "theme"]]}, "two distinct"),
        ({"oracle": "olh"}, "oracle"),
        ({"mechanism": "spl", "epsilon": 0.002}, "below the least"),
        (
            {
                "attributes": [{"name": "a", "domain_size": 4096}, {"name": "b", "domain_size": 2}],
                "pairs": [["a", "b"]],
            },
            "8192 cells, at most 4096",
        ),
        ({"attributes": [{"name": "Bad", "domain_size": 2}, ATTRIBUTES[1]], "pairs": None}, "name"),
        (
            {
                "attributes": [{"name": "a", "domain_size": 2, "labels": ["x"]}, ATTRIBUTES[1]],
                "pairs": None,
            },
            "exactly domain_size = 2",
        ),
        (
            {"attributes": [{"name": "a", "lower": 1, "upper": 1}, ATTRIBUTES[1]], "pairs": None},
            "lower < upper",
        ),
        (
            {"attributes": [{"name": "a", "domain_size": True}, ATTRIBUTES[1]], "pairs": None},
            "domain_size must be a number",
        ),
        ({"attributes": [{"name": "a"}, ATTRIBUTES[1]], "pairs": None}, "either domain_size"),
    ],
)
def test_spec_refusals_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=None) as error:
        MechanismSpec.model_validate(spec_json(**changes))
    assert message in str(error.value)


def test_resolve_protocol_names_the_least_variance_protocol() -> None:
    auto = spec_json("auto")
    resolved = resolve_protocol(auto)
    costs = {p: build(p).variance(1) for p in PROTOCOLS}
    assert resolved == auto | {"mechanism": min(costs, key=lambda p: costs[p])}
    assert resolve_protocol(spec_json("spl")) == spec_json("spl")


# --- rows, reports, payloads --------------------------------------------------------------


def test_rows_take_labels_indices_and_numbers() -> None:
    mech = as_attributes(build())
    assert mech is not None
    rows = mech.rows([{"theme": "dark", "font": 3, "size": 0, "minutes": 2.5, "lang": 2}])
    assert rows.tolist() == [[1.0, 3.0, 0.0, 2.5, 2.0]]
    assert mech.attribute_names == ("theme", "font", "size", "minutes", "lang")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"theme": "blue", "font": 0, "size": 0, "minutes": 1, "lang": 0},
            "attribute 'theme': unknown label",
        ),
        (
            {"theme": 0, "font": 4, "size": 0, "minutes": 1, "lang": 0},
            "attribute 'font': needs a label",
        ),
        ({"theme": 0, "font": 0, "minutes": 1, "lang": 0}, "attribute 'size': missing"),
        (
            {"theme": 0, "font": 0, "size": 0, "minutes": "x", "lang": 0},
            "'minutes': needs a finite number",
        ),
        ({"theme": 0, "font": True, "size": 0, "minutes": 1, "lang": 0}, "'font': a boolean"),
        (
            {"theme": 0, "font": 0, "size": 0, "minutes": 1, "lang": 0, "more": 1},
            "unknown attribute 'more'",
        ),
    ],
)
def test_rows_refusals_name_the_record_and_attribute(record: dict[str, Any], message: str) -> None:
    mech = build()
    good = {"theme": 0, "font": 0, "size": 0, "minutes": 1, "lang": 0}
    with pytest.raises(ValueError, match="record 1") as error:
        mech.rows([good, record])
    assert message in str(error.value)


def test_encode_refuses_bad_rows() -> None:
    mech = build()
    with pytest.raises(ValueError, match="row 1, attribute 'font'"):
        mech.encode(np.array([[0, 0, 0, 1.0, 0], [0, 4, 0, 1.0, 0]]))
    with pytest.raises(ValueError, match="shape"):
        mech.encode(np.zeros((2, 4)))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("oracle", ["grr", "oue"])
def test_payloads_round_trip(protocol: str, oracle: str) -> None:
    mech = build(protocol, oracle=oracle)
    reports = mech.encode(population(50), np.random.default_rng(1))
    payloads = mech.to_payloads(reports)
    assert set(payloads[0]) == mech.payload_fields
    assert np.array_equal(mech.from_payloads(payloads), reports)
    assert mech.aggregate(reports).length == mech.empty_statistics().length


@pytest.mark.parametrize(
    ("protocol", "payload", "message"),
    [
        ("spl", {"report": "!!"}, "not valid base64"),
        ("spl", {"report": "AAAA"}, "expected"),
        ("spl", {"report": "AAAA", "view": 0}, "exactly"),
        ("smp", {"view": 9, "report": "AAA="}, "'view' must be an integer in 0..3"),
        ("smp", {"view": True, "report": "AAA="}, "'view'"),
        ("smp", {"view": 0, "report": "//8="}, "outside 0..11"),
        ("rsfd", {"report": 5}, "base64 string"),
    ],
)
def test_from_payloads_refuses_naming_the_problem(
    protocol: str, payload: dict[str, Any], message: str
) -> None:
    mech = build(protocol, oracle="grr")
    with pytest.raises(ValueError, match="report 0") as error:
        mech.from_payloads([payload])
    assert message in str(error.value)


def test_check_reports_refuses_padding_and_shapes() -> None:
    mech = build("smp", oracle="oue")
    assert mech.views[3].width == 1 < mech.report_width - 1  # lang: 3 bits in one byte
    reports = mech.encode(population(40), np.random.default_rng(2))
    row = int(np.flatnonzero(reports[:, 0] == 3)[0])
    bad = reports.copy()
    bad[row, -1] = 1
    with pytest.raises(ValueError, match=f"report {row}: bytes past view 3"):
        mech.check_reports(bad)
    bad = reports.copy()
    bad[row, 1] |= 1  # a padding bit of lang's 3-bit row
    with pytest.raises(ValueError, match="padding"):
        mech.check_reports(bad)
    with pytest.raises(ValueError, match="uint8 of shape"):
        mech.check_reports(reports[:, :-1])


# --- the fast path's law -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("oracle", ["grr", "oue"])
def test_simulate_statistics_has_the_law_of_encode_and_aggregate(
    protocol: str, oracle: str
) -> None:
    """Each count (and each numeric view's count of its lower half of outputs) of encode +
    aggregate and of simulate_statistics: homogeneity at ALPHA over all of them."""
    mech = build(protocol, oracle=oracle)
    rows = population(40)
    rng = np.random.default_rng(11)
    runs = 1500
    encoded = np.array([mech.aggregate(mech.encode(rows, rng)).counts for _ in range(runs)])
    simulated = np.array([mech.simulate_statistics(rows, rng).counts for _ in range(runs)])
    columns = []
    for v, view in enumerate(mech.views):
        start, stop = mech.block_starts[v], mech.block_starts[v + 1]
        if view.plan.is_numeric:
            half = start + (stop - start) // 2
            columns.append((encoded[:, start:half].sum(1), simulated[:, start:half].sum(1)))
        else:
            columns.extend((encoded[:, j], simulated[:, j]) for j in range(start, stop))
    columns.extend((encoded[:, j], simulated[:, j]) for j in range(mech.prefix))
    for left, right in columns:
        assert_same_law(left, right, ALPHA / len(columns))


# --- estimation --------------------------------------------------------------------------


def outputs(estimate: Any, protocol: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The estimate's quantities, (values, std) each, by name."""
    theme, font, size, minutes, lang = estimate.attributes
    first, second = estimate.marginals
    found = {
        "lang": (lang.frequencies, lang.std),
        "size": (size.frequencies, size.std),
        "minutes": (np.array([minutes.mean]), np.array([minutes.std])),
        "theme": (theme.frequencies, theme.std),
        "font": (font.frequencies, font.std),
        "theme_font": (first.frequencies.ravel(), first.std.ravel()),
        "font_size": (second.frequencies.ravel(), second.std.ravel()),
        "font_given_theme": (first.given_first.ravel(), first.given_first_std.ravel()),
    }
    return found


def truths(rows: np.ndarray) -> dict[str, np.ndarray]:
    n = rows.shape[0]
    theme, font, size = (rows[:, j].astype(np.int64) for j in range(3))
    joint = np.bincount(theme * 4 + font, minlength=12) / n
    return {
        "lang": np.bincount(rows[:, 4].astype(np.int64), minlength=3) / n,
        "size": np.bincount(size, minlength=3) / n,
        "minutes": np.array([rows[:, 3].mean()]),
        "theme": np.bincount(theme, minlength=3) / n,
        "font": np.bincount(font, minlength=4) / n,
        "theme_font": joint,
        "font_size": np.bincount(font * 3 + size, minlength=12) / n,
        "font_given_theme": (joint.reshape(3, 4) / joint.reshape(3, 4).sum(1)[:, None]).ravel(),
    }


#: Where the stated std is exact (variance-ratio test): every categorical quantity, direct
#: and consistent, under every protocol (smp and rsfd include the covariance between
#: views). The numeric std is an upper bound (duchi) or conservative (rsfd): only its upper
#: side is tested. The conditionals' std is first order (delta method).
EXACT = ("lang", "size", "theme", "font", "theme_font", "font_size")


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("oracle", ["grr", "oue"])
def test_unbiased_with_the_stated_variance(protocol: str, oracle: str) -> None:
    mech = build(protocol, oracle=oracle)
    rows = population(4000)
    rng = np.random.default_rng(3)
    runs = 400
    runs_out = [
        outputs(mech.estimate(mech.simulate_statistics(rows, rng)), protocol) for _ in range(runs)
    ]
    truth = truths(rows)
    checked = sum(truth[name].size for name in truth)
    low, high = variance_ratio_bounds(runs, checked)
    for name, expected in truth.items():
        values = np.array([run[name][0] for run in runs_out])
        variance = np.array([run[name][1] ** 2 for run in runs_out]).mean(axis=0)
        z = (values.mean(axis=0) - expected) / np.sqrt(variance / runs)
        assert np.abs(z).max() < normal_bound(checked), (name, z)
        ratio = values.var(axis=0, ddof=1) / variance
        if name in EXACT:
            assert low < ratio.min() and ratio.max() < high, (name, ratio)
        elif name == "font_given_theme":
            # delta method: first order; at n = 4000 its relative error is well under 10%
            assert 0.9 * low < ratio.min() and ratio.max() < 1.1 * high, (name, ratio)
        elif name == "minutes":
            assert ratio.max() < high, (name, ratio)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_consistency_is_exact_and_postprocessing_valid(protocol: str) -> None:
    mech = build(protocol)
    estimate = mech.estimate(mech.simulate_statistics(population(3000), np.random.default_rng(4)))
    theme, font, size, minutes, lang = estimate.attributes
    assert isinstance(minutes, NumericAttribute) and isinstance(theme, CategoricalAttribute)
    assert isinstance(lang, CategoricalAttribute) and lang.method == "direct"
    assert isinstance(font, CategoricalAttribute) and isinstance(size, CategoricalAttribute)
    assert (theme.method, font.method) == ("consistent", "consistent")
    first, second = estimate.marginals
    assert first.attributes == ("theme", "font")
    np.testing.assert_allclose(first.frequencies.sum(axis=1), theme.frequencies, atol=1e-12)
    np.testing.assert_allclose(first.frequencies.sum(axis=0), font.frequencies, atol=1e-12)
    np.testing.assert_allclose(second.frequencies.sum(axis=1), font.frequencies, atol=1e-12)
    assert isinstance(size, CategoricalAttribute)
    np.testing.assert_allclose(second.frequencies.sum(axis=0), size.frequencies, atol=1e-12)
    for attribute in (theme, font, size, lang):
        assert attribute.postprocessed.min() >= 0
        assert attribute.postprocessed.sum() == pytest.approx(1.0)
    for marginal in estimate.marginals:
        assert marginal.postprocessed.min() >= 0
        assert marginal.postprocessed.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(first.postprocessed.sum(axis=1), theme.postprocessed, atol=1e-6)
    np.testing.assert_allclose(first.postprocessed.sum(axis=0), font.postprocessed, atol=1e-6)
    assert minutes.lower <= minutes.postprocessed_mean <= minutes.upper
    assert estimate.marginal("theme", "font") is first


@pytest.mark.parametrize("oracle", ["grr", "oue"])
def test_smp_leaves_a_view_without_reports_out_of_the_consistent_estimates(oracle: str) -> None:
    """View 0 (theme x font) without reports: theme (only in it) and its marginal answer NaN;
    font comes from view 1 (font x size) alone, finite, as if view 0 were not declared."""
    mech = build("smp", oracle=oracle)
    full = mech.simulate_statistics(population(2000), np.random.default_rng(8)).counts.copy()
    counts = full.copy()
    counts[0] = 0
    counts[mech.block_starts[0] : mech.block_starts[1]] = 0
    estimate = mech.estimate(CountStatistics(int(counts[: mech.k].sum()), counts))
    theme, font, size = (cast(CategoricalAttribute, a) for a in estimate.attributes[:3])
    assert np.isnan(theme.frequencies).all() and np.isnan(theme.std).all()
    assert theme.n == 0
    first, second = estimate.marginals
    assert np.isnan(first.frequencies).all() and np.isnan(first.std).all()
    assert np.isnan(first.given_first).all() and np.isnan(first.given_second_std).all()
    for quantity in (font.frequencies, font.std, size.frequencies, second.std, second.given_first):
        assert np.isfinite(quantity).all()
    np.testing.assert_allclose(second.frequencies.sum(axis=1), font.frequencies, atol=1e-12)
    p, q = mech.oracle_probabilities(mech.views[1])
    view = (counts[mech.block_starts[1] : mech.block_starts[2]] / counts[1] - q) / (p - q)
    np.testing.assert_allclose(font.frequencies, normalize(view).reshape(4, 3).sum(axis=1))


def test_estimate_refuses_zero_reports_and_foreign_statistics() -> None:
    mech = build()
    with pytest.raises(ValueError, match="zero reports"):
        mech.estimate(mech.empty_statistics())
    with pytest.raises(ValueError, match="expected"):
        mech.estimate(build("spl").aggregate(build("spl").encode(population(3))))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_planning_variance_scales_as_one_over_n(protocol: str) -> None:
    mech = build(protocol)
    assert mech.variance(100) == pytest.approx(mech.variance(1) / 100)
    assert mech.variance(1) > 0


@pytest.mark.parametrize(
    "dependence", [INDEPENDENT, ViewDependence(-0.01, raw=False), ViewDependence(-0.02, raw=True)]
)
def test_consistent_variances_equal_the_dense_propagation(dependence: ViewDependence) -> None:
    """Four attributes, pairs (0,1), (0,2), (0,3), (1,2) (attribute 0 in three views): every
    variance make_consistent states equals diag(L Sigma L^T), L the consistency map (read off
    its outputs), Sigma the dense covariance of all views: own blocks, and between views j, l
    scale * (J_jl - E_j E_l^T) (smp) or scale * J_jl (rsfd: the raw cross moment; the cell
    averages cancel through N), J_jl the views' joint law under a 4-way population h whose
    pair margins are the plug-in distributions."""
    rng = np.random.default_rng(21)
    sizes = (2, 3, 2, 3)
    h = rng.dirichlet(np.ones(36)).reshape(sizes)
    configurations = np.array(list(np.ndindex(*sizes)))
    columns = [(0, 1), (0, 2), (0, 3), (1, 2)]
    onehots = [
        np.eye(sizes[a] * sizes[b])[configurations[:, a] * sizes[b] + configurations[:, b]]
        for a, b in columns
    ]
    covs = []
    for a, b in columns:
        size = sizes[a] * sizes[b]
        covs.append(
            ViewCovariance(rng.uniform(0.5, 1.0, size), rng.normal(size=(size, 1)), np.array([0.1]))
        )
    margins = [
        (h.ravel() @ onehot).reshape(sizes[a], sizes[b])
        for onehot, (a, b) in zip(onehots, columns, strict=True)
    ]

    def run(flat: np.ndarray) -> Any:
        starts = np.cumsum([0] + [m.size for m in margins])
        views = [
            PairView(
                c,
                flat[starts[v] : starts[v + 1]].reshape(margins[v].shape),
                covs[v],
                covs[v],
                margins[v],
            )
            for v, c in enumerate(columns)
        ]
        return make_consistent(views, dependence)

    def flatten(result: Any) -> np.ndarray:
        parts = [result.one_way[c][0] for c in range(4)]
        for v, (cells, _, _, _) in enumerate(result.pairs):
            a, b = columns[v]
            parts += [
                cells.ravel(),
                (cells + result.one_way[a][0][:, None]).ravel(),
                (cells + result.one_way[b][0][None, :]).ravel(),
            ]
        return np.concatenate(parts)

    base = np.concatenate([m.ravel() for m in margins])
    reference = flatten(run(base))
    linear = np.column_stack([flatten(run(base + e)) - reference for e in np.eye(base.size)])
    blocks = [[np.zeros(0)] * 4 for _ in range(4)]
    for j in range(4):
        for other in range(4):
            if j == other:
                blocks[j][other] = covs[j].dense()
                continue
            joint = onehots[j].T @ (h.ravel()[:, None] * onehots[other])
            means = np.outer(margins[j].ravel(), margins[other].ravel())
            blocks[j][other] = dependence.scale * (joint if dependence.raw else joint - means)
    expected = np.einsum("ij,jk,ik->i", linear, np.block(blocks), linear)
    result = run(base)
    stated = [result.one_way[c][1] for c in range(4)]
    for _, cells, with_first, with_second in result.pairs:
        stated += [cells.ravel(), with_first.ravel(), with_second.ravel()]
    np.testing.assert_allclose(np.concatenate(stated), expected, rtol=1e-9, atol=1e-12)


SHARED_ATTRIBUTES = [
    {"name": "a", "domain_size": 3},
    {"name": "b", "domain_size": 2},
    {"name": "c", "domain_size": 2},
]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("oracle", ["grr", "oue"])
def test_attribute_shared_by_two_pairs_has_the_stated_variance(protocol: str, oracle: str) -> None:
    """Pairs (a, b), (a, c) at epsilon 6: a's one-way combines both views, where the
    covariance between views is large (``smp``: the two disjoint groups make up the whole
    population, so their sampling terms cancel; ``rsfd``: the raw cross moment; without the
    cross-view terms the empirical over stated variance of a was 0.06 to 0.08 under smp with
    GRR, 0.63 to 0.72 otherwise, all outside the bounds below). Unbiased (z within
    ``normal_bound``), and the empirical over stated variance of a and of every pair cell
    within ``variance_ratio_bounds`` (Bonferroni over all checked quantities); the
    conditionals (delta method, first order) within those bounds widened by 10%."""
    spec = {
        "mechanism": protocol,
        "epsilon": 6.0,
        "attributes": SHARED_ATTRIBUTES,
        "pairs": [["a", "b"], ["a", "c"]],
        "oracle": oracle,
    }
    mech = cast(MultiAttributeMechanism, make_mechanism(MechanismSpec.model_validate(spec)))
    rng = np.random.default_rng(6)
    n = 2000
    a = rng.choice(3, n, p=[0.5, 0.3, 0.2])
    rows = np.column_stack([a] + [(a + rng.integers(0, 2, n)) % 2 for _ in range(2)])
    runs = 1000
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
        "a": [],
        "cells": [],
        "given_first": [],
        "given_second": [],
    }
    for _ in range(runs):
        estimate = mech.estimate(mech.simulate_statistics(rows.astype(np.float64), rng))
        first = cast(CategoricalAttribute, estimate.attributes[0])
        found["a"].append((first.frequencies, first.std))
        for name, value_field, std_field in (
            ("cells", "frequencies", "std"),
            ("given_first", "given_first", "given_first_std"),
            ("given_second", "given_second", "given_second_std"),
        ):
            found[name].append(
                (
                    np.concatenate([getattr(m, value_field).ravel() for m in estimate.marginals]),
                    np.concatenate([getattr(m, std_field).ravel() for m in estimate.marginals]),
                )
            )
    joints = [np.bincount(a * 2 + rows[:, j], minlength=6) / n for j in (1, 2)]
    truth = {"a": np.bincount(a, minlength=3) / n, "cells": np.concatenate(joints)}
    checked = sum(len(found[name][0][0]) for name in found)
    low, high = variance_ratio_bounds(runs, checked)
    for name, pairs in found.items():
        values = np.array([value for value, _ in pairs])
        variance = np.array([std**2 for _, std in pairs]).mean(axis=0)
        ratio = values.var(axis=0, ddof=1) / variance
        if name in truth:
            z = (values.mean(axis=0) - truth[name]) / np.sqrt(variance / runs)
            assert np.abs(z).max() < normal_bound(checked), (name, z)
            assert low < ratio.min() and ratio.max() < high, (name, ratio)
        else:
            assert 0.9 * low < ratio.min() and ratio.max() < 1.1 * high, (name, ratio)


def test_smp_of_two_byte_views_counts_as_the_general_path_does() -> None:
    """The one-bincount path of ``smp`` (every view a 2-byte GRR index) gives the counts
    the view-by-view path gives, and a report out of range is still refused by name."""
    attributes = [{"name": "a", "domain_size": 5}, {"name": "b", "domain_size": 300}]
    mech = build("smp", attributes=attributes, pairs=None, oracle="grr")
    rng = np.random.default_rng(8)
    rows = np.column_stack([rng.integers(0, 5, 5000), rng.integers(0, 300, 5000)])
    reports = mech.encode(rows.astype(np.float64), rng)
    _, blocks = mech._view_blocks(reports)
    general = np.concatenate(
        [[block.shape[0] for block, _ in blocks]]
        + [view.counts(block) for view, (block, _) in zip(mech.views, blocks, strict=True)]
    )
    assert mech.aggregate(reports) == CountStatistics(5000, general)
    bad = reports.copy()
    bad[17] = [0, 0, 9]  # view 0 holds 5 values: 9 is out of range
    with pytest.raises(ValueError, match="report 17"):
        mech.aggregate(bad)
