"""The when: expression language: what it evaluates, and what it refuses."""

from __future__ import annotations

import pytest

from pipeline.context import Principal
from pipeline.errors import ExpressionError
from pipeline.expr import parse

VALUES = {"prompt_tokens": 1600, "role": "admin", "tags": {"tier": "gold"}, "documents": [],
          "principal": Principal("k1", "admin", "acme")}


@pytest.mark.parametrize(("source", "expected"), [
    ("prompt_tokens > 1500", True),
    ("prompt_tokens >= 1600 and prompt_tokens < 1601", True),
    ("prompt_tokens == 1 or role == 'admin'", True),
    ("not role == 'admin'", False),
    ("role in ['admin', 'analyst']", True),
    ("role not in ('admin',)", False),
    ("tags.tier == 'gold'", True),
    ("tags.missing == null", True),
    ("principal.tenant == 'acme'", True),
    ("documents", False),
    ("1 < prompt_tokens < 2000", True),
    ("prompt_tokens > -1 and true and not false", True),
])
def test_evaluates(source, expected):
    assert bool(parse(source).evaluate(VALUES.__getitem__)) is expected


@pytest.mark.parametrize(("source", "message"), [
    ("__import__('os')", "call is not allowed"),
    ("prompt_tokens + 1 > 2", "binop is not allowed"),
    ("principal.__class__", "private name '__class__' is not allowed"),
    ("[x for x in tags]", "listcomp is not allowed"),
    ("lambda: 1", "lambda is not allowed"),
    ("tags['tier']", "subscript is not allowed"),
    ("-role", "'-' applies to numbers only"),
    ("role ==", "invalid syntax"),
    ("", "empty expression"),
])
def test_refuses(source, message):
    with pytest.raises(ExpressionError, match=message):
        parse(source)


def test_names_are_roots():
    assert parse("tags.tier == 'x' and prompt_tokens > 1 and role in ['a']").names == {"tags", "prompt_tokens", "role"}


def test_type_errors_become_expression_errors():
    with pytest.raises(ExpressionError, match="cannot evaluate"):
        parse("role > 3").evaluate(VALUES.__getitem__)


def test_unknown_record_field():
    with pytest.raises(ExpressionError, match="Principal has no field 'secret'"):
        parse("principal.secret == 1").evaluate(VALUES.__getitem__)
