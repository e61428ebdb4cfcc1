"""Who is calling: API keys checked against the hashed keys in the SQL store.

A key comes as ``Authorization: Bearer <key>`` (OpenAI's clients, ours) or as ``x-api-key: <key>``
(Anthropic's clients), on every route of the API; the bearer header wins when both are sent.

Roles: ``caller`` (calls pipelines its ``access.roles`` allow), ``auditor``
(reads audits and metrics), ``admin`` (everything). With auth off (only
allowed on a loopback address) every request is anonymous and allowed.

While the key store's database is unreachable, a key that verified within the
last ``OUTAGE_GRACE_S`` keeps working (the audit log spools meanwhile), so a
database outage does not take the API down; unknown keys get 503 until the
database is back. Only a SHA-256 of each key is remembered, never the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterable

from litestar import Request
from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import Principal
from serving.http.problems import Problem
from store.keys import KeyInfo, KeyStore

#: How long after its last successful verification a key is still accepted while the key store is down.
OUTAGE_GRACE_S = 600.0
#: At most this many verified keys are remembered for outages (the oldest are forgotten first).
MAX_REMEMBERED_KEYS = 10_000


class Authenticator:
    def __init__(self, keys: KeyStore | None, enabled: bool):
        self.keys = keys
        self.enabled = enabled
        self._verified: dict[str, tuple[KeyInfo, float]] = {}  # sha256(key) -> (info, when verified)

    async def principal(self, request: Request) -> Principal | None:
        """The caller, or a 401 problem; None when auth is off."""
        if not self.enabled:
            return None
        headers = request.headers
        return await self.verify(api_key(headers.get("authorization", ""), headers.get("x-api-key", "")))

    async def verify(self, token: str | None) -> Principal:
        """The key *token*'s holder, or a 401 (none, or a bad key) or 503 (key store away) problem."""
        if token is None:
            raise Problem(401, "Unauthorized",
                          "send an API key as 'Authorization: Bearer <key>' or as 'x-api-key: <key>'",
                          "unauthorized", {"WWW-Authenticate": "Bearer"})
        if self.keys is None:
            raise Problem(503, "Backend unavailable", "the key store is not open", "backend_error")
        try:
            info = await asyncio.to_thread(self.keys.verify, token)
        except SQLAlchemyError as exc:
            info = self._remembered(token)
            if info is None:
                raise Problem(503, "Backend unavailable", "the key store cannot be reached; retry shortly",
                              "backend_error", {"Retry-After": "5"}) from exc
        else:
            self._remember(token, info)
        if info is None:
            raise Problem(401, "Unauthorized", "unknown or revoked API key", "unauthorized",
                          {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return Principal(key_id=info.id, role=info.role, tenant=info.tenant)

    def _remember(self, token: str, info: KeyInfo | None) -> None:
        digest = hashlib.sha256(token.encode()).hexdigest()
        self._verified.pop(digest, None)  # re-inserted last: the dict's order is the age order
        if info is None:
            return  # unknown or revoked now: forget it
        self._verified[digest] = (info, time.monotonic())
        while len(self._verified) > MAX_REMEMBERED_KEYS:
            del self._verified[next(iter(self._verified))]

    def _remembered(self, token: str) -> KeyInfo | None:
        entry = self._verified.get(hashlib.sha256(token.encode()).hexdigest())
        if entry is None or time.monotonic() - entry[1] > OUTAGE_GRACE_S:
            return None
        return entry[0]

    def require(self, principal: Principal | None, roles: Iterable[str], what: str) -> None:
        """Raise 403 unless *principal* has one of *roles* (admins always do)."""
        if not self.enabled or principal is None:
            return
        allowed = set(roles)
        if principal.role != "admin" and principal.role not in allowed:
            raise Problem(403, "Forbidden", f"role {principal.role!r} may not {what}; "
                                            f"allowed: {', '.join(sorted(allowed | {'admin'}))}", "forbidden")

    async def authorize(self, request: Request, roles: Iterable[str], what: str) -> Principal | None:
        principal = await self.principal(request)
        self.require(principal, roles, what)
        return principal


def api_key(authorization: str, x_api_key: str) -> str | None:
    """The key in an ``Authorization: Bearer`` header, else in an ``x-api-key`` header; None without one."""
    return bearer_token(authorization) if authorization else (x_api_key.strip() or None)


def bearer_token(header: str) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` header; None when there is none."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
