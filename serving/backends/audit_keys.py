"""The audit log's keys and anchors as the server config names them, or as the server makes them itself.

    signer = serving_signer(server, engine.url)      # the config's key, else the server's own (made on first start)
    folder = anchor_folder(server, root, engine.url)  # where digests go: audit.anchors.dir, else beside the database
    local = local_key(server, engine.url)             # LocalKey(private, digests), or None

With neither ``audit.signing_key`` nor ``audit.checkpoint_key`` set and a SQLite file database, a serving
process signs with a key of its own, as sshd makes its host keys: ``<name>-audit-signing.pem`` (mode 0600)
and its ``.pub`` beside ``<name>.db``, made on first start, and delivers digests to ``<name>-audit-digests/``
beside it unless ``audit.anchors.dir`` names a folder. ``inferline audit verify`` with the same config finds
the public key and the folder there. Other processes (``inferline run``, ``eval``, ``audit erase``) never
read that private key: the server's next checkpoint covers what they append. PostgreSQL gets no key of its
own: the processes sharing one database must share one configured key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from pipeline.errors import SpecError, SpecIssue
from serving.config.audit import AnchorsSpec
from serving.config.server import ServerSpec
from store.audit import Ed25519Signer, HmacSigner, Signer, load_or_create, load_public_key

logger = logging.getLogger(__name__)
#: ``anchors.every_s`` where the config names no anchors (the folder beside the database).
DEFAULT_ANCHOR_EVERY_S: float = AnchorsSpec.model_fields["every_s"].default


@dataclass(frozen=True, slots=True)
class LocalKey:
    """Where a server keeps the key it made for itself, beside its SQLite database, and its digests."""

    private: Path
    digests: Path

    @property
    def public(self) -> Path:
        return self.private.with_name(self.private.name + ".pub")


def local_key(server: ServerSpec, database: str | sa.URL) -> LocalKey | None:
    """The server's own key and digest folder for *database*; None when the config names a key, turns
    ``audit.local_key`` off, or the database is not a SQLite file."""
    audit = server.audit
    if not audit.local_key or audit.signing_key or audit.checkpoint_key:
        return None
    url = sa.make_url(database)
    name = url.database or ""
    if url.get_backend_name() != "sqlite" or name in ("", ":memory:") or name.startswith("file:") \
            or url.query.get("mode") == "memory":
        return None
    path = Path(name)
    return LocalKey(path.with_name(f"{path.stem}-audit-signing.pem"), path.with_name(f"{path.stem}-audit-digests"))


def serving_signer(server: ServerSpec, database: str | sa.URL) -> Signer | None:
    """What a serving process signs checkpoints and digests with: the config's key, else its own, read or made
    (with its digest folder) on first start; None when there is neither. SpecError when the own key's file
    holds no key, or its public key is there without it. Blocking (file I/O)."""
    configured = checkpoint_signer(server)
    local = local_key(server, database)
    if configured is not None or local is None:
        return configured
    if local.public.exists() and not local.private.exists():
        raise _refused(local, f"missing, though its public key {local.public.name} is there: restore it, or move "
                     f"{local.public.name} away (list it in audit.public_keys to keep verifying the checkpoints "
                     "it signed) for a new key to be made")
    try:
        signer, made = load_or_create(local.private)
        local.digests.mkdir(exist_ok=True)
    except ValueError as exc:
        raise _refused(local, f"{exc}: give the file its key back, or move it and its .pub away") from None
    except OSError as exc:
        raise _refused(local, f"cannot be read or made ({exc.strerror or exc})") from None
    if made:
        logger.info("audit: made the signing key %s (public key %s, key id %s): checkpoints and digests "
                    "(%s) are signed with it", local.private, local.public.name, signer.key_id, local.digests.name)
    return signer


def _refused(local: LocalKey, reason: str) -> SpecError:
    return SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.local_key", f"{local.private}: {reason}")])


def can_sign(server: ServerSpec, database: str | sa.URL) -> bool:
    """Whether a serving process of *server* on *database* signs checkpoints (with the config's key or its own)."""
    return checkpoint_signer(server) is not None or local_key(server, database) is not None


def anchor_folder(server: ServerSpec, root: Path, database: str | sa.URL) -> Path | None:
    """Where digests go: ``audit.anchors.dir`` (relative to *root*), else the server's own folder beside the
    database (when it makes its own key), else nowhere."""
    if server.audit.anchors is not None:
        return root / Path(server.audit.anchors.dir)
    local = local_key(server, database)
    return None if local is None else local.digests


def exposure_window_s(server: ServerSpec) -> float:
    """How soon after a record is written a digest outside the database covers it, while a server holding
    the key runs: ``checkpoint_every_s + anchors.every_s``."""
    anchors = server.audit.anchors
    return server.audit.checkpoint_every_s + (anchors.every_s if anchors is not None else DEFAULT_ANCHOR_EVERY_S)


def checkpoint_signer(server: ServerSpec) -> Signer | None:
    """What the config signs checkpoints and digests with: the Ed25519 ``signing_key``, else the HMAC
    ``checkpoint_key``, else nothing. A key that is not one stops the server with :class:`SpecError`."""
    audit = server.audit
    if audit.signing_key:
        try:
            return Ed25519Signer.from_pem(audit.signing_key)
        except ValueError as exc:
            raise SpecError([SpecIssue("inferline.yaml", 1, 1, "audit.signing_key",
                                       f"{exc}: give the private key `inferline audit keygen` writes "
                                       "(INFERLINE_AUDIT__SIGNING_KEY_FILE=path)")]) from None
    return HmacSigner(audit.checkpoint_key.encode()) if audit.checkpoint_key else None


def public_keys(server: ServerSpec, root: Path) -> list[bytes]:
    """The PEM texts of ``audit.public_keys`` (paths relative to *root*); SpecError for one that cannot be read."""
    keys = []
    for n, name in enumerate(server.audit.public_keys):
        path = root / Path(name)
        try:
            keys.append(path.read_bytes())
            load_public_key(keys[-1])
        except (OSError, ValueError) as exc:
            raise SpecError([SpecIssue("inferline.yaml", 1, 1, f"audit.public_keys.{n}",
                                       f"{path}: {exc}")]) from None
    return keys
