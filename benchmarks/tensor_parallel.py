"""What tensor parallelism costs per step on this machine.

1. The all-reduce alone: gloo (torch.distributed's CPU backend, loopback TCP) and our
   shared-memory all-reduce summing a [tokens, hidden] bf16 activation over 2 and 3 local
   ranks, for SmolLM2's hidden 576 and a Llama-8B-like 4096: the price of each of the 2
   all-reduces per layer.
2. The engine: TP=1 against TP=3 (SmolLM2-135M allows 1 and 3; shared memory, then gloo) on the same ShareGPT
   prompts, bf16, greedy, EOS ignored, each engine in its own process, cold pass then
   warm pass; rank 0 times every collective it waits in, so the result splits each step
   into communication and the rest.

    python -m benchmarks tensor_parallel --num-prompts 16 --max-tokens 64 \\
        --out benchmarks/results/tensor_parallel.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedllm.bench.throughput import in_own_process, save
from pagedllm.bench.workloads import sharegpt_truncated

DTYPE = "bfloat16"


def _allreduce_rank(rank: int, world: int, port: int, shapes: list[tuple[int, int]], reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from pagedllm.distributed import TPGroup, shm
    from pagedllm.kernels import load_ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo = TPGroup(rank, world, rank, world, distributed=True)
    local = TPGroup(rank, world, rank, world, distributed=True)
    shm.attach(local, load_ops(), wanted=True)
    for tokens, hidden in shapes:
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        row = {"ranks": world, "tokens": tokens, "hidden": hidden, "bytes": x.numel() * 2}
        for name, group in (("gloo", gloo), ("shm", local)):
            for _ in range(5):
                group.all_reduce(x)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                group.all_reduce(x)
                times.append(time.perf_counter() - t0)
            row[f"{name}_median_us"] = statistics.median(times) * 1e6
            row[f"{name}_p90_us"] = sorted(times)[int(0.9 * reps)] * 1e6
        if rank == 0:
            out.put(row)
    dist.destroy_process_group()


def allreduce_micro(reps: int) -> list[dict]:
    import torch.multiprocessing as mp

    from pagedllm.util import free_port

    shapes = [(t, h) for h in (576, 4096) for t in (1, 16, 64, 256)]
    rows: list[dict] = []
    for world in (2, 3):
        q = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_allreduce_rank, args=(world, free_port(), shapes, reps, q), nprocs=world,
                           start_method="spawn")
        while not q.empty():
            rows.append(q.get())
    return rows


def engine(tp: int, prompts: list[list[int]], max_tokens: int, shm: bool = True) -> list[dict]:
    from pagedllm import LLM, SamplingParams

    os.environ["PAGEDLLM_TP_SHM"] = "1" if shm else "0"
    llm = LLM(dtype=DTYPE, max_model_len=2048, tensor_parallel_size=tp)
    group, layers = llm.engine.runner.tp, llm.engine.model_cfg.num_layers
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for name in ("cold", "warm"):
        llm.reset_prefix_cache()
        group.comm_seconds, group.comm_calls, steps0 = 0.0, 0, llm.engine.steps
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = llm.engine.steps - steps0
        rows.append({"tp": tp, "pass": name, "elapsed_s": dt, "output_tokens": n, "output_tok_s": n / dt,
                     "steps": steps, "step_ms": dt / steps * 1e3,
                     "comm_ms_per_step": group.comm_seconds / steps * 1e3,
                     "allreduce_ms_per_layer": group.comm_seconds / steps / layers * 1e3,
                     "comm_share": group.comm_seconds / dt, "collectives_per_step": group.comm_calls / steps,
                     "runner": llm.engine.runner.describe()})
    llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = ap.parse_args()
    micro = allreduce_micro(args.reps)
    print("all-reduce of bf16 [tokens x hidden], local ranks (1 thread each): gloo (loopback TCP) vs shared memory")
    for r in micro:
        print(f"  {r['ranks']} ranks  [{r['tokens']:>4} x {r['hidden']}]  {r['bytes'] / 1024:8.1f} KiB  "
              f"gloo median {r['gloo_median_us']:8.1f} us (p90 {r['gloo_p90_us']:8.1f})  "
              f"shm median {r['shm_median_us']:7.1f} us (p90 {r['shm_p90_us']:7.1f})  "
              f"-> {r['gloo_median_us'] / r['shm_median_us']:.1f}x")
    prompts = [list(r.prompt) for r in sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_tokens)]
    runs = (in_own_process(engine, 1, prompts, args.max_tokens) + in_own_process(engine, 3, prompts, args.max_tokens)
            + in_own_process(engine, 3, prompts, args.max_tokens, shm=False))
    base = {r["pass"]: r for r in runs if r["tp"] == 1}
    print(f"\nengine: {args.num_prompts} ShareGPT prompts (cut to {args.max_prompt_len}), {args.max_tokens} tokens "
          f"each, {DTYPE}, {os.cpu_count()} logical CPUs")
    for r in runs:
        print(f"  TP={r['tp']} {r['pass']:4}  {r['output_tok_s']:7.1f} out tok/s ({r['output_tok_s'] / base[r['pass']]['output_tok_s']:.2f}x TP=1)"
              f"  step {r['step_ms']:7.1f} ms  comm {r['comm_ms_per_step']:6.1f} ms/step"
              f" = {r['allreduce_ms_per_layer']:.2f} ms/layer ({100 * r['comm_share']:.0f} % of the time)  [{r['runner']}]")
    save({"allreduce": micro, "engine": runs, "num_prompts": args.num_prompts,
          "max_prompt_len": args.max_prompt_len, "max_tokens": args.max_tokens, "dtype": DTYPE}, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
