"""KV cache dtypes: how one token's K and V are stored, and so what a token costs.

Unquantized kinds store K and V in a float type. Quantized kinds store a code per value
(8 or 4 bits) and one bf16 scale per token and head for each of K and V (int4 keys: a
bf16 scale and min per 32 dims, asymmetric: keys carry an offset): a new token is
quantized alone into its slot, so a block shared by several sequences, or kept by the
prefix cache, is never rewritten (a scale per block would have to grow, and requantize,
as tokens arrive). `bytes_per_token` is the one formula every report uses (M_KV per token).
No torch here: the analysis tools and the config read it too.
"""
from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 2  # one bf16 scale per token, head, and K or V


@dataclass(frozen=True, slots=True)
class KVDtype:
    name: str          # canonical: bfloat16, float16, float32, fp8_e4m3, fp8_e5m2, int8, int4
    bits: int          # per stored value
    quantized: bool
    fmt: int = 0       # the CPU kernel's format number (kv_quant.h's Fmt)
    k_group: int = 0   # keys: a scale and a min per this many dims (asymmetric); 0: one scale per head

    def k_head_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K for one KV head, its scales (and mins) included."""
        if not self.quantized:
            return head_dim * self.bits // 8
        extra = 2 * SCALE_BYTES * (head_dim // self.k_group) if self.k_group else SCALE_BYTES
        return head_dim * self.bits // 8 + extra

    def v_head_bytes(self, head_dim: int) -> int:
        """Bytes of one token's V for one KV head, its scale included."""
        return head_dim * self.bits // 8 + (SCALE_BYTES if self.quantized else 0)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> int:
        """L x KVH x (K's + V's bytes: d x bits / 8 each, + their scales): M_KV per token
        (2 x L x d_kv x bytes for the unquantized kinds). v_head_dim: V's width where it is not
        head_dim (0: no V rows, multi-head latent attention's pool)."""
        v = head_dim if v_head_dim is None else v_head_dim
        return num_layers * num_kv_heads * (self.k_head_bytes(head_dim) + (self.v_head_bytes(v) if v else 0))

    def check_head_dim(self, head_dim: int) -> None:
        """int4 packs two values a byte, V's in halves of 16 dims: head_dim must be a multiple of 32."""
        if self.bits == 4 and head_dim % 32:
            raise ValueError(f"kv_cache_dtype {self.name} needs head_dim a multiple of 32 to pack, "
                             f"and this model's is {head_dim}; use int8 or fp8")
        if self.bits == 8 and self.quantized and head_dim % 4:
            raise ValueError(f"kv_cache_dtype {self.name} needs head_dim a multiple of 4, not {head_dim}")


KV_DTYPES: dict[str, KVDtype] = {
    "float32": KVDtype("float32", 32, False),
    "bfloat16": KVDtype("bfloat16", 16, False),
    "float16": KVDtype("float16", 16, False),
    "int8": KVDtype("int8", 8, True, 1),
    "fp8_e4m3": KVDtype("fp8_e4m3", 8, True, 2),
    "fp8_e5m2": KVDtype("fp8_e5m2", 8, True, 3),
    "int4": KVDtype("int4", 4, True, 4, k_group=32),
}
# vLLM's spellings: fp8 is e4m3.
KV_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
              "fp32": "float32", "float": "float32"}
CHOICES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def canonical_kv_dtype(name: str) -> str:
    """auto, or one of KV_DTYPES' names; ValueError naming the choices otherwise."""
    key = str(name).strip().lower()
    key = KV_ALIASES.get(key, key)
    if key != "auto" and key not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(CHOICES)} (or float16, float32), got {name!r}")
    return key


def resolve_kv_dtype(name: str, model_dtype: str) -> KVDtype:
    """The stored kind: auto (and the model's own dtype) stores K/V as the model computes them."""
    key = canonical_kv_dtype(name)
    return KV_DTYPES[model_dtype if key == "auto" else key]
