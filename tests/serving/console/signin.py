"""Helpers for the console's tests: reading CSRF tokens out of pages, signing in."""

from __future__ import annotations

import re

from litestar.testing import TestClient

_META = re.compile(r'<meta name="csrf-token" content="([0-9a-f]*)">')


def csrf_of(html: str) -> str:
    """The CSRF token a console page carries (its meta tag; forms carry the same)."""
    found = _META.search(html)
    assert found is not None, "no csrf-token meta tag in the page"
    return found.group(1)


def sign_in(client: TestClient, key: str) -> None:
    """Sign *client* in to the console with *key*, as the login form does."""
    token = csrf_of(client.get("/ui/login").text)
    response = client.post("/ui/login", data={"api_key": key, "csrf_token": token, "next": "/ui"},
                           follow_redirects=False)
    assert response.status_code == 303, response.text
