"""Anchors: every checkpoint also kept outside the database, as a signed digest file, and checked against it.

    anchors = Anchors(engine, Path("/mnt/audit-digests"), signer)
    anchors.deliver()                  # a digest file for each checkpoint not delivered yet (a thread does this)
    report = verify_anchors(engine, Path("/mnt/audit-digests"), verifier)   # the database against them

A digest (``<seq, 20 digits>.json``, written once, never overwritten) holds the checkpoint's seq, the
first seq it covers (the one after the digest before it), the chain head hash at that seq, the
checkpoint's own signature, the SHA-256 of the previous digest file (64 zeros for the first) and a
signature over all of that, by the same key (Ed25519: anyone with the public key checks it). Each
digest names the one before it, as CloudTrail's digest files do, so a digest removed or replaced shows.

Someone who can write the database can cut its tail together with the checkpoints after it and move
the chain head back, or restore an older copy: the chain and its checkpoints then agree with
themselves, and only the digests, kept where those writers cannot reach, still know the head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from store.audit.chain import utc_text
from store.audit.models import AuditChainHead, AuditCheckpoint, AuditRecord
from store.audit.signing import Signer, Verifier
from store.audit.verify import Tail, tail_after

logger = logging.getLogger(__name__)

GENESIS = "0" * 64
VERSION = 1
_NAME = re.compile(r"^(\d{20})\.json$")
#: A checkpoint older than this without a digest is reported missing (delivery runs every few seconds).
UNDELIVERED_GRACE = timedelta(minutes=10)


def digest_name(seq: int) -> str:
    return f"{seq:020d}.json"


def _canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest_message(digest: dict[str, Any]) -> bytes:
    """What a digest's signature covers: the digest without its signature, as canonical JSON."""
    return _canonical({k: v for k, v in digest.items() if k != "signature"})


def make_digest(checkpoint: dict[str, Any], first_seq: int, previous_sha256: str, signer: Signer) -> dict[str, Any]:
    digest = {"version": VERSION, "seq": checkpoint["seq"], "first_seq": first_seq,
              "head_hash": checkpoint["head_hash"], "checkpoint_signature": checkpoint["signature"],
              "checkpoint_algorithm": checkpoint["algorithm"], "key_id": signer.key_id,
              "algorithm": signer.algorithm, "checkpoint_created_at": utc_text(checkpoint["created_at"]),
              "previous_digest_sha256": previous_sha256}
    return {**digest, "signature": signer.sign(digest_message(digest))}


def digest_file_bytes(digest: dict[str, Any]) -> bytes:
    return _canonical(digest) + b"\n"


@dataclass(slots=True)
class Delivery:
    """What one :meth:`Anchors.deliver` did."""

    written: list[dict[str, Any]] = field(default_factory=list)
    #: The newest digest no longer matches the database (rolled back or rewritten since): an alarm.
    mismatch: str | None = None


class Anchors:
    """Writes a digest file for each checkpoint of *engine*'s log not delivered yet, in seq order."""

    def __init__(self, engine: sa.Engine, folder: Path, signer: Signer):
        self.engine = engine
        self.folder = folder
        self.signer = signer
        self._last: tuple[int, str] | None = None  # the newest digest this object wrote or found

    def _newest(self) -> tuple[int, str]:
        # A listing reads every name in the folder, one more per checkpoint (every few seconds): it is done
        # again only once the digest last seen has gone. Digests another process added since are met as
        # files already there, and taken as they are.
        if self._last is not None and (self._last[0] == 0 or (self.folder / digest_name(self._last[0])).exists()):
            return self._last
        return self.last()

    def last(self) -> tuple[int, str]:
        """The seq of the newest digest in the folder and the SHA-256 of its file; (0, GENESIS) for none."""
        names = sorted(name for name in os.listdir(self.folder) if _NAME.match(name)) if self.folder.is_dir() else []
        if not names:
            return 0, GENESIS
        data = (self.folder / names[-1]).read_bytes()
        return int(_NAME.match(names[-1]).group(1)), hashlib.sha256(data).hexdigest()  # type: ignore[union-attr]

    def deliver(self, limit: int = 1000) -> Delivery:
        """A digest file for each checkpoint after the newest digest (up to *limit*); OSError when the
        folder cannot be written (the next call retries)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        last_seq, last_sha = self._newest()
        delivery = Delivery()
        with self.engine.connect() as conn:
            if last_seq:
                held = conn.scalar(sa.select(AuditRecord.hash).where(AuditRecord.seq == last_seq))
                digest = json.loads((self.folder / digest_name(last_seq)).read_text())
                if held != digest.get("head_hash"):
                    delivery.mismatch = (f"the database's record at seq {last_seq} is not the one the newest digest "
                                         "names: the log was cut, rolled back or rewritten since")
            rows = conn.execute(sa.select(AuditCheckpoint.seq, AuditCheckpoint.head_hash, AuditCheckpoint.signature,
                                          AuditCheckpoint.algorithm, AuditCheckpoint.created_at)
                                .where(AuditCheckpoint.seq > last_seq).order_by(AuditCheckpoint.seq).limit(limit))
            checkpoints = [dict(row._mapping) for row in rows]
        for checkpoint in checkpoints:
            digest = make_digest(checkpoint, last_seq + 1, last_sha, self.signer)
            data = digest_file_bytes(digest)
            path = self.folder / digest_name(checkpoint["seq"])
            staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(staged, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            try:
                _publish(staged, path, data)
            except FileExistsError:  # another process delivered it first: theirs stands
                data = path.read_bytes()
                digest = json.loads(data)
            finally:
                staged.unlink(missing_ok=True)
            delivery.written.append(digest)
            last_seq, last_sha = checkpoint["seq"], hashlib.sha256(data).hexdigest()
        self._last = last_seq, last_sha
        return delivery


def _publish(staged: Path, path: Path, data: bytes) -> None:
    """Make *path* hold *data*, whole, never replacing a file there (FileExistsError): a hard link of the
    fsynced *staged* file; where the mount has no hard links, an exclusive create."""
    try:
        os.link(staged, path)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


@dataclass(frozen=True, slots=True)
class AnchorFinding:
    """kind: tail_cut, rolled_back, rewritten, checkpoint_removed, digest_missing, digest_altered."""

    kind: str
    seq: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class AnchorReport:
    ok: bool
    digests: int
    #: The newest digest's seq: the head the database must still hold.
    anchored_seq: int
    findings: list[AnchorFinding]
    #: Digests no key given could check.
    unchecked: int = 0
    #: The records after the newest digest: not anchored yet.
    unanchored: Tail | None = None


def verify_anchors(engine: sa.Engine, folder: Path, verifier: Verifier | None,
                   now: datetime | None = None, window_s: float | None = None) -> AnchorReport:
    """The digests in *folder* checked against each other (signatures, the chain of digests) and the
    database against them (every digested head still there, unchanged). *window_s*: how soon a digest
    follows a record (the server's ``checkpoint_every_s + anchors.every_s``): a checkpoint older than that
    without a digest is ``digest_missing`` (without it, one older than :data:`UNDELIVERED_GRACE`)."""
    findings: list[AnchorFinding] = []
    digests, unchecked = _read_digests(folder, verifier, findings)
    anchored = digests[-1]["seq"] if digests else 0
    with engine.connect() as conn:
        head_seq = conn.scalar(sa.select(AuditChainHead.seq)) or 0
        unanchored = tail_after(conn, anchored, head_seq)
        seqs = [d["seq"] for d in digests]
        held = dict(conn.execute(sa.select(AuditRecord.seq, AuditRecord.hash).where(AuditRecord.seq.in_(seqs)))
                    .all()) if seqs else {}
        received = dict(conn.execute(sa.select(AuditRecord.seq, AuditRecord.received_at)
                                     .where(AuditRecord.seq.in_(seqs))).all()) if seqs else {}
        checkpoints = dict(conn.execute(sa.select(AuditCheckpoint.seq, AuditCheckpoint.created_at)).all())
    cut_reported = False
    for digest in digests:
        seq = digest["seq"]
        if seq not in held:
            if seq > head_seq and not cut_reported:
                cut_reported = True
                findings.append(AnchorFinding("tail_cut", head_seq + 1, (
                    f"the database ends at seq {head_seq}, but a digest names the record at seq {seq} (and "
                    f"{len([d for d in digests if d['seq'] > head_seq])} digest(s) in all lie beyond it): records "
                    "were cut from the end, or an older copy of the database was restored")))
            elif seq <= head_seq:
                findings.append(AnchorFinding("rewritten", seq, f"the record at seq {seq}, which a digest names, "
                                                                "is gone from inside the chain"))
            continue
        if held[seq] != digest["head_hash"]:
            made = _parse_time(digest.get("checkpoint_created_at"))
            later = made is not None and received.get(seq) is not None and _aware(received[seq]) > made
            if later:
                findings.append(AnchorFinding("rolled_back", digest["first_seq"], (
                    f"seq {digest['first_seq']}..{seq}: the database holds records received after the digest of "
                    f"seq {seq} was made ({utc_text(made)}): an older copy was restored and written on")))
            else:
                findings.append(AnchorFinding("rewritten", digest["first_seq"], (
                    f"seq {digest['first_seq']}..{seq}: the chain no longer leads to the head the digest signed: "
                    "records in this range were changed (and the chain recomputed over them)")))
        elif seq not in checkpoints:
            findings.append(AnchorFinding("checkpoint_removed", seq, f"the checkpoint at seq {seq} is gone from the "
                                                                     "database; its digest keeps it"))
    grace = (now or datetime.now(UTC)) - (UNDELIVERED_GRACE if window_s is None else timedelta(seconds=window_s))
    digested = set(seqs)
    for seq, created in sorted(checkpoints.items()):
        if seq not in digested and (seq < anchored or _aware(created) < grace):
            findings.append(AnchorFinding("digest_missing", seq, (
                f"the checkpoint at seq {seq} (made {utc_text(_aware(created))}) has no digest: it was never "
                "delivered, or its digest file was removed")))
    return AnchorReport(not findings, len(digests), anchored, findings, unchecked, unanchored)


def _read_digests(folder: Path, verifier: Verifier | None,
                  findings: list[AnchorFinding]) -> tuple[list[dict[str, Any]], int]:
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder of digests")
    names = sorted(name for name in os.listdir(folder) if _NAME.match(name))
    digests: list[dict[str, Any]] = []
    unchecked = 0
    previous_seq, previous_sha = 0, GENESIS
    for name in names:
        data = (folder / name).read_bytes()
        seq = int(name[:20])
        try:
            digest = json.loads(data)
            ok_shape = (isinstance(digest, dict) and digest.get("seq") == seq
                        and isinstance(digest.get("first_seq"), int))
        except ValueError:
            ok_shape = False
        if not ok_shape:
            findings.append(AnchorFinding("digest_altered", seq, f"{name} is not a digest of seq {seq}"))
            previous_seq, previous_sha = seq, hashlib.sha256(data).hexdigest()
            continue
        good = verifier.check(digest.get("algorithm", ""), digest.get("key_id", ""), digest_message(digest),
                              str(digest.get("signature", ""))) if verifier is not None else None
        if good is None:
            unchecked += 1
        elif not good:
            findings.append(AnchorFinding("digest_altered", seq, f"{name}: its signature does not match (edited, "
                                                                 "or signed by another key)"))
        if digest["previous_digest_sha256"] != previous_sha:
            if digest["first_seq"] != previous_seq + 1:
                findings.append(AnchorFinding("digest_missing", previous_seq + 1, (
                    f"{name} follows a digest of seq {digest['first_seq'] - 1}, which is not in the folder "
                    f"(the newest one before it is of seq {previous_seq or 'none'})")))
            else:
                findings.append(AnchorFinding("digest_altered", previous_seq, (
                    f"{name} names a previous digest other than the one in the folder: "
                    f"{digest_name(previous_seq) if previous_seq else 'the first digest'} was replaced")))
        digests.append(digest)
        previous_seq, previous_sha = seq, hashlib.sha256(data).hexdigest()
    return digests, unchecked


def _parse_time(value: Any) -> datetime | None:
    try:
        return _aware(datetime.fromisoformat(str(value)))
    except ValueError:
        return None


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
