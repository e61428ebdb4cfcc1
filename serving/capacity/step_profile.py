"""``inferline profile MODEL``: what one engine step costs, measured on this machine.

Three measurements, on the engine exactly as ``inferline serve`` configures it (dtype, threads,
KV cache, speculative decoding), one step at a time:

* **prefill**: one new prompt of n tokens (n up to the step's token budget), nothing else in the
  batch: the step's time for each n (and a fit ``base_ms + per_token_ms * n``, for reading);
* **decode**: b sequences all decoding (b = 1, 2, 4, ...): the mean step time and the tokens each
  sequence gains per step (more than one where speculative decoding's guesses are accepted);
* **mixed**: 1 and 4 sequences decoding while a new prompt of 32 or 128 tokens is prefilled in the same
  step: what a prompt chunk costs beside decodes, which is not simply its cost alone.

A step's time jumps where its rows (prompt tokens plus decodes) pass the engine's small-batch kernel
limit (``small_rows``: on the CPU, start-up measures up to where our kernel beats oneDNN, and stops
measuring at 128 rows): given that limit, prefill and mixed steps are also measured just below and just
above it, and the step model keeps the two sides apart (:class:`StepModel`).

The profile (JSON) is what ``inferline plan`` builds its step-time model from (:class:`StepModel`):
a step that decodes b sequences and prefills n prompt tokens takes ``decode_ms(b) + mixed_extra_ms(n, b)``
(``prefill_ms(n)`` with no decodes), each interpolated between the measured sizes.
Prompts are chat requests of synthetic text (:func:`synthetic_prompt_maker`), as ``inferline load`` sends them.
"""

from __future__ import annotations

import bisect
import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from serving.runtime.workspace import Workspace

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
PREFILL_SIZES = (16, 64, 128, 256, 512)
#: Mixed steps: this many sequences decoding while a new prompt of each of MIXED_SIZES tokens is prefilled.
MIXED_BATCHES = (1, 4)
MIXED_SIZES = (32, 128)


class SteppingEngine(Protocol):
    """What the profile needs of an engine: serving.engine.engine.LLMEngine has it."""

    config: Any
    has_unfinished: bool

    def add_request(self, prompt_ids: Sequence[int], sampling: Any, cache_salt: str = "") -> Any: ...

    def step(self) -> list[Any]: ...


def profile_engine(engine: SteppingEngine, make_prompt: Callable[[int, int], list[int]],
                   sampling: Callable[..., Any], *, batch_sizes: Sequence[int] = BATCH_SIZES,
                   prefill_sizes: Sequence[int] = PREFILL_SIZES, repeats: int = 3, context_tokens: int = 64,
                   decode_steps: int = 24, passes: int = 2, mixed_batches: Sequence[int] = MIXED_BATCHES,
                   mixed_sizes: Sequence[int] = MIXED_SIZES, small_rows: int | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Measure *engine*; *make_prompt(n, seed)* gives n prompt token ids, *sampling(**kw)* sampling params.

    Every size is measured in each of *passes* sweeps and the samples of all sweeps pooled, so that a
    burst of other work on a shared machine lands on a part of each size's samples, not on all of one
    size's; step times are then made non-decreasing in the batch size (more work is never faster: a
    dip is noise).

    Each figure is the **mean** of its samples, not the median: the plan adds step times up (a request's
    inter-token latency and end-to-end time are sums of steps) and divides its tokens by the mean tokens
    per step, and a sum is the count times the mean. Step times are skewed to the right (a step that
    verifies speculative guesses is longer, and it is the one that gains them; a machine shared with
    other work has slow steps, which a server meets too), so their median tends to fall below their
    mean, and near an objective's edge a few percent of step time move the predicted attainment by tens
    of points (docs/capacity.md).

    *small_rows*, the engine's small-batch kernel limit, adds sizes on both sides of it
    (:func:`sizes_around_limit`); ``inferline profile`` records it as ``engine.small_rows``.
    """
    budget = engine.config.max_num_batched_tokens
    salt = iter(range(1 << 30))
    prefill_sizes, mixed_sizes = sizes_around_limit(prefill_sizes, mixed_sizes, mixed_batches, small_rows)
    sizes = [n for n in prefill_sizes if n <= budget]
    batches = [b for b in batch_sizes if b <= min(engine.config.max_num_seqs, budget)]
    prefill_ms: dict[int, list[float]] = {n: [] for n in sizes}
    decode_ms: dict[int, list[float]] = {b: [] for b in batches}
    decode_tokens: dict[int, list[float]] = {b: [] for b in batches}
    mixed_ms: dict[tuple[int, int], list[float]] = {(b, n): [] for b in mixed_batches for n in mixed_sizes
                                                    if b <= min(engine.config.max_num_seqs - 1, budget - n)}
    for sweep in range(passes):
        for n in sizes:
            for r in range(repeats + (sweep == 0)):  # the very first run of a size warms it up: not kept
                engine.add_request(make_prompt(n, 1000 * n + 100 * sweep + r), sampling(max_tokens=1, temperature=0.0),
                                   cache_salt=f"profile-{next(salt)}")
                started = clock()
                while engine.has_unfinished:
                    engine.step()
                if sweep or r:
                    prefill_ms[n].append((clock() - started) * 1e3)
        for b in batches:
            times, tokens = _decode(engine, b, make_prompt, sampling, context_tokens, decode_steps, salt, clock,
                                    seed=7919 * b + 104729 * sweep)
            decode_ms[b] += times
            decode_tokens[b] += tokens
        for b, n in mixed_ms:
            mixed_ms[b, n] += _mixed(engine, b, n, make_prompt, sampling, context_tokens, repeats, salt, clock,
                                     seed=15485863 * (sweep + 1) + 31 * b + n)
    prefill = [[n, round(statistics.fmean(prefill_ms[n]), 3)] for n in sizes]
    base_ms, per_token_ms = _fit([p[0] for p in prefill], [p[1] for p in prefill])
    steps = _non_decreasing([statistics.fmean(decode_ms[b]) for b in batches])
    decode = [{"batch": b, "step_ms": round(ms, 3), "tokens_per_step": round(statistics.fmean(decode_tokens[b]), 3)}
              for b, ms in zip(batches, steps, strict=True)]
    return {"prefill": {"points": prefill, "base_ms": round(base_ms, 4), "per_token_ms": round(per_token_ms, 5)},
            "decode": decode,
            "mixed": [{"batch": b, "prefill_tokens": n, "step_ms": round(statistics.fmean(times), 3)}
                      for (b, n), times in mixed_ms.items() if times],
            "context_tokens": context_tokens, "passes": passes,
            "measured_at": datetime.now(UTC).isoformat()}


def sizes_around_limit(prefill_sizes: Sequence[int], mixed_sizes: Sequence[int], mixed_batches: Sequence[int],
                       small_rows: int | None) -> tuple[list[int], list[int]]:
    """The prefill and mixed prompt sizes, with the sizes on both sides of a small-batch limit added.

    A step of r rows runs on the small-batch kernel while r <= *small_rows*, on oneDNN above; where
    start-up's scan stopped at its last row count while our kernel was still ahead, the step past it
    costs markedly more (docs/capacity.md, run 27). A prefill alone of
    ``small_rows`` and ``small_rows + 1`` tokens; beside b decodes, ``small_rows - max(b)`` tokens (every
    batch measured stays on the kernel) and ``small_rows`` (every batch is past it).
    """
    prefill, mixed = sorted(set(prefill_sizes)), sorted(set(mixed_sizes))
    if small_rows and small_rows > 0:
        prefill = sorted({*prefill, small_rows, small_rows + 1})
        below = small_rows - max(mixed_batches, default=0)
        mixed = sorted({*mixed, *([below] if below > 0 else []), small_rows})
    return prefill, mixed


def _decode(engine: SteppingEngine, batch: int, make_prompt: Callable[[int, int], list[int]],
            sampling: Callable[..., Any], context_tokens: int, steps: int, salt: Any,
            clock: Callable[[], float], seed: int) -> tuple[list[float], list[float]]:
    """Step times (ms) and tokens per sequence of *steps* steps in which *batch* sequences all decode."""
    params = sampling(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(make_prompt(context_tokens, seed + i), params, cache_salt=f"profile-{next(salt)}")
            for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):  # every prompt prefilled: from here on, decodes only
        engine.step()
    times, tokens = [], []
    while engine.has_unfinished and len(times) < steps and not any(s.is_finished for s in seqs):
        started = clock()
        produced = len(engine.step())
        times.append((clock() - started) * 1e3)
        tokens.append(produced / batch)
    while engine.has_unfinished:
        engine.step()
    return times, tokens


def _mixed(engine: SteppingEngine, batch: int, prefill: int, make_prompt: Callable[[int, int], list[int]],
           sampling: Callable[..., Any], context_tokens: int, repeats: int, salt: Any, clock: Callable[[], float],
           seed: int) -> list[float]:
    """Times (ms) of steps in which *batch* sequences decode while a new prompt of *prefill* tokens is prefilled."""
    params = sampling(max_tokens=4 * (repeats + 2), temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(make_prompt(context_tokens, seed + i), params, cache_salt=f"profile-{next(salt)}")
            for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    times = []
    for r in range(repeats):
        engine.add_request(make_prompt(prefill, seed + 1000 + r), sampling(max_tokens=1, temperature=0.0),
                           cache_salt=f"profile-{next(salt)}")
        started = clock()
        engine.step()  # the running decodes first, then the new prompt in what is left of the budget
        times.append((clock() - started) * 1e3)
        engine.step()  # a plain decode step between two mixed ones
    while engine.has_unfinished:
        engine.step()
    return times


def _non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [mean for mean, count in blocks for _ in range(int(count))]


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with a, b >= 0 (a step cannot take negative time; a noisy machine can
    make an unconstrained fit say so): through the origin when the free intercept comes out negative."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if my - slope * mx < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if slope < 0:
        return my, 0.0
    return my - slope * mx, slope


class StepModel:
    """Step times from a profile: ``step_ms(prefill_tokens, num_decodes)``, and decode tokens per step.

    A prefill of n tokens alone takes ``prefill_ms(n)``: piecewise linear through the measured points
    (attention makes long prompts dearer per token than short ones), or ``base_ms + per_token_ms * n``
    when the profile has no points. Beside b decodes, a prefill of n tokens adds ``mixed_extra_ms(n, b)``:
    what the profile's mixed steps measured beyond a plain decode step of the same batch (averaged over
    the batches measured, linear in n through those sizes); without mixed measurements, its time less a
    step's fixed cost ``base_ms``, which the decodes' step already pays. Where the profile records the
    engine's small-batch limit (``engine.small_rows``), a step's extra comes from the mixed points on its
    own side of the limit (n + b rows at most ``small_rows``, or more), the other side's only where its
    own has none: across the limit the matmuls change kernels and the time jumps.
    """

    def __init__(self, profile: dict[str, Any]):
        prefill, decode = profile["prefill"], sorted(profile["decode"], key=lambda d: d["batch"])
        if not decode:
            raise ValueError("the profile has no decode measurements")
        self.per_token_ms = float(prefill["per_token_ms"])
        points = sorted((int(n), float(ms)) for n, ms in prefill.get("points") or ())
        self._prefill_n = [n for n, _ in points]
        self._prefill_ms = [ms for _, ms in points]
        if len(points) >= 2:  # the first segment's line at n = 0
            (n0, t0), (n1, t1) = points[0], points[1]
            self.base_ms = max(0.0, t0 - (t1 - t0) / (n1 - n0) * n0)
        else:
            self.base_ms = float(prefill["base_ms"])
        self._batches = [int(d["batch"]) for d in decode]
        self._step_ms = [float(d["step_ms"]) for d in decode]
        self._tokens = [float(d["tokens_per_step"]) for d in decode]
        limit = (profile.get("engine") or {}).get("small_rows")
        self.small_rows: int | None = int(limit) if isinstance(limit, int) and limit > 0 else None
        # Mixed points by side of the small-batch limit (True: on the small-batch kernel; one side only
        # without a limit), each side's extras averaged over the batches measured at a size.
        extra: dict[bool, dict[int, list[float]]] = {}
        for m in profile.get("mixed") or ():
            n, b = int(m["prefill_tokens"]), int(m["batch"])
            extra.setdefault(self._small(n + b), {}).setdefault(n, []).append(float(m["step_ms"]) - self.decode_ms(b))
        self._mixed = {side: (sorted(points), [max(0.0, statistics.fmean(points[n])) for n in sorted(points)])
                       for side, points in extra.items()}

    def _small(self, rows: int) -> bool:
        return self.small_rows is None or rows <= self.small_rows

    def mixed_extra_ms(self, tokens: int, decodes: int = 1) -> float:
        """What prefilling *tokens* adds to a step that also decodes *decodes* sequences."""
        side = self._small(tokens + decodes)
        ns, ms = self._mixed.get(side) or self._mixed.get(not side) or ([], [])
        if len(ns) >= 2:
            return max(0.0, _interpolate(ns, ms, tokens))
        if len(ns) == 1:
            return ms[0] * tokens / ns[0]
        return max(0.0, self.prefill_ms(tokens) - self.base_ms)

    def prefill_ms(self, tokens: int) -> float:
        if len(self._prefill_n) < 2:
            return self.base_ms + self.per_token_ms * tokens
        return max(self.base_ms, _interpolate(self._prefill_n, self._prefill_ms, tokens))

    def decode_ms(self, batch: int) -> float:
        return _interpolate(self._batches, self._step_ms, batch)

    def tokens_per_step(self, batch: int) -> float:
        """Tokens one decoding sequence gains per step at this batch size (>= 1)."""
        return max(1.0, _interpolate(self._batches, self._tokens, batch, extrapolate=False))

    def step_ms(self, prefill_tokens: int, num_decodes: int) -> float:
        if num_decodes == 0:
            return self.prefill_ms(prefill_tokens) if prefill_tokens else 0.0
        extra = self.mixed_extra_ms(prefill_tokens, num_decodes) if prefill_tokens else 0.0
        return self.decode_ms(num_decodes) + extra


def _interpolate(xs: list[int], ys: list[float], x: float, *, extrapolate: bool = True) -> float:
    """Piecewise linear through the points; beyond them the end segment's line (or the end value)."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if extrapolate and x > xs[0] else 1.0)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0 or i == len(xs):
        if not extrapolate:
            return ys[0] if i == 0 else ys[-1]
        i = 1 if i == 0 else len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def synthetic_prompt_maker(tokenizer: Any, vocab_size: int,
                           system: str = "You are a helpful AI assistant.") -> Callable[[int, int], list[int]]:
    """*n* token ids of a chat request as ``inferline load`` sends one: synthetic user text (random common
    words) in the model's chat template after a short system prompt, seeded. The template matters for
    decode steps: what the model answers to it decides how often speculative decoding's guesses hold."""
    from serving.capacity.loadgen import synthetic_text

    def chat(text: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    overhead = len(chat(""))

    def make(n: int, seed: int) -> list[int]:
        text = synthetic_text(tokenizer, max(1, n - overhead), random.Random(seed))
        ids = chat(text)
        if len(ids) > n:  # a prompt shorter than the template: the plain text, cut to n
            ids = tokenizer.encode(synthetic_text(tokenizer, n, random.Random(seed)), add_special_tokens=False)
        return [i % vocab_size for i in ids[:n]]

    return make


def small_rows_of(model: Any) -> dict[str, int]:
    """Up to how many rows the model's linear layers (``small_rows``) and LM head (``head_small_rows``) run
    on the small-batch kernel, as its start-up measured on this machine (none off the CPU float32 path).
    A step's time jumps where its rows cross it, and two processes can measure it apart near the
    crossover: a profile is the plan of an engine that chose as this one did."""
    out = {}
    for key, attr in (("small_rows", "linear"), ("head_small_rows", "head_linear")):
        rows = getattr(getattr(model, attr, None), "small_rows", None)
        if isinstance(rows, int):
            out[key] = rows
    return out


def profile_model(workspace: Workspace, model: str, *, batch_sizes: Sequence[int], prefill_sizes: Sequence[int],
                  repeats: int, decode_steps: int, passes: int) -> dict[str, Any]:
    """The step profile of local model *model* of *workspace*'s config, as ``inferline profile`` writes it."""
    import os

    import torch

    from serving.backends.engine_config import engine_config
    from serving.engine.engine import LLMEngine
    from serving.engine.sampling_params import SamplingParams

    spec = workspace.server.models[model]
    config = engine_config(spec, workspace.root)
    engine = LLMEngine(config, name=model)
    limits = small_rows_of(engine.model)
    measured = profile_engine(engine, synthetic_prompt_maker(engine.tokenizer, engine.model.shape.vocab_size),
                              SamplingParams, batch_sizes=list(batch_sizes), prefill_sizes=list(prefill_sizes),
                              repeats=repeats, decode_steps=decode_steps, passes=passes,
                              small_rows=limits.get("small_rows"))
    return {"model": model, "source": spec.source, "device": config.device, "dtype": config.dtype,
            "num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "engine": {"max_num_batched_tokens": config.max_num_batched_tokens,
                       "max_num_seqs": config.max_num_seqs, "block_size": config.block_size,
                       "prefix_cache": config.enable_prefix_caching, "speculative": config.speculative,
                       "speculative_max_batch": config.speculative_max_batch,
                       **limits},
            **measured}
