"""The web console: `GET /` serves its page, `/console/` its static files (HTML, CSS, JS modules; no build step).

The page calls the public endpoints itself with the key its user types, so these routes need no key (http_server)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

CONSOLE_DIR = Path(__file__).resolve().parents[1] / "console"  # frontend/console/: the package data
STATIC_PREFIX = "/console/"
# The page and its files, served without a key: nothing here reads server state.
OPEN_PATHS = frozenset({"/", "/console"})

routes = web.RouteTableDef()


def is_console_path(path: str) -> bool:
    """Paths the router can only match to the console's files (it resolves `..` before matching)."""
    return path in OPEN_PATHS or path.startswith(STATIC_PREFIX)


@routes.get("/")
async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(CONSOLE_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@routes.get("/console")
@routes.get(STATIC_PREFIX)
async def console_root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/")


routes.static(STATIC_PREFIX, CONSOLE_DIR, append_version=False)
