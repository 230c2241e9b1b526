"""Privacy accounting: (epsilon, delta) of the Poisson-subsampled Gaussian mechanism,
continuous or discrete.

:func:`gaussian_epsilon`, :func:`calibrate_noise_multiplier` and the rounds accountant
cover the mechanism behind DP-SGD (Abadi et al. 2016) and, with users in place of
examples, DP-FedAvg (McMahan et al. 2018). They delegate to Google's ``dp-accounting``
package rather than re-deriving the bounds by hand. The same releases made with exact
**discrete** Gaussian noise on an integer lattice (what the federated code runs; see
:mod:`shared.federated.lattice`) are accounted by their zCDP bound instead
(``mechanism="discrete_gaussian"``, :func:`discrete_gaussian_rdp`): the privacy loss
distribution of the continuous Gaussian, which the PLD accountant uses, is not proven to
bound the discrete one, its Renyi divergences are. Pure epsilon budgets (basic
composition, a sum of epsilons against a cap) are :mod:`shared.caps`.

This module is imported by the on-device client, so it must stay light: it imports neither
``scipy`` nor ``dp_accounting`` at import time. ``dp_accounting`` (which pulls in ``scipy``)
is imported lazily inside the functions that need it.

References:
    - M. Abadi et al. *Deep Learning with Differential Privacy*. CCS 2016.
    - I. Mironov. *Renyi Differential Privacy*. CSF 2017.
    - I. Mironov, K. Talwar, L. Zhang. *Renyi Differential Privacy of the Sampled Gaussian
      Mechanism*. 2019.
    - H. B. McMahan, D. Ramage, K. Talwar, L. Zhang. *Learning Differentially Private
      Recurrent Language Models*. ICLR 2018.
    - A. Koskela, J. Jalko, A. Honkela. *Computing Tight Differential Privacy Guarantees
      Using FFT*. AISTATS 2020.
    - V. Doroshenko, B. Ghazi, P. Kamath, R. Kumar, P. Manurangsi. *Connect the Dots: Tighter
      Discrete Approximations of Privacy Loss Distributions*. PETS 2022.
    - C. Canonne, G. Kamath, T. Steinke. *The Discrete Gaussian for Differential Privacy*.
      NeurIPS 2020.
    - Y. Zhu, Y.-X. Wang. *Poisson Subsampled Renyi Differential Privacy*. ICML 2019.
    - P. Kairouz, Z. Liu, T. Steinke. *The Distributed Discrete Gaussian Mechanism for
      Federated Learning with Secure Aggregation*. ICML 2021.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only, never executed at runtime
    from dp_accounting import DpEvent, PrivacyAccountant

__all__ = [
    "DEFAULT_CALIBRATION_TOL",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "MAX_CALIBRATION_EVALUATIONS",
    "MAX_PLD_POINTS",
    "AccountingMethod",
    "GaussianRoundsAccountant",
    "NoiseMechanism",
    "Releases",
    "calibrate_noise_multiplier",
    "discrete_gaussian_rdp",
    "discrete_gaussian_releases_epsilon",
    "discrete_gaussian_sum_multiplier",
    "gaussian_epsilon",
    "gaussian_rounds_epsilon",
    "pld_discretization",
    "releases_discretization",
    "releases_epsilon",
]

AccountingMethod = Literal["pld", "rdp"]
_METHODS: tuple[str, ...] = ("pld", "rdp")
#: The noise a release adds: the continuous Gaussian, or the exact discrete Gaussian on a
#: lattice (accounted by its Renyi divergences whatever the method: see the module doc).
NoiseMechanism = Literal["gaussian", "discrete_gaussian"]
_MECHANISMS: tuple[str, ...] = ("gaussian", "discrete_gaussian")

#: Default absolute tolerance on the noise multiplier returned by
#: :func:`calibrate_noise_multiplier`; gives at least 3 significant digits for z >= 0.01.
DEFAULT_CALIBRATION_TOL = 1e-5

#: Default PLD discretization interval (the ``dp-accounting`` default). Coarser values are
#: faster and remain *valid* upper bounds on epsilon (the PLD accountant discretizes
#: pessimistically), only less tight.
DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4

#: Most points the PLD accountant's privacy-loss grid may need. The PLD of ``T`` rounds
#: spans a range of privacy losses ``W`` (in nats) that grows with epsilon; at interval
#: ``h`` its grid (the FFT length of the composition) holds about ``W / h`` points. The
#: interval is coarsened to ``W / MAX_PLD_POINTS`` when the requested one would need more
#: (see :func:`pld_discretization`), which keeps every PLD evaluation to one FFT of at most
#: this length. Below it the requested interval is used unchanged.
MAX_PLD_POINTS = 2**21

#: Most epsilon evaluations :func:`calibrate_noise_multiplier` makes (bracket search and
#: Brent's method together); each is one bounded accountant call.
MAX_CALIBRATION_EVALUATIONS = 120

#: Relative tolerance added to the absolute one in calibration: epsilon is computed to
#: about 1e-12 relative precision, so asking a multiplier of 1e5 for an absolute 1e-5 would
#: chase rounding noise.
_CALIBRATION_RTOL = 1e-9

#: Tail mass ``tau`` dp-accounting drops (pessimistically, into the infinite loss) when it
#: composes a PLD; the grid covers the losses outside of which at most ``tau`` lies.
_PLD_TAIL_MASS = 1e-15


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_finite(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ValueError unless it is a finite real > 0."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    out = float(value)  # type: ignore[arg-type]
    if not math.isfinite(out) or out <= 0.0:
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return out


def _check_delta(delta: object) -> float:
    if not _is_real(delta) or not 0.0 < float(delta) < 1.0:  # type: ignore[arg-type]
        raise ValueError(f"delta must be in the open interval (0, 1), got {delta!r}")
    return float(delta)  # type: ignore[arg-type]


def _check_sample_rate(sample_rate: object) -> float:
    if not _is_real(sample_rate) or not 0.0 < float(sample_rate) <= 1.0:  # type: ignore[arg-type]
        raise ValueError(
            f"sample_rate must be in the half-open interval (0, 1], got {sample_rate!r}"
        )
    return float(sample_rate)  # type: ignore[arg-type]


def _check_steps(steps: object) -> int:
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or int(steps) < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return int(steps)


def _check_mechanism(mechanism: object) -> NoiseMechanism:
    if mechanism == "gaussian":
        return "gaussian"
    if mechanism == "discrete_gaussian":
        return "discrete_gaussian"
    raise ValueError(f"mechanism must be one of {_MECHANISMS}, got {mechanism!r}")


def _check_method(method: object) -> AccountingMethod:
    if method == "pld":
        return "pld"
    if method == "rdp":
        return "rdp"
    raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


# --------------------------------------------------------------------------------------
# Approximate DP: Poisson-subsampled Gaussian via dp-accounting
# --------------------------------------------------------------------------------------


def _subsampled_gaussian_event(noise_multiplier: float, sample_rate: float, steps: int) -> DpEvent:
    import dp_accounting

    event: DpEvent = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        event = dp_accounting.PoissonSampledDpEvent(sample_rate, event)
    return dp_accounting.SelfComposedDpEvent(event, steps)


def _make_accountant(
    method: AccountingMethod, value_discretization_interval: float
) -> PrivacyAccountant:
    if method == "pld":
        from dp_accounting import pld

        return pld.PLDAccountant(value_discretization_interval=value_discretization_interval)
    from dp_accounting import rdp

    return rdp.RdpAccountant()


#: Gaussian releases by their parameters: ``{(noise_multiplier, sample_rate): count}``.
Releases = dict[tuple[float, float], int]


def _releases_accountant(
    releases: Releases, method: AccountingMethod, value_discretization_interval: float
) -> PrivacyAccountant:
    accountant = _make_accountant(method, value_discretization_interval)
    for (z, q), count in sorted(releases.items()):
        accountant.compose(_subsampled_gaussian_event(z, q, count))
    return accountant


def _rounds_accountant(
    rounds: dict[float, int],
    sample_rate: float,
    method: AccountingMethod,
    value_discretization_interval: float,
) -> PrivacyAccountant:
    return _releases_accountant(
        _at_rate(rounds, sample_rate), method, value_discretization_interval
    )


def _at_rate(rounds: dict[float, int], sample_rate: float) -> Releases:
    return {(z, sample_rate): count for z, count in rounds.items()}


def _loss_range(releases: Releases) -> float:
    """An upper estimate ``W`` of the privacy-loss range (nats) the PLD grid must cover.

    For each multiplier ``z`` (at sampling rate ``q``) run ``n`` times, the composed loss
    ``L`` exceeds the RDP bound ``eps_RDP(tau)`` (the RDP conversion at delta ``tau``,
    Mironov 2017) with probability at most ``tau``, and falls below ``-log(2 / tau)``
    with probability at most ``tau / 2`` (Markov on ``E[exp(-L)] = 1``). dp-accounting
    bounds the composed range with Chernoff orders no larger than ``20 / (one round's
    grid)``, which widens it by about one round's loss range; one unsampled Gaussian
    round's losses lie in ``mu^2 / 2 +- 8 mu`` with ``mu = 1 / z``, a width below
    ``1 / z^2 + 16 / z``, and sampling only narrows it. Composing the releases adds their
    ranges::

        W = sum_(z, q) [ eps_RDP,z,q(tau) + log(2 / tau) + 1 / z^2 + 16 / z ]
    """
    width = 0.0
    for (z, q), count in releases.items():
        upper = float(_releases_accountant({(z, q): count}, "rdp", 1.0).get_epsilon(_PLD_TAIL_MASS))
        width += upper + math.log(2.0 / _PLD_TAIL_MASS) + z**-2 + 16.0 / z
    return width


def pld_discretization(
    rounds: dict[float, int], sample_rate: float, value_discretization_interval: float
) -> float:
    """The PLD interval used for ``rounds`` at ``sample_rate``: the requested one, or
    coarser if needed (:func:`releases_discretization` of the same releases)."""
    return releases_discretization(_at_rate(rounds, sample_rate), value_discretization_interval)


def releases_discretization(releases: Releases, value_discretization_interval: float) -> float:
    """The PLD interval used for ``releases``: the requested one, or coarser if needed.

    ``max(h, W / MAX_PLD_POINTS)`` with ``W`` from :func:`_loss_range`, so that the grid
    of the composition holds at most about ``MAX_PLD_POINTS`` points whatever the rounds,
    sampling rates and multipliers. A coarser interval is still a valid upper bound on
    epsilon: dp-accounting rounds every loss up (pessimistic estimate; Koskela et al.
    2020, Doroshenko et al. 2022) and moves truncated tails to the infinite loss.
    Costs one RDP evaluation per distinct release.

    Raises:
        ValueError: when no finite range bounds the losses (the releases are not private).
    """
    width = _loss_range(releases)
    if not math.isfinite(width):
        raise ValueError(f"the privacy loss of releases {releases} is unbounded")
    return max(value_discretization_interval, width / MAX_PLD_POINTS)


def _rounds_epsilon(
    rounds: dict[float, int],
    sample_rate: float,
    delta: float,
    method: AccountingMethod,
    value_discretization_interval: float,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Epsilon of validated, non-empty ``rounds`` at one sampling rate."""
    return _releases_epsilon(
        _at_rate(rounds, sample_rate), delta, method, value_discretization_interval, mechanism
    )


def _releases_epsilon(
    releases: Releases,
    delta: float,
    method: AccountingMethod,
    value_discretization_interval: float,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Epsilon of validated, non-empty ``releases``; PLD on a grid of bounded size.

    Losses so large that the PLD grid's interval overflows a float's exponential are
    answered with ``inf``, an upper bound like any other. Discrete Gaussian releases are
    answered by :func:`_discrete_releases_epsilon`, whatever the method.
    """
    if mechanism == "discrete_gaussian":
        return _discrete_releases_epsilon(releases, delta)
    interval = value_discretization_interval
    if method == "pld":
        interval = releases_discretization(releases, interval)
    try:
        accountant = _releases_accountant(releases, method, interval)
    except OverflowError:
        return math.inf
    return float(accountant.get_epsilon(delta))


def gaussian_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: AccountingMethod = "pld",
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Epsilon at ``delta`` of ``steps`` rounds of the Poisson-subsampled Gaussian mechanism.

    Each round includes every record (example in DP-SGD, user in DP-FedAvg) independently
    with probability ``q = sample_rate``, clips each contribution to L2 norm ``C`` and adds
    ``N(0, (z C)^2 I)`` noise to the sum, with ``z = noise_multiplier`` (Abadi et al. 2016).
    With user-level clipping this is exactly DP-FedAvg (McMahan et al. 2018), and the
    guarantee is then user-level. ``q == 1`` means no sampling (the plain Gaussian mechanism
    composed ``steps`` times). The ``dp-accounting`` event is
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), steps)`` under the
    add-or-remove-one neighbouring relation.

    Methods:
        ``"rdp"``: Renyi DP (Mironov 2017). The subsampled Gaussian's RDP of order ``alpha``
        is computed numerically (Mironov, Talwar & Zhang 2019), RDP composes additively,
        ``eps_RDP(alpha) = T * eps_1(alpha)``, and is converted to ``(eps, delta)`` with
        the optimal-order conversion ``min_alpha eps_RDP(alpha) + log(1/delta)/(alpha-1)``
        (with the tighter refinements implemented in ``dp-accounting``). Fast but loose.

        ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022
        "connect the dots"). The per-step PLD is discretized with step
        ``value_discretization_interval``, self-composed by FFT convolution, and epsilon is
        read off the hockey-stick divergence. Nearly tight and always a valid (pessimistic)
        upper bound; a coarser interval is faster and looser. The interval is coarsened
        where the requested one would need a grid of more than ``MAX_PLD_POINTS`` points
        (:func:`pld_discretization`), so one call costs at most one FFT of that length.

    Args:
        noise_multiplier: ``z`` = noise standard deviation / L2 sensitivity; finite > 0.
        sample_rate: Poisson sampling probability ``q`` in (0, 1].
        steps: number of rounds ``T``, an integer >= 1.
        delta: target delta in (0, 1).
        method: ``"pld"`` (default) or ``"rdp"``.
        value_discretization_interval: PLD discretization step (ignored for RDP); finite > 0.
        mechanism: ``"gaussian"`` (default) or ``"discrete_gaussian"``, whose releases are
            accounted by :func:`discrete_gaussian_rdp` whatever the method.

    Returns:
        The smallest epsilon such that the composed mechanism is ``(epsilon, delta)``-DP
        according to the chosen accountant.

    Raises:
        ValueError: on any invalid argument; the message names it and its value.
    """
    z = _positive_finite("noise_multiplier", noise_multiplier)
    q = _check_sample_rate(sample_rate)
    t = _check_steps(steps)
    d = _check_delta(delta)
    m = _check_method(method)
    vdi = _positive_finite("value_discretization_interval", value_discretization_interval)
    return _rounds_epsilon({z: t}, q, d, m, vdi, _check_mechanism(mechanism))


def calibrate_noise_multiplier(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: AccountingMethod = "pld",
    *,
    tol: float = DEFAULT_CALIBRATION_TOL,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Smallest noise multiplier ``z`` whose ``steps``-fold subsampled Gaussian is
    ``(target_epsilon, delta)``-DP (``mechanism="discrete_gaussian"``: its discrete
    counterpart, by :func:`discrete_gaussian_rdp`; one stage, as by RDP).

    Epsilon (as computed by :func:`gaussian_epsilon`) is decreasing in ``z``, so this
    solves ``eps(z) = target_epsilon`` by Brent's method (``scipy.optimize.brentq``) on a
    bracket ``[lo, hi]`` with ``eps(lo) > target >= eps(hi)``, found cheaply:

    1. RDP: ``hi`` doubles from 1 (``lo`` halves from 1/2) until the bracket holds, then
       Brent gives ``z_RDP``.
    2. PLD only: since PLD is tighter than RDP, ``z* <= z_RDP``; the bracket is
       ``[z_RDP / 2^k, z_RDP 2^j]`` with ``k`` and ``j`` as small as hold (usually
       ``k = 1, j = 0``), then Brent again. Where RDP cannot reach the target at all
       (its finite orders put a floor under its epsilon), PLD starts from ``z = 1``.

    The returned ``z`` is within ``tol + 1e-9 z`` of the exact minimal ``z*`` of the chosen
    method *and* satisfies the target, ``gaussian_epsilon(z, ...) <= target_epsilon``:
    Brent's root ``r`` is kept if it meets the target, else ``r`` plus that tolerance, else
    the bracket's upper end. Each stage makes at most ``MAX_CALIBRATION_EVALUATIONS``
    epsilon evaluations (ArithmeticError beyond), each bounded as in
    :func:`gaussian_epsilon`.

    See :func:`gaussian_epsilon` for the mechanism, the methods and the references
    (Abadi et al. 2016; Mironov 2017; Koskela et al. 2020; Doroshenko et al. 2022;
    McMahan et al. 2018).

    Args:
        target_epsilon: the epsilon to reach; finite > 0.
        sample_rate: Poisson sampling probability ``q`` in (0, 1].
        steps: number of rounds ``T``, an integer >= 1.
        delta: target delta in (0, 1).
        method: ``"pld"`` (default) or ``"rdp"``.
        tol: absolute tolerance on ``z``; the default 1e-5 gives at least 3 significant
            digits for any ``z >= 0.01``. Finite > 0.
        value_discretization_interval: PLD discretization step (ignored for RDP); each PLD
            evaluation costs an FFT of about ``W / value_discretization_interval`` points.

    Raises:
        ValueError: on any invalid argument; the message names it and its value.
        ArithmeticError: when no multiplier is found within the evaluation budget.
    """
    eps = _positive_finite("target_epsilon", target_epsilon)
    q = _check_sample_rate(sample_rate)
    t = _check_steps(steps)
    d = _check_delta(delta)
    m = _check_method(method)
    tolerance = _positive_finite("tol", tol)
    vdi = _positive_finite("value_discretization_interval", value_discretization_interval)
    noise = _check_mechanism(mechanism)

    def gap(use: AccountingMethod) -> Callable[[float], float]:
        """``eps(z) - target`` by ``use``, refused past the evaluation budget."""
        evaluations = 0

        def over(z: float) -> float:
            nonlocal evaluations
            evaluations += 1
            if evaluations > MAX_CALIBRATION_EVALUATIONS:
                raise ArithmeticError(
                    f"no noise multiplier reaches epsilon {eps:g} at delta={d:g} over {t} "
                    f"rounds at q={q:g} within {MAX_CALIBRATION_EVALUATIONS} {use} evaluations"
                )
            return _rounds_epsilon({z: t}, q, d, use, vdi, noise) - eps

        return over

    if m == "rdp" or noise == "discrete_gaussian":
        return _solve_decreasing(gap("rdp"), 1.0, 0.5, tolerance)
    try:
        start = _solve_decreasing(gap("rdp"), 1.0, 0.5, tolerance)
    except ArithmeticError:  # RDP's orders cannot reach the target: PLD searches alone
        start = 1.0
    return _solve_decreasing(gap("pld"), start, start / 2.0, tolerance)


def _solve_decreasing(gap: Callable[[float], float], high: float, low: float, tol: float) -> float:
    """The smallest ``z`` (within ``tol``) with ``gap(z) <= 0``, for ``gap`` decreasing.

    ``high`` doubles while ``gap(high) > 0`` and ``low`` halves while ``gap(low) <= 0``;
    Brent's method then finds the root in ``[low, high]`` to within
    ``tol + _CALIBRATION_RTOL * z``, and the first of the root, the root plus that step and
    ``high`` that meets the target is returned.
    """
    from scipy import optimize

    while gap(high) > 0:
        low, high = high, 2.0 * high
    while low < high and gap(low) <= 0:
        high, low = low, low / 2.0
    root = float(optimize.brentq(gap, low, high, xtol=tol, rtol=_CALIBRATION_RTOL))
    step = tol + _CALIBRATION_RTOL * root
    for candidate in (root, root + step):
        if candidate <= high and gap(candidate) <= 0:
            return candidate
    return high


def gaussian_rounds_epsilon(
    rounds: dict[float, int],
    sample_rate: float,
    delta: float,
    method: AccountingMethod = "pld",
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Epsilon at ``delta`` of rounds of the Poisson-subsampled Gaussian whose noise differs.

    ``rounds`` maps a noise multiplier ``z`` to the number of rounds run with it, all at
    sampling rate ``q``: :func:`releases_epsilon` of ``{(z, q): count}``. With a single
    ``z`` this is :func:`gaussian_epsilon`. No rounds at all spend nothing: epsilon 0.

    Raises:
        ValueError: on any invalid argument; the message names it and its value.
    """
    q = _check_sample_rate(sample_rate)
    return releases_epsilon(
        {(z, q): count for z, count in rounds.items()},
        delta,
        method,
        value_discretization_interval=value_discretization_interval,
        mechanism=mechanism,
    )


def releases_epsilon(
    releases: Mapping[tuple[float, float], int],
    delta: float,
    method: AccountingMethod = "pld",
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    mechanism: NoiseMechanism = "gaussian",
) -> float:
    """Epsilon at ``delta`` of Poisson-subsampled Gaussian releases whose parameters differ.

    ``releases`` maps ``(z, q)``, a noise multiplier and a sampling rate, to the number of
    releases made with them: DP-SGD steps (Abadi et al. 2016), federated rounds, or both,
    as for a silo whose steps at one rate are composed with those at another. The events
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), count)`` are
    composed in one accountant (RDP adds the orders' divergences, PLD convolves the loss
    distributions, on a grid of at most about ``MAX_PLD_POINTS`` points). No releases at
    all spend nothing: epsilon 0. ``mechanism="discrete_gaussian"``: the releases add
    exact discrete Gaussian noise and are accounted by
    :func:`discrete_gaussian_releases_epsilon`, whatever the method.

    Raises:
        ValueError: on any invalid argument; the message names it and its value.
    """
    d = _check_delta(delta)
    m = _check_method(method)
    vdi = _positive_finite("value_discretization_interval", value_discretization_interval)
    noise = _check_mechanism(mechanism)
    checked: Releases = {}
    for (z, q), count in releases.items():
        key = (_positive_finite("noise_multiplier", z), _check_sample_rate(q))
        checked[key] = checked.get(key, 0) + _check_steps(count)
    if not checked:
        return 0.0
    return _releases_epsilon(checked, d, m, vdi, noise)


@dataclass
class GaussianRoundsAccountant:
    """The running (epsilon, delta) of a sequence of Poisson-subsampled Gaussian rounds.

    Holds how many releases ran at each noise multiplier and answers
    :func:`gaussian_rounds_epsilon` for them. ``epsilon_after(z, count)`` says what
    ``count`` more releases at ``z`` would bring the total to (one federated round, or a
    silo's DP-SGD steps of one round), so that a caller can refuse a round before it
    runs. ``mechanism`` says which noise the releases add (see :func:`releases_epsilon`).
    A pure-math object: no I/O, persistence is the caller's (``rounds`` is a plain
    dict of floats to ints).
    """

    sample_rate: float
    delta: float
    method: AccountingMethod = "pld"
    rounds: dict[float, int] | None = None
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL
    mechanism: NoiseMechanism = "gaussian"

    def __post_init__(self) -> None:
        self.sample_rate = _check_sample_rate(self.sample_rate)
        self.delta = _check_delta(self.delta)
        self.method = _check_method(self.method)
        self.mechanism = _check_mechanism(self.mechanism)
        self.rounds = {} if self.rounds is None else dict(self.rounds)

    def _with(self, noise_multiplier: float, count: int) -> dict[float, int]:
        assert self.rounds is not None
        key = _positive_finite("noise_multiplier", noise_multiplier)
        return {**self.rounds, key: self.rounds.get(key, 0) + _check_steps(count)}

    def _epsilon(self, rounds: dict[float, int]) -> float:
        return gaussian_rounds_epsilon(
            rounds,
            self.sample_rate,
            self.delta,
            self.method,
            value_discretization_interval=self.value_discretization_interval,
            mechanism=self.mechanism,
        )

    def epsilon(self) -> float:
        """Epsilon at ``delta`` of the rounds recorded so far (0 before the first)."""
        assert self.rounds is not None
        return self._epsilon(self.rounds)

    def epsilon_after(self, noise_multiplier: float, count: int = 1) -> float:
        """Epsilon if ``count`` more releases at ``noise_multiplier`` were recorded (nothing
        changes)."""
        return self._epsilon(self._with(noise_multiplier, count))

    def record(self, noise_multiplier: float, count: int = 1) -> None:
        """Count ``count`` releases run at ``noise_multiplier``."""
        self.rounds = self._with(noise_multiplier, count)


# --------------------------------------------------------------------------------------
# The discrete Gaussian: zCDP, Poisson subsampling, sums of shares
# --------------------------------------------------------------------------------------


def discrete_gaussian_rdp(
    noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]
) -> tuple[float, ...]:
    """Renyi DP, at each order, of one Poisson-subsampled discrete Gaussian release.

    Without sampling (``q = 1``): noise ``N_Z(0, sigma^2)`` per coordinate on integer
    vectors of L2 sensitivity ``Delta``, ``z = sigma / Delta``, is ``rho``-zCDP with
    ``rho = 1 / (2 z^2)`` (Canonne, Kamath and Steinke 2020, Theorem 14 with Proposition
    5): ``eps(alpha) = alpha rho``, the continuous Gaussian's RDP, at every order.

    With sampling rate ``q < 1``, at integer orders ``alpha >= 2``, the general Poisson
    subsampling bound of Zhu and Wang (2019, Theorem 6), which needs nothing of the
    mechanism but its RDP ``eps(l) = l rho``::

        eps_q(alpha) <= log( (1-q)^(alpha-1) (alpha q - q + 1)
                             + C(alpha, 2) q^2 (1-q)^(alpha-2) e^(eps(2))
                             + 3 sum_(l=3..alpha) C(alpha, l) q^l (1-q)^(alpha-l)
                                 e^((l-1) eps(l)) ) / (alpha - 1)

    capped by ``alpha rho`` (sampling never hurts: Renyi divergence is jointly
    quasi-convex). The continuous Gaussian's exact value (Mironov, Talwar and Zhang 2019)
    is the same sum without the factor 3, so this is never below it. A fractional order
    takes the bound of the next integer (Renyi divergence grows with the order).
    """
    from scipy.special import gammaln, logsumexp

    rho = 0.5 / noise_multiplier**2
    if sample_rate >= 1.0:
        return tuple(alpha * rho for alpha in orders)
    log_q, log_1q = math.log(sample_rate), math.log1p(-sample_rate)
    values = []
    for order in orders:
        alpha = max(2, math.ceil(order))
        ell = np.arange(2, alpha + 1, dtype=np.float64)
        terms = (
            gammaln(alpha + 1.0) - gammaln(ell + 1.0) - gammaln(alpha - ell + 1.0)
            + ell * log_q + (alpha - ell) * log_1q + (ell - 1.0) * ell * rho
        )  # fmt: skip
        terms[1:] += math.log(3.0)
        first = (alpha - 1) * log_1q + math.log1p((alpha - 1) * sample_rate)
        bound = float(logsumexp(np.append(terms, first))) / (alpha - 1)
        values.append(min(bound, order * rho))
    return tuple(values)


@functools.lru_cache(maxsize=1024)
def _discrete_rdp_cached(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return discrete_gaussian_rdp(noise_multiplier, sample_rate, tuple(DEFAULT_RDP_ORDERS))


def _discrete_releases_epsilon(releases: Releases, delta: float) -> float:
    """Epsilon at ``delta`` of validated discrete Gaussian releases: RDP composed
    (``sum count * eps_(z,q)(alpha)``) at dp-accounting's default orders and converted by
    its ``compute_epsilon`` (Mironov 2017 with the refinement of Canonne, Kamath and
    Steinke 2020, Proposition 12)."""
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

    total = np.zeros(len(DEFAULT_RDP_ORDERS))
    for (z, q), count in releases.items():
        total += count * np.asarray(_discrete_rdp_cached(z, q))
    if not np.all(np.isfinite(total)):
        return math.inf
    return float(compute_epsilon(DEFAULT_RDP_ORDERS, total, delta)[0])


def discrete_gaussian_releases_epsilon(
    releases: Mapping[tuple[float, float], int], delta: float
) -> float:
    """Epsilon at ``delta`` of Poisson-subsampled discrete Gaussian releases,
    ``releases[(z, q)]`` of them at multiplier ``z`` and sampling rate ``q``: the same as
    ``releases_epsilon(releases, delta, mechanism="discrete_gaussian")``.

    Each release's RDP is :func:`discrete_gaussian_rdp`; they add up, order by order
    (Mironov 2017), and the sum is converted to ``(epsilon, delta)``. Never below the
    continuous Gaussian's epsilon by the same RDP accountant, equal to it without
    sampling; above the continuous PLD figure, which is not proven to hold for the
    discrete noise.

    Raises:
        ValueError: on any invalid argument; the message names it and its value.
    """
    return releases_epsilon(releases, delta, "rdp", mechanism="discrete_gaussian")


def discrete_gaussian_sum_multiplier(
    noise_multiplier: float, share_std: float, shares: int, dim: int
) -> float:
    """The multiplier a sum of discrete Gaussian shares is charged at.

    ``shares`` (``n``) devices each add ``N_Z(0, sigma^2)`` (``sigma = share_std`` lattice
    steps) to every one of ``dim`` (``d``) integer coordinates, and ``noise_multiplier``
    ``z`` is what the sum would have were it one discrete Gaussian (``sqrt(n) sigma /
    Delta``). The sum is not one. Two valid bounds, of which the larger multiplier is
    returned:

    * one share alone: the sum is one share plus independent noise (post-processing), so
      it is at least as private as ``N_Z(0, sigma^2)``: multiplier ``z / sqrt(n)``;
    * for ``sigma >= 1``, Kairouz, Liu and Steinke (2021, Theorem 1): ``eps^2 / 2``-zCDP
      with ``eps^2 = 1 / z^2 + 2 tau d`` (the larger of the constants ``tau d / 2`` and
      ``2 tau d`` in circulation), ``tau = 10 sum_(k=1..n-1) exp(-2 pi^2 sigma^2 k /
      (k + 1)) <= 10 (n - 1) exp(-pi^2 sigma^2)`` (the bound on ``tau`` is what is used):
      multiplier ``1 / eps``, within a hair of ``z`` once ``sigma`` is a few steps.

    Composing two such sums (updates and a count) adds their ``eps^2``; a caller may
    charge both at once with the smaller ``sigma`` and the sum of the ``d``.
    """
    z = _positive_finite("noise_multiplier", noise_multiplier)
    sigma = _positive_finite("share_std", share_std)
    if shares <= 1:
        return z
    single = z / math.sqrt(shares)
    if sigma < 1.0:
        return single
    tau = 10.0 * (shares - 1) * math.exp(-(math.pi**2) * sigma * sigma)
    return max(single, 1.0 / math.sqrt(z**-2 + 2.0 * tau * dim))
