"""YAML with source positions: parse once, then point at any ``loc`` path.

PyYAML's composed node tree keeps a mark (line, column) on every node, which
is what lets a validation error deep in ``stages[2].with.top_k`` name the line
and column the user has to fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from pipeline.errors import SpecIssue

Loc = Sequence[str | int]


@dataclass(slots=True)
class YamlSource:
    """A parsed YAML document and the node tree it came from."""

    file: str
    text: str
    data: Any
    root: yaml.Node | None

    def issue(self, loc: Loc, message: str, *, at_key: bool = False) -> SpecIssue:
        """A :class:`SpecIssue` located at *loc* (at the key itself when *at_key*)."""
        line, col = self.position(loc, at_key=at_key)
        return SpecIssue(self.file, line, col, format_loc(loc), message)

    def position(self, loc: Loc, *, at_key: bool = False) -> tuple[int, int]:
        """1-based line and column of the deepest node on *loc* that exists."""
        node = self.root
        if node is None:
            return 1, 1
        mark = node.start_mark
        for step in loc:
            child, key_node = _child(node, step)
            if child is None:
                break
            node = child
            mark = key_node.start_mark if (at_key and key_node is not None) else child.start_mark
        return mark.line + 1, mark.column + 1

    def char_at(self, line: int, col: int) -> str:
        """The character at 1-based *line* and *col*, or ``''``."""
        lines = self.text.splitlines()
        if 0 < line <= len(lines) and 0 < col <= len(lines[line - 1]):
            return lines[line - 1][col - 1]
        return ""


#: Values that aliases may add to a document ("billion laughs": aliases of aliases) before it is refused.
MAX_EXPANDED_NODES = 100_000


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false are booleans. YAML 1.1 reads yes, no,
    on and off as booleans too, so a step's ``retry: {on: [error]}`` had the key True (and a country code NO
    read as false); editors, which speak YAML 1.2, read them as the strings they are."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def parse(file: str, text: str) -> tuple[YamlSource | None, list[SpecIssue]]:
    """Parse *text*; on a syntax error return no source and the located issue."""
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:  # a control character: refused before any parsing
        return None, [_reader_issue(file, text, exc)]
    try:
        root = loader.get_single_node()
        if root is not None and (problem := _structure_issue(file, root)) is not None:
            return None, [problem]
        issues = [] if root is None else _duplicate_keys(file, root)
        data = None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        return None, [SpecIssue(file, line, col, "", f"YAML syntax error: {problem}{context}")]
    except yaml.reader.ReaderError as exc:
        return None, [_reader_issue(file, text, exc)]
    except RecursionError:
        mark = loader.get_mark()
        return None, [SpecIssue(file, mark.line + 1, mark.column + 1, "",
                                "YAML syntax error: the document nests too deeply")]
    except (ValueError, TypeError, OverflowError) as exc:  # a scalar the constructors refuse: 2001-13-45
        node = _unconstructible(loader, root)  # type: ignore[arg-type]
        mark = node.start_mark if node is not None else loader.get_mark()
        return None, [SpecIssue(file, mark.line + 1, mark.column + 1, "", f"YAML value cannot be read: {exc}")]
    finally:
        loader.dispose()
    return YamlSource(file, text, data, root), issues


def _reader_issue(file: str, text: str, exc: yaml.reader.ReaderError) -> SpecIssue:
    before = text[:exc.position]
    line, col = before.count("\n") + 1, exc.position - (before.rfind("\n") + 1) + 1
    return SpecIssue(file, line, col, "", f"YAML syntax error: unacceptable character #x{exc.character:04x} "
                                          f"(control characters are not allowed; remove it)")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _structure_issue(file: str, root: yaml.Node) -> SpecIssue | None:
    """An alias that contains itself, or aliases that add more than MAX_EXPANDED_NODES values to the
    document: what the later steps, which walk the document as a tree, would never finish. A document
    without aliases is walked in time linear in its text, however large."""
    limit = _num_nodes(root) + MAX_EXPANDED_NODES  # past this many values, aliases added the rest
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # post-order, without recursion: the depth is the document's
        node, children_done = stack.pop()
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = min(limit + 1, 1 + sum(sizes[id(c)] for c in _children(node)))
            if sizes[id(node)] > limit:
                mark = node.start_mark
                return SpecIssue(file, mark.line + 1, mark.column + 1, "", "YAML aliases expand to more than "
                                 f"{MAX_EXPANDED_NODES:,} values beyond the document's own; write the values out or "
                                 "use fewer aliases")
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            mark = node.start_mark
            return SpecIssue(file, mark.line + 1, mark.column + 1, "", "YAML alias refers to itself (a recursive "
                             "anchor); a spec is a tree")
        on_path.add(id(node))
        stack.append((node, True))
        stack += [(child, False) for child in _children(node) if id(child) not in sizes]
    return None


def _num_nodes(root: yaml.Node) -> int:
    """How many distinct nodes the document has: its own values, each alias's target counted once."""
    seen = {id(root)}
    stack = [root]
    while stack:
        for child in _children(stack.pop()):
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return len(seen)


def _unconstructible(loader: yaml.SafeLoader, root: yaml.Node) -> yaml.Node | None:
    """The first scalar the safe constructors refuse, to point at it."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.ScalarNode):
            loader.constructed_objects, loader.recursive_objects = {}, {}  # left half-done by the failure
            try:
                loader.construct_object(node)
            except (ValueError, TypeError, OverflowError, yaml.YAMLError):
                return node
        stack += reversed(_children(node))
    return None


def format_loc(loc: Loc) -> str:
    """``('stages', 2, 'with', 'top_k')`` -> ``stages[2].with.top_k``."""
    out = ""
    for step in loc:
        if isinstance(step, str) and not step.isprintable():  # a key with a line break in it: keep one line
            out += f"[{step!r}]"
        else:
            out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _child(node: yaml.Node, step: str | int) -> tuple[yaml.Node | None, yaml.Node | None]:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == str(step):
                return value_node, key_node
    elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and 0 <= step < len(node.value):
        return node.value[step], None
    return None, None


def _duplicate_keys(file: str, node: yaml.Node, path: tuple[str | int, ...] = ()) -> list[SpecIssue]:
    # YAML allows a repeated key and keeps the last one silently; in a config
    # file that is almost always a mistake, so it is an error here.
    issues: list[SpecIssue] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                first = seen[key].start_mark.line + 1
                mark = key_node.start_mark
                loc = format_loc((*path, key))
                issues.append(SpecIssue(file, mark.line + 1, mark.column + 1, loc,
                                        f"duplicate key {key!r} (first defined on line {first})"))
            seen[key] = key_node
            issues += _duplicate_keys(file, value_node, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            issues += _duplicate_keys(file, item, (*path, index))
    return issues
