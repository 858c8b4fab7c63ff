"""The decoder's shape, read from a Hugging Face config.json.

A config's model_type names its family (registry.py): which decoder runs it and which of that
decoder's options its checkpoints use. A new family that differs from Llama only by such options
costs a row in its own file (families/) and a registry line."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..kv_dtype import KVDtype
from ..util import cdiv
from . import registry
from .family import EVERY_LAYER, LAYER_TYPES_ONLY, NO_WINDOWS, QWEN_LAYERS, Family
from .deltanet_config import DeltaNetConfig
from .mamba_config import MambaConfig
from .mla_config import MLAConfig
from .moe_config import MoEConfig

ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")  # rope.py computes each
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def moe_config(cfg: dict[str, Any], fam: Family, num_layers: int) -> MoEConfig | None:
    """The routing of a mixture of experts from its HF config (None for a dense family); ValueError
    naming a router or layout we do not compute."""
    if not fam.moe:
        return None
    # the checkpoints' own key, or the one transformers 5 writes (num_local_experts for all)
    e = cfg.get("num_experts") or cfg.get("num_local_experts")
    k, width = cfg.get("num_experts_per_tok"), cfg.get(fam.expert_width_key)
    if not all(isinstance(v, int) and v > 0 for v in (e, k, width)) or k > e:
        raise ValueError(f"{cfg.get('model_type')}: num_experts (num_local_experts)={e}, num_experts_per_tok={k} and "
                         f"{fam.expert_width_key}={width} must be positive ints, top k at most the experts")
    for key in ("router_jitter_noise", "clip_qkv"):
        if cfg.get(key):
            raise ValueError(f"{cfg.get('model_type')}: {key}={cfg[key]} is not supported")
    if cfg.get("scoring_func", "softmax") != "softmax" or cfg.get("topk_method", "greedy") != "greedy":
        raise ValueError(f"{cfg.get('model_type')}: router {cfg.get('scoring_func')}/{cfg.get('topk_method')} is not "
                         "supported (softmax scores, greedy top-k are)")
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)) if step and step > 0 else \
        (False,) * num_layers
    return MoEConfig(e, k, width, bool(cfg.get("norm_topk_prob", fam.moe_norm_topk)),
                     int(cfg.get("shared_expert_intermediate_size") or 0), sparse if not all(sparse) else ())


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False              # the attention's output projection has a bias too (gpt-oss)
    # A learned logit per head that joins every query's softmax and attends to nothing (gpt-oss's
    # attention sinks): the weights of the real keys sum to less than one.
    sinks: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    sliding_window: int | None = None  # the widest layer's attention window, where the model uses one
    # Each layer's window W (a query at p sees keys p - W < j <= p), 0 for full attention;
    # empty: every layer full.
    layer_windows: tuple[int, ...] = field(default=())
    family: Family = field(default_factory=Family)
    activation: str = "silu"          # the MLP's gate: silu, gelu_tanh, or gpt-oss's swiglu_oai (MoEConfig)
    attn_scale: float = 0.0           # softmax scale of q.k (0: head_dim ** -0.5)
    rotary_dim: int = 0               # RoPE on the first rotary_dim dims of a head (0: all of them)
    local_rope_theta: float = 0.0     # RoPE base of the windowed layers, where theirs differs (Gemma 3)
    # Each layer's RoPE: 0 the global one, 1 the local one, -1 none (SmolLM3's NoPE layers); empty: all 0.
    layer_ropes: tuple[int, ...] = field(default=())
    final_logit_softcap: float = 0.0  # logits = c * tanh(logits / c) (0: none)
    moe: MoEConfig | None = None      # a mixture of experts' routing (None: a dense model)
    # Hybrid models: the layers that keep a recurrent state instead of K/V (kv.groups' STATE), and
    # their mixer: "short_conv" (gated short convolutions, short_conv.py), "mamba2" (mamba2.py,
    # shaped by `mamba`) or "gated_deltanet" (gated_deltanet.py, shaped by `deltanet`); each runs a
    # causal convolution of conv_kernel taps (conv_bias: its bias).
    state_layers: tuple[int, ...] = field(default=())
    state_mixer: str = ""
    conv_kernel: int = 0
    conv_bias: bool = False
    mamba: MambaConfig | None = None
    deltanet: DeltaNetConfig | None = None   # state_mixer "gated_deltanet" (Qwen3-Next): its heads
    # Multi-head latent attention (DeepSeek-V2/V3, mla.py): the pool keeps one latent head of
    # head_dim = mla.latent a layer and no V rows; rotary_dim is its rotary key's.
    mla: MLAConfig | None = None
    # Granite's scalars: embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before the residual add, logits times logit_scale.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    # Nemotron-H: its blocks (each one mixer, MLP blocks among them) run as our layers of one
    # Mamba-2 or attention block each, then the MLP blocks that follow it, as many as this gives a layer.
    trailing_mlps: tuple[int, ...] = field(default=())

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type", "llama")
        fam = registry.family(mt)
        if fam.hf_keys is not None:
            cfg = fam.hf_keys(cfg)
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{mt}: use_bidirectional_attention (an embedding model) is not supported")
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping is not supported (Gemma 2's attention); Gemma 3 has none")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{mt}: activation {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        (theta, scaling), local = rope_parameters(cfg, fam)
        partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        windows = layer_windows(cfg, fam)
        n = cfg["num_hidden_layers"]
        if local is not None:
            ropes = tuple(1 if w else 0 for w in windows) if any(windows) else ()
        else:
            ropes = tuple(0 if use else -1 for use in cfg["no_rope_layers"]) if cfg.get("no_rope_layers") else ()
        if ropes and len(ropes) != n:
            raise ValueError(f"no_rope_layers has {len(ropes)} entries for {n} layers (num_hidden_layers)")
        scalar = cfg.get("query_pre_attn_scalar")
        return replace(cls(
            model_type=mt, hidden_size=cfg["hidden_size"], num_layers=n,
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", fam.qkv_bias), eos_token_ids=eos,
            sliding_window=max(windows, default=0) or None, layer_windows=windows if any(windows) else (),
            family=fam, activation=ACTIVATIONS[act], attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            local_rope_theta=local or 0.0, layer_ropes=ropes if any(r != 0 for r in ropes) else (),
            final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0), moe=moe_config(cfg, fam, n)),
            **(fam.own_config(cfg) if fam.own_config is not None else {}))

    @property
    def rotary(self) -> int:
        """How many of a head's dims RoPE turns."""
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def ropes(self) -> list[tuple[float, dict[str, Any] | None]]:
        """(base, scaling) of each RoPE table that layer_ropes indexes: the global one, and the
        windowed layers' own where they have one."""
        return [(self.rope_theta, self.rope_scaling)] + ([(self.local_rope_theta, None)] if self.local_rope_theta else [])

    def stop_ids(self, tokenizer) -> set[int]:
        """The tokens that end an output: the config's EOS, the tokenizer's, and the family's
        end-of-turn tokens that the tokenizer has (Gemma's <end_of_turn>)."""
        ids = set(self.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in self.family.stop_tokens:
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != unk:
                ids.add(tid)
        return ids

    def rope_of(self, layer: int) -> int:
        return self.layer_ropes[layer] if self.layer_ropes else 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_window(self) -> int:
        """The window by which a sequence's old blocks can be released: the widest one when
        every layer is windowed, 0 when any layer attends to every key (it needs them all)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return 0
        return max(self.layer_windows)

    @property
    def pool_v_dim(self) -> int:
        """A KV head's V width in the pool: head_dim, or 0 under multi-head latent attention (the
        values are read from the latent in K's rows)."""
        return 0 if self.mla is not None else self.head_dim

    def kv_bytes_per_token(self, kv: KVDtype) -> int:
        """M_KV per token, stored as `kv`: 2 (K and V) * L * d_kv * bytes, scales included, over the
        layers that keep K/V (a hybrid's state layers keep a state per sequence instead); under
        multi-head latent attention L * (kv_lora_rank + rope_dim) * bytes."""
        return kv.bytes_per_token(self.num_layers - len(self.state_layers), self.num_kv_heads, self.head_dim,
                                  self.pool_v_dim)

    def expanded_kv_bytes_per_token(self, kv: KVDtype) -> int:
        """Under multi-head latent attention, what one token's K and V would take expanded to full
        heads (heads x (nope + rope + v) a layer, as transformers caches them); 0 otherwise."""
        return self.num_layers * self.mla.expanded(self.num_heads) * kv.bits // 8 if self.mla is not None else 0

    @property
    def state_scans(self) -> bool:
        """Whether a state layer runs a recurrence over its rows (state_steps' segments)."""
        return self.state_mixer in ("mamba2", "gated_deltanet")

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A state layer's state in a block: (what its K rows hold, what its V rows hold): the
        convolution's last K - 1 inputs, and Mamba's SSM state [heads, head_dim, state_size] or
        the delta rule's [value heads, k_dim, v_dim]."""
        taps = max(0, self.conv_kernel - 1)
        if self.state_mixer == "mamba2":
            m = self.mamba
            return (taps, m.conv_dim), (m.num_heads, m.head_dim, m.state_size)
        if self.state_mixer == "gated_deltanet":
            d = self.deltanet
            return (taps, d.conv_dim), (d.num_v_heads, d.k_dim, d.v_dim)
        return (taps, self.hidden_size), ()

    def check_state_room(self, block_size: int, rows: tuple[int, int]) -> None:
        """ValueError where a state layer's state does not fit one layer slot of a block of
        block_size tokens whose K and V rows hold rows[0] and rows[1] values a token, naming the
        block size the larger of the two needs (naming the first short one sent a user to a
        size the other refused next). The engine checks its pool with it, kv-calc its arithmetic."""
        needs = []
        for shape, row, name in zip(self.state_shapes(), rows, ("K", "V")):
            values = math.prod(shape) if shape else 0
            needs.append((cdiv(values, row) if values else 0, values, row, name))
        need, values, row, name = max(needs)
        if block_size < need:
            raise ValueError(f"block_size {block_size} is too small for {self.model_type}'s state ({values} values "
                             f"a layer in a block's {name} rows, which hold {block_size * row}): use block_size "
                             f">= {need}")

    def check_tensor_parallel(self, n: int, expert_parallel: bool = False) -> None:
        """Each rank takes whole heads, KV heads, MLP columns and vocab rows; of a mixture's experts
        1/n of each one's columns, or with expert_parallel n-th of the experts whole."""
        if n > 1 and self.family.no_tensor_parallel:
            raise ValueError(f"tensor_parallel_size > 1 is not supported for {self.model_type}: "
                             f"{self.family.no_tensor_parallel}")
        parts = {"attention heads": self.num_heads, "KV heads": self.num_kv_heads,
                 "intermediate size": self.intermediate_size, "vocab size": self.vocab_size}
        if self.moe is not None:
            parts["experts" if expert_parallel else "experts' intermediate size"] = \
                self.moe.num_experts if expert_parallel else self.moe.width
            if self.moe.shared_width:
                parts["shared expert's intermediate size"] = self.moe.shared_width
        bad = [f"{name} ({count})" for name, count in parts.items() if count % n]
        if bad:
            ok = [d for d in range(1, self.num_heads + 1) if all(c % d == 0 for c in parts.values())]
            raise ValueError(f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; "
                             f"this model allows {ok}")

    def shard(self, n: int, expert_parallel: bool = False) -> "ModelConfig":
        """One rank's slice of the model under tensor parallelism of n: a mixture's experts each
        sharded as a dense MLP is, or with expert_parallel split whole over the ranks (the shared
        expert, which every token runs, is sharded either way)."""
        if n == 1:
            return self
        self.check_tensor_parallel(n, expert_parallel)
        moe = self.moe
        if moe is not None:
            moe = replace(moe, shared_width=moe.shared_width // n, **(
                {"expert_ranks": n} if expert_parallel else {"width": moe.width // n}))
        return replace(self, num_heads=self.num_heads // n, num_kv_heads=self.num_kv_heads // n,
                       intermediate_size=self.intermediate_size // n, vocab_size=self.vocab_size // n, moe=moe)


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def rope_parameters(cfg: dict[str, Any], fam: Family) -> tuple[tuple[float, dict | None], float | None]:
    """((base, scaling) of the global RoPE, the windowed layers' base or None), from a config in
    either layout: transformers >= 5 folds rope_theta and rope_scaling into rope_parameters, per
    layer type where they differ; older configs keep rope_theta, rope_scaling and, where the
    family's windowed layers have a base of their own, rope_local_base_freq. Scaling None: plain RoPE."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention: rope_type {sliding['rope_type']!r} is not supported "
                             "on windowed layers (default is)")
        local = sliding.get("rope_theta")
        params = params.get("full_attention") or {}
    elif fam.local_rope_theta:
        local = cfg.get("rope_local_base_freq", fam.local_rope_theta)
    rope = {**(cfg.get("rope_scaling") or {}), **params}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", fam.rope_theta)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    kind = dict(fam.rope_aliases).get(kind, kind)
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
    scaling = None
    if kind != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        scaling = {**rope, "rope_type": kind}
        for key in ("original_max_position_embeddings", "partial_rotary_factor"):  # top-level in older configs
            if key not in scaling and key in cfg:
                scaling[key] = cfg[key]
        scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    return (theta, scaling), (float(local) if local is not None else None)


def layer_windows(cfg: dict[str, Any], fam: Family) -> tuple[int, ...]:
    """Each layer's window from an HF config, as transformers reads it (0: full attention), by the
    family's `windows`:
    - EVERY_LAYER: every layer by `sliding_window`;
    - QWEN_LAYERS: the layers `layer_types` marks "sliding_attention", or else those from
      `max_window_layers` on, and only when `use_sliding_window` is set;
    - LAYER_TYPES_ONLY: the layers `layer_types` marks so (or, in older configs, all but every
      `sliding_window_pattern`-th), always."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    how = fam.windows
    if how == NO_WINDOWS or not window:
        return (0,) * n
    if how in (QWEN_LAYERS, EVERY_LAYER) and not cfg.get("use_sliding_window", how == EVERY_LAYER):
        return (0,) * n
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    if how == EVERY_LAYER:
        return (window,) * n
    types = cfg.get("layer_types")
    if types is None:
        if how == LAYER_TYPES_ONLY:
            every = cfg.get("sliding_window_pattern", 6)
            return tuple(window if (i + 1) % every else 0 for i in range(n))
        first = cfg.get("max_window_layers", n)
        return tuple(window if i >= first else 0 for i in range(n))
    unknown = sorted(set(types) - LAYER_TYPES.keys())
    if unknown:
        raise ValueError(f"layer_types: {unknown} not supported; each layer must be one of {sorted(LAYER_TYPES)}")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")
    return tuple(window if LAYER_TYPES[t] else 0 for t in types)
