"""Walking the audit chain in seq order and saying what does not add up.

Each row is checked three ways: its own hash (an edited field), its link to
the row before (prev_hash), and its seq against the one expected (a deleted
row leaves a gap). Gaps that a prune marker accounts for pass: the marker,
itself a chained record, lists each pruned seq range with the prev_hash that
led into it and the hash that left it, so the walk can link over the range.
Rows are read in keyset batches, never all at once.

Recomputing the hashes is most of the work, and each row's hash depends only
on the row itself (its prev_hash is one of its columns), so a long span is
split into seq ranges that worker processes read and hash in parallel; each
hands back, per row, only what the walk needs (seq, id, prev_hash, hash and
whether the hash matched; the whole row where it did not), and the walk, which
is sequential but cheap, runs here in seq order over their answers. A worker
that fails has its range checked in this process instead.

The newest records, after the newest good checkpoint, are covered by none yet:
the report names them (:class:`Tail`), and when the oldest of them is older
than the window in which a checkpoint should have followed, that is a
``missing_checkpoint`` finding.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import logging
import os
import pickle
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from store.audit.chain import STAGE_COLUMNS, record_hash, utc_text
from store.audit.models import GENESIS_HASH, AuditChainHead, AuditCheckpoint, AuditRecord, AuditStage
from store.audit.signing import Verifier, checkpoint_message

BATCH_SIZE = 2000
MAX_FINDINGS = 1000
#: A worker process takes about 0.3 s to start: spans with fewer records than this per worker stay here.
MIN_ROWS_PER_WORKER = 20_000
#: Seq range one worker process checks: bounds what its answer holds in memory.
MAX_ROWS_PER_RANGE = 250_000
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)
#: (row, its stages, whether its hash matched): a row that matched may hold only seq, id, prev_hash, hash.
Checked = tuple[Mapping[str, Any], list[dict[str, Any]], bool]
_records = AuditRecord.__table__
_stages = AuditStage.__table__
_checkpoints = AuditCheckpoint.__table__
_COVER_PAGE = 256


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong: kind is modified, inserted, deleted, reordered, gap, bad_checkpoint or missing_checkpoint."""

    kind: str
    seq: int | None
    record_id: str | None
    detail: str


@dataclass(frozen=True, slots=True)
class Tail:
    """The newest records, seqs first_seq..last_seq, past what covers the rest (a good checkpoint, a digest)."""

    first_seq: int
    last_seq: int
    #: How many records of those seqs the database holds.
    count: int
    #: When the oldest of them was completed: none has been uncovered for longer.
    since: datetime

    def age_s(self, now: datetime) -> float:
        return max(0.0, (now - self.since).total_seconds())


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of a verify: ok only when there are no findings."""

    ok: bool
    checked: int
    head_seq: int
    findings: list[Finding] = field(default_factory=list)
    #: Checkpoints that no key given could check (signed with another algorithm or an unknown key).
    unchecked_checkpoints: int = 0
    #: With a window: the records after the newest checkpoint the keys given find good (a check to the head).
    uncovered: Tail | None = None


@dataclass(frozen=True, slots=True)
class _Range:
    first: int
    last: int
    prev_hash: str
    last_hash: str


class _Walk:
    """The state of one walk along the chain: what the next row must be."""

    def __init__(self, ranges: list[_Range], head_seq: int, trusted_start: bool) -> None:
        self.ranges = ranges
        self.starts = [r.first for r in ranges]
        self.head_seq = head_seq
        self.expected: int | None = None if trusted_start else 1
        self.link: str | None = None if trusted_start else GENESIS_HASH
        self.findings: list[Finding] = []
        self.checked = 0
        self.previous: Mapping[str, Any] | None = None
        #: Checkpointed seqs whose record hash the checkpoint check needs, and those hashes.
        self.watched: set[int] = set()
        self.hashes: dict[int, str] = {}

    def report(self, kind: str, row: Mapping[str, Any] | None, detail: str, seq: int | None = None) -> None:
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(Finding(kind, row["seq"] if row is not None else seq,
                                         row["id"] if row is not None else None, detail))

    def feed(self, row: Mapping[str, Any], stages: list[dict[str, Any]], hash_ok: bool, nxt: Checked | None) -> bool:
        """Check *row* (*hash_ok*: its stored hash matched its contents); True when it also consumed
        *nxt* (a reordered pair)."""
        self.checked += 1
        if row["seq"] in self.watched:
            self.hashes[row["seq"]] = row["hash"]
        if row["seq"] > self.head_seq:
            self.report("inserted", row, f"seq {row['seq']} is past the chain head {self.head_seq}")
        if self._pruned_range(row["seq"]) is not None:
            self.report("inserted", row, "a row inside a range that a prune marker says was deleted")
            return False
        self._check_seq(row)
        if hash_ok:
            self._check_link(row, nxt)
            return False
        if nxt is not None and self._is_swap(row, stages, *nxt):
            self.checked += 1
            self.report("reordered", row, f"seqs {row['seq']} and {nxt[0]['seq']} were swapped")
            self.link, self.expected = row["hash"], nxt[0]["seq"] + 1
            return True
        self.report("modified", row, _why_modified(row, stages))
        self._check_link(row, nxt)
        return False

    def _check_seq(self, row: Mapping[str, Any]) -> None:
        if self.expected is None or row["seq"] == self.expected:
            return
        seq, link = self.expected, self.link
        while seq < row["seq"]:
            pruned = self._pruned_range(seq)
            if pruned is None or pruned.first != seq or (link is not None and pruned.prev_hash != link):
                self.report("deleted", None, f"seq {self.expected}..{row['seq'] - 1} missing; "
                            "no prune marker accounts for it", seq=self.expected)
                self.link = row["prev_hash"]  # resynchronise: one finding per hole, not two
                return
            seq, link = pruned.last + 1, pruned.last_hash
        self.link = link

    def _check_link(self, row: Mapping[str, Any], nxt: Checked | None) -> None:
        if self.link is not None and row["prev_hash"] != self.link:
            if nxt is not None and nxt[0]["prev_hash"] == self.link:
                # The next row links straight past this one: this one was slipped in.
                self.report("inserted", row, "not linked from the previous record; the next record skips it")
                return
            if self.previous is not None and row["prev_hash"] == self.previous["prev_hash"]:
                # This row links past the previous one, which links in properly: that one was slipped in.
                self.report("inserted", self.previous, "the next record's prev_hash skips this record")
            else:
                self.report("gap", row, f"prev_hash does not match the hash of the record before seq {row['seq']}")
        self.link, self.expected, self.previous = row["hash"], row["seq"] + 1, row

    def _is_swap(self, row: Mapping[str, Any], stages: list, other: Mapping[str, Any], other_stages: list,
                 other_ok: bool) -> bool:
        # Both rows of a swapped pair fail their own hash (each was chained at the other's seq).
        if other_ok or other["seq"] != row["seq"] + 1 or row["prev_hash"] != other["hash"]:
            return False
        if self.link is not None and other["prev_hash"] != self.link:
            return False
        return (record_hash(row["prev_hash"], {**row, "seq": other["seq"]}, stages) == row["hash"]
                and record_hash(other["prev_hash"], {**other, "seq": row["seq"]}, other_stages) == other["hash"])

    def _pruned_range(self, seq: int) -> _Range | None:
        index = bisect.bisect_right(self.starts, seq) - 1
        if index >= 0 and self.ranges[index].last >= seq:
            return self.ranges[index]
        return None


def _why_modified(row: Mapping[str, Any], stages: list[dict[str, Any]]) -> str:
    for shift in (-1, 1):
        if record_hash(row["prev_hash"], {**row, "seq": row["seq"] + shift}, stages) == row["hash"]:
            return f"renumbered: the record was chained at seq {row['seq'] + shift}"
    return "the stored hash does not match the record's contents"


def verify_chain(engine: sa.Engine, since: datetime | None, until: datetime | None,
                 verifier: Verifier | None, workers: int | None = None, *, window_s: float | None = None,
                 now: datetime | None = None) -> VerifyReport:
    """Walk the chain (or the seq span of records received in [since, until)) and report findings.

    *workers*: processes that recompute hashes in parallel; None picks one per CPU for a long span,
    1 does everything in this process. *window_s* (with keys, up to the head): how soon a checkpoint
    follows a record (the server's ``checkpoint_every_s`` and then some); the report names the records no
    good checkpoint covers yet in ``uncovered``, and those older than the window (at *now*) are a
    ``missing_checkpoint`` finding.
    """
    with engine.connect() as conn:
        head_seq, head_hash = conn.execute(sa.select(AuditChainHead.seq, AuditChainHead.hash)).one()
        lo, hi = _seq_span(conn, since, until)
        walk = _Walk(_prune_ranges(conn), head_seq, trusted_start=since is not None)
        checking = verifier is not None and not verifier.empty
        if checking:
            walk.watched = set(conn.scalars(sa.select(AuditCheckpoint.seq)))
        if lo is not None:
            with _cyclic_gc_paused():
                _walk_rows(walk, _checked_rows(engine, conn, lo, hi, workers))
        if until is None:
            _check_tail(walk, head_seq, head_hash)
        unchecked = _check_checkpoints(conn, walk, verifier, lo, hi, head_seq) if checking else 0
        uncovered = None
        if checking and until is None and verifier is not None and window_s is not None:
            uncovered = _check_coverage(conn, walk, verifier, head_seq, window_s, now or datetime.now(UTC))
    return VerifyReport(not walk.findings, walk.checked, head_seq, walk.findings, unchecked, uncovered)


def _check_coverage(conn: sa.Connection, walk: _Walk, verifier: Verifier, head_seq: int, window_s: float,
                    now: datetime) -> Tail | None:
    """The records no good checkpoint covers; reported missing when the oldest is older than *window_s*."""
    uncovered = tail_after(conn, _newest_cover(conn, verifier, head_seq), head_seq)
    if uncovered is not None and uncovered.age_s(now) > window_s:
        walk.report("missing_checkpoint", None, (
            f"seq {uncovered.first_seq}..{uncovered.last_seq}: {uncovered.count} record(s), the oldest written "
            f"{age_text(uncovered.age_s(now), up=False)} ago, are covered by no signed checkpoint, though one "
            f"follows within {window_s:g} s while a server holding the key runs: none has run since, or their "
            "checkpoints were removed"), seq=uncovered.first_seq)
    return uncovered


def tail_after(conn: sa.Connection, seq: int, head_seq: int) -> Tail | None:
    """The records after *seq*, up to the head at *head_seq*; None when the database holds none."""
    if head_seq <= seq:
        return None
    count, oldest = conn.execute(sa.select(sa.func.count(), sa.func.min(_records.c.completed_at))
                                 .where(_records.c.seq > seq, _records.c.seq <= head_seq)).one()
    if not count:
        return None
    return Tail(seq + 1, head_seq, count, oldest if oldest.tzinfo is not None else oldest.replace(tzinfo=UTC))


def age_text(seconds: float, *, up: bool = True) -> str:
    """*seconds* for a reader: 2 s, 12 min, 3 h, 2 d; rounded *up* ("in the last ..."), or down ("... ago")."""
    unit, size = next(((unit, size) for unit, size in (("d", 86400), ("h", 3600), ("min", 60)) if seconds >= 2 * size),
                      ("s", 1))
    count = -(-seconds // size) if up else seconds // size
    return f"{max(1, count):.0f} {unit}"


def _newest_cover(conn: sa.Connection, verifier: Verifier, head_seq: int) -> int:
    """The seq of the newest checkpoint, at or before the head, that *verifier* finds good and whose record
    (when not pruned) is the one it signed; 0 for none. Newest first, a page at a time: it is usually the first."""
    c, r = _checkpoints.c, _records.c
    before = head_seq + 1
    while True:
        page = conn.execute(sa.select(c.seq, c.head_hash, c.signature, c.algorithm, c.key_id, r.hash)
                            .select_from(_checkpoints.outerjoin(_records, r.seq == c.seq))
                            .where(c.seq < before).order_by(c.seq.desc()).limit(_COVER_PAGE)).all()
        for seq, head_hash, signature, algorithm, key_id, held in page:
            if held in (None, head_hash) and verifier.check(algorithm, key_id, checkpoint_message(seq, head_hash),
                                                            signature):
                return seq
        if len(page) < _COVER_PAGE:
            return 0
        before = page[-1][0]


def _walk_rows(walk: _Walk, rows: Iterator[Checked]) -> None:
    current = next(rows, None)
    while current is not None:
        following = next(rows, None)
        if walk.feed(*current, following):
            following = next(rows, None)
        current = following


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    # The walk allocates millions of short-lived, acyclic dicts; each batch outlives a few young
    # collections, which then keep triggering full ones that rescan every long-lived object of the
    # process (a server with a model loaded has millions): 15-30% of verify's time. Plain reference
    # counting frees the batches; the collector's previous state is restored after.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _checked_rows(engine: sa.Engine, conn: sa.Connection, lo: int, hi: int,
                  workers: int | None) -> Iterator[Checked]:
    """Every row of seqs lo..hi in order with its hash checked: here, or by worker processes."""
    count = _worker_count(engine, hi - lo + 1, workers)
    if count <= 1:
        yield from _hash_checked(_rows(conn, lo, hi))
        return
    url = engine.url.render_as_string(hide_password=False)
    ranges = _ranges(lo, hi, count)
    pending: deque[tuple[tuple[int, int], Future[bytes | None]]] = deque()
    with ThreadPoolExecutor(count, thread_name_prefix="audit-verify") as pool:
        # At most one range waiting beyond those running: answers are consumed in order.
        queued = iter(ranges)
        for span in queued:
            pending.append((span, pool.submit(_run_worker, url, *span)))
            if len(pending) > count:
                break
        while pending:
            span, answer = pending.popleft()
            following = next(queued, None)
            if following is not None:
                pending.append((following, pool.submit(_run_worker, url, *following)))
            result = answer.result()
            if result is None:
                yield from _hash_checked(_rows(conn, *span))
            else:
                yield from _unpack(pickle.loads(result))


def _worker_count(engine: sa.Engine, num_rows: int, workers: int | None) -> int:
    url = engine.url
    if url.get_backend_name() == "sqlite" and (url.database in (None, "", ":memory:")
                                               or url.query.get("mode") == "memory"):
        return 1  # another process cannot see this database
    if workers is not None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        return workers
    if not sys.executable:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, num_rows // MIN_ROWS_PER_WORKER))


def _ranges(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
    num_rows = hi - lo + 1
    parts = max(count, -(-num_rows // MAX_ROWS_PER_RANGE))
    width = -(-num_rows // parts)
    return [(start, min(start + width - 1, hi)) for start in range(lo, hi + 1, width)]


def _hash_checked(rows: Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]) -> Iterator[Checked]:
    for row, stages in rows:
        yield row, stages, record_hash(row["prev_hash"], row, stages) == row["hash"]


# A worker's answer: (seq, id, prev_hash, hash) for each row whose hash matched, (row, stages) for one that
# did not; a tenth of the bytes of whole rows, and the walk needs no more of a matching row.
def _pack(rows: Iterator[Checked]) -> list[tuple[Any, ...]]:
    return [(row["seq"], row["id"], row["prev_hash"], row["hash"]) if ok else (row, stages)
            for row, stages, ok in rows]


def _unpack(items: list[tuple[Any, ...]]) -> Iterator[Checked]:
    for item in items:
        if len(item) == 4:
            seq, record_id, prev_hash, stored = item
            yield {"seq": seq, "id": record_id, "prev_hash": prev_hash, "hash": stored}, [], True
        else:
            yield item[0], item[1], False


def _run_worker(url: str, lo: int, hi: int) -> bytes | None:
    """Check seqs lo..hi in a fresh interpreter (the URL goes on its stdin, never its command line);
    None when it failed, so the caller checks the range itself."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(_PROJECT_ROOT),
                                                                      os.environ.get("PYTHONPATH"))))}
    # -P: the working directory stays off sys.path, so a folder there named "store" cannot shadow ours.
    command = [sys.executable, "-P", "-c", "from store.audit.verify import worker_main; worker_main()"]
    try:
        done = subprocess.run(command, input=pickle.dumps((url, lo, hi)), capture_output=True, env=env, check=False)
    except OSError as exc:
        logger.warning("audit verify: could not start a worker (%s); checking seq %d..%d here", exc, lo, hi)
        return None
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1][:200]
        password = sa.make_url(url).password
        if password:  # an error may quote the URL it was given
            last = last.replace(str(password), "***")
        logger.warning("audit verify: a worker failed (%s); checking seq %d..%d here", last, lo, hi)
        return None
    return done.stdout


def worker_main() -> None:
    """A verify worker: reads (url, lo, hi) pickled from stdin, writes its packed answer to stdout."""
    from store.engine import make_engine

    url, lo, hi = pickle.loads(sys.stdin.buffer.read())
    engine = make_engine(url)
    try:
        with engine.connect() as conn, _cyclic_gc_paused():
            answer = pickle.dumps(_pack(_hash_checked(_rows(conn, lo, hi))), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        engine.dispose()
    sys.stdout.buffer.write(answer)


def _seq_span(conn: sa.Connection, since: datetime | None, until: datetime | None) -> tuple[int | None, int]:
    query = sa.select(sa.func.min(_records.c.seq), sa.func.max(_records.c.seq))
    if since is not None:
        query = query.where(_records.c.received_at >= since)
    if until is not None:
        query = query.where(_records.c.received_at < until)
    lo, hi = conn.execute(query).one()
    return (None, 0) if lo is None else (1 if since is None else lo, hi)


def _prune_ranges(conn: sa.Connection) -> list[_Range]:
    markers = conn.execute(sa.select(_records.c.pruned).where(_records.c.kind == "prune"))
    ranges = [_Range(*item) for (pruned,) in markers if isinstance(pruned, dict)
              for item in pruned.get("ranges", []) if isinstance(item, list) and len(item) == 4]
    return sorted(ranges, key=lambda r: r.first)


def _rows(conn: sa.Connection, lo: int, hi: int) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    after = lo - 1
    names = [column.name for column in _records.columns]
    while True:
        statement = (sa.select(*(_raw(column) for column in _records.columns))
                     .where(_records.c.seq > after, _records.c.seq <= hi).order_by(_records.c.seq).limit(BATCH_SIZE))
        batch = [_typed(dict(zip(names, row, strict=True))) for row in _fetch_raw(conn, statement)]
        if not batch:
            return
        stages: dict[str, list[dict[str, Any]]] = {}
        joined = (sa.select(_stages.c.record_id, *(_raw(_stages.c[name]) for name in STAGE_COLUMNS))
                  .join(_records, _records.c.id == _stages.c.record_id)
                  .where(_records.c.seq > after, _records.c.seq <= batch[-1]["seq"])
                  .order_by(_records.c.seq, _stages.c.position))  # the index order: no sort step
        for record_id, stage_id, kind, status, duration_ms, cost_usd, decision, step in _fetch_raw(conn, joined):
            stage = {"stage_id": stage_id, "type": kind, "status": status, "duration_ms": duration_ms,
                     "cost_usd": cost_usd, "decision": _json(decision)}
            if step is not None:  # a row without one is chained without one (store/audit/chain.py)
                stage["step"] = _json(step)
            found = stages.get(record_id)
            if found is None:
                stages[record_id] = [stage]
            else:
                found.append(stage)
        for row in batch:
            yield row, stages.get(row["id"], [])
        after = batch[-1]["seq"]


# Verify reads 100k+ rows: JSON and timestamp columns come back raw and are decoded here with
# json.loads / datetime.fromisoformat, several times cheaper per value than the generic result processors.
_DATETIME_COLUMNS = ("received_at", "first_token_at", "completed_at")
_JSON_COLUMNS = ("params", "route", "retrieval", "policy", "pruned")
_decode = json.JSONDecoder().raw_decode  # what json.loads does for us, minus its per-call setup


def _fetch_raw(conn: sa.Connection, statement: sa.Select[Any]) -> list[tuple[Any, ...]]:
    # Tuples straight from the driver's cursor: the selected columns need no result processing
    # (see _raw), and skipping Row objects is most of the cost of reading 100k records.
    result = conn.execute(statement)
    try:
        return result.cursor.fetchall()
    finally:
        result.close()


def _raw(column: sa.Column[Any]) -> sa.ColumnElement[Any]:
    if column.name in _DATETIME_COLUMNS or column.name in _JSON_COLUMNS or column.name in ("decision", "step"):
        return sa.type_coerce(column, sa.String).label(column.name)
    return column


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    for name in _DATETIME_COLUMNS:
        value = row[name]
        if isinstance(value, str):  # SQLite: naive UTC text, "2026-01-01 12:00:00.000000" as SQLAlchemy writes it
            row[name] = (value.replace(" ", "T") + "Z" if len(value) == 26 and value[10] == " "
                         else utc_text(datetime.fromisoformat(value).replace(tzinfo=UTC)))
    for name in _JSON_COLUMNS:
        row[name] = _json(row[name])
    return row


def _json(value: Any) -> Any:
    # SQLite hands back JSON text; psycopg has already decoded json columns.
    if value is None or value == "null":  # most stages decide nothing
        return None
    return _decode(value)[0] if isinstance(value, str) else value


def _check_tail(walk: _Walk, head_seq: int, head_hash: str) -> None:
    last_seq = walk.expected - 1 if walk.expected is not None else 0
    if last_seq < head_seq:
        walk.report("deleted", None, f"seq {last_seq + 1}..{head_seq} missing at the end of the chain",
                    seq=last_seq + 1)
    elif last_seq == head_seq and walk.link is not None and walk.link != head_hash:
        walk.report("modified", None, "the last record does not match the chain head's hash", seq=head_seq)


def _check_checkpoints(conn: sa.Connection, walk: _Walk, verifier: Verifier, lo: int | None, hi: int,
                       head_seq: int) -> int:
    """Report the checkpoints whose signature or record does not match; how many had no key to check them."""
    query = sa.select(AuditCheckpoint.seq, AuditCheckpoint.head_hash, AuditCheckpoint.signature,
                      AuditCheckpoint.algorithm, AuditCheckpoint.key_id)
    if lo is not None:
        query = query.where(AuditCheckpoint.seq >= lo, AuditCheckpoint.seq <= max(hi, head_seq))
    unchecked = 0
    for seq, head_hash, signature, algorithm, key_id in conn.execute(query.order_by(AuditCheckpoint.seq)):
        good = verifier.check(algorithm, key_id, checkpoint_message(seq, head_hash), signature)
        if good is None:
            unchecked += 1
            continue
        if not good:
            walk.report("bad_checkpoint", None, "signature does not match (wrong key, or edited)", seq=seq)
        elif seq > head_seq:
            walk.report("bad_checkpoint", None, f"signed at seq {seq}, past the chain head {head_seq}", seq=seq)
        elif seq in walk.hashes and walk.hashes[seq] != head_hash:
            walk.report("bad_checkpoint", None, "the record at this seq is not the one that was signed", seq=seq)
    return unchecked
