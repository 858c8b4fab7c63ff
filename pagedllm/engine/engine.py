"""LLMEngine: add_request / step / abort over the scheduler, KV manager and runner."""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Sequence as Seq

from ..config import EngineConfig
from ..kv import KVCacheManager
from ..loader import load_config, load_tokenizer, resolve_model_dir, served_model_name
from ..models import ModelConfig
from ..outputs import RequestOutput
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from ..structured import GrammarCompiler, checked, mark_checked
from .beam import BeamGroup
from .observer import EngineObserver
from .output_processor import OutputProcessor
from .scheduler import Scheduler, StepUpdate
from .sequence import Request, Sequence, SeqStatus
from .speculative import SpecPolicy
from .stats import EngineStats
from .validation import RequestRules

logger = logging.getLogger(__name__)
GRAMMAR_POLL = 0.02  # seconds an engine with nothing else to run waits on a compile between polls


class LLMEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        from ..runtime.model_runner import ModelRunner  # torch stays out of the pure parts

        self.cfg = cfg
        # The HF directories read (a GGUF's converted one): the server's /model_info names them.
        self.model_dir = model_dir = resolve_model_dir(cfg.model)
        self.tokenizer_dir = model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer)
        self.model_cfg = ModelConfig.from_hf(load_config(model_dir))
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        if cfg.speculative_config is not None and cfg.speculative_config.method == "draft_model":
            _check_draft_tokenizer(self.tokenizer, cfg.speculative_config.model)
        # A windowed model's layers attend within their windows (the attention backends
        # mask by each layer's own), so its limit is its positions', not its window's.
        limit = self.model_cfg.max_position_embeddings
        self.max_model_len = cfg.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit {limit} "
                             "(max_position_embeddings)")
        self._launcher = None
        tp = None
        # PAGEDLLM_TP_GROUP=1: a process group even of one rank, so the GPU check runs
        # the collectives' code path on its one device.
        if cfg.tensor_parallel_size > 1 or os.environ.get("PAGEDLLM_TP_GROUP") == "1":
            from ..runtime.launch import start_group

            self.model_cfg.check_tensor_parallel(cfg.tensor_parallel_size)
            self._launcher = start_group(cfg, model_dir, self.model_cfg, self.max_model_len)
            tp = self._launcher.group
            # Workers stop when the engine is collected or the process exits, closed or not.
            weakref.finalize(self, self._launcher.close)
        try:
            self.runner = ModelRunner(cfg, model_dir, self.model_cfg, self.max_model_len, tp)
        except BaseException:
            if self._launcher is not None:
                self._launcher.close(graceful=False)
            raise
        spec = cfg.speculative_config
        window = self._release_window()
        # A step's slots for one sequence: its chunk (drafts included) within the budget, and lookahead slots past it.
        lookahead = SpecPolicy.of(spec).num_lookahead_tokens if spec is not None else 0
        tier = None
        if cfg.kv_offload_dir is not None:
            tier = self.runner.attach_tier(cfg, model_dir, cfg.kv_offload_dir, cfg.kv_offload_size)
        self.kv = KVCacheManager(self.runner.kv_cache.num_blocks, cfg.block_size,
                                 cfg.enable_prefix_caching, cfg.allocation, self.max_model_len,
                                 sliding_window=window, max_step_tokens=cfg.max_num_batched_tokens + lookahead,
                                 tier=tier, write_policy=cfg.kv_offload_write_policy)
        if tier is not None:
            logger.info("KV tier: %s, %s, up to %.1f GiB, %d bytes a block", tier.dir, cfg.kv_offload_write_policy,
                        cfg.kv_offload_size / 2**30, tier.block_bytes)
        if self.kv.sliding_window:
            logger.info("sliding window of %d tokens: each sequence releases the KV blocks below it", window)
        self.eos_token_ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills,
                                   SpecPolicy.of(spec) if spec is not None else None, self.max_model_len,
                                   frozenset(self.eos_token_ids), cfg.max_logprobs, cfg.preemption_mode,
                                   cfg.scheduling_policy, cfg.scheduling_aging_bound)
        self.processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.rules = RequestRules(self.tokenizer, self.model_cfg.vocab_size, self.max_model_len, cfg.max_num_seqs,
                                  self.kv.shape, cfg.max_logprobs)
        self.requests: dict[str, Request] = {}
        # Structured outputs (thread-safe: the server checks grammars from its event loop).
        # Nothing starts until the first constrained request: no import, no worker process.
        self.grammars = GrammarCompiler(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids,
                                        timeout=cfg.grammar_compile_timeout)
        self._compiling: list[Request] = []   # waiting for their grammar
        self._req_ids = itertools.count()
        self.peak_used_blocks = 0
        self.peak_waste = 0.0
        # Streaming callers want every request that moved in a step, not only finished ones.
        self.stream_outputs = False
        # Benchmarks set this to a list to get one record per step (costs a table walk).
        self.step_log: list[dict] | None = None
        self._t0 = time.perf_counter()
        self.model_name = served_model_name(cfg.model)
        # Told of requests, steps and aborts (pagedllm.engine.observer); the visualizer is one.
        self.observers: list[EngineObserver] = []
        # The figures after the latest step, built when first read (an offline run reads none).
        self._view: EngineStats = self.stats()
        self._view_step = 0

    def _release_window(self) -> int:
        """The window by which sequences release their old blocks: every layer that reads
        the pool (the target's, a draft model's: one block table serves both) must be
        windowed, else none are released and that is said once."""
        readers = [self.model_cfg] + ([self.runner.draft.cfg] if self.runner.draft is not None else [])
        if not any(c.sliding_window for c in readers):
            return 0
        windows = [c.kv_window for c in readers]
        if 0 in windows:
            logger.info("sliding-window layers mask their own windows, but a sequence keeps all its KV blocks: "
                        "a full-attention layer%s reads every key", " (of the draft model)" if windows[0] else "")
            return 0
        return max(windows)

    def close(self) -> None:
        """Stop the tensor-parallel workers and the grammar compiler, if any; the tier's writes
        finish, and every cached block it lacks is written now (write-back). Idempotent."""
        if self.kv.tier is not None:
            self.runner.write_blocks(self.kv.blocks_to_flush())
            self.kv.tier.close()
        if self._launcher is not None:
            self._launcher.close()
        self.grammars.close()

    # -- requests ------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Seq[int],
                    params: SamplingParams | BeamSearchParams | None = None, cache_salt: str | None = None,
                    owner: str | None = None, add_special_tokens: bool = True,
                    prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and queue a request. Raises ValueError naming what is wrong; a
        rejected request touches nothing. A text prompt gets the tokenizer's special
        tokens (BOS), as vLLM's; a chat-templated one already has them: pass False.
        `prompt_token_ids`: a text prompt's ids from validate(), so it is encoded once.
        BeamSearchParams make a beam-search request: one group of up to beam_width beams."""
        params, beam = self.rules.split_params(params or SamplingParams())
        request_id = str(next(self._req_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is not None and isinstance(prompt, str):
            text, token_ids = prompt, self.rules.tokenize(prompt_token_ids, add_special_tokens)[1]
        else:
            text, token_ids = self.rules.tokenize(prompt, add_special_tokens)
        max_tokens = self.rules.check_lengths(len(token_ids), params, beam.beam_width if beam else 1)
        compiling = self._grammar_of(params, beam)
        req = Request(request_id, text, token_ids, params, max_tokens, cache_salt, time.time(), owner=owner)
        if compiling is not None:
            req.compiling = compiling
            self._compiling.append(req)
        if params.prompt_logprobs is not None:
            req.prompt_scores = self.scheduler.prompt_scores_for(params.prompt_logprobs)
        base_seed = params.seed if params.seed is not None else _request_seed(self.cfg.seed, request_id)
        for i in range(1 if beam else params.num_samples):
            seq = Sequence(self.scheduler.new_seq_id(), req, i, list(token_ids), len(token_ids),
                           seed=(base_seed * 1_000_003 + i) & 0x7FFFFFFFFFFF,
                           status=SeqStatus.PENDING)
            req.seqs.append(seq)
        if beam is not None:
            req.beam = BeamGroup(beam, 0 if beam.ignore_eos else len(self.eos_token_ids), max_tokens)
            req.beams = [req.seqs[0]]
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        for o in self.observers:
            if o.active:
                o.on_request(req)
        return req

    def _grammar_of(self, params: SamplingParams, beam: BeamSearchParams | None) -> Future | None:
        so = params.structured_outputs
        if so is None:
            return None
        if beam is not None:  # pragma: no cover (BeamSearchParams carries no constraint)
            raise ValueError("structured outputs are not supported with beam search")
        self.grammars.count_request()
        return self.grammars.submit(so, count=not checked(so))

    def check_grammar(self, so: StructuredOutputsParams) -> None:
        """Compile `so`'s grammar now (cached), blocking; ValueError naming what is wrong.
        Safe from another thread: the compiler is."""
        self.grammars.compile(so)
        mark_checked(so)

    def _settle_grammars(self) -> list[Request]:
        """Requests whose grammar compile ended since the last step: ready to be admitted,
        or failed (the schema, regex or grammar was refused; they end with its error)."""
        failed, pending = [], []
        for req in self._compiling:
            fut = req.compiling
            if req.finished:
                continue
            if not fut.done():
                pending.append(req)
                continue
            req.compiling = None
            try:
                req.grammar = fut.result()
            except Exception as e:
                self.scheduler.fail(req, str(e))
                failed.append(req)
        self._compiling = pending
        return failed

    def validate(self, prompt: str | Seq[int], params: SamplingParams | BeamSearchParams,
                 add_special_tokens: bool = True) -> list[int]:
        """Token ids of a request that add_request would accept; ValueError otherwise.
        Reads no mutable engine state, so it is safe to call from another thread."""
        return self.rules.validate(prompt, params, add_special_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; returns its final output."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.status is SeqStatus.PENDING:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "abort"
            else:
                self.scheduler.finish(seq, "abort")
        req.finish_time = time.time()
        for o in self.observers:
            if o.active:
                o.on_abort(req)
        return self.processor.output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of the requests that finished (or, with
        stream_outputs, of every request that moved, as its output_kind asks)."""
        up = self.core_step()
        return [] if up is None else self.process(up)

    def core_step(self) -> StepUpdate | None:
        """Schedule, execute, and let the scheduler apply the result (tokens, stops on ids
        and lengths, beams, drafts); None when nothing was scheduled. No text is made here."""
        failed = self._settle_grammars() if self._compiling else []
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.runner.move_blocks(out.plan)
            if failed:
                return StepUpdate(out, touched={r.request_id: r for r in failed})
            if self._compiling:  # only compiles to wait for: not a busy loop beside them
                wait([r.compiling for r in self._compiling], timeout=GRAMMAR_POLL, return_when=FIRST_COMPLETED)
            return None
        res = self.runner.execute(out.plan)
        if self.kv.pool.num_used > self.peak_used_blocks:
            self.peak_used_blocks = self.kv.pool.num_used
            self.peak_waste = self.kv.stats().waste
        if self.step_log is not None:
            self.step_log.append(self._step_record(out))
        up = self.scheduler.update_from_output(out, res)
        up.touched.update((r.request_id, r) for r in failed)
        return up

    def process(self, up: StepUpdate) -> list[RequestOutput]:
        """The step's outputs (the output processor: stop strings, text, logprob texts); the
        observers are told; finished requests leave."""
        outputs = self.processor.process(up, self.stream_outputs, time.time())
        watching = [o for o in self.observers if o.active]
        if watching:  # a watcher shows the slot figures: this step's view walked once, for it and the metrics
            view = self.refresh_view()
            for o in watching:
                o.on_step(up.out, up.new_tokens, view)
        for req in up.touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    @property
    def view(self) -> EngineStats:
        """The step's read-only view: built once a step, when first read, its counters O(1).
        The KV slot figures (used slots, eta, blocks without sharing) are those of the latest
        walk (a watcher's, a scrape's, an idle engine's), so a reader never finds them missing."""
        if self._view_step != self.steps:
            view, walked = self.stats(walk=False), self._view.kv
            view.kv.used_slots, view.kv.waste = walked.used_slots, walked.waste
            view.kv.blocks_without_sharing = walked.blocks_without_sharing
            self._view, self._view_step = view, self.steps
        return self._view

    def refresh_view(self) -> EngineStats:
        """The view, walked afresh (between steps: an idle engine, a metrics scrape)."""
        self._view, self._view_step = self.stats(), self.steps
        return self._view

    @property
    def tokens_run(self) -> int:
        """Prompt tokens computed and tokens generated so far (a step's work, by difference)."""
        return self.scheduler.computed_prompt_tokens + self.scheduler.generation_tokens

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    def _step_record(self, out) -> dict:
        kv = self.kv.stats()
        return {"t": time.perf_counter() - self._t0, "used_blocks": kv.used_blocks, "usage": kv.usage,
                "waste": kv.waste, "blocks_without_sharing": kv.blocks_without_sharing,
                "batch_seqs": len(out.scheduled), "running_seqs": len(self.scheduler.running), "waiting_seqs": len(self.scheduler.waiting),
                "prefill_tokens": out.num_prefill_tokens, "decode_tokens": out.num_decode_tokens,
                "cached_free_blocks": kv.cached_free_blocks}

    # -- figures -------------------------------------------------------------
    def stats(self, walk: bool = True) -> EngineStats:
        """The engine's figures now; walk=False leaves out the KV slot figures that walk every
        block table (used slots, eta), so it costs O(batch)."""
        return EngineStats(
            kv=self.kv.stats(walk), bytes_per_token=self.runner.kv_cache.bytes_per_token * self.runner.tp.size,
            kv_cache_dtype=self.runner.kv_cache.kv_dtype.name,
            peak_used_blocks=self.peak_used_blocks, peak_waste=self.peak_waste,
            preemptions=self.scheduler.num_preemptions,
            num_running=len({s.request.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request.request_id for s in self.scheduler.waiting}),
            prompt_tokens=self.scheduler.prompt_tokens, computed_prompt_tokens=self.scheduler.computed_prompt_tokens,
            generation_tokens=self.scheduler.generation_tokens, steps=self.steps,
            spec=self.scheduler.spec.snapshot() if self.cfg.speculative_config is not None else None,
            grammar=self.grammars.snapshot())


def _check_draft_tokenizer(tokenizer, draft_model: str) -> None:
    """A draft model must speak the target's tokens: same vocabulary, same ids."""
    draft = load_tokenizer(resolve_model_dir(draft_model))
    ours, theirs = tokenizer.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"speculative_config: the draft model {draft_model!r} has another tokenizer than the "
                         f"target ({len(theirs)} tokens vs {len(ours)}; e.g. {differ}): a draft must use the "
                         "target's token ids")


def _request_seed(engine_seed: int, request_id: str) -> int:
    """A request's default seed from a stable hash of (engine seed, request id): Python's
    hash() is salted per process, so `--seed` would not reproduce a run in a new one."""
    digest = hashlib.blake2b(f"{engine_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
