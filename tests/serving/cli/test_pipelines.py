"""``inferline pipelines`` against a live server (uvicorn in a thread, fake engines, auth on)."""

from __future__ import annotations

from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.engine import make_engine
from store.keys import KeyStore
from store.migrate import create_schema
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.live_server import LiveServer
from tests.serving.workspaces import CHAT, write_workspace


def test_deploy_versions_rollback_and_retire_from_the_command_line(tmp_path, monkeypatch, capsys):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_URL", "INFERLINE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    workspace = open_workspace(str(config))
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    keys = KeyStore(engine)
    (_, admin), (_, caller) = keys.create("ops", "admin"), keys.create("app", "caller")
    server = LiveServer(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris."))))
    try:
        edited = tmp_path / "chat-v2.yaml"
        edited.write_text(CHAT.replace("name: chat", "name: chat\nversion: '2'"))
        common = ["--url", server.url, "--key", admin]
        assert main(["pipelines", "deploy", "chat", str(edited), *common]) == 0
        assert capsys.readouterr().out.startswith("chat now serves version 2 (")
        assert main(["pipelines", "versions", "chat", *common]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and lines[0].startswith("* ") and "version 2" in lines[0] and "version 1" in lines[1]
        assert main(["pipelines", "rollback", "chat", *common]) == 0
        assert "now serves version 1" in capsys.readouterr().out
        assert main(["pipelines", "activate", "chat", lines[0].split()[1], *common]) == 0
        assert "now serves version 2" in capsys.readouterr().out
        assert main(["pipelines", "split", "chat", "1=90", "2=10", *common]) == 0
        assert "90" in capsys.readouterr().out
        assert main(["pipelines", "activate", "chat", "1", *common]) == 0  # the label works too
        assert main(["pipelines", "promote", "chat", *common]) == 0
        assert "now serves version 2" in capsys.readouterr().out
        assert main(["pipelines", "split", "chat", *common]) == 2  # neither weights nor --clear
        assert main(["pipelines", "split", "chat", "--clear", *common]) == 0
        assert "all traffic to the active version" in capsys.readouterr().out
        edited.write_text(CHAT.replace("name: chat", "name: chat\nversion: '3'"))
        assert main(["pipelines", "deploy", "chat", str(edited), "--keep", *common]) == 0
        assert capsys.readouterr().out.startswith("chat: version 3 (")
        assert main(["pipelines", "shadow", "chat", "3", "25", *common]) == 0
        assert "25% of requests also run on version 3" in capsys.readouterr().out
        assert main(["pipelines", "shadow", "chat", "3", *common]) == 2  # no percent
        assert main(["pipelines", "shadow", "chat", "--clear", *common]) == 0
        assert "no shadow" in capsys.readouterr().out
        assert main(["pipelines", "rollback", "chat", "--url", server.url, "--key", caller]) == 1  # not an admin
        assert "403" in capsys.readouterr().err
        assert main(["pipelines", "retire", "chat", *common]) == 0
        assert main(["pipelines", "retire", "chat", *common]) == 1
        assert "404" in capsys.readouterr().err
        missing = tmp_path / "missing.yaml"
        assert main(["pipelines", "deploy", "chat", str(missing), *common]) == 2
    finally:
        server.stop()


def test_a_short_hash_and_a_label_used_twice_are_explained(tmp_path, monkeypatch, capsys):
    """activate with fewer than six characters of a hash says six are needed; a deploy whose version: label
    another kept version has (here both files leave version: out) warns that pins by label are ambiguous."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_URL", "INFERLINE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    workspace = open_workspace(str(write_workspace(tmp_path, auth=True)))
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    (_, admin) = KeyStore(engine).create("ops", "admin")
    server = LiveServer(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris."))))
    try:
        common = ["--url", server.url, "--key", admin]
        assert main(["pipelines", "activate", "chat", "9a", *common]) == 1
        assert "a spec hash prefix needs six or more characters ('9a' has 2)" in capsys.readouterr().err
        edited = tmp_path / "chat-edited.yaml"
        edited.write_text(CHAT.replace("Chat.", "Chat, edited."))  # no version: either: labelled 1 as well
        assert main(["pipelines", "deploy", "chat", str(edited), "--keep", *common]) == 0
        err = capsys.readouterr().err
        assert "warning: version label '1' (the file has no version:, so its label is the default) also names 1 " \
               "other kept version(s) of 'chat'" in err and "set a version: of its own" in err
        edited.write_text(CHAT.replace("Chat.", "Chat, again.").replace("name: chat", "name: chat\nversion: '1'"))
        assert main(["pipelines", "deploy", "chat", str(edited), *common]) == 0
        err = capsys.readouterr().err
        assert "version label '1' also names 2 other kept version(s)" in err and "no version:" not in err
        edited.write_text(CHAT.replace("name: chat", "name: chat\nversion: '2'"))
        assert main(["pipelines", "deploy", "chat", str(edited), *common]) == 0
        assert "warning" not in capsys.readouterr().err
    finally:
        server.stop()
