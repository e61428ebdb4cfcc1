"""Load-time checks of a ``when:`` expression against the types of the fields it names.

The fields' types are known at load (``prompt_tokens`` is an ``int``, ``role`` a ``str``), so a comparison
that can never be true, or that fails on every request, is refused with the fix::

    prompt_tokens > '5'       ->  prompt_tokens is a number and '5' is a string: > cannot compare them; write 5
    role == admin             ->  unknown field 'admin' in expression; quote strings: 'admin'

What the fields of a mapping hold (``tags.tier``: whatever the client sent) is not known, and is not checked.
A value with a known set of values (a JSON Schema's enum, a ``Literal``) is compared only with one of them::

    steps.classify.output.intent == 'refnd'  ->  ... is one of 'refund', 'tech', 'other': == 'refnd' is never true

Messages speak of the user's text and words (a number, a string, a list), never of Python's syntax tree.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Mapping

from pipeline.errors import ExpressionError
from pipeline.types import UNKNOWN, ValueType, merge

Kinds = frozenset[str]

_CONSTANTS = {"true": "bool", "false": "bool", "null": "null", "True": "bool", "False": "bool", "None": "null"}
_WORDS = {"number": "a number", "string": "a string", "bool": "a boolean", "null": "null", "list": "a list",
          "mapping": "a mapping", "record": "a record"}
_PLURALS = {"number": "numbers", "string": "strings", "bool": "booleans", "null": "nulls", "list": "lists",
            "mapping": "mappings", "record": "records"}
_ORDERED = frozenset({"number", "string"})
_SYMBOLS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.In: "in", ast.NotIn: "not in"}
#: The one function expressions may call: the first of its arguments that is not null.
COALESCE = "coalesce"


class TypeChecker:
    """Checks one parsed expression (*text* is its source) against *names*: each root name's :class:`ValueType`.

    A dotted name reads a field of a record (``principal.tenant``, ``steps.classify.output.intent``): a field
    the record's type does not have is an error; a mapping's keys (``tags.tier``) are the client's, unchecked.
    """

    def __init__(self, text: str, names: Mapping[str, ValueType]):
        self.text = text
        self.names = names

    def check(self, node: ast.AST) -> None:
        """Raise :class:`ExpressionError` at the first unknown name or impossible comparison."""
        roots = {id(child.value) for child in ast.walk(node) if isinstance(child, ast.Attribute)}
        called = {id(child.func) for child in ast.walk(node) if isinstance(child, ast.Call)}  # coalesce only
        for child in ast.walk(node):
            if isinstance(child, ast.Name) and child.id not in _CONSTANTS and id(child) not in called:
                self._known(child, is_bare=id(child) not in roots)
            elif isinstance(child, ast.Attribute):
                self.type_of(child)
        for child in ast.walk(node):
            if isinstance(child, ast.Compare):
                self._compare(child)

    # --- names ---------------------------------------------------------------

    def _known(self, node: ast.Name, is_bare: bool) -> None:
        if node.id in self.names:
            return
        roots = list(self.names)
        close = difflib.get_close_matches(node.id, roots, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        elif is_bare:  # a word on its own, not the start of a dotted name: most likely text without quotes
            hint = f"; quote strings: '{node.id}'"
        else:
            hint = ""
        raise self._error(node, f"unknown field {node.id!r} in expression{hint} (fields: {', '.join(roots)})")

    def type_of(self, node: ast.expr) -> ValueType:
        """What *node* (a name, a dotted name, a literal, a call of coalesce) may hold; raises on a field that a
        record it reads does not have."""
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return ValueType(frozenset({_CONSTANTS[node.id]}))
            return self.names.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            parent = self.type_of(node.value).without_null()
            if parent.fields is None:
                return UNKNOWN  # a mapping's key, or a record whose fields are not known here
            found = parent.field(node.attr)
            if found is None:
                known = parent.field_names()
                raise self._error(node, f"{_dotted(node.value)} has no field {node.attr!r}"
                                        f"{_suggest(node.attr, known)} (its fields: {', '.join(known)})")
            return found
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == COALESCE:
            given = [self.type_of(arg) for arg in node.args]
            firm = [t for t in given if t.kinds is not None and "null" not in t.kinds]
            return merge([t.without_null() for t in given]) if firm else merge(given)
        kinds = self._kinds(node)
        return ValueType(kinds) if kinds is not None else UNKNOWN

    # --- comparisons ---------------------------------------------------------

    def _compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
            symbol = _SYMBOLS[type(op)]
            left_kinds, right_kinds = self._kinds(left), self._kinds(right)
            if isinstance(op, (ast.In, ast.NotIn)):
                self._membership(symbol, left, left_kinds, right, right_kinds)
            elif isinstance(op, (ast.Eq, ast.NotEq)):
                self._equality(symbol, left, left_kinds, right, right_kinds)
                self._enum(symbol, left, right)
                self._enum(symbol, right, left)
            else:
                self._order(symbol, left, left_kinds, right, right_kinds)

    def _order(self, symbol: str, left: ast.expr, left_kinds: Kinds | None, right: ast.expr,
               right_kinds: Kinds | None) -> None:
        for side, kinds in ((left, left_kinds), (right, right_kinds)):
            if kinds is not None and not kinds & _ORDERED:
                raise self._error(side, f"{self._show(side)} is {_words(kinds)}: {symbol} compares numbers "
                                        f"with numbers, or strings with strings")
        if left_kinds is not None and right_kinds is not None and not left_kinds & right_kinds & _ORDERED:
            raise self._mismatch(symbol, left, left_kinds, right, right_kinds, f"{symbol} cannot compare them")

    def _equality(self, symbol: str, left: ast.expr, left_kinds: Kinds | None, right: ast.expr,
                  right_kinds: Kinds | None) -> None:
        if left_kinds is None or right_kinds is None or left_kinds & right_kinds:
            return
        if left_kinds == {"null"} or right_kinds == {"null"}:  # "x == null": a test for absence, always fine
            return
        never = "always true" if symbol == "!=" else "never true"
        raise self._mismatch(symbol, left, left_kinds, right, right_kinds, f"{symbol} is {never} between them")

    def _enum(self, symbol: str, side: ast.expr, literal: ast.expr) -> None:
        """``steps.classify.output.intent == 'refnd'``: a value *side*'s enum does not hold."""
        if not (isinstance(literal, ast.Constant) and isinstance(side, (ast.Name, ast.Attribute, ast.Call))):
            return
        allowed = self.type_of(side).values
        if allowed is None or literal.value in allowed or literal.value is None:
            return
        never = "always true" if symbol == "!=" else "never true"
        close = difflib.get_close_matches(str(literal.value), [str(v) for v in allowed], n=1, cutoff=0.6)
        fix = f"; did you mean {close[0]!r}?" if close else ""
        raise self._error(literal, f"{self._show(side)} is {self.type_of(side).describe()}: {symbol} "
                                   f"{self._show(literal)} is {never}{fix}")

    def _membership(self, symbol: str, left: ast.expr, left_kinds: Kinds | None, right: ast.expr,
                    right_kinds: Kinds | None) -> None:
        if right_kinds is None:
            return
        if "list" in right_kinds:
            items = self._elements(right)
            if left_kinds is not None and items and not left_kinds & items and not items <= {"null"}:
                raise self._error(left, f"{self._show(left)} is {_words(left_kinds)} and {self._show(right)} "
                                        f"holds {_words(items, _PLURALS)}: {symbol} is "
                                        f"{'always' if symbol == 'not in' else 'never'} true"
                                        f"{self._fix(left, left_kinds, items)}")
        elif right_kinds & {"string", "mapping"}:
            if left_kinds is not None and "string" not in left_kinds:
                fix = self._fix(left, left_kinds, {"string"})
                raise self._error(left, f"{self._show(left)} is {_words(left_kinds)}: {symbol} "
                                        f"{self._show(right)} looks for a string{fix}")
        else:
            raise self._error(right, f"{self._show(right)} is {_words(right_kinds)}: {symbol} needs a list, a string "
                                     f"or a mapping on its right, as in role in ['admin', 'analyst']")

    def _mismatch(self, symbol: str, left: ast.expr, left_kinds: Kinds, right: ast.expr, right_kinds: Kinds,
                  verdict: str) -> ExpressionError:
        literal = right if _is_literal(right) or not _is_literal(left) else left
        other_kinds = left_kinds if literal is right else right_kinds
        message = (f"{self._show(left)} is {_words(left_kinds)} and {self._show(right)} is {_words(right_kinds)}: "
                   f"{verdict}{self._fix(literal, self._kinds(literal) or frozenset(), other_kinds)}")
        return self._error(literal, message)

    def _fix(self, node: ast.expr, kinds: Kinds, wanted: Kinds | set[str]) -> str:
        """``; write 5`` where *node* is a literal that would fit as *wanted* with its quotes added or removed."""
        if not _is_literal(node):
            return ""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            unquoted = node.value.strip()
            if "number" in wanted and _is_number_text(unquoted):
                return f"; write {unquoted} (without quotes) to compare numbers"
            if "bool" in wanted and unquoted in ("true", "false"):
                return f"; write {unquoted} (without quotes)"
        if "string" in wanted and kinds & {"number", "bool"}:
            return f"; quote strings: '{self._show(node)}'"
        return ""

    # --- kinds ---------------------------------------------------------------

    def _kinds(self, node: ast.expr) -> Kinds | None:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool):
                return frozenset({"bool"})
            if value is None:
                return frozenset({"null"})
            return frozenset({"string"}) if isinstance(value, str) else frozenset({"number"})
        if isinstance(node, ast.UnaryOp):
            return frozenset({"bool"}) if isinstance(node.op, ast.Not) else frozenset({"number"})
        if isinstance(node, ast.Compare):
            return frozenset({"bool"})
        if isinstance(node, (ast.List, ast.Tuple)):
            return frozenset({"list"})
        if isinstance(node, (ast.Name, ast.Attribute, ast.Call)):
            return self.type_of(node).kinds
        return None  # and/or give one of their operands: either may be the one

    def _elements(self, node: ast.expr) -> Kinds | None:
        if isinstance(node, (ast.List, ast.Tuple)):
            kinds = [self._kinds(element) for element in node.elts]
            if not kinds or any(k is None for k in kinds):
                return None
            return frozenset().union(*kinds)  # type: ignore[arg-type]
        items = self.type_of(node).items
        return None if items is None else items.kinds

    # --- messages ------------------------------------------------------------

    def _show(self, node: ast.expr) -> str:
        return ast.get_source_segment(self.text, node) or "the value"

    def _error(self, node: ast.AST, message: str) -> ExpressionError:
        return ExpressionError(message, col=node_column(self.text, node))


def node_column(text: str, node: ast.AST) -> int:
    """1-based column of *node* in *text*, in characters (the tree counts UTF-8 bytes)."""
    offset = getattr(node, "col_offset", 0)
    return len(text.encode()[:offset].decode(errors="ignore")) + 1


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(getattr(node, "id", ""))
    return ".".join(reversed(parts))


def _is_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")


def _words(kinds: Kinds | set[str], words: Mapping[str, str] = _WORDS) -> str:
    return " or ".join(words[kind] for kind in sorted(kinds, key=list(_WORDS).index))


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
