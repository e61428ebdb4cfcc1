"""OpenAI's Responses API (serving/http/responses_routes.py): ``POST /v1/responses`` with its inputs, text
formats, tools and streamed events; stored responses read, continued and deleted by their key only, and
expired; what it refuses. Over fake engines (what reaches the engine, the events), then on the real model
behind a real HTTP server, through the official ``openai`` package."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient
from openai import OpenAI

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.db import utcnow
from store.engine import make_engine
from store.keys import KeyStore
from store.responses import ResponseStore
from tests import fakes
from tests.serving import workspaces as serving

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
ANSWER = "Paris is the capital of France."


@pytest.fixture
def client(tmp_path, monkeypatch, fake_engines):
    """The app over fake engines, auth off, with room for a tool call in ``max_tokens``."""
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace("max_tokens: 64", "max_tokens: 128"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as test_client:
        yield test_client


def create(client, **body):
    return client.post("/v1/responses", json={"model": "chat", "input": "What is the capital of France?", **body})


def prompt(fake_engines) -> str:
    """The last prompt the fake engine got, as text (its tokenizer has one token per byte)."""
    return bytes(fake_engines.engines["smol"].submitted[-1][0]).decode()


def reply(fake_engines, text: str) -> None:
    fake_engines.engines["smol"].reply = text.encode()


def events(response) -> list[dict]:
    """The events of a streamed response, each checked to name its type in ``event:`` and in its data."""
    parsed = []
    for block in response.text.replace("\r\n", "\n").strip().split("\n\n"):
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        parsed.append(event)
    return parsed


# -- a response -------------------------------------------------------------------------------------


def test_a_string_input_answers_a_response_object(client, fake_engines):
    response = create(client, metadata={"ticket": "42"}, user="u-1")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert body["model"] == "chat" and body["output_text"] == ANSWER
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": ANSWER, "annotations": [], "logprobs": []}]
    usage = body["usage"]
    assert usage["input_tokens"] == len(prompt(fake_engines).encode()) and usage["output_tokens"] == len(ANSWER)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert body["incomplete_details"] is None and body["error"] is None and body["store"] is True
    assert body["metadata"] == {"ticket": "42"} and body["user"] == "u-1"
    assert body["text"] == {"format": {"type": "text"}} and body["tool_choice"] == "auto"
    assert response.headers["x-request-id"] == body["id"].removeprefix("resp_")
    assert prompt(fake_engines).endswith("<user>What is the capital of France?")


def test_items_and_instructions_make_the_conversation(client, fake_engines):
    response = create(client, instructions="Be brief.", tools=[WEATHER], input=[
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 21 C.", "annotations": []}]},
        {"role": "user", "content": "And tomorrow?"}])
    assert response.status_code == 200, response.text
    sent = prompt(fake_engines)
    assert sent.startswith("<system>Be brief.\n\nYou can call these functions:")  # the tools' preamble follows
    assert "<tool_response> tags.<system>Answer in English.<user>Weather" in sent
    assert '<user>Weather in Paris?<assistant>{"name": "get_weather", "arguments": {"city": "Paris"}}' in sent
    assert '<user><tool_response>\n{"temp_c": 21}\n</tool_response><assistant>It is 21 C.<user>And tomorrow?' in sent


def test_user_is_the_requests_user_tag(tmp_path, monkeypatch, fake_engines):
    monkeypatch.setattr(serving, "CHAT", serving.CHAT.replace(
        "{id: prompt, type: prompt}", "{id: prompt, type: prompt, with: {system: 'Hello {{ tags.user }}.'}}"))
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as client:
        assert create(client, user="alice").status_code == 200
    assert prompt(fake_engines).startswith("<system>Hello alice.<user>")


@pytest.mark.parametrize(("fmt", "output"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}, {"json_schema": SCHEMA}),
])
def test_the_text_format_becomes_the_output_constraint(client, fake_engines, fmt, output):
    response = create(client, text={"format": fmt})
    assert response.status_code == 200, response.text
    assert fake_engines.engines["smol"].submitted[-1][1].output == output
    assert response.json()["text"] == {"format": fmt}


def test_a_forced_function_call_is_a_function_call_item(client, fake_engines):
    reply(fake_engines, CALL)
    response = create(client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert response.status_code == 200, response.text
    body = response.json()
    [item] = body["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert json.loads(item["arguments"]) == {"city": "Paris"} and item["call_id"].startswith("call_")
    assert body["output_text"] == "" and body["tools"][0]["name"] == "get_weather"
    constraint = fake_engines.engines["smol"].submitted[-1][1].output["json_schema"]
    assert constraint["properties"]["name"] == {"const": "get_weather"}


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client, fake_engines):
    body = create(client, max_output_tokens=5).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output_text"] == ANSWER[:5] and body["output"][0]["status"] == "incomplete"
    assert body["max_output_tokens"] == 5


# -- streamed --------------------------------------------------------------------------------------


def test_the_streamed_events_in_order(client):
    response = create(client, stream=True)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    sent = events(response)
    kinds = [e["type"] for e in sent]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    text = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    done = sent[-1]["response"]
    assert text == ANSWER == done["output_text"] == sent[-4]["text"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == len(ANSWER)
    assert sent[0]["response"]["status"] == "in_progress" and sent[0]["response"]["id"] == done["id"]
    assert {e["item_id"] for e in sent if "item_id" in e} == {done["output"][0]["id"]}
    assert client.get(f"/v1/responses/{done['id']}").json() == done  # stored as streamed


def test_a_streamed_function_call(client, fake_engines):
    reply(fake_engines, CALL)
    sent = events(create(client, stream=True, tools=[WEATHER], tool_choice="required"))
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert sent[2]["item"]["type"] == "function_call" and sent[2]["item"]["status"] == "in_progress"
    assert json.loads(sent[3]["delta"]) == {"city": "Paris"} == json.loads(sent[4]["arguments"])
    assert sent[-1]["response"]["output"] == [sent[5]["item"]]


def test_streamed_content_with_tools_offered_is_a_message(client):
    sent = events(create(client, stream=True, tools=[WEATHER]))
    assert sent[-1]["type"] == "response.completed" and sent[-1]["response"]["output_text"] == ANSWER
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == ANSWER


def test_held_content_that_looked_like_a_call_is_a_message(client, fake_engines):
    reply(fake_engines, '{"city": "Paris"}')  # JSON, but no call: content, sent once it is known
    sent = events(create(client, stream=True, tools=[WEATHER]))
    assert [e["delta"] for e in sent if e["type"] == "response.output_text.delta"] == ['{"city": "Paris"}']
    assert sent[-1]["response"]["output"][0]["type"] == "message"


def test_a_failure_after_the_start_is_an_error_event(client, monkeypatch):
    class Failing(fakes.FakeStream):
        async def _events(self):
            async for event in super()._events():
                yield event
                if event.num_output_tokens == 3:
                    raise RuntimeError("the engine went away")

    monkeypatch.setattr(fakes, "FakeStream", Failing)
    response = create(client, stream=True)
    assert response.status_code == 200
    sent = events(response)
    assert [e["type"] for e in sent[:4]] == ["response.created", "response.in_progress",
                                             "response.output_item.added", "response.content_part.added"]
    assert sent[-1]["type"] == "error" and sent[-1]["message"] and sent[-1]["sequence_number"] == len(sent) - 1
    assert "response.completed" not in {e["type"] for e in sent}
    assert client.get(f"/v1/responses/{sent[0]['response']['id']}").status_code == 404  # nothing stored


def test_the_openai_stream_helper_accumulates_a_call(client, fake_engines):
    reply(fake_engines, CALL)
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    with openai.responses.stream(model="chat", input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice="required") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert openai.responses.retrieve(final.id).output[0].call_id == call.call_id


def test_a_streamed_reply_cut_short_is_incomplete(client):
    sent = events(create(client, stream=True, max_output_tokens=4))
    assert sent[-1]["type"] == "response.incomplete"
    assert sent[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# -- stored responses --------------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(client, fake_engines):
    first = create(client, instructions="Be brief.").json()
    reply(fake_engines, "Lyon.")
    second = create(client, input="And the second city?", previous_response_id=first["id"]).json()
    sent = prompt(fake_engines)
    assert sent.endswith(f"<user>What is the capital of France?<assistant>{ANSWER}<user>And the second city?")
    assert "Be brief." not in sent  # instructions are not carried over
    assert second["previous_response_id"] == first["id"]
    create(client, input="And the third?", previous_response_id=second["id"])
    assert prompt(fake_engines).endswith(f"<assistant>{ANSWER}<user>And the second city?<assistant>Lyon."
                                         "<user>And the third?")


def test_get_and_delete(client):
    body = create(client).json()
    assert client.get(f"/v1/responses/{body['id']}").json() == body
    deleted = client.delete(f"/v1/responses/{body['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
    for response in (client.get(f"/v1/responses/{body['id']}"), client.delete(f"/v1/responses/{body['id']}"),
                     create(client, previous_response_id=body["id"])):
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"
    assert create(client, previous_response_id=body["id"]).json()["error"]["param"] == "previous_response_id"


def test_a_response_that_cannot_be_stored_says_so(client, monkeypatch):
    def away(self, response):
        raise sa.exc.OperationalError("INSERT", {}, Exception("the database is away"))

    monkeypatch.setattr(ResponseStore, "save", away)
    response = create(client)
    assert response.status_code == 503 and response.json()["error"]["code"] == "backend_error"
    sent = events(create(client, stream=True))
    assert sent[-1]["type"] == "error" and "could not be stored" in sent[-1]["message"]
    assert "response.completed" not in {e["type"] for e in sent}
    assert create(client, store=False).status_code == 200


def test_store_false_keeps_nothing(client):
    body = create(client, store=False).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404


def test_an_expired_response_is_gone(client, tmp_path):
    body = create(client).json()
    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    with engine.begin() as conn:
        expires = conn.execute(sa.text("SELECT expires_at FROM responses")).scalar_one()
        conn.execute(sa.text("UPDATE responses SET expires_at = :t"), {"t": utcnow() - timedelta(seconds=1)})
    engine.dispose()
    assert str(expires).startswith(str((utcnow() + timedelta(days=30)).date()))  # the default: 30 days
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404
    assert create(client, previous_response_id=body["id"]).status_code == 404


def test_expired_responses_are_pruned_at_start(tmp_path, monkeypatch, fake_engines):
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=False) as client:
        expired, kept = create(client).json()["id"], create(client).json()["id"]
    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE responses SET expires_at = :t WHERE id = :id"),
                     {"t": utcnow() - timedelta(seconds=1), "id": expired})
    again = TestClient(create_server(open_workspace(str(tmp_path / "inferline.yaml")), engines=fake_engines))
    with again:  # a restart: its first pass deletes what expired (a background task: wait for it)
        for _ in range(500):
            with engine.connect() as conn:
                left = conn.execute(sa.text("SELECT id FROM responses")).scalars().all()
            if left == [kept]:
                break
            time.sleep(0.01)
        assert left == [kept]
        assert again.get(f"/v1/responses/{kept}").status_code == 200
    engine.dispose()


def test_another_key_cannot_read_continue_or_delete(tmp_path, monkeypatch, fake_engines):
    with serving.client_for(tmp_path, monkeypatch, fake_engines, auth=True) as client:
        store = KeyStore(make_engine(f"sqlite:///{tmp_path / 'keys.db'}"))
        owner, other, auditor = ({"Authorization": f"Bearer {store.create(name, role)[1]}"}
                                 for name, role in (("a", "caller"), ("b", "caller"), ("c", "auditor")))
        body = client.post("/v1/responses", json={"model": "chat", "input": "Hi"}, headers=owner).json()
        path = f"/v1/responses/{body['id']}"
        assert client.get(path, headers=other).status_code == 404
        assert client.delete(path, headers=other).status_code == 404
        assert client.post("/v1/responses", headers=other, json={
            "model": "chat", "input": "Hi", "previous_response_id": body["id"]}).status_code == 404
        assert client.get(path, headers=auditor).status_code == 403
        assert client.get(path).status_code == 401
        assert client.get(path, headers=owner).json() == body
        assert client.post("/v1/responses", headers=owner, json={
            "model": "chat", "input": "Hi", "previous_response_id": body["id"]}).status_code == 200
        assert client.delete(path, headers=owner).status_code == 200
        audited = client.get("/audit/records", params={"pipeline": "chat"}, headers=auditor).json()["records"]
        assert body["id"].removeprefix("resp_") in {record["request_id"] for record in audited}
        assert len(audited) == 2  # the two that ran (the pipeline's audit stage): the other key's continuation did not
        refused = client.get("/audit/records", params={"status": "denied"}, headers=auditor).json()["records"]
        assert sorted(r["http_status"] for r in refused) == [401, 403]  # the reads refused, which name no pipeline


# -- refused -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning: not supported"),
    ({"include": ["file_search_call.results"], "background": True}, "background", "background, include"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input", "input[0].content[0]: input_image is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_file"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input[0].type: 'reasoning' items"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input", "input[0]: name: not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "input[0].arguments"),
    ({"input": []}, "input", "at least one item"),
    ({"input": ["hi"]}, "input", "input[0]: expected an item"),
    ({"input": [{"role": "user", "content": 5}]}, "input", "input[0].content"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "text.format.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "no function 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected 'auto'"),
    ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools", "tools[0].parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
])
def test_what_is_not_done_is_refused_by_name(client, fake_engines, body, param, needle):
    response = create(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"]
    assert not fake_engines.engines["smol"].submitted


@pytest.mark.parametrize("body", [
    {"model": "chat"}, {"input": "x"}, {"model": "chat", "input": 5}, {"model": "chat", "input": "x", "store": "x"},
    {"model": "chat", "input": "x", "metadata": {"k": "v" * 600}}, {"model": "chat", "input": "x", "temperature": 9},
    {"model": "nope", "input": "x"},
])
def test_a_malformed_request_is_an_openai_4xx(client, body):
    response = client.post("/v1/responses", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_missing_response_is_an_openai_404(client):
    for response in (client.get("/v1/responses/resp_nope"), client.delete("/v1/responses/resp_nope")):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "response_not_found"
