// 16-float vectors for the CPU kernels: GCC vector extensions (one AVX-512 register,
// two AVX2 ones, four NEON ones), with AVX-512 intrinsics only where GCC's generic code
// is slow. Storage types are converted to fp32 16 at a time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {

constexpr int L = 16;  // lanes of a vector

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef _Float16 vhf __attribute__((vector_size(32)));

constexpr vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Storage <-> fp32, 16 elements at a time.
inline vf load16(const float* p) { return loadf(p); }
inline vf load16(const c10::BFloat16* p) {
#ifdef __AVX512F__  // one widening load + shift (GCC's generic conversion takes five)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}
inline vf load16(const c10::Half* p) {
#ifdef __AVX512F__  // GCC 12 converts a _Float16 vector an element at a time without AVX512-FP16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  vhf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
#endif
}
inline void store16(float* p, vf v) { storef(p, v); }
// fp32 lanes to bf16: V float lanes, U uint32 and H uint16 lanes of as many.
template <typename V, typename U, typename H>
inline void store_bf16_lanes(c10::BFloat16* p, V v) {
  U u = (U)v;
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  u = (v != v) ? U{} + 0x7FC0u : u;            // keep NaN a NaN
  H h = __builtin_convertvector(u, H);
  std::memcpy(p, &h, sizeof h);
}
inline void store16(c10::BFloat16* p, vf v) { store_bf16_lanes<vf, vu, vh>(p, v); }
inline void store16(c10::Half* p, vf v) {
  vhf h = __builtin_convertvector(v, vhf);
  std::memcpy(p, &h, sizeof h);
}

inline float hmax(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < L; ++i) m = std::max(m, v[i]);
  return m;
#endif
}
inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
#endif
}

// The sums of four vectors into out[0..3]: one transposing reduction (13 instructions where
// AVX-512 is) instead of four separate ones (~32): a tile's epilogue, paid per output.
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
#ifdef __AVX512F__
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a, (__m512)b), _mm512_unpackhi_ps((__m512)a, (__m512)b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps((__m512)c, (__m512)d), _mm512_unpackhi_ps((__m512)c, (__m512)d));
  // per 128-bit lane: [a, b, c, d] partial sums
  // (pairs of floats move as one 64-bit lane; they add as floats)
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

#ifdef __AVX512F__
// 16 vectors of 16 dwords transposed in place: dword j of r[i] goes to dword i of r[j] (the
// block kernels' unpacked rows into panels, the chunked scan's y^T into rows).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e], 128-bit lane l: dword 4l + e of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // the 4 x 4 lanes of r[e], r[4 + e], r[8 + e], r[12 + e] transposed
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// The same for 16 vectors of floats.
inline void transpose16(vf (&x)[L]) {
#ifdef __AVX512F__
  __m512i r[L];
  for (int i = 0; i < L; ++i) r[i] = (__m512i)x[i];
  transpose16(r);
  for (int i = 0; i < L; ++i) x[i] = (vf)r[i];
#else
  for (int i = 0; i < L; ++i)
    for (int j = i + 1; j < L; ++j) std::swap(x[i][j], x[j][i]);
#endif
}

// 2^x; x < -126 (and -inf) gives 0, x > 126 gives 2^126. V: a float vector of any width, I:
// the int32 vector of as many lanes.
template <typename V, typename I>
inline V exp2_lanes(V x) {
  const V magic = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  V xc = x < -126.f ? V{} - 126.f : x;
  xc = xc > 126.f ? V{} + 126.f : xc;
  V n = (xc + magic) - magic;
  V t = (xc - n) * 0.6931471805599453f;  // |t| <= ln2 / 2
  // e^t, Taylor to t^7: relative error < 2e-8 on the range.
  V p = V{} + 1.f / 5040;
  p = p * t + 1.f / 720;
  p = p * t + 1.f / 120;
  p = p * t + 1.f / 24;
  p = p * t + 1.f / 6;
  p = p * t + 0.5f;
  p = p * t + 1.f;
  p = p * t + 1.f;
  I e = __builtin_convertvector(n, I) << 23;
  V r = (V)((I)p + e);
  return x < -126.f ? V{} : r;
}

inline vf exp2v(vf x) { return exp2_lanes<vf, vi>(x); }
inline vf expv(vf x) { return exp2v(x * 1.4426950408889634f); }

// The CPU's own width, for loops that need no 16-lane layout (rows of elementwise kernels, the
// softmax's sweeps): vn, LN lanes, with splatn, loadn, storen, hsumn, hmaxn, exp2n and logn. On
// x86 without AVX-512, GCC 12 keeps a 16-lane vector in memory (a splat is 16 scalar stores, a
// value crosses the stack at each use); an 8-lane one lives in a ymm register: silu_and_mul ran
// 3x slower than torch's two ops on a Zen 3. Elsewhere vn is vf, and these are the 16-lane
// functions above.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int LN = 8;
typedef float vn __attribute__((vector_size(32)));
typedef int32_t vni __attribute__((vector_size(32)));
typedef uint32_t vnu __attribute__((vector_size(32)));
typedef uint16_t vnh __attribute__((vector_size(16)));
typedef _Float16 vnhf __attribute__((vector_size(16)));
constexpr vni IOTAN = {0, 1, 2, 3, 4, 5, 6, 7};

inline vn splatn(float x) { return vn{x, x, x, x, x, x, x, x}; }
inline vn loadn(const float* p) { vn v; std::memcpy(&v, p, sizeof v); return v; }
inline vn loadn(const c10::BFloat16* p) {
  vnh h;
  std::memcpy(&h, p, sizeof h);
  return (vn)(__builtin_convertvector(h, vnu) << 16);
}
// fp16 bits to fp32. GCC 12 converts a _Float16 vector an element at a time where the CPU has
// no AVX512-FP16; F16C (every AVX2 CPU) converts eight in one instruction.
inline vn half_to_float(vnh h) {
#ifdef __F16C__
  __m128i x;
  std::memcpy(&x, &h, sizeof x);
  return (vn)_mm256_cvtph_ps(x);
#else
  vnhf f;
  std::memcpy(&f, &h, sizeof f);
  return __builtin_convertvector(f, vn);
#endif
}
inline vn loadn(const c10::Half* p) {
  vnh h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}
inline void storen(float* p, vn v) { std::memcpy(p, &v, sizeof v); }
inline void storen(c10::BFloat16* p, vn v) { store_bf16_lanes<vn, vnu, vnh>(p, v); }
inline void storen(c10::Half* p, vn v) {
#ifdef __F16C__
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
  vnhf h = __builtin_convertvector(v, vnhf);
  std::memcpy(p, &h, sizeof h);
#endif
}
inline float hsumn(vn v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float hmaxn(vn v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
constexpr int LN = L;
typedef vf vn;
typedef vi vni;
typedef vu vnu;
typedef vh vnh;
constexpr vni IOTAN = IOTA;
inline vn half_to_float(vnh h) { return load16(reinterpret_cast<const c10::Half*>(&h)); }
inline vn splatn(float x) { return splat(x); }
template <typename T>
inline vn loadn(const T* p) { return load16(p); }
template <typename T>
inline void storen(T* p, vn v) { store16(p, v); }
inline float hsumn(vn v) { return hsum(v); }
inline float hmaxn(vn v) { return hmax(v); }
#endif
inline vn exp2n(vn x) { return exp2_lanes<vn, vni>(x); }
inline vn expn(vn x) { return exp2n(x * 1.4426950408889634f); }

// Natural log for x > 0 (normal floats): x = 2^e * m, m in [sqrt(1/2), sqrt(2)),
// log m = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172: series to t^11. V, I as exp2_lanes.
template <typename V, typename I>
inline V log_lanes(V x) {
  I bits = (I)x;
  I e = ((bits >> 23) & 0xFF) - 127;
  V m = (V)((bits & 0x007FFFFF) | 0x3F800000);  // [1, 2)
  const I big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const V t = (m - 1.f) / (m + 1.f), t2 = t * t;
  V p = V{} + 1.f / 11;
  p = p * t2 + 1.f / 9;
  p = p * t2 + 1.f / 7;
  p = p * t2 + 1.f / 5;
  p = p * t2 + 1.f / 3;
  p = p * t2 + 1.f;
  return 2.f * t * p + __builtin_convertvector(e, V) * 0.6931471805599453f;
}

inline vf logv(vf x) { return log_lanes<vf, vi>(x); }
inline vn logn(vn x) { return log_lanes<vn, vni>(x); }

}  // namespace pagedllm
