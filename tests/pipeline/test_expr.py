"""The when: expression language: what it evaluates, and what it refuses."""

from __future__ import annotations

import ast
import re

import pytest

from pipeline.context import EXPRESSION_TYPES, Principal
from pipeline.errors import ExpressionError
from pipeline.expr import parse
from pipeline.types import ValueType

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


#: Python's syntax-tree names, which must never reach a user: as the tree spells them (Call, BinOp, Is...), and
#: lowercased as messages used to show them ("binop is not allowed", "operator Is"); and Python's "invalid syntax".
TREE_NAMES = re.compile(
    r"\b(?:" + "|".join(name for name in dir(ast) if isinstance(getattr(ast, name), type)
                         and issubclass(getattr(ast, name), ast.AST) and name[0].isupper()) + r")\b"
    r"|\b(?:call|binop|boolop|unaryop|listcomp|setcomp|dictcomp|generatorexp|subscript|namedexpr|ifexp|joinedstr"
    r"|starred|constant|attribute|operator)\b|invalid syntax")


@pytest.mark.parametrize(("source", "message"), [
    ("__import__('os')", "calling a function is not allowed; use comparisons"),
    ("prompt_tokens + 1 > 2", r"arithmetic \(\+ - \* / ...\) is not allowed"),
    ("principal.__class__", "private name '__class__' is not allowed"),
    ("[x for x in tags]", r"a comprehension \(\[... for ...\]\) is not allowed"),
    ("lambda: 1", "lambda is not allowed"),
    ("tags['tier']", r"indexing with \[...\] is not allowed; use a dotted name: tags.tier"),
    ("-role", "'-' applies to numbers only"),
    ("role ==", "the expression ends too early: something must follow '=='"),
    ("", "empty expression"),
    ("role is null", "use == instead of is"),
    ("role is not null", "use != instead of is not"),
    ("a if b else c", "if ... else inside an expression is not allowed; use and / or"),
])
def test_refuses(source, message):
    with pytest.raises(ExpressionError, match=message):
        parse(source)


# What people write from other languages, and the one-line fix: (source, message, 1-based column).
@pytest.mark.parametrize(("source", "message", "col"), [
    ("role = 'admin'", "use == to compare instead of =", 6),
    ("role == 'a' && prompt_tokens > 5", "use and instead of &&", 13),
    ("role == 'a' || prompt_tokens > 5", "use or instead of ||", 13),
    ("!documents", "use not instead of !", 1),
    ("role == 'a' & prompt_tokens > 5", "use and instead of &", 13),
    ("~documents", "use not instead of ~", 1),
    ("role == 'a' AND prompt_tokens > 5", "write and in lowercase", 13),
    ("role == 'admin' or", "the expression ends too early: something must follow 'or'", 19),
    ("role == 'adm", "a string is not closed: end it with the quote it starts with", 9),
    ("(role == 'a'", r"'\(' is never closed", 1),
    ("role == gold member", r"expected and, or or a comparison before 'member'; quote text that has spaces", 14),
    ("  role = 'x'", "use == to compare instead of =", 8),  # columns count from the start of the text as written
    ("not " * 3000 + "documents", "the expression nests too deeply", 1),
    ("(" * 300 + "documents" + ")" * 300, "the expression nests too deeply", 201),
])
def test_syntax_errors_say_what_to_write(source, message, col):
    with pytest.raises(ExpressionError, match=message) as info:
        parse(source)
    assert info.value.col == col


@pytest.mark.parametrize("source", [
    "__import__('os')", "prompt_tokens + 1 > 2", "[x for x in tags]", "lambda: 1", "tags['tier']", "role ==",
    "role is null", "role = 'x'", "a && b", "!x", "a b", "{'a': 1}", "{1, 2}", "(x := 1)", "f'{role}' == 'x'",
    "a if b else c", "*a", "+1 > 0", "b'x' == role", "1j == 1", "... == 1", "x ^ y", "role == 'a' or",
])
def test_no_syntax_tree_names_in_messages(source):
    with pytest.raises(ExpressionError) as info:
        parse(source, EXPRESSION_TYPES)
    assert not TREE_NAMES.search(str(info.value)), str(info.value)


# With the fields' types, comparisons that can never hold are refused at load: (source, message, column).
@pytest.mark.parametrize(("source", "message", "col"), [
    ("prompt_tokens > '5'", "prompt_tokens is a number and '5' is a string: > cannot compare them; write 5 "
                            r"\(without quotes\)", 17),
    ("'1500' <= prompt_tokens", "'1500' is a string and prompt_tokens is a number: <= cannot compare them; "
                                "write 1500", 1),
    ("role == 5", "role is a string and 5 is a number: == is never true between them; quote strings: '5'", 9),
    ("role != 5", "!= is always true between them", 9),
    ("prompt_tokens == true", "prompt_tokens is a number and true is a boolean: == is never true", 18),
    ("documents > 3", "documents is a list: > compares numbers with numbers, or strings with strings", 1),
    ("prompt_tokens in ['a', 'b']", r"prompt_tokens is a number and \['a', 'b'\] holds strings: in is never true", 1),
    ("3 in stop", "3 is a number and stop holds strings: in is never true; quote strings: '3'", 1),
    ("role in 5", "5 is a number: in needs a list, a string or a mapping on its right", 9),
    ("prompt_tokens in input", "prompt_tokens is a number: in input looks for a string", 1),
    ("role == admin", "unknown field 'admin' in expression; quote strings: 'admin'", 9),
    ("promt_tokens > 10", "unknown field 'promt_tokens' in expression; did you mean 'prompt_tokens'?", 1),
    ("principal.secret == 'x'", "principal has no field 'secret' \\(its fields: key_id, role, tenant\\)", 1),
    ("1 < prompt_tokens < '9'", "prompt_tokens is a number and '9' is a string", 21),
])
def test_types_are_checked_where_known(source, message, col):
    with pytest.raises(ExpressionError, match=message) as info:
        parse(source, EXPRESSION_TYPES)
    assert info.value.col == col


@pytest.mark.parametrize("source", [
    "prompt_tokens > 1500", "role in ['admin', 'analyst']", "tags.tier > 5", "tags.tier == 'gold'",
    "role == null", "max_output_tokens > 5", "principal.tenant == 'acme'", "principal == null", "'x' in stop",
    "'admin' in role", "1 < prompt_tokens < 2000", "not documents", "prompt_tokens > -1 and true",
    "'tier' in tags", "route_plan.retries > 0",
])
def test_well_typed_expressions_pass(source):
    assert parse(source, EXPRESSION_TYPES).source == source


def test_names_are_roots():
    assert parse("tags.tier == 'x' and prompt_tokens > 1 and role in ['a']").names == {"tags", "prompt_tokens", "role"}


def test_type_errors_become_expression_errors():
    with pytest.raises(ExpressionError, match="cannot evaluate"):
        parse("role > 3").evaluate(VALUES.__getitem__)


def test_unknown_record_field():
    with pytest.raises(ExpressionError, match="Principal has no field 'secret'"):
        parse("principal.secret == 1").evaluate(VALUES.__getitem__)


STEPS = {**EXPRESSION_TYPES, "steps": ValueType.record({
    "classify": ValueType.record({"output": ValueType.from_schema({
        "type": "object", "required": ["intent", "urgency"],
        "properties": {"intent": {"enum": ["refund", "tech", "other"]}, "urgency": {"type": "integer"}}}),
        "status": ValueType.of(str)}),
    "refund": ValueType.record({"output": ValueType.of(str)}),
    "tech": ValueType.record({"output": ValueType.of(str)})})}


@pytest.mark.parametrize(("source", "message", "col"), [
    ("steps.classify.output.intent == 'refnd'", "steps.classify.output.intent is one of 'refund', 'tech', 'other': "
                                                "== 'refnd' is never true; did you mean 'refund'\\?", 33),
    ("steps.classify.output.urgency > 'high'", "steps.classify.output.urgency is a number and 'high' is a string", 33),
    ("steps.classify.output.intnt == 'tech'", "steps.classify.output has no field 'intnt'; did you mean 'intent'",
     1),
    ("steps.clasify.output == 'x'", "steps has no field 'clasify'; did you mean 'classify'", 1),
    ("coalesce(steps.refund.output, steps.tech.output) > 3", "is a string and 3 is a number", 52),
])
def test_step_outputs_are_typed_from_their_declarations(source, message, col):
    with pytest.raises(ExpressionError, match=message) as info:
        parse(source, STEPS)
    assert info.value.col == col


def test_coalesce_is_the_first_value_that_is_not_null():
    expression = parse("coalesce(steps.refund.output, steps.tech.output, 'none') == 'tech help'", STEPS)
    steps = {"refund": {"output": None}, "tech": {"output": "tech help"}}
    assert expression.evaluate({"steps": steps}.__getitem__) is True
    assert (("steps", "refund", "output"), True) in expression.paths
    assert parse("steps.classify.output.intent == 'tech'", STEPS).paths == {
        (("steps", "classify", "output", "intent"), False)}
    with pytest.raises(ExpressionError, match="coalesce takes the values"):
        parse("coalesce() == 1")
