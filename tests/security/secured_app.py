"""An in-process app with auth on, over fake engines, and one API key per role.

The app is the real ``create_server`` (every route, the console included) on a SQLite database in a
temporary folder; only the model is a fake (tests/fakes.py), so hundreds of requests take seconds.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

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
