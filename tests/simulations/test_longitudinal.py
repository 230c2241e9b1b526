"""``ldp-sim longitudinal``: the command end to end, the population it draws, the per-period
variance and lifetime epsilon it reports, and the adversary's check of the stateless leak."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import make_mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.numeric import NumericMechanism
from simulations import longitudinal
from simulations.cli import main
from simulations.longitudinal import (
    MEMOIZED,
    NUMERIC,
    ONE_SHOT,
    RESULT_COLUMNS,
    Population,
    distinct_per_device,
    frequency_variances,
    make_specs,
    simulate,
)
from simulations.populations import parse_categorical_shape, parse_numeric_shape

EVERY = MEMOIZED + ONE_SHOT
#: Two-sided normal quantile for a false failure at most once in 10^6 runs.
Z = 4.8916


def population(devices: int, periods: int, change: float, d: int = 4, seed: int = 5) -> Population:
    return Population(
        devices, periods, change, d, parse_categorical_shape("zipf:1.1"),
        parse_numeric_shape("normal:0.4,0.2"), 0.0, 1.0, seed,
    )  # fmt: skip


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_command_writes_results_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "long"
    code = main(
        [
            "longitudinal", "--devices", "2000", "--periods", "4", "--domain-size", "4",
            "--epsilon", "2", "--epsilon-report", "1", "--reps", "2",
            "--adversary-devices", "100", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "adversary_threshold" in printed and "longitudinal.png" in printed
    rows = read_rows(out / "results.csv")
    assert [row["mechanism"] for row in rows] == list(EVERY)
    assert list(rows[0]) == RESULT_COLUMNS
    for row in rows:
        memoized = row["memoized"] == "True"
        assert memoized == (row["mechanism"] in MEMOIZED)
        assert float(row["one_shot_lifetime"]) == 4 * float(row["epsilon_report"])
        assert float(row["epsilon"]) == (2.0 if memoized else 1.0)
        assert float(row["variance"]) > 0 and float(row["mse"]) > 0
        assert (row["adversary_memoized"] == "nan") != memoized
    periods = read_rows(out / "periods.csv")
    assert list(periods[0]) == ["mechanism", "period", "mse", "variance", "ratio", "ratio_se"]
    assert len(periods) == len(EVERY) * 4
    lifetime = read_rows(out / "lifetime.csv")
    assert list(lifetime[0]) == ["mechanism", "distinct_keys", "lifetime_epsilon", "share"]
    for name in EVERY:
        shares = [float(r["share"]) for r in lifetime if r["mechanism"] == name]
        assert sum(shares) == pytest.approx(1.0, abs=1e-12)
    document = json.loads((out / "results.json").read_text())
    assert [row["mechanism"] for row in document["mechanisms"]] == list(EVERY)
    assert len(document["periods"]) == len(periods)
    assert (out / "longitudinal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--epsilon", "1", "--epsilon-report", "1"), "epsilon_report must be < epsilon"),
        (("--flip-probability", "0.6", "--mechanisms", "onebitmean"), "flip_probability"),
        (
            (
                "--change",
                "1.5",
            ),
            "not a probability",
        ),
        (
            (
                "--mechanisms",
                "olh",
            ),
            "unknown mechanism",
        ),
        (("--lower", "2", "--upper", "1"), "must be below upper"),
        (("--domain-size", "3", "--shape", "zipf:0"), "zipf exponent"),
    ],
)
def test_bad_arguments_are_named(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["longitudinal", "--devices", "10", "--periods", "2", "--quiet", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_population_draws_fit_their_law_and_drift() -> None:
    """First-period values against the Zipf shares (chi-square), and the share of devices
    whose value differs from the period before against c (1 - sum_v pi_v^2), the chance of
    drawing anew and landing elsewhere (binomial); false failure below 1e-6 each."""
    change = 0.3
    drifting = population(40_000, 3, change, d=6)
    support, law = drifting.law(numeric=False)
    first, second, _ = drifting.values(0, numeric=False)
    observed = np.bincount(first, minlength=6)
    _, p_value = stats.chisquare(observed, law * first.size)
    assert p_value > 1e-6
    moved = float(np.mean(first != second))
    expected = change * (1 - float(law @ law))
    assert abs(moved - expected) <= Z * math.sqrt(expected * (1 - expected) / first.size)
    levels, shares = drifting.law(numeric=True)
    assert shares.sum() == pytest.approx(1.0, abs=1e-9)
    numbers = next(drifting.values(0, numeric=True))
    assert set(np.unique(numbers)) <= set(levels)
    frozen = population(500, 4, 0.0)
    frames = list(frozen.values(0, numeric=True))
    assert all(np.array_equal(frames[0], frame) for frame in frames)


def test_distinct_keys_per_device() -> None:
    keys = np.array([[1, 2, 3, 7], [1, 2, 4, 7], [1, 5, 3, 8], [1, 2, 3, 9]])
    # A value left and returned to is one key: the second column's 2, 2, 5, 2 is two keys.
    assert distinct_per_device(keys).tolist() == [1, 2, 2, 3]


def test_unchanging_devices_spend_epsilon_once() -> None:
    """Devices that keep their value: a memoized mechanism's lifetime is epsilon exactly,
    for every device; one-shot reporting spends T epsilon_report."""
    periods = 12
    frozen = population(1500, periods, 0.0)
    specs = make_specs(EVERY, 2.0, 0.5, frozen)
    run = simulate(frozen, specs, adversary_devices=0, progress=False)
    names = ("lifetime_mean", "lifetime_median", "lifetime_p99", "lifetime_max")
    for row in run.rows:
        expected = 2.0 if row["memoized"] else periods * 0.5
        assert [row[name] for name in names] == [expected] * 4, row["mechanism"]
    for name in MEMOIZED:
        (only,) = [r for r in run.lifetime if r["mechanism"] == name]
        assert (only["distinct_keys"], only["lifetime_epsilon"], only["share"]) == (1, 2.0, 1.0)


def test_lifetime_counts_each_devices_distinct_values() -> None:
    """With values as memo keys (lgrr, lsue), the lifetime distribution is that of the
    number of distinct values in each device's history, counted here one device at a time."""
    periods, devices = 8, 3000
    drifting = population(devices, periods, 0.4)
    history = np.stack(list(drifting.values(0, numeric=False)))
    distinct = np.bincount([len(set(history[:, i].tolist())) for i in range(devices)])
    run = simulate(
        drifting, make_specs(["lgrr", "lsue"], 1.5, 1.0, drifting), adversary_devices=0,
        progress=False,
    )  # fmt: skip
    for name in ("lgrr", "lsue"):
        mine = {r["distinct_keys"]: r for r in run.lifetime if r["mechanism"] == name}
        assert {k: r["share"] for k, r in mine.items()} == {
            k: distinct[k] / devices for k in np.flatnonzero(distinct).tolist()
        }
        assert all(r["lifetime_epsilon"] == 1.5 * k for k, r in mine.items())
        (row,) = [r for r in run.rows if r["mechanism"] == name]
        assert row["lifetime_mean"] == pytest.approx(
            1.5 * distinct @ np.arange(distinct.size) / devices
        )
        assert row["lifetime_max"] == 1.5 * (distinct.size - 1)


def test_variances_add_over_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-period variance assembled from blocks of devices equals the formula at the
    whole population's frequencies (categorical) or values (numeric)."""
    monkeypatch.setattr(longitudinal, "DEVICE_BLOCK", 1000)
    drifting = population(3500, 3, 0.5)
    assert len(drifting.blocks()) == 4
    specs = make_specs(["lgrr", "dbitflip", "onebitmean", "oue"], 2.0, 1.0, drifting)
    run = simulate(drifting, specs, adversary_devices=0, progress=False)
    for spec in specs:
        mech = make_mechanism(spec)
        numeric = spec.mechanism in NUMERIC
        frames = zip(
            *(drifting.values(start, numeric) for start, _ in drifting.blocks()), strict=True
        )
        mine = [r["variance"] for r in run.periods if r["mechanism"] == spec.mechanism]
        for period, parts in enumerate(frames):
            values = np.concatenate(parts)
            n = values.size
            if isinstance(mech, CategoricalMechanism):
                truth = np.bincount(values, minlength=4) / n
                expected = float(frequency_variances(mech, truth, n).mean())
            else:
                assert isinstance(mech, NumericMechanism)
                expected = float(mech.report_variance(values).sum()) / n**2
            assert mine[period] == pytest.approx(expected, rel=1e-12), spec.mechanism


@pytest.mark.slow
def test_period_estimates_match_the_analytical_variance() -> None:
    """One period, 300 repetitions (fresh memos and noise; the one-shot mechanisms take the
    same path without a memo): every estimate is unbiased with
    the analytical variance, so each repetition's ratio of squared errors to variances has
    mean 1. Numeric: one error, normal at n = 1500 (central limit), so 300 times the ratio is
    chi-square with 300 degrees of freedom: two-sided 1e-6. Categorical (d = 16): the mean
    ratio within 5.5 of its standard error across repetitions (false failure below 2e-6,
    simulated for chi-square ratios of 16 terms, whose mean and spread fall together)."""
    reps = 300
    single = population(1500, 1, 0.0, d=16)
    specs = make_specs(MEMOIZED + ("grr", "duchi"), 2.0, 1.0, single)
    run = simulate(single, specs, reps=reps, adversary_devices=0, progress=False)
    for row in run.rows:
        if row["mechanism"] in NUMERIC:
            level = stats.chi2.cdf(reps * row["ratio"], reps)
            assert 5e-7 < level < 1 - 5e-7, row["mechanism"]
        else:
            assert abs(row["ratio"] - 1) <= 5.5 * row["ratio_se"], row["mechanism"]


@pytest.mark.slow
def test_stateless_check_detects_the_leak() -> None:
    """Devices keep one value for 40 periods. Memoized, the adversary's success stays within
    the bound of one epsilon-LDP response (a false alarm at most once in 10^6 runs); with the
    permanent response drawn anew each period, it passes the bound (expected 0.67-1.0 here
    against a threshold near 0.55, or 0.80 for onebitmean: 8 standard errors or more)."""
    periods = 40
    fleet = population(200, periods, 0.1)
    specs = make_specs(EVERY, 1.0, 0.5, fleet)
    run = simulate(fleet, specs, adversary_devices=1000, progress=False)
    for row in run.rows:
        name = row["mechanism"]
        k = 2 if name in NUMERIC else 4
        if row["memoized"]:
            assert row["adversary_bound"] == pytest.approx(1 / (1 + (k - 1) * math.exp(-1.0)))
            assert not row["leak_memoized"], name
            assert row["leak_stateless"], name
            assert row["adversary_stateless"] > row["adversary_memoized"], name
        else:
            assert math.isnan(row["adversary_memoized"])
            assert row["adversary_bound"] > 0.999  # 40 reports at 0.5: epsilon 20
