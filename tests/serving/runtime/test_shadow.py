"""Shadow by step: a shadow run of a workflow version counts, in /metrics and in its audit record, the steps whose
output is not the served run's, and only those (the in-process app over scripted fake engines)."""

from __future__ import annotations

from pathlib import Path

from litestar.testing import TestClient

from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines, FakeStream
from tests.serving.http.test_deploy_routes import _metric, _wait_for
from tests.serving.workspaces import CHAT, write_workspace

ROOT = Path(__file__).parents[3]
DRAFT_CHECK = (ROOT / "pipelines" / "draft_check.yaml").read_text()
JUDGE = "You review a support answer before it is sent."
#: Each step's answer, by a phrase of its prompt (the first that matches): the redraft's system prompt starts as
#: the draft's, so it comes first; the candidate's judge is told to be strict, and rejects every draft. Any other
#: prompt (the chat pipeline's) gets the last.
SCRIPT = (("A reviewer rejected", "Please write to billing@lumen.example."),
          ("strictly", '{"passed": false, "reasons": "it promises a date"}'),
          ("You review", '{"passed": true, "reasons": "fine"}'),
          ("Lumen's support team", "You can ask for a refund in Settings."),
          ("", "Refunds are in Settings."))


class ScriptedEngine(FakeEngine):
    """Answers each prompt by the first phrase of :data:`SCRIPT` in it."""

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        prompt = bytes(prompt_ids).decode(errors="replace")
        reply = next(reply for phrase, reply in SCRIPT if phrase in prompt)
        stream = FakeStream(reply.encode(), len(prompt_ids), sampling.max_tokens)
        self.streams.append(stream)
        return stream


def _app(tmp_path, monkeypatch):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "draft_check.yaml").write_text(DRAFT_CHECK)
    return create_server(open_workspace(str(config)), engines=FakeEngines(smol=ScriptedEngine()))


def test_a_shadow_whose_judge_prompt_differs_counts_the_judge_and_what_follows_not_the_draft(tmp_path, monkeypatch):
    strict = DRAFT_CHECK.replace(JUDGE, f"{JUDGE} Judge strictly.").replace(
        "name: draft_check", "name: draft_check\nversion: '2'")
    with TestClient(_app(tmp_path, monkeypatch)) as client:
        assert client.post("/pipelines/draft_check/versions", json={"yaml": strict, "activate": False}).status_code \
            == 201
        assert client.put("/pipelines/draft_check/shadow", json={"version": "2", "percent": 100}).status_code == 200
        for question in ("Can I get my money back?", "Where is my parcel?"):
            answer = client.post("/pipelines/draft_check", json={"input": question}).json()
            assert answer["output"] == "You can ask for a refund in Settings."  # the served judge passed it

        def differing(step: str) -> float:
            return _metric(client, 'inferline_shadow_steps_differing_total{candidate="2",pipeline="draft_check",'
                                   f'step="{step}"}}')

        _wait_for(lambda: differing("redraft") == 2)
        # The judge rejects now, so the reply is skipped and the redraft runs: three steps differ, the draft not.
        assert differing("judge") == differing("accepted") == 2
        assert differing("draft") == differing("log") == 0
        assert 'step="draft"' not in client.get("/metrics").text

        records = client.get("/audit/records", params={"limit": 20, "pipeline": "draft_check"}).json()["records"]
        shadows = [r for r in records if r["pipeline_version"] == "2" and r["model"]]  # not the deploy actions
        assert len(shadows) == 2
        for record in shadows:
            row = client.get(f"/audit/records/{record['id']}").json()
            decision = next(s["decision"] for s in row["stages"] if s["type"] == "shadow")
            assert sorted(decision["steps_differing"]) == ["accepted", "judge", "redraft"]
            assert "steps" not in decision["served"]  # compared, not kept: hashes of content


def test_a_shadow_of_an_identical_chain_counts_no_step(tmp_path, monkeypatch):
    with TestClient(_app(tmp_path, monkeypatch)) as client:
        same = CHAT.replace("name: chat", "name: chat\nversion: '2'")
        assert client.post("/pipelines/chat/versions", json={"yaml": same, "activate": False}).status_code == 201
        assert client.put("/pipelines/chat/shadow", json={"version": "2", "percent": 100}).status_code == 200
        assert client.post("/pipelines/chat", json={"input": "Can I get my money back?"}).status_code == 200
        _wait_for(lambda: _metric(
            client, 'inferline_shadow_runs_total{candidate="2",output="identical",pipeline="chat"}') == 1)
        assert "inferline_shadow_steps_differing_total{" not in client.get("/metrics").text
        record = next(r for r in client.get("/audit/records", params={"limit": 20, "pipeline": "chat"}).json()[
            "records"] if r["pipeline_version"] == "2" and r["model"])
        row = client.get(f"/audit/records/{record['id']}").json()
        assert next(s["decision"] for s in row["stages"] if s["type"] == "shadow")["steps_differing"] == []
