"""What a caller may ask a mechanism for, beyond the interface every mechanism has.

Every mechanism encodes, aggregates, serializes and plans (``shared.mechanisms.base``).
Everything else is an *ability*, a small protocol here that a mechanism class declares
it provides (``provides = (Memoized,)``) and that callers ask for by name, never by
testing for a class:

    >>> if (lifelong := as_memoized(mechanism)) is not None:
    ...     ledger.debit_memoized(..., lifelong.ledger_keys(values, context)[0], ...)

* ``CategoricalValues``: values are category indices 0..d-1; ``estimate(stats)`` gives
  frequencies (``Estimate``); the exact law (``transition_matrix``) and the simulation
  fast path (``simulate_statistics``) are available.
* ``NumericValues``: values are reals clipped to [lower, upper]; ``estimate(stats)``
  gives a mean (``MeanEstimate``).
* ``DistributionValues``: values are reals clipped to [lower, upper], estimated as a
  distribution over buckets (``DistributionEstimate``: histogram, CDF, quantiles, ranges).
* ``AttributeValues``: each value is a row of several private attributes (categories or
  bounded reals); ``estimate(stats)`` gives per-attribute estimates and the 2-way marginals
  of the declared pairs (``AttributesEstimate``).
* ``CandidateQueries``: values are strings, estimated against candidate strings the
  analyst names (``estimate(stats, candidates)``).
* ``Discovery``: the most frequent strings found without candidates (``heavy_hitters``).
* ``Memoized``: reports re-use a permanent response per value; the device ledger charges
  ``epsilon_lifetime`` once per ledger key and ``epsilon_report`` per report.

Per-device state reaches ``encode`` the same way for every mechanism, as one
``DeviceContext`` (memo, secret, cohort); a mechanism reads what it needs from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np

from shared.attributes import AttributesEstimate
from shared.distributions import DistributionEstimate
from shared.estimates import Estimate, HeavyHitters, MeanEstimate
from shared.memo import Memo
from shared.statistics import CountStatistics, MomentStatistics

if TYPE_CHECKING:
    from shared.mechanisms.base import Mechanism

#: Per-device secrets: one ``bytes`` for every value (one device), or one per value
#: (a sequence of ``bytes``, or a uint8 array of shape (n, L)).
Secrets = bytes | Sequence[bytes] | np.ndarray


@dataclass(frozen=True)
class DeviceContext:
    """What the devices behind a batch of values keep for one spec.

    ``memo``: their permanent randomness (``shared.memo``), one row per value; a memoized
    mechanism draws its permanent response from it, ``pem`` a device's group. ``None``
    draws it fresh, which gives one report the same law.
    ``secrets``: per-device secrets (RAPPOR's permanent response and cohort derive from
    them).
    ``cohorts``: RAPPOR cohorts, one per value; ``None`` derives each from its secret.
    """

    memo: Memo | None = None
    secrets: Secrets | None = None
    cohorts: np.ndarray | Sequence[int] | None = None


#: The context of devices that keep nothing: every permanent draw fresh.
FRESH = DeviceContext()


@runtime_checkable
class CategoricalValues(Protocol):
    """Values are category indices 0..domain_size-1, estimated as frequencies."""

    domain_size: int

    @property
    def p(self) -> float:
        """P(a report supports v | value v)."""
        ...

    @property
    def q(self) -> float:
        """P(a report supports v | value u), u != v."""
        ...

    def estimate(self, stats: CountStatistics) -> Estimate: ...

    def estimate_many(self, stats: Sequence[CountStatistics]) -> list[Estimate]:
        """``estimate`` of each statistics, computed together (a breakdown's groups)."""
        ...

    def transition_matrix(self) -> np.ndarray: ...

    def simulate_statistics(
        self, counts: np.ndarray, rng: np.random.Generator
    ) -> CountStatistics: ...


@runtime_checkable
class NumericValues(Protocol):
    """Values are reals clipped to [lower, upper], estimated as a mean."""

    lower: float
    upper: float

    def estimate(self, stats: MomentStatistics) -> MeanEstimate: ...

    def debias(self, reports: np.ndarray) -> np.ndarray:
        """The unbiased value, in original units, that each report stands for."""
        ...

    def report_variance(self, values: np.ndarray) -> np.ndarray: ...

    def simulate_statistics(
        self, levels: np.ndarray, counts: np.ndarray, rng: np.random.Generator
    ) -> MomentStatistics: ...


@runtime_checkable
class DistributionValues(Protocol):
    """Values are reals clipped to [lower, upper], estimated as their distribution over the
    spec's buckets (``shared.mechanisms.spec.DistributionSpec``)."""

    lower: float
    upper: float

    def edges(self) -> np.ndarray:
        """The D + 1 bucket edges in value units."""
        ...

    def estimate(self, stats: CountStatistics) -> DistributionEstimate: ...

    def simulate_statistics(self, buckets: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """The statistics of ``buckets[b]`` devices with a value in bucket b reporting once
        each, drawn from their law (the simulation fast path; a seeded Generator only)."""
        ...


@runtime_checkable
class AttributeValues(Protocol):
    """Each value is a row of several private attributes, reported together under one
    epsilon (``shared.mechanisms.multidim``)."""

    @property
    def attribute_names(self) -> tuple[str, ...]:
        """The attributes, in the spec's order (the columns of ``encode``'s values)."""
        ...

    def rows(self, records: Sequence[dict[str, Any]]) -> np.ndarray:
        """``encode``'s values from one dict per device (attribute name -> a label or
        index of a categorical attribute, a number of a numeric one); ValueError naming the
        record and attribute at fault."""
        ...

    def estimate(self, stats: CountStatistics) -> AttributesEstimate: ...

    def simulate_statistics(self, rows: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """The statistics of the devices whose values are ``rows`` reporting once each, drawn
        from their law (the simulation fast path; a seeded Generator only)."""
        ...


@runtime_checkable
class CandidateQueries(Protocol):
    """Values are strings, estimated for the candidate strings an analyst names."""

    def estimate(
        self, stats: CountStatistics, candidates: Sequence[str] | None = None
    ) -> Estimate: ...

    def simulate_statistics(
        self, values: Sequence[str], counts: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """The statistics of ``counts[i]`` devices reporting ``values[i]`` once each, drawn
        from their law (the simulation fast path; a seeded numpy Generator only)."""
        ...


@runtime_checkable
class Discovery(Protocol):
    """The most frequent strings, found without candidates."""

    def heavy_hitters(self, stats: CountStatistics, k: int) -> HeavyHitters: ...


@runtime_checkable
class Memoized(Protocol):
    """Reports re-use a permanent response per value (a ledger key)."""

    @property
    def epsilon_report(self) -> float:
        """What one report reveals."""
        ...

    @property
    def epsilon_lifetime(self) -> float:
        """What any number of reports of one ledger key reveal (may be infinite)."""
        ...

    def memo_keys(self, values: Any, memo: Memo | None = None) -> np.ndarray:
        """Each value's memo key (int64): its permanent response depends on the value only
        through it, so distinct keys per device count what a device spends for life."""
        ...

    def ledger_keys(self, values: Any, context: DeviceContext) -> list[bytes]:
        """The key the device ledger charges ``epsilon_lifetime`` once for, per value."""
        ...


def _provided(mechanism: Mechanism[Any], ability: type) -> bool:
    return ability in type(mechanism).abilities


def as_categorical(mechanism: Mechanism[Any]) -> CategoricalValues | None:
    """``mechanism`` as ``CategoricalValues``, or None when its values are not categories."""
    return cast(CategoricalValues, mechanism) if _provided(mechanism, CategoricalValues) else None


def as_numeric(mechanism: Mechanism[Any]) -> NumericValues | None:
    """``mechanism`` as ``NumericValues``, or None when its values are not numbers."""
    return cast(NumericValues, mechanism) if _provided(mechanism, NumericValues) else None


def as_distribution(mechanism: Mechanism[Any]) -> DistributionValues | None:
    """``mechanism`` as ``DistributionValues``, or None when it does not estimate a
    distribution."""
    return cast(DistributionValues, mechanism) if _provided(mechanism, DistributionValues) else None


def as_attributes(mechanism: Mechanism[Any]) -> AttributeValues | None:
    """``mechanism`` as ``AttributeValues``, or None when its values are not attribute rows."""
    return cast(AttributeValues, mechanism) if _provided(mechanism, AttributeValues) else None


def as_candidate_queries(mechanism: Mechanism[Any]) -> CandidateQueries | None:
    """``mechanism`` as ``CandidateQueries``, or None when it does not estimate strings."""
    return cast(CandidateQueries, mechanism) if _provided(mechanism, CandidateQueries) else None


def as_discovery(mechanism: Mechanism[Any]) -> Discovery | None:
    """``mechanism`` as ``Discovery``, or None when it needs candidates to find strings."""
    return cast(Discovery, mechanism) if _provided(mechanism, Discovery) else None


def as_memoized(mechanism: Mechanism[Any]) -> Memoized | None:
    """``mechanism`` as ``Memoized``, or None when each report is drawn afresh."""
    return cast(Memoized, mechanism) if _provided(mechanism, Memoized) else None
