"""``/docs`` and ``/redoc``, where admins paste API keys, carry the dashboard's headers.

Attack reproduced: the documentation pages had no Content-Security-Policy and no frame
headers, so another site could frame them (clickjacking the "Authorize" dialog) and a
script injected into them would run. Now every page and asset carries the dashboard's
security headers; each page's policy admits its own inline script or style by hash
(recomputed here from the HTML served), and no script from anywhere but this origin;
``'unsafe-inline'`` appears only for the style sheets and style attributes ReDoc's
styling library inserts at run time (they cannot run code). Headless Chromium
(Debian's ``/usr/bin/chromium``, driven by Playwright) checks that both pages still
render their operations with the policy on, and that the policy blocks nothing of theirs.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.docs_pages import ASSETS_URL
from aggregator.settings import Settings
from simulations.server import Server

PAGES = ("/docs", "/redoc", "/docs/oauth2-redirect")
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.DOTALL)
INLINE_STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.DOTALL)
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(database=str(tmp_path / "docs.sqlite3"), compaction_interval=0))
    with TestClient(app) as client:
        yield client


def policy(header: str) -> dict[str, list[str]]:
    """A Content-Security-Policy header as directive -> sources."""
    directives = {}
    for part in header.split(";"):
        name, *sources = part.split()
        directives[name] = sources
    return directives


def sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("path", PAGES)
def test_documentation_pages_carry_the_dashboard_headers(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    headers = response.headers
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["cross-origin-opener-policy"] == "same-origin"
    rules = policy(headers["content-security-policy"])
    assert rules["frame-ancestors"] == ["'none'"]
    assert rules["object-src"] == ["'none'"]
    assert rules["base-uri"] == ["'none'"]
    assert rules["default-src"] == ["'self'"]
    assert rules["connect-src"] == ["'self'"]
    # Scripts: this origin and the page's own inline scripts by hash, nothing else.
    scripts = INLINE_SCRIPT.findall(response.text)
    assert rules["script-src"] == ["'self'", *(sha256(s) for s in scripts)]
    for style in INLINE_STYLE.findall(response.text):
        assert sha256(style) in rules["style-src"]
    # 'unsafe-inline' only for the style sheets and attributes ReDoc inserts at run time;
    # never for scripts, and nowhere on the Swagger UI pages. No eval anywhere.
    relaxed = {"style-src-elem", "style-src-attr"} if path == "/redoc" else set()
    for name, sources in rules.items():
        assert "'unsafe-eval'" not in sources
        assert name in relaxed or "'unsafe-inline'" not in sources, name


def test_swagger_ui_has_an_inline_script_admitted_by_its_hash(client: TestClient) -> None:
    """The check above is not vacuous: /docs starts Swagger UI with an inline script."""
    response = client.get("/docs")
    [script] = INLINE_SCRIPT.findall(response.text)
    assert "SwaggerUIBundle(" in script
    assert sha256(script) in policy(response.headers["content-security-policy"])["script-src"]


@pytest.mark.parametrize("asset", ["swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"])
def test_documentation_assets_carry_the_headers(client: TestClient, asset: str) -> None:
    response = client.get(f"{ASSETS_URL}/{asset}")
    assert response.status_code == 200
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert policy(response.headers["content-security-policy"])["frame-ancestors"] == ["'none'"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (Debian package: chromium)")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            # Any host but the loopback server is unreachable, as on an offline network.
            args=["--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"],
        )
        yield launched
        launched.close()


@pytest.mark.parametrize(
    ("path", "operation"),
    [("/docs", ".opblock"), ("/redoc", "[data-section-id^='tag/reports/operation']")],
)
@pytest.mark.slow
def test_pages_render_their_operations_under_the_policy(
    browser: Any, hostile_target: Callable[..., Server], path: str, operation: str
) -> None:
    """The page renders the API's operations with the policy on, and the policy blocks
    none of its scripts or styles; the only thing it may block is an image from another
    host (ReDoc's "powered by" logo, which an offline network could not load anyway)."""
    server = hostile_target()
    context = browser.new_context()
    page = context.new_page()
    violations: list[str] = []
    errors: list[str] = []
    page.on(
        "console",
        lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.on("pageerror", lambda error: errors.append(str(error)))
    response = page.goto(server.url + path)
    assert response is not None and "content-security-policy" in response.headers
    page.wait_for_selector(operation, timeout=60_000)
    assert page.locator(operation).count() >= 1
    page.wait_for_load_state("networkidle")
    context.close()
    assert not errors
    for violation in violations:
        assert "img-src" in violation and server.url not in violation, violation
