"""Text detectors for input rails and streaming output rails: PII, deny rules and prompt injection.

Plain Python and ``re``. Every regex is compiled once: at import, or for deny rules when the matcher is
built, and written so that ``re`` can skip through prose in C (see "Speed").

    findings = find_pii(text)                        # [Finding(rule="pii.email", kind="EMAIL", ...), ...]
    redactor = Redactor()                            # one per request
    safe = redactor.redact(text, findings)           # "mail <EMAIL_1> or call <PHONE_1>"
    redactor.restore(model_output)                   # placeholders back to the original values
    DenyMatcher([DenyRule("weapons", keywords=("pipe bomb",))]).find(text)
    injection_score(text).score                      # 0..1

The detectors favour precision: a rail that flags ordinary prompts gets turned off, so a candidate must
pass a checksum or a structural check before it is reported. Choices worth knowing:

- Overlapping PII candidates: the longer span wins; on equal length the higher priority
  (secret > card > iban > ssn > email > ip > phone).
- Phones need separators or a leading "+": a bare run of digits (an order number, a Unix time) is never
  a phone. NANP numbers need a valid area code and exchange (first digit 2-9).
- Cards need a network's prefix and length (Visa, Mastercard, Amex, Diners, JCB, Discover/UnionPay),
  the usual groupings (4-4-4-4, 4-6-5, ...) and a valid Luhn sum.
- IBANs are uppercase and mod-97 checked, without a per-country length table.
- IPv4 octets are 0-255 without leading zeros. IPv6 needs a digit; a "::" form needs two groups, one of
  them 3+ digits long: "fe80::1" is an address, "::1", "dead::beef" and the slice "x[1::2]" are not.
- High-entropy secrets need upper, lower and digits, so hex git SHAs and UUIDs (lowercase hex) are not
  flagged; nor are CamelCase names, paths ("/" ends a token) or runs over 256 characters (data, not keys).
- ``password=...`` style assignments report only the value. A quoted value counts unless it looks like
  code or a snake_case name; an unquoted one must mix letters with digits or symbols ("hunter2" yes,
  "letmein" no).
- Deny keywords match whole words, case-insensitively, any whitespace run matching a space.
- Injection heuristics are weighted regexes; weights below 0.5 (new_instructions, zero-width characters,
  base64 blobs, generic chat-template tokens) do not block on their own.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

PII_TYPES: tuple[str, ...] = ("email", "phone", "card", "iban", "ssn", "ip", "secret")

# On overlap with equal lengths the lower number wins.
_PRIORITY = {"secret": 0, "card": 1, "iban": 2, "ssn": 3, "email": 4, "ip": 5, "phone": 6}

_Span = tuple[int, int]


def _lower(text: str) -> str:
    """``text.lower()`` with every index unchanged, so spans found in it hold for *text*."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    # A few characters lower to two ("İ" -> "i̇"): keep those as they are.
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


def _word_start(*words: str) -> str:
    """A regex for any of *words* (lowercase regex sources) starting a word, in a form ``re`` can skip to.

    See "Speed" below: first letter, then the boundary check as a look-behind, then the rest.
    """
    return "(?:" + "|".join(rf"{re.escape(w[0])}(?<!\w.){w[1:]}" for w in words) + ")"


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected span ``text[start:end]``.

    ``rule`` is "pii.<type>", "deny.<rule id>" or "injection.<heuristic>"; ``category`` is "pii",
    the deny rule's category or "injection"; ``kind`` names the placeholder for PII ("EMAIL", ...).
    """

    rule: str
    category: str
    start: int
    end: int
    score: float = 1.0
    kind: str = ""


# ---------------------------------------------------------------- PII patterns

# Speed: a pattern that opens with a literal or a character class lets ``re`` skip in C to where that
# character occurs; one that opens with a look-behind enters the matcher at every position (many times
# slower on prose). So patterns consume their first character, then check the character before it with a
# two-character look-behind, ``(?<![\w].)``. Rare anchors ("@", "+") are found with str.find or a literal.

_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])")
_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}\Z")  # searched in the 64 characters before "@"
_EMAIL_LOCAL_MAX = 64

# International: "+" then digit groups, each after a mandatory separator, so that no digit run can be
# split two ways (no catastrophic backtracking); or E.164 without separators.
_PHONE_INTL = re.compile(
    r"\+(?<![\w+.-].)(?:\d{1,4}(?:[ .-]?\(\d{1,4}\)[ .-]?\d{1,8})?(?:[ .-]\d{1,8}){0,6}|\d{8,15})(?!\w|[.-]\d)")
# NANP without its optional "+1 " (see _NANP_PREFIX): NXX area code, NXX exchange, separators required.
_PHONE_NANP = re.compile(
    r"[(2-9](?<![\w+].)(?:(?<=\()[2-9]\d\d\) ?|(?<=[2-9])\d\d[ .-])[2-9]\d\d[ .-]\d{4}(?!\w|[.-]\d)")
_NANP_PREFIX = re.compile(r"\+?1[ .-]?\Z")

# Each repetition consumes exactly one digit, so backtracking stays linear.
_CARD = re.compile(r"[2-6](?<![\w.-].)\d{3}(?:[ -]?\d){9,15}(?!\d)")
_CARD_SEPARATOR = re.compile(r"[ -]")
_CARD_GROUPINGS = ((4, 6, 5), (4, 6, 4))  # Amex, Diners; everything else is groups of four
# Network prefixes and lengths: Visa, Mastercard (both series), Amex, Diners, JCB, Discover/UnionPay/Maestro.
_CARD_NETWORKS = re.compile(r"4(?:\d{12}|\d{15}|\d{18})|5[1-5]\d{14}|2[2-7]\d{14}|3[47]\d{13}|3[0689]\d{12,14}"
                            r"|35\d{14,17}|6\d{15,18}")

_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9].)[A-Z]\d\d(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?(?![A-Za-z0-9])")

# Areas 000, 666 and 9xx, group 00 and serial 0000 are never issued.
_SSN = re.compile(r"[0-8](?<![\w-].)\d\d(?<!000)(?<!666)([ -])(?!00)\d\d\1(?!0000)\d{4}(?![\w-]|\.\d)")

# Octets are range-checked in Python: simpler than a regex alternation, and no leading zeros.
_IPV4 = re.compile(r"\d(?<![\w.].)\d{0,2}(?:\.\d{1,3}){3}(?!\w|\.\d)")
_HEXTET = r"[0-9A-Fa-f]{1,4}"
_IPV6 = re.compile(
    rf"(?<![\w:.])(?:(?:{_HEXTET}:){{7}}{_HEXTET}"
    rf"|(?:{_HEXTET}(?::{_HEXTET})*)?::(?:{_HEXTET}(?::{_HEXTET})*)?)(?![\w:]|\.\d)"
)
# Both IPv6 forms contain "::" or ":<hextet>:"; found by a literal ":", they anchor the full pattern, which
# can only start where the run of hex digits and colons around them starts (39 characters at most).
_IPV6_HINT = re.compile(r":(?::|[0-9A-Fa-f]{1,4}:)")
_IPV6_RUN_BEFORE = re.compile(r"[0-9A-Fa-f:]*\Z")
_IPV6_RUN = re.compile(r"[0-9A-Fa-f:]+")
_IPV6_MAX = 39

_SECRET_TOKENS = (
    r"s(?<![\w-].)k-(?:proj-|ant-|live-|test-)?(?P<sk>[A-Za-z0-9_-]{20,})",  # OpenAI, Anthropic
    r"s(?<![\w-].)k_(?:live|test)_[A-Za-z0-9]{24,}",  # Stripe
    r"g(?<![\w-].)h(?:[pousr]_[A-Za-z0-9]{36,255}|ithub_pat_[A-Za-z0-9_]{22,255})",
    r"h(?<![\w-].)f_[A-Za-z0-9]{34,}",  # Hugging Face
    r"A(?<![\w-].)(?:KIA|SIA)[A-Z0-9]{16}",  # AWS access key id
    r"A(?<![\w-].)Iza[0-9A-Za-z_-]{35}",  # Google
    r"x(?<![\w-].)ox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
    r"i(?<![\w-].)l_[A-Za-z0-9]{12}_[A-Za-z0-9_-]{43}",  # Inferline (store/keys.py)
    r"e(?<![\w-].)yJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*",  # JWT
)
_SECRET_TOKEN = re.compile(
    "|".join(f"{token}(?![\\w-])" for token in _SECRET_TOKENS)
    # An unterminated block (a stream cut mid-key) runs to the end of the text.
    + r"|-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(?:-----END[A-Z0-9 ]*PRIVATE KEY-----|\Z)"
)
# Every _SECRET_TOKEN match contains one of these: most texts skip the pass.
_SECRET_TOKEN_HINTS = ("sk-", "sk_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "hf_", "github_pat_", "AKIA", "ASIA",
                       "xox", "AIza", "il_", "eyJ", "-----BEGIN")

# Matched in lowercased text. "_" may precede the name (DB_PASSWORD=...; "auth_token" ends in "token").
_SECRET_NAME = "|".join(rf"{n[0]}(?<![a-z0-9].){n[1:]}" for n in (
    r"pass(?:word|wd|phrase)", "pwd", r"secret(?:[ _-]?(?:access[ _-]?)?key)?", r"api[ _-]?key",
    r"access[ _-]?key(?:[ _-]?id)?", r"private[ _-]?key", "token"))
_SECRET_NAME_HINTS = ("pass", "pwd", "secret", "key", "token")
# Only the value is reported.
_ASSIGNMENT = re.compile(
    rf"(?:{_SECRET_NAME})[\"']?[ \t]*[:=][ \t]*"
    r"(?:(?P<q>[\"'`])(?P<quoted>[^\"'`\s]{4,200})(?P=q)|(?P<bare>[^\s\"'`,;]{6,200}))"
)
# Code rather than a literal: calls, templates, attribute paths, masks ("hf_***").
_NOT_A_LITERAL = re.compile(r"[()\[\]{}<>]|^[$%@&]|\*\*|\.\.\.|^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
# Unquoted, joined words are prose or a name ("token: state-of-the-art", "secret: my_secret").
_JOINED_WORDS = re.compile(r"[A-Za-z]+(?:[-_][A-Za-z]+)*")
_PLACEHOLDER_VALUES = frozenset({"none", "null", "true", "false", "redacted", "required", "optional", "string"})

# "/" ends a token: with it, URL and file paths look random. 256+ characters are data (images), not keys.
# (A look-behind first is faster here: the first character would match almost everywhere.)
_ENTROPY_TOKEN = re.compile(r"(?<![A-Za-z0-9+_-])[A-Za-z0-9+_-]{32,256}={0,2}(?![A-Za-z0-9+=_-])")
_MIN_ENTROPY_BITS = 4.0
# Random text changes character class (upper/lower/digit/other) between ~60% of neighbours and has few
# word-like runs; CamelCase and kebab identifiers (Qwen2_5OmniThinkerForConditionalGeneration) do not.
_MIN_CLASS_CHANGES = 0.4
_MAX_WORDY = 0.6
_WORDY_RUN = re.compile(r"[A-Z]?[a-z]{3,}|[A-Z]{3,}")
_CHAR_CLASS = str.maketrans(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", "U" * 26 + "l" * 26 + "d" * 10)


# ---------------------------------------------------------------- PII validators

def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_groups_ok(groups: list[str], seps: set[str]) -> bool:
    if len(groups) == 1:
        return True
    if len(seps) != 1:
        return False
    lengths = tuple(len(g) for g in groups)
    if lengths in _CARD_GROUPINGS:
        return True
    return all(n == 4 for n in lengths[:-1]) and 1 <= lengths[-1] <= 4


def _card_span(start: int, raw: str) -> _Span | None:
    """The longest Luhn-valid card at the start of *raw*, dropping trailing groups (an expiry, a CVV)."""
    groups = _CARD_SEPARATOR.split(raw)
    seps = set(_CARD_SEPARATOR.findall(raw))
    for n in range(len(groups), 0, -1):
        digits = "".join(groups[:n])
        if len(digits) < 13:
            break
        if _card_groups_ok(groups[:n], seps) and _CARD_NETWORKS.fullmatch(digits) and _luhn_ok(digits):
            return start, start + len(" ".join(groups[:n]))
    return None


def _iban_ok(compact: str) -> bool:
    if not 15 <= len(compact) <= 34:
        return False
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _iban_span(start: int, raw: str) -> _Span | None:
    groups = raw.split(" ")
    for n in range(len(groups), 0, -1):
        if _iban_ok("".join(groups[:n])):
            return start, start + len(" ".join(groups[:n]))
    return None


def _nanp_start(text: str, start: int) -> int | None:
    """Where a NANP number found at *start* begins, with its "+1 " prefix; None if glued to other text."""
    prefix = _NANP_PREFIX.search(text, max(0, start - 3), start)
    if prefix:
        start = prefix.start()
    return None if _glued(text, start, "_+.-") else start


def _ipv4_ok(raw: str) -> bool:
    return all(int(octet) <= 255 and (octet == "0" or octet[0] != "0") for octet in raw.split("."))


def _ipv6_ok(raw: str) -> bool:
    if not any(ch.isdigit() for ch in raw):
        return False
    hextets = [h for h in raw.split(":") if h]
    if "::" not in raw:
        return len(hextets) == 8
    # Python slices (x[1::2]) and C++ names are "::" between short groups; addresses have a long one.
    return raw.count("::") == 1 and 2 <= len(hextets) <= 7 and max(map(len, hextets)) >= 3


def _entropy(token: str) -> float:
    n = len(token)
    return -sum(c / n * math.log2(c / n) for c in Counter(token).values())


def _looks_random(token: str) -> bool:
    body = token.rstrip("=")
    classes = body.translate(_CHAR_CLASS)
    if not ("U" in classes and "l" in classes and "d" in classes):
        return False
    changes = sum(a != b for a, b in pairwise(classes)) / (len(classes) - 1)
    if changes < _MIN_CLASS_CHANGES:
        return False
    wordy = sum(len(run) for run in _WORDY_RUN.findall(body)) / len(body)
    return wordy < _MAX_WORDY and _entropy(body) >= _MIN_ENTROPY_BITS


def _assignment_value_ok(value: str, quoted: bool) -> bool:
    if value.lower() in _PLACEHOLDER_VALUES or _NOT_A_LITERAL.search(value):
        return False
    if quoted:  # but a snake_case name is a constant's name (ACCESS_TOKEN = "access_token")
        return "_" not in value or not _JOINED_WORDS.fullmatch(value)
    # Unquoted, it must mix letters with digits or symbols: not a number, not words or an identifier.
    return any(c.isalpha() for c in value) and not _JOINED_WORDS.fullmatch(value)


# ---------------------------------------------------------------- PII scanners

def _glued(text: str, start: int, joiners: str) -> bool:
    """Whether the character before *start* continues a word (a letter, digit or one of *joiners*)."""
    return start > 0 and (text[start - 1].isalnum() or text[start - 1] in joiners)


def _scan_email(text: str) -> Iterator[_Span]:
    # Anchored on "@", found by str.find: no regex pass at all over text without one.
    at = text.find("@")
    while at != -1:
        domain = _EMAIL_DOMAIN.match(text, at + 1)
        local = domain and _EMAIL_LOCAL.search(text, max(0, at - _EMAIL_LOCAL_MAX), at)
        if domain and local and not _glued(text, local.start(), "_.%+-"):
            yield local.start(), domain.end()
        at = text.find("@", at + 1)


def _scan_phone(text: str) -> Iterator[_Span]:
    if "+" in text:
        for m in _PHONE_INTL.finditer(text):
            if 8 <= sum(ch.isdigit() for ch in m.group()) <= 15:
                yield m.span()
    for m in _PHONE_NANP.finditer(text):
        start = _nanp_start(text, m.start())
        if start is not None:
            yield start, m.end()


def _scan_card(text: str) -> Iterator[_Span]:
    for m in _CARD.finditer(text):
        span = _card_span(m.start(), m.group())
        if span:
            yield span


def _scan_iban(text: str) -> Iterator[_Span]:
    for m in _IBAN.finditer(text):
        span = _iban_span(m.start(), m.group())
        if span:
            yield span


def _scan_ssn(text: str) -> Iterator[_Span]:
    return (m.span() for m in _SSN.finditer(text))


def _scan_ipv6(text: str) -> Iterator[_Span]:
    pos = 0
    while hint := _IPV6_HINT.search(text, pos):
        before = _IPV6_RUN_BEFORE.search(text, max(0, hint.start() - _IPV6_MAX), hint.start())
        m = _IPV6.match(text, before.start() if before else hint.start())
        if m and _ipv6_ok(m.group()):
            yield m.span()
            pos = m.end()
        else:  # the run had one possible start, now tried: go on after it
            run = _IPV6_RUN.match(text, hint.start())
            pos = run.end() if run else hint.end()


def _scan_ip(text: str) -> Iterator[_Span]:
    yield from (m.span() for m in _IPV4.finditer(text) if _ipv4_ok(m.group()))
    yield from _scan_ipv6(text)


def _scan_secret(text: str) -> Iterator[_Span]:
    if any(hint in text for hint in _SECRET_TOKEN_HINTS):
        for m in _SECRET_TOKEN.finditer(text):
            sk = m["sk"]
            if sk is None or (any(c.isdigit() for c in sk) and any(c.isalpha() for c in sk)):
                yield m.span()
    lowered = _lower(text)
    if ("=" in text or ":" in text) and any(hint in lowered for hint in _SECRET_NAME_HINTS):
        for m in _ASSIGNMENT.finditer(lowered):
            group = "quoted" if m["quoted"] else "bare"
            start, end = m.span(group)
            if _assignment_value_ok(text[start:end], quoted=group == "quoted"):
                yield start, end
    for m in _ENTROPY_TOKEN.finditer(text):
        if _looks_random(m.group()):
            yield m.span()


_SCANNERS = {
    "email": _scan_email, "phone": _scan_phone, "card": _scan_card, "iban": _scan_iban,
    "ssn": _scan_ssn, "ip": _scan_ip, "secret": _scan_secret,
}


def _resolve(candidates: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Keep non-overlapping candidates: longest first, then by type priority, then leftmost."""
    candidates.sort(key=lambda c: (c[0] - c[1], _PRIORITY[c[2]], c[0]))
    starts: list[int] = []
    kept: list[tuple[int, int, str]] = []  # parallel to starts, sorted by start
    for start, end, pii_type in candidates:
        i = bisect_left(starts, start)
        if (i > 0 and kept[i - 1][1] > start) or (i < len(kept) and kept[i][0] < end):
            continue
        starts.insert(i, start)
        kept.insert(i, (start, end, pii_type))
    return kept


def find_pii(text: str, types: Collection[str] = PII_TYPES) -> list[Finding]:
    """Non-overlapping PII findings sorted by start.

    On overlap the longer span wins, then the higher-priority type:
    secret > card > iban > ssn > email > ip > phone. Raises ValueError for an unknown type.
    """
    unknown = set(types) - _SCANNERS.keys()
    if unknown:
        raise ValueError(f"unknown PII types {sorted(unknown)}; known: {', '.join(PII_TYPES)}")
    candidates = [(start, end, t) for t in types for start, end in _SCANNERS[t](text) if end > start]
    return [Finding(f"pii.{t}", "pii", start, end, kind=t.upper()) for start, end, t in _resolve(candidates)]


# ---------------------------------------------------------------- deny rules

# Numbered back-references and conditionals would point at the wrong group inside a combined regex.
_NUMBERED_REFERENCE = re.compile(r"\\[1-9]|\(\?\(\d|\\g<\d")


@dataclass(frozen=True, slots=True)
class DenyRule:
    """A policy rule: keywords (whole words, case-insensitive) and regexes (case-insensitive)."""

    id: str
    category: str = "denied"
    message: str = ""
    keywords: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()


def _normal_keyword(keyword: str) -> str:
    return " ".join(_lower(keyword).split())


def _keyword_regex(keywords: Collection[str]) -> str:
    """One alternation of lowercase keywords, longest first ("pipe bomb" before "pipe"), as whole words.

    Any run of whitespace matches a space. Each alternative opens with its first character, then checks
    the word boundary before it: ``re`` then skips in C to the keywords' first letters.
    """
    alternatives = []
    for keyword in sorted(keywords, key=len, reverse=True):
        body = r"\s+".join(re.escape(part) for part in keyword.split())
        first = re.escape(keyword[0])
        alternatives.append(rf"{first}(?<!\w.){body[len(first):]}(?!\w)")
    return "|".join(alternatives)


def _pattern_regexes(rules: Sequence[DenyRule]) -> tuple[re.Pattern[str] | None, dict[str, DenyRule],
                                                           list[tuple[DenyRule, re.Pattern[str]]]]:
    """The rules' patterns as one regex with a group per rule, plus those that cannot share it."""
    shared: list[DenyRule] = []
    alone: list[DenyRule] = []
    for rule in rules:
        for pattern in rule.patterns:
            re.compile(pattern, re.IGNORECASE)  # raises re.error, naming the bad pattern
        if rule.patterns:
            numbered = any(map(_NUMBERED_REFERENCE.search, rule.patterns))
            (alone if numbered else shared).append(rule)
    combined = None
    if shared:
        try:
            combined = re.compile("|".join(f"(?P<r{i}>{'|'.join(f'(?:{p})' for p in rule.patterns)})"
                                           for i, rule in enumerate(shared)), re.IGNORECASE)
        except re.error:  # the same group name in two rules, or an inline "(?i)" not at the start
            shared, alone = [], [r for r in rules if r.patterns]
    groups = {f"r{i}": rule for i, rule in enumerate(shared)}
    separate = [(rule, re.compile("|".join(f"(?:{p})" for p in rule.patterns), re.IGNORECASE)) for rule in alone]
    return combined, groups, separate


class DenyMatcher:
    """Finds the text matched by a set of deny rules.

    Everything is compiled once, here: all keywords into one regex (matched in lowercased text, where it
    needs no IGNORECASE and runs several times faster), all patterns into one case-insensitive regex with
    a named group per rule. A rule whose patterns cannot share that regex (numbered back-references) gets
    its own. A keyword listed by two rules belongs to the first.
    """

    def __init__(self, rules: Sequence[DenyRule]) -> None:
        self._rules: dict[str, DenyRule] = {}
        self._by_keyword: dict[str, DenyRule] = {}
        for rule in rules:
            if rule.id in self._rules:
                raise ValueError(f"duplicate deny rule id {rule.id!r}")
            self._rules[rule.id] = rule
            for keyword in map(_normal_keyword, rule.keywords):
                if keyword:
                    self._by_keyword.setdefault(keyword, rule)
        self._keywords = re.compile(_keyword_regex(self._by_keyword)) if self._by_keyword else None
        self._patterns, self._groups, self._separate = _pattern_regexes(rules)

    def find(self, text: str) -> list[Finding]:
        """Every rule match in *text* as ``Finding("deny.<id>", rule.category, ...)``, sorted by start."""
        found: list[tuple[DenyRule, int, int]] = []
        if self._keywords is not None:
            lowered = _lower(text)
            found += ((self._by_keyword[" ".join(m.group().split())], *m.span())
                      for m in self._keywords.finditer(lowered))
        if self._patterns is not None:
            found += ((self._groups[m.lastgroup or ""], *m.span()) for m in self._patterns.finditer(text))
        for rule, regex in self._separate:
            found += ((rule, *m.span()) for m in regex.finditer(text))
        findings = [Finding(f"deny.{rule.id}", rule.category, start, end) for rule, start, end in found if end > start]
        findings.sort(key=lambda f: (f.start, f.end))
        return findings

    def rule(self, rule_id: str) -> DenyRule:
        """The rule with id *rule_id*; KeyError if there is none."""
        return self._rules[rule_id]


# ---------------------------------------------------------------- prompt injection

_EARLIER = r"(?:previous|above|prior|preceding|earlier|system|initial|original|developer)"
_RULES = r"(?:instructions?|prompts?|rules|directions|directives|guidelines|guardrails)"
_IGNORE = ("ignore", "disregard", "forget", "override", "bypass", "skip")
_REVEAL = ("reveal", "print", "show", "repeat", "display", "output", "leak", "dump", "expose", r"tell\s+me",
           r"give\s+me", r"write\s+out")
_HIDDEN = r"(?:system|hidden|initial|original|secret|developer|internal)"
_UNFILTERED = r"(?:unfiltered|uncensored|unrestricted|jailbroken|evil)"
_NO_LIMITS = r"(?:without|with\s+no|no|free\s+(?:of|from))\s+(?:any\s+)?(?:restrictions|limits|limitations|filters" \
             r"|rules|guidelines|censorship|ethics|morals)"


@dataclass(frozen=True, slots=True)
class _Signal:
    """One regex of a heuristic. It runs only if the lowercased text contains one of its hints (substrings
    that every match contains; none for regexes that skip through text fast enough by themselves)."""

    heuristic: str
    weight: float
    hints: tuple[str, ...]
    regex: re.Pattern[str]


def _signal(heuristic: str, weight: float, hints: tuple[str, ...], source: str) -> _Signal:
    return _Signal(heuristic, weight, hints, re.compile(source, re.MULTILINE))


# Patterns are lowercase: they run on lowercased text (no IGNORECASE, which is several times slower).
_SIGNALS = (
    _signal("ignore_instructions", 0.8, _IGNORE,
            rf"{_word_start(*_IGNORE)}\s+(?:(?:all|any|every|the|my|of|these|those)\s+){{0,3}}"
            rf"(?:your\s+(?:{_EARLIER}\s+)?|{_EARLIER}\s+)(?:\w+\s+)?{_RULES}\b"),
    _signal("ignore_instructions", 0.7, _IGNORE,
            rf"{_word_start(*_IGNORE)}\s+(?:all\s+|everything\s+)?(?:the\s+|that\s+)?"
            r"(?:above|everything\s+(?:above|before))(?=\s*(?:[,.;:!]|and\b|then\b|$))"),
    _signal("reveal_prompt", 0.6, ("prompt", "instruction", "message"),
            rf"{_word_start(*_REVEAL)}\s+(?:me\s+|us\s+)?(?:your\s+(?:{_HIDDEN}\s+|full\s+|exact\s+|entire\s+)?"
            rf"(?:system\s+)?(?:prompt|system\s+message)|(?:your|the)\s+{_HIDDEN}\s+(?:system\s+)?"
            r"(?:prompt|instructions|message))\b"),
    _signal("role_play", 0.7, (),
            rf"{_word_start('you')}\s+are\s+(?:now\s+(?:dan\b|an?\s+{_UNFILTERED}\b)|(?:now\s+)?jailbroken\b)"),
    _signal("role_play", 0.7, ("pretend", "imagine", "act as"),
            rf"(?:{_word_start('pretend', 'imagine')}\s+(?:that\s+)?(?:you\s+are|you['\u2019]re|to\s+be)|"
            rf"{_word_start('act')}\s+as)\b[^.\n]{{0,80}}?\b{_NO_LIMITS}\b"
            rf"|{_word_start('act')}\s+as\s+(?:an?\s+)?{_UNFILTERED}\b"),
    _signal("role_play", 0.7, ("anything",), rf"{_word_start('do')}\s+anything\s+now\b"),
    _signal("role_play", 0.7, ("dan mode", "jailbreak", "developer"),
            rf"{_word_start('dan', 'jailbreak')}\s+mode\b"
            rf"|{_word_start('developer')}\s+mode\s+(?:enabled|activated|output)\b"
            rf"|{_word_start('in')}\s+developer\s+mode\s+(?:now|from\s+now)\b"),
    _signal("new_instructions", 0.4, ("instruction",),
            rf"{_word_start('new', 'updated', 'revised', 'real')}\s+(?:system\s+)?instructions?\s*:"),
    _signal("new_instructions", 0.4, ("system",), r"^[ \t]*\[?system\]?[ \t]*:"),
    _signal("new_instructions", 0.4, ("##",), r"^[ \t]*#{2,}[ \t]*(?:new\s+)?(?:system\s+)?instructions?\b"),
    # A role marker claiming "system" is an attack; other template tokens may be a developer's question.
    _signal("delimiter_spoof", 0.7, (), r"<\|im_start\|>[ \t]*system\b|<\|system\|>|<</?sys>>"),
    _signal("delimiter_spoof", 0.45, ("<", "["),
            r"<\|[a-z_]{2,24}\|>|\[/?inst\]|<(?:start|end)_of_turn>"),
)

_TAGS = "\U000e0000-\U000e007f"  # invisible copies of ASCII: "ASCII smuggling"
_BIDI = "\u202a-\u202e\u2066-\u2069"  # reorder what is displayed ("Trojan Source")
_ZERO_WIDTH = "\u200b-\u200f\u2060-\u2064\ufeff"
_HIDDEN_RUN = re.compile(f"[{_TAGS}{_BIDI}{_ZERO_WIDTH}]+")
_HIDDEN_WEIGHTS = ((re.compile(f"[{_TAGS}]"), 0.9), (re.compile(f"[{_BIDI}]"), 0.6))
_ZERO_WIDTH_WEIGHT = 0.35
_JOINERS = frozenset("\u200c\u200d")
_BASE64_BLOB = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{200,}={0,2}")
_BASE64_MIN = 200
_BASE64_WEIGHT = 0.35


@dataclass(frozen=True, slots=True)
class InjectionResult:
    """Combined score ``1 - prod(1 - w)`` over the heuristics that fired, and one finding per heuristic."""

    score: float
    findings: tuple[Finding, ...]


def _hidden_run_weight(text: str, run: re.Match[str]) -> float:
    for regex, weight in _HIDDEN_WEIGHTS:
        if regex.search(run.group()):
            return weight
    start, end = run.span()
    if start == 0 and run.group() == "\ufeff":  # a byte-order mark
        return 0.0
    # A joiner between non-ASCII characters is an emoji sequence or Indic/Persian script, not hiding.
    between_non_ascii = start > 0 and end < len(text) and not text[start - 1].isascii() and not text[end].isascii()
    if between_non_ascii and set(run.group()) <= _JOINERS:
        return 0.0
    return _ZERO_WIDTH_WEIGHT


def _might_hold_blob(text: str) -> bool:
    # A run of _BASE64_MIN characters without a space covers a whole half-size block: probe those.
    step = _BASE64_MIN // 2
    return any(text.find(" ", i, i + step) == -1 for i in range(0, len(text) - step + 1, step))


def _hidden_text(text: str) -> Finding | None:
    """The strongest hidden-text signal: invisible or reordering characters, or a long base64 blob."""
    best: tuple[float, int, int] = (0.0, 0, 0)
    for run in _HIDDEN_RUN.finditer(text):
        weight = _hidden_run_weight(text, run)
        if weight > best[0]:
            best = (weight, *run.span())
    if best[0] < _BASE64_WEIGHT and len(text) >= _BASE64_MIN and _might_hold_blob(text):
        blob = _BASE64_BLOB.search(text)
        if blob:
            best = (_BASE64_WEIGHT, *blob.span())
    weight, start, end = best
    return Finding("injection.hidden_text", "injection", start, end, weight) if weight else None


def injection_score(text: str) -> InjectionResult:
    """Score *text* for signs of prompt injection.

    Each heuristic that fires gives one finding: its strongest match (the first of equals), with that
    match's weight as its score. The combined score is ``1 - prod(1 - score)``.
    """
    lowered = _lower(text)
    present: dict[str, bool] = {}  # several signals share hints: look each up once
    best: dict[str, Finding] = {}
    for signal in _SIGNALS:
        seen = best.get(signal.heuristic)
        if seen and seen.score >= signal.weight:
            continue
        if signal.hints and not any(present.setdefault(h, h in lowered) for h in signal.hints):
            continue
        m = signal.regex.search(lowered)
        if m:
            best[signal.heuristic] = Finding(f"injection.{signal.heuristic}", "injection", *m.span(), signal.weight)
    hidden = _hidden_text(text)
    if hidden:
        best["hidden_text"] = hidden
    keep = 1.0
    for finding in best.values():
        keep *= 1.0 - finding.score
    findings = tuple(sorted(best.values(), key=lambda f: f.start))
    return InjectionResult(min(1.0, max(0.0, 1.0 - keep)), findings)


# ---------------------------------------------------------------- redaction

_KIND_MAX_CHARS = 10
_INDEX_MAX_DIGITS = 6
PLACEHOLDER_MAX_CHARS: int = 1 + _KIND_MAX_CHARS + 1 + _INDEX_MAX_DIGITS + 1
"""Length of the longest placeholder, ``<KKKKKKKKKK_999999>``: how much a stream must hold back."""

#: A placeholder; group 1 is its kind (``EMAIL``...). Rails and the policy stage match the same ones.
PLACEHOLDER = re.compile(rf"<([A-Z]{{1,{_KIND_MAX_CHARS}}})_\d{{1,{_INDEX_MAX_DIGITS}}}>")
_NOT_KIND = re.compile(r"[^A-Z]+")


def _placeholder_kind(finding: Finding) -> str:
    # Kinds come from rule categories too ("self-harm"): letters only, so that "<KIND_N>" parses one way.
    return _NOT_KIND.sub("", (finding.kind or finding.category).upper())[:_KIND_MAX_CHARS] or "REDACTED"


class Redactor:
    """Replaces findings with typed placeholders ``<EMAIL_1>``, ``<PHONE_2>``, ... and maps them back.

    One Redactor serves one request: the same value always gets the same placeholder, numbers count
    per kind, and :meth:`restore` turns placeholders in the model's output back into the values.
    """

    def __init__(self) -> None:
        self._by_value: dict[tuple[str, str], str] = {}
        self._values: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    @property
    def mapping(self) -> dict[str, str]:
        """Placeholder -> original value (a copy)."""
        return dict(self._values)

    def redact(self, text: str, findings: Sequence[Finding]) -> str:
        """*text* with every finding's span replaced; ValueError for overlapping or out-of-range findings."""
        parts: list[str] = []
        pos = 0
        for f in sorted(findings, key=lambda f: (f.start, f.end)):
            if f.start < pos or f.end < f.start or f.end > len(text):
                raise ValueError(f"findings overlap or fall outside the text: {f}")
            if f.end == f.start:
                continue
            parts += (text[pos:f.start], self._placeholder(_placeholder_kind(f), text[f.start:f.end], text))
            pos = f.end
        parts.append(text[pos:])
        return "".join(parts)

    def restore(self, text: str) -> str:
        """*text* with every known placeholder replaced by its value; unknown ones are left as they are."""
        if "<" not in text or not self._values:
            return text
        return PLACEHOLDER.sub(lambda m: self._values.get(m.group(), m.group()), text)

    def _placeholder(self, kind: str, value: str, text: str) -> str:
        known = self._by_value.get((kind, value))
        if known is not None:
            return known
        index = self._counts.get(kind, 0)
        while True:
            index += 1
            if index >= 10**_INDEX_MAX_DIGITS:
                raise ValueError(f"more than {10**_INDEX_MAX_DIGITS - 1} distinct {kind} values")
            placeholder = f"<{kind}_{index}>"
            # A placeholder the caller typed themselves must not be restored to someone's value.
            if placeholder not in text:
                break
        self._counts[kind] = index
        self._by_value[(kind, value)] = placeholder
        self._values[placeholder] = value
        return placeholder
