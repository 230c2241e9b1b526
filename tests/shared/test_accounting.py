"""Tests for shared.accounting: subsampled-Gaussian accounting."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shared.accounting as accounting
from shared.accounting import (
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    MAX_CALIBRATION_EVALUATIONS,
    MAX_PLD_POINTS,
    AccountingMethod,
    calibrate_noise_multiplier,
    gaussian_epsilon,
    pld_discretization,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5
# A coarser PLD grid keeps the PLD calibration tests at ~1 s instead of ~10 s. PLD
# discretization is pessimistic, so this only loosens epsilon (by ~1e-3 here).
FAST_PLD = 1e-3

# --------------------------------------------------------------------------------------
# Reference figures (dp-accounting 0.6.0, delta = 1e-5, q = 0.01, T = 1000)
# --------------------------------------------------------------------------------------


def test_reference_epsilon_rdp() -> None:
    eps = gaussian_epsilon(1.1, 0.01, 1000, DELTA, method="rdp")
    assert abs(eps - 1.712) < 2e-3  # measured 1.71177


@pytest.mark.slow
def test_reference_epsilon_pld() -> None:
    eps = gaussian_epsilon(1.1, 0.01, 1000, DELTA, method="pld")
    assert abs(eps - 1.515) < 2e-3  # measured 1.51537 (default grid 1e-4)


def test_reference_epsilon_pld_coarse_grid_still_matches() -> None:
    eps = gaussian_epsilon(
        1.1, 0.01, 1000, DELTA, method="pld", value_discretization_interval=FAST_PLD
    )
    assert abs(eps - 1.515) < 2e-3  # measured 1.51619
    # The coarse grid is pessimistic: never below the fine-grid value.
    assert eps >= 1.5153


@pytest.mark.slow
def test_reference_calibration_rdp() -> None:
    z = calibrate_noise_multiplier(3.0, 0.01, 1000, DELTA, method="rdp")
    assert abs(z - 0.865) < 2e-3  # measured 0.86461


@pytest.mark.slow
def test_reference_calibration_pld() -> None:
    z = calibrate_noise_multiplier(
        3.0, 0.01, 1000, DELTA, method="pld", value_discretization_interval=FAST_PLD
    )
    assert abs(z - 0.814) < 2e-3  # measured 0.81363 (0.81359 with the default grid)


def test_default_pld_grid_is_the_dp_accounting_default() -> None:
    """As documented: the PLD interval is dp-accounting's own unless a caller asks for
    another."""
    from dp_accounting import pld

    parameters = inspect.signature(pld.PLDAccountant).parameters
    assert DEFAULT_VALUE_DISCRETIZATION_INTERVAL == (
        parameters["value_discretization_interval"].default
    )


def test_default_method_is_pld() -> None:
    kwargs: dict[str, Any] = {"value_discretization_interval": FAST_PLD}
    assert gaussian_epsilon(1.1, 0.01, 100, DELTA, **kwargs) == gaussian_epsilon(
        1.1, 0.01, 100, DELTA, "pld", **kwargs
    )


def _analytic_gaussian_delta(eps: float, sigma: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with L2 sensitivity 1 (Balle & Wang 2018)."""
    from scipy.stats import norm

    return float(
        norm.cdf(-eps * sigma + 1 / (2 * sigma))
        - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))
    )


@pytest.mark.slow
def test_unsampled_pld_matches_analytic_gaussian() -> None:
    # q = 1: T Gaussian rounds with multiplier z equal one Gaussian with sigma = z / sqrt(T).
    z, steps = 2.0, 50
    eps = gaussian_epsilon(z, 1.0, steps, DELTA, method="pld")
    sigma = z / math.sqrt(steps)
    assert _analytic_gaussian_delta(eps, sigma) == pytest.approx(DELTA, rel=1e-3)


@pytest.mark.slow
def test_unsampled_rdp_is_upper_bound_of_exact() -> None:
    z, steps = 2.0, 50
    exact = gaussian_epsilon(z, 1.0, steps, DELTA, method="pld")
    rdp = gaussian_epsilon(z, 1.0, steps, DELTA, method="rdp")
    assert rdp >= exact - 1e-3


def test_rdp_upper_bounds_pld_in_reference_setting() -> None:
    rdp = gaussian_epsilon(1.1, 0.01, 1000, DELTA, method="rdp")
    pld = gaussian_epsilon(
        1.1, 0.01, 1000, DELTA, method="pld", value_discretization_interval=FAST_PLD
    )
    assert pld < rdp


# --------------------------------------------------------------------------------------
# Monotonicity and round trip
# --------------------------------------------------------------------------------------

METHOD_KWARGS: list[tuple[AccountingMethod, dict[str, Any]]] = [
    ("rdp", {}),
    ("pld", {"value_discretization_interval": FAST_PLD}),
]


@pytest.mark.parametrize(("method", "kwargs"), METHOD_KWARGS)
def test_more_noise_less_epsilon(method: AccountingMethod, kwargs: dict[str, Any]) -> None:
    eps = [gaussian_epsilon(z, 0.01, 200, DELTA, method, **kwargs) for z in (0.7, 1.0, 1.5, 3.0)]
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False)), eps


@pytest.mark.parametrize(("method", "kwargs"), METHOD_KWARGS)
def test_more_steps_more_epsilon(method: AccountingMethod, kwargs: dict[str, Any]) -> None:
    eps = [gaussian_epsilon(1.0, 0.01, t, DELTA, method, **kwargs) for t in (1, 10, 100, 500)]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False)), eps


@pytest.mark.parametrize(("method", "kwargs"), METHOD_KWARGS)
@pytest.mark.slow
def test_higher_sample_rate_more_epsilon(method: AccountingMethod, kwargs: dict[str, Any]) -> None:
    eps = [gaussian_epsilon(1.0, q, 100, DELTA, method, **kwargs) for q in (0.001, 0.01, 0.1, 1.0)]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False)), eps


@pytest.mark.parametrize(("method", "kwargs"), METHOD_KWARGS)
@pytest.mark.parametrize(("target", "q", "steps"), [(1.0, 0.02, 200), (4.0, 0.05, 50)])
@pytest.mark.slow
def test_calibration_round_trip(
    method: AccountingMethod, kwargs: dict[str, Any], target: float, q: float, steps: int
) -> None:
    tol = 1e-5
    z = calibrate_noise_multiplier(target, q, steps, DELTA, method, tol=tol, **kwargs)
    eps = gaussian_epsilon(z, q, steps, DELTA, method, **kwargs)
    # The calibrated z satisfies the target ...
    assert eps <= target + 1e-9
    # ... and is (near-)minimal: within tol in z, so epsilon is close to the target,
    assert eps == pytest.approx(target, abs=1e-2)
    # and backing off by a few tolerances already breaks the target.
    assert gaussian_epsilon(z - 10 * tol, q, steps, DELTA, method, **kwargs) > target


@pytest.mark.slow
def test_calibration_tighter_target_needs_more_noise() -> None:
    zs = [calibrate_noise_multiplier(e, 0.01, 100, DELTA, "rdp") for e in (0.5, 1.0, 2.0, 8.0)]
    assert all(a > b for a, b in zip(zs, zs[1:], strict=False)), zs


# --------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------

GOOD_EPS: dict[str, Any] = {
    "noise_multiplier": 1.0,
    "sample_rate": 0.01,
    "steps": 10,
    "delta": DELTA,
    "method": "rdp",
}
GOOD_CAL: dict[str, Any] = {
    "target_epsilon": 1.0,
    "sample_rate": 0.01,
    "steps": 10,
    "delta": DELTA,
    "method": "rdp",
}

BAD_COMMON: list[tuple[str, Any]] = [
    ("delta", 0.0),
    ("delta", 1.0),
    ("delta", -1e-5),
    ("delta", 1.5),
    ("delta", math.nan),
    ("delta", "1e-5"),
    ("sample_rate", 0.0),
    ("sample_rate", -0.1),
    ("sample_rate", 1.0000001),
    ("sample_rate", math.nan),
    ("steps", 0),
    ("steps", -3),
    ("steps", 10.0),
    ("steps", 2.5),
    ("steps", True),
    ("steps", "10"),
    ("method", "gdp"),
    ("method", "PLD"),
    ("method", None),
    ("value_discretization_interval", 0.0),
    ("value_discretization_interval", math.inf),
]
BAD_NOISE: list[tuple[str, Any]] = [
    ("noise_multiplier", 0.0),
    ("noise_multiplier", -1.0),
    ("noise_multiplier", math.inf),
    ("noise_multiplier", math.nan),
    ("noise_multiplier", None),
]
BAD_TARGET: list[tuple[str, Any]] = [
    ("target_epsilon", 0.0),
    ("target_epsilon", -2.0),
    ("target_epsilon", math.inf),
    ("target_epsilon", math.nan),
    ("target_epsilon", "3"),
    ("tol", 0.0),
    ("tol", -1e-3),
    ("tol", math.nan),
]


@pytest.mark.parametrize(("name", "value"), BAD_COMMON + BAD_NOISE)
def test_gaussian_epsilon_rejects_invalid(name: str, value: Any) -> None:
    kwargs = {**GOOD_EPS, name: value}
    with pytest.raises(ValueError, match=rf"^{name}\b") as info:
        gaussian_epsilon(**kwargs)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(("name", "value"), BAD_COMMON + BAD_TARGET)
def test_calibrate_rejects_invalid(name: str, value: Any) -> None:
    kwargs = {**GOOD_CAL, name: value}
    with pytest.raises(ValueError, match=rf"^{name}\b") as info:
        calibrate_noise_multiplier(**kwargs)
    assert repr(value) in str(info.value)


def test_numpy_integer_steps_accepted() -> None:
    import numpy as np

    assert gaussian_epsilon(1.0, 0.01, np.int64(10), DELTA, "rdp") == gaussian_epsilon(
        1.0, 0.01, 10, DELTA, "rdp"
    )


# --------------------------------------------------------------------------------------
# Import weight
# --------------------------------------------------------------------------------------


def test_import_does_not_pull_scipy_or_dp_accounting() -> None:
    code = (
        "import sys\n"
        "import shared.accounting\n"
        "heavy = sorted(m for m in ('scipy', 'dp_accounting') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


# --------------------------------------------------------------------------------------
# Bounded cost over the extremes of the parameters a task may give
# --------------------------------------------------------------------------------------


def _pld_points(noise_multiplier: float, sample_rate: float, steps: int, interval: float) -> int:
    """Points of the composed PLD grid (the FFT length) the accountant builds here."""
    rounds = {noise_multiplier: steps}
    used = pld_discretization(rounds, sample_rate, interval)
    accountant = accounting._rounds_accountant(rounds, sample_rate, "pld", used)
    pld = accountant._pld  # type: ignore[attr-defined]
    return max(pld._pmf_remove.size, pld._pmf_add.size)


@pytest.mark.slow
@pytest.mark.parametrize("z", [0.1, 0.3, 1e6])
@pytest.mark.parametrize("q", [1e-12, 0.3, 1.0])
@pytest.mark.parametrize("steps", [1, 10_000])
def test_pld_grid_is_bounded_over_the_extremes(z: float, q: float, steps: int) -> None:
    """Smallest multiplier, smallest and largest sampling rate, one and the most rounds:
    the PLD grid never holds more than MAX_PLD_POINTS points (z = 0.3, q = 1, 10000 rounds
    needed ~5e6 at the federated interval 1e-3 before its interval was coarsened)."""
    assert _pld_points(z, q, steps, 1e-3) <= MAX_PLD_POINTS


@pytest.mark.slow
def test_coarsened_pld_stays_an_upper_bound() -> None:
    """Where the interval is coarsened, epsilon is never below the value on a grid twice as
    fine (both pessimistic upper bounds), within 1% of it, and below the RDP bound."""
    z, q, steps = 1.0, 0.3, 10_000
    used = pld_discretization({z: steps}, q, 1e-4)
    assert used > 1e-4  # the case coarsens
    fine = accounting._rounds_accountant({z: steps}, q, "pld", used / 2).get_epsilon(DELTA)
    coarse = gaussian_epsilon(z, q, steps, DELTA, "pld", value_discretization_interval=1e-4)
    assert fine <= coarse <= fine * 1.01
    assert coarse <= gaussian_epsilon(z, q, steps, DELTA, "rdp")


@pytest.mark.slow
def test_previously_slow_configurations_answer() -> None:
    """z = 0.1 over 100 unsampled rounds took the PLD accountant ~16 s on the 1e-3 grid:
    now one bounded FFT, and still an upper bound below RDP's."""
    pld = gaussian_epsilon(0.1, 1.0, 100, DELTA, "pld", value_discretization_interval=1e-3)
    assert 0 < pld <= gaussian_epsilon(0.1, 1.0, 100, DELTA, "rdp")


@pytest.mark.parametrize(
    ("target", "q", "steps", "delta"),
    [(1e-3, 1e-12, 10_000, 1e-30), (20.0, 1e-12, 10_000, 1e-5), (20.0, 1e-3, 10_000, 1e-12)],
)
@pytest.mark.slow
def test_calibration_work_is_bounded(
    monkeypatch: pytest.MonkeyPatch, target: float, q: float, steps: int, delta: float
) -> None:
    """Calibration at the extremes (smallest target and delta, tiny q, the most rounds)
    makes at most MAX_CALIBRATION_EVALUATIONS evaluations per method, each a bounded PLD
    or RDP call, and its answer meets the target."""
    counts = {"pld": 0, "rdp": 0}
    evaluate = accounting._rounds_epsilon

    def counted(rounds: dict[float, int], *args: Any) -> float:
        counts[args[2]] += 1
        return float(evaluate(rounds, *args))

    monkeypatch.setattr(accounting, "_rounds_epsilon", counted)
    z = calibrate_noise_multiplier(
        target, q, steps, delta, "pld", value_discretization_interval=1e-3
    )
    assert all(0 < n <= MAX_CALIBRATION_EVALUATIONS for n in counts.values()), counts
    assert gaussian_epsilon(z, q, steps, delta, "pld", value_discretization_interval=1e-3) <= target


# --------------------------------------------------------------------------------------
# The discrete Gaussian: zCDP, Poisson subsampling, sums of shares
# --------------------------------------------------------------------------------------


def _true_subsampled_dg_rdp(sigma: float, q: float, alpha: int) -> float:
    """max(D_alpha(M || P), D_alpha(P || M)) for P = N_Z(0, sigma^2), Q = N_Z(1, sigma^2)
    and M = (1 - q) P + q Q (one coordinate, sensitivity 1), by direct summation over
    |y| <= 60 sigma + 60 in log space (the rest is below exp(-1800))."""
    from scipy.special import logsumexp

    reach = math.ceil(60 * sigma) + 60
    y = np.arange(-reach, reach + 1, dtype=np.float64)
    log_p = -(y**2) / (2 * sigma**2)
    log_p -= logsumexp(log_p)
    log_q = -((y - 1) ** 2) / (2 * sigma**2)
    log_q -= logsumexp(log_q)
    log_m = np.logaddexp(math.log1p(-q) + log_p, math.log(q) + log_q)
    forward = logsumexp(alpha * log_m - (alpha - 1) * log_p) / (alpha - 1)
    backward = logsumexp(alpha * log_p - (alpha - 1) * log_m) / (alpha - 1)
    return float(max(forward, backward))


def _subsampled_gaussian_rdp(sigma: float, q: float, alpha: int) -> float:
    """The continuous subsampled Gaussian's exact RDP at an integer order (Mironov, Talwar
    and Zhang 2019): log(sum_l C(alpha, l) (1-q)^(alpha-l) q^l e^((l^2 - l) / (2 sigma^2)))
    / (alpha - 1)."""
    from scipy.special import gammaln, logsumexp

    ell = np.arange(alpha + 1, dtype=np.float64)
    terms = (
        gammaln(alpha + 1.0) - gammaln(ell + 1.0) - gammaln(alpha - ell + 1.0)
        + (alpha - ell) * math.log1p(-q) + ell * math.log(q) + (ell**2 - ell) / (2 * sigma**2)
    )  # fmt: skip
    return float(logsumexp(terms)) / (alpha - 1)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.5])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_discrete_rdp_bounds_the_true_divergences(sigma: float, q: float) -> None:
    """Zhu and Wang's bound from the zCDP curve is above the Renyi divergence of the
    subsampled discrete Gaussian, both directions, computed directly; and above the
    continuous Gaussian's exact RDP, equal to it at order 2 (the sum has no term with the
    factor 3 there)."""
    orders = (2, 3, 5, 10, 32)
    ours = accounting.discrete_gaussian_rdp(sigma, q, orders)
    for order, bound in zip(orders, ours, strict=True):
        assert bound >= _true_subsampled_dg_rdp(sigma, q, order) * (1 - 1e-9)
        continuous = _subsampled_gaussian_rdp(sigma, q, order)
        assert bound >= continuous * (1 - 1e-9)
        if order == 2:
            assert bound == pytest.approx(continuous, rel=1e-9)


def test_unsampled_discrete_rdp_is_the_zcdp_line() -> None:
    """q = 1: alpha / (2 z^2) at every order, the continuous Gaussian's RDP: equal epsilons
    by the RDP method (the rounding's cost is in the noise, not here)."""
    orders = (1.5, 2.0, 7.0, 64.0)
    assert accounting.discrete_gaussian_rdp(1.3, 1.0, orders) == pytest.approx(
        tuple(order / (2 * 1.3**2) for order in orders), rel=1e-15
    )
    for z, steps in [(0.8, 1), (1.1, 50), (4.0, 1000)]:
        discrete = gaussian_epsilon(z, 1.0, steps, DELTA, mechanism="discrete_gaussian")
        assert discrete == pytest.approx(gaussian_epsilon(z, 1.0, steps, DELTA, "rdp"), rel=1e-9)


@pytest.mark.parametrize(
    ("z", "q", "steps"), [(1.1, 0.01, 1000), (0.8, 0.1, 100), (2.0, 0.3, 20), (1.0, 1.0, 10)]
)
def test_discrete_epsilon_is_never_below_the_continuous_figures(
    z: float, q: float, steps: int
) -> None:
    """The discrete Gaussian's epsilon is at least the continuous one by RDP, and at least
    the continuous PLD figure (which it does not rely on)."""
    discrete = gaussian_epsilon(z, q, steps, DELTA, mechanism="discrete_gaussian")
    assert discrete == gaussian_epsilon(z, q, steps, DELTA, "pld", mechanism="discrete_gaussian")
    assert discrete >= gaussian_epsilon(z, q, steps, DELTA, "rdp") * (1 - 1e-12)
    assert discrete >= gaussian_epsilon(
        z, q, steps, DELTA, "pld", value_discretization_interval=FAST_PLD
    )
    releases = {(z, q): steps}
    assert accounting.discrete_gaussian_releases_epsilon(releases, DELTA) == discrete


@pytest.mark.slow
def test_discrete_calibration_meets_the_target_and_needs_more_noise() -> None:
    z = calibrate_noise_multiplier(2.0, 0.01, 1000, DELTA, mechanism="discrete_gaussian")
    assert gaussian_epsilon(z, 0.01, 1000, DELTA, mechanism="discrete_gaussian") <= 2.0
    below = gaussian_epsilon(z * 0.999, 0.01, 1000, DELTA, mechanism="discrete_gaussian")
    assert below > 2.0
    assert z >= calibrate_noise_multiplier(
        2.0, 0.01, 1000, DELTA, "pld", value_discretization_interval=FAST_PLD
    )


def test_the_rounds_accountant_charges_the_discrete_mechanism() -> None:
    running = accounting.GaussianRoundsAccountant(
        0.01, DELTA, "pld", {1.1: 999}, mechanism="discrete_gaussian"
    )
    assert running.epsilon_after(1.1) == gaussian_epsilon(
        1.1, 0.01, 1000, DELTA, mechanism="discrete_gaussian"
    )
    with pytest.raises(ValueError, match="mechanism"):
        accounting.GaussianRoundsAccountant(0.01, DELTA, mechanism="laplace")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mechanism"):
        gaussian_epsilon(1.0, 0.1, 1, DELTA, mechanism="gauss")  # type: ignore[arg-type]


def test_a_sum_of_discrete_shares_is_charged_at_most_its_continuous_multiplier() -> None:
    """One share: z. Wide shares: z to within 1e-12 (tau is below exp(-900)). Narrow shares:
    the single share's z / sqrt(n), never more than what Kairouz, Liu and Steinke allow."""
    charge = accounting.discrete_gaussian_sum_multiplier
    assert charge(1.3, 0.2, 1, 10) == 1.3
    assert charge(1.3, 10.0, 100, 500_001) == pytest.approx(1.3, rel=1e-12)
    assert charge(1.3, 10.0, 100, 500_001) <= 1.3
    assert charge(1.3, 0.2, 100, 10) == pytest.approx(0.13)
    tau = 10 * 99 * math.exp(-(math.pi**2) * 1.5**2)
    kls = 1 / math.sqrt(1.3**-2 + 2 * tau * 1000)
    assert charge(1.3, 1.5, 100, 1000) == pytest.approx(max(0.13, kls))
