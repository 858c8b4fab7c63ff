"""What this machine's CPU runs fast, for the tests whose subject is not the dtype itself.

bf16 is the dtype of choice where the CPU has it natively (avx512_bf16, AMX): the engine's
`dtype=auto` picks it there. Elsewhere torch emulates bf16 matmuls at a fraction of fp32's
speed, and `auto` picks fp32: a test that runs a model end to end "in the dtype users run"
runs it in FAST_DTYPE, so its checks hold on the dtype this machine actually serves in."""
from __future__ import annotations


from pagedllm.runtime.device import cpu_has_native_bf16

NATIVE_BF16 = cpu_has_native_bf16()
FAST_DTYPE = "bfloat16" if NATIVE_BF16 else "float32"
