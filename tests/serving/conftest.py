"""Fixtures of the serving tests: an in-process app over fake engines (tests/serving/workspaces.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.engine import make_engine
from store.keys import KeyStore
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import client_for


@pytest.fixture
def fake_engines() -> FakeEngines:
    return FakeEngines(smol=FakeEngine("Paris is the capital of France."))


@pytest.fixture
def client(tmp_path, monkeypatch, fake_engines):
    with client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


@pytest.fixture
def rag_client(tmp_path, monkeypatch, fake_engines):
    """The app with a ``rag`` pipeline too, retrieving two passages from a fake ``handbook`` index."""
    with client_for(tmp_path, monkeypatch, fake_engines, auth=False, rag=True) as test_client:
        yield test_client


@pytest.fixture
def auth_client(tmp_path, monkeypatch, fake_engines):
    with client_for(tmp_path, monkeypatch, fake_engines, auth=True) as test_client:
        yield test_client


@pytest.fixture
def keys(tmp_path) -> KeyStore:
    return KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The bundled model's transformers tokenizer, loaded once (tests/serving/backends/test_model_pool.py,
    test_piece_cache.py)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models/smollm2-135m-instruct")
