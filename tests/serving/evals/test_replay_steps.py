"""``inferline replay`` by step: a recorded ``draft_check`` request replayed through candidates that change one
step, reusing the recorded outputs of the steps they did not change (fake engines, the in-process app)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from serving.cli.replay import read_records
from serving.evals.replay import replay, summarize_replay
from serving.evals.replay_steps import short_diff
from serving.runtime.workspace import Workspace, open_workspace
from serving.server import create_server
from store.audit import AuditFilters
from tests.fakes import FakeEngine, FakeEngines, FakeStream
from tests.serving.workspaces import write_workspace

ROOT = Path(__file__).parents[3]
DRAFT_CHECK = (ROOT / "pipelines" / "draft_check.yaml").read_text()
QUESTIONS = ("Can I get my money back?", "Where is my parcel?")
DRAFT = "You can ask for a refund in Settings, and we answer within a day."
#: Each step's answer, by a phrase of its prompt (the first that matches): the redraft's system prompt starts
#: as the draft's, so it comes first; ``strictly`` and ``one sentence`` are the candidates' new prompts.
SCRIPT = (("A reviewer rejected", "Please write to billing@lumen.example."),
          ("strictly", '{"passed": false, "reasons": "it promises a date"}'),
          ("You review", '{"passed": true, "reasons": "fine"}'),
          ("one sentence", "Refunds are in Settings."),
          ("Lumen's support team", DRAFT))


class ScriptedEngine(FakeEngine):
    """Answers each prompt by the first phrase of :data:`SCRIPT` in it; keeps every prompt it was sent."""

    def __init__(self):
        super().__init__()
        self.prompts: list[str] = []

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        prompt = bytes(prompt_ids).decode(errors="replace")
        self.prompts.append(prompt)
        reply = next(reply for phrase, reply in SCRIPT if phrase in prompt)
        stream = FakeStream(reply.encode(), len(prompt_ids), sampling.max_tokens)
        self.streams.append(stream)
        return stream

    def drafts(self) -> int:
        """How many first drafts it wrote (not a redraft, not a judgement)."""
        return sum("You review" not in p and "strictly" not in p and "A reviewer" not in p for p in self.prompts)


def recorded(tmp_path, monkeypatch) -> Workspace:
    """``draft_check`` served twice through the in-process app and audited in full (the judge passes both
    drafts), and once by a copy that keeps only hashes (``hashed``)."""
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "draft_check.yaml").write_text(DRAFT_CHECK)
    (tmp_path / "pipelines" / "hashed.yaml").write_text(
        DRAFT_CHECK.replace("name: draft_check", "name: hashed").replace("content: full", "content: hash"))
    workspace = open_workspace(str(config))
    with TestClient(create_server(workspace, engines=FakeEngines(smol=ScriptedEngine()))) as client:
        for question in QUESTIONS:
            assert client.post("/pipelines/draft_check", json={"input": question}).json()["output"] == DRAFT
        assert client.post("/pipelines/hashed", json={"input": QUESTIONS[0]}).status_code == 200
    return workspace


def candidate(workspace: Workspace, tmp_path, old: str, new: str, name: str = "draft_check"):
    """``draft_check`` with *old* replaced by *new*, as pipeline *name*."""
    path = tmp_path / "candidate.yaml"
    assert old in DRAFT_CHECK
    path.write_text(DRAFT_CHECK.replace(old, new).replace("name: draft_check", f"name: {name}"))
    return workspace.load_pipeline(path)


def by_step(result) -> dict[str, dict]:
    return {step["step"]: step for step in result["steps"]}


#: The judge's prompt made stricter: the fake judge then fails both drafts, so the redraft runs.
STRICTER = ("You review a support answer", "You strictly review a support answer")


async def test_a_changed_judge_reruns_the_judge_and_what_follows_and_reuses_the_draft(tmp_path, monkeypatch):
    """Before replay by step, every step ran again: the draft was written anew, at its full cost."""
    workspace = recorded(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(pipeline="draft_check"), 100,
                                    with_stages=True)
    engine = ScriptedEngine()
    results = await replay(workspace, candidate(workspace, tmp_path, *STRICTER), records,
                           engines=FakeEngines(smol=engine))
    assert len(results) == 2 and engine.drafts() == 0  # no draft written again
    for result in results:
        steps = by_step(result)
        draft = steps["draft"]
        assert draft["run"] == "reused" and draft["identical"] and draft["new"]["output"] == DRAFT
        assert draft["new"]["cost_usd"] == 0 and draft["new"]["output_tokens"] == 0 and draft["old"]["cost_usd"] > 0
        assert steps["judge"]["run"] == "rerun" and not steps["judge"]["identical"]
        assert steps["judge"]["diff"] == '{"passed": [-true,-] {+false,+} "reasons": [-"fine"}-] {+"it promises a ' \
                                         'date"}+}'
        assert steps["redraft"]["run"] == "rerun" and steps["accepted"]["run"] == "skipped"
        assert result["new"]["output"] == "Please write to billing@lumen.example." and not result["identical"]
        assert result["reuse"]["mode"] == "step" and result["reuse"]["reused"] == 1
        assert result["reuse"]["saved"]["cost_usd"] == draft["old"]["cost_usd"]
        assert result["reuse"]["saved"]["output_tokens"] == draft["old"]["output_tokens"] > 0
    totals = summarize_replay(results, skipped)
    assert totals["steps"]["reused"] == 2 and totals["steps"]["saved"]["cost_usd"] == pytest.approx(
        sum(by_step(r)["draft"]["old"]["cost_usd"] for r in results))

    engine = ScriptedEngine()  # --full: both model steps again, the draft at its cost
    full = await replay(workspace, candidate(workspace, tmp_path, *STRICTER), records,
                        engines=FakeEngines(smol=engine), full=True)
    assert engine.drafts() == 2
    for result in full:
        draft = by_step(result)["draft"]
        assert draft["run"] == "rerun" and draft["identical"] and draft["new"]["cost_usd"] == draft["old"]["cost_usd"]
        assert by_step(result)["judge"]["run"] == "rerun"
        assert result["reuse"] == {"mode": "full", "reused": 0, "rerun": 4, "skipped": 1,
                                   "saved": {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0, "duration_ms": 0}}
    assert [r["new"]["output"] for r in full] == [r["new"]["output"] for r in results]


async def test_a_changed_first_step_reruns_everything(tmp_path, monkeypatch):
    workspace = recorded(tmp_path, monkeypatch)
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline="draft_check"), 100, with_stages=True)
    engine = ScriptedEngine()
    shorter = candidate(workspace, tmp_path, "Answer the customer in at most three sentences.\"",
                        "Answer the customer in one sentence.\"")
    results = await replay(workspace, shorter, records, engines=FakeEngines(smol=engine))
    assert engine.drafts() == 2
    for result in results:
        steps = by_step(result)
        assert {step["run"] for step in steps.values()} == {"rerun", "skipped"}, steps
        assert steps["draft"]["diff"] and steps["accepted"]["run"] == "rerun"  # a new draft, judged and sent
        assert result["new"]["output"] == "Refunds are in Settings." and result["reuse"]["reused"] == 0


async def test_an_unchanged_candidate_reuses_every_step_it_can(tmp_path, monkeypatch):
    workspace = recorded(tmp_path, monkeypatch)
    records, _ = read_records(workspace.database_url, AuditFilters(pipeline="draft_check"), 100, with_stages=True)
    engine = ScriptedEngine()
    same = workspace.load_pipeline(workspace.pipelines_dir / "draft_check.yaml")
    results = await replay(workspace, same, records, engines=FakeEngines(smol=engine))
    assert not engine.prompts and all(r["identical"] for r in results)  # no model call at all
    assert {s["step"]: s["run"] for s in results[0]["steps"]} == {
        "draft": "reused", "judge": "reused", "accepted": "reused", "redraft": "skipped", "log": "rerun"}


async def test_a_record_that_keeps_hashes_tells_which_steps_changed_and_reuses_nothing(tmp_path, monkeypatch):
    workspace = recorded(tmp_path, monkeypatch)
    records, skipped = read_records(workspace.database_url, AuditFilters(pipeline="hashed"), 100, with_stages=True)
    assert not records and [s["why"] for s in skipped] == ["content kept as hash"]
    hashed = candidate(workspace, tmp_path, *STRICTER, name="hashed")
    assert await replay(workspace, hashed, records, engines=FakeEngines(smol=ScriptedEngine()),
                        skipped=skipped) == []
    entry = skipped[0]
    assert entry["steps"] == {"changed": ["judge"], "added": [], "removed": [], "after": ["accepted", "redraft"],
                              "unchanged": ["draft"], "not_run": []}
    assert "content: hash" in entry["reuse"] and "cannot be reused" in entry["reuse"] and "stages" not in entry
    assert summarize_replay([], skipped)["steps"]["changes_only"] == 1


def test_the_command_line_shows_each_step_and_what_reuse_saved(tmp_path, monkeypatch, capsys):
    from serving.cli.main import main
    from serving.evals import replay as replay_module

    workspace = recorded(tmp_path, monkeypatch)

    async def over_fakes(*args, **kwargs):  # the command over the fake model instead of the config's
        return await replay(*args, **kwargs, engines=FakeEngines(smol=ScriptedEngine()))

    monkeypatch.setattr(replay_module, "replay", over_fakes)
    config = str(workspace.root / "inferline.yaml")
    stricter = tmp_path / "stricter.yaml"
    stricter.write_text(DRAFT_CHECK.replace(*STRICTER))
    report = tmp_path / "replay.html"
    assert main(["replay", "draft_check", "--candidate", str(stricter), "--config", config, "--format", "table",
                 "--html", str(report)]) == 1
    out, err = capsys.readouterr()
    lines = [line.split() for line in out.splitlines()]
    steps = [line[:2] for line in lines if line[0] in ("draft", "judge")]
    assert steps == [["draft", "reused"], ["judge", "rerun"]] * 2
    assert "steps 2 reused, 6 rerun, 2 skipped; reusing saved" in err
    page = report.read_text()
    assert page.count('<tr class="steps">') == 2 and "<del>true,</del> <ins>false,</ins>" in page

    assert main(["replay", "draft_check", "--candidate", str(stricter), "--config", config, "--format", "jsonl",
                 "--full"]) == 1
    out, err = capsys.readouterr()
    results = [json.loads(line) for line in out.splitlines()]
    assert all(by_step(r)["draft"]["run"] == "rerun" for r in results) and "(--full: every step rerun)" in err

    hashed = tmp_path / "hashed.yaml"
    hashed.write_text(DRAFT_CHECK.replace(*STRICTER).replace("name: draft_check", "name: hashed"))
    assert main(["replay", "hashed", "--candidate", str(hashed), "--config", config, "--format", "jsonl"]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["skipped"] == "content kept as hash" and line["steps"]["changed"] == ["judge"]
    assert main(["replay", "hashed", "--candidate", str(hashed), "--config", config, "--format", "table"]) == 0
    out = capsys.readouterr().out
    assert "content kept as hash; steps changed: judge; after them: accepted, redraft; unchanged: draft" in out


def test_a_short_diff_marks_the_words_that_changed_with_a_little_context():
    assert short_diff("same", "same") == ""
    old = "one two three four five six seven eight nine ten eleven twelve"
    assert short_diff(old, old.replace("six", "6")) == "… two three four five [-six-] {+6+} seven eight nine ten …"
    assert short_diff("a  b", "a b") == "(only the spacing differs)"
    assert len(short_diff("x " * 300, "y " * 300)) == 240
