"""A metric's JSON round-trips: a ``GET /v1/metrics`` item is a valid ``PUT`` body.

Exporting the metrics of one aggregator and loading them into another is a loop over
``GET /v1/metrics`` and ``PUT /v1/metrics/{name}`` with each item as it is. The item
carries ``name`` (which must equal the path's name) and ``version`` (read-only: the
server assigns versions, so the one sent is ignored). Checked for every mechanism kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.settings import Settings

ADMIN_KEY = "roundtrip-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROBLEM = "application/problem+json"

#: One metric per mechanism kind: (spec, labels).
METRICS: dict[str, tuple[dict[str, Any], list[str] | None]] = {
    "grr": ({"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}, ["red", "green", "blue"]),
    "sue": ({"mechanism": "sue", "epsilon": 1.5, "domain_size": 4}, None),
    "oue": ({"mechanism": "oue", "epsilon": 2.0, "domain_size": 5}, list("abcde")),
    "olh": ({"mechanism": "olh", "epsilon": 1.0, "domain_size": 10}, None),
    "hr": ({"mechanism": "hr", "epsilon": 1.0, "domain_size": 6}, list("uvwxyz")),
    "auto": ({"mechanism": "auto", "epsilon": 1.0, "domain_size": 8}, None),
    "rappor": (
        {
            "mechanism": "rappor",
            "num_bits": 16,
            "num_hashes": 2,
            "num_cohorts": 4,
            "f": 0.5,
            "p": 0.25,
            "q": 0.75,
        },
        ["a.example", "b.example", "c.example"],
    ),
    "laplace": ({"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 10.0}, None),
    "duchi": ({"mechanism": "duchi", "epsilon": 0.5, "lower": -1.0, "upper": 1.0}, None),
    "piecewise": (
        {"mechanism": "piecewise", "epsilon": 2.0, "lower": 0.0, "upper": 120.0, "grid_steps": 16},
        None,
    ),
}


@contextmanager
def service(database: Path) -> Iterator[TestClient]:
    """A fresh aggregator over ``database`` with one admin key."""
    app = create_app(Settings(database=str(database), compaction_interval=0))
    bootstrap_keys(
        app.state.keys, app.state.services.repositories.keys, {"LDP_ADMIN_KEYS": ADMIN_KEY}
    )
    with TestClient(app) as client:
        yield client


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[[], TestClient]]:
    """``new()`` makes another fresh aggregator (its own SQLite file); all closed after."""
    made: list[Path] = []
    with ExitStack() as stack:

        def new() -> TestClient:
            made.append(tmp_path / f"service-{len(made)}.sqlite3")
            return stack.enter_context(service(made[-1]))

        yield new


def put(client: TestClient, name: str, body: dict[str, Any]) -> Response:
    return client.put(f"/v1/metrics/{name}", json=body, headers=ADMIN)


def listing(client: TestClient) -> list[dict[str, Any]]:
    response = client.get("/v1/metrics")
    assert response.status_code == 200, response.text
    return list(response.json())


def definition(kind: str) -> dict[str, Any]:
    spec, labels = METRICS[kind]
    body: dict[str, Any] = {"description": f"a {kind} metric", "mechanism": spec}
    if labels is not None:
        body["labels"] = labels
    return body


@pytest.mark.parametrize("kind", list(METRICS))
def test_a_listed_metric_loads_into_a_fresh_service_unchanged(
    services: Callable[[], TestClient], kind: str
) -> None:
    source, target = services(), services()
    name = f"roundtrip.{kind}"
    assert put(source, name, definition(kind)).status_code == 201
    exported = listing(source)
    [item] = exported
    assert item["name"] == name and item["version"] == 1

    loaded = put(target, name, item)
    assert loaded.status_code == 201, loaded.text
    assert loaded.json() == item
    assert listing(target) == exported
    assert (
        target.get(f"/v1/metrics/{name}/versions").json()
        == source.get(f"/v1/metrics/{name}/versions").json()
    )

    # Loading the same item again is a no-op: the same version, nothing new.
    again = put(target, name, item)
    assert again.status_code == 200, again.text
    assert listing(target) == exported


def test_the_whole_listing_loads_at_once(services: Callable[[], TestClient]) -> None:
    source, target = services(), services()
    for kind in METRICS:
        assert put(source, f"all.{kind}", definition(kind)).status_code == 201
    exported = listing(source)
    assert len(exported) == len(METRICS)
    for item in exported:
        assert put(target, item["name"], item).status_code == 201
    assert listing(target) == exported


def test_the_version_in_the_body_is_ignored_the_server_assigns_it(
    services: Callable[[], TestClient],
) -> None:
    source, target = services(), services()
    first = definition("grr")
    assert put(source, "colour", first).status_code == 201
    second = {**first, "mechanism": {**first["mechanism"], "epsilon": 2.0}}
    assert put(source, "colour", second).status_code == 201
    [item] = listing(source)
    assert item["version"] == 2

    # A fresh service has no version 1 of it: the item becomes its version 1.
    loaded = put(target, "colour", item)
    assert loaded.status_code == 201, loaded.text
    assert loaded.json() == {**item, "version": 1}

    # Any version number is accepted and ignored; the spec decides whether one is new.
    for claimed in (1, 7, 2**40):
        same = put(target, "colour", {**item, "version": claimed})
        assert same.status_code == 200 and same.json()["version"] == 1, same.text
    changed = put(target, "colour", {**first, "name": "colour", "version": 1})
    assert changed.status_code == 201 and changed.json()["version"] == 2, changed.text


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"name": "other"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "colour", "version": 0}, "version"),
        ({"name": "colour", "version": "two"}, "version"),
        ({"name": "colour", "owner": "team"}, "owner"),
    ],
    ids=["another name", "empty name", "version 0", "version not a number", "unknown field"],
)
def test_a_body_that_disagrees_is_refused_and_changes_nothing(
    services: Callable[[], TestClient], extra: dict[str, Any], field: str
) -> None:
    client = services()
    assert put(client, "colour", definition("grr")).status_code == 201
    before = listing(client)
    refused = put(client, "colour", {**definition("oue"), **extra})
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"].startswith(PROBLEM)
    problem = refused.json()
    assert field in [item["field"] for item in problem["errors"]], problem
    if field == "name":
        assert repr(extra["name"]) in problem["detail"] and "'colour'" in problem["detail"]
    assert listing(client) == before
    assert client.get("/v1/metrics/other/versions").status_code == 404


def test_a_unit_is_kept_by_put_and_changing_it_makes_no_new_version(
    services: Callable[[], TestClient],
) -> None:
    client = services()
    body = definition("laplace") | {"unit": "minutes"}
    created = put(client, "timed", body)
    assert created.status_code == 201, created.text
    assert created.json()["unit"] == "minutes"
    [item] = listing(client)
    assert item["unit"] == "minutes"
    changed = put(client, "timed", body | {"unit": "s"})
    assert changed.status_code == 200 and changed.json()["version"] == 1
    assert [entry["unit"] for entry in listing(client)] == ["s"]
