"""Engine behaviour on the real model: parallel sampling with shared blocks, seeds,
stops, chunked prefill, reserve-max, aborts, and bad input that disturbs nobody."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams

PROMPT = ("The old librarian kept every book in loose-leaf envelopes, so that readers of the same "
          "chapters could share the same pages. One morning a curious student asked her why")


def run_to_completion(engine, limit=2000):
    done = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done += engine.step()
    raise AssertionError("engine did not finish")


def test_parallel_sampling_shares_prompt_blocks(llm_fp32):
    engine = llm_fp32.engine
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    req = engine.add_request("n4", PROMPT, params)
    while req.seqs[0].num_output_tokens == 0:
        engine.step()
    tables = [engine.kv.block_table(s.seq_id).block_ids for s in req.seqs]
    n_prompt = len(req.prompt_token_ids)
    full = n_prompt // 16
    assert full >= 2
    for t in tables[1:]:
        assert t[:full] == tables[0][:full], "samples must share the prompt's full blocks"
    st = engine.kv.stats()
    assert n_prompt % 16, "the prompt should end in a partial block, to exercise copy-on-write"
    assert st.blocks_without_sharing == 4 * -(-n_prompt // 16)
    assert st.used_blocks == -(-n_prompt // 16), "four samples, one copy of the prompt"
    cow_before = st.cow_copies
    outs = run_to_completion(engine)
    texts = [c.token_ids for c in outs[0].outputs]
    assert len(texts) == 4 and len(set(map(tuple, texts))) > 1, "samples should differ"
    assert engine.kv.stats().cow_copies - cow_before >= 3, "3 of 4 samples copy the shared partial block"
    # The same seed gives the same four continuations.
    again = llm_fp32.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == texts
    assert engine.kv.pool.num_used == 0


def test_seed_reproducible_regardless_of_batch(llm_fp32):
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm_fp32.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8)
    batch = llm_fp32.generate(["Hello there", PROMPT, "Numbers: 1 2 3"], [others, p, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_stop_conditions(llm_fp32):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = llm_fp32.generate(["1, 2, 3, 4,"], greedy, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    stop_at = base.text[4:8]
    out = llm_fp32.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=30, stop=[stop_at]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert stop_at not in out.text and base.text.startswith(out.text)
    tok = base.token_ids[5]
    out = llm_fp32.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok and len(out.token_ids) <= 6


def test_chunked_prefill_same_as_whole(make_llm, tiny_fp32, tiny_model):
    long_prompt = " ".join(f"item {i} costs {i * 3} coins;" for i in range(60))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = tiny_fp32.generate([long_prompt], p, use_tqdm=False)[0]
    chunked = make_llm(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=48,
                  enable_prefix_caching=False)
    assert len(whole.prompt_token_ids) > 3 * 48
    out = chunked.generate([long_prompt, "Hi"], p, use_tqdm=False)
    assert out[0].outputs[0].token_ids == whole.outputs[0].token_ids
    assert chunked.get_stats().steps > len(whole.prompt_token_ids) // 48


def test_reserve_max_same_tokens_more_waste(make_llm, tiny_model):
    prompts = [PROMPT, "Hello, my name is", "The weather today"]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(model=tiny_model, dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    paged = make_llm(**kw)
    reserve = make_llm(allocation="reserve-max", **kw)
    a = paged.generate(prompts, p, use_tqdm=False)
    b = reserve.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    sa, sb = paged.get_stats(), reserve.get_stats()
    assert sb.peak_used_blocks == 3 * 16 and sa.peak_used_blocks <= 8
    assert sb.peak_waste > 0.7 > sa.peak_waste


def test_abort_frees_blocks(llm_fp32):
    engine = llm_fp32.engine
    engine.add_request("to-abort", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort_request("to-abort")
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()
    engine.kv.check_integrity()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(top_k=-3), "top_k"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_do_not_disturb_others(llm_fp32):
    engine = llm_fp32.engine
    good = engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad1", "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad2", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad3", [5] * 3000, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad4", PROMPT, SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad5", [1, 2, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1"):
        llm_fp32.generate([PROMPT, ""], SamplingParams(), use_tqdm=False)
    outs = run_to_completion(engine)
    assert [o.request_id for o in outs] == ["good"]
    assert len(outs[0].outputs[0].token_ids) == 12 and good.finished
    assert engine.kv.pool.num_used == 0
    engine.kv.check_integrity()


def test_request_larger_than_pool_rejected(make_llm):
    llm = make_llm(dtype="float32", num_gpu_blocks_override=4, max_model_len=512)
    with pytest.raises(ValueError, match="whole pool"):
        llm.generate([PROMPT], SamplingParams(max_tokens=100), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 4


def test_chat_applies_template(llm_fp32):
    out = llm_fp32.chat([{"role": "user", "content": "Say hello."}],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "<|im_start|>assistant" in out.prompt and out.outputs[0].text
    with pytest.raises(ValueError, match="role"):
        llm_fp32.chat([{"role": "wizard", "content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="messages"):
        llm_fp32.chat([], use_tqdm=False)


def test_async_engine_survives_a_failing_step(llm_fp32):
    """An internal error fails the requests in flight, not the engine."""
    import asyncio

    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = llm_fp32.engine
    aeng = AsyncLLMEngine(engine, log_interval=1000)
    real_step = engine.core_step  # what the engine-core loop runs
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    engine.core_step = flaky_step
    try:
        async def run(rid):
            outs = [o async for o in aeng.generate(rid, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))]
            return outs[-1]

        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(run("a"))
        out = asyncio.run(run("b"))
        assert out.finished and len(out.outputs[0].token_ids) == 5 and aeng.alive
        assert engine.kv.pool.num_used == 0
    finally:
        engine.core_step = real_step
        aeng.shutdown()
        engine.stream_outputs = False


def test_max_num_seqs_counts_parallel_samples(make_llm):
    llm = make_llm(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("a", "Hello there", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    engine.add_request("b", "General Kenobi", SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak <= 4, "a request's forks count against max_num_seqs"
    assert engine.kv.pool.num_used == 0


def test_one_request_failing_inside_a_step_fails_alone(llm_fp32, monkeypatch):
    """A fault in one request's sampling or stop check (injected: nothing known triggers
    one now) ends that request only; the batch's others finish as they would alone."""
    import pagedllm.runtime.sampler as sampler

    engine = llm_fp32.engine
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)
    alone = llm_fp32.generate([PROMPT, "Name three colors."], params, use_tqdm=False)
    real = sampler._sample_batch

    bad: set[int] = set()  # seq ids of the request whose sampling fails

    def faulty(logits, rows, kernels, gens):
        if any(seq.seq_id in bad for seqs in rows for seq in seqs):
            raise FloatingPointError("injected")
        return real(logits, rows, kernels, gens)
    monkeypatch.setattr(sampler, "_sample_batch", faulty)
    engine.add_request("ok-1", PROMPT, params)
    bad.update(s.seq_id for s in engine.add_request("bad-sample", "Tell me a story.", params).seqs)
    engine.add_request("ok-2", "Name three colors.", params)
    engine.add_request("bad-stop", "Hello", SamplingParams(max_tokens=10, stop=["zzz"], temperature=0))
    monkeypatch.setattr(engine.processor, "_check_stop_strings",
                        _failing_for("bad-stop", engine.processor._check_stop_strings))
    outs = {o.request_id: o for o in run_to_completion(engine)}
    for rid in ("bad-sample", "bad-stop"):
        assert outs[rid].outputs[0].finish_reason == "error" and outs[rid].error, rid
    assert "injected" in outs["bad-sample"].error
    assert outs["ok-1"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs["ok-2"].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert engine.kv.pool.num_used == 0
    engine.kv.check_integrity()


def _failing_for(rid, check):
    def wrapped(seq, n):
        if seq.request.request_id == rid:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return check(seq, n)
    return wrapped


def test_tiny_temperature_and_top_p_are_well_defined():
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(top_p=5e-324).top_p > 0
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
                dict(n=True), dict(seed=2**80)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_long_prefill_leaves_room_for_decodes_and_short_prompts(make_llm):
    llm = make_llm(dtype="float32", kv_cache_memory="64MiB", max_model_len=2048, max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.scheduler.long_prefill_token_threshold == 64
    engine.add_request("decoding", "Hi", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("long-1", [7] * 1000, SamplingParams(max_tokens=1))
    engine.add_request("long-2", [8] * 1000, SamplingParams(max_tokens=1))
    engine.add_request("short", "Hello there", SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    got = {s.seq.request.request_id: s.num_tokens for s in out.scheduled}
    # one long prompt at a time, 64 tokens a step; the short one jumps the waiting long one
    assert got == {"decoding": 1, "long-1": 64, "short": len(engine.tokenizer.encode("Hello there"))}
    assert [s.request.request_id for s in engine.scheduler.waiting] == ["long-2"]
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert engine.kv.pool.num_used == 0


# -- vLLM compatibility (issue 13): names, stable seeds, special tokens, cache_salt --------
def test_served_model_name_is_the_whole_name():
    from pagedllm.loader import DEFAULT_MODEL_NAME, served_model_name

    assert served_model_name("/models/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"
    assert served_model_name("/models/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"
    assert served_model_name("~/w/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_model_name("Mistral-7B-v0.3") == "Mistral-7B-v0.3"
    assert served_model_name(None) == DEFAULT_MODEL_NAME


_SEED_SCRIPT = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[2], dtype="float32", kv_cache_memory="64MiB", max_model_len=256, seed=int(sys.argv[1]))
p = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
outs = llm.generate(["Once upon a time", "Once upon a time"], p, use_tqdm=False)
print(json.dumps([o.outputs[0].text for o in outs]))
"""


def test_engine_seed_reproduces_sampling_in_a_new_process(tiny_model):
    import json
    import os
    import subprocess
    import sys

    def run(seed: int) -> list[str]:
        # A fresh hash salt per process, as a real second run has.
        env = {**os.environ, "PYTHONHASHSEED": "random"}
        out = subprocess.run([sys.executable, "-c", _SEED_SCRIPT, str(seed), tiny_model], capture_output=True, text=True,
                             env=env, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(3), run(3)
    assert first == second, "the same --seed must give the same samples in a new process"
    assert first[0] != first[1], "two requests of one run get different default seeds"


def test_completion_prompts_get_special_tokens_chat_prompts_do_not(llm_fp32):
    from tokenizers.processors import TemplateProcessing

    tok = llm_fp32.tokenizer
    text = "The library opens at nine"
    greedy = SamplingParams(temperature=0, max_tokens=1)
    # As the tokenizer itself would encode the text (SmolLM2's adds nothing).
    assert llm_fp32.generate(text, greedy, use_tqdm=False)[0].prompt_token_ids == tok.encode(text)
    # A Llama-style tokenizer adds a BOS: the completion prompt gets it, the chat prompt
    # (whose template already starts as it wants) gets no second one.
    backend = tok.backend_tokenizer
    saved = backend.post_processor
    bos = "<|endoftext|>"
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    try:
        bos_id = tok.convert_tokens_to_ids(bos)
        ids = llm_fp32.generate(text, greedy, use_tqdm=False)[0].prompt_token_ids
        assert ids[0] == bos_id and ids[1:] == tok.encode(text, add_special_tokens=False)
        msgs = [{"role": "user", "content": text}]
        chat_ids = llm_fp32.chat(msgs, greedy, use_tqdm=False)[0].prompt_token_ids
        template = llm_fp32.apply_chat_template(msgs)
        assert chat_ids == tok.encode(template, add_special_tokens=False)
        assert chat_ids[0] != bos_id
    finally:
        backend.post_processor = saved
    assert tok.encode(text) == tok.encode(text, add_special_tokens=False)


def test_cache_salt_inside_a_prompt_dict(llm_fp32):
    prompt = ("Salted prefixes: each tenant keeps its own pages of the shared book, and nobody reads "
              "another tenant's margin notes, however alike the chapters are. ") * 2
    p = SamplingParams(temperature=0, max_tokens=1)
    first, again = (llm_fp32.generate({"prompt": prompt, "cache_salt": "alice"}, p, use_tqdm=False)[0]
                    for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32, "the same salt hits"
    other = llm_fp32.generate({"prompt": prompt, "cache_salt": "bob"}, p, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0, "another salt must not hit alice's blocks"
    plain = llm_fp32.generate(prompt, p, use_tqdm=False, cache_salt="alice")[0]
    assert plain.num_cached_tokens >= 32, "the argument salts a plain prompt"
    ids = llm_fp32.generate({"prompt_token_ids": first.prompt_token_ids, "cache_salt": "carol"}, p,
                            use_tqdm=False)[0]
    assert ids.num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm_fp32.generate({"prompt": prompt, "cache_salt": 5}, p, use_tqdm=False)


def test_each_prompt_is_encoded_once(llm_fp32, monkeypatch):
    """LLM.generate validates the batch before queueing it; the ids validation made are the
    ones queued, not a second encoding. The output still carries the prompt's text."""
    tok = llm_fp32.engine.tokenizer
    calls: list[str] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: calls.append(text) or real(text, **kw))
    prompts = ["The library opens at nine", "Where are the maps?"]
    outs = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert sorted(calls) == sorted(prompts)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [real(p) for p in prompts]


def test_rope_tables_hold_the_engines_positions(tiny_model):
    """A runner's RoPE tables hold max_model_len positions, not the model's own limit (Gemma 3's
    32,768 rows were 64 MiB); an engine asking a shared runner for more is refused."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model, dtype="float32", kv_cache_memory="8MiB", max_model_len=96))
    assert [r.cos.shape[0] for r in eng.runner.model.ropes] == [96]
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds the 96 positions this runner was built for"):
        LLMEngine(EngineConfig(model=tiny_model, dtype="float32", kv_cache_memory="8MiB", max_model_len=1024),
                  runner=eng.runner, model_cfg=eng.model_cfg, tokenizer=eng.tokenizer)
    eng.add_request("a", list(range(1, 90)), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()  # positions up to 95: the table's last row
