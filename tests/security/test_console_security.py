"""The web console's cookies and CSRF protection, over every state-changing console route.

The routes come from the app's route table (every POST under ``/ui``), so a new form cannot skip the
check: each refuses a request without its CSRF token, with a wrong one, with one of another session,
and from another site even with the right token; and every cookie the console sets is ``HttpOnly``,
``SameSite=Strict``, scoped to ``/ui``, and ``Secure`` over https. (The console's own tests,
tests/serving/console/, check its pages one by one.)
"""

from __future__ import annotations

import re
from http.cookies import SimpleCookie

import pytest

from serving.console.session import CSRF_COOKIE, CSRF_FIELD, CSRF_HEADER, KEY_COOKIE
from tests.security.secured_app import App
from tests.security.test_auth_matrix import ACCESS, csrf_token

NONCE = "m" * 32


def console_posts(secured: App) -> list[str]:
    return sorted(route.path for route in secured.app.routes
                  if route.path.startswith("/ui") and "POST" in route.methods)


def test_every_console_post_is_csrf_protected(secured):
    paths = console_posts(secured)
    assert paths, "the console has no form routes?"
    key = secured.keys["admin"]  # a key that may do everything: only the token decides
    right = csrf_token(secured, NONCE, key, "admin")
    other_session = csrf_token(secured, "o" * 32, key, "admin")
    for path in paths:
        concrete = ACCESS[("POST", path)][1]
        for token, extra in [(None, {}), ("0" * 64, {}), (other_session, {}), (right, {"origin": "https://evil.test"}),
                             (right, {"sec-fetch-site": "cross-site"})]:
            response = post(secured, concrete.path, key, token, concrete.json, extra)
            assert response.status_code == 403, (path, token and token[:8], extra, response.status_code)
        accepted = post(secured, concrete.path, key, right, concrete.json, {})
        assert accepted.status_code not in (401, 403), (path, accepted.status_code, accepted.text[:300])


@pytest.mark.parametrize("header", ["x-api-key", "authorization"])
def test_a_console_run_acts_as_its_session_only(secured, header):
    """A key the request carries itself (as ``x-api-key`` or a bearer) is dropped: the session's decides."""
    key, admin = secured.keys["caller"], secured.keys["admin"]
    token = csrf_token(secured, NONCE, key, "caller")
    carried = {header: admin if header == "x-api-key" else f"Bearer {admin}"}
    refused = post(secured, "/ui/api/pipelines/reviews/run", key, token, {"input": "hi"}, carried)
    assert refused.status_code == 403, (refused.status_code, refused.text[:300])  # reviews: auditors only
    assert post(secured, "/ui/api/pipelines/chat/run", key, token, {"input": "hi"}, carried).status_code == 200


def post(secured: App, path: str, key: str, token: str | None, json_body: dict | None, extra: dict[str, str]):
    headers = {"cookie": f"{KEY_COOKIE}={key}; {CSRF_COOKIE}={NONCE}", **extra}
    form = {"api_key": key}
    if token is not None:
        if json_body is not None:
            headers[CSRF_HEADER] = token
        else:
            form[CSRF_FIELD] = token
    if json_body is not None:
        return secured.client.post(path, json=json_body, headers=headers, follow_redirects=False)
    return secured.client.post(path, data=form, headers=headers, follow_redirects=False)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_the_console_cookies_are_httponly_strict_and_scoped(secured, scheme):
    secured.client.cookies.clear()
    base = f"{scheme}://testserver.local"
    page = secured.client.get(f"{base}/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    login = secured.client.post(f"{base}/ui/login", data={"api_key": secured.keys["caller"], "csrf_token": token},
                                follow_redirects=False)
    logout_token = csrf_token(secured, login_nonce(login), secured.keys["caller"], "caller")
    logout = secured.client.post(f"{base}/ui/logout", data={"csrf_token": logout_token}, follow_redirects=False)
    secured.client.cookies.clear()
    assert login.status_code == 303 and logout.status_code == 303, (login.text[:300], logout.text[:300])
    cookies = [header for response in (page, login, logout) for header in response.headers.get_list("set-cookie")]
    assert {SimpleCookie(c).popitem()[0] for c in cookies} >= {KEY_COOKIE, CSRF_COOKIE}
    for header in cookies:
        flags = {part.strip().split("=")[0].lower(): part.strip() for part in header.split(";")[1:]}
        assert "httponly" in flags, header
        assert flags.get("samesite", "").lower() == "samesite=strict", header
        assert flags.get("path") == "Path=/ui", header
        assert ("secure" in flags) == (scheme == "https"), header


def login_nonce(login) -> str:
    for header in login.headers.get_list("set-cookie"):
        cookie = SimpleCookie(header)
        if CSRF_COOKIE in cookie:
            return cookie[CSRF_COOKIE].value
    raise AssertionError("the login set no CSRF cookie")
