"""The remote (OpenAI-compatible) backend: against httpx mock transports, and against a real second server."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import ChatEngine, Engine, SamplingParams, Tokenizer
from serving.backends.remote import RemoteEngine, open_remote
from serving.config.models import ModelSpec

URL = "http://remote.test/v1"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
ROOT = Path(__file__).parents[3]


def sse(*chunks: dict | str) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n" for c in chunks)


def delta(content: str | None = None, finish: str | None = None) -> dict:
    body = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "usage": None,
            "choices": [{"index": 0, "delta": body, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"object": "chat.completion.chunk", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def engine(handler: Callable, **spec: object) -> RemoteEngine:
    settings = {"backend": "openai", "base_url": URL, "timeout_s": 5, **spec}
    return open_remote("big", ModelSpec(**settings), ROOT, transport=httpx.MockTransport(handler))


def streaming(body: bytes, seen: list[httpx.Request] | None = None) -> Callable:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    return handler


async def collect(remote: RemoteEngine, sampling: SamplingParams | None = None, messages: list = MESSAGES) -> list:
    stream = await remote.submit_messages(messages, sampling or SamplingParams(max_tokens=8))
    try:
        return [event async for event in stream]
    finally:
        await stream.aclose()


async def test_streams_text_and_maps_usage_and_sampling():
    seen: list[httpx.Request] = []
    body = sse(delta(""), delta("Paris"), delta(" it"), delta(" is."), delta(None, "stop"), usage(21, 4), "[DONE]")
    remote = engine(streaming(body, seen), remote_model="llama-3")
    events = await collect(remote, SamplingParams(max_tokens=8, temperature=0, top_p=0.9, seed=7, top_k=5,
                                                  presence_penalty=0.5, stop_token_ids=(2,)))
    assert [e.text for e in events] == ["Paris", " it", " is.", ""]
    assert [e.num_output_tokens for e in events] == [1, 2, 3, 4]
    assert [e.finish_reason for e in events] == [None, None, None, "stop"]
    last = events[-1]
    assert (last.token_id, last.num_prompt_tokens, last.num_cached_tokens) == (None, 21, 0)
    request = seen[0]
    sent = json.loads(request.content)
    assert str(request.url) == f"{URL}/chat/completions" and "authorization" not in request.headers
    assert sent == {"model": "llama-3", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 8, "temperature": 0, "top_p": 0.9, "seed": 7, "presence_penalty": 0.5,
                    "frequency_penalty": 0.0}
    load = remote.occupancy()
    assert (load.running, load.waiting) == (0, 0) and load.ttft_s is not None and load.ttft_s >= 0
    await remote.aclose()


async def test_finish_without_usage_counts_the_prompt_locally():
    remote = engine(streaming(sse(delta("Hi"), delta(" there", "length"), "[DONE]")))
    events = await collect(remote)
    assert [(e.text, e.finish_reason) for e in events] == [("Hi", None), (" there", None), ("", "length")]
    assert events[-1].num_output_tokens == 2
    assert events[-1].num_prompt_tokens == len(remote.tokenizer.encode_chat(MESSAGES)) > 0
    await remote.aclose()


async def test_usage_on_the_finish_chunk_ends_the_stream():
    final = {**delta(None, "content_filter"), "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    remote = engine(streaming(sse(delta("x"), final)))
    events = await collect(remote)
    estimate = len(remote.tokenizer.encode_chat(MESSAGES))  # our count until the server's usage arrives
    assert [(e.finish_reason, e.num_prompt_tokens, e.num_output_tokens) for e in events] == [
        (None, estimate, 1), ("content_filter", 3, 1)]


async def test_api_key_comes_from_the_named_env_var(monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "sk-test-123")
    seen: list[httpx.Request] = []
    remote = engine(streaming(sse(delta("a", "stop"), "[DONE]"), seen), api_key_env="REMOTE_TEST_KEY")
    await collect(remote)
    assert seen[0].headers["authorization"] == "Bearer sk-test-123"
    monkeypatch.delenv("REMOTE_TEST_KEY")
    await collect(remote)
    assert "authorization" not in seen[1].headers
    await remote.aclose()


def refusing(status: int, body: dict | str, headers: dict | None = None) -> Callable:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.Response(status, json=body, headers=headers)
        return httpx.Response(status, text=body, headers=headers)
    return handler


async def test_429_is_overloaded_with_retry_after():
    remote = engine(refusing(429, {"error": {"message": "queue full"}}, {"Retry-After": "7"}))
    with pytest.raises(Overloaded, match="queue full") as caught:
        await remote.submit_messages(MESSAGES, SamplingParams())
    assert caught.value.retry_after_s == 7
    assert remote.occupancy().running == 0
    with pytest.raises(Overloaded) as caught:
        await engine(refusing(429, "slow down")).submit_messages(MESSAGES, SamplingParams())
    assert caught.value.retry_after_s == 1


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_5xx_is_a_backend_error(status):
    remote = engine(refusing(status, {"error": {"message": "engine died"}}))
    with pytest.raises(BackendError, match=f"HTTP {status}: engine died"):
        await remote.submit_messages(MESSAGES, SamplingParams())
    assert remote.occupancy().running == 0


async def test_4xx_is_invalid_input_with_the_servers_message():
    remote = engine(refusing(400, {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}))
    with pytest.raises(InvalidInput) as caught:
        await remote.submit_messages(MESSAGES, SamplingParams())
    assert str(caught.value) == "max_tokens is too large"
    problem = engine(refusing(422, {"title": "Invalid", "detail": "messages: too long"}))
    with pytest.raises(InvalidInput, match="messages: too long"):
        await problem.submit_messages(MESSAGES, SamplingParams())


async def test_auth_or_unknown_model_is_a_backend_error_not_the_callers_fault():
    with pytest.raises(BackendError, match="HTTP 401: bad key"):
        await engine(refusing(401, {"error": {"message": "bad key"}})).submit_messages(MESSAGES, SamplingParams())
    with pytest.raises(BackendError, match="HTTP 404"):
        await engine(refusing(404, {"detail": "no model"})).submit_messages(MESSAGES, SamplingParams())


@pytest.mark.parametrize("error", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow"),
                                   httpx.ConnectTimeout("slow")])
async def test_unreachable_or_slow_server_is_a_backend_error(error):
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    remote = engine(handler)
    with pytest.raises(BackendError):
        await remote.submit_messages(MESSAGES, SamplingParams())
    assert remote.occupancy().running == 0
    await remote.aclose()


class Body(httpx.AsyncByteStream):
    """A response body that sends *head*, then fails with *error* or waits until closed."""

    def __init__(self, head: bytes, error: Exception | None = None):
        self.head, self.error = head, error
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        if self.error is not None:
            raise self.error
        await self.closed.wait()

    async def aclose(self) -> None:
        self.closed.set()


async def test_aclose_mid_stream_closes_the_response():
    body = Body(sse(delta("Once"), delta(" upon")))
    remote = engine(lambda request: httpx.Response(200, stream=body))
    stream = await remote.submit_messages(MESSAGES, SamplingParams())
    assert remote.occupancy().running == 1
    events = aiter(stream)
    assert (await anext(events)).text == "Once"
    assert (await anext(events)).text == " upon"
    await stream.aclose()
    assert body.closed.is_set() and remote.occupancy().running == 0
    await stream.aclose()  # idempotent
    assert remote.occupancy().running == 0
    await remote.aclose()


@pytest.mark.parametrize("tail", [b"data: {not json\n\n", b'data: {"error": {"message": "oom"}}\n\n', b""])
async def test_malformed_or_truncated_stream_raises_backend_error(tail):
    remote = engine(streaming(sse(delta("Hi")) + tail))
    stream = await remote.submit_messages(MESSAGES, SamplingParams())
    with pytest.raises(BackendError):
        async for _event in stream:
            pass
    assert remote.occupancy().running == 0


async def test_connection_drop_mid_stream_raises_backend_error():
    body = Body(sse(delta("Hi")), httpx.RemoteProtocolError("peer closed connection"))
    remote = engine(lambda request: httpx.Response(200, stream=body))
    stream = await remote.submit_messages(MESSAGES, SamplingParams())
    texts = []
    with pytest.raises(BackendError, match="stream broke"):
        async for event in stream:
            texts.append(event.text)
    assert texts == ["Hi"] and body.closed.is_set() and remote.occupancy().running == 0


async def test_token_ids_are_refused_and_identity_is_the_endpoint():
    remote = engine(streaming(b""), base_url=URL + "/", remote_model="llama-3")
    assert isinstance(remote, Engine) and isinstance(remote, ChatEngine)
    with pytest.raises(InvalidInput, match="chat messages"):
        await remote.submit([1, 2, 3], SamplingParams())
    assert remote.weights_hash == hashlib.sha256(f"remote:{URL}#llama-3".encode()).hexdigest()
    assert engine(streaming(b"")).remote_model == "big"
    with pytest.raises(ValueError, match="base_url"):  # refused when inferline.yaml loads
        ModelSpec(backend="openai")
    with pytest.raises(BackendError, match="base_url"):
        open_remote("big", ModelSpec.model_construct(backend="openai", base_url=None), ROOT)


async def test_estimated_tokenizer():
    tokenizer = engine(streaming(b"")).tokenizer
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode_chat([{"role": "user", "content": "abcde"}, {"role": "assistant", "content": ""}])
    assert ids == [0] * ((2 + 4) + (0 + 4))
    assert tokenizer.decode(ids) == ""


async def test_engine_aclose_closes_the_shared_client_and_is_idempotent():
    remote = engine(streaming(sse(delta("a", "stop"), "[DONE]")))
    await remote.aclose()  # never opened: nothing to close
    await collect(remote)
    client = remote._client
    assert client is not None
    await collect(remote)
    assert remote._client is client  # one client for every request
    await remote.aclose()
    await remote.aclose()
    assert client.is_closed


@pytest.mark.slow
async def test_local_hf_tokenizer_counts_exactly():
    remote = engine(streaming(b""), tokenizer="models/smollm2-135m-instruct")
    ids = remote.tokenizer.encode_chat(MESSAGES)
    assert len(ids) > 10 and any(ids)
    assert "capital of France" in remote.tokenizer.decode(ids)


@pytest.mark.slow
@pytest.mark.integration
async def test_against_a_real_inferline_server(tmp_path):
    from tests.serving.cli.test_serve import Server  # imported here: fast runs need not import openai

    server = await asyncio.to_thread(Server, tmp_path, auth=False)
    remote = open_remote("remote", ModelSpec(backend="openai", base_url=server.url + "/v1", remote_model="chat",
                                             timeout_s=60), tmp_path)
    try:
        async with asyncio.timeout(120):
            events = await collect(remote, SamplingParams(max_tokens=16, temperature=0),
                                   [{"role": "user", "content": "What is the capital of France?"}])
    finally:
        await remote.aclose()
        await asyncio.to_thread(server.stop)
    assert "Paris" in "".join(event.text for event in events)
    last = events[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.num_output_tokens > 0 and last.num_prompt_tokens > 0
    assert all(event.finish_reason is None for event in events[:-1])


async def test_several_servers_get_requests_by_prompt_prefix():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, content=sse(delta("ok"), delta(None, "stop"), "[DONE]"),
                              headers={"content-type": "text/event-stream"})

    spec = ModelSpec(backend="openai", base_url="http://a.test/v1", base_urls=["http://b.test/v1"])
    remote = open_remote("big", spec, ROOT, transport=httpx.MockTransport(handler))
    systems = [f"You are assistant number {i}, " + "with a long shared system prompt. " * 8 for i in range(8)]
    for system in systems:
        for question in ("one?", "two?"):
            stream = await remote.submit_messages([{"role": "system", "content": system},
                                                   {"role": "user", "content": question}], SamplingParams())
            [event async for event in stream]
    by_prompt = [seen[i:i + 2] for i in range(0, len(seen), 2)]
    assert all(a == b for a, b in by_prompt)  # a shared prefix stays on one server
    assert {pair[0] for pair in by_prompt} == {"a.test", "b.test"}  # different prefixes spread
    assert remote.occupancy().running == 0  # every stream released its server
    await remote.aclose()


# --- base_url: self ---------------------------------------------------------------------------


async def test_base_url_self_follows_the_port_the_server_listens_on(tmp_path, monkeypatch):
    from serving.backends.model_pool import ModelPool
    from serving.config.server import ServerSpec
    from serving.runtime.workspace import open_workspace
    from serving.server import create_server
    from tests.fakes import FakeEngine, FakeEngines
    from tests.serving.live_server import LiveServer
    from tests.serving.workspaces import write_workspace

    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    served = await asyncio.to_thread(LiveServer, create_server(open_workspace(str(write_workspace(tmp_path, False))),
                                                            engines=FakeEngines(smol=FakeEngine("Paris."))))
    try:
        assert served.port != 8000
        monkeypatch.setenv("INFERLINE_PORT", str(served.port))  # as `inferline serve` would be told
        config = tmp_path / "self.yaml"
        config.write_text("models:\n  loopback: {backend: openai, base_url: self, remote_model: chat}\n"
                          "http: {host: 0.0.0.0}\n")
        server: ServerSpec = open_workspace(str(config)).server
        pool = ModelPool(server, tmp_path)
        remote = await pool.get("loopback")
        assert remote.base_url == f"http://127.0.0.1:{served.port}/v1"
        events = await collect(remote, SamplingParams(max_tokens=16, temperature=0),
                               [{"role": "user", "content": "Capital of France?"}])
        await pool.close()
    finally:
        await asyncio.to_thread(served.stop)
    assert "".join(event.text for event in events) == "Paris."


async def test_the_example_loopback_follows_the_configured_port(monkeypatch):
    from serving.backends.model_pool import ModelPool
    from serving.runtime.workspace import open_workspace

    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    monkeypatch.setenv("INFERLINE_PORT", "8123")
    workspace = open_workspace(str(ROOT / "inferline.yaml"))
    pool = ModelPool(workspace.server, ROOT)
    remote = await pool.get("loopback")
    assert isinstance(remote, ChatEngine) and remote.base_url == "http://127.0.0.1:8123/v1"
    await pool.close()


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:9001/v1"),
                                           ("0.0.0.0", "http://127.0.0.1:9001/v1"), ("::", "http://[::1]:9001/v1"),
                                           ("fd00::5", "http://[fd00::5]:9001/v1"), ("gpu-box", "http://gpu-box:9001/v1")])
def test_self_is_reached_where_the_server_listens(host, url):
    from serving.config.server import HttpSpec

    spec = ModelSpec(backend="openai", base_url="self")
    remote = open_remote("me", spec, ROOT, served=HttpSpec(host=host, port=9001))
    assert remote.base_url == url


def test_self_is_refused_where_it_cannot_be_resolved():
    from pydantic import ValidationError

    from serving.config.server import HttpSpec, ServerSpec

    with pytest.raises(ValidationError, match=r"base_url: self needs a fixed http\.port"):
        ServerSpec(models={"me": ModelSpec(backend="openai", base_url="self")}, http=HttpSpec(port=0))
    with pytest.raises(ValidationError, match="backend: openai needs base_url: http"):
        ModelSpec(backend="openai", base_url="http://a.test/v1", base_urls=["self"])
    with pytest.raises(BackendError, match="base_url: self needs the port this server listens on"):
        open_remote("me", ModelSpec(backend="openai", base_url="self"), ROOT)
