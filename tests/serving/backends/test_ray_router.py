"""The prefix router's choice (serving/backends/ray_router.py) as plain functions, without Ray running."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from serving.backends.placement import Placement
from serving.backends.ray_router import PrefixRouter, choose, rank, request_key

IDS = ["a1b2", "c3d4", "e5f6"]
PLACEMENT = Placement(1, "prefix", block_size=4, prefix_blocks=2)


def test_rank_is_a_stable_order_of_all_replicas():
    assert sorted(rank(123, IDS)) == sorted(IDS)
    assert rank(123, IDS) == rank(123, list(reversed(IDS)))


def test_keys_spread_over_replicas():
    firsts = Counter(rank(key, IDS)[0] for key in range(3000))
    assert set(firsts) == set(IDS)
    assert min(firsts.values()) > 800  # about a third each


def test_a_new_replica_takes_keys_only_for_itself():
    before = {key: rank(key, IDS)[0] for key in range(2000)}
    after = {key: rank(key, [*IDS, "g7h8"])[0] for key in range(2000)}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(after[key] == "g7h8" for key in moved)
    assert len(moved) < 700  # about a quarter


def test_the_keys_replica_first_then_the_rest():
    groups = choose(7, IDS, {i: 0 for i in IDS}, max_imbalance=4)
    ranked = rank(7, IDS)
    assert groups == [ranked[:1], ranked[1:]]


def test_an_overloaded_replica_leaves_the_choice_to_the_least_loaded():
    chosen = rank(7, IDS)[0]
    loads = {i: 1 for i in IDS}
    loads[chosen] = 6
    assert choose(7, IDS, loads, max_imbalance=4) == [IDS]  # one group: Ray Serve takes the lightest
    loads[chosen] = 5
    assert choose(7, IDS, loads, max_imbalance=4)[0] == [chosen]


def test_unknown_loads_do_not_move_a_prefix():
    chosen = rank(7, IDS)[0]
    assert choose(7, IDS, {chosen: None}, max_imbalance=0)[0] == [chosen]


@pytest.mark.parametrize(("key", "ids"), [(None, IDS), (7, IDS[:1])])
def test_no_key_or_one_replica_is_one_group(key, ids):
    assert choose(key, ids, {}, max_imbalance=4) == [ids]


def test_the_key_is_the_placements_prefix_key_salted():
    prompt = list(range(20))
    key = request_key([prompt, {}, "tenant-a", {}], {}, PLACEMENT)
    assert key == PLACEMENT.prefix_key(prompt, "tenant-a")
    assert key != request_key([prompt, {}, "tenant-b", {}], {}, PLACEMENT)
    # Only the first prefix_blocks blocks count: a longer tail keeps the replica.
    assert key == request_key([[*prompt, 99, 98], {}, "tenant-a"], {}, PLACEMENT)
    assert request_key([], {"prompt_ids": prompt, "cache_salt": "tenant-a"}, PLACEMENT) == key
    assert request_key([prompt[:3]], {}, PLACEMENT) is None  # under one block


class FakeReplica:
    def __init__(self, unique_id: str):
        self.replica_id = SimpleNamespace(unique_id=unique_id)


class FakeCache:
    def __init__(self, loads):
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id.unique_id)


async def test_choose_replicas_reads_the_generate_call_and_probes_unknown_loads():
    router = PrefixRouter.__new__(PrefixRouter)  # Ray builds it with a deployment; the policy needs none of that
    router.initialize_state(block_size=4, prefix_blocks=2, max_imbalance=4)
    replicas = [FakeReplica(i) for i in IDS]
    probed = []

    async def probe(stale, backoff_index):
        probed.extend(r.replica_id.unique_id for r in stale)
        return [(r, 0) for r in stale]

    router._replica_queue_len_cache = FakeCache({IDS[0]: 0})
    router._probe_queue_lens = probe
    prompt = list(range(12))
    request = SimpleNamespace(metadata=SimpleNamespace(call_method="generate"), args=[prompt, {}, "", {}], kwargs={})
    groups = await router.choose_replicas(replicas, request)
    expected = rank(PLACEMENT.prefix_key(prompt), IDS)
    assert [[r.replica_id.unique_id for r in group] for group in groups] == [expected[:1], expected[1:]]
    assert sorted(probed) == sorted(IDS[1:])
    other = SimpleNamespace(metadata=SimpleNamespace(call_method="check_health"), args=[], kwargs={})
    assert await router.choose_replicas(replicas, other) == [replicas]
