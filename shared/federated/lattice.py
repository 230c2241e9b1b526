"""Clipped updates on an integer lattice, and exact discrete Gaussian noise on it.

A clipped update ``x`` (``||x|| <= C``) of ``d`` coordinates is mapped to integers by a
public **step** ``g = 2^(floor(log2 C) - LATTICE_BITS)``, a power of two, so that
``c = C / g`` lies in ``[2^16, 2^17)`` and ``x / g``, the scaled update, is computed
exactly. It is then rounded to an integer vector by **conditional randomized rounding**
(Kairouz, Liu and Steinke, *The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation*, ICML 2021): every coordinate ``v`` becomes
``floor(v) + Bernoulli(v - floor(v))`` (unbiased), and the whole vector is drawn again
while its L2 norm exceeds the bound

    ``Delta = min(c + sqrt(d), sqrt(c^2 + d / 4 + sqrt(2 ln(1 / beta)) (c + sqrt(d) / 2)))``

with ``beta = ROUNDING_FAILURE``. The first term holds for every rounding (each
coordinate moves by less than 1); the second fails with probability at most ``beta``
(Hoeffding: ``||round(v)||^2`` is a sum of independent terms of mean at most
``v_i^2 + 1/4`` and range at most ``2 |v_i| + 1``, whose squares sum to at most
``(2 c + sqrt(d))^2``). After ``MAX_ROUNDING_DRAWS`` draws over the bound (chance
``beta^64``) the vector is rounded toward zero instead, whose norm is at most ``c``.
So **every** rounded update has integer coordinates and norm at most ``Delta``, checked
exactly: the L2 sensitivity on the lattice is ``Delta`` (one user added or removed) or
``2 Delta`` (one replaced), a little above ``c``; rounding costs ``Delta / c - 1``, about
``1/c + d / (8 c^2)``, a few parts in 10^5 for the largest models.

Noise is ``N_Z(0, (z Delta)^2)`` on every coordinate (:func:`shared.discrete_gaussian.
discrete_gaussian`, exact), which makes the release ``1 / (2 z^2)``-zCDP with respect to
the sensitivity ``Delta`` (Canonne, Kamath and Steinke 2020): the noise multiplier ``z``
keeps its meaning, and the rounding is paid for in noise (``z Delta g``, a fraction
``Delta / c - 1`` above ``z C``). The result is mapped back by the step: ``g (round(x / g)
+ noise)``, exact in float64 for integers below ``2^53``.

The unclipped bits of adaptive clipping use the lattice ``{0, L}`` with ``L =
count_scale(sigma)`` (``COUNT_SCALE``, or a smaller power of two for a very large
``sigma``): a bit ``b`` becomes ``b L``, its noise ``N_Z(0, (L sigma)^2)``; ``L`` is even,
so that the centred bit ``b - 1/2`` of Andrew et al. is an integer too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shared.discrete_gaussian import discrete_gaussian
from shared.randomness import RandomSource, Rng, as_source

__all__ = [
    "COUNT_SCALE",
    "LATTICE_BITS",
    "MAX_COUNT_NOISE",
    "Lattice",
    "count_on_lattice",
    "count_scale",
    "noisy_count",
    "noise_variance",
]

#: The lattice has ``2^LATTICE_BITS`` to ``2^(LATTICE_BITS + 1)`` steps per clip norm.
LATTICE_BITS = 16

#: ``beta``: the chance that one randomized rounding exceeds the Hoeffding bound.
ROUNDING_FAILURE = 0.05

#: Roundings drawn before rounding toward zero (each over the bound with chance <= beta).
MAX_ROUNDING_DRAWS = 64

#: The lattice of a count: a unit is at most ``COUNT_SCALE`` integer steps (see above).
COUNT_SCALE = 1 << 16

#: Largest count noise std: ``2 MAX_COUNT_NOISE`` lattice steps stay within the sampler's
#: range (``sigma <= 2^40``).
MAX_COUNT_NOISE = float(1 << 38)

#: Bits kept after the binary point when ``(z Delta)^2`` is rounded up to a dyadic rational.
_VARIANCE_BITS = 20


def noise_variance(std: float) -> Fraction:
    """``sigma^2`` for a wanted ``sigma = std``: ``std^2`` rounded *up* to a multiple of
    ``2^-20`` (exact rational arithmetic), so the noise is never below the one asked for."""
    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"the noise std must be a finite number > 0, got {std!r}")
    scaled = Fraction(std) ** 2 * (1 << _VARIANCE_BITS)
    return Fraction(math.ceil(scaled), 1 << _VARIANCE_BITS)


@dataclass(frozen=True)
class Lattice:
    """The lattice of updates of ``dim`` coordinates clipped to ``clip_norm``."""

    clip_norm: float
    dim: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a finite number > 0, got {self.clip_norm!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {self.dim!r}")

    @property
    def step(self) -> float:
        """``g = 2^(floor(log2 C) - LATTICE_BITS)``: a power of two, public."""
        return math.ldexp(1.0, math.frexp(self.clip_norm)[1] - 1 - LATTICE_BITS)

    @property
    def scaled_clip(self) -> float:
        """``c = C / g``, in ``[2^16, 2^17)`` (exact: ``g`` is a power of two)."""
        return self.clip_norm / self.step

    @property
    def bound(self) -> float:
        """``Delta``: the largest L2 norm of a rounded update (see the module docstring),
        rounded up by a part in 10^12 so that float rounding cannot make it too small."""
        c, d = self.scaled_clip, float(self.dim)
        always = c + math.sqrt(d)
        hoeffding = math.sqrt(
            c * c + d / 4 + math.sqrt(2 * math.log(1 / ROUNDING_FAILURE)) * (c + math.sqrt(d) / 2)
        )
        return min(always, hoeffding) * (1 + 1e-12)

    def round(self, rows: np.ndarray, rng: Rng | RandomSource = None) -> np.ndarray:
        """Every row (L2 norm at most ``C``) as an int64 vector of norm at most ``Delta``:
        conditional randomized rounding of ``row / g``.

        Raises:
            ValueError: for rows of another width or with a norm above ``C``.
        """
        scaled = np.asarray(rows, dtype=np.float64) / self.step
        if scaled.ndim != 2 or scaled.shape[1] != self.dim:
            raise ValueError(f"rows must be (m, {self.dim}), got shape {scaled.shape}")
        if not np.all(np.linalg.norm(scaled, axis=1) <= self.scaled_clip * (1 + 1e-9)):
            raise ValueError(f"every row must be clipped to L2 norm {self.clip_norm:g} first")
        source = as_source(rng)
        limit = math.floor(Fraction(self.bound) ** 2)
        base = np.floor(scaled)
        fraction = scaled - base
        out = np.zeros(scaled.shape, dtype=np.int64)
        pending = np.arange(scaled.shape[0])
        for _ in range(MAX_ROUNDING_DRAWS):
            if not pending.size:
                return out
            up = source.uniform(pending.size * self.dim).reshape(-1, self.dim) < fraction[pending]
            draws = base[pending].astype(np.int64) + up
            within = _squared_norms(draws) <= limit
            out[pending[within]] = draws[within]
            pending = pending[~within]
        out[pending] = np.trunc(scaled[pending]).astype(np.int64)  # norm <= ||row / g|| <= c
        if not np.all(_squared_norms(out) <= limit):
            raise ArithmeticError("a rounded update exceeds the lattice's norm bound")
        return out

    def noise(
        self, multiplier: float, shape: int | tuple[int, ...], rng: Rng | RandomSource = None
    ) -> np.ndarray:
        """``N_Z(0, (z Delta)^2)`` on every coordinate (int64), ``z = multiplier > 0``."""
        return discrete_gaussian(noise_variance(multiplier * self.bound), shape, rng)

    def noisy_round(
        self, rows: np.ndarray, multiplier: float, rng: Rng | RandomSource = None
    ) -> np.ndarray:
        """``round(row / g) + N_Z(0, (z Delta)^2 I)`` for every clipped row, on the lattice
        (int64; times ``g`` it is the update again); without noise (``z = 0``) the rounded
        rows alone."""
        source = as_source(rng)
        lattice = self.round(rows, source)
        if multiplier > 0:
            lattice = lattice + self.noise(multiplier, lattice.shape, source)
        return lattice

    def noisy_sum(
        self, rows: np.ndarray, multiplier: float, rng: Rng | RandomSource = None
    ) -> np.ndarray:
        """``g (sum_k round(row_k / g) + N_Z(0, (z Delta)^2 I))``: the rows' sum on the
        lattice, noised once (``z = 0``: no noise)."""
        source = as_source(rng)
        total = self.round(rows, source).sum(axis=0)
        if multiplier > 0:
            total = total + self.noise(multiplier, total.shape, source)
        return total * self.step


def count_scale(std: float) -> int:
    """``L``: the largest power of two from 2 to ``COUNT_SCALE`` with ``L std <= 2^40``.

    Raises:
        ValueError: for a std above ``MAX_COUNT_NOISE`` (or not a finite number >= 0).
    """
    if not (math.isfinite(std) and 0 <= std <= MAX_COUNT_NOISE):
        raise ValueError(f"a count's noise std must lie in [0, 2^38], got {std!r}")
    scale = COUNT_SCALE
    while scale > 2 and scale * std > 2.0**40:
        scale //= 2
    return scale


def count_on_lattice(count: np.ndarray | float, std: float, rng: Rng | RandomSource = None) -> int:
    """``sum_k rint(L c_k) + N_Z(0, (L std)^2)`` with ``L = count_scale(std)``: counts
    ``c_k`` in ``[0, 1]`` (bits, maybe already noised) summed on the count's lattice, and
    noise added there (none for ``std = 0``, where ``L = COUNT_SCALE``)."""
    scale = count_scale(std)
    units = np.asarray(count, dtype=np.float64) * scale
    total = int(np.rint(units).astype(np.int64).sum())
    if std > 0:
        total += int(discrete_gaussian(noise_variance(std * scale), 1, rng)[0])
    return total


def noisy_count(count: np.ndarray | float, std: float, rng: Rng | RandomSource = None) -> float:
    """``count_on_lattice(count, std) / L`` (:func:`count_on_lattice`): the noisy sum of the
    counts ``c_k``; ``std = 0``: their plain sum."""
    if std == 0:
        return float(np.sum(count))
    return count_on_lattice(count, std, rng) / count_scale(std)


def _squared_norms(rows: np.ndarray) -> np.ndarray:
    """Exact squared L2 norms of int64 rows (|entries| <= 2^18, at most 2^26 of them)."""
    return np.einsum("ij,ij->i", rows, rows)
