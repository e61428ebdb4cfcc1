"""Stored responses (store/responses.py): saved, read by their owner only, deleted, expired and pruned."""

from __future__ import annotations

from datetime import timedelta

from store.db import utcnow
from store.responses import ResponseStore, StoredResponse

CONVERSATION = [{"type": "message", "role": "user", "content": "Hi"},
                {"type": "message", "role": "assistant", "content": "Hello!"}]


def stored(response_id: str, owner: str | None = "k1", days: float | None = 30) -> StoredResponse:
    now = utcnow()
    return StoredResponse(response_id, owner, "chat", CONVERSATION, {"id": response_id, "object": "response"},
                          now, None if days is None else now + timedelta(days=days))


def test_a_saved_response_reads_back_for_its_owner(engine):
    responses = ResponseStore(engine)
    responses.save(stored("resp_1"))
    found = responses.get("resp_1", "k1")
    assert found is not None
    assert (found.pipeline, found.conversation, found.body) == ("chat", CONVERSATION,
                                                                {"id": "resp_1", "object": "response"})
    assert responses.get("resp_1", None) == found  # auth off: anyone reads
    assert responses.get("resp_1", "k2") is None
    assert responses.get("resp_2", "k1") is None


def test_an_ownerless_response_is_only_read_without_an_owner(engine):
    responses = ResponseStore(engine)
    responses.save(stored("resp_1", owner=None))
    assert responses.get("resp_1", None) is not None
    assert responses.get("resp_1", "k1") is None


def test_delete_is_the_owners_only(engine):
    responses = ResponseStore(engine)
    responses.save(stored("resp_1"))
    assert not responses.delete("resp_1", "k2")
    assert responses.get("resp_1", "k1") is not None
    assert responses.delete("resp_1", "k1")
    assert responses.get("resp_1", "k1") is None
    assert not responses.delete("resp_1", "k1")


def test_expired_responses_are_not_returned_and_are_pruned(engine):
    responses = ResponseStore(engine)
    responses.save(stored("resp_old", days=1))
    responses.save(stored("resp_new", days=30))
    responses.save(stored("resp_kept", days=None))
    later = utcnow() + timedelta(days=2)
    assert responses.get("resp_old", "k1", now=later) is None
    assert not responses.delete("resp_old", "k1", now=later)
    assert responses.get("resp_new", "k1", now=later) is not None
    assert responses.prune(now=later) == 1
    assert responses.get("resp_old", "k1") is None  # gone, not merely hidden
    assert responses.prune(now=utcnow() + timedelta(days=365)) == 1
    assert responses.get("resp_kept", "k1", now=utcnow() + timedelta(days=3650)) is not None


def test_a_paused_request_resumes_once_and_for_its_owner_only(engine):
    from store.responses import PausedRequest

    responses = ResponseStore(engine)
    now = utcnow()
    responses.pause(PausedRequest("r1", "k1", "orders", {"step": "answer"}, now, now + timedelta(days=1)))
    responses.pause(PausedRequest("r2", "k1", "orders", {"step": "answer"}, now, now - timedelta(seconds=1)))
    assert responses.resume("r1", "k2") is None
    taken = responses.resume("r1", "k1")
    assert taken is not None and taken.state == {"step": "answer"} and taken.pipeline == "orders"
    assert responses.resume("r1", "k1") is None  # resumed once: an approval never runs a call twice
    assert responses.resume("r2", "k1") is None  # expired
    assert responses.prune() == 1
