"""Tensor-parallel ranks as Ray actors (`--distributed-executor-backend ray`, vLLM's flag).

What Ray adds over our own launcher (runtime.launch, `mp`): placement across machines, one
bundle of CPUs (a GPU where there is one) per rank in a placement group, packed or spread as
asked, on a cluster Ray already runs (`ray start --head` on one machine, `ray start
--address=...` on the others, found through RAY_ADDRESS as Ray's own clients find it), or on
a local one started for you. Inside a placement group already (a Ray Serve replica given
`placement_group_bundles`), that group is used.

Ray places and supervises; the ranks still meet through torch.distributed (gloo on CPU,
NCCL on CUDA) at rank 0's address, exactly as under `mp`: rank 0 is this process (the
engine, with the scheduler), which takes a bundle on its own node; ranks 1.. are actors in
the other bundles, each running the same worker loop as an `mp` worker. A dead actor closes
its sockets, so the next collective fails at once, and Ray names the actor and its node.

Every node needs PagedLLM installed and the model at the same path (a shared file system,
or the same cache directory filled on each)."""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ..config import EngineConfig
from ..distributed import TPGroup
from ..models import ModelConfig
from ..util import free_port
from .launch import _TIMEOUT, _backend, _init_watching, serve, tell_stop

logger = logging.getLogger(__name__)

READY_TIMEOUT = float(os.environ.get("PAGEDLLM_RAY_PLACEMENT_TIMEOUT", "60"))


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend ray needs Ray: pip install 'pagedllm[ray]'") from None
    if not ray.is_initialized():
        # RAY_ADDRESS (or a cluster started on this machine) is joined; else a local one starts.
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING)
    return ray


class RankActor:
    """A tensor-parallel rank > 0 in a Ray worker process (made remote in start_ray_group)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def serve(self, cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int, group: TPGroup,
              backend: str, init: str) -> None:
        logging.basicConfig(level=logging.WARNING,
                            format=f"[tp rank {group.rank}] %(levelname)s %(name)s: %(message)s")
        dist.init_process_group(backend, init_method=init, rank=group.rank, world_size=group.size, timeout=_TIMEOUT)
        serve(cfg, model_dir, model_cfg, max_model_len, group)


@dataclass
class RayLauncher:
    """Rank 0's handle on its actors and their placement group (Launcher's interface)."""
    group: TPGroup
    actors: list = field(default_factory=list)
    serving: list = field(default_factory=list)   # each actor's serve() call: done means it ended
    nodes: list = field(default_factory=list)     # every rank's node id
    placement_group: object = None
    owns_placement_group: bool = True
    closed: bool = False
    patience: float = 0.0   # seconds diagnose() waits for Ray to report a death (0 while starting)

    def diagnose(self) -> str | None:
        import ray

        if not self.serving:
            return None
        done, _ = ray.wait(self.serving, num_returns=1, timeout=self.patience)
        for ref in done:
            rank = self.serving.index(ref) + 1
            where = f"tensor-parallel rank {rank} (Ray actor {self.actors[rank - 1]._actor_id.hex()[:12]} on node " \
                    f"{self.nodes[rank][:12]})"
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return f"{where} died: {str(e).splitlines()[0][:200]}"
            except ray.exceptions.RayError as e:
                return f"{where} failed: {str(e).splitlines()[0][:200]}"
            return f"{where} stopped serving"
        return None

    def close(self, graceful: bool = True) -> None:
        import ray

        if self.closed:
            return
        self.closed = True
        if graceful and tell_stop(self.group):
            ray.wait(self.serving, num_returns=len(self.serving), timeout=10)
        for a in self.actors:
            ray.kill(a)
        if self.placement_group is not None and self.owns_placement_group:
            ray.util.remove_placement_group(self.placement_group)
        if dist.is_initialized():
            dist.destroy_process_group()


def _placement(ray, n: int, cpus: int, strategy: str) -> tuple[object, bool]:
    """The caller's placement group, else a new one of n bundles placed as `strategy` asks."""
    from ray.util.placement_group import get_current_placement_group, placement_group

    current = get_current_placement_group()
    if current is not None:
        if len(current.bundle_specs) < n:
            raise ValueError(f"tensor_parallel_size {n} inside a Ray placement group of {len(current.bundle_specs)} "
                             "bundles: give it one bundle per rank")
        return current, False
    pg = placement_group([{"CPU": cpus} for _ in range(n)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=READY_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ValueError(f"the Ray cluster cannot place {n} bundles of {cpus} CPU ({strategy}) within "
                         f"{READY_TIMEOUT:.0f} s; it has {ray.available_resources().get('CPU', 0):g} CPUs free over "
                         f"{len([x for x in ray.nodes() if x['Alive']])} nodes") from None
    return pg, True


def _local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """(local rank, ranks on its node) for each rank: the ranks of one node share its cores."""
    count, seen, out = Counter(nodes), Counter(), []
    for node in nodes:
        out.append((seen[node], count[node]))
        seen[node] += 1
    return out


def start_ray_group(cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> RayLauncher:
    """Rank 0's group, its other ranks placed as Ray actors."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process: close it first "
                           "(LLMEngine.close()); torch.distributed holds one group per process")
    ray = _ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n, cpus = cfg.tensor_parallel_size, cfg.num_threads or 1
    pg, owned = _placement(ray, n, cpus, cfg.ray_placement_strategy)
    on = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    mine = [i for i in range(n) if on[i] == here]
    if not mine:
        if owned:
            ray.util.remove_placement_group(pg)
        raise ValueError(f"no bundle of the Ray placement group ({cfg.ray_placement_strategy}) is on this node, "
                         "where rank 0 (the engine) runs: free a CPU here, or run the engine on a node with one")
    others = [i for i in range(n) if i != mine[0]]
    nodes = [here] + [on[i] for i in others]
    local = _local_ranks(nodes)
    backend = _backend(cfg.device)
    addr = ray.util.get_node_ip_address()
    init = f"tcp://{addr}:{free_port(addr)}"
    remote = ray.remote(RankActor)
    # Two threads: serve() holds one for the actor's life; node_id() (a health question) gets the other.
    actors = [remote.options(num_cpus=cpus, max_concurrency=2, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in others]
    groups = [TPGroup(r, n, *local[r], distributed=True) for r in range(n)]
    serving = [a.serve.remote(cfg, model_dir, model_cfg, max_model_len, groups[r], backend, init)
               for r, a in enumerate(actors, start=1)]
    launcher = RayLauncher(groups[0], actors, serving, nodes, pg, owned)
    launcher.group.diagnose = launcher.diagnose
    try:
        _init_watching(backend, init, n, launcher)
    except BaseException:
        launcher.close(graceful=False)
        raise
    launcher.patience = 3.0
    logger.info("tensor parallel: %d ranks on Ray (%s), %d node%s, placement %s", n, backend, len(set(nodes)),
                "s" * (len(set(nodes)) > 1), cfg.ray_placement_strategy)
    return launcher
