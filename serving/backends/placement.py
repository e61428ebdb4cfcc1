"""Which replica serves a request: prefix-aware, round robin or least loaded. Plain Python, no torch.

Used for a local model's engine replicas (``serving.backends.model_pool``) and for a remote model's servers
(``serving.backends.remote``, ``base_urls``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from serving.engine.block_manager import hash_block

#: Weight of the newest sample in the load figures' moving averages (time to first token).
EWMA_ALPHA = 0.2


def ewma(previous: float | None, sample: float) -> float:
    """The exponential moving average after *sample* (the sample itself when there was none)."""
    return sample if previous is None else previous + EWMA_ALPHA * (sample - previous)

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ReplicaOccupancy:
    """One replica's queue: requests waiting for admission and requests in its running batch."""

    waiting: int = 0
    running: int = 0

    @property
    def total(self) -> int:
        return self.waiting + self.running


@dataclass(slots=True)
class Placement:
    """Which replica of a model serves a request. Plain Python: no engine needed to test it.

    ``prefix`` (default) keeps requests that share a prompt prefix on one replica, so that its prefix
    cache holds that prefix once and hits it, instead of every replica computing and caching it. The key is
    the hash of the prompt's first ``prefix_blocks`` full KV blocks of ``block_size`` tokens, chained from
    ``cache_salt`` as the engine's prefix cache chains them (tenants with different salts share nothing
    there either). The key picks a replica by rendezvous (highest random weight) hashing, which
    needs no table and moves only 1/N of the keys if N changes. Locality must not turn into a hot spot:
    when that replica's load (waiting + running) exceeds the lightest replica's by more than
    ``max_imbalance``, the lightest takes the request. A prompt shorter than one block has no prefix
    worth keeping together and goes to the least loaded replica.
    ``round_robin`` cycles; ``least_loaded`` takes the fewest waiting, then the fewest running.
    Ties go to the lowest replica index.
    """

    replicas: int
    kind: str = "prefix"
    block_size: int = 16
    prefix_blocks: int = 4
    max_imbalance: int = 16
    _next: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("prefix", "round_robin", "least_loaded"):
            raise ValueError(f"unknown placement {self.kind!r}; use prefix, round_robin or least_loaded")
        if self.replicas < 1 or self.block_size < 1 or self.prefix_blocks < 1:
            raise ValueError("replicas, block_size and prefix_blocks must be positive")

    def choose(self, prompt_ids: Sequence[int], cache_salt: str, loads: Sequence[ReplicaOccupancy]) -> int:
        """The replica index for a request, given each replica's load now (``len(loads) == replicas``)."""
        if self.kind == "round_robin":
            index, self._next = self._next, (self._next + 1) % self.replicas
            return index
        if self.kind == "least_loaded":
            return least_loaded(loads)
        key = self.prefix_key(prompt_ids, cache_salt)
        if key is None:
            return least_loaded(loads)
        chosen = rendezvous(key, self.replicas)
        lightest = min(range(len(loads)), key=lambda i: (loads[i].total, loads[i].waiting, i))
        if loads[chosen].total - loads[lightest].total > self.max_imbalance:
            return lightest
        return chosen

    def prefix_key(self, prompt_ids: Sequence[int], cache_salt: str = "") -> int | None:
        """The hash of the prompt's leading full blocks (at most ``prefix_blocks``); None under one block."""
        size = self.block_size
        num_blocks = min(self.prefix_blocks, len(prompt_ids) // size)
        if num_blocks == 0:
            return None
        key = _salt_root(cache_salt)
        for start in range(0, num_blocks * size, size):
            key = hash_block(key, tuple(prompt_ids[start:start + size]))
        return key


def _salt_root(cache_salt: str) -> int:
    # Like the engine's root_hash, but stable across processes (str hashes are randomized per process),
    # so that a prompt's replica, and with it a test or a benchmark, is the same on every run.
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


def least_loaded(loads: Sequence[ReplicaOccupancy]) -> int:
    """The index with the fewest waiting, then the fewest running (then the lowest index)."""
    return min(range(len(loads)), key=lambda i: (loads[i].waiting, loads[i].running, i))


def rendezvous(key: int, replicas: int) -> int:
    """The replica with the highest weight ``mix(key, replica)`` (rendezvous hashing)."""
    best, best_weight = 0, -1
    for replica in range(replicas):
        weight = _mix64((key + 0x9E3779B97F4A7C15 * (replica + 1)) & _MASK64)
        if weight > best_weight:
            best, best_weight = replica, weight
    return best


def _mix64(x: int) -> int:
    # splitmix64's finalizer: Python's hash of nearby tuples is not mixed enough for per-replica weights.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
