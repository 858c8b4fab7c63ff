"""A step's plan (plain data from the scheduler) as the forward's inputs, and what each logits
row is for: sampling, verifying drafts, an embedding, prompt scores."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..attention import AttentionBackend, StepLayout
from ..kv import KVLayout
from ..kv.groups import KV, STATE
from ..models import ModelConfig
from ..models.state_step import state_steps
from ..plan import StepPlan
from ..util import cdiv
from .rejection import Verify


def step_bucket(n: int) -> int:
    """Token count a step is padded to: powers of two to 16, then multiples of 16 to 512,
    of 64 to 2048, of 256 beyond (at most 1/8 extra rows past 128 tokens)."""
    if n <= 16:
        return 1 << max(0, n - 1).bit_length()
    step = 16 if n <= 512 else 64 if n <= 2048 else 256
    return cdiv(n, step) * step


@dataclass(slots=True)
class StepInputs:
    """What every tensor-parallel rank needs to run a step's forward: rank 0 builds it
    from the plan and broadcasts it (sampling stays on rank 0)."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    seq_lens: list[int]
    q_starts: list[int]
    num_decodes: int
    logit_rows: list[int]
    copies: list[tuple[int, int]]
    # Prompt logprobs: rows that score the next prompt token, that token, the top k asked.
    score_rows: list[int] = field(default_factory=list)
    score_ids: list[int] = field(default_factory=list)
    score_top: list[int] = field(default_factory=list)
    # Layer groups 1.. (kv.groups): their slots and tables (slots and tables above: group 0's).
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)
    lora_rows: dict[int, list[int]] = field(default_factory=dict)   # adapter id -> its rows (enable_lora)
    # Under tensor parallelism: adapters placed or evicted since the last broadcast, in order:
    # ("load", id, pages, its LoRARequest) / ("evict", id); every rank places its own slice.
    adapter_events: list[tuple] = field(default_factory=list)


@dataclass(slots=True)
class RowRoles:
    """What rank 0 does with the step's logits rows."""
    sample: list = field(default_factory=list)              # (logits row, [SampleTarget]) that sample
    checks: list[Verify] = field(default_factory=list)      # drafts to verify
    scored: list[tuple[int, int, int]] = field(default_factory=list)   # (seq id, prompt tokens scored, top k)
    embeds: list[tuple[int, int]] = field(default_factory=list)        # (logits row, seq id) asking an embedding


def step_inputs(plan: StepPlan) -> tuple[StepInputs, RowRoles]:
    """The step's inputs, and its rows' roles (scored in the order of StepInputs.score_rows)."""
    # Single-token queries first, shortest context first: they attend in padded
    # groups of similar length. Chunks with no keys before them last: the CPU backend may
    # run that tail of the step apart (attention/fresh_prefill.py).
    order = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.start == 0, c.start))
    more = len(order[0].groups) if order else 0   # layer groups 1..
    step = StepInputs([], [], [], [c.block_ids for c in order], [c.end for c in order], [0],
                      sum(1 for c in order if c.num_tokens == 1), [], plan.copies,
                      group_slots=[[] for _ in range(more)], group_tables=[[] for _ in range(more)])
    roles = RowRoles()
    for c in order:
        base = len(step.ids)
        step.ids.extend(c.token_ids)
        step.positions.extend(range(c.start, c.end))
        step.slots.extend(c.slots)
        for g, (sl, bt) in enumerate(c.groups):
            step.group_slots[g].extend(sl)
            step.group_tables[g].append(bt)
        end = len(step.ids)
        step.q_starts.append(end)
        if c.lora_id:
            step.lora_rows.setdefault(c.lora_id, []).extend(range(base, end))
        if c.draft:  # a speculating decode: its last len(draft) + 1 rows verify
            roles.checks.append(Verify(len(step.logit_rows), c.samples[0], c.draft))
            step.logit_rows.extend(range(end - len(c.draft) - 1, end))
        elif c.samples:
            if c.samples[0].params.embed:
                roles.embeds.append((len(step.logit_rows), c.samples[0].seq_id))
            roles.sample.append((len(step.logit_rows), c.samples))
            step.logit_rows.append(end - 1)
        if c.score_ids:
            first = base + c.score_start - c.start
            step.score_rows.extend(range(first, first + len(c.score_ids)))
            step.score_ids.extend(c.score_ids)
            step.score_top.extend([c.score_top] * len(c.score_ids))
            roles.scored.append((c.seq_id, len(c.score_ids), c.score_top))
    return step, roles


def group_metas(backend: AttentionBackend, layout: KVLayout, mc: ModelConfig, step: StepInputs,
                slots: list[list[int]], num_rows: int, block_size: int, device) -> list:
    """Each layer group's step metadata: the attention backend's for a K/V group (its slots and
    tables), the state layers' (state_steps, built once for every state group) for a state group.
    slots: each group's, padded to num_rows."""
    tables = [step.tables, *step.group_tables]
    state = [t for t, holds in zip(tables, layout.kinds) if holds == STATE]
    states = iter(state_steps(state, step.seq_lens, step.q_starts, num_rows, block_size, mc.conv_kernel, device,
                              mc.state_scans) if state else ())
    return [backend.build_metadata(StepLayout(sl, t, step.seq_lens, step.q_starts, step.num_decodes), device)
            if holds == KV else next(states)
            for sl, t, holds in zip(slots, tables, layout.kinds)]
