"""A workspace of small pipelines over fake engines, for the evaluator's fast tests."""

from __future__ import annotations

import pytest

from serving.runtime.workspace import Workspace, open_workspace
from tests.fakes import TEST_STAGES
from tests.serving.evals.workspaces import GRADER, QA, write_pipelines


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Workspace:
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_pipelines(tmp_path, qa=QA, grader=GRADER)
    workspace = open_workspace(str(config))
    for cls in TEST_STAGES:
        workspace.registry.register(cls)
    return workspace
