"""The graph of a pipeline's steps: which step needs which, checked at load.

    - {id: guard, type: policy}
    - {id: classify, type: llm, ...}                  # follows guard: a step without needs: follows the one before
    - {id: context, type: retrieve, needs: [guard]}   # beside classify: both need only guard
    - {id: answer, type: llm, needs: [classify, context]}   # joins them
    - {id: log, type: audit, always: true}            # an always step without needs: waits for every step before it

A chain is the graph where each step needs the one before it, so every chain file is a graph already. A step
with ``fallback: OTHER`` has OTHER run in its place when it fails; OTHER is then only ever a fallback (never
scheduled on its own), runs on its primary's needs, and gives its outputs under the primary's id.

:func:`build_graph` checks the topology (unknown or repeated needs, cycles, fallbacks, streaming) and returns the
graph with each step's ancestors, which the loader's checks of data flow and ``steps.ID`` references read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.diagnostics import suggest


@dataclass(frozen=True, slots=True)
class Node:
    """What the graph needs of one step: its id and how it says what it follows."""

    id: str
    #: None: the step before it (every step before it, for an ``always`` step).
    needs: tuple[str, ...] | None = None
    always: bool = False
    fallback: str | None = None
    stream: bool = False
    #: Whether it has a ``when:`` of its own (an alternative: several such steps may each stream).
    conditional: bool = False
    #: ``repeat.from``: it closes a loop that starts at that step.
    repeat_from: str | None = None


@dataclass(frozen=True, slots=True)
class GraphIssue:
    """A problem of the graph: the step's index in the file, the key it is about, and the message."""

    index: int
    key: tuple[str | int, ...]
    message: str


@dataclass(frozen=True, slots=True)
class Graph:
    """The steps of a pipeline as a graph (only the steps of a file that passed :func:`build_graph`)."""

    #: Every step, in file order.
    ids: tuple[str, ...]
    #: What each step waits for (a fallback step: its primary's).
    deps: dict[str, tuple[str, ...]]
    #: Every step each one runs after, directly or not.
    ancestors: dict[str, frozenset[str]]
    #: The steps in an order that respects ``deps`` (file order where free).
    order: tuple[str, ...]
    #: primary -> the step that runs in its place when it fails.
    fallbacks: dict[str, str]
    #: The steps that say ``stream: true``: their text goes to the client (several only as alternatives, each
    #: with its own ``when:``; the first of them to send text answers).
    streaming: tuple[str, ...] = ()
    #: Loops by the step that closes them: the steps of each, in order (the first is its ``repeat.from``).
    loops: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _loop_of: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._loop_of.update({step: closer for closer, body in self.loops.items() for step in body})

    def loop_of(self, step: str) -> str | None:
        """The step closing the loop *step* runs in, or None."""
        return self._loop_of.get(step)

    @property
    def fallback_only(self) -> frozenset[str]:
        return frozenset(self.fallbacks.values())

    @property
    def is_chain(self) -> bool:
        """Whether each scheduled step needs exactly the one before it (no two can ever run together)."""
        scheduled = [step for step in self.order if step not in self.fallback_only]
        return all(self.deps[step] == ((scheduled[i - 1],) if i else ()) for i, step in enumerate(scheduled))

    def runs_before(self, first: str, then: str) -> bool:
        return first in self.ancestors.get(then, frozenset())

    def ordered(self, a: str, b: str) -> bool:
        """Whether *a* and *b* can never run at the same time (one runs before the other)."""
        return a == b or self.runs_before(a, b) or self.runs_before(b, a)


def build_graph(nodes: Sequence[Node]) -> tuple[Graph | None, list[GraphIssue]]:
    """The graph of *nodes* (in file order), or None with the issues that keep it from being one."""
    issues: list[GraphIssue] = []
    index = {node.id: i for i, node in enumerate(nodes)}
    fallbacks = _fallbacks(nodes, index, issues)
    fallback_only = set(fallbacks.values())
    deps: dict[str, tuple[str, ...]] = {}
    for i, node in enumerate(nodes):
        if node.id in fallback_only:
            if node.needs is not None:
                issues.append(GraphIssue(i, ("needs",), f"step {node.id!r} is the fallback of "
                                         f"{_primary(fallbacks, node.id)!r} and runs in its place, on its needs: "
                                         "remove needs: here"))
            continue
        earlier = [other.id for other in nodes[:i] if other.id not in fallback_only]
        if node.needs is None:
            deps[node.id] = tuple(earlier) if node.always else tuple(earlier[-1:])
        else:
            deps[node.id] = _checked_needs(i, node, index, fallback_only, fallbacks, issues)
    for primary, fallback in fallbacks.items():
        if primary in deps:
            deps[fallback] = deps[primary]
    streaming = [i for i, node in enumerate(nodes) if node.stream]
    for i in streaming[1:] if any(not nodes[i].conditional for i in streaming) else ():
        issues.append(GraphIssue(i, ("stream",), f"{nodes[streaming[0]].id!r} already streams its text to the "
                                 "client: several steps stream only as alternatives, each with a when: of its own "
                                 "(the branches of a switch); remove stream: here or add its when:"))
    for i in streaming:
        if nodes[i].id in fallback_only:
            issues.append(GraphIssue(i, ("stream",), f"step {nodes[i].id!r} is a fallback: it streams when its "
                                     f"primary {_primary(fallbacks, nodes[i].id)!r} does; remove stream: here"))
    cycle = _cycle(nodes, deps)
    if cycle:
        issues.append(GraphIssue(index[cycle[0]], ("needs",), "these steps need each other in a circle: "
                                 + " -> ".join(cycle) + "; remove one of those needs"))
    if issues:
        return None, issues
    order = _order(nodes, deps)
    ancestors = _ancestors(order, deps)
    loops = _loops(nodes, index, order, deps, ancestors, issues)
    if issues:
        return None, issues
    for closer, body in loops.items():  # a step after a loop waits for the whole loop: its last step
        for step in order:
            if step not in body and any(need in body for need in deps[step]):
                deps[step] = tuple(dict.fromkeys(closer if need in body else need for need in deps[step]))
    ancestors = _ancestors(order, deps)
    return Graph(tuple(node.id for node in nodes), deps, ancestors, order, fallbacks,
                 tuple(nodes[i].id for i in streaming), loops), []


def _ancestors(order: Sequence[str], deps: dict[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    found: dict[str, frozenset[str]] = {}
    for step in order:
        found[step] = frozenset().union(*(found[d] | {d} for d in deps[step])) if deps[step] else frozenset()
    return found


def _loops(nodes: Sequence[Node], index: dict[str, int], order: Sequence[str], deps: dict[str, tuple[str, ...]],
           ancestors: dict[str, frozenset[str]], issues: list[GraphIssue]) -> dict[str, tuple[str, ...]]:
    """Each loop's steps: its first, the last (the step with ``repeat:``), and every step between them."""
    loops: dict[str, tuple[str, ...]] = {}
    taken: dict[str, str] = {}
    for i, node in enumerate(nodes):
        first = node.repeat_from
        if first is None:
            continue
        where = ("repeat", "from")
        if first not in index:
            issues.append(GraphIssue(i, where, f"no step {first!r}{suggest(first, list(index))}"))
            continue
        if first != node.id and first not in ancestors.get(node.id, ()):
            issues.append(GraphIssue(i, where, f"the loop runs from {first!r} to {node.id!r}, but {node.id!r} does "
                                     f"not run after {first!r}: add {first!r} to its needs"))
            continue
        body = tuple(step for step in order if step == first or step == node.id or
                     (first in ancestors[step] and step in ancestors[node.id]))
        clash = next((step for step in body if step in taken), None)
        if clash is not None:
            issues.append(GraphIssue(i, ("repeat",), f"step {clash!r} is already in the loop that "
                                     f"{taken[clash]!r} closes: loops neither nest nor overlap"))
            continue
        loops[node.id] = body
        taken |= dict.fromkeys(body, node.id)
    return loops


def _fallbacks(nodes: Sequence[Node], index: dict[str, int], issues: list[GraphIssue]) -> dict[str, str]:
    found: dict[str, str] = {}
    for i, node in enumerate(nodes):
        if node.fallback is None:
            continue
        target = node.fallback
        if target not in index:
            issues.append(GraphIssue(i, ("fallback",), f"no step {target!r}{suggest(target, list(index))} "
                                     f"(steps: {', '.join(index)})"))
        elif target == node.id:
            issues.append(GraphIssue(i, ("fallback",), "a step cannot be its own fallback"))
        elif target in found.values():
            issues.append(GraphIssue(i, ("fallback",), f"step {target!r} is already the fallback of "
                                     f"{_primary(found, target)!r}; give this step a fallback of its own"))
        elif nodes[index[target]].fallback is not None or target in found:
            issues.append(GraphIssue(i, ("fallback",), f"step {target!r} has a fallback of its own or is a "
                                     "primary: a fallback is a plain step; chain no fallbacks"))
        else:
            found[node.id] = target
    return found


def _primary(fallbacks: dict[str, str], fallback: str) -> str:
    return next(primary for primary, target in fallbacks.items() if target == fallback)


def _checked_needs(i: int, node: Node, index: dict[str, int], fallback_only: set[str],
                   fallbacks: dict[str, str], issues: list[GraphIssue]) -> tuple[str, ...]:
    kept: list[str] = []
    for n, need in enumerate(node.needs or ()):
        where = ("needs", n)
        if need not in index:
            issues.append(GraphIssue(i, where, f"no step {need!r}{suggest(need, list(index))} "
                                     f"(steps: {', '.join(index)})"))
        elif need == node.id:
            issues.append(GraphIssue(i, where, "a step cannot need itself"))
        elif need in fallback_only:
            issues.append(GraphIssue(i, where, f"step {need!r} runs only in the place of "
                                     f"{_primary(fallbacks, need)!r}: need {_primary(fallbacks, need)!r}"))
        elif need in kept:
            issues.append(GraphIssue(i, where, f"{need!r} is named twice"))
        else:
            kept.append(need)
    return tuple(kept)


def _cycle(nodes: Sequence[Node], deps: dict[str, tuple[str, ...]]) -> list[str]:
    """A cycle among *deps*, as the steps around it with the first repeated at the end; [] when none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(step: str) -> list[str]:
        state[step] = 1
        path.append(step)
        for need in deps.get(step, ()):
            if state.get(need) == 1:
                return [*path[path.index(need):], need]
            if need not in state and (found := visit(need)):
                return found
        path.pop()
        state[step] = 2
        return []

    for node in nodes:
        if node.id in deps and node.id not in state and (found := visit(node.id)):
            return list(reversed(found))  # in the direction the steps run
    return []


def _order(nodes: Sequence[Node], deps: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    done: list[str] = []
    placed: set[str] = set()
    pending = [node.id for node in nodes if node.id in deps]
    while pending:
        step = next(s for s in pending if all(d in placed for d in deps[s]))
        pending.remove(step)
        placed.add(step)
        done.append(step)
    return tuple(done)
