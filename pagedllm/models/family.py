"""What a model family is to us: one model_type's options of the shared decoder (decoder.py), the
config keys it reads its own way, how its checkpoints name their tensors, and how llama.cpp writes
its GGUF files. Plain data, torch-free: config.py reads it before any model is built.

A family's rows live in its file (families/); registry.py lists them by model_type."""
from __future__ import annotations

from functools import cached_property
from dataclasses import dataclass, field
from typing import Any, Callable

# How a family's layers get their sliding windows (config.layer_windows).
EVERY_LAYER, QWEN_LAYERS, LAYER_TYPES_ONLY, NO_WINDOWS = "every", "qwen", "layer_types", "none"


@dataclass(frozen=True)
class WeightMapper:
    """A family's checkpoint tensors in our names (weights.load_hf_weights applies it)."""
    # Module names, theirs -> ours, each applied once to each part of a dotted name (a chain,
    # a -> b and b -> c, renames a to b and b to c, never a to c).
    renames: tuple[tuple[str, str], ...] = ()
    norm_offset: float = 0.0   # checkpoints store RMSNorm weights as w - offset (1: x * (1 + w))
    plain_norms: tuple[str, ...] = ()   # norms (name endings) the offset is not for: stored as w itself
    # The family's own changes to the checkpoint's tensors (in our names, before any is fused or
    # stacked), called with them and the ModelConfig: rows reordered, tensors we do not run dropped.
    reorder: Callable[[dict[str, Any], Any], None] | None = None

    @cached_property
    def _table(self) -> dict[str, str]:
        return dict(self.renames)

    def name(self, theirs: str) -> str:
        if not self.renames:
            return theirs
        return ".".join(self._table.get(part, part) for part in theirs.split("."))


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp writes a family's GGUF files, and who turns one into an HF directory
    (loader/model_files.py: transformers' reader, or loader/gguf_moe.py where it has none)."""
    arch: str                   # the file's general.architecture
    experts: bool = False       # files of `arch` with experts are this family's, those without another's
    fused_up: bool = False      # ffn_up holds the gate's rows then the up's, as the model fuses them
    expert_keys: bool = False   # transformers' reader leaves the expert widths at defaults: read from the file's keys
    convert: bool = False       # transformers' reader does not convert it: gguf_moe.py does
    expert_count_key: str = "num_experts"   # where the converted config.json holds {arch}.expert_count
    config: tuple[tuple[str, Any], ...] = ()   # config.json keys the file does not hold (its routing)
    # gguf_moe.py's conversion, where a family's files differ from the common layout:
    layer_names: tuple[tuple[str, str], ...] = ()   # per-layer GGUF names -> transformers' ("{}": weight / bias)
    # a layer's ffn_*_exps arrays (weights and biases, "ffn_gate_exps.weight" ...) -> transformers' tensors
    experts_to_hf: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None
    own_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None   # the converted config's own keys


@dataclass(frozen=True)
class Family:
    """What one model_type is to us; a field's default is the plain decoder's (no option taken)."""
    architecture: str = ""  # transformers' class, for a config that lacks it (a GGUF's converted one)
    # The class that runs it, "module:Class" in pagedllm.models: named, not imported, so that reading a
    # config (config.py, below every decoder) never imports a decoder.
    decoder: str = "decoder:DecoderForCausalLM"

    # Options of the shared decoder.
    qkv_bias: bool = False       # q/k/v biases when the config does not say (attention_bias)
    qk_norm: bool = False        # RMSNorm over each head of q and k before RoPE
    qk_norm_whole: bool = False  # RMSNorm over all of q's (and k's) heads at once, before RoPE
    # Mixture of experts (config.moe_config): its experts' width under this config key (the dense MLP's
    # intermediate_size is its own where a model has both), and whether the top k's weights are
    # renormalized where the config does not say
    moe: bool = False
    expert_width_key: str = "moe_intermediate_size"
    moe_norm_topk: bool = False
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too
    attn_output_gate: bool = False   # q_proj gives each head a gate too: output * sigmoid(gate) (Qwen3-Next)
    embed_scale: bool = False    # embeddings times sqrt(hidden_size)
    windows: str = NO_WINDOWS

    # Config keys read the family's own way (config.rope_parameters).
    rope_theta: float = 10_000.0   # the RoPE base where the config names none
    local_rope_theta: float = 0.0  # windowed layers' own base where an older config names none (0: no own base)
    rope_aliases: tuple[tuple[str, str], ...] = ()   # rope_type names of its early configs -> ours
    no_tensor_parallel: str = ""   # why tensor_parallel_size > 1 is refused ("": it is not)

    weights: WeightMapper = field(default_factory=WeightMapper)
    stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens its chat format ends a reply with (beside EOS)
    chat_template: str = ""      # ours (loader/chat_templates/) for files that carry none
    gguf: GGUFArch | None = None  # None: no GGUF file of it is read
    # ModelConfig fields its config.json holds its own way (key names, derived widths, state layers):
    # called with the HF config, returns those fields; ValueError naming a variant we do not run.
    own_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # The HF config as the shared reader (config.py) reads it, where the family's config.json lacks
    # keys that reader needs (Nemotron-H's names no num_hidden_layers): called first, returns the dict read.
    hf_keys: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def config_number(v: Any) -> float:
    """A float as config.json holds it: transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)
