"""The OpenAI-compatible API against the library it wraps, in one run: one function per measurement.

    .venv/bin/python bench/api.py [--quick] [--repeats R]

embeddings  ``POST /v1/embeddings`` (the ``embed`` pipeline: policy, embed, audit) on a real ``inferline serve``
            process on a free loopback port, against sentence-transformers' own ``encode`` of the same
            all-MiniLM-L6-v2 in this process. The texts are sentences of the handbook (pipelines/data/handbook),
            in requests of 32 (``batch_size: 32`` on both sides), sent one at a time on one keep-alive
            connection, so that a request's serving time adds to its model time rather than hiding behind
            another's. One untimed warm-up request per side; then R (7) rounds, in each of which every side
            sends its N (10) requests in turn. Each side's time is, for each of the N batches, its fastest
            over the rounds, added up: this machine is shared and noisy, and the fastest of several tries
            is the one that ran undisturbed.

n4          ``n=4`` in one request against 4 separate requests sent together, through ``AsyncEngine``, with
            the prefix cache off and on (bench/api_n4.py, which also runs alone).

Figures (the last line of stdout is one JSON object with them all):
  embeddings_vs_st           server texts/s (``encoding_format: "float"``) / sentence-transformers texts/s
                             (target >= 0.9).
  embeddings_base64_vs_st    the same with ``encoding_format: "base64"`` (what the ``openai`` package asks for).
  embeddings_*_texts_per_s   each side's texts per second.
  embeddings_vectors_match   every vector the server sent (float and base64) is sentence-transformers' own
                             within 1e-5.
  embeddings_added_ms        per request, the server's time minus sentence-transformers' (each as above): what
                             serving adds (HTTP, JSON, runner, policy, audit, the thread hop).

  n4_vs_separate             n=4 tok/s / separate tok/s, prefix cache off (target >= 1.5): what the fork saves.
  n4_vs_separate_prefix_cache  the same with the prefix cache on (the default), where the separate requests
                             already share most of the prompt through it.

A new measurement is one more ``measure_*(args) -> dict`` function, merged in :func:`main`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds http.py, which would shadow the standard library's http package; the repository root
# must be importable (serving, store, bench.server_process).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import os

# Both sides' torch threads sleep while waiting, as the server's do (bench/server_process.py): spinning
# threads on a shared machine slow whichever side runs next to them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import base64
import json
import re
import tempfile
import time
from typing import Any

import httpx
import numpy as np

from bench.server_process import ROOT, ServerProcess
from stages.detectors import find_pii

BATCH = 32


def handbook_sentences(count: int) -> list[str]:
    """*count* sentences of the handbook, in order, repeated when it has fewer; those with personal data
    (an address, a phone number) are left out: the pipeline's policy would redact them, and the vectors
    of the two sides would differ."""
    text = " ".join(path.read_text() for path in sorted((ROOT / "pipelines/data/handbook").glob("*.md")))
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text)
                 if len(s.split()) >= 4 and not find_pii(s)]
    return [sentences[i % len(sentences)] for i in range(count)]


def measure_embeddings(args: argparse.Namespace) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from store.embeddings import model_folder

    texts = handbook_sentences(BATCH * args.requests)
    batches = [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)]
    model = SentenceTransformer(str(model_folder()), device="cpu", local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "pipelines").mkdir()
        (folder / "pipelines" / "embed.yaml").write_text((ROOT / "pipelines" / "embed.yaml").read_text())
        server = ServerProcess.start(folder / "server", auth=False, pipelines=folder / "pipelines",
                                     settings={"models": None, "indexes": None,
                                               "embedding_models": {"minilm": {"device": "cpu"}}})
        try:
            with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client:
                times, vectors = _rounds(model, client, batches, args.repeats)
        finally:
            exit_code = server.stop()
    match = all(np.allclose(a, b, atol=1e-5) for side in ("float", "base64")
                for a, b in zip(vectors[side], vectors["st"], strict=True))
    # Each batch's fastest time over the rounds, added up: the time each side takes undisturbed.
    best = {side: sum(min(each) for each in zip(*rounds, strict=True)) for side, rounds in times.items()}
    rate = {side: len(texts) / seconds for side, seconds in best.items()}
    return {
        "embeddings_vs_st": round(rate["float"] / rate["st"], 3),
        "embeddings_base64_vs_st": round(rate["base64"] / rate["st"], 3),
        "embeddings_st_texts_per_s": round(rate["st"], 1),
        "embeddings_float_texts_per_s": round(rate["float"], 1),
        "embeddings_base64_texts_per_s": round(rate["base64"], 1),
        "embeddings_vectors_match": match,
        "embeddings_added_ms": round((best["float"] - best["st"]) / len(batches) * 1e3, 2),
        "embeddings_requests": len(batches), "embeddings_batch": BATCH, "embeddings_rounds": args.repeats,
        "embeddings_server_exit_code": exit_code,
    }


def _rounds(model: Any, client: httpx.Client, batches: list[list[str]],
            repeats: int) -> tuple[dict[str, list[list[float]]], dict[str, list[np.ndarray]]]:
    """Each side's seconds per request, by round (``times[side][round][request]``), and the vectors of the
    last round. In each round every side sends all its requests in turn: the server's work after an answer
    (chaining the audit record) falls on its own next request, not on sentence-transformers'."""
    sides = {
        "st": lambda batch: model.encode(batch, batch_size=BATCH, normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False),
        "float": lambda batch: _served(client, batch, "float"),
        "base64": lambda batch: _served(client, batch, "base64"),
    }
    for call in sides.values():  # warm-up, untimed
        call(batches[0])
    times: dict[str, list[list[float]]] = {side: [] for side in sides}
    vectors: dict[str, list[np.ndarray]] = {side: [] for side in sides}
    for repeat in range(repeats):
        for side, call in sides.items():
            times[side].append([])
            for batch in batches:
                start = time.perf_counter()
                out = call(batch)
                times[side][-1].append(time.perf_counter() - start)
                if repeat == repeats - 1:
                    vectors[side].append(out)
    return times, vectors


def _served(client: httpx.Client, batch: list[str], encoding: str) -> np.ndarray:
    response = client.post("/v1/embeddings", json={"model": "embed", "input": batch, "encoding_format": encoding})
    response.raise_for_status()
    return _vectors(response.json())


def _vectors(body: dict[str, Any]) -> np.ndarray:
    rows = [d["embedding"] for d in body["data"]]
    if isinstance(rows[0], str):
        return np.stack([np.frombuffer(base64.b64decode(row), dtype="<f4") for row in rows])
    return np.array(rows, dtype=np.float32)


def measure_n4(args: argparse.Namespace) -> dict[str, Any]:
    """``n=4`` in one request against 4 separate ones, through the engine (bench/api_n4.py: figures and method)."""
    from bench import api_n4

    return api_n4.measure(args.quick)


MEASUREMENTS = (measure_embeddings, measure_n4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="requests per round (default 10; 4 --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per side (default 7; 2 --quick)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (4 if args.quick else 10)
    args.repeats = args.repeats or (2 if args.quick else 7)
    results: dict[str, Any] = {"quick": args.quick}
    for measure in MEASUREMENTS:
        results |= measure(args)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
