"""Quantized K/V in torch: the reference every kernel is checked against, and the torch
backend's own storage.

One token's head is stored as its codes, then its bf16 scale (pagedllm/kv_dtype.py):
int8 / int4 offset binary (q + 128, q + 8; symmetric q), fp8 as its bits. The scale is
amax / code max, rounded up to a bf16 so no value clips; values are quantized with the
stored scale itself, so its rounding moves the grid, not the error bound (half a step).
int4 packs byte i = dim i (low nibble) | dim i + D/2 (high nibble), the CPU kernel's V rows.
int4 keys are asymmetric per kv.k_group dims: codes [0, 15], value code * scale + min,
stored as the codes, then the groups' bf16 scales, then their bf16 mins.
Each head is rotated first, by a normalized Hadamard matrix over blocks of the largest
power of two dividing D: it spreads keys' outlier channels over all dims, so one scale
per token fits them all (H is its own inverse; the kernel rotates q, and its output back).
"""
from __future__ import annotations

import functools

import torch

from ..kv_dtype import SCALE_BYTES, KVDtype

QMAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def hadamard(d: int) -> torch.Tensor:
    """[d, d] block-diagonal normalized Hadamard matrix (blocks: d's largest power-of-two divisor)."""
    n = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / n ** 0.5] * (d // n))


@functools.lru_cache(maxsize=None)
def hadamard_on(d: int, device: torch.device) -> torch.Tensor:
    """hadamard(d) in fp32 on `device`, made once: every layer of every step rotates, and
    a host-to-device copy inside a captured CUDA graph would fail. Read-only."""
    return hadamard(d).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x H over the last dim, in fp32 (H H = I: rotates back too)."""
    return x.float() @ hadamard_on(x.shape[-1], x.device)


def scales(x: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """[..., D] -> [...] fp32 values of the bf16 scales (0 for an all-zero row)."""
    amax = x.float().abs().amax(-1)
    s = (amax / QMAX[kv.name] * (1 + 1 / 128)).to(torch.bfloat16).float()
    return torch.where(torch.isfinite(amax), s, torch.zeros_like(s))


def codes(x: torch.Tensor, s: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """[..., D] values and [...] scales -> [..., D] uint8 codes (unpacked)."""
    qmax = QMAX[kv.name]
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    y = (x.float() * inv[..., None]).nan_to_num(0.0).clamp(-qmax, qmax)
    if kv.name in FP8:
        return y.to(FP8[kv.name]).view(torch.uint8)
    return (torch.round(y) + (128 if kv.bits == 8 else 8)).to(torch.uint8)


def values(c: torch.Tensor, s: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """Unpacked codes [..., D] and scales [...] -> fp32 values."""
    if kv.name in FP8:
        v = c.view(FP8[kv.name]).float()
    else:
        v = c.float() - (128 if kv.bits == 8 else 8)
    return v * s[..., None]


def pack4(c: torch.Tensor) -> torch.Tensor:
    half = c.shape[-1] // 2
    return c[..., :half] | (c[..., half:] << 4)


def unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.cat([p & 0xF, p >> 4], dim=-1)


def bf16_bytes(s: torch.Tensor) -> torch.Tensor:
    """[...] fp32 scales (bf16 values) -> [..., 2] their bf16 bytes."""
    return s.to(torch.bfloat16).contiguous().view(torch.uint8).view(*s.shape, SCALE_BYTES)


def bytes_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).squeeze(-1).float()


def asym_codes(y: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., D] -> codes [..., D] in [0, 15], scales and mins [..., D / group] (bf16 values)."""
    g = y.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    mn = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo)).to(torch.bfloat16).float()
    rng = hi - mn
    s = (rng / 15 * (1 + 1 / 128)).to(torch.bfloat16).float()
    s = torch.where(torch.isfinite(rng) & (rng > 0), s, torch.zeros_like(s))
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    c = torch.round((g - mn[..., None]) * inv[..., None]).nan_to_num(0.0).clamp(0, 15).to(torch.uint8)
    return c.flatten(-2), s, mn


def asym_values(c: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, group: int) -> torch.Tensor:
    return (c.float().unflatten(-1, (-1, group)) * s[..., None] + mn[..., None]).flatten(-2)


def quantize(x: torch.Tensor, kv: KVDtype, key: bool = False) -> torch.Tensor:
    """[..., D] -> [..., k_head_bytes(D) or v_head_bytes(D)] uint8: codes of x H (int4
    packed), then the bf16 scale (int4 keys: the groups' scales, then their mins)."""
    x = rotate(x)
    if key and kv.k_group:
        c, s, mn = asym_codes(x, kv.k_group)
        return torch.cat([pack4(c), bf16_bytes(s).flatten(-2), bf16_bytes(mn).flatten(-2)], dim=-1)
    s = scales(x, kv)
    c = codes(x, s, kv)
    if kv.bits == 4:
        c = pack4(c)
    return torch.cat([c, bf16_bytes(s)], dim=-1)


def dequantize(rows: torch.Tensor, kv: KVDtype, dtype: torch.dtype = torch.float32, key: bool = False) -> torch.Tensor:
    """quantize's rows [..., bytes] -> [..., D] values in dtype."""
    if key and kv.k_group:
        d = rows.shape[-1] * kv.k_group // (kv.k_group // 2 + 2 * SCALE_BYTES)
        ng = d // kv.k_group
        c = unpack4(rows[..., :d // 2])
        s = bytes_bf16(rows[..., d // 2:d // 2 + 2 * ng].unflatten(-1, (ng, SCALE_BYTES)))
        mn = bytes_bf16(rows[..., d // 2 + 2 * ng:].unflatten(-1, (ng, SCALE_BYTES)))
        return rotate(asym_values(c, s, mn, kv.k_group)).to(dtype)
    c, s = rows[..., :-SCALE_BYTES], bytes_bf16(rows[..., -SCALE_BYTES:])
    if kv.bits == 4:
        c = unpack4(c)
    return rotate(values(c, s, kv)).to(dtype)


def cpu_pool_values(k_cache: torch.Tensor, v_cache: torch.Tensor, kv: KVDtype, block_size: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's quantized pools (uint8 [nb, KVH, row], kernels/csrc/kv_quant.h) as
    fp32 K and V [nb, B, KVH, D], rotated back: what its attention must equal, read plainly."""
    nb, kvh, _ = k_cache.shape
    B, D = block_size, head_dim
    cb = B * D * kv.bits // 8
    e = 32 // kv.bits  # dims per 32-bit K lane
    vcb = v_cache.shape[2] - B * SCALE_BYTES
    vs = bytes_bf16(v_cache[:, :, vcb:].reshape(nb, kvh, B, SCALE_BYTES))
    ng = D // kv.k_group if kv.k_group else 1
    extras = bytes_bf16(k_cache[:, :, cb:].reshape(nb, kvh, -1, ng, B, SCALE_BYTES)).permute(0, 1, 4, 2, 3)
    ks = extras[..., 0, :]  # [nb, KVH, B, groups]
    lanes = k_cache[:, :, :cb].reshape(nb, kvh, D // e, B, 4)  # [g, key, byte]
    if kv.bits == 8:
        kc = lanes.permute(0, 1, 3, 2, 4).reshape(nb, kvh, B, D)
    else:  # nibble x of lane g = dim g*8 + x: byte x//2, low nibble for even x
        nib = torch.stack([lanes & 0xF, lanes >> 4], dim=-1)  # [.., g, key, byte, 2]
        kc = nib.permute(0, 1, 3, 2, 4, 5).reshape(nb, kvh, B, D)
    if kv.name in ("int8", "int4"):  # [ceil(B/2), D * bits / 8, 2] pairs of keys (int8 signed)
        row = D * kv.bits // 8
        vc = v_cache[:, :, :vcb].reshape(nb, kvh, -1, row, 2).transpose(3, 4).reshape(nb, kvh, -1, row)[:, :, :B]
        if kv.bits == 8:
            vc = (vc.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # as offset codes
    else:
        vc = v_cache[:, :, :cb].reshape(nb, kvh, B, D * kv.bits // 8)
    if kv.bits == 4:
        vc = unpack4(vc)
    if kv.k_group:
        k = asym_values(kc, ks, extras[..., 1, :], kv.k_group)
    else:
        k = values(kc, ks[..., 0], kv)
    k = rotate(k).transpose(1, 2).contiguous()
    v = rotate(values(vc, vs, kv)).transpose(1, 2).contiguous()
    return k, v
