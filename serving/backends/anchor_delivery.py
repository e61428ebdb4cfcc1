"""Delivering the audit log's digests outside the database, off every request's path.

Every ``audit.anchors.every_s`` seconds the server's seal (serving/backends/audit_seal.py) has a digest
file written for each new checkpoint (store/audit/anchors.py) and, with ``audit.anchors.url``, each digest
POSTed there as JSON. A failure is logged, counted and retried on the next round; a request never waits
for any of it. A digest POST that
keeps failing waits in memory (the newest 10,000) until the endpoint is back; the files are the record.

Metrics: ``inferline_audit_anchor_deliveries_total{target="file"|"http", result="ok"|"failed"}``,
``inferline_audit_anchored_seq`` (the newest digest's seq), and
``inferline_audit_anchor_mismatches_total``: the newest digest no longer matches the database (cut,
rolled back or rewritten since): the alarm to page someone on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from store.audit import Anchors

logger = logging.getLogger(__name__)


class AnchorDelivery:
    def __init__(self, anchors: Anchors, *, url: str | None, every_s: float,
                 registry: CollectorRegistry | None = None):
        self.anchors = anchors
        self.url = url
        self.every_s = every_s
        self._unposted: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.deliveries = Counter("inferline_audit_anchor_deliveries", "Audit digests delivered outside the "
                                  "database, by target (file, http) and result (ok, failed).", ["target", "result"],
                                  registry=registry)
        self.anchored = Gauge("inferline_audit_anchored_seq", "The seq of the newest audit digest delivered.",
                              registry=registry)
        self.mismatches = Counter("inferline_audit_anchor_mismatches", "Rounds in which the newest digest no longer "
                                  "matched the database (cut, rolled back or rewritten).", registry=registry)

    async def deliver_once(self, client: httpx.AsyncClient | None = None) -> int:
        """One round: the new digests written (and posted); how many were written."""
        try:
            delivery = await asyncio.to_thread(self.anchors.deliver)
        except Exception as exc:  # the folder or the database is away: the next round retries
            self.deliveries.labels("file", "failed").inc()
            logger.error("audit anchors: digests not written to %s (%s: %s); retrying in %g s", self.anchors.folder,
                         type(exc).__name__, exc, self.every_s)
            return 0
        if delivery.mismatch:
            self.mismatches.inc()
            logger.error("audit anchors: %s", delivery.mismatch)
        if delivery.written:
            self.deliveries.labels("file", "ok").inc(len(delivery.written))
            self.anchored.set(delivery.written[-1]["seq"])
            self._unposted.extend(delivery.written if self.url else ())
        if self.url and client is not None:
            await self._post(client)
        return len(delivery.written)

    async def _post(self, client: httpx.AsyncClient) -> None:
        while self._unposted:
            digest = self._unposted[0]
            try:
                response = await client.post(self.url, json=digest)  # type: ignore[arg-type]
                response.raise_for_status()
            except httpx.HTTPError as exc:
                self.deliveries.labels("http", "failed").inc()
                logger.warning("audit anchors: digest of seq %d not posted to %s (%s); retrying in %g s",
                               digest["seq"], self.url, type(exc).__name__, self.every_s)
                return
            self._unposted.popleft()
            self.deliveries.labels("http", "ok").inc()
