"""``inferline keys``: its handlers through argparse, against a temporary SQLite file."""

from __future__ import annotations

import argparse

import pytest

from serving.cli.keys import add_keys_parser
from store.engine import make_engine
from store.keys import KeyStore


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    # No stray inferline.yaml or INFERLINE_* setting may choose the database.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERLINE_DATABASE", raising=False)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferline")
    add_keys_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


@pytest.fixture
def database(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'state' / 'keys.db'}"


def keys(parser: argparse.ArgumentParser, *argv: str) -> int:
    args = parser.parse_args(["keys", *argv])
    return args.handler(args)


def verify(database: str, plaintext: str):
    engine = make_engine(database)
    try:
        return KeyStore(engine).verify(plaintext)
    finally:
        engine.dispose()


def test_create_prints_the_key_once(parser, database, capsys):
    assert keys(parser, "create", "--role", "auditor", "--name", "compliance", "--database", database) == 0
    out, err = capsys.readouterr()
    [plaintext] = out.splitlines()
    assert out == plaintext + "\n"
    assert "will not be shown again" in err
    assert plaintext not in err
    info = verify(database, plaintext)
    assert (info.role, info.name) == ("auditor", "compliance")


def test_list_shows_keys_without_secrets(parser, database, capsys):
    assert keys(parser, "list", "--database", database) == 0
    assert capsys.readouterr().err == "no API keys\n"
    keys(parser, "create", "--role", "caller", "--name", "support bot", "--database", database)
    plaintext = capsys.readouterr().out.strip()
    key_id = plaintext.split("_")[1]
    assert keys(parser, "list", "--database", database) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["id", "name", "tenant", "role", "created", "status", "last", "used"]
    assert row.startswith(f"{key_id}  support bot  support bot  caller  ")  # the tenant defaults to the name
    assert row.split()[-2:] == ["active", "-"]
    assert plaintext.split("_", 2)[2] not in row


def test_create_with_a_tenant_stores_it_and_list_shows_it(parser, database, capsys):
    assert keys(parser, "create", "--role", "caller", "--name", "billing app", "--tenant", "acme",
                "--database", database) == 0
    out, err = capsys.readouterr()
    plaintext = out.strip()
    assert "for 'billing app', tenant 'acme'" in err
    info = verify(database, plaintext)
    assert (info.name, info.tenant) == ("billing app", "acme")
    keys(parser, "create", "--role", "caller", "--name", "billing batch", "--tenant", "acme", "--database", database)
    capsys.readouterr()
    assert keys(parser, "list", "--database", database) == 0
    _, first, second = capsys.readouterr().out.splitlines()
    cells = [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in (first, second)]
    assert [row[1:3] for row in cells] == [["billing app", "acme"], ["billing batch", "acme"]]


def test_a_blank_tenant_is_refused(parser, database, capsys):
    assert keys(parser, "create", "--role", "caller", "--name", "bot", "--tenant", " ", "--database", database) == 1
    assert capsys.readouterr().err == "inferline: a key needs a tenant: whose requests it makes\n"


def test_revoke_then_revoke_again(parser, database, capsys):
    keys(parser, "create", "--role", "caller", "--name", "bot", "--database", database)
    plaintext = capsys.readouterr().out.strip()
    key_id = plaintext.split("_")[1]
    assert keys(parser, "revoke", key_id, "--database", database) == 0
    assert capsys.readouterr().out == f"revoked {key_id}\n"
    assert verify(database, plaintext) is None
    assert keys(parser, "revoke", key_id, "--database", database) == 1
    assert "unknown or already revoked" in capsys.readouterr().err
    assert keys(parser, "list", "--database", database) == 0
    assert " revoked " in capsys.readouterr().out


def test_revoking_an_unknown_key_fails(parser, database, capsys):
    assert keys(parser, "revoke", "nosuchkey123", "--database", database) == 1
    assert "no active key 'nosuchkey123'" in capsys.readouterr().err


def test_the_database_comes_from_the_environment_then_the_config(parser, tmp_path, monkeypatch, capsys):
    from_config = tmp_path / "from-config.db"
    (tmp_path / "server.yaml").write_text(f"database: sqlite:///{from_config}\n")
    from_env = f"sqlite:///{tmp_path / 'from-env.db'}"

    assert keys(parser, "create", "--role", "admin", "--name", "ops", "--config", "server.yaml") == 0
    by_config = capsys.readouterr().out.strip()
    assert verify(f"sqlite:///{from_config}", by_config) is not None

    monkeypatch.setenv("INFERLINE_DATABASE", from_env)
    assert keys(parser, "create", "--role", "admin", "--name", "ops", "--config", "server.yaml") == 0
    by_env = capsys.readouterr().out.strip()
    assert verify(from_env, by_env) is not None
    assert verify(f"sqlite:///{from_config}", by_env) is None

    explicit = f"sqlite:///{tmp_path / 'explicit.db'}"
    assert keys(parser, "create", "--role", "admin", "--name", "ops", "--database", explicit) == 0
    assert verify(explicit, capsys.readouterr().out.strip()) is not None


def test_an_unreachable_database_is_one_line_without_the_password(parser, capsys):
    url = "postgresql://admin:hunter2@127.0.0.1:1/inferline?connect_timeout=2"
    assert keys(parser, "list", "--database", url) == 1
    err = capsys.readouterr().err
    assert err.startswith("inferline: database postgresql://admin:***@127.0.0.1:1/inferline")
    assert "hunter2" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [["create", "--role", "root", "--name", "x"], ["create", "--role", "caller"],
                                  [], ["revoke"], ["rotate"]])
def test_usage_errors_exit_2(parser, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["keys", *argv])
    assert exit_info.value.code == 2
    assert "usage: inferline keys" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["create"], ["list"], ["revoke"]])
def test_help_everywhere(parser, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["keys", *argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: inferline keys {' '.join(argv)}".rstrip())
    if argv == ["create"]:
        assert "--tenant TENANT" in out and "(default: NAME)" in " ".join(out.split())
    if argv:
        assert "--database URL" in out
        assert "--config FILE" in out
