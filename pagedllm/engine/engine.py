"""LLMEngine: add_request / step / abort over the scheduler, KV manager and runner.

The runner is injectable: any object with the Runner interface (runner_api.py) runs the
steps, so the engine core (scheduling, KV, stops, beams, speculation, outputs) is tested
against a fake one with no model loaded."""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import asdict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Sequence as Seq

from ..config import EngineConfig
from ..kv_dtype import KV_DTYPES
from ..loader import load_config, load_tokenizer, resolve_model_dir, served_model_name
from ..models import ModelConfig
from ..outputs import RequestOutput
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from ..structured import GrammarCompiler, checked, mark_checked
from ..util import release_freed_heap
from .adapters import LoRAHook
from .assembly import kv_manager, model_runner, warn_if_pool_short
from .beam import BeamGroup
from .beam_search import BeamSearch
from .kv_events import kv_medium, start_publisher
from .observer import EngineObserver
from .output_processor import OutputProcessor
from .prompt_scoring import PromptScoring
from .queue_policy import make_policy
from .runner_api import Runner
from .scheduler import Scheduler
from .sequence import Request, Sequence, SeqStatus, request_seed
from .speculative import Speculation, SpecPolicy
from .stats import EngineStats
from .step_types import StepUpdate
from .step_update import StepApplier
from .stops import StopRules
from .tier_loads import TierLoads
from .validation import RequestRules, check_draft_tokenizer

logger = logging.getLogger(__name__)
GRAMMAR_POLL = 0.02  # seconds an engine with nothing else to run waits on a compile between polls


class LLMEngine:
    def __init__(self, cfg: EngineConfig, runner: Runner | None = None, model_cfg: ModelConfig | None = None,
                 tokenizer=None) -> None:
        """runner: what runs the steps (default: a ModelRunner on cfg.model's weights); with
        one, model_cfg and tokenizer describe its model (default: read from cfg.model)."""
        self.cfg = cfg
        # The HF directories read (a GGUF's converted one): the server's /model_info names them.
        if model_cfg is None or tokenizer is None:
            self.model_dir = model_dir = resolve_model_dir(cfg.model)
            self.tokenizer_dir = model_dir if cfg.tokenizer is None else resolve_model_dir(cfg.tokenizer)
        else:
            self.model_dir = self.tokenizer_dir = model_dir = Path(cfg.model or ".")
        self.model_cfg = model_cfg or ModelConfig.from_hf(load_config(model_dir))
        self.tokenizer = tokenizer or load_tokenizer(self.tokenizer_dir, cfg.chat_template)
        if cfg.speculative_config is not None and cfg.speculative_config.method == "draft_model":
            check_draft_tokenizer(self.tokenizer, cfg.speculative_config.model)
        # A windowed model's layers attend within their windows (the attention backends
        # mask by each layer's own), so its limit is its positions', not its window's.
        limit = self.model_cfg.max_position_embeddings
        self.max_model_len = cfg.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit {limit} "
                             "(max_position_embeddings)")
        self._launcher = None
        loads = runner is None
        if loads:
            runner, self._launcher = model_runner(cfg, model_dir, self.model_cfg, self.max_model_len)
            if self._launcher is not None:   # workers stop when the engine is collected or the process exits
                weakref.finalize(self, self._launcher.close)
        else:
            runner.reset_sequences()   # a runner that served another engine: its sequence ids mean nothing now
            held = getattr(runner, "max_model_len", None)
            if held is not None and held < self.max_model_len:  # its RoPE tables end there (build.py)
                raise ValueError(f"max_model_len {self.max_model_len} exceeds the {held} positions this runner "
                                 "was built for")
        self.runner = runner
        self.kv = kv_manager(cfg, runner, model_dir, self.max_model_len)
        # vLLM's KV events for KV-aware routers (engine.kv_events), when configured.
        self.kv_events = start_publisher(cfg.kv_events_config, kv_medium(self.runner))
        if self.kv_events is not None:
            self.kv.record_events(salted_token_ids=cfg.kv_events_config.salted_token_ids)
        self._weights = self.runner.weights
        # a latent pool's K/V expanded to full heads (the KV report's comparison): fixed at start
        kv_dtype = KV_DTYPES[self.runner.kv_dtype_name]
        self._expanded_bytes_per_token = self.model_cfg.expanded_kv_bytes_per_token(kv_dtype)
        warn_if_pool_short(cfg, self.kv, self._weights, self.max_model_len)
        self.eos_token_ids = self.model_cfg.stop_ids(self.tokenizer)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self._scheduler()
        self.processor = OutputProcessor(self.tokenizer)
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
        if loads:   # the heap its load freed, back to the OS (over a given runner, nothing was loaded)
            release_freed_heap()

    def _scheduler(self) -> None:
        """The scheduler, and the features that join its steps (StepHooks), in the order they
        are asked: the tier's loads extend a prefix hit before prompt scoring reads it."""
        cfg = self.cfg
        self.stop_rules = StopRules(frozenset(self.eos_token_ids), self.max_model_len)
        self.scheduler = sched = Scheduler(
            self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold,
            cfg.max_num_partial_prefills, self.max_model_len,
            make_policy(cfg.scheduling_policy, cfg.scheduling_aging_bound))
        self.applier = StepApplier(sched, self.stop_rules)
        self.speculation = None
        # First: a request waiting for its adapter starts no tier load.
        self.adapters = LoRAHook(self.runner.loras, cfg.max_loras)
        sched.add_hook(self.adapters)
        if self.kv.connector is not None:
            sched.add_hook(TierLoads(cfg.preemption_mode))
        self.scoring = PromptScoring(cfg.max_logprobs)
        sched.add_hook(self.scoring)
        if cfg.speculative_config is not None:
            self.speculation = Speculation(SpecPolicy.of(cfg.speculative_config),
                                           lambda seq: self.stop_rules.tokens_left(seq.request, seq.num_output_tokens))
            sched.add_hook(self.speculation)
        sched.add_hook(BeamSearch(self.stop_rules, self.applier.first_token))

    def close(self) -> None:
        """Stop the tensor-parallel workers and the grammar compiler, if any; the tier's writes
        finish, and every cached block it lacks is written now (write-back). Idempotent."""
        if self.kv.connector is not None:
            self.runner.write_blocks(self.kv.blocks_to_flush())
            self.kv.connector.close()
        if self._launcher is not None:
            self._launcher.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.grammars.close()
        self.adapters.close()

    # -- requests ------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Seq[int],
                    params: SamplingParams | BeamSearchParams | None = None, cache_salt: str | None = None,
                    owner: str | None = None, add_special_tokens: bool = True,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    lora_request=None) -> Request:
        """Validate and queue a request. Raises ValueError naming what is wrong; a
        rejected request touches nothing. A text prompt gets the tokenizer's special
        tokens (BOS), as vLLM's; a chat-templated one already has them: pass False.
        `prompt_token_ids`: a text prompt's ids from validate(), so it is encoded once.
        BeamSearchParams make a beam-search request: one group of up to beam_width beams.
        `priority` (vLLM's): lower runs first under the priority queue policy.
        `lora_request` (vLLM's LoRARequest; enable_lora): the adapter it runs under (adapters.py)."""
        params, beam = self.rules.split_params(params or SamplingParams())
        request_id = str(next(self._req_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is not None and isinstance(prompt, str):
            text, token_ids = prompt, self.rules.tokenize(prompt_token_ids, add_special_tokens)[1]
        else:
            text, token_ids = self.rules.tokenize(prompt, add_special_tokens)
        max_tokens = self.rules.check_lengths(len(token_ids), params, beam.beam_width if beam else 1)
        self.check_priority(priority)
        read = self.adapters.acquire(lora_request)   # last of the checks: it holds the adapter from here
        try:
            compiling = self._grammar_of(params, beam)
        except BaseException:
            self.adapters.release(lora_request)
            raise
        req = Request(request_id, text, token_ids, params, max_tokens, cache_salt, time.time(), owner=owner,
                      priority=priority, lora=lora_request)
        if compiling is not None:
            req.compiling = compiling
            self._compiling.append(req)
        self.adapters.queued(req, read)
        if params.prompt_logprobs is not None:
            req.prompt_scores = self.scoring.new_scores(params.prompt_logprobs)
        base_seed = params.seed if params.seed is not None else request_seed(self.cfg.seed, request_id)
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

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.scheduler.policy.name != "priority":
            raise ValueError(f"priority {priority} needs the priority queue policy (--scheduling-policy priority); "
                             f"this engine runs {self.scheduler.policy.name}")

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
        failed, waiting = [], []
        for req in self._compiling:
            if req.finished:
                continue
            if not req.compiling.done():
                waiting.append(req)
                continue
            compiling, req.compiling = req.compiling, None
            try:
                req.grammar = compiling.result()
            except Exception as e:  # the compile's own error: the request's, not the engine's
                self.scheduler.fail(req, str(e))
                failed.append(req)
        self._compiling = waiting
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
        self.adapters.ended(req)
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
        failed += self.adapters.settle(self.scheduler.fail)
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.runner.move_blocks(out.plan)
            if failed:
                return StepUpdate(out, touched={r.request_id: r for r in failed})
            reads = [r.compiling for r in self._compiling] + self.adapters.pending()
            if reads:  # only compiles and reads to wait for: not a busy loop beside them
                wait(reads, timeout=GRAMMAR_POLL, return_when=FIRST_COMPLETED)
            return None
        res = self.runner.execute(out.plan)
        if self.kv.pool.num_used > self.peak_used_blocks:
            self.peak_used_blocks = self.kv.pool.num_used
            self.peak_waste = self.kv.stats().waste
        if self.step_log is not None:
            self.step_log.append(self._step_record(out))
        up = self.applier.apply(out, res)
        up.touched.update((r.request_id, r) for r in failed)
        if self.kv_events is not None:   # drained on the engine's thread: the step's blocks, in order
            self.kv_events.publish(self.kv.take_events())
        return up

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block; returns how many (KV events: AllBlocksCleared)."""
        dropped = self.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())
        return dropped

    def process(self, up: StepUpdate) -> list[RequestOutput]:
        """The step's outputs (the output processor: stop strings, text, logprob texts); the
        observers are told; finished requests leave."""
        self.applier.decide(self.processor.stops(up))
        outputs = self.processor.outputs(up, self.stream_outputs, time.time())
        watching = [o for o in self.observers if o.active]
        if watching:  # a watcher shows the slot figures: this step's view walked once, for it and the metrics
            view = self.refresh_view()
            for o in watching:
                o.on_step(up.out, up.new_tokens, view)
        for req in up.touched.values():
            if req.finished and self.requests.pop(req.request_id, None) is not None:
                self.adapters.ended(req)
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
        c = self.scheduler.counters
        return c.computed_prompt_tokens + c.generation_tokens

    @property
    def steps(self) -> int:
        return self.scheduler.counters.steps

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
            kv=self.kv.stats(walk), bytes_per_token=self.runner.bytes_per_token,
            bytes_per_block=self.runner.bytes_per_block, kv_cache_dtype=self.runner.kv_dtype_name,
            peak_used_blocks=self.peak_used_blocks, peak_waste=self.peak_waste,
            num_running=len({s.request.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request.request_id for s in self.scheduler.waiting}),
            spec=self.speculation.stats.snapshot() if self.speculation is not None else None,
            grammar=self.grammars.snapshot(), weights_bytes=self._weights.resident,
            active_weights_bytes=self._weights.active, **asdict(self.scheduler.counters),
            expanded_bytes_per_token=self._expanded_bytes_per_token,
            lora=self.adapters.use(self.scheduler.running, self.scheduler.waiting))
