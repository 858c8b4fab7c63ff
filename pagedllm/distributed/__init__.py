"""Tensor parallelism on torch.distributed: the rank group's collectives (group.py) and
their shared-memory path between the ranks of one machine (shm.py). How the ranks'
processes start, each running a model runner, is the runtime's (runtime/launch.py)."""
from .group import TPGroup, WorkerDiedError

__all__ = ["TPGroup", "WorkerDiedError"]
