"""The engine core on a fake runner (no model): the real scheduler, KV manager, hooks, stops and
output processor, checked against the fake model's reference tokens (fakes.reference), which a
wrong slot, table or copy would change."""
from __future__ import annotations

import pytest

from pagedllm.kv.groups import held_blocks
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

from .fakes import EOS, fake_engine, reference, run

LAYOUTS = [(0, 0), (0, 32), (32, 32)]   # full attention; half the layers windowed; all windowed


def prompts(*lengths: int) -> list[list[int]]:
    return [[0] + [(i * 7 + n) % 200 + 3 for i in range(n)] for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("layers", LAYOUTS)
def test_greedy_tokens_match_the_reference_in_a_batch_under_preemption(layers):
    """A pool too small for the batch: sequences are preempted and recomputed, chunked and
    prefix-hit, and every output is the reference, token for token."""
    engine = fake_engine(layers, num_blocks=24, max_num_batched_tokens=64)
    ps = prompts(5, 40, 90, 17, 33, 70)
    outs = run(engine, ps, [greedy(60)] * len(ps))
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 60, layers, stop_ids=()) for p in ps]
    assert engine.stats().preemptions > 0 or layers == (32, 32)
    assert engine.kv.pool.num_used == 0, "blocks leaked"


@pytest.mark.parametrize("layers", LAYOUTS)
def test_prefix_hits_serve_the_shared_prompt_and_change_no_token(layers):
    engine = fake_engine(layers, num_blocks=128)
    shared = prompts(80)[0]
    ps = [shared + [5, 6, 7], shared + [9, 9], shared + [11]]
    run(engine, ps[:1], [greedy(8)])
    outs = run(engine, ps[1:], [greedy(8)] * 2)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 8, layers, stop_ids=()) for p in ps[1:]]
    assert all(o.num_cached_tokens == 80 for o in outs)


@pytest.mark.parametrize("layers", LAYOUTS)
@pytest.mark.parametrize("num_blocks", [64, 20])
def test_speculation_keeps_the_greedy_tokens(layers, num_blocks):
    """Drafts (the fake proposes every third one wrong) are verified, accepted or rolled back,
    and in a pool too small for the batch dropped before anyone is preempted: the output is the
    one decoding without speculation gives, and every block comes back."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = fake_engine(layers, num_blocks=num_blocks, max_num_batched_tokens=64, speculative_config=spec)
    ps = prompts(5, 40, 90, 60)
    outs = run(engine, ps, [greedy(50)] * len(ps))
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 50, layers, stop_ids=()) for p in ps]
    st = engine.stats()
    assert 0 < st.spec.num_accepted_tokens < st.spec.num_draft_tokens
    assert (st.preemptions > 0) == (num_blocks == 20) or layers == (32, 32)
    assert engine.kv.pool.num_used == 0


def test_disable_by_batch_size_turns_drafts_off_in_big_batches():
    """With as many sequences running as disable_by_batch_size, nobody drafts; alone, it does."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    engine = fake_engine(num_blocks=64, speculative_config=spec)
    [p] = prompts(30)
    run(engine, [p] * 3, [greedy(24)] * 3)
    assert engine.stats().spec.num_drafts == 0
    assert run(engine, [p], [greedy(24)])[0].outputs[0].token_ids == reference(p, 24, stop_ids=())
    assert engine.stats().spec.num_drafts > 0


def test_sampled_tokens_are_the_same_alone_and_in_a_batch_with_forks():
    """n = 3 samples fork off one prompt (shared blocks, copy-on-write of the partial one); a
    seeded request's samples are the same whatever runs beside it."""
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=30, ignore_eos=True)
    alone = run(fake_engine(num_blocks=64), prompts(21), [params])[0]
    engine = fake_engine(num_blocks=64)
    batch = run(engine, prompts(21, 50, 8), [params, greedy(30), greedy(30)])[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batch.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1, "the samples differ"
    assert engine.stats().kv.cow_copies > 0


def test_stops_token_ids_strings_min_tokens_and_lengths():
    engine = fake_engine()
    [p] = prompts(12)
    ref = reference(p, 40, stop_ids=())
    stop_tok = ref[5]
    text = engine.tokenizer.decode(ref[:20])
    stop_str = text[-3:]
    outs = run(engine, [p] * 4, [
        greedy(40, stop_token_ids=[stop_tok]),
        greedy(40, stop=[stop_str]),
        greedy(40, stop_token_ids=[stop_tok], min_tokens=10),
        greedy(7)])
    first = ref.index(stop_tok) + 1
    assert outs[0].outputs[0].token_ids == ref[:first] and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].stop_reason == stop_str and stop_str not in outs[1].outputs[0].text
    assert len(outs[2].outputs[0].token_ids) >= 10
    assert outs[3].outputs[0].token_ids == ref[:7] and outs[3].outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored():
    engine = fake_engine()
    ps = prompts(*range(3, 40))
    outs = run(engine, ps, [SamplingParams(temperature=0, max_tokens=40)] * len(ps))
    stopped = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, "some reference continuation reaches EOS"
    for o in stopped:
        assert o.outputs[0].token_ids[-1] == EOS
        assert o.outputs[0].token_ids == reference(o.prompt_token_ids, 40)


def test_one_failing_request_ends_alone_and_leaks_no_block():
    engine = fake_engine(num_blocks=64)
    ids = [engine.add_request(None, p, greedy(20)).request_id for p in prompts(10, 20, 30)]
    engine.step()
    victim = engine.requests[ids[1]].seqs[0].seq_id
    engine.runner.fail_next[victim] = "sampling blew up"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done[ids[1]].error == "sampling blew up"
    assert all(done[i].error is None and len(done[i].outputs[0].token_ids) == 20 for i in (ids[0], ids[2]))
    assert engine.kv.pool.num_used == 0


def test_abort_frees_every_block_at_once():
    engine = fake_engine(num_blocks=64)
    rid = engine.add_request(None, prompts(70)[0], SamplingParams(n=2, temperature=1.0, max_tokens=50)).request_id
    for _ in range(3):
        engine.step()
    assert engine.kv.pool.num_used > 0
    out = engine.abort_request(rid)
    assert out.finished and engine.kv.pool.num_used == 0
    engine.kv.check_integrity()


def test_beam_search_runs_beams_as_one_unit_and_frees_them():
    engine = fake_engine(num_blocks=64)
    rid = engine.add_request(None, prompts(20)[0], BeamSearchParams(beam_width=3, max_tokens=12)).request_id
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
        engine.kv.check_integrity()
    [out] = [o for o in done if o.request_id == rid]
    scores = out.metrics["beam_scores"]
    assert len(out.outputs) == 3 and scores == sorted(scores, reverse=True)
    assert engine.stats().kv.forks > 0 and engine.kv.pool.num_used == 0


def test_prompt_logprobs_come_from_the_cache_the_second_time():
    engine = fake_engine(num_blocks=128, max_logprobs=5)
    shared = prompts(64)[0]
    a, b = shared + [4, 5], shared + [6, 7]
    first = run(engine, [a], [SamplingParams(max_tokens=1, prompt_logprobs=2)])[0]
    second = run(engine, [b], [SamplingParams(max_tokens=1, prompt_logprobs=2)])[0]
    assert engine.stats().kv.scores.hits >= 63
    assert second.prompt_logprobs[:64] == first.prompt_logprobs[:64]


def test_the_score_cache_stays_under_its_cap():
    engine = fake_engine(num_blocks=128, max_logprobs=20, prompt_logprobs_cache_memory=6000)
    run(engine, prompts(100, 90), [SamplingParams(max_tokens=1, prompt_logprobs=20)] * 2)
    s = engine.stats().kv.scores
    assert 0 < s.bytes <= 6000 and s.dropped > 0 and s.cap_bytes == 6000


def test_a_windowed_group_frees_its_blocks_while_the_full_group_keeps_its_own():
    """Half the layers windowed (W = 64), a block holding one layer group's layers: during a
    long generation the sequence holds ceil(n / B) blocks in the full group and
    ceil(n / B) - (n - W) // B in the windowed one (groups.held_blocks), where the same model
    with every layer full would hold 2 ceil(n / B) blocks of the same size."""
    B, W, n_prompt, n_out = 16, 64, 40, 600
    engine = fake_engine((0, W), num_blocks=256)
    engine.add_request(None, prompts(n_prompt)[0], greedy(n_out))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_computed_tokens
            if n > n_prompt + 1:
                assert engine.kv.pool.num_used == held_blocks((0, W), n, B), n
                checked += 1
    assert checked > 500
    n = n_prompt + 1 + n_out - 1      # the prompt (and its BOS) and every output token but the last are computed
    assert held_blocks((0, W), n, B) == 2 * -(-n // B) - (n - W) // B < held_blocks((0, 0), n, B)
    assert engine.stats().kv.window_released == (n - W) // B


def test_priority_engine_admits_the_urgent_request_first():
    engine = fake_engine(num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    low = [engine.add_request(None, p, greedy(3), priority=3).request_id for p in prompts(5, 6, 7, 8)]
    engine.step()
    urgent = engine.add_request(None, prompts(9)[0], greedy(3), priority=-5).request_id
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step()]
    assert order == [low[0], urgent] + low[1:]
    with pytest.raises(ValueError, match="priority"):
        fake_engine().add_request(None, prompts(5)[0], greedy(3), priority=1)


def test_each_layer_groups_blocks_show_in_the_report_metrics_and_totals():
    """A model whose layers mix attention types: the KV report, /metrics and the totals over
    data-parallel replicas (walked or not) carry each layer group's blocks."""
    import pickle

    from pagedllm.engine.kv_report import kv_report
    from pagedllm.dp.stats import counters_only, sum_stats, zero_stats
    from pagedllm.server.metrics import EngineCollector

    engine = fake_engine((0, 32), num_blocks=64)
    run(engine, prompts(120), [greedy(40)])
    engine.add_request(None, prompts(90)[0], greedy(20))
    for _ in range(4):   # the prompt, then decodes: the window leaves the prompt's first blocks behind
        engine.step()
    st = engine.stats()
    full, window = st.kv.groups
    assert (full.kind, window.kind) == ("full", "sliding_window(32)") and window.released > 0
    assert full.held_blocks > window.held_blocks > 0
    line = [x for x in kv_report(st).splitlines() if "layer groups" in x]
    assert line == [f"  layer groups (2, a block holds one group's layers): full {full.held_blocks} held, "
                    f"sliding_window(32) {window.held_blocks} held ({window.released} released)"]
    fams = {f.name: f for f in EngineCollector(lambda: st, "m", "pagedllm").collect()}
    held = {s.labels["kind"]: s.value for s in fams["pagedllm:kv_cache_group_blocks"].samples}
    assert held == {"full": full.held_blocks, "sliding_window(32)": window.held_blocks}
    replica = pickle.loads(pickle.dumps(engine.stats(walk=False)))   # a replica's view, over the pipe
    total = sum_stats([zero_stats(16), replica, counters_only(st)])
    assert [g.window for g in total.kv.groups] == [0, 32] and total.kv.groups[1].held_blocks is None
    assert total.kv.groups[1].released == 2 * window.released
