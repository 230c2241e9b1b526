"""``/docs`` and ``/redoc`` work offline: every asset they load is served by the app itself.

The pages' HTML may name no other host (a CDN left in would leave them blank without
internet access), and each script and stylesheet they reference must answer 200 from the
app with a JavaScript or CSS body. Where Debian's ``chromium`` is installed, a headless
browser loads ``/docs`` from a real server and the Swagger UI must list the operations.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.docs_pages import ASSETS_URL
from aggregator.settings import Settings

#: Every URL a page loads or links to: src=, href=, spec-url= (ReDoc) and url: (Swagger UI).
REFERENCE = re.compile(
    r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|\burl\s*:\s*['"]([^'"]+)['"]"""
)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(database=str(tmp_path / "docs.sqlite3"), compaction_interval=0))
    with TestClient(app) as client:
        yield client


def references(html: str) -> list[str]:
    return [a or b for a, b in REFERENCE.findall(html)]


@pytest.mark.parametrize(
    ("page", "scripts", "stylesheets"),
    [
        ("/docs", [f"{ASSETS_URL}/swagger-ui-bundle.js"], [f"{ASSETS_URL}/swagger-ui.css"]),
        ("/redoc", [f"{ASSETS_URL}/redoc.standalone.js"], []),
    ],
)
def test_pages_load_only_local_assets(
    client: TestClient, page: str, scripts: list[str], stylesheets: list[str]
) -> None:
    response = client.get(page)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    found = references(html)
    assert found, f"{page} references nothing: the pattern no longer matches the page"
    assert "://" not in html.replace("http://www.w3.org", ""), f"{page} names another host"
    for url in found:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc, f"{page} loads {url} from elsewhere"
        assert url.startswith("/"), f"{page} references {url}, not a path on this server"
    assert set(scripts + stylesheets) <= set(found)
    for url in scripts:
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert "javascript" in asset.headers["content-type"], asset.headers["content-type"]
        assert len(asset.content) > 100_000  # the real build, not a placeholder
    for url in stylesheets:
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["content-type"].startswith("text/css")
        assert b".swagger-ui" in asset.content
    for url in found:  # the favicon and the OpenAPI document answer too
        assert client.get(url).status_code == 200, url


def test_oauth2_redirect_page_is_served(client: TestClient) -> None:
    response = client.get("/docs/oauth2-redirect")
    assert response.status_code == 200
    assert "://" not in response.text


def test_pages_stay_out_of_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not {"/docs", "/redoc", "/docs/oauth2-redirect"} & set(paths)
    assert not any(path.startswith(ASSETS_URL) for path in paths)


def test_unknown_asset_is_a_problem_not_a_crash(client: TestClient) -> None:
    response = client.get(f"{ASSETS_URL}/no-such-file.js")
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("application/problem+json")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian package: chromium)")
@pytest.mark.slow
def test_swagger_ui_renders_the_operations_in_a_browser(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    """Headless chromium, offline but for loopback, renders Swagger UI's operation list."""
    server = start_server(str(tmp_path / "browser.sqlite3"))
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            # Any host but the loopback server is unreachable, as on an offline machine.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=15000", "--dump-dom", f"{server.url}/docs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'class="swagger-ui' in dom
    assert "opblock" in dom, "Swagger UI rendered no operation"
    assert "/v1/reports" in dom and "/v1/metrics/{name}/estimate" in dom
