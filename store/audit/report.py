"""The reviewers' report over a period: what was served, refused and spent, and whether the log holds.

    report = build_report(engine, AuditFilters(since=..., until=..., pipeline=None), verifier, anchors_dir)

One JSON-able dict: requests by pipeline, version and model (with their status), by day; policy
blocks by rule and category; errors by type; cost by key, tenant and pipeline; the chain's and the
anchors' verification over the period; and a summary of the access log (who read the log, how). For a
quarterly review or an incident; ``inferline audit report`` prints it as JSON or a self-contained HTML
page (serving/console/report_html.py), and the console shows it.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from store.audit.anchors import verify_anchors
from store.audit.filters import AuditFilters
from store.audit.models import AuditAccess, AuditRecord
from store.audit.query import conditions, day_column
from store.audit.signing import Verifier
from store.audit.verify import verify_chain
from store.keys import ApiKey

_records = AuditRecord.__table__
_keys = ApiKey.__table__
_access = AuditAccess.__table__
#: The most rows of each breakdown kept (the largest first).
TOP = 50


def build_report(engine: sa.Engine, filters: AuditFilters, verifier: Verifier | None = None,
                 anchors: Path | None = None, *, workers: int | None = None) -> dict[str, Any]:
    """The report of the records *filters* select (its since, until and pipeline); the chain checked over
    the period (with *verifier*'s keys) and, with *anchors*, the database against the digests there."""
    where = conditions(filters)
    c = _records.c
    requests = (c.kind == "record", ~_is_action())
    with engine.connect() as conn:
        def grouped(*columns: Any, extra: Any = None) -> list[dict[str, Any]]:
            counts = [sa.func.count().label("count"),
                      sa.func.sum(sa.case((c.status == "ok", 1), else_=0)).label("ok"),
                      sa.func.sum(sa.case((c.status == "denied", 1), else_=0)).label("denied"),
                      sa.func.sum(sa.case((c.status == "failed", 1), else_=0)).label("failed"),
                      sa.func.sum(c.cost_usd).label("cost_usd"),
                      sa.func.sum(c.input_tokens + c.output_tokens).label("tokens")]
            statement = (sa.select(*columns, *counts).select_from(extra if extra is not None else _records)
                         .where(*where, *requests).group_by(*columns).order_by(sa.desc("count")).limit(TOP))
            return [{**{col.name: row._mapping[col.name] for col in columns},
                     "count": row.count, "ok": int(row.ok or 0), "denied": int(row.denied or 0),
                     "failed": int(row.failed or 0), "cost_usd": round(float(row.cost_usd or 0), 6),
                     "tokens": int(row.tokens or 0)} for row in conn.execute(statement)]

        totals = grouped()[0]
        with_key = _records.outerjoin(_keys, _keys.c.id == c.key_id)
        tenant = sa.func.coalesce(_keys.c.tenant, _keys.c.name, sa.literal("(no key)")).label("tenant")
        day = day_column(conn.dialect.name).label("day")
        report: dict[str, Any] = {
            "period": {"since": _iso(filters.since), "until": _iso(filters.until), "pipeline": filters.pipeline,
                       "made_at": datetime.now(UTC).isoformat()},
            "totals": totals,
            "by_pipeline_version_model": grouped(c.pipeline, c.pipeline_version, c.model),
            "by_day": sorted(grouped(day), key=lambda row: row["day"] or ""),
            "cost_by_pipeline": grouped(c.pipeline),
            "cost_by_key": grouped(c.key_id, _keys.c.name.label("key_name"), extra=with_key),
            "cost_by_tenant": grouped(tenant, extra=with_key),
            "errors": [{"error_type": row.error_type, "count": row.count} for row in conn.execute(
                sa.select(c.error_type, sa.func.count().label("count")).where(*where, *requests, c.status == "failed")
                .group_by(c.error_type).order_by(sa.desc("count")).limit(TOP))],
            "policy_blocks": _policy_blocks(conn, where, requests),
            "deployments_and_erasures": conn.scalar(sa.select(sa.func.count()).select_from(_records)
                                                    .where(*where, _is_action())) or 0,
            "access_log": _access_summary(conn, filters),
        }
    chain = verify_chain(engine, filters.since, filters.until, verifier, workers)
    report["verification"] = {
        "chain": {"ok": chain.ok, "checked": chain.checked, "head_seq": chain.head_seq,
                  "unchecked_checkpoints": chain.unchecked_checkpoints,
                  "findings": [{"kind": f.kind, "seq": f.seq, "detail": f.detail} for f in chain.findings[:TOP]]},
        "anchors": None,
    }
    if anchors is not None:
        anchored = verify_anchors(engine, anchors, verifier)
        report["verification"]["anchors"] = {
            "ok": anchored.ok, "digests": anchored.digests, "anchored_seq": anchored.anchored_seq,
            "unchecked": anchored.unchecked, "database_alone_shows_it": not chain.ok,
            "findings": [{"kind": f.kind, "seq": f.seq, "detail": f.detail} for f in anchored.findings[:TOP]]}
    return report


def _is_action() -> sa.ColumnElement[bool]:
    """A record of a server action (a deploy, an erasure), not of a request: its policy entry says where."""
    text = sa.cast(_records.c.policy, sa.Text)
    return sa.or_(text.like('%"where": "deploy"%'), text.like('%"where":"deploy"%'),
                  text.like('%"where": "erase"%'), text.like('%"where":"erase"%'))


def _policy_blocks(conn: sa.Connection, where: list[Any], requests: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Blocked and denied decisions by rule and category, with how many requests they stopped."""
    c = _records.c
    counted: Counter[tuple[str, str, str]] = Counter()
    statement = sa.select(c.policy).where(*where, *requests, c.policy_action.in_(("block", "deny")))
    for (policy,) in conn.execute(statement.execution_options(yield_per=2000)):
        for entry in policy or []:
            if entry.get("action") in ("block", "deny"):
                counted[(str(entry.get("rule", "")), str(entry.get("category", "")),
                         str(entry.get("where", "")))] += 1
    return [{"rule": rule, "category": category, "where": where_, "count": count}
            for (rule, category, where_), count in counted.most_common(TOP)]


def _access_summary(conn: sa.Connection, filters: AuditFilters) -> list[dict[str, Any]]:
    """Who read the log in the period, and how (query, show, export, decrypt, verify...)."""
    a = _access.c
    where = [*([a.at >= filters.since] if filters.since else []), *([a.at < filters.until] if filters.until else [])]
    statement = (sa.select(a.key_id, a.role, a.action, sa.func.count().label("count"))
                 .where(*where).group_by(a.key_id, a.role, a.action).order_by(sa.desc("count")).limit(TOP))
    return [{"key_id": row.key_id, "role": row.role, "action": row.action, "count": row.count}
            for row in conn.execute(statement)]


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
