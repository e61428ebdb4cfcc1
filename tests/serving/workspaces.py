"""A server config with its pipelines in a temporary folder, and the in-process app over fake engines."""

from __future__ import annotations

import textwrap
from pathlib import Path

from litestar.testing import TestClient

from serving.runtime import resources
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngines, FakeIndex

SERVER = """
models:
  smol:
    source: models/smollm2-135m-instruct
    price: {{input_per_1k: 1.0, output_per_1k: 2.0}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: {auth}}}
http: {{max_body_bytes: 4096}}
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

AUDIT_ONLY = """
name: reviews
access: {roles: [auditor]}
stages:
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate}
  - {id: out, type: stream}
"""

RAG = """
name: rag
access: {roles: [caller]}
stages:
  - {id: context, type: retrieve, with: {index: handbook, top_k: 2}}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
"""


def write_workspace(root: Path, auth: bool, rag: bool = False) -> Path:
    """The server config and its pipelines; *rag*: a ``rag`` pipeline too, over a ``handbook`` index."""
    (root / "pipelines").mkdir()
    (root / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT))
    (root / "pipelines" / "reviews.yaml").write_text(textwrap.dedent(AUDIT_ONLY))
    config = root / "inferline.yaml"
    config.write_text(SERVER.format(db=root / "keys.db", auth=str(auth).lower()))
    if rag:
        (root / "pipelines" / "rag.yaml").write_text(textwrap.dedent(RAG))
        config.write_text(config.read_text() + "indexes:\n  handbook: {path: idx}\n")
    return config


class FakeIndexes(dict):
    """The app's index registry with a :class:`FakeIndex` for ``handbook``: nothing to load or watch."""

    def __init__(self, *config: object):
        super().__init__(handbook=FakeIndex())

    def refresh(self, names: object = None) -> list[str]:
        return []

    async def watch(self) -> None:
        return None


def client_for(tmp_path: Path, monkeypatch, engines: FakeEngines, auth: bool, rag: bool = False) -> TestClient:
    """A test client of the app over *engines* in *tmp_path* (not entered yet: use it in ``with``)."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    if rag:
        monkeypatch.setattr(resources, "IndexRegistry", FakeIndexes)
    workspace = open_workspace(str(write_workspace(tmp_path, auth, rag)))
    return TestClient(create_server(workspace, engines=engines))
