"""The API reference at `/docs`: /openapi.json listed by a small page shipped in the package
(sparrow/server/web/docs.*). FastAPI's own page pulled Swagger UI's JavaScript, unpinned, from a
CDN onto the API's origin with no Content-Security-Policy; the server is meant to work offline,
and a page on its origin should run no code from elsewhere. The page answers without the API key
(as /openapi.json does) under the same CSP as the chat page: this origin only, no inline script.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from .web_ui import CSP

FILES = {"docs.html": "text/html", "docs.js": "text/javascript", "docs.css": "text/css"}
PAGE = "/docs"
ASSETS = ("/docs/docs.js", "/docs/docs.css")


def add_routes(app: FastAPI) -> None:
    root = resources.files("sparrow.server") / "web"
    files = {name: (root / name).read_bytes() for name in FILES}
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    def answer(name: str) -> Response:
        return Response(files[name], media_type=f"{FILES[name]}; charset=utf-8", headers=headers)

    @app.api_route(PAGE, methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return answer("docs.html")

    @app.api_route("/docs/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str):
        if name not in FILES or name == "docs.html":
            return Response(status_code=404)
        return answer(name)
