"""A small, safe expression language for ``when:`` conditions.

Grammar (a strict subset of Python's expression syntax, evaluated by a tree
walker, never by ``eval``)::

    expr    := expr 'or' expr | expr 'and' expr | 'not' expr | compare
    compare := operand (('==' | '!=' | '<' | '<=' | '>' | '>=' | 'in' | 'not in') operand)*
    operand := NAME ('.' NAME)* | NUMBER | STRING | true | false | null
             | '[' operand, ... ']' | '(' expr ')' | '-' NUMBER

Names are flow fields of the request context (``prompt_tokens``, ``role``,
``tags.tier``...); a dotted name reads a key of a dict or an attribute of a
record. Example::

    when: "prompt_tokens > 1500 and role in ['admin', 'analyst']"
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ExpressionError

_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}

Resolver = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class Expression:
    """A parsed expression; :meth:`evaluate` runs it against a name resolver."""

    source: str
    tree: ast.expr
    #: The root names it reads (``tags`` for ``tags.tier``).
    names: frozenset[str]

    def evaluate(self, resolve: Resolver) -> Any:
        try:
            return _eval(self.tree, resolve)
        except ExpressionError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ExpressionError(f"cannot evaluate {self.source!r}: {exc}") from exc


def parse(source: str) -> Expression:
    """Parse *source*, rejecting anything outside the grammar above."""
    if not source or not source.strip():
        raise ExpressionError("empty expression")
    text = source.strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        # An expression cut short reports offset 0: point just past its end.
        raise ExpressionError(exc.msg, col=exc.offset or len(text) + 1) from None
    names: set[str] = set()
    _check(tree, names)
    return Expression(source, tree, frozenset(names))


def _check(node: ast.AST, names: set[str]) -> None:
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            _check(value, names)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        _check(node.operand, names)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if not (isinstance(node.operand, ast.Constant) and _is_number(node.operand.value)):
            _reject(node, "'-' applies to numbers only")
    elif isinstance(node, ast.Compare):
        for op in node.ops:
            if type(op) not in _COMPARE:
                _reject(node, f"operator {type(op).__name__} is not allowed")
        for operand in (node.left, *node.comparators):
            _check(operand, names)
    elif isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            names.add(node.id)
    elif isinstance(node, ast.Attribute):
        _check_dotted(node, names)
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (str, int, float, bool)) and node.value is not None:
            _reject(node, f"constant {node.value!r} is not allowed")
    elif isinstance(node, (ast.List, ast.Tuple)):
        for element in node.elts:
            _check(element, names)
    else:
        _reject(node, f"{type(node).__name__.lower()} is not allowed; use comparisons, and/or/not and 'in'")


def _check_dotted(node: ast.Attribute, names: set[str]) -> None:
    base: ast.expr = node
    while isinstance(base, ast.Attribute):
        if base.attr.startswith("_"):
            _reject(base, f"private name {base.attr!r} is not allowed")
        base = base.value
    if not isinstance(base, ast.Name):
        _reject(node, "only dotted names like tags.tier are allowed")
    names.add(base.id)


def _reject(node: ast.AST, message: str) -> None:
    raise ExpressionError(message, col=getattr(node, "col_offset", -1) + 1)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _eval(node: ast.expr, resolve: Resolver) -> Any:
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(bool(_eval(v, resolve)) for v in node.values)
        return any(bool(_eval(v, resolve)) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, resolve)
        return (not bool(value)) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, resolve)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _eval(right_node, resolve)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Name):
        return _CONSTANTS[node.id] if node.id in _CONSTANTS else resolve(node.id)
    if isinstance(node, ast.Attribute):
        return _member(_eval(node.value, resolve), node.attr)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, resolve) for e in node.elts]
    raise ExpressionError(f"unexpected {type(node).__name__}")  # unreachable after _check


def _member(value: Any, name: str) -> Any:
    # Missing tags are common ("tags.tier == 'gold'" on an untagged request): read as null.
    if isinstance(value, dict):
        return value.get(name)
    if value is None:
        return None
    if not hasattr(type(value), "__dataclass_fields__") or name not in type(value).__dataclass_fields__:
        raise ExpressionError(f"{type(value).__name__} has no field {name!r}")
    return getattr(value, name)
