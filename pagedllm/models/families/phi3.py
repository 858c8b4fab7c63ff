"""Phi-3 and Phi-4: fused qkv / gate_up checkpoints, partial rotary, LongRoPE."""
from __future__ import annotations

from ..family import EVERY_LAYER, Family, GGUFArch

PHI3 = Family(
    windows=EVERY_LAYER, architecture="Phi3ForCausalLM",
    rope_aliases=(("su", "longrope"), ("yarn", "longrope")),   # its early configs' names, as transformers reads them
    no_tensor_parallel="its checkpoints fuse q/k/v and gate/up into one tensor each, which the loader does not "
                       "cut by rank",
    gguf=GGUFArch("phi3", fused_up=True))   # its ffn_up is HF's gate_up_proj, beside a fused attn_qkv
