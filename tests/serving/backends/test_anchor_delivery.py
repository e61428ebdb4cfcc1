"""Digests posted to an HTTP endpoint (a real one, on loopback): a failure is counted and retried on the
next round, and the files are written whatever the endpoint does."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
from prometheus_client import CollectorRegistry

from serving.backends.anchor_delivery import AnchorDelivery
from store.audit import Anchors, AuditStore
from store.engine import make_engine
from store.migrate import create_schema
from tests.store.audit.test_anchors import SIGNER
from tests.store.audit.test_store import make_record


class Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []
    failing = 1

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Receiver.failing:
            Receiver.failing -= 1
            self.send_response(503)
        else:
            Receiver.received.append(body)
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_digests_are_posted_and_a_failure_retried(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    create_schema(engine)
    store = AuditStore(engine, spool_path=tmp_path / "spool", checkpoint_key=SIGNER, checkpoint_every=2)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    delivery = AnchorDelivery(Anchors(engine, tmp_path / "digests", SIGNER), every_s=1,
                              url=f"http://127.0.0.1:{server.server_address[1]}/digests", registry=registry)

    async def rounds() -> list[int]:
        async with httpx.AsyncClient(trust_env=False) as client:
            for i in range(4):
                store.write(make_record(i))
            first = await delivery.deliver_once(client)  # two digests written; the first POST fails
            second = await delivery.deliver_once(client)  # nothing new written; both posted now
            return [first, second]

    try:
        assert asyncio.run(rounds()) == [2, 0]
    finally:
        server.shutdown()
        server.server_close()
    assert [d["seq"] for d in Receiver.received] == [2, 4]
    value = registry.get_sample_value
    assert value("inferline_audit_anchor_deliveries_total", {"target": "file", "result": "ok"}) == 2
    assert value("inferline_audit_anchor_deliveries_total", {"target": "http", "result": "failed"}) == 1
    assert value("inferline_audit_anchor_deliveries_total", {"target": "http", "result": "ok"}) == 2
    assert value("inferline_audit_anchored_seq") == 4
