"""Ray over a two-node local cluster (ray.cluster_utils.Cluster: two raylets of one CPU each,
no dashboard), started once for the module (~5 s, ~1 GB):

- tensor parallelism on Ray (`distributed_executor_backend="ray"`): TP=2 placed one rank per
  node gives TP=1's greedy tokens in fp32; a killed worker actor fails the next request with
  the actor named, within 30 s, and a new engine starts cleanly on the same cluster;
- engine replicas on Ray Serve (`pagedllm serve --ray`, deploy/ray_serve.py): 2 replicas, one
  a node; 16 chats behind one system prompt go to the replica that holds it; a killed replica
  is restarted by Serve, and the requests sent once it is back all succeed."""
from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
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
    # The placement group went with the engine: the same placement is given again at once.
    assert cpus_come_back()
    from ray.util.placement_group import placement_group, remove_placement_group

    again = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    assert ray.get(again.ready(), timeout=15)
    remove_placement_group(again)
    assert cpus_come_back()


def test_a_placement_the_cluster_cannot_give_is_named(cluster, tiny_model, monkeypatch):
    import pagedllm.runtime.ray_launch as rl

    monkeypatch.setattr(rl, "READY_TIMEOUT", 1.0)
    with pytest.raises(ValueError, match=r"cannot place 2 bundles of 2 CPU \(STRICT_SPREAD\)"):
        LLM(tiny_model, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_SPREAD", num_threads=2, dtype="float32", max_model_len=256)
    assert cpus_come_back(), "the unplaced group was removed"


# -- replicas on Ray Serve ----------------------------------------------------------------
SYSTEM = "You are the warehouse's careful assistant. Answer with the record's figure only. " * 8


@pytest.fixture(scope="module")
def served(cluster, tiny_model):
    """Two engine replicas of the tiny model behind the ingress, on a free port."""
    from ray import serve

    from pagedllm.cli import build_parser, engine_config
    from pagedllm.deploy import ray_serve
    from pagedllm.util import free_port

    port = free_port()
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--model", tiny_model,
                                      "--served-model-name", "tiny", "--port", str(port), "--max-model-len", "1024",
                                      "--num-threads", "1", "--dtype", "float32", "--kv-cache-memory", "64MiB"])
    app = ray_serve.application(engine_config(args), ray_serve.server_options(args), ray_serve.scaling_of(args))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app, name="pagedllm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    # No serve.shutdown(): the cluster's teardown ends every process of it at once (a graceful
    # Serve shutdown waits seconds on its replicas for nothing).


def chat(url: str, i: int) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Record {i}?"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def replicas() -> dict[str, int]:
    from ray import serve

    return serve.status().applications["pagedllm"].deployments["EngineReplica"].replica_states


def test_chats_behind_one_system_prompt_go_to_the_replica_holding_it(served):
    first = chat(served, 0)
    assert first.status_code == 200, first.text
    # 2 at a time: the router's load bound (dp.router.load_bound: ceil(1.25 x mean) + 1) lets the
    # holder take a 5th in flight while the other replica idles, so a request spills over only when
    # four completions reach the router late. (8 at a time spilled 2-3, and 4 at a time 3 once,
    # whenever the suite's load slowed the answers: the bound doing its job, and a flaky count.)
    with ThreadPoolExecutor(2) as pool:
        rest = list(pool.map(lambda i: chat(served, i), range(1, 16)))
    assert all(r.status_code == 200 for r in rest), [r.text for r in rest if r.status_code != 200]
    where = collections.Counter(r.headers["x-pagedllm-replica"] for r in [first, *rest])
    assert where.most_common(1)[0][1] >= 15, where
    assert where.most_common(1)[0][0] == first.headers["x-pagedllm-replica"]
    stream = httpx.post(served + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    bad = httpx.post(served + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_a_killed_replica_is_restarted_and_then_serves(served):
    names = [n for n in ray.util.list_named_actors(all_namespaces=True)
             if "EngineReplica" in n["name"] and n["name"].startswith("SERVE_REPLICA")]
    assert len(names) == 2
    victim = names[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    end = time.monotonic() + 90
    while True:
        now = {n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in n["name"]}
        if victim["name"] not in now and len(now) == 2 and replicas().get("RUNNING") == 2:
            break
        assert time.monotonic() < end, f"Serve did not restart the replica: {replicas()}"
        time.sleep(0.5)
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: chat(served, 100 + i), range(8)))
    assert all(r.status_code == 200 for r in after), [r.text for r in after if r.status_code != 200]


def test_serve_pieces_without_a_cluster(tiny_model):
    """The app builder (a Serve config's import path) takes `pagedllm serve`'s flags; scaling is
    fixed or autoscaled; the router reads a prompt's start; the health check fails a replica
    whose engine can never step again."""
    from ray.serve.config import AutoscalingConfig

    from pagedllm.ray_app import app_builder
    from pagedllm.deploy.ray_serve import EngineReplica, ReplicaScaling, routing_text

    assert type(app_builder({"model": tiny_model, "min_replicas": 1, "max_replicas": 3})).__name__ == "Application"
    assert ReplicaScaling(2).options() == {"num_replicas": 2}
    auto = ReplicaScaling(1, 1, 3, 4.0).options()["autoscaling_config"]
    assert isinstance(auto, AutoscalingConfig) and (auto.min_replicas, auto.max_replicas) == (1, 3)
    with pytest.raises(ValueError, match="need 0 <= min <= max"):
        ReplicaScaling(1, 4, 2).options()
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}'
    assert routing_text(chat) == "system: S\nuser: U\n"
    assert routing_text(b'{"prompt": "Hello"}') == "Hello" and routing_text(b'{"prompt": [1, 2]}') == "1 2"
    assert routing_text(b"not json") == routing_text(b"[1]") == ""

    class Dead:
        error = WorkerDiedError("tensor-parallel rank 1 died")

        def shutdown(self) -> None:
            pass

    replica = object.__new__(EngineReplica)
    replica.engine = Dead()
    with pytest.raises(RuntimeError, match="the engine failed: tensor-parallel rank 1 died"):
        replica.check_health()
    Dead.error = None
    replica.check_health()
