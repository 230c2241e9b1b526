"""What no honest device sends, and how honest a window of reports looks.

Local privacy makes every report noisy, so a forged report hides among honest ones and
debiasing amplifies it. Three things here let the service shrink and expose that:

* **Refusal rules.** A mechanism lists (``Mechanism.refusal_rules``) the sets of reports
  that an honest device produces with probability at most ``FALSE_REFUSAL_BOUND`` =
  2^-40 *for every input* (``RefusalRule.false_refusal`` is that largest probability,
  computed exactly by the mechanism and stated in its docstring). ``Mechanism.refusals``
  says, per report, which rule it breaks; the service refuses such reports at ingest
  (422 naming the rule) and counts them per metric version and hour.
* **Profiles** (the ``Profiled`` ability). A per-report summary whose honest law the
  mechanism knows (for a unary encoding, the number of ones in the report: Bernoulli(p)
  + Binomial(d - 1, q) whatever the input), kept as mergeable counts beside the
  statistics; ``fit`` tests a window's profile against the honest law (``FitTest``: the
  statistic, its degrees of freedom and a p-value). Under no attack the p-value is
  uniform (or, where the honest law depends on the inputs, stochastically larger than
  uniform: the test is then conservative, and says so).
* **Bounded influence** (the ``BoundedInfluence`` ability). A mean whose reports beyond
  the honest noise's quantiles are winsorized, from the profile's tail counts and sums,
  with a stated bound on the bias this adds (``RobustMean``).

The chi-square p-value is computed with scipy, imported inside ``chi_square_fit`` only
(the device imports this module and never calls it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np

from shared.statistics import CountStatistics, MomentStatistics

if TYPE_CHECKING:
    from shared.mechanisms.base import Mechanism

#: An honest report breaks a refusal rule with probability at most 2^-REFUSAL_BITS.
REFUSAL_BITS = 40
FALSE_REFUSAL_BOUND = 2.0**-REFUSAL_BITS
#: Reports a window needs before its profile is tested (fewer: no ``FitTest``).
MIN_FIT_REPORTS = 50
#: A window whose fit p-value is below this is flagged: the estimate may be attacked.
ALERT_P_VALUE = 1e-3
#: Bins of a chi-square test are pooled until each expects at least this many reports.
MIN_EXPECTED_PER_BIN = 5.0


@dataclass(frozen=True)
class RefusalRule:
    """A set of reports no honest device sends but with probability ``false_refusal``.

    ``name``: ``"<mechanism>.<rule>"`` (``"oue.ones_count"``), what a 422 names.
    ``description``: the rule with its numbers (``"more than 331 of the 1024 bits set"``).
    ``false_refusal``: the largest probability, over every input, that one honest report
    breaks the rule; at most ``FALSE_REFUSAL_BOUND``.
    """

    name: str
    description: str
    false_refusal: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.false_refusal <= FALSE_REFUSAL_BOUND:
            raise ValueError(
                f"rule {self.name!r} refuses an honest report with probability "
                f"{self.false_refusal:.3g}, above 2^-{REFUSAL_BITS}"
            )


class ReportRefusedError(ValueError):
    """A report breaks a refusal rule: the rule, the report's index and what it does."""

    def __init__(self, rule: RefusalRule, report: int, detail: str) -> None:
        self.rule, self.report, self.detail = rule, report, detail
        #: Why, without the report's index.
        self.reason = (
            f"refused by rule {rule.name!r}: {detail} ({rule.description}; an honest device "
            f"sends such a report with probability at most {rule.false_refusal:.2g})"
        )
        super().__init__(f"report {report}: {self.reason}")


@dataclass(frozen=True)
class FitTest:
    """A goodness-of-fit test of a window's reports against the honest model.

    ``statistic`` with ``degrees_of_freedom`` gives ``p_value``; ``reports`` tested;
    ``test`` says which statistic of the reports was tested against which law, and
    whether the p-value is exact-asymptotic (uniform under no attack) or conservative.
    """

    test: str
    statistic: float
    degrees_of_freedom: int
    p_value: float
    reports: int

    def as_json(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "statistic": self.statistic,
            "degrees_of_freedom": self.degrees_of_freedom,
            "p_value": self.p_value,
            "reports": self.reports,
        }


def chi_square_fit(
    observed: np.ndarray, probabilities: np.ndarray, test: str
) -> FitTest | None:
    """Pearson's chi-square of ``observed`` counts against ``probabilities`` (summing to 1),
    bins pooled left to right until each expects ``MIN_EXPECTED_PER_BIN`` reports (the
    last pool joined to the one before when short); None below ``MIN_FIT_REPORTS``
    reports or with fewer than two pooled bins.

    X^2 = sum_b (O_b - n P_b)^2 / (n P_b) is asymptotically chi-square with B - 1 degrees
    of freedom under the honest law (Pearson 1900), so P(chi2_(B-1) >= X^2) is the p-value.
    """
    observed = np.asarray(observed, dtype=np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    if observed.shape != probabilities.shape or observed.ndim != 1:
        raise ValueError(
            f"observed {observed.shape} and probabilities {probabilities.shape} must be "
            "vectors of one length"
        )
    n = float(observed.sum())
    if n < MIN_FIT_REPORTS:
        return None
    expected = n * probabilities
    pooled_observed: list[float] = []
    pooled_expected: list[float] = []
    running_o = running_e = 0.0
    for o, e in zip(observed.tolist(), expected.tolist(), strict=True):
        running_o += o
        running_e += e
        if running_e >= MIN_EXPECTED_PER_BIN:
            pooled_observed.append(running_o)
            pooled_expected.append(running_e)
            running_o = running_e = 0.0
    if running_o or running_e:
        if pooled_expected:
            pooled_observed[-1] += running_o
            pooled_expected[-1] += running_e
        else:
            pooled_observed.append(running_o)
            pooled_expected.append(running_e)
    if len(pooled_expected) < 2:
        return None
    o_arr, e_arr = np.array(pooled_observed), np.array(pooled_expected)
    if np.any(e_arr <= 0):
        # a report in a bin the honest law never reaches: no honest window looks like this
        return FitTest(test, math.inf, len(e_arr) - 1, 0.0, int(n))
    statistic = float(np.sum((o_arr - e_arr) ** 2 / e_arr))
    from scipy.stats import chi2  # server side only: the device never tests fits

    degrees = len(e_arr) - 1
    return FitTest(test, statistic, degrees, float(chi2.sf(statistic, degrees)), int(n))


@runtime_checkable
class Profiled(Protocol):
    """A per-report summary with a known honest law, kept as mergeable counts."""

    @property
    def profile_length(self) -> int:
        """The length of the profile's count vector (``CountStatistics.length``)."""
        ...

    def profile(self, reports: np.ndarray) -> CountStatistics:
        """The profile of a batch of reports (n = the batch's size); profiles merge by
        addition like statistics."""
        ...

    def fit(self, profile: CountStatistics) -> FitTest | None:
        """The window's profile tested against the honest law, or None when too few reports."""
        ...


@dataclass(frozen=True)
class RobustMean:
    """A mean with every report's debiased value winsorized to [``low``, ``high``].

    ``mean`` and ``std`` as ``MeanEstimate``'s; ``bias_bound``: the largest |E[mean] -
    true mean| the winsorizing can add, over every set of inputs in [lower, upper];
    ``winsorized``: how many reports were moved; ``influence``: the most one report can
    move the mean of n, (high - low) / n.
    """

    mean: float
    std: float
    n: int
    low: float
    high: float
    bias_bound: float
    winsorized: int

    @property
    def influence(self) -> float:
        return (self.high - self.low) / self.n if self.n else math.inf

    def as_json(self, z: float) -> dict[str, Any]:
        half = z * self.std + self.bias_bound
        return {
            "mean": self.mean,
            "std": self.std,
            "ci_low": self.mean - half,
            "ci_high": self.mean + half,
            "bias_bound": self.bias_bound,
            "winsorized": self.winsorized,
            "low": self.low,
            "high": self.high,
        }


@runtime_checkable
class BoundedInfluence(Protocol):
    """A numeric mechanism whose mean can be estimated with every report's influence bounded."""

    def robust_mean(self, stats: MomentStatistics, profile: CountStatistics) -> RobustMean:
        """The winsorized mean of the window (its statistics and its profile)."""
        ...


def as_profiled(mechanism: Mechanism[Any]) -> Profiled | None:
    """``mechanism`` as ``Profiled``, or None when its reports have no profile."""
    return cast(Profiled, mechanism) if Profiled in type(mechanism).abilities else None


def as_bounded_influence(mechanism: Mechanism[Any]) -> BoundedInfluence | None:
    """``mechanism`` as ``BoundedInfluence``, or None when it has no winsorized mean."""
    return (
        cast(BoundedInfluence, mechanism)
        if BoundedInfluence in type(mechanism).abilities
        else None
    )
