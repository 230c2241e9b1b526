"""``prepare`` handles a batch as columns: these check it against the report-by-report rules.

Each report goes to the group of its (metric, version) and the bucket of its time (the
server's hour when absent); an id repeated within the batch is folded once, at its first
occurrence; every report refused for its metric, version or time is named, in order,
with the field at fault.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from aggregator.ingest import BatchRejected, prepare
from aggregator.repositories.reports import PROFILE, STATS
from aggregator.storage import PartialRow
from shared.integrity import as_profiled
from shared.mechanisms import Mechanism, make_mechanism
from shared.schemas import MechanismSpec, ReportBatch


def ROW_ORDER(row: PartialRow) -> tuple[str, int, int, str]:  # noqa: N802 (a sort key)
    return (row.metric, row.version, row.bucket, row.kind)

NOW = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
HOUR = 3600


@dataclass(frozen=True)
class Version:
    version: int


class Lookup:
    """A fixed catalog: (metric, version) -> mechanism."""

    def __init__(self, mechanisms: dict[tuple[str, int], Mechanism]) -> None:
        self._mechanisms = mechanisms

    def mechanism(self, name: str, version: int) -> Mechanism | None:
        return self._mechanisms.get((name, version))

    def versions(self, name: str) -> list[Any]:
        return [Version(v) for (metric, v) in self._mechanisms if metric == name]

    def get(self, name: str, version: int | None = None) -> None:
        """Its metrics have no dimensions (no spec to read them from)."""
        return None


def mechanism(spec: dict[str, Any]) -> Mechanism:
    return make_mechanism(MechanismSpec.model_validate(spec))


CATALOG = Lookup(
    {
        ("colour", 1): mechanism({"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}),
        ("colour", 2): mechanism({"mechanism": "grr", "epsilon": 2.0, "domain_size": 6}),
        ("page", 1): mechanism({"mechanism": "oue", "epsilon": 1.0, "domain_size": 10}),
    }
)


def report(metric: str, version: int, payload: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "report_id": extra.pop("report_id", str(uuid.uuid4())),
        "metric": metric,
        "version": version,
        "payload": payload,
        **extra,
    }


def payloads_of(metric: str, version: int, values: np.ndarray) -> list[dict[str, Any]]:
    found = CATALOG.mechanism(metric, version)
    assert found is not None
    return found.to_payloads(found.encode(values, np.random.default_rng(len(values))))


def reference_rows(reports: list[dict[str, Any]], new: set[str]) -> list[PartialRow]:
    """One row per (metric, version, bucket) of the first occurrences of the new ids."""
    now_bucket = int(NOW.timestamp()) // HOUR * HOUR
    seen: set[str] = set()
    cells: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for item in reports:
        if item["report_id"] in seen:
            continue
        seen.add(item["report_id"])
        if item["report_id"] not in new:
            continue
        stamp = item.get("time")
        bucket = now_bucket if stamp is None else int(datetime.fromisoformat(stamp).timestamp())
        cells.setdefault((item["metric"], item["version"], bucket), []).append(item["payload"])
    rows = []
    for (metric, version, bucket), payloads in cells.items():
        found = CATALOG.mechanism(metric, version)
        assert found is not None
        decoded = found.from_payloads(payloads)
        stats = found.aggregate(decoded)
        rows.append(PartialRow(metric, version, bucket, stats.n, stats.to_bytes()))
        if (profiled := as_profiled(found)) is not None:  # its profile, beside its statistics
            profile = profiled.profile(decoded)
            rows.append(
                PartialRow(metric, version, bucket, profile.n, profile.to_bytes(), 0, PROFILE)
            )
    return sorted(rows, key=ROW_ORDER)


def mixed_batch() -> list[dict[str, Any]]:
    """Three metric versions interleaved, three hours (one absent), two repeated ids."""
    rng = np.random.default_rng(7)
    hours = [None, "2026-03-01T11:00:00Z", "2026-03-01T09:00:00Z"]
    sources = [
        ("colour", 1, payloads_of("colour", 1, rng.integers(0, 4, 40))),
        ("colour", 2, payloads_of("colour", 2, rng.integers(0, 6, 30))),
        ("page", 1, payloads_of("page", 1, rng.integers(0, 10, 30))),
    ]
    reports = []
    for i in range(100):
        metric, version, payloads = sources[i % 3] if i < 90 else sources[0]
        stamp = hours[i % len(hours)] if i % 7 else hours[(i // 7) % 3]
        extra = {} if stamp is None else {"time": stamp}
        reports.append(report(metric, version, payloads[i // 3 % len(payloads)], **extra))
    reports.append(dict(reports[4]))  # a retry inside the batch
    reports.append(dict(reports[50]))
    return reports


def test_mixed_batch_folds_each_first_occurrence_into_its_cell() -> None:
    reports = mixed_batch()
    prepared, repeats = prepare(
        ReportBatch.model_validate({"reports": reports}), CATALOG, HOUR, NOW
    )
    assert repeats == 2
    firsts = list(dict.fromkeys(item["report_id"] for item in reports))
    assert prepared.ids == [uuid.UUID(i).bytes for i in firsts]
    for mask_seed in (None, 3):
        if mask_seed is None:
            new = [True] * len(firsts)
        else:
            new = list(np.random.default_rng(mask_seed).random(len(firsts)) < 0.5)
        kept = {rid for rid, fresh in zip(firsts, new, strict=True) if fresh}
        rows = sorted(prepared.fold(new), key=ROW_ORDER)
        assert rows == reference_rows(reports, kept)
        assert sum(row.n for row in rows if row.kind == STATS) == len(kept)


def test_every_refused_report_is_named_with_its_field() -> None:
    grr = payloads_of("colour", 1, np.array([0, 1, 2, 3, 0, 1, 2]))
    future = (NOW + timedelta(hours=3)).strftime("%Y-%m-%dT%H:00:00Z")
    old = "2026-02-01T00:00:00Z"
    reports = [
        report("colour", 1, grr[0]),
        report("shape", 1, grr[1]),
        report("colour", 1, grr[2], time=future),
        report("colour", 1, grr[3], time=old),
        report("colour", 9, grr[4]),
        report("shape", 1, grr[5], time=future),  # the metric is named, not the time
        report("colour", 1, grr[6], time="2026-03-01T10:00:00Z"),
    ]
    with pytest.raises(BatchRejected) as caught:
        prepare(
            ReportBatch.model_validate({"reports": reports}),
            CATALOG,
            HOUR,
            NOW,
            oldest=NOW - timedelta(days=7),
        )
    assert [(p["report"], p["field"]) for p in caught.value.problems] == [
        (1, "metric"),
        (2, "time"),
        (3, "time"),
        (4, "version"),
        (5, "metric"),
    ]
    messages = [p["message"] for p in caught.value.problems]
    assert "unknown metric 'shape'" in messages[0]
    assert "in the future" in messages[1] and "older than the server keeps" in messages[2]
    assert "has no version 9 (it has [1, 2])" in messages[3]


def test_the_first_payload_with_an_unexpected_field_is_named() -> None:
    grr = payloads_of("colour", 1, np.arange(6) % 4)
    grr[3] = {**grr[3], "extra": 1}
    grr[5] = {**grr[5], "other": 2}
    reports = [report("page", 1, payloads_of("page", 1, np.array([1]))[0])]
    reports += [report("colour", 1, payload) for payload in grr]
    with pytest.raises(BatchRejected) as caught:
        prepare(ReportBatch.model_validate({"reports": reports}), CATALOG, HOUR, NOW)
    assert [(p["report"], p["field"]) for p in caught.value.problems] == [(4, "payload")]
    assert "unexpected field(s) ['extra']" in caught.value.problems[0]["message"]


def test_a_refused_report_does_not_hide_a_bad_payload_in_another() -> None:
    """Reports of a refused time are left out of their group; the others' payloads are
    still checked, so one rejection names both problems."""
    grr = payloads_of("colour", 1, np.array([0, 1, 2]))
    future = (NOW + timedelta(hours=3)).strftime("%Y-%m-%dT%H:00:00Z")
    reports = [
        report("colour", 1, grr[0], time=future),
        report("colour", 1, {"value": 99}),
        report("colour", 1, grr[2]),
    ]
    with pytest.raises(BatchRejected) as caught:
        prepare(ReportBatch.model_validate({"reports": reports}), CATALOG, HOUR, NOW)
    assert [(p["report"], p["field"]) for p in caught.value.problems] == [
        (0, "time"),
        (1, "payload"),
    ]
