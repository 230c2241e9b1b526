"""The release threshold applies per time bucket, so differencing windows reveals nothing.

With a threshold on a window's total only, the estimates over ``[h-3, h)`` and
``[h-3, h+1)`` differ by exactly the reports of hour ``h``: one lone report's hour was
refused (409) on its own, but its histogram was the difference of two released
estimates. Now a bucket's reports enter an estimate only when the bucket holds at least
``min_reports`` (summed over its partial rows), so adding a small bucket to a window
leaves the estimate unchanged, and the estimate says what it left out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.estimates import ReleasedBuckets
from aggregator.repositories.reports import ReportsRepository
from aggregator.settings import Settings
from aggregator.storage import PartialRow

KEYS = {
    "admin": "threshold-admin-key-0123456789",
    "analyst": "threshold-analyst-key-0123456789",
    "device": "threshold-device-key-0123456789",
}
MIN_REPORTS = 10
GRR4 = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}
#: Fields that describe the window and what it left out, not the estimate itself.
WINDOW_FIELDS = {
    "window",
    "buckets",
    "suppressed_buckets",
    "suppressed_reports",
    "pending_reports",
}


@dataclass
class Api:
    client: TestClient
    storage: ReportsRepository

    def define(self, name: str, spec: dict[str, Any]) -> None:
        response = self.client.put(
            f"/v1/metrics/{name}", json={"mechanism": spec}, headers=self.auth("admin")
        )
        assert response.status_code == 201, response.text

    def post(self, name: str, values: list[int], hour_offset: int) -> None:
        """One batch of GRR reports of ``values`` (as sent, no noise needed), in one hour."""
        batch = [
            {
                "report_id": str(uuid.uuid4()),
                "metric": name,
                "version": 1,
                "payload": {"value": value},
                "time": iso(hour_offset),
            }
            for value in values
        ]
        response = self.client.post(
            "/v1/reports", json={"reports": batch}, headers=self.auth("device")
        )
        assert response.json() == {"accepted": len(values), "duplicates": 0}, response.text

    def estimate(self, name: str, start: int | None = None, end: int | None = None) -> Response:
        params = {}
        if start is not None:
            params["start"] = iso(start)
        if end is not None:
            params["end"] = iso(end)
        return self.client.get(
            f"/v1/metrics/{name}/estimate", params=params, headers=self.auth("analyst")
        )

    def released(self, name: str, start: int | None = None, end: int | None = None) -> Any:
        response = self.estimate(name, start, end)
        assert response.status_code == 200, response.text
        return response.json()

    def compact(self) -> Any:
        return self.client.post("/v1/admin/compact", headers=self.auth("admin")).json()

    @staticmethod
    def auth(role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[role]}"}


def iso(hour_offset: int) -> str:
    """The start of the current UTC hour plus ``hour_offset`` hours."""
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return (now + timedelta(hours=hour_offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextmanager
def running(database: str) -> Iterator[Api]:
    settings = Settings(database=database, min_reports=MIN_REPORTS, compaction_interval=0)
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Api(client, app.state.services.repositories.reports)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with running(str(tmp_path / "threshold.sqlite3")) as service:
        yield service


@pytest.fixture
def db_api(database_url: str) -> Iterator[Api]:
    with running(database_url) as service:
        yield service


def estimate_only(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in WINDOW_FIELDS}


def test_differencing_two_windows_no_longer_reveals_a_lone_report(api: Api) -> None:
    """The attack: [h-3, h) and [h-3, h+1), where hour h holds one report (value 3)."""
    api.define("colour", GRR4)
    for offset in (-5, -4, -3):
        api.post("colour", [0, 1, 2, 0, 1, 2, 0, 1, 2, 0], offset)
    api.post("colour", [3], -2)  # the lone report: its hour alone is refused
    alone = api.estimate("colour", -2, -1)
    assert alone.status_code == 409
    assert "holds 1 reports in 1 time bucket" in alone.json()["detail"]

    without = api.released("colour", -5, -2)
    with_lone = api.released("colour", -5, -1)
    assert estimate_only(with_lone) == estimate_only(without)  # nothing to difference
    assert with_lone["n"] == without["n"] == 30
    assert (without["buckets"], without["suppressed_buckets"], without["suppressed_reports"]) == (
        3,
        0,
        0,
    )
    assert (with_lone["buckets"], with_lone["suppressed_buckets"]) == (3, 1)
    assert with_lone["suppressed_reports"] == 1
    assert with_lone["min_reports"] == MIN_REPORTS
    # Unbounded windows and a window of the small bucket with others: the same estimate.
    for start, end in ((None, None), (-5, None), (-4, -1)):
        body = api.released("colour", start, end)
        assert body["suppressed_reports"] == 1
    assert estimate_only(api.released("colour", None, None)) == estimate_only(without)

    # Once the hour holds MIN_REPORTS reports it is released, with every one of them.
    api.post("colour", [3] * (MIN_REPORTS - 1), -2)
    grown = api.released("colour", -5, -1)
    assert (grown["n"], grown["buckets"], grown["suppressed_buckets"]) == (40, 4, 0)
    assert estimate_only(grown) != estimate_only(without)


def test_the_threshold_sums_a_buckets_partial_rows(db_api: Api) -> None:
    api = db_api
    api.define("colour", GRR4)
    # Hour -3: 10 reports in four batches (four partial rows of 3, 3, 2, 2): released.
    for values in ([0, 1, 2], [0, 1, 2], [3, 3], [0, 1]):
        api.post("colour", values, -3)
    # Hours -2 and -1: 6 reports each in two rows of 3; 12 in the window, none released.
    for offset in (-2, -1):
        api.post("colour", [0, 1, 2], offset)
        api.post("colour", [2, 2, 2], offset)
    assert len(api.storage.partial_rows("colour", 1)) == 8
    body = api.released("colour")
    assert (body["n"], body["buckets"]) == (10, 1)
    assert (body["suppressed_buckets"], body["suppressed_reports"]) == (2, 12)
    refused = api.estimate("colour", -2, None)
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "holds 12 reports in 2 time buckets" in detail and f"at least {MIN_REPORTS}" in detail


def test_compaction_changes_no_estimate_and_no_suppression(db_api: Api) -> None:
    api = db_api
    api.define("colour", GRR4)
    rng = np.random.default_rng(7)
    sizes = {-4: [4, 4, 4], -3: [5, 4], -2: [3, 3, 2], -1: [20]}  # 12, 9, 8, 20 reports
    for offset, batches in sizes.items():
        for size in batches:
            api.post("colour", rng.integers(0, 4, size).tolist(), offset)
    windows = [(None, None), (-4, -2), (-3, None), (-4, -3), (-3, -1)]
    before = {window: api.estimate("colour", *window) for window in windows}
    assert [before[w].status_code for w in windows] == [200, 200, 200, 200, 409]
    assert before[(None, None)].json()["suppressed_reports"] == 17
    assert api.compact() == {"groups": 3, "rows_merged": 8}  # hour -1 has one row already
    assert len(api.storage.partial_rows("colour", 1)) == 4
    after = {window: api.estimate("colour", *window) for window in windows}
    for window in windows:
        assert after[window].status_code == before[window].status_code
        assert after[window].json() == before[window].json()


def test_no_reports_at_all_is_a_clear_409(api: Api) -> None:
    api.define("colour", GRR4)
    response = api.estimate("colour")
    assert response.status_code == 409
    assert response.headers["content-type"].startswith("application/problem+json")
    detail = response.json()["detail"]
    assert detail.startswith("the window holds 0 reports;") and str(MIN_REPORTS) in detail


def row(bucket: int, n: int) -> PartialRow:
    return PartialRow("m", 1, bucket, n, b"")


def test_released_buckets_sum_rows_per_bucket() -> None:
    rows = [row(0, 4), row(3600, 9), row(0, 6), row(7200, 10), row(3600, 0), row(10800, 0)]
    released = ReleasedBuckets.of(rows, 10, current=10800)
    assert released.rows == [rows[0], rows[2], rows[3]]
    assert (released.buckets, released.suppressed_buckets, released.suppressed_reports) == (
        2,
        1,
        9,
    )
    assert released.pending_reports == 0  # the small bucket is not the current one
    empty = ReleasedBuckets.of([], 10, current=0)
    assert (empty.rows, empty.buckets, empty.suppressed_buckets) == ([], 0, 0)
    assert ReleasedBuckets.of(rows, 1, current=10800).suppressed_buckets == 0


def test_pending_reports_are_the_suppressed_ones_of_the_current_bucket() -> None:
    """Reports of the bucket still filling (``current`` and later) are pending; those of a
    closed small bucket are suppressed only; a current bucket at the threshold is released."""
    rows = [row(0, 4), row(3600, 9), row(7200, 3), row(7200, 2)]
    released = ReleasedBuckets.of(rows, 5, current=7200)
    assert (released.suppressed_reports, released.pending_reports) == (4, 0)
    released = ReleasedBuckets.of(rows, 10, current=7200)
    assert (released.suppressed_reports, released.pending_reports) == (18, 5)
    assert ReleasedBuckets.of(rows, 10, current=3600).pending_reports == 14
