"""An in-process app with auth on, over fake engines, and one API key per role.

The app is the real ``create_server`` (every route, the console included) on a SQLite database in a
temporary folder; only the model is a fake (tests/fakes.py), so hundreds of requests take seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import ROLES, KeyStore
from tests.fakes import FakeEngine, FakeEngines
from tests.security.secured_app import ANSWER, App, make_workspace


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[App]:
    """One app for the module (its requests do not depend on each other)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUTH__ENABLED"):
            patch.delenv(name, raising=False)
        root = tmp_path_factory.mktemp("secured")
        workspace = open_workspace(str(make_workspace(root)))
        app = create_server(workspace, engines=FakeEngines(smol=FakeEngine(ANSWER)))
        db_url = f"sqlite:///{root / 'server.db'}"
        with TestClient(app, raise_server_exceptions=False) as client:
            store = KeyStore(make_engine(db_url))
            keys = {role: store.create(f"security-{role}", role)[1] for role in ROLES}
            yield App(app, client, db_url, keys)
