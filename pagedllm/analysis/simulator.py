"""Replay a length distribution through the real scheduler and KV cache manager,
without the model: predicts utilization, waste and batch size for paged vs reserve-max
(e.g. LLaMA-13B on a 40 GB A100 from its config.json)."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from ..engine.scheduler import Scheduler
from ..engine.sequence import Request, Sequence, SeqStatus
from ..engine.step_update import StepApplier
from ..engine.stops import StopRules
from ..config import EngineConfig
from ..kv import KVCacheManager
from ..kv.groups import KVLayout
from ..plan import StepResult
from ..sampling_params import SamplingParams


@dataclass
class SimResult:
    policy: str
    num_blocks: int
    block_size: int
    steps: int
    preemptions: int
    max_concurrent_seqs: int
    mean_batch_seqs: float
    peak_used_blocks: int
    peak_usage: float
    mean_usage: float
    mean_waste: float
    prompt_tokens_computed: int
    generated_tokens: int


def simulate(lengths: list[tuple[int, int]], num_blocks: int, block_size: int = 16, policy: str = "paged",
             max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
             seed: int = 0, prompts: list[list[int]] | None = None,
             enable_prefix_caching: bool = False, scheduling_policy: str | None = None,
             layout: KVLayout | None = None) -> SimResult:
    """Each (prompt_len, output_len) runs to exactly output_len tokens (ignore_eos), with
    the engine's scheduling: same admission, chunking, preemption and block decisions.
    layout: the model's layer groups (kv_calc.engine_groups; default one group of every layer),
    num_blocks counted in its blocks, as the engine keeps them under the paged policy."""
    groups = layout if layout is not None and policy == "paged" else None
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, policy, max_model_len,
                        max_step_tokens=max_num_batched_tokens if groups else 0,
                        group_windows=groups.windows if groups else None, group_kinds=groups.kinds if groups else None)
    if scheduling_policy is None:  # the engine's default admission order
        scheduling_policy = EngineConfig.__dataclass_fields__["scheduling_policy"].default
    sched = Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len=max_model_len, policy=scheduling_policy)
    applier = StepApplier(sched, StopRules(frozenset(), max_model_len))
    rng = random.Random(seed)
    ids = itertools.count()
    for i, (p, o) in enumerate(lengths):
        if p + o > max_model_len:
            raise ValueError(f"request {i}: {p} + {o} tokens exceed max_model_len {max_model_len}")
        # Distinct random tokens: no accidental prefix hits unless prompts are given.
        toks = prompts[i] if prompts is not None else [rng.randrange(1, 1 << 30) for _ in range(p)]
        req = Request(str(i), None, toks, SamplingParams(max_tokens=o, ignore_eos=True), o)
        req.seqs.append(Sequence(next(ids), req, 0, list(toks), len(toks), seed=0, status=SeqStatus.PENDING))
        sched.add(req.seqs[0])
    steps = running_sum = 0
    usage_sum = waste_sum = 0.0
    max_running = peak_used = prompt_computed = generated = 0
    while sched.num_unfinished:
        out = sched.schedule()
        if not out.scheduled:
            raise RuntimeError("simulation stalled: a request cannot fit the pool")
        steps += 1
        prompt_computed += out.num_prefill_tokens
        st = kv.stats()  # blocks held during the step's forward pass, as the engine records
        # Token 0 for every row that samples: the engine's update path appends it and stops
        # the sequence at its length, as after a real forward.
        sampled = StepResult(tokens={t.seq_id: 0 for s in out.scheduled for t in s.sample_for})
        generated += len(applier.apply(out, sampled).new_tokens)
        running = len(out.scheduled)  # sequences in this step's batch, as the engine records
        max_running = max(max_running, running)
        running_sum += running
        peak_used = max(peak_used, st.used_blocks)
        usage_sum += st.usage
        waste_sum += st.waste
    return SimResult(policy, num_blocks, block_size, steps, sched.num_preemptions, max_running,
                     running_sum / max(1, steps), peak_used, peak_used / num_blocks, usage_sum / max(1, steps),
                     waste_sum / max(1, steps), prompt_computed, generated)
