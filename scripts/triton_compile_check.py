"""Compile the Triton attention kernels for NVIDIA GPUs on a machine that has none.

The kernels are launched through the engine's own attention backend (the same calls,
dtypes and specializations a GPU run makes), but a stand-in Triton driver names the target
GPU and a compile hook builds each kernel with Triton's compiler and the ptxas it bundles,
then skips the launch. Each cubin is then read with the bundled cuobjdump:

  - it compiles (bf16/fp16 with tensor cores, fp32 in IEEE mode, bf16 queries over fp8
    KV: e4m3 and e5m2) for sm_80 and sm_90;
  - no register spills (beyond a stray word) and shared memory within the GPU's limit;
  - decode/prefill dots run on tensor cores (HMMA/HGMMA) for bf16/fp16;
  - K/V tiles are read with 128-bit loads (cp.async) where head_dim allows (not fp8's rows:
    D codes then a 2-byte scale, so a row starts 2-byte aligned);
  - serving does not recompile: a decode sweep over batch sizes 1..256 and contexts
    1..32k compiles each kernel only once per partition size, and sliding windows add none.

What it cannot tell: speed. That needs the GPU (scripts/gpu_check.sh).

    python scripts/triton_compile_check.py [--quick] [--arch 80,90] [--dtype bf16,fp16,fp32,e4m3,e5m2] [--json FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, not the interpreter (set before triton is imported)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.attention import PrefillSeq  # noqa: E402
from pagedllm.attention import triton_kernels as tk  # noqa: E402
from pagedllm.attention.triton_backend import TritonMetadata, TritonPagedAttention  # noqa: E402
from pagedllm.kv_dtype import KV_DTYPES  # noqa: E402
from pagedllm.util import cdiv  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # bytes per block (opt-in max)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "e4m3": torch.bfloat16, "e5m2": torch.bfloat16}  # the last two: bf16 queries over fp8 KV pools
KV_KINDS = {"e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
# (name, query heads, kv heads, head dim, block size)
MODELS = [("smollm2-135m", 9, 3, 64, 16), ("llama3-8b", 32, 8, 128, 16), ("qwen2-7b", 28, 4, 128, 32),
          ("llama2-7b-mha", 32, 32, 128, 16), ("head-dim-96", 32, 32, 96, 16)]
QUICK = [("smollm2-135m", 9, 3, 64, 16), ("llama3-8b", 32, 8, 128, 16)]
# ptxas now and then parks a word or two in local memory even at low register counts;
# real spills (a tile that does not fit) run to hundreds of bytes.
SPILL_TOLERANCE = 16
GRAPH_BOUND = 131072  # decode captured in a CUDA graph uses max_model_len as its bound


class StandInDriver:
    """What JITFunction asks of the active driver before it compiles; launches never happen."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclass
class Compiled:
    kernel: str
    arch: int
    dtype: str
    model: str
    constants: dict
    regs: int = 0
    spill_bytes: int = 0  # ptxas's spill stores + loads
    shared_bytes: int = 0
    sass: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)


class Compiler:
    """The jit_cache_hook: compiles each new specialization for the stand-in target, records
    it, and tells Triton not to launch."""

    def __init__(self) -> None:
        self.seen: dict[tuple, Compiled] = {}
        self.context = ("", 0, "")  # model, arch, dtype being checked
        self.keys_by_kernel: dict[str, set] = collections.defaultdict(set)

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        jf = fn.jit_function
        name = jf.fn.__name__
        model, arch, dtype = self.context
        self.keys_by_kernel[name].add(key)
        if (name, arch, key) in self.seen:
            return True
        src = ASTSource(jf, compile["signature"], compile["constants"], compile["configs"][0])
        opts = {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas")}
        binary = triton.compile(src, target=driver.active.get_current_target(), options=opts)
        consts = {jf.arg_names[k[0]]: v for k, v in compile["constants"].items()
                  if isinstance(v, (int, bool, float))}
        rec = Compiled(name, arch, dtype, model, consts, shared_bytes=binary.metadata.shared)
        inspect_binary(binary, rec)
        self.seen[(name, arch, key)] = rec
        return True  # compiled here; Triton returns without launching


def inspect_binary(binary, rec: Compiled) -> None:
    """Registers and spills from ptxas's own report (-v), instructions from the SASS."""
    arch = f"sm_{rec.arch}a" if rec.arch >= 90 else f"sm_{rec.arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(binary.asm["ptx"])
        cubin.write_bytes(binary.asm["cubin"])
        log = subprocess.run([get_ptxas(rec.arch).path, "-v", f"--gpu-name={arch}", ptx, "-o", Path(tmp) / "v.o"],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    rec.regs = int(re.search(r"Used (\d+) registers", log).group(1))
    rec.spill_bytes = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    ops = collections.Counter(m.split(".")[0] + (".128" if m.endswith(".128") else "")
                              for m in re.findall(r"\b((?:HMMA|HGMMA|LDGSTS|LDG|STG)[\w.]*)", sass))
    rec.sass = dict(ops)


def judge(rec: Compiled) -> None:
    tensor_cores = rec.sass.get("HMMA", 0) + rec.sass.get("HGMMA", 0)
    if rec.spill_bytes > SPILL_TOLERANCE:
        rec.problems.append(f"register spills: {rec.spill_bytes} B stored + loaded")
    if rec.shared_bytes > SHARED_LIMIT.get(rec.arch, 48 * 1024):
        rec.problems.append(f"shared memory {rec.shared_bytes} B over sm_{rec.arch}'s limit")
    if rec.kernel in ("_decode_partition", "_prefill"):
        if rec.dtype != "fp32" and not tensor_cores:
            rec.problems.append("no tensor-core instructions for a half-precision dot")
        if rec.dtype == "fp32" and tensor_cores:
            rec.problems.append("tensor cores (TF32) used where IEEE fp32 was asked for")
        d = rec.constants.get("D", 0)
        if d and d == rec.constants.get("BD") and not rec.constants.get("FP8") \
                and not (rec.sass.get("LDGSTS.128") or rec.sass.get("LDG.128")):
            rec.problems.append("K/V not read with 128-bit loads")


def decode_meta(s: int, max_blocks: int, max_context: int, graph: bool) -> TritonMetadata:
    # Eager steps pass int64 tables/lengths (pad_rows); the CUDA-graph buffers are int32.
    idx = torch.int32 if graph else torch.long
    return TritonMetadata(slot_mapping=torch.zeros(s, dtype=torch.long), num_decodes=s,
                             decode_block_tables=torch.zeros((s, max_blocks), dtype=idx),
                             decode_context_lens=torch.ones(s, dtype=idx), decode_max_context=max_context,
                             prefills=[])


def prefill_meta(block: int, chunks: tuple = ((40, 104), (100, 100))) -> TritonMetadata:
    """Prefill chunks (new tokens, context they end at). Default: 40 new tokens over a
    64-token cached prefix, and a fresh 100-token prompt."""
    seqs, at = [], 0
    for q_len, ctx in chunks:
        seqs.append(PrefillSeq(at, q_len, ctx, torch.arange(cdiv(ctx, block))))
        at += q_len
    return TritonMetadata(slot_mapping=torch.arange(at), num_decodes=0, decode_block_tables=None,
                             decode_context_lens=None, decode_max_context=0, prefills=seqs)


def run_backend(model: tuple, dtype: torch.dtype, meta: TritonMetadata, window: int = 0, kv: str | None = None) -> None:
    """One forward through the backend; kv: its pools' fp8 kind (uint8 rows, as the runner
    allocates them)."""
    _, h, kvh, d, block = model
    t = meta.slot_mapping.numel()
    backend = TritonPagedAttention()
    if kv:
        backend.use_kv_dtype(KV_DTYPES[kv])
    q = torch.zeros((t, h, d), dtype=dtype)
    k = torch.zeros((t, kvh, d), dtype=dtype)
    k_shape, v_shape = backend.cache_shapes(16, block, kvh, d, dtype)
    pool = backend.pool_dtype(dtype)
    kc, vc = torch.zeros(k_shape, dtype=pool), torch.zeros(v_shape, dtype=pool)  # never touched: nothing launches
    backend.forward(q, k, k.clone(), kc, vc, meta, d ** -0.5, window=window)


def check_model(comp: Compiler, model: tuple, arch: int, dt: str) -> None:
    comp.context = (model[0], arch, dt)
    dtype, kv = DTYPES[dt], KV_KINDS.get(dt)
    block = model[4]
    run_backend(model, dtype, prefill_meta(block), kv=kv)
    run_backend(model, dtype, decode_meta(8, 4, 60, graph=False), kv=kv)
    run_backend(model, dtype, decode_meta(8, GRAPH_BOUND // block, GRAPH_BOUND, graph=True), kv=kv)


def recompiles(comp: Compiler, model: tuple, arch: int) -> list[str]:
    """Steps as serving produces them: decodes of batch 1..256 over contexts 1..32k (tables
    as wide as the longest), prefill chunks of any length over any cached prefix. Each
    decode kernel may compile once per partition size, the others once. fp8 KV (e4m3) is
    one more variant of each (the reduce is shared: its inputs are fp32 partials)."""
    comp.keys_by_kernel.clear()
    block = model[4]
    parts = set()
    for dt in ("bf16", "e4m3"):
        comp.context = (model[0], arch, dt)
        kv = KV_KINDS.get(dt)
        for s, ctx in [(1, 1), (3, 17), (16, 512), (17, 513), (64, 2048), (100, 2100), (255, 4095), (256, 8000),
                       (2, 16384), (5, 16385), (7, 32768)]:
            run_backend(model, torch.bfloat16, decode_meta(s, cdiv(ctx, block), ctx, graph=False), kv=kv)
            parts.add(max(tk.PARTITION, triton.next_power_of_2(triton.cdiv(ctx, tk.MAX_PARTS))))
        for chunks in [((1, 1),), ((7, 7), (300, 900)), ((2048, 2048),), ((16, 4000), (5, 5), (33, 65), (64, 64))]:
            run_backend(model, torch.bfloat16, prefill_meta(block, chunks), kv=kv)
        # A sliding window is an argument like the lengths: windowed layers compile nothing more.
        for window in (1, 4096):
            run_backend(model, torch.bfloat16, decode_meta(64, cdiv(2048, block), 2048, graph=False), window, kv)
            run_backend(model, torch.bfloat16, prefill_meta(block, ((7, 7), (300, 900))), window, kv)
    got = {k: len(v) for k, v in comp.keys_by_kernel.items()}
    want = {"_reshape_and_cache": 2, "_decode_partition": 2 * len(parts), "_decode_reduce": len(parts),
            "_prefill": 2}
    return [f"{k}: {got.get(k, 0)} compiled variants over the sweep, expected {n}"
            for k, n in want.items() if got.get(k, 0) != n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="two models in bf16 on sm_80/sm_90, one also over fp8 e4m3 KV; fp32 on sm_90")
    ap.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    ap.add_argument("--dtype", default="bf16,fp16,fp32,e4m3,e5m2",
                    help="query dtypes; e4m3, e5m2: bf16 queries over fp8 KV")
    ap.add_argument("--json", default=None, help="write every compiled kernel's figures here")
    args = ap.parse_args()
    if not (BIN / "ptxas").exists():
        print(f"no ptxas bundled with triton at {BIN}: cannot compile for NVIDIA GPUs here")
        return 2
    archs = [int(a) for a in args.arch.split(",")]
    dtypes = args.dtype.split(",")
    models = QUICK if args.quick else MODELS
    plan = {a: [(m, d) for m in models for d in dtypes] for a in archs}  # per arch: (model, dtype)
    if args.quick:
        plan = {a: [(m, "bf16") for m in models] + [(models[-1], "e4m3")] for a in archs}
        plan[archs[-1]].append((models[-1], "fp32"))
    comp = Compiler()
    knobs.runtime.jit_cache_hook = comp
    problems: list[str] = []
    for arch in archs:
        driver.set_active(StandInDriver(arch))
        for kern in (tk._reshape_and_cache, tk._decode_partition, tk._decode_reduce, tk._prefill):
            kern.device_caches.clear()  # binders hold the target they were made for
        for model, dt in plan[arch]:
            check_model(comp, model, arch, dt)
        problems += [f"sm_{arch} {QUICK[-1][0]}: {p}" for p in recompiles(comp, QUICK[-1], arch)]
    knobs.runtime.jit_cache_hook = None

    recs = list(comp.seen.values())
    print(f"triton {triton.__version__}: {len(recs)} kernels compiled to cubin\n")
    print(f"{'kernel':<19} {'sm':>3} {'dtype':<5} {'model':<14} {'PART/BM':>7} {'regs':>4} {'smem KB':>7} "
          f"{'spill B':>7}  tensor-core / 128-bit loads")
    for r in sorted(recs, key=lambda r: (r.arch, r.model, r.dtype, r.kernel)):
        judge(r)
        tc = r.sass.get("HMMA", 0) + r.sass.get("HGMMA", 0)
        wide = r.sass.get("LDGSTS.128", 0) + r.sass.get("LDG.128", 0)
        tile = r.constants.get("PART", r.constants.get("BM", ""))
        print(f"{r.kernel:<19} {r.arch:>3} {r.dtype:<5} {r.model:<14} {tile!s:>7} {r.regs:>4} "
              f"{r.shared_bytes / 1024:>7.1f} {r.spill_bytes:>7}  {tc} / {wide}"
              + ("   <- " + "; ".join(r.problems) if r.problems else ""))
        problems += [f"{r.kernel} sm_{r.arch} {r.dtype} {r.model}: {p}" for p in r.problems]
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in recs], indent=1, default=str))
    print()
    for p in problems:
        print("PROBLEM", p)
    print("OK: every kernel compiles cleanly" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
