"""The dashboard's integrity warning in a real browser (Debian's chromium via Playwright)
against a real ``ldp-aggregator serve``.

An ``oue`` metric with honest reports shows its fit's p-value and no warning; once forged
maximal-gain reports (the target bits and the honest count of ones, 10% of the reports)
are added, the page shows the warning (role="alert") with the p-value the estimate API
gives. A ``laplace`` metric shows its robust (winsorized) mean with the bias bound, and
the reports refused by the noise-tail rule.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="no /usr/bin/chromium (Debian package: chromium)"
    ),
]

OUE = {"mechanism": "oue", "epsilon": 1.0, "domain_size": 64}
LAPLACE = {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 100.0}
#: Reports stamped an hour ago: their time bucket is released (the current one is filling).
LAST_HOUR = (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:00:00Z")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("integrity-server")
    running = start_server(str(directory / "integrity.sqlite3"), directory)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def page(server: Server) -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"],
        )
        try:
            yield browser.new_context().new_page()
        finally:
            browser.close()


def define(server: Server, name: str, spec: dict[str, Any]) -> None:
    response = httpx.put(
        f"{server.url}/v1/metrics/{name}", json={"mechanism": spec}, headers=server.headers("admin")
    )
    assert response.status_code == 201, response.text


def post(server: Server, name: str, payloads: list[dict[str, Any]]) -> httpx.Response:
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": payload,
         "time": LAST_HOUR}
        for payload in payloads
    ]  # fmt: skip
    return httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60,
    )


def estimate(server: Server, name: str) -> dict[str, Any]:
    response = httpx.get(
        f"{server.url}/v1/metrics/{name}/estimate", headers=server.headers("analyst"), timeout=60
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def show(page: Any, server: Server, name: str) -> None:
    page.goto(f"{server.url}/ui/metrics/{name}")
    if page.locator("#key-input").is_visible():  # typed once, the tab keeps it
        page.fill("#key-input", server.keys["analyst"])
        page.click("#key-form button[type=submit]")
    page.wait_for_selector("#estimate-facts .fact")


def test_forged_reports_raise_the_warning(server: Server, page: Any) -> None:
    define(server, "colour", OUE)
    mech = make_mechanism(MechanismSpec.model_validate(OUE))
    rng = np.random.default_rng(11)
    honest = mech.encode(rng.integers(0, 64, 1800), rng=rng)
    assert post(server, "colour", mech.to_payloads(honest)).status_code == 200
    show(page, server, "colour")
    facts = page.inner_text("#estimate-facts")
    fit = estimate(server, "colour")["integrity"]["fit"]
    assert "honest-model fit p = " in facts
    assert page.locator("#integrity-warning").is_hidden()
    # Maximal-gain reports: the 5 target bits and enough random others for the honest
    # count of ones, round(p + (d - 1) q) (Cao, Jia and Gong 2021).
    ones = round(mech.p + 63 * mech.q)
    bits = np.zeros((200, 64), dtype=np.uint8)
    bits[:, :5] = 1
    for row in bits:  # a test's handful of forged reports
        row[5 + rng.choice(59, ones - 5, replace=False)] = 1
    assert post(server, "colour", mech.to_payloads(np.packbits(bits, axis=1))).status_code == 200
    integrity = estimate(server, "colour")["integrity"]
    assert integrity["alert"] and integrity["fit"]["p_value"] < fit["p_value"]
    show(page, server, "colour")
    warning = page.locator("#integrity-warning")
    warning.wait_for(state="visible")
    assert warning.get_attribute("role") == "alert"
    text = warning.inner_text()
    assert "may be attacked" in text and "forged reports" in text
    assert f"{integrity['fit']['p_value']:.1e}" in text


def test_a_laplace_metric_shows_its_robust_mean_and_refusals(server: Server, page: Any) -> None:
    define(server, "latency", LAPLACE)
    mech = make_mechanism(MechanismSpec.model_validate(LAPLACE))
    rng = np.random.default_rng(12)
    honest = mech.encode(rng.uniform(0, 100, 300), rng=rng)
    assert post(server, "latency", mech.to_payloads(honest)).status_code == 200
    far = mech.grid_steps + mech.refusal_bound + 1
    assert post(server, "latency", [{"value": far}]).status_code == 422
    show(page, server, "latency")
    page.wait_for_selector("#mean-table")
    body = estimate(server, "latency")
    table = page.inner_text("#mean-table")
    assert "robust (bias at most" in table
    assert f"{body['robust']['mean']:.5g}" in table.replace(",", "")
    assert "laplace.noise_tail" in page.inner_text("#estimate-facts")
    assert page.locator("#integrity-warning").is_hidden()
