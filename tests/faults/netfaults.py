"""Network faults on loopback: a backend that hangs, and a TCP proxy that can be cut and restored.

    with HangingServer() as hung:          # accepts, reads, never answers
        ... base_url = hung.url ...
    proxy = TcpProxy(("127.0.0.1", 5432)).start()
    proxy.stop()     # refuses new connections and resets the open ones: the database is "down"
    proxy.start()    # the same port again: it is back
    proxy.close()
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


def _listener(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


class HangingServer:
    """Accepts connections and reads whatever comes, but never sends a byte back."""

    def __init__(self) -> None:
        self._sock = _listener()
        self.port = self._sock.getsockname()[1]
        self.num_connections = 0
        self._conns: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="hanging-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.num_connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    @staticmethod
    def _swallow(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self) -> HangingServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class TcpProxy:
    """Forwards a loopback port to *target*; :meth:`stop` is an outage, :meth:`start` the recovery."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = _listener()
        self.port = probe.getsockname()[1]
        probe.close()
        self._sock: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self.num_resets = 0

    def start(self) -> TcpProxy:
        with self._lock:
            if self._sock is None:
                self._sock = _listener(self.port)
                threading.Thread(target=self._accept, args=(self._sock,), name="tcp-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the port (new connections are refused) and reset every open connection."""
        with self._lock:
            sock, self._sock = self._sock, None
            pairs, self._pairs = self._pairs, []
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for pair in pairs:
            self.num_resets += 1
            for end in pair:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    close = stop

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._sock is not listener:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self._pairs.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
