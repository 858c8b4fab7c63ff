"""A model-free engine: a byte-level tokenizer built in memory, and a fake runner whose "model"
reads its context through the paged KV cache.

The fake runner keeps a KV store keyed by slot: each step it carries out the plan's block
copies, writes every chunk token's (token id, position) into its slots, in every layer
group's blocks, and then computes each sampling row's next token from the context it reads
back through the chunk's block tables (a windowed group: the last W positions only). A read
of a slot that holds another position or nothing fails the step. So a scheduler or KV bug
(a wrong slot, a stale block, a lost copy-on-write, a released block still read) changes the
tokens or fails loudly, while a correct engine gives exactly `reference()`'s tokens, alone,
in a batch, after preemption, with prefix hits, speculation or forks.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import xxhash
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.kv import KVLayout, kv_layout
from pagedllm.models import ModelConfig
from pagedllm.outputs import Logprob
from pagedllm.plan import ChunkPlan, PromptScores, SampleTarget, StepPlan, StepResult

SPECIALS = ["<s>", "</s>", "<unk>"]
BOS, EOS = 0, 1
VOCAB = 256 + len(SPECIALS)
TOP = 8            # candidates the fake model ranks per row


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Every byte a token (GPT-2's byte-to-unicode alphabet), plus <s>, </s> and <unk>: real
    detokenization (a character split over bytes, a leading space) with no file."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_bos_token = True
    return fast


def _byte_of(c: str) -> int:
    """The byte GPT-2's alphabet maps to character c."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(c))]


def model_config(layer_windows: tuple[int, ...] = (0, 0), max_len: int = 8192) -> ModelConfig:
    n = len(layer_windows)
    return ModelConfig("llama", 64, n, 4, 2, 16, 128, VOCAB, 1e-6, 10000.0, None, max_len, False, False,
                       eos_token_ids=(EOS,), sliding_window=max(layer_windows) or None,
                       layer_windows=layer_windows if any(layer_windows) else ())


def candidates(context: tuple[int, ...], num_prompt: int = 0) -> list[tuple[int, float]]:
    """The fake model's ranked next tokens with their logprobs, from its whole context (for a
    window group: what the window reads). Distinct tokens, best first, EOS among them at times."""
    h = xxhash.xxh3_64_intdigest(repr(context).encode())
    toks, i = [], 0
    while len(toks) < TOP:
        t = (h >> (i % 48)) % VOCAB if i < 48 else (h + i * 7919) % VOCAB
        t = t if t not in (BOS,) else EOS
        if t not in toks:
            toks.append(t)
        i += 1
    weights = [math.exp(-0.7 * r) for r in range(TOP)]
    z = math.log(sum(weights) + 1.0)   # the rest of the vocabulary holds the other mass
    return [(t, math.log(w) - z) for t, w in zip(toks, weights)]


def next_token(contexts: tuple[tuple[int, ...], ...], target: SampleTarget, rng: random.Random | None) -> tuple[int, list]:
    cands = candidates(contexts)
    if target.params.min_tokens > target.num_output_tokens:   # as the real sampler: no EOS before min_tokens
        cands = [c for c in cands if c[0] != EOS]
    if target.params.temperature == 0 or rng is None:
        return cands[0][0], cands
    ws = [math.exp(lp / target.params.temperature) for _, lp in cands[:4]]
    return rng.choices([t for t, _ in cands[:4]], weights=ws)[0], cands


def windows_of(layout: KVLayout) -> list[int]:
    return [g.window for g in layout.groups]


def contexts_at(tokens: list[int], end: int, windows: list[int]) -> tuple[tuple[int, ...], ...]:
    """What each layer group's queries at position end - 1 read: every token, or the last W."""
    return tuple(tuple(tokens[max(0, end - w) if w else 0:end]) for w in windows)


def reference(prompt: list[int], max_tokens: int, layer_windows: tuple[int, ...] = (0, 0),
              min_tokens: int = 0, stop_ids: tuple[int, ...] = (EOS,)) -> list[int]:
    """Greedy output of the fake model, computed on plain token lists (no KV, no engine)."""
    from pagedllm.sampling_params import SamplingParams

    windows = windows_of(kv_layout(layer_windows))
    toks = list(prompt)
    out: list[int] = []
    params = SamplingParams(temperature=0, min_tokens=min_tokens, max_tokens=max_tokens)
    while len(out) < max_tokens:
        t = SampleTarget(0, params, 0, toks, len(prompt))
        tok, _ = next_token(contexts_at(toks, len(toks), windows), t, None)
        toks.append(tok)
        out.append(tok)
        if tok in stop_ids and len(out) >= min_tokens:
            break
    return out


@dataclass
class FakeRunner:
    """The engine's Runner interface (engine.runner_api) over a KV store of (token, position)."""
    num_blocks: int = 256
    block_size: int = 16
    layer_windows: tuple[int, ...] = (0, 0)
    bytes_per_layer_token: int = 128
    eos_token_ids: frozenset[int] = frozenset({EOS})
    store: dict[int, tuple[int, int]] = field(default_factory=dict)
    generators: dict[int, random.Random] = field(default_factory=dict)
    fail_next: dict[int, str] = field(default_factory=dict)   # seq id -> error for its next sample
    steps: int = 0
    kv_dtype_name: str = "float32"
    loras: object = None   # engine.runner_api: adapters in host memory (lora.registry.AdapterCache), or None
    placed: dict[int, list[int]] = field(default_factory=dict)   # adapter id -> the pool pages written
    adapters_run: list[set[int]] = field(default_factory=list)    # each step's adapter ids

    def __post_init__(self) -> None:
        self.kv_layout = kv_layout(self.layer_windows)
        self.windows = windows_of(self.kv_layout)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_layer_token * len(self.layer_windows)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_layer_token * self.kv_layout.layers_per_block * self.block_size

    @property
    def weights(self):
        from types import SimpleNamespace
        return SimpleNamespace(resident=0, active=0)   # no model

    def describe(self) -> str:
        return "fake runner (KV of token ids)"

    def reset_sequences(self) -> None:
        self.generators.clear()

    def move_blocks(self, plan: StepPlan) -> None:
        self._place(plan)

    def _place(self, plan: StepPlan) -> None:
        """Adapters' pages as the plan places and evicts them; a chunk runs only under one placed,
        in pages no sequence's table holds."""
        for a in plan.adapter_evictions:
            self.placed.pop(a, None)
        self.placed.update(plan.adapter_loads)
        used = {c.lora_id for c in plan.chunks if c.lora_id}
        for c in plan.chunks:
            assert not c.lora_id or c.lora_id in self.placed, f"seq {c.seq_id}: adapter {c.lora_id} not placed"
            for a in used:
                assert not set(self.placed[a]) & set(c.block_ids), f"seq {c.seq_id}'s table holds adapter pages"
        if used:
            self.adapters_run.append(used)

    def write_blocks(self, pairs) -> None:
        pass

    def attach_tier(self, *args):
        raise ValueError("the fake runner has no KV tier")

    # -- a step ------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        self._place(plan)
        for seq_id in plan.finished_seq_ids:
            self.generators.pop(seq_id, None)
        B = self.block_size
        for src, dst in plan.copies:
            for off in range(B):
                got = self.store.get(src * B + off)
                if got is not None:
                    self.store[dst * B + off] = got
                else:
                    self.store.pop(dst * B + off, None)
        for c in plan.chunks:
            for slots in [c.slots] + [sl for sl, _ in c.groups]:
                for j, (tok, slot) in enumerate(zip(c.token_ids, slots)):
                    if slot >= 0:
                        self.store[slot] = (tok, c.start + j)
        res = StepResult()
        for c in plan.chunks:
            self._sample(c, res)
        return res

    def _read(self, c: ChunkPlan, end: int) -> tuple[tuple[int, ...], ...]:
        """Each group's context for the query at position end - 1, read through its table."""
        B, out = self.block_size, []
        tables = [c.block_ids] + [bt for _, bt in c.groups]
        for w, table in zip(self.windows, tables):
            ctx = []
            for p in range(max(0, end - w) if w else 0, end):
                b = table[p // B]
                assert b >= 0, f"seq {c.seq_id}: position {p} read through a released table entry"
                got = self.store.get(b * B + p % B)
                assert got is not None and got[1] == p, f"seq {c.seq_id}: slot of position {p} holds {got}"
                ctx.append(got[0])
            out.append(tuple(ctx))
        return tuple(out)

    def _sample(self, c: ChunkPlan, res: StepResult) -> None:
        if c.score_ids:
            res.prompt_logprobs[c.seq_id] = self._score(c)
        if not c.samples:
            return
        if c.draft:   # verify: accept drafts while they are the model's own greedy tokens
            t = c.samples[0]
            n = len(c.token_ids) - len(c.draft)
            accepted = []
            for i, d in enumerate(c.draft):
                tok, _ = next_token(self._read(c, c.start + n + i), t, None)
                if tok != d:
                    break
                accepted.append(d)
            tok, _ = next_token(self._read(c, c.start + n + len(accepted)), t, None)
            res.accepted[t.seq_id], res.tokens[t.seq_id] = accepted, tok
            self._propose(t, accepted + [tok], res)
            return
        ctx = self._read(c, c.end)
        for t in c.samples:
            if t.seq_id in self.fail_next:
                res.errors[t.seq_id] = self.fail_next.pop(t.seq_id)
                continue
            rng = self.generators.setdefault(t.seq_id, random.Random(t.seed))
            tok, cands = next_token(ctx, t, rng if t.params.temperature else None)
            if t.beam_candidates:
                res.logprobs[t.seq_id] = {tid: Logprob(lp, r + 1) for r, (tid, lp) in
                                          enumerate(candidates(ctx)[:t.beam_candidates])}
                continue
            res.tokens[t.seq_id] = tok
            k = t.params.logprobs
            if k is not None or t.params.ranks_samples:
                entry = {tok: Logprob(dict(cands).get(tok, -20.0), [x for x, _ in cands].index(tok) + 1
                                      if tok in dict(cands) else TOP + 1)}
                for r, (tid, lp) in enumerate(cands[:k or 0]):
                    entry.setdefault(tid, Logprob(lp, r + 1))
                res.logprobs[t.seq_id] = entry
            self._propose(t, [tok], res)

    def _propose(self, t: SampleTarget, new: list[int], res: StepResult) -> None:
        """Drafts for the next step: the model's own next tokens, every third one wrong (so
        some are accepted and some rolled back)."""
        if not t.num_spec:
            return
        toks = list(t.token_ids) + new
        drafts = []
        for i in range(t.num_spec):
            tok, _ = next_token(contexts_at(toks, len(toks), self.windows), t, None)
            tok = tok if (len(toks) + i) % 3 else (tok + 1) % VOCAB
            drafts.append(tok)
            toks.append(tok)
        res.drafts[t.seq_id] = drafts

    def _score(self, c: ChunkPlan) -> PromptScores:
        k = c.score_top
        out = PromptScores(k)
        for i, want in enumerate(c.score_ids):
            pos = c.score_start + i          # the row at pos scores the token at pos + 1
            cands = candidates(self._read(c, pos + 1))
            lps = dict(cands)
            out.logprobs.append(lps.get(want, -20.0))
            out.ranks.append([t for t, _ in cands].index(want) + 1 if want in lps else TOP + 1)
            for r in range(k):
                tid, lp = cands[r] if r < len(cands) else (0, -30.0)
                out.top_ids.append(tid)
                out.top_logprobs.append(lp)
        return out


def fake_engine(layer_windows: tuple[int, ...] = (0, 0), num_blocks: int = 256, loras=None, **cfg):
    """An LLMEngine over a FakeRunner: the real scheduler, KV manager, stops, outputs.
    loras: its adapters in host memory (lora.registry.AdapterCache over fake adapters)."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine

    block_size = cfg.pop("block_size", 16)
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, layer_windows=layer_windows, loras=loras)
    mc = model_config(layer_windows, cfg.pop("max_position_embeddings", 8192))
    return LLMEngine(EngineConfig(model="fake", block_size=block_size, **cfg), runner=runner, model_cfg=mc,
                     tokenizer=byte_tokenizer())


def run(engine, prompts, params) -> list:
    """Every prompt to the end (offline, as LLM.generate), outputs in prompt order."""
    ids = [engine.add_request(None, p, sp).request_id for p, sp in zip(prompts, params)]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
        engine.kv.check_integrity()
    return [done[i] for i in ids]
