"""On paper: how tensor parallelism (TP) and data parallelism (DP) change KV capacity and
concurrency for one model on G GPUs of a given memory size (e.g. LLaMA-13B on 1-8 A100s).

For each layout TP=t x DP=G/t, every GPU holds a 1/t shard of the model (Megatron style:
attention heads, KV heads, MLP columns and vocabulary split t ways; norms replicated) and
KV for its heads only, so per GPU:

    weights   = param_count(shard) * bytes          (~ weights / t)
    KV budget = utilization * memory - weights - activation reserve
    KV bytes per token per rank = 2 * L * (d_kv / t) * bytes

A replica's t ranks hold the same tokens, so its capacity is budget / (bytes per token per
rank) tokens, in blocks of block_size. The real scheduler and KV manager (simulator.py)
then replay its share of a length distribution over one replica's blocks for its max and
mean concurrent sequences; the cluster holds DP times that.

Assumptions (printed with every table): weights and KV in one dtype (fp16 by default);
gpu_memory_utilization of each GPU's memory is usable (0.9); a fixed activation reserve
per GPU (1.5 GiB: a 2048-token step of 13B needs ~0.3 GiB of activations at TP=1, the
rest covers CUDA context, cuBLAS/NCCL workspaces and CUDA graphs; not divided by t);
block size 16; a layout "does not fit" when its KV budget cannot hold one sequence of
max_model_len tokens (the condition on which vLLM refuses to start); requests all arrive
at once and run to their full output length; the cluster serves the same requests in every
layout, DP replicas taking equal shares (one replica replays every DP-th request).

Ignored: compute. TP adds two all-reduces per layer per step (their cost grows with t and
falls with interconnect bandwidth); TP cuts per-token latency (each rank does 1/t of the
matmuls and reads 1/t of the weights and KV), DP does not; a replica's throughput is not
modelled, only how many sequences its memory holds. Also ignored: pipeline parallelism,
KV-head replication when t exceeds the KV heads, quantization, prefix sharing."""
from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ModelConfig
from ..config import canonical_dtype
from ..kv.groups import held_blocks
from ..kv_dtype import resolve_kv_dtype
from .kv_calc import DTYPE_BYTES, block_bytes, engine_groups, kv_calc, param_count
from .simulator import SimResult, simulate

GIB = 2**30


@dataclass(frozen=True)
class ParallelAssumptions:
    dtype: str = "float16"                          # weights and KV
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 3 * GIB // 2    # per GPU, whatever t
    block_size: int = 16
    max_model_len: int = 2048                       # the fit rule and the simulator's limit
    max_num_seqs: int = 256                         # per replica, as the engine's flag
    max_num_batched_tokens: int = 2048              # per replica step

    def notes(self) -> list[str]:
        reserve = self.activation_reserve_bytes / GIB
        return [
            (f"weights and KV in {self.dtype} ({DTYPE_BYTES[self.dtype]} bytes); TP shards heads, KV heads, "
             "MLP and vocab t ways (norms replicated)"),
            (f"per GPU: KV budget = {self.gpu_memory_utilization} x memory - weights/t - {reserve:.2f} GiB "
             "activation reserve (not divided by t)"),
            (f"block size {self.block_size}; max_model_len {self.max_model_len}; max_num_seqs {self.max_num_seqs} "
             f"and max_num_batched_tokens {self.max_num_batched_tokens} per replica"),
            f"does not fit: the KV budget holds fewer than max_model_len ({self.max_model_len}) tokens",
            ("seq/rep: sequences in a step's batch when the real scheduler and KV manager replay the workload "
             "over one replica's blocks, every request arriving at once and running to its full output length "
             "(mean over all steps, ramp-up and drain included); the cluster serves the same requests in every "
             "layout, split evenly: a replica gets every DP-th request, cluster = DP x one replica"),
            ("bound: what capped a replica in the replay: memory (the pool filled), max_num_seqs, "
             "max_num_batched_tokens, or workload (the pool never filled: more requests would run more at once)"),
            ("ignored: compute and the two all-reduces per layer per step that TP adds; TP cuts per-token "
             "latency, DP does not; pipeline parallelism, KV-head replication, quantization, prefix sharing"),
        ]


@dataclass
class ParallelRow:
    gpu_memory_bytes: int
    gpus: int
    tp: int
    dp: int
    fits: bool
    reason: str                     # why not, when it does not fit
    weights_per_gpu: int
    reserve_per_gpu: int
    kv_budget_per_gpu: int          # may be negative when it does not fit
    kv_bytes_per_token_rank: int
    kv_tokens_per_replica: int
    kv_blocks_per_replica: int
    max_seqs_per_replica: int
    mean_seqs_per_replica: float
    preemptions_per_replica: int
    bound: str                      # what capped the replica's concurrency in the replay

    @property
    def cluster_kv_tokens(self) -> int:
        return self.dp * self.kv_tokens_per_replica

    @property
    def cluster_max_seqs(self) -> int:
        return self.dp * self.max_seqs_per_replica

    @property
    def cluster_mean_seqs(self) -> float:
        return self.dp * self.mean_seqs_per_replica


def layouts(cfg: ModelConfig, gpus: int) -> list[int]:
    """The TP sizes for G GPUs: divisors of G that split the model evenly."""
    return [t for t in range(1, gpus + 1) if gpus % t == 0 and _splits(cfg, t)]


def _splits(cfg: ModelConfig, tp: int) -> bool:
    try:
        cfg.check_tensor_parallel(tp)
    except ValueError:
        return False
    return True


def _check_tp(cfg: ModelConfig, tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    cfg.check_tensor_parallel(tp)


def _replica(cfg: ModelConfig, tp: int, gpu_bytes: int, a: ParallelAssumptions) -> dict:
    """Memory of one rank, and the replica's KV capacity (same on all its t ranks)."""
    rank = cfg.shard(tp)  # the engine's own slicing: heads, KV heads, MLP and vocab t ways
    elt = DTYPE_BYTES[a.dtype]
    weights = param_count(rank) * elt
    budget = int(gpu_bytes * a.gpu_memory_utilization) - weights - a.activation_reserve_bytes
    kv = resolve_kv_dtype("auto", canonical_dtype(a.dtype))
    bpt = rank.kv_bytes_per_token(kv)
    # one max_model_len sequence's blocks as the engine keeps them (windows, state blocks)
    layout = engine_groups(rank)
    need = held_blocks(layout.windows, a.max_model_len, a.block_size) * block_bytes(rank, kv, layout, a.block_size)
    out = {"weights_per_gpu": weights, "reserve_per_gpu": a.activation_reserve_bytes, "kv_budget_per_gpu": budget,
           "kv_bytes_per_token_rank": bpt, "kv_tokens_per_replica": 0, "kv_blocks_per_replica": 0,
           "fits": budget >= need, "reason": ""}
    if budget < need:
        usable = f"{a.gpu_memory_utilization} x {gpu_bytes / GIB:.0f} GiB = {gpu_bytes * a.gpu_memory_utilization / GIB:.1f} GiB"
        taken = f"weights {weights / GIB:.1f} GiB + reserve {a.activation_reserve_bytes / GIB:.1f} GiB"
        out["reason"] = (f"{taken} exceed {usable}" if budget < 0 else
                         f"{taken} leave {budget / GIB:.2f} GiB of {usable} for KV, under one "
                         f"{a.max_model_len}-token sequence ({need / GIB:.2f} GiB)")
        return out
    c = kv_calc(rank, a.dtype, a.max_model_len, block_size=a.block_size, budget_bytes=budget)
    out.update(kv_blocks_per_replica=c.num_blocks, kv_tokens_per_replica=c.max_tokens)
    return out


def _bound(s: SimResult, a: ParallelAssumptions) -> str:
    if s.preemptions or s.peak_used_blocks == s.num_blocks:
        return "memory"
    if s.max_concurrent_seqs >= a.max_num_seqs:
        return "max_num_seqs"
    if s.max_concurrent_seqs >= a.max_num_batched_tokens:
        return "max_num_batched_tokens"  # a step's token budget: one per decoding sequence
    return "workload"  # the pool never filled: more requests would run more at once


def project_parallel(cfg: ModelConfig, lengths: list[tuple[int, int]], gpu_memory_bytes: list[int],
                     gpus: tuple[int, ...] = (1, 2, 4, 8), tp_sizes: list[int] | None = None,
                     a: ParallelAssumptions = ParallelAssumptions(), seed: int = 0) -> list[ParallelRow]:
    """One row per (memory, G, t): every valid t dividing G, or only tp_sizes (each checked).
    The cluster serves all of lengths whatever the layout, split evenly: one replica replays
    every DP-th request and the others are taken to do the same. Layouts with the same
    blocks per replica and DP share that replay."""
    if a.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {a.dtype!r}")
    for t in tp_sizes or []:
        _check_tp(cfg, t)
    replays: dict[tuple[int, int], SimResult] = {}
    layout = engine_groups(cfg)   # every rank's: TP slices heads, not layers
    rows = []
    for mem in gpu_memory_bytes:
        for g in gpus:
            for t in tp_sizes if tp_sizes is not None else layouts(cfg, g):
                if g % t:
                    continue  # t must divide G: DP = G / t replicas
                r = _replica(cfg, t, mem, a)
                sim = None
                if r["fits"]:
                    key = (r["kv_blocks_per_replica"], g // t)
                    if key not in replays:
                        replays[key] = simulate(lengths[::g // t], key[0], a.block_size, "paged", a.max_num_seqs,
                                                a.max_num_batched_tokens, a.max_model_len, seed, layout=layout)
                    sim = replays[key]
                rows.append(ParallelRow(
                    gpu_memory_bytes=mem, gpus=g, tp=t, dp=g // t, **r,
                    max_seqs_per_replica=sim.max_concurrent_seqs if sim else 0,
                    mean_seqs_per_replica=sim.mean_batch_seqs if sim else 0.0,
                    preemptions_per_replica=sim.preemptions if sim else 0,
                    bound=_bound(sim, a) if sim else "does not fit"))
    return rows


def format_projection(name: str, rows: list[ParallelRow], a: ParallelAssumptions, workload: str) -> str:
    head = (f"{'GPU':>7} {'G':>2} {'TP':>3} {'DP':>3} {'weights/GPU':>11} {'KV/GPU':>9} {'KV B/tok/rank':>13} "
            f"{'KV tok/replica':>14} {'blocks/rep':>10} {'max seq/rep':>11} {'mean seq/rep':>12} "
            f"{'cluster KV tok':>14} {'cluster max':>11} {'cluster mean':>12}  bound")
    lines = [f"TP x DP projection for {name}; workload: {workload}", "assumptions:"]
    lines += [f"  - {n}" for n in a.notes()]
    lines += ["", head]
    for r in rows:
        mem = f"{r.gpu_memory_bytes / GIB:.0f}GiB"
        left = f"{mem:>7} {r.gpus:>2} {r.tp:>3} {r.dp:>3} {r.weights_per_gpu / GIB:>7.2f} GiB "
        if not r.fits:
            lines.append(left + f"DOES NOT FIT: {r.reason}")
            continue
        lines.append(left + f"{r.kv_budget_per_gpu / GIB:>5.1f} GiB {r.kv_bytes_per_token_rank:>13,} "
                     f"{r.kv_tokens_per_replica:>14,} {r.kv_blocks_per_replica:>10,} {r.max_seqs_per_replica:>11,} "
                     f"{r.mean_seqs_per_replica:>12.1f} {r.cluster_kv_tokens:>14,} {r.cluster_max_seqs:>11,} "
                     f"{r.cluster_mean_seqs:>12.1f}  {r.bound}")
    return "\n".join(lines)
