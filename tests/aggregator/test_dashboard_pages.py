"""The dashboard's pages without a browser: what the server renders and the headers it sends.

Checked here: the security headers on every response under ``/ui`` (a policy with no
inline script or style and no other origin), pages with no inline script, event
handler, style attribute or other host, admin input (labels, descriptions, names in
paths) rendered as text, the public privacy promise of each kind of metric, versions,
404 pages, a health panel that shows an unreachable database instead of failing, the
vendored chart library unmodified (its recorded checksum) and shipped by the package
data, and the analyst key's field, which a form cannot send.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.registry import DEMO_METRICS
from aggregator.routes.ui import CONTENT_SECURITY_POLICY, ui_directory
from aggregator.settings import Settings
from shared.mechanisms.rappor import rappor_epsilon_infinity

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "pages-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
XSS_LABEL = "<script>alert(1)</script>"
XSS_DESCRIPTION = '<img src=x onerror="alert(2)">'
#: The directives the pages' policy must hold, as the dashboard's design requires.
REQUIRED_POLICY = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self' data:",
    "connect-src": "'self'",
    "frame-ancestors": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    database = tmp_path_factory.mktemp("pages") / "pages.sqlite3"
    app = create_app(Settings(database=str(database), compaction_interval=0))
    service = app.state.aggregator
    repositories = app.state.services.repositories
    assert bootstrap_keys(app.state.keys, repositories.keys, {"LDP_ADMIN_KEYS": ADMIN_KEY}) is None
    service.define_missing(DEMO_METRICS)
    with TestClient(app) as test_client:
        define(test_client, "xss.test", {"mechanism": "grr", "epsilon": 1.0, "domain_size": 2},
               labels=[XSS_LABEL, "plain"], description=XSS_DESCRIPTION)  # fmt: skip
        define(test_client, "mood", {"mechanism": "lgrr", "epsilon": 4.0, "epsilon_report": 1.0,
               "domain_size": 2}, labels=["calm", "busy"])  # fmt: skip
        define(test_client, "sketch", {"mechanism": "pem", "epsilon": 2.0, "max_length": 8})
        define(test_client, "colour", {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})
        define(test_client, "colour", {"mechanism": "grr", "epsilon": 2.0, "domain_size": 3})
        yield test_client


def define(client: TestClient, name: str, spec: dict[str, Any], **fields: Any) -> None:
    response = client.put(f"/v1/metrics/{name}", json={"mechanism": spec, **fields}, headers=ADMIN)
    assert response.status_code == 201, response.text


class Page(HTMLParser):
    """The parts of a page that matter to its policy: tags with their attributes, and the
    text of script elements."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_text: list[str] = []
        self.text: list[str] = []
        self._in_script = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        (self.script_text if self._in_script else self.text).append(data)

    def all(self, tag: str) -> list[dict[str, str | None]]:
        return [attributes for name, attributes in self.tags if name == tag]


PAGES = [
    "/ui/",
    "/ui/metrics/app.theme",
    "/ui/metrics/app.session_minutes",
    "/ui/metrics/browser.home_page",
    "/ui/metrics/sketch",
    "/ui/metrics/xss.test",
    "/ui/metrics/colour?version=1",
    "/ui/federated",
    "/ui/federated/digits",
    "/ui/metrics/absent",
]


def policy(header: str) -> dict[str, str]:
    """A Content-Security-Policy's directives by name."""
    directives = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition(" ")
        if name:
            directives[name] = value.strip()
    return directives


@pytest.mark.parametrize(
    "path", [*PAGES, "/ui/static/common.js", "/ui/static/dashboard.css", "/ui/static/none.js"]
)
def test_every_response_under_ui_carries_the_security_headers(
    client: TestClient, path: str
) -> None:
    response = client.get(path)
    assert response.status_code in (200, 404)
    headers = response.headers
    directives = policy(headers["content-security-policy"])
    for name, value in REQUIRED_POLICY.items():
        assert directives.get(name) == value, (name, directives)
    assert "unsafe" not in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-frame-options"] == "DENY"
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert headers["cache-control"] == "no-cache"  # revalidated: a new version is used at once


def test_the_api_is_left_as_it_was(client: TestClient) -> None:
    response = client.get("/v1/metrics")
    assert response.status_code == 200
    assert "content-security-policy" not in response.headers
    paths = client.get("/openapi.json").json()["paths"]
    assert not any(path.startswith("/ui") for path in paths)
    redirect = client.get("/ui", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/ui/")


@pytest.mark.parametrize("path", PAGES)
def test_pages_hold_no_inline_code_and_load_only_this_origin(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.headers["content-type"].startswith("text/html")
    page = Page(response.text)
    assert "://" not in response.text, "a page names another host"
    scripts = page.all("script")
    assert scripts, "the page loads no script"
    for script in scripts:
        assert script.get("src"), "an inline script"
    assert not "".join(page.script_text).strip()
    for tag, attributes in page.tags:
        for name, value in attributes.items():
            assert not name.startswith("on"), (tag, name)
            assert name != "style", (tag, name)
            assert not (value or "").strip().lower().startswith("javascript:"), (tag, name)
    assert not page.all("style")
    for attributes in [*scripts, *page.all("link"), *page.all("a"), *page.all("img")]:
        url = attributes.get("src") or attributes.get("href") or ""
        parts = urlsplit(url)
        assert not parts.netloc and parts.scheme in ("", "data"), url
        if parts.path.startswith("/ui/static/"):
            asset = client.get(parts.path)
            assert asset.status_code == 200, url
            expected = "text/css" if url.endswith(".css") else "javascript"
            assert expected in asset.headers["content-type"]


def test_admin_input_is_rendered_as_text(client: TestClient) -> None:
    for path in ("/ui/", "/ui/metrics/xss.test"):
        html = client.get(path).text
        assert XSS_LABEL not in html and "<img src=x" not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        page = Page(html)
        assert XSS_LABEL in "".join(page.text) and XSS_DESCRIPTION in "".join(page.text)
        assert all(script.get("src") for script in page.all("script"))
        assert not page.all("img")
    missing = client.get("/ui/metrics/%3Cb%3Ebold")
    assert missing.status_code == 404
    assert "<b>bold" not in missing.text and "There is no metric &lt;b&gt;bold." in missing.text
    task = client.get("/ui/federated/%3Ci%3E")
    assert task.status_code == 404 and "<i>" not in task.text.split("<main>")[1]


def row_of(html: str, name: str) -> str:
    """The overview's table row of one metric."""
    link = f'<a class="metric-link" href="/ui/metrics/{re.escape(name)}">'
    match = re.search(
        rf'<tr data-search="[^"]*">\s*<td>{link}.*?</tr>',
        html,
        re.DOTALL,
    )
    assert match is not None, name
    return match.group(0)


def test_the_overview_shows_each_metrics_public_promise(client: TestClient) -> None:
    html = client.get("/ui/").text
    theme = row_of(html, "app.theme")
    assert "<code>grr</code>" in theme and "ε = 2</span>" in theme and "per report" in theme
    assert "3 categories" in theme and '<span class="label">dark</span>' in theme
    assert "v1" in theme
    start = row_of(html, "app.start_screen")
    assert "<code>auto</code> → <code>" in start  # the mechanism auto resolved to
    minutes = row_of(html, "app.session_minutes")
    assert "numbers clipped to [0, 120]" in minutes
    rappor = row_of(html, "browser.home_page")
    spec = DEMO_METRICS["browser.home_page"].mechanism
    assert spec.num_hashes is not None and spec.f is not None
    lifetime = rappor_epsilon_infinity(spec.num_hashes, spec.f)
    assert f"ε∞ = {lifetime:.4g}" in rappor and "lifetime bound per distinct value" in rappor
    mood = row_of(html, "mood")
    assert "ε = 4</span>" in mood and "lifetime bound per distinct value" in mood
    assert "ε<sub>report</sub> = 1" in mood
    sketch = row_of(html, "sketch")
    assert "strings of up to 8 bytes; no candidate strings" in sketch
    colour = row_of(html, "colour")
    assert "ε = 2</span>" in colour and "v2" in colour  # the current version
    assert 'id="metric-filter"' in html and f"{len(DEMO_METRICS) + 4} metrics" in html


def test_a_metric_page_lists_its_versions(client: TestClient) -> None:
    current = client.get("/ui/metrics/colour").text
    assert 'data-version="2"' in current and 'data-latest="2"' in current
    assert '<a href="?version=1">v1</a>' in current
    assert '<strong aria-current="true">v2</strong>' in current
    assert "an earlier version" not in current
    earlier = client.get("/ui/metrics/colour?version=1").text
    assert 'data-version="1"' in earlier and "ε = 1</span>" in earlier
    assert "an earlier version: its estimates use only the reports made under it" in earlier
    for bad in ("3", "0", "x", ""):
        response = client.get(f"/ui/metrics/colour?version={bad}")
        assert response.status_code == 404, bad
        assert "There is no metric colour version" in response.text


def test_each_kind_gets_its_own_panels(client: TestClient) -> None:
    categorical = client.get("/ui/metrics/app.theme").text
    assert 'id="estimate-chart"' in categorical and 'id="show-postprocessed"' in categorical
    numeric = client.get("/ui/metrics/app.session_minutes").text
    assert 'id="mean-summary"' in numeric and 'id="estimate-chart"' not in numeric
    assert 'id="series-item"' not in numeric
    strings = client.get("/ui/metrics/browser.home_page").text
    assert 'id="strings-table"' in strings and 'id="heavy-table"' not in strings
    discovery = client.get("/ui/metrics/sketch").text
    assert 'id="heavy-table"' in discovery
    for html in (categorical, numeric, strings, discovery):
        assert 'id="series-chart"' in html and 'id="series-n-chart"' in html
        assert 'id="window-preset"' in html and 'id="needs-key"' in html


def test_the_key_field_cannot_be_submitted(client: TestClient) -> None:
    page = Page(client.get("/ui/").text)
    (form,) = [a for a in page.all("form") if a.get("id") == "key-form"]
    assert "action" not in form and "method" not in form
    (field,) = [a for a in page.all("input") if a.get("id") == "key-input"]
    assert field.get("type") == "password" and "name" not in field
    assert field.get("autocomplete") == "off"
    assert all("name" not in a for a in page.all("input"))


def test_health_shows_an_unreachable_database(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    html = client.get("/ui/").text
    assert '<dd class="state-ok">ok</dd>' in html and "<dd>sqlite</dd>" in html
    database = client.app.state.services.repositories.database  # type: ignore[attr-defined]

    def unreachable() -> None:
        raise ConnectionError("database down")

    monkeypatch.setattr(database, "ping", unreachable)
    for path in ("/ui/", "/ui/metrics/app.theme", "/ui/federated"):
        response = client.get(path)
        assert response.status_code == 200
        assert '<strong class="state-unreachable">unreachable</strong>' in response.text


def test_the_chart_library_is_shipped_unmodified() -> None:
    vendor = ui_directory() / "static" / "vendor"
    record = (vendor / "VERSIONS.txt").read_text()
    library = vendor / "chart.umd.min.js"
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    assert f"sha256:   {digest}" in record
    assert "version:  4.5.1" in record and "licence:  MIT" in record
    assert library.read_text().startswith("/*!\n * Chart.js v4.5.1\n")
    assert "Permission is hereby granted" in (vendor / "chart.js.LICENSE.md").read_text()


def test_the_package_data_ships_every_dashboard_file() -> None:
    """Every file under aggregator/ui matches a package-data pattern, so wheels carry it."""
    document = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = document["tool"]["setuptools"]["package-data"]["aggregator"]
    package = ROOT / "aggregator"
    files = [p for p in (package / "ui").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) >= 12
    for path in files:
        relative = path.relative_to(package).as_posix()
        matched = [
            p
            for p in patterns
            if fnmatch.fnmatch(relative, p) and p.count("/") == relative.count("/")
        ]
        assert matched, f"{relative} is not in the package data"


def test_the_scripts_never_parse_text_as_html() -> None:
    for script in (ui_directory() / "static").glob("*.js"):
        text = script.read_text()
        for forbidden in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                          "eval(", "new Function", "setTimeout(\"", "localStorage"):  # fmt: skip
            assert forbidden not in text, (script.name, forbidden)
