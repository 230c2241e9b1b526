"""Attacks with small batches: differencing a lone report out of two windows, and
inflating the database with one-report requests.

1. Differencing. With ``--min-reports 10`` a lone report's hour was refused (409), but
   the estimates over ``[h-3, h)`` and ``[h-3, h+1)`` were both released and differed by
   exactly that report's histogram. Defence: the threshold applies to each stored time
   bucket (the sum over its partial rows); a bucket below it is left out of every
   estimate and counted in ``suppressed_buckets`` / ``suppressed_reports``, so the two
   windows give the same estimate.
2. Storage amplification. A RAPPOR metric at the largest allowed table (1,024 cohorts x
   4,095 bits: 2^22 counts) stored every batch as a dense row: four one-report requests
   (about 3.3 KB on the wire) grew the database by 193 MiB. Defence: partial statistics
   are written in the smaller of a dense and a sparse format, and RAPPOR aggregates only
   the cohorts a batch holds; a report of k bits costs at most 29 + 12 (k + 1) bytes.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from simulations.server import Server

GRR4 = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}
LARGEST_RAPPOR = {
    "mechanism": "rappor",
    "num_bits": 4095,
    "num_hashes": 2,
    "num_cohorts": 1024,
    "f": 0.5,
    "p": 0.5,
    "q": 0.75,
}
MiB = 1 << 20


def hour(offset: int) -> str:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return (now + timedelta(hours=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


def define(server: Server, name: str, body: dict[str, Any]) -> None:
    response = httpx.put(
        f"{server.url}/v1/metrics/{name}", json=body, headers=server.headers("admin"), timeout=30
    )
    assert response.status_code == 201, response.text


def send(server: Server, name: str, payloads: list[dict[str, Any]], time: str | None) -> None:
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": payload}
        | ({"time": time} if time is not None else {})
        for payload in payloads
    ]
    response = httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60,
    )
    assert response.json() == {"accepted": len(payloads), "duplicates": 0}, response.text


def estimate(server: Server, name: str, **params: str) -> httpx.Response:
    return httpx.get(
        f"{server.url}/v1/metrics/{name}/estimate",
        params=params,
        headers=server.headers("analyst"),
        timeout=120,
    )


@pytest.mark.slow
def test_differencing_two_windows_reveals_nothing(
    hostile_target: Callable[..., Server],
) -> None:
    server = hostile_target("--min-reports", "10")
    define(server, "colour", {"mechanism": GRR4})
    for offset in (-4, -3, -2):
        send(server, "colour", [{"value": v} for v in [0, 1, 2] * 3 + [0]], hour(offset))
    send(server, "colour", [{"value": 3}], hour(-1))  # the victim: alone in its hour
    assert estimate(server, "colour", start=hour(-1), end=hour(0)).status_code == 409

    before = estimate(server, "colour", start=hour(-4), end=hour(-1))
    after = estimate(server, "colour", start=hour(-4), end=hour(0))
    assert before.status_code == after.status_code == 200, server.log_tail()
    left, right = before.json(), after.json()
    # What an attacker subtracts: every per-category number is identical.
    assert right["n"] == left["n"] == 30
    assert right["estimates"] == left["estimates"]
    assert right["postprocessed"] == left["postprocessed"]
    assert (right["suppressed_buckets"], right["suppressed_reports"]) == (1, 1)
    assert (left["suppressed_buckets"], left["suppressed_reports"]) == (0, 0)


@pytest.mark.slow
def test_one_report_requests_cannot_inflate_the_database(
    hostile_target: Callable[..., Server], tmp_path: Path
) -> None:
    server = hostile_target()
    define(server, "site", {"mechanism": LARGEST_RAPPOR, "labels": ["a.example", "b.example"]})
    database = tmp_path / "target-0.db"
    wal = tmp_path / "target-0.db-wal"

    def size() -> int:
        return database.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    rng = np.random.default_rng(5)
    packed = np.packbits(rng.integers(0, 2, (4, 4095), dtype=np.uint8), axis=1, bitorder="little")
    payloads = [
        {"cohort": int(cohort), "bits": base64.b64encode(row.tobytes()).decode()}
        for cohort, row in zip(rng.integers(0, 1024, 4), packed, strict=True)
    ]
    assert sum(len(str(p)) for p in payloads) < 4 * 1024  # a few kilobytes on the wire
    start = size()
    for payload in payloads:
        send(server, "site", [payload], None)
    grown = size() - start
    assert grown < 1 * MiB, f"four one-report requests grew the database by {grown} bytes"

    response = estimate(server, "site")
    assert response.status_code == 200, server.log_tail()
    assert response.json()["n"] == 4
