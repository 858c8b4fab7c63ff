"""The Triton paged-attention kernels against the torch reference backend.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1) on small shapes; with a
GPU (or PAGEDLLM_GPU_SHAPES=1) the same cases run at larger shapes. Skipped, with the
reason, where Triton is not installed."""
from __future__ import annotations

import os
import random

import pytest
import torch

from pagedllm.attention import StepLayout, triton_available
from pagedllm.attention.kv_quant import FP8, quantize
from pagedllm.attention.torch_ref import TorchPagedAttention
from pagedllm.kv_dtype import KV_DTYPES

if triton_available() is not None:
    pytest.skip(f"Triton kernels not tested: {triton_available()}", allow_module_level=True)

from pagedllm.attention import triton_kernels as tk  # noqa: E402
from pagedllm.attention.triton_backend import TritonPagedAttention  # noqa: E402

tl = tk.tl  # triton.language, imported once the interpreter is set (triton_kernels sets it)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BIG = CUDA or os.environ.get("PAGEDLLM_GPU_SHAPES") == "1"
# (heads, kv heads, head dim): GQA 4:1, MHA, and a head dim that is not a power of two.
SHAPES = [(8, 2, 64), (4, 4, 32), (6, 2, 48)] if BIG else [(4, 2, 16), (2, 2, 32), (6, 2, 24)]
MAX_CTX = 3000 if BIG else 90


def make_batch(rng: random.Random, block_size: int, kvh: int, d: int, decode_lens: list[int],
               prefill: list[tuple[int, int]], dtype=torch.float32, kv: str | None = None):
    """A random pool and block tables for decodes (context lengths) and prefills
    (cached prefix length, new query tokens); physical blocks shuffled across sequences.
    kv: a quantized kind: the pool holds random values' quantized rows (keys 3x larger)."""
    need = [-(-n // block_size) for n in decode_lens] + [-(-(c + q) // block_size) for c, q in prefill]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn((num_blocks, block_size, kvh, d), generator=g).to(DEV, dtype)
    v_cache = torch.randn((num_blocks, block_size, kvh, d), generator=g).to(DEV, dtype)
    if kv:
        k_cache, v_cache = quantize(k_cache * 3, KV_DTYPES[kv], key=True), quantize(v_cache, KV_DTYPES[kv])
    return k_cache, v_cache, tables


def build_layout(block_size: int, tables: list[list[int]], decode_lens: list[int], prefill: list[tuple[int, int]]):
    """The step as the runner lays it out (decodes first), and its query row count."""
    slots, starts, lens, used = [], [0], [], []
    nd = len(decode_lens)
    for i, n in enumerate(decode_lens):
        slots.append(tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size)
        starts.append(starts[-1] + 1)
        lens.append(n)
        used.append(tables[i][:-(-n // block_size)])
    for j, (cached, ql) in enumerate(prefill):
        t = tables[nd + j]
        end = cached + ql
        slots += [t[p // block_size] * block_size + p % block_size for p in range(cached, end)]
        starts.append(starts[-1] + ql)
        lens.append(end)
        used.append(t[:-(-end // block_size)])
    return StepLayout(slots, used, lens, starts, nd), starts[-1]


def release_below_window(layout: StepLayout, k_cache, v_cache, block_size: int, window: int, firsts: list[int]) -> None:
    """What the KV manager does under a sliding window: each table's entries wholly below
    its first query's window become -1, and their blocks are overwritten with huge values
    (read once, they would swamp the result)."""
    for table, first in zip(layout.block_tables, firsts):
        for i in range(max(0, first - window + 1) // block_size):
            k_cache[table[i]], v_cache[table[i]] = (255, 255) if k_cache.dtype == torch.uint8 else (1e4, 1e4)
            table[i] = -1


def run_both(seed: int, block_size: int, shape, decode_lens, prefill, dtype=torch.float32, atol=2e-4, window=0,
             kv: str | None = None):
    """The Triton backend's step against the torch reference's, on copies of one pool
    (kv: both storing that quantized kind)."""
    h, kvh, d = shape
    rng = random.Random(seed)
    k_cache, v_cache, tables = make_batch(rng, block_size, kvh, d, decode_lens, prefill, dtype, kv)
    layout, t = build_layout(block_size, tables, decode_lens, prefill)
    if window:
        release_below_window(layout, k_cache, v_cache, block_size, window,
                             [n - 1 for n in decode_lens] + [c for c, _ in prefill])
    ref_backend, triton = TorchPagedAttention(), TritonPagedAttention()
    if kv:
        ref_backend.use_kv_dtype(KV_DTYPES[kv])
        triton.use_kv_dtype(KV_DTYPES[kv])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, h, d), generator=g).to(DEV, dtype)
    k = torch.randn((t, kvh, d), generator=g).to(DEV, dtype)
    v = torch.randn((t, kvh, d), generator=g).to(DEV, dtype)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = ref_backend.forward(q, k, v, k_cache, v_cache, ref_backend.build_metadata(layout, DEV), d ** -0.5,
                              window=window)
    out = triton.forward(q, k, v, kc2, vc2, triton.build_metadata(layout, DEV), d ** -0.5, window=window)
    assert torch.equal(kc2, k_cache) and torch.equal(vc2, v_cache), "reshape_and_cache wrote different slots"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_mixed_lengths(block_size, shape):
    rng = random.Random(block_size * 31 + shape[2])
    lens = [1, 2, block_size, block_size + 1] + [rng.randint(1, MAX_CTX) for _ in range(4)]
    run_both(1, block_size, shape, lens, [])


def test_decode_long_context_splits_into_partitions():
    """Contexts over one partition (512 tokens) are split and reduced."""
    lens = [tk.PARTITION + 7, 2 * tk.PARTITION + 100, 3] if not BIG else [4096, 2049, 511, 513]
    run_both(2, 16, SHAPES[0], lens, [])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_over_cached_prefix(block_size, shape):
    """Fresh prompts, chunks after a cached prefix (full and partial blocks), one-token chunks."""
    prefill = [(0, 37), (2 * block_size, 20), (block_size + 5, 1), (0, 1), (3, 70 if not BIG else 700)]
    run_both(3, block_size, shape, [], prefill)


def test_mixed_decode_and_prefill_batch():
    run_both(4, 16, SHAPES[0], [5, 40, 1], [(16, 9), (0, 33)])


def test_empty_batch_and_padding_rows():
    run_both(5, 16, SHAPES[0], [], [])
    # Padding rows as CUDA-graph buckets make them: slot -1 (nothing written), context 0 (output 0).
    h, kvh, d = SHAPES[0]
    k_cache = torch.zeros((4, 16, kvh, d), device=DEV)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones((2, kvh, d), device=DEV)
    tk.reshape_and_cache(k, k, k_cache, v_cache, torch.tensor([5, -1], device=DEV))
    assert k_cache.view(-1, kvh, d)[5].eq(1).all() and k_cache.sum() == kvh * d
    q = torch.randn((2, h, d), device=DEV)
    out = tk.paged_decode(q, k_cache, v_cache, torch.tensor([[0], [0]], device=DEV),
                          torch.tensor([6, 0], device=DEV), 0.1, max_context=2048)
    assert torch.isfinite(out).all() and out[1].eq(0).all()
    # A graph-sized bound (128k) makes longer partitions, not hundreds of them; same answer.
    big = tk.paged_decode(q, k_cache, v_cache, torch.tensor([[0], [0]], device=DEV),
                          torch.tensor([6, 0], device=DEV), 0.1, max_context=131072)
    torch.testing.assert_close(big, out)


@pytest.mark.parametrize("window", [1, 20, 70])
def test_sliding_window_skips_released_blocks(window):
    """A windowed layer: decodes (one split into partitions wholly below the window) and
    prefill chunks whose tiles start inside and below the window; the -1 entries the
    window released are never read."""
    decode = [1, 17, 60, tk.PARTITION + 40] if not BIG else [1, 17, 600, 3 * tk.PARTITION + 40]
    run_both(7, 16, SHAPES[2], decode, [(0, 37), (45, 20), (70, 1), (3, 50)], window=window)


def test_bf16():
    """bf16 K/V and queries (tensor cores on a GPU; widened to fp32 dots in the interpreter,
    whose numpy dot has no bf16)."""
    if BIG:
        run_both(6, 16, SHAPES[0], [2048] * 8 + [17], [(512, 300)], dtype=torch.bfloat16, atol=2e-2)
    else:
        run_both(6, 16, SHAPES[0], [MAX_CTX, 40, 17, 1], [(20, 45)], dtype=torch.bfloat16, atol=2e-2)


@tk.triton.jit
def _widen_fp8(codes_ptr, out_ptr, FP8: tl.constexpr):
    c = tl.load(codes_ptr + tl.arange(0, 256))
    tl.store(out_ptr + tl.arange(0, 256), tk._fp8_as_fp16(c, FP8).to(tl.float32) * tk._fp8_unit(FP8))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # e5m2's NaN x 1, in numpy
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_widen_exactly(kind):
    """Every fp8 code, widened by the kernels' bit moves (sm_80 has no e4m3 type), is the
    value torch gives it: subnormals and signed zeros included (e4m3's NaN code aside: the
    quantizer clamps to the finite range; e5m2's inf and NaN come through as fp16's)."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    got = torch.empty(256, device=DEV)
    _widen_fp8[(1,)](codes, got, FP8=tk.FP8_KINDS[kind])
    want = codes.view(FP8[kind]).float()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite]) and torch.equal(got[finite].signbit(), want[finite].signbit())
    assert (~finite).sum() == (2 if kind == "fp8_e4m3" else 8)
    if kind == "fp8_e5m2":
        assert torch.equal(got[~finite].isinf(), want[~finite].isinf()) and got[~finite].isnan().sum() == 6


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_read_in_place(kind):
    """fp8 pools (torch layout: codes, then the bf16 scale) read in place: decodes and
    prefills over cached prefixes, GQA 3:1 at a head dim that is not a power of two (the
    row's scale sits past D, inside the padded tile), a window with released blocks (0xff:
    NaN if read), bf16 (e4m3) and fp16 (e5m2) queries; the pools written byte for byte as
    the torch backend's."""
    run_both(8, 16, SHAPES[0], [5, 40, 1], [(16, 9), (0, 33)], kv=kind)
    run_both(9, 16, SHAPES[2], [1, 17, 60], [(45, 20), (3, 50)], window=20, kv=kind)
    half = torch.bfloat16 if kind == "fp8_e4m3" else torch.float16
    run_both(10, 16, SHAPES[0], [MAX_CTX, 17], [(20, 45)], dtype=half, atol=2e-2, kv=kind)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    """A 2-layer random Llama with the default model's tokenizer: the interpreter runs the
    whole engine on it in seconds, where the real 30 layers take minutes."""
    import shutil

    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharp logits: no near-ties for greedy to break differently
        for layer in model.model.layers:  # attention must dominate the residual stream, or the
            for proj, k in (("q_proj", 3), ("k_proj", 3), ("v_proj", 6), ("o_proj", 6)):  # test
                getattr(layer.self_attn, proj).weight.mul_(k)  # could not see an attention bug
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return str(out)


def test_engine_greedy_output_same_as_torch_backend(tiny_model):
    """The whole engine on the Triton backend (interpreted on CPU): prefill, a prefix hit,
    n=2 fork with copy-on-write, decode; greedy tokens equal the torch backend's."""
    from pagedllm import LLM, SamplingParams

    system = "You are a helpful assistant who answers questions about geography in one short sentence. "
    prompts = [system + "The capital of France is", system + "The longest river is", "List three colors:"]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
                  attention_backend=backend, device=DEV)
        assert llm.engine.runner.backend_name == backend
        greedy = [llm.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                               use_tqdm=False)[0]
                  for p in prompts[:2]]  # one after the other: the second hits the first's blocks
        forked = llm.generate(prompts[2], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8,
                                                          ignore_eos=True, logprobs=0), use_tqdm=False)
        outs[backend] = [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for o in greedy + forked
                         for c in o.outputs]
        assert llm.get_stats().kv.cow_copies >= 1 and llm.get_stats().kv.prefix_hits > 0
    assert [t for t, _ in outs["triton"]] == [t for t, _ in outs["torch"]]
    for (_, a), (_, b) in zip(outs["triton"], outs["torch"]):  # logprobs show errors argmax hides
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)  # logprobs: relative to their size


def test_engine_on_fp8_kv_same_as_torch_backend(tiny_model):
    """--kv-cache-dtype fp8 through the whole engine on both backends: uint8 pools of the
    torch layout, a prefix hit and copy-on-write over their bytes, the rotated query and
    output. Both quantize each new row alike, so greedy tokens and logprobs agree."""
    from pagedllm import LLM, SamplingParams

    system = "You are a helpful assistant who answers questions about geography in one short sentence. "
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                  attention_backend=backend, device=DEV, kv_cache_dtype="fp8")
        assert llm.engine.runner.backend.kv.name == "fp8_e4m3"
        run = [llm.generate(system + p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, n=n,
                                                       seed=3), use_tqdm=False)[0]
               for p, n in (("The capital of France is", 1), ("The longest river is", 2))]  # a hit, then a fork
        outs[backend] = [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                         for o in run for c in o.outputs]
        assert llm.get_stats().kv.prefix_hits > 0 and llm.get_stats().kv.cow_copies >= 1
    assert [t for t, _ in outs["triton"]] == [t for t, _ in outs["torch"]]
    for (_, a), (_, b) in zip(outs["triton"], outs["torch"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)  # logprobs: relative to their size


def test_decode_graph_buffers_give_the_same_tokens(tiny_model):
    """The CUDA-graph decode path's static buffers, buckets and padding rows (slot -1,
    context 0), run eagerly here: greedy tokens equal the plain Triton path's."""
    import torch as _torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.runtime.cuda_graphs import DecodeGraphs

    prompts = ["Name a fruit:", "The sky is", "One plus one is"]  # 3 decodes -> bucket 4, one padding row
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=128,
              attention_backend="triton", device=DEV, max_num_seqs=6, enforce_eager=True)
    r = llm.engine.runner
    assert r.graphs is None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    # Tokens and their logprobs: a wrong position or length shows in the logprobs even when
    # the argmax survives it.
    run = lambda: [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])  # noqa: E731
                   for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    plain = run()
    r.graphs = DecodeGraphs(r.model, r.backend, r.kv_cache.layers, 6, r.max_model_len, r.block_size, _torch.device(DEV),
                            use_graphs=CUDA)
    r.graphs.capture()
    assert r.graphs.buckets == [1, 2, 4, 8]
    llm.reset_prefix_cache()
    graphed = run()
    assert [t for t, _ in graphed] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(graphed, plain):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)  # logprobs: relative to their size


def test_graphed_decode_forward_never_waits_on_the_host(tiny_model):
    """What a CUDA graph replays must not read tensor values on the host (.item(), nonzero,
    ...: capture fails or bakes one step's values in) nor build tensors from Python data.
    The decode forward over the graph buffers, every aten op recorded."""
    import torch as _torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pagedllm import LLM
    from pagedllm.runtime.cuda_graphs import DecodeGraphs

    host_reads = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::equal",
                  "aten::is_nonzero", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::_unique2"}
    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=128,
              attention_backend="triton", device=DEV, max_num_seqs=4, enforce_eager=True)
    r = llm.engine.runner
    g = DecodeGraphs(r.model, r.backend, r.kv_cache.layers, 4, r.max_model_len, r.block_size, _torch.device(DEV),
                     use_graphs=False)
    g.ctx[:2] = _torch.tensor([5, 9], dtype=_torch.int32)
    g.slots[:2] = _torch.tensor([4, 40])
    with _torch.inference_mode(), Record():
        g.model(g.ids[:4], g.positions[:4], g.kv_layers, g._meta(4))
    assert {"aten::linear", "aten::embedding"} <= set(ops)  # the forward ran under the recorder
    assert not host_reads & set(ops), sorted(host_reads & set(ops))


@pytest.mark.skipif(CUDA, reason="the interpreter is only used without CUDA")
def test_triton_imported_before_the_interpreter_was_set_is_a_clear_error():
    """transformers imports triton; if that happens before PagedLLM sets TRITON_INTERPRET=1,
    the interpreter cannot run Triton's own library functions. Say so, at backend creation."""
    import subprocess
    import sys

    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton\n"
            "from pagedllm.attention import get_backend\n"
            "try:\n    get_backend('triton')\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ValueError: attention backend triton cannot run here" in res.stdout, res.stdout + res.stderr
    assert "export TRITON_INTERPRET=1" in res.stdout and "--attention-backend torch" in res.stdout
