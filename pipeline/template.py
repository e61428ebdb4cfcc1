"""Sandboxed prompt templates (Jinja2's sandbox).

Templates see the request context's flow fields by name (``{{ input }}``,
``{% for d in documents %}``) and nothing else: no attribute starting with an
underscore, no callables beyond Jinja's safe filters. The names a template
uses are known at load time, so the loader can check that each one exists and
is written by an earlier stage; an attribute the sandbox would refuse at every
request (``{{ cycler.__init__ }}``) is refused at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import TemplateError


class _Undefined(jinja2.ChainableUndefined):
    """Top-level names are checked at load time, so a missing key below them
    (``{{ tags.audience }}`` on an untagged request) renders as empty; but an
    attribute the sandbox refused is an error, not a silent blank."""

    __slots__ = ()

    def __str__(self) -> str:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()
        return ""


_ENV = ImmutableSandboxedEnvironment(
    undefined=_Undefined,
    autoescape=False,  # prompts are plain text, not HTML
    keep_trailing_newline=False,
)


def coalesce(*values: Any) -> Any:
    """The first of *values* that is not null (a step skipped by its ``when:`` gives null): templates and
    ``when:`` expressions both have it."""
    return next((value for value in values if value is not None and not isinstance(value, jinja2.Undefined)), None)


_ENV.globals["coalesce"] = coalesce


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled template, the root names it reads and its dotted names (``steps.classify.output``), each with
    whether a ``coalesce(...)`` holds it."""

    source: str
    names: frozenset[str]
    compiled: jinja2.Template
    paths: frozenset[tuple[tuple[str, ...], bool]] = frozenset()

    def render(self, values: Mapping[str, Any]) -> str:
        try:
            return self.compiled.render(values)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"template failed to render: {exc}") from exc


def compile_template(source: str) -> Template:
    """Compile *source*; raises :class:`TemplateError` with line info on bad syntax."""
    try:
        ast = _ENV.parse(source)
        compiled = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"template syntax error on its line {exc.lineno}: {exc.message}") from exc
    refused = _refused_attributes(ast)
    if refused:
        line, name = refused[0]
        names = ", ".join(dict.fromkeys(repr(n) for _, n in refused))
        raise TemplateError(f"template line {line}: {names}: an attribute that starts with '_' is refused by the "
                            f"sandbox at every request; to read a key of that name, write ['{name}'] instead of "
                            f".{name}")
    names = frozenset(meta.find_undeclared_variables(ast)) - {"coalesce"}
    return Template(source, names, compiled, frozenset(_paths(ast, names, False)))


def _paths(node: nodes.Node, roots: frozenset[str], coalesced: bool) -> list[tuple[tuple[str, ...], bool]]:
    """The dotted names under *node* that start at one of *roots* (outermost only: ``steps.a.output`` once,
    not also ``steps.a``), each with whether it is an argument of ``coalesce(...)``."""
    if isinstance(node, nodes.Getattr | nodes.Name):
        parts: list[str] = []
        while isinstance(node, nodes.Getattr):
            parts.append(node.attr)
            node = node.node
        if isinstance(node, nodes.Name) and node.name in roots:
            return [((node.name, *reversed(parts)), coalesced)]
        return _paths(node, roots, coalesced) if not isinstance(node, nodes.Name) else []
    inside = coalesced or (isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name)
                           and node.node.name == "coalesce")
    return [path for child in node.iter_child_nodes() for path in _paths(child, roots, inside)]


def _refused_attributes(node: nodes.Node) -> list[tuple[int, str]]:
    """The attributes under *node*, in the order they are written, that the sandbox refuses whatever they are
    read on (a name starting with ``_``: ``cycler.__init__``, ``x|attr('__class__')``), with their lines."""
    found = [item for child in node.iter_child_nodes() for item in _refused_attributes(child)]
    if isinstance(node, nodes.Getattr):
        name = node.attr
    elif isinstance(node, nodes.Filter) and node.name == "attr" and node.args and isinstance(node.args[0], nodes.Const):
        name = node.args[0].value
    else:
        return found
    return [*found, (node.lineno, name)] if isinstance(name, str) and name.startswith("_") else found
