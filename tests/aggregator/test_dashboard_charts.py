"""The dashboard's charts in a real browser: axis titles and units, placeholders, the
epsilon budget on its axis, and a window that never ends in the future.

One server for the module (``ldp-aggregator serve --config``, a fresh SQLite file): a
numeric metric with a unit and a categorical one, both with reports in the current
hour, a categorical metric with no report at all, a federated task with an epsilon
budget of 4 that has run one round, and one that has run none. The browser, the tab
and what a tab must never do (leave the origin, show the key in an address, break
the page's policy, open a dialog) are those of ``test_dashboard_browser.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server
from tests.aggregator import test_dashboard_browser as browser_tests
from tests.aggregator.test_dashboard_browser import Session

# The browser, the tab and the screenshots' directory, as the other browser tests have them.
browser = browser_tests.browser
session = browser_tests.session
shots = browser_tests.shots

NUMERIC = "latency"
CATEGORICAL = "colour"
EMPTY = "quiet"
BUDGETED = "budgeted"
IDLE = "idle"
BUDGET = 4.0
CONFIG = """
[metrics.latency]
description = "Page load time."
unit = "ms"
[metrics.latency.mechanism]
mechanism = "piecewise"
epsilon = 2.0
lower = 0.0
upper = 5000.0

[metrics.colour]
labels = ["red", "green", "blue"]
[metrics.colour.mechanism]
mechanism = "grr"
epsilon = 2.0
domain_size = 3

[metrics.quiet]
labels = ["yes", "no"]
[metrics.quiet.mechanism]
mechanism = "grr"
epsilon = 1.0
domain_size = 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("dashboard-charts")
    config = directory / "metrics.toml"
    config.write_text(CONFIG)
    running = start_server(
        str(directory / "charts.sqlite3"), directory, extra=["--config", str(config)]
    )
    try:
        rng = np.random.default_rng(11)
        send_reports(running, NUMERIC, rng.gamma(4.0, 300.0, 400), rng)
        send_reports(running, CATEGORICAL, rng.choice(3, 300, p=[0.5, 0.3, 0.2]), rng)
        browser_tests.create_task(
            running, BUDGETED, {"target_epsilon": BUDGET}, rounds_run=1, rng=rng
        )
        browser_tests.create_task(running, IDLE, {"noise_multiplier": 1.0}, rounds_run=0, rng=rng)
        yield running
    finally:
        running.stop()


def send_reports(server: Server, name: str, values: np.ndarray, rng: np.random.Generator) -> None:
    """``values`` perturbed by the metric's mechanism (seeded), sent in the current hour."""
    (spec,) = [m for m in httpx.get(f"{server.url}/v1/metrics").json() if m["name"] == name]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec["mechanism"]))
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": payload}
        for payload in mechanism.to_payloads(mechanism.encode(values, rng=rng))
    ]
    response = httpx.post(
        f"{server.url}/v1/reports", json={"reports": reports}, headers=server.headers("device")
    )
    assert response.json() == {"accepted": len(values), "duplicates": 0}, response.text


def axis_titles(session: Session, canvas_id: str) -> dict[str, str]:
    """The title of each axis of the chart on ``canvas_id``, by axis id."""
    titles: dict[str, str] = session.page.evaluate(
        """(id) => {
            const chart = Chart.getChart(document.getElementById(id));
            return Object.fromEntries(Object.values(chart.scales).map(
                (scale) => [scale.id, scale.options.title.display ? scale.options.title.text : ""]
            ));
        }""",
        canvas_id,
    )
    return titles


def wait_for_chart(session: Session, canvas_id: str) -> None:
    session.page.wait_for_function(
        "(id) => Chart.getChart(document.getElementById(id)) !== undefined", arg=canvas_id
    )


def placeholder_of(session: Session, canvas_id: str) -> Any:
    """What is shown in the chart box of ``canvas_id`` instead of a chart."""
    return session.page.locator(f".chart-box:has(#{canvas_id}) .chart-placeholder")


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_axis_has_a_title_with_the_metrics_unit(session: Session) -> None:
    session.open(f"/ui/metrics/{NUMERIC}")
    session.enter_key()
    session.page.wait_for_selector("#mean-table")
    wait_for_chart(session, "series-chart")
    assert axis_titles(session, "series-chart") == {"x": "time (UTC)", "y": "mean (ms)"}
    assert axis_titles(session, "series-n-chart") == {"x": "time (UTC)", "y": "reports"}
    assert session.page.inner_text(".mean-value").endswith(" ms")
    headers = session.page.locator("#mean-table th").all_inner_texts()
    assert headers == ["Mean of", "Estimate (ms)", "95% interval (ms)", "Std (ms)"]
    assert session.page.inner_text(".promise dd.unit") == "ms"
    session.shot("metric-numeric-unit")

    session.open(f"/ui/metrics/{CATEGORICAL}")
    wait_for_chart(session, "estimate-chart")
    titles = axis_titles(session, "estimate-chart")
    assert titles == {"x": "category", "y": "share of reports (95% interval)"}
    wait_for_chart(session, "series-chart")
    item = session.page.locator("#series-item option:checked").inner_text()
    assert axis_titles(session, "series-chart") == {
        "x": "time (UTC)",
        "y": f"share of reports: {item}",
    }
    session.page.check("#show-postprocessed")
    assert axis_titles(session, "estimate-chart")["y"] == "post-processed share of reports"


@pytest.mark.slow
def test_a_window_without_reports_shows_placeholders_not_empty_charts(session: Session) -> None:
    session.open(f"/ui/metrics/{EMPTY}")
    session.enter_key()
    for canvas_id in ("estimate-chart", "series-chart"):
        message = placeholder_of(session, canvas_id)
        message.wait_for()
        assert message.inner_text() == "No reports in this window yet"
        assert session.page.locator(f"#{canvas_id}").is_hidden()
        assert session.page.evaluate(
            "(id) => Chart.getChart(document.getElementById(id)) === undefined", canvas_id
        )
    assert session.page.locator("#series-n-chart-box").is_hidden()
    assert session.page.locator("#estimate-table").is_hidden()
    assert session.page.locator("#estimate-message").is_hidden()  # said once, in the box
    session.shot("metric-no-reports")

    # A window with reports draws its charts again in the same boxes.
    session.open(f"/ui/metrics/{CATEGORICAL}")
    wait_for_chart(session, "estimate-chart")
    assert session.page.locator("#estimate-chart").is_visible()
    assert placeholder_of(session, "estimate-chart").count() == 0


#: The page's clock in the window test: half past ten, so the current hour ends at 11:00.
NOW = "2026-11-20T10:30:00Z"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "step", "start"),
    [
        ("24h", "auto", "2026-11-19T11:00:00Z"),
        ("24h", "1d", "2026-11-19T00:00:00Z"),
        ("7d", "1d", "2026-11-13T00:00:00Z"),
        ("30d", "auto", "2026-10-21T00:00:00Z"),
    ],
)
def test_a_preset_window_ends_with_the_current_hour(
    session: Session, preset: str, step: str, start: str
) -> None:
    session.page.clock.set_fixed_time(NOW)
    session.open(f"/ui/metrics/{CATEGORICAL}?window={preset}&step={step}")
    with session.page.expect_request(lambda request: "/series" in request.url) as asked:
        session.enter_key()
    query = parse_qs(urlsplit(asked.value.url).query)
    assert (query["start"], query["end"]) == ([start], ["2026-11-20T11:00:00Z"])
    (estimate,) = session.api_requests(f"/v1/metrics/{CATEGORICAL}/estimate")
    assert parse_qs(urlsplit(estimate.url).query)["end"] == ["2026-11-20T11:00:00Z"]
    summary = session.page.locator("#window-summary")
    assert " to 2026-11-20 11:00 UTC" in summary.inner_text()


@pytest.mark.slow
def test_the_training_charts_count_rounds_and_reach_the_budget(session: Session) -> None:
    session.open(f"/ui/federated/{BUDGETED}")
    session.enter_key()
    wait_for_chart(session, "task-epsilon-chart")
    status = httpx.get(
        f"{session.server.url}/v1/federated/tasks/{BUDGETED}",
        headers=session.server.headers("analyst"),
    ).json()
    assert status["budget"] == BUDGET and len(status["history"]) == 1

    def budget_on_axis() -> dict[str, float]:
        placed: dict[str, float] = session.page.evaluate(
            """(budget) => {
                const chart = Chart.getChart(document.getElementById("task-epsilon-chart"));
                return {
                    max: chart.scales.y.max,
                    pixel: chart.scales.y.getPixelForValue(budget),
                    top: chart.chartArea.top,
                };
            }""",
            BUDGET,
        )
        return placed

    placed = budget_on_axis()
    # The budget's line is inside the plot, below its top edge, not drawn on the frame.
    assert placed["max"] > BUDGET and placed["pixel"] > placed["top"] + 2, placed
    session.shot("federated-task-budget")
    # With its line hidden (its legend entry clicked), the axis still reaches the budget.
    session.page.evaluate(
        """() => {
            const chart = Chart.getChart(document.getElementById("task-epsilon-chart"));
            chart.setDatasetVisibility(1, false);
            chart.update();
        }"""
    )
    assert budget_on_axis()["max"] >= BUDGET

    assert status["delta"] == 1e-5  # written as the status panel writes it
    assert axis_titles(session, "task-epsilon-chart") == {
        "x": "round",
        "y": "ε spent (δ = 0.00001)",
    }
    assert axis_titles(session, "task-evaluation-chart") == {
        "x": "round",
        "y": "accuracy",
        "other": "loss",
    }

    session.open(f"/ui/federated/{IDLE}")
    for canvas_id in ("task-evaluation-chart", "task-epsilon-chart"):
        message = placeholder_of(session, canvas_id)
        message.wait_for()
        assert message.inner_text().startswith("No round has closed yet")
