"""Starting a tensor-parallel group: local worker processes started for you, or every
rank under torchrun (multi-node: --nnodes, --node-rank, --master-addr; env://
rendezvous). No RPC layer of our own: ranks meet through torch.distributed, and rank 0
sends each step's plan to the others with a broadcast.

Under torchrun every process runs the same command; rank 0 goes on to be the engine,
the others serve rank 0's steps and exit when it closes."""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ..config import EngineConfig
from ..models import ModelConfig
from ..util import free_port, spare_final_collections
from ..distributed import TPGroup, WorkerDiedError

logger = logging.getLogger(__name__)

# Collectives wait this long for a rank before raising (a dead rank raises at once:
# its sockets close). Long enough for the slowest first step of a big model on CPU.
_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("PAGEDLLM_TP_TIMEOUT", "900")))


def torchrun_ranks() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) when launched by torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))


def _backend(device: str) -> str:
    from .device import resolve_device

    return "nccl" if resolve_device(device).type == "cuda" else "gloo"


@dataclass
class Launcher:
    """Rank 0's handle on the group: the local workers it started (none under torchrun)."""
    group: TPGroup
    procs: list = field(default_factory=list)
    closed: bool = False

    def diagnose(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def close(self, graceful: bool = True) -> None:
        """Tell the workers to stop, wait for them, leave the process group. Not graceful
        (rank 0 failed mid-start, the workers may wait in another collective): kill them."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            tell_stop(self.group)
        else:
            for p in self.procs:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def tell_stop(group: TPGroup) -> bool:
    """Rank 0 tells the other ranks to stop serving; False if one is already gone (the others
    see the same closed sockets and exit)."""
    try:
        group.broadcast(None)
        return True
    except WorkerDiedError:
        return False


def start_group(cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> Launcher:
    """Rank 0's group. A torchrun rank other than 0 never returns: it serves rank 0 and exits."""
    n = cfg.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process: close it first "
                           "(LLMEngine.close()); torch.distributed holds one group per process")
    backend = _backend(cfg.device)
    ranks = torchrun_ranks()
    if ranks is not None:
        rank, world, local_rank, local_size = ranks
        if world != n:
            raise ValueError(f"tensor_parallel_size {n} but torchrun started {world} processes "
                             f"(WORLD_SIZE); they must be equal")
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=_TIMEOUT)
        group = TPGroup(rank, n, local_rank, local_size, distributed=True)
        if rank != 0:
            serve(cfg, model_dir, model_cfg, max_model_len, group)
            sys.exit(0)
        logger.info("tensor parallel: %d ranks under torchrun (%s)", n, backend)
        return Launcher(group)
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    procs = [_spawn((cfg, model_dir, model_cfg, max_model_len, r, n, backend, init)) for r in range(1, n)]
    launcher = Launcher(TPGroup(0, n, 0, n, distributed=True), procs)
    launcher.group.diagnose = launcher.diagnose
    try:
        _init_watching(backend, init, n, launcher)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    logger.info("tensor parallel: %d rank%s, %d local worker processes (%s)", n, "s" * (n > 1), n - 1, backend)
    return launcher


def _init_watching(backend: str, init: str, n: int, launcher: Launcher) -> None:
    """Rank 0 joins the group while watching its workers: one that dies on the way in
    (a bad import, no memory) is an error now, not a wait for the rendezvous timeout."""
    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(backend, init_method=init, rank=0, world_size=n, timeout=_TIMEOUT)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=join, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = launcher.diagnose()
        if dead and t.is_alive():
            raise WorkerDiedError(f"{dead} while starting (its error is printed above)")
    if failure:
        raise failure[0]


def _spawn(args: tuple) -> subprocess.Popen:
    """A fresh interpreter running `python -m pagedllm.runtime.launch`, its arguments
    pickled on stdin: unlike multiprocessing's spawn it does not re-run the caller's
    __main__, so a script, a notebook or the REPL needs no `if __name__` guard."""
    p = subprocess.Popen([sys.executable, "-m", "pagedllm.runtime.launch"], stdin=subprocess.PIPE)
    p.stdin.write(pickle.dumps(args))
    p.stdin.close()
    return p


def _die_with_parent() -> None:
    """End this worker when rank 0's process ends, however it ends (a rank blocked in
    a collective would see the sockets close; one still loading would not). Polls the
    parent pid: the kernel's PR_SET_PDEATHSIG fires when the spawning *thread* exits."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int,
                 rank: int, n: int, backend: str, init: str) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=n, timeout=_TIMEOUT)
    serve(cfg, model_dir, model_cfg, max_model_len, TPGroup(rank, n, rank, n, distributed=True))


def serve(cfg: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int, group: TPGroup) -> None:
    """A rank other than 0: load its slice, then run every step rank 0 sends until it says stop."""
    from .model_runner import ModelRunner

    try:
        ModelRunner(cfg, model_dir, model_cfg, max_model_len, group).serve()
    except WorkerDiedError:
        pass  # rank 0 went away: nothing left to serve
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # rank 0 sees our sockets close and names us
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        spare_final_collections()


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
