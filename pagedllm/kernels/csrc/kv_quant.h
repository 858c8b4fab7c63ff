// Quantized KV blocks: codes and one scale per token and head, inside the block.
//
// A quantized pool is uint8 [num_blocks, KVH, bytes per block and head]; each (block, head)
// row holds its codes, then one bf16 scale per key (K's row, then V's row, alike):
//   K codes [D / E, B, 4]: a 32-bit lane per key holding E = 32 / bits consecutive dims,
//     so a 64-byte line is 16 keys x E dims: one vector of 16 keys per dim, no transpose.
//   V codes [B, D * bits / 8]: a key's values contiguous along d (int4: byte i holds dim i
//     in its low nibble and dim i + D/2 in its high one, so 16 bytes give two vectors of
//     16 consecutive dims). int8 and int4: in pairs of keys, [ceil(B / 2), D * bits / 8, 2]
//     (int8 signed), two keys' bytes side by side (as the bf16 pool's pairs): one widening
//     load and one 16-bit integer dot-product instruction (AVX512_VNNI) then do 32
//     multiply-adds of P.V (int4: 64, its two nibbles after a mask and a shift).
// Scales per token (not per block): a new token is quantized once into its slot and never
// touches its neighbours, so a shared or cached block is never rewritten. The scale is
// bf16, rounded up so that amax / scale never exceeds the code range; the grid is the
// stored scale, so its rounding costs range, not accuracy.
// Rotated first: each head is multiplied by a normalized Hadamard matrix (over blocks of
// the largest power of two dividing D) before it is quantized, and the query with it, so
// Q.K is unchanged; the output is rotated back (P.(V H)) H = P.V. The rotation spreads a
// few large dims (keys have outlier channels) over all of them, so one scale per token
// fits every dim: it halves fp8's error on SmolLM2 and makes int4 usable at all.
// Codes: int8 q + 128 and V's int4 q + 8 (offset binary, symmetric q in [-127, 127] /
// [-7, 7]); fp8 e4m3 (OCP "fn": max 448) and e5m2 as their bits. int4 keys are asymmetric
// per 32 dims: code c in [0, 15], value c * scale + min, a bf16 scale and min per group
// (keys keep an offset that one symmetric scale per token wastes half of 16 levels on:
// measured on SmolLM2, perplexity +9 % symmetric per token, +2.6 % this way).
// After the codes, per (block, head) row: K's scales [G][B] (G groups per key, 1 but for
// int4's D / 32), then int4's mins [G][B]; V's scales [B].
#pragma once

#include "vec.h"

namespace pagedllm {

enum class Fmt : int { plain = 0, i8 = 1, e4m3 = 2, e5m2 = 3, i4 = 4 };

template <Fmt F>
constexpr int BITS = F == Fmt::i4 ? 4 : 8;
template <Fmt F>
constexpr int PER_LANE = 32 / BITS<F>;  // dims of one key in a K lane
template <Fmt F>
constexpr float QMAX = F == Fmt::i8 ? 127.f : F == Fmt::i4 ? 7.f : F == Fmt::e4m3 ? 448.f : 57344.f;
template <Fmt F>
constexpr bool K_ASYM = F == Fmt::i4;
template <Fmt F>
constexpr bool V_PAIRS = F == Fmt::i8 || F == Fmt::i4;
template <Fmt F, int D>
constexpr int K_GROUPS = F == Fmt::i4 && D >= 32 ? D / 32 : 1;  // (int4 needs D % 32 == 0)
constexpr int MAX_K_GROUPS = 8;  // head_dim 256 at int4
// fp8 decodes through fp16 bits: e4m3's exponent lands 8 below its value (folded into the scale).
template <Fmt F>
constexpr float DECODE_MUL = F == Fmt::e4m3 ? 256.f : 1.f;

typedef uint8_t vb __attribute__((vector_size(16)));

// The readers work in the CPU's own width (vec.h's vn, LN lanes): on AVX2 a 16-lane vector
// lives in memory, and a decode step of int8 or fp8 K/V cost 4-10x its fp32 read.

// Low 16 bits of each lane as fp16 -> fp32 (exact, subnormals included).
inline vn half_bits(vnu h) {
#if defined(__AVX2__) && !defined(__AVX512F__)  // two halves packed (GCC's own narrowing takes four steps)
  const __m256i x = (__m256i)h;
  const __m128i n = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  vnh w;
  std::memcpy(&w, &n, sizeof w);
  return half_to_float(w);
#else
  return half_to_float(__builtin_convertvector(h, vnh));
#endif
}

// LN codes (one per lane, in its low byte / nibble) -> values / DECODE_MUL.
template <Fmt F>
inline vn decode(vnu b) {
  if constexpr (F == Fmt::i8) return __builtin_convertvector((vni)b - 128, vn);
  else if constexpr (F == Fmt::i4) return __builtin_convertvector((vni)b - 8, vn);
  else if constexpr (F == Fmt::e5m2) return half_bits(b << 8);  // e5m2 is fp16's top byte
  else return half_bits(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

// Element i of each K lane (LN keys, one dim); int4 keys: the raw code (asymmetric).
template <Fmt F>
inline vn k_elem(vnu u, int i) {
  constexpr unsigned mask = (1u << BITS<F>) - 1;
  if constexpr (K_ASYM<F>) return __builtin_convertvector((vni)((u >> (BITS<F> * i)) & mask), vn);
  else return decode<F>((u >> (BITS<F> * i)) & mask);
}

typedef uint8_t vnb __attribute__((vector_size(LN)));
typedef int16_t vns __attribute__((vector_size(2 * LN)));

// fp8 V: dims LN*c .. LN*c + LN - 1 of one key's row.
template <Fmt F>
inline vn v_chunk(const uint8_t* row, int c) {
  vnb x;
  std::memcpy(&x, row + c * LN, sizeof x);
  const vnh w = __builtin_convertvector(x, vnh);  // fp16 bits built in 16-bit lanes: no narrowing after
  return half_to_float(F == Fmt::e5m2 ? vnh(w << 8) : vnh(((w & 0x80) << 8) | ((w & 0x7F) << 7)));
}

// int8 and int4 V, a pair row at a time (two keys' bytes side by side): the LN 16-bit lanes at
// `p` hold (key 0's byte, key 1's byte) of LN consecutive bytes of the row, split here into
// each key's values: int8 (dims of those bytes) in v[0] and v[1]; int4 also the high nibbles
// (dims + D / 2) in v[2] and v[3]. Signed int8, int4 offset by 8.
template <Fmt F>
inline void v_pair(const uint8_t* p, vn (&v)[F == Fmt::i4 ? 4 : 2]) {
  vns w;
  std::memcpy(&w, p, sizeof w);
  const vni x = __builtin_convertvector(w, vni);  // sign-extended: key 1's byte is the high one
  if constexpr (F == Fmt::i8) {
    v[0] = __builtin_convertvector((x << 24) >> 24, vn);
    v[1] = __builtin_convertvector(x >> 8, vn);
  } else {
    v[0] = __builtin_convertvector((x & 0xF) - 8, vn);
    v[1] = __builtin_convertvector(((x >> 8) & 0xF) - 8, vn);
    v[2] = __builtin_convertvector(((x >> 4) & 0xF) - 8, vn);
    v[3] = __builtin_convertvector(((x >> 12) & 0xF) - 8, vn);
  }
}

inline float round_up_bf16(float x) {  // the nearest bf16 at or above x (x >= 0)
  const float r = float(c10::BFloat16(x * (1.f + 1.f / 128)));
  return r;
}

// The Hadamard block for head_dim d: its largest power-of-two divisor (64 -> 64, 96 -> 32).
inline int hadamard_block(int d) { return d & -d; }

// x <- x H in place: the normalized Walsh-Hadamard transform of each block of n values
// (H is symmetric and orthogonal: applying it twice gives x back).
inline void hadamard(float* x, int d) {
  const int n = hadamard_block(d);
  for (int b = 0; b < d; b += n)
    for (int h = 1; h < n; h <<= 1)
      for (int i = b; i < b + n; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float u = x[j], w = x[j + h];
          x[j] = u + w;
          x[j + h] = u - w;
        }
  const float s = 1.f / std::sqrt(float(n));
  for (int j = 0; j < d; ++j) x[j] *= s;
}

// The writer, 16 values at a time (a scalar conversion per value cost a decode step more
// than its attention saved). Round to nearest even, as torch's casts do: the magic number
// for integers (|x| < 2^22), the fp32 bits for fp8.
inline vf round_even(vf x) {
  const vf m = splat(12582912.f);
  const vf r = (x + m) - m;
  return x < 0.f ? -((-x + m) - m) : r;
}

// fp8 codes of 16 values already scaled into the code range: the mantissa rounded to MB bits
// in the fp32 bits (the carry runs into the exponent); below the smallest normal, multiples
// of its 2^-MB.
template <Fmt F>
inline vu fp8_codes(vf y) {
  constexpr int MB = F == Fmt::e4m3 ? 3 : 2, BIAS = F == Fmt::e4m3 ? 7 : 15;
  constexpr float MIN_NORMAL = F == Fmt::e4m3 ? 1.f / 64 : 1.f / 16384;
  const vu sign = ((vu)y >> 31) << 7;
  const vf a = y < 0.f ? -y : y;
  vu bits = (vu)a;
  bits = bits + ((1u << (22 - MB)) - 1) + ((bits >> (23 - MB)) & 1u);
  const vu normal = (((bits >> 23) - (127 - BIAS)) << MB) | ((bits >> (23 - MB)) & ((1u << MB) - 1));
  const vu small = (vu)__builtin_convertvector(round_even(a * ((1 << MB) / MIN_NORMAL)), vi);
  return sign | ((vi)(a < MIN_NORMAL) ? small : normal);
}

// Codes of 16 values (scaled by inv), clamped to the code range: offset binary for int8
// keys and int4 values, signed for int8 values, fp8 bits.
template <Fmt F>
inline vu encode16(vf x, float inv, bool is_key) {
  vf y = x * inv;
  y = y > QMAX<F> ? splat(QMAX<F>) : y;
  y = y < -QMAX<F> ? splat(-QMAX<F>) : y;
  y = y == y ? y : vf{};  // NaN -> 0
  if constexpr (F == Fmt::e4m3 || F == Fmt::e5m2) return fp8_codes<F>(y);
  const vi q = __builtin_convertvector(round_even(y), vi);
  if constexpr (F == Fmt::i8) return (vu)(is_key ? q + 128 : q) & 0xFFu;
  else return (vu)(q + 8);
}

// Bytes of one (block, head) row of codes, and of the whole row with its scales.
inline int64_t code_bytes(int bits, int64_t block_size, int64_t d) { return block_size * d * bits / 8; }
inline int64_t k_row_bytes(int64_t fmt, int64_t block_size, int64_t d) {
  return Fmt(fmt) == Fmt::i4 ? block_size * (d / 2 + 4 * (d / 32)) : block_size * (d + 2);
}
inline int64_t v_code_bytes(int64_t fmt, int64_t block_size, int64_t d) {
  return Fmt(fmt) == Fmt::i4 ? (block_size + 1) / 2 * d : Fmt(fmt) == Fmt::i8 ? (block_size + 1) / 2 * 2 * d
                                                                              : block_size * d;
}
inline int64_t v_row_bytes(int64_t fmt, int64_t block_size, int64_t d) {
  return v_code_bytes(fmt, block_size, d) + 2 * block_size;
}

}  // namespace pagedllm
