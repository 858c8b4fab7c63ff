"""The visualizer's event stream against the real engine: replaying the messages must
rebuild the block manager's tables, ref counts and cache marks, step after step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.config import EngineConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.viz.hub import VizHub
from pagedllm.viz.scenarios import SCENARIOS, library_messages, record, trace_path
from pagedllm.viz.state import KVReplay, kv_picture


def replay_messages(messages: list[dict]) -> KVReplay:
    assert messages[0]["kind"] == "snapshot"
    r = KVReplay.from_picture(messages[0])
    for m in messages[1:]:
        for ev in m.get("kv", []):
            r.apply(ev)
    return r


def assert_matches(kv, r: KVReplay) -> None:
    assert r.picture() == kv_picture(kv)


def follow_tier(messages: list[dict]) -> tuple[set[str], list[str]]:
    """Follow blocks to the second tier and back by their keys, as the page does: (keys that
    went to the tier, keys loaded back in order). A load of a key that never went there, or a
    cached or loaded block without its key, fails."""
    key_of = {int(b): k for b, k in messages[0].get("keys", {}).items()}
    to_tier: set[str] = set()
    loaded: list[str] = []
    for m in messages[1:]:
        evicted: dict[int, str] = {}   # a write-back save comes after its evict, in the same step
        for ev in m.get("kv", []):
            if ev["type"] == "cache":
                key_of[ev["block"]] = ev["key"]
            elif ev["type"] == "evict" and ev["block"] in key_of:
                evicted[ev["block"]] = key_of.pop(ev["block"])
            elif ev["type"] == "offload":
                to_tier.update(evicted.get(b) or key_of[b] for b in ev["blocks"])
            elif ev["type"] == "tier_load":
                assert ev["key"] in to_tier, f"step {m['step']}: block {ev['block']} loaded a key the tier never got"
                key_of[ev["block"]] = ev["key"]
                loaded.append(ev["key"])
    return to_tier, loaded


@pytest.fixture(scope="module")
def engine(tiny_model):
    from pagedllm.engine.engine import LLMEngine

    # A tight pool so the run has prefix hits, forks, copy-on-write, evictions and preemptions
    # (the tiny model's: the subject is the events, not the text).
    return LLMEngine(EngineConfig(model=tiny_model, dtype="float32", num_gpu_blocks_override=12, max_model_len=256,
                                  block_size=8))


def test_events_rebuild_manager_state_every_step(engine):
    hub = VizHub(engine)
    engine.observers.append(hub)
    hub.start_recording()
    system = "You are a terse assistant for a public library. Answer briefly. " * 2
    engine.add_request("a", system + "Opening hours?", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("b", system + "Can I renew online?", SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("c", "Name a poem.", SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=40,
                                                           ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("b")  # between steps, as a client disconnect would
        assert_matches(engine.kv, replay_messages(hub.recording))
    trace = hub.stop_recording()
    kinds = {ev["type"] for m in trace for ev in m.get("kv", [])}
    assert {"alloc", "hit", "fork", "cow", "free", "fill", "cache"} <= kinds
    assert any(m["kind"] == "abort" for m in trace)
    assert any(m.get("preempted") for m in trace), "the tight pool should force a preemption"
    assert engine.stats().preemptions > 0
    assert engine.observers == [hub] and not hub.active and engine.kv.listener is None
    json.dumps(trace)  # a trace is plain JSON


def test_snapshot_midway_then_events(engine):
    """A subscriber joining mid-run starts from a snapshot; snapshot + later events = state."""
    hub = VizHub(engine)
    engine.observers.append(hub)
    engine.add_request("x", "Tell me about paged attention in one line.", SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    hub.start_recording()
    snap = hub.recording[0]
    assert snap["seqs"] and snap["tables"]
    while engine.has_unfinished_requests():
        engine.step()
        assert_matches(engine.kv, replay_messages(hub.recording))
    hub.stop_recording()


def test_hub_inactive_costs_nothing(engine):
    hub = VizHub(engine)
    engine.observers.append(hub)
    assert not hub.active and engine.kv.listener is None and engine.kv.pool.on_evict is None
    hub.poll()
    assert not hub.active


def test_library_trace_ends_with_5_blocks_vs_11():
    msgs = library_messages()
    r = replay_messages(msgs)
    last = msgs[-1]
    assert r.used == 5 and last["figures"]["used"] == 5
    assert last["figures"]["without_sharing"] == 11
    assert any(ev["type"] == "cow" for m in msgs for ev in m.get("kv", []))
    assert r.shared == 2


def test_committed_traces_replay_consistently():
    """Every built-in trace exists and its events replay into its own final figures."""
    for name in SCENARIOS:
        path = trace_path(name)
        assert path.exists(), f"missing trace {path}: run `python -m pagedllm.viz.scenarios`"
        trace = json.loads(path.read_text())
        r = replay_messages(trace["messages"])
        fig = [m for m in trace["messages"] if "figures" in m][-1]["figures"]
        assert (r.used, r.shared, r.cached_free) == (fig["used"], fig["shared"], fig["cached_free"]), name


def test_scenarios_show_what_they_promise():
    def kinds(trace):
        return {ev["type"] for m in trace["messages"] for ev in m.get("kv", [])}

    traces = {n: json.loads(trace_path(n).read_text()) for n in SCENARIOS}
    assert "hit" in kinds(traces["chat"]) and any(
        ev["type"] == "hit" and ev["blocks"] for m in traces["chat"]["messages"] for ev in m.get("kv", []))
    assert {"fork", "cow"} <= kinds(traces["parallel-n4"])
    # Beams fork every step they are chosen twice, copy on write, and the pruned are freed.
    beam = traces["beam"]["messages"]
    assert {"fork", "cow", "free"} <= kinds(traces["beam"])
    assert sum(ev["type"] == "fork" for m in beam for ev in m.get("kv", [])) >= 4
    assert any(ev["type"] == "free" for m in beam[:-1] if m.get("kind") == "step" for ev in m["kv"]), \
        "a beam that is not chosen is freed before the search ends"
    assert any(m.get("preempted") for m in traces["preemption"]["messages"])
    # A sequence past its window releases blocks; a later one's hit skips those its window never reads.
    window = [ev for m in traces["sliding-window"]["messages"] for ev in m.get("kv", [])]
    assert sum(ev["type"] == "slide" for ev in window) >= 3
    assert any(ev["type"] == "hit" and ev["blocks"][:3] == [-1] * 3 for ev in window)
    # The document's blocks go to the tier as the pool evicts them and come back for the later
    # questions, every full block of its prompt; a preempted story is swapped out.
    tier = traces["tier"]["messages"]
    assert tier[0]["config"]["tier"] == {"write_policy": "write_back", "preemption_mode": "swap"}
    to_tier, loaded = follow_tier(tier)
    loads = [ev for m in tier for ev in m.get("kv", []) if ev["type"] == "tier_load"]
    doc = (len(tier[1]["prompt"]) - 1) // tier[0]["config"]["block_size"]  # its full blocks, as a hit counts them
    assert [ev["index"] for ev in loads[:doc]] == list(range(doc)) and len(set(loaded)) >= doc
    assert any(ev["type"] == "swap_out" and ev["blocks"] for m in tier for ev in m.get("kv", []))
    fig = tier[-1]["figures"]
    assert fig["tier_hits"] == doc * tier[0]["config"]["block_size"] and fig["swap_outs"] == 1
    assert fig["tier_loaded"] == len(loads) and fig["tier_offloaded"] == len(to_tier)
    # Adapters are paged into the pool, held, left idle, used again where they lie, and evicted for KV.
    lora = traces["lora"]["messages"]
    assert {"adapter_load", "adapter_hold", "adapter_idle", "adapter_evict"} <= kinds(traces["lora"])
    assert lora[0]["config"]["lora"] and not traces["chat"]["messages"][0]["config"].get("lora")
    # A trace without a tier carries none of its figures: the page hides its panel.
    assert "tier_blocks" not in traces["chat"]["messages"][-1]["figures"]


def test_tier_scenario_folder():
    """The tier scenario runs in a fresh temporary folder unless given one; others have none."""
    import shutil

    fields = SCENARIOS["tier"].engine_fields()
    try:
        assert Path(fields["kv_offload_dir"]).is_dir() and not any(Path(fields["kv_offload_dir"]).iterdir())
        assert fields["num_gpu_blocks_override"] == 20 and fields["preemption_mode"] == "swap"
    finally:
        shutil.rmtree(fields["kv_offload_dir"])
    assert SCENARIOS["tier"].engine_fields("/srv/kv")["kv_offload_dir"] == "/srv/kv"
    assert "kv_offload_dir" not in SCENARIOS["chat"].engine_fields()


@pytest.mark.parametrize("name", ["library", "sliding-window"])
def test_kv_only_traces_are_reproducible(name):
    fresh = json.loads(json.dumps(record(name)["messages"]))
    assert fresh == json.loads(trace_path(name).read_text())["messages"]


def test_step_controller_gates_steps():
    """Paused: no step until step_once, which allows exactly one; resume and step_once
    wake the engine thread; the hub's poll runs between steps."""
    import threading
    import time

    from pagedllm.viz.controller import StepController

    polls, wakes = [], []
    hub = type("Hub", (), {"poll": lambda self: polls.append(1)})()
    c = StepController(hub, step_delay=0.0, wake=lambda: wakes.append(1))
    assert c.may_step() and not c.paused
    c.poll()
    assert polls == [1]
    c.pause()
    assert c.paused and not c.may_step()
    c.step_once()
    assert wakes == [1] and c.may_step() and not c.may_step()
    c.resume()
    assert wakes == [1, 1] and c.may_step() and c.may_step()
    c.set_delay(0.05)
    stop = threading.Event()
    t0 = time.monotonic()
    c.after_step(stop)
    assert c.step_delay == 0.05 and time.monotonic() - t0 >= 0.04


def test_lookahead_slots_and_rollbacks_replay():
    """Speculative decoding's lookahead slots and rollbacks are events like any other: the
    replay rebuilds the manager after every step, and the trace shows both."""
    from pagedllm.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(dtype="float32", num_gpu_blocks_override=16, max_model_len=256, block_size=4,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 5}))
    hub = VizHub(eng)
    eng.observers.append(hub)
    hub.start_recording()
    eng.add_request("a", "Count from 1 to 30, separated by commas.", SamplingParams(max_tokens=40))
    eng.add_request("b", "the cat sat on the mat. the cat sat on the mat. the cat",
                    SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    while eng.has_unfinished_requests():
        eng.step()
        assert_matches(eng.kv, replay_messages(hub.recording))
    trace = hub.stop_recording()
    events = [ev for m in trace for ev in m.get("kv", [])]
    assert any(ev["type"] == "fill" and ev.get("lookahead") for ev in events)
    assert any(ev["type"] == "rollback" and ev["blocks"] for ev in events), "a rollback that frees a block"
    assert any(len(b) == 4 and b[3] for m in trace if m["kind"] == "step" for b in m["batch"])
    assert "spec_drafted" in trace[-1]["figures"]


def test_tier_events_replay_and_figures(tmp_path, tiny_model):
    """With a second tier (write-through, swap preemption): pins, unpins, tier loads, offloads
    and a swap-out replay into the manager's own state after every step; blocks loaded back are
    ones that went to the tier; the figures, the stats dict and the KV report carry the tier."""
    from pagedllm.engine.kv_report import kv_report
    from pagedllm.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model, dtype="float32", num_gpu_blocks_override=12, max_model_len=256,
                                 block_size=4, kv_offload_dir=str(tmp_path), preemption_mode="swap"))
    hub = VizHub(eng)
    eng.observers.append(hub)
    hub.start_recording()
    replay, seen = KVReplay.from_picture(hub.recording[0]), 1
    doc = "The reading hall opens at nine and closes at eight. Readers borrow twelve books for three weeks. "
    short = SamplingParams(max_tokens=2, ignore_eos=True)

    def run() -> None:
        nonlocal seen
        while eng.has_unfinished_requests():
            eng.step()
            for m in hub.recording[seen:]:
                for ev in m.get("kv", []):
                    replay.apply(ev)
            seen = len(hub.recording)
            assert_matches(eng.kv, replay)

    eng.add_request("q1", doc + "When does it open?", short)
    run()
    # Two long answers need more than the pool: the document is evicted, one answer swapped out.
    eng.add_request("a", "Count slowly from one to forty:", SamplingParams(max_tokens=20, ignore_eos=True))
    eng.add_request("b", "Name every planet and a fact:", SamplingParams(max_tokens=20, ignore_eos=True))
    run()
    eng.add_request("q2", doc + "How many books?", short)
    run()
    trace = hub.stop_recording()
    eng.close()
    kinds = {ev["type"] for m in trace for ev in m.get("kv", [])}
    assert {"pin", "unpin", "tier_load", "offload", "swap_out"} <= kinds
    to_tier, loaded = follow_tier(trace)
    assert loaded and to_tier
    st = eng.stats()
    fig = trace[-1]["figures"]
    assert st.kv.tier.hits > 0 and st.kv.tier.swap_outs == 1 and st.preemptions == 1
    assert (fig["tier_hits"], fig["tier_loaded"], fig["tier_offloaded"], fig["swap_outs"]) == (
        st.kv.tier.hits, st.kv.tier.loaded_blocks, st.kv.tier.offloaded_blocks, st.kv.tier.swap_outs)
    assert fig["tier_loaded"] == len(loaded) and fig["tier_hit_rate"] == round(st.kv.tier_hit_rate, 4)
    d = st.as_dict()
    assert d["kv"]["tier"]["store"]["blocks"] == st.kv.tier.store.blocks > 0 and d["kv"]["tier_hit_rate"] == st.kv.tier_hit_rate
    json.dumps(d)
    line = [x for x in kv_report(st, str(tmp_path)).splitlines() if x.startswith("  tier: ")]
    assert line == [f"  tier: {st.kv.tier.store.blocks} blocks ({st.kv.tier.store.bytes / 2**20:.1f} MiB of 20.0 GiB) in "
                    f"{tmp_path}, {st.kv.tier.hits}/{st.kv.prefix_queries} prompt tokens from the tier (tier hit "
                    f"rate {st.kv.tier_hit_rate:.1%}), loaded {st.kv.tier.loaded_blocks}, offloaded "
                    f"{st.kv.tier.offloaded_blocks} (backlog 0), evicted 0 (tier LRU), swap-outs 1 "
                    f"({st.kv.tier.swap_out_blocks} blocks), read failures 0, write errors 0"]
