"""MCP tool pins kept with pipeline versions (store/pipeline_versions.py ToolPins): the first pins of a version
hold, per tool; another version, or another pipeline, pins its own; two writers racing keep one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from store.pipeline_versions import ToolPins


def kept(engine: sa.Engine, name: str, spec_sha256: str) -> dict[str, str]:
    """Every pin of the version, as the table holds them."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT tool, schema_sha256 FROM tool_pins WHERE name = :n AND spec_sha256 = :s"),
                            {"n": name, "s": spec_sha256})
        return dict(rows.all())


def test_the_first_pins_of_a_version_hold(engine):
    pins = ToolPins(engine)
    assert pins.pin("orders", "a" * 64, {"answer/orders/status": "1" * 64}) == {"answer/orders/status": "1" * 64}
    later = pins.pin("orders", "a" * 64, {"answer/orders/status": "2" * 64, "answer/orders/cancel": "3" * 64})
    assert later == {"answer/orders/status": "1" * 64, "answer/orders/cancel": "3" * 64}  # a new tool: pinned now
    assert pins.pin("orders", "b" * 64, {"answer/orders/status": "2" * 64}) == {"answer/orders/status": "2" * 64}
    assert pins.pin("billing", "a" * 64, {"answer/orders/status": "4" * 64}) == {"answer/orders/status": "4" * 64}
    assert kept(engine, "orders", "a" * 64) == {"answer/orders/status": "1" * 64, "answer/orders/cancel": "3" * 64}


def test_writers_racing_agree_on_one_pin(engine):
    pins = ToolPins(engine)
    with ThreadPoolExecutor(4) as pool:
        held = list(pool.map(lambda i: pins.pin("orders", "c" * 64, {"answer/orders/status": f"{i}" * 64}),
                             range(4)))
    assert len({tuple(k.items()) for k in held}) == 1 and kept(engine, "orders", "c" * 64) == held[0]
