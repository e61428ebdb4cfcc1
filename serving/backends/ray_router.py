"""Prefix-aware replica choice for a ``backend: ray`` model: a Ray Serve request router.

Ray Serve's default router picks a replica by "power of two choices": requests that share a prompt
prefix land anywhere, and every replica computes and caches that prefix. :class:`PrefixRouter` does for
a model's Ray Serve replicas what :class:`serving.backends.placement.Placement` does for local replicas
(``placement: prefix``, the default): the key is the hash of the prompt's first KV blocks, chained from
the request's ``cache_salt`` as the engine's prefix cache chains them, and it picks a replica by
rendezvous hashing. Ray replicas come and go (autoscaling, restarts) under random ids, so the
rendezvous weights are over replica ids rather than indexes: a new or lost replica moves only the keys
it wins or held. The choice depends on the key and the replica ids only, so every process holding a
handle (each ingress replica, ``inferline serve --ray``) sends a prefix to the same replica without
sharing any state. When that replica has more than ``max_imbalance`` requests in flight over the
lightest, or the prompt is shorter than one block, Ray Serve's own choice (the least loaded) decides.

Wired by :func:`serving.backends.ray_deploy.deployment_options` as the deployment's
``request_router_config``::

    models:
      smol:
        backend: ray
        placement: prefix          # the default; least_loaded keeps Ray Serve's own router
        max_imbalance: 16
        kv_cache: {block_size: 16}
        ray: {num_replicas: 2}

Ray Serve's request router API is alpha (``ray.serve.request_router``, Ray 2.60).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from serving.backends.placement import Placement

with warnings.catch_warnings():
    # Ray Serve's own pydantic models use V1-style Field options; not ours to fix.
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.serve.request_router import RequestRouter


_MASK64 = (1 << 64) - 1


def rank(key: int, replica_ids: Sequence[str]) -> list[str]:
    """*replica_ids* by rendezvous weight for *key*, highest first (the first is the key's replica)."""
    return sorted(replica_ids, key=lambda replica_id: (-_weight(key, replica_id), replica_id))


def _weight(key: int, replica_id: str) -> int:
    # A stable hash (not Python's per-process str hash): every router process must agree.
    digest = hashlib.blake2b((key & _MASK64).to_bytes(8, "little") + replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def choose(key: int | None, replica_ids: Sequence[str], loads: Mapping[str, int | None],
           max_imbalance: int) -> list[list[str]]:
    """Ranked groups of replica ids for a request of prefix *key*, as Ray Serve's ``choose_replicas`` returns
    them: Ray tries the first group, taking its least loaded replica that has room, then the next.

    *loads*: requests in flight per replica, None where unknown. No key (a prompt under one block), or a
    key whose replica is more than *max_imbalance* requests above the lightest known: one group of all
    replicas, so Ray Serve takes the least loaded. Otherwise the key's replica alone, then the rest."""
    if key is None or len(replica_ids) < 2:
        return [list(replica_ids)]
    ranked = rank(key, replica_ids)
    known = [load for load in (loads.get(replica_id) for replica_id in replica_ids) if load is not None]
    chosen_load = loads.get(ranked[0])
    if chosen_load is not None and known and chosen_load - min(known) > max_imbalance:
        return [list(replica_ids)]
    return [ranked[:1], ranked[1:]]


def request_key(args: Sequence[Any], kwargs: Mapping[str, Any], placement: Placement) -> int | None:
    """The prefix key of an ``EngineDeployment.generate(prompt_ids, sampling, cache_salt, hints)`` call."""
    prompt_ids = args[0] if args else kwargs.get("prompt_ids")
    cache_salt = args[2] if len(args) > 2 else kwargs.get("cache_salt", "")
    if not isinstance(prompt_ids, list | tuple):
        return None
    return placement.prefix_key(prompt_ids, cache_salt if isinstance(cache_salt, str) else "")


class PrefixRouter(RequestRouter):
    """Ray Serve request router of a model's engine deployment: a prompt prefix's replica first.

    Runs in each process that holds the deployment's handle; Ray Serve calls ``choose_replicas`` once per
    routing attempt. Loads are the requests in flight per replica as Ray Serve counts them (its queue
    length cache, probed where stale)."""

    def initialize_state(self, block_size: int = 16, prefix_blocks: int = 4, max_imbalance: int = 16) -> None:
        self._placement = Placement(1, "prefix", block_size, prefix_blocks)
        self._max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        key = None
        if pending_request is not None and pending_request.metadata.call_method == "generate":
            key = request_key(pending_request.args, pending_request.kwargs, self._placement)
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        groups = choose(key, list(by_id), await self._loads(candidate_replicas), self._max_imbalance)
        return [[by_id[replica_id] for replica_id in group] for group in groups if group]

    async def _loads(self, replicas: list[Any]) -> dict[str, int | None]:
        loads: dict[str, int | None] = {}
        stale = []
        for replica in replicas:
            load = self._replica_queue_len_cache.get(replica.replica_id)
            loads[replica.replica_id.unique_id] = load
            if load is None:
                stale.append(replica)
        if stale:
            for replica, load in await self._probe_queue_lens(stale, 0):
                loads[replica.replica_id.unique_id] = load
        return loads
