"""Hostile requests get a 4xx with a problem-details body: never a 500, never a hang.

Oversized and endless bodies, deeply nested JSON, invalid UTF-8, numbers out of range (huge, negative,
NaN, infinite), and pipeline names with path traversal, control and odd Unicode characters (on the
deploy routes, refused by the pipeline name grammar before they name a file). (Prompts
past the context window need the real engine: tests/faults/test_server_faults.py.) The
OpenAI-compatible routes answer the same requests in OpenAI's error shape (``{"error": {...}}``)
with the same statuses, as OpenAI clients expect; Anthropic's Messages API in Anthropic's (a 400
where the others answer 422, as Anthropic does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.spec import is_pipeline_name
from tests.security.secured_app import App

MAX_BODY = 65536  # http.max_body_bytes of the app under test (conftest.SERVER)


def assert_problem(response, statuses: tuple[int, ...] = (400, 404, 413, 422)) -> dict:
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body = response.json()
    assert body["status"] == response.status_code and body["title"] and body["type"].startswith("https://")
    return body


def assert_openai_error(response, statuses: tuple[int, ...] = (400, 404, 413, 422)) -> dict:
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    return body


def post(secured: App, path: str, content: bytes, **headers: str):
    return secured.client.post(path, content=content, headers={
        **secured.auth("caller"), "content-type": "application/json", **headers})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_BODIES = {
    "oversized": (b'{"input": "' + b"x" * (MAX_BODY + 10) + b'"}', (413,)),
    "deeply nested array": (nested(20_000).encode(), (400, 422)),
    "deeply nested tags": (('{"input": "x", "tags": {"a": ' + nested(10_000) + "}}").encode(), (400, 422)),
    "deeply nested objects": (('{"a":' * 5000 + "1" + "}" * 5000).encode(), (400, 422)),
    "invalid utf-8": (b'{"input": "\xff\xfe\xfd"}', (400,)),
    "lone surrogate": (b'{"input": "\\ud800"}', (200, 400, 422)),
    "nul byte": (b'{"input": "a\x00b"}', (400,)),
    "not json": (b"input=hello", (400,)),
    "empty": (b"", (400, 422)),
    "json null": (b"null", (400, 422)),
    "json array": (b'[{"input": "x"}]', (400, 422)),
    "NaN literal": (b'{"input": "x", "temperature": NaN}', (400,)),
    "Infinity literal": (b'{"input": "x", "temperature": Infinity}', (400,)),
    "overflowing float": (b'{"input": "x", "temperature": 1e999}', (400, 422)),
    "huge int": (b'{"input": "x", "max_tokens": ' + b"9" * 400 + b"}", (400, 422)),
    "max_tokens 2**64": (b'{"input": "x", "max_tokens": 18446744073709551616}', (400, 422)),
    "max_tokens over the schema": (b'{"input": "x", "max_tokens": 1000000000}', (422,)),
    "max_tokens over the pipeline": (b'{"input": "x", "max_tokens": 1000000}', (400,)),
    "negative max_tokens": (b'{"input": "x", "max_tokens": -5}', (422,)),
    "fractional max_tokens": (b'{"input": "x", "max_tokens": 1.5}', (422,)),
    "negative temperature": (b'{"input": "x", "temperature": -1}', (422,)),
    "NaN string temperature": (b'{"input": "x", "temperature": "NaN"}', (422,)),
    "top_p zero": (b'{"input": "x", "top_p": 0}', (422,)),
    "negative top_k": (b'{"input": "x", "top_k": -1}', (422,)),
    "penalty out of range": (b'{"input": "x", "presence_penalty": -1e308}', (422,)),
    "seed huge": (b'{"input": "x", "seed": ' + b"1" * 100 + b"}", (200, 400, 422)),  # seeds are hashed to 64 bits
    "duplicate keys": (b'{"input": "x", "input": {"a": 1}}', (400, 422)),  # the last one wins: not a string
    "wrong types": (b'{"input": ["x"], "stream": "yes", "tags": [1]}', (422,)),
    # Refused at submit by the real engine (400); a backend that does not enforce constraints answers,
    # and the stream stage records that the answer could not be checked (200).
    "bad output regex": (b'{"input": "x", "output": {"regex": "("}}', (200, 400)),
    "bad output schema": (b'{"input": "x", "output": {"json_schema": {"type": "nonsense"}}}', (200, 400)),
    "deep output schema": (('{"input": "x", "output": {"json_schema": ' + '{"items": ' * 500 + "{}" + "}" * 500
                            + "}}").encode(), (200, 400)),
    "deep output object": (('{"input": "x", "output": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}").encode(), (400,)),
}
#: Cases whose field has no counterpart in a chat completion (extra keys there are ignored, as OpenAI does).
NOT_FOR_OPENAI = {"duplicate keys", "wrong types"}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_bodies_get_a_problem(secured, name):
    content, statuses = BAD_BODIES[name]
    response = post(secured, "/pipelines/chat", content)
    if response.status_code == 200:  # only where the case allows it: a value the model may see
        assert 200 in statuses
        return
    assert_problem(response, statuses)


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_bodies_on_the_openai_route_get_an_openai_error(secured, name):
    if name in NOT_FOR_OPENAI:
        pytest.skip("no such field in a chat completion")
    content, statuses = BAD_BODIES[name]
    if content.startswith(b'{"input": "x"'):  # the same fault in a chat completion's body
        content = b'{"model": "chat", "messages": [{"role": "user", "content": "x"}]' + content[len(b'{"input": "x"'):]
    response = post(secured, "/v1/chat/completions", content)
    if response.status_code == 200:
        assert 200 in statuses
        return
    assert_openai_error(response, statuses)


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_bodies_on_the_anthropic_route_get_an_anthropic_error(secured, name):
    if name in NOT_FOR_OPENAI:
        pytest.skip("no such field in a message request")
    content, statuses = BAD_BODIES[name]
    if content.startswith(b'{"input": "x"'):  # the same fault in a message request's body
        content = (b'{"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]'
                   + content[len(b'{"input": "x"'):])
    response = post(secured, "/v1/messages", content)
    if response.status_code == 200:
        assert 200 in statuses
        return
    # Anthropic answers a body that does not fit the schema with a 400, not a 422.
    assert response.status_code in {400 if status == 422 else status for status in statuses}, response.text[:500]
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body


def test_a_body_without_length_past_the_limit_is_413(secured):
    def endless() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(MAX_BODY // 1024 + 8):
            yield b"x" * 1024
        yield b'"}'

    response = secured.client.post("/pipelines/chat", content=endless(),
                                   headers={**secured.auth("caller"), "content-type": "application/json"})
    assert_problem(response, (413,))


ODD_NAMES = [
    "..%2F..%2Fetc%2Fpasswd", "%2e%2e", "...", "chat%00", "chat%0a", "chat%20", "%20chat", "CHAT", "chat.yaml",
    "chat%2Fx", "%5C..%5Cwindows", "ch%C3%A0t", "%E2%80%AEtahc", "%F0%9F%92%A5", "%ff%fe", "a" * 5000, "chat;drop",
    "chat'--", "%25", "$%7Bjndi%7D", "~root", "chat%3Fx%3D1",
]


@pytest.mark.parametrize("name", ODD_NAMES, ids=lambda n: n[:30])
def test_odd_pipeline_names_are_404(secured, name):
    posted = secured.client.post(f"/pipelines/{name}", json={"input": "x"}, headers=secured.auth("caller"))
    assert_problem(posted, (404,))
    described = secured.client.get(f"/pipelines/{name}", headers=secured.auth("caller"))
    assert_problem(described, (404,))
    cookie = {"cookie": f"inferline_console_key={secured.keys['caller']}"}
    console = secured.client.get(f"/ui/pipelines/{name}", headers=cookie)
    assert console.status_code == 404  # the console's page, or the router's problem for a path no route has


@pytest.mark.parametrize("model", ["../../etc/passwd", "chat\x00", "chat/../chat", "ch\u00e0t", "", "x" * 5000])
def test_odd_model_names_on_the_openai_route_are_404(secured, model):
    response = secured.client.post("/v1/chat/completions", headers=secured.auth("caller"), json={
        "model": model, "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(response, (404,))


# (A literal "/../" never reaches the server: clients resolve dot segments before sending.)
@pytest.mark.parametrize("path", ["/pipelines/%2e%2e/audit/records", "/pipelines/chat%2F..%2F..%2Faudit%2Frecords",
                                  "/audit/records/..%2F..%2Fetc", "/audit/records/" + "%00" * 10,
                                  "/ui/static/..%2F..%2F..%2Fpyproject.toml", "/ui/static/%2e%2e/plugin.py"])
def test_path_traversal_reaches_nothing(secured, path):
    response = secured.client.get(path, headers=secured.auth("admin"))
    assert response.status_code in (401, 403, 404, 405), (path, response.status_code)
    assert "[project]" not in response.text and "ConsolePlugin" not in response.text


def test_hostile_audit_record_ids_are_404(secured):
    for record_id in ["' OR 1=1 --", "..", "%", "_", "x" * 5000, "\u202e", "1; DROP TABLE audit_records"]:
        response = secured.client.get(f"/audit/records/{record_id}", headers=secured.auth("auditor"))
        assert_problem(response, (404,))


def test_a_stream_request_with_a_bad_body_never_starts_a_stream(secured):
    response = secured.client.post("/pipelines/chat", headers={**secured.auth("caller"), "accept": "text/event-stream"},
                                   content=json.dumps({"input": "x", "max_tokens": -1}))
    assert_problem(response, (422,))


@pytest.mark.parametrize("path", ["/audit/records", "/audit/summary", "/audit/verify", "/audit/export",
                                  "/audit/access", "/ui/audit", "/ui/audit/export", "/ui/audit/access"])
@pytest.mark.parametrize(("instant", "statuses"), [
    ("0001-01-01T00:19:01+19:58", (400,)),   # year 0 in UTC: no such datetime
    ("9999-12-31T23:59:59-10:00", (400,)),   # year 10000 in UTC
    ("2026-11-01T09:30:00", (200,)),         # no offset: taken as UTC
    ("not-a-date", (400, 422)),
])
def test_audit_time_filters_out_of_range_are_4xx(secured, path, instant, statuses):
    for name in ("since", "until"):
        headers = ({"cookie": f"inferline_console_key={secured.keys['auditor']}"} if path.startswith("/ui")
                   else secured.auth("auditor"))
        response = secured.client.get(path, params={name: instant}, headers=headers)
        assert response.status_code in statuses, (path, name, instant, response.status_code, response.text[:300])


#: Names no pipeline may have: NUL and other control characters, dot segments, slashes, past the 128
#: characters of the grammar, non-ASCII, upper case, a file's own name.
HOSTILE_NAMES = ["support\x00", "chat\x00.yaml", "..", ".", "...", "../chat", "..\\..\\x", "a/b", "/etc/passwd",
                 "a" * 129, "a" * 5000, "chàt", "\u202etahc", "💥", "\udcff", "CHAT", "chat.yaml", "chat\n",
                 " chat", "-chat", "1chat", "chat;rm", "$(id)", "%2e%2e", "~root", "\\\\?\\c:"]
#: A body each pipeline route takes, so that the name is what decides (the deploy's names its pipeline).
BODIES = {("POST", "/pipelines/{name:str}"): {"input": "x"},
          ("POST", "/pipelines/{name:str}/activate"): {"spec_sha256": "ffffff"},
          ("PUT", "/pipelines/{name:str}/traffic"): {"weights": {"1": 1}},
          ("PUT", "/pipelines/{name:str}/shadow"): {"version": "1", "percent": 5}}


def pipeline_routes(secured: App) -> list[tuple[str, str]]:
    """Every route that takes a pipeline's name in its path (the deploy routes among them), from app.routes."""
    return sorted((method, route.path) for route in secured.app.routes for method in route.methods
                  if route.path.startswith("/pipelines/{name:str}") and method not in ("HEAD", "OPTIONS"))


def pipeline_files(root: Path) -> set[Path]:
    """The files a deploy writes (``<name>.yaml`` and its temporary ``.<name>.yaml.<pid>.tmp``), anywhere below
    *root*: the folder above the workspace, so that a name that climbed out of it is seen too. Both hold ".yaml":
    other temporary files (the audit anchors' digests, written every 2 s) are not a deploy's."""
    return {path for path in root.rglob("*") if ".yaml" in path.name or ".yml" in path.name}


def call_with_name(secured: App, method: str, path: str, name: str):
    body = BODIES.get((method, path), {"yaml": f"name: {json.dumps(name)}\nstages: [{{id: p, type: prompt}}]\n"}
                      if path.endswith("/versions") and method == "POST" else None)
    # Dots percent-encoded too: a client resolves a literal "/../" before sending, and "%2e%2e" is what reaches us.
    url = path.replace("{name:str}", quote(name, safe="", errors="surrogatepass").replace(".", "%2E"))
    return secured.client.request(method, url, json=body, headers=secured.auth("admin"))


def assert_refused_before_any_file(secured: App, name: str) -> None:
    """*name* on every pipeline route: a 4xx; a deploy route says what a name may be, unless the name
    changed the route itself (a '/' in it: the router's 404); no file is written anywhere."""
    root = Path(secured.db_url.removeprefix("sqlite:///")).parent.parent
    before = pipeline_files(root)
    for method, path in pipeline_routes(secured):
        response = call_with_name(secured, method, path, name)
        assert 400 <= response.status_code < 500, (method, path, name[:40], response.status_code, response.text[:300])
        assert response.headers["content-type"].startswith("application/problem+json")
        is_deploy = path != "/pipelines/{name:str}" or method == "DELETE"
        if is_deploy and "/" not in name and name:
            assert response.json()["type"].endswith("/invalid_pipeline_name"), (method, path, response.text[:300])
    assert pipeline_files(root) == before, name[:40]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=lambda name: ascii(name)[:30])
def test_hostile_names_on_the_deploy_routes_are_4xx_and_write_nothing(secured, name):
    assert not is_pipeline_name(name)
    assert_refused_before_any_file(secured, name)


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
# Without '/': a name with one is another path, which may be a route of its own (the fixed list has some).
@given(st.text(st.characters(exclude_characters="/"), min_size=1, max_size=200).filter(
    lambda name: not is_pipeline_name(name)))
def test_any_name_no_pipeline_may_have_is_4xx_on_the_deploy_routes(secured, name):
    assert_refused_before_any_file(secured, name)
