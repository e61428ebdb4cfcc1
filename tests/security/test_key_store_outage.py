"""While the key store's database is away, keys verified shortly before keep working; others get 503.

(The end-to-end version, a real server under load with its PostgreSQL cut: tests/faults/test_database_outage.py.)
"""

from __future__ import annotations

import sqlalchemy as sa

from serving.http import auth
from tests.security.secured_app import App


def test_a_key_store_outage_keeps_recently_verified_keys_working(secured: App, monkeypatch):
    state = secured.app.state["inferline"]
    assert secured.client.get("/pipelines", headers=secured.auth("caller")).status_code == 200  # verified now

    def down(plaintext: str):
        raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))

    monkeypatch.setattr(state.services.auth.keys, "verify", down)
    assert secured.client.get("/pipelines", headers=secured.auth("caller")).status_code == 200
    run = secured.client.post("/pipelines/chat", json={"input": "hi"}, headers=secured.auth("caller"))
    assert run.status_code == 200
    unseen = secured.client.get("/pipelines", headers=secured.auth("auditor"))  # never verified before the outage
    assert unseen.status_code == 503 and unseen.headers["retry-after"] == "5"
    assert unseen.headers["content-type"].startswith("application/problem+json")
    assert secured.client.get("/metrics", headers=secured.auth("caller")).status_code == 403  # roles still apply
    monkeypatch.setattr(auth, "OUTAGE_GRACE_S", 0.0)  # past the grace period: refused too
    assert secured.client.get("/pipelines", headers=secured.auth("caller")).status_code == 503
