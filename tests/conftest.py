"""Shared fixtures: a registry with the built-ins plus small test stages."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator

# Before anything imports torch: see serving/engine/__init__.py for why.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engine's start-up measurements (serving/engine/calibration.py): measured afresh by this session's first
# engine, then read back by every later one, servers and CLI subprocesses included (they inherit it), never from
# a file another session left behind.
if "INFERLINE_CALIBRATION_CACHE" not in os.environ:  # set here, inherited by the xdist workers
    _calibration_dir = tempfile.mkdtemp(prefix="inferline-tests-")
    os.environ["INFERLINE_CALIBRATION_CACHE"] = os.path.join(_calibration_dir, "calibration.json")
    atexit.register(shutil.rmtree, _calibration_dir, True)

import pytest

from pipeline.protocols import Catalog, ModelInfo
from pipeline.registry import StageRegistry
from stages import register_builtins
from tests.fakes import TEST_STAGES


@pytest.fixture
def registry() -> StageRegistry:
    registry = register_builtins(StageRegistry())
    for cls in TEST_STAGES:
        registry.register(cls)
    return registry


@pytest.fixture
def catalog() -> Catalog:
    return Catalog(models={"smol": ModelInfo("smol"), "big": ModelInfo("big")},
                   indexes=frozenset({"handbook"}))


@pytest.fixture
def fresh_minute() -> None:
    """Wait, if needed, until at least 20 s of the current minute are left: rate-limit tests count
    within one fixed one-minute window and must not straddle two."""
    left = 60 - time.time() % 60
    if left < 20:
        time.sleep(left + 0.05)


@pytest.fixture
def redis_url() -> str:
    """The test Redis (db 15 of 127.0.0.1:6379, or $TEST_REDIS_URL); its absence fails loudly."""
    import redis

    url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {url} is unreachable ({exc}); start it, or deselect with -m 'not integration'.",
                    pytrace=False)
    finally:
        client.close()
    return url


@pytest.fixture
def redis_prefix(redis_url) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    import redis

    prefix = f"inferline-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
