"""The graph of a pipeline's steps: default needs, joins, fallbacks, and every topology error."""

from __future__ import annotations

import pytest

from pipeline.graph import Node, build_graph


def graph(*nodes: Node):
    built, issues = build_graph(nodes)
    assert not issues, issues
    return built


def test_a_chain_is_a_graph_whose_steps_each_need_the_one_before():
    chain = graph(Node("a"), Node("b"), Node("c"))
    assert chain.deps == {"a": (), "b": ("a",), "c": ("b",)} and chain.is_chain
    assert chain.ancestors["c"] == {"a", "b"} and chain.order == ("a", "b", "c")


def test_needs_lets_steps_run_side_by_side_and_join():
    built = graph(Node("guard"), Node("classify"), Node("context", needs=("guard",)),
                  Node("answer", needs=("classify", "context")), Node("log", always=True))
    assert not built.is_chain
    assert not built.ordered("classify", "context") and built.ordered("guard", "answer")
    assert built.deps["log"] == ("guard", "classify", "context", "answer")  # always: waits for every step before
    assert built.ancestors["answer"] == {"guard", "classify", "context"}


def test_a_step_may_need_a_later_one_in_the_file():
    built = graph(Node("b", needs=("a",)), Node("a", needs=()))
    assert built.order == ("a", "b")


def test_alternatives_may_each_stream():
    built = graph(Node("a"), Node("b", stream=True, conditional=True), Node("c", needs=("a",), stream=True,
                                                                           conditional=True))
    assert built.streaming == ("b", "c")


def test_a_fallback_runs_on_its_primarys_needs_and_only_in_its_place():
    built = graph(Node("prompt"), Node("answer", fallback="backup"), Node("backup"), Node("out"))
    assert built.fallbacks == {"answer": "backup"} and built.fallback_only == {"backup"}
    assert built.deps["backup"] == ("prompt",) and built.deps["out"] == ("answer",)  # not the fallback


@pytest.mark.parametrize(("nodes", "index", "key", "message"), [
    ((Node("a"), Node("b", needs=("c",))), 1, ("needs", 0), "no step 'c' (steps: a, b)"),
    ((Node("guard"), Node("b", needs=("gaurd",))), 1, ("needs", 0), "no step 'gaurd'; did you mean 'guard'?"),
    ((Node("a", needs=("a",)),), 0, ("needs", 0), "a step cannot need itself"),
    ((Node("a"), Node("b", needs=("a", "a"))), 1, ("needs", 1), "'a' is named twice"),
    ((Node("a", needs=("c",)), Node("b", needs=("a",)), Node("c", needs=("b",))), 0, ("needs",),
     "these steps need each other in a circle: a -> b -> c -> a; remove one of those needs"),
    ((Node("a", stream=True), Node("b", stream=True)), 1, ("stream",), "several steps stream only as alternatives"),
    ((Node("a", fallback="x"),), 0, ("fallback",), "no step 'x'"),
    ((Node("a", fallback="a"),), 0, ("fallback",), "cannot be its own fallback"),
    ((Node("a", fallback="c"), Node("b", fallback="c"), Node("c")), 1, ("fallback",), "already the fallback of 'a'"),
    ((Node("a", fallback="b"), Node("b", needs=())), 1, ("needs",), "runs in its place, on its needs"),
    ((Node("a", fallback="b"), Node("b"), Node("c", needs=("b",))), 2, ("needs", 0), "need 'a'"),
])
def test_topology_errors_name_the_step_and_the_fix(nodes, index, key, message):
    built, issues = build_graph(nodes)
    assert built is None
    assert [(i.index, i.key) for i in issues][:1] == [(index, key)] and message in issues[0].message, issues
