// Linear layers over weights kept in llama.cpp-style blocks of 32 along K (models/quantization.py
// packs them once at load):
//   q4_1: qs uint8 [N, ceil(K/64), 32] (byte i of pair p: element i of block 2p in the low
//         nibble, of block 2p + 1 in the high one), d, m fp16 [N, 2 ceil(K/64)]; w = d * q + m.
//   q8_0: qs int8 [N, K/32, 32], d fp16 [N, K/32]; w = d * q.
//   GGUF's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4: the file's own bytes [N, row bytes] (ggml_linear),
//         unpacked block by block like the others: a Q4_K_M file stays ~4.5 bits a weight.
// out [M, N] = x [M, K] . W^T, x and out bf16 or fp32, fp32 accumulation.
//
// Every M runs here. Each block is read and unpacked once and applied to every row: up to
// MR rows the unpacked block stays in registers; more rows (big batches, prefill) unpack a
// group of 4 output rows of W into an L1 scratch inside the loop over groups and run every
// tile of 6 rows of x over it, x in chunks that stay in L2. The unpacking is paid once per
// group and chunk, and no layer is ever dequantized whole: measured on SmolLM2's shapes at
// 48 rows (2 cores, weights hot in cache), about bf16 oneDNN's time; at 256+ rows
// 0.85-0.95x of it; and a third of bf16's bytes to read when the weights come from memory.
// Paths: q4_1 x bf16 on AVX512-BF16 at up to 4 rows multiplies the nibbles as they are (run_words);
// the other types x bf16 at up to 4 rows on AVX512-VNNI take x as int8 codes and the blocks as
// bytes (run_codes: one request's decode, as llama.cpp computes it); bf16 x from 64 rows on
// AVX512-BF16 unpacks W a panel of 32 columns at a time into the bf16 panels' layout and runs
// their outer-product tiles over it (run_panels: a prefill, at 0.9x+ the bf16 panels' speed); the
// rest unpack blocks to fp32 (and to bf16 for vdpbf16ps where there is AVX512-BF16). MXFP4 repacked
// at load (mxfp4_interleave, MX4IL) runs bf16 x at every row count on an int8 outer-product kernel
// (run_il: ~600 GFLOP/s here, the bf16 panels 430-460).
// The generic code is GCC vector extensions (vec.h): one AVX-512 register per 16 lanes,
// two AVX2 ones on CPUs without it; intrinsics only under #ifdef. Without AVX-512, fp32 x up to
// 16 rows runs run_rows8 (a row of W at a time, 8-lane registers) and from 17 rows run_sgemm (W
// unpacked a group of rows at a time, then torch's sgemm) instead of the tiles: GCC keeps 16-lane
// vectors in memory there, and the tiles ran at a tenth of sgemm's rate.
// One request's decode is bound by streaming the weights: measured on one core of this
// machine, SmolLM2-135M's 97 MB of q4_1 + q8_0 blocks take ~16 ms a token from memory,
// ~10 ms when they sit in L2 (benchmarks/quantization.py, models/quantization.py). On both
// cores run_codes streams Gemma 3's 178 MB Q8_0 LM head at 20-30 GB/s (a plain sum of floats
// reads 25-30), its Q4_K/Q5_0/Q6_K layers at 19-25.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "bf16_panels.h"
#include "blocks.h"
#include "vec.h"

namespace pagedllm {
namespace {

constexpr int G = 32;  // weights per block
constexpr int NB = 4;  // output rows unpacked together
// Blocks of W per parallel task, at least: ~4 us of work against a fork of ~2 us, so that
// SmolLM2's small matmuls (576 x 576) still split over two cores.
constexpr int64_t GRAIN_BLOCKS = 512 / NB;
constexpr int MR = 6;  // activation rows per tile (with NB: 24 accumulators, 4 blocks, x)

// 16 bytes widened to 16 int32 lanes. Elsewhere than AVX-512 a whole-vector conversion, which
// GCC turns into two vpmovsxbd/vpmovzxbd on AVX2 (filling the lanes one by one, as this did
// before, made the block kernels 3-4x slower than fp32 sgemm on an AVX2 CPU).
typedef int8_t vb __attribute__((vector_size(16)));
typedef uint8_t vub __attribute__((vector_size(16)));
inline vi widen(const int8_t* p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}
inline vi widen(const uint8_t* p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vub b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}

// fp16 -> fp32 in one instruction where F16C is (c10::Half's conversion is bit twiddling,
// and GCC converts a vector of _Float16 element by element).
inline float h2f(c10::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return float(h);
#endif
}
inline vf h2f16(const c10::Half* p) {
#ifdef __AVX512F__
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return load16(p);
#endif
}

// Q4_1 blocks go in pairs: byte i of pair p holds element i of block 2p (low nibble) and of
// block 2p + 1 (high nibble), so one 32-byte load feeds two blocks of 32 16-bit lanes. An
// odd last block pairs with an empty one (d = m = 0) that is never read.
struct Q41 {
  const uint8_t* qs;    // [N, npair, 32]
  const c10::Half* d;  // [N, 2 npair]
  const c10::Half* m;
  int64_t npair;
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = qs + (n * npair + b / 2) * G;
    const int shift = (b & 1) * 4;
    const int64_t i = n * 2 * npair + b;
    const vf dd = splat(h2f(d[i])), mm = splat(h2f(m[i]));
    lo = __builtin_convertvector((widen(p) >> shift) & 15, vf) * dd + mm;
    hi = __builtin_convertvector((widen(p + 16) >> shift) & 15, vf) * dd + mm;
  }
};

struct Q80 {
  const int8_t* qs;
  const c10::Half* d;
  int64_t nblk;
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const int64_t i = n * nblk + b;
    const vf dd = splat(h2f(d[i]));
    lo = __builtin_convertvector(widen(qs + i * G), vf) * dd;
    hi = __builtin_convertvector(widen(qs + i * G + 16), vf) * dd;
  }
};

// GGUF's other block types, read as the file stores them: `raw` [N, row bytes], each row the
// file's blocks one after another (ggml-common.h's layouts; gguf-py's quants.py reads them the
// same way). block(n, b) gives the 32 weights b*32.. of row n; K-quants keep 256 along K in a
// super-block of 8 (Q4_K, Q5_K: a 6-bit scale and min per 32) or 16 (Q6_K: an int8 scale per
// 16: lo and hi get their own) sub-blocks, with fp16 d (and dmin) per super-block.
struct Raw {
  const uint8_t* raw;
  int64_t row_bytes;
  const uint8_t* at(int64_t n, int64_t blk, int64_t bytes) const { return raw + n * row_bytes + blk * bytes; }
};
inline float f16(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return h2f(h);
}
// Q5_0 / Q5_1's 32 five-bit quants: 4 bytes of fifth bits at qh (bit i: element i's), then 16
// bytes of nibbles at qs (byte i: element i low, element 16 + i high). a: elements 0-15, c: 16-31.
inline void five_bits(const uint8_t* qh, const uint8_t* qs, vi& a, vi& c) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const vi q = widen(qs);
  a = (q & 15) | ((((vi{} + int32_t(h & 0xFFFF)) >> lane) & 1) << 4);
  c = (q >> 4) | ((((vi{} + int32_t(h >> 16)) >> lane) & 1) << 4);
}

struct Q50 : Raw {  // 22 bytes / 32: d, fifth bits, nibbles; w = d (q - 16)
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = at(n, b, 22);
    vi a, c;
    five_bits(p + 2, p + 6, a, c);
    const vf d = splat(f16(p));
    lo = __builtin_convertvector(a - 16, vf) * d;
    hi = __builtin_convertvector(c - 16, vf) * d;
  }
};

struct Q51 : Raw {  // 24 bytes / 32: d, m, fifth bits, nibbles; w = d q + m
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = at(n, b, 24);
    vi a, c;
    five_bits(p + 4, p + 8, a, c);
    const vf d = splat(f16(p)), m = splat(f16(p + 2));
    lo = __builtin_convertvector(a, vf) * d + m;
    hi = __builtin_convertvector(c, vf) * d + m;
  }
};

// MXFP4 (OCP microscaling; gpt-oss's experts): 17 bytes / 32, an E8M0 exponent e, then 16 bytes of
// FP4 (E2M1) codes, byte i: element i low, element 16 + i high (as Q4_0). ggml keeps the codes'
// values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and the scale halved, 2^(e - 128):
// the same weights, whole numbers times a power of two, so they are exact in bf16.
constexpr float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {  // 2^(e - 128), its two smallest as denormals
  const uint32_t bits = e >= 2 ? uint32_t(e - 1) << 23 : 0x00200000u << e;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline vf mxfp4_values(vi q) {
#ifdef __AVX512F__
  return (vf)_mm512_permutexvar_ps((__m512i)q, _mm512_loadu_ps(MXFP4_VALUES));
#else
  vf v;
  for (int i = 0; i < L; ++i) v[i] = MXFP4_VALUES[q[i]];
  return v;
#endif
}
struct MX4 : Raw {
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = at(n, b, 17);
    const vi q = widen(p + 1);
    const vf d = splat(e8m0_half(p[0]));
    lo = mxfp4_values(q & 15) * d;
    hi = mxfp4_values(q >> 4) * d;
  }
};

// MXFP4 repacked (mxfp4_interleave) for the int8 outer-product kernel (run_il): W's rows in groups
// of 16; a group's block b is 272 bytes: the 16 rows' E8M0 exponents, then 4 units of 64 bytes,
// byte 4c + i of unit s holding row c's codes of k = 8s + i (low nibble) and 8s + 4 + i (high), so
// that one vpdpbusd multiplies 4 k of 16 rows by a broadcast of 4 codes of x. The same bytes as
// the file's blocks (17 a 32), another order.
constexpr int64_t IL_ROWS = 16, IL_BYTES = 16 + 4 * 64;
struct MX4IL : Raw {
  const uint8_t* group(int64_t n, int64_t b) const { return raw + ((n / IL_ROWS) * (row_bytes / 17) + b) * IL_BYTES; }
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = group(n, b);
    const int64_t c = n % IL_ROWS;
    alignas(16) uint8_t codes[32];
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 4; ++i) {
        const uint8_t v = p[16 + s * 64 + c * 4 + i];
        codes[8 * s + i] = v & 15;
        codes[8 * s + 4 + i] = v >> 4;
      }
    const vf d = splat(e8m0_half(p[c]));
    lo = mxfp4_values(widen(codes)) * d;
    hi = mxfp4_values(widen(codes + 16)) * d;
  }
};

// Q4_K / Q5_K's 12 bytes of scales: sub-block j's 6-bit scale and min.
inline void scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Sub-block j of a Q4_K (144 bytes: d, dmin, scales, nibbles) or Q5_K (176 bytes: the same with
// 32 bytes of fifth bits before the nibbles, bit j of byte i for sub-block j's element i) super-block
// at p. The nibbles' 32-byte group g holds sub-blocks 2g (low) and 2g + 1 (high). w = d sc q - dmin mn.
template <bool FIFTH>
inline void k_sub(const uint8_t* p, int j, vf& lo, vf& hi) {
  int sc, mn;
  scale_min(p + 4, j, sc, mn);
  const vf d = splat(f16(p) * float(sc)), m = splat(f16(p + 2) * float(mn));
  const uint8_t* q = p + (FIFTH ? 48 : 16) + (j / 2) * 32;
  const int shift = (j & 1) * 4;
  vi a = (widen(q) >> shift) & 15, c = (widen(q + 16) >> shift) & 15;
  if constexpr (FIFTH) {
    a |= ((widen(p + 16) >> j) & 1) << 4;
    c |= ((widen(p + 32) >> j) & 1) << 4;
  }
  lo = __builtin_convertvector(a, vf) * d - m;
  hi = __builtin_convertvector(c, vf) * d - m;
}

struct Q4K : Raw {
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const { k_sub<false>(at(n, b / 8, 144), int(b % 8), lo, hi); }
};

struct Q5K : Raw {
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const { k_sub<true>(at(n, b / 8, 176), int(b % 8), lo, hi); }
};

struct Q6K : Raw {  // 210 bytes / 256: ql 128, qh 64, int8 scales 16 (one per 16), d; w = d sc (q - 32)
  inline void block(int64_t n, int64_t b, vf& lo, vf& hi) const {
    const uint8_t* p = at(n, b / 8, 210);
    const int t = int(b % 8), h = t / 4;
    const uint8_t* ql = p + h * 64 + (t % 2) * 32;   // low 4 bits: nibble (t / 2) % 2 of these bytes
    const uint8_t* qh = p + 128 + h * 32;            // high 2 bits: bits 2 (t % 4) of these
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 2 * t;
    const float d = f16(p + 208);
    const int ls = ((t / 2) % 2) * 4, hs = (t % 4) * 2;
    lo = __builtin_convertvector((((widen(ql) >> ls) & 15) | (((widen(qh) >> hs) & 3) << 4)) - 32, vf) *
         splat(d * float(sc[0]));
    hi = __builtin_convertvector((((widen(ql + 16) >> ls) & 15) | (((widen(qh + 16) >> hs) & 3) << 4)) - 32, vf) *
         splat(d * float(sc[1]));
  }
};

// How a block meets a row of x. F32: the block as two fp32 vectors, x fp32, FMAs.
struct F32 {
  using X = float;
  struct Wb {
    vf lo, hi;
  };
  template <class Q>
  static Wb unpack(const Q& q, int64_t n, int64_t b) {
    Wb w;
    q.block(n, b, w.lo, w.hi);
    return w;
  }
  struct Xv {
    vf lo, hi;
  };
  static Xv loadx(const X* x) { return {loadf(x), loadf(x + 16)}; }
  static void dot(vf& acc, const Wb& w, const Xv& x) { acc += w.lo * x.lo + w.hi * x.hi; }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// BF16: the block rounded to bf16 (to nearest, as the bf16 model's weights were), x bf16,
// one vdpbf16ps per row and block instead of two FMAs: more rows cost little extra.
struct BF16 {
  using X = c10::BFloat16;
  using Wb = __m512bh;
  template <class Q>
  static Wb unpack(const Q& q, int64_t n, int64_t b) {
    vf lo, hi;
    q.block(n, b, lo, hi);
    return _mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);  // lanes 0-15 from lo
  }
  using Xv = __m512bh;
  static Xv loadx(const X* x) { return (__m512bh)_mm512_loadu_si512(x); }
  static void dot(vf& acc, const Wb& w, const Xv& x) { acc = (vf)_mm512_dpbf16_ps((__m512)acc, w, x); }
};
#define PAGEDLLM_BF16_DOT 1
#endif

// Where tile() gets blocks: unpacked from the quantized weight, or from a scratch of
// rows n0.. unpacked before ([row][block]).
template <class P, class Q>
struct Unpacked {
  const Q& q;
  typename P::Wb get(int64_t n, int64_t b) const { return P::unpack(q, n, b); }
};
template <class P>
struct Scratch {
  const typename P::Wb* w;
  int64_t nblk, n0;
  typename P::Wb get(int64_t n, int64_t b) const { return w[(n - n0) * nblk + b]; }
};

// res[r][j] = x row r . W row n0 + j, for R rows of x (k apart) and J rows of W.
template <class P, int J, int R, class S>
inline void tile(const S& src, int64_t n0, const typename P::X* x, int64_t k, float* res) {
  vf acc[R][J] = {};
  const int64_t nblk = k / G;
  for (int64_t b = 0; b < nblk; ++b) {
    typename P::Wb w[J];
    for (int j = 0; j < J; ++j) w[j] = src.get(n0 + j, b);
    for (int r = 0; r < R; ++r) {  // x's 32 values loaded once for the J dots (a load per dot was the bound)
      const typename P::Xv xv = P::loadx(x + r * k + b * G);
      for (int j = 0; j < J; ++j) P::dot(acc[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 4) {
      hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], res + r * J);
    } else {
      for (int j = 0; j < J; ++j) res[r * J + j] = hsum(acc[r][j]);
    }
  }
}

template <class P, int J, class S>
inline void tile_rows(const S& src, int64_t n0, const typename P::X* x, int64_t k, int rows, float* res) {
  switch (rows) {
    case 1: tile<P, J, 1>(src, n0, x, k, res); break;
    case 2: tile<P, J, 2>(src, n0, x, k, res); break;
    case 3: tile<P, J, 3>(src, n0, x, k, res); break;
    case 4: tile<P, J, 4>(src, n0, x, k, res); break;
    case 5: tile<P, J, 5>(src, n0, x, k, res); break;
    default: tile<P, J, 6>(src, n0, x, k, res); break;
  }
}

template <class T>
inline void put(T* out, int64_t ldo, int64_t m0, int rows, int64_t n0, int cols, const float* res) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (cols == 4) {  // 4 roundings to nearest even in one instruction (a tile's epilogue)
      for (int r = 0; r < rows; ++r)
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (m0 + r) * ldo + n0),
                         (__m128i)_mm_cvtneps_pbh(_mm_loadu_ps(res + r * 4)));
      return;
    }
  }
#endif
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) out[(m0 + r) * ldo + n0 + j] = T(res[r * cols + j]);
}

// Rows of x per pass over W when there are many (prefill): a chunk of x stays in L2 while
// every group of W's columns is unpacked and run over it, so x is not streamed from memory
// once per group; W's unpacking is repeated once per chunk (a few percent at this size).
constexpr int64_t CHUNK_BYTES = 256 * 1024;

#ifndef __AVX512F__
// Without AVX-512, fp32 x from SGEMM_MIN_M rows: W unpacked to fp32 a group of rows at a time
// (a scratch that stays in L2) and multiplied by torch's sgemm (MKL). The tiles above hold 6 x 4
// accumulators of 16 lanes: 48 of AVX2's 16 ymm registers, so every FMA spilled, and a prefill ran
// at a tenth of sgemm's rate (19 GFLOP/s on a 2-core Zen 3 EPYC, where sgemm runs ~150).
constexpr int64_t SGEMM_MIN_M = 2;

template <class Q, class T>
void run_sgemm(const Q& q, const float* x, int64_t m, int64_t n, int64_t k, T* out) {
  const int64_t nblk = k / G;
  // Columns a group: about 4 groups a thread (an even split of small layers), 16-128 of them.
  const int64_t wanted_groups = 4 * at::get_num_threads();
  const int64_t cols = std::clamp<int64_t>((n + wanted_groups - 1) / wanted_groups, 16, 128);
  const int64_t groups = (n + cols - 1) / cols;
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {m, k}, at::kFloat);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> w(size_t(cols) * k), res(size_t(m) * cols);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * cols, c = std::min(cols, n - n0);
      for (int64_t j = 0; j < c; ++j)
        for (int64_t b = 0; b < nblk; ++b) {
          vf lo, hi;
          q.block(n0 + j, b, lo, hi);
          storef(w.data() + j * k + b * G, lo);
          storef(w.data() + j * k + b * G + L, hi);
        }
      at::Tensor r = at::from_blob(res.data(), {m, c}, at::kFloat);
      at::mm_out(r, xt, at::from_blob(w.data(), {c, k}, at::kFloat).t());
      put(out, n, 0, int(m), n0, int(c), res.data());
    }
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Without AVX-512, a decode step's few rows (fp32 x, up to ROWS8_MAX_M) on any block type: a row
// of W at a time, multiplied into 8-lane accumulators. q4_1 and q8_0 (`--quantization int4 / int8`,
// most GGUF files' layers) widen and scale their codes 8 at a time in intrinsics; the other types
// unpack a block with their own reader into L1 first. The generic tiles' 16-lane vectors (two ymm
// each) spill there, and 2+ rows went through run_sgemm, which writes the unpacked weights out and
// reads them back: SmolLM2's q4_1 blocks
// decoded at 15.6 tok/s on a 2-core Zen 3, slower than its fp32 weights (22.5), which are 5.6x
// the bytes. The weights and the sums are fp32's (w = d q + m, then FMAs): no codes for x.
// Past 8 rows a row of W is taken again for the next 8, from L1. Against run_sgemm on SmolLM2's
// layers from memory there: 4-6x at 1-8 rows, 1.6-2x at 16, even near 24-32: the bound sits below.
#define PAGEDLLM_ROWS8 1
constexpr int64_t ROWS8_MAX_M = 16;

inline __m256i bytes8_u(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bytes8_s(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// R rows of x (k apart) times 8 weights at offset o, into accumulator a of each row. One row
// keeps 4 accumulators, two rows 2 each: FMA chains long enough to hide FMA's latency.
template <int R>
struct Acc8 {
  static constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;
  __m256 v[R][A];
  Acc8() {
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) v[r][a] = _mm256_setzero_ps();
  }
  inline __attribute__((always_inline)) void add(int a, __m256 w, const float* x, int64_t k, int64_t o) {
    for (int r = 0; r < R; ++r) v[r][a % A] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + o), w, v[r][a % A]);
  }
  void sums(float* res) const {
    for (int r = 0; r < R; ++r) {
      __m256 s = v[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, v[r][a]);
      res[r] = hsumn((vn)s);
    }
  }
};

// Row n of a q4_1 W: a pair of blocks shares 32 bytes, one 8-byte load feeds 8 weights of each.
template <int R>
void row8(const Q41& q, int64_t n, const float* x, int64_t k, float* res) {
  Acc8<R> acc;
  const int64_t nblk = k / G;
  const uint8_t* qs = q.qs + n * q.npair * G;
  const c10::Half *d = q.d + n * 2 * q.npair, *mn = q.m + n * 2 * q.npair;
  const __m256i low = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < nblk; b += 2) {
    const uint8_t* p = qs + b / 2 * G;
    const bool two = b + 1 < nblk;  // an odd last block: its pair's high nibbles are padding, and x ends here
    const __m256 d0 = _mm256_set1_ps(h2f(d[b])), m0 = _mm256_set1_ps(h2f(mn[b]));
    const __m256 d1 = _mm256_set1_ps(h2f(d[b + 1])), m1 = _mm256_set1_ps(h2f(mn[b + 1]));  // (padded: in bounds)
    for (int i = 0; i < 4; ++i) {
      const __m256i v = bytes8_u(p + 8 * i);
      acc.add(i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), d0, m0), x, k, b * G + 8 * i);
      if (two)
        acc.add(i + 1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1), x, k, (b + 1) * G + 8 * i);
    }
  }
  acc.sums(res);
}

template <int R>
void row8(const Q80& q, int64_t n, const float* x, int64_t k, float* res) {
  Acc8<R> acc;
  const int8_t* qs = q.qs + n * q.nblk * G;
  const c10::Half* d = q.d + n * q.nblk;
  for (int64_t b = 0; b < q.nblk; ++b) {
    const __m256 db = _mm256_set1_ps(h2f(d[b]));
    for (int i = 0; i < 4; ++i)
      acc.add(i, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s(qs + b * G + 8 * i)), db), x, k, b * G + 8 * i);
  }
  acc.sums(res);
}

// GGUF's other types: each block unpacked by its own reader (16-lane generic code) into 32 floats
// in L1, then the same 8-lane FMAs.
template <int R, class Q>
void row8(const Q& q, int64_t n, const float* x, int64_t k, float* res) {
  Acc8<R> acc;
  alignas(64) float w[G];
  for (int64_t b = 0; b < k / G; ++b) {
    vf lo, hi;
    q.block(n, b, lo, hi);
    storef(w, lo);
    storef(w + L, hi);
    for (int i = 0; i < 4; ++i) acc.add(i, _mm256_load_ps(w + 8 * i), x, k, b * G + 8 * i);
  }
  acc.sums(res);
}

template <class Q, class T>
void run_rows8(const Q& q, const float* x, int64_t m, int64_t n, int64_t k, T* out) {
  const int64_t grain = std::max<int64_t>(1, GRAIN_BLOCKS * NB / std::max<int64_t>(1, k / G));
  at::parallel_for(0, n, grain, [&](int64_t j0, int64_t j1) {
    float res[ROWS8_MAX_M];
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t r0 = 0; r0 < m; r0 += 8) {  // a second pass finds W's row in L1
        const float* xr = x + r0 * k;
        float* rr = res + r0;
        switch (std::min<int64_t>(8, m - r0)) {
          case 1: row8<1>(q, j, xr, k, rr); break;
          case 2: row8<2>(q, j, xr, k, rr); break;
          case 3: row8<3>(q, j, xr, k, rr); break;
          case 4: row8<4>(q, j, xr, k, rr); break;
          case 5: row8<5>(q, j, xr, k, rr); break;
          case 6: row8<6>(q, j, xr, k, rr); break;
          case 7: row8<7>(q, j, xr, k, rr); break;
          default: row8<8>(q, j, xr, k, rr); break;
        }
      }
      put(out, n, 0, int(m), j, 1, res);
    }
  });
}
#endif

// out [m, n] = x [m, k] . W^T, W's blocks read through q (Q41 or Q80), P the arithmetic.
// Up to MR rows each block is unpacked into registers and used at once. More rows unpack a
// group of NB columns of W into an L1 scratch (P's words: bf16 pairs ready for vdpbf16ps)
// inside the loop over groups, and run every tile of rows over it: the dequantization is
// paid once per group and chunk of rows, never as a copy of the layer.
template <class P, class Q, class T>
void run(const Q& q, const typename P::X* x, int64_t m, int64_t n, int64_t k, T* out) {
#ifndef __AVX512F__
  if constexpr (std::is_same_v<P, F32>) {
#ifdef PAGEDLLM_ROWS8
    if (m <= ROWS8_MAX_M) return run_rows8(q, x, m, n, k, out);
#endif
    if (m >= SGEMM_MIN_M) return run_sgemm(q, x, m, n, k, out);
  }
#endif
  const int64_t groups = (n + NB - 1) / NB, nblk = k / G;
  if (m <= MR) {
    const int64_t grain = std::max<int64_t>(1, GRAIN_BLOCKS / std::max<int64_t>(1, nblk));
    const Unpacked<P, Q> direct{q};
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      float res[MR * NB];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * NB;
        const int cols = int(std::min<int64_t>(NB, n - n0));
        if (cols == NB) {
          tile_rows<P, NB>(direct, n0, x, k, int(m), res);
          put(out, n, 0, int(m), n0, NB, res);
        } else {
          for (int j = 0; j < cols; ++j) {
            tile_rows<P, 1>(direct, n0 + j, x, k, int(m), res);
            put(out, n, 0, int(m), n0 + j, 1, res);
          }
        }
      }
    });
    return;
  }
  const int64_t chunk = std::max<int64_t>(MR, CHUNK_BYTES / (k * int64_t(sizeof(typename P::X))) / MR * MR);
  for (int64_t c0 = 0; c0 < m; c0 += chunk) {
    const int64_t rows_here = std::min(chunk, m - c0);
    const int64_t grain = std::max<int64_t>(1, GRAIN_BLOCKS / std::max<int64_t>(1, nblk * ((rows_here + MR - 1) / MR)));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      float res[MR * NB];
      std::vector<typename P::Wb> scratch(size_t(NB) * nblk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * NB;
        const int cols = int(std::min<int64_t>(NB, n - n0));
        for (int j = 0; j < cols; ++j)
          for (int64_t b = 0; b < nblk; ++b) scratch[j * nblk + b] = P::unpack(q, n0 + j, b);
        const Scratch<P> kept{scratch.data(), nblk, n0};
        for (int64_t m0 = c0; m0 < c0 + rows_here; m0 += MR) {
          const int rows = int(std::min<int64_t>(MR, c0 + rows_here - m0));
          if (cols == NB) {
            tile_rows<P, NB>(kept, n0, x + m0 * k, k, rows, res);
            put(out, n, m0, rows, n0, NB, res);
          } else {
            for (int j = 0; j < cols; ++j) {
              tile_rows<P, 1>(kept, n0 + j, x + m0 * k, k, rows, res);
              put(out, n, m0, rows, n0 + j, 1, res);
            }
          }
        }
      }
    });
  }
}

#ifdef PAGEDLLM_BF16_DOT
// W's columns 32 p .. 32 p + 31 unpacked from their blocks (rounded to bf16 as BF16::unpack does)
// into dst in the panels' layout [K / 2][32][2] (bf16_panels.h), zero past n: a block of 16 rows of
// W is 16 vectors of k pairs, which a transpose turns into 16 k pairs of 16 columns each. Each row's
// blocks are unpacked RUN at a time into an L1 buffer first: a row's bytes read in sequence, the 16
// rows' cache misses in flight together (a block of each row in turn waited on each row's miss).
template <class Q>
void unpack_panel(const Q& q, int64_t p, int64_t n, int64_t k, c10::BFloat16* dst) {
  constexpr int64_t RUN = 8;
  const int64_t nblk = k / G;
  __m512i run[16][RUN];
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = p * panels::COLS + half * 16;
    for (int64_t b0 = 0; b0 < nblk; b0 += RUN) {
      const int64_t nb = std::min(RUN, nblk - b0);
      for (int j = 0; j < 16; ++j)
        for (int64_t i = 0; i < nb; ++i)
          run[j][i] = c0 + j < n ? (__m512i)BF16::unpack(q, c0 + j, b0 + i) : _mm512_setzero_si512();
      for (int64_t i = 0; i < nb; ++i) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = run[j][i];
        transpose16(r);
        const int64_t b = b0 + i;
        for (int e = 0; e < 16; ++e) _mm512_storeu_si512(dst + ((b * 16 + e) * panels::COLS + half * 16) * 2, r[e]);
      }
    }
  }
}

// From this many rows a matmul on blocks unpacks each panel of 32 columns of W once a chunk of
// rows into the thread's scratch and runs the bf16 panels' outer-product tiles over it (14 rows,
// no horizontal sums: bf16_panels.h), instead of run<BF16>'s dot products on 4 columns, which ran
// at 0.74-0.79x the bf16 panels at 64-1,024 rows (2880 x 2880 MXFP4, 2-core Zen 4); unpacked
// panels, 0.8x at 64 rows and 0.9-0.97x from 256. The transpose into the panels' layout costs
// more than the tiles gain below ~48-64 rows (MXFP4) and ~64-128 (Q4_K, Q6_K): there run<BF16>.
constexpr int64_t PANELS_MIN_M = 64;
constexpr int64_t PANELS_ROW_CHUNK = 1024;   // rows a panel is unpacked for (x's chunk stays in L3)

template <class Q>
void run_panels(const Q& q, const c10::BFloat16* x, int64_t m, int64_t n, int64_t k, c10::BFloat16* out) {
  panels::sweep_panels(
      x, k, m, n, k, 1,
      [&](int64_t p) {
        thread_local std::vector<c10::BFloat16> scratch;  // kept between calls, as the panels' row buffer
        scratch.resize(std::max<size_t>(scratch.size(), size_t(k) * panels::COLS));
        unpack_panel(q, p, n, k, scratch.data());
        return static_cast<const c10::BFloat16*>(scratch.data());
      },
      [&](int64_t row0, int64_t p, int64_t n_valid) {
        return panels::Store(out + row0 * n + p * panels::COLS, n, n_valid, nullptr);
      }, PANELS_ROW_CHUNK);
}
#endif

#ifdef PAGEDLLM_BF16_DOT
// Q4_1 against bf16 rows without unpacking to fp32. A nibble q with 0x4300 in the bits
// above it is the bf16 number 128 + q, exactly, so
//   sum (d q + m) x = d sum (128 + q) x + (m - 128 d) sum x,
// the first term from vdpbf16ps on the words as they come (2 integer ops a block), the
// second from each block's sum of x, computed once per call. The weights enter exactly.
// (Q8_0 the same way, split into nibbles, measured slower than converting: one request is
// bound by reading the weights, more rows by the extra dot product.)
struct Words {
  __m512bh a, b;  // blocks 2p and 2p + 1
};
inline Words nibble_words(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i bias = _mm512_set1_epi16(0x4300);
  return {(__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000F), bias, 0xEA),  // (v & 15) | bias
          (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias)};
}

// A step: the 32 bytes of a pair of blocks of one row of W.
struct Q4Fmt {
  static constexpr int BLOCKS = 2;
  static constexpr float OFF = 128.f;  // a block's offset term is (m - OFF d) sum x
  const Q41& q;
  int64_t steps, ld;  // ld: scales per row of W
  explicit Q4Fmt(const Q41& q) : q(q), steps(q.npair), ld(2 * q.npair) {}
  Words load(int64_t n, int64_t s) const { return nibble_words(q.qs + (n * steps + s) * G); }
  const c10::Half* d(int64_t n) const { return q.d + n * ld; }
  const c10::Half* m(int64_t n) const { return q.m + n * ld; }
  // acc += the scaled dots of a step (d: its scales as fp32); `two`: both blocks are inside K.
  static void dot(vf& acc, const Words& w, const c10::BFloat16* x, const float* d, bool two) {
    const __m512 zero = _mm512_setzero_ps();
    acc = (vf)_mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w.a, (__m512bh)_mm512_loadu_si512(x)), _mm512_set1_ps(d[0]),
                              (__m512)acc);
    if (two)
      acc = (vf)_mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w.b, (__m512bh)_mm512_loadu_si512(x + G)),
                                _mm512_set1_ps(d[1]), (__m512)acc);
  }
};
template <class F>
struct FromBlocks {
  const F& f;
  Words get(int64_t n, int64_t s) const { return f.load(n, s); }
};

// Per-column constants of a group of W's rows, fp32, `ld` apart, zero past the last block:
// d, and the offset coefficient m - OFF d.
struct Consts {
  const float* d;
  const float* off;
  int64_t ld;
};

// res[r][j] for R rows of x (bf16, k apart; sx: their block sums, c.ld apart) and J rows of W.
template <class F, int J, int R, class S>
inline void tile_words(const S& src, int64_t n0, const c10::BFloat16* x, const float* sx, int64_t k, Consts c,
                       float* res) {
  const float* dc = c.d;
  const int64_t nblk = k / G, full = nblk / F::BLOCKS;
  vf acc[R][J] = {};
  for (int64_t s = 0; s < full; ++s)
    for (int j = 0; j < J; ++j) {  // (an array of J words would live on the stack)
      const Words w = src.get(n0 + j, s);
      for (int r = 0; r < R; ++r) F::dot(acc[r][j], w, x + r * k + s * F::BLOCKS * G, dc + j * c.ld + s * F::BLOCKS, true);
    }
  if (full * F::BLOCKS < nblk) {  // q4_1 with an odd number of blocks: the last one alone
    for (int j = 0; j < J; ++j) {
      const Words w = src.get(n0 + j, full);
      for (int r = 0; r < R; ++r)
        F::dot(acc[r][j], w, x + r * k + full * F::BLOCKS * G, dc + j * c.ld + full * F::BLOCKS, false);
    }
  }
  for (int r = 0; r < R; ++r)  // + sum_b (m_b - OFF d_b) sx_b
    for (int j = 0; j < J; ++j) {
      vf t = acc[r][j];
      for (int64_t b = 0; b < c.ld; b += L) t += loadf(c.off + j * c.ld + b) * loadf(sx + r * c.ld + b);
      res[r * J + j] = hsum(t);
    }
}

template <class F, int J, class S>
inline void tile_words_rows(const S& src, int64_t n0, const c10::BFloat16* x, const float* sx, int64_t k, Consts c,
                            int rows, float* res) {
  switch (rows) {
    case 1: tile_words<F, J, 1>(src, n0, x, sx, k, c, res); break;
    case 2: tile_words<F, J, 2>(src, n0, x, sx, k, c, res); break;
    case 3: tile_words<F, J, 3>(src, n0, x, sx, k, c, res); break;
    default: tile_words<F, J, 4>(src, n0, x, sx, k, c, res); break;
  }
}

constexpr int MRW = 4;  // rows per tile here: 16 accumulators, words, x
// Up to this many rows the words path; beyond it the extra FMA per block and row costs more
// than unpacking each block to bf16 once (run<BF16>, amortized over the rows).
constexpr int64_t WORDS_MAX_M = MRW;

template <class F>
void run_words(const F& f, const c10::BFloat16* x, int64_t m, int64_t n, int64_t k, c10::BFloat16* out) {
  const int64_t nblk = k / G, groups = (n + NB - 1) / NB, ld = (nblk + L - 1) / L * L;
  std::vector<float> sx(m * ld, 0.f);  // each block's sum of x (exact bf16 values, fp32 sums)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nblk; ++b)
      sx[r * ld + b] = hsum(load16(x + r * k + b * G) + load16(x + r * k + b * G + 16));
  const int64_t grain = std::max<int64_t>(1, GRAIN_BLOCKS / std::max<int64_t>(1, nblk));
  const FromBlocks<F> direct{f};
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float res[MRW * NB];
    std::vector<float> dc(NB * ld, 0.f), oc(NB * ld, 0.f);
    const Consts c{dc.data(), oc.data(), ld};
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NB;
      const int cols = int(std::min<int64_t>(NB, n - n0));
      for (int j = 0; j < cols; ++j) {  // this group's constants, once
        const c10::Half* d = f.d(n0 + j);
        const c10::Half* mm = f.m(n0 + j);
        int64_t b = 0;
        for (; b + L <= nblk; b += L) {
          const vf dv = h2f16(d + b);
          storef(dc.data() + j * ld + b, dv);
          storef(oc.data() + j * ld + b, h2f16(mm + b) - F::OFF * dv);
        }
        for (; b < nblk; ++b) {
          dc[j * ld + b] = h2f(d[b]);
          oc[j * ld + b] = h2f(mm[b]) - F::OFF * dc[j * ld + b];
        }
      }
      const Consts one[NB] = {c, {c.d + ld, c.off + ld, ld}, {c.d + 2 * ld, c.off + 2 * ld, ld},
                              {c.d + 3 * ld, c.off + 3 * ld, ld}};
      // Only ever called for up to MRW rows (WORDS_MAX_M): one tile, words straight from W.
      if (cols == NB) {
        tile_words_rows<F, NB>(direct, n0, x, sx.data(), k, c, int(m), res);
        put(out, n, 0, int(m), n0, NB, res);
      } else {
        for (int j = 0; j < cols; ++j) {
          tile_words_rows<F, 1>(direct, n0 + j, x, sx.data(), k, one[j], int(m), res);
          put(out, n, 0, int(m), n0 + j, 1, res);
        }
      }
    }
  });
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// A few rows of bf16 x against blocks in int8 arithmetic, as llama.cpp computes one request:
// each 32 values of x become int8 codes and a scale (max |x| / 127, to nearest), each 64
// weights of W unsigned codes that vpdpbusd multiplies by x's codes four at a time, and a
// lane's int32 sum is scaled once: w_i = scale_l q_i + off_l for the four codes of lane l, so
//   sum w x = sum_l (scale_l dx_l dot_l + off_l sx_l),   sx_l: the lane's four x values, dequantized.
// Unpacking a block to bytes is two or three integer ops where the fp32 path needs ten and
// two conversions: measured on Gemma 3's matmuls at one row, 2.5-4x that path (which was bound by
// the unpacking, not by memory), and the LM head's 178 MB of Q8_0 at close to memory speed.
// The x codes add ~0.4 % relative error per 32 values (the same codes as llama.cpp's q8_0
// activations); fp32 x keeps the exact path.
// (GCC left some of these out of line: a call per unit spills every accumulator, as all zmm
// registers are the caller's to save; Q5_0 ran at 40 % of the others' speed.)
#define ALWAYS_INLINE inline __attribute__((always_inline))
struct Codes {
  __m512i q;              // 64 unsigned codes (bytes)
  __m512 scale, off;      // per lane of 4 codes
};
inline __m512 pair_ps(float a, float b) { return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1); }
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i srl8(__m256i v, int s, int mask) {  // bytes >> s & mask (s: not a constant)
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(char(mask)));
}
// Q5_0 / Q5_1's 32 codes as bytes (elements 0-15: low nibbles, 16-31: high; bit i of qh: 16 on i).
inline __m256i five_codes(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                                       _mm256_set1_epi8(15));
  return _mm256_or_si256(nib, _mm256_maskz_mov_epi8(h, _mm256_set1_epi8(16)));
}

inline void prefetch(const uint8_t* p, int64_t bytes) {  // the cache lines of [p, p + bytes)
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(p + bytes - 1), _MM_HINT_T1);
}
// A weight type's codes come a unit at a time: PER chunks (64 weights each) of row n, unit u.
// The 32-weight types' unit is one chunk (`two`: both of its blocks are inside K; a K of an
// odd number of blocks ends in a half chunk whose upper codes are zero, as x's are there); the
// K-quants' unit is a 256-weight super-block, its scales unpacked once for its four chunks.
// prefetch(n, u): the unit's bytes.
struct C80 {  // int8 q: xor 128 makes the unsigned code q + 128
  static constexpr int PER = 1;
  const Q80& w;
  void prefetch(int64_t n, int64_t u) const {
    const int64_t i = n * w.nblk + 2 * u;
    _mm_prefetch(reinterpret_cast<const char*>(w.qs + i * G), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w.d + i), _MM_HINT_T1);
  }
  ALWAYS_INLINE void unit(int64_t n, int64_t u, bool two, Codes* out) const {
    const int64_t i = n * w.nblk + 2 * u;
    const uint8_t* p = reinterpret_cast<const uint8_t*>(w.qs + i * G);
    const __m256i flip = _mm256_set1_epi8(char(0x80));
    const __m256i lo = _mm256_xor_si256(load32(p), flip);
    const __m256i hi = two ? _mm256_xor_si256(load32(p + G), flip) : _mm256_setzero_si256();
    const __m512 s = pair_ps(h2f(w.d[i]), two ? h2f(w.d[i + 1]) : 0.f);
    *out = {join(lo, hi), s, _mm512_mul_ps(s, _mm512_set1_ps(-128.f))};
  }
};
// Two fp16 numbers (at a and b) as lanes 0-7 and 8-15.
inline __m512 pair_f16(const uint8_t* a, const uint8_t* b) {
  uint16_t x, y;
  std::memcpy(&x, a, 2);
  std::memcpy(&y, b, 2);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(int(x | uint32_t(y) << 16)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}
template <bool M1>  // Q5_1 (d, m, bits, nibbles: w = d q + m) or Q5_0 (d, bits, nibbles: w = d (q - 16))
struct C5 {
  static constexpr int PER = 1;
  static constexpr int64_t B = M1 ? 24 : 22, H = M1 ? 4 : 2;
  const Raw& w;
  void prefetch(int64_t n, int64_t u) const {  // a unit is under a line: one a unit covers the row
    _mm_prefetch(reinterpret_cast<const char*>(w.at(n, 2 * u, B)), _MM_HINT_T1);
  }
  ALWAYS_INLINE void unit(int64_t n, int64_t u, bool two, Codes* out) const {
    const uint8_t* p = w.at(n, 2 * u, B);
    if (!two) {
      const __m256i lo = five_codes(p + H, p + H + 4);
      const __m512 s = pair_ps(f16(p), 0.f);
      *out = {join(lo, _mm256_setzero_si256()), s,
              M1 ? pair_ps(f16(p + 2), 0.f) : _mm512_mul_ps(s, _mm512_set1_ps(-16.f))};
      return;
    }
    // Both blocks at once: their 16 nibble bytes twice each, the second copy shifted to the
    // high nibbles (elements 16-31 of a block), and the 64 fifth bits as one mask.
    const __m512i twice = join(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + H + 4))),
                               _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + B + H + 4))));
    const __m512i nib = _mm512_and_si512(_mm512_mask_srli_epi16(twice, 0xFF00FF00, twice, 4), _mm512_set1_epi8(15));
    uint32_t h0, h1;
    std::memcpy(&h0, p + H, 4);
    std::memcpy(&h1, p + B + H, 4);
    const __m512i q = _mm512_or_si512(nib, _mm512_maskz_mov_epi8(uint64_t(h0) | uint64_t(h1) << 32, _mm512_set1_epi8(16)));
    const __m512 s = pair_f16(p, p + B);
    *out = {q, s, M1 ? pair_f16(p + 2, p + B + 2) : _mm512_mul_ps(s, _mm512_set1_ps(-16.f))};
  }
};
// MXFP4: a code's value plus 12 as an unsigned byte (one shuffle of 16 entries), the offset -12 d.
struct CMX4 {
  static constexpr int PER = 1;
  const Raw& w;
  void prefetch(int64_t n, int64_t u) const { _mm_prefetch(reinterpret_cast<const char*>(w.at(n, 2 * u, 17)), _MM_HINT_T1); }
  static __m256i codes(const uint8_t* qs) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i nib = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                                         _mm256_set1_epi8(15));
    const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return _mm256_shuffle_epi8(table, nib);
  }
  ALWAYS_INLINE void unit(int64_t n, int64_t u, bool two, Codes* out) const {
    const uint8_t* p = w.at(n, 2 * u, 17);
    const __m256i hi = two ? codes(p + 17 + 1) : _mm256_setzero_si256();
    const __m512 s = pair_ps(e8m0_half(p[0]), two ? e8m0_half(p[17]) : 0.f);
    *out = {join(codes(p + 1), hi), s, _mm512_mul_ps(s, _mm512_set1_ps(-12.f))};
  }
};
// Lanes 0-7 from element a of v's first 8, lanes 8-15 from element b (chunk g of a super-block
// whose 8 sub-blocks' scales are v: a = 2g, b = 2g + 1).
inline __m512 spread_pairs(__m256 v, int g) {
  const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                       _mm512_set1_epi32(2 * g));
  return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}
template <bool FIFTH>  // Q4_K / Q5_K: chunk g is sub-blocks 2g, 2g + 1, which share 32 bytes of nibbles
struct CK {
  static constexpr int PER = 4;
  static constexpr int64_t B = FIFTH ? 176 : 144;
  const Raw& w;
  void prefetch(int64_t n, int64_t u) const { pagedllm::prefetch(w.at(n, u, B), B); }
  ALWAYS_INLINE void unit(int64_t n, int64_t u, bool, Codes* out) const {
    const uint8_t* p = w.at(n, u, B);
    // The 12 bytes of 6-bit scales and mins as three words: sub-blocks 0-3 keep theirs in the low
    // 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 keep the low 4 bits in bytes 8-11 (scale
    // low nibble, min high) and the top 2 in the spare top bits of bytes 0-3 and 4-7.
    uint32_t s0, s1, s2;
    std::memcpy(&s0, p + 4, 4);
    std::memcpy(&s1, p + 8, 4);
    std::memcpy(&s2, p + 12, 4);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
    const uint64_t sc = uint64_t(s0 & low6) | uint64_t((s2 & low4) | (((s0 >> 6) & top2) << 4)) << 32;
    const uint64_t mn = uint64_t(s1 & low6) | uint64_t(((s2 >> 4) & low4) | (((s1 >> 6) & top2) << 4)) << 32;
    const __m256 scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc)))),
                                        _mm256_set1_ps(f16(p)));
    const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn)))),
                                      _mm256_set1_ps(-f16(p + 2)));
    __m256i qh{};
    if constexpr (FIFTH) qh = load32(p + 16);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load32(p + (FIFTH ? 48 : 16) + g * 32);
      __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15)), hi = srl8(v, 4, 15);
      if constexpr (FIFTH) {  // fifth bits: bit j of byte i for sub-block j's element i
        const __m256i sixteen = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << (2 * g)))), sixteen));
        hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(2 << (2 * g)))), sixteen));
      }
      out[g] = {join(lo, hi), spread_pairs(scales, g), spread_pairs(mins, g)};
    }
  }
};
struct C6K {  // Q6_K: chunk u is sub-blocks 2u, 2u + 1; an int8 scale per 16 codes (4 lanes)
  static constexpr int PER = 4;
  const Raw& w;
  void prefetch(int64_t n, int64_t u) const { pagedllm::prefetch(w.at(n, u, 210), 210); }
  ALWAYS_INLINE void unit(int64_t n, int64_t u, bool, Codes* out) const {
    const uint8_t* p = w.at(n, u, 210);
    const __m512 scales = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)))),
        _mm512_set1_ps(f16(p + 208)));
    const __m512 offs = _mm512_mul_ps(scales, _mm512_set1_ps(-32.f));
    for (int c = 0; c < 4; ++c) {
      const int h = c / 2, ls = (c % 2) * 4;  // low 4 bits: a nibble of ql; high 2: bits of qh
      const uint8_t* ql = p + h * 64;
      const __m256i qh = load32(p + 128 + h * 32);
      const __m256i lo = _mm256_or_si256(srl8(load32(ql), ls, 15), _mm256_slli_epi16(srl8(qh, ls, 3), 4));
      const __m256i hi = _mm256_or_si256(srl8(load32(ql + 32), ls, 15), _mm256_slli_epi16(srl8(qh, ls + 2, 3), 4));
      const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                           _mm512_set1_epi32(4 * c));
      out[c] = {join(lo, hi), _mm512_permutexvar_ps(idx, scales), _mm512_permutexvar_ps(idx, offs)};
    }
  }
};

// x's rows as codes: per row `chunks` 64-byte groups (zero past K), and per chunk 16 lanes of
// the codes' scale and of the lane's dequantized sum.
struct XCodes {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  int64_t chunks;
};
// 32 values of x as int8 codes at q, to nearest, with the scale d = max |x| / 127 (returned) and
// the codes' sum at *sum where asked.
inline float quantize_block(const c10::BFloat16* x, int8_t* q, int32_t* sum) {
  const vf a = load16(x), c = load16(x + 16);
  const vf aa = (vf)((vu)a & 0x7FFFFFFFu), ca = (vf)((vu)c & 0x7FFFFFFFu);
  const float d = hmax(aa > ca ? aa : ca) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m512i qa = _mm512_cvtps_epi32((__m512)(a * inv)), qc = _mm512_cvtps_epi32((__m512)(c * inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qc));
  if (sum != nullptr) *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
  return d;
}

XCodes quantize_x(const c10::BFloat16* x, int64_t m, int64_t k) {
  XCodes xc;
  xc.chunks = (k + 2 * G - 1) / (2 * G);
  const int64_t kp = xc.chunks * 2 * G;
  xc.q.assign(m * kp, 0);
  xc.dx.assign(m * xc.chunks * L, 0.f);
  xc.sx.assign(m * xc.chunks * L, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / G; ++b) {
      const float d = quantize_block(x + r * k + b * G, xc.q.data() + r * kp + b * G, nullptr);
      float* dl = xc.dx.data() + (r * xc.chunks + b / 2) * L + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) dl[i] = d;
    }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < xc.chunks; ++c) {
      const __m512i q = _mm512_loadu_si512(xc.q.data() + r * kp + c * 2 * G);
      const __m512 dl = _mm512_loadu_ps(xc.dx.data() + (r * xc.chunks + c) * L);
      _mm512_storeu_ps(xc.sx.data() + (r * xc.chunks + c) * L,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q)), dl));
    }
  return xc;
}

// Rows of W ahead that a tile prefetches, a unit at a time: the hardware's own prefetch left
// one request's LM head (178 MB of Q8_0) at ~40 % of the memory's speed.
constexpr int64_t PREFETCH_ROWS = 4 * NB;

// res[r][j] for R rows of x's codes and J rows of W from n0.
template <int J, int R, class C>
inline void tile_codes(const C& w, int64_t n0, const XCodes& xc, int64_t nblk, float* res) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t kp = xc.chunks * 2 * G, units = xc.chunks / C::PER;
  for (int64_t u = 0; u < units; ++u)
    for (int j = 0; j < J; ++j) {
      w.prefetch(n0 + j + PREFETCH_ROWS, u);
      Codes wc[C::PER];
      w.unit(n0 + j, u, 2 * u + 1 < nblk, wc);
      for (int e = 0; e < C::PER; ++e) {
        const int64_t c = u * C::PER + e;
        for (int r = 0; r < R; ++r) {
          const __m512i xq = _mm512_loadu_si512(xc.q.data() + r * kp + c * 2 * G);
          const __m512 dl = _mm512_loadu_ps(xc.dx.data() + (r * xc.chunks + c) * L);
          const __m512 sl = _mm512_loadu_ps(xc.sx.data() + (r * xc.chunks + c) * L);
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wc[e].q, xq));
          acc[r][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(wc[e].scale, dl), _mm512_fmadd_ps(wc[e].off, sl, acc[r][j]));
        }
      }
    }
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 4) {
      hsum4((vf)acc[r][0], (vf)acc[r][1], (vf)acc[r][2], (vf)acc[r][3], res + r * J);
    } else {
      for (int j = 0; j < J; ++j) res[r * J + j] = _mm512_reduce_add_ps(acc[r][j]);
    }
  }
}

template <int J, class C>
inline void tile_codes_rows(const C& w, int64_t n0, const XCodes& xc, int64_t nblk, int rows, float* res) {
  switch (rows) {
    case 1: tile_codes<J, 1>(w, n0, xc, nblk, res); break;
    case 2: tile_codes<J, 2>(w, n0, xc, nblk, res); break;
    case 3: tile_codes<J, 3>(w, n0, xc, nblk, res); break;
    default: tile_codes<J, 4>(w, n0, xc, nblk, res); break;
  }
}

constexpr int64_t CODES_MAX_M = 4;  // beyond: bf16 dot products on blocks unpacked once per group (run)

template <class C>
void run_codes(const C& w, const c10::BFloat16* x, int64_t m, int64_t n, int64_t k, c10::BFloat16* out) {
  const XCodes xc = quantize_x(x, m, k);
  const int64_t groups = (n + NB - 1) / NB, nblk = k / G;
  const int64_t grain = std::max<int64_t>(1, GRAIN_BLOCKS / std::max<int64_t>(1, nblk));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float res[CODES_MAX_M * NB];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NB;
      const int cols = int(std::min<int64_t>(NB, n - n0));
      if (cols == NB) {
        tile_codes_rows<NB>(w, n0, xc, nblk, int(m), res);
        put(out, n, 0, int(m), n0, NB, res);
      } else {
        for (int j = 0; j < cols; ++j) {
          tile_codes_rows<1>(w, n0 + j, xc, nblk, int(m), res);
          put(out, n, 0, int(m), n0 + j, 1, res);
        }
      }
    }
  });
}
template <class W>
struct CodesOf;
template <>
struct CodesOf<Q80> { using T = C80; };
template <>
struct CodesOf<Q50> { using T = C5<false>; };
template <>
struct CodesOf<Q51> { using T = C5<true>; };
template <>
struct CodesOf<Q4K> { using T = CK<false>; };
template <>
struct CodesOf<Q5K> { using T = CK<true>; };
template <>
struct CodesOf<Q6K> { using T = C6K; };
template <>
struct CodesOf<MX4> { using T = CMX4; };
#define PAGEDLLM_INT8_CODES 1

// x's rows as int8 codes a block of 32 (quantize_block, as quantize_x), with each (row, block)'s d
// and 12 times its codes' sum (the MXFP4 codes' offset: a weight is d_w (u - 12)).
struct XBlocks {
  std::vector<int8_t> q;
  std::vector<float> d, c12;
};
XBlocks quantize_blocks(const c10::BFloat16* x, int64_t m, int64_t k) {
  const int64_t nblk = k / G;
  XBlocks xb{std::vector<int8_t>(m * k), std::vector<float>(m * nblk), std::vector<float>(m * nblk)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nblk; ++b) {
      int32_t sum;
      xb.d[r * nblk + b] = quantize_block(x + r * k + b * G, xb.q.data() + r * k + b * G, &sum);
      xb.c12[r * nblk + b] = 12.f * float(sum);
    }
  return xb;
}

// res[r][0..15] = x rows r0 .. r0 + R - 1 . W's 16 rows of group g: per block, each 4 k of x (a
// broadcast dword of codes) times 4 k of the 16 rows (one vpdpbusd), summed in int32 over the
// block, then d_w d_x (sum - 12 sum x) added in fp32.
template <int R>
inline void tile_il(const uint8_t* w, int64_t nblk, const XBlocks& xb, int64_t r0, int64_t k, float* res) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * IL_BYTES;
    for (int64_t o = 0; o < IL_BYTES; o += 64)   // the block after next's lines
      _mm_prefetch(reinterpret_cast<const char*>(p + 2 * IL_BYTES + o), _MM_HINT_T0);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int s = 0; s < 4; ++s) {
      const __m512i v = _mm512_loadu_si512(p + 16 + s * 64);
      const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
      const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb.q.data() + (r0 + r) * k + b * G + 8 * s;
        int32_t a, c;
        std::memcpy(&a, xr, 4);
        std::memcpy(&c, xr + 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(a));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(c));
      }
    }
    // d_w: 2^(e - 128), e from 2 on as bits (e - 1) << 23; 0 and 1 as the denormals they are
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512 dw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23));
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    if (tiny)
      dw = _mm512_mask_mov_ps(dw, tiny, _mm512_castsi512_ps(_mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nblk + b;
      const __m512 t = _mm512_sub_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(xb.c12[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xb.d[i])), t, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + r * IL_ROWS, acc[r]);
}

constexpr int IL_TILE = 8;  // rows of x a tile: 8 int32 and 8 fp32 accumulators

// out [m, n] bf16 = x [m, k] bf16 . W^T, W repacked MXFP4 (n a multiple of 16): groups of 16 rows
// of W spread over the threads, every tile of x's rows over a group while its bytes are in cache.
void run_il(const MX4IL& q, const c10::BFloat16* x, int64_t m, int64_t n, int64_t k, c10::BFloat16* out) {
  const XBlocks xb = quantize_blocks(x, m, k);
  const int64_t nblk = k / G, groups = n / IL_ROWS;
  at::parallel_for(0, groups, std::max<int64_t>(1, GRAIN_BLOCKS / std::max<int64_t>(1, nblk)), [&](int64_t g0, int64_t g1) {
    float res[IL_TILE * IL_ROWS];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* w = q.raw + g * nblk * IL_BYTES;
      for (int64_t r0 = 0; r0 < m; r0 += IL_TILE) {
        const int rows = int(std::min<int64_t>(IL_TILE, m - r0));
        switch (rows) {
          case 1: tile_il<1>(w, nblk, xb, r0, k, res); break;
          case 2: tile_il<2>(w, nblk, xb, r0, k, res); break;
          case 3: tile_il<3>(w, nblk, xb, r0, k, res); break;
          case 4: tile_il<4>(w, nblk, xb, r0, k, res); break;
          case 5: tile_il<5>(w, nblk, xb, r0, k, res); break;
          case 6: tile_il<6>(w, nblk, xb, r0, k, res); break;
          case 7: tile_il<7>(w, nblk, xb, r0, k, res); break;
          default: tile_il<8>(w, nblk, xb, r0, k, res); break;
        }
        for (int r = 0; r < rows; ++r) store16(out + (r0 + r) * n + g * IL_ROWS, loadf(res + r * IL_ROWS));
      }
    }
  });
}
#endif

void check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t qbytes,
           int64_t per_row, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x must be contiguous bf16 or fp32 [M, K]");
  TORCH_CHECK(x.size(1) % G == 0, op, ": K must be a multiple of 32, got ", x.size(1));
  const int64_t n = qs.size(0), nblk = x.size(1) / G;
  TORCH_CHECK(qs.dim() == 3 && qs.is_contiguous() && qs.size(1) == (nblk + per_row - 1) / per_row &&
                  qs.size(2) == qbytes, op, ": qs must be contiguous [N, ", per_row == 1 ? "K/32" : "ceil(K/64)",
              ", ", qbytes, "] for this K");
  TORCH_CHECK(d.dim() == 2 && d.is_contiguous() && d.scalar_type() == at::kHalf && d.size(0) == n &&
                  d.size(1) == qs.size(1) * per_row, op, ": scales must be contiguous fp16 [N, ", qs.size(1) * per_row, "]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
                  out.size(0) == x.size(0) && out.size(1) == n, op, ": out must be contiguous [M, N] in x's dtype");
}

template <class W>
void dispatch_ptr(const W& w, const void* xv, void* outv, int64_t m, int64_t n, int64_t k, bool bf16) {
  if (m == 0 || n == 0) return;
  if (!bf16) {
    run<F32>(w, static_cast<const float*>(xv), m, n, k, static_cast<float*>(outv));
    return;
  }
  const auto* x = static_cast<const c10::BFloat16*>(xv);
  auto* out = static_cast<c10::BFloat16*>(outv);
#ifdef PAGEDLLM_INT8_CODES
  if constexpr (!std::is_same_v<W, Q41>) {
    if (m <= CODES_MAX_M) {
      run_codes(typename CodesOf<W>::T{w}, x, m, n, k, out);
      return;
    }
  }
#endif
#ifdef PAGEDLLM_BF16_DOT
  if (m >= PANELS_MIN_M)
    run_panels(w, x, m, n, k, out);
  else
    run<BF16>(w, x, m, n, k, out);
#else
  std::vector<float> buf(size_t(m) * k);
  for (int64_t i = 0; i < m * k; i += L) storef(buf.data() + i, load16(x + i));
  run<F32>(w, buf.data(), m, n, k, out);
#endif
}

// The repacked MXFP4: bf16 rows on the int8 outer-product kernel at every row count (a row's
// result the same whatever the others), fp32 x on the exact fp32 path. Measured on a 2880 x 2880
// matrix in cache (2-core Zen 4): ~600 GFLOP/s from 4 rows, where the file's blocks ran 120-380
// (int8 codes at 1-4 rows, 4-column bf16 dot products, the panels) and the bf16 panels 430-460;
// a batch's decode (2-16 rows an expert) had run the MXFP4 experts in the bf16 experts' time.
void il_ptr(const MX4IL& q, const void* x, void* out, int64_t m, int64_t n, int64_t k, bool bf16) {
  TORCH_CHECK(n % IL_ROWS == 0, "repacked MXFP4 needs rows in groups of ", IL_ROWS, ", got ", n);
  if (m == 0 || n == 0) return;
#ifdef PAGEDLLM_INT8_CODES
  if (bf16)
    return run_il(q, static_cast<const c10::BFloat16*>(x), m, n, k, static_cast<c10::BFloat16*>(out));
#endif
  TORCH_CHECK(!bf16, "repacked MXFP4 runs bf16 rows only where the CPU has AVX512-VNNI");
  run<F32>(q, static_cast<const float*>(x), m, n, k, static_cast<float*>(out));
}

template <class W>
void dispatch(at::Tensor& out, const at::Tensor& x, const W& w) {
  dispatch_ptr(w, x.data_ptr(), out.data_ptr(), x.size(0), out.size(1), x.size(1), out.scalar_type() != at::kFloat);
}

// q4_1: bf16 rows up to WORDS_MAX_M multiply the nibbles as they are (run_words), the rest as the others.
void q4_1_ptr(const Q41& q, const void* x, void* out, int64_t m, int64_t n, int64_t k, bool bf16) {
#ifdef PAGEDLLM_BF16_DOT
  if (bf16 && m <= WORDS_MAX_M) {
    if (m > 0 && n > 0)
      run_words(Q4Fmt(q), static_cast<const c10::BFloat16*>(x), m, n, k, static_cast<c10::BFloat16*>(out));
    return;
  }
#endif
  dispatch_ptr(q, x, out, m, n, k, bf16);
}

}  // namespace

void q4_1_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  check(out, x, qs, d, G, 2, "q4_1_linear");
  TORCH_CHECK(qs.scalar_type() == at::kByte && m.sizes() == d.sizes() && m.is_contiguous() &&
                  m.scalar_type() == at::kHalf, "q4_1_linear: qs must be uint8 and m like d");
  const Q41 q{qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(), qs.size(1)};
  q4_1_ptr(q, x.data_ptr(), out.data_ptr(), x.size(0), out.size(1), x.size(1), x.scalar_type() == at::kBFloat16);
}

void q8_0_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check(out, x, qs, d, G, 1, "q8_0_linear");
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8_0_linear: qs must be int8");
  dispatch(out, x, Q80{qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), qs.size(1)});
}

// GGUF's block types that run from the file's own bytes, by ggml's type ids: bytes per block of
// how many weights.
struct GGMLType {
  int64_t id, bytes, weights;
  const char* name;
};
constexpr GGMLType GGML_TYPES[] = {{6, 22, 32, "Q5_0"}, {7, 24, 32, "Q5_1"}, {12, 144, 256, "Q4_K"},
                                   {13, 176, 256, "Q5_K"}, {14, 210, 256, "Q6_K"}, {39, 17, 32, "MXFP4"},
                                   {BLOCKS_MXFP4_IL, 17, 32, "MXFP4 repacked (mxfp4_interleave)"}};

void ggml_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& raw, int64_t type) {
  const GGMLType* t = nullptr;
  for (const auto& g : GGML_TYPES)
    if (g.id == type) t = &g;
  TORCH_CHECK(t != nullptr, "ggml_linear: ggml type ", type, " has no kernel (Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13, Q6_K 14, "
              "MXFP4 39, repacked MXFP4 1039 do)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "ggml_linear: x must be contiguous bf16 or fp32 [M, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % t->weights == 0, "ggml_linear: ", t->name, " needs K a multiple of ", t->weights, ", got ", k);
  const int64_t row_bytes = k / t->weights * t->bytes;
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.size(1) == row_bytes,
              "ggml_linear: raw must be contiguous uint8 [N, ", row_bytes, "] (", t->name, " rows of K = ", k, ")");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.size(0) == x.size(0) &&
                  out.size(1) == raw.size(0), "ggml_linear: out must be contiguous [M, N] in x's dtype");
  block_matmul({type, raw.data_ptr(), nullptr, nullptr, raw.size(0), k}, x.data_ptr(), out.data_ptr(), x.size(0),
               x.scalar_type() == at::kBFloat16);
}

// MXFP4 rows [R, K/32 * 17] (ggml's blocks; R a multiple of 16) in the repacked order MX4IL reads,
// the same size: once at load, for the int8 outer-product kernel.
at::Tensor mxfp4_interleave(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.size(0) % IL_ROWS == 0 &&
                  raw.size(1) % 17 == 0, "mxfp4_interleave: raw must be contiguous uint8 [R, K/32 * 17], R a multiple of ",
              IL_ROWS);
  const int64_t nblk = raw.size(1) / 17, groups = raw.size(0) / IL_ROWS;
  at::Tensor out = at::empty_like(raw);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nblk; ++b) {
        uint8_t* p = dst + (g * nblk + b) * IL_BYTES;
        for (int64_t c = 0; c < IL_ROWS; ++c) {
          const uint8_t* blk = src + ((g * IL_ROWS + c) * nblk + b) * 17;
          auto code = [&](int e) { return e < 16 ? blk[1 + e] & 15 : blk[1 + e - 16] >> 4; };
          p[c] = blk[0];
          for (int s = 0; s < 4; ++s)
            for (int i = 0; i < 4; ++i)
              p[16 + s * 64 + c * 4 + i] = uint8_t(code(8 * s + i) | code(8 * s + 4 + i) << 4);
        }
      }
  });
  return out;
}

int64_t block_row_bytes(int64_t type, int64_t k) {
  TORCH_CHECK(k % G == 0, "blocks need K a multiple of 32, got ", k);
  if (type == BLOCKS_Q8_0) return k;              // int8 codes [k / 32, 32] (scales apart)
  if (type == BLOCKS_Q4_1) return (k / G + 1) / 2 * G;  // pairs of blocks, 32 bytes each
  for (const auto& g : GGML_TYPES)
    if (g.id == type) {
      TORCH_CHECK(k % g.weights == 0, g.name, " needs K a multiple of ", g.weights, ", got ", k);
      return k / g.weights * g.bytes;
    }
  TORCH_CHECK(false, "blocks of ggml type ", type, " have no kernel (q4_1 3, Q8_0 8, Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13, Q6_K 14, "
              "MXFP4 39)");
  return 0;
}

void block_matmul(const BlockWeight& w, const void* x, void* out, int64_t rows, bool bf16) {
  const int64_t n = w.n, k = w.k;
  switch (w.type) {
    case BLOCKS_Q4_1:
      return q4_1_ptr(Q41{static_cast<const uint8_t*>(w.q), w.d, w.m, (k / G + 1) / 2}, x, out, rows, n, k, bf16);
    case BLOCKS_Q8_0: return dispatch_ptr(Q80{static_cast<const int8_t*>(w.q), w.d, k / G}, x, out, rows, n, k, bf16);
    default: break;
  }
  const Raw r{static_cast<const uint8_t*>(w.q), block_row_bytes(w.type, k)};
  switch (w.type) {
    case 6: return dispatch_ptr(Q50{r}, x, out, rows, n, k, bf16);
    case 7: return dispatch_ptr(Q51{r}, x, out, rows, n, k, bf16);
    case 12: return dispatch_ptr(Q4K{r}, x, out, rows, n, k, bf16);
    case 13: return dispatch_ptr(Q5K{r}, x, out, rows, n, k, bf16);
    case 39: return dispatch_ptr(MX4{r}, x, out, rows, n, k, bf16);
    case BLOCKS_MXFP4_IL: return il_ptr(MX4IL{r}, x, out, rows, n, k, bf16);
    default: return dispatch_ptr(Q6K{r}, x, out, rows, n, k, bf16);
  }
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("q4_1_linear(Tensor(a!) out, Tensor x, Tensor qs, Tensor d, Tensor m) -> ()");
  m.def("q8_0_linear(Tensor(a!) out, Tensor x, Tensor qs, Tensor d) -> ()");
  m.def("ggml_linear(Tensor(a!) out, Tensor x, Tensor raw, int type) -> ()");
  m.def("mxfp4_interleave(Tensor raw) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("q4_1_linear", &pagedllm::q4_1_linear);
  m.impl("q8_0_linear", &pagedllm::q8_0_linear);
  m.impl("ggml_linear", &pagedllm::ggml_linear);
  m.impl("mxfp4_interleave", &pagedllm::mxfp4_interleave);
}
