"""The visualizer's event stream against the real engine: replaying the messages must
rebuild the block manager's tables, ref counts and cache marks, step after step."""
from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def engine():
    from pagedllm.engine.engine import LLMEngine

    # A tight pool so the run has prefix hits, forks, copy-on-write, evictions and preemptions.
    return LLMEngine(EngineConfig(dtype="float32", num_gpu_blocks_override=12, max_model_len=256, block_size=8))


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
    engine.add_request("x", "Tell me about paged attention in one line.", SamplingParams(max_tokens=16, ignore_eos=True))
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
