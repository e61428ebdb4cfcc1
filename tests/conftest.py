"""Shared fixtures: a registry with the built-ins plus small test stages."""

from __future__ import annotations

import os
import time

# Before anything imports torch: see serving/engine/__init__.py for why.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
