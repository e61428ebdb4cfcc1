"""An in-process app over fake engines (fast), for the HTTP layer's own tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving import app as serving_app
from serving.wiring import open_workspace
from store.db import make_engine
from store.keys import KeyStore
from tests.fakes import FakeEngine, FakeEngines, FakeIndex

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

    def __init__(self, workspace: object):
        super().__init__(handbook=FakeIndex())

    def refresh(self, names: object = None) -> list[str]:
        return []

    async def watch(self) -> None:
        return None


@pytest.fixture
def fake_engines() -> FakeEngines:
    return FakeEngines(smol=FakeEngine("Paris is the capital of France."))


def _client(tmp_path: Path, monkeypatch, engines: FakeEngines, auth: bool, rag: bool = False):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    if rag:
        monkeypatch.setattr(serving_app, "IndexRegistry", FakeIndexes)
    workspace = open_workspace(str(write_workspace(tmp_path, auth, rag)))
    return TestClient(serving_app.create_app(workspace, engines=engines))


@pytest.fixture
def client(tmp_path, monkeypatch, fake_engines):
    with _client(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


@pytest.fixture
def rag_client(tmp_path, monkeypatch, fake_engines):
    """The app with a ``rag`` pipeline too, retrieving two passages from a fake ``handbook`` index."""
    with _client(tmp_path, monkeypatch, fake_engines, auth=False, rag=True) as test_client:
        yield test_client


@pytest.fixture
def auth_client(tmp_path, monkeypatch, fake_engines):
    with _client(tmp_path, monkeypatch, fake_engines, auth=True) as test_client:
        yield test_client


@pytest.fixture
def keys(tmp_path) -> KeyStore:
    return KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The bundled model's transformers tokenizer, loaded once (tests/serving/test_model_pool.py,
    test_piece_cache.py)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models/smollm2-135m-instruct")
