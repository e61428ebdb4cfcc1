"""A small HTTP order service, for the ``http`` tool of ``pipelines/order_status.yaml`` and the tool tests.

    python examples/mcp_orders/order_service.py --port 8081

``GET /orders/{id}`` answers the order as JSON. Every request's headers are kept (``OrderService.seen``), so
that a test can show which headers a tool sent: the server's own ``X-Api-Key``, never a caller's token.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

ORDERS = {"A-1001": {"status": "shipped", "carrier": "DHL"}, "A-1002": {"status": "waiting for payment"}}


class OrderService(ThreadingHTTPServer):
    """The service on ``(host, port)`` (port 0: one the system picks), with the headers of every request."""

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0)):
        super().__init__(address, _Handler)
        #: Each request's path and headers, in order.
        self.seen: list[tuple[str, dict[str, str]]] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> OrderService:
        threading.Thread(target=self.serve_forever, daemon=True, name="order-service").start()
        return self


class _Handler(BaseHTTPRequestHandler):
    server: OrderService

    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers.items())))
        path = urlsplit(self.path).path
        if path == "/big":
            self._send(200, {"blob": "x" * 100_000})
        elif path.startswith("/orders/") and (order := ORDERS.get(unquote(path.removeprefix("/orders/")))):
            self._send(200, {"id": unquote(path.removeprefix("/orders/")), **order})
        else:
            self._send(404, {"error": f"no such order: {unquote(path)}"})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # quiet: tests and examples read their output
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args()
    OrderService(("127.0.0.1", args.port)).serve_forever()


if __name__ == "__main__":
    main()
