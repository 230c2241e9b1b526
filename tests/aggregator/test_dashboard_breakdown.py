"""Breakdowns and multi-attribute metrics on the dashboard, in a real browser.

One server for the module (``ldp-aggregator serve --config``, a fresh SQLite file, a
release threshold of ``MIN_REPORTS`` per time bucket and cell) with metrics that declare
dimensions ``platform`` x ``version``: a categorical one (GRR, three labels), a numeric
one and a distribution. Their reports (seeded, perturbed by the metric's own mechanism)
fall in the current hour, each with its dimension values; the platform ``web`` gets
fewer than the threshold, so its group is withheld. The browser, the tab and what a tab
must never do (leave the origin, show the key in an address, break the page's policy,
open a dialog) are those of ``test_dashboard_browser.py``; here, besides, the console
must show no error at all.

Checked against the API's own answers to the requests the page made: the "Break down
by" selector lists the dimensions and a "Where" filter each; choosing one asks
``estimate?by=`` and draws one bar per group and category (the chart's data and
whiskers are the groups' numbers, and so is the table), says the withheld group in
words; a where filter narrows the estimate (``where=`` asked, the numbers those of the
answer); numeric groups' means and distribution groups' quantiles with their intervals.

The multi-attribute page (a metric of kind "attributes": a chart per attribute, a heat map
per declared pair, the conditional shares in both directions) is checked twice: against
the JSON of ``aggregator.attribute_estimates`` for a hand-made estimate served in place of
the page and the API (Playwright's routing; the page depends on the JSON alone), with
the corner cases (a value without labels, a conditional share with no answer, an empty
cell); and against the real server's answers for an ``smp`` metric whose devices' font
depends on their theme.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from aggregator import estimates
from aggregator.attribute_estimates import attributes_estimate
from aggregator.routes.ui import CONTENT_SECURITY_POLICY, TEMPLATES, Health, PrivacyPromise
from shared.mechanisms import make_mechanism
from shared.mechanisms.registry import MECHANISMS
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server
from tests.aggregator import test_dashboard_browser as browser_tests
from tests.aggregator.test_attribute_estimates import BASE as ESTIMATE_BASE
from tests.aggregator.test_attribute_estimates import example
from tests.aggregator.test_dashboard_browser import Session, assert_shown

# The browser, the tab and the screenshots' directory, as the other browser tests have them.
pytestmark = browser_tests.pytestmark
browser = browser_tests.browser
session = browser_tests.session
shots = browser_tests.shots

CATEGORICAL = "checkout.method"
NUMERIC = "checkout.seconds"
DISTRIBUTION = "checkout.latency"
MIN_REPORTS = 50
PLATFORMS = ["android", "ios", "web"]
VERSIONS = ["1.0", "2.0"]
DIMENSIONS = f"""dimensions = {{ platform = {PLATFORMS!r}, version = {VERSIONS!r} }}""".replace(
    "'", '"'
)
CONFIG = f"""
[metrics."{CATEGORICAL}"]
labels = ["card", "wallet", "cash"]
{DIMENSIONS}
[metrics."{CATEGORICAL}".mechanism]
mechanism = "grr"
epsilon = 2.0
domain_size = 3

[metrics."{NUMERIC}"]
unit = "s"
{DIMENSIONS}
[metrics."{NUMERIC}".mechanism]
mechanism = "piecewise"
epsilon = 2.0
lower = 0.0
upper = 100.0

[metrics."{DISTRIBUTION}"]
unit = "ms"
{DIMENSIONS}
[metrics."{DISTRIBUTION}".mechanism]
mechanism = "hh"
epsilon = 2.0
lower = 1.0
upper = 10000.0
buckets = 16
branching = 4
scale = "log"
"""
#: Reports per (platform, version) cell; web's are below the release threshold.
PER_CELL = {"android": 1500, "ios": 1200, "web": 10}
#: The share of each payment method per platform (web's are withheld anyway).
METHODS = {"android": [0.6, 0.3, 0.1], "ios": [0.2, 0.7, 0.1], "web": [0.3, 0.3, 0.4]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("dashboard-breakdown")
    config = directory / "metrics.toml"
    config.write_text(CONFIG)
    running = start_server(
        str(directory / "breakdown.sqlite3"),
        directory,
        extra=["--config", str(config), "--min-reports", str(MIN_REPORTS)],
    )
    try:
        rng = np.random.default_rng(20261128)
        for platform, size in PER_CELL.items():
            for version in VERSIONS:
                cell = {"platform": platform, "version": version}
                methods = rng.choice(3, size, p=METHODS[platform])
                send_reports(running, CATEGORICAL, methods, cell, rng)
                mean = 20.0 if platform == "android" else 45.0
                send_reports(running, NUMERIC, rng.uniform(0, 2 * mean, size), cell, rng)
                median = 150.0 if platform == "android" else 600.0
                send_reports(
                    running, DISTRIBUTION, rng.lognormal(np.log(median), 0.7, size), cell, rng
                )
        yield running
    finally:
        running.stop()


def send_reports(
    server: Server,
    name: str,
    values: np.ndarray,
    dimensions: dict[str, str],
    rng: np.random.Generator,
) -> None:
    """``values`` perturbed by the metric's mechanism (seeded), sent in the current hour
    with ``dimensions``."""
    (spec,) = [m for m in httpx.get(f"{server.url}/v1/metrics").json() if m["name"] == name]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec["mechanism"]))
    reports = [
        {
            "report_id": str(uuid.uuid4()),
            "metric": name,
            "version": 1,
            "payload": payload,
            "dimensions": dimensions,
        }
        for payload in mechanism.to_payloads(mechanism.encode(values, rng=rng))
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


def last_estimate(tab: Session, name: str) -> tuple[dict[str, list[str]], Any]:
    """The query of the page's last estimate request for ``name`` and the API's answer."""
    request = tab.api_requests(f"/v1/metrics/{name}/estimate")[-1]
    return parse_qs(urlsplit(request.url).query), tab.same_answer(request)


def choose(tab: Session, selector: str, value: str, fragment: str) -> None:
    """Choose ``value`` in ``selector`` and wait for the estimate it asks (``fragment`` in
    its address) to be answered and shown."""
    with tab.page.expect_response(
        lambda response: "/estimate" in response.url and fragment in response.url
    ):
        tab.page.select_option(selector, value)
    settled(tab)


def settled(tab: Session) -> None:
    """Wait until the page has shown the answers to its last choice."""
    tab.page.wait_for_selector("#metric:not([aria-busy])", state="attached")


def table_rows(tab: Session, selector: str) -> list[list[str]]:
    return [row.locator("td").all_inner_texts() for row in tab.page.locator(selector).all()]


def interval_ends(text: str) -> tuple[str, str]:
    """ "[38.10%, 44.37%]" -> ("38.10%", "44.37%")."""
    shown = re.fullmatch(r"\[(\S+), (\S+)\]", text)
    assert shown is not None, text
    return shown.group(1), shown.group(2)


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.slow
def test_breaking_down_draws_one_group_per_value(tab: Session) -> None:
    tab.open(f"/ui/metrics/{CATEGORICAL}")
    # The promise says which dimensions there are, and that they are in the clear.
    promise = tab.page.inner_text(".promise")
    assert "platform" in promise and "not protected by local privacy" in promise
    tab.enter_key()
    tab.page.wait_for_selector("#estimate-table tbody tr")
    options = tab.page.locator("#breakdown-by option").all_inner_texts()
    assert options == ["none", "platform", "version"]
    filters = tab.page.locator(".where-select").evaluate_all(
        "(selects) => selects.map((s) => [s.dataset.dimension, [...s.options].map((o) => o.value)])"
    )
    assert filters == [["platform", ["", *PLATFORMS]], ["version", ["", *VERSIONS]]]
    assert tab.page.locator("#groups-section").is_hidden()
    query, _ = last_estimate(tab, CATEGORICAL)
    assert "by" not in query and "where" not in query

    choose(tab, "#breakdown-by", "platform", "by=platform")
    query, body = last_estimate(tab, CATEGORICAL)
    assert query["by"] == ["platform"]
    groups = body["groups"]
    assert [group["dimensions"] for group in groups] == [
        {"platform": "android"},
        {"platform": "ios"},
    ]
    assert body["withheld_groups"] == 1
    assert [group["n"] for group in groups] == [2 * PER_CELL["android"], 2 * PER_CELL["ios"]]
    tab.page.wait_for_selector("#groups-section", state="visible")
    assert tab.page.inner_text("#groups-title") == "By platform"
    withheld = tab.page.inner_text("#groups-withheld")
    assert withheld.startswith("1 group holds reports") and f"{MIN_REPORTS} reports" in withheld
    # The platform broken down by cannot also be filtered.
    assert tab.page.locator(".where-select[data-dimension=platform]").is_disabled()

    chart = tab.chart("groups-chart")
    assert chart["labels"] == ["card", "wallet", "cash"]
    assert [d["label"] for d in chart["datasets"]] == ["android", "ios"]
    for dataset, group in zip(chart["datasets"], groups, strict=True):
        assert dataset["data"] == [item["frequency"] for item in group["estimates"]]
        assert dataset["intervals"] == [[i["ci_low"], i["ci_high"]] for i in group["estimates"]]
    assert whiskers_drawn(tab, "groups-chart") == [[True] * 3] * 2

    rows = table_rows(tab, "#groups-table tbody tr")
    assert len(rows) == 6
    expected = [(group, item) for group in groups for item in group["estimates"]]
    for cells, (group, item) in zip(rows, expected, strict=True):
        name, reports, label, frequency, interval, std = cells
        assert name == group["dimensions"]["platform"] and label == item["label"]
        assert reports == f"{group['n']:,}"
        assert_shown(frequency, item["frequency"])
        low, high = interval_ends(interval)
        assert_shown(low, item["ci_low"])
        assert_shown(high, item["ci_high"])
        assert_shown(std, item["std"])
    # The groups differ as their devices do: wallet is ios's most common method.
    android, ios = groups
    assert android["estimates"][0]["frequency"] > ios["estimates"][0]["frequency"]
    assert ios["estimates"][1]["ci_low"] > android["estimates"][1]["ci_high"]
    assert "by=platform" in tab.page.url
    tab.shot("metric-breakdown-categorical")


@pytest.mark.slow
def test_a_where_filter_narrows_the_estimate(tab: Session) -> None:
    tab.open(f"/ui/metrics/{CATEGORICAL}")
    tab.enter_key()
    tab.page.wait_for_selector("#estimate-table tbody tr")
    choose(tab, ".where-select[data-dimension=platform]", "ios", "where=platform%3Aios")
    query, body = last_estimate(tab, CATEGORICAL)
    assert query["where"] == ["platform:ios"] and "by" not in query
    assert body["where"] == {"platform": "ios"} and body["n"] == 2 * PER_CELL["ios"]
    tab.page.wait_for_function(
        "(n) => document.querySelector('#estimate-facts').innerText.includes(n)",
        arg=f"{body['n']:,}",
    )
    chart = tab.chart("estimate-chart")
    assert chart["datasets"][0]["data"] == [item["frequency"] for item in body["estimates"]]
    rows = table_rows(tab, "#estimate-table tbody tr")
    for cells, item in zip(rows, body["estimates"], strict=True):
        assert_shown(cells[1], item["frequency"])
    # The series is of the filtered cells too.
    series = tab.api_requests(f"/v1/metrics/{CATEGORICAL}/series")[-1]
    assert parse_qs(urlsplit(series.url).query)["where"] == ["platform:ios"]

    # Broken down by version among ios devices: two groups, each one ios cell.
    choose(tab, "#breakdown-by", "version", "by=version")
    query, body = last_estimate(tab, CATEGORICAL)
    assert query["where"] == ["platform:ios"] and query["by"] == ["version"]
    assert [group["n"] for group in body["groups"]] == [PER_CELL["ios"]] * 2
    assert body["withheld_groups"] == 0
    tab.page.wait_for_selector("#groups-section", state="visible")
    assert tab.page.inner_text("#groups-title") == "By version (where platform = ios)"
    assert tab.page.locator("#groups-withheld").is_hidden()
    chart = tab.chart("groups-chart")
    assert [d["label"] for d in chart["datasets"]] == VERSIONS
    for dataset, group in zip(chart["datasets"], body["groups"], strict=True):
        assert dataset["data"] == [item["frequency"] for item in group["estimates"]]
    # The choices survive a reload (they are in the page's address, the key is not).
    tab.page.reload()
    tab.page.wait_for_selector("#groups-table tbody tr")
    assert tab.page.input_value("#breakdown-by") == "version"
    assert tab.page.input_value(".where-select[data-dimension=platform]") == "ios"
    tab.shot("metric-breakdown-where")


@pytest.mark.slow
def test_numeric_groups_show_means_and_distribution_groups_quantiles(tab: Session) -> None:
    tab.open(f"/ui/metrics/{NUMERIC}?by=platform")
    tab.enter_key()
    tab.page.wait_for_selector("#groups-table tbody tr")
    query, body = last_estimate(tab, NUMERIC)
    assert query["by"] == ["platform"]
    groups = body["groups"]
    (means,) = tab.chart("groups-chart")["datasets"]
    assert tab.chart("groups-chart")["labels"] == ["android", "ios"]
    assert means["data"] == [group["mean"] for group in groups]
    assert means["intervals"] == [[group["ci_low"], group["ci_high"]] for group in groups]
    headers = tab.page.locator("#groups-table th").all_inner_texts()
    assert headers == ["Group", "Reports", "Mean (s)", "95% interval (s)", "Std"]
    assert groups[0]["ci_high"] < groups[1]["ci_low"]  # 20 s against 45 s
    tab.shot("metric-breakdown-numeric")

    tab.open(f"/ui/metrics/{DISTRIBUTION}?by=platform")
    tab.page.wait_for_selector("#groups-table tbody tr")
    query, body = last_estimate(tab, DISTRIBUTION)
    assert query["by"] == ["platform"] and query["quantiles"] == ["0.5,0.95,0.99"]
    chart = tab.chart("groups-chart")
    assert chart["labels"] == ["android", "ios"]
    assert [d["label"] for d in chart["datasets"]] == ["p50", "p95", "p99"]
    for index, dataset in enumerate(chart["datasets"]):
        items = [group["quantiles"][index] for group in body["groups"]]
        assert dataset["data"] == [item["value"] for item in items]
        assert dataset["intervals"] == [[item["ci_low"], item["ci_high"]] for item in items]
    axis = tab.page.evaluate(
        """() => {
            const y = Chart.getChart(document.getElementById("groups-chart")).scales.y;
            return { type: y.type, min: y.min, max: y.max, title: y.options.title.text };
        }"""
    )
    assert axis == {
        "type": "logarithmic",
        "min": 1.0,
        "max": 10_000.0,
        "title": "quantile (ms) (95% interval), log scale",
    }
    assert whiskers_drawn(tab, "groups-chart") == [[True, True]] * 3
    rows = table_rows(tab, "#groups-table tbody tr")
    assert [cells[0] for cells in rows] == ["android", "ios"]
    assert tab.page.locator("#groups-table th").all_inner_texts()[2:] == [
        "p50 (ms)",
        "p95 (ms)",
        "p99 (ms)",
    ]
    tab.shot("metric-breakdown-distribution")


def whiskers_drawn(tab: Session, canvas_id: str) -> list[list[bool]]:
    """Per dataset and bar: whether its whisker is on the canvas (a near-black opaque pixel
    at the middle of its interval; the bars are of the palette's colours)."""
    drawn: list[list[bool]] = tab.page.evaluate(
        """(id) => {
            const canvas = document.getElementById(id);
            const chart = Chart.getChart(canvas);
            const ratio = canvas.width / canvas.clientWidth;
            const context = canvas.getContext("2d");
            const dark = (x, y) => {
                const pixels = context.getImageData(
                    Math.round(x * ratio) - 1, Math.round(y * ratio) - 1, 3, 3).data;
                for (let i = 0; i < pixels.length; i += 4) {
                    const [r, g, b, a] = pixels.slice(i, i + 4);
                    if (a > 200 && r < 70 && g < 70 && b < 90) return true;
                }
                return false;
            };
            return chart.data.datasets.map((dataset, d) =>
                chart.getDatasetMeta(d).data.map((bar, i) => {
                    const [low, high] = dataset.intervals[i];
                    const y = (chart.scales.y.getPixelForValue(low) +
                        chart.scales.y.getPixelForValue(high)) / 2;
                    return dark(bar.x, y);
                }));
        }""",
        canvas_id,
    )
    return drawn


# --- a multi-attribute metric, its JSON served in place of the API ------------------------------

ATTRIBUTES = "prefs"


def attributes_page() -> str:
    """The page of an "attributes" metric (theme x font, and minutes) as the server renders
    it (``metric.html``)."""
    promise = PrivacyPromise(
        name=ATTRIBUTES,
        version=1,
        description="Display preferences.",
        unit=None,
        kind="attributes",
        mechanism="smp",
        resolved=None,
        epsilon=2.0,
        epsilon_meaning="per report",
        epsilon_report=None,
        lifetime=None,
        domain="3 private attributes in one report",
        labels=(),
        more_labels=0,
        parameters=(("oracle", "auto"),),
        attributes=(
            "theme: 3 categories (light, dark, auto)",
            "font: 2 categories",
            "session_min: numbers in [0, 120]",
        ),
        pairs=("theme × font",),
    )
    health = Health("ok", "sqlite", 1, "2026-11-28 12:00:00 UTC")
    return TEMPLATES.get_template("metric.html").render(
        base="",
        static="/ui/static",
        page="metric",
        metric=promise,
        versions=[promise],
        latest=1,
        health=health,
    )


def attributes_answer(marginals: bool = True) -> dict[str, Any]:
    """The estimate of ``example()`` as the estimate endpoint would answer it."""
    fields = attributes_estimate(example(), "auto", 0.95, marginals=marginals)
    return {**ESTIMATE_BASE, "metric": ATTRIBUTES, **fields}


@pytest.fixture
def attributes_tab(tab: Session) -> Session:
    """``tab`` with the attributes metric's page, estimate and series served by the test
    (with the dashboard's security headers), its assets by the server."""
    page = attributes_page()
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY}
    estimate = attributes_answer()
    step = {"start": "2026-11-28T11:00:00Z", "end": "2026-11-28T12:00:00Z", "n": 1000}
    series = {
        "metric": ATTRIBUTES,
        "version": 1,
        "mechanism": "smp",
        "kind": "attributes",
        "epsilon": 2.0,
        "where": {},
        "by": None,
        "step": "1h",
        "start": step["start"],
        "end": step["end"],
        "min_reports": 1,
        "confidence": 0.95,
        "steps": [step | {"estimate": attributes_answer(marginals=False)}],
    }

    def serve(route: Any) -> None:
        path = urlsplit(route.request.url).path
        if path == f"/ui/metrics/{ATTRIBUTES}":
            route.fulfill(status=200, body=page, content_type="text/html", headers=headers)
        elif path.endswith("/estimate"):
            route.fulfill(status=200, json=estimate)
        elif path.endswith("/series"):
            route.fulfill(status=200, json=series)
        else:
            route.continue_()

    tab.page.route(f"**/{ATTRIBUTES}*", serve)
    tab.page.route(f"**/v1/metrics/{ATTRIBUTES}/**", serve)
    return tab


def assert_attributes_drawn(tab: Session, body: dict[str, Any]) -> None:
    """The page shows ``body``, an "attributes" estimate: a chart per attribute (each
    value's share with its whisker, or the mean with its interval) and its table; per
    declared pair a heat map whose cells hold the unbiased share and interval (as text and
    tooltip), coloured by the post-processed share, the cells' table, and the conditional
    shares in both directions."""
    facts = tab.page.inner_text("#estimate-facts")
    assert f"protocol {body['protocol']}" in facts and f"frequency oracle {body['oracle']}" in facts
    for a, attribute in enumerate(body["attributes"]):
        chart = tab.chart(f"attribute-chart-{a}")
        (dataset,) = chart["datasets"]
        if attribute["kind"] == "numeric":
            assert dataset["data"] == [attribute["mean"]]
            assert dataset["intervals"] == [[attribute["ci_low"], attribute["ci_high"]]]
            continue
        items = attribute["estimates"]
        assert chart["labels"] == [item["label"] for item in items]
        assert dataset["data"] == [item["frequency"] for item in items]
        assert dataset["intervals"] == [[item["ci_low"], item["ci_high"]] for item in items]
        assert whiskers_drawn(tab, f"attribute-chart-{a}") == [[True] * len(items)]
        rows = table_rows(tab, f"#attribute-{a} tbody tr")
        for cells, item, valid in zip(rows, items, attribute["postprocessed"], strict=True):
            assert cells[0] == item["label"]
            assert_shown(cells[1], item["frequency"])
            assert_shown(cells[4], valid["frequency"])
    for k, marginal in enumerate(body["marginals"]):
        first, second = marginal["attributes"]
        heat = tab.page.locator(f"#heatmap-{k}")
        assert heat.locator("thead th").all_inner_texts()[1:] == marginal["columns"]
        assert heat.locator("tbody th").all_inner_texts() == marginal["rows"]
        drawn = heat.locator("td").evaluate_all(
            """(cells) => cells.map((td) => ({
                share: td.querySelector('.heat-share').textContent,
                interval: td.querySelector('.heat-interval').textContent,
                title: td.title,
                colour: getComputedStyle(td).backgroundColor,
            }))"""
        )
        assert len(drawn) == len(marginal["cells"])
        for shown, cell in zip(drawn, marginal["cells"], strict=True):
            assert_shown(shown["share"], cell["frequency"])
            low, high = interval_ends(shown["interval"])
            assert_shown(low, cell["ci_low"])
            assert_shown(high, cell["ci_high"])
            assert shown["title"].startswith(
                f"{first} = {cell['row']}, {second} = {cell['column']}:"
            )
        # The darkest cell holds the largest post-processed share.
        darkness = [sum(int(c) for c in re.findall(r"\d+", s["colour"])[:3]) for s in drawn]
        shares = [cell["postprocessed"] for cell in marginal["cells"]]
        assert shares[darkness.index(min(darkness))] == max(shares)
        rows = table_rows(tab, f"#cells-table-{k} tbody tr")
        assert [row[:2] for row in rows] == [[c["row"], c["column"]] for c in marginal["cells"]]
        for row, cell in zip(rows, marginal["cells"], strict=True):
            assert_shown(row[2], cell["frequency"])
            assert_shown(row[5], cell["postprocessed"])
        for direction in ("given_second", "given_first"):
            tab.page.select_option(f"#conditional-{k}", direction)
            texts = conditional_shares(tab, k)
            for text, item in zip(texts, marginal[direction], strict=True):
                if item["share"] is None:
                    assert text == "–"
                else:
                    assert_shown(text, item["share"])


def conditional_shares(tab: Session, k: int) -> list[str]:
    """The shares the conditional table of pair ``k`` shows, row-major."""
    texts: list[str] = tab.page.locator(f"#conditional-table-{k} td").evaluate_all(
        "(cells) => cells.map((td) => td.querySelector('.heat-share')?.textContent ?? "
        "td.textContent)"
    )
    return texts


@pytest.mark.slow
def test_an_attributes_metric_draws_each_attribute_and_the_joint_heat_map(
    attributes_tab: Session,
) -> None:
    tab = attributes_tab
    tab.open(f"/ui/metrics/{ATTRIBUTES}")
    promise = tab.page.inner_text(".promise")
    assert "theme: 3 categories (light, dark, auto)" in promise and "theme × font" in promise
    tab.enter_key()
    tab.page.wait_for_selector("#heatmap-0")
    settled(tab)
    body = attributes_answer()
    assert_attributes_drawn(tab, body)
    assert tab.chart("attribute-chart-1")["labels"] == ["0", "1"]  # no labels: indices

    # An empty cell is white; the row "dark" sums below zero: no share among it.
    (marginal,) = body["marginals"]
    colours = tab.page.locator("#heatmap-0 td").evaluate_all(
        "(cells) => cells.map((td) => getComputedStyle(td).backgroundColor)"
    )
    shares = [cell["postprocessed"] for cell in marginal["cells"]]
    assert colours[shares.index(0.0)] == "rgb(255, 255, 255)"
    assert conditional_shares(tab, 0)[2:4] == ["–", "–"]
    assert tab.page.inner_text("#conditional-table-0 caption") == "P(font = column | theme = row)"
    tab.page.select_option("#conditional-0", "given_second")
    assert tab.page.inner_text("#conditional-table-0 caption") == "P(theme = row | font = column)"

    # Over time: each value of each attribute, and the means.
    options = tab.page.locator("#series-item option").all_inner_texts()
    assert options[:3] == ["theme = light", "theme = dark", "theme = auto"]
    assert options[-1] == "session_min (mean)"
    tab.page.select_option("#series-item", str(len(options) - 1))
    minutes = body["attributes"][2]
    assert tab.chart("series-chart")["datasets"][2]["data"] == [minutes["mean"]]
    tab.page.select_option("#conditional-0", "given_first")
    tab.shot("metric-attributes-stubbed")


# --- a multi-attribute metric served by the real server -------------------------------------------

REAL_ATTRIBUTES = "display.prefs"
ATTRIBUTES_SPEC = {
    "mechanism": "smp",
    "epsilon": 2.0,
    "attributes": [
        {"name": "theme", "domain_size": 3, "labels": ["light", "dark", "auto"]},
        {"name": "font", "domain_size": 4},
        {"name": "session_min", "lower": 0, "upper": 120},
    ],
    "pairs": [["theme", "font"]],
}
#: Devices reporting the multi-attribute metric, and the most reports one batch may hold.
ATTRIBUTE_DEVICES = 20_000
BATCH = 10_000


def send_attribute_reports(server: Server, rng: np.random.Generator) -> None:
    """``ATTRIBUTE_DEVICES`` devices, half on each platform: theme (0.5, 0.3, 0.2), a font
    that depends on it (the dark theme's devices prefer the largest), minutes uniform on
    [0, 60] (seeded), perturbed by the metric's mechanism and sent in the current hour."""
    response = httpx.put(
        f"{server.url}/v1/metrics/{REAL_ATTRIBUTES}",
        json={
            "description": "Display preferences.",
            "mechanism": ATTRIBUTES_SPEC,
            "dimensions": {"platform": ["android", "ios"]},
        },
        headers=server.headers("admin"),
    )
    assert response.status_code == 201, response.text
    spec = response.json()["mechanism"]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec))
    theme = rng.choice(3, ATTRIBUTE_DEVICES, p=[0.5, 0.3, 0.2])
    font_law = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    font = (rng.random(ATTRIBUTE_DEVICES)[:, None] > font_law[theme].cumsum(axis=1)).sum(axis=1)
    minutes = rng.uniform(0.0, 60.0, ATTRIBUTE_DEVICES)
    values = np.column_stack([theme, font, minutes]).astype(np.float64)
    platforms = ["android", "ios"]
    reports = [
        {
            "report_id": str(uuid.uuid4()),
            "metric": REAL_ATTRIBUTES,
            "version": 1,
            "payload": payload,
            "dimensions": {"platform": platforms[i % 2]},
        }
        for i, payload in enumerate(mechanism.to_payloads(mechanism.encode(values, rng=rng)))
    ]
    for first in range(0, len(reports), BATCH):
        batch = reports[first : first + BATCH]
        response = httpx.post(
            f"{server.url}/v1/reports",
            json={"reports": batch},
            headers=server.headers("device"),
            timeout=120,
        )
        assert response.json() == {"accepted": len(batch), "duplicates": 0}, response.text


@pytest.mark.slow
@pytest.mark.skipif(
    "smp" not in MECHANISMS or not hasattr(estimates, "AttributesEstimateOut"),
    reason="the multi-attribute mechanisms are not registered or not served yet",
)
def test_an_attributes_metric_of_the_server_shows_the_apis_numbers(tab: Session) -> None:
    send_attribute_reports(tab.server, np.random.default_rng(27))
    tab.open(f"/ui/metrics/{REAL_ATTRIBUTES}")
    promise = tab.page.inner_text(".promise")
    assert "theme: 3 categories (light, dark, auto)" in promise and "theme × font" in promise
    tab.enter_key()
    tab.page.wait_for_selector("#heatmap-0")
    settled(tab)
    _, body = last_estimate(tab, REAL_ATTRIBUTES)
    assert body["kind"] == "attributes" and body["n"] == ATTRIBUTE_DEVICES
    assert [a["name"] for a in body["attributes"]] == ["theme", "font", "session_min"]
    (marginal,) = body["marginals"]
    assert marginal["rows"] == ["light", "dark", "auto"]
    assert marginal["columns"] == ["0", "1", "2", "3"]
    assert_attributes_drawn(tab, body)
    # The dark theme's devices prefer font 3: the largest conditional share of its row.
    dark = [item for item in marginal["given_first"] if item["row"] == "dark"]
    assert max(dark, key=lambda item: item["share"] or -1.0)["column"] == "3"
    tab.shot("metric-attributes")

    # Broken down by platform: each group's attributes in the table.
    choose(tab, "#breakdown-by", "platform", "by=platform")
    _, body = last_estimate(tab, REAL_ATTRIBUTES)
    groups = body["groups"]
    assert [group["dimensions"]["platform"] for group in groups] == ["android", "ios"]
    rows = table_rows(tab, "#groups-table tbody tr")
    expected = [
        (group["dimensions"]["platform"], attribute, item)
        for group in groups
        for attribute in group["attributes"]
        for item in attribute.get("estimates") or [None]
    ]
    assert len(rows) == len(expected) == 2 * (3 + 4 + 1)
    for cells, (platform, attribute, item) in zip(rows, expected, strict=True):
        assert cells[:3] == [platform, f"{attribute['n']:,}", attribute["name"]]
        if item is None:
            assert cells[3] == "mean"
        else:
            assert cells[3] == item["label"]
            assert_shown(cells[4], item["frequency"])
