"""The interactive API documentation (``/docs``, Swagger UI; ``/redoc``, ReDoc), served offline.

FastAPI's default pages load Swagger UI and ReDoc from a public CDN, so on a machine
without internet access (an air-gapped deployment, a laptop on a train) they stay blank.
Here both pages load their JavaScript and CSS from ``/docs-assets/``, a static mount of
the built files that the ``fastapi-offline`` package ships (Swagger UI 5, a bundle of
swagger-ui-dist, Apache-2.0; ReDoc 2 standalone, MIT); only its files are used, not its
application class. The page HTML comes from FastAPI's own ``get_swagger_ui_html`` and
``get_redoc_html``, pointed at those local URLs.

Admins paste API keys into these pages ("Authorize"), so they carry the dashboard's
security headers (``aggregator/routes/ui.py``): no framing by another site, no MIME
sniffing, no referrer, a separate browsing context group, and a Content-Security-Policy
that admits scripts, connections and images from this origin only. Each page's own
inline ``<script>`` and ``<style>`` blocks are admitted by their SHA-256 hashes, computed
from the HTML actually served, never by ``'unsafe-inline'``; the one relaxation is that
style attributes and the style sheets ReDoc's styling library inserts at run time are
allowed (``style-src-attr``/``style-src-elem 'unsafe-inline'`` on ``/redoc`` only), which
cannot run code. The assets under ``/docs-assets/`` carry the same headers.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aggregator.routes.ui import CONTENT_SECURITY_POLICY, SECURITY_HEADERS

__all__ = [
    "ASSETS_URL",
    "DOCS_URL",
    "REDOC_URL",
    "add_docs_pages",
    "assets_directory",
    "page_policy",
]

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
#: Where the Swagger UI and ReDoc files are mounted.
ASSETS_URL = "/docs-assets"
SWAGGER_JS = "swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui.css"
REDOC_JS = "redoc.standalone.js"
FAVICON = "favicon.png"
#: The dashboard's headers but its Content-Security-Policy (each page has its own).
OTHER_HEADERS: tuple[tuple[bytes, bytes], ...] = tuple(
    (name, value) for name, value in SECURITY_HEADERS if name != b"Content-Security-Policy"
)
#: Inline ``<script>`` (without ``src``) and ``<style>`` blocks of a page.
_INLINE = re.compile(r"<(script|style)(?![^>]*\bsrc=)[^>]*>(.*?)</\1>", re.DOTALL)


def page_policy(html: str, *, runtime_styles: bool = False) -> str:
    """The Content-Security-Policy of a documentation page: the dashboard's, with the
    page's inline scripts and styles admitted by hash (``'sha256-...'`` of their exact
    text, CSP Level 2), and, with ``runtime_styles``, style attributes and elements that
    the page's scripts insert (ReDoc's CSS-in-JS). Workers may start from this origin
    or from ``blob:`` URLs the page made (ReDoc's search)."""
    directives = dict(
        (part.split(" ", 1)[0], part.split(" ", 1)[1] if " " in part else "")
        for part in CONTENT_SECURITY_POLICY.split("; ")
    )
    for kind, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        directives[f"{kind}-src"] += f" 'sha256-{digest}'"
    if runtime_styles:
        # Without hashes: a hash in the list would make browsers ignore 'unsafe-inline'.
        directives["style-src-elem"] = "'self' 'unsafe-inline'"
        directives["style-src-attr"] = "'unsafe-inline'"
    directives["worker-src"] = "'self' blob:"
    return "; ".join(f"{name} {sources}" for name, sources in directives.items())


def _secured(page: HTMLResponse, *, runtime_styles: bool = False) -> HTMLResponse:
    """``page`` with the security headers and its own Content-Security-Policy."""
    policy = page_policy(bytes(page.body).decode(), runtime_styles=runtime_styles)
    for name, value in OTHER_HEADERS:
        page.headers[name.decode()] = value.decode()
    page.headers["Content-Security-Policy"] = policy
    page.headers["Cache-Control"] = "no-cache"
    return page


class _AssetHeaders:
    """ASGI wrapper: the security headers (and a policy admitting nothing inline) on the
    documentation assets."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers = [
            *OTHER_HEADERS,
            (b"Content-Security-Policy", CONTENT_SECURITY_POLICY.encode()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, with_headers)


def assets_directory() -> Path:
    """The installed directory holding the Swagger UI and ReDoc builds.

    Raises ``RuntimeError`` naming the missing file when the installation lacks one, so a
    broken install fails at start rather than serving blank pages.
    """
    directory = Path(str(files("fastapi_offline") / "static"))
    for name in (SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON):
        if not (directory / name).is_file():
            raise RuntimeError(
                f"the documentation asset {name} is missing from {directory}; "
                "reinstall the fastapi-offline package"
            )
    return directory


def add_docs_pages(app: FastAPI) -> None:
    """Mount the assets and add ``/docs``, its OAuth2 redirect page, and ``/redoc`` to ``app``.

    ``app`` must be built with ``docs_url=None`` and ``redoc_url=None`` so that FastAPI does
    not add its CDN-backed pages first. URLs are prefixed with the request's ``root_path``,
    so the pages also work behind a proxy that serves the API under a sub-path.
    """
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("build the app with docs_url=None and redoc_url=None")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url or f"{DOCS_URL}/oauth2-redirect"
    assets = _AssetHeaders(StaticFiles(directory=assets_directory()))
    app.mount(ASSETS_URL, assets, name="docs-assets")

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    async def swagger_ui(request: Request) -> HTMLResponse:
        base = root(request)
        page = get_swagger_ui_html(
            openapi_url=f"{base}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{base}{ASSETS_URL}/{SWAGGER_JS}",
            swagger_css_url=f"{base}{ASSETS_URL}/{SWAGGER_CSS}",
            swagger_favicon_url=f"{base}{ASSETS_URL}/{FAVICON}",
            oauth2_redirect_url=f"{base}{oauth2_redirect_url}",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        return _secured(page)

    async def swagger_ui_redirect(request: Request) -> HTMLResponse:
        return _secured(get_swagger_ui_oauth2_redirect_html())

    async def redoc(request: Request) -> HTMLResponse:
        base = root(request)
        page = get_redoc_html(
            openapi_url=f"{base}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{base}{ASSETS_URL}/{REDOC_JS}",
            redoc_favicon_url=f"{base}{ASSETS_URL}/{FAVICON}",
            with_google_fonts=False,
        )
        return _secured(page, runtime_styles=True)

    # Plain Starlette routes, as FastAPI registers its own documentation pages: outside
    # the OpenAPI document and the API's dependencies.
    app.add_route(DOCS_URL, swagger_ui, include_in_schema=False)
    app.add_route(oauth2_redirect_url, swagger_ui_redirect, include_in_schema=False)
    app.add_route(REDOC_URL, redoc, include_in_schema=False)
