"""Load-time checks of a ``when:`` expression against the types of the fields it names.

The fields' types are known at load (``prompt_tokens`` is an ``int``, ``role`` a ``str``), so a comparison
that can never be true, or that fails on every request, is refused with the fix::

    prompt_tokens > '5'       ->  prompt_tokens is a number and '5' is a string: > cannot compare them; write 5
    role == admin             ->  unknown field 'admin' in expression; quote strings: 'admin'

What the fields of a mapping hold (``tags.tier``: whatever the client sent) is not known, and is not checked.
Messages speak of the user's text and words (a number, a string, a list), never of Python's syntax tree.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Mapping

from pipeline.errors import ExpressionError

Kinds = frozenset[str]

_CONSTANTS = {"true": "bool", "false": "bool", "null": "null", "True": "bool", "False": "bool", "None": "null"}
_BASE_KINDS = {"int": "number", "float": "number", "str": "string", "bool": "bool", "None": "null",
               "list": "list", "tuple": "list", "dict": "mapping"}
_WORDS = {"number": "a number", "string": "a string", "bool": "a boolean", "null": "null", "list": "a list",
          "mapping": "a mapping", "record": "a record"}
_PLURALS = {"number": "numbers", "string": "strings", "bool": "booleans", "null": "nulls", "list": "lists",
            "mapping": "mappings", "record": "records"}
_ORDERED = frozenset({"number", "string"})
_SYMBOLS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.In: "in", ast.NotIn: "not in"}


def type_kinds(type_text: str) -> Kinds | None:
    """What a field of type *type_text* (``"int | None"``, ``"list[str]"``) may hold; None when not known."""
    kinds = set()
    for part in type_text.split("|"):
        base = part.strip().split("[", 1)[0]
        kind = _BASE_KINDS.get(base) or ("record" if base[:1].isupper() and base != "Any" else None)
        if kind is None:
            return None
        kinds.add(kind)
    return frozenset(kinds)


def element_kinds(type_text: str) -> Kinds | None:
    """What the items of a list field hold (``"list[str]"`` -> strings); None when not known."""
    text = type_text.strip()
    if not text.startswith(("list[", "tuple[")) or not text.endswith("]"):
        return None
    return type_kinds(text[text.index("[") + 1:-1])


class TypeChecker:
    """Checks one parsed expression (*text* is its source) against *fields*: name -> type text.

    *fields* holds the flow fields and, dotted, the fields of records among them (``principal.tenant``).
    """

    def __init__(self, text: str, fields: Mapping[str, str]):
        self.text = text
        self.fields = fields

    def check(self, node: ast.AST) -> None:
        """Raise :class:`ExpressionError` at the first unknown name or impossible comparison."""
        roots = {id(child.value) for child in ast.walk(node) if isinstance(child, ast.Attribute)}
        for child in ast.walk(node):
            if isinstance(child, ast.Name) and child.id not in _CONSTANTS:
                self._known(child, is_bare=id(child) not in roots)
            elif isinstance(child, ast.Attribute):
                self._member(child)
        for child in ast.walk(node):
            if isinstance(child, ast.Compare):
                self._compare(child)

    # --- names ---------------------------------------------------------------

    def _known(self, node: ast.Name, is_bare: bool) -> None:
        if node.id in self.fields:
            return
        roots = [name for name in self.fields if "." not in name]
        close = difflib.get_close_matches(node.id, roots, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        elif is_bare:  # a word on its own, not the start of a dotted name: most likely text without quotes
            hint = f"; quote strings: '{node.id}'"
        else:
            hint = ""
        raise self._error(node, f"unknown field {node.id!r} in expression{hint} (fields: {', '.join(roots)})")

    def _member(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        parent = dotted.rsplit(".", 1)[0]
        members = sorted(name.rsplit(".", 1)[1] for name in self.fields if name.startswith(parent + "."))
        kinds = self._kinds_of_name(parent)
        if members and dotted not in self.fields and kinds is not None and kinds <= {"record", "null"}:
            raise self._error(node, f"{parent} has no field {node.attr!r}{_suggest(node.attr, members)} "
                                    f"(its fields: {', '.join(members)})")

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
        if isinstance(node, ast.Name):
            return frozenset({_CONSTANTS[node.id]}) if node.id in _CONSTANTS else self._kinds_of_name(node.id)
        if isinstance(node, ast.Attribute):
            return self._kinds_of_name(_dotted(node))
        return None  # and/or give one of their operands: either may be the one

    def _kinds_of_name(self, name: str) -> Kinds | None:
        type_text = self.fields.get(name)
        return None if type_text is None else type_kinds(type_text)

    def _elements(self, node: ast.expr) -> Kinds | None:
        if isinstance(node, (ast.List, ast.Tuple)):
            kinds = [self._kinds(element) for element in node.elts]
            if not kinds or any(k is None for k in kinds):
                return None
            return frozenset().union(*kinds)  # type: ignore[arg-type]
        name = _dotted(node) if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        type_text = self.fields.get(name)
        return None if type_text is None else element_kinds(type_text)

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
