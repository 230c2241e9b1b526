"""Attack: make the server reread its whole metric catalog, request after request.

A device key (or anyone, for the public listing) could name metrics that do not exist:
each such report made the server reread and reparse every metric definition, so with
one 100,000-candidate RAPPOR metric defined a batch of 10,000 such reports took minutes
of server CPU, and every ``GET /v1/metrics`` reserialized 2 MB. Defence: a batch looks
each distinct (metric, version) up once in the in-memory catalog; the catalog rereads
the definitions only when the storage's change stamp moved (checked at most once per
second); the listing is serialized once per catalog state and served with an ETag (304
on ``If-None-Match``). The test counts reloads through ``ldp_catalog_reloads_total``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import httpx
import pytest

from simulations.server import Server

RAPPOR = {
    "mechanism": "rappor",
    "num_bits": 32,
    "num_hashes": 1,
    "num_cohorts": 64,
    "f": 0.5,
    "p": 0.25,
    "q": 0.75,
}


def reloads(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r"^ldp_catalog_reloads_total (\S+)$", text, re.MULTILINE)
    assert found is not None, "the server exports no ldp_catalog_reloads_total"
    return float(found.group(1))


@pytest.mark.slow
def test_unknown_metrics_and_the_listing_cost_no_reload(
    hostile_target: Callable[..., Server],
) -> None:
    server = hostile_target()
    admin = server.headers("admin")
    big = {
        "description": "100,000 candidate strings",
        "mechanism": RAPPOR,
        "labels": [f"candidate-{i}.example" for i in range(100_000)],
    }
    defined = httpx.put(f"{server.url}/v1/metrics/big", json=big, headers=admin, timeout=60)
    assert defined.status_code == 201, defined.text
    before = reloads(server)

    batch = {
        "reports": [
            {"report_id": str(uuid.uuid4()), "metric": f"no-such-{i}", "version": 1, "payload": {}}
            for i in range(10_000)
        ]
    }
    refused = httpx.post(
        f"{server.url}/v1/reports", json=batch, headers=server.headers("device"), timeout=60
    )
    assert refused.status_code == 422, refused.text
    problems = refused.json()["errors"]
    assert len(problems) == 10_000
    assert problems[9_999] == {
        "report": 9_999,
        "field": "metric",
        "message": "unknown metric 'no-such-9999'",
    }

    first = httpx.get(f"{server.url}/v1/metrics", timeout=60)
    assert first.status_code == 200 and "big" in {m["name"] for m in first.json()}
    etag = first.headers["etag"]
    second = httpx.get(f"{server.url}/v1/metrics", headers={"If-None-Match": etag})
    assert second.status_code == 304 and second.content == b""
    third = httpx.get(f"{server.url}/v1/metrics", timeout=60)
    assert third.content == first.content and third.headers["etag"] == etag

    assert reloads(server) == before, server.log_tail()
