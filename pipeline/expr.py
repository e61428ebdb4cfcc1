"""A small, safe expression language for ``when:`` conditions.

Grammar (a strict subset of Python's expression syntax, evaluated by a tree
walker, never by ``eval``)::

    expr    := expr 'or' expr | expr 'and' expr | 'not' expr | compare
    compare := operand (('==' | '!=' | '<' | '<=' | '>' | '>=' | 'in' | 'not in') operand)*
    operand := NAME ('.' NAME)* | NUMBER | STRING | true | false | null
             | '[' operand, ... ']' | '(' expr ')' | '-' NUMBER | 'coalesce(' operand, ... ')'

Names are flow fields of the request context (``prompt_tokens``, ``role``,
``tags.tier``...) and the outputs of earlier steps (``steps.classify.output.intent``);
a dotted name reads a key of a dict or an attribute of a record. ``coalesce(a, b, ...)``
is the first of its arguments that is not null (a step skipped by its ``when:`` gives
null). Example::

    when: "prompt_tokens > 1500 and role in ['admin', 'analyst']"
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
import tokenize
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ExpressionError
from pipeline.exprtypes import COALESCE, TypeChecker, node_column
from pipeline.types import ValueType

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
    #: Every dotted name it reads, as its parts (``("steps", "classify", "output")``), with whether it is read
    #: inside ``coalesce(...)``.
    paths: frozenset[tuple[tuple[str, ...], bool]] = frozenset()

    def evaluate(self, resolve: Resolver) -> Any:
        try:
            return _eval(self.tree, resolve)
        except ExpressionError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ExpressionError(f"cannot evaluate {self.source!r}: {exc}") from exc


def parse(source: str, fields: Mapping[str, ValueType] | None = None) -> Expression:
    """Parse *source*, rejecting anything outside the grammar above.

    With *fields* (root name -> type, as :data:`pipeline.context.EXPRESSION_TYPES` and a step's ``steps``), the
    names it reads must be among them, and comparisons must be possible between the types involved (see
    :mod:`pipeline.exprtypes`).
    """
    if not source or not source.strip():
        raise ExpressionError("empty expression")
    lead = len(source) - len(source.lstrip())
    text = source.strip()
    try:
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError as exc:
            raise _syntax_error(text, exc) from None
        names: set[str] = set()
        _check(text, tree, names)
        if fields is not None:
            TypeChecker(text, fields).check(tree)
    except ExpressionError as exc:
        raise ExpressionError(str(exc), col=exc.col + lead if exc.col > 0 else exc.col) from None
    except RecursionError:  # "not not not ... x": Python's parser and our walk both recurse
        raise ExpressionError(_TOO_DEEP, col=lead + 1) from None
    return Expression(source, tree, frozenset(names), frozenset(_paths(tree, False)))


def _paths(node: ast.AST, coalesced: bool) -> list[tuple[tuple[str, ...], bool]]:
    """The dotted names under *node*, outermost only, each with whether a ``coalesce(...)`` holds it."""
    if isinstance(node, (ast.Attribute, ast.Name)) and not (isinstance(node, ast.Name) and node.id in _CONSTANTS):
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return [((getattr(node, "id", ""), *reversed(parts)), coalesced)]
    inside = coalesced or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == COALESCE)
    children = node.args if isinstance(node, ast.Call) else ast.iter_child_nodes(node)
    return [path for child in children for path in _paths(child, inside)]


_TOO_DEEP = "the expression nests too deeply; write it flatter"


#: Operators of other languages, and what to write instead.
_FOREIGN = {"=": "use == to compare", "&&": "use and", "&": "use and", "||": "use or", "|": "use or",
            "!": "use not", "~": "use not"}
_KEYWORDS = frozenset({"and", "or", "not", "in"})


def _syntax_error(text: str, exc: SyntaxError) -> ExpressionError:
    """What to write instead, for the mistakes people make; Python's "invalid syntax" says nothing."""
    tokens = _tokens(text)
    for index, (kind, string, col) in enumerate(tokens):
        after = tokens[index + 1] if index + 1 < len(tokens) else None
        if string in ("&", "|") and after is not None and after[1] == string and after[2] == col + 1:
            string *= 2
        if string == "!" and after is not None and after[1] == "=":  # a split "!=" ("! =")
            continue
        if string in _FOREIGN and kind != tokenize.STRING:
            return ExpressionError(f"{_FOREIGN[string]} instead of {string}", col=col + 1)
        if kind == tokenize.NAME and string.lower() in _KEYWORDS and string not in _KEYWORDS:
            return ExpressionError(f"write {string.lower()} in lowercase", col=col + 1)
    message = exc.msg.split(" (detected at", 1)[0]
    if message.startswith("too many nested"):
        return ExpressionError(_TOO_DEEP, col=exc.offset or 1)
    if message.startswith("unterminated string"):
        return ExpressionError("a string is not closed: end it with the quote it starts with",
                               col=exc.offset or len(text) + 1)
    if message.endswith("was never closed"):
        opening = message.removesuffix(" was never closed")
        return ExpressionError(f"{opening} is never closed: close it", col=exc.offset or 1)
    if not exc.offset or exc.offset > len(text) or (tokens and exc.offset > tokens[-1][2] + len(tokens[-1][1])):
        # An expression cut short reports offset 0: point just past its end.
        last = tokens[-1][1] if tokens else text
        return ExpressionError(f"the expression ends too early: something must follow {last!r}", col=len(text) + 1)
    word = _token_at(tokens, exc.offset - 1)
    if word is not None and word[0] in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING):
        return ExpressionError(f"expected and, or or a comparison before {word[1]!r}; quote text that has spaces "
                               f"('like this')", col=exc.offset)
    return ExpressionError("cannot read the expression here; write comparisons such as prompt_tokens > 1500 or "
                           "role == 'admin', joined by and, or, not", col=exc.offset)


def _tokens(text: str) -> list[tuple[int, str, int]]:
    """(type, text, 0-based column) of each token of one line, up to where the tokenizer gives up."""
    out = []
    with contextlib.suppress(tokenize.TokenError, SyntaxError):
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER) or token.start[0] != 1:
                continue
            if token.type == tokenize.ERRORTOKEN and not token.string.strip():
                continue
            out.append((token.type, token.string, token.start[1]))
    return out


def _token_at(tokens: list[tuple[int, str, int]], col: int) -> tuple[int, str, int] | None:
    return next((t for t in tokens if t[2] <= col < t[2] + max(1, len(t[1]))), None)


#: What a construct outside the grammar is, in the user's words, and what to write instead.
_REFUSED: dict[type[ast.AST], str] = {
    ast.Call: "calling a function is not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.Subscript: "indexing with [...] is not allowed; use a dotted name: tags.tier",
    ast.IfExp: "if ... else inside an expression is not allowed; use and / or",
    ast.Dict: "a {...} mapping is not allowed; use a list: ['a', 'b']",
    ast.Set: "a {...} set is not allowed; use a list: ['a', 'b']",
    ast.ListComp: "a comprehension ([... for ...]) is not allowed",
    ast.SetComp: "a comprehension ({... for ...}) is not allowed",
    ast.DictComp: "a comprehension ({... for ...}) is not allowed",
    ast.GeneratorExp: "a comprehension ((... for ...)) is not allowed",
    ast.NamedExpr: "use == to compare instead of :=",
    ast.JoinedStr: "f-strings are not allowed; use a plain string",
    ast.Starred: "* is not allowed",
    ast.Await: "await is not allowed",
}
_ARITHMETIC: dict[type[ast.operator], str] = {ast.BitAnd: "use and instead of &", ast.BitOr: "use or instead of |"}
_CONSTANT_WORDS = {bytes: "a byte string", complex: "an imaginary number", type(...): "..."}


def _check(text: str, node: ast.AST, names: set[str]) -> None:
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            _check(text, value, names)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        _check(text, node.operand, names)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if not (isinstance(node.operand, ast.Constant) and _is_number(node.operand.value)):
            _reject(text, node, "'-' applies to numbers only")
    elif isinstance(node, ast.UnaryOp):
        _reject(text, node, "use not instead of ~" if isinstance(node.op, ast.Invert) else "'+' is not needed; "
                                                                                          "write the number alone")
    elif isinstance(node, ast.Compare):
        for op in node.ops:
            if isinstance(op, (ast.Is, ast.IsNot)):
                _reject(text, node, f"use {'==' if isinstance(op, ast.Is) else '!='} instead of "
                                    f"{'is' if isinstance(op, ast.Is) else 'is not'}")
        for operand in (node.left, *node.comparators):
            _check(text, operand, names)
    elif isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            names.add(node.id)
    elif isinstance(node, ast.Attribute):
        _check_dotted(text, node, names)
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (str, int, float, bool)) and node.value is not None:
            what = _CONSTANT_WORDS.get(type(node.value), repr(node.value))
            _reject(text, node, f"{what} is not allowed; use numbers, 'strings', true, false or null")
    elif isinstance(node, (ast.List, ast.Tuple)):
        for element in node.elts:
            _check(text, element, names)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == COALESCE:
        if node.keywords or not node.args:
            _reject(text, node, "coalesce takes the values to choose from, in order: coalesce(a, b)")
        for argument in node.args:
            _check(text, argument, names)
    elif isinstance(node, ast.BinOp):
        message = _ARITHMETIC.get(type(node.op), "arithmetic (+ - * / ...) is not allowed; write the number itself")
        raise ExpressionError(message, col=_operator_column(text, node.left))
    else:
        refused = next((message for kind, message in _REFUSED.items() if isinstance(node, kind)),
                       "this is not allowed here")
        _reject(text, node, f"{refused}; use comparisons, and/or/not and 'in'"
                if "; " not in refused else refused)


def _operator_column(text: str, left: ast.expr) -> int:
    """1-based column of the operator after the operand *left*: past spaces and closing parentheses."""
    end = len(text.encode()[:left.end_col_offset].decode(errors="ignore"))
    rest = text[end:]
    return end + len(rest) - len(rest.lstrip(" )")) + 1


def _check_dotted(text: str, node: ast.Attribute, names: set[str]) -> None:
    base: ast.expr = node
    while isinstance(base, ast.Attribute):
        if base.attr.startswith("_"):
            _reject(text, base, f"private name {base.attr!r} is not allowed")
        base = base.value
    if not isinstance(base, ast.Name):
        _reject(text, node, "only dotted names like tags.tier are allowed")
    names.add(base.id)


def _reject(text: str, node: ast.AST, message: str) -> None:
    raise ExpressionError(message, col=node_column(text, node))


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
    if isinstance(node, ast.Call):  # coalesce: _check allows no other call
        return next((value for value in (_eval(arg, resolve) for arg in node.args) if value is not None), None)
    raise ExpressionError("this is not allowed here")  # unreachable after _check


def _member(value: Any, name: str) -> Any:
    # Missing tags are common ("tags.tier == 'gold'" on an untagged request): read as null.
    if isinstance(value, dict):
        return value.get(name)
    if value is None:
        return None
    if not hasattr(type(value), "__dataclass_fields__") or name not in type(value).__dataclass_fields__:
        raise ExpressionError(f"{type(value).__name__} has no field {name!r}")
    return getattr(value, name)
