"""Who is using the console, and the CSRF token of their forms.

Login takes an API key; the console keeps it in a cookie the page's scripts
cannot read (``HttpOnly``), that no other site's page can make the browser
send (``SameSite=Strict``), only sent back to ``/ui`` and, over https, only
over https (``Secure``). Every request resolves the cookie's key against the
key store, exactly as the API resolves a bearer key, so a revoked key stops
working in the console at once.

CSRF: a signed double-submit token. A second cookie holds a random nonce; the
token in every form (and the ``X-CSRF-Token`` header of the playground's
fetch) is an HMAC, under a per-process secret, of that nonce and of the
session's key. A state-changing request passes only if its token matches the
one its cookies give, and, where the browser says where it comes from
(``Origin``, ``Sec-Fetch-Site``), only from this very origin. The nonce is
renewed at login and logout, so a token never outlives its session.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from litestar import Request
from litestar.datastructures import Cookie
from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import Principal
from serving.http.auth import Authenticator
from serving.http.problems import Problem

KEY_COOKIE = "inferline_console_key"
CSRF_COOKIE = "inferline_console_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
COOKIE_PATH = "/ui"
#: A console session lasts a working day; the key itself may live much longer.
SESSION_MAX_AGE_S = 12 * 3600


class LoginRequired(Exception):
    """Auth is on and the console has no (valid) key for this browser: send it to the login page."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class Session:
    """One console request's view of its user: the principal (None with auth off) and the CSRF nonce."""

    auth_enabled: bool
    principal: Principal | None
    nonce: str
    key: str = ""
    #: The nonce was made for this request: the response must set its cookie.
    is_new_nonce: bool = False

    @property
    def role(self) -> str:
        """The user's role; with auth off everyone may do everything, as in the API."""
        if not self.auth_enabled:
            return "admin"
        return self.principal.role if self.principal else ""

    def can(self, *roles: str) -> bool:
        """Whether the user holds one of *roles* (admins and auth-off sessions always do)."""
        return self.role == "admin" or self.role in roles


class SessionManager:
    """Reads sessions from cookies, checks CSRF tokens, and makes the cookies."""

    def __init__(self, auth: Callable[[], Authenticator], secret: bytes | None = None):
        #: The app's authenticator, once it has started (before, a 503).
        self._auth = auth
        # Per process: a restart only invalidates the forms already on screen (reloading fixes them);
        # the login itself is the key cookie and survives.
        self._secret = secret or secrets.token_bytes(32)

    @property
    def auth(self) -> Authenticator:
        return self._auth()

    async def session(self, request: Request, *, optional: bool = False) -> Session:
        """The session of *request*; raises LoginRequired when auth is on and no valid key is held
        (*optional*: a session without a principal instead, for the login and logout forms)."""
        nonce = request.cookies.get(CSRF_COOKIE, "")
        is_new = not _looks_like_nonce(nonce)
        if is_new:
            nonce = secrets.token_urlsafe(24)
        if not self.auth.enabled:
            return Session(False, None, nonce, is_new_nonce=is_new)
        key = request.cookies.get(KEY_COOKIE, "")
        principal = await self.verify(key) if key else None
        if principal is None:
            if optional:
                return Session(True, None, nonce, is_new_nonce=is_new)
            raise LoginRequired("your key is no longer valid; sign in again" if key else "")
        return Session(True, principal, nonce, key=key, is_new_nonce=is_new)

    async def verify(self, key: str) -> Principal | None:
        """The principal of API key *key*, or None for an unknown or revoked one."""
        if self.auth.keys is None:
            raise Problem(503, "Backend unavailable", "the key store is not open", "backend_error")
        try:
            info = await asyncio.to_thread(self.auth.keys.verify, key.strip())
        except SQLAlchemyError as exc:
            raise Problem(503, "Backend unavailable", "the key store cannot be reached; retry shortly",
                          "backend_error", {"Retry-After": "5"}) from exc
        return None if info is None else Principal(key_id=info.id, role=info.role, tenant=info.tenant)

    def require(self, session: Session, roles: tuple[str, ...], what: str) -> None:
        """403 unless the session's role is one of *roles* (the API's own rule and wording)."""
        self.auth.require(session.principal, roles, what)

    # --- CSRF ------------------------------------------------------------------------

    def token(self, session: Session) -> str:
        """The CSRF token the session's forms carry."""
        return self._sign(session.nonce, session.key)

    def check_csrf(self, request: Request, session: Session, submitted: str | None) -> None:
        """Raise 403 unless *submitted* is this session's token and the request comes from this origin."""
        if not _same_origin(request):
            raise Problem(403, "Forbidden", "cross-site request refused", "csrf_failed")
        if session.is_new_nonce or not submitted or not hmac.compare_digest(
                submitted.encode(), self.token(session).encode()):
            raise Problem(403, "Forbidden", "the form's security token is missing, wrong or expired: "
                                            "reload the page and try again", "csrf_failed")

    def _sign(self, nonce: str, key: str) -> str:
        # The key enters as its hash: the token may sit in a page, the key must not.
        binding = hashlib.sha256(key.encode()).hexdigest()
        return hmac.new(self._secret, f"{nonce}|{binding}".encode(), hashlib.sha256).hexdigest()

    # --- cookies ---------------------------------------------------------------------

    def cookies(self, request: Request, session: Session) -> list[Cookie]:
        """The cookies a page response sets: the CSRF nonce when it is new."""
        return [self._cookie(request, CSRF_COOKIE, session.nonce)] if session.is_new_nonce else []

    def login_cookies(self, request: Request, key: str) -> list[Cookie]:
        """The key, and a fresh nonce: tokens issued before the login stop working."""
        return [self._cookie(request, KEY_COOKIE, key.strip()),
                self._cookie(request, CSRF_COOKIE, secrets.token_urlsafe(24))]

    def logout_cookies(self, request: Request) -> list[Cookie]:
        """The key cookie expired, and a fresh nonce."""
        return [self._cookie(request, KEY_COOKIE, "", max_age=0),
                self._cookie(request, CSRF_COOKIE, secrets.token_urlsafe(24))]

    @staticmethod
    def _cookie(request: Request, name: str, value: str, max_age: int = SESSION_MAX_AGE_S) -> Cookie:
        return Cookie(key=name, value=value, path=COOKIE_PATH, max_age=max_age, httponly=True,
                      samesite="strict", secure=request.url.scheme == "https")


def safe_next(target: str | None) -> str:
    """Where to go after login: a console path only, never another site (``//evil``, ``https://…``)."""
    if not target or not (target == "/ui" or target.startswith(("/ui/", "/ui?"))) or "\\" in target:
        return "/ui"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/ui"
    return target


def _looks_like_nonce(value: str) -> bool:
    return 16 <= len(value) <= 64 and all(c.isalnum() or c in "-_" for c in value)


def _same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site. Requests without these headers
    (curl, old browsers) are judged by the token alone."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    parts = urlsplit(origin)
    return bool(parts.netloc) and parts.netloc == host
