"""``ctx.facts`` keys are declared: every key the code reads or writes is one of :class:`Facts`."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.context import Facts, RequestContext

ROOT = Path(__file__).parents[2]
#: ``x.facts["key"]``, ``x.facts.get("key"``, ``.setdefault(``, ``.pop(``, and ``"key" in ctx.facts``.
USES = re.compile(r"""\.facts(?:\[|\.get\(|\.setdefault\(|\.pop\()\s*["']([a-z_]+)["']"""
                  r"""|["']([a-z_]+)["'] in ctx\.facts""")


def keys_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for package in ("pipeline", "stages", "serving"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for match in USES.finditer(path.read_text()):
                key = match.group(1) or match.group(2)
                used.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return used


def test_every_fact_the_code_uses_is_declared():
    used = keys_used()
    assert {"sampling", "route", "policy", "decisions"} <= set(used)  # the scan finds them
    undeclared = {key: files for key, files in used.items() if key not in Facts.__annotations__}
    assert not undeclared, f"declare these keys in pipeline.context.Facts: {undeclared}"


def test_the_scan_would_see_an_undeclared_key():
    assert USES.search('ctx.facts["colour"] = 1').group(1) == "colour"
    assert "colour" not in Facts.__annotations__


def test_a_new_context_has_no_facts():
    ctx = RequestContext.from_text("chat", "hi")
    assert ctx.facts == {}
    ctx.facts["route"] = {"model": "smol"}
    assert RequestContext.from_text("chat", "hi").facts == {}
