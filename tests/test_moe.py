"""Mixtures of experts (models/moe.py): Qwen3-MoE, Qwen2-MoE (its shared expert), OLMoE (its
whole-projection QK-norm) and Mixtral (its own module names), each a tiny random model of 16
experts made with transformers' own class: greedy tokens equal HF transformers', prompt
logprobs agree within float rounding, on the compiled kernel (one call a layer) and on the
torch path; the kernel against torch on routing with ties and experts no row chose. Quantized
experts: GGUF files of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral (Q8_0; Q4_K_M's Q4_K and Q6_K experts) give
transformers' greedy tokens from the same file; int8 / int4 experts from float weights; the block
kernel against its blocks dequantized, for every block type."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import hf_memo
from hf_greedy import assert_greedy_matches

from pagedllm import SamplingParams

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)


def _config(family: str):
    import transformers as tf

    if family == "qwen3_moe":   # the first layer dense (mlp_only_layers), top-4 of 16, renormalized
        return tf.Qwen3MoeConfig(**BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                 num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0])
    if family == "qwen2_moe":   # a shared expert beside the routed ones, not renormalized
        return tf.Qwen2MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=16, num_experts_per_tok=4,
                                 norm_topk_prob=False)
    if family == "olmoe":
        return tf.OlmoeConfig(**BASE, intermediate_size=32, num_experts=16, num_experts_per_tok=4)
    if family == "mixtral":
        return tf.MixtralConfig(**BASE, intermediate_size=48, num_local_experts=16, num_experts_per_tok=2,
                                sliding_window=None)
    raise AssertionError(family)


def make_model(tmp_path, model_dir, family: str):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():   # norms and the router away from their init, so a slip would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    out = tmp_path / family
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, out / f)
    return model, out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_moe_family_matches_hf(make_llm, tmp_path, model_dir, family, monkeypatch):
    hf, path = make_model(tmp_path, model_dir, family)
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    want, refs = [], []
    for ids in prompts:
        with torch.no_grad():
            want.append(hf_memo.generate(hf, torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist())
            refs.append(torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1))
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.layers[1].mlp.w13.shape[0] == 16
    from pagedllm.analysis.kv_calc import param_count   # kv-calc's weights: the checkpoint's, every expert
    assert param_count(llm.engine.model_cfg) == sum(p.numel() for p in hf.parameters())
    assert param_count(llm.engine.model_cfg, active=True) < param_count(llm.engine.model_cfg)
    from pagedllm.engine.kv_report import kv_report   # the weights as held (every expert) and as one token reads them
    st = llm.get_stats()
    assert (st.weights_bytes, st.active_weights_bytes) == (4 * param_count(llm.engine.model_cfg),
                                                            4 * param_count(llm.engine.model_cfg, active=True))
    assert "GiB read a token (its top k experts a layer)" in kv_report(st)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out, w, ref in zip(prompts, outs, want, refs):
        assert out.outputs[0].token_ids == w
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_layer_equals_torch(dtype):
    """kernels/csrc/moe.cpp against the torch grouping: 37 rows, top-3 of 8 experts with two
    experts no row chose, ties in the router's scores, SiLU and GELU gates, gpt-oss's clamped SwiGLU
    with its expert biases (a limit of 1: most values clamped), and a decode-sized batch (the
    experts spread over the threads)."""
    from types import SimpleNamespace

    from pagedllm.kernels import load_ops
    from pagedllm.models.config import MoEConfig
    from pagedllm.models.ops import Ops
    from pagedllm.models.moe import SparseMoE, experts_torch

    g = torch.Generator().manual_seed(0)
    moe = SparseMoE(SimpleNamespace(hidden_size=64, activation="silu", moe=MoEConfig(8, 3, 48, False)))
    moe.w13.data = (torch.randn(8, 2 * 48, 64, generator=g) / 8).to(dtype)
    moe.w2.data = (torch.randn(8, 64, 48, generator=g) / 8).to(dtype)
    ops = Ops(load_ops())
    # bf16 weights also packed for vdpbf16ps where the CPU has it (pack_bf16: every row count on one kernel)
    layouts = [False, True] if dtype == torch.bfloat16 and ops.k.moe_can_pack() else [False]
    for packed in layouts:
        if packed:
            plain = moe.expert_weights(5, dtype)
            moe.pack_bf16()
            assert all(torch.equal(a, b) for a, b in zip(moe.expert_weights(5, dtype), plain))
        for t, act in ((37, "silu"), (3, "gelu_tanh"), (300, "silu"), (3, "swiglu_oai"), (37, "swiglu_oai")):
            moe.activation = act
            oai = act == "swiglu_oai"
            moe.routing = MoEConfig(8, 3, 48, False, swiglu_limit=1.0)
            moe.w13_bias = (torch.randn(8, 96, generator=g) / 2).to(dtype) if oai else None
            moe.w2_bias = (torch.randn(8, 64, generator=g) / 2).to(dtype) if oai else None
            x = torch.randn(t, 64, generator=g).to(dtype)
            experts = torch.randint(0, 6, (t, 3), generator=g)   # experts 6 and 7: chosen by no row
            weights = torch.rand(t, 3, generator=g)
            weights[0] = 1 / 3   # a tie
            want = experts_torch(moe, x, weights, experts, ops.act_mul)
            got = ops.experts(moe, x, weights, experts)
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got.float(), want.float(), **tol)


def test_moe_refusals(make_llm, tmp_path, model_dir):
    """What a mixture of experts does not run yet is refused naming it; a missing expert
    tensor fails the load naming the tensor."""
    from safetensors.torch import load_file, save_file

    _, path = make_model(tmp_path, model_dir, "qwen3_moe")
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*experts \(16\)"):
        make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=3,
                 enable_expert_parallel=True)
    for bad, why in (({"batch_invariant": True}, "batch_invariant is not supported with a mixture of experts"),
                     ({"enable_lora": True}, "enable_lora is not supported with a mixture of experts")):
        with pytest.raises(ValueError, match=why):
            make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", **bad)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB")


GGUF_BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=260,   # gguf_files' tiny byte-level tokenizer: a conversion of seconds, not tens max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False, intermediate_size=512, moe_intermediate_size=256, num_experts=16,
                 num_experts_per_tok=4)


@pytest.fixture(scope="module")
def gguf_q8(tmp_path_factory):
    """arch -> a tiny random mixture (K = 256: K-quant super-blocks fit; a byte-level vocabulary of 260)
    as a Q8_0 GGUF file written by gguf-py, made once for the module."""
    import transformers as tf

    from benchmarks.lib.gguf_files import write_gguf

    made: dict = {}

    def get(arch: str):
        if arch not in made:
            if arch == "qwen3moe":
                cfg = tf.Qwen3MoeConfig(**GGUF_BASE, head_dim=64, norm_topk_prob=True)
            elif arch == "qwen2moe":
                cfg = tf.Qwen2MoeConfig(**GGUF_BASE, shared_expert_intermediate_size=128, norm_topk_prob=False)
            else:   # OLMoE, and Mixtral: llama.cpp writes it as "llama" with expert tensors
                base = {**GGUF_BASE, "intermediate_size": GGUF_BASE["moe_intermediate_size"]}
                base.pop("moe_intermediate_size")
                cfg = tf.OlmoeConfig(**base) if arch == "olmoe" else \
                    tf.MixtralConfig(**{**base, "num_local_experts": base.pop("num_experts")}, sliding_window=None)
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.add_(torch.randn_like(p) * 0.3)
                    elif name.endswith("gate.weight"):
                        p.normal_(0, 0.5)
            made[arch] = write_gguf(model, tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", arch, "Q8_0", None)
        return made[arch]
    return get


# The expert types of a file llama.cpp's quantizer writes: Q4_K_M's Q4_K gate/up and Q6_K down, and
# Q2_K (no kernel here). Their blocks are random (sane scales): the reference is what transformers reads
# from the same bytes, so where the bytes come from does not matter (llama-cpp-python is no test dependency).
EXPERT_TYPES = {"Q4_K_M": {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
                "Q2_K": {"ffn_gate_exps": "Q2_K", "ffn_up_exps": "Q2_K", "ffn_down_exps": "Q2_K"}}


def _gguf_moe(gguf_q8, tmp_path, arch: str, quant: str):
    """The mixture as a Q8_0 file, or the same file with its experts in `quant`'s types (EXPERT_TYPES)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from unit.test_quantization_kernels import random_raw

    path = gguf_q8(arch)
    if quant == "Q8_0":
        return path
    reader, out = GGUFReader(str(path)), tmp_path / f"{arch}-{quant}.gguf"
    w = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    g = torch.Generator().manual_seed(1)
    for t in reader.tensors:
        kind = next((q for key, q in EXPERT_TYPES[quant].items() if f".{key}." in t.name), None)
        if kind is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        e, n, k = (int(d) for d in reversed(t.shape))
        if kind == "Q2_K":   # zeros: a valid block (d = 0), and the load fails before any value is read
            raw = np.zeros((e, n, k // 256 * GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1]), np.uint8)
        else:
            raw = random_raw(kind, e * n, k, g).raw.numpy().reshape(e, n, -1)
        w.add_tensor(t.name, raw, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("arch,quant,kinds", [("qwen3moe", "Q4_K_M", "Q4_K/Q6_K"),
                                              ("qwen2moe", "Q8_0", "q8_0/q8_0"),
                                              ("olmoe", "Q8_0", "q8_0/q8_0"),
                                              ("llama", "Q8_0", "q8_0/q8_0")])
def test_gguf_experts_match_transformers(make_llm, gguf_q8, tmp_path, arch, quant, kinds):
    """The file's own expert blocks (ffn_*_exps) run in the compiled layer and give the greedy tokens
    of transformers' model of the same file (its dequantized values, as our conversion saved them
    with the expert widths transformers' GGUF reader leaves out)."""
    from transformers import AutoModelForCausalLM

    path = _gguf_moe(gguf_q8, tmp_path, arch, quant)
    llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    summary = llm.engine.runner.model.quant_summary
    assert kinds in summary and "routers float" in summary, summary
    assert llm.engine.runner.model.layers[0].mlp.quantized
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    assert (getattr(hf.config, "moe_intermediate_size", None) or hf.config.intermediate_size) == 256
    assert llm.engine.model_cfg.model_type == {"llama": "mixtral"}.get(arch, arch.replace("moe", "_moe")
                                                                      if arch.startswith("qwen") else arch)
    assert_greedy_matches(llm, hf, [[5, 17, 200, 250, 12], list(range(100, 160))], 10)


def test_int8_int4_and_w8a8_experts(make_llm, tmp_path, model_dir):
    """quantization int8 / int4 puts the experts on q8_0 / q4_1 blocks made from the float weights,
    w8a8 on int8 weights and activations (the router stays float); their prompt logprobs stay near
    the float model's."""
    _, path = make_model(tmp_path, model_dir, "qwen3_moe")
    ids = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(llm):
        out = llm.generate([ids], params, use_tqdm=False)[0]
        return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    ref = logprobs(make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB"))
    for method, fmt, tol in (("int8", "q8_0", 0.02), ("int4", "q4_1", 0.3), ("w8a8", None, 0.1)):
        llm = make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization=method)
        moe = llm.engine.runner.model.layers[1].mlp
        assert moe.quantized and getattr(moe.gate, "qformat", None) is None
        summary = llm.engine.runner.model.quant_summary
        assert moe.w8a8 and "W8A8 too, routers float" in summary if fmt is None else \
            moe.w13_format == fmt and f"layers on {fmt} blocks, routers float" in summary
        got = logprobs(llm)
        assert 0 < (got - ref).abs().max() < tol, (method, (got - ref).abs().max())


def _dense_kernel_experts(moe, x, weights, experts, k):
    """The reference of a bf16 run: each expert's rows through the dense block kernels
    (q8_0_linear, q4_1_linear, ggml_linear) on that expert's blocks, combined in fp32."""
    from pagedllm.models.quantization import FORMAT_IDS

    def linear(fmt, parts, e, rows):
        out = rows.new_empty(rows.shape[0], parts[0].shape[1])
        if fmt == "q8_0":
            k.q8_0_linear(out, rows, parts[0][e], parts[1][e])
        elif fmt == "q4_1":
            k.q4_1_linear(out, rows, parts[0][e], parts[1][e], parts[2][e])
        else:
            k.ggml_linear(out, rows, parts[0][e], FORMAT_IDS[fmt])
        return out

    _, p13, _, p2, _ = moe.block_args()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in experts.unique().tolist():
        row, slot = (experts == e).nonzero(as_tuple=True)
        h = torch.empty(len(row), p13[0].shape[1] // 2, dtype=x.dtype)
        gate_up = linear(moe.w13_format, p13, e, x[row].contiguous())
        if moe.w13_bias is None:
            k.silu_and_mul(h, gate_up)
        else:   # gpt-oss: its biases and SwiGLU in fp32, rounded once, as the kernel does
            h = moe.activate(gate_up.float() + moe.w13_bias[e].float(), None).to(x.dtype)
        y = linear(moe.w2_format, p2, e, h)
        if moe.w2_bias is not None:
            y = (y.float() + moe.w2_bias[e].float()).to(x.dtype)
        out.index_add_(0, row, y.float() * weights[row, slot, None])
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_block_experts_equal_their_dequantized(fmt):
    """moe_experts_blocks against the torch grouping over the same blocks dequantized in fp32, and
    in bf16 against the dense block kernels run expert by expert (the same arithmetic: at a few rows
    x as int8 codes, as llama.cpp computes it), at decode (experts spread over the threads) and
    prefill sizes. MXFP4 as gpt-oss runs it: its clamped SwiGLU (limit 1) and expert biases."""
    from pagedllm.kernels import load_ops
    from types import SimpleNamespace

    from pagedllm.models.config import MoEConfig
    from pagedllm.models.ops import Ops
    from pagedllm.models.moe import SparseMoE, experts_torch
    from pagedllm.models.quantization import quantize_q4_1, quantize_q8_0

    g = torch.Generator().manual_seed(0)
    e, hid, width = 8, 256, 256
    oai = fmt == "MXFP4"
    moe = SparseMoE(SimpleNamespace(hidden_size=hid, activation="swiglu_oai" if oai else "silu",
                                    moe=MoEConfig(e, 3, width, False, expert_bias=oai, swiglu_limit=1.0)))
    if oai:
        moe.w13_bias.data, moe.w2_bias.data = torch.randn(e, 2 * width, generator=g), torch.randn(e, hid, generator=g)
    if fmt in ("q8_0", "q4_1"):
        make = quantize_q8_0 if fmt == "q8_0" else quantize_q4_1
        w13, w2 = make(torch.randn(e * 2 * width, hid, generator=g) / 16), make(torch.randn(e * hid, width, generator=g) / 16)
    else:
        from unit.test_quantization_kernels import random_raw   # random bytes, sane fp16 scales

        w13, w2 = random_raw(fmt, e * 2 * width, hid, g), random_raw(fmt, e * hid, width, g)
    moe.set_blocks(w13, w2)
    ops = Ops(load_ops())
    biases = (moe.w13_bias.data, moe.w2_bias.data) if oai else ()
    for dtype in (torch.float32, torch.bfloat16):
        if oai:
            moe.w13_bias.data, moe.w2_bias.data = (b.to(dtype) for b in biases)
        for t in (3, 37):
            x = torch.randn(t, hid, generator=g).to(dtype)
            experts = torch.randint(0, 6, (t, 3), generator=g)   # experts 6 and 7: chosen by no row
            weights = torch.rand(t, 3, generator=g)
            want = experts_torch(moe, x, weights, experts, ops.act_mul) if dtype == torch.float32 else \
                _dense_kernel_experts(moe, x, weights, experts, ops.k)
            got = ops.experts(moe, x, weights, experts).float()
            tol = dict(atol=1e-5 * want.abs().max().item(), rtol=1e-5) if dtype == torch.float32 else \
                dict(atol=1e-3 * want.abs().max().item(), rtol=2 ** -7)   # bf16: an ulp of the output's rounding
            torch.testing.assert_close(got, want.float(), **tol)


def test_gguf_expert_type_without_kernel_fails_naming_it(make_llm, gguf_q8, tmp_path):
    """Experts in a block type with no kernel here (Q2_K) fail the load naming the tensor and its type,
    rather than running some other way."""
    path = _gguf_moe(gguf_q8, tmp_path, "qwen3moe", "Q2_K")
    with pytest.raises(ValueError, match=r"expert tensors of a type without a kernel here: blk\.\d+\.ffn_\w+_exps\.weight: Q2_K"):
        make_llm(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")


@pytest.mark.parametrize("family,inter", [("qwen2_moe", 32), ("mixtral", 48)])
def test_tensor_parallel_mixture_matches_one_rank(tmp_path, model_dir, family, inter):
    """Under tensor_parallel_size 2 a mixture's experts are sharded (each rank 1/2 of every expert's
    columns) or, with enable_expert_parallel, split whole (each rank 8 of the 16); the router runs on
    both ranks, the shared expert is sharded, and one all-reduce adds the parts: greedy tokens equal
    one rank's, and each rank holds half the experts' bytes. Qwen2-MoE: routed experts and a shared
    one; Mixtral: experts under its own names (block_sparse_moe.experts.E.w1), cut by ours."""
    from pagedllm import LLM

    hf, path = make_model(tmp_path, model_dir, family)
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(model=str(path), dtype="float32", num_gpu_blocks_override=16, num_threads=1)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    for ep in (False, True):
        llm = LLM(**kw, tensor_parallel_size=2, enable_expert_parallel=ep)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want, ep
        moe = llm.engine.runner.model.layers[1].mlp
        assert (moe.local_experts, moe.w13.shape[1]) == ((8, 2 * inter) if ep else (16, inter))
        del llm


def test_bf16_experts_packed_for_vdpbf16ps(tmp_path, model_dir, monkeypatch):
    """A bf16 mixture's experts are packed once at load where the CPU has AVX512-BF16 (one kernel for
    a decode step's few rows and a prefill's hundreds): its prompt logprobs equal the plain layout's
    (PAGEDLLM_PREPACK=0) within bf16 rounding."""
    from pagedllm import LLM
    from pagedllm.kernels import load_ops

    can = load_ops().moe_can_pack()   # without AVX512-BF16 the experts stay plain, and so the same
    _, path = make_model(tmp_path, model_dir, "qwen3_moe")
    ids = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = {}
    for packed in (True, False):
        monkeypatch.setenv("PAGEDLLM_PREPACK", "panels" if packed else "0")   # panels forced: the chooser might time plain faster
        llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB")
        assert llm.engine.runner.model.layers[1].mlp.packed == (packed and can)
        out = llm.generate([ids], params, use_tqdm=False)[0]
        got[packed] = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    torch.testing.assert_close(got[True], got[False], atol=0.05, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_experts_equal_their_arithmetic_in_torch(dtype):
    """moe_experts_w8a8 (VNNI's u8 x s8 sums on weights packed once, each row's activations quantized
    as the kernel runs) against the same arithmetic in torch (codes times scales, float matmuls),
    at decode and prefill sizes, and as one rank of two under expert parallelism."""
    from types import SimpleNamespace

    from pagedllm.kernels import load_ops
    from pagedllm.models.config import MoEConfig
    from pagedllm.models.ops import Ops
    from pagedllm.models.moe import SparseMoE, experts_torch

    ops = Ops(load_ops())   # (without AVX512-VNNI ops.experts runs the reference's own torch path)
    g = torch.Generator().manual_seed(0)
    for ranks in (1, 2):
        moe = SparseMoE(SimpleNamespace(hidden_size=64, activation="silu",
                                        moe=MoEConfig(8, 3, 48, False, expert_ranks=ranks)))
        moe.w13.data = (torch.randn(*moe.w13.shape, generator=g) / 8).to(dtype)
        moe.w2.data = (torch.randn(*moe.w2.shape, generator=g) / 8).to(dtype)
        moe.first_expert = 4 if ranks == 2 else 0
        moe.set_w8a8()
        for t in (3, 37):
            x = torch.randn(t, 64, generator=g).to(dtype)
            experts = torch.randint(0, 8, (t, 3), generator=g)
            weights = torch.rand(t, 3, generator=g)
            want = experts_torch(moe, x, weights, experts, ops.act_mul).float()
            got = ops.experts(moe, x, weights, experts).float()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_router_ties_are_transformers_choice():
    """moe_route (one compiled call) picks the experts transformers' torch.topk picks, ties at the k-th
    place included (two experts with the same router row score the same for every token), with the
    same renormalized weights."""
    from types import SimpleNamespace

    from pagedllm.kernels import load_ops
    from pagedllm.models.config import MoEConfig
    from pagedllm.models.ops import Ops
    from pagedllm.models.moe import SparseMoE

    ops = Ops(load_ops())
    g = torch.Generator().manual_seed(0)
    moe = SparseMoE(SimpleNamespace(hidden_size=64, activation="silu", moe=MoEConfig(16, 4, 32, True)))
    w = torch.randn(16, 64, generator=g)
    w[[3, 5, 9, 11]] = w[7].clone()   # five experts always tied
    moe.gate.weight.data = w
    x = torch.randn(40, 64, generator=g)
    x[:20] = w[7] * 3     # rows that score the tied five highest: which 4 of them is the tie's choice
    for rows in (x, x[:5]):   # the small_mm logits (decode) and the matmul's (prefill)
        got_w, got_e = ops.k.moe_route(rows.contiguous(), moe.gate.weight, 4, True)
        probs = torch.softmax(torch.nn.functional.linear(rows, w).float(), dim=-1)
        want_w, want_e = torch.topk(probs, 4, dim=-1)
        assert torch.equal(got_e.sort(-1).values, want_e.sort(-1).values)
        torch.testing.assert_close(got_w.sort(-1).values, (want_w / want_w.sum(-1, keepdim=True)).sort(-1).values)


def test_weights_on_huge_pages_give_the_same_tokens(tmp_path, model_dir, monkeypatch):
    """The engine moves its packed weights onto 2 MiB pages at load (runtime/host_pages.py; the
    suite turns that off with PAGEDLLM_HUGE_PAGES=0 for start-up time): here every storage moves
    (the size floor lowered), the experts' packed stacks, the head and the embedding included,
    and the engine writes the same tokens and prompt logprobs, bit for bit, as without."""
    from pagedllm import LLM
    from pagedllm.runtime import host_pages

    _, path = make_model(tmp_path, model_dir, "qwen3_moe")
    prompts = [list(range(100, 140)), list(range(300, 320))]
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    got = {}
    monkeypatch.setattr(host_pages, "MIN_WEIGHT_BYTES", 1)
    for huge in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", huge)
        llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB")
        model = llm.engine.runner.model
        on_huge = [t.data_ptr() % host_pages.HUGE == 0 for t in (model.layers[1].mlp.w13, model.layers[1].mlp.w2,
                                                                 model.embed_tokens.weight)]
        assert all(on_huge) == (huge == "1"), on_huge
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[huge] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])])
                     for o, p in zip(outs, prompts)]
        llm.engine.close()
    assert got["1"] == got["0"]
