"""An in-process app with auth on, over fake engines, and one API key per role.

The app is the real ``create_app`` (every route, the console included) on a SQLite database in a
temporary folder; only the model is a fake (tests/fakes.py), so hundreds of requests take seconds.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from serving.app import create_app
from serving.wiring import open_workspace
from store.db import make_engine
from store.keys import ROLES, KeyStore
from tests.fakes import FakeEngine, FakeEngines

SERVER = """
models:
  smol:
    source: models/smollm2-135m-instruct
    context_window: 512
    price: {{input_per_1k: 1.0, output_per_1k: 2.0}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: true}}
http: {{max_body_bytes: 65536}}
"""

CHAT = """
name: chat
description: Chat.
access: {roles: [caller]}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true, with: {content: full}}
"""

REVIEWS = """
name: reviews
access: {roles: [auditor]}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate}
  - {id: out, type: stream}
"""

ANSWER = "Paris is the capital of France."


@dataclass
class App:
    """The app under test, its client, its database and a key per role."""

    app: Litestar
    client: TestClient
    db_url: str
    keys: dict[str, str]

    def auth(self, role: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"} if role else {}


def make_workspace(root: Path) -> Path:
    (root / "pipelines").mkdir()
    (root / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT))
    (root / "pipelines" / "reviews.yaml").write_text(textwrap.dedent(REVIEWS))
    config = root / "inferline.yaml"
    config.write_text(SERVER.format(db=root / "server.db"))
    return config


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[App]:
    """One app for the module (its requests do not depend on each other)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUTH__ENABLED"):
            patch.delenv(name, raising=False)
        root = tmp_path_factory.mktemp("secured")
        workspace = open_workspace(str(make_workspace(root)))
        app = create_app(workspace, engines=FakeEngines(smol=FakeEngine(ANSWER)))
        db_url = f"sqlite:///{root / 'server.db'}"
        with TestClient(app, raise_server_exceptions=False) as client:
            store = KeyStore(make_engine(db_url))
            keys = {role: store.create(f"security-{role}", role)[1] for role in ROLES}
            yield App(app, client, db_url, keys)
