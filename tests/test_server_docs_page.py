"""/docs (issue 69, transport): sparrow's own page listing /openapi.json, shipped in the package,
under a Content-Security-Policy, with nothing fetched from anywhere but this server (FastAPI's
page pulled Swagger UI's JavaScript from a CDN onto the API's origin)."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from sparrow.server import docs_page
from sparrow.server.app import ServerState, create_app


def test_docs_page_is_self_contained_and_public():
    client = TestClient(create_app(ServerState(api_key="k3y")))
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    texts = [page.text]
    for asset in docs_page.ASSETS:
        r = client.get(asset)  # public, as the page and /openapi.json are
        assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff", asset
        texts.append(r.text)
    assert all(not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", t) for t in texts)  # no other origin
    assert "<script>" not in page.text and 'src="/docs/docs.js"' in page.text  # no inline script
    assert "innerHTML" not in texts[1] and "/openapi.json" in texts[1]
    assert client.get("/docs/secret", headers={"Authorization": "Bearer k3y"}).status_code == 404
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/v1/models").status_code == 401  # the rest still needs the key
