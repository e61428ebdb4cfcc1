"""Output rails over streamed text, fed in every chunk size."""

from __future__ import annotations

import pytest

from stages.detectors import DenyMatcher, DenyRule
from stages.rails import Detectors, OutputRails, non_overlapping, pii_actions, strongest

DENY = DenyMatcher([DenyRule("secrets", "security", keywords=("launch codes",))])


def rails(pii: str = "redact", deny: str = "block", hold_back: int = 24, restore=None) -> OutputRails:
    return OutputRails("guard", Detectors(pii_actions(pii, {}), DENY, {"secrets": deny}), hold_back, restore)


def stream(filter_: OutputRails, text: str, size: int) -> tuple[list[str], str | None]:
    sent: list[str] = []
    for start in range(0, len(text), size):
        piece, reason = filter_.feed(text[start:start + size])
        sent.append(piece)
        if reason:
            return sent, reason
    piece, reason = filter_.flush()
    sent.append(piece)
    return sent, reason


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50, 1000])
def test_redaction_is_the_same_whatever_the_chunking(size):
    text = "Write to ann.lee@mail.example or 415-555-2671, then wait for the reply from the office."
    sent, reason = stream(rails(), text, size)
    assert "".join(sent) == "Write to <EMAIL_1> or <PHONE_1>, then wait for the reply from the office."
    assert reason is None


@pytest.mark.parametrize("size", [1, 4, 9, 1000])
def test_a_block_sends_only_what_came_before_it(size):
    text = "Sure. The launch codes are 0000 and more secrets follow after this sentence here."
    filter_ = rails()
    sent, reason = stream(filter_, text, size)
    assert "".join(sent) == "Sure. The "
    assert reason == "content_filter"
    assert filter_.feed("more")[1] == "content_filter"  # stays stopped
    assert filter_.decisions == [{"stage": "guard", "where": "output", "rule": "deny.secrets",
                                  "category": "security", "action": "block", "score": 1.0, "span": [10, 22]}]


def test_text_is_held_back_but_never_lost():
    filter_ = rails(hold_back=10)
    first, _ = filter_.feed("one two three four five six")
    assert first and len(first) <= len("one two three four five six") - 10
    assert not first.endswith("fi")  # never a cut inside a word
    rest, reason = filter_.flush()
    assert first + rest == "one two three four five six" and reason is None


def test_flag_records_without_changing_the_text():
    filter_ = rails(pii="flag", deny="flag")
    sent, _ = stream(filter_, "The launch codes go to a@b.io today.", 3)
    assert "".join(sent) == "The launch codes go to a@b.io today."
    assert [(d["rule"], d["action"], d["span"]) for d in filter_.decisions] == [
        ("deny.secrets", "flag", [4, 16]), ("pii.email", "flag", [23, 29])]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_restore_never_confuses_the_callers_values_with_new_placeholders(size):
    filter_ = rails(restore={"<EMAIL_1>": "me@home.example"})
    text = "I wrote to <EMAIL_1> and copied x@y.example as asked, all done now."
    sent, _ = stream(filter_, text, size)
    assert "".join(sent) == "I wrote to me@home.example and copied <EMAIL_1> as asked, all done now."
    assert filter_.sent_redacted == "I wrote to <EMAIL_1> and copied <EMAIL_1> as asked, all done now."


def test_helpers():
    assert pii_actions("redact", {"ip": "allow", "card": "block"}, ("email", "ip", "card")) == {
        "email": "redact", "card": "block"}
    assert strongest(["flag", "block", "redact"]) == "block" and strongest([]) == "allow"
    from stages.detectors import Finding
    kept = non_overlapping([Finding("a", "x", 0, 5), Finding("b", "x", 3, 8), Finding("c", "x", 8, 9)])
    assert [f.rule for f in kept] == ["a", "c"]


@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_overlapping_findings_never_leak_a_redacted_span(size):
    deny = DenyMatcher([DenyRule("line", "info", patterns=(r"2671 (?:is|was) the [a-z]{1,10} line",))])
    filter_ = OutputRails("guard", Detectors(pii_actions("redact", {}), deny, {"line": "flag"}), 48)
    sent, _ = stream(filter_, "Or call +1 415 555 2671 is the main line for the office and more words here.", size)
    assert "555" not in "".join(sent) and "<PHONE_1>" in "".join(sent)


def test_a_block_never_sends_part_of_an_overlapping_span():
    deny = DenyMatcher([DenyRule("malware", "security", keywords=("keylogger",))])
    filter_ = OutputRails("guard", Detectors(pii_actions("redact", {}), deny, {"malware": "block"}), 48)
    sent, reason = stream(filter_, "Please contact my.keylogger@corp.example for the tool", 3)
    assert "".join(sent) == "Please contact " and reason == "content_filter"


def test_text_without_spaces_still_streams():
    filter_ = rails(hold_back=16)
    text = "数据" * 400
    sent, _ = stream(filter_, text, 2)
    assert sum(len(piece) for piece in sent[:-1]) > len(text) - 40  # released as it comes, not at the end
    assert "".join(sent) == text
