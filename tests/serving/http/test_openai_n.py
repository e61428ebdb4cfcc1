"""``n`` answers and ``logprobs`` in OpenAI requests, on a real server process with the real model: the
pipeline runs once, the engine forks the answers from one prefill, the audit record keeps them all; where
``n`` cannot be done (a remote model, tools) the request is refused by name. Log-probabilities come back in
OpenAI's shapes, streamed with their deltas."""

from __future__ import annotations

import json
import textwrap
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PIPELINES = {
    "sampled": """
        name: sampled
        stages:
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: gen, type: generate, with: {max_tokens: 12, temperature: 1.0, top_p: 0.95}}
          - {id: out, type: stream}
          - {id: log, type: audit, always: true, with: {content: full}}
        """,
    "twice": """
        name: twice
        stages:
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: gen, type: generate, with: {max_tokens: 8, temperature: 1.0, n: 2}}
          - {id: out, type: stream}
        """,
    "greedy": """
        name: greedy
        stages:
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: gen, type: generate, with: {max_tokens: 10, temperature: 0}}
          - {id: out, type: stream}
        """,
    "cached": """
        name: cached
        stages:
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: cache, type: cache}
          - {id: gen, type: generate, with: {max_tokens: 8, temperature: 0}}
          - {id: out, type: stream}
        """,
    "remote": """
        name: remote
        stages:
          - {id: route, type: route, with: {default: loopback}}
          - {id: prompt, type: prompt}
          - {id: tok, type: tokenize}
          - {id: gen, type: generate, with: {max_tokens: 8, temperature: 0}}
          - {id: out, type: stream}
        """,
}
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serving.cli.test_serve import Server  # imported here: fast runs need not start it

    tmp = tmp_path_factory.mktemp("n-server")
    (tmp / "pipelines").mkdir()
    for name, text in PIPELINES.items():
        (tmp / "pipelines" / f"{name}.yaml").write_text(textwrap.dedent(text))
    running = Server(tmp, pipelines=tmp / "pipelines")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keys(server):
    return {"caller": server.key("caller"), "auditor": server.key("auditor")}


def post(server, keys, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {keys['caller']}"})


def audit_record(server, keys, request_id: str) -> dict:
    """The request's record (the sink writes records in batches: it may take a moment to show)."""
    auditor = {"Authorization": f"Bearer {keys['auditor']}"}
    for _ in range(50):
        page = httpx.get(f"{server.url}/audit/records", params={"pipeline": "sampled"}, headers=auditor).json()
        found = [r for r in page["records"] if r["request_id"] == request_id]
        if found:
            return httpx.get(f"{server.url}/audit/records/{found[0]['id']}", headers=auditor).json()
        time.sleep(0.1)
    raise AssertionError(f"no audit record for request {request_id}")


def test_n3_chat_answers_three_choices_counted_and_audited(server, keys):
    response = post(server, keys, "/v1/chat/completions", model="sampled", messages=ASK, n=3, seed=5)
    assert response.status_code == 200, response.text
    body = response.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") and c["message"]["role"] == "assistant" for c in choices)
    texts = [c["message"]["content"] for c in choices]
    assert len(set(texts)) > 1  # sampled with seeds of their own
    tokens = body["usage"]["completion_tokens"]
    lengths = [12 if c["finish_reason"] == "length" else 1 for c in choices]  # at least one token each
    assert sum(lengths) <= tokens <= 3 * 12
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + tokens
    record = audit_record(server, keys, body["id"].removeprefix("chatcmpl-"))
    assert json.loads(record["output_content"]) == texts
    assert record["output_tokens"] == tokens and record["params"]["n"] == 3
    again = post(server, keys, "/v1/chat/completions", model="sampled", messages=ASK, n=3, seed=5).json()
    assert [c["message"]["content"] for c in again["choices"]] == texts


def test_n3_chat_streamed_carries_each_index_to_its_finish(server, keys):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {keys['caller']}"},
                      json={"model": "sampled", "messages": ASK, "n": 3, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    texts, finished = ["", "", ""], {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = choice["finish_reason"]
    assert sorted(finished) == [0, 1, 2]
    assert all(texts)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] >= 3 and usage["total_tokens"] == usage["prompt_tokens"] + usage[
        "completion_tokens"]


def test_completions_with_n(server, keys):
    response = post(server, keys, "/v1/completions", model="sampled", prompt="Once upon a time", n=2)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]


def test_n_skips_the_response_cache_rather_than_answering_one(server, keys):
    first = post(server, keys, "/v1/chat/completions", model="cached", messages=ASK)
    assert first.status_code == 200
    both = post(server, keys, "/v1/chat/completions", model="cached", messages=ASK, n=2)
    assert both.status_code == 200, both.text
    texts = [c["message"]["content"] for c in both.json()["choices"]]
    assert texts == [first.json()["choices"][0]["message"]["content"]] * 2  # greedy: both the same answer


@pytest.mark.parametrize(("model", "extra", "needle"), [
    ("remote", {}, "remote"),
    ("sampled", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_n_that_cannot_be_done_is_refused_by_name(server, keys, model, extra, needle):
    response = post(server, keys, "/v1/chat/completions", model=model, messages=ASK, n=2, **extra)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("n: ") and needle in message, message


def test_n_above_16_is_a_malformed_body(server, keys):
    response = post(server, keys, "/v1/chat/completions", model="sampled", messages=ASK, n=17)
    assert response.status_code == 422
    assert response.json()["error"]["message"].startswith("n: ")


def test_a_pipeline_that_samples_n_answers_them_all_on_the_pipeline_api(server, keys):
    response = post(server, keys, "/pipelines/twice", input="Name a colour.")
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["output"] == body["choices"][0]["output"]
    assert body["usage"]["output_tokens"] == sum(c["output_tokens"] for c in body["choices"])
    with httpx.stream("POST", f"{server.url}/pipelines/twice", timeout=120,
                      headers={"Authorization": f"Bearer {keys['caller']}"},
                      json={"input": "Name a colour.", "stream": True}) as streamed:
        deltas = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith('data: {"text"')]
    assert {d["index"] for d in deltas} == {0, 1}


# -- logprobs -------------------------------------------------------------------------------------


def check_tokens(content: list[dict], k: int) -> None:
    for token in content:
        assert token["logprob"] <= 0 and token["bytes"] == list(token["token"].encode())
        top = [t["logprob"] for t in token["top_logprobs"]]
        assert len(top) == k and top == sorted(top, reverse=True)


def test_chat_logprobs_with_the_top_k(server, keys):
    body = post(server, keys, "/v1/chat/completions", model="greedy", messages=ASK, logprobs=True,
                top_logprobs=3).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    check_tokens(content, 3)
    for token in content:  # greedy: the chosen token is the likeliest one
        assert token["token"] == token["top_logprobs"][0]["token"]
        assert token["logprob"] == pytest.approx(token["top_logprobs"][0]["logprob"])
    plain = post(server, keys, "/v1/chat/completions", model="greedy", messages=ASK, logprobs=True).json()
    assert [t["top_logprobs"] for t in plain["choices"][0]["logprobs"]["content"]] == [[]] * len(content)
    assert [t["token"] for t in plain["choices"][0]["logprobs"]["content"]] == [t["token"] for t in content]
    unasked = post(server, keys, "/v1/chat/completions", model="greedy", messages=ASK).json()
    assert unasked["choices"][0]["logprobs"] is None


def test_streamed_chat_logprobs_ride_with_their_deltas(server, keys):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {keys['caller']}"},
                      json={"model": "greedy", "messages": ASK, "stream": True, "logprobs": True, "top_logprobs": 2,
                            "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    content = [t for c in chunks for choice in c["choices"] if choice["logprobs"]
               for t in choice["logprobs"]["content"]]
    assert len(content) == chunks[-1]["usage"]["completion_tokens"]
    check_tokens(content, 2)
    text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
    assert text.strip() and all(not c["choices"][0]["logprobs"] for c in chunks[:1])  # the role chunk has none


def test_completions_logprobs_and_n_with_logprobs(server, keys):
    body = post(server, keys, "/v1/completions", model="sampled", prompt="Once upon a time", logprobs=2, n=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    total = 0
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        count = len(logprobs["tokens"])
        total += count
        assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == count
        assert all(lp <= 0 for lp in logprobs["token_logprobs"])
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    assert total == body["usage"]["completion_tokens"]
