"""Storage faults on SQLite: a full database, and a database file that lost its contents.

A full database (``PRAGMA max_page_count`` at the file's size, so that any growth fails
with ``SQLITE_FULL``, as a full disk does) must answer 503 with ``Retry-After``, not 500,
with ``/healthz`` saying that the writer cannot commit; once there is room again the
same batch is stored, and every report is counted once.

A zero-length file, a missing file whose marker says a database was created there, and
a file without the aggregator's tables beside such a marker must be refused with one
line saying what to do, by the storage and by ``ldp-aggregator serve``, and left as
they are; a brand-new path still gets a new database.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import aggregator
from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.registry import DEMO_METRICS
from aggregator.settings import Settings
from aggregator.storage import MissingDatabaseError, Repositories

#: The checkout whose aggregator the test runs (and the command it starts).
REPO = Path(aggregator.__file__).resolve().parents[1]
METRIC, VERSION, DOMAIN = "app.theme", 1, 3  # a demo metric: GRR over three categories
KEYS = {"admin": "faults-admin-key-0123456789", "device": "faults-device-key-0123456789"}
ANALYST = "faults-analyst-key-0123456789"


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_batch(size: int) -> list[dict[str, Any]]:
    return [
        {
            "report_id": str(uuid.uuid4()),
            "metric": METRIC,
            "version": VERSION,
            "payload": {"value": index % DOMAIN},
        }
        for index in range(size)
    ]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database=str(tmp_path / "full.sqlite3"), compaction_interval=0, min_reports=1
    )
    app = create_app(settings)
    service = app.state.aggregator
    service.define_missing(DEMO_METRICS)
    environment = {
        "LDP_ADMIN_KEYS": KEYS["admin"],
        "LDP_ANALYST_KEYS": ANALYST,
        "LDP_DEVICE_KEYS": KEYS["device"],
    }
    bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment)
    with TestClient(app) as test_client:
        yield test_client


def set_max_pages(client: TestClient, pages: int | None) -> None:
    """Cap the database at ``pages`` pages (None: at its size now) on the writers' connection."""
    database = client.app.state.services.repositories.database  # type: ignore[attr-defined]
    with database.write() as conn:
        if pages is None:
            pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar_one())
        conn.exec_driver_sql(f"PRAGMA max_page_count = {pages}")


def test_a_full_sqlite_database_answers_503_with_retry_after_and_recovers(
    client: TestClient,
) -> None:
    first = new_batch(10)
    reply = client.post("/v1/reports", json={"reports": first}, headers=headers(KEYS["device"]))
    assert reply.status_code == 200, reply.text
    set_max_pages(client, None)

    refused = new_batch(3000)  # thousands of new ids need new pages
    response = client.post(
        "/v1/reports", json={"reports": refused}, headers=headers(KEYS["device"])
    )
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    body = response.json()
    assert body["type"] == "/problems/storage-unavailable"
    assert "full" in body["detail"] and "send it again" in body["detail"]

    health = client.get("/healthz")
    assert health.status_code == 503, health.text
    assert int(health.headers["retry-after"]) >= 1
    assert "writer cannot commit" in health.json()["detail"]
    assert "full" in health.json()["detail"]

    set_max_pages(client, 1_000_000_000)  # room again
    again = client.post("/v1/reports", json={"reports": refused}, headers=headers(KEYS["device"]))
    assert again.status_code == 200, again.text
    assert again.json() == {"accepted": len(refused), "duplicates": 0}  # nothing was stored
    assert client.get("/healthz").status_code == 200
    estimate = client.get(f"/v1/metrics/{METRIC}/estimate", headers=headers(ANALYST))
    assert estimate.status_code == 200, estimate.text
    assert estimate.json()["n"] == len(first) + len(refused)


# --- a database file that lost its contents ---------------------------------------------


def make_database(path: Path) -> None:
    """A database with one report, closed (its WAL checkpointed into the file)."""
    storage = Repositories.open(str(path))
    try:
        storage.reports.ingest([uuid.uuid4().bytes], lambda new: [])
    finally:
        storage.close()


def refusal(path: Path) -> str:
    with pytest.raises(MissingDatabaseError) as raised:
        Repositories.open(str(path))
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_an_emptied_database_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    path.write_bytes(b"")  # truncated: a failed copy, a full disk, an operator's mistake
    message = refusal(path)
    assert f"the SQLite file {path} is empty (0 bytes)" in message
    assert "restore it from a backup" in message
    assert f"delete {path}" in message and f"{path}-created" in message
    assert path.stat().st_size == 0  # nothing was created in it


def test_an_empty_file_is_refused_even_without_a_marker(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    path.touch()
    assert "is empty (0 bytes)" in refusal(path)
    assert path.stat().st_size == 0


def test_a_deleted_database_with_its_marker_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    path.unlink()
    message = refusal(path)
    assert f"the SQLite file {path} is missing" in message
    assert f"delete {path}-created to start a new, empty database" in message
    assert not path.exists()


def test_a_file_without_the_tables_beside_a_marker_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    path.unlink()
    with sqlite3.connect(path) as other:  # a valid SQLite file that is not the database
        other.execute("CREATE TABLE unrelated (x)")
    other.close()
    assert "holds none of the aggregator's tables" in refusal(path)


def test_a_new_path_gets_a_database_and_a_marker_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    marker = tmp_path / "agg.sqlite3-created"
    assert marker.is_file() and "ldp-aggregator" in marker.read_text()
    reopened = Repositories.open(str(path))
    try:
        assert reopened.reports.report_count() == 1
    finally:
        reopened.close()


def test_a_database_from_before_the_marker_opens_and_gets_one(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    marker = tmp_path / "agg.sqlite3-created"
    marker.unlink()
    make_database(path)
    assert marker.is_file()


def test_serve_refuses_an_empty_database_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "agg.sqlite3"
    make_database(path)
    path.write_bytes(b"")
    environment = {name: value for name, value in os.environ.items() if not name.startswith("LDP_")}
    environment["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-m", "aggregator.cli", "serve", "--database", str(path), "--port", "0"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1, result.stderr
    line = result.stderr.strip()
    assert line.startswith("ldp-aggregator: error: cannot open the database"), line
    assert "is empty (0 bytes)" in line and "restore it from a backup" in line
    assert path.stat().st_size == 0
