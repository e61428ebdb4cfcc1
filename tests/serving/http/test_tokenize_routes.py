"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, over the bundled model's own tokenizer."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from serving.backends.tokenizer import HFTokenizer
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


@pytest.fixture
def served(tmp_path, monkeypatch, smol_tokenizer):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    create_schema(engine)
    keys = KeyStore(engine)
    fake = FakeEngine("Paris.")
    fake.tokenizer = HFTokenizer(smol_tokenizer)  # the real tokenizer: ids as the model would see them
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=fake))) as client:
        yield client, keys.create("app", "caller")[1], keys.create("review", "auditor")[1], smol_tokenizer


def test_tokenize_and_detokenize_as_vllm_answers(served):
    client, caller, _, tokenizer = served
    auth = {"Authorization": f"Bearer {caller}"}
    text = client.post("/tokenize", headers=auth, json={"model": "chat", "prompt": "Hello world",
                                                       "return_token_strs": True})
    assert text.status_code == 200, text.text
    body = text.json()
    assert body["tokens"] == tokenizer("Hello world")["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and "max_model_len" in body
    chat = client.post("/tokenize", headers=auth, json={"model": "smol", "messages": [
        {"role": "user", "content": "Hi"}], "add_generation_prompt": True}).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"] and chat["token_strs"] is None
    assert client.post("/detokenize", headers=auth, json={"model": "chat", "tokens": body["tokens"]}).json() == {
        "prompt": "Hello world"}


def test_bad_inputs_get_openai_shaped_4xx(served):
    client, caller, auditor, _ = served
    auth = {"Authorization": f"Bearer {caller}"}
    cases = [
        (client.post("/tokenize", headers=auth, json={"model": "chat"}), 422),  # neither prompt nor messages
        (client.post("/tokenize", headers=auth, json={"model": "chat", "prompt": "x", "messages": [
            {"role": "user", "content": "x"}]}), 422),
        (client.post("/tokenize", headers=auth, json={"model": "chat", "prompt": "x", "bogus": 1}), 422),
        (client.post("/tokenize", headers=auth, json={"model": "nope", "prompt": "x"}), 404),
        (client.post("/detokenize", headers=auth, json={"model": "chat", "tokens": [-1, 10 ** 9]}), 400),
        (client.post("/tokenize", json={"model": "chat", "prompt": "x"}), 401),
        (client.post("/tokenize", headers={"Authorization": f"Bearer {auditor}"},
                     json={"model": "chat", "prompt": "x"}), 403),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) >= {"message", "type", "code"}, response.text
