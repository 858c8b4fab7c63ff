"""The sampler kernel's cost per step by setting, each against temperature alone in the same run:
48 rows of SmolLM2's 49,152 logits, flat (random normals, what a logit_bias can make of a row) and
peaked (normals x 3, nearer a language model's), on one thread (the engine samples a step's rows
in parallel; one thread shows a row's cost).

    python -m benchmarks sampling --out benchmarks/results/sampling_avx2.json

An older tree's kernel, with this script (run as a file, from outside this checkout, so that the
older package is the one imported; its commit is the one recorded):

    cd /tmp && PYTHONPATH=<older tree> python <this checkout>/benchmarks/sampling.py --out <file>
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# (label, logit scale, temperature, top_k, top_p): the first is the baseline of the ratios. The hot
# ones are a client's own temperature: every score s = (x - max) / T lands near 0, in one bucket.
SETTINGS = [("temperature 0.8 alone", 1.0, 0.8, 0, 1.0), ("peaked, top_p 0.9", 3.0, 0.8, 0, 0.9),
            ("peaked, top_k 50, top_p 0.95", 3.0, 0.8, 50, 0.95), ("flat, top_p 0.9", 1.0, 0.8, 0, 0.9),
            ("flat, top_k 20000", 1.0, 0.8, 20000, 1.0),
            ("peaked, temperature 100, top_p 0.9", 3.0, 100.0, 0, 0.9),
            ("peaked, temperature 1e6, top_p 0.9", 3.0, 1e6, 0, 0.9),
            ("peaked, temperature 1e6, top_k 20000", 3.0, 1e6, 20000, 1.0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/sampling.json")
    a = p.parse_args()
    from pagedllm.bench.provenance import save_result
    from pagedllm.kernels import load_ops

    ops = load_ops()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows, base = [], None
    for label, scale, temperature, k, top_p in SETTINGS:
        x = scale * torch.randn(a.rows, a.vocab, generator=g)
        args = (torch.full((a.rows,), temperature), torch.full((a.rows,), k, dtype=torch.int64),
                torch.full((a.rows,), top_p), torch.arange(a.rows))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            tokens = ops.sample(x, *args)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        base = base or ms
        rows.append({"setting": label, "temperature": temperature, "top_k": k, "top_p": top_p, "logit_scale": scale,
                     "ms": ms,
                     "over_temperature": ms / base, "first_tokens": tokens[:8].tolist()})
        print(f"{label:38s} {ms:8.2f} ms  ({ms / base:.2f}x temperature alone)", flush=True)
    # Run as a file beside an older tree (the docstring), the command says so.
    command = ("python -m benchmarks sampling" if __package__ else
               f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} python {sys.argv[0]}")
    save_result({"benchmark": "sampling", "command": command + " " + " ".join(sys.argv[1:]),
                 "rows": a.rows, "vocab": a.vocab, "threads": 1, "results": rows}, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
