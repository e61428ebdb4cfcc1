"""Incremental detokenization and stop strings, without a model."""

from __future__ import annotations

import pytest

from stages.text import IncrementalDetokenizer, StopStrings


# A byte-level toy tokenizer: token id = one byte, as GPT-2 style tokenizers can split characters.
def decode_bytes(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_never_split():
    text = "héllo 👋 wörld"
    detok = IncrementalDetokenizer(decode_bytes)
    deltas = [detok.add(b) for b in text.encode()]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "👋" in deltas  # the 4-byte emoji arrives whole, in one delta


def test_flush_returns_an_unfinished_character_as_replacement():
    detok = IncrementalDetokenizer(decode_bytes)
    assert detok.add(0xF0) == ""
    assert detok.flush() == "\ufffd"


def test_context_tokens_are_not_emitted():
    detok = IncrementalDetokenizer(decode_bytes, context_ids=list(b"prompt: "))
    assert detok.add(ord("A")) == "A"


@pytest.mark.parametrize("chunks", [
    ["Hello wor", "ld\n\nUs", "er: more"],
    ["Hello world", "\n", "\n", "U", "s", "e", "r", ":", " more"],
    ["Hello world\n\nUser: more"],
])
def test_stop_string_across_chunks(chunks):
    stops = StopStrings(["\n\nUser:"])
    sent, hit = [], False
    for chunk in chunks:
        text, hit = stops.feed(chunk)
        sent.append(text)
        if hit:
            break
    assert hit
    assert "".join(sent) == "Hello world"


def test_partial_match_is_released_when_it_is_not_a_stop():
    stops = StopStrings(["STOP"])
    assert stops.feed("ab ST") == ("ab ", False)
    assert stops.feed("ART") == ("START", False)
    assert stops.feed("x ST") == ("x ", False)
    assert stops.flush() == "ST"


def test_earliest_of_several_stops_wins():
    stops = StopStrings(["END", "\n"])
    assert stops.matched is None
    assert stops.feed("one\ntwo END") == ("one", True)
    assert stops.matched == "\n"  # which one ended the text (Anthropic's stop_sequence)


def test_no_stops_passes_through():
    assert StopStrings([]).feed("anything") == ("anything", False)
