"""Signing checkpoints and digests: Ed25519, which anyone holding the public key can check, or HMAC.

    signer = Ed25519Signer.from_pem(private_pem)      # audit.signing_key: the server signs
    signer.sign(b"1000:ab12...")                      # hex signature; signer.key_id names the key
    verifier = Verifier(public_keys=[public_pem, old_public_pem], hmac_key=None)
    verifier.check("ed25519", key_id, message, signature)   # True, False, or None: no key to check it
    signer, made = load_or_create(Path("inferline-audit-signing.pem"))   # a server's own key, made once

An Ed25519 key id is the first 16 hex characters of the SHA-256 of the raw public key; each
checkpoint stores the id of the key that signed it, so after a rotation the old public keys keep
verifying the old checkpoints. HMAC (``audit.checkpoint_key``, the algorithm before Ed25519) still
signs and verifies, but whoever verifies with it holds the key that can also forge a checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

HMAC = "hmac-sha256"
ED25519 = "ed25519"


class Signer(Protocol):
    algorithm: str
    key_id: str

    def sign(self, message: bytes) -> str: ...


@dataclass(frozen=True, slots=True)
class HmacSigner:
    """HMAC-SHA256 with a shared secret (the checkpoint key)."""

    key: bytes
    algorithm: str = HMAC
    key_id: str = ""

    def sign(self, message: bytes) -> str:
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()


class Ed25519Signer:
    """Ed25519 with a private key; what it signs, its public key verifies."""

    algorithm = ED25519

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id_of(self.public_key)

    @classmethod
    def from_pem(cls, pem: bytes | str) -> Ed25519Signer:
        """From a PKCS#8 PEM private key (``inferline audit keygen`` writes one); ValueError if it is not
        an unencrypted Ed25519 private key."""
        data = pem.encode() if isinstance(pem, str) else pem
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise ValueError("not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"an Ed25519 private key is needed, not {type(key).__name__}")
        return cls(key)

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()

    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def as_signer(key: bytes | Signer) -> Signer:
    """*key* as a signer: bytes are an HMAC key (the configuration before Ed25519)."""
    return HmacSigner(key) if isinstance(key, bytes) else key


def key_id_of(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_public_key(pem: bytes | str) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM (SubjectPublicKeyInfo); ValueError if it is not one."""
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"an Ed25519 public key is needed, not {type(key).__name__}")
    return key


def generate_pem() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair: (private PEM, public PEM)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return private, Ed25519Signer(key).public_pem()


def load_or_create(path: Path) -> tuple[Ed25519Signer, bool]:
    """The Ed25519 key in the PEM file *path*, made there first when there is none (mode 0600, its public key
    in ``<path>.pub``), as sshd makes its host keys: (the signer, whether it was made now). Processes that
    start together end up with one key: the first file linked in place wins, the others read it. ValueError
    when the file holds no unencrypted Ed25519 key; OSError when it cannot be read or made."""
    made = False
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        pem, _ = generate_pem()
        made = _create_once(path, pem)
        if not made:
            pem = path.read_bytes()
    signer = Ed25519Signer.from_pem(pem)
    public = path.with_name(path.name + ".pub")
    if made or not public.exists():
        staged = path.with_name(f".{public.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        staged.write_bytes(signer.public_pem())
        os.replace(staged, public)
    return signer, made


def _create_once(path: Path, data: bytes) -> bool:
    """Write *data* to *path* (mode 0600) unless a file is there already; whether this call wrote it. The
    file appears whole: a hard link of a fsynced copy (an exclusive create where links are not supported)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(staged, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        pass
    finally:
        staged.unlink(missing_ok=True)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except FileExistsError:
        return False
    return True


class Verifier:
    """Checks signatures with the public keys it was given (by key id) and, for HMAC, a shared key."""

    def __init__(self, public_keys: Iterable[bytes | str | Ed25519PublicKey] = (), hmac_key: bytes | None = None):
        self.public_keys: dict[str, Ed25519PublicKey] = {}
        for key in public_keys:
            public = key if isinstance(key, Ed25519PublicKey) else load_public_key(key)
            self.public_keys[key_id_of(public)] = public
        self.hmac_key = hmac_key

    @classmethod
    def for_signer(cls, signer: Signer | None, public_keys: Iterable[bytes | str] = ()) -> Verifier:
        """What the server that signs with *signer* can check: its own key, and the older public keys."""
        keys: list[bytes | str | Ed25519PublicKey] = list(public_keys)
        if isinstance(signer, Ed25519Signer):
            keys.append(signer.public_key)
        return cls(keys, signer.key if isinstance(signer, HmacSigner) else None)

    @property
    def empty(self) -> bool:
        return not self.public_keys and self.hmac_key is None

    def check(self, algorithm: str, key_id: str, message: bytes, signature: str) -> bool | None:
        """True when *signature* is good, False when it is not, None when there is no key to check it."""
        if algorithm == HMAC:
            if self.hmac_key is None:
                return None
            return hmac.compare_digest(HmacSigner(self.hmac_key).sign(message), signature)
        if algorithm == ED25519:
            public = self.public_keys.get(key_id)
            if public is None:
                return None
            try:
                public.verify(bytes.fromhex(signature), message)
            except (InvalidSignature, ValueError):
                return False
            return True
        return False


def checkpoint_message(seq: int, head_hash: str) -> bytes:
    """What a checkpoint signs: ``"<seq>:<head_hash>"``."""
    return f"{seq}:{head_hash}".encode()


def as_verifier(key: bytes | Verifier | None) -> Verifier | None:
    """*key* as a verifier: bytes are an HMAC key; None stays None."""
    return Verifier(hmac_key=key) if isinstance(key, bytes) else key
