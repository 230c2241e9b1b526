"""The dashboard in a real browser: headless Chromium against a real ``ldp-aggregator serve``.

One server per module (loopback, a fresh SQLite file, ``--demo-data``: a day of
simulated devices' reports for the demo metrics), with a metric whose label is a script
tag and a federated task that has run three rounds. Chromium is Debian's
(``/usr/bin/chromium``), driven by Playwright's Python package; it resolves no host but
the loopback server, as on an offline network, and every request a page makes is
recorded: each must go to the server's own origin, and none may carry the key in its
address. Content Security Policy violations are collected from the console and must
not occur.

Checked: without a key only the public specs are shown and nothing is asked of the
analyst API; the key typed once is kept in the tab's sessionStorage (not a cookie, not
localStorage, not any URL, not the server's log) and sent as a Bearer header; a
categorical metric's bars and whiskers are the estimate API's numbers (read back from
the chart, and the whiskers found on the canvas at the interval ends), and so is the
table; the post-processed toggle; the series of a chosen window, step by step; a
numeric and a string metric; the federated pages; a label ``<script>alert(1)</script>``
shown as text with no dialog ever opened. Screenshots of the main pages are written
to a temporary directory (and copied to ``$LDP_DASHBOARD_SHOTS`` when that is set).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from aggregator.demo_data import DEMO_HOURS, DEMO_REPORTS_PER_HOUR
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no /usr/bin/chromium (Debian package: chromium)"
)

XSS_LABEL = "<script>alert(1)</script>"
#: The categorical demo metric whose bars are checked.
CATEGORICAL = "app.start_screen"
#: A discovery metric without candidate strings.
DISCOVERY = "words.pem"
TASK = "digits"
ROUNDS_RUN = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("dashboard-server")
    running = start_server(str(directory / "dashboard.sqlite3"), directory, extra=["--demo-data"])
    try:
        add_xss_metric(running)
        add_discovery_metric(running)
        add_federated_task(running)
        yield running
    finally:
        running.stop()


def add_xss_metric(server: Server) -> None:
    """A metric whose first label is a script tag, with reports in the current hour."""
    body = {
        "description": '<img src=x onerror="alert(2)">',
        "mechanism": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 2},
        "labels": [XSS_LABEL, "plain"],
    }
    response = httpx.put(
        f"{server.url}/v1/metrics/xss.test", json=body, headers=server.headers("admin")
    )
    assert response.status_code == 201, response.text
    reports = [
        {
            "report_id": str(uuid.uuid4()),
            "metric": "xss.test",
            "version": 1,
            "payload": {"value": v},
        }
        for v in [0, 1] * 10
    ]
    response = httpx.post(
        f"{server.url}/v1/reports", json={"reports": reports}, headers=server.headers("device")
    )
    assert response.json() == {"accepted": 20, "duplicates": 0}, response.text


def add_discovery_metric(server: Server) -> None:
    """A ``pem`` metric with no candidate strings, and reports of four words (seeded)."""
    spec = {"mechanism": "pem", "epsilon": 4.0, "max_length": 4}
    response = httpx.put(
        f"{server.url}/v1/metrics/{DISCOVERY}",
        json={"mechanism": spec},
        headers=server.headers("admin"),
    )
    assert response.status_code == 201, response.text
    rng = np.random.default_rng(8)
    words = np.array(["kiwi", "fig", "plum", "pear"], dtype=object)
    values = words[rng.choice(4, 3000, p=[0.4, 0.3, 0.2, 0.1])]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec))
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": DISCOVERY, "version": 1, "payload": payload}
        for payload in mechanism.to_payloads(mechanism.encode(values, rng=rng))
    ]
    response = httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60,
    )
    assert response.json() == {"accepted": 3000, "duplicates": 0}, response.text


def add_federated_task(server: Server) -> None:
    """A task of one client per round (noise given, so nothing is calibrated), run for
    ``ROUNDS_RUN`` rounds, with a public evaluation set."""
    create_task(server, TASK, {"noise_multiplier": 1.0}, ROUNDS_RUN, np.random.default_rng(4))


def create_task(
    server: Server, name: str, privacy: dict[str, float], rounds_run: int, rng: np.random.Generator
) -> None:
    """A central task of one client per round with an evaluation set, run ``rounds_run``
    rounds."""
    body = {
        "name": name,
        "config": {
            "model": {"kind": "logistic", "num_features": 4, "num_classes": 3},
            "mode": "central",
            "rounds": 5,
            "population": 1000,
            "clients_per_round": 1,
            "accounting": "rdp",
            **privacy,
        },
        "evaluation": {
            "x": rng.normal(size=(30, 4)).tolist(),
            "y": rng.integers(0, 3, 30).tolist(),
        },
    }
    created = httpx.post(
        f"{server.url}/v1/federated/tasks", json=body, headers=server.headers("admin"), timeout=120
    )
    assert created.status_code == 201, created.text
    for round_number in range(rounds_run):
        update = np.asarray(rng.normal(scale=0.1, size=15), dtype="<f8").tobytes()
        upload = {
            "update_id": str(uuid.uuid4()),
            "round": round_number,
            "update": base64.b64encode(update).decode(),
        }
        response = httpx.post(
            f"{server.url}/v1/federated/tasks/{name}/updates",
            json=upload,
            headers=server.headers("device"),
            timeout=60,
        )
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def browser(server: Server) -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--no-sandbox",
                # Any host but the loopback server is unreachable, as on an offline network.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            ],
        )
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dashboard-shots")


@dataclass
class Session:
    """One browser tab with what it sent and what the console said."""

    page: Any
    server: Server
    shots: Path
    requests: list[Any] = field(default_factory=list)
    policy_violations: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def saw_request(self, request: Any) -> None:
        self.requests.append(request)

    def saw_console_message(self, message: Any) -> None:
        if "Content Security Policy" in message.text:
            self.policy_violations.append(message.text)

    def saw_dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def open(self, path: str) -> None:
        self.page.goto(self.server.url + path)

    def enter_key(self) -> None:
        self.page.fill("#key-input", self.server.keys["analyst"])
        self.page.click("#key-form button[type=submit]")
        self.page.wait_for_selector("#key-status", state="visible")

    def shot(self, name: str) -> None:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        copies = os.environ.get("LDP_DASHBOARD_SHOTS")
        if copies:
            Path(copies).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(copies) / path.name)

    def api_requests(self, fragment: str) -> list[Any]:
        return [r for r in self.requests if fragment in urlsplit(r.url).path]

    def same_answer(self, request: Any) -> Any:
        """What the API answers to the request the page made, asked again with the key."""
        response = httpx.get(request.url, headers=self.server.headers("analyst"), timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def chart(self, canvas_id: str) -> Any:
        """The data a Chart.js chart on the page was given."""
        return self.page.evaluate(
            """(id) => {
                const chart = Chart.getChart(document.getElementById(id));
                return chart && {
                    labels: chart.data.labels,
                    datasets: chart.data.datasets.map((d) => ({
                        label: d.label, data: d.data, intervals: d.intervals ?? null,
                    })),
                };
            }""",
            canvas_id,
        )


@pytest.fixture
def session(browser: Any, server: Server, shots: Path) -> Iterator[Session]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    tab = Session(page, server, shots)
    page.on("request", tab.saw_request)
    page.on("console", tab.saw_console_message)
    page.on("dialog", tab.saw_dialog)
    yield tab
    context.close()
    assert tab.requests, "the page made no request"
    origin = server.url + "/"
    for request in tab.requests:
        assert request.url.startswith(origin), f"a request left the server: {request.url}"
        assert server.keys["analyst"] not in request.url
    assert not tab.policy_violations
    assert not tab.dialogs


def percent_cell(text: str) -> float:
    """A share as the tables write it: "41.24%" -> 0.4124."""
    return float(text.rstrip("%")) / 100


def assert_shown(text: str, value: float) -> None:
    """A two-decimal percentage shows ``value``: it is ``value`` rounded."""
    assert abs(percent_cell(text) - value) <= 0.00005 + 1e-12, (text, value)


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.slow
def test_without_a_key_only_the_public_specs_are_shown(session: Session) -> None:
    session.open("/ui/")
    rows = session.page.locator("#metric-table tbody tr")
    assert rows.count() == 9  # the seven demo metrics, one with a script label, one pem
    assert "ε = 1" in rows.filter(has_text=CATEGORICAL).inner_text()
    assert session.page.locator(".health-line").inner_text().startswith("Service ok")
    session.shot("overview-without-key")
    session.page.fill("#metric-filter", "rappor")
    assert session.page.locator("#metric-table tbody tr:visible").count() == 1
    session.open(f"/ui/metrics/{CATEGORICAL}")
    assert session.page.locator("#needs-key").is_visible()
    assert session.page.locator("#analysis").is_hidden()
    assert session.page.locator(".promise").is_visible()
    session.open("/ui/federated")
    assert session.page.locator("#tasks").is_hidden()
    assert not session.api_requests("/v1/")  # the analyst API was never asked
    assert all("authorization" not in r.headers for r in session.requests)


@pytest.mark.slow
def test_a_categorical_metric_shows_the_estimate_apis_numbers(session: Session) -> None:
    session.open("/ui/")
    session.enter_key()
    stored = session.page.evaluate("sessionStorage.getItem('ldp-analyst-key')")
    assert stored == session.server.keys["analyst"]
    assert session.page.evaluate("document.cookie") == ""
    assert session.page.evaluate("localStorage.length") == 0
    session.page.click(f"text={CATEGORICAL}")
    session.page.wait_for_selector("#estimate-table tbody tr")
    (request,) = session.api_requests(f"/v1/metrics/{CATEGORICAL}/estimate")
    assert request.headers["authorization"] == "Bearer " + session.server.keys["analyst"]
    body = session.same_answer(request)
    estimates = body["estimates"]
    # The default window is the last day: DEMO_REPORTS_PER_HOUR demo reports an hour (23
    # hours of them if an hour began since the start).
    assert body["n"] == DEMO_REPORTS_PER_HOUR * body["buckets"] and body["buckets"] in (23, 24)

    chart = session.chart("estimate-chart")
    assert chart["labels"] == [item["label"] for item in estimates]
    (bars,) = chart["datasets"]
    assert bars["data"] == [item["frequency"] for item in estimates]
    assert bars["intervals"] == [[item["ci_low"], item["ci_high"]] for item in estimates]
    assert_whiskers_drawn(session, len(estimates))

    rows = session.page.locator("#estimate-table tbody tr").all()
    assert len(rows) == len(estimates)
    for row, item, projected in zip(rows, estimates, body["postprocessed"], strict=True):
        label, frequency, interval, _, _, postprocessed = row.locator("td").all_inner_texts()
        assert label == item["label"]
        assert_shown(frequency, item["frequency"])
        low, high = re.fullmatch(r"\[(\S+), (\S+)\]", interval).groups()  # type: ignore[union-attr]
        assert_shown(low, item["ci_low"])
        assert_shown(high, item["ci_high"])
        assert_shown(postprocessed, projected["frequency"])
    session.shot("metric-categorical")

    session.page.check("#show-postprocessed")
    (shown,) = session.chart("estimate-chart")["datasets"]
    assert shown["data"] == [item["frequency"] for item in body["postprocessed"]]
    assert shown["intervals"] is None  # a post-processed distribution has no interval
    assert abs(sum(shown["data"]) - 1.0) < 1e-9 and min(shown["data"]) >= 0.0
    session.shot("metric-categorical-postprocessed")
    session.page.uncheck("#show-postprocessed")
    assert session.chart("estimate-chart")["datasets"][0]["intervals"] is not None


def assert_whiskers_drawn(session: Session, bars: int) -> None:
    """On the canvas, each bar's whisker is drawn (opaque, near black: the bars are blue, the
    canvas transparent) at both interval ends and between them, and not just beside."""
    probes = session.page.evaluate(
        """() => {
            const canvas = document.getElementById("estimate-chart");
            const chart = Chart.getChart(canvas);
            const ratio = canvas.width / canvas.clientWidth;
            const context = canvas.getContext("2d");
            const dark = (x, y) => {
                const pixels = context.getImageData(
                    Math.round(x * ratio) - 1, Math.round(y * ratio) - 1, 3, 3).data;
                for (let i = 0; i < pixels.length; i += 4) {  // opaque and near black
                    const [r, g, b, a] = pixels.slice(i, i + 4);
                    if (a > 200 && r < 70 && g < 70 && b < 90) return true;
                }
                return false;
            };
            const dataset = chart.data.datasets[0];
            return chart.getDatasetMeta(0).data.map((bar, i) => {
                const [low, high] = dataset.intervals[i];
                const top = chart.scales.y.getPixelForValue(high);
                const bottom = chart.scales.y.getPixelForValue(low);
                const cap = Math.max(3, Math.min(10, bar.width / 4)) - 1.5;
                return {
                    top: dark(bar.x + cap, top), bottom: dark(bar.x + cap, bottom),
                    middle: dark(bar.x, (top + bottom) / 2),
                    beside: dark(bar.x + cap + 8, top - 8),
                };
            });
        }"""
    )
    assert len(probes) == bars
    for probe in probes:
        assert probe == {"top": True, "bottom": True, "middle": True, "beside": False}, probe


@pytest.mark.slow
def test_the_series_of_a_window_is_the_series_apis(session: Session) -> None:
    session.open(f"/ui/metrics/{CATEGORICAL}")
    session.enter_key()
    session.page.wait_for_selector("#estimate-table tbody tr")
    session.page.select_option("#window-step", "1h")
    session.page.select_option("#window-preset", "7d")
    session.page.wait_for_function(
        "() => Chart.getChart(document.getElementById('series-chart'))?.data.labels.length === 168"
    )
    request = session.api_requests(f"/v1/metrics/{CATEGORICAL}/series")[-1]
    query = parse_qs(urlsplit(request.url).query)
    assert query["step"] == ["1h"] and query["version"] == ["1"]
    body = session.same_answer(request)
    steps = body["steps"]
    released_steps = sum(step["estimate"] is not None for step in steps)
    assert len(steps) == 168 and released_steps in (DEMO_HOURS, DEMO_HOURS + 1)
    assert sum(step["n"] for step in steps) == DEMO_HOURS * DEMO_REPORTS_PER_HOUR
    assert "window=7d" in session.page.url and "step=1h" in session.page.url

    def assert_series_of(index: int) -> None:
        low, high, line = session.chart("series-chart")["datasets"]
        rows = [
            step["estimate"]["estimates"][index] if step["estimate"] else None for step in steps
        ]
        assert line["data"] == [row and row["frequency"] for row in rows]
        assert low["data"] == [row and row["ci_low"] for row in rows]
        assert high["data"] == [row and row["ci_high"] for row in rows]

    shown = int(session.page.input_value("#series-item"))
    assert_series_of(shown)
    released, suppressed = session.chart("series-n-chart")["datasets"]
    for step, a, b in zip(steps, released["data"], suppressed["data"], strict=True):
        assert a + b == step["n"] and a == (step["estimate"]["n"] if step["estimate"] else 0)
    summary = session.page.inner_text("#series-summary")
    assert summary.startswith(f"168 steps · {released_steps} with an estimate")
    session.shot("metric-series-7-days")

    other = (shown + 1) % 8
    session.page.select_option("#series-item", str(other))
    assert_series_of(other)

    # A custom window, typed in UTC, is asked for as typed (whole hours) and kept in the
    # page's address.
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    start, end = hour - timedelta(hours=3), hour + timedelta(hours=1)
    session.page.select_option("#window-preset", "custom")
    session.page.fill("#window-start", start.strftime("%Y-%m-%dT%H:%M"))
    session.page.fill("#window-end", end.strftime("%Y-%m-%dT%H:%M"))
    session.page.click("#window-form button[type=submit]")
    session.page.wait_for_function(
        "() => Chart.getChart(document.getElementById('series-chart'))?.data.labels.length === 4"
    )
    query = parse_qs(urlsplit(session.api_requests("/series")[-1].url).query)
    assert query["start"] == [start.strftime("%Y-%m-%dT%H:%M:%SZ")]
    assert query["end"] == [end.strftime("%Y-%m-%dT%H:%M:%SZ")]
    assert "window=custom" in session.page.url


@pytest.mark.slow
def test_numeric_and_string_metrics(session: Session) -> None:
    session.open("/ui/metrics/app.session_minutes")
    session.enter_key()
    session.page.wait_for_selector("#mean-summary .mean-value")
    (request,) = session.api_requests("/v1/metrics/app.session_minutes/estimate")
    body = session.same_answer(request)
    summary = session.page.inner_text("#mean-summary")
    assert f"{body['mean']:.5g}" in summary.replace(",", "")
    session.page.wait_for_function(
        "() => Chart.getChart(document.getElementById('series-chart')) !== undefined"
    )
    series = session.same_answer(session.api_requests("/v1/metrics/app.session_minutes/series")[-1])
    line = session.chart("series-chart")["datasets"][2]["data"]
    assert line == [step["estimate"] and step["estimate"]["mean"] for step in series["steps"]]
    session.shot("metric-numeric")

    session.open("/ui/metrics/browser.home_page")
    session.page.wait_for_selector("#strings-table tbody tr")
    (request,) = session.api_requests("/v1/metrics/browser.home_page/estimate")
    candidates = session.same_answer(request)["candidates"]
    strings = session.page.locator("#strings-table tbody tr td:first-child").all_inner_texts()
    ranked = sorted(candidates, key=lambda item: -item["frequency"])
    assert strings == [item["string"] for item in ranked]
    session.shot("metric-strings")

    # A discovery metric: its heavy hitters, then its estimate and series at them.
    session.open(f"/ui/metrics/{DISCOVERY}")
    session.page.wait_for_selector("#strings-table tbody tr")
    (request,) = session.api_requests(f"/v1/metrics/{DISCOVERY}/heavy-hitters")
    found = [item["string"] for item in session.same_answer(request)["heavy_hitters"]]
    assert {"kiwi", "fig", "plum"} <= set(found)
    shown = session.page.locator("#heavy-table tbody tr td:first-child").all_text_contents()
    assert shown == found
    (request,) = session.api_requests(f"/v1/metrics/{DISCOVERY}/series")
    assert parse_qs(urlsplit(request.url).query)["candidates"] == found
    session.page.wait_for_selector("#series-item option", state="attached")
    assert session.page.locator("#series-item option").all_text_contents() == found
    session.shot("metric-heavy-hitters")


@pytest.mark.slow
def test_the_federated_pages(session: Session) -> None:
    session.open("/ui/federated")
    session.enter_key()
    row = session.page.locator("#task-table tbody tr")
    row.wait_for()
    assert row.locator("td").first.inner_text() == TASK
    assert f"{ROUNDS_RUN} of 5" in row.inner_text()
    session.shot("federated-tasks")
    session.page.click(f"#task-table a:text('{TASK}')")
    session.page.wait_for_selector("#round-table tbody tr")
    status = httpx.get(
        f"{session.server.url}/v1/federated/tasks/{TASK}", headers=session.server.headers("analyst")
    ).json()
    history = status["history"]
    assert len(history) == ROUNDS_RUN
    evaluation = session.chart("task-evaluation-chart")
    assert evaluation["labels"] == [str(record["round"]) for record in history]
    accuracy = next(d for d in evaluation["datasets"] if d["label"] == "accuracy")
    assert accuracy["data"] == [record["evaluation"]["accuracy"] for record in history]
    spent, budget = session.chart("task-epsilon-chart")["datasets"]
    assert spent["data"] == [record["epsilon"] for record in history]
    assert budget["data"] == [status["budget"]] * ROUNDS_RUN
    assert session.page.locator("#round-table tbody tr").count() == ROUNDS_RUN
    session.shot("federated-task")


@pytest.mark.slow
def test_a_script_label_is_shown_as_text(session: Session) -> None:
    session.open("/ui/")
    cell = (
        session.page.locator("#metric-table tbody tr", has_text="xss.test").locator(".label").first
    )
    assert cell.inner_text() == XSS_LABEL
    session.enter_key()
    session.page.click("text=xss.test")
    session.page.wait_for_selector("#estimate-table tbody tr")
    first = session.page.locator("#estimate-table tbody tr td").first
    assert first.inner_text() == XSS_LABEL
    assert session.chart("estimate-chart")["labels"][0] == XSS_LABEL
    injected = session.page.evaluate(
        "[...document.scripts].filter((s) => !s.src || s.text.includes('alert')).length"
    )
    assert injected == 0
    assert session.page.locator("img").count() == 0
    session.shot("metric-script-label")
    # Were a tag to get in all the same, the page's policy would not run it.
    session.page.evaluate(
        """() => {
            const script = document.createElement("script");
            script.textContent = "window.injected = true";
            document.body.append(script);
        }"""
    )
    assert session.page.evaluate("window.injected") is None
    (violation,) = session.policy_violations
    assert "script-src 'self'" in violation
    session.policy_violations.clear()


@pytest.mark.slow
def test_the_key_never_reaches_a_log_and_can_be_forgotten(session: Session) -> None:
    session.open("/ui/")
    session.enter_key()
    session.page.click("#key-forget")
    assert session.page.evaluate("sessionStorage.length") == 0
    assert session.page.locator("#key-form").is_visible()
    session.page.fill("#key-input", "not-a-key-of-this-service")
    session.page.click("#key-form button[type=submit]")
    session.page.click(f"text={CATEGORICAL}")
    session.page.wait_for_selector("#key-message:has-text('refused')")
    assert session.page.evaluate("sessionStorage.length") == 0  # a refused key is dropped
    log = session.server.log_path.read_text(errors="replace")
    assert session.server.keys["analyst"] not in log
    assert "not-a-key-of-this-service" not in log
