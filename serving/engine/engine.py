"""The engine: a step loop over scheduler, model runner and sampler.

``LLMEngine`` is synchronous and single-threaded: ``add_request``, ``abort``
and ``step``, plus ``generate`` for offline batches. One step reads top-down:
schedule → run → sample → postprocess → collect finished.

A request for ``n`` sequences (``SamplingParams.n``) is prefilled once: its first sequence is queued,
and the other ``n - 1`` are forked from it when its prompt is computed, sharing its full prompt
blocks (scheduler.py). Each has its own ``seq_id`` and ``index`` and samples on its own; with a seed,
sequence ``i`` samples under a seed derived from it (``SamplingParams.for_choice``).
``AsyncEngine`` (in ``async_engine.py``) drives it from a background thread
for the server.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch
from prometheus_client import CollectorRegistry

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.constraints import Constraint, ConstraintCompiler, ConstraintError, Grammar
from serving.engine.errors import EngineError, InvalidRequest
from serving.engine.metrics import EngineMetrics
from serving.engine.model_runner import ModelRunner, kv_bytes_per_block
from serving.engine.models import LoadedModel, load_model
from serving.engine.sampler import Sampler, TokenLogprobs
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.speculative import DraftModel, PromptLookup, accept, check_draft, propose_counts, verify_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One new token of one request, and whether the request is done."""

    seq_id: int
    token_id: int | None
    """None when the request ends without a new token (it outgrew the KV cache)."""
    finish_reason: str | None
    logprobs: TokenLogprobs | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    index: int = 0
    """Which of its request's ``n`` sequences."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request, as ``generate`` returns it."""

    seq_id: int
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    ttft_s: float
    e2e_s: float


class LLMEngine:
    """Continuous batching over a paged KV cache for one model."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 name: str | None = None, metrics_registry: CollectorRegistry | None = None,
                 draft: LoadedModel | None = None):
        """Load ``config.model`` (or use *loaded*, already in memory) and size the KV pool.

        *name* labels the metrics (default: the model folder's name); *metrics_registry*
        is where they register (default: a private one). *draft*: the draft model for
        ``speculative="draft"``, already loaded (default: loaded from ``config.draft_model``).
        """
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.config
        self.max_model_len = min(config.max_model_len or self.model.shape.max_position,
                                 self.model.shape.max_position)
        # The scheduler ends sequences at the model's real limit, not only a configured one.
        self.config = config = replace(config, max_model_len=self.max_model_len)
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // kv_bytes_per_block(
            self.model, config.block_size))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.eos_token_ids)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        # Logits rows: one per running sequence, or 1 + k for each of at most speculative_max_batch.
        guessing = (1 + config.num_speculative_tokens) * config.speculative_max_batch if config.speculative else 0
        self.model.prepare(config.max_num_batched_tokens, max(config.max_num_seqs, guessing))
        self.sampler = Sampler()
        self.proposer = _proposer(config, self.model, self.tokenizer, num_blocks, draft)
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.metrics = EngineMetrics(name or _model_name(config.model), metrics_registry)
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        logger.info("engine ready: %d KV blocks of %d tokens; attention: %s", num_blocks, config.block_size,
                    "C++ paged kernel" if self.runner.use_kernel else "torch (gather + SDPA)")

    # -- requests -----------------------------------------------------------

    def add_request(self, prompt_ids: Seq[int], sampling: SamplingParams, cache_salt: str = "", *,
                    priority: int = 0, tenant: str = "", deadline_s: float | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequest or EngineOverloaded.

        *priority* is its class (0 interactive, 1 batch: lower first), *tenant* whose turn it takes,
        *deadline_s* the ``time.perf_counter()`` by which it must be admitted (else it finishes as
        ``deadline``); see wait_queue.py.
        """
        seq = self.make_sequence(prompt_ids, sampling, cache_salt, priority=priority, tenant=tenant,
                                 deadline_s=deadline_s)
        self.enqueue(seq)
        return seq

    def make_sequence(self, prompt_ids: Seq[int], sampling: SamplingParams, cache_salt: str = "", *,
                      priority: int = 0, tenant: str = "", deadline_s: float | None = None) -> Sequence:
        """A validated, not yet queued sequence (the async front validates on the caller's side).

        With ``sampling.n`` above 1 it is the request's first sequence, and its ``forks`` hold the others
        (indexes 1 to n - 1), each with ``for_choice`` parameters.
        """
        self.validate(prompt_ids, sampling)
        seqs = [Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), sampling.for_choice(index),
                         self.eos_token_ids, cache_salt, priority=priority, tenant=tenant, deadline_s=deadline_s,
                         index=index)
                for index in range(sampling.n)]
        if sampling.output is not None:
            grammar = self.compile_output(sampling.output)
            for seq in seqs:
                seq.matcher = grammar.start()
        seqs[0].forks = seqs[1:]
        return seqs[0]

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence from :meth:`make_sequence` (its forks come later); raises EngineOverloaded."""
        self.scheduler.add(seq)
        for each in (seq, *seq.forks):
            self._seqs[each.seq_id] = each

    def compile_output(self, output) -> Grammar:
        """The compiled constraint of a request's ``output`` (cached by content); raises InvalidRequest.

        The compiler (a table over the vocabulary, about half a second) is built on first use.
        """
        (kind, value), = output.items()
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler(self.tokenizer, self.model.shape.vocab_size,
                                                    eos_token_id=self.tokenizer.eos_token_id)
        try:
            return self._compiler.compile(Constraint(kind, value))
        except ConstraintError as exc:
            raise InvalidRequest(f"output: {exc}") from None

    def validate(self, prompt_ids: Seq[int], sampling: SamplingParams) -> None:
        vocab = self.model.shape.vocab_size
        sampling.validate(vocab)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model takes at most "
                                 f"{self.max_model_len - 1} plus at least one generated token")
        if not self.block_manager.fits_pool(len(prompt_ids) + 1):
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens, more than the KV cache "
                                 f"({self.block_manager.num_blocks} blocks of {self.config.block_size}) holds")

    def abort(self, seq_id: int) -> None:
        """End a sequence and free its blocks; a request's first sequence takes its forks not queued yet
        with it (abort every ``seq_id`` of a request to end it all)."""
        seq = self.scheduler.abort(seq_id)
        if seq is None:
            seq = self._seqs.get(seq_id)
            if seq is not None and not seq.is_finished:  # a fork not queued yet: it never starts
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self._release(seq)
            return
        for each in (seq, *seq.forks):
            self._release(each)
        self._update_gauges()  # no step may follow: the gauges must not keep the aborted request

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one batched forward; return the tokens it produced."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs = self._retire(plan)
        if not plan.scheduled:
            return outputs
        ordered = self.runner.order(plan.scheduled)
        num_prompt_tokens, num_decodes = count_work(ordered)  # before the step moves them on
        logits = self.runner.run(ordered)
        outputs += self._postprocess(plan, ordered, logits)
        self.metrics.observe_step(time.perf_counter() - started, num_prompt_tokens, num_decodes)
        return outputs

    def _retire(self, plan: SchedulerOutput) -> list[StepOutput]:
        """The last outputs of what the scheduler ended without running (aborted, past their deadline)."""
        if plan.preempted:
            self.metrics.add_preemptions(len(plan.preempted))
        ended = [self._ended(seq) for seq in plan.finished]
        if ended and not plan.scheduled:
            self._update_gauges()
        return ended

    def _postprocess(self, plan: SchedulerOutput, ordered: list[ScheduledSeq],
                     logits: torch.Tensor) -> list[StepOutput]:
        """Sample, accept what speculation guessed right, advance the sequences, collect their new tokens."""
        sampling_items = [item for item in ordered if item.samples]
        sampled = self.sampler(logits, verify_rows(sampling_items))
        accepted = accept(sampling_items, sampled.token_ids, sampled.logprobs)
        for num_guesses, num_accepted in accepted.speculation:
            self.metrics.add_speculation(num_guesses, num_accepted)
        lengths = {item.seq.seq_id: item.seq.num_tokens for item in sampling_items}
        self.scheduler.update(plan, accepted.token_ids)
        outputs = self._collect([item.seq for item in sampling_items], lengths, accepted.logprobs)
        if self.proposer is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Guess the next tokens of the running decodes, unless the batch is too large for it to pay."""
        decoding = [seq for seq in self.scheduler.running
                    if seq.num_uncomputed_tokens == 1 and seq.sampling.speculative and seq.matcher is None]
        if not decoding or len(self.scheduler.running) > self.config.speculative_max_batch:
            return
        counts = propose_counts(decoding, self.config.num_speculative_tokens, self.max_model_len)
        for seq, guesses in zip(decoding, self.proposer.propose(decoding, counts), strict=True):
            seq.guesses = guesses

    def _ended(self, seq: Sequence) -> StepOutput:
        """The last output of a sequence the scheduler finished without running it."""
        self._release(seq)
        if seq.finish_reason == "deadline":
            self.metrics.add_deadline_drops(1)
        return StepOutput(seq.seq_id, None, seq.finish_reason, None, seq.num_prompt_tokens,
                          seq.num_cached_tokens, seq.num_output_tokens, seq.index)

    def _collect(self, seqs: list[Sequence], lengths: dict[int, int],
                 logprobs: dict[int, list[TokenLogprobs | None]]) -> list[StepOutput]:
        """One output per new token (a verified decode may add several), the last one with the finish reason."""
        now = time.perf_counter()
        outputs, itls = [], []
        for seq in seqs:
            new_tokens = seq.token_ids[lengths[seq.seq_id]:]
            if seq.first_token_s is None:
                seq.first_token_s = now
                self.metrics.observe_first_token(now - seq.arrival_s, (seq.first_scheduled_s or now) - seq.arrival_s)
                itls += [0.0] * (len(new_tokens) - 1)
            else:  # tokens that arrive together share the wait
                itls += [(now - (seq.last_token_s or now)) / len(new_tokens)] * len(new_tokens)
            seq.last_token_s = now
            base = seq.num_output_tokens - len(new_tokens)
            # Sampled tokens have logprobs; tokens a constraint forced after them have none.
            token_logprobs = logprobs[seq.seq_id] + [None] * (len(new_tokens) - len(logprobs[seq.seq_id]))
            for index, (token_id, lp) in enumerate(zip(new_tokens, token_logprobs, strict=False)):
                last = index == len(new_tokens) - 1
                outputs.append(StepOutput(seq.seq_id, token_id, seq.finish_reason if last else None, lp,
                                          seq.num_prompt_tokens, seq.num_cached_tokens, base + index + 1,
                                          seq.index))
            if seq.is_finished:
                self.metrics.observe_finished(now - seq.arrival_s)
                # A request's prompt counts once, with its first sequence, however many were forked from it.
                self.metrics.add_tokens(seq.num_prompt_tokens if seq.index == 0 else 0, seq.num_output_tokens)
                self._release(seq)
        self.metrics.observe_tokens(itls)
        self._update_gauges()
        return outputs

    def _release(self, seq: Sequence) -> None:
        self.sampler.release(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)

    def _update_gauges(self) -> None:
        bm = self.block_manager
        self.metrics.set_gauges(self.scheduler.num_running, self.scheduler.num_waiting, bm.usage)
        self.metrics.set_prefix_totals(bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens)

    # -- offline use ---------------------------------------------------------

    def generate(self, prompts: Seq[Seq[int]], params: Seq[SamplingParams] | SamplingParams,
                 cache_salt: str = "") -> list[RequestOutput]:
        """Run every prompt to completion, all submitted at once; one output per sequence, in prompt order
        (a prompt sampled ``n`` times: its ``n`` outputs, in index order)."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        firsts = [self.add_request(p, s, cache_salt) for p, s in zip(prompts, params_list, strict=True)]
        seqs = [each for seq in firsts for each in (seq, *seq.forks)]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [RequestOutput(s.seq_id, s.output_token_ids, s.finish_reason or "", s.num_cached_tokens,
                              (s.first_token_s or 0.0) - s.arrival_s, (s.last_token_s or 0.0) - s.arrival_s)
                for s in seqs]

    def stats(self) -> dict[str, object]:
        """Health and load figures: queue depths, KV usage, metric snapshot."""
        bm = self.block_manager
        return {
            "model": self.config.model, "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting, "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks, "kv_usage": bm.usage,
            "attention_kernel": "cpp" if self.runner.use_kernel else "torch", **self.metrics.snapshot(),
        }


def _proposer(config: EngineConfig, model, tokenizer, num_blocks: int,
              draft: LoadedModel | None) -> PromptLookup | DraftModel | None:
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        return PromptLookup(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative != "draft":
        raise EngineError(f"speculative must be ngram or draft, got {config.speculative!r}")
    if draft is None:
        if not config.draft_model:
            raise EngineError("speculative: draft needs a draft model (draft_model)")
        dtype = config.dtype
        if dtype == "int8" or (dtype == "gguf" and not config.draft_model.endswith(".gguf")):
            dtype = "float32"
        draft = load_model(config.draft_model, dtype, config.device)
    try:
        check_draft(model, draft.model, tokenizer, draft.tokenizer)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    return DraftModel(draft.model, num_blocks, config.block_size)


def _model_name(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1]


def _eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    ids = [i for i in ids if i is not None]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def count_work(ordered: Seq[ScheduledSeq]) -> tuple[int, int]:
    """A step's prompt tokens (a prompt's chunk, or a preempted sequence's recompute) and its decodes."""
    prefills = [item.num_new_tokens for item in ordered if item.seq.num_computed_tokens < item.seq.num_prompt_tokens]
    return sum(prefills), len(ordered) - len(prefills)
