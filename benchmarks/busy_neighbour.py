"""A busy neighbour: the same ShareGPT run quiet, then beside `yes > /dev/null` (one core
kept busy), with the thread governor on (the default) and off (PAGEDLLM_ADAPT_THREADS=0:
the engine keeps one thread per core whatever happens), then beside the same loop at
`nice -n 19` (background work the kernel gives way to: the governor should not). Each run
in a fresh process. Issue 38's bars: >= 0.5 of quiet beside the busy loop, >= 0.9 beside
the niced one.

    python -m benchmarks busy_neighbour --out benchmarks/results/busy_neighbour.json

--duty 0.1,0.25,0.5 adds neighbours that spin that share of every --period-ms and sleep
the rest (a client parsing a server's stream wakes like this), each beside the engine held
at 2 threads and at 1 (the governor off): where one thread starts to win is where the
governor should drop to it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from pagedllm.bench.provenance import provenance
from pagedllm.bench.throughput import in_own_process, run_engine, save
from pagedllm.bench.workloads import sharegpt_truncated


def run(reqs, adapt: bool, threads: int | None = None) -> dict:
    r = in_own_process(run_engine, reqs, {"dtype": "bfloat16", "max_model_len": 2048, "num_threads": threads},
                       use_tqdm=False, env={"PAGEDLLM_ADAPT_THREADS": "1" if adapt else "0"})
    r.pop("steps")
    return r


# Spins `on` seconds of every `period`, sleeping the rest: a neighbour that wakes often and
# keeps a set share of one core.
DUTY_LOOP = """
import sys, time
period, on = float(sys.argv[1]), float(sys.argv[2])
nxt = time.perf_counter()
while True:
    end = time.perf_counter() + on
    while time.perf_counter() < end:
        pass
    nxt += period
    time.sleep(max(0.0, nxt - time.perf_counter()))
"""


def duty_neighbour(share: float, period_ms: float) -> subprocess.Popen:
    period = period_ms / 1000
    return subprocess.Popen([sys.executable, "-c", DUTY_LOOP, str(period), str(period * share)])


def duty_rows(reqs, shares: list[float], period_ms: float) -> dict:
    rows = {}
    for share in shares:
        for how, adapt, threads in (("2 threads", False, 2), ("1 thread", False, 1), ("governor", True, None)):
            n = duty_neighbour(share, period_ms)
            try:
                rows[f"{share:.0%} of every {period_ms:g} ms, {how}"] = run(reqs, adapt=adapt, threads=threads)
            finally:
                n.kill()
                n.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--duty", default="", help="neighbour shares of a core to try, e.g. 0.1,0.25,0.5")
    ap.add_argument("--period-ms", type=float, default=4.0)
    ap.add_argument("--only-duty", action="store_true", help="skip the busy and niced loops")
    ap.add_argument("--out", default="results/busy_neighbour.json")
    args = ap.parse_args()
    reqs = sharegpt_truncated(args.num_prompts, args.max_prompt_len, args.max_output_len)
    rows = {"quiet": run(reqs, adapt=True)}
    if args.duty:
        rows.update(duty_rows(reqs, [float(x) for x in args.duty.split(",")], args.period_ms))
    if args.only_duty:
        report(rows, args)
        return
    busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        rows["busy neighbour, governor on"] = run(reqs, adapt=True)
        rows["busy neighbour, governor off"] = run(reqs, adapt=False)
    finally:
        busy.kill()
        busy.wait()
    niced = subprocess.Popen(["nice", "-n", "19", "yes"], stdout=subprocess.DEVNULL)
    try:
        rows["niced neighbour (nice 19), governor on"] = run(reqs, adapt=True)
    finally:
        niced.kill()
        niced.wait()
    report(rows, args)


def report(rows: dict, args) -> None:
    quiet = rows["quiet"]["output_tok_s"]
    for name, r in rows.items():
        print(f"{name:<40}{r['output_tok_s']:8.1f} output tok/s  {r['output_tok_s'] / quiet:6.2f} of quiet "
              f"(cold pass {r['cold']['output_tok_s']:.1f}; {r['threads_at_end']} threads at the end, "
              f"{r['thread_changes']} changes)")
    save({"args": vars(args), "provenance": provenance(), "results": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
