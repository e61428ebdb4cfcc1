"""Constrained decoding: a request's JSON schema, regex or choice, compiled into a token-level matcher.

Compilation is llguidance's (see bench/constraints.py for the comparison with xgrammar and outlines-core):
a JSON schema or regex becomes a grammar over bytes, and the matcher computes, at each step, which of the
model's tokens may come next. It never builds a whole-vocabulary automaton up front, so compiling takes
milliseconds; a token mask is computed at each step, its cost depending on the matcher's state.

    compiler = ConstraintCompiler(tokenizer, vocab_size)         # once per model: reads the whole vocabulary
    grammar = compiler.compile(Constraint("json_schema", schema)) # before queueing; raises ConstraintError
    matcher = grammar.start()                                     # per request
    # every step, for that request's row only:
    matcher.apply(logits[row])                                    # disallowed tokens → -inf, in place
    # (or for a batch: bitmask = compiler.allocate_bitmask(rows); matcher.fill_bitmask(bitmask[i]) per
    #  constrained row; apply_bitmask(logits, bitmask))
    token_id = sample(logits[row])
    matcher.advance(token_id)
    if matcher.is_terminated(): ...                               # finish with reason "stop"
    for token_id in matcher.forced(): ...                         # append without sampling, advance each

JSON is written compactly on one line with the separators ", " and ": " (what ``json.dumps`` writes): free
whitespace would let a small model pad forever and would shorten forced spans. A schema keyword that
llguidance knows but does not implement (``uniqueItems``, ``contains``, ``not``, ``if``...) is an error
naming it; keywords outside JSON Schema are ignored, as the specification says. Regexes use Rust's syntax
(no look-around, no backreferences) and must match the whole output; ``^`` and ``$`` are accepted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np
import torch

ConstraintKind = Literal["json_schema", "regex", "choice"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "choice")

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
"""Passed as overrides, so a schema's own ``x-guidance`` options cannot loosen them."""
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
_BIAS_TABLE = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1, 0.0, -np.inf
).astype(np.float32)
"""Row ``b``: the additive logit bias of the 8 tokens whose allowed-bits are byte ``b`` (0 or -inf).
Gathering these rows and adding them is cheaper on the CPU than unpacking the bits into a bool mask for
``masked_fill_``."""


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the message names the keyword, the regex error or the bad value."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: a JSON schema (dict or JSON text), a regex, or one of fixed strings."""

    kind: ConstraintKind
    value: str | dict | list[str]

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        return cls("json_schema", {"type": "object"})

    def key(self) -> str:
        """A stable hash of the kind and the canonical JSON of the value (key order does not matter)."""
        value = self.value
        if self.kind == "json_schema" and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(f"{self.kind}\0{canonical}".encode()).hexdigest()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets ``logits[..., t]`` to -inf where bit ``t`` of ``bitmask[...]`` is 0, in place.

    ``logits`` is ``[vocab]`` or ``[rows, vocab]`` (a view of a bigger tensor is fine); ``bitmask`` is the
    matching int32 ``[words]`` or ``[rows, words]`` on the CPU, with ``32 * words >= vocab`` (bits past
    ``vocab`` are ignored). Logits must be finite or -inf: on the CPU the mask is added as a 0/-inf bias.
    """
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
        raise ValueError(f"bitmask must be int32 on the CPU, got {bitmask.dtype} on {bitmask.device}")
    vocab_size = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab_size:
        raise ValueError(f"bitmask of {bitmask.shape[-1]} words is too short for {vocab_size} logits")
    if logits.device.type != "cpu":
        _apply_bitmask_with_shifts(logits, bitmask.to(logits.device, non_blocking=True))
        return
    bytes_ = bitmask.contiguous().numpy().view(np.uint8)
    bias = np.take(_BIAS_TABLE, bytes_, axis=0).reshape(*bytes_.shape[:-1], -1)[..., :vocab_size]
    logits.add_(torch.from_numpy(bias))


def _apply_bitmask_with_shifts(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same on the logits' own device (a GPU): unpack the bits there, no host round trip of the logits."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    logits.masked_fill_(bits.flatten(-2)[..., : logits.shape[-1]] == 0, float("-inf"))


class ConstraintCompiler:
    """Compiles constraints for one tokenizer and one logits width; keep one per model and share it.

    Building the token table (``__init__``) reads the whole vocabulary, so it is done once; each compile
    takes milliseconds, and the last ``max_cached`` grammars are kept by ``Constraint.key()``. Thread-safe:
    request handlers may compile while the engine loop runs matchers.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, eos_token_id: int | None = None, max_cached: int = 128):
        eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_cached = max_cached
        # The mask covers the larger of the two: tokens past the logits' width are cut off when applied,
        # ids past the tokenizer's are never allowed (llguidance refuses an n_vocab below its own count).
        self._ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos_token_id)
        self.num_mask_words = (self._ll_tokenizer.vocab_size + 31) // 32
        """Width of a bitmask row in int32 words (``ceil(vocab / 32)``; 1536 for SmolLM2)."""
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A ``[num_rows, num_mask_words]`` int32 bitmask with every token allowed (for unconstrained rows)."""
        return torch.full((num_rows, self.num_mask_words), -1, dtype=torch.int32)

    def compile(self, constraint: Constraint) -> Grammar:
        """The grammar of ``constraint``, from the cache when an equal one was compiled before."""
        key = _key(constraint)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = Grammar(constraint, self._build(constraint), self)
        with self._lock:
            grammar = self._cache.setdefault(key, grammar)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = _grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise ConstraintError(f"{constraint.kind}: {_clean(messages[0])}")
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{constraint.kind}: {_clean(matcher.get_error())}")
        return matcher


def compile_error(kind: str, value: Any) -> str | None:
    """Why ``ConstraintCompiler.compile`` would refuse this constraint whatever the model, or None.

    Needs no tokenizer, so a pipeline's own ``output:`` is checked when the pipeline loads, before any model
    is: a schema keyword llguidance does not implement, a regex it cannot parse (Rust's syntax: no
    look-around, no backreferences), an empty choice.
    """
    constraint = Constraint(kind, value)  # type: ignore[arg-type]
    try:
        _key(constraint)
        grammar = _grammar_text(constraint)
    except ConstraintError as exc:
        return str(exc).removeprefix(f"{kind}: ")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return _clean(messages[0]) if is_error else None


def _key(constraint: Constraint) -> str:
    try:
        return constraint.key()
    except (TypeError, ValueError) as e:  # a value json.dumps cannot write
        raise ConstraintError(f"{constraint.kind}: not JSON-serializable: {e}") from None


def _grammar_text(constraint: Constraint) -> str:
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConstraintError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConstraintError(f"json_schema: must be a JSON object, got {type(value).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"json_schema: {e}") from None
    if kind == "regex":
        if not isinstance(value, str):
            raise ConstraintError(f"regex: must be a string, got {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ConstraintError("choice: must be a non-empty list of strings")
        for i, choice in enumerate(value):
            if not isinstance(choice, str) or not choice:
                raise ConstraintError(f"choice[{i}]: must be a non-empty string, got {choice!r}")
        escaped = ("".join("\\" + c if c in _REGEX_META else c for c in choice) for choice in value)
        return llguidance.LLMatcher.grammar_from_regex("(" + "|".join(escaped) + ")")
    raise ConstraintError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")


def _clean(message: str) -> str:
    """llguidance's message, with a regex parse error cut to ``invalid regex '...': <why>``."""
    lines = message.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if "regex parse error" in line]
    details = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if starts and details and starts[0] + 1 < len(lines):
        return f"invalid regex '{lines[starts[0] + 1].strip()}': {details[0]}"
    return "\n".join(line for line in lines if " | " not in line).strip()


class Grammar:
    """A compiled constraint, shared by every request that uses it; ``start()`` gives each its own matcher."""

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher, compiler: ConstraintCompiler):
        self.constraint = constraint
        self.vocab_size = compiler.vocab_size
        self.eos_token_id = compiler.eos_token_id
        self.num_mask_words = compiler.num_mask_words
        self._template = template
        """Never advanced: matchers are copies of it, which share its compiled lexer and parser tables."""

    def start(self) -> Matcher:
        """A matcher at the beginning of the output (a few µs)."""
        return Matcher(self._template.deep_copy(), self)


class Matcher:
    """One request's position in its constraint. Use it from one thread at a time.

    Once the output is complete and nothing may follow, only EOS is allowed and ``is_terminated()`` is
    true; where the output may end or go on (an integer's digits), EOS is one of the allowed tokens.
    """

    __slots__ = ("_bitmask", "_matcher", "eos_token_id", "num_mask_words", "num_tokens", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: Grammar):
        self._matcher = matcher
        self.vocab_size = grammar.vocab_size
        self.eos_token_id = grammar.eos_token_id
        self.num_mask_words = grammar.num_mask_words
        self._bitmask: torch.Tensor | None = None
        self.num_tokens = 0
        """Tokens advanced over so far (EOS included): the most ``rollback`` can undo."""

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        """Writes the allowed tokens into one row of ``ConstraintCompiler.allocate_bitmask``'s tensor."""
        if (bitmask_row.dtype != torch.int32 or not bitmask_row.is_contiguous() or bitmask_row.device.type != "cpu"
                or bitmask_row.numel() != self.num_mask_words):
            raise ValueError(f"bitmask_row must be a contiguous int32 CPU tensor of {self.num_mask_words} words")
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)

    def apply(self, logits_row: torch.Tensor) -> None:
        """Sets the logits of the tokens not allowed next to -inf, in place (one ``[vocab]`` row)."""
        if self._bitmask is None:
            self._bitmask = torch.empty(self.num_mask_words, dtype=torch.int32)
        self.fill_bitmask(self._bitmask)
        apply_bitmask(logits_row, self._bitmask)

    def allowed_token_ids(self) -> list[int]:
        """The token ids allowed next (for tests and debugging; ``apply`` is the fast path)."""
        bitmask = torch.empty(self.num_mask_words, dtype=torch.int32)
        self.fill_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.flatnonzero(bits).tolist()

    def advance(self, token_id: int) -> None:
        """Consumes one token; raises ValueError, leaving the matcher as it was, if it is not allowed."""
        if token_id == self.eos_token_id:
            is_allowed = self._matcher.is_accepting()  # validate_tokens never counts EOS
        else:
            is_allowed = 0 <= token_id < self.vocab_size and self._matcher.validate_tokens([token_id]) == 1
        if not is_allowed:
            raise ValueError(f"token {token_id} is not allowed here by the constraint")
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} was rejected: {self._matcher.get_error().splitlines()[0]}")
        self.num_tokens += 1

    def forced(self, max_tokens: int = 64) -> list[int]:
        """Tokens the constraint allows in one way only from here (up to ``max_tokens``), without EOS.

        Not consumed: append them to the output and ``advance`` each. The tokenization is canonical; the
        last forced token is held back when a longer token could also start there.
        """
        return self._matcher.compute_ff_tokens()[:max_tokens]

    def is_accepting(self) -> bool:
        """The output so far is complete (EOS is allowed), though it may also go on."""
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        """Nothing but EOS may follow, or EOS was consumed: end the request with finish reason "stop"."""
        return self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` advances (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_tokens} were advanced over")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error().splitlines()[0]}")
        self.num_tokens -= num_tokens
