"""Sandboxed prompt templates (Jinja2's sandbox).

Templates see the request context's flow fields by name (``{{ input }}``,
``{% for d in documents %}``) and nothing else: no attribute starting with an
underscore, no callables beyond Jinja's safe filters. The names a template
uses are known at load time, so the loader can check that each one exists and
is written by an earlier stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta
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


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled template and the root names it reads."""

    source: str
    names: frozenset[str]
    compiled: jinja2.Template

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
    return Template(source, frozenset(meta.find_undeclared_variables(ast)), compiled)
