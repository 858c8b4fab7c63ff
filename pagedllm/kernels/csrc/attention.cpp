// Paged attention for CPUs: reads K/V in place through the block tables.
//
// One op serves a whole step, decodes and prefill chunks alike (varlen): query token i
// of a sequence with ctx_len keys sits at absolute position ctx_len - q_len + i and sees
// keys 0..that position (causal). Work is cut into items of one KV head and a tile of
// query tokens; the query heads that share the KV head (GQA) ride along, so every K/V
// row is read once per item. Small decode batches split long contexts across threads
// and merge the parts' softmax states afterwards (unless split_k is off: the merge sums
// in another order than one pass does, so a row's result would depend on the batch).
// Otherwise a query row's result depends only on its own position and keys: key chunks
// start at key 0 whatever the tile, and keys past a row's last one add exact zeros.
// Math in fp32 whatever the storage
// type (fp32, bf16, fp16); the bf16 dot-product path rounds the softmax weights to bf16
// for P.V, as flash attention on GPUs does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "vec.h"

namespace pagedllm {
namespace {

// PAGEDLLM_KV_PREFETCH=0 turns the decode's prefetch of its keys off (prefetch_keys; for
// comparisons: benchmarks/kv_prefetch.py). Read once.
inline bool kv_prefetch() {
  static const bool on = [] {
    const char* v = std::getenv("PAGEDLLM_KV_PREFETCH");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}
constexpr int MAX_ROWS = 32;   // query rows (tokens x heads of a group) per prefill item
constexpr float LOG2E = 1.4426950408889634f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Item {
  int32_t seq, kvh, t0, t1;  // sequence, KV head, query tokens [t0, t1) of the sequence
  int32_t lo, hi;            // keys [lo, hi) this item covers
  int32_t part;              // -1: writes the output; else its slot in the split-K buffers
  int64_t cost;
};

// Pool layouts, per block and KV head, with P = 2 for 16-bit types and 1 for fp32:
//   K [num_blocks, KVH, D / P, B, P]   keys of a block contiguous along each (pair of) dims
//   V [num_blocks, KVH, ceil(B / P), D, P]   (pairs of) keys' values contiguous along d
// With P = 2 a 64-byte line holds 16 keys x 2 dims (K) or 16 dims x 2 keys (V): one
// bf16 dot-product instruction (AVX512_BF16) then does 32 multiply-adds of Q.K or P.V.
// Without it the pair splits into two fp32 vectors (a shift and a mask).
template <typename T>
constexpr int PAIR = sizeof(T) == 2 ? 2 : 1;

#if defined(__AVX512BF16__)
template <typename T>
constexpr bool BF16_DOT = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool BF16_DOT = false;
#endif

template <typename T>
struct Args {
  const T* q; int64_t q_tok, q_head;
  T* out; int64_t o_tok, o_head;
  const T* k; int64_t k_blk, k_head;
  const T* v; int64_t v_blk, v_head;
  const int32_t* tables; int64_t t_row;
  const int32_t* ctx_lens;
  const int32_t* q_start;
  int block_size, group;
  float scale;  // softmax scale times log2(e): the kernel works in base 2
  float* part_acc; float* part_ml;  // split-K: [part][group][D] and [part][group][2]
  int window;  // > 0: query at position p sees keys p - window + 1 .. p (sliding window)
  // Quantized pools (kv_quant.h): bytes, with k_blk / k_head / v_blk / v_head in bytes;
  // a (block, head) row's scales follow its code_bytes of codes.
  const uint8_t* kq; const uint8_t* vq; int64_t code_bytes, v_code_bytes;
  // Attention sinks (gpt-oss): per query head a logit (base 2, unscaled) in the softmax's
  // denominator beside the keys', attending to nothing; null: none.
  const float* sinks = nullptr;
};

constexpr int QK_ROWS = 4;   // query rows sharing one pass over a K tile
constexpr int CHUNK = 512;   // keys whose scores are computed before their softmax and P.V

struct Scratch {
  std::vector<float> q, acc, s, m, l, alpha, qsum, qmul, qcorr, pmul, vsc;
  std::vector<uint32_t> qp, pp;    // bf16 pairs of q and of P (dot-product path)
  std::vector<uint32_t> qlo;       // int4 keys: the query's int8 residual codes
  std::vector<uint16_t> kt, vt;    // a gathered tile, in the pool's own layout
  std::vector<int> last_key;
  void fit(int rows, int d) {
    const size_t r = size_t(rows + QK_ROWS);  // room to pad to whole row blocks
    if (q.size() < r * d) { q.resize(r * d); acc.resize(r * d); qp.resize(r * d / 2 + 1); qlo.resize(r * d / 4 + 1); }
    if (s.size() < r * CHUNK) { s.resize(r * CHUNK); pp.resize(r * CHUNK / 2); }
    if (kt.size() < size_t(d) * L * 2) { kt.resize(size_t(d) * L * 2); vt.resize(size_t(d) * L * 2); }
    if (m.size() < r) {
      m.resize(r); l.resize(r); alpha.resize(r); last_key.resize(r); qsum.resize(r * MAX_K_GROUPS);
      qmul.resize(r); qcorr.resize(r); pmul.resize(r);
    }
    if (vsc.size() < size_t(CHUNK)) vsc.resize(CHUNK);
  }
};

// The two fp32 vectors in a line of 16 bf16 pairs: low halves (element 2i), high halves.
inline void split_pairs(const c10::BFloat16* p, vf& lo, vf& hi) {
  vu u;
  std::memcpy(&u, p, sizeof u);
  lo = (vf)(u << 16);
  hi = (vf)(u & 0xFFFF0000u);
}
inline void split_pairs(const c10::Half* p, vf& lo, vf& hi) {
  for (int i = 0; i < L; ++i) {
    lo[i] = float(p[2 * i]);
    hi[i] = float(p[2 * i + 1]);
  }
}

#if defined(__AVX512BF16__)
// acc += x . (the bf16 pair at p, broadcast): the broadcast rides in the instruction
// ({1to16}), where the intrinsics cost a separate vpbroadcastd per dot product.
inline vf dot_bcast(vf acc, __m512bh x, const uint32_t* p) {
  __m512 r = (__m512)acc;
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(r) : "v"(x), "m"(*p));
  return (vf)r;
}
#endif

// Chunks of LN dims that RB rows' accumulators over them leave room for in the registers:
// the largest power of two up to budget / RB that divides the n chunks of a row.
template <int RB>
constexpr int chunks_per_pass(int n) {
  constexpr int budget = LN == 8 ? 12 : 24;  // of 16 ymm / 32 zmm registers
  int p = 16;  // (a head of 256 dims: one pass of 16 zmm, as before there was a pass at all)
  while (p > 1 && (p * RB > budget || n % p)) p /= 2;
  return p;
}

// Scores S[r][0..16) (rows CHUNK apart) for R query rows against a K tile: kt(j) points
// at pair-row j (16 keys x P dims). Dot path: q as bf16 pairs, scaled after; else q as
// floats, already scaled.
template <typename T, int NC, int R, typename KT>
inline void qk_block(const float* qs, const uint32_t* qp, float scale, float* S, KT kt) {
  constexpr int D = NC * L, P = PAIR<T>;
  vf a0[R] = {}, a1[R] = {};
#if defined(__AVX512BF16__)
  if constexpr (BF16_DOT<T>) {
    for (int j = 0; j < D / 2; j += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt(j)), k1 = (__m512bh)_mm512_loadu_si512(kt(j + 1));
      for (int r = 0; r < R; ++r) {
        a0[r] = dot_bcast(a0[r], k0, qp + r * D / 2 + j);
        a1[r] = dot_bcast(a1[r], k1, qp + r * D / 2 + j + 1);
      }
    }
    for (int r = 0; r < R; ++r) storef(S + r * CHUNK, (a0[r] + a1[r]) * scale);
    return;
  }
#endif
  if constexpr (P == 2) {
    for (int j = 0; j < D / 2; ++j) {
      vf lo, hi;
      split_pairs(kt(j), lo, hi);
      for (int r = 0; r < R; ++r) {
        a0[r] += splat(qs[r * D + 2 * j]) * lo;
        a1[r] += splat(qs[r * D + 2 * j + 1]) * hi;
      }
    }
  } else {  // fp32 keys, in the CPU's width: NH vectors of LN keys make the tile, as many
    // at a time as their sums (two a row and vector: even and odd dims) fit in registers
    constexpr int NH = L / LN, NHI = 2 * NH * R <= 12 ? NH : 1;
    for (int h0 = 0; h0 < NH; h0 += NHI) {
      vn b0[R][NHI] = {}, b1[R][NHI] = {};
      for (int d = 0; d < D; d += 2) {
        vn k0[NHI], k1[NHI];
        for (int h = 0; h < NHI; ++h) k0[h] = loadn(kt(d) + (h0 + h) * LN), k1[h] = loadn(kt(d + 1) + (h0 + h) * LN);
        for (int r = 0; r < R; ++r) {
          const vn q0 = splatn(qs[r * D + d]), q1 = splatn(qs[r * D + d + 1]);
          for (int h = 0; h < NHI; ++h) b0[r][h] += q0 * k0[h], b1[r][h] += q1 * k1[h];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < NHI; ++h) storen(S + r * CHUNK + (h0 + h) * LN, b0[r][h] + b1[r][h]);
    }
    return;
  }
  for (int r = 0; r < R; ++r) storef(S + r * CHUNK, a0[r] + a1[r]);
}

// f(std::integral_constant<int, n>) for n in 1..4: loops over rows with a count known at
// compile time, so a decode of 3 query heads per KV head does 3 rows of work, not 4.
template <typename F>
inline void with_rows(int n, F f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// acc[r] = acc[r] * alpha[r] + sum over the chunk's keys of P[r][t] V[t], for RB rows.
// tile(t0) gives the V pair-rows of the tile starting at chunk key t0: vt(i, c) points at
// pair-row i (keys t0+P*i..), dims 16c..16c+15. S: P as floats, pp: as bf16 pairs,
// CHUNK keys per row.
template <typename T, int NC, int RB, typename TILE>
inline void pv_block(float* acc, const float* S, const uint32_t* pp, const float* alpha, int n, TILE tile) {
  constexpr int D = NC * L, P = PAIR<T>;
  if constexpr (std::is_same_v<T, float>) {  // in the CPU's width, over as many dims as the registers hold
    constexpr int NCN = D / LN, CP = chunks_per_pass<RB>(NCN);
    for (int c0 = 0; c0 < NCN; c0 += CP) {
      vn o[RB][CP];
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CP; ++c) o[r][c] = loadn(acc + r * D + (c0 + c) * LN) * alpha[r];
      for (int t0 = 0; t0 < n; t0 += L) {
        const auto vt = tile(t0);
        const int keys = std::min(L, n - t0);
        for (int i = 0; i < keys; ++i)
          for (int c = 0; c < CP; ++c) {
            const int d = (c0 + c) * LN;  // dims d .. d + LN - 1: in 16-dim row d / L
            const vn v = loadn(vt(i, d / L) + d % L);
            for (int r = 0; r < RB; ++r) o[r][c] += splatn(S[r * CHUNK + t0 + i]) * v;
          }
      }
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CP; ++c) storen(acc + r * D + (c0 + c) * LN, o[r][c]);
    }
    return;
  }
  vf o[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = loadf(acc + r * D + c * L) * alpha[r];
  for (int t0 = 0; t0 < n; t0 += L) {
    const auto vt = tile(t0);
    const int pairs = (std::min(L, n - t0) + P - 1) / P;  // P = 0 past n: a half-used pair adds nothing
#if defined(__AVX512BF16__)
    if constexpr (BF16_DOT<T>) {
      for (int i = 0; i < pairs; ++i)
        for (int c = 0; c < NC; ++c) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(vt(i, c));
          for (int r = 0; r < RB; ++r)
            o[r][c] = dot_bcast(o[r][c], v, pp + r * CHUNK / 2 + t0 / 2 + i);
        }
      continue;
    }
#endif
    for (int i = 0; i < pairs; ++i)
      for (int c = 0; c < NC; ++c) {
        if constexpr (P == 2) {
          vf lo, hi;
          split_pairs(vt(i, c), lo, hi);
          for (int r = 0; r < RB; ++r)
            o[r][c] += splat(S[r * CHUNK + t0 + 2 * i]) * lo + splat(S[r * CHUNK + t0 + 2 * i + 1]) * hi;
        } else {
          const vf v = load16(vt(i, c));
          for (int r = 0; r < RB; ++r) o[r][c] += splat(S[r * CHUNK + t0 + i]) * v;
        }
      }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) storef(acc + r * D + c * L, o[r][c]);
}

// Quantized K: scores S[r][0..16) of R rows against 16 keys whose lanes start at kb, one
// line of 64 bytes per PER_LANE dims (lane_row bytes apart); ks / km: the keys' scales
// (and int4's mins) per group of dims, 16 floats a group. A scale is per key, that is per
// lane: it multiplies a group's finished dot products once; a min adds min * (the row's sum
// of q over the group). In the CPU's width: LN keys at a time.
template <Fmt F, int NC, int R>
inline void qk_block_q(const float* qs, const float* qsum, float* S, const uint8_t* kb, int64_t lane_row,
                       const float* ks, const float* km) {
  constexpr int D = NC * L, E = PER_LANE<F>, G = K_GROUPS<F, D>, LG = D / E / G;  // lanes per group
  for (int h = 0; h < L; h += LN) {
    vn out[R] = {};
    for (int grp = 0; grp < G; ++grp) {
      vn a0[R] = {}, a1[R] = {};
      for (int g = grp * LG; g < (grp + 1) * LG; ++g) {
        vnu u;
        std::memcpy(&u, kb + g * lane_row + h * 4, sizeof u);
        for (int i = 0; i < E; i += 2) {
          const vn k0 = k_elem<F>(u, i), k1 = k_elem<F>(u, i + 1);
          for (int r = 0; r < R; ++r) {
            a0[r] += splatn(qs[r * D + g * E + i]) * k0;
            a1[r] += splatn(qs[r * D + g * E + i + 1]) * k1;
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        out[r] += (a0[r] + a1[r]) * loadn(ks + grp * L + h);
        if constexpr (K_ASYM<F>) out[r] += splatn(qsum[r * G + grp]) * loadn(km + grp * L + h);
      }
    }
    for (int r = 0; r < R; ++r) storen(S + r * CHUNK + h, out[r]);
  }
}

// Quantized V: acc[r] = acc[r] * alpha[r] + sum over keys t in [t_lo, n) of P[r][t] V[t],
// the key's scale folded into its weight (vs[t]: 0 outside [t_lo, n)). Rows of the pool's
// own layout: fp8 a key at a time (row(t): its codes), int8 and int4 a pair of keys at a
// time (pair(i): the pair row of keys 2i, 2i + 1), decoded once for the RB rows. In the CPU's
// width, over as many dims at a time as the registers hold.
template <Fmt F, int NC, int RB, typename ROW>
inline void pv_block_q(float* acc, const float* S, const float* vs, const float* alpha, int t_lo, int n, ROW row) {
  constexpr int D = NC * L, NCN = D / LN;
  constexpr bool pairs = V_PAIRS<F>, i4 = F == Fmt::i4;
  constexpr int loads = i4 ? NCN / 2 : NCN;  // vectors of codes a row (pair row) of D dims takes
  constexpr int CP = chunks_per_pass<RB * (i4 ? 2 : 1)>(loads);
  for (int c0 = 0; c0 < loads; c0 += CP) {
    vn o[RB][CP * (i4 ? 2 : 1)];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CP; ++c) {
        o[r][c] = loadn(acc + r * D + (c0 + c) * LN) * alpha[r];
        if constexpr (i4) o[r][CP + c] = loadn(acc + r * D + D / 2 + (c0 + c) * LN) * alpha[r];
      }
    if constexpr (pairs) {
      for (int t = t_lo & ~1; t < n; t += 2) {  // t even: chunks start on a whole tile
        const uint8_t* pr = row(t / 2);
        float w0[RB], w1[RB];
        for (int r = 0; r < RB; ++r) {
          w0[r] = S[r * CHUNK + t] * vs[t];
          w1[r] = S[r * CHUNK + t + 1] * vs[t + 1];
        }
        for (int c = 0; c < CP; ++c) {
          vn v[i4 ? 4 : 2];
          v_pair<F>(pr + (c0 + c) * 2 * LN, v);
          for (int r = 0; r < RB; ++r) {
            o[r][c] += splatn(w0[r]) * v[0] + splatn(w1[r]) * v[1];
            if constexpr (i4) o[r][CP + c] += splatn(w0[r]) * v[2] + splatn(w1[r]) * v[3];
          }
        }
      }
    } else {
      for (int t = t_lo; t < n; ++t) {
        const uint8_t* codes = row(t);
        for (int c = 0; c < CP; ++c) {
          const vn v = v_chunk<F>(codes, c0 + c);
          for (int r = 0; r < RB; ++r) o[r][c] += splatn(S[r * CHUNK + t] * vs[t]) * v;
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CP; ++c) {
        storen(acc + r * D + (c0 + c) * LN, o[r][c]);
        if constexpr (i4) storen(acc + r * D + D / 2 + (c0 + c) * LN, o[r][CP + c]);
      }
  }
}

inline float bf16_at(const uint8_t* p) {
  c10::BFloat16 x;
  std::memcpy(&x, p, sizeof x);
  return float(x);
}

#if defined(__AVX512VNNI__)
constexpr bool INT8_DOT = true;
// int8 keys with AVX512_VNNI: the query row as int8 (q4: its D / 4 quads of codes) against
// a 64-byte line of 16 keys x 4 dims (unsigned, offset by 128) per instruction; the offset
// comes back out as 128 x the row's code sum (qcorr), its scale and the keys' after.
template <int NC, int R>
inline void qk_block_i8(const int32_t* q4, const float* qmul, const float* qcorr, float* S, const uint8_t* kb,
                        int64_t lane_row, vf ks) {
  constexpr int D = NC * L;
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int g = 0; g < D / 4; ++g) {
    const __m512i kv = _mm512_loadu_si512(kb + g * lane_row);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], kv, _mm512_set1_epi32(q4[r * D / 4 + g]));
  }
  for (int r = 0; r < R; ++r)
    storef(S + r * CHUNK, ((vf)_mm512_cvtepi32_ps(acc[r]) - qcorr[r]) * (ks * qmul[r]));
}

// int4 keys with AVX512_VNNI: a lane's low nibbles are 4 even dims of 8, its high ones the 4
// odd (q4 holds the row's int8 codes in that order: even quad, odd quad per lane); codes
// are unsigned, so no offset: per group of 32 dims, scale x dot + min x the row's q sum.
template <int NC, int R>
inline void qk_block_i4(const int32_t* q4, const int32_t* q4lo, const float* qmul, const float* qsum, float* S,
                        const uint8_t* kb, int64_t lane_row, const vf* ks, const vf* km) {
  constexpr int D = NC * L, G = D / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  vf out[R] = {};
  for (int grp = 0; grp < G; ++grp) {
    __m512i acc[R], res[R];  // the query's codes' dot, and its residual codes'
    for (int r = 0; r < R; ++r) acc[r] = res[r] = _mm512_setzero_si512();
    for (int g = grp * 4; g < grp * 4 + 4; ++g) {
      const __m512i u = _mm512_loadu_si512(kb + g * lane_row);
      const __m512i lo = _mm512_and_si512(u, nib), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), nib);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(q4[r * D / 4 + 2 * g]));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(q4[r * D / 4 + 2 * g + 1]));
        res[r] = _mm512_dpbusd_epi32(res[r], lo, _mm512_set1_epi32(q4lo[r * D / 4 + 2 * g]));
        res[r] = _mm512_dpbusd_epi32(res[r], hi, _mm512_set1_epi32(q4lo[r * D / 4 + 2 * g + 1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const vf dot = (vf)_mm512_cvtepi32_ps(acc[r]) + (vf)_mm512_cvtepi32_ps(res[r]) * (1.f / 254);
      out[r] += dot * (ks[grp] * qmul[r]) + splat(qsum[r * G + grp]) * km[grp];
    }
  }
  for (int r = 0; r < R; ++r) storef(S + r * CHUNK, out[r]);
}

// int8 and int4 values with AVX512_VNNI: acc[r] = acc[r] * alpha[r] + pmul[r] * sum over key
// pairs [i0, i1) of p16[r] . V, where p16 holds each row's weights (times the keys' scales)
// as int16 pairs and pair(i) points at the pair row of keys 2i, 2i+1 (their bytes side by
// side). int8: 32 bytes give two keys' dims c..c+15; int4: also dims c + D/2.. (the high
// nibbles), offset by 8.
template <Fmt F, int NC, int RB, typename PAIR_ROW>
inline void pv_block_int(float* acc, const uint32_t* p16, const float* pmul, const float* alpha, int i0, int i1,
                         PAIR_ROW pair) {
  constexpr int D = NC * L, H = F == Fmt::i4 ? NC / 2 : NC;  // 32-byte loads per pair row
  const __m512i nib = _mm512_set1_epi16(0x0F), eight = _mm512_set1_epi16(8);
  __m512i ai[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) ai[r][c] = _mm512_setzero_si512();
  for (int i = i0; i < i1; ++i) {
    const uint8_t* row = pair(i);
    for (int c = 0; c < H; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 2 * L));
      __m512i v0, v1;  // words of dims c.. (and int4's c + D/2..) of the two keys
      if constexpr (F == Fmt::i4) {
        const __m512i w = _mm512_cvtepu8_epi16(bytes);
        v0 = _mm512_sub_epi16(_mm512_and_si512(w, nib), eight);
        v1 = _mm512_sub_epi16(_mm512_srli_epi16(w, 4), eight);
      } else {
        v0 = v1 = _mm512_cvtepi8_epi16(bytes);
      }
      for (int r = 0; r < RB; ++r) {
        const __m512i p = _mm512_set1_epi32(int32_t(p16[r * CHUNK / 2 + i]));
        ai[r][c] = _mm512_dpwssd_epi32(ai[r][c], v0, p);
        if constexpr (F == Fmt::i4) ai[r][c + H] = _mm512_dpwssd_epi32(ai[r][c + H], v1, p);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c)
      storef(acc + r * D + c * L, loadf(acc + r * D + c * L) * alpha[r] + (vf)_mm512_cvtepi32_ps(ai[r][c]) * pmul[r]);
}
#else
constexpr bool INT8_DOT = false;
#endif
// P.V through the 16-bit integer dot product: int8 and int4 values (measured on SmolLM2 int4:
// perplexity +3.6 % against the fp32 path's +6.3 %, and faster).
template <Fmt F>
constexpr bool PV_INT = F == Fmt::i8 || F == Fmt::i4;

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next
// tile: ask for its K lines while this one computes.
template <typename T>
inline void prefetch_k(const Args<T>& a, const int32_t* table, int j, int h, int d) {
  const int B = a.block_size, P = PAIR<T>;
  const char* kp = reinterpret_cast<const char*>(a.k + int64_t(table[j / B]) * a.k_blk + h * a.k_head + j % B * P);
  for (int r = 0; r < d / P; ++r) __builtin_prefetch(kp + int64_t(r) * B * P * sizeof(T));
}

// A line into L2. As inline asm: GCC takes a function whose only effect is __builtin_prefetch for
// one without effects, and drops the calls to it (measured: no prefetcht1 left in the object).
inline void to_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Every K and V line of keys [j0, j1) (whole blocks) of KV head h, into L2: a block's K (and V)
// of one head is one run of bytes, its codes and scales in a quantized pool. Blocks sit anywhere
// in the pool, so the hardware prefetcher cannot follow a sequence's keys, and a decode reads a
// few KB a block (SmolLM2: 2 KB of K and 2 KB of V a block and KV head in bf16) that would
// otherwise wait out its misses a tile at a time: asked for all at once they overlap (BENCHMARKS.md §43).
template <typename T, Fmt F>
inline void prefetch_keys(const Args<T>& a, const int32_t* table, int h, int j0, int j1) {
  constexpr bool quant = F != Fmt::plain;
  constexpr int64_t unit = quant ? 1 : sizeof(T);   // quantized pools' strides are in bytes
  const char* k = quant ? reinterpret_cast<const char*>(a.kq) : reinterpret_cast<const char*>(a.k);
  const char* v = quant ? reinterpret_cast<const char*>(a.vq) : reinterpret_cast<const char*>(a.v);
  const int64_t k_bytes = a.k_head * unit, v_bytes = a.v_head * unit;
  const int B = a.block_size;
  for (int b = j0 / B; b <= (j1 - 1) / B; ++b) {
    const char* kp = k + (int64_t(table[b]) * a.k_blk + h * a.k_head) * unit;
    const char* vp = v + (int64_t(table[b]) * a.v_blk + h * a.v_head) * unit;
    for (int64_t o = 0; o < k_bytes; o += 64) to_l2(kp + o);
    for (int64_t o = 0; o < v_bytes; o += 64) to_l2(vp + o);
  }
}

// A decode item's first chunk of keys (prefetch_keys), asked for while the item before it runs.
template <typename T, Fmt F>
inline void prefetch_item(const Item& it, const Args<T>& a) {
  if (a.q_start[it.seq + 1] - a.q_start[it.seq] != 1 || a.block_size % L != 0) return;
  const int pos = a.ctx_lens[it.seq] - 1;   // the query's position: it sees keys up to it
  const int need = a.window > 0 ? std::max(0, pos - a.window + 1) : 0;
  const int c0 = std::max(it.lo, need / L * L), hi = std::min({it.hi, pos + 1, c0 + CHUNK});
  if (hi > c0) prefetch_keys<T, F>(a, a.tables + it.seq * a.t_row, it.kvh, std::max(c0, need), hi);
}

template <typename T, int NC, Fmt F>
void run_item(const Item& it, const Args<T>& a, Scratch& sc) {
  constexpr int D = NC * L, P = PAIR<T>;
  constexpr int PV_ROWS = NC <= 2 ? 8 : NC <= 4 ? 4 : NC <= 8 ? 2 : 1;  // accumulators that fit in registers
  const int G = a.group, B = a.block_size;
  const int q_len = a.q_start[it.seq + 1] - a.q_start[it.seq];
  const int first_pos = a.ctx_lens[it.seq] - q_len;  // absolute position of query token 0
  const int rows = (it.t1 - it.t0) * G;
  const int qk_rows = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
  const int pv_rows = (rows + PV_ROWS - 1) / PV_ROWS * PV_ROWS;
  const int32_t* table = a.tables + it.seq * a.t_row;
  sc.fit(std::max(qk_rows, pv_rows), D);
  float *qs = sc.q.data(), *acc = sc.acc.data(), *S = sc.s.data();
  float *m = sc.m.data(), *l = sc.l.data(), *alpha = sc.alpha.data();
  uint32_t *qp = sc.qp.data(), *pp = sc.pp.data();
  T *kt = reinterpret_cast<T*>(sc.kt.data()), *vt = reinterpret_cast<T*>(sc.vt.data());
  int* last_key = sc.last_key.data();  // causal: row r sees keys <= last_key[r]
  // Sliding window: row r sees keys > last_key[r] - window; no row of the item sees a key
  // below `need`, whose block may already be freed (its table entry -1): never read it.
  const int need = a.window > 0 ? std::max(0, first_pos + it.t0 - a.window + 1) : 0;

  for (int r = 0; r < std::max(qk_rows, pv_rows); ++r) {
    const bool live = r < rows;
    last_key[r] = live ? first_pos + it.t0 + r / G : -1;
    const T* src = a.q + (a.q_start[it.seq] + it.t0 + r / G) * a.q_tok + (it.kvh * G + r % G) * a.q_head;
    for (int c = 0; c < NC; ++c) {
      storef(qs + r * D + c * L, live ? load16(src + c * L) * a.scale : vf{});
      storef(acc + r * D + c * L, vf{});
    }
    if constexpr (BF16_DOT<T> && F == Fmt::plain) {
      if (live) std::memcpy(qp + r * D / 2, src, sizeof(T) * D);
      else std::memset(qp + r * D / 2, 0, sizeof(T) * D);
    }
    if constexpr (F != Fmt::plain) {
      hadamard(qs + r * D, D);  // keys are stored rotated (kv_quant.h)
      constexpr int G = K_GROUPS<F, D>;
      for (int grp = 0; grp < G; ++grp) {  // for asymmetric keys' mins
        float sum = 0.f;
        for (int x = grp * D / G; x < (grp + 1) * D / G; ++x) sum += qs[r * D + x];
        sc.qsum[r * G + grp] = sum;
      }
      if constexpr ((F == Fmt::i8 || F == Fmt::i4) && INT8_DOT) {  // the row as int8, for integer dot products
        float qa = 0.f;
        for (int x = 0; x < D; ++x) qa = std::max(qa, std::abs(qs[r * D + x]));
        const float inv = qa > 0.f ? 127.f / qa : 0.f;
        int8_t* qi = reinterpret_cast<int8_t*>(sc.qp.data()) + r * D;
        int8_t* ql = reinterpret_cast<int8_t*>(sc.qlo.data()) + r * D;
        int sum = 0;
        float group_sum[K_GROUPS<F, D>] = {};
        for (int x = 0; x < D; ++x) {
          // int4 keys' lanes give 4 even dims of 8 (low nibbles), then the 4 odd ones.
          const int at = F == Fmt::i4 ? x / 8 * 8 + (x % 2) * 4 + x % 8 / 2 : x;
          const float y = qs[r * D + x] * inv;
          sum += qi[at] = int8_t(std::nearbyint(y));
          // int4 keys' error is larger than int8's; a second int8 code for what the first
          // left (in 1/254 steps) keeps the query's own rounding well below it.
          if constexpr (F == Fmt::i4) ql[at] = int8_t(std::nearbyint((y - qi[at]) * 254.f));
          group_sum[x * G / D] += F == Fmt::i4 ? qi[at] + ql[at] / 254.f : 0.f;
        }
        sc.qmul[r] = qa / 127.f;
        sc.qcorr[r] = 128.f * float(sum);
        if constexpr (K_ASYM<F>)  // the mins meet the same (rounded) query as the codes
          for (int grp = 0; grp < G; ++grp) sc.qsum[r * G + grp] = sc.qmul[r] * group_sum[grp];
      }
    }
    m[r] = NEG_INF;
    l[r] = 0.f;
    alpha[r] = 1.f;
  }
  // Blocks of a multiple of 16 keys: a tile is read where it lies. Smaller ones: its keys
  // are gathered into kt / vt, in the same layout.
  const bool whole_tiles = B % L == 0;
  const int64_t k_row = int64_t(B) * P;  // elements between pair-rows of K in a block
  auto k_tile = [&](int j0, int n) -> std::pair<const T*, int64_t> {
    if (whole_tiles)
      return {a.k + int64_t(table[j0 / B]) * a.k_blk + it.kvh * a.k_head + (j0 % B) * P, k_row};
    std::memset(kt, 0, sizeof(T) * D * L);
    for (int t = std::max(0, need - j0); t < n; ++t) {
      const int j = j0 + t;
      const T* ks = a.k + int64_t(table[j / B]) * a.k_blk + it.kvh * a.k_head + (j % B) * P;
      for (int d = 0; d < D; ++d) kt[(d / P) * L * P + t * P + d % P] = ks[(d / P) * k_row + d % P];
    }
    return {kt, int64_t(L) * P};
  };
  auto v_tile = [&](int j0, int n) -> const T* {  // pair-rows D * P elements apart
    if (whole_tiles) return a.v + int64_t(table[j0 / B]) * a.v_blk + it.kvh * a.v_head + (j0 % B / P) * D * P;
    std::memset(vt, 0, sizeof(T) * D * L);
    for (int t = std::max(0, need - j0); t < n; ++t) {
      const int j = j0 + t;
      const T* vs = a.v + int64_t(table[j / B]) * a.v_blk + it.kvh * a.v_head + (j % B / P) * D * P + j % B % P;
      for (int d = 0; d < D; ++d) vt[(t / P) * D * P + d * P + t % P] = vs[d * P];
    }
    return vt;
  };

  // Quantized tiles: 16 keys' K lanes where they lie (or gathered into kt), and their
  // scales (and mins) per group, as vectors over the 16 keys.
  constexpr Fmt FQ = F == Fmt::plain ? Fmt::i8 : F;  // (plain instances never use these)
  constexpr int E = PER_LANE<FQ>, KG = K_GROUPS<FQ, D>;
  vf ks[KG], km[KG];
  auto kq_tile = [&](int j0, int n) -> std::pair<const uint8_t*, int64_t> {
    if (whole_tiles) {
      const uint8_t* blk = a.kq + int64_t(table[j0 / B]) * a.k_blk + it.kvh * a.k_head;
      const int pos = j0 % B;
      const auto* sc16 = reinterpret_cast<const c10::BFloat16*>(blk + a.code_bytes) + pos;
      for (int grp = 0; grp < KG; ++grp) {
        ks[grp] = load16(sc16 + grp * B) * DECODE_MUL<FQ>;
        if constexpr (K_ASYM<FQ>) km[grp] = load16(sc16 + (KG + grp) * B);
      }
      return {blk + pos * 4, int64_t(B) * 4};
    }
    uint8_t* k8 = reinterpret_cast<uint8_t*>(sc.kt.data());
    std::memset(k8, 0, size_t(D / E) * 64);
    float fs[KG][L] = {}, fm[KG][L] = {};
    for (int t = std::max(0, need - j0); t < n; ++t) {
      const int j = j0 + t;
      const uint8_t* blk = a.kq + int64_t(table[j / B]) * a.k_blk + it.kvh * a.k_head;
      for (int g = 0; g < D / E; ++g) std::memcpy(k8 + g * 64 + t * 4, blk + (int64_t(g) * B + j % B) * 4, 4);
      for (int grp = 0; grp < KG; ++grp) {
        fs[grp][t] = bf16_at(blk + a.code_bytes + (grp * B + j % B) * 2);
        if constexpr (K_ASYM<FQ>) fm[grp][t] = bf16_at(blk + a.code_bytes + ((KG + grp) * B + j % B) * 2);
      }
    }
    for (int grp = 0; grp < KG; ++grp) {
      ks[grp] = loadf(fs[grp]) * DECODE_MUL<FQ>;
      km[grp] = loadf(fm[grp]);
    }
    return {k8, 64};
  };
  const int64_t v_row = int64_t(D) * BITS<FQ> / 8;
  auto vq_row = [&](int j) -> std::pair<const uint8_t*, float> {  // (int8: the key's byte in its pair row)
    const uint8_t* blk = a.vq + int64_t(table[j / B]) * a.v_blk + it.kvh * a.v_head;
    const int pos = j % B;
    const uint8_t* row = V_PAIRS<FQ> ? blk + (pos / 2) * 2 * v_row + pos % 2 : blk + pos * v_row;
    return {row, bf16_at(blk + a.v_code_bytes + pos * 2) * DECODE_MUL<FQ>};
  };

  // The last query row sees keys up to first_pos + t1 - 1; the first, none below `need`
  // (chunks start on a whole tile).
  const int hi = std::min(it.hi, first_pos + it.t1);
  // A decode asks for its first chunk's keys now (the item before may have already), and each
  // chunk for the next one's: at most two chunks on their way (128 KB of SmolLM2's, 512 of Gemma 3's).
  const bool ahead = whole_tiles && rows == G && kv_prefetch();
  if (ahead) prefetch_item<T, F>(it, a);
  for (int c0 = std::max(it.lo, need / L * L); c0 < hi; c0 += CHUNK) {
    const int cn = std::min(CHUNK, hi - c0);
    if (ahead && c0 + CHUNK < hi) prefetch_keys<T, F>(a, table, it.kvh, c0 + CHUNK, std::min(hi, c0 + 2 * CHUNK));
    // 1. Scores of every row against the chunk's keys: tiles independent of each other.
    for (int t0 = 0; t0 < cn; t0 += L) {
      if constexpr (F == Fmt::plain) {
        const auto [kb, ks] = k_tile(c0 + t0, std::min(L, cn - t0));
        if (whole_tiles && t0 + L < cn) prefetch_k(a, table, c0 + t0 + L, it.kvh, D);
        for (int r = 0; r < qk_rows; r += QK_ROWS)
          with_rows(std::min(QK_ROWS, rows - r), [&](auto R) {
            qk_block<T, NC, R>(qs + r * D, qp + r * D / 2, a.scale, S + r * CHUNK + t0,
                               [&](int j) { return kb + j * ks; });
          });
      } else {
        const auto [kb, lane_row] = kq_tile(c0 + t0, std::min(L, cn - t0));
        if (whole_tiles && t0 + L < cn) {
          const uint8_t* nb = a.kq + int64_t(table[(c0 + t0 + L) / B]) * a.k_blk + it.kvh * a.k_head +
                              (c0 + t0 + L) % B * 4;
          for (int g = 0; g < D / E; ++g) __builtin_prefetch(nb + int64_t(g) * B * 4);
        }
        for (int r = 0; r < qk_rows; r += QK_ROWS)
          with_rows(std::min(QK_ROWS, rows - r), [&](auto R) {
#if defined(__AVX512VNNI__)
            if constexpr (F == Fmt::i8) {
              qk_block_i8<NC, R>(reinterpret_cast<const int32_t*>(sc.qp.data()) + r * D / 4, sc.qmul.data() + r,
                                 sc.qcorr.data() + r, S + r * CHUNK + t0, kb, lane_row, ks[0]);
              return;
            }
            if constexpr (F == Fmt::i4) {
              qk_block_i4<NC, R>(reinterpret_cast<const int32_t*>(sc.qp.data()) + r * D / 4,
                                 reinterpret_cast<const int32_t*>(sc.qlo.data()) + r * D / 4, sc.qmul.data() + r,
                                 sc.qsum.data() + r * KG, S + r * CHUNK + t0, kb, lane_row, ks, km);
              return;
            }
#endif
            qk_block_q<F, NC, R>(qs + r * D, sc.qsum.data() + r * KG, S + r * CHUNK + t0, kb, lane_row,
                                 reinterpret_cast<const float*>(ks), reinterpret_cast<const float*>(km));
          });
      }
    }
    // 2. Softmax over the chunk, carried across chunks (m running max, alpha rescales acc).
    for (int r = 0; r < rows; ++r) {
      float* sr = S + r * CHUNK;
      int visible = std::min(cn, last_key[r] - c0 + 1);  // keys of the chunk this row sees
      // Window: keys of the chunk below this row's first one (first >= 0 only with a window).
      const int first = a.window > 0 ? last_key[r] - a.window + 1 - c0 : 0;
      if (first >= visible) visible = 0;
      // In the CPU's own width (vn): a sweep of single floats, no 16-key layout. Keys from
      // visible to the end of its vector become 0 (an odd chunk's last pair reads one).
      vn mv = splatn(m[r]);
      for (int t0 = 0; t0 < visible; t0 += LN) {
        vn s = loadn(sr + t0);
        s = IOTAN + t0 < visible && IOTAN + t0 >= first ? s : splatn(NEG_INF);
        storen(sr + t0, s);
        mv = mv > s ? mv : s;
      }
      const float mx = hmaxn(mv);
      alpha[r] = visible > 0 ? std::exp2(m[r] - mx) : 1.f;  // 0 on the first visible chunk
      vn sum{};
      for (int t0 = 0; t0 < cn; t0 += LN) {
        const vn p = t0 < visible ? exp2n(loadn(sr + t0) - mx) : vn{};
        storen(sr + t0, p);
        sum += p;
#if defined(__AVX512BF16__)
        if constexpr (BF16_DOT<T>)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + r * CHUNK / 2 + t0 / 2),
                              (__m256i)_mm512_cvtneps_pbh((__m512)p));
#endif
      }
      if (visible > 0) {
        l[r] = l[r] * alpha[r] + hsumn(sum);
        m[r] = mx;
      }
    }
    // 3. acc += P . V, row block by row block, over the chunk's tiles.
    const int t_lo = std::max(0, need - c0);  // keys of the chunk below every row's window: not read
    uint8_t* pair_tile = reinterpret_cast<uint8_t*>(sc.vt.data());
    float* vs = sc.vsc.data();  // V's scales of the chunk's keys, 0 past it and below the window
    if constexpr (F != Fmt::plain) {
      for (int t0 = 0; t0 < cn; t0 += L) {
        if (whole_tiles && t0 >= t_lo) {  // 16 keys of one block: their scales side by side
          const uint8_t* blk = a.vq + int64_t(table[(c0 + t0) / B]) * a.v_blk + it.kvh * a.v_head;
          const vf x = load16(reinterpret_cast<const c10::BFloat16*>(blk + a.v_code_bytes) + (c0 + t0) % B);
          storef(vs + t0, IOTA + t0 < cn ? x * DECODE_MUL<FQ> : vf{});
        } else {
          for (int t = t0; t < t0 + L; ++t) vs[t] = t < t_lo || t >= cn ? 0.f : vq_row(c0 + t).second;
        }
      }
    }
    // The pair row of chunk keys 2i, 2i + 1 (int8, int4): where it lies when blocks hold whole
    // pairs; in odd blocks the two keys' bytes are gathered side by side (zero codes for keys
    // outside [t_lo, cn), whose blocks may be gone).
    auto pair = [&](int i) -> const uint8_t* {
      const int j = c0 + 2 * i;
      if (B % 2 == 0) {
        const uint8_t* blk = a.vq + int64_t(table[j / B]) * a.v_blk + it.kvh * a.v_head;
        return blk + (j % B) / 2 * 2 * v_row;
      }
      for (int x = 0; x < 2; ++x) {
        const bool real = 2 * i + x < cn && 2 * i + x >= t_lo;
        const uint8_t* src = real ? vq_row(j + x).first : nullptr;
        for (int b = 0; b < v_row; ++b) pair_tile[b * 2 + x] = real ? src[b * 2] : (F == Fmt::i4 ? 0x88 : 0);
      }
      return pair_tile;
    };
#if defined(__AVX512VNNI__)
    if constexpr (PV_INT<F>) {
      // Each row's weights times the keys' scales, as int16 of the row's max (pmul back).
      for (int r = 0; r < pv_rows; ++r) {
        const float* sr = S + r * CHUNK;
        vf mv{};
        for (int t0 = 0; t0 < cn; t0 += L) {  // S past cn / below t_lo meet a zero scale
          const vf p = loadf(sr + t0) * loadf(vs + t0);
          mv = mv > p ? mv : p;
        }
        const float mx = hmax(mv);
        const vf mul = splat(mx > 0.f ? 32767.f / mx : 0.f);
        int16_t* p16 = reinterpret_cast<int16_t*>(pp + r * CHUNK / 2);
        for (int t0 = 0; t0 < cn; t0 += L) {
          const __m512i w = _mm512_cvtps_epi32((__m512)(loadf(sr + t0) * loadf(vs + t0) * mul));  // nearest
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + t0), _mm512_cvtsepi32_epi16(w));
        }
        sc.pmul[r] = mx / 32767.f;
      }
    }
#endif
    for (int r = 0; r < pv_rows; r += PV_ROWS) {
      auto pv = [&](auto R) {
#if defined(__AVX512VNNI__)
        if constexpr (PV_INT<F>) {
          constexpr int RB = std::min<int>(decltype(R)::value, PV_ROWS);
          pv_block_int<F, NC, RB>(acc + r * D, pp + r * CHUNK / 2, sc.pmul.data() + r, alpha + r, t_lo / 2,
                                  (cn + 1) / 2, pair);
          return;
        }
#endif
        if constexpr (F != Fmt::plain) {
          constexpr int RB = std::min<int>(decltype(R)::value, PV_ROWS);
          if constexpr (V_PAIRS<F>) pv_block_q<F, NC, RB>(acc + r * D, S + r * CHUNK, vs, alpha + r, t_lo, cn, pair);
          else pv_block_q<F, NC, RB>(acc + r * D, S + r * CHUNK, vs, alpha + r, t_lo, cn,
                                     [&](int t) { return vq_row(c0 + t).first; });
          return;
        }
        pv_block<T, NC, std::min<int>(R, PV_ROWS)>(acc + r * D, S + r * CHUNK, pp + r * CHUNK / 2, alpha + r, cn,
                                                   [&](int t0) {
          const T* vb = v_tile(c0 + t0, std::min(L, cn - t0));
          return [=](int i, int c) { return vb + i * D * P + c * L * P; };
        });
      };
      const int n = std::min(PV_ROWS, rows - r);  // a short last block: exact rows up to 4, else padded
      if (n < PV_ROWS && n <= 4) with_rows(n, pv);
      else pv(std::integral_constant<int, PV_ROWS>{});
    }
  }

  for (int r = 0; r < rows; ++r) {
    float* ar = acc + r * D;
    if constexpr (F != Fmt::plain) hadamard(ar, D);  // rotated values back (linear: before split-K's merge too)
    if (it.part >= 0) {  // split-K: keep the unnormalised state for the merge
      float* pa = a.part_acc + (int64_t(it.part) * G + r) * D;
      std::memcpy(pa, ar, sizeof(float) * D);
      a.part_ml[(int64_t(it.part) * G + r) * 2] = m[r];
      a.part_ml[(int64_t(it.part) * G + r) * 2 + 1] = l[r];
      continue;
    }
    T* dst = a.out + (a.q_start[it.seq] + it.t0 + r / G) * a.o_tok + (it.kvh * G + r % G) * a.o_head;
    const float den = l[r] + (a.sinks ? std::exp2(a.sinks[it.kvh * G + r % G] - m[r]) : 0.f);
    const float inv = l[r] > 0.f ? 1.f / den : 0.f;  // no visible key (context 0): output 0
    for (int c = 0; c < NC; ++c) store16(dst + c * L, loadf(ar + c * L) * inv);
  }
}

// Merge the split-K parts of one (sequence, KV head): parts [p0, p0 + np).
template <typename T, int NC>
void merge_parts(int seq, int kvh, int p0, int np, const Args<T>& a) {
  constexpr int D = NC * L;
  const int G = a.group;
  for (int g = 0; g < G; ++g) {
    float mx = NEG_INF;
    for (int p = 0; p < np; ++p) mx = std::max(mx, a.part_ml[((int64_t)(p0 + p) * G + g) * 2]);
    vf o[NC] = {};
    float den = 0.f;
    for (int p = 0; p < np; ++p) {
      const float* ml = a.part_ml + ((int64_t)(p0 + p) * G + g) * 2;
      if (ml[1] == 0.f) continue;
      const float w = std::exp2(ml[0] - mx);
      den += w * ml[1];
      const float* pa = a.part_acc + ((int64_t)(p0 + p) * G + g) * D;
      for (int c = 0; c < NC; ++c) o[c] += loadf(pa + c * L) * w;
    }
    const float inv = den > 0.f ? 1.f / (den + (a.sinks ? std::exp2(a.sinks[kvh * G + g] - mx) : 0.f)) : 0.f;
    T* dst = a.out + a.q_start[seq] * a.o_tok + (kvh * G + g) * a.o_head;
    for (int c = 0; c < NC; ++c) store16(dst + c * L, o[c] * inv);
  }
}

struct Split { int32_t seq, kvh, p0, np; };

// Cut the step into items. Prefill chunks: tiles of query tokens. Decodes: one item per
// (sequence, KV head), or several key ranges when there are too few items to keep
// every thread busy (one long sequence decoding alone).
std::vector<Item> plan(const int32_t* ctx_lens, const int32_t* q_start, int num_seqs, int kv_heads, int group,
                       int threads, bool split_k, int window, std::vector<Split>& splits, int& num_parts) {
  // A window: a decode reads its last `window` keys, from a whole tile.
  auto first_key = [&](int ctx) { return window > 0 ? std::max(0, ctx - window) / L * L : 0; };
  std::vector<Item> items;
  const int tile = std::max(1, MAX_ROWS / group);
  int64_t decode_keys = 0;
  int64_t n_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    if (q_len == 1) decode_keys += ctx_lens[s] - first_key(ctx_lens[s]);
    n_items += (q_len + tile - 1) / tile;
  }
  n_items *= kv_heads;
  // Parts of at least 256 keys (merging costs more than it saves below that).
  int64_t part_len = std::numeric_limits<int32_t>::max();
  if (split_k && n_items < 4 * threads && decode_keys > 0)
    part_len = std::max<int64_t>(256, (decode_keys * kv_heads + 4 * threads - 1) / (4 * threads));
  num_parts = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    const int ctx = ctx_lens[s];
    if (q_len <= 0) continue;
    const int k0 = q_len == 1 ? first_key(ctx) : 0;
    if (q_len == 1 && ctx - k0 > part_len) {
      const int np = int((ctx - k0 + part_len - 1) / part_len);
      const int step = ((ctx - k0 + np - 1) / np + L - 1) / L * L;  // whole tiles: parts start on a tile
      for (int h = 0; h < kv_heads; ++h) {
        splits.push_back({s, h, num_parts, np});
        for (int p = 0; p < np; ++p) {
          const int lo = k0 + p * step, hi = std::min(ctx, lo + step);
          items.push_back({s, h, 0, 1, lo, hi, num_parts++, int64_t(hi - lo) * group});
        }
      }
      continue;
    }
    for (int t0 = 0; t0 < q_len; t0 += tile) {
      const int t1 = std::min(q_len, t0 + tile);
      const int64_t keys = std::min<int64_t>(ctx - q_len + t1, window > 0 ? window + t1 - t0 : ctx);
      for (int h = 0; h < kv_heads; ++h)
        items.push_back({s, h, t0, t1, 0, ctx, -1, keys * (t1 - t0) * group + keys});
    }
  }
  // Longest first: dynamic scheduling then ends with small items to even out the threads.
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <typename T, int NC, Fmt F>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& tables, const at::Tensor& ctx_lens, const at::Tensor& q_start, double scale, bool split_k,
         int64_t block_size, int window, int plan_threads, const float* sinks) {
  const int num_seqs = int(ctx_lens.size(0));
  const int kv_heads = int(k_cache.size(1));
  const int group = int(q.size(1) / kv_heads);
  // The split-K plan (and so the sums' order) for plan_threads, not for however many run now:
  // a thread governor that drops a thread under load then changes no result. The items still
  // run on the threads of the moment.
  const int threads = at::get_num_threads();
  const int planned = plan_threads > 0 ? plan_threads : threads;
  std::vector<Split> splits;
  int num_parts = 0;
  std::vector<Item> items = plan(ctx_lens.data_ptr<int32_t>(), q_start.data_ptr<int32_t>(), num_seqs, kv_heads,
                                 group, planned, split_k, window, splits, num_parts);
  std::vector<float> part_acc(size_t(num_parts) * group * NC * L), part_ml(size_t(num_parts) * group * 2);
  constexpr bool quant = F != Fmt::plain;
  Args<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1),
            out.data_ptr<T>(), out.stride(0), out.stride(1),
            quant ? nullptr : k_cache.data_ptr<T>(), k_cache.stride(0), k_cache.stride(1),
            quant ? nullptr : v_cache.data_ptr<T>(), v_cache.stride(0), v_cache.stride(1),
            tables.data_ptr<int32_t>(), tables.stride(0),
            ctx_lens.data_ptr<int32_t>(), q_start.data_ptr<int32_t>(),
            int(block_size), group, float(scale) * LOG2E,
            part_acc.data(), part_ml.data(), window,
            quant ? k_cache.data_ptr<uint8_t>() : nullptr, quant ? v_cache.data_ptr<uint8_t>() : nullptr,
            quant ? code_bytes(BITS<F>, block_size, NC * L) : 0,
            quant ? v_code_bytes(int64_t(F), block_size, NC * L) : 0, sinks};
  // Rows past the last sequence pad the step to a bucketed size (slot -1, no sequence):
  // give them zeros rather than whatever the allocator left there.
  const int64_t used = q_start.data_ptr<int32_t>()[num_seqs];
  for (int64_t r = used; r < out.size(0); ++r)
    for (int64_t h = 0; h < out.size(1); ++h) std::memset(out.data_ptr<T>() + r * out.stride(0) + h * out.stride(1), 0, sizeof(T) * out.size(2));
  const int64_t n = int64_t(items.size());
  if (threads <= 1 || n <= 1) {
    Scratch sc;
    for (const Item& it : items) run_item<T, NC, F>(it, a, sc);
    for (const Split& sp : splits) merge_parts<T, NC>(sp.seq, sp.kvh, sp.p0, sp.np, a);
    return;
  }
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads)
  {
    Scratch sc;
    // Items go to whichever thread is free, longest first; a thread takes its next item before
    // it runs the current one, so that the next one's keys are on their way meanwhile.
    int64_t i = taken.fetch_add(1);
    while (i < n) {
      const int64_t next = taken.fetch_add(1);
      if (next < n && kv_prefetch()) prefetch_item<T, F>(items[next], a);
      run_item<T, NC, F>(items[i], a, sc);
      i = next;
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < int64_t(splits.size()); ++i)
      merge_parts<T, NC>(splits[i].seq, splits[i].kvh, splits[i].p0, splits[i].np, a);
  }
}

// The head dims the kernel is compiled for: f(integral_constant NC), NC = head_dim / 16.
// -DPAGEDLLM_HEAD_DIMS=64,128 compiles a subset (each dim is 15 instantiations of the kernel and
// most of this file's compile time): the test suite's second, AVX2-only copy needs one.
#ifdef PAGEDLLM_HEAD_DIMS
constexpr int kHeadDims[] = {PAGEDLLM_HEAD_DIMS};
#else
constexpr int kHeadDims[] = {16, 32, 64, 80, 96, 128, 256};
#endif

constexpr bool compiled_dim(int d) {
  for (int x : kHeadDims)
    if (x == d) return true;
  return false;
}

template <int D, typename Fn>
bool dispatch_dim(int64_t d, Fn& f) {
  if constexpr (compiled_dim(D)) {
    if (d == D) {
      f(std::integral_constant<int, D / 16>{});
      return true;
    }
  }
  return false;
}

template <typename Fn>
void with_dim(int64_t d, const char* op, Fn f) {
  if (dispatch_dim<16>(d, f) || dispatch_dim<32>(d, f) || dispatch_dim<64>(d, f) || dispatch_dim<80>(d, f) ||
      dispatch_dim<96>(d, f) || dispatch_dim<128>(d, f) || dispatch_dim<256>(d, f))
    return;
  std::string dims;
  for (int x : kHeadDims) dims += (dims.empty() ? "" : ", ") + std::to_string(x);
  TORCH_CHECK(false, op, ": head_dim ", d, " is not supported (", dims, " are)");
}

// The pool format the kernels are compiled for: f(integral_constant Fmt).
template <typename Fn>
void with_fmt(int64_t fmt, const char* op, Fn f) {
  switch (Fmt(fmt)) {
    case Fmt::plain: return f(std::integral_constant<Fmt, Fmt::plain>{});
    case Fmt::i8: return f(std::integral_constant<Fmt, Fmt::i8>{});
    case Fmt::e4m3: return f(std::integral_constant<Fmt, Fmt::e4m3>{});
    case Fmt::e5m2: return f(std::integral_constant<Fmt, Fmt::e5m2>{});
    case Fmt::i4: return f(std::integral_constant<Fmt, Fmt::i4>{});
  }
  TORCH_CHECK(false, op, ": kv format ", fmt, " is unknown (0 plain, 1 int8, 2 fp8_e4m3, 3 fp8_e5m2, 4 int4)");
}

int bits_of(int64_t fmt) { return Fmt(fmt) == Fmt::i4 ? 4 : 8; }

// The caches' block size. Plain caches, in the layout above: K [num_blocks, KVH, D / P, B, P],
// V [num_blocks, KVH, ceil(B / P), D, P]. Quantized: uint8 K and V [num_blocks, KVH, row]
// with row = B * (D * bits / 8 + 2) (kv_quant.h).
int64_t check_caches(const at::Tensor& k, const at::Tensor& v, int64_t d, int64_t fmt) {
  if (fmt != 0) {
    const int bits = bits_of(fmt);
    const int64_t per_key = k_row_bytes(fmt, 1, d), B = k.dim() == 3 ? k.size(2) / per_key : 0;
    TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() &&
                    k.scalar_type() == at::kByte && v.scalar_type() == at::kByte && k.size(0) == v.size(0) &&
                    k.size(1) == v.size(1) && B > 0 && v.size(2) == v_row_bytes(fmt, B, d) &&
                    k.size(2) == k_row_bytes(fmt, B, d) && (bits == 8 ? d % 4 == 0 : d % 32 == 0),
                "cpu attention: quantized caches must be contiguous uint8 K [num_blocks, KVH, block_size * "
                "(head_dim * bits / 8 + scale bytes)] and V alike (int4: head_dim a multiple of 32)");
    return B;
  }
  const int64_t P = k.element_size() == 2 ? 2 : 1;
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.is_contiguous() && v.is_contiguous() &&
                  k.scalar_type() == v.scalar_type() && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) * P == d && k.size(4) == P && v.size(2) == (k.size(3) + P - 1) / P && v.size(3) == d &&
                  v.size(4) == P,
              "cpu attention: caches must be contiguous K [num_blocks, KVH, D/P, B, P] and "
              "V [num_blocks, KVH, ceil(B/P), D, P] (P = 2 for 16-bit types, 1 for fp32)");
  return k.size(3);
}

// out/q [T, H, D]; caches as check_caches says; tables int32 [S, W]; ctx_lens int32 [S] (keys of each sequence after this step's
// tokens); q_start int32 [S + 1] (rows of each sequence's queries). split_k false: no
// decode is split across threads, so every row's result is independent of the batch.
// plan_threads > 0: long decodes are split as for that many threads, whatever the current count.
// kv_fmt: the caches' format (kv_quant.h). window > 0: sliding-window attention; table
// entries of blocks wholly below every query's window are not read (they may be -1).
// sinks [H]: attention sinks (gpt-oss), a logit per query head in each row's softmax.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& ctx_lens, const at::Tensor& q_start, double scale,
                     bool split_k, int64_t kv_fmt, int64_t window, int64_t plan_threads,
                     const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: q and out must be [T, H, D] alike");
  TORCH_CHECK(plan_threads >= 0 && plan_threads < 4096, "paged_attention: plan_threads must be in [0, 4096)");
  const int64_t B = check_caches(k_cache, v_cache, q.size(2), kv_fmt);
  TORCH_CHECK((kv_fmt != 0 || q.scalar_type() == k_cache.scalar_type()) && q.scalar_type() == out.scalar_type(),
              "paged_attention: q, out and (unquantized) caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: q and out must be contiguous in D");
  TORCH_CHECK(window >= 0 && window < (int64_t(1) << 30), "paged_attention: window must be >= 0");
  TORCH_CHECK(tables.scalar_type() == at::kInt && ctx_lens.scalar_type() == at::kInt &&
                  q_start.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1 &&
                  ctx_lens.is_contiguous() && q_start.is_contiguous(),
              "paged_attention: tables, ctx_lens and q_start must be contiguous int32");
  TORCH_CHECK(q_start.size(0) == ctx_lens.size(0) + 1 && tables.size(0) >= ctx_lens.size(0),
              "paged_attention: q_start must have one more entry than ctx_lens, tables a row per sequence");
  // Tables come from the KV manager, but a bad one would read outside the pool: check
  // every block a query can see.
  const int32_t* cl = ctx_lens.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int64_t W = tables.size(1), nb = k_cache.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[ctx_lens.size(0)] <= q.size(0), "paged_attention: q_start out of range");
  for (int64_t s = 0; s < ctx_lens.size(0); ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(q_len >= 0 && q_len <= cl[s] && cl[s] <= W * B, "paged_attention: sequence ", s, " has ", q_len,
                " queries and ", cl[s], " keys for a table of ", W, " blocks of ", B);
    const int32_t* row = tables.data_ptr<int32_t>() + s * tables.stride(0);
    const int64_t need = window > 0 ? std::max<int64_t>(0, cl[s] - q_len - window + 1) : 0;
    for (int64_t j = need / B; j < (cl[s] + B - 1) / B; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < nb, "paged_attention: block ", row[j], " is outside the pool of ", nb);
  }
  std::vector<float> sink_logits;   // base 2, as the kernel's scores are
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "paged_attention: sinks must be [H], one a query head");
    const at::Tensor s = sinks->to(at::kFloat).contiguous();
    for (int64_t h = 0; h < s.size(0); ++h) sink_logits.push_back(s.data_ptr<float>()[h] * LOG2E);
  }
  const float* sink2 = sink_logits.empty() ? nullptr : sink_logits.data();
  const int64_t d = q.size(2);
  with_dim(d, "paged_attention", [&](auto nc) {
    with_fmt(kv_fmt, "paged_attention", [&](auto f) {
      constexpr int NC = decltype(nc)::value;
      constexpr Fmt F = decltype(f)::value;
      switch (q.scalar_type()) {
        case at::kFloat:
          return run<float, NC, F>(out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k, B, int(window),
                                   int(plan_threads), sink2);
        case at::kBFloat16:
          return run<c10::BFloat16, NC, F>(out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k, B,
                                           int(window), int(plan_threads), sink2);
        case at::kHalf:
          if constexpr (F == Fmt::plain)
            return run<c10::Half, NC, F>(out, q, k_cache, v_cache, tables, ctx_lens, q_start, scale, split_k, B,
                                         int(window), int(plan_threads), sink2);
          [[fallthrough]];
        default: TORCH_CHECK(false, "paged_attention: dtype ", q.scalar_type(), " is not supported",
                             kv_fmt ? " with a quantized KV cache (float32 and bfloat16 are)" : "");
      }
    });
  });
}

template <typename T>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slots) {
  constexpr int64_t P = PAIR<T>;
  const int64_t n = k.size(0), kvh = k.size(1), d = k.size(2), B = k_cache.size(3);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const T *ks = k.data_ptr<T>(), *vs = v.data_ptr<T>();
  T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = sl[i];
      if (slot < 0) continue;  // padding row
      const int64_t blk = slot / B, pos = slot % B;
      for (int64_t h = 0; h < kvh; ++h) {
        const T* kr = ks + i * k.stride(0) + h * k.stride(1);
        const T* vr = vs + i * v.stride(0) + h * v.stride(1);
        T* kd = kc + k_cache.stride(0) * blk + k_cache.stride(1) * h + pos * P;
        T* vd = vc + v_cache.stride(0) * blk + v_cache.stride(1) * h + (pos / P) * d * P + pos % P;
        for (int64_t j = 0; j < d; ++j) {
          kd[(j / P) * B * P + j % P] = kr[j];
          vd[j * P] = vr[j];
        }
      }
    }
  });
}

// One token's head (d values) -> its bf16 scale and codes, quantized with that scale.
// One token's head (d values) -> rotated (kv_quant.h), its bf16 scale, and its codes.
template <Fmt F, typename T>
float quantize_row(const T* x, int64_t d, float* tmp, uint8_t* codes, bool is_key) {
  for (int64_t j = 0; j < d; ++j) tmp[j] = float(x[j]);
  hadamard(tmp, int(d));
  vf am{};
  for (int64_t j = 0; j < d; j += L) {
    const vf t = loadf(tmp + j);
    am = am > t ? am : t;
    am = am > -t ? am : -t;
  }
  const float amax = hmax(am);
  const float scale = amax > 0.f && std::isfinite(amax) ? round_up_bf16(amax / QMAX<F>) : 0.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t j = 0; j < d; j += L) {
    const vb c = __builtin_convertvector(encode16<F>(loadf(tmp + j), inv, is_key), vb);
    std::memcpy(codes + j, &c, L);
  }
  return scale;
}

// One key's head -> rotated, a bf16 scale and min per 32 dims (into the row's extras:
// scales [G][B], then mins [G][B]) and asymmetric int4 codes.
template <typename T>
void quantize_key_asym4(const T* x, int64_t d, int64_t B, int64_t pos, float* tmp, uint8_t* codes, uint8_t* extras) {
  for (int64_t j = 0; j < d; ++j) tmp[j] = float(x[j]);
  hadamard(tmp, int(d));
  const int64_t G = d / 32;
  for (int64_t grp = 0; grp < G; ++grp) {
    const float* y = tmp + grp * 32;
    float lo = y[0], hi = y[0];
    for (int j = 1; j < 32; ++j) { lo = std::min(lo, y[j]); hi = std::max(hi, y[j]); }
    const c10::BFloat16 mn(std::isfinite(lo) ? lo : 0.f);
    const float range = std::isfinite(hi - lo) ? hi - float(mn) : 0.f;
    const c10::BFloat16 sc(range > 0.f ? round_up_bf16(range / 15.f) : 0.f);
    const float inv = float(sc) > 0.f ? 1.f / float(sc) : 0.f;
    for (int j = 0; j < 32; j += L) {  // (x - min) / scale rounded, in [0, 15]
      vf c = round_even((loadf(y + j) - float(mn)) * inv);
      c = c > 15.f ? splat(15.f) : c;
      c = c > 0.f ? c : vf{};  // (NaN too)
      const vb b = __builtin_convertvector(__builtin_convertvector(c, vi), vb);
      std::memcpy(codes + grp * 32 + j, &b, L);
    }
    std::memcpy(extras + (grp * B + pos) * 2, &sc, 2);
    std::memcpy(extras + ((G + grp) * B + pos) * 2, &mn, 2);
  }
}

// Quantize each new token's K and V heads into their slots (kv_quant.h's layout).
template <Fmt F, typename T>
void write_kv_quant(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots, int64_t B) {
  constexpr int E = PER_LANE<F>, bits = BITS<F>;
  const int64_t n = k.size(0), kvh = k.size(1), d = k.size(2), cb = code_bytes(bits, B, d);
  const int64_t vcb = v_code_bytes(int64_t(F), B, d);
  const int64_t* sl = slots.data_ptr<int64_t>();
  uint8_t *kc = k_cache.data_ptr<uint8_t>(), *vc = v_cache.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> codes(d);
    std::vector<float> tmp(d);
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = sl[i];
      if (slot < 0) continue;  // padding row
      const int64_t blk = slot / B, pos = slot % B;
      for (int64_t h = 0; h < kvh; ++h) {
        uint8_t* kr = kc + k_cache.stride(0) * blk + k_cache.stride(1) * h;
        const T* kx = k.data_ptr<T>() + i * k.stride(0) + h * k.stride(1);
        if constexpr (K_ASYM<F>) quantize_key_asym4(kx, d, B, pos, tmp.data(), codes.data(), kr + cb);
        else {
          const c10::BFloat16 ks(quantize_row<F>(kx, d, tmp.data(), codes.data(), true));
          std::memcpy(kr + cb + pos * 2, &ks, 2);
        }
        for (int64_t g = 0; g < d / E; ++g) {  // lane g of key pos: dims gE..gE+E-1
          uint32_t lane = 0;
          for (int x = 0; x < E; ++x) lane |= uint32_t(codes[g * E + x]) << (bits * x);
          std::memcpy(kr + (g * B + pos) * 4, &lane, 4);
        }
        uint8_t* vr = vc + v_cache.stride(0) * blk + v_cache.stride(1) * h;
        const c10::BFloat16 vsc(
            quantize_row<F>(v.data_ptr<T>() + i * v.stride(0) + h * v.stride(1), d, tmp.data(), codes.data(), false));
        if constexpr (F == Fmt::i8) {  // pair row pos / 2, the key's byte of each dim's pair
          uint8_t* row = vr + (pos / 2) * d * 2 + pos % 2;
          for (int64_t x = 0; x < d; ++x) row[x * 2] = codes[x];
        } else if constexpr (F == Fmt::i4) {  // likewise, a byte holding dims x and x + D/2
          uint8_t* row = vr + (pos / 2) * d + pos % 2;
          for (int64_t x = 0; x < d / 2; ++x) row[x * 2] = uint8_t(codes[x] | (codes[x + d / 2] << 4));
        } else {
          std::memcpy(vr + pos * d, codes.data(), d);
        }
        std::memcpy(vr + vcb + pos * 2, &vsc, 2);
      }
    }
  });
}

// New tokens' K/V into their slots (slot -1: skip). k/v [T, KVH, D]; kv_fmt as paged_attention's.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots, int64_t kv_fmt) {
  const int64_t B = check_caches(k_cache, v_cache, k.size(2), kv_fmt);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.stride(2) == 1 &&
                  v.stride(2) == 1 && k.scalar_type() == v.scalar_type() &&
                  (kv_fmt != 0 || k.scalar_type() == k_cache.scalar_type()),
              "write_kv: k and v must be [T, KVH, D] alike, in the caches' dtype unless quantized");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
                  slots.is_contiguous(),
              "write_kv: slots must be int64 [T]");
  const int64_t num_slots = k_cache.size(0) * B;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < k.size(0); ++i)
    TORCH_CHECK(sl[i] < num_slots, "write_kv: slot ", sl[i], " is outside the pool of ", num_slots);
  with_fmt(kv_fmt, "write_kv", [&](auto f) {
    constexpr Fmt F = decltype(f)::value;
    switch (k.scalar_type()) {
      case at::kFloat:
        if constexpr (F == Fmt::plain) return write_kv_impl<float>(k, v, k_cache, v_cache, slots);
        else return write_kv_quant<F, float>(k, v, k_cache, v_cache, slots, B);
      case at::kBFloat16:
        if constexpr (F == Fmt::plain) return write_kv_impl<c10::BFloat16>(k, v, k_cache, v_cache, slots);
        else return write_kv_quant<F, c10::BFloat16>(k, v, k_cache, v_cache, slots, B);
      case at::kHalf:
        if constexpr (F == Fmt::plain) return write_kv_impl<c10::Half>(k, v, k_cache, v_cache, slots);
        else return write_kv_quant<F, c10::Half>(k, v, k_cache, v_cache, slots, B);
      default: TORCH_CHECK(false, "write_kv: dtype ", k.scalar_type(), " is not supported");
    }
  });
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor ctx_lens, Tensor q_start, float scale, bool split_k=True, int kv_fmt=0, int window=0, "
        "int plan_threads=0, Tensor? sinks=None) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int kv_fmt=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention", &pagedllm::paged_attention);
  m.impl("write_kv", &pagedllm::write_kv);
}
