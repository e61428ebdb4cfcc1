"""Constraint compilation and matching on the real tokenizer, driven by random logits (no model forward)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from serving.engine.constraints import (
    Constraint,
    ConstraintCompiler,
    ConstraintError,
    Matcher,
    _apply_bitmask_with_shifts,
    apply_bitmask,
    compile_error,
)
from tests.serving.engine.model import MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
MAX_STEPS = 300


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return json.loads((MODEL / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer, vocab_size)


def _generate(matcher: Matcher, vocab_size: int, seed: int) -> list[int]:
    """Argmax of random logits under the mask until the constraint ends; forced spans taken as they come."""
    gen = torch.Generator().manual_seed(seed)
    token_ids: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            assert matcher.allowed_token_ids() == [matcher.eos_token_id]
            return token_ids
        logits = torch.randn(vocab_size, generator=gen)
        matcher.apply(logits)
        token_id = int(logits.argmax())
        assert torch.isfinite(logits[token_id])
        matcher.advance(token_id)
        if token_id == matcher.eos_token_id:
            assert matcher.is_terminated()
            return token_ids
        token_ids.append(token_id)
        for forced_id in matcher.forced():
            matcher.advance(forced_id)
            token_ids.append(forced_id)
    raise AssertionError(f"not terminated after {MAX_STEPS} steps")


def _check_schema(value: dict) -> None:
    assert set(value) <= set(SCHEMA["properties"]) and set(SCHEMA["required"]) <= set(value)
    assert re.fullmatch("[A-Z][a-z]+", value["name"]) and len(value["name"]) <= 8
    assert type(value["age"]) is int and 18 <= value["age"] <= 120
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"red", "green", "blue"}
    assert set(value["address"]) == {"city", "zip"}
    assert isinstance(value["address"]["city"], str) and len(value["address"]["city"]) <= 12
    assert re.fullmatch("[0-9]{5}", value["address"]["zip"])
    assert type(value.get("active", True)) is bool


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_validates(compiler, tokenizer, vocab_size, seed):
    token_ids = _generate(compiler.compile(Constraint("json_schema", SCHEMA)).start(), vocab_size, seed)

    _check_schema(json.loads(tokenizer.decode(token_ids)))


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_matches(compiler, tokenizer, vocab_size, seed):
    pattern = r"[a-z]{2,10}@[a-z]{2,8}\.(com|org|net)"
    token_ids = _generate(compiler.compile(Constraint("regex", pattern)).start(), vocab_size, seed)

    assert re.fullmatch(pattern, tokenizer.decode(token_ids))


@pytest.mark.parametrize("seed", range(4))
def test_choice_output_is_one_of_them(compiler, tokenizer, vocab_size, seed):
    choices = ["yes please", "no thanks", "a.b*c|d (x)", "multi\nline ünïcode"]
    token_ids = _generate(compiler.compile(Constraint("choice", choices)).start(), vocab_size, seed)

    assert tokenizer.decode(token_ids) in choices


def test_json_object_accepts_any_object_only(compiler, tokenizer):
    grammar = compiler.compile(Constraint.json_object())
    matcher = grammar.start()
    for token_id in tokenizer.encode('{"a": [1, 2.5], "b": {"c": null}}', add_special_tokens=False):
        matcher.advance(token_id)

    assert matcher.is_accepting()
    assert matcher.eos_token_id in matcher.allowed_token_ids()
    with pytest.raises(ValueError, match="not allowed"):
        grammar.start().advance(tokenizer.encode("[", add_special_tokens=False)[0])


INVALID = [
    (Constraint("json_schema", {"type": "array", "uniqueItems": True}), "uniqueItems"),
    (Constraint("json_schema", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), '"not"'),
    (Constraint("json_schema", {"type": "strin"}), "strin"),
    (Constraint("json_schema", {"type": "string", "format": "banana"}), "banana"),
    (Constraint("json_schema", {"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
    (Constraint("json_schema", {"type": "string", "pattern": "(?=a)b"}), "look-around"),
    (Constraint("json_schema", {"$ref": "#/$defs/missing"}), "missing"),
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", True), "JSON object"),
    (Constraint("json_schema", {"enum": {1, 2}}), "not JSON-serializable"),
    (Constraint("regex", "[a-z"), "invalid regex '\\[a-z': unclosed character class"),
    (Constraint("regex", r"(a)\1"), "backreferences"),
    (Constraint("choice", []), "non-empty list"),
    (Constraint("choice", ["a", ""]), r"choice\[1\]"),
    (Constraint("grammar", "x"), "kind"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("constraint", "message"), INVALID)
def test_invalid_constraint_raises_naming_the_problem(compiler, constraint, message):
    with pytest.raises(ConstraintError, match=message) as e:
        compiler.compile(constraint)

    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith((constraint.kind, "kind: "))


@pytest.mark.parametrize(("constraint", "message"), INVALID)
def test_compile_error_refuses_the_same_without_a_tokenizer(constraint, message):
    # What a pipeline's own output: is checked with at load, before any model is loaded.
    assert re.search(message, compile_error(constraint.kind, constraint.value) or "")


@pytest.mark.parametrize("constraint", [Constraint("json_schema", SCHEMA), Constraint("regex", r"\d{3}-[a-z]+"),
                                        Constraint("choice", ["yes", "no"]), Constraint.json_object()])
def test_compile_error_passes_what_compiles(constraint):
    assert compile_error(constraint.kind, constraint.value) is None


def test_compile_is_cached_by_key(compiler, monkeypatch):
    first = compiler.compile(Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}))

    same_as_text = Constraint("json_schema", '{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert compiler.compile(same_as_text) is first
    assert Constraint("choice", ["a", "b"]).key() != Constraint("choice", ["b", "a"]).key()
    assert Constraint("regex", "a").key() != Constraint("choice", ["a"]).key()

    monkeypatch.setattr(compiler, "max_cached", 2)
    compiler.compile(Constraint("regex", "x+"))
    compiler.compile(Constraint("regex", "y+"))
    assert compiler.compile(first.constraint) is not first


def test_forced_tokens_finish_a_choice(compiler, tokenizer):
    matcher = compiler.compile(Constraint("choice", ["yes please", "no thanks"])).start()
    assert matcher.forced() == []

    matcher.advance(tokenizer.encode("yes", add_special_tokens=False)[0])
    forced = matcher.forced()
    assert tokenizer.decode(forced) == " please"
    for token_id in forced:
        matcher.advance(token_id)

    assert matcher.is_terminated()
    assert matcher.allowed_token_ids() == [tokenizer.eos_token_id]
    assert matcher.forced() == []


def test_matchers_of_one_grammar_are_independent(compiler, tokenizer, vocab_size):
    grammar = compiler.compile(Constraint("choice", ["yes please", "no thanks"]))
    advanced, fresh = grammar.start(), grammar.start()
    before = fresh.allowed_token_ids()
    advanced.advance(tokenizer.encode("no", add_special_tokens=False)[0])

    assert fresh.allowed_token_ids() == before
    assert advanced.allowed_token_ids() != before

    # One batch: only the constrained rows change, each by its own matcher.
    logits = torch.randn(3, vocab_size)
    original = logits.clone()
    bitmask = compiler.allocate_bitmask(3)
    advanced.fill_bitmask(bitmask[0])
    fresh.fill_bitmask(bitmask[2])
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits[1], original[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == advanced.allowed_token_ids()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == before


def test_disallowed_token_raises_and_leaves_the_matcher_usable(compiler, tokenizer):
    matcher = compiler.compile(Constraint("regex", "[0-9]+")).start()
    allowed = matcher.allowed_token_ids()

    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(tokenizer.encode("x", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(10**6)
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(tokenizer.eos_token_id)
    assert matcher.allowed_token_ids() == allowed
    matcher.advance(tokenizer.encode("7", add_special_tokens=False)[0])


def test_eos_ends_an_output_that_could_go_on(compiler, tokenizer):
    matcher = compiler.compile(Constraint("regex", "[0-9]+")).start()
    matcher.advance(tokenizer.encode("7", add_special_tokens=False)[0])
    assert matcher.is_accepting() and not matcher.is_terminated()
    assert tokenizer.eos_token_id in matcher.allowed_token_ids()

    matcher.advance(tokenizer.eos_token_id)

    assert matcher.is_terminated()
    assert matcher.allowed_token_ids() == [tokenizer.eos_token_id]


def test_rollback_restores_the_earlier_state(compiler, tokenizer):
    matcher = compiler.compile(Constraint("json_schema", SCHEMA)).start()
    token_ids = tokenizer.encode('{"name": "Bob", "age": 3', add_special_tokens=False)
    matcher.advance(token_ids[0])
    after_first = matcher.allowed_token_ids()
    for token_id in token_ids[1:]:
        matcher.advance(token_id)

    matcher.rollback(len(token_ids) - 1)

    assert matcher.allowed_token_ids() == after_first
    with pytest.raises(ValueError, match="cannot roll back 2"):
        matcher.rollback(2)
    assert matcher.allowed_token_ids() == after_first


def test_rollback_undoes_eos(compiler, tokenizer):
    matcher = compiler.compile(Constraint("regex", "[0-9]+")).start()
    matcher.advance(tokenizer.encode("7", add_special_tokens=False)[0])
    matcher.advance(tokenizer.eos_token_id)

    matcher.rollback(1)

    assert not matcher.is_terminated() and matcher.is_accepting()
    assert len(matcher.allowed_token_ids()) > 1


@pytest.mark.parametrize("shape", [(49152,), (3, 49152), (2, 49100)])
def test_apply_bitmask_matches_a_plain_unpack(shape):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=gen)
    num_words = (shape[-1] + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (*shape[:-1], num_words), dtype=torch.int32, generator=gen)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[..., : shape[-1]]
    expected = logits.masked_fill(torch.from_numpy(bits) == 0, float("-inf"))

    shifted = logits.clone()

    apply_bitmask(logits, bitmask)
    _apply_bitmask_with_shifts(shifted, bitmask)  # the GPU path, run here on the CPU

    assert torch.equal(logits, expected)
    assert torch.equal(shifted, expected)


def test_logits_wider_than_the_tokenizer(tokenizer):
    vocab_size = len(tokenizer) + 64
    compiler = ConstraintCompiler(tokenizer, vocab_size)
    matcher = compiler.compile(Constraint("regex", "[a-z]+")).start()
    logits = torch.zeros(vocab_size)

    matcher.apply(logits)

    assert max(matcher.allowed_token_ids()) < len(tokenizer)
    assert torch.isinf(logits[len(tokenizer):]).all()
