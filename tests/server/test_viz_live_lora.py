"""`pagedllm viz --scenario lora` on a live engine: the scenario's requests run under their
adapters, which are paged into the KV pool (the page's "LoRA adapters in the pool" figure),
two at a time; their random weights are the server's own, served to no tenant by name."""
from __future__ import annotations

import asyncio

from pagedllm.viz.routes import _served_adapters, run_scenario
from pagedllm.viz.scenarios import SCENARIOS

from .inproc import serve_in_process


class Figures:
    """Each step's adapter figures, as the visualizer's watcher reads them."""
    active = True

    def __init__(self) -> None:
        self.resident: list[int] = []
        self.running: set[str] = set()
        self.most_at_once = 0

    def on_request(self, req) -> None:
        pass

    def on_abort(self, req) -> None:
        pass

    def on_step(self, out, new_tokens, view) -> None:
        self.resident.append(view.kv.adapters.resident)
        self.running |= set(view.lora.running)
        self.most_at_once = max(self.most_at_once, len(view.lora.running))


def test_the_live_lora_scenario_pages_its_adapters_in():
    sc = SCENARIOS["lora"]
    e = sc.engine
    server = serve_in_process("--enable-lora", "--max-loras", str(e["max_loras"]), "--max-num-seqs",
                              str(e["max_num_seqs"]), "--num-gpu-blocks-override", str(e["num_gpu_blocks_override"]))
    try:
        engine = server.engine.engine
        seen = Figures()
        engine.observers.append(seen)
        asyncio.run_coroutine_threadsafe(run_scenario(server.built.state, "lora"), server.loop).result(600)
        assert max(seen.resident) > 0 and seen.running == set(sc.adapters)
        assert seen.most_at_once == e["max_loras"]
        kv = engine.kv.stats()
        assert kv.adapters.loads >= len(sc.adapters) and kv.used_blocks == 0
        models = {m["id"] for m in server.client().get("/v1/models", timeout=30).json()["data"]}
        assert not set(sc.adapters) & models and not server.built.state.loras.by_name   # no tenant is served them
        done = server.engine.stats
        assert done.num_running == done.num_waiting == 0
        assert engine.scheduler.counters.generation_tokens >= 20 * len(sc.requests)   # none failed or ended early
        # A second run takes the same adapters: served once.
        state = server.built.state
        again = asyncio.run_coroutine_threadsafe(_served_adapters(state, sc), server.loop).result(60)
        assert again == {n: state.loras.unlisted[n] for n in sc.adapters} and len(state.loras.unlisted) == len(sc.adapters)
    finally:
        server.close()
