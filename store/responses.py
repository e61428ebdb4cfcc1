"""Stored responses of the Responses API (``POST /v1/responses`` with ``store: true``).

    responses = ResponseStore(engine)
    responses.save(StoredResponse(id="resp_...", owner="k1", pipeline="chat", conversation=[...],
                                  body={...}, created_at=now, expires_at=now + timedelta(days=30)))
    responses.get("resp_...", owner="k1")      # None: missing, expired, or another owner's
    responses.delete("resp_...", owner="k1")   # True if it was there
    responses.prune()                          # drop the expired ones; returns how many

``conversation`` is the whole exchange up to and including the response: the conversation it continued
(its ``previous_response_id``'s, recursively), its input items and its output items, so that continuing
it reads one row, and deleting an earlier response does not cut a later one's history. ``owner`` is the
API key that made it; None (auth off) matches any reader, and a reader of None reads any.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, Session, mapped_column

from store.db import Base, UTCDateTime, utcnow


class ResponseRow(Base):
    """One stored response: what the client gets back, and the conversation it ends."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    """``resp_`` and the request id."""
    owner: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    """The key id that made it; null when auth is off."""
    pipeline: Mapped[str] = mapped_column(sa.String(200))
    conversation: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    """Every item of the exchange, oldest first: earlier turns, this input, this output."""
    body: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """The response object, as ``GET /v1/responses/{id}`` returns it."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)
    """When it stops being returned and may be pruned; null: kept until deleted."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    owner: str | None
    pipeline: str
    conversation: list[dict[str, Any]]
    body: dict[str, Any]
    created_at: datetime
    expires_at: datetime | None

    @classmethod
    def of(cls, row: ResponseRow) -> StoredResponse:
        return cls(row.id, row.owner, row.pipeline, list(row.conversation), dict(row.body), row.created_at,
                   row.expires_at)


class ResponseStore:
    """The ``responses`` table."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def save(self, response: StoredResponse) -> None:
        with Session(self.engine) as session, session.begin():
            session.add(ResponseRow(id=response.id, owner=response.owner, pipeline=response.pipeline,
                                    conversation=response.conversation, body=response.body,
                                    created_at=response.created_at, expires_at=response.expires_at))

    def get(self, response_id: str, owner: str | None, now: datetime | None = None) -> StoredResponse | None:
        """The response, unless it is missing, expired at *now*, or not *owner*'s (None reads any)."""
        with Session(self.engine) as session:
            row = session.scalar(self._visible(response_id, owner, now or utcnow()))
            return None if row is None else StoredResponse.of(row)

    def delete(self, response_id: str, owner: str | None, now: datetime | None = None) -> bool:
        """Delete the response if :meth:`get` would return it; whether it did."""
        with Session(self.engine) as session, session.begin():
            row = session.scalar(self._visible(response_id, owner, now or utcnow()))
            if row is None:
                return False
            session.delete(row)
            return True

    def prune(self, now: datetime | None = None) -> int:
        """Delete every response expired at *now*; how many."""
        with Session(self.engine) as session, session.begin():
            result = session.execute(sa.delete(ResponseRow).where(ResponseRow.expires_at <= (now or utcnow())))
            return result.rowcount or 0

    @staticmethod
    def _visible(response_id: str, owner: str | None, now: datetime) -> sa.Select[tuple[ResponseRow]]:
        query = sa.select(ResponseRow).where(
            ResponseRow.id == response_id, sa.or_(ResponseRow.expires_at.is_(None), ResponseRow.expires_at > now))
        return query if owner is None else query.where(ResponseRow.owner == owner)
