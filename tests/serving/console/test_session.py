"""The console's session logic on its own: CSRF tokens, origins, cookies, redirects."""

from __future__ import annotations

import pytest
from litestar import Request

from pipeline.context import Principal
from serving.console.session import CSRF_COOKIE, KEY_COOKIE, LoginRequired, Session, SessionManager, safe_next
from serving.http.auth import Authenticator
from serving.http.problems import Problem


def request(scheme: str = "http", headers: dict[str, str] | None = None, cookies: str = "") -> Request:
    raw = [(k.encode(), v.encode()) for k, v in {"host": "console.test", **(headers or {})}.items()]
    if cookies:
        raw.append((b"cookie", cookies.encode()))
    scope = {"type": "http", "method": "POST", "path": "/ui/login", "raw_path": b"/ui/login", "query_string": b"",
             "headers": raw, "scheme": scheme, "server": ("console.test", 443 if scheme == "https" else 80),
             "root_path": "", "client": ("127.0.0.1", 1), "app": None, "state": {}}
    return Request(scope)  # type: ignore[arg-type]


def manager(enabled: bool = True) -> SessionManager:
    return SessionManager(lambda: Authenticator(None, enabled), secret=b"s" * 32)


def test_the_token_is_bound_to_the_nonce_the_key_and_the_secret():
    sessions = manager()
    session = Session(True, Principal("k", "caller"), nonce="n" * 24, key="il_key")
    token = sessions.token(session)
    assert len(token) == 64 and token == sessions.token(session)
    assert token != sessions.token(Session(True, None, nonce="m" * 24, key="il_key"))
    assert token != sessions.token(Session(True, None, nonce="n" * 24, key="il_other"))
    assert token != SessionManager(Authenticator(None, True), secret=b"t" * 32).token(session)
    assert "il_key" not in token


def test_check_csrf():
    sessions = manager()
    session = Session(True, None, nonce="n" * 24)
    good = sessions.token(session)
    sessions.check_csrf(request(), session, good)
    sessions.check_csrf(request(headers={"origin": "http://console.test", "sec-fetch-site": "same-origin"}),
                        session, good)
    for submitted in (None, "", good[:-1] + "0", good.upper()):
        with pytest.raises(Problem) as info:
            sessions.check_csrf(request(), session, submitted)
        assert info.value.status == 403 and info.value.kind == "csrf_failed"
    for headers in ({"origin": "http://evil.test"}, {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                    {"sec-fetch-site": "same-site"}):
        with pytest.raises(Problem):
            sessions.check_csrf(request(headers=headers), session, good)
    # a nonce made for this very request (the browser sent none) can never match a submitted token
    with pytest.raises(Problem):
        sessions.check_csrf(request(), Session(True, None, nonce="n" * 24, is_new_nonce=True), good)


async def test_sessions_from_cookies():
    off = await manager(enabled=False).session(request())
    assert off.principal is None and off.is_new_nonce and off.can("auditor")  # auth off: everything
    with pytest.raises(LoginRequired):
        await manager().session(request(cookies=f"{CSRF_COOKIE}={'n' * 24}"))
    optional = await manager().session(request(cookies=f"{CSRF_COOKIE}={'n' * 24}"), optional=True)
    assert optional.principal is None and optional.nonce == "n" * 24 and not optional.is_new_nonce
    assert not optional.can("caller")
    odd = await manager(enabled=False).session(request(cookies=f"{CSRF_COOKIE}=<script>"))
    assert odd.is_new_nonce and odd.nonce != "<script>"


@pytest.mark.parametrize(("scheme", "secure"), [("http", False), ("https", True)])
def test_cookie_flags(scheme, secure):
    cookies = {c.key: c for c in manager().login_cookies(request(scheme), "il_key")}
    key = cookies[KEY_COOKIE]
    assert key.value == "il_key" and key.httponly and key.samesite == "strict" and key.path == "/ui"
    assert bool(key.secure) is secure and cookies[CSRF_COOKIE].httponly
    gone = {c.key: c for c in manager().logout_cookies(request(scheme))}
    assert gone[KEY_COOKIE].max_age == 0 and gone[KEY_COOKIE].value == ""


@pytest.mark.parametrize(("target", "expected"), [
    (None, "/ui"), ("", "/ui"), ("/ui/audit?status=ok", "/ui/audit?status=ok"), ("/pipelines", "/ui"),
    ("//evil.test/ui", "/ui"), ("https://evil.test/ui", "/ui"), ("/ui\\evil", "/ui"), ("/uix", "/ui"),
    ("/ui/traces", "/ui/traces"),
])
def test_safe_next(target, expected):
    assert safe_next(target) == expected
