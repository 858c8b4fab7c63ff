"""LoRA admission on the engine core with a fake runner (no model): the engine's LoRAHook alone
decides when a request under an adapter starts, and the pool holds its pages while it runs."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from pagedllm.lora.registry import AdapterCache
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

from .fakes import fake_engine, reference

PAGES = {"a": 3, "b": 5, "c": 2, "d": 4}


def adapters(gate: threading.Event | None = None, broken: str | None = None) -> AdapterCache:
    def read(req: LoRARequest):
        if gate is not None:
            gate.wait(10)
        if req.lora_name == broken:
            raise ValueError(f"lora: {req.lora_name!r} has no adapter_config.json")
        return SimpleNamespace(num_pages=PAGES[req.lora_name])
    return AdapterCache(read, capacity=8)


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, "abcd".index(name) + 1, f"/adapters/{name}")


def prompts(n: int) -> list[list[int]]:
    return [[0] + [(i * 5 + k) % 200 + 3 for i in range(30 + 7 * k)] for k in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_at_most_max_loras_adapters_run_and_every_page_comes_back():
    engine = fake_engine(num_blocks=96, loras=adapters(), enable_lora=True, max_loras=2, max_num_batched_tokens=64)
    ps, names = prompts(8), "abcdabcd"
    ids = [engine.add_request(None, p, greedy(12), lora_request=lora(n)).request_id for p, n in zip(ps, names)]
    done, peak = {}, 0
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
        engine.kv.check_integrity()
        peak = max(peak, len(engine.kv.adapters.users))
        assert len(engine.kv.adapters.users) <= 2
        use = engine.stats().lora
        assert use.max_loras == 2 and set(use.running) <= set("abcd")
    runner = engine.runner
    assert peak == 2 and all(len(step) <= 2 for step in runner.adapters_run)
    assert {a for step in runner.adapters_run for a in step} == {1, 2, 3, 4}
    assert [done[i].outputs[0].token_ids for i in ids] == [reference(p, 12, stop_ids=()) for p in ps]
    assert not engine.kv.adapters.users and engine.kv.pool.num_used == 0, "pages or blocks leaked"
    assert not runner.loras.refs   # every request gave its adapter back


def test_a_request_waits_for_its_adapters_read_while_others_run():
    gate = threading.Event()
    engine = fake_engine(num_blocks=64, loras=adapters(gate), enable_lora=True, max_loras=2)
    slow = engine.add_request(None, prompts(1)[0], greedy(4), lora_request=lora("a")).request_id
    base = engine.add_request(None, prompts(2)[1], greedy(4)).request_id
    finished = set()
    for _ in range(8):   # the base-model request runs to its end while the adapter is being read
        finished |= {o.request_id for o in engine.step()}
    assert base in finished and slow not in finished and engine.stats().lora.waiting == ("a",)
    gate.set()
    while slow not in finished:
        finished |= {o.request_id for o in engine.step()}
    assert engine.kv.pool.num_used == 0 and not engine.kv.adapters.users


def test_a_failed_read_ends_its_request_alone():
    engine = fake_engine(num_blocks=64, loras=adapters(broken="b"), enable_lora=True, max_loras=2)
    ids = [engine.add_request(None, p, greedy(5), lora_request=lora(n)).request_id
           for p, n in zip(prompts(3), "abc")]
    done = {}
    while len(done) < 3:
        for out in engine.step():
            done[out.request_id] = out
    assert "no adapter_config.json" in (done[ids[1]].error or "")
    assert [len(done[i].outputs[0].token_ids) for i in (ids[0], ids[2])] == [5, 5]
    assert engine.kv.pool.num_used == 0 and not engine.runner.loras.refs


def test_an_engine_without_adapters_refuses_a_lora_request_by_name():
    engine = fake_engine(num_blocks=32)
    try:
        engine.add_request(None, prompts(1)[0], greedy(2), lora_request=lora("a"))
    except ValueError as e:
        assert "enable_lora" in str(e) and not engine.requests
    else:
        raise AssertionError("a lora_request was queued on an engine that serves no adapters")
