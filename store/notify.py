"""Change notices between the server processes on one database: PostgreSQL ``LISTEN``/``NOTIFY``.

    announce(engine)                    # after a deploy, keep, activation, rollback, retire, split or shadow
    await listen(engine, on_notice)     # until cancelled: on_notice() for each notice, reconnecting

A notice says only "look again": each process then reads the pipelines folder and the traffic tables as
its polling would, at once rather than within ``reload.poll_s``. Notices are scoped to the database
schema (the payload is ``current_schema()``), so deployments sharing a PostgreSQL database in separate
schemas do not wake each other. On any other database nothing is sent and :func:`listen` returns at
once: the processes poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
import sqlalchemy as sa

logger = logging.getLogger(__name__)

CHANNEL = "inferline_pipelines"


def supported(engine: sa.Engine) -> bool:
    """Whether *engine*'s database carries notices (PostgreSQL)."""
    return engine.dialect.name == "postgresql"


def announce(engine: sa.Engine) -> None:
    """Tell every process listening on *engine*'s database and schema to look again (nothing elsewhere)."""
    if supported(engine):
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:channel, current_schema())"), {"channel": CHANNEL})


async def listen(engine: sa.Engine, on_notice: Callable[[], None], *, retry_s: float = 2.0) -> None:
    """Call *on_notice* for each notice on *engine*'s database and schema, until cancelled. A lost
    connection is opened again every *retry_s* seconds, with one *on_notice* call once it is back (a
    notice sent meanwhile is lost, not what it announced)."""
    if not supported(engine):
        return
    conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    first = True
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                schema = (await (await conn.execute("SELECT current_schema()")).fetchone() or ("",))[0]
                await conn.execute(f"LISTEN {CHANNEL}")
                if not first:
                    logger.info("pipelines: listening for change notices again")
                    on_notice()
                async for notice in conn.notifies():
                    if notice.payload == schema:
                        on_notice()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("pipelines: change notices from the database lost (%s: %s); polling until they "
                           "are back", type(exc).__name__, exc)
        first = False
        await asyncio.sleep(retry_s)
