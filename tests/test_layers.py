"""The layers of DESIGN.md hold: import-linter's contracts (pyproject.toml) pass on the project, and
fail when a wrong import or a cycle is added to a copy of it."""

from __future__ import annotations

import os
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
