"""The interactive API documentation (``/docs``, Swagger UI; ``/redoc``, ReDoc), served offline.

FastAPI's default pages load Swagger UI and ReDoc from a public CDN, so on a machine
without internet access (an air-gapped deployment, a laptop on a train) they stay blank.
Here both pages load their JavaScript and CSS from ``/docs-assets/``, a static mount of
the built files that the ``fastapi-offline`` package ships (Swagger UI 5, a bundle of
swagger-ui-dist, Apache-2.0; ReDoc 2 standalone, MIT); only its files are used, not its
application class. The page HTML comes from FastAPI's own ``get_swagger_ui_html`` and
``get_redoc_html``, pointed at those local URLs.
"""

from __future__ import annotations

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

__all__ = ["ASSETS_URL", "DOCS_URL", "REDOC_URL", "add_docs_pages", "assets_directory"]

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
#: Where the Swagger UI and ReDoc files are mounted.
ASSETS_URL = "/docs-assets"
SWAGGER_JS = "swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui.css"
REDOC_JS = "redoc.standalone.js"
FAVICON = "favicon.png"


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
    app.mount(ASSETS_URL, StaticFiles(directory=assets_directory()), name="docs-assets")

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    async def swagger_ui(request: Request) -> HTMLResponse:
        base = root(request)
        return get_swagger_ui_html(
            openapi_url=f"{base}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{base}{ASSETS_URL}/{SWAGGER_JS}",
            swagger_css_url=f"{base}{ASSETS_URL}/{SWAGGER_CSS}",
            swagger_favicon_url=f"{base}{ASSETS_URL}/{FAVICON}",
            oauth2_redirect_url=f"{base}{oauth2_redirect_url}",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    async def swagger_ui_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        base = root(request)
        return get_redoc_html(
            openapi_url=f"{base}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{base}{ASSETS_URL}/{REDOC_JS}",
            redoc_favicon_url=f"{base}{ASSETS_URL}/{FAVICON}",
            with_google_fonts=False,
        )

    # Plain Starlette routes, as FastAPI registers its own documentation pages: outside
    # the OpenAPI document and the API's dependencies.
    app.add_route(DOCS_URL, swagger_ui, include_in_schema=False)
    app.add_route(oauth2_redirect_url, swagger_ui_redirect, include_in_schema=False)
    app.add_route(REDOC_URL, redoc, include_in_schema=False)
