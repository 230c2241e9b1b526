"""Longitudinal generalized randomized response (L-GRR): a memoized GRR, then a fresh one.

Arcolezi, Couchot, Al Bouna and Xiao, "Longitudinal collection and analysis of mobile
phone data with local differential privacy" (IFIP Summer School on Privacy and Identity
Management, 2021) and "Improving the utility of locally differentially private protocols
for longitudinal and multidimensional frequency estimates" (Digital Communications and
Networks, 2023), after RAPPOR's two rounds (Erlingsson, Pihur and Korolova, CCS 2014).

A device with value v in 0..d-1 answers it with

1. a *permanent* response y1 = GRR_lam1(v), drawn once per (device, metric version, v)
   from the device's memo (``shared.memo``) and the same for every later report of v;
2. for each report, an *instantaneous* response y = GRR_lam2(y1), fresh.

In the keep/uniform form of ``shared.mechanisms.grr``, GRR_lam(x) = lam delta_x +
(1 - lam) Uniform(d): keep x with probability lam, else draw uniformly from all d
values. Writing U for the uniform matrix (every entry 1/d), GRR_lam = lam I + (1 - lam) U
and U A = U for every stochastic A, so composing two responses is again one:
(lam1 I + (1 - lam1) U)(lam2 I + (1 - lam2) U) = lam1 lam2 I + (1 - lam1 lam2) U. With
lam(eps) = (e^eps - 1) / (e^eps + d - 1), GRR's keep probability at eps:

* the permanent response is GRR at ``epsilon`` (lam1 = lam(epsilon)), so any number of
  reports of one value, post-processing of y1, are ``epsilon``-LDP: p1 = e^eps /
  (e^eps + d - 1), q1 = 1 / (e^eps + d - 1) (``permanent_matrix``);
* lam2 = lam(eps_1) / lam(eps) with eps_1 = ``epsilon_report``, so one report is GRR with
  keep probability lam(eps_1), i.e. exactly GRR at eps_1 (``transition_matrix``):
  P(y = v | v) = p = e^eps_1 / (e^eps_1 + d - 1), P(y = v | u) = q = 1 / (e^eps_1 + d - 1).
  The instantaneous probabilities are

      p2 = lam2 + (1 - lam2) / d = (e^(eps + eps_1) + (d - 2) e^eps_1 - (d - 1))
                                   / ((e^eps - 1)(e^eps_1 + d - 1)),
      q2 = (1 - lam2) / d = (e^eps - e^eps_1) / ((e^eps - 1)(e^eps_1 + d - 1)),

  the solution of P(y = v | v) / P(y = v | u) = e^eps_1 with the chain's exact
  P(y = v | v) = p1 p2 + (1 - p1) q2 and P(y = v | u) = q1 p2 + (1 - q1) q2. The larger
  lam2, the smaller the variance, so this is also the least-variance choice for the pair.
  For d = 2 it is the papers' p2 = (e^(eps + eps_1) - 1) / (e^(eps + eps_1) + (d - 1)
  e^eps + e^eps_1 - d e^eps_1 - 1) (also multi-freq-ldpy's ``L_GRR``). For d > 2 the
  papers' p2 solves (p1 p2 + q1 q2) / (p1 q2 + q1 p2) = e^eps_1, which leaves out the
  (d - 2) q1 q2 of the paths through a third value: its reports are then
  less than eps_1-LDP (eps = 1, eps_1 = 0.5, d = 3: one report realizes 0.442) at a
  larger variance than the chain here, which reaches eps_1.

Estimator and variance. p - q = (p1 - q1)(p2 - q2), and q = q1 (p2 - q2) + q2, so the
frequency-oracle estimator f_v = (C_v / n - q) / (p - q) is the papers'
(C_v / n - q1 (p2 - q2) - q2) / ((p1 - q1)(p2 - q2)), unbiased per period. Devices are
independent (their permanent responses too), so one period's C_v is a sum of independent
indicators with the one-report law, however many periods the devices have reported
before: the per-period variance is GRR's at eps_1,

    Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))
             = (e^eps_1 + d - 2) / (n (e^eps_1 - 1)^2)    at f_v = 0

(Wang et al., USENIX Security 2017). Estimates of different periods from the same devices
are correlated through the permanent responses: averaging periods does not average the
permanent noise away, which is the point.

Realized probabilities. The permanent response keeps v with probability T1 / 2^53, T1 =
GRR's certified threshold at ``epsilon`` (``grr.k_ary_keep_threshold``); the instantaneous
one keeps y1 with probability T2 / 2^53, so one report keeps v with lam = T1 T2 / 2^106
exactly, and its likelihood ratio is (lam (d - 1) + 1) / (1 - lam) =
(T1 T2 (d - 1) + 2^106) / (2^106 - T1 T2), which grows with T2: T2 is rounded down from
2^53 lam(eps_1) / (T1 / 2^53) and stepped down until that exact ratio is proven at most
e^eps_1 (``shared.randomness.certified_threshold``). ``p``, ``q``, ``transition_matrix``,
``permanent_matrix`` and ``simulate_statistics`` use these realized values.

Memo draws (what a client in another language must reproduce). The permanent response of
value v reads the memo stream of purpose ``b"lgrr prr"`` keyed by v (``shared.memo``:
scope = ``spec_scope(spec_hash)``, words little-endian uint64 w0, w1, ...): it is v
if (w0 >> 11) < T1 (the top 53 bits of w0 below T1), and otherwise the first of
w1 & m, w2 & m, ... that is below d, with m = 2^ceil(log2 d) - 1. The
instantaneous response is fresh: keep y1 if a uniform 53-bit integer is below T2, else a
uniform value of 0..d-1 (``grr.k_ary_response``).

Report: the reported index (int64). Payload: ``{"value": int}``.
Sufficient statistics: the histogram of reported values.

Refusal rules: none (``shared.integrity``). A device whose permanent response is y reports
y with probability p2 = lam2 + (1 - lam2)/d >= 1/d >= 2^-20, so every output is likely
under some input and device state, and no nonempty set of outputs is below 2^-40 for
all of them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import as_index_array
from shared.mechanisms.categorical import require_enumerable
from shared.mechanisms.grr import (
    CountedIndices,
    k_ary_keep_threshold,
    k_ary_probabilities,
    k_ary_response,
)
from shared.mechanisms.memoized import ChainedSpec, MemoizedMechanism
from shared.mechanisms.registry import register
from shared.memo import Memo
from shared.randomness import BITS53, Rng, as_source, certified_threshold

#: Memo purpose of the permanent response (see the module docstring).
PERMANENT_PURPOSE = b"lgrr prr"


def composite_law(keep: Fraction, k: int) -> tuple[Fraction, Fraction]:
    """Exact (P(report = value), P(report = each other)) of GRR with keep probability
    ``keep`` over k values: (keep + (1 - keep) / k, (1 - keep) / k)."""
    other = (1 - keep) / k
    return keep + other, other


def grr_matrix(same: float, other: float, k: int) -> np.ndarray:
    """The (k, k) matrix with ``same`` on the diagonal and ``other`` elsewhere."""
    require_enumerable(k * k)
    matrix = np.full((k, k), other)
    np.fill_diagonal(matrix, same)
    return matrix


class LgrrSpec(ChainedSpec):
    """``{"mechanism": "lgrr", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 8}``."""

    mechanism: Literal["lgrr"]


@register
class LongitudinalGRR(MemoizedMechanism, CountedIndices):
    """L-GRR: permanent GRR at ``epsilon``, instantaneous GRR to ``epsilon_report`` (module
    docstring)."""

    name = "lgrr"
    spec_model = LgrrSpec
    spec: LgrrSpec

    @cached_property
    def permanent_threshold(self) -> int:
        """T1: the permanent response keeps the value with probability T1 / 2^53."""
        return k_ary_keep_threshold(self.epsilon_lifetime, self.domain_size)

    @cached_property
    def instantaneous_threshold(self) -> int:
        """T2: the instantaneous response keeps the permanent one with probability T2 / 2^53:
        2^53 lam(eps_1) / (T1 / 2^53) rounded down, then certified (the exact one-report
        ratio (T1 T2 (d - 1) + 2^106) / (2^106 - T1 T2) at most e^epsilon_report)."""
        d, t1 = self.domain_size, self.permanent_threshold
        grown = math.expm1(self.epsilon_report)
        wanted = grown / (grown + d)  # lam(eps_1), GRR's keep probability at eps_1
        scale = BITS53 * BITS53
        return certified_threshold(
            min(1.0, wanted * BITS53 / t1),
            "down",
            lambda t: Fraction(t1 * t * (d - 1) + scale, scale - t1 * t),
            self.epsilon_report,
        )

    @cached_property
    def keep_probability(self) -> Fraction:
        """lam = T1 T2 / 2^106: one report keeps the value with exactly this probability."""
        return Fraction(self.permanent_threshold * self.instantaneous_threshold, BITS53 * BITS53)

    @property
    def p(self) -> float:
        """Realized P(report v | v) = p1 p2 + (1 - p1) q2, nominally e^eps_1 / (e^eps_1 + d - 1)."""
        return float(composite_law(self.keep_probability, self.domain_size)[0])

    @property
    def q(self) -> float:
        """Realized P(report v | u) = q1 p2 + (1 - q1) q2, nominally 1 / (e^eps_1 + d - 1)."""
        return float(composite_law(self.keep_probability, self.domain_size)[1])

    @property
    def permanent_probabilities(self) -> tuple[float, float]:
        """Realized (p1, q1) of the permanent response, nominally GRR's at ``epsilon``."""
        return k_ary_probabilities(self.permanent_threshold, self.domain_size)

    @property
    def instantaneous_probabilities(self) -> tuple[float, float]:
        """Realized (p2, q2) of the instantaneous response (module docstring)."""
        return k_ary_probabilities(self.instantaneous_threshold, self.domain_size)

    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The category itself: the permanent response is memoized per value."""
        return as_index_array(values, self.domain_size)

    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """GRR at ``epsilon`` from the memo: keep v iff the top 53 bits of its stream's word 0
        are below T1, else the first of the next words (masked) below d (module docstring)."""
        values = self.memo_keys(values)
        return self._permanent(values, self.memo_for(values, None, memo))

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """One report per value: the memoized permanent response of each value (memo row
        i = value i's device; ``None``: drawn fresh from ``rng``), then a fresh
        instantaneous GRR from ``rng``. O(1) memory per value."""
        values = as_index_array(values, self.domain_size)
        permanent = self._permanent(values, self.memo_for(values, rng, context.memo))
        return k_ary_response(
            permanent, self.domain_size, self.instantaneous_threshold, as_source(rng)
        )

    def _permanent(self, values: np.ndarray, memo: Memo) -> np.ndarray:
        """``permanent`` of checked values, one row of ``memo`` each."""
        draws = memo.draws(PERMANENT_PURPOSE, values)
        keep = draws.bernoulli_below(self.permanent_threshold)[:, 0]
        return np.where(keep, values, draws.integers(self.domain_size))

    @property
    def keep_fraction(self) -> float:
        """lam = T1 T2 / 2^106, the composite keep probability, rounded to a double
        (relative error at most 2^-53)."""
        return float(self.keep_probability)

    def transition_matrix(self) -> np.ndarray:
        """Exact law of one report (permanent and instantaneous composed): e^epsilon_report."""
        return grr_matrix(self.p, self.q, self.domain_size)

    def permanent_matrix(self) -> np.ndarray:
        """Exact law of the permanent response: GRR at ``epsilon``, the lifetime bound."""
        return grr_matrix(*self.permanent_probabilities, self.domain_size)
