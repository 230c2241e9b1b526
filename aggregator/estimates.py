"""Estimates as published: the JSON shapes of ``GET /v1/metrics/{name}/estimate``.

The numbers are the mechanisms' (``Mechanism.estimate``): unbiased frequencies or mean
with standard errors, the 95% normal interval ``estimate ± 1.96 std``, and beside them
the post-processed estimate (a valid distribution, or a mean inside the bounds), which
is biased and marked so. RAPPOR metrics are decoded against the metric's candidate
strings (its labels) or the ones the request lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, Field

from shared.estimates import Estimate, MeanEstimate
from shared.mechanisms import Mechanism, Rappor, RapporEstimate
from shared.schemas import MetricSpec
from shared.statistics import CountStatistics, MomentStatistics

CONFIDENCE = 0.95


@dataclass(frozen=True)
class EstimateWindow:
    """Buckets ``first <= bucket < stop`` (unix seconds; None: unbounded)."""

    first: int | None
    stop: int | None

    @classmethod
    def of(
        cls, start: datetime | None, end: datetime | None, bucket_seconds: int
    ) -> EstimateWindow:
        """The buckets that start in ``[start, end)``; a bucket holds reports stamped in it."""
        first = stop = None
        if start is not None:
            seconds = int(_utc(start, "start").timestamp())
            first = -(-seconds // bucket_seconds) * bucket_seconds  # round up to a bucket
        if end is not None:
            seconds = int(_utc(end, "end").timestamp())
            stop = -(-seconds // bucket_seconds) * bucket_seconds
        if first is not None and stop is not None and stop <= first:
            raise ValueError("end must be later than start (by at least one bucket)")
        return cls(first, stop)

    def as_json(self) -> dict[str, str | None]:
        return {"start": _iso(self.first), "end": _iso(self.stop)}


def _utc(value: datetime, name: str) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{name} must carry a time zone, e.g. 2026-11-22T00:00:00Z")
    return value


def _iso(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class Window(BaseModel):
    start: str | None = Field(description="First bucket included (UTC), or null: from the first.")
    end: str | None = Field(description="First bucket excluded (UTC), or null: to the last.")


class FrequencyItem(BaseModel):
    index: int
    label: str | None
    frequency: float = Field(description="Unbiased estimate of the share of reports.")
    std: float
    ci_low: float
    ci_high: float
    count: float = Field(description="n * frequency: the estimated number of reports.")


class PostprocessedItem(BaseModel):
    index: int
    label: str | None
    frequency: float


class EstimateBase(BaseModel):
    metric: str
    version: int
    mechanism: str
    epsilon: float
    n: int
    confidence: float = CONFIDENCE
    window: Window


class CategoricalEstimateOut(EstimateBase):
    kind: Literal["categorical"] = "categorical"
    resolved_mechanism: str = Field(description="The mechanism 'auto' resolved to.")
    estimates: list[FrequencyItem]
    postprocessed: list[PostprocessedItem] = Field(
        description="The closest valid distribution (simplex projection); biased."
    )


class NumericEstimateOut(EstimateBase):
    kind: Literal["numeric"] = "numeric"
    mean: float = Field(description="Unbiased estimate of the mean of the clipped values.")
    std: float
    ci_low: float
    ci_high: float
    lower: float
    upper: float
    postprocessed_mean: float = Field(description="The mean clipped to [lower, upper]; biased.")


class CandidateItem(BaseModel):
    string: str
    frequency: float
    std: float
    ci_low: float
    ci_high: float
    count: float
    detected: bool


class StringEstimateOut(EstimateBase):
    kind: Literal["string"] = "string"
    epsilon_infinity: float = Field(description="Bound over any number of reports of one value.")
    candidates: list[CandidateItem]
    detected: list[str] = Field(description="Detected candidates, most frequent first.")
    explained_mass: float
    unexplained_mass: float
    smallest_detectable_frequency: float
    correction: str
    alpha: float


EstimateOut = CategoricalEstimateOut | NumericEstimateOut | StringEstimateOut


def build_estimate(
    metric: MetricSpec,
    mechanism: Mechanism,
    stats: CountStatistics | MomentStatistics,
    window: EstimateWindow,
    candidates: list[str] | None = None,
) -> dict[str, object]:
    """The published estimate of ``stats`` (JSON-ready, one of the ``*EstimateOut`` shapes)."""
    base: dict[str, object] = {
        "metric": metric.name,
        "version": metric.version,
        "mechanism": metric.mechanism.mechanism,
        "epsilon": metric.mechanism.epsilon,
        "n": stats.n,
        "confidence": CONFIDENCE,
        "window": window.as_json(),
    }
    if isinstance(mechanism, Rappor):
        assert isinstance(stats, CountStatistics)
        listed = candidates or list(metric.labels or ())
        if not listed:
            raise ValueError(
                "this RAPPOR metric lists no candidate strings: pass candidates=... to decode"
            )
        return base | _string_estimate(mechanism, mechanism.estimate(stats, candidates=listed))
    result = mechanism.estimate(stats)
    if isinstance(result, MeanEstimate):
        low, high = result.ci(CONFIDENCE)
        return base | {
            "kind": "numeric",
            "mean": result.mean,
            "std": result.std,
            "ci_low": low,
            "ci_high": high,
            "lower": result.lower,
            "upper": result.upper,
            "postprocessed_mean": result.postprocessed(),
        }
    assert isinstance(result, Estimate)
    low_array, high_array = result.ci(CONFIDENCE)
    counts = result.counts
    projected = result.postprocessed().frequencies
    return base | {
        "kind": "categorical",
        "resolved_mechanism": mechanism.name,
        "estimates": [
            {
                "index": i,
                "label": metric.label_of(i),
                "frequency": float(result.frequencies[i]),
                "std": float(result.std[i]),
                "ci_low": float(low_array[i]),
                "ci_high": float(high_array[i]),
                "count": float(counts[i]),
            }
            for i in range(result.frequencies.size)
        ],
        "postprocessed": [
            {"index": i, "label": metric.label_of(i), "frequency": float(projected[i])}
            for i in range(projected.size)
        ],
    }


def _string_estimate(mechanism: Rappor, result: RapporEstimate) -> dict[str, object]:
    low, high = result.ci(CONFIDENCE)
    counts = result.counts
    return {
        "kind": "string",
        "epsilon_infinity": mechanism.epsilon_infinity,
        "candidates": [
            {
                "string": string,
                "frequency": float(result.frequencies[i]),
                "std": float(result.std[i]),
                "ci_low": float(low[i]),
                "ci_high": float(high[i]),
                "count": float(counts[i]),
                "detected": bool(result.detected[i]),
            }
            for i, string in enumerate(result.candidates)
        ],
        "detected": [item.string for item in result.detected_strings(CONFIDENCE)],
        "explained_mass": result.explained_mass,
        "unexplained_mass": result.unexplained_mass,
        "smallest_detectable_frequency": result.smallest_detectable_frequency,
        "correction": result.correction,
        "alpha": result.alpha,
    }
