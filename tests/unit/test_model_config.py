"""The families (models/registry.py) read from HF configs in both layouts, and our RoPE
tables (models/rope.py) against transformers' own for every scaling we take. No model loads."""
from __future__ import annotations

import re

import pytest
import torch

from pagedllm.models import ModelConfig
from pagedllm.models.rope import RotaryEmbedding

GEMMA = dict(model_type="gemma3_text", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
             tie_word_embeddings=True)
FULL_AT = (5, 11, 17)


def test_gemma3_old_and_new_layouts_agree():
    """A Hub config.json (rope_theta, rope_local_base_freq, sliding_window_pattern) and the one
    transformers 5 writes (rope_parameters per layer type, layer_types) give the same model."""
    old = ModelConfig.from_hf({**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6})
    types = ["full_attention" if i in FULL_AT else "sliding_attention" for i in range(18)]
    new = ModelConfig.from_hf({**GEMMA, "layer_types": types, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})
    assert old == new
    assert [i for i in range(18) if new.window(i) == 0] == list(FULL_AT)
    assert [i for i in range(18) if new.rope_of(i) == 0] == list(FULL_AT)  # the global base on full layers
    assert new.ropes() == [(1e6, None), (1e4, None)]
    assert new.scale == 256 ** -0.5 and new.activation == "gelu_tanh" and new.family.sandwich_norms


def test_gemma3_4b_scales_its_global_rope_only():
    cfg = ModelConfig.from_hf({**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert cfg.ropes()[0][1]["factor"] == 8.0 and cfg.ropes()[1] == (1e4, None)


def test_qwen3_smollm3_phi3_options():
    base = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512, vocab_size=1000)
    q3 = ModelConfig.from_hf({**base, "model_type": "qwen3", "head_dim": 128})
    assert q3.family.qk_norm and not q3.qkv_bias and q3.head_dim == 128
    s3 = ModelConfig.from_hf({**base, "model_type": "smollm3", "no_rope_layers": [1, 1, 1, 0]})
    assert [s3.rope_of(i) for i in range(4)] == [0, 0, 0, -1]
    phi = ModelConfig.from_hf({**base, "model_type": "phi3", "partial_rotary_factor": 0.75, "sliding_window": 2047,
                               "rope_scaling": {"type": "su", "short_factor": [1.0] * 24, "long_factor": [2.0] * 24},
                               "original_max_position_embeddings": 4096, "max_position_embeddings": 131072})
    assert phi.rotary == 48 and phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 4096
    assert phi.layer_windows == (2047,) * 4
    with pytest.raises(ValueError, match="phi3"):
        phi.check_tensor_parallel(2)


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported; supported: llama, .*gemma3_text"),
    ({"model_type": "gemma3", "text_config": {}}, "gemma3_text"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    ({"model_type": "llama", "hidden_act": "relu2"}, "activation 'relu2'"),
    ({**GEMMA, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "granitemoehybrid", "num_local_experts": 32, "num_experts_per_tok": 40},
     r"granitemoehybrid: num_local_experts \(32\), num_experts_per_tok \(40\)"),
    ({"model_type": "granitemoehybrid", "num_local_experts": 0, "layer_types": ["mamba", "ssd"]},
     r"layer_types \['ssd'\]"),
    ({"model_type": "granitemoehybrid", "num_local_experts": 0, "position_embedding_type": "alibi"},
     "position_embedding_type 'alibi'"),
    ({"model_type": "lfm2", "layer_types": ["conv", "mamba"]}, "lfm2: layer_types"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-ME*-"}, "nemotron_h: blocks of experts"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M+"}, r"hybrid_override_pattern has \['\+'\]"),
    ({"model_type": "nemotron_h", "layers_block_type": ["mlp", "linear_attention"]}, "starts with an MLP block"),
    ({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "mlp"], "mlp_hidden_act": "silu"},
     "mlp_hidden_act 'silu'"),
    ({"model_type": "nemotron_h"}, "names no blocks"),
])
def test_unsupported_fails_at_load_naming_what(bad, match):
    """A variant we do not run is refused naming what, before any weight is read."""
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, **bad}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


SCALINGS = [
    ("linear", {"rope_type": "linear", "factor": 4.0}),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                     "mscale_all_dim": 0.5, "beta_fast": 24, "beta_slow": 2}),
    ("longrope", {"rope_type": "longrope", "original_max_position_embeddings": 128,
                  "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [3.0 + 0.2 * i for i in range(8)]}),
]


@pytest.mark.parametrize("name, scaling", SCALINGS, ids=[s[0] for s in SCALINGS])
def test_rope_tables_equal_transformers(name, scaling):
    """cos and sin at each position equal transformers' RoPE of the same config (for
    LongRoPE: its short factors below the original context, its long ones from it on)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                         rope_parameters={**scaling, "rope_theta": 10000.0})
    ours = RotaryEmbedding(16, 512, 10000.0, {**scaling, "max_position_embeddings": 512})
    for seq_len, positions in ((1, torch.arange(0, 128)), (512, torch.arange(128, 512))):
        inv, attn = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq_len=seq_len)
        angles = positions[:, None].double() * inv.double()[None, :]
        # transformers' frequencies are float32 (ours float64): 1e-7 relative, times angles up to ~500
        torch.testing.assert_close(ours.cos[positions], (angles.cos() * attn).float(), atol=1e-4, rtol=0)
        torch.testing.assert_close(ours.sin[positions], (angles.sin() * attn).float(), atol=1e-4, rtol=0)


def _header_only_gguf(path, arch: str):
    """A GGUF file of one tensor: its header is all a check before converting reads."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_of_an_unsupported_architecture_is_refused_before_converting(tmp_path):
    from pagedllm.loader import resolve_model_dir

    path = _header_only_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"tiny-gpt2.gguf holds a GGUF of architecture 'gpt2', which is not "
                                         r"supported; supported: llama, .*gemma3"):
        resolve_model_dir(path)


def test_a_router_we_do_not_compute_fails_naming_it():
    """A mixture's router other than softmax scores and a greedy top k (DeepSeek's sigmoid scores,
    grouped top k), or router noise, fails at load naming the key, not as wrong routing later."""
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_experts": 16, "num_experts_per_tok": 4}
    assert ModelConfig.from_hf(base).moe.num_experts == 16
    for extra, why in (({"scoring_func": "sigmoid"}, "router sigmoid/None is not supported"),
                       ({"topk_method": "group_limited_greedy"}, "router None/group_limited_greedy"),
                       ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
                       ({"num_experts_per_tok": 17}, "top k at most the experts")):
        with pytest.raises(ValueError, match=re.escape(why)):
            ModelConfig.from_hf({**base, **extra})


def test_hybrid_configs_name_their_state_layers_and_shapes():
    """Granite 4.0-H's config keys: its Mamba layers, their state (conv taps and SSM) and its
    scalars; infinity as transformers writes it in config.json."""
    cfg = ModelConfig.from_hf({"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 3,
                               "num_attention_heads": 4, "intermediate_size": 1, "shared_intermediate_size": 96,
                               "vocab_size": 100, "num_local_experts": 0, "mamba_n_heads": 4, "mamba_d_state": 8,
                               "mamba_n_groups": 2, "layer_types": ["mamba", "attention", "linear_attention"],
                               "time_step_limit": [0.0, {"__float__": "Infinity"}], "logits_scaling": 4.0,
                               "attention_multiplier": 0.25})
    assert cfg.state_layers == (0, 2) and cfg.state_mixer == "mamba2" and cfg.intermediate_size == 96
    assert cfg.mamba.head_dim == 32 and cfg.mamba.conv_dim == 128 + 2 * 2 * 8 and cfg.mamba.dt_limit[1] == float("inf")
    assert cfg.state_shapes() == ((3, 160), (4, 32, 8)) and cfg.logit_scale == 0.25 and cfg.scale == 0.25
    assert cfg.layer_ropes == (-1, -1, -1), "no RoPE unless position_embedding_type says rope"
    # Nemotron-H: its blocks as our layers (each Mamba-2 or attention block, then the MLP blocks after
    # it), from NVIDIA's pattern or transformers' list alike; no num_hidden_layers in transformers' file
    nvidia = {"model_type": "nemotron_h", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
              "intermediate_size": 96, "vocab_size": 100, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
              "ssm_state_size": 16, "layer_norm_epsilon": 1e-6, "hidden_act": "relu2"}
    pattern = ModelConfig.from_hf({**nvidia, "hybrid_override_pattern": "M-*--MM-", "num_hidden_layers": 8})
    listed = ModelConfig.from_hf({**nvidia, "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp",
                                                                   "mlp", "linear_attention", "linear_attention", "mlp"]})
    assert pattern == listed
    assert pattern.num_layers == 4 and pattern.trailing_mlps == (1, 2, 0, 1) and pattern.state_layers == (0, 2, 3)
    assert pattern.mamba.inner == 128 and pattern.mamba.norm_groups == 2 and pattern.rms_norm_eps == 1e-6
    assert pattern.state_shapes() == ((3, 128 + 2 * 2 * 16), (8, 16, 16)) and pattern.layer_ropes == (-1,) * 4
    assert not pattern.qkv_bias and pattern.mamba.dt_limit == (0.0, float("inf"))
    lfm = ModelConfig.from_hf({"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "intermediate_size": 6656, "vocab_size": 100, "full_attn_idxs": [1]})
    assert lfm.state_layers == (0,) and lfm.intermediate_size == 4608 and lfm.state_shapes() == ((2, 64), ())
