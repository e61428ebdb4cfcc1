"""Constrained-decoding libraries compared on SmolLM2's vocabulary: which one compiles our constraints.

    .venv/bin/python bench/constraints.py [--quick] [--only NAME ...] [--model DIR] [--seed N]

For each of llguidance, xgrammar and outlines-core that imports (one that does not is named in ``notes``):

  setup_ms       one-time tokenizer preparation for the whole vocabulary (cache it per tokenizer)
  compile_ms     per constraint, cold: a JSON schema (nested object, array of enums, integer with a minimum,
                 string with pattern and maxLength, required fields), a regex and a choice of three strings;
                 for llguidance it includes building the template matcher, for xgrammar the compiler's
                 cache is off, for outlines-core it is the regex → token index
  start_us       a fresh per-request matcher from the compiled constraint
  first_path_us  fill + advance over the whole valid path below, the first time (lazy state building shows here)
  fill_us        per token of a fixed valid path (the same HF tokenization for every library): the
                 allowed-token bitmask of one row (median, p90, mean over 30 passes, 5 with --quick)
  advance_us     per token of that path: consuming it
  walk           two generations from the argmax of seeded random logits under each library's own mask, until
                 EOS or 300 tokens: how many tokens, how many ended with EOS, and the fill times there (free
                 text inside strings is often the costly state); a token the mask allowed but advance rejected
                 is an error
  keywords       per JSON Schema keyword: ``enforced`` (a valid instance is accepted and one invalid only in
                 that keyword is rejected), ``ignored`` (both accepted), ``error`` (compile refused it: the
                 message) or ``wrong`` (the valid instance was rejected)

The valid paths: a JSON instance of the schema written by ``json.dumps`` (separators ", " and ": ", which every
library is configured to require), an e-mail address for the regex and the last choice. ``apply_us``
compares ways to turn one bitmask row into -inf logits (numpy unpack + masked_fill, torch shifts, xgrammar's
CPU kernel where it imports, and the byte lookup table + add that serving/engine/constraints.py uses).
Everything runs on the CPU. The last line of output is one JSON object with all figures, ``timings_s`` and
``notes``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import statistics
import time

# As bench/engine.py: the engine package sets it, but only before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 300

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
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
REGEX = r"[a-z]{2,10}@[a-z]{2,8}\.(com|org|net)"
CHOICE = ["yes please", "no thanks", "maybe later"]
CONSTRAINTS = [
    ("json_schema", SCHEMA, json.dumps({"name": "Alice", "age": 30, "tags": ["red", "blue"],
                                        "address": {"city": "Paris", "zip": "75001"}, "active": True})),
    ("regex", REGEX, "alice@example.com"),
    ("choice", CHOICE, "maybe later"),
]

_INT = {"type": "integer"}
KEYWORDS: list[tuple[str, dict, object, object]] = [
    ("enum", {"enum": ["a", "b"]}, "a", "c"),
    ("const", {"const": "x"}, "x", "y"),
    ("type list", {"type": ["string", "null"]}, None, 1),
    ("minimum", {"type": "integer", "minimum": 5}, 7, 3),
    ("maximum", {"type": "integer", "maximum": 5}, 3, 7),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, 6, 5),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 5}, 4, 5),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 9, 10),
    ("number minimum", {"type": "number", "minimum": 1.5}, 2.5, 1.0),
    ("minLength", {"type": "string", "minLength": 3}, "abcd", "ab"),
    ("maxLength", {"type": "string", "maxLength": 3}, "ab", "abcd"),
    ("pattern", {"type": "string", "pattern": "^[0-9]{3}$"}, "123", "12a"),
    ("pattern+maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "abc", "abcdef"),
    ("format date", {"type": "string", "format": "date"}, "2024-01-31", "hello"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2024-01-31T10:00:00Z", "hello"),
    ("format email", {"type": "string", "format": "email"}, "a@b.com", "hello"),
    ("format uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "hello"),
    ("items", {"type": "array", "items": _INT}, [1, 2], [1, "a"]),
    ("minItems", {"type": "array", "items": _INT, "minItems": 2}, [1, 2], [1]),
    ("maxItems", {"type": "array", "items": _INT, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ("uniqueItems", {"type": "array", "items": _INT, "uniqueItems": True}, [1, 2], [1, 1]),
    ("prefixItems", {"type": "array", "prefixItems": [_INT, {"type": "string"}], "items": False}, [1, "a"], ["a", 1]),
    ("contains", {"type": "array", "contains": {"const": 1}}, [1], [2]),
    ("required", {"type": "object", "properties": {"a": _INT}, "required": ["a"]}, {"a": 1}, {}),
    ("additionalProperties false", {"type": "object", "properties": {"a": _INT}, "additionalProperties": False},
     {"a": 1}, {"a": 1, "b": 2}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": _INT}, {"x": 1}, {"x": "s"}),
    ("minProperties", {"type": "object", "additionalProperties": _INT, "minProperties": 1}, {"x": 1}, {}),
    ("maxProperties", {"type": "object", "additionalProperties": _INT, "maxProperties": 1}, {"x": 1}, {"x": 1, "y": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": _INT}, "additionalProperties": False},
     {"x1": 1}, {"y": 1}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"A1": 1}),
    ("anyOf", {"anyOf": [_INT, {"type": "string"}]}, 1, True),
    ("oneOf", {"oneOf": [_INT, {"type": "boolean"}]}, 1, "s"),
    ("allOf", {"allOf": [_INT, {"minimum": 3}]}, 4, 2),
    ("not", {"not": _INT}, "s", 1),
    ("$ref/$defs", {"$defs": {"p": _INT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}},
                    "required": ["a"]}, {"a": 1}, {"a": "s"}),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "required": ["c"], "additionalProperties": False,
                                        "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                        "$ref": "#/$defs/n"}, {"c": [{"c": []}]}, {"c": [{}]}),
    ("if/then", {"type": "object", "properties": {"a": _INT, "b": _INT},
                 "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("dependentRequired", {"type": "object", "properties": {"a": _INT, "b": _INT}, "dependentRequired": {"a": ["b"]}},
     {"a": 1, "b": 2}, {"a": 1}),
]


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


def _choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(_escape_regex(c) for c in choices) + ")"


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, value):
        m = self.ll.LLMatcher
        if kind == "json_schema":
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            grammar = m.grammar_from_json_schema(value, defaults=options)
        else:
            grammar = m.grammar_from_regex(value if kind == "regex" else _choice_regex(value))
        is_error, messages = m.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0])
        return m(self.tok, grammar, log_level=0)

    def start(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def finish(self, matcher, eos_id: int) -> bool:
        return matcher.consume_token(eos_id)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, kind: str, value):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(value)
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask.view(1, -1), 0)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def finish(self, matcher, eos_id: int) -> bool:
        return matcher.accept_token(eos_id)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core

        self.oc = outlines_core
        # Byte-level BPE: map each token's printable form back to its bytes (GPT-2's table).
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = [b for b in range(256) if b not in printable]
        to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
        special = set(tokenizer.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id not in special and token_id < vocab_size:
                by_bytes.setdefault(bytes(to_byte[c] for c in token), []).append(token_id)
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, kind: str, value):
        if kind == "json_schema":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(value), r"[ ]?")
        else:
            regex = value if kind == "regex" else _choice_regex(value)
        return self.oc.Index(regex, self.vocab)

    def start(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def advance(self, matcher, token_id: int) -> bool:
        matcher.advance(token_id, return_tokens=False)
        return True

    def finish(self, matcher, eos_id: int) -> bool:
        return matcher.is_finished()


LIBRARIES = {lib.name: lib for lib in (Llguidance, Xgrammar, OutlinesCore)}


def _apply_numpy(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: logits.shape[-1]]
    logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _apply_shifts(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(-1)[: logits.shape[-1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 2)


def _walk(lib, compiled, vocab_size: int, eos_id: int, gen: torch.Generator) -> tuple[list[float], bool]:
    """One generation from random logits under the mask: fill times in µs, and whether EOS ended it."""
    matcher = lib.start(compiled)
    bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    fill_us = []
    for _ in range(MAX_STEPS):
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask)
        fill_us.append((time.perf_counter() - t0) * 1e6)
        logits = torch.randn(vocab_size, generator=gen)
        _apply_numpy(logits, bitmask)
        token_id = int(logits.argmax())
        if token_id == eos_id:
            return fill_us, True
        if not lib.advance(matcher, token_id):
            raise RuntimeError(f"{lib.name} rejected token {token_id} that its own mask allowed")
    return fill_us, False


def _path(lib, compiled, token_ids: list[int], vocab_size: int) -> tuple[list[float], list[float]]:
    """Fill and advance times in µs along a fixed valid token path."""
    matcher = lib.start(compiled)
    bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    fill_us, advance_us = [], []
    for token_id in token_ids:
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask)
        t1 = time.perf_counter()
        if not lib.advance(matcher, token_id):
            raise RuntimeError(f"{lib.name} rejected token {token_id} of a valid path")
        advance_us.append((time.perf_counter() - t1) * 1e6)
        fill_us.append((t1 - t0) * 1e6)
    return fill_us, advance_us


def _keyword_support(lib, tokenizer, eos_id: int) -> dict[str, str]:
    out = {}
    for keyword, schema, valid, invalid in KEYWORDS:
        try:
            compiled = lib.compile("json_schema", schema)
        except Exception as e:  # each library raises its own error types
            out[keyword] = "error: " + str(e).splitlines()[0][:120]
            continue
        verdicts = []
        for instance in (valid, invalid):
            matcher = lib.start(compiled)
            ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
            try:
                verdicts.append(all(lib.advance(matcher, t) for t in ids) and lib.finish(matcher, eos_id))
            except Exception:
                verdicts.append(False)
        out[keyword] = {(True, False): "enforced", (True, True): "ignored"}.get(tuple(verdicts), "wrong")
    return out


def _pct(values: list[float], q: float) -> float:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))], 1) if values else float("nan")


def _stats(values: list[float]) -> dict:
    return {"median": _pct(values, 0.5), "p90": _pct(values, 0.9), "mean": round(statistics.fmean(values), 1)}


def _bench_library(lib, tokenizer, vocab_size: int, eos_id: int, num_runs: int, seed: int) -> dict:
    result: dict = {key: {} for key in ("compile_ms", "start_us", "first_path_us", "fill_us", "advance_us", "walk")}
    for kind, value, text in CONSTRAINTS:
        t0 = time.perf_counter()
        compiled = lib.compile(kind, value)
        result["compile_ms"][kind] = _ms(t0)
        t0 = time.perf_counter()
        for _ in range(20):
            lib.start(compiled)
        result["start_us"][kind] = round((time.perf_counter() - t0) / 20 * 1e6, 1)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        fills, advances = _path(lib, compiled, token_ids, vocab_size)
        result["first_path_us"][kind] = round(sum(fills) + sum(advances))
        for _ in range(num_runs):
            f, a = _path(lib, compiled, token_ids, vocab_size)
            fills += f
            advances += a
        result["fill_us"][kind] = _stats(fills)
        result["advance_us"][kind] = _stats(advances)
        gen = torch.Generator().manual_seed(seed)
        walks = [_walk(lib, compiled, vocab_size, eos_id, gen) for _ in range(2)]
        result["walk"][kind] = {"tokens": [len(f) for f, _ in walks], "finished": sum(done for _, done in walks),
                                "fill_us": _stats([x for f, _ in walks for x in f])}
        print(f"  {kind:12s} compile {result['compile_ms'][kind]:7.1f} ms  start {result['start_us'][kind]:5.1f} µs  "
              f"first path {result['first_path_us'][kind]:6d} µs / {len(token_ids)} tokens  "
              f"fill {result['fill_us'][kind]['median']:6.1f} µs (mean {result['fill_us'][kind]['mean']:.1f})  "
              f"advance {result['advance_us'][kind]['median']:5.1f} µs  "
              f"walk fill mean {result['walk'][kind]['fill_us']['mean']:.1f} µs", flush=True)
    result["keywords"] = _keyword_support(lib, tokenizer, eos_id)
    return result


def _bench_apply(vocab_size: int) -> dict:
    bitmask = torch.randint(-(2**31), 2**31 - 1, ((vocab_size + 31) // 32,), dtype=torch.int32)
    logits = torch.randn(vocab_size)
    ways = {"numpy_unpackbits": _apply_numpy, "torch_shifts": _apply_shifts}
    try:
        import xgrammar

        ways["xgrammar_cpu"] = lambda lg, bm: xgrammar.apply_token_bitmask_inplace(lg.view(1, -1), bm.view(1, -1))
    except ImportError:
        pass
    from serving.engine.constraints import apply_bitmask

    ways["bias_table_add (ours)"] = apply_bitmask
    out = {}
    for name, fn in ways.items():
        fn(logits.clone(), bitmask)
        t0 = time.perf_counter()
        for _ in range(200):
            fn(logits, bitmask)
        out[name] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 timed passes over each path instead of 30")
    parser.add_argument("--only", nargs="+", choices=sorted(LIBRARIES), help="the libraries to run (default: all)")
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"), help="model folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random logits")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import transformers

    t_all = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    eos_id = tokenizer.eos_token_id
    report: dict = {"vocab_size": vocab_size, "tokenizer_len": len(tokenizer), "libraries": {}, "notes": [],
                    "timings_s": {}}
    for name in args.only or LIBRARIES:
        t0 = time.perf_counter()
        try:
            lib = LIBRARIES[name](tokenizer, vocab_size)
        except ImportError as e:
            report["notes"].append(f"{name}: not installed ({e})")
            continue
        setup_ms = _ms(t0)
        print(f"{name}: setup {setup_ms:.0f} ms", flush=True)
        report["libraries"][name] = {"setup_ms": setup_ms} | _bench_library(
            lib, tokenizer, vocab_size, eos_id, 5 if args.quick else 30, args.seed)
        report["timings_s"][name] = round(time.perf_counter() - t0, 1)
    report["apply_us"] = _bench_apply(vocab_size)
    print("apply (one row):", report["apply_us"], flush=True)
    report["timings_s"]["total"] = round(time.perf_counter() - t_all, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
