"""Spans reach a real OTLP/HTTP receiver (started here, on loopback) with the GenAI conventions' attributes."""

from __future__ import annotations

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
