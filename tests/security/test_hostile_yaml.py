"""hypothesis over the YAML loaders: any text gives a valid spec or a located SpecError, nothing else.

Four kinds of input: arbitrary text (control characters, BOMs, odd line breaks); YAML built from
hostile fragments (anchors and aliases, merge keys, tags, bad timestamps, deep nesting); the shipped
pipelines with characters inserted and deleted; and well-formed YAML of random mappings over the
spec's own keys. Each error must read ``file:line:col: ...`` with a line inside the file.
``$RELIABILITY_HYPOTHESIS_EXAMPLES`` examples per kind (200 here; ``make reliability`` runs 2,000).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.errors import SpecError
from pipeline.loader import LoadedPipeline, load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo
from serving.config.loader import load_server

EXAMPLES = int(os.environ.get("RELIABILITY_HYPOTHESIS_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ROOT = Path(__file__).parents[2]
SHIPPED = [path.read_text() for path in sorted((ROOT / "pipelines").glob("*.yaml"))]
LOCATED = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): ")

FRAGMENTS = [
    "name: chat\n", "name: ../../etc\n", "name: {a: 1}\n", "stages:\n", "stages: 7\n", "  - {id: p, type: prompt}\n",
    "  - id: g\n    type: generate\n    with: {max_tokens: ten}\n", "  - {id: p, type: ../x}\n", "    when: \"a ==\"\n",
    "    when: \"__import__('os')\"\n", "    with: {index: ../../etc}\n", "&a [1, 2]\n", "*a\n", "b: &b {c: *b}\n",
    "<<: *a\n", "<<: [*a, *b]\n", "!!python/object:os.system {}\n", "!!binary AAAA\n", "x: !!timestamp 2001-13-45\n",
    "x: 2001-13-45\n", "x: 2001-02-30 25:61:61\n", "!!float nan\n", "x: .inf\n", "x: 0x\n", "x: 0o9\n", "? [a]\n: b\n",
    "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "---\n", "...\n", "\t", "\x00", "\x07", "\x85", "\u2028", "\ufeff",
    "\udcff", "'", '"', "[" * 50, "{" * 50, "- " * 40, "'\\u0000'", "x: \"\\ud800\"\n", "@", "`", "|\n", ">-\n",
    "key: value\nkey: again\n", ": :\n", "- - - -\n", "\r\n", "\r",
    "    when: \"role = 'x' && !y || z\"\n", "    when: \"prompt_tokens > '5'\"\n", "access: {roles: [callers]}\n",
    "stages: []\n", "    with: {output: {json_schema: {type: numbr, properties: 7}}}\n",
    "    with: {output: {regex: '(?<=a)b'}}\n",
]

SPEC_KEYS = ["name", "description", "version", "access", "roles", "stages", "id", "type", "with", "when", "always",
             "on_error", "timeout_s", "slo", "max_tokens", "system", "index", "top_k", "rules", "default", "fallback"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["prompt", "generate", "stream", "audit", "chat", "../x"]))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(SPEC_KEYS) | st.text(max_size=8), inner, max_size=5)),
    max_leaves=30)


def check(text: str, file: str = "p.yaml") -> None:
    """The property: a LoadedPipeline, or a SpecError whose every issue is located inside *text*."""
    try:
        loaded = load_pipeline_text(text, file, registry(), None)
    except SpecError as exc:
        assert_located(exc, file, text)
    else:
        assert isinstance(loaded, LoadedPipeline)


def assert_located(exc: SpecError, file: str, text: str) -> None:
    assert exc.issues, "a SpecError without issues"
    num_lines = max(1, len(text.splitlines()) + 1)
    for issue in exc.issues:
        assert issue.file == file and 1 <= issue.line <= num_lines + 1 and issue.col >= 1, issue
        assert LOCATED.match(str(issue)) and "\n" not in str(issue), str(issue)  # one line: file:line:col: ...


_REGISTRY = None


def registry():
    global _REGISTRY
    if _REGISTRY is None:
        from pipeline.registry import StageRegistry
        from stages import register_builtins

        _REGISTRY = register_builtins(StageRegistry())
    return _REGISTRY


@FUZZ
@given(st.text())
@example("\x07")
@example("a: b\x85c")
@example("[" * 5000 + "]" * 5000)
@example("a:\n" + "".join("  " * i + "b:\n" for i in range(1, 400)))
@example("x: 2001-13-45")
@example("a: &a [*a, *a]\nname: *a")
def test_any_text(text):
    check(text)


def laughs(levels: int, width: int = 9) -> str:
    """The "billion laughs": each anchor a list of *width* aliases of the one before."""
    lines = ["l0: &l0 [lol]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join([*lines, f"name: *l{levels - 1}", "stages: []"])


@pytest.mark.parametrize("text", [laughs(9), "a: &a [*a]\nname: *a", "a: &a {b: *a}\nstages: [*a]",
                                  "- " * 2000 + "x", "stages: " + "[" * 3000,
                                  "name: x\nstages: [{id: p, type: prompt, when: '" + "not " * 3000 + "input'}]\n"])
def test_alias_bombs_and_deep_documents_are_located_errors(text):
    with pytest.raises(SpecError) as raised:
        load_pipeline_text(text, "p.yaml", registry(), None)
    assert_located(raised.value, "p.yaml", text)


def test_a_large_document_without_alias_bombs_loads():
    """The alias limit counts what aliases add: a file that is large by itself (here 120,000 values, one
    small alias among them) loads; it was refused as an alias bomb."""
    ids = ", ".join(["7"] * 120_000)
    text = ("name: big\ndescription: &d Stops on many tokens.\nversion: *d\nstages:\n  - {id: p, type: prompt}\n"
            f"  - {{id: t, type: tokenize}}\n  - {{id: g, type: generate, with: {{stop_token_ids: [{ids}]}}}}\n"
            "  - {id: s, type: stream}\n")
    loaded = load_pipeline_text(text, "p.yaml", registry(), Catalog(models={"smol": ModelInfo("smol")}))
    assert len(loaded.plans[2].config.stop_token_ids) == 120_000 and loaded.spec.version == "Stops on many tokens."


@FUZZ
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join))
def test_hostile_fragments(text):
    check(text)


@FUZZ
@given(st.sampled_from(SHIPPED), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3),
                                                    st.sampled_from(FRAGMENTS)), max_size=4))
def test_mutated_shipped_pipelines(text, edits):
    for position, cut, insert in edits:
        at = position % (len(text) + 1)
        text = text[:at] + insert + text[at + cut:]
    check(text)


@FUZZ
@given(documents)
def test_random_mappings_over_the_spec_keys(document):
    check(yaml.safe_dump(document, allow_unicode=True))


SERVER_FRAGMENTS = [*FRAGMENTS, "models:\n", "  smol: {source: x}\n", "indexes: {'../x': {}}\n",
                    "http: {port: -1}\n", "auth: {enabled: maybe}\n"]


@FUZZ
@given(st.one_of(st.text(), st.lists(st.sampled_from(SERVER_FRAGMENTS), max_size=20).map("".join)))
@example("indexes:\n  ../../etc: {}\n")
def test_the_server_config_loader(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "inferline.yaml"
    try:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    except UnicodeEncodeError:  # pragma: no cover - surrogatepass writes every str
        pytest.skip("not writable")
    try:
        load_server(path)
    except SpecError as exc:
        assert_located(exc, str(path), path.read_text(encoding="utf-8", errors="replace"))
