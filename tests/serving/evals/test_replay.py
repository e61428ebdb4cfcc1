"""``inferline replay``: audited requests through a candidate, old answers against new (fake engines)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving.cli.replay import read_records
from serving.evals.replay import replay, summarize_replay
from serving.evals.replay_report import html_report
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from store.audit import AuditFilters
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import CHAT, write_workspace

ROOT = Path(__file__).parents[3]


def audited_workspace(tmp_path, monkeypatch):
    """Three requests served and audited in full, and one by a pipeline that keeps only hashes."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(
        CHAT.replace("name: chat", "name: hashed").replace("content: full", "content: hash"))
    workspace = open_workspace(str(config))
    with TestClient(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris.")))) as client:
        for question in ("one?", "two?", "three?"):
            assert client.post("/pipelines/chat", json={"input": question}).status_code == 200
        assert client.post("/pipelines/hashed", json={"input": "four?"}).status_code == 200
    return workspace


async def test_an_unchanged_candidate_answers_the_same(tmp_path, monkeypatch):
    workspace = audited_workspace(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(pipeline="chat"), 100)
    assert len(records) == 3 and not skipped
    candidate = workspace.load_pipeline(workspace.pipelines_dir / "chat.yaml")
    results = await replay(workspace, candidate, records, engines=FakeEngines(smol=FakeEngine("Paris.")))
    totals = summarize_replay(results, skipped)
    assert totals["replayed"] == 3 and totals["identical"] == 3 and totals["status_changed"] == 0
    assert {r["old"]["output"] for r in results} == {"Paris."}


async def test_a_changed_candidate_shows_the_differences_and_skips_what_was_not_kept(tmp_path, monkeypatch):
    workspace = audited_workspace(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(), 100)
    assert len(records) == 3 and [skip["why"] for skip in skipped] == ["content kept as hash"]
    candidate_file = tmp_path / "candidate.yaml"
    candidate_file.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3"))
    candidate = workspace.load_pipeline(candidate_file)
    results = await replay(workspace, candidate, records, engines=FakeEngines(smol=FakeEngine("Paris.")))
    totals = summarize_replay(results, skipped)
    assert totals["identical"] == 0 and totals["skipped"] == 1
    assert all(r["new"]["output"] == "Par" and r["new"]["finish_reason"] == "length" for r in results)
    assert totals["output_tokens"]["new"] < totals["output_tokens"]["old"]
    page = html_report("chat", "candidate.yaml", totals, results)
    assert page.count('<tr class="diff">') == 3 and "http" not in page.split("<body>")[1]


def test_the_command_line_reports_and_exits_1_on_a_change(tmp_path, monkeypatch, capsys):
    from serving.cli.main import main
    from serving.evals import replay as replay_module

    workspace = audited_workspace(tmp_path, monkeypatch)

    async def over_fakes(*args, **kwargs):  # the command over the fake model instead of the config's
        return await replay(*args, **kwargs, engines=FakeEngines(smol=FakeEngine("Paris.")))

    monkeypatch.setattr(replay_module, "replay", over_fakes)  # the command imports it when it runs
    config = str(workspace.root / "inferline.yaml")
    same = main(["replay", "chat", "--candidate", str(workspace.pipelines_dir / "chat.yaml"), "--format", "jsonl",
                 "--config", config])
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert same == 0 and len(lines) == 3 and all(line["identical"] for line in lines)
    assert "replayed 3: 3 identical" in err
    changed = tmp_path / "candidate.yaml"
    changed.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3"))
    report = tmp_path / "replay.html"
    assert main(["replay", "chat", "--candidate", str(changed), "--html", str(report), "--config", config,
                 "--since", "1h"]) == 1
    assert "0 identical" in capsys.readouterr().err and report.read_text().count('class="diff"') == 3
    assert main(["replay", "hashed", "--candidate", str(changed), "--config", config, "--format", "table"]) == 0
    out, err = capsys.readouterr()  # nothing replayable: each record is named with why
    assert "skipped 1 record(s)" in err and out.startswith("skip  ") and "content kept as hash" in out
    assert main(["replay", "chat", "--candidate", str(tmp_path / "nope.yaml"), "--config", config]) == 1
    assert main(["replay", "chat", "--candidate", str(changed), "--since", "soon", "--config", config]) == 2


def test_replay_against_a_running_server(tmp_path, monkeypatch, capsys):
    """The records from the server's audit API, the candidate kept there and each input sent to it pinned:
    an unchanged candidate answers the same, a changed one differs; what was not kept is skipped."""
    from serving.cli.main import main
    from store.engine import make_engine
    from store.keys import KeyStore
    from store.migrate import create_schema
    from tests.serving.live_server import LiveServer

    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=True)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(
        CHAT.replace("name: chat", "name: hashed").replace("content: full", "content: hash"))
    workspace = open_workspace(str(config))
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    (_, admin), (_, caller) = KeyStore(engine).create("ops", "admin"), KeyStore(engine).create("app", "caller")
    server = LiveServer(create_server(workspace, engines=FakeEngines(smol=FakeEngine("Paris."))))
    try:
        import httpx
        for question in ("one?", "two?"):
            assert httpx.post(f"{server.url}/pipelines/chat", json={"input": question}, timeout=30,
                              headers={"Authorization": f"Bearer {caller}"}).status_code == 200
        common = ["--url", server.url, "--key", admin, "--format", "jsonl"]
        same = main(["replay", "chat", "--candidate", str(workspace.pipelines_dir / "chat.yaml"), *common])
        out, err = capsys.readouterr()
        lines = [json.loads(line) for line in out.splitlines()]
        assert same == 0 and len(lines) == 2 and all(line["identical"] for line in lines), err
        assert {line["new"]["version"] for line in lines} == {"1"} and lines[0]["new"]["status"] == "ok"
        changed = tmp_path / "candidate.yaml"
        changed.write_text(CHAT.replace("max_tokens: 64", "max_tokens: 3").replace("name: chat",
                                                                                   "name: chat\nversion: '2'"))
        assert main(["replay", "chat", "--candidate", str(changed), *common]) == 1
        out, err = capsys.readouterr()
        lines = [json.loads(line) for line in out.splitlines()]
        assert {(line["new"]["version"], line["new"]["output"]) for line in lines} == {("2", "Par")}
        # The first run's requests were served, so audited, too: four records now, none the same.
        assert "replayed 4: 0 identical" in err and "2 not a request" in err  # the keep actions
        assert main(["replay", "chat", "--candidate", "2", "--since", "1h", *common]) == 1  # a kept version
        assert main(["replay", "hashed", "--candidate", "2", *common]) == 0
        assert "skipped" in capsys.readouterr().err
        assert main(["replay", "chat", "--candidate", "7", *common]) == 1  # no such version there
        assert "404" in capsys.readouterr().err
        assert main(["replay", "chat", "--candidate", "2", "--url", server.url, "--key", caller]) == 1
        assert "403" in capsys.readouterr().err  # a caller may not read the audit log
        serving = httpx.post(f"{server.url}/pipelines/chat", json={"input": "x"}, timeout=30,
                             headers={"Authorization": f"Bearer {caller}"}).json()["pipeline_version"]
        assert serving == "1"  # keeping the candidate served nothing new
    finally:
        server.stop()


TAGGED = """
name: tagged
access: {roles: [caller]}
stages:
  - {id: prompt, type: prompt, with: {system: "You help {{ tags.product or 'everyone' }} ({{ tags.user }})."}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0.7}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true, with: {content: full}}
"""


class EchoingEngine(FakeEngine):
    """Answers with what it was asked: the sampling and a digest of the whole prompt, then words that
    max_tokens cuts short. Two answers are identical only when the requests were."""

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        digest = hashlib.sha256(bytes(prompt_ids)).hexdigest()[:12]
        self.reply = f"t={sampling.temperature} p={sampling.top_p} s={sampling.seed} {digest} {'la ' * 40}".encode()
        return await super().submit(prompt_ids, sampling, cache_salt, hints=hints)


def echoing() -> FakeEngines:
    return FakeEngines(smol=EchoingEngine())


#: Four requests, each with what a replay must send again: a caller's max_tokens and greedy temperature and
#: a tag; OpenAI's user (the user tag); a chat history (every turn: the record keeps the chat); a caller's seed.
REQUESTS = [
    ("/pipelines/tagged", {"input": "one?", "max_tokens": 40, "temperature": 0, "tags": {"product": "acme"}}),
    ("/v1/chat/completions", {"model": "tagged", "messages": [{"role": "user", "content": "two?"}], "max_tokens": 30,
                              "temperature": 0, "user": "alice"}),
    ("/pipelines/tagged", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                        {"role": "user", "content": "three?"}], "max_tokens": 40, "temperature": 0}),
    ("/pipelines/tagged", {"input": "four?", "seed": 7}),
]


def tagged_workspace(tmp_path, monkeypatch, *, auth: bool):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE", "INFERLINE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=auth)
    (tmp_path / "pipelines" / "tagged.yaml").write_text(TAGGED)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(TAGGED.replace("name: tagged", "name: hashed")
                                                        .replace("content: full", "content: hash"))
    return open_workspace(str(config))


def by_input(results, records):
    """Each comparison by the last user message of its record."""
    inputs = {record["id"]: json.loads(record["input_content"])[-1]["content"] if record["params"].get("turns")
              else record["input_content"] for record in records}
    return {inputs[result["record_id"]]: result for result in results}


async def test_a_replay_sends_each_request_as_it_was_sent(tmp_path, monkeypatch):
    """Before replays restored requests, only their text was sent: none of these four compared equal."""
    workspace = tagged_workspace(tmp_path, monkeypatch, auth=False)
    with TestClient(create_server(workspace, engines=echoing())) as client:
        for path, body in REQUESTS:
            assert client.post(path, json=body).status_code == 200
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline="tagged"), 100)
    candidate = workspace.load_pipeline(workspace.pipelines_dir / "tagged.yaml")
    results = by_input(await replay(workspace, candidate, records, engines=echoing()), records)
    assert all(r["identical"] for r in results.values()), results
    assert results["one?"]["sent"] == {"params": {"max_tokens": 40, "temperature": 0.0}, "tags": ["product"]}
    assert results["two?"]["sent"]["tags"] == ["user"] and results["four?"]["sent"]["params"] == {"seed": 7}
    assert all(not r["not_restored"] for r in results.values())
    totals = summarize_replay(list(results.values()), [])
    assert totals["not_restored"] == 0


async def test_the_candidates_own_sampling_applies_where_the_caller_set_none(tmp_path, monkeypatch):
    """A value the serving version chose is the candidate's to change; a value the caller sent is sent again,
    unless the candidate does not let callers set it, which the comparison says."""
    workspace = tagged_workspace(tmp_path, monkeypatch, auth=False)
    with TestClient(create_server(workspace, engines=echoing())) as client:
        for path, body in REQUESTS:
            assert client.post(path, json=body).status_code == 200
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline="tagged"), 100)
    cooler = tmp_path / "cooler.yaml"
    cooler.write_text(TAGGED.replace("temperature: 0.7", "temperature: 0.2"))
    results = by_input(await replay(workspace, workspace.load_pipeline(cooler), records, engines=echoing()), records)
    assert results["one?"]["identical"] and results["two?"]["identical"]  # their callers asked for 0
    assert results["four?"]["new"]["output"].startswith("t=0.2 ") and not results["four?"]["identical"]
    strict = tmp_path / "strict.yaml"
    strict.write_text(TAGGED.replace("temperature: 0.7}", "temperature: 0.7, client_params: [max_tokens]}"))
    results = by_input(await replay(workspace, workspace.load_pipeline(strict), records, engines=echoing()), records)
    notes = {n["what"]: n["why"] for n in results["one?"]["not_restored"]}
    assert "does not let callers set it" in notes["temperature"] and results["one?"]["sent"]["params"] == {
        "max_tokens": 40}
    assert [n["what"] for n in results["four?"]["not_restored"]] == ["seed"]


def test_replay_on_a_server_sends_each_request_as_it_was_sent(tmp_path, monkeypatch, capsys):
    """--url: the same requests, sent again to a live server pinned to the candidate, compare equal; a record
    kept as a hash is named in the report with why it was not replayed."""
    import httpx

    from serving.cli.main import main
    from store.engine import make_engine
    from store.keys import KeyStore
    from store.migrate import create_schema
    from tests.serving.live_server import LiveServer

    workspace = tagged_workspace(tmp_path, monkeypatch, auth=True)
    engine = make_engine(workspace.database_url)
    create_schema(engine)
    (_, admin), (_, caller) = KeyStore(engine).create("ops", "admin"), KeyStore(engine).create("app", "caller")
    server = LiveServer(create_server(workspace, engines=echoing()))
    try:
        for path, body in REQUESTS:
            assert httpx.post(f"{server.url}{path}", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {caller}"}).status_code == 200
        assert httpx.post(f"{server.url}/pipelines/hashed", json={"input": "five?"}, timeout=30,
                          headers={"Authorization": f"Bearer {caller}"}).status_code == 200
        common = ["--url", server.url, "--key", admin]
        assert main(["replay", "tagged", "--candidate", str(workspace.pipelines_dir / "tagged.yaml"), *common,
                     "--format", "jsonl"]) == 0  # every answer the same, the chat's included
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        records = {record["id"]: record for record in httpx.get(
            f"{server.url}/audit/records", params={"pipeline": "tagged", "until": "now"}, timeout=30,
            headers={"Authorization": f"Bearer {admin}"}).json()["records"]}
        results = by_input(lines, [records[line["record_id"]] for line in lines])
        assert all(r["identical"] for r in results.values()), results
        assert results["one?"]["sent"] == {"params": {"max_tokens": 40, "temperature": 0.0}, "tags": ["product"]}
        assert not results["three?"]["not_restored"]
        report = tmp_path / "replay.html"
        assert main(["replay", "hashed", "--candidate", str(workspace.pipelines_dir / "hashed.yaml"), *common,
                     "--format", "table", "--html", str(report)]) == 0
        out = capsys.readouterr().out
        assert "skip  " in out and "content kept as hash" in out
        assert "<h2>Not replayed</h2>" in report.read_text() and "content kept as hash" in report.read_text()
    finally:
        server.stop()


@pytest.mark.slow
async def test_greedy_requests_replay_identically_on_the_real_model(tmp_path, monkeypatch):
    """The real model samples at the pipeline's temperature 1.0 unless the caller asks for greedy decoding:
    requests sent again with their caller's temperature and max_tokens answer word for word the same."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "tagged.yaml").write_text(TAGGED.replace("temperature: 0.7", "temperature: 1.0"))
    config = tmp_path / "inferline.yaml"
    config.write_text(f"models:\n  smol: {{source: {ROOT / 'models/smollm2-135m-instruct'}, device: cpu}}\n"
                      f"database: sqlite:///{tmp_path / 'replay.db'}\npipelines: pipelines/\n"
                      "auth: {enabled: false}\n")
    workspace = open_workspace(str(config))
    with TestClient(create_server(workspace)) as client:
        for path, body in REQUESTS[:2]:
            assert client.post(path, json=body).status_code == 200
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline="tagged"), 100)
    candidate = workspace.load_pipeline(workspace.pipelines_dir / "tagged.yaml")
    results = await replay(workspace, candidate, records)
    assert len(results) == 2 and all(r["identical"] and r["new"]["output"] for r in results), results
    assert sorted(r["new"]["output_tokens"] for r in results) == sorted(r["old"]["output_tokens"] for r in results)
