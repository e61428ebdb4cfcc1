"""A model backend for any OpenAI-compatible server: vLLM, TGI, llama.cpp, or another Inferline.

Selected per model in ``inferline.yaml`` with ``backend: openai``::

    models:
      big:
        backend: openai
        base_url: http://gpu-box:8000/v1   # or self: this server's own /v1, wherever it listens
        api_key_env: BIG_API_KEY      # the name of the variable holding the key, never the key
        remote_model: meta-llama/Llama-3.1-8B-Instruct   # the id the server expects; default: big
        timeout_s: 60                 # connect, and longest wait for any byte of the reply
        tokenizer: models/llama-3.1-tokenizer            # optional, for counting only
        price: {input_per_1k: 0.0005, output_per_1k: 0.0015}

The server applies its own chat template, so the engine takes chat messages
(``submit_messages``) rather than token ids, and streams text: its events have
``token_id`` None and the delta in ``text``. Errors that can be known before any
text (unreachable, 429, 5xx, 4xx) are raised by ``submit_messages`` itself, so
that the caller can still fall back to another model.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import BackendError, InvalidInput, Overloaded
from pipeline.protocols import ModelOccupancy, SamplingParams, SchedulingHints, TokenEvent, Tokenizer
from serving.backends.placement import Placement, ReplicaOccupancy, ewma
from serving.backends.tokenizer import HFTokenizer
from serving.config.models import SELF_URL, ModelSpec
from serving.config.server import HttpSpec

logger = logging.getLogger(__name__)

#: Concurrent streams to one server; httpx's default (100) would quietly cap a busy model.
_MAX_CONNECTIONS = 256
#: Prefix placement over several servers hashes the messages' first 4 blocks of this many bytes.
_PREFIX_BLOCK_CHARS = 64
#: 4xx answers that say the endpoint or our configuration is wrong, not the request: the caller should fall back.
_NOT_THE_REQUEST = frozenset({401, 403, 404, 408})


def open_remote(name: str, spec: ModelSpec, root: Path, *, served: HttpSpec | None = None,
                transport: httpx.AsyncBaseTransport | None = None) -> RemoteEngine:
    """The engine of model *name* (``backend: openai``); does no I/O until the first request.

    ``base_url: self`` is the ``/v1`` API of the server that *served* says where it listens.
    """
    if spec.base_url == SELF_URL:
        if served is None or served.port == 0:
            raise BackendError(f"model {name!r}: base_url: {SELF_URL} needs the port this server listens on "
                               "(http.port, INFERLINE_PORT or serve --port; not 0)")
        spec = spec.model_copy(update={"base_url": own_url(served)})
    return RemoteEngine(name, spec, root, transport=transport)


def own_url(served: HttpSpec) -> str:
    """The ``/v1`` URL at which a server listening as *served* reaches itself: a wildcard address
    (0.0.0.0, ::) is reached on loopback."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(served.host, served.host)
    if ":" in host and not host.startswith("["):  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{served.port}/v1"


@dataclass(slots=True)
class RemoteEvent:
    """One streamed piece of text; the last event of a request carries its finish reason and usage."""

    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    token_id: int | None = None
    num_cached_tokens: int = 0


class RemoteTokenizer:
    """Counts tokens for a remote model: with a local HF tokenizer if configured, else an estimate.

    The estimate (about four characters a token, plus four a message for the template) is for
    budgets and context checks only; its ids are zeros, which decode to nothing.
    """

    def __init__(self, path: Path | None):
        self._path = path
        self._hf: Any = None

    def _loaded(self) -> Any:
        if self._hf is None:
            from transformers import AutoTokenizer  # slow to import: only when a remote model tokenizes here

            self._hf = HFTokenizer(AutoTokenizer.from_pretrained(self._path, local_files_only=True))
        return self._hf

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if self._path is not None:
            return self._loaded().encode_chat(messages)
        return [0] * sum(math.ceil(len(message.get("content", "")) / 4) + 4 for message in messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._path is None:
            return ""
        try:
            return self._loaded().decode(token_ids)
        except (ValueError, IndexError, OverflowError, TypeError):
            return ""  # ids this tokenizer does not know


class RemoteEngine:
    """The pipeline's ChatEngine protocol over an OpenAI-compatible ``/chat/completions`` endpoint: the server
    applies its own chat template, so stages hand it messages (``submit_messages``), never token ids.

    ``weights_hash`` identifies the endpoint and model id (sha256 of ``remote:<base_url>#<model>``),
    not weights: we cannot see what the server actually runs.
    """

    def __init__(self, name: str, spec: ModelSpec, root: Path, *,
                 transport: httpx.AsyncBaseTransport | None = None):
        if not spec.base_url:
            raise BackendError(f"model {name!r}: backend openai needs base_url: (http://host:port/v1)")
        self.name = name
        self.base_url = spec.base_url.rstrip("/")
        #: Every server of this model: base_url first, then base_urls (replicas).
        self.base_urls = list(dict.fromkeys([self.base_url, *(u.rstrip("/") for u in spec.base_urls)]))
        self._placement = Placement(len(self.base_urls), spec.placement, _PREFIX_BLOCK_CHARS,
                                    max_imbalance=spec.max_imbalance)
        self.remote_model = spec.remote_model or name
        self.tokenizer: Tokenizer = RemoteTokenizer(root / spec.tokenizer if spec.tokenizer else None)
        self.weights_hash = hashlib.sha256(f"remote:{self.base_url}#{self.remote_model}".encode()).hexdigest()
        self._api_key_env = spec.api_key_env
        self._timeout_s = spec.timeout_s
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._in_flight = [0] * len(self.base_urls)
        self._ttft_s: float | None = None

    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str = "", *,
                     hints: SchedulingHints | None = None) -> RemoteStream:
        raise InvalidInput(f"model {self.name!r} is remote: it takes chat messages (submit_messages), not token ids")

    async def submit_messages(self, messages: Sequence[Mapping[str, str]], sampling: SamplingParams,
                              cache_salt: str = "") -> RemoteStream:
        """Open the stream; raises Overloaded, BackendError or InvalidInput before any text is returned.

        *cache_salt* is not sent: the server keeps its own prefix cache, which we can neither partition
        nor see, and no OpenAI-compatible field for it is common to vLLM, TGI and llama.cpp. It only
        salts the choice among several servers (``base_urls``).
        """
        if sampling.logprobs is not None:
            raise InvalidInput(f"logprobs: model {self.name!r} is remote; only a local engine returns the tokens' "
                               "log-probabilities here; send the request without logprobs")
        if sampling.n > 1:
            raise InvalidInput(f"n: model {self.name!r} is remote, and only a local engine samples several answers "
                               f"to one request; send n: 1 (this request asked for {sampling.n})")
        started = time.monotonic()
        server = self._choose(messages, cache_salt)
        self._in_flight[server] += 1
        try:
            response = await self._open(self.base_urls[server], self._body(messages, sampling))
        except BaseException:
            self._in_flight[server] -= 1
            raise
        return RemoteStream(self, response, messages, started, server)

    def _choose(self, messages: Sequence[Mapping[str, str]], cache_salt: str) -> int:
        """Which server: with several, requests whose messages start alike go to the same one (its prefix
        cache), by the same placement as local replicas, over the text's leading characters."""
        if len(self.base_urls) == 1:
            return 0
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages).encode()[:_PREFIX_BLOCK_CHARS * 4]
        loads = [ReplicaOccupancy(0, count) for count in self._in_flight]
        return self._placement.choose(list(text), cache_salt, loads)

    def occupancy(self) -> ModelOccupancy:
        """Requests in flight count as running: the servers' own queues are invisible from here."""
        return ModelOccupancy(waiting=0, running=sum(self._in_flight), ttft_s=self._ttft_s)

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _body(self, messages: Sequence[Mapping[str, str]], sampling: SamplingParams) -> dict[str, Any]:
        # Only fields every OpenAI-compatible server knows; top_k, min_p, repetition_penalty and stop
        # token ids (ids of *our* tokenizer) are not portable and are left out.
        body: dict[str, Any] = {
            "model": self.remote_model,
            "messages": [{"role": message["role"], "content": message["content"]} for message in messages],
            "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.output is not None:  # OpenAI's structured outputs, and vLLM's guided decoding for the rest
            (kind, value), = sampling.output.items()
            if kind == "json_schema":
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": value, "strict": True}}
            else:
                body["guided_regex" if kind == "regex" else "guided_choice"] = value
        return body

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=self._transport, timeout=httpx.Timeout(self._timeout_s),
                limits=httpx.Limits(max_connections=_MAX_CONNECTIONS, max_keepalive_connections=32))
        return self._client

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self._api_key_env) if self._api_key_env else None
        if self._api_key_env and not key:
            logger.debug("model %s: environment variable %s is not set; sending no key", self.name, self._api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _open(self, base_url: str, body: dict[str, Any]) -> httpx.Response:
        client = self._http()
        # client.send(stream=True) is what client.stream() does inside its context manager: the response
        # has to outlive this call, since the TokenStream returned reads it.
        request = client.build_request("POST", f"{base_url}/chat/completions", json=body, headers=self._headers())
        try:
            response = await client.send(request, stream=True)
        except httpx.PoolTimeout as exc:
            raise Overloaded(f"model {self.name!r}: {_MAX_CONNECTIONS} requests already in flight", 1.0) from exc
        except httpx.TimeoutException as exc:
            logger.warning("model %s: %s timed out (%s)", self.name, base_url, type(exc).__name__)
            raise BackendError(f"model {self.name!r}: the server timed out") from exc
        except httpx.HTTPError as exc:
            logger.warning("model %s: %s unreachable (%s)", self.name, base_url, type(exc).__name__)
            raise BackendError(f"model {self.name!r}: the server is unreachable: {type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise await self._refusal(response, base_url)
        return response

    async def _refusal(self, response: httpx.Response, base_url: str) -> Exception:
        """The error for an HTTP error status (the response is read and closed)."""
        status = response.status_code
        try:
            await response.aread()
            message = _error_message(response)
        except httpx.HTTPError:
            message = response.reason_phrase  # the body broke off; the status alone decides
        finally:
            await response.aclose()
        logger.warning("model %s: %s answered HTTP %d", self.name, base_url, status)
        logger.debug("model %s: HTTP %d: %s", self.name, status, message)
        if status == 429:
            return Overloaded(f"model {self.name!r} is overloaded: {message}", _retry_after(response))
        if status >= 500 or status in _NOT_THE_REQUEST:
            return BackendError(f"model {self.name!r}: the server answered HTTP {status}: {message}")
        return InvalidInput(message)

    def _observe_ttft(self, ttft_s: float) -> None:
        self._ttft_s = ewma(self._ttft_s, ttft_s)

    def _finished(self, server: int) -> None:
        self._in_flight[server] -= 1


class RemoteStream:
    """The events of one remote request, read from its already open SSE response."""

    def __init__(self, engine: RemoteEngine, response: httpx.Response, messages: Sequence[Mapping[str, str]],
                 started: float, server: int = 0):
        self._engine, self._response, self._messages, self._started = engine, response, messages, started
        #: Which of the model's servers (``base_urls``) answers.
        self.server = server
        self._closed = False
        self._first = True

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def aclose(self) -> None:
        """Close the response: the server sees the disconnect and stops generating. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine._finished(self.server)
        await self._response.aclose()

    async def _events(self) -> AsyncIterator[RemoteEvent]:
        try:
            async for event in self._parse():
                if self._first:
                    self._first = False
                    self._engine._observe_ttft(time.monotonic() - self._started)
                yield event
        except httpx.HTTPError as exc:
            if self._closed:
                return  # closed by aclose() while we were reading: an abort, not a failure
            logger.warning("model %s: stream broke (%s)", self._engine.name, type(exc).__name__)
            raise BackendError(f"model {self._engine.name!r}: the stream broke: {type(exc).__name__}") from exc
        finally:
            await self.aclose()

    async def _parse(self) -> AsyncIterator[RemoteEvent]:
        """Content events as they come; the finish event is held until the usage chunk or ``[DONE]``."""
        finish: str | None = None
        # Our own count until the server's usage arrives (it comes last): a stream left early (a stop
        # string, an output rail, a disconnect) still reports its prompt for cost and budgets.
        prompt, output = len(self._engine.tokenizer.encode_chat(self._messages)), 0
        async with aclosing(_sse_data(self._response)) as events:
            async for data in events:
                if data == "[DONE]":
                    break
                chunk = self._decode(data)
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        output += 1
                        yield RemoteEvent(text, None, prompt, output)
                    finish = choice.get("finish_reason") or finish
                if isinstance(usage := chunk.get("usage"), Mapping):
                    prompt, output = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
                    if finish:
                        break
            else:
                if finish is None:  # closed without [DONE] or a finish reason: the server went away
                    raise BackendError(f"model {self._engine.name!r}: the stream ended before the reply did")
        yield RemoteEvent("", finish or "stop", prompt, output)

    def _decode(self, data: str) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            raise BackendError(f"model {self._engine.name!r}: the server sent a malformed chunk")
        if isinstance(error := chunk.get("error"), Mapping):  # failed after the 200 status was sent
            raise BackendError(f"model {self._engine.name!r}: {error.get('message') or 'the server failed'}")
        return chunk


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (several ``data:`` lines of one event are joined)."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        # event:, id:, retry: and ": comment" lines carry nothing we use
    if lines:
        yield "\n".join(lines)


def _error_message(response: httpx.Response) -> str:
    """The server's own words: OpenAI's ``error.message``, a problem's ``detail``, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error", "title"):
            if isinstance(body.get(key), str) and body[key]:
                return body[key]
    return response.text[:500]


def _retry_after(response: httpx.Response) -> float:
    """Retry-After in seconds (a number or an HTTP date); 1 when absent or unreadable."""
    value = response.headers.get("retry-after", "").strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 1.0
