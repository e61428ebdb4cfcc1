"""API keys (store/keys.py) on SQLite and on a real PostgreSQL, and the naming convention of store/db.py.

The PostgreSQL variants are marked ``integration``; each runs in a fresh schema
that is dropped afterwards. PostgreSQL being down fails them: deselect them with
``-m "not integration"`` rather than letting them skip silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import pytest
import sqlalchemy as sa

from store.keys import ROLES, ApiKey, KeyInfo, KeyStore

KEY_FORMAT = re.compile(r"il_([A-Za-z0-9]{12})_([A-Za-z0-9_-]{43})")


@pytest.fixture
def keys(engine) -> KeyStore:
    return KeyStore(engine)


def _raw_rows(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM api_keys")))


# --- create and verify --------------------------------------------------------


def test_a_created_key_verifies(keys):
    info, plaintext = keys.create("support bot", "caller")
    match = KEY_FORMAT.fullmatch(plaintext)
    assert match, plaintext
    assert match[1] == info.id
    assert (info.name, info.role, info.revoked_at) == ("support bot", "caller", None)
    assert info.created_at.tzinfo is UTC
    verified = keys.verify(plaintext)
    assert verified is not None
    assert (verified.id, verified.name, verified.role) == (info.id, "support bot", "caller")
    assert verified.created_at == info.created_at
    assert verified.created_at.tzinfo is UTC
    assert verified.is_active


def test_every_key_is_new(keys):
    made = [keys.create("same name", "caller") for _ in range(5)]
    assert len({info.id for info, _ in made}) == 5
    assert len({plaintext for _, plaintext in made}) == 5
    assert all(keys.verify(plaintext).id == info.id for info, plaintext in made)


def test_the_database_holds_a_hash_not_the_secret(keys, engine):
    info, plaintext = keys.create("bot", "auditor")
    secret = KEY_FORMAT.fullmatch(plaintext)[2]
    [row] = _raw_rows(engine)
    stored = row._mapping
    assert stored["id"] == info.id
    assert stored["secret_hash"] == hashlib.sha256(secret.encode()).hexdigest()
    for value in stored.values():
        assert secret not in str(value)
        assert plaintext not in str(value)


def test_last_used_at_is_set_on_verify_and_not_rewritten_at_once(keys):
    info, plaintext = keys.create("bot", "caller")
    assert info.last_used_at is None
    first = keys.verify(plaintext).last_used_at
    assert first is not None
    assert first.tzinfo is UTC
    keys.verify(plaintext)
    [listed] = keys.list()
    assert listed.last_used_at == first


def test_verify_from_many_threads(keys):
    _, plaintext = keys.create("bot", "caller")
    _, other = keys.create("other", "admin")
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(keys.verify, [plaintext, other, plaintext + "x"] * 8))
    assert [r.role if r else None for r in results] == ["caller", "admin", None] * 8


# --- what fails ---------------------------------------------------------------


def test_a_revoked_key_fails(keys):
    info, plaintext = keys.create("bot", "caller")
    _, kept = keys.create("kept", "caller")
    assert keys.revoke(info.id) is True
    assert keys.verify(plaintext) is None
    assert keys.verify(kept) is not None
    assert keys.revoke(info.id) is False


@pytest.mark.parametrize("key_id", ["nosuchkey123", "", "x", "il_", "a" * 10_000, None])
def test_revoking_an_unknown_key_is_false(keys, key_id):
    keys.create("bot", "caller")
    assert keys.revoke(key_id) is False
    assert all(info.is_active for info in keys.list())


def test_a_tampered_secret_fails(keys):
    info, plaintext = keys.create("bot", "caller")
    _, other = keys.create("other", "caller")
    flipped = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert keys.verify(flipped) is None
    # A valid secret under the wrong id.
    assert keys.verify(f"il_{info.id}_{KEY_FORMAT.fullmatch(other)[2]}") is None
    assert keys.verify(plaintext) is not None


@pytest.mark.parametrize("bad", [
    "", "il_", "il__", "il_x_y", "Bearer x", "x" * 100_000, "il_" + "a" * 12 + "_" + "b" * 100_000,
    "il_abcdefghijkl_" + "\u00e9" * 43, "il_abcdefghijk\u00e9_" + "b" * 43, "\x00", None, 42, b"il_x",
])
def test_malformed_input_is_none(keys, bad):
    keys.create("bot", "caller")
    assert keys.verify(bad) is None


def test_near_misses_of_a_real_key_are_none(keys):
    _, plaintext = keys.create("bot", "caller")
    rest = plaintext.removeprefix("il_")
    for near in [f"Bearer {plaintext}", f" {plaintext}", f"{plaintext}\n", f"{plaintext}A", plaintext[:-1],
                 plaintext.upper(), f"IL_{rest}", plaintext.replace("_", "-", 1), plaintext + plaintext]:
        assert keys.verify(near) is None, near
    assert keys.verify(plaintext) is not None


@pytest.mark.parametrize("role", ["root", "Admin", "", "caller "])
def test_unknown_roles_are_refused(keys, role):
    with pytest.raises(ValueError, match="allowed roles: caller, auditor, admin"):
        keys.create("bot", role)
    assert keys.list() == []


@pytest.mark.parametrize("name", ["", "   ", "x" * 201])
def test_bad_names_are_refused(keys, name):
    with pytest.raises(ValueError, match="name"):
        keys.create(name, "caller")


def test_the_table_refuses_unknown_roles_too(engine):
    row = {"id": "abcdefghijkl", "name": "x", "role": "root", "secret_hash": "0" * 64, "created_at": "2024-01-01"}
    with pytest.raises(sa.exc.IntegrityError, match="ck_api_keys_role"), engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO api_keys (id, name, role, secret_hash, created_at) "
                             "VALUES (:id, :name, :role, :secret_hash, :created_at)"), row)


def test_the_tenant_is_the_name_unless_given(keys):
    default, _ = keys.create(" support bot ", "caller")
    shared, plaintext = keys.create("billing batch", "caller", tenant=" acme ")
    assert (default.tenant, shared.tenant) == ("support bot", "acme")
    assert keys.verify(plaintext).tenant == "acme"
    with pytest.raises(ValueError, match="at most 200"):
        keys.create("bot", "caller", tenant="t" * 201)


# --- list ---------------------------------------------------------------------


def test_list_shows_every_key_and_no_hash(keys):
    assert keys.list() == []
    made = {role: keys.create(f"{role} key", role)[0] for role in ROLES}
    keys.revoke(made["auditor"].id)
    listed = keys.list()
    assert [info.id for info in listed] == [made[role].id for role in ROLES]
    assert [info.role for info in listed] == list(ROLES)
    assert [info.is_active for info in listed] == [True, False, True]
    assert listed[1].revoked_at.tzinfo is UTC
    assert listed[1].revoked_at >= listed[1].created_at
    assert {f.name for f in dataclasses.fields(KeyInfo)}.isdisjoint({"secret_hash", "secret"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        listed[0].role = "admin"


# --- store/db.py --------------------------------------------------------------


def test_constraints_follow_the_naming_convention():
    table = ApiKey.__table__
    assert table.primary_key.name == "pk_api_keys"
    assert {c.name for c in table.constraints} >= {"pk_api_keys", "ck_api_keys_role"}
