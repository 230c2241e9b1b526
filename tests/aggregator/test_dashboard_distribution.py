"""A distribution metric's page in a real browser: histogram, quantiles, a range, quantiles
over time.

One server for the module (``ldp-aggregator serve --config``, a fresh SQLite file) with an
``hh`` metric on a log scale (1 to 10,000 ms, 64 buckets) and ``REPORTS_PER_HOUR``
reports in each of the last ``HOURS`` hours: values drawn from a log-normal law (seeded),
perturbed by the metric's own mechanism and posted as devices post them, each with its
hour. The browser, the tab and what a tab must never do (leave the origin, show the key
in an address, break the page's policy, open a dialog) are those of
``test_dashboard_browser.py``; here, besides, the console must show no error at all.

Checked against the API's own answers to the requests the page made: the histogram's
bars (one per bucket, spanning its bucket on the logarithmic value axis, as high as its
post-processed share) with the unbiased shares' whiskers drawn on the canvas; the
quantiles' table and their marks on the chart; the share of a range asked in the form;
the p50, p95 and p99 lines of the series with their bands.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server
from tests.aggregator import test_dashboard_browser as browser_tests
from tests.aggregator.test_dashboard_browser import Session, assert_shown, assert_whiskers_drawn

# The browser, the tab and the screenshots' directory, as the other browser tests have them.
browser = browser_tests.browser
session = browser_tests.session
shots = browser_tests.shots

METRIC = "page.load"
LOWER, UPPER, BUCKETS = 1.0, 10_000.0, 64
HOURS = 4
REPORTS_PER_HOUR = 2000
QUANTILES = [0.5, 0.95, 0.99]
CONFIG = f"""
[metrics."{METRIC}"]
description = "Time to load a page."
unit = "ms"
[metrics."{METRIC}".mechanism]
mechanism = "hh"
epsilon = 2.0
lower = {LOWER}
upper = {UPPER}
buckets = {BUCKETS}
branching = 4
scale = "log"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("dashboard-distribution")
    config = directory / "metrics.toml"
    config.write_text(CONFIG)
    running = start_server(
        str(directory / "distribution.sqlite3"), directory, extra=["--config", str(config)]
    )
    try:
        rng = np.random.default_rng(20261128)
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        for back in range(HOURS):
            # The median drifts from hour to hour, so that the series has a shape.
            values = rng.lognormal(np.log(150.0 + 40.0 * back), 0.9, REPORTS_PER_HOUR)
            send_reports(running, values, hour - timedelta(hours=back), rng)
        yield running
    finally:
        running.stop()


def send_reports(
    server: Server, values: np.ndarray, hour: datetime, rng: np.random.Generator
) -> None:
    """``values`` perturbed by the metric's mechanism (seeded), sent as reports of ``hour``."""
    (spec,) = [m for m in httpx.get(f"{server.url}/v1/metrics").json() if m["name"] == METRIC]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec["mechanism"]))
    time = hour.strftime("%Y-%m-%dT%H:00:00Z")
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": METRIC, "version": 1, "time": time, "payload": p}
        for p in mechanism.to_payloads(mechanism.encode(values, rng=rng))
    ]
    response = httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60,
    )
    assert response.json() == {"accepted": len(values), "duplicates": 0}, response.text


@pytest.fixture
def tab(session: Session) -> Iterator[Session]:
    """The tab of ``session``, whose console must show no error and no uncaught exception."""
    errors: list[str] = []

    def saw_console_message(message: Any) -> None:
        if message.type == "error":
            errors.append(message.text)

    session.page.on("console", saw_console_message)
    session.page.on("pageerror", lambda error: errors.append(str(error)))
    yield session
    assert not errors, errors


def open_metric(tab: Session) -> dict[str, Any]:
    """Open the metric's page with the key; the estimate the page was given (asked again)."""
    tab.open(f"/ui/metrics/{METRIC}")
    tab.enter_key()
    tab.page.wait_for_selector("#quantile-table tbody tr")
    (request,) = tab.api_requests(f"/v1/metrics/{METRIC}/estimate")
    assert parse_qs(urlsplit(request.url).query)["quantiles"] == ["0.5,0.95,0.99"]
    body: dict[str, Any] = tab.same_answer(request)
    assert body["kind"] == "distribution" and body["value_buckets"] == BUCKETS
    assert body["n"] == HOURS * REPORTS_PER_HOUR
    return body


def number_cell(text: str) -> float:
    """A number as the page writes it (four significant digits, thousands separated)."""
    return float(text.replace(",", ""))


def assert_number_shown(text: str, value: float) -> None:
    """``text`` is ``value`` to four significant digits: within half a unit of the fourth
    digit, 5e-4 of the value (and a hair for the floating point)."""
    assert abs(number_cell(text) - value) <= 5e-4 * abs(value) + 1e-12, (text, value)


def histogram(tab: Session) -> Any:
    """The histogram's bars as drawn: per bar its data, pixels and the bucket's edges'
    pixels; the value axis; the quantile marks."""
    return tab.page.evaluate(
        """() => {
            const chart = Chart.getChart(document.getElementById("estimate-chart"));
            const x = chart.scales.x;
            const [bars, points] = chart.data.datasets;
            return {
                axis: { type: x.type, min: x.min, max: x.max, title: x.options.title.text },
                bars: chart.getDatasetMeta(0).data.map((bar, i) => ({
                    share: bars.data[i].y, interval: bars.intervals[i],
                    unbiased: points.data[i].y,
                    left: bar.x - bar.width / 2, right: bar.x + bar.width / 2,
                    height: bar.base - bar.y,
                })),
                marks: chart.options.plugins.markers.items.map((item) => ({
                    label: item.label, value: item.value, low: item.low, high: item.high,
                    color: item.color, x: x.getPixelForValue(item.value),
                })),
                area: chart.chartArea,
            };
        }"""
    )


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_histogram_and_quantiles_are_the_estimate_apis(tab: Session) -> None:
    tab.open("/ui/")
    row = tab.page.locator("#metric-table tbody tr", has_text=METRIC)
    assert row.locator("td").nth(1).inner_text() == "distribution"
    assert "in 64 buckets (log scale)" in row.inner_text()

    body = open_metric(tab)
    buckets = body["histogram"]
    drawn = histogram(tab)
    assert drawn["axis"] == {
        "type": "logarithmic",
        "min": LOWER,
        "max": UPPER,
        "title": "value (ms), log scale",
    }
    bars = drawn["bars"]
    assert len(bars) == BUCKETS == len(buckets)
    assert [bar["share"] for bar in bars] == [bucket["postprocessed"] for bucket in buckets]
    assert [bar["unbiased"] for bar in bars] == [bucket["fraction"] for bucket in buckets]
    assert [bar["interval"] for bar in bars] == [[b["ci_low"], b["ci_high"]] for b in buckets]
    # A bar for every bucket with a post-processed share, none for the others.
    with_share = sum(bucket["postprocessed"] > 0 for bucket in buckets)
    assert sum(bar["height"] > 0 for bar in bars) == with_share > BUCKETS // 4
    # Each bar spans its bucket on the value axis: equal ratios, equal widths.
    edges = tab.page.evaluate(
        """(edges) => {
            const x = Chart.getChart(document.getElementById("estimate-chart")).scales.x;
            return edges.map((edge) => x.getPixelForValue(edge));
        }""",
        [buckets[0]["low"]] + [bucket["high"] for bucket in buckets],
    )
    for bar, left, right in zip(bars, edges, edges[1:], strict=False):
        assert abs(bar["left"] - left) < 1.0 and abs(bar["right"] - right) < 1.0, (bar, left)
    assert_whiskers_drawn(tab, BUCKETS)

    # The quantiles: the table, the marks on the chart (drawn in their colour), the
    # chart's text alternative.
    quantiles = body["quantiles"]
    assert [item["q"] for item in quantiles] == QUANTILES
    rows = [
        row.locator("td").all_inner_texts()
        for row in tab.page.locator("#quantile-table tbody tr").all()
    ]
    headers = tab.page.locator("#quantile-table th").all_inner_texts()
    assert headers == ["Quantile", "Value (ms)", "95% interval (ms)"]
    assert [cells[0] for cells in rows] == ["p50", "p95", "p99"]
    for (_, value, interval), item in zip(rows, quantiles, strict=True):
        assert_number_shown(value, item["value"])
        low, high = interval.split(" to ")
        assert_number_shown(low, item["ci_low"])
        assert_number_shown(high, item["ci_high"])
        assert item["ci_low"] <= item["value"] <= item["ci_high"]
    marks = drawn["marks"]
    assert [(m["label"], m["value"], m["low"], m["high"]) for m in marks] == [
        (name, q["value"], q["ci_low"], q["ci_high"])
        for name, q in zip(["p50", "p95", "p99"], quantiles, strict=True)
    ]
    for mark in marks:
        assert mark_drawn(tab, mark), mark
    label = tab.page.get_attribute("#estimate-chart", "aria-label") or ""
    assert "64 buckets from 1 to 10,000 ms (log scale)" in label
    assert all(f"{name} " in label for name in ("p50", "p95", "p99"))
    assert tab.page.locator("#histogram-table tbody tr").count() == BUCKETS
    tab.shot("metric-distribution")


def mark_drawn(tab: Session, mark: dict[str, Any]) -> bool:
    """Whether a quantile's line is on the canvas: near its x, low in the plot, a pixel of
    its colour (each channel within 40 of it; the bars, whiskers and other marks are of
    other colours)."""
    color = [int(mark["color"][i : i + 2], 16) for i in (1, 3, 5)]
    found: bool = tab.page.evaluate(
        """([x, color]) => {
            const canvas = document.getElementById("estimate-chart");
            const chart = Chart.getChart(canvas);
            const ratio = canvas.width / canvas.clientWidth;
            const y = chart.chartArea.bottom - 0.1 * chart.chartArea.height;
            const pixels = canvas.getContext("2d").getImageData(
                Math.round(x * ratio) - 2, Math.round(y * ratio) - 2, 5, 5).data;
            for (let i = 0; i < pixels.length; i += 4) {
                const close = [0, 1, 2].every((c) => Math.abs(pixels[i + c] - color[c]) <= 40);
                if (close && pixels[i + 3] > 200) return true;
            }
            return false;
        }""",
        [mark["x"], color],
    )
    return found


@pytest.mark.slow
def test_the_range_form_shows_the_apis_share(tab: Session) -> None:
    open_metric(tab)
    # A range whose low end is above its high end is refused in the page, not asked.
    tab.page.fill("#range-low", "500")
    tab.page.fill("#range-high", "100")
    tab.page.click("#range-form button[type=submit]")
    assert "low end must be below" in tab.page.inner_text("#range-message")
    assert tab.page.locator("#range-result").is_hidden()

    tab.page.fill("#range-low", "100")
    tab.page.fill("#range-high", "500")
    with tab.page.expect_response(lambda response: "range=" in response.url) as answered:
        tab.page.click("#range-form button[type=submit]")
    request = answered.value.request
    assert parse_qs(urlsplit(request.url).query)["range"] == ["100,500"]
    tab.page.wait_for_selector("#range-result", state="visible")
    share = tab.same_answer(request)["range"]
    assert (share["requested_low"], share["requested_high"]) == (100, 500)
    assert_shown(tab.page.inner_text("#range-fraction"), share["fraction"])
    what = tab.page.inner_text("#range-what")
    shown = re.search(r"from (\S+) to (\S+) ms \(95% interval \[(\S+), (\S+)\]", what)
    assert shown is not None, what
    low, high, ci_low, ci_high = shown.groups()
    assert_number_shown(low, share["low"])
    assert_number_shown(high, share["high"])
    assert_shown(ci_low, share["ci_low"])
    assert_shown(ci_high, share["ci_high"])
    # 500 is not an edge of the log-scale buckets (edges 10^(4k/64)): the end moved.
    assert "Asked for 100 to 500 ms" in tab.page.inner_text("#range-edges")
    assert tab.page.locator("#range-message").is_hidden()
    tab.shot("metric-distribution-range")


@pytest.mark.slow
def test_the_quantiles_over_time_are_the_series_apis(tab: Session) -> None:
    open_metric(tab)
    tab.page.wait_for_function(
        "() => Chart.getChart(document.getElementById('series-chart')) !== undefined"
    )
    request = tab.api_requests(f"/v1/metrics/{METRIC}/series")[-1]
    query = parse_qs(urlsplit(request.url).query)
    assert query["quantiles"] == ["0.5,0.95,0.99"] and query["step"] == ["1h"]
    body = tab.same_answer(request)
    steps = body["steps"]
    assert body["kind"] == "distribution"
    released = [i for i, step in enumerate(steps) if step["estimate"] is not None]
    assert len(released) == HOURS and released == list(range(released[0], released[0] + HOURS))
    assert tab.page.locator("#series-item-choice").count() == 0  # nothing to choose

    datasets = tab.chart("series-chart")["datasets"]
    assert len(datasets) == 3 * len(QUANTILES)  # per quantile: band low, band high, line
    for index, (q, name) in enumerate(zip(QUANTILES, ["p50", "p95", "p99"], strict=True)):
        low, high, line = datasets[3 * index : 3 * index + 3]
        points = [
            next(item for item in step["estimate"]["quantiles"] if item["q"] == q)
            if step["estimate"]
            else None
            for step in steps
        ]
        assert line["label"] == name
        assert line["data"] == [point and point["value"] for point in points]
        assert low["data"] == [point and point["ci_low"] for point in points]
        assert high["data"] == [point and point["ci_high"] for point in points]
    drawn = tab.page.evaluate(
        """() => {
            const chart = Chart.getChart(document.getElementById("series-chart"));
            return {
                axis: chart.scales.y.type,
                title: chart.scales.y.options.title.text,
                legend: chart.legend.legendItems.map((item) => item.text),
                fills: chart.data.datasets.map((d) => d.fill),
            };
        }"""
    )
    assert drawn["axis"] == "logarithmic" and drawn["title"] == "quantile (ms), log scale"
    assert drawn["legend"] == ["p50", "p95", "p99"]
    assert drawn["fills"] == [False, "-1", False] * len(QUANTILES)
    middle = released[0] + HOURS // 2 - 1  # the next step has an estimate too
    probed = [band_drawn(tab, 3 * index, middle) for index in range(len(QUANTILES))]
    assert all(painted is not False for painted in probed), probed
    assert any(probed), probed  # at least one band was wide enough to probe
    tab.shot("metric-distribution-series")


def band_drawn(tab: Session, low_dataset: int, step: int) -> bool | None:
    """Whether the band between datasets ``low_dataset`` and the next is painted just after
    ``step`` (the next step has a band too): a few pixels right of the step (clear of its
    grid line), halfway between the line and the band's farther edge, a pixel at least as
    opaque as the band (alpha 0.2, 51 of 255; a grid line is 0.1, and the blank canvas 0)."""
    painted: bool | None = tab.page.evaluate(
        """([low, step]) => {
            const canvas = document.getElementById("series-chart");
            const chart = Chart.getChart(canvas);
            const ratio = canvas.width / canvas.clientWidth;
            const bottom = chart.getDatasetMeta(low).data[step];
            const top = chart.getDatasetMeta(low + 1).data[step];
            const line = chart.getDatasetMeta(low + 2).data[step];
            const edge = Math.abs(bottom.y - line.y) > Math.abs(top.y - line.y) ? bottom : top;
            if (Math.abs(edge.y - line.y) < 8) return null;  // too thin to probe
            const y = (edge.y + line.y) / 2;
            const pixel = canvas.getContext("2d").getImageData(
                Math.round((bottom.x + 4) * ratio), Math.round(y * ratio), 1, 1).data;
            return pixel[3] >= 45;
        }""",
        [low_dataset, step],
    )
    return painted
