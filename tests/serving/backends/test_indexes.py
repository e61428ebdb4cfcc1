"""Indexes in the server: the index CLI, hot reload, and a RAG request over HTTP (real FAISS and MiniLM)."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving.backends.indexes import IndexRegistry
from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.vector_index import VectorStore
from tests.fakes import FakeEngine, FakeEngines

pytestmark = pytest.mark.slow

PAGES = {
    "billing.md": "# Billing\n\nThe Plus plan costs eight dollars per user per month.",
    "shortcuts.md": "# Shortcuts\n\nPress Ctrl+Shift+K to open the command palette.",
}

SERVER = """
models:
  smol: {source: models/none}
indexes:
  kb: {path: idx, chunk_tokens: 64, overlap: 8, reload_every_s: 0.1}
database: sqlite:///server.db
pipelines: pipelines/
auth: {enabled: false}
"""

RAG = """
name: rag
stages:
  - {id: context, type: retrieve, with: {index: kb, top_k: 1}}
  - {id: prompt, type: prompt}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 8}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true}
"""


@pytest.fixture
def workspace_dir(tmp_path, monkeypatch) -> Path:
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "docs").mkdir()
    for name, text in PAGES.items():
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "rag.yaml").write_text(textwrap.dedent(RAG))
    (tmp_path / "inferline.yaml").write_text(textwrap.dedent(SERVER))
    return tmp_path


def cli(workspace_dir: Path, *args: str) -> int:
    return main(["index", *args, "--config", str(workspace_dir / "inferline.yaml")])


def test_the_index_commands(workspace_dir, capsys):
    assert cli(workspace_dir, "build", str(workspace_dir / "docs"), "--name", "kb") == 0
    assert "2 documents" in capsys.readouterr().out
    assert cli(workspace_dir, "info", "kb") == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["name"], info["documents"], info["settings"]["chunk_tokens"]) == ("kb", 2, 64)
    assert cli(workspace_dir, "search", "kb", "open the command palette", "--json", "--top-k", "1") == 0
    (hit,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert hit["source"] == "shortcuts.md" and hit["rank"] == 1
    (workspace_dir / "docs" / "export.md").write_text("# Export\n\nExport a workspace as Markdown.")
    assert cli(workspace_dir, "add", str(workspace_dir / "docs"), "--name", "kb") == 0
    assert "1 added, 0 changed, 2 unchanged" in capsys.readouterr().out
    assert cli(workspace_dir, "info", "nothing") == 1
    assert "no index at" in capsys.readouterr().err


async def test_a_rebuilt_index_is_swapped_in_while_old_holders_keep_theirs(workspace_dir):
    assert cli(workspace_dir, "build", str(workspace_dir / "docs"), "--name", "kb") == 0
    workspace = open_workspace(str(workspace_dir / "inferline.yaml"))
    registry = IndexRegistry(workspace.server, workspace.root)
    assert registry.refresh() == ["kb"] and registry.refresh() == []
    old = registry["kb"]
    watcher = asyncio.create_task(registry.watch())
    try:
        (workspace_dir / "docs" / "billing.md").write_text("# Billing\n\nThe Plus plan now costs nine dollars.")
        assert cli(workspace_dir, "build", str(workspace_dir / "docs"), "--name", "kb") == 0
        deadline = time.monotonic() + 10
        while registry["kb"] is old and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
    new = registry["kb"]
    assert new.version != old.version
    assert "nine" in new.search("Plus price", 1)[0].text
    assert "eight" in old.search("Plus price", 1)[0].text  # a request holding the old one finishes on it


def test_a_rag_request_over_http_reports_and_records_its_retrieval(workspace_dir):
    assert cli(workspace_dir, "build", str(workspace_dir / "docs"), "--name", "kb") == 0
    app = create_server(open_workspace(str(workspace_dir / "inferline.yaml")),
                     engines=FakeEngines(smol=FakeEngine("It costs $8 [1].")))
    with TestClient(app) as client:
        response = client.post("/pipelines/rag", json={"input": "How much is the Plus plan?"})
        assert response.status_code == 200, response.text
        (source,) = response.json()["sources"]  # top_k: 1
        record = client.get("/audit/records").json()["records"][0]
        detail = client.get(f"/audit/records/{record['id']}").json()
    retrieval = detail["retrieval"]
    assert retrieval["index"] == "kb" and retrieval["ids"][0].startswith("billing#")
    assert retrieval["version"] == VectorStore.current_version(workspace_dir / "idx")
    assert 0 < retrieval["scores"][0] <= 1
    assert (source["n"], source["citation"], source["path"]) == (1, "[1]", "billing.md")
    assert (source["id"], source["score"]) == (retrieval["ids"][0], retrieval["scores"][0])
    assert source["title"] == "Billing"


def test_an_index_not_built_yet_is_reported_once_then_loads_when_built(workspace_dir, caplog):
    """The watcher refreshes every ``reload_every_s``: the warning comes once, not at every refresh."""
    workspace = open_workspace(str(workspace_dir / "inferline.yaml"))
    registry = IndexRegistry(workspace.server, workspace.root)
    with caplog.at_level("WARNING", logger="serving.backends.indexes"):
        for _ in range(3):
            assert registry.refresh() == []
    assert caplog.text.count("index 'kb' is not built yet") == 1 and "it loads when built" in caplog.text
    assert cli(workspace_dir, "build", str(workspace_dir / "docs"), "--name", "kb") == 0
    assert registry.refresh() == ["kb"] and len(registry["kb"].chunks) == 2
