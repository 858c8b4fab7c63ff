// bf16 matmuls on weights packed once into panels for AVX512-BF16's pair dot products
// (vdpbf16ps: 32 products an instruction, each exact in fp32, summed in fp32). Used by the
// dense linear layers (panel_linear.cpp), a greedy LM head's argmax (gemm_argmax: the tokens
// without the logits) and a mixture's bf16 experts (moe.cpp).
//
// Layout (models/prepack.py to_panels): W [N, K] as [ceil(N / 32)][K / 2][32][2], N padded with
// zero columns to a multiple of 32. A panel is 32 output columns; its K pairs follow one another,
// each pair of the 32 columns two 64-byte vectors, so a panel is one sequential stream (one
// stream per panel read ~1.3x faster than two 16-column slabs at a decode step's 8-32 rows).
//
// A tile is R <= 14 rows of x by one panel: 28 fp32 accumulators of the 32 zmm registers. Each
// k pair loads the panel's two vectors once and adds a broadcast pair of every row times them:
// an outer product, no horizontal sums, the weights read once per tile of rows. At a decode step's
// few rows that streams the weights at memory speed; at hundreds of rows the panel stays in L2
// while the tiles of rows run over it, near the bf16 peak. A row's sums run over k in the same
// order whatever the other rows, the tile or the thread: the result of a row does not depend on
// the batch (batch-invariant by construction).
//
// Measured against oneDNN on reordered weights (torch.ops.mkldnn._linear_pointwise), SmolLM2-135M's
// 121 matmuls of a step from memory, 2-core Zen 4: 1.67x at one row (at the machine's read
// bandwidth), 1.5x at 20, 1.3x at 32, 1.1x at 96 (BENCHMARKS.md §42).
#pragma once

#ifdef __AVX512BF16__
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedllm {
namespace panels {

constexpr int64_t COLS = 32;      // output columns of a panel
constexpr int ROWS = 14;          // rows of x of a tile
constexpr int64_t AHEAD = 16;     // k pairs the tile prefetches ahead (2 KB of the panel)
// At a decode's few rows (one tile a panel, each panel read once from memory, little work a line)
// the tile leaves the fetching to the hardware's stream prefetcher: AHEAD's T0 prefetches on top of
// it cost 10-30 % of the read rate at 1-4 rows (2-core Zen 4; a mixture's experts at a decode step,
// 1-3 rows each, 1.1-1.3x without). From ~6 rows the prefetches pay (0.6-0.9x without).
constexpr int STREAM_ROWS = 4;
constexpr int64_t ROW_CHUNK = 256;  // rows a sweep over the panels takes (x's chunk stays in L2 / L3)

// The fp32 sums of x[r] . panel for r < R, handed to sink(r, sums of columns 0-15, 16-31); x's
// pair kp of row r at xp + kp * s_kp + r * s_r (elements: packed by pack_rows, s_kp = 2 * ROWS
// and s_r = 2; or in place, s_kp = 2 and s_r = the row stride).
template <int R, bool STREAM, typename Sink>
inline void tile(const c10::BFloat16* xp, int64_t s_kp, int64_t s_r, const c10::BFloat16* panel, int64_t k2,
                 Sink& sink) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const char* p = reinterpret_cast<const char*>(panel);
  for (int64_t kp = 0; kp < k2; ++kp) {
    // past the panel's end these touch the next panel (or nothing: prefetches never fault)
    if constexpr (!STREAM) {
      _mm_prefetch(p + (kp + AHEAD) * 128, _MM_HINT_T0);
      _mm_prefetch(p + (kp + AHEAD) * 128 + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + kp * 128);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p + kp * 128 + 64);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xp + kp * s_kp + r * s_r, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) sink(r, acc[r][0], acc[r][1]);
}

// tile<rows>, rows in 1..R chosen at run time.
template <int R, bool STREAM, typename Sink>
inline void tile_of(int rows, const c10::BFloat16* xp, int64_t s_kp, int64_t s_r, const c10::BFloat16* panel,
                    int64_t k2, Sink& sink) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, STREAM>(xp, s_kp, s_r, panel, k2, sink);
    return tile_of<R - 1, STREAM>(rows, xp, s_kp, s_r, panel, k2, sink);
  }
}

// tile_of, without prefetches (STREAM) at STREAM_ROWS rows or fewer (rows <= STREAM_ROWS there).
template <typename Sink>
inline void tile_any(bool stream, int rows, const c10::BFloat16* xp, int64_t s_kp, int64_t s_r,
                     const c10::BFloat16* panel, int64_t k2, Sink& sink) {
  if (stream) return tile_of<STREAM_ROWS, true>(rows, xp, s_kp, s_r, panel, k2, sink);
  tile_of<ROWS, false>(rows, xp, s_kp, s_r, panel, k2, sink);
}

inline __mmask16 low_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

// fp32 sums to bf16, to nearest even, and back: the values a bf16 output holds, in fp32 lanes.
inline __m512 as_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// A tile's sink that writes out[r][0..n_valid) = sums (+ bias) rounded once to bf16 (ldo apart).
struct Store {
  c10::BFloat16* out;
  int64_t ldo;
  __mmask16 m0, m1;
  __m512 b0, b1;
  Store(c10::BFloat16* out, int64_t ldo, int64_t n_valid, const c10::BFloat16* bias)
      : out(out), ldo(ldo), m0(low_lanes(n_valid)), m1(low_lanes(n_valid - 16)),
        b0(_mm512_setzero_ps()), b1(_mm512_setzero_ps()) {
    if (bias != nullptr) {  // bf16 widened exactly: the bias is read where it lies, no fp32 copy a call
      b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, bias)), 16));
      b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, bias + 16)), 16));
    }
  }
  void operator()(int r, __m512 s0, __m512 s1) {
    _mm256_mask_storeu_epi16(out + r * ldo, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(s0, b0)));
    _mm256_mask_storeu_epi16(out + r * ldo + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(s1, b1)));
  }
};

// Whether a tile's rows, ldx elements apart, put more than half of an L1 set's 8 ways on one set
// (64 sets of 64-byte lines): rows 4 KB apart (K = 2048) all fall in one, and a tile of them ran
// at ~80 % of the peak where oneDNN ran ~97 % (blocking K to keep a panel's block in L1 changed
// nothing). Such rows are packed first; others are read in place (packing them cost ~6 % on
// SmolLM2's K = 576 and 1536).
inline bool rows_collide(int64_t ldx) {
  int per_set[64] = {}, worst = 0;
  for (int r = 0; r < ROWS; ++r) worst = std::max(worst, ++per_set[(r * ldx * 2 / 64) % 64]);
  return worst > 4;
}

// A tile's rows of x as its kernel reads them: pair kp of row r at dst[kp * ROWS + r], so the
// broadcasts of one k pair read one line.
inline void pack_rows(c10::BFloat16* dst, const c10::BFloat16* x, int64_t ldx, int rows, int64_t k2) {
  for (int r = 0; r < rows; ++r) {
    const c10::BFloat16* row = x + r * ldx;
    for (int64_t kp = 0; kp < k2; ++kp) std::memcpy(dst + 2 * (kp * ROWS + r), row + 2 * kp, 4);
  }
}

// Every tile of x [m, k] (ldx apart, k even) over every panel of W (n columns): panel_at(p) gives
// panel p in the panels' layout (W's own, or one unpacked from quantized blocks into the thread's
// scratch, valid until that thread's next call), sink_at(row0, p, n_valid) makes the sink of rows
// row0.. over panel p. Rows go in chunks of ROW_CHUNK, packed once a chunk; panels are spread over
// the threads (`grain` panels at least a thread), every tile of the chunk's rows over a panel
// before the next. Inside a parallel region (a decode step's experts) it runs inline on the
// caller's thread.
template <typename PanelAt, typename SinkAt>
inline void sweep_panels(const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t n, int64_t k, int64_t grain,
                         const PanelAt& panel_at, const SinkAt& sink_at, int64_t row_chunk = ROW_CHUNK) {
  const int64_t k2 = k / 2, np = (n + COLS - 1) / COLS;
  const bool pack = m > ROWS / 2 && rows_collide(ldx);
  const bool stream = m <= STREAM_ROWS;   // then rows <= m: tile_any's STREAM tiles cover them
  // the caller's thread's buffer, kept between calls (a fresh one of ~100 KB+ is an mmap, its
  // pages faulted in every call)
  thread_local std::vector<c10::BFloat16> packed;
  if (pack) packed.resize(std::max<size_t>(packed.size(), ((std::min(m, row_chunk) + ROWS - 1) / ROWS) * k * ROWS));
  c10::BFloat16* xp = packed.data();
  for (int64_t c0 = 0; c0 < m; c0 += row_chunk) {
    const int64_t c1 = std::min(m, c0 + row_chunk), tiles = (c1 - c0 + ROWS - 1) / ROWS;
    if (pack) {
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          pack_rows(xp + t * k * ROWS, x + (c0 + t * ROWS) * ldx, ldx, int(std::min<int64_t>(ROWS, c1 - c0 - t * ROWS)),
                    k2);
      });
    }
    at::parallel_for(0, np, grain, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n_valid = std::min(COLS, n - p * COLS);
        const c10::BFloat16* w = panel_at(p);
        for (int64_t t = 0; t < tiles; ++t) {
          const int rows = int(std::min<int64_t>(ROWS, c1 - c0 - t * ROWS));
          auto sink = sink_at(c0 + t * ROWS, p, n_valid);
          if (pack)
            tile_any(stream, rows, xp + t * k * ROWS, 2 * ROWS, 2, w, k2, sink);
          else
            tile_any(stream, rows, x + (c0 + t * ROWS) * ldx, 2, ldx, w, k2, sink);
        }
      }
    });
  }
}

// sweep_panels over W packed whole in panels (models/prepack.py to_panels).
template <typename SinkAt>
inline void sweep(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t n, int64_t k,
                  int64_t grain, const SinkAt& sink_at) {
  const int64_t panel = k / 2 * COLS * 2;
  sweep_panels(x, ldx, m, n, k, grain, [=](int64_t p) { return w + p * panel; }, sink_at);
}

// out [m, n] (ldo apart) = x [m, k] (ldx apart, k even) . W^T (+ bias), W packed in panels.
inline void gemm(c10::BFloat16* out, int64_t ldo, const c10::BFloat16* x, int64_t ldx, int64_t m,
                 const c10::BFloat16* w, int64_t n, int64_t k, const c10::BFloat16* bias, int64_t grain = 1) {
  sweep(x, ldx, m, w, n, k, grain, [&](int64_t row0, int64_t p, int64_t n_valid) {
    return Store(out + row0 * ldo + p * COLS, ldo, n_valid, bias != nullptr ? bias + p * COLS : nullptr);
  });
}

// A tile's sink that keeps, for each of its rows, the panel's largest bf16-rounded value and its
// first column (a NaN counts as the largest, the first NaN wins: torch.max(dim)'s order), at
// best[(row0 + r) * np + p] and col[...]. Columns past n_valid (the panel's zero padding) are out.
struct PanelBest {
  float* best;
  int32_t* col;
  int64_t np;
  __mmask16 m0, m1;
  PanelBest(float* best, int32_t* col, int64_t np, int64_t n_valid)
      : best(best), col(col), np(np), m0(low_lanes(n_valid)), m1(low_lanes(n_valid - 16)) {}
  void operator()(int r, __m512 s0, __m512 s1) {
    const __m512 lo = _mm512_set1_ps(-INFINITY);
    const __m512 v0 = _mm512_mask_mov_ps(lo, m0, as_bf16(s0)), v1 = _mm512_mask_mov_ps(lo, m1, as_bf16(s1));
    const uint32_t nan = uint32_t(_mm512_mask_cmp_ps_mask(m0, v0, v0, _CMP_UNORD_Q)) |
                         uint32_t(_mm512_mask_cmp_ps_mask(m1, v1, v1, _CMP_UNORD_Q)) << 16;
    float top;
    uint32_t at;
    if (nan != 0) {
      top = NAN;
      at = nan;
    } else {
      top = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
      const __m512 t = _mm512_set1_ps(top);
      at = uint32_t(_mm512_cmp_ps_mask(v0, t, _CMP_EQ_OQ)) | uint32_t(_mm512_cmp_ps_mask(v1, t, _CMP_EQ_OQ)) << 16;
    }
    best[r * np] = top;
    col[r * np] = int32_t(__builtin_ctz(at));  // a row of -inf only: every lane equals, column 0
  }
};

// idx[r] = the first column of x[r] . W^T's largest value, rounded to bf16 as gemm's output would
// be (without a bias), which is what argmax over gemm's output gives, without writing m x n of it:
// each panel's best per row, then the panels in order, per row.
inline void gemm_argmax(int64_t* idx, const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w,
                        int64_t n, int64_t k) {
  const int64_t np = (n + COLS - 1) / COLS;
  thread_local std::vector<float> best_buf;   // kept between calls, as sweep's buffer
  thread_local std::vector<int32_t> col_buf;
  best_buf.resize(std::max<size_t>(best_buf.size(), m * np));
  col_buf.resize(std::max<size_t>(col_buf.size(), m * np));
  // pointers, not the names: inside the threads' lambdas a thread_local names that thread's own
  float* best = best_buf.data();
  int32_t* col = col_buf.data();
  sweep(x, ldx, m, w, n, k, 1, [=](int64_t row0, int64_t p, int64_t n_valid) {
    return PanelBest(best + row0 * np + p, col + row0 * np + p, np, n_valid);
  });
  at::parallel_for(0, m, 1, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* b = best + r * np;
      int64_t p_best = 0;
      for (int64_t p = 1; p < np; ++p) {
        const float v = b[p], top = b[p_best];
        if (top != top) break;                      // a NaN: nothing later wins
        if (v > top || v != v) p_best = p;          // strictly larger, or the first NaN
      }
      idx[r] = p_best * COLS + col[r * np + p_best];
    }
  });
}

}  // namespace panels
}  // namespace pagedllm
#endif
