"""A metric's unit, and the dashboard's typed page routes, without a browser.

Checked here: ``unit`` is optional and short (1 to 32 characters); a definition that
changes only its unit keeps its version (as one that changes only its description),
while a change of spec still makes a new one; the metric page shows the unit in the
promise and hands it to the page's script; the page routes take typed parameters (a
name that fails the API's name pattern, a version that is not a positive integer) and
answer anything else with the HTML "not found" page, never a JSON problem document.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import ValidationError

from aggregator.app import create_app
from aggregator.registry import METRIC_NAME
from aggregator.routes.ui import router
from aggregator.service import Aggregator
from aggregator.settings import Settings
from shared.schemas import MechanismSpec, MetricDefinition

LATENCY = MechanismSpec(mechanism="piecewise", epsilon=1.0, lower=0.0, upper=5000.0)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    database = tmp_path_factory.mktemp("units") / "units.sqlite3"
    app = create_app(Settings(database=str(database), compaction_interval=0))
    with TestClient(app) as test_client:
        yield test_client


def service_of(client: TestClient) -> Aggregator:
    service: Aggregator = client.app.state.aggregator  # type: ignore[attr-defined]
    return service


@pytest.mark.parametrize("unit", ["ms", "x" * 32, None])
def test_a_unit_is_optional_and_short(unit: str | None) -> None:
    assert MetricDefinition(mechanism=LATENCY, unit=unit).unit == unit


@pytest.mark.parametrize("unit", ["", "x" * 33])
def test_a_unit_that_is_empty_or_long_is_refused(unit: str) -> None:
    with pytest.raises(ValidationError, match="unit"):
        MetricDefinition(mechanism=LATENCY, unit=unit)


def test_a_new_unit_keeps_the_version_a_new_spec_does_not(client: TestClient) -> None:
    service = service_of(client)
    first, created = service.define("load.ms", MetricDefinition(mechanism=LATENCY, unit="ms"))
    assert created and first.version == 1 and first.unit == "ms"
    renamed, created = service.define(
        "load.ms", MetricDefinition(mechanism=LATENCY, unit="milliseconds")
    )
    assert not created and renamed.version == 1 and renamed.unit == "milliseconds"
    assert service.catalog.get("load.ms") == renamed
    wider = LATENCY.model_copy(update={"upper": 9000.0})
    second, created = service.define("load.ms", MetricDefinition(mechanism=wider, unit="ms"))
    assert created and second.version == 2
    listed = client.get("/v1/metrics").json()
    assert [m["unit"] for m in listed if m["name"] == "load.ms"] == ["ms"]


def test_the_metric_page_shows_the_unit(client: TestClient) -> None:
    service = service_of(client)
    service.define("wait", MetricDefinition(mechanism=LATENCY, unit="s"))
    service.define("plain", MetricDefinition(mechanism=LATENCY))
    html = client.get("/ui/metrics/wait").text
    assert 'data-unit="s"' in html and '<dt>Unit</dt><dd class="unit">s</dd>' in html
    assert "numbers clipped to [0, 5000] s" in html
    overview = client.get("/ui/").text
    assert "numbers clipped to [0, 5000] s" in overview
    plain = client.get("/ui/metrics/plain").text
    assert 'data-unit=""' in plain and "<dt>Unit</dt>" not in plain
    assert "numbers clipped to [0, 5000]</" in plain


def test_a_unit_is_rendered_as_text(client: TestClient) -> None:
    service_of(client).define("tagged", MetricDefinition(mechanism=LATENCY, unit="<b>ms"))
    html = client.get("/ui/metrics/tagged").text
    assert "<b>ms" not in html and 'data-unit="&lt;b&gt;ms"' in html


def test_the_page_routes_are_typed_and_answer_html() -> None:
    routes = {route.name: route for route in router.routes if isinstance(route, APIRoute)}
    assert set(routes) == {"overview", "metric", "federated", "task"}
    for route in routes.values():
        assert route.response_class is HTMLResponse and not route.include_in_schema
    (name,) = routes["metric"].dependant.path_params
    assert name.field_info.annotation is str
    assert [rule.pattern for rule in name.field_info.metadata] == [METRIC_NAME.pattern]
    (version,) = routes["metric"].dependant.query_params
    assert version.field_info.annotation == int | None


@pytest.mark.parametrize(
    ("path", "what"),
    [
        ("/ui/metrics/Not%20A%20Name", "metric Not A Name"),
        ("/ui/metrics/" + "a" * 65, "metric " + "a" * 65),
        ("/ui/metrics/plain?version=abc", "metric plain version abc"),
        ("/ui/metrics/plain?version=-1", "metric plain version -1"),
        ("/ui/metrics/plain?version=99999999999", "metric plain version 99999999999"),
        ("/ui/metrics/plain?version=2", "metric plain version 2"),
        ("/ui/federated/-x", "task -x"),
    ],
)
def test_a_page_that_does_not_exist_is_the_html_not_found_page(
    client: TestClient, path: str, what: str
) -> None:
    service_of(client).define("plain", MetricDefinition(mechanism=LATENCY))
    response = client.get(path)
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert f"There is no {what}." in response.text
