"""Sliding-window attention end to end, on tiny random models built here (window 32, blocks
of 16, fp32): greedy tokens equal HF transformers' (checked to differ from the same weights
without a window, so the window is really applied), sequences release the blocks below their
window as they run, a prefix hit that lacks blocks no query reads is exact, speculative
rollbacks and n > 1 forks keep what their queries read, and a model with some full-attention
layers masks each layer by its own window and keeps every block."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from hf_greedy import hf_greedy

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.kv.block_table import RELEASED
from pagedllm.models import ModelConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.util import cdiv

W, B, CHUNK, GEN = 32, 16, 32, 20
HOLD = cdiv(W - 1 + CHUNK, B) + 1  # the most blocks a sequence holds at once: its window and a step's chunk
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Three windows long, and one not a whole number of blocks (its last block is partial).
PROMPTS = [_prompt(1, 3 * W), _prompt(2, 3 * W - 6)]


def _sharpen(model) -> None:
    """Attention dominates the residual stream and the logits are sharp: the window shows in
    the tokens, and greedy has no near-ties for float rounding to break differently."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for layer in model.model.layers:
            for proj, k in (("q_proj", 3), ("k_proj", 3), ("v_proj", 6), ("o_proj", 6)):
                getattr(layer.self_attn, proj).weight.mul_(k)


def _build(tmp_path_factory, model_dir, name: str, cfg):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    _sharpen(model)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)  # any tokenizer with the same vocabulary will do
    return model, str(out)


def _without_window(model):
    """The same weights with full attention in every layer."""
    cfg = copy.deepcopy(model.config)
    cfg.sliding_window = None
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    full = type(model)(cfg).eval()
    full.load_state_dict(model.state_dict())
    return full


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """Each prompt token's logprob given the tokens before it (from the second on)."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, t].item() for i, t in enumerate(ids) if i]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, model_dir):
    import transformers as tf

    model, path = _build(tmp_path_factory, model_dir, "mistral-w32", tf.MistralConfig(**BASE, sliding_window=W))
    return model, path, _windowed_greedy(model)


def _windowed_greedy(model) -> list[list[int]]:
    """HF's greedy tokens for PROMPTS, checked to differ from the same weights' without a window."""
    want = [hf_greedy(model, p, GEN) for p in PROMPTS]
    full = _without_window(model)
    assert any(w != hf_greedy(full, p, GEN) for w, p in zip(want, PROMPTS)), \
        "HF's tokens do not depend on the window: these tests could not fail"
    return want


def engine(path: str, backend: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="float32", block_size=B, attention_backend=backend,
                                  max_num_batched_tokens=CHUNK, **{"kv_cache_memory": "8MiB", **kw}))


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, each_step=None) -> list:
    reqs = [eng.add_request(None, p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if each_step is not None:
            each_step(eng)
    return [done[r.request_id] for r in reqs]


def held_within_window(eng: LLMEngine) -> None:
    """Between steps every running sequence holds at most the blocks of its window and one
    step's tokens, and what it released lies below the window of its next query."""
    kv = eng.kv
    for seq in eng.scheduler.running:
        t = kv.block_table(seq.seq_id)
        assert len(t.held) <= HOLD, (seq.seq_id, t.block_ids)
        assert t.num_released <= kv.first_window_block(seq.num_computed_tokens)
    assert kv.pool.num_used <= len(eng.scheduler.running) * HOLD
    kv.check_integrity()


def test_mistral_window_matches_hf_and_releases_blocks(mistral, window_backend):
    """Chunked prefill over three windows, then decodes; n = 2 forks off a prompt whose early
    blocks are released already (and copies its partial last block on write)."""
    _, path, want = mistral
    eng = engine(path, window_backend)
    assert eng.kv.groups[0].window == W and eng.max_model_len == BASE["max_position_embeddings"]
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    outs = run(eng, PROMPTS, greedy, held_within_window)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Each released every block below the window of its last query (at len + GEN - 2): 5 of
    # its 8 logical blocks, 4 of 7; at most HOLD (5) blocks at once.
    assert eng.kv.stats().window_released == sum(eng.kv.first_window_block(len(p) + GEN - 2) for p in PROMPTS) == 9
    assert eng.peak_used_blocks <= 2 * HOLD
    (pair,) = run(eng, PROMPTS[1:], SamplingParams(n=2, temperature=0, max_tokens=GEN, ignore_eos=True),
                  held_within_window)
    assert [c.token_ids for c in pair.outputs] == [want[1]] * 2
    assert eng.kv.stats().cow_copies >= 1 and eng.kv.stats().forks >= 1
    eng.kv.check_integrity()
    assert eng.kv.pool.num_used == 0


def test_visualizer_events_rebuild_windowed_tables(mistral):
    """The visualizer's event stream carries the window's releases: replaying it rebuilds
    the manager's tables (-1 entries included), ref counts and cache marks every step."""
    from pagedllm.viz.hub import VizHub
    from pagedllm.viz.state import KVReplay, kv_picture

    _, path, _ = mistral
    eng = engine(path, "torch")
    hub = VizHub(eng)
    eng.observers.append(hub)
    hub.start_recording()
    assert hub.recording[0]["config"]["sliding_window"] == W

    def replayed(eng: LLMEngine) -> None:
        msgs = hub.recording
        r = KVReplay.from_picture(msgs[0])
        for m in msgs[1:]:
            for ev in m.get("kv", []):
                r.apply(ev)
        assert r.picture() == kv_picture(eng.kv)

    run(eng, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), replayed)
    trace = hub.stop_recording()
    assert any(ev["type"] == "slide" for m in trace for ev in m.get("kv", []))
    assert trace[-1]["figures"]["window_released"] == eng.kv.stats().window_released > 0


def test_prefix_hits_under_the_window_are_exact(mistral, window_backend):
    """Requests sharing a long prefix with an earlier one get what a cold run gives:
    - with prompt logprobs (kept beside the cached blocks), its rows up to the last kept one
      are recomputed rather than re-read over the hit (their windows need keys a window hit
      may lack), from the block boundary before it;
    - after a filler evicted the first request's earliest blocks, a hit that lacks them
      (no query of the new request reads them) still serves the whole shared prefix.
    That a hit never lacks a block some query reads is the manager's rule (tests/kv)."""
    hf, path, _ = mistral
    eng = engine(path, window_backend, kv_cache_memory=None, num_gpu_blocks_override=12)
    first = PROMPTS[0]
    scored = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    run(eng, [first], scored)
    again = first + _prompt(3, 10)
    (out,) = run(eng, [again], scored)
    assert out.num_cached_tokens == len(first) - B  # the kept scores end one token short of the hit
    assert out.outputs[0].token_ids == hf_greedy(hf, again, 8)
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], again[1:])]
    assert got == pytest.approx(hf_prompt_logprobs(hf, again), abs=2e-4)

    run(eng, [_prompt(4, 7 * B)], SamplingParams(temperature=0, max_tokens=1))  # evicts the oldest blocks
    shared = first + _prompt(5, 10)
    hit = eng.kv.lookup_prefix(shared)
    assert hit[0] == RELEASED and len(hit) * B > 2 * W, hit  # a deep hit, its first blocks gone
    assert RELEASED not in hit[eng.kv.first_window_block(len(hit) * B):]
    (out,) = run(eng, [shared], SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True), held_within_window)
    assert out.num_cached_tokens == len(hit) * B
    assert out.outputs[0].token_ids == hf_greedy(hf, shared, GEN)


def test_speculative_rollback_keeps_the_window(mistral, window_backend):
    """N-gram drafts over a repetitive prompt, some rejected: the window releases relative
    to each step's first query, so the queries re-run after a rollback still find every key
    they read; greedy tokens are HF's."""
    hf, path, _ = mistral
    eng = engine(path, window_backend, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = _prompt(5, 24) * 4
    (out,) = run(eng, [prompt], SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True), held_within_window)
    spec = eng.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec  # accepted ones, and rollbacks
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GEN)
    assert eng.kv.stats().window_released > 0


@pytest.fixture(scope="module")
def qwen2_pattern(tmp_path_factory, model_dir):
    import transformers as tf

    cfg = tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=W, max_window_layers=1)
    hf, path = _build(tmp_path_factory, model_dir, "qwen2-pattern", cfg)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    return path, _windowed_greedy(hf), hf


def test_layer_pattern_masks_each_layer_and_frees_the_windowed_groups_blocks(qwen2_pattern, window_backend):
    """Qwen2 with use_sliding_window and max_window_layers 1: layer 0 full, layer 1 windowed
    (HF's layer_types). Each layer masks by its own window; the KV cache has a group per
    attention type (a block holds one layer): the windowed group releases the blocks below
    its window while the full group keeps every one, and the tokens are still HF's."""
    path, want, _ = qwen2_pattern
    eng = engine(path, window_backend)
    assert eng.model_cfg.layer_windows == (0, W) and [g.window for g in eng.kv.groups] == [0, W]

    def check(e):
        for seq in e.scheduler.running:
            assert len(e.kv.block_table(seq.seq_id, 1).held) <= HOLD
            full = e.kv.block_table(seq.seq_id, 0)
            assert len(full.held) == cdiv(full.num_tokens, B)
        e.kv.check_integrity()
    outs = run(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True), check)
    assert [o.outputs[0].token_ids for o in outs] == want
    st = eng.kv.stats()
    assert st.groups[1].released > 0 and st.groups[0].released == 0


def test_the_disk_tier_loads_only_what_the_windows_read(qwen2_pattern, tmp_path):
    """Layer groups through the second tier: engine A writes each group's blocks under its own
    keys; engine B, a fresh pool on the same folder, serves a longer prompt's shared 96 tokens
    from disk, loading all six of the full group's blocks but only the windowed group's last
    two (first_window_block(96) = 4: no query of B reads below it), to HF's tokens."""
    path, _, hf = qwen2_pattern
    a = engine(path, "cpu", kv_offload_dir=str(tmp_path))
    run(a, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1))
    a.kv.connector.store.flush()
    a.close()
    b = engine(path, "cpu", kv_offload_dir=str(tmp_path))
    longer = PROMPTS[0] + _prompt(6, 10)
    (out,) = run(b, [longer], SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_greedy(hf, longer, GEN)
    f = b.kv.connector.figures()
    assert f.hits == 6 * B and f.loaded_blocks == 6 + 2 and out.num_cached_tokens == 6 * B
    b.kv.check_integrity()
    b.close()


def test_half_windowed_layers_hold_the_formulas_blocks_over_a_4k_token_generation(tmp_path_factory, model_dir):
    """A Qwen2-shaped random-weight model with windows on half its layers (max_window_layers 2
    of 4, W = 512), block size 16: a sequence growing to 4,096 tokens holds, after each decode
    step with n tokens computed, exactly kv.groups.held_blocks((0, W), n, B) =
    ceil(n / B) + ceil(n / B) - (n - W) // B blocks of one group's layers, where full
    attention in every layer would hold 2 ceil(n / B): 2 x 256 against 256 + 33 at the end."""
    import transformers as tf

    from pagedllm.kv.groups import held_blocks

    window, prompt_len, total = 512, 2048, 4096
    cfg = tf.Qwen2Config(**{**BASE, "num_hidden_layers": 4, "max_position_embeddings": total},
                         use_sliding_window=True, sliding_window=window, max_window_layers=2)
    _, path = _build(tmp_path_factory, model_dir, "qwen2-half-windowed", cfg)
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=B, kv_cache_memory="16MiB",
                                 max_num_batched_tokens=512))
    assert [g.window for g in eng.kv.groups] == [0, window] and eng.runner.kv_layout.layers_per_block == 2
    eng.add_request(None, _prompt(3, prompt_len), SamplingParams(max_tokens=total - prompt_len, ignore_eos=True))
    seen = 0
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            n = seq.num_computed_tokens
            if n > prompt_len:   # a decode step: its one query at n - 1
                assert eng.kv.pool.num_used == held_blocks((0, window), n, B), n
                seen += 1
    assert seen == total - prompt_len - 2   # every decode step but the last (it finishes the sequence)
    n = total - 1
    assert held_blocks((0, window), n, B) == 256 + 256 - (n - window) // B == 256 + 33
    assert held_blocks((0, window), n, B) < held_blocks((0, 0), n, B) == 2 * 256
    st = eng.stats()
    assert st.kv.groups[1].released == (n - window) // B and st.kv.pool.used_blocks == 0


def test_layer_windows_from_hf_configs():
    """Which layers are windowed, as transformers reads each config; what we cannot run is
    refused naming the field."""
    base = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    of = lambda **kw: ModelConfig.from_hf({**base, **kw})  # noqa: E731
    assert of(model_type="mistral", sliding_window=4096).layer_windows == (4096,) * 3
    assert of(model_type="mistral", sliding_window=None).layer_windows == ()
    assert of(model_type="qwen2", sliding_window=64, max_window_layers=1).layer_windows == ()  # use_sliding_window off
    m = of(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert m.layer_windows == (0, 64, 64) and m.kv_window == 0 and m.sliding_window == 64
    m = of(model_type="qwen2", use_sliding_window=True, sliding_window=64,
           layer_types=["sliding_attention"] * 3)
    assert m.kv_window == 64 and [m.window(i) for i in range(3)] == [64] * 3
    assert of(model_type="llama", sliding_window=64).layer_windows == ()
    with pytest.raises(ValueError, match="layer_types"):
        of(model_type="qwen2", use_sliding_window=True, sliding_window=64,
           layer_types=["chunked_attention", "full_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        of(model_type="qwen2", use_sliding_window=True, sliding_window=64, layer_types=["full_attention"])
