"""The layers of docs/design.md hold: import-linter's contracts (pyproject.toml) pass on the project, and
fail when a wrong import or a cycle is added to a copy of it."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("pipeline", "stages", "serving", "store")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT_IMPORTS, "--no-cache", str(root / "pyproject.toml")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def project_copy(tmp_path: Path) -> Path:
    """The product code and its contracts, without the tests, models and data."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(module: Path, statement: str) -> None:
    """*statement* inside a function at the end of *module*: lazy imports count too."""
    module.write_text(module.read_text() + f"\n\ndef _wrong():\n    {statement}\n")


def test_the_project_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_import_up_the_layers_breaks_a_contract(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "serving" / "backends" / "weights.py", "from serving.http import app")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "serving's subpackages, each above the next BROKEN" in result.stdout
    assert "serving.backends.weights -> serving.http.app" in result.stdout


def test_store_importing_the_pipeline_breaks_its_contract(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "store" / "db.py", "import pipeline.errors")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "store imports nothing of ours BROKEN" in result.stdout


def test_a_cycle_inside_one_layer_breaks_the_acyclic_contract(tmp_path):
    root = project_copy(tmp_path)
    # placement is imported by local_engine; importing it back closes a circle within backends/.
    add_import(root / "serving" / "backends" / "placement.py", "from serving.backends import local_engine")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "no import cycle: siblings of every package import one another one way BROKEN" in result.stdout
    assert ".placement -> .local_engine" in result.stdout


def test_the_server_files_models_sit_below_the_backends(tmp_path):
    root = project_copy(tmp_path)
    # The backends are built from serving.config's models: config reaching back up closes the loop.
    add_import(root / "serving" / "config" / "models.py", "from serving.backends import model_pool")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "serving's subpackages, each above the next BROKEN" in result.stdout
    assert "serving.config.models -> serving.backends.model_pool" in result.stdout


def test_the_server_files_models_import_nothing_of_serving_below_them(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "serving" / "config" / "server.py", "from serving.engine import config")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "the server file's models import only the pipeline core BROKEN" in result.stdout


def test_the_core_names_no_server_setting():
    """pipeline/ and stages/ see the server file only as a Catalog of names: no model of serving/config."""
    settings = set()
    for path in (ROOT / "serving" / "config").glob("*.py"):
        settings |= {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    assert {"ServerSpec", "ModelSpec", "AuditSpec"} <= settings  # the scan finds them
    found = [f"{path.relative_to(ROOT)}: {name}" for package in ("pipeline", "stages")
             for path in sorted((ROOT / package).rglob("*.py")) for name in sorted(settings)
             if re.search(rf"\b{name}\b", path.read_text())]
    assert found == []


def test_serving_reaching_inside_the_audit_package_breaks_the_facade_contract(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "serving" / "backends" / "anchor_delivery.py", "from store.audit.anchors import Anchors")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "the audit log is reached through its facade, store.audit BROKEN" in result.stdout
    assert "serving.backends.anchor_delivery -> store.audit.anchors" in result.stdout


def test_a_new_module_of_the_audit_package_is_behind_the_facade_too(tmp_path):
    # The contract names store.audit's children by wildcard: a module added later needs no new line.
    root = project_copy(tmp_path)
    (root / "store" / "audit" / "newroom.py").write_text('"""A module the contract has never heard of."""\n')
    add_import(root / "serving" / "cli" / "audit.py", "import store.audit.newroom")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "the audit log is reached through its facade, store.audit BROKEN" in result.stdout
    assert "serving.cli.audit -> store.audit.newroom" in result.stdout


def test_making_an_engine_outside_the_runtime_breaks_the_engine_creation_contract(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "serving" / "cli" / "keys.py", "from store.engine import make_engine")
    add_import(root / "serving" / "http" / "audit_routes.py", "from store.migrate import create_schema")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "only serving.runtime.database creates database engines and migrates the schema BROKEN" in result.stdout
    assert "serving.cli.keys -> store.engine" in result.stdout
    assert "serving.http.audit_routes -> store.migrate" in result.stdout


def test_capacity_importing_the_http_app_breaks_its_contract(tmp_path):
    root = project_copy(tmp_path)
    add_import(root / "serving" / "capacity" / "planner.py", "from serving.http import problems")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "capacity sits beside the HTTP app, never above it BROKEN" in result.stdout
    assert "serving.capacity.planner -> serving.http.problems" in result.stdout
    # The layers alone allow it: capacity is above http there.
    assert "serving's subpackages, each above the next KEPT" in result.stdout
