"""Stored responses of the Responses API (``POST /v1/responses`` with ``store: true``).

    responses = ResponseStore(engine)
    responses.save(StoredResponse(id="resp_...", owner="k1", pipeline="chat", conversation=[...],
                                  body={...}, created_at=now, expires_at=now + timedelta(days=30)))
    responses.get("resp_...", owner="k1")      # None: missing, expired, or another owner's
    responses.delete("resp_...", owner="k1")   # True if it was there
    responses.prune()                          # drop the expired ones; returns how many

A request an ``agent`` step paused for the client's approval of tool calls keeps its state here too, until
it is resumed (once) or expires::

    responses.pause(PausedRequest(id=request_id, owner="k1", pipeline="orders", state={...},
                                  created_at=now, expires_at=now + timedelta(days=30)))
    responses.resume(request_id, owner="k1")   # the state, deleted as it is read; None: missing or taken

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


class PausedRow(Base):
    """A request paused for approval: the state its ``agent`` step resumes from."""

    __tablename__ = "paused_requests"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    """The paused request's id."""
    owner: Mapped[str | None] = mapped_column(sa.String(64), index=True)
    """The key id that made it; null when auth is off."""
    pipeline: Mapped[str] = mapped_column(sa.String(200))
    state: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """The agent step's loop (turns, round, proposed calls): it holds tool results, so only its owner reads it."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)


@dataclass(frozen=True, slots=True)
class PausedRequest:
    id: str
    owner: str | None
    pipeline: str
    state: dict[str, Any]
    created_at: datetime
    expires_at: datetime | None


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
        """Delete every response and paused request expired at *now*; how many."""
        with Session(self.engine) as session, session.begin():
            pruned = 0
            for row in (ResponseRow, PausedRow):
                result = session.execute(sa.delete(row).where(row.expires_at <= (now or utcnow())))
                pruned += result.rowcount or 0
            return pruned

    def pause(self, paused: PausedRequest) -> None:
        with Session(self.engine) as session, session.begin():
            session.add(PausedRow(id=paused.id, owner=paused.owner, pipeline=paused.pipeline, state=paused.state,
                                  created_at=paused.created_at, expires_at=paused.expires_at))

    def resume(self, request_id: str, owner: str | None, now: datetime | None = None) -> PausedRequest | None:
        """The paused request, deleted as it is read (a request resumes once, so an approval never runs a call
        twice); None if it is missing, expired, already resumed, or not *owner*'s (None reads any)."""
        query = sa.select(PausedRow).where(PausedRow.id == request_id, sa.or_(
            PausedRow.expires_at.is_(None), PausedRow.expires_at > (now or utcnow())))
        if owner is not None:
            query = query.where(PausedRow.owner == owner)
        with Session(self.engine) as session, session.begin():
            row = session.scalar(query.with_for_update())
            if row is None:
                return None
            taken = session.execute(sa.delete(PausedRow).where(PausedRow.id == row.id))
            if not taken.rowcount:  # another resume took it between the read and the delete
                return None
            return PausedRequest(row.id, row.owner, row.pipeline, dict(row.state), row.created_at, row.expires_at)

    @staticmethod
    def _visible(response_id: str, owner: str | None, now: datetime) -> sa.Select[tuple[ResponseRow]]:
        query = sa.select(ResponseRow).where(
            ResponseRow.id == response_id, sa.or_(ResponseRow.expires_at.is_(None), ResponseRow.expires_at > now))
        return query if owner is None else query.where(ResponseRow.owner == owner)
