"""Who is calling: bearer API keys checked against the hashed keys in the SQL store.

Roles: ``caller`` (calls pipelines its ``access.roles`` allow), ``auditor``
(reads audits and metrics), ``admin`` (everything). With auth off (only
allowed on a loopback address) every request is anonymous and allowed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from litestar import Request
from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import Principal
from serving.problems import Problem
from store.keys import KeyStore


class Authenticator:
    def __init__(self, keys: KeyStore | None, enabled: bool):
        self.keys = keys
        self.enabled = enabled

    async def principal(self, request: Request) -> Principal | None:
        """The caller, or a 401 problem; None when auth is off."""
        if not self.enabled:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Problem(401, "Unauthorized", "send an API key as 'Authorization: Bearer <key>'",
                          "unauthorized", {"WWW-Authenticate": "Bearer"})
        if self.keys is None:
            raise Problem(503, "Backend unavailable", "the key store is not open", "backend_error")
        try:
            info = await asyncio.to_thread(self.keys.verify, token.strip())
        except SQLAlchemyError as exc:
            raise Problem(503, "Backend unavailable", "the key store cannot be reached; retry shortly",
                          "backend_error", {"Retry-After": "5"}) from exc
        if info is None:
            raise Problem(401, "Unauthorized", "unknown or revoked API key", "unauthorized",
                          {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return Principal(key_id=info.id, role=info.role, tenant=info.name)

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
