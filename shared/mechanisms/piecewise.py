"""Piecewise mechanism (Wang, Xiao, Yang, Zhao, Hong, Lin, Yu, "Collecting and
Analyzing Multidimensional Data with Local Differential Privacy", ICDE 2019,
Algorithm 2).

For t in [-1, 1] let z = e^(eps/2), C = (z + 1) / (z - 1),
l(t) = (C + 1) t / 2 - (C - 1) / 2 and r(t) = l(t) + C - 1. The output y in
[-C, C] has density

    pdf(y | t) = (e^eps - z) / (2 z + 2)           for y in [l(t), r(t)],
                 (e^eps - z) / (2 z + 2) / e^eps   otherwise,

i.e. y is uniform on [l(t), r(t)] with probability z / (z + 1), else uniform on
the rest of [-C, C]. The density ratio of any two inputs is at most e^eps.
E[y | t] = t and

    Var[y | t] = t^2 / (z - 1) + (z + 3) / (3 (z - 1)^2)

(normalized units; times ((upper - lower) / 2)^2); the worst case is |t| = 1.
It beats Duchi's mechanism for eps above about 1.29.

The output is continuous and drawn with 53-bit uniforms; unlike ``laplace`` it
does not claim protection against floating-point attacks on the low bits.

Report: y (float64, normalized), payload ``{"value": float}``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared.mechanisms.numeric import NumericMechanism
from shared.randomness import Rng, as_source


class PiecewiseMechanism(NumericMechanism):
    name = "piecewise"
    payload_fields = frozenset({"value"})

    @property
    def z(self) -> float:
        return math.exp(self.epsilon / 2)

    @property
    def bound(self) -> float:
        """C = (e^(eps/2) + 1) / (e^(eps/2) - 1): outputs lie in [-C, C]."""
        return (self.z + 1) / (self.z - 1)

    def centre(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The high-density interval [l(t), r(t)]."""
        c = self.bound
        left = (c + 1) / 2 * t - (c - 1) / 2
        return left, left + c - 1

    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
        t = self.normalize(values)
        source = as_source(rng)
        c = self.bound
        left, right = self.centre(t)
        in_centre = source.bernoulli(self.z / (self.z + 1), t.size)
        u = source.uniform(t.size)
        inside = left + u * (c - 1)
        outside_offset = u * (c + 1)  # position along [-C, l) followed by (r, C]
        left_length = left + c
        outside = np.where(
            outside_offset < left_length, -c + outside_offset, right + outside_offset - left_length
        )
        return np.where(in_centre, inside, outside)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(f"piecewise reports must be a 1-d array, got shape {array.shape}")
        bad = np.flatnonzero(~np.isfinite(array) | (np.abs(array) > self.bound))
        if bad.size:
            raise ValueError(
                f"report {bad[0]}: {array[bad[0]]!r} is outside [-{self.bound}, {self.bound}]"
            )
        return array

    def debias(self, reports: np.ndarray) -> np.ndarray:
        return self.to_original(reports)

    def report_variance(self, values: np.ndarray) -> np.ndarray:
        t = self.normalize(values)
        z = self.z
        return (t**2 / (z - 1) + (z + 3) / (3 * (z - 1) ** 2)) * self.half_range**2

    def worst_case_inputs(self) -> np.ndarray:
        return np.array([self.lower, self.upper])

    def report_central_moments(self, values: np.ndarray) -> np.ndarray:
        """Integrals of (y - t)^j against the piecewise-constant density (normalized
        units, times h^j): D_h on [l(t), r(t)], D_h / e^eps on the rest of [-C, C],
        with the integral of (y - t)^j over [a, b] = ((b - t)^(j+1) - (a - t)^(j+1)) / (j+1)."""
        t = self.normalize(values)
        left, right = self.centre(t)
        c = self.bound
        high = (math.exp(self.epsilon) - self.z) / (2 * self.z + 2)
        low = high / math.exp(self.epsilon)

        def integral(a: np.ndarray | float, b: np.ndarray | float, j: int) -> np.ndarray:
            return ((b - t) ** (j + 1) - (a - t) ** (j + 1)) / (j + 1)

        moments = [
            high * integral(left, right, j) + low * (integral(-c, left, j) + integral(right, c, j))
            for j in (2, 3, 4)
        ]
        return np.stack(moments, axis=1) * self.half_range ** np.array([2, 3, 4])

    def density(self, values: np.ndarray, outputs: np.ndarray) -> np.ndarray:
        """pdf(y | x) as a (len(values), len(outputs)) matrix."""
        left, right = self.centre(self.normalize(values))
        y = np.asarray(outputs, dtype=np.float64)[None, :]
        high = (math.exp(self.epsilon) - self.z) / (2 * self.z + 2)
        inside = (y >= left[:, None]) & (y <= right[:, None])
        return np.where(inside, high, high / math.exp(self.epsilon))

    def transition_matrix(self, values: np.ndarray) -> np.ndarray:
        """Densities at 4096 midpoints of [-C, C] (the ratio bound is on densities)."""
        edges = np.linspace(-self.bound, self.bound, 4097)
        return self.density(values, (edges[:-1] + edges[1:]) / 2)

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [{"value": float(y)} for y in self.check_reports(reports)]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        values = np.empty(len(payloads), dtype=np.float64)
        for i, payload in enumerate(payloads):
            value = payload.get("value") if isinstance(payload, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"report {i}: payload needs a number 'value', got {payload!r}")
            values[i] = value
        return self.check_reports(values)
