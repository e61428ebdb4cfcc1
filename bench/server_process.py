"""A real ``inferline serve`` process on loopback, for the load bench and the fault tests.

    server = ServerProcess.start(tmp, auth=True)           # the default inferline.yaml, auth on
    key = server.key("caller")                              # made by the real CLI: `inferline keys create`
    ...                                                     # requests to server.url
    code = server.stop()                                    # SIGTERM; its exit status

The config is the repository's own ``inferline.yaml`` with model and index paths made absolute, auth
set as asked, the database and the audit spool in *tmp* (or ``database=`` a URL), and *settings*
merged in (more models, ``plugins:``, ``http:``...). Nothing but the loopback address is bound.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli() -> list[str]:
    script = Path(sys.executable).with_name("inferline")
    return [str(script)] if script.exists() else [sys.executable, "-m", "serving.cli.main"]


def write_config(tmp: Path, *, auth: bool = True, database: str | None = None, pipelines: Path | None = None,
                 settings: dict[str, Any] | None = None) -> Path:
    """``inferline.yaml`` for a server in *tmp*: the default config with paths made absolute, then
    *settings* merged in (nested mappings merge key by key; None removes the key; anything else replaces)."""
    config = yaml.safe_load((ROOT / "inferline.yaml").read_text())
    for model in config.get("models", {}).values():
        if "source" in model and not Path(model["source"]).is_absolute():
            model["source"] = str(ROOT / model["source"])
    for index in config.get("indexes", {}).values():
        if "path" in index and not Path(index["path"]).is_absolute():
            index["path"] = str(ROOT / index["path"])
    config |= {"auth": {"enabled": auth}, "pipelines": f"{pipelines or ROOT / 'pipelines'}/",
               "database": database or f"sqlite:///{tmp}/server.db"}
    _merge(config, settings or {})
    path = tmp / "inferline.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _merge(into: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@dataclass
class ServerProcess:
    """One ``inferline serve`` child process and the config it runs."""

    config: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, tmp: Path, *, env: dict[str, str] | None = None, wait: bool = True,
              **config_options: object) -> ServerProcess:
        tmp.mkdir(parents=True, exist_ok=True)
        config = write_config(tmp, **config_options)  # type: ignore[arg-type]
        port = free_port()
        log_path = tmp / "server.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_AUTH__ENABLED"):
            if env is None or name not in env:
                environ.pop(name, None)
        proc = subprocess.Popen([*cli(), "serve", "--config", str(config), "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=environ)
        server = cls(config, port, proc, log_path, log)
        if wait:
            server.wait_ready()
        return server

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def key(self, role: str, name: str | None = None) -> str:
        """A new API key with *role*, made by ``inferline keys create`` against the server's database."""
        out = subprocess.run([*cli(), "keys", "create", "--role", role, "--name", name or f"reliability-{role}",
                              "--config", str(self.config)], capture_output=True, text=True, check=True,
                             cwd=self.config.parent, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        return out.stdout.strip().splitlines()[-1]

    def rss_bytes(self) -> int:
        """The server's resident memory now (Linux: /proc/PID/status VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line for the server process")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM, then the exit status (None if it had to be killed after *timeout_s*)."""
        self.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
