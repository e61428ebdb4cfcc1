"""The inferline command: exit codes and output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import __version__
from serving.cli import main

ROOT = Path(__file__).parents[2]
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
    assert lines[1].split() == ["stage", "type", "status", "start", "ms", "ms", "cost", "usd"]
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


@pytest.mark.slow
def test_run_chat_streams_a_real_answer():
    exe = Path(sys.executable).with_name("inferline")
    result = subprocess.run([exe, "run", "pipelines/chat.yaml", "--input", "What is the capital of France?",
                             "--trace"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    rows = {line.split()[0]: line.split() for line in result.stderr.splitlines() if line.strip()}
    assert [rows[s][2] for s in ("prompt", "tok", "gen", "out")] == ["ok"] * 4
    assert float(rows["out"][5]) > 0  # token and compute cost of the default model's price
