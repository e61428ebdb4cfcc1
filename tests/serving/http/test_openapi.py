"""``/schema``: the OpenAPI document and its viewer, served whole by the app (nothing from a CDN)."""

from __future__ import annotations

import re

import pytest

_URL = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


@pytest.mark.parametrize("path", ["/schema", "/schema/swagger"])
def test_the_viewer_loads_its_files_from_this_server_only(auth_client, path):
    # auth_client: auth on, and no key sent: /schema stays public.
    page = auth_client.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = _URL.findall(page.text)
    assert "/schema/assets/swagger-ui-bundle.js" in urls and "/schema/assets/swagger-ui.css" in urls
    assert all(url.startswith("/schema/assets/") for url in urls), urls  # no CDN, no other host
    for url in urls:
        asset = auth_client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 0, url
    assert auth_client.get("/schema/assets/swagger-ui-bundle.js").headers["content-type"].startswith(
        "text/javascript")
    assert auth_client.get("/schema/assets/swagger-ui.css").headers["content-type"].startswith("text/css")


def test_an_unknown_viewer_file_is_a_404_problem(client):
    response = client.get("/schema/assets/swagger-editor.js")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert "swagger-ui-bundle.js" in response.json()["detail"]

