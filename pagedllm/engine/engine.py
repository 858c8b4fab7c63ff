"""LLMEngine: add_request / step / abort over the scheduler, KV manager and runner."""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Sequence as Seq

from ..config import EngineConfig
from ..kv import KVCacheManager, KVStats
from ..loader import load_config, load_tokenizer, resolve_model_dir, served_model_name
from ..models import ModelConfig
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import BeamSearchParams, SamplingParams
from .beam import BeamGroup
from .detokenizer import detokenize, final_text
from .observer import EngineObserver
from .scheduler import Scheduler
from .sequence import Request, Sequence, SeqStatus
from .speculative import SpecStats, make_proposer
from .validation import RequestRules

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters of the engine's life so far, for reports and metrics: the KV manager's
    own figures, and what only the engine knows (peaks, tokens, queues)."""
    kv: KVStats
    bytes_per_token: int
    peak_used_blocks: int
    peak_waste: float        # eta at the step of peak usage
    preemptions: int
    num_running: int              # requests with a sequence running
    num_waiting: int              # requests with a sequence waiting (and none running)
    prompt_tokens: int            # prompt tokens of requests that started generating
    computed_prompt_tokens: int   # prefill tokens actually run (cache hits skip, recompute repeats)
    generation_tokens: int
    steps: int
    spec: SpecStats | None = None   # speculative decoding's counts, when it is on

    @property
    def peak_kv_usage(self) -> float:
        return self.peak_used_blocks / self.kv.num_blocks

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv"]["hit_rate"] = self.kv.hit_rate
        d["peak_kv_usage"] = self.peak_kv_usage
        if self.spec is not None:
            d["spec"].update(acceptance_rate=self.spec.acceptance_rate,
                             mean_accepted_length=self.spec.mean_accepted_length)
        return d


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
        # Sliding-window attention equals full attention up to the window, and full
        # attention is what we compute, so a windowed model is capped at its window.
        limit = min(self.model_cfg.max_position_embeddings, self.model_cfg.sliding_window or 1 << 62)
        self.max_model_len = cfg.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit {limit} "
                             "(max_position_embeddings, or its sliding window)")
        self._launcher = None
        tp = None
        # PAGEDLLM_TP_GROUP=1: a process group even of one rank, so the GPU check runs
        # the collectives' code path on its one device.
        if cfg.tensor_parallel_size > 1 or os.environ.get("PAGEDLLM_TP_GROUP") == "1":
            from ..distributed.launch import start_group

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
        self.kv = KVCacheManager(self.runner.kv_cache.num_blocks, cfg.block_size,
                                 cfg.enable_prefix_caching, cfg.allocation, self.max_model_len)
        spec = cfg.speculative_config
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills,
                                   make_proposer(spec) if spec is not None else None, self.max_model_len)
        self.rules = RequestRules(self.tokenizer, self.model_cfg.vocab_size, self.max_model_len, cfg.max_num_seqs,
                                  self.kv)
        self.eos_token_ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self.peak_used_blocks = 0
        self.peak_waste = 0.0
        self.prompt_tokens = 0
        self.computed_prompt_tokens = 0
        # Streaming callers want every request that moved in a step, not only finished ones.
        self.stream_outputs = False
        # Benchmarks set this to a list to get one record per step (costs a table walk).
        self.step_log: list[dict] | None = None
        self._t0 = time.perf_counter()
        self.generation_tokens = 0
        self.steps = 0
        self.model_name = served_model_name(cfg.model)
        # Told of requests, steps and aborts (pagedllm.engine.observer); the visualizer is one.
        self.observers: list[EngineObserver] = []

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self._launcher is not None:
            self._launcher.close()

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
        req = Request(request_id, text, token_ids, params, max_tokens, cache_salt, time.time(), owner=owner)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        base_seed = params.seed if params.seed is not None else _request_seed(self.cfg.seed, request_id)
        for i in range(1 if beam else params.num_samples):
            seq = Sequence(next(self._seq_ids), req, i, list(token_ids), len(token_ids),
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
        return self.make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of the requests that finished (or, with
        stream_outputs, of every request that got a token)."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        res = self.runner.execute(out.plan)
        sampled, logprobs, errors = res.tokens, res.logprobs, res.errors
        if res.prompt_logprobs:
            self._prompt_logprobs(out, res.prompt_logprobs)
        self.steps += 1
        if self.kv.pool.num_used > self.peak_used_blocks:
            self.peak_used_blocks = self.kv.pool.num_used
            self.peak_waste = self.kv.stats().waste
        if self.step_log is not None:
            self.step_log.append(self._step_record(out))
        self.computed_prompt_tokens += out.num_prefill_tokens
        now = time.time()
        touched: dict[str, Request] = {}
        new_tokens = []
        for seq, token in self.scheduler.update(out, sampled, res.accepted):
            req = seq.request
            touched[req.request_id] = req
            if req.error is not None or seq.finished:  # a verified run of tokens can end early
                continue
            new_tokens.append((seq, token))
            try:
                self._accept(seq, token, logprobs.get(seq.seq_id), now)
            except Exception as e:  # e.g. detokenizing for stop strings: this request only
                self._fail(req, f"{type(e).__name__}: {e}")
        for req in self._beam_groups(out, logprobs) if logprobs else ():  # beams' candidates come as logprobs
            touched[req.request_id] = req
            try:
                new_tokens += self._advance_beams(req, now)
            except Exception as e:  # this request only
                self._fail(req, f"{type(e).__name__}: {e}")
        if errors:  # rare: skip the walk over the batch on every ordinary step
            for s in out.scheduled:
                for seq in s.sample_for:
                    if seq.seq_id in errors and seq.request.error is None:
                        self._fail(seq.request, errors[seq.seq_id])
                        touched[seq.request.request_id] = seq.request
        for o in self.observers:
            if o.active:
                o.on_step(out, new_tokens)
        outputs = []
        for req in touched.values():
            if req.finished:
                req.finish_time = now
                self.requests.pop(req.request_id, None)
            if req.finished or self.stream_outputs:
                outputs.append(self.make_output(req))
        return outputs

    def _prompt_logprobs(self, out, scores: dict[int, list]) -> None:
        """Append each scored prompt token's logprobs to its request, texts decoded."""
        for s in out.scheduled:
            entries = scores.get(s.seq.seq_id)
            if entries is None or s.seq.request.prompt_logprobs is None:
                continue
            s.seq.request.prompt_logprobs.extend(map(self._decoded, entries))

    def _decoded(self, entry: dict) -> dict:
        """A logprobs entry with each token's text set (vLLM's decoded_token)."""
        for tid, lp in entry.items():
            lp.decoded_token = self.tokenizer.convert_tokens_to_string([self.tokenizer.convert_ids_to_tokens(tid)])
        return entry

    @staticmethod
    def _beam_groups(out, logprobs: dict) -> list[Request]:
        """Beam groups whose live beams all have their candidates after this step."""
        ready: dict[str, Request] = {}
        for s in out.scheduled:
            for seq in s.sample_for:
                req = seq.request
                if req.beam is not None and seq.seq_id in logprobs and not seq.finished:
                    req.candidates[seq.seq_id] = [(t, lp.logprob) for t, lp in logprobs[seq.seq_id].items()]
                    if all(b.seq_id in req.candidates for b in req.beams):
                        ready[req.request_id] = req
        return list(ready.values())

    def _advance_beams(self, req: Request, now: float) -> list[tuple[Sequence, int]]:
        """One beam-search step: choose the next beams (pure, in engine.beam), then apply
        it to block tables: a beam chosen once extends itself, chosen again forks (shared
        blocks, copy-on-write of the partial last one), not chosen is freed now."""
        beams, group, eos = req.beams, req.beam, self.eos_token_ids
        ignore_eos = group.params.ignore_eos

        def ends(token: int, gen_len: int) -> str | None:
            if not ignore_eos and token in eos:
                return "stop"
            if gen_len >= req.max_tokens or len(req.prompt_token_ids) + gen_len >= self.max_model_len:
                return "length"
            return None
        chosen = group.step([req.candidates.pop(b.seq_id) for b in beams], [b.output_token_ids for b in beams], ends)
        if req.first_token_time is None:
            req.first_token_time = now
            self.prompt_tokens += len(req.prompt_token_ids)
        extended: set[int] = set()
        nxt: list[Sequence] = []
        for c in chosen:  # forks first: a child copies its parent's tokens before the parent grows
            parent = beams[c.beam]
            if c.beam in extended:
                child = Sequence(next(self._seq_ids), req, len(req.seqs), parent.token_ids + [c.token],
                                 len(req.prompt_token_ids), parent.seed)
                req.seqs.append(child)
                self.scheduler.fork(parent, child)
                nxt.append(child)
            else:
                extended.add(c.beam)
                nxt.append(parent)
        for seq, c in zip(nxt, chosen):
            if seq is beams[c.beam]:
                seq.token_ids.append(c.token)
        for i, b in enumerate(beams):
            if i not in extended:
                self.scheduler.finish(b, "pruned")
        req.beams = [] if group.done else nxt
        if group.done:
            for b in nxt:
                self.scheduler.finish(b, "stop")
        self.generation_tokens += len(chosen)
        return [(seq, c.token) for seq, c in zip(nxt, chosen)]

    def _accept(self, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.token_ids.append(token)
        self.generation_tokens += 1
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = now
            self.prompt_tokens += len(req.prompt_token_ids)
        if logprob is not None:
            seq.cumulative_logprob += logprob[token].logprob
            if seq.params.logprobs is not None:  # else only best_of's ranking asked for it
                seq.logprobs.append(self._decoded(logprob))
        self._check_stop(seq, token)

    def _fail(self, req: Request, error: str) -> None:
        """Something went wrong for this request alone inside a step: end it (its blocks
        go back now) and let the rest of the batch go on."""
        logger.warning("request %s failed inside a step: %s", req.request_id, error)
        req.error = error
        for seq in req.seqs:
            if seq.status is SeqStatus.PENDING:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
            else:
                self.scheduler.finish(seq, "error")

    def _step_record(self, out) -> dict:
        kv = self.kv.stats()
        return {"t": time.perf_counter() - self._t0, "used_blocks": kv.used_blocks, "usage": kv.usage,
                "waste": kv.waste, "blocks_without_sharing": kv.blocks_without_sharing,
                "batch_seqs": len(out.scheduled), "running_seqs": len(self.scheduler.running), "waiting_seqs": len(self.scheduler.waiting),
                "prefill_tokens": out.num_prefill_tokens, "decode_tokens": out.num_decode_tokens,
                "cached_free_blocks": kv.cached_free_blocks}

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:  # nothing ends the output before min_tokens (vLLM)
            if seq.num_output_tokens >= seq.request.max_tokens or len(seq.token_ids) >= self.max_model_len:
                self.scheduler.finish(seq, "length")
            return
        if not p.ignore_eos and token in self.eos_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if token in p.stop_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if p.stop:
            # Only the new text, and the tail it may complete a stop string with, can hold
            # a stop string that was not there one token ago.
            tail = max(0, len(seq.text) - max(len(s) for s in p.stop) + 1)
            if self._detokenize(seq):
                for s in p.stop:
                    at = seq.text.find(s, tail)
                    if at >= 0:
                        seq.text = seq.text[:at + len(s)] if p.include_stop_str_in_output else seq.text[:at]
                        return self.scheduler.finish(seq, "stop", s)
        if seq.num_output_tokens >= seq.request.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _detokenize(self, seq: Sequence) -> str:
        """Bring seq.text up to its output ids, decoding only the new ones; returns the new
        text. A character still missing bytes is held back until the sequence ends."""
        args = (self.tokenizer, seq.token_ids, seq.num_prompt_tokens, seq.detok, seq.params.skip_special_tokens)
        if seq.finished:
            seq.text = final_text(*args, seq.text)
            return ""
        new = detokenize(*args)
        seq.text += new
        return new

    def make_output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return self._beam_output(req)
        outs = []
        p = req.params
        seqs = req.seqs
        if p.ranks_samples:
            # best_of: the n samples of highest cumulative logprob, known only at the end
            # (vLLM streams none of a best_of request either).
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:p.n] if req.finished else []
        for index, seq in enumerate(seqs):
            ids = seq.output_token_ids
            if not (seq.finish_reason == "stop" and isinstance(seq.stop_reason, str)):  # cut at its stop string
                self._detokenize(seq)
            cumulative = seq.cumulative_logprob if p.logprobs is not None or p.ranks_samples else None
            outs.append(CompletionOutput(index, seq.text, list(ids), seq.finish_reason, seq.stop_reason,
                                         list(seq.logprobs) if p.logprobs is not None else None, cumulative))
        metrics = {"arrival_time": req.arrival_time, "scheduled_time": req.scheduled_time,
                   "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                   "n": req.params.n, "max_tokens": req.max_tokens}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             req.num_cached_tokens, metrics, req.error,
                             list(req.prompt_logprobs) if req.prompt_logprobs is not None else None)

    def _beam_output(self, req: Request) -> RequestOutput:
        """The kept hypotheses, best score first, once the search is over (nothing before:
        a beam's tokens can still be dropped)."""
        outs = []
        if req.finished and req.error is None:
            for i, h in enumerate(req.beam.results()):
                text = self.tokenizer.decode(h.output_ids, skip_special_tokens=True)
                outs.append(CompletionOutput(i, text, list(h.output_ids), h.finish_reason,
                                             h.output_ids[-1] if h.finish_reason == "stop" else None,
                                             None, h.cumulative))
        metrics = {"arrival_time": req.arrival_time, "scheduled_time": req.scheduled_time,
                   "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                   "n": req.beam.width, "max_tokens": req.max_tokens, "beam_scores": [h.score for h in req.beam.results()]}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             req.num_cached_tokens, metrics, req.error)

    # -- figures -------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            kv=self.kv.stats(), bytes_per_token=self.runner.kv_cache.bytes_per_token * self.runner.tp.size,
            peak_used_blocks=self.peak_used_blocks, peak_waste=self.peak_waste,
            preemptions=self.scheduler.num_preemptions,
            num_running=len({s.request.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request.request_id for s in self.scheduler.waiting}),
            prompt_tokens=self.prompt_tokens, computed_prompt_tokens=self.computed_prompt_tokens,
            generation_tokens=self.generation_tokens, steps=self.steps,
            spec=self.scheduler.spec.snapshot() if self.cfg.speculative_config is not None else None)


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
