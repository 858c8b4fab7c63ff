"""The Triton paged-attention kernels against the torch reference backend.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1) on small shapes; with a
GPU (or PAGEDLLM_GPU_SHAPES=1) the same cases run at larger shapes. Skipped, with the
reason, where Triton is not installed."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm.attention import triton_available

if triton_available() is not None:
    pytest.skip(f"Triton kernels not tested: {triton_available()}", allow_module_level=True)

# Imported first, it sets TRITON_INTERPRET=1 before anything imports triton: the fixtures' HF
# transformers does, and triton read afterwards would not interpret (this file alone failed).
from pagedllm.attention import triton_kernels  # noqa: E402, F401



CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (heads, kv heads, head dim): GQA 4:1, MHA, and a head dim that is not a power of two.


@pytest.fixture(scope="module")
def attention_model(tmp_path_factory, model_dir):
    """A 2-layer random Llama with the default model's tokenizer whose attention dominates: the
    interpreter runs the whole engine on it in seconds, where the real 30 layers take minutes.
    (The suite's `tiny_model` leans on its output head instead, for n-gram drafts.)"""
    import transformers as tf
    from tiny import copy_tokenizer

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
    out = tmp_path_factory.mktemp("attention-llama")
    model.save_pretrained(out)
    copy_tokenizer(model_dir, out)
    return str(out)


def test_engine_greedy_output_same_as_torch_backend(make_llm, attention_model):
    """The whole engine on the Triton backend (interpreted on CPU): prefill, a prefix hit,
    n=2 fork with copy-on-write, decode; greedy tokens equal the torch backend's."""
    from pagedllm import SamplingParams

    system = "You are a helpful assistant who answers questions about geography in one short sentence. "
    prompts = [system + "The capital of France is", system + "The longest river is", "List three colors:"]
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(model=attention_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
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


def test_engine_on_fp8_kv_same_as_torch_backend(make_llm, attention_model):
    """--kv-cache-dtype fp8 through the whole engine on both backends: uint8 pools of the
    torch layout, a prefix hit and copy-on-write over their bytes, the rotated query and
    output. Both quantize each new row alike, so greedy tokens and logprobs agree."""
    from pagedllm import SamplingParams

    system = "You are a helpful assistant who answers questions about geography in one short sentence. "
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(model=attention_model, dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
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


def test_decode_graph_buffers_give_the_same_tokens(make_llm, attention_model):
    """The CUDA-graph decode path's static buffers, buckets and padding rows (slot -1,
    context 0), run eagerly here: greedy tokens equal the plain Triton path's."""
    import torch as _torch

    from pagedllm import SamplingParams
    from pagedllm.runtime.cuda_graphs import DecodeGraphs

    prompts = ["Name a fruit:", "The sky is", "One plus one is"]  # 3 decodes -> bucket 4, one padding row
    llm = make_llm(model=attention_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=128,
              attention_backend="triton", device=DEV, max_num_seqs=6, enforce_eager=True)
    r = llm.engine.runner
    assert r.graphs is None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    # Tokens and their logprobs: a wrong position or length shows in the logprobs even when
    # the argmax survives it.
    run = lambda: [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])  # noqa: E731
                   for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    plain = run()
    r.graphs = DecodeGraphs(r.model, r.backend, r.kv_cache.layers, 6, r.max_model_len, llm.engine.cfg.block_size, _torch.device(DEV),
                            use_graphs=CUDA)
    r.graphs.capture()
    assert r.graphs.buckets == [1, 2, 4, 8]
    llm.reset_prefix_cache()
    graphed = run()
    assert [t for t, _ in graphed] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(graphed, plain):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)  # logprobs: relative to their size


def test_graphed_decode_forward_never_waits_on_the_host(make_llm, attention_model):
    """What a CUDA graph replays must not read tensor values on the host (.item(), nonzero,
    ...: capture fails or bakes one step's values in) nor build tensors from Python data.
    The decode forward over the graph buffers, every aten op recorded."""
    import torch as _torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pagedllm.runtime.cuda_graphs import DecodeGraphs

    host_reads = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::equal",
                  "aten::is_nonzero", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::_unique2"}
    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    llm = make_llm(model=attention_model, dtype="float32", kv_cache_memory="64MiB", max_model_len=128,
              attention_backend="triton", device=DEV, max_num_seqs=4, enforce_eager=True)
    r = llm.engine.runner
    g = DecodeGraphs(r.model, r.backend, r.kv_cache.layers, 4, r.max_model_len, llm.engine.cfg.block_size, _torch.device(DEV),
                     use_graphs=False)
    g.ctx[:2] = _torch.tensor([5, 9], dtype=_torch.int32)
    g.slots[:2] = _torch.tensor([4, 40])
    with _torch.inference_mode(), Record():
        g.model(g.ids[:4], g.positions[:4], g.kv_layers, g._meta(4))
    # the forward ran under the recorder (its matmuls on oneDNN's reordered weights on a CPU)
    assert "aten::embedding" in ops and {"aten::linear", "mkldnn::_linear_pointwise"} & set(ops)
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
