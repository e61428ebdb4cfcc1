"""The inferline command: exit codes and output."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import __version__
from serving.backends.model_pool import ModelPool
from serving.cli.main import main
from tests.fakes import CALLS, FakeEngine

ROOT = Path(__file__).parents[3]
EXAMPLES = sorted((ROOT / "pipelines").glob("*.yaml"))


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)


def test_examples_validate(capsys):
    assert EXAMPLES, "pipelines/ has no examples"
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.count("ok ") == len(EXAMPLES)


def test_validate_a_folder(capsys):
    assert main(["validate", "pipelines"]) == 0
    assert "ok pipelines/hello.yaml (hello, 1 stages)" in capsys.readouterr().out


def test_validate_a_broken_copy(tmp_path, capsys):
    broken = tmp_path / "hello.yaml"
    text = (ROOT / "pipelines" / "hello.yaml").read_text()
    broken.write_text(text.replace("type: prompt", "type: promtp").replace("system: |", "sytem: |"))
    assert main(["validate", str(broken), "pipelines/hello.yaml"]) == 1
    captured = capsys.readouterr()
    assert "ok pipelines/hello.yaml" in captured.out
    errors = captured.err.splitlines()
    assert errors[0].startswith(f"{broken}:")
    assert ": stages[0].type: unknown stage type 'promtp'; did you mean 'prompt'?" in errors[0]
    assert errors[-1] == "1 of 2 file(s) invalid"


def test_validate_reports_two_files_of_one_name(tmp_path, capsys):
    # serve refuses to start with two pipelines of one name (one endpoint each): validate must say so first.
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("name: support\nstages: [{id: p, type: prompt}]\n")
    second.write_text("# a copy, renamed on disk only\nname:   support\nstages: [{id: p, type: prompt}]\n")
    assert main(["validate", str(tmp_path), str(first)]) == 1  # the same file named twice is no clash
    captured = capsys.readouterr()
    assert captured.out.count(f"ok {first} (support, 1 stages)") == 2 and str(second) not in captured.out
    assert captured.err.splitlines() == [
        f"{second}:2:9: name: pipeline name 'support' is already used by {first}:1:7; give each pipeline its own "
        "name (it is its endpoint, /pipelines/support)",
        "1 of 3 file(s) invalid",
    ]


def test_validate_compiles_a_pipelines_own_output_as_the_engine_would(tmp_path, capsys):
    # Python's re takes a look-behind; the constrained decoder (Rust's regex syntax) does not.
    path = tmp_path / "codes.yaml"
    path.write_text("name: codes\nstages:\n  - {id: prompt, type: prompt}\n  - {id: tok, type: tokenize}\n"
                    "  - id: gen\n    type: generate\n    with:\n      output: {regex: '(?<=#)[0-9]+'}\n"
                    "  - {id: out, type: stream}\n")
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        f"{path}:8:23: stages[2].with.output.regex: constrained decoding cannot compile it: invalid regex "
        "'(?<=#)[0-9]+': look-around, including look-ahead and look-behind, is not supported")


def test_validate_a_missing_file(capsys):
    assert main(["validate", "pipelines/nope.yaml"]) == 1
    assert "pipelines/nope.yaml: cannot read: No such file or directory" in capsys.readouterr().err


def test_run_prints_messages_and_trace(capsys):
    assert main(["run", "hello", "--input", "Hi there", "--trace"]) == 0
    captured = capsys.readouterr()
    assert "[user] Hi there" in captured.out
    lines = captured.err.splitlines()
    assert lines[0] == "(no stage streamed text; the messages the pipeline built:)"
    assert lines[1].split() == ["stage", "type", "status", "start", "ms", "ms", "tokens", "cost", "usd"]
    assert lines[2].split()[:3] == ["prompt", "prompt", "ok"]
    assert "trace " in captured.err and "cost 0.000000 usd" in captured.err


def test_run_streams_text_from_a_plugin_stage(tmp_path, capsys):
    (tmp_path / "cliplugin.py").write_text(
        "from pipeline.stage import Stage\n"
        "class Shout(Stage):\n"
        "    type_name = 'shout'\n"
        "    async def run(self, ctx, scope):\n"
        "        for word in ctx.input.split():\n"
        "            await scope.emit_text(word.upper() + ' ')\n"
        "        scope.add_cost(0.5, 'other')\n")
    (tmp_path / "inferline.yaml").write_text(f"plugins: ['cliplugin:Shout']\npipelines: {tmp_path}\n")
    (tmp_path / "loud.yaml").write_text("name: loud\nstages: [{id: s, type: shout}]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["run", "loud", "--input", "make it loud", "--trace", "--config", str(tmp_path / "inferline.yaml")])
    finally:
        sys.path.remove(str(tmp_path))
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out == "MAKE IT LOUD \n"
    assert "cost 0.500000 usd" in captured.err


def test_run_unknown_pipeline(capsys):
    assert main(["run", "nope", "--input", "x"]) == 1
    assert "no pipeline 'nope'" in capsys.readouterr().err


# --- run: by name, tags, messages, params and the trace, over fake models -----------------------

ROUTED = """
name: support-answer
stages:
  - {id: first, type: record}
  - {id: prompt, type: prompt}
  - id: pick
    type: route
    with: {rules: [{when: "tags.tier == 'gold'", model: big}], default: smol}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0, client_params: [max_tokens, temperature]}}
  - {id: out, type: stream}
"""


class ClosingFake(FakeEngine):
    async def aclose(self) -> None:
        pass


@pytest.fixture
def fake_models(monkeypatch) -> dict[str, tuple[ClosingFake, list[str]]]:
    """Each model the pool starts: a fake that answers with its name, and the stages run before it started."""
    started: dict[str, tuple[ClosingFake, list[str]]] = {}

    async def start(pool, name):
        started[name] = (ClosingFake(f"reply from {name}."), list(CALLS))
        return started[name][0]

    monkeypatch.setattr(ModelPool, "_start", start)
    CALLS.clear()
    return started


@pytest.fixture
def routed_config(tmp_path) -> str:
    """A server with two models, and support-answer in answers.yaml: its name is not its file name."""
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "answers.yaml").write_text(textwrap.dedent(ROUTED))
    (tmp_path / "inferline.yaml").write_text(
        "plugins: ['tests.fakes:RecordStage']\npipelines: pipelines/\n"
        f"database: sqlite:///{tmp_path / 'run.db'}\n"
        "models:\n  smol: {source: models/none}\n  big: {source: models/none}\n")
    return str(tmp_path / "inferline.yaml")


@pytest.mark.parametrize("pipeline", ["support-answer", "answers"])
def test_run_finds_a_pipeline_by_its_name_or_its_file_name(pipeline, routed_config, fake_models, capsys):
    assert main(["run", pipeline, "--input", "Hi", "--config", routed_config]) == 0
    assert capsys.readouterr().out == "reply from smol.\n"


def test_run_by_an_ambiguous_or_unknown_name_says_what_exists(routed_config, fake_models, capsys):
    folder = Path(routed_config).parent / "pipelines"
    (folder / "support-answer.yaml").write_text(textwrap.dedent(ROUTED).replace("support-answer", "other"))
    assert main(["run", "support-answer", "--input", "Hi", "--config", routed_config]) == 1
    err = capsys.readouterr().err
    assert "pipeline 'support-answer' is ambiguous" in err
    assert "answers.yaml (name: support-answer) and support-answer.yaml (name: other)" in err
    assert main(["run", "nope", "--input", "Hi", "--config", routed_config]) == 1
    assert "no pipeline 'nope'" in (err := capsys.readouterr().err)
    assert "(there: support-answer (answers.yaml), other (support-answer.yaml))" in err
    assert not fake_models


def test_run_with_a_tag_takes_the_route_rule_on_tags(routed_config, fake_models, capsys):
    assert main(["run", "support-answer", "--input", "Hi", "--tag", "tier=gold", "--config", routed_config]) == 0
    assert capsys.readouterr().out == "reply from big.\n"
    assert main(["run", "support-answer", "--input", "Hi", "--tag", "tier=silver", "--config", routed_config]) == 0
    assert capsys.readouterr().out == "reply from smol.\n"


def test_run_with_messages_and_params(routed_config, fake_models, capsys):
    assert main(["run", "support-answer", "--message", "system:Answer in French.", "--message", "user:Hello!",
                 "--param", "max_tokens=5", "--param", "temperature=0.5", "--config", routed_config]) == 0
    assert capsys.readouterr().out == "reply\n"  # the first five tokens (bytes) of the fake's answer
    [(prompt_ids, sampling, _)] = fake_models["smol"][0].submitted
    assert (sampling.max_tokens, sampling.temperature) == (5, 0.5)
    assert b"<system>Answer in French.<user>Hello!" in bytes(prompt_ids)


@pytest.mark.parametrize(("argv", "error"), [
    (["--param", "foo=1"], "--param foo: unknown parameter; known: max_tokens, temperature, top_p, top_k, seed"),
    (["--param", "temperature=hot"], "--param temperature: Input should be a valid number"),
    (["--param", "max_tokens=0"], "--param max_tokens: Input should be greater than or equal to 1"),
    (["--tag", "tier"], "--tag 'tier': expected KEY=VALUE, e.g. --tag tier=gold"),
    (["--message", "robot:Hi"], "--message 1: role: Input should be 'system', 'user' or 'assistant'"),
    (["--message", "system:Be brief."], "'messages' needs at least one user message"),
])
def test_run_refuses_what_the_http_api_refuses(argv, error, routed_config, fake_models, capsys):
    given = [] if "--message" in argv else ["--input", "Hi"]
    assert main(["run", "support-answer", *given, *argv, "--config", routed_config]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"inferline run: {error}") and len(err.splitlines()) == 1
    assert not fake_models and not CALLS  # refused before anything ran


def test_run_with_a_param_the_pipeline_does_not_take(routed_config, fake_models, capsys):
    assert main(["run", "support-answer", "--input", "Hi", "--param", "top_p=0.5", "--config", routed_config]) == 1
    assert "this pipeline does not let callers set ['top_p']" in capsys.readouterr().err


def test_run_trace_shows_model_loading_as_rows_of_its_own(routed_config, fake_models, capsys):
    assert main(["run", "support-answer", "--input", "Hi", "--trace", "--config", routed_config]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].split() == ["stage", "type", "status", "start", "ms", "ms", "tokens", "cost", "usd"]
    loads = {line.split()[0]: line.split() for line in lines[1:3]}
    assert set(loads) == {"smol", "big"}  # every model the route may pick
    assert all(row[1:4] == ["load", "ok", "-"] for row in loads.values())
    assert [line.split()[0] for line in lines[3:-1]] == ["first", "prompt", "pick", "tok", "gen", "out"]
    assert "ms (model loading before it: " in lines[-1]
    assert all(before == [] for _, before in fake_models.values())  # started before the request's first stage


def test_bad_server_config(tmp_path, capsys):
    config = tmp_path / "inferline.yaml"
    config.write_text("modles: {}\n")
    assert main(["validate", "pipelines", "--config", str(config)]) == 1
    assert f"{config}:1:1: modles: unknown key 'modles'; did you mean 'models'?" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: inferline" in capsys.readouterr().err


def test_console_script_version_and_help():
    exe = Path(sys.executable).with_name("inferline")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"inferline {__version__}"
    for command in (["--help"], ["validate", "--help"], ["run", "--help"]):
        result = subprocess.run([exe, *command], capture_output=True, text=True, check=True)
        assert result.stdout.startswith("usage: inferline")


def test_the_command_line_imports_no_model_library_until_a_command_needs_one():
    """`inferline --help`, `keys` and `audit` start without torch, transformers or llguidance (about 4 s of
    imports on 2 cores): each command imports what it runs when it runs."""
    heavy = ("torch", "transformers", "llguidance", "litestar", "faiss")
    code = f"import sys; import serving.cli.main; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_run_chat_streams_a_real_answer():
    exe = Path(sys.executable).with_name("inferline")
    result = subprocess.run([exe, "run", "pipelines/chat.yaml", "--input", "What is the capital of France?",
                             "--trace"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    rows = {line.split()[0]: line.split() for line in result.stderr.splitlines() if line.strip()}
    assert [rows[s][2] for s in ("prompt", "tok", "gen", "out")] == ["ok"] * 4
    assert rows["smol"][1:4] == ["load", "ok", "-"]  # the model's loading: a row of its own, before the request
    assert float(rows["out"][6]) > 0 and rows["out"][5] != "-"  # its tokens, and the default model's price
