"""`GET /`: the playground page (deployments/static/playground.html), a person's first stop.

One static file shipped as package data, plain HTML/CSS/JS that only calls the public API, so it stays right
as the API behind it changes. `http.playground: false` turns it off for API-only deployments (404).
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi.responses import HTMLResponse, JSONResponse, Response

__all__ = ["PLAYGROUND_FILE", "playground_page", "playground_response"]

PLAYGROUND_FILE = "static/playground.html"


@functools.cache
def playground_page() -> str:
    """The page's HTML, read once from the installed package."""
    return resources.files("deployments").joinpath(PLAYGROUND_FILE).read_text(encoding="utf-8")


def playground_response(enabled: bool) -> Response:
    """The page, or 404 in the app's error shape when `http.playground` is off."""
    if not enabled:
        body = {"error": {"type": "not_found", "message": "GET /: the playground is off (http.playground: false); "
                          "the API is under /v1 (OpenAPI at /docs)"}}
        return JSONResponse(status_code=404, content=body)
    # no-cache: a redeployed server's page is picked up on the next load, not a stale copy.
    return HTMLResponse(playground_page(), headers={"cache-control": "no-cache"})
