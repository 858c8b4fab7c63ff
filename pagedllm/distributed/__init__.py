"""Tensor parallelism on torch.distributed: the rank group (group.py) and how its
processes start, locally or under torchrun (launch.py)."""
from .group import TPGroup, WorkerDiedError

__all__ = ["TPGroup", "WorkerDiedError"]
