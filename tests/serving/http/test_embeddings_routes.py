"""``POST /v1/embeddings`` through the app in-process, over the real all-MiniLM-L6-v2 (and a fake chat model).

The vectors are checked against sentence-transformers' own ``encode``; the official ``openai`` package
calls a real server (uvicorn on a loopback port).
"""

from __future__ import annotations

import base64
import json
import textwrap
import time

import numpy as np
import pytest
from litestar.testing import TestClient
from openai import OpenAI

from serving.http.embeddings_routes import nine_digits
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.embeddings import shared_embedder
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import CHAT

pytestmark = pytest.mark.slow

SERVER = """
models:
  smol: {{source: models/smollm2-135m-instruct}}
embedding_models:
  minilm: {{source: all-MiniLM-L6-v2, device: cpu, batch_size: 32, price: {{input_per_1k: 0.5}}}}
database: sqlite:///{db}
pipelines: pipelines/
auth: {{enabled: true}}
http: {{max_body_bytes: 1000000}}
"""

EMBED = """
name: embed
access: {roles: [caller]}
stages:
  - {id: guard, type: policy, with: {pii: redact}}
  - {id: vectors, type: embed, with: {model: minilm}}
  - {id: log, type: audit, always: true, with: {content: redacted}}
"""

TEXTS = [f"Sentence number {i} is about {topic}." for i, topic in
         enumerate(["cats", "the weather in Lisbon", "refund policies", "GPU kernels", "a quiet lake"] * 14)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("embeddings")
    (root / "pipelines").mkdir()
    (root / "pipelines" / "chat.yaml").write_text(textwrap.dedent(CHAT))
    (root / "pipelines" / "embed.yaml").write_text(textwrap.dedent(EMBED))
    config = root / "inferline.yaml"
    config.write_text(SERVER.format(db=root / "server.db"))
    with pytest.MonkeyPatch.context() as patch:
        for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
            patch.delenv(name, raising=False)
        workspace = open_workspace(str(config))
    db = make_engine(f"sqlite:///{root / 'server.db'}")
    create_schema(db)
    keys = KeyStore(db)
    return workspace, {role: keys.create(role, role)[1] for role in ("caller", "auditor", "admin")}


@pytest.fixture(scope="module")
def client(app):
    workspace, _ = app
    with TestClient(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Hi.")))) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def keys(app):
    return app[1]


def auth(keys, role="caller"):
    return {"Authorization": f"Bearer {keys[role]}"}


def embed(client, keys, **body):
    return client.post("/v1/embeddings", json={"model": "embed", **body}, headers=auth(keys))


def reference(texts):
    """sentence-transformers' own vectors of *texts*, from the bundled model."""
    return shared_embedder("all-MiniLM-L6-v2", "cpu").model.encode(texts, convert_to_numpy=True,
                                                                   show_progress_bar=False)


def test_float_and_base64_are_sentence_transformers_vectors_in_order(client, keys):
    floats = embed(client, keys, input=TEXTS, encoding_format="float")
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == "embed"
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert {d["object"] for d in body["data"]} == {"embedding"}
    as_floats = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    packed = embed(client, keys, input=TEXTS, encoding_format="base64").json()["data"]
    as_base64 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed])
    assert as_floats.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(as_floats, as_base64)
    np.testing.assert_allclose(as_floats, reference(TEXTS), atol=1e-5)
    # Each text alone gives its own vector: batching (three batches of 32 here) keeps the order.
    alone = embed(client, keys, input=TEXTS[41]).json()["data"]
    assert len(alone) == 1
    np.testing.assert_allclose(as_floats[41], alone[0]["embedding"], atol=1e-5)


def test_usage_counts_the_tokens_the_model_reads(client, keys):
    tokenizer = shared_embedder("all-MiniLM-L6-v2", "cpu").tokenizer
    texts = ["Hello there", "A somewhat longer sentence, with punctuation!"]
    body = embed(client, keys, input=texts).json()
    expected = sum(len(tokenizer(t)["input_ids"]) for t in texts)  # [CLS] ... [SEP] included
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_tokenize_on_an_embeddings_pipeline_counts_with_its_embedding_model(client, keys):
    """/tokenize names the pipeline: its count is what /v1/embeddings bills, the embedding model's tokens."""
    tokenizer = shared_embedder("all-MiniLM-L6-v2", "cpu").tokenizer
    text = "A somewhat longer sentence, with punctuation!"
    counted = client.post("/tokenize", json={"model": "embed", "prompt": text, "return_token_strs": True},
                          headers=auth(keys))
    assert counted.status_code == 200, counted.text
    body = counted.json()
    assert body["tokens"] == tokenizer(text)["input_ids"] and body["token_strs"][0] == "[CLS]"
    assert body["count"] == embed(client, keys, input=text).json()["usage"]["prompt_tokens"]
    assert body["max_model_len"] == shared_embedder("all-MiniLM-L6-v2", "cpu").max_tokens
    back = client.post("/detokenize", json={"model": "embed", "tokens": body["tokens"]}, headers=auth(keys))
    assert back.json() == {"prompt": tokenizer.decode(body["tokens"], skip_special_tokens=True)}
    chat = client.post("/tokenize", json={"model": "embed", "messages": [{"role": "user", "content": text}]},
                       headers=auth(keys))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text


def test_dimensions_must_be_the_models_own(client, keys):
    assert embed(client, keys, input="x y", dimensions=384).status_code == 200
    response = embed(client, keys, input="x y", dimensions=128)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "dimensions" and "384" in error["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "empty list"),
    ({"input": ["fine", "  "]}, "input", "input[1]: an empty text"),
    ({"input": [101, 2023, 102]}, "input", "token ids are not accepted"),
    ({"input": [[101, 2023]]}, "input", "token ids are not accepted"),
    ({"input": ["a"] * 2049}, "input", "2049 texts, over the limit of 2048"),
    ({"input": "word " * 300}, "input", "input[0]: 302 tokens, over the 256"),
    ({"input": "x", "logit_bias": {}}, "logit_bias", "not supported"),
    ({"input": "x", "model": "chat"}, "model", "no embed stage"),
])
def test_bad_requests_are_refused_by_name_in_openai_shape(client, keys, body, param, words):
    response = client.post("/v1/embeddings", json={"model": "embed", **body}, headers=auth(keys))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_schema_errors_and_unknown_pipelines_in_openai_shape(client, keys):
    bad_format = embed(client, keys, input="x", encoding_format="xml")
    assert bad_format.status_code == 422 and "encoding_format" in bad_format.json()["error"]["message"]
    unknown = client.post("/v1/embeddings", json={"model": "nope", "input": "x"}, headers=auth(keys))
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "embed", "prompt": "hi"}),
    ("/v1/responses", {"model": "embed", "input": "hi"}),
    ("/v1/messages", {"model": "embed", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/pipelines/embed", {"input": "hi"}),
])
def test_text_routes_refuse_an_embeddings_pipeline(client, keys, path, body):
    response = client.post(path, json=body, headers=auth(keys))
    assert response.status_code == 400, response.text
    error = response.json().get("error") or response.json()
    assert "/v1/embeddings" in (error.get("message") or error.get("detail")), response.text


def test_roles_apply(client, keys):
    assert client.post("/v1/embeddings", json={"model": "embed", "input": "x"}).status_code == 401
    denied = client.post("/v1/embeddings", json={"model": "embed", "input": "x"}, headers=auth(keys, "auditor"))
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"


def test_the_audit_record_keeps_the_redacted_texts_and_the_usage_not_the_vectors(client, keys):
    response = embed(client, keys, input=["Mail jane.doe@example.com about it", "Nothing personal"])
    assert response.status_code == 200
    usage = response.json()["usage"]["prompt_tokens"]
    request_id = response.headers["x-request-id"]
    records = client.get("/audit/records", params={"pipeline": "embed"}, headers=auth(keys, "auditor")).json()
    (record,) = [r for r in records["records"] if r["request_id"] == request_id]
    detail = client.get(f"/audit/records/{record['id']}", headers=auth(keys, "auditor")).json()
    assert detail["content_mode"] == "redacted"
    assert detail["input_content"] == '["Mail <EMAIL_1> about it", "Nothing personal"]'
    assert detail["output_content"] == ""
    assert (detail["input_tokens"], detail["output_tokens"]) == (usage, 0)
    assert detail["model"] == "minilm" and detail["cost_usd"] == pytest.approx(usage * 0.5 / 1000)
    assert [(p["rule"], p["action"]) for p in detail["policy"]] == [("pii.email", "redact")]


def test_the_openai_package_against_a_real_server(app, client, keys):
    workspace, _ = app
    server = LiveServer(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Hi."))))
    try:
        openai = OpenAI(base_url=f"{server.url}/v1", api_key=keys["caller"], max_retries=0)
        result = openai.embeddings.create(model="embed", input=TEXTS[:5])  # asks for base64, decodes it
        floats = openai.embeddings.create(model="embed", input=TEXTS[:5], encoding_format="float")
    finally:
        server.stop()
    assert [d.index for d in result.data] == list(range(5))
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_array_equal(got, np.array([d.embedding for d in floats.data], dtype=np.float32))
    np.testing.assert_allclose(got, reference(TEXTS[:5]), atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 5


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-7, 1e-30, 1e30])
def test_nine_digits_give_back_every_float32(scale):
    values = (np.random.default_rng(7).standard_normal((64, 384)) * scale).astype(np.float32)
    values[0, :3] = [0.0, -0.0, np.float32(1e-45)]  # zeros and the smallest subnormal too
    text = json.dumps(nine_digits(values).tolist())
    np.testing.assert_array_equal(np.array(json.loads(text), dtype=np.float32), values)
    if 1e-7 <= scale <= 1:  # an embedding's range: nine digits at most (and a sign, a point, an exponent)
        assert max(len(repr(v)) for v in nine_digits(values[1:]).ravel().tolist()) <= 16


HOSTILE = {
    "deeply nested input": b'{"model": "embed", "input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    "invalid utf-8": b'{"model": "embed", "input": "\xff\xfe"}',
    "nul byte": b'{"model": "embed", "input": "a\x00b"}',
    "input null": b'{"model": "embed", "input": null}',
    "input object": b'{"model": "embed", "input": {"text": "x"}}',
    "mixed list": b'{"model": "embed", "input": ["x", 5]}',
    "no input": b'{"model": "embed"}',
    "huge dimensions": b'{"model": "embed", "input": "x", "dimensions": ' + b"9" * 400 + b"}",
    "negative dimensions": b'{"model": "embed", "input": "x", "dimensions": -3}',
    "NaN dimensions": b'{"model": "embed", "input": "x", "dimensions": NaN}',
    "float encoding_format": b'{"model": "embed", "input": "x", "encoding_format": 1.5}',
    "not json": b"model=embed&input=x",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bodies_get_an_openai_4xx(client, keys, name):
    response = client.post("/v1/embeddings", content=HOSTILE[name],
                           headers={**auth(keys), "content-type": "application/json"})
    assert response.status_code in (400, 413, 422), (response.status_code, response.text[:300])
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}


def test_a_shadow_run_audits_the_texts_too(client, keys):
    candidate = "version: '2'\n" + textwrap.dedent(EMBED).replace("content: redacted", "content: full")
    admin = auth(keys, "admin")
    assert client.post("/pipelines/embed/versions", json={"yaml": candidate, "activate": False},
                       headers=admin).status_code == 201
    shadow_on = client.put("/pipelines/embed/shadow", json={"version": "2", "percent": 100}, headers=admin)
    assert shadow_on.status_code == 200
    try:
        assert embed(client, keys, input=["Shadowed text", "Call +1 415 555 0100"]).status_code == 200
        deadline = time.monotonic() + 10
        while True:
            records = client.get("/audit/records", params={"pipeline": "embed"}, headers=admin).json()["records"]
            # (the deploy and the shadow's setting are recorded too, under version 2, without content)
            shadows = [r for r in records if r["pipeline_version"] == "2" and r["content_mode"] == "full"]
            if shadows or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        (shadow,) = shadows
        detail = client.get(f"/audit/records/{shadow['id']}", headers=admin).json()
        # content: full keeps the texts as the client sent them (the served pipeline's policy redacted the phone).
        assert json.loads(detail["input_content"]) == ["Shadowed text", "Call +1 415 555 0100"]
        assert detail["content_mode"] == "full" and detail["output_content"] == ""
    finally:
        client.delete("/pipelines/embed/shadow", headers=admin)
