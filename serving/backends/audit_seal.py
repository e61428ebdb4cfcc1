"""A serving process's seal on the audit log's newest records: a signed checkpoint at the chain head every
few seconds, and its digest delivered outside the database, off every request's path.

    seal = audit_seal(server, root, store, signer, registry)   # None without a key to sign with
    await seal.start()       # a round now (what the journals of stopped processes held is covered), then every few s
    await seal.aclose()      # after the last record is chained: one last round, then stop

Checkpoints at multiples of ``audit.checkpoint_every`` come only from a writer that holds the key, so the
records since the last multiple, and any a process without the key appended (``inferline run``,
``eval``, ``audit erase``), would have only the bare chain, which an insider cuts without a trace. Every
``audit.checkpoint_every_s`` seconds the seal signs the head as it is unless a checkpoint signs it already
(``AuditWriter.cover_head``: one read when nothing is new, no database work on the request path), and every
``anchors.every_s`` seconds it delivers the new checkpoints as digests (serving/backends/anchor_delivery.py).
A record is thus outside the database's reach within ``checkpoint_every_s + anchors.every_s`` while the
server runs. Processes sharing a database each sign the head they see; its row lock leaves one checkpoint per head.

Metric: ``inferline_audit_checkpointed_seq``, the seq of the newest head this process signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Gauge

from serving.backends.anchor_delivery import AnchorDelivery
from serving.backends.audit_keys import DEFAULT_ANCHOR_EVERY_S, anchor_folder
from serving.config.server import ServerSpec
from store.audit import Anchors, AuditStore, Signer

logger = logging.getLogger(__name__)
#: At shutdown, how long the last round may take before it is abandoned.
LAST_ROUND_TIMEOUT_S = 10.0


class AuditSeal:
    """Signs the chain head every *every_s* seconds (when records came since) and delivers digests with *delivery*."""

    def __init__(self, store: AuditStore, *, every_s: float, delivery: AnchorDelivery | None = None,
                 registry: CollectorRegistry | None = None):
        self.store = store
        self.every_s = every_s
        self.delivery = delivery
        self.checkpointed = Gauge("inferline_audit_checkpointed_seq", "The seq of the newest audit chain head "
                                  "this process signed a checkpoint at.", registry=registry)
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """A round now, then one every few seconds in the background. Call it once the journals that stopped
        processes left are chained, so that those records are covered before the first request."""
        await self.cover_once()
        if self.delivery is not None:
            await self.delivery.deliver_once()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def cover_once(self) -> int | None:
        """Sign the chain head unless a checkpoint signs it already; the seq signed, or None. A failure (the
        database is away) is logged, and the next round tries again."""
        try:
            seq = await asyncio.to_thread(self.store.cover_head)
        except Exception as exc:
            logger.error("audit: the chain head was not signed (%s: %s); retrying in %g s", type(exc).__name__, exc,
                         self.every_s)
            return None
        if seq is not None:
            self.checkpointed.set(seq)
        return seq

    async def aclose(self) -> None:
        """One last round, then stop: call it after the sink has chained its last record, so that a stopped
        server leaves its whole log covered and delivered."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        done, _ = await asyncio.wait({task}, timeout=LAST_ROUND_TIMEOUT_S)
        if not done:
            logger.error("audit: the last checkpoint and delivery took over %g s; abandoned", LAST_ROUND_TIMEOUT_S)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        # Stopping is an event, not a cancellation: a round under way (in a thread) finishes before the last one.
        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            client = None
            if self.delivery is not None and self.delivery.url:
                client = await stack.enter_async_context(httpx.AsyncClient(timeout=10, trust_env=False))
            cover_at = loop.time() + self.every_s  # start() did the first round
            deliver_at = loop.time() + (self.delivery.every_s if self.delivery is not None else 0.0)
            while True:
                stopping = self._stopping.is_set()
                if stopping or loop.time() >= cover_at:
                    await self.cover_once()
                    cover_at = loop.time() + self.every_s
                if self.delivery is not None and (stopping or loop.time() >= deliver_at):
                    await self.delivery.deliver_once(client)  # the checkpoint just signed, at once
                    deliver_at = loop.time() + self.delivery.every_s
                if stopping:
                    return
                wake = min(cover_at, deliver_at) if self.delivery is not None else cover_at
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), max(0.0, wake - loop.time()))


def audit_seal(server: ServerSpec, root: Path, store: AuditStore, signer: Signer | None,
               registry: CollectorRegistry | None = None) -> AuditSeal | None:
    """The seal of a serving process of *server* whose store signs with *signer*: checkpoints every
    ``audit.checkpoint_every_s``, digests to ``audit.anchors`` (or the server's own folder beside its
    database); None without a signer."""
    if signer is None:
        return None
    delivery = None
    folder = anchor_folder(server, root, store.engine.url)
    if folder is not None:
        spec = server.audit.anchors
        delivery = AnchorDelivery(Anchors(store.engine, folder, signer), url=spec.url if spec else None,
                                  every_s=spec.every_s if spec else DEFAULT_ANCHOR_EVERY_S, registry=registry)
    return AuditSeal(store, every_s=server.audit.checkpoint_every_s, delivery=delivery, registry=registry)
