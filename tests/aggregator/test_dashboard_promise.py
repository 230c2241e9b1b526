"""The public promise of a metric with dimensions or several attributes, without a browser.

Checked here: a multi-attribute spec's attributes and declared pairs in words (labels
listed up to ``LISTED_LABELS``, then an ellipsis; numeric bounds), and the metric page's
rendering of dimensions (said to be sent in the clear) and of the breakdown choices.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.routes.ui import LISTED_LABELS, _attributes
from aggregator.settings import Settings
from shared.schemas import MechanismSpec, MetricDefinition


def test_attributes_and_pairs_in_words() -> None:
    many = [f"v{i}" for i in range(LISTED_LABELS + 3)]
    spec = {
        "attributes": [
            {"name": "theme", "domain_size": 3, "labels": ("light", "dark", "auto")},
            {"name": "font", "domain_size": 4, "labels": None},
            {"name": "country", "domain_size": len(many), "labels": many},
            {"name": "minutes", "lower": 0.0, "upper": 120.5},
        ],
        "pairs": (("theme", "font"),),
    }
    attributes, pairs = _attributes(spec)
    assert attributes == (
        "theme: 3 categories (light, dark, auto)",
        "font: 4 categories",
        f"country: {len(many)} categories ({', '.join(many[:LISTED_LABELS])}, …)",
        "minutes: numbers in [0, 120.5]",
    )
    assert pairs == ("theme × font",)
    assert _attributes({"attributes": spec["attributes"][:1], "pairs": None})[1] == ()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    database = tmp_path_factory.mktemp("promise") / "promise.sqlite3"
    app = create_app(Settings(database=str(database), compaction_interval=0))
    with TestClient(app) as test_client:
        yield test_client


def test_the_page_of_a_metric_with_dimensions_offers_the_breakdown(client: TestClient) -> None:
    service = client.app.state.aggregator  # type: ignore[attr-defined]
    spec = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 1.0, "domain_size": 2})
    dimensions: dict[str, tuple[str, ...]] = {
        "platform": ("android", "<b>ios</b>"),
        "version": ("1.0", "2.0"),
    }
    service.define("sliced", MetricDefinition(mechanism=spec, dimensions=dimensions))
    service.define("plain", MetricDefinition(mechanism=spec))
    html = client.get("/ui/metrics/sliced").text
    assert "not protected by local privacy" in html
    assert '<option value="platform">platform</option>' in html
    assert '<select class="where-select" data-dimension="version"' in html
    assert "&lt;b&gt;ios&lt;/b&gt;" in html and "<b>ios</b>" not in html  # admin input: text
    assert 'id="groups-section"' in html
    plain = client.get("/ui/metrics/plain").text
    assert "breakdown-by" not in plain and "groups-section" not in plain
