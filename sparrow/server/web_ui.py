"""The chat page at `/` (`sparrow serve --no-web-ui` leaves it out): static files shipped in the
package (sparrow/server/web/), read once at start; no build step, and nothing fetched from
anywhere but this server.

The page and its files answer without the API key (the page asks for it, and keeps it in the
tab's sessionStorage). A Content-Security-Policy lets the page load and connect to this origin
only, and run no inline script: model text is always written with textContent, and the policy
is a second wall behind that.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
PAGE = "/"
ASSETS = tuple(f"/ui/{name}" for name in FILES if name != "index.html")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read() -> dict[str, bytes]:
    root = resources.files("sparrow.server") / "web"
    return {name: (root / name).read_bytes() for name in FILES}


def add_routes(app: FastAPI) -> None:
    files = _read()
    headers = {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    def answer(name: str) -> Response:
        return Response(files[name], media_type=f"{FILES[name]}; charset=utf-8", headers=headers)

    @app.api_route(PAGE, methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return answer("index.html")

    @app.api_route("/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str):
        if name not in FILES or name == "index.html":
            return Response(status_code=404)
        return answer(name)
