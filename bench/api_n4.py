"""``n=4`` in one request against 4 separate requests sent at the same time, through the engine.

    .venv/bin/python bench/api_n4.py [--quick]

Drives :class:`serving.engine.async_engine.AsyncEngine` in-process (the layer where ``n`` forks; the HTTP
app above it adds the same per-request cost to both sides) on the bundled SmolLM2-135M-Instruct, float32,
on the CPU. One prompt of about 440 tokens (a chat turn over a repeated passage), sampled at temperature 1,
``max_tokens`` 64 (32 with ``--quick``) with ``ignore_eos``:

  n4        one request with ``n=4``: the prompt is prefilled once, three forks share its full KV blocks.
  separate  four requests of ``n=1``, submitted together (the same step admits them all, so none hits the
            prefix cache: each prefills the whole prompt).

Both sides run twice: with the prefix cache off (the figures without a suffix: what the fork itself saves),
and on (``*_prefix_cache``). With it on, the separate requests also share most of the prompt when it is longer
than a step's token budget (512): the first one's prefill takes the whole step, the other three are admitted
after it and hit the blocks it cached, so the two sides come out close.

Each side runs ``rounds`` times (3; 2 with ``--quick``), alternating, each round under a fresh cache salt so
that no round reuses another's cached prompt; a side's figure is output tokens / wall seconds from submit to
the last token, best round. The last line is one JSON object: ``n4_vs_separate`` (n4 tok/s / separate tok/s;
the target is >= 1.5), both tok/s, the prompt's length, max_tokens and each side's prompt tokens computed by
the model, then the same figures with the prefix cache on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/ holds an http.py that would shadow the standard library's: the repository root instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from serving.engine.async_engine import AsyncEngine
from serving.engine.config import EngineConfig
from serving.engine.engine import count_work
from serving.engine.sampling_params import SamplingParams

MODEL = ROOT / "models" / "smollm2-135m-instruct"
PASSAGE = ("The river town kept its records in a stone house by the bridge: tolls, floods, marriages, the price "
           "of salt and the names of the boats that came up from the coast each spring. ")


def _prompt(tokenizer) -> list[int]:
    text = PASSAGE * 10 + "\nWrite a short story set in this town."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def _drain(stream) -> int:
    return len([event async for event in stream if event.token_id is not None])


async def _side(engine: AsyncEngine, prompt: list[int], max_tokens: int, n4: bool, salt: str) -> tuple[float, int]:
    """Output tokens per second of one round, and the prompt tokens it prefilled."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    prefilled = _PREFILLED[0]
    started = time.perf_counter()
    if n4:
        streams = [await engine.submit(prompt, SamplingParams(**{**_fields(sampling), "n": 4}), salt)]
    else:
        streams = [await engine.submit(prompt, sampling, salt) for _ in range(4)]
    num_tokens = sum(await asyncio.gather(*(_drain(s) for s in streams)))
    seconds = time.perf_counter() - started
    if num_tokens != 4 * max_tokens:
        raise RuntimeError(f"expected {4 * max_tokens} output tokens, got {num_tokens}")
    return num_tokens / seconds, _PREFILLED[0] - prefilled


_PREFILLED = [0]
"""Prompt tokens the model has computed so far (see :func:`_count_prefill`)."""


def _count_prefill(engine: AsyncEngine) -> None:
    """Count each step's prompt tokens (the engine's own split of a step: ``count_work``)."""
    runner = engine.engine.runner
    run = runner.run

    def counted(ordered):
        _PREFILLED[0] += count_work(ordered)[0]
        return run(ordered)

    runner.run = counted


def _fields(sampling: SamplingParams) -> dict:
    return {name: getattr(sampling, name) for name in sampling.__dataclass_fields__}


async def _measure(quick: bool) -> dict:
    figures = await _pair(quick, prefix_caching=False)
    cached = await _pair(quick, prefix_caching=True)
    return {**figures, **{f"{name}_prefix_cache": value for name, value in cached.items()
                          if name in ("n4_vs_separate", "n4_tok_s", "separate_tok_s", "separate_prefill_tokens")}}


async def _pair(quick: bool, prefix_caching: bool) -> dict:
    max_tokens, rounds = (32, 2) if quick else (64, 3)
    engine = AsyncEngine(EngineConfig(model=str(MODEL), device="cpu", dtype="float32",
                                      enable_prefix_caching=prefix_caching))
    await engine.start()
    try:
        _count_prefill(engine)
        prompt = _prompt(engine.tokenizer)
        await _side(engine, prompt[:64], 4, False, "warm-up")
        best = {"n4": (0.0, 0), "separate": (0.0, 0)}
        for round_ in range(rounds):
            for side in ("separate", "n4"):
                tok_s, prefill = await _side(engine, prompt, max_tokens, side == "n4", f"{side}-{round_}")
                if tok_s > best[side][0]:
                    best[side] = (tok_s, prefill)
    finally:
        await engine.shutdown()
    return {"n4_vs_separate": round(best["n4"][0] / best["separate"][0], 3),
            "n4_tok_s": round(best["n4"][0], 1), "separate_tok_s": round(best["separate"][0], 1),
            "n4_prefill_tokens": best["n4"][1], "separate_prefill_tokens": best["separate"][1],
            "prompt_tokens": len(prompt), "max_tokens": max_tokens, "rounds": rounds, "engine": "AsyncEngine, cpu"}


def measure(quick: bool = False) -> dict:
    """Run both sides and return the figures (see the module docstring)."""
    return asyncio.run(_measure(quick))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 2 rounds")
    print(json.dumps(measure(parser.parse_args().quick)))
