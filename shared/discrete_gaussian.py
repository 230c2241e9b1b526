"""The exact discrete Gaussian distribution on the integers, and its sampler.

``N_Z(0, sigma^2)`` puts mass ``exp(-y^2 / (2 sigma^2)) / Z`` on every integer ``y``, with
``Z = sum_y exp(-y^2 / (2 sigma^2))`` (Canonne, Kamath and Steinke, *The Discrete Gaussian
for Differential Privacy*, NeurIPS 2020). Added to an integer vector whose neighbours
differ by at most ``Delta`` in L2 norm, independent ``N_Z(0, sigma^2)`` noise on every
coordinate satisfies ``Delta^2 / (2 sigma^2)``-zCDP, exactly the bound of the continuous
Gaussian (their Theorem 14): Renyi divergence of order ``alpha`` at most
``alpha Delta^2 / (2 sigma^2)``.

Sampling (:func:`discrete_gaussian`) is their Algorithm 3, with no floating point: with
``t = floor(sigma) + 1``, draw ``Y`` from the discrete Laplace ``P(Y = y) ∝ exp(-|y| / t)``
(:meth:`shared.randomness.RandomSource.discrete_laplace`, their Algorithm 2) and accept it
with probability ``exp(-gamma)``, ``gamma = (|Y| - sigma^2 / t)^2 / (2 sigma^2)``; the
accepted ``Y`` is exactly ``N_Z(0, sigma^2)``. For ``sigma^2 = n / d`` in lowest terms,
``gamma = (|Y| d t - n)^2 / (2 n d t^2)``, a ratio of integers computed exactly with
Python's integers. The trial ``Bernoulli(exp(-gamma))`` is their Algorithm 1: ``floor
(gamma)`` trials at ``gamma = 1`` and one at the fractional part ``f``, which draws
``A_k ~ Bernoulli(f / k)`` for ``k = 1, 2, ...`` until the first failure and succeeds when
that ``k`` is odd. ``Bernoulli(f / k)`` is ``Bernoulli(f)`` and ``Bernoulli(1 / k)``
together; ``Bernoulli(r / D)`` for integers ``r < D`` compares a uniform 64-bit word ``W``
with ``T = floor(2^64 r / D)``: ``W < T`` succeeds, ``W > T`` fails, and a tie (chance
``2^-64``) draws ``Bernoulli(r' / D)`` with ``r' = 2^64 r mod D``, which makes the
probability exactly ``T / 2^64 + r' / (D 2^64) = r / D``.

The integers are large (``D`` has about 4 log2(sigma) + 2 log2(d) bits), so each
``gamma`` is first computed in floating point with a proven error bound and a wide
margin; only where the margin leaves the integer part of ``gamma``, or a comparison of
``W`` with ``T``, undecided (a chance of about ``2^-35 (S + 1)`` per trial, ``S`` below)
are the exact integers computed. Every outcome is decided exactly as the integer
algorithm decides it.

Everything is vectorized over rejection rounds (a round draws 1.4 candidates for every
value still missing, and the accepted ones fill the missing values in order), never over
values.
The bits come from :class:`shared.randomness.RandomSource`: the operating system's CSPRNG
for ``rng=None``, a seeded ``numpy.random.Generator`` in simulations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational

import numpy as np
import numpy.typing as npt

from shared.randomness import RandomSource, Rng, as_source

__all__ = [
    "MAX_VARIANCE",
    "discrete_gaussian",
    "discrete_gaussian_pmf",
    "exact_variance",
]

#: Largest ``sigma^2`` accepted: ``sigma <= 2^40`` keeps every integer of the discrete
#: Laplace step (``t k`` for the trial index ``k``) and every output within int64.
MAX_VARIANCE = Fraction(2**80)

#: Candidates drawn per missing value: a candidate is accepted with probability about 0.52
#: (sigma below 1) to 0.76 (large sigma), so 1.4 of them fill most values in one round.
_OVERSAMPLING = 1.4

#: Widest support :func:`discrete_gaussian_pmf` sums term by term (sigma up to about 25,000).
_DIRECT_SUM_REACH = 1_000_000


def exact_variance(variance: int | float | Fraction) -> Fraction:
    """``sigma^2`` as an exact fraction: a float is converted exactly (every double is a
    dyadic rational), an int or Fraction kept as it is.

    Raises:
        ValueError: unless ``0 < sigma^2 <= MAX_VARIANCE`` (and finite).
    """
    if isinstance(variance, bool) or not isinstance(variance, int | float | Rational):
        raise ValueError(f"the variance must be an int, float or Fraction, got {variance!r}")
    if isinstance(variance, float) and not math.isfinite(variance):
        raise ValueError(f"the variance must be finite, got {variance!r}")
    exact = Fraction(variance)
    if not 0 < exact <= MAX_VARIANCE:
        raise ValueError(f"the variance must lie in (0, 2^80], got {variance!r}")
    return exact


def discrete_gaussian(
    variance: int | float | Fraction,
    size: int | tuple[int, ...],
    rng: Rng | RandomSource = None,
) -> np.ndarray:
    """Independent draws of ``N_Z(0, sigma^2)``, exactly (int64, of shape ``size``).

    ``variance`` is ``sigma^2`` (a float is taken as the exact rational it is). Canonne,
    Kamath and Steinke (2020), Algorithm 3, vectorized: see the module docstring.

    Raises:
        ValueError: for a variance outside ``(0, 2^80]`` or a negative size.
    """
    exact = exact_variance(variance)
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
        raise ValueError(f"size must be a non-negative int or a tuple of them, got {size!r}")
    count = math.prod(shape)
    source = as_source(rng)
    n, d = exact.numerator, exact.denominator
    t = math.isqrt(n // d) + 1  # floor(sigma) + 1: floor(sqrt(x)) = isqrt(floor(x))
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        # Candidates for every missing value and some: about one round in all. The
        # accepted ones are independent draws of N_Z(0, sigma^2), taken in their order.
        want = count - filled
        candidates = source.discrete_laplace(1, t, math.ceil(_OVERSAMPLING * want) + 4)
        accepted = candidates[_run_trials(_acceptance_trials(candidates, n, d, t), source)]
        taken = accepted[:want]
        out[filled : filled + taken.size] = taken
        filled += taken.size
    return out.reshape(shape)


def bernoulli_exp_ratio(
    numerators: npt.NDArray[np.object_], denominator: int, source: RandomSource
) -> np.ndarray:
    """Booleans, True with probability exactly ``exp(-numerators[i] / denominator)``.

    ``numerators`` holds non-negative Python integers of any size (an object array);
    ``denominator`` is a positive integer. Canonne, Kamath and Steinke (2020), Algorithm 1
    with exact big-integer arithmetic (see the module docstring).
    """
    remainders = numerators % denominator
    thresholds = ((remainders << 64) // denominator).astype(np.uint64)
    trials = _ExpTrials(
        (numerators // denominator).astype(np.int64),
        thresholds,
        thresholds,
        lambda i: int(remainders[i]),
        denominator,
    )
    return _run_trials(trials, source)


@dataclass(frozen=True)
class _ExpTrials:
    """Trials ``Bernoulli(exp(-gamma_i))``, ``gamma_i = whole_i + r_i / D``, ``r_i < D``.

    ``T_i = floor(2^64 r_i / D)`` is known to lie in ``[low_i, high_i]``; ``remainder(i)``
    gives the exact ``r_i``, asked for only when a uniform word falls in that range.
    """

    whole: np.ndarray
    low: np.ndarray
    high: np.ndarray
    remainder: Callable[[int], int]
    denominator: int


#: The floating-point screen's margin on gamma, relative to ``S + 1`` (see below).
_SCREEN_MARGIN = 2.0**-36
#: Largest float below 2^64 (``2^64 - 2^11``): float thresholds are clamped to it.
_BELOW_2_64 = float(2**64 - 2**11)


def _acceptance_trials(candidates: np.ndarray, n: int, d: int, t: int) -> _ExpTrials:
    """The acceptance trials of Algorithm 3 for ``sigma^2 = n / d``: ``gamma(y) = (|y| d t -
    n)^2 / D``, ``D = 2 n d t^2``, screened in floating point.

    With ``a = |y| d t`` and ``S = (a + n)^2 / D`` (both in float64), the float value of
    ``gamma`` is within ``16 u S`` of the exact one (``u = 2^-53``: a relative error of at
    most ``5 u (a + n)`` in ``a - n``, squared, and ``3 u`` from the square and the
    division). Widened by the margin ``m = 2^-36 (S + 1)``, thousands of times that, the
    interval ``[gamma - m, gamma + m]`` holds the exact ``gamma``: when its ends have the
    same integer part, that is ``whole``, and ``floor(2^64 f)`` of the fractional part
    ``f`` lies between the thresholds of its ends; otherwise (a chance of about ``m``)
    ``whole`` and ``T`` are computed exactly from Python integers. A uniform word between
    the two thresholds (a chance of about ``2 m``) is decided by the exact remainder.
    """
    scale = 2 * n * d * t * t
    magnitude = np.abs(candidates)
    a = magnitude.astype(np.float64) * float(d * t)
    n_float, scale_float = float(n), float(scale)
    gamma = (a - n_float) ** 2 / scale_float
    margin = _SCREEN_MARGIN * ((a + n_float) ** 2 / scale_float + 1.0)
    lower = np.maximum(gamma - margin, 0.0)
    upper = gamma + margin
    whole = np.floor(lower)
    unclear = np.flatnonzero(whole != np.floor(upper))
    low = np.floor(np.minimum((lower - whole) * 2.0**64, _BELOW_2_64)).astype(np.uint64)
    high = np.ceil(np.minimum((upper - whole) * 2.0**64, _BELOW_2_64)).astype(np.uint64)
    whole_int = whole.astype(np.int64)

    def remainder(i: int) -> int:
        return ((int(magnitude[i]) * d * t - n) ** 2) % scale

    for i in unclear:
        exact_whole, rest = divmod((int(magnitude[i]) * d * t - n) ** 2, scale)
        whole_int[i] = exact_whole
        low[i] = high[i] = (rest << 64) // scale
    return _ExpTrials(whole_int, low, high, remainder, scale)


def _run_trials(trials: _ExpTrials, source: RandomSource) -> np.ndarray:
    """Run every trial: Algorithm 1 on the fractional part, ``A_k ~ Bernoulli(f)
    Bernoulli(1 / k)`` until the first failure, success if that ``k`` is odd; then
    ``whole`` trials at ``gamma = 1`` (:meth:`RandomSource.bernoulli_exp`)."""
    result = np.zeros(trials.whole.size, dtype=bool)
    active = np.arange(trials.whole.size)
    k = 1
    while active.size:
        words = source.words(active.size)
        low, high = trials.low[active], trials.high[active]
        success = words < low
        for at in np.flatnonzero((words >= low) & (words <= high)):
            success[at] = _below_fraction(
                int(words[at]), trials.remainder(int(active[at])), trials.denominator, source
            )
        if k > 1:
            success &= source.integers(k, active.size) == 0
        result[active[~success]] = k % 2 == 1
        active = active[success]
        k += 1
    heavy = np.flatnonzero(result & (trials.whole > 0))
    if heavy.size:
        result[heavy] = source.bernoulli_exp(trials.whole[heavy], 1)
    return result


def _below_fraction(word: int, remainder: int, denominator: int, source: RandomSource) -> bool:
    """``Bernoulli(r / D)`` given its first uniform word ``W``: ``W < T`` succeeds and
    ``W > T`` fails, ``T = floor(2^64 r / D)``; a tie draws ``Bernoulli(r' / D)``, ``r' =
    2^64 r mod D``."""
    threshold, tie = divmod(remainder << 64, denominator)
    if word != threshold:
        return word < threshold
    return _bernoulli_rational(tie, denominator, source)


def _bernoulli_rational(numerator: int, denominator: int, source: RandomSource) -> bool:
    """One draw, True with probability exactly ``numerator / denominator`` (< 1): compare
    uniform 64-bit words with the base-2^64 digits of the ratio until they differ."""
    while True:
        numerator <<= 64
        digit, numerator = divmod(numerator, denominator)
        word = source.word()
        if word != digit:
            return word < digit


def discrete_gaussian_pmf(values: npt.ArrayLike, variance: int | float | Fraction) -> np.ndarray:
    """``P(Y = y) = exp(-y^2 / (2 sigma^2)) / Z`` of ``N_Z(0, sigma^2)``, in floating point.

    ``Z`` sums ``exp(-y^2 / (2 sigma^2))`` over ``|y| <= ceil(40 sigma) + 40`` with
    ``math.fsum`` (each term within about 1e-16 relative); the terms left out add less
    than ``exp(-800)`` relative, so the result is within about 1e-15 relative of the exact
    pmf. Past a million terms (sigma above about 25,000) ``Z`` is the Poisson summation
    ``sigma sqrt(2 pi) sum_k exp(-2 pi^2 sigma^2 k^2)``, whose terms ``|k| >= 1`` are then
    far below a double's precision. For tests and planning; the sampler uses none of this.
    """
    sigma2 = float(exact_variance(variance))
    sigma = math.sqrt(sigma2)
    reach = math.ceil(40.0 * sigma) + 40
    if reach <= _DIRECT_SUM_REACH:
        ys = np.arange(-reach, reach + 1, dtype=np.float64)
        normalizer = math.fsum(np.exp(-(ys**2) / (2.0 * sigma2)).tolist())
    else:  # Poisson summation: Z = sigma sqrt(2 pi) (1 + 2 sum_k exp(-2 pi^2 sigma^2 k^2))
        normalizer = (
            sigma * math.sqrt(2.0 * math.pi) * (1.0 + 2.0 * math.exp(-2 * math.pi**2 * sigma2))
        )
    points = np.asarray(values, dtype=np.float64)
    return np.exp(-(points**2) / (2.0 * sigma2)) / normalizer
