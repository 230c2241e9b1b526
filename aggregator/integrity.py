"""How honest a window of reports looks: the ``integrity`` object of every estimate.

Beside an estimate the service publishes (``window_integrity``):

* ``fit``: the window's report profile (``shared.integrity.Profiled``: kept beside the
  statistics at ingest, one row per batch and unit) tested against the mechanism's honest
  law (``FitTest``), over the same released units (time buckets per cell) as the
  estimate; null for a mechanism without a profile or below ``MIN_FIT_REPORTS``;
* ``refused`` and ``refused_share``: the reports the mechanism's refusal rules refused in
  the window (by rule; those batches were answered 422 and stored nothing), and their
  share of all reports offered, refused / (refused + n);
* ``alert`` (the fit's p-value below ``ALERT_P_VALUE``) and ``message``, what the
  dashboard shows as a warning.

For a numeric mechanism with a bounded-influence mean (``BoundedInfluence``), ``robust``
is the winsorized mean with its bias bound (``RobustMean``), when every report of the
window has a profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aggregator.repositories.reports import PartialRow
from shared.estimates import z_value
from shared.integrity import (
    ALERT_P_VALUE,
    FitTest,
    as_bounded_influence,
    as_profiled,
)
from shared.mechanisms import Mechanism
from shared.statistics import CountStatistics, MomentStatistics

__all__ = ["integrity_fields", "robust_estimate", "window_integrity", "window_profile"]


def integrity_fields(
    mechanism: Mechanism[Any],
    released: Sequence[PartialRow],
    profiles: Sequence[PartialRow],
    refused: dict[int, dict[str, int]],
    stats: object,
    first: int,
    stop: int,
) -> dict[str, object]:
    """What an estimate of the ``released`` rows (statistics ``stats``) over buckets
    ``[first, stop)`` adds: ``integrity``, and ``robust`` for a numeric metric with a
    bounded-influence mean. ``profiles``: profile rows covering at least the window;
    ``refused``: refused reports by bucket and rule (``ReportsRepository.refused_counts``)."""
    profile = window_profile(mechanism, released, profiles)
    by_rule: dict[str, int] = {}
    for bucket, counts in refused.items():
        if first <= bucket < stop:
            for rule, reports in counts.items():
                by_rule[rule] = by_rule.get(rule, 0) + reports
    fields: dict[str, object] = {
        "integrity": window_integrity(mechanism, profile, by_rule, sum(r.n for r in released))
    }
    robust = robust_estimate(mechanism, stats, profile)
    if robust is not None:
        fields["robust"] = robust
    return fields


def window_profile(
    mechanism: Mechanism[Any], released: Sequence[PartialRow], profiles: Sequence[PartialRow]
) -> CountStatistics | None:
    """The merged profile of the profile rows in the released units (bucket, cell) of the
    estimate, or None for a mechanism without a profile."""
    profiled = as_profiled(mechanism)
    if profiled is None:
        return None
    units = {(row.bucket, row.cell) for row in released}
    total = CountStatistics.empty(profiled.profile_length)
    return total.merge_many(
        CountStatistics.from_bytes(row.stats) for row in profiles if (row.bucket, row.cell) in units
    )


def window_integrity(
    mechanism: Mechanism[Any],
    profile: CountStatistics | None,
    refused: dict[str, int],
    n: int,
) -> dict[str, Any]:
    """The ``integrity`` object of an estimate of ``n`` reports (JSON-ready)."""
    profiled = as_profiled(mechanism)
    fit: FitTest | None = (
        profiled.fit(profile) if profiled is not None and profile is not None else None
    )
    refused_total = sum(refused.values())
    alert = fit is not None and fit.p_value < ALERT_P_VALUE
    message = None
    if alert:
        assert fit is not None
        message = (
            f"the reports do not look like honest {mechanism.name} reports: {fit.test} gives "
            f"p = {fit.p_value:.2g} over {fit.reports} reports (alert below {ALERT_P_VALUE:g}); "
            "forged reports may be moving this estimate"
        )
    return {
        "fit": fit.as_json() if fit is not None else None,
        "refused": dict(sorted(refused.items())),
        "refused_share": refused_total / (refused_total + n) if refused_total + n else 0.0,
        "alert": alert,
        "message": message,
    }


def robust_estimate(
    mechanism: Mechanism[Any], stats: object, profile: CountStatistics | None
) -> dict[str, Any] | None:
    """The ``robust`` object of a numeric estimate (the winsorized mean, 95% interval
    widened by the bias bound), or None when the mechanism has none or some report of the
    window has no profile (it was stored before profiles were kept)."""
    bounded = as_bounded_influence(mechanism)
    if bounded is None or profile is None or not isinstance(stats, MomentStatistics):
        return None
    if profile.n != stats.n:
        return None
    return bounded.robust_mean(stats, profile).as_json(z_value(0.95))
