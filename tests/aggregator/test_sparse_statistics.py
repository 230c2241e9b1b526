"""A tiny batch writes a row in proportion to its reports, not to the metric's table.

Partial statistics used to be stored dense: with a RAPPOR metric at the largest allowed
table (1,024 cohorts x 4,095 bits + the cohort counts = 2^22 cells), each one-report
request wrote a 32 MiB row (four of them grew the database by 193 MiB). They are now
written in the smaller of a dense and a sparse format (``CountStatistics.to_bytes``): a
report of k bits adds at most k + 1 nonzero cells, 12 bytes each. Rows written dense
before the sparse format existed still load, and compaction writes the smaller form.
"""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.repositories.reports import ReportsRepository
from aggregator.settings import Settings
from aggregator.storage import PartialRow
from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

KEYS = {
    "admin": "sparse-admin-key-0123456789",
    "analyst": "sparse-analyst-key-0123456789",
    "device": "sparse-device-key-0123456789",
}
LARGEST_RAPPOR = {
    "mechanism": "rappor",
    "num_bits": 4095,
    "num_hashes": 2,
    "num_cohorts": 1024,
    "f": 0.5,
    "p": 0.5,
    "q": 0.75,
}
SMALL_RAPPOR = {**LARGEST_RAPPOR, "num_bits": 16, "num_cohorts": 4}
CANDIDATES = ["alpha.example", "beta.example"]
MiB = 1 << 20


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database=str(tmp_path / "sparse.sqlite3"), min_reports=1, compaction_interval=0
    )
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as test_client:
        yield test_client


def storage_of(client: TestClient) -> ReportsRepository:
    return client.app.state.services.repositories.reports  # type: ignore[attr-defined,no-any-return]


def define(client: TestClient, name: str, spec: dict[str, Any]) -> Rappor:
    body = {"mechanism": spec, "labels": CANDIDATES}
    response = client.put(f"/v1/metrics/{name}", json=body, headers=auth("admin"))
    assert response.status_code == 201, response.text
    mech = make_mechanism(MechanismSpec.model_validate(spec))
    assert isinstance(mech, Rappor)
    return mech


def random_payloads(mech: Rappor, count: int, seed: int) -> list[dict[str, Any]]:
    """Reports with uniformly random bits and cohorts (any bits are a valid report)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, (count, mech.num_bits), dtype=np.uint8)
    packed = np.packbits(bits, axis=1, bitorder="little")
    cohorts = rng.integers(0, mech.num_cohorts, count)
    return [
        {"cohort": int(cohort), "bits": base64.b64encode(row.tobytes()).decode()}
        for cohort, row in zip(cohorts, packed, strict=True)
    ]


def post(client: TestClient, name: str, payloads: list[dict[str, Any]]) -> None:
    batch = [
        {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": payload}
        for payload in payloads
    ]
    response = client.post("/v1/reports", json={"reports": batch}, headers=auth("device"))
    assert response.json() == {"accepted": len(payloads), "duplicates": 0}, response.text


def database_bytes(client: TestClient) -> int:
    path = Path(client.app.state.aggregator.settings.database)  # type: ignore[attr-defined]
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def estimate(client: TestClient, name: str) -> dict[str, Any]:
    response = client.get(f"/v1/metrics/{name}/estimate", headers=auth("analyst"))
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def assert_estimates(body: dict[str, Any], mech: Rappor, reports: np.ndarray) -> None:
    """The published estimate is the mechanism's estimate of all the reports, exactly."""
    expected = mech.estimate(mech.aggregate(reports), candidates=CANDIDATES)
    assert body["n"] == reports.size
    assert [c["frequency"] for c in body["candidates"]] == expected.frequencies.tolist()
    assert [c["std"] for c in body["candidates"]] == expected.std.tolist()


def test_one_report_requests_to_the_largest_rappor_table_write_kilobytes(
    client: TestClient,
) -> None:
    mech = define(client, "site", LARGEST_RAPPOR)
    assert mech.empty_statistics().length == 1 << 22  # 32 MiB as a dense row
    payloads = random_payloads(mech, 4, seed=3)
    before = database_bytes(client)
    for payload in payloads:
        post(client, "site", [payload])
    grown = database_bytes(client) - before
    assert grown < 1 * MiB, f"four one-report requests grew the database by {grown} bytes"
    rows = storage_of(client).partial_rows("site", 1)
    assert len(rows) == 4
    bound = 5 + 24 + 12 * (mech.num_bits + 1)  # header + at most k + 1 cells per report
    assert all(len(row.stats) <= bound for row in rows)
    assert_estimates(estimate(client, "site"), mech, mech.from_payloads(payloads))


def legacy_dense_blob(stats: CountStatistics) -> bytes:
    """A row as written before the sparse format existed (always dense)."""
    header = b"LDPC1" + struct.pack("<qq", stats.n, stats.length)
    return header + stats.counts.astype("<i8").tobytes()


@pytest.mark.parametrize(("reports_per_row", "smaller"), [(1, b"LDPS1"), (40, b"LDPC1")])
def test_legacy_dense_rows_load_and_compaction_writes_the_smaller_form(
    client: TestClient, reports_per_row: int, smaller: bytes
) -> None:
    mech = define(client, "site", SMALL_RAPPOR)
    storage = storage_of(client)
    old = mech.from_payloads(random_payloads(mech, 2 * reports_per_row, seed=11))
    new = random_payloads(mech, reports_per_row, seed=12)
    post(client, "site", new)
    (sparse_row,) = storage.partial_rows("site", 1)  # old rows go into the same bucket
    legacy = [mech.aggregate(part) for part in np.array_split(old, 2)]
    storage.add_partial_rows(
        [PartialRow("site", 1, sparse_row.bucket, s.n, legacy_dense_blob(s)) for s in legacy]
    )
    everything = np.concatenate([old, mech.from_payloads(new)])
    before = estimate(client, "site")
    assert_estimates(before, mech, everything)

    response = client.post("/v1/admin/compact", headers=auth("admin"))
    assert response.json() == {"groups": 1, "rows_merged": 3}
    (compacted,) = storage.partial_rows("site", 1)
    total = mech.aggregate(everything)
    nonzero = int(np.count_nonzero(total.counts))
    assert compacted.stats[:5] == smaller
    assert len(compacted.stats) == min(5 + 16 + 8 * total.length, 5 + 24 + 12 * nonzero)
    assert mech.statistics_from_bytes(compacted.stats) == total
    assert estimate(client, "site") == before
