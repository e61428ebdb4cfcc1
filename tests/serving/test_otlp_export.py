"""Spans reach a real OTLP/HTTP receiver (started here, on loopback) with the GenAI conventions' attributes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from litestar.testing import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: what the SDK's exporter posts to /v1/traces, decoded."""

    requests: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf":
            Collector.requests.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
        else:
            self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_http_receiver(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        config = write_workspace(tmp_path, auth=False)
        endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
        config.write_text(config.read_text() + f"telemetry: {{exporter: otlp, endpoint: '{endpoint}'}}\n")
        with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))) \
                as client:
            answer = client.post("/pipelines/chat", json={"input": "Capital of France?"}).json()
        # Leaving the app shut its tracer provider down, which flushes the batch to the receiver.
    finally:
        receiver.shutdown()
        receiver.server_close()
    spans = [span for request in Collector.requests for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert {span.trace_id.hex() for span in spans} == {answer["trace_id"]}
    generate = next(span for span in spans if span.name == "stage gen")
    attributes = {a.key: a.value for a in generate.attributes}
    assert attributes["gen_ai.provider.name"].string_value == "inferline"
    assert attributes["gen_ai.request.model"].string_value == attributes["gen_ai.response.model"].string_value == "smol"
    assert attributes["gen_ai.operation.name"].string_value == "chat"
    stream = {a.key: a.value for a in next(span for span in spans if span.name == "stage out").attributes}
    assert stream["gen_ai.usage.output_tokens"].int_value == answer["usage"]["output_tokens"]
    assert "Capital of France" not in str(Collector.requests)  # no message content on spans by default


def _spans_of(tmp_path, monkeypatch, telemetry: str, requests: list[tuple[str, dict]]):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pipeline import tracing

    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"):
        monkeypatch.delenv(name, raising=False)
    exported = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "_processor", lambda exporter, endpoint: SimpleSpanProcessor(exported))
    config = write_workspace(tmp_path, auth=False)
    config.write_text(config.read_text() + f"telemetry: {telemetry}\n")
    with TestClient(create_server(open_workspace(str(config)), engines=FakeEngines(smol=FakeEngine("Paris.")))) \
            as client:
        for path, body in requests:
            assert client.post(path, json=body).status_code == 200
    return exported.get_finished_spans()


def test_each_route_names_its_operation_and_content_stays_off_spans(tmp_path, monkeypatch):
    spans = _spans_of(tmp_path, monkeypatch, "{exporter: console}", [
        ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "Capital of France?"}]}),
        ("/v1/completions", {"model": "chat", "prompt": "Capital of France?"}),
        ("/pipelines/chat", {"input": "Capital of France?"})])
    requests = [s for s in spans if s.name == "pipeline chat"]
    generates = [s for s in spans if s.name == "stage gen"]
    assert [s.attributes["gen_ai.operation.name"] for s in requests] == ["chat", "text_completion", "chat"]
    assert [s.attributes["gen_ai.operation.name"] for s in generates] == ["chat", "text_completion", "chat"]
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)
    assert "Capital of France" not in str([dict(s.attributes) for s in spans])


def test_message_content_on_spans_when_opted_in(tmp_path, monkeypatch):
    spans = _spans_of(tmp_path, monkeypatch, "{exporter: console, capture_message_content: true}", [
        ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "Capital of France?"}]})])
    request = next(s for s in spans if s.name == "pipeline chat")
    assert json.loads(request.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Capital of France?"}]}]
    output = json.loads(request.attributes["gen_ai.output.messages"])
    assert output == [{"role": "assistant", "parts": [{"type": "text", "content": "Paris."}], "finish_reason": "stop"}]
