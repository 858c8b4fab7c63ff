"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`) over a two-node local
cluster (ray.cluster_utils.Cluster: two raylets of one CPU each, no dashboard): TP=2 placed
one rank per node gives TP=1's greedy tokens in fp32; a killed worker actor fails the next
request with the actor named, within 30 s, and a new engine starts cleanly on the same cluster.

The cluster is started once for the module (~10 s, ~1 GB). Ray Serve replicas are tested in
tests/server/test_ray_serve.py."""
from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import WorkerDiedError

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 300, 4000, 12], list(range(100, 150)), list(range(1000, 1040)) + [7]]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def cpus_come_back(timeout: float = 15.0) -> bool:
    """Both CPUs free again (Ray removes a placement group asynchronously)."""
    end = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) != 2:
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def on_ray(model: str, **kw) -> LLM:
    return LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
               dtype="float32", num_gpu_blocks_override=32, max_model_len=256, num_threads=1, **kw)


@pytest.fixture(scope="module")
def tp1(tiny_model) -> list[list[int]]:
    llm = LLM(tiny_model, dtype="float32", num_gpu_blocks_override=32, max_model_len=256, num_threads=1)
    try:
        return tokens(llm)
    finally:
        llm.close()


def test_tp2_one_rank_per_node_matches_tp1_then_a_killed_actor_is_named(cluster, tiny_model, tp1):
    llm = on_ray(tiny_model)
    try:
        launcher = llm.engine._launcher
        assert len(set(launcher.nodes)) == 2, "STRICT_SPREAD: one rank per node"
        assert ray.get(launcher.actors[0].node_id.remote()) != ray.get_runtime_context().get_node_id()
        assert tokens(llm) == tp1
        ray.kill(launcher.actors[0])
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"tensor-parallel rank 1 \(Ray actor [0-9a-f]+ on node"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        llm.close()
    # The placement group went with the engine: a new one is placed on the same two CPUs.
    assert cpus_come_back()
    again = on_ray(tiny_model)
    try:
        assert tokens(again) == tp1
    finally:
        again.close()


def test_a_placement_the_cluster_cannot_give_is_named(cluster, tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_TIMEOUT", "3")
    import pagedllm.runtime.ray_launch as rl

    monkeypatch.setattr(rl, "READY_TIMEOUT", 3.0)
    with pytest.raises(ValueError, match=r"cannot place 2 bundles of 2 CPU \(STRICT_SPREAD\)"):
        LLM(tiny_model, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_SPREAD", num_threads=2, dtype="float32", max_model_len=256)
    assert cpus_come_back(), "the unplaced group was removed"
