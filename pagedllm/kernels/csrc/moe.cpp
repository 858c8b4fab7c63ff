// A mixture of experts' layer (models/moe.py) in one call: each row's top-k experts (chosen by the
// router, with their weights) run over the rows that chose them, and every row gets the weighted sum
// of its experts' outputs.
//
//   1. group: count each expert's (row, slot) pairs and lay them out expert by expert;
//   2. for each expert some row chose (in C++; an expert no row chose costs nothing): gather its
//      rows, h = x_e W13_e^T (gate over up), a = act(gate) * up, y_e = a W2_e^T, into one
//      workspace of the step (no tensor allocated per expert);
//   3. combine: out[row] = sum over its k slots of weight * y[slot's place], in fp32, rounded once.
//
// bf16 experts packed at load in panels (bf16_panels.h) run one vdpbf16ps kernel at every row count; other float
// experts' matmuls are ATen's (oneDNN), or small_mm at a few rows; quantized experts
// (moe_experts_blocks: q8_0, q4_1, GGUF's K-quants...) run quant_linear.cpp's block kernels
// on each expert's blocks in place (blocks.h), one expert's weights never unpacked whole.
// A decode step gives most experts 0-2 rows: then the experts are
// spread over the threads, each matmul single-threaded; a prefill's experts have many rows each,
// and each matmul takes every thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "bf16_panels.h"
#include "blocks.h"
#include "vec.h"

namespace pagedllm {
namespace {

// Few rows an expert on average: the experts, not a matmul's rows, are spread over the threads.
constexpr int64_t FEW_ROWS = 16;
// An expert of at most this many rows runs in small_mm (its weights read once, at memory speed)
// instead of a oneDNN call (measured ~14 GB/s of weights at a decode step's 4 rows an expert).
constexpr int SMALL = 8;

// y[m, j] = xf[m, :] . w[j, :] for m < rows (<= SMALL): each weight row read once for all rows;
// xf the rows in fp32 (converted once, they stay in L1).
template <class T>
void small_mm(T* y, const float* xf, const T* w, int rows, int64_t n, int64_t k) {
  for (int64_t j = 0; j < n; ++j) {
    const T* wr = w + j * k;
    vf acc[SMALL] = {};
    int64_t i = 0;
    for (; i + L <= k; i += L) {
      const vf wv = load16(wr + i);
      for (int m = 0; m < rows; ++m) acc[m] += wv * loadf(xf + m * k + i);
    }
    for (int m = 0; m < rows; ++m) {
      float sum = hsum(acc[m]);
      for (int64_t t = i; t < k; ++t) sum += float(wr[t]) * xf[m * k + t];
      y[m * n + j] = T(sum);
    }
  }
}

#ifdef __AVX512BF16__
// The same on bf16 rows with AVX512-BF16's pair dot products (vdpbf16ps: 32 products an
// instruction, each exact in fp32, summed in fp32): half the instructions of small_mm, whose
// loads of fp32 rows bound it at a decode step's 4-8 rows an expert.
void small_mm_bf16(c10::BFloat16* y, const c10::BFloat16* x, const c10::BFloat16* w, int rows, int64_t n,
                   int64_t k) {
  for (int64_t j = 0; j < n; ++j) {
    const c10::BFloat16* wr = w + j * k;
    __m512 acc[SMALL];
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + i);
      for (int m = 0; m < rows; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * k + i));
    }
    for (int m = 0; m < rows; ++m) {
      float sum = _mm512_reduce_add_ps(acc[m]);
      for (int64_t t = i; t < k; ++t) sum += float(wr[t]) * float(x[m * k + t]);
      y[m * n + j] = c10::BFloat16(sum);
    }
  }
}
#endif

// W8A8 experts packed for vpdpbusd hold W [N, K] as slabs of 16 output columns, each slab's K one
// vector of the 16 columns' quads after another; a tile is at most MR rows of x by 2 slabs (32
// columns): 16 accumulators of the 32 zmm registers. (bf16 experts are packed in panels: bf16_panels.h.)
constexpr int64_t SLAB = 16;
constexpr int MR = 8;

// f(std::integral_constant<int, rows>) for rows 1..8: a tile's row count as a compile-time constant.
template <class F>
inline void by_rows(int rows, const F& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// out [m, n] tile by tile for packed weights: tile(R, NV, m0, n0, res) sums R rows (from m0) against
// NV slabs (from column n0) into res, store(rows, nv, m0, n0, res) writes them out. Blocks of 32
// columns (64 KB of bf16 weights at k = 1024: they stay in L2 while every tile of rows runs over
// them) are spread over the threads; inside a parallel region (a decode step's experts) it runs inline.
template <class Acc, class Tile, class Store>
void over_tiles(int64_t m, int64_t n, const Tile& tile, const Store& store) {
  const int64_t blocks = (n + 2 * SLAB - 1) / (2 * SLAB);
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(1, (m + MR - 1) / MR));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    Acc res[MR * 2 * SLAB];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 2 * SLAB;
      const int nv = n - n0 >= 2 * SLAB ? 2 : 1;
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int rows = int(std::min<int64_t>(MR, m - m0));
        by_rows(rows, [&](auto r) {
          if (nv == 2)
            tile(r, std::integral_constant<int, 2>{}, m0, n0, res);
          else
            tile(r, std::integral_constant<int, 1>{}, m0, n0, res);
        });
        store(rows, nv, m0, n0, res);
      }
    }
  });
}


#ifdef __AVX512VNNI__
// W8A8 experts (models/moe.py set_w8a8): int8 weights with a scale per output channel, packed once
// for VNNI as [N/16][K/4][16][4] (16 columns' 4 consecutive codes a 64-byte vector), and int8
// activations with a scale per row, computed here per expert's rows (a row's result never
// depends on the rows beside it). vpdpbusd multiplies unsigned codes by signed ones, so x goes as
// its codes plus 128 and each column's 128 * sum(w) comes off the int32 sum:
//   y[m, n] = sx[m] * sw[n] * (sum_k (xq[m, k] + 128) w[n, k] - 128 * colsum[n]).
// Integer sums are exact whatever their order; the weights are half of bf16's bytes.
constexpr int32_t W8_ZERO = 128;

// rows of x as uint8 codes (int8 + 128) and fp32 scales: s = max|row| / 127, to nearest even
// (models/w8a8.py's quantize_rows: the same two roundings).
template <class T>
void codes_rows(uint8_t* q, float* s, const T* x, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / k), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * k;
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += L) m = _mm512_max_ps(m, _mm512_abs_ps((__m512)load16(xr + i)));
      const float scale = _mm512_reduce_max_ps(m) / 127.f;
      const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      s[r] = scale;
      for (int64_t i = 0; i < k; i += L) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps((__m512)load16(xr + i), inv));
        c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + i),
                         _mm512_cvtepi32_epi8(_mm512_add_epi32(c, _mm512_set1_epi32(W8_ZERO))));
      }
    }
  });
}

template <int R, int NV>
inline void w8_tile(const uint8_t* xq, int64_t ldx, const int8_t* wp, int64_t slab, int64_t k, int32_t* res) {
  __m512i acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < k / 4; ++kk) {
    __m512i w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wp + v * slab + kk * 4 * SLAB);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq + r * ldx + 4 * kk, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xb, w[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_si512(res + (r * NV + v) * SLAB, acc[r][v]);
}

// out [m, n] (ldo apart) from m rows of codes xq (k apart) and their scales sx, against W8A8
// weights packed (wp), their scales ws and column sums cs.
template <class T>
void w8_mm(T* out, int64_t ldo, const uint8_t* xq, const float* sx, int64_t m, const int8_t* wp, const float* ws,
           const int32_t* cs, int64_t n, int64_t k) {
  const int64_t slab = k * SLAB;
  over_tiles<int32_t>(
      m, n,
      [&](auto r, auto nv, int64_t m0, int64_t n0, int32_t* res) {
        w8_tile<decltype(r)::value, decltype(nv)::value>(xq + m0 * k, k, wp + (n0 / SLAB) * slab, slab, k, res);
      },
      [&](int rows, int nv, int64_t m0, int64_t n0, const int32_t* res) {
        for (int r = 0; r < rows; ++r)
          for (int64_t c = 0; c < nv * SLAB; ++c)
            out[(m0 + r) * ldo + n0 + c] =
                T(sx[m0 + r] * ws[n0 + c] * float(res[r * nv * SLAB + c] - W8_ZERO * cs[n0 + c]));
      });
}
#endif

template <class T>
void to_float(float* out, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = float(x[i]);
}

inline vf silu_v(vf a) { return a / (1.f + expv(-a)); }
inline vf gelu_tanh_v(vf a) { return a / (1.f + expv(-(a + 0.044715f * a * a * a) * 1.5957691216057308f)); }

// The experts' activation (models/moe.py activate) and gpt-oss's biases: gate|up plus its expert's
// b13 row, then act(gate) * up; the expert's output plus its b2 row.
enum ActKind : int64_t { GELU_TANH = 0, SILU = 1, SWIGLU_OAI = 2 };
struct Act {
  int64_t kind;
  float alpha, limit;       // SWIGLU_OAI: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
  const void* b13;          // [E, 2I] in x's dtype, or null
  const void* b2;           // [E, H] in x's dtype, or null
};

inline vf act_v(const Act& act, vf g, vf u) {
  if (act.kind == SILU) return silu_v(g) * u;
  if (act.kind == GELU_TANH) return gelu_tanh_v(g) * u;
  const vf lim = splat(act.limit), neg = splat(-act.limit);
  g = g > lim ? lim : g;
  u = u > lim ? lim : (u < neg ? neg : u);
  return (u + 1.f) * g / (1.f + expv(-g * act.alpha));
}
inline float act_1(const Act& act, float g, float u) {
  if (act.kind == SILU) return g / (1.f + std::exp(-g)) * u;
  if (act.kind == GELU_TANH) return g / (1.f + std::exp(-(g + 0.044715f * g * g * g) * 1.5957691216057308f)) * u;
  g = std::min(g, act.limit);
  u = std::clamp(u, -act.limit, act.limit);
  return (u + 1.f) * g / (1.f + std::exp(-g * act.alpha));
}

// a[r] = act(h[r, :n] (+ b), h[r, n:] (+ b)) for rows [r0, r1) of expert e
template <class T>
void act_rows(T* a, const T* h, int64_t r0, int64_t r1, int64_t n, const Act& act, int64_t e) {
  const T* b = act.b13 ? static_cast<const T*>(act.b13) + e * 2 * n : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = h + r * 2 * n;
    T* o = a + r * n;
    int64_t i = 0;
    for (; i + L <= n; i += L) {
      vf x = load16(g + i), u = load16(g + n + i);
      if (b) x += load16(b + i), u += load16(b + n + i);
      store16(o + i, act_v(act, x, u));
    }
    for (; i < n; ++i)
      o[i] = T(act_1(act, float(g[i]) + (b ? float(b[i]) : 0.f), float(g[n + i]) + (b ? float(b[n + i]) : 0.f)));
  }
}

// act_rows over places [start, start + n) on every thread: a prefill's expert runs alone on the
// caller's thread between its matmuls; inside a parallel region (a decode step's experts) it runs inline.
template <class T>
void act_all(T* a, const T* h, int64_t start, int64_t n, int64_t width, const Act& act, int64_t e) {
  at::parallel_for(start, start + n, 16, [&](int64_t b, int64_t end) { act_rows<T>(a, h, b, end, width, act, e); });
}

// y's rows [start, start + n) plus expert e's down bias, where it has one.
template <class T>
void add_b2(T* y, int64_t start, int64_t n, int64_t hid, const Act& act, int64_t e) {
  if (!act.b2) return;
  const T* b = static_cast<const T*>(act.b2) + e * hid;
  for (int64_t r = start; r < start + n; ++r) {
    T* yr = y + r * hid;
    int64_t i = 0;
    for (; i + L <= hid; i += L) store16(yr + i, load16(yr + i) + load16(b + i));
    for (; i < hid; ++i) yr[i] = T(float(yr[i]) + float(b[i]));
  }
}

template <class T>
void run_expert(const at::Tensor& xs, at::Tensor& h, at::Tensor& a, at::Tensor& y, const at::Tensor& w13,
                const at::Tensor& w2, int64_t e, int64_t start, int64_t n, int64_t width, const Act& act,
                bool packed) {
  const int64_t hid = xs.size(1);
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (packed) {
      panels::gemm(h.data_ptr<T>() + start * 2 * width, 2 * width, xs.data_ptr<T>() + start * hid, hid, n,
                   w13.data_ptr<T>() + e * 2 * width * hid, 2 * width, hid, nullptr);
      act_all<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, n, width, act, e);
      panels::gemm(y.data_ptr<T>() + start * hid, hid, a.data_ptr<T>() + start * width, width, n,
                   w2.data_ptr<T>() + e * hid * width, hid, width, nullptr);
      add_b2<T>(y.data_ptr<T>(), start, n, hid, act, e);
      return;
    }
  }
#endif
  TORCH_CHECK(!packed, "moe_experts: packed weights need bf16 and a CPU with AVX512-BF16");
  if (n <= SMALL) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      T* hp = h.data_ptr<T>() + start * 2 * width;
      small_mm_bf16(hp, xs.data_ptr<T>() + start * hid, w13.data_ptr<T>() + e * 2 * width * hid, int(n), 2 * width,
                    hid);
      act_rows<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, start + n, width, act, e);
      small_mm_bf16(y.data_ptr<T>() + start * hid, a.data_ptr<T>() + start * width, w2.data_ptr<T>() + e * hid * width,
                    int(n), hid, width);
      add_b2<T>(y.data_ptr<T>(), start, n, hid, act, e);
      return;
    }
#endif
    std::vector<float> xf(n * std::max(hid, width));
    to_float(xf.data(), xs.data_ptr<T>() + start * hid, n * hid);
    T* hp = h.data_ptr<T>() + start * 2 * width;
    small_mm<T>(hp, xf.data(), w13.data_ptr<T>() + e * 2 * width * hid, int(n), 2 * width, hid);
    act_rows<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, start + n, width, act, e);
    to_float(xf.data(), a.data_ptr<T>() + start * width, n * width);
    small_mm<T>(y.data_ptr<T>() + start * hid, xf.data(), w2.data_ptr<T>() + e * hid * width, int(n), hid, width);
    add_b2<T>(y.data_ptr<T>(), start, n, hid, act, e);
    return;
  }
  auto he = h.narrow(0, start, n), ae = a.narrow(0, start, n), ye = y.narrow(0, start, n);
  at::mm_out(he, xs.narrow(0, start, n), w13[e].t());
  act_all<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, n, width, act, e);
  at::mm_out(ye, ae, w2[e].t());
  add_b2<T>(y.data_ptr<T>(), start, n, hid, act, e);
}

// A step's workspaces: x's rows gathered expert by expert (xs), each place's gate|up (h), its
// activation (a) and its expert's output (y).
struct Work {
  at::Tensor xs, h, a, y;
};

// Work for `places` rows, carved from one buffer of the calling thread kept between calls and
// grown to the largest step seen. A prefill's workspaces are hundreds of MB (DeepSeek-V2-Lite's
// widths, 2,048 tokens: 200 MB); fresh ones are mapped anew by malloc at every call, and faulting
// their pages in cost ~40 ms a layer, 7 % of the experts' own time.
Work workspace(int64_t places, int64_t hid, int64_t width, const at::TensorOptions& opts) {
  thread_local at::Tensor buffer;
  const int64_t row = hid + 2 * width + width + hid, bytes = places * row * int64_t(opts.dtype().itemsize());
  if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  const at::Tensor all = buffer.narrow(0, 0, bytes).view(opts.dtype().toScalarType());
  int64_t at_ = 0;
  auto take = [&](int64_t cols) {
    at::Tensor t = all.narrow(0, at_, places * cols).view({places, cols});
    at_ += places * cols;
    return t;
  };
  at::Tensor xs = take(hid), h = take(2 * width), a = take(width), y = take(hid);
  return {xs, h, a, y};
}

// out = the experts' weighted sum for each row; run(work, e, start, n) computes local expert e's y
// for places [start, start + n) from xs (float or block weights). The stacks hold experts
// first .. first + ne - 1 of the model's (expert parallelism: a rank's share); a slot naming
// another rank's expert adds nothing here (that rank adds it, and the all-reduce sums the two).
template <class T, class Run>
void moe(at::Tensor& out, const at::Tensor& x, int64_t ne, int64_t first, int64_t width, const at::Tensor& weights,
         const at::Tensor& experts, const Run& run) {
  const int64_t t = x.size(0), hid = x.size(1), k = experts.size(1);
  const int64_t* ex = experts.data_ptr<int64_t>();
  auto local = [&](int64_t i) { return ex[i] - first >= 0 && ex[i] - first < ne ? ex[i] - first : int64_t(-1); };
  std::vector<int64_t> count(ne + 1, 0), place(t * k), order(t * k);
  for (int64_t i = 0; i < t * k; ++i)
    if (local(i) >= 0) ++count[local(i) + 1];
  for (int64_t e = 0; e < ne; ++e) count[e + 1] += count[e];  // count[e]: expert e's first place
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < t * k; ++i) {
    const int64_t e = local(i);
    place[i] = e < 0 ? -1 : next[e]++;
    if (e >= 0) order[place[i]] = i / k;  // the row at each place
  }
  const int64_t places = count[ne];
  Work w = workspace(places, hid, width, x.options());
  const T* xp = x.data_ptr<T>();
  T* xsp = w.xs.data_ptr<T>();
  at::parallel_for(0, places, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) std::memcpy(xsp + p * hid, xp + order[p] * hid, hid * sizeof(T));
  });
  std::vector<int64_t> used;
  for (int64_t e = 0; e < ne; ++e)
    if (count[e + 1] > count[e]) used.push_back(e);
  if (!used.empty() && places / int64_t(used.size()) < FEW_ROWS) {
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, int64_t(used.size()), 1, [&](int64_t b, int64_t end) {
      c10::InferenceMode guard(inference);  // a worker thread does not inherit the caller's mode
      for (int64_t i = b; i < end; ++i) run(w, used[i], count[used[i]], count[used[i] + 1] - count[used[i]]);
    });
  } else {
    for (int64_t e : used) run(w, e, count[e], count[e + 1] - count[e]);
  }
  const float* wp = weights.data_ptr<float>();
  const T* yp = w.y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    std::vector<float> acc(hid);
    for (int64_t r = b; r < e; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        if (place[r * k + j] < 0) continue;  // another rank's expert
        const float wt = wp[r * k + j];
        const T* src = yp + place[r * k + j] * hid;
        int64_t i = 0;
        for (; i + L <= hid; i += L) storef(acc.data() + i, loadf(acc.data() + i) + splat(wt) * load16(src + i));
        for (; i < hid; ++i) acc[i] += wt * float(src[i]);
      }
      for (int64_t i = 0; i < hid; ++i) op[r * hid + i] = T(acc[i]);
    }
  });
}

// x [T, H] and out like it, contiguous, bf16 or fp32.
void check_rows(const char* op, const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x [T, H] and out like it, contiguous, bf16 or fp32");
}

// experts int64 [T, k] (ids in [0, total)) and weights float32 [T, k] for x's T rows; the stacks
// hold experts first .. first + ne - 1.
void check_routing(const char* op, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                   int64_t ne, int64_t first, int64_t total) {
  TORCH_CHECK(experts.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && experts.dim() == 2 &&
                  experts.sizes() == weights.sizes() && experts.size(0) == x.size(0) && experts.is_contiguous() &&
                  weights.is_contiguous(),
              op, ": experts int64 [T, k] and weights float32 [T, k]");
  TORCH_CHECK(first >= 0 && first + ne <= total, op, ": experts ", first, "..", first + ne - 1, " are not among the ",
              total);
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts.numel(); ++i)
    TORCH_CHECK(ex[i] >= 0 && ex[i] < total, op, ": expert ", ex[i], " is outside the ", total);
}

// One matmul's stacked blocks (models/moe.py: [q] raw bytes, [q, d] q8_0, [q, d, m] q4_1 pairs,
// each with the experts first): expert e's as a BlockWeight.
struct StackedBlocks {
  int64_t type, n, k;
  std::vector<at::Tensor> parts;
  BlockWeight of(int64_t e) const {
    auto at_e = [&](size_t i) -> const void* {
      if (i >= parts.size()) return nullptr;
      const at::Tensor& p = parts[i];
      return static_cast<const uint8_t*>(p.data_ptr()) + e * p.stride(0) * p.element_size();
    };
    return {type, at_e(0), static_cast<const c10::Half*>(at_e(1)), static_cast<const c10::Half*>(at_e(2)), n, k};
  }
};

StackedBlocks stacked(int64_t type, const std::vector<at::Tensor>& parts, int64_t ne, int64_t n, int64_t k,
                      const char* what) {
  const int64_t row = block_row_bytes(type, k);
  const bool raw = type != BLOCKS_Q8_0 && type != BLOCKS_Q4_1;
  const size_t want = raw ? 1 : type == BLOCKS_Q8_0 ? 2 : 3;
  TORCH_CHECK(parts.size() == want, "moe_experts_blocks: ", what, " of type ", type, " takes ", want, " tensors, got ",
              parts.size());
  TORCH_CHECK(parts[0].is_contiguous() && parts[0].size(0) == ne && parts[0].numel() * parts[0].element_size() ==
                  ne * n * row, "moe_experts_blocks: ", what, "'s blocks must be contiguous [E, ", n, ", ", row,
              " bytes] for E = ", ne, " and K = ", k);
  for (size_t i = 1; i < parts.size(); ++i)
    TORCH_CHECK(parts[i].is_contiguous() && parts[i].scalar_type() == at::kHalf && parts[i].numel() ==
                    ne * n * (type == BLOCKS_Q8_0 ? k / 32 : row / 16), "moe_experts_blocks: ", what,
                "'s scales must be contiguous fp16, one per block of each expert's rows");
  return {type, n, k, parts};
}

// The activation's kind and gpt-oss's biases (b13 [E, 2I], b2 [E, H], contiguous, in x's dtype).
Act make_act(const char* op, const at::Tensor& x, int64_t kind, int64_t ne, int64_t width,
             const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha, double limit) {
  TORCH_CHECK(kind >= GELU_TANH && kind <= SWIGLU_OAI, op, ": activation ", kind,
              " is unknown (0 gelu_tanh, 1 silu, 2 swiglu_oai)");
  auto check = [&](const c10::optional<at::Tensor>& b, int64_t n, const char* what) -> const void* {
    if (!b.has_value()) return nullptr;
    TORCH_CHECK(b->is_contiguous() && b->scalar_type() == x.scalar_type() && b->numel() == ne * n, op, ": ", what,
                " must be contiguous [", ne, ", ", n, "] in x's dtype");
    return b->data_ptr();
  };
  return {kind, float(alpha), float(limit), check(b13, 2 * width, "b13"), check(b2, x.size(1), "b2")};
}

}  // namespace

void moe_experts_blocks(at::Tensor out, const at::Tensor& x, int64_t type13, const std::vector<at::Tensor>& w13,
                        int64_t type2, const std::vector<at::Tensor>& w2, int64_t width, const at::Tensor& weights,
                        const at::Tensor& experts, int64_t act_kind, int64_t first, int64_t total,
                        const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha,
                        double limit) {
  check_rows("moe_experts_blocks", out, x);
  TORCH_CHECK(!w13.empty() && !w2.empty() && width > 0, "moe_experts_blocks: no blocks");
  const int64_t ne = w13[0].size(0), hid = x.size(1);
  const StackedBlocks g = stacked(type13, w13, ne, 2 * width, hid, "w13"), d = stacked(type2, w2, ne, hid, width, "w2");
  check_routing("moe_experts_blocks", x, weights, experts, ne, first, total);
  const Act act = make_act("moe_experts_blocks", x, act_kind, ne, width, b13, b2, alpha, limit);
  if (x.size(0) == 0) return;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    moe<T>(out, x, ne, first, width, weights, experts, [&](Work& w, int64_t e, int64_t start, int64_t n) {
      block_matmul(g.of(e), w.xs.data_ptr<T>() + start * hid, w.h.data_ptr<T>() + start * 2 * width, n, bf16);
      act_all<T>(w.a.data_ptr<T>(), w.h.data_ptr<T>(), start, n, width, act, e);
      block_matmul(d.of(e), w.a.data_ptr<T>() + start * width, w.y.data_ptr<T>() + start * hid, n, bf16);
      add_b2<T>(w.y.data_ptr<T>(), start, n, hid, act, e);
    });
  };
  if (bf16)
    run(c10::BFloat16());
  else
    run(float());
}

// Row r's softmax (fp32) and its top k, largest first, into weights / experts; renormalized to sum to
// 1 where asked. An exact tie at the k-th place goes to at::topk, so that which experts run on a tie
// is transformers' own choice (its torch.topk), not an order of our making.
template <class T>
void top_k_row(const T* logit, int64_t ne, int64_t k, bool renorm, float* wout, int64_t* eout) {
  std::vector<float> p(ne);
  for (int64_t i = 0; i < ne; ++i) p[i] = float(logit[i]);
  const float mx = *std::max_element(p.begin(), p.end());
  float sum = 0.f;
  for (auto& v : p) sum += (v = std::exp(v - mx));
  for (auto& v : p) v /= sum;
  std::vector<int64_t> idx(ne);
  for (int64_t i = 0; i < ne; ++i) idx[i] = i;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  bool tie = false;
  for (int64_t i = k; i < ne && !tie; ++i) tie = p[idx[i]] == p[idx[k - 1]];
  if (tie) {
    auto [v, e] = at::topk(at::from_blob(p.data(), {ne}, at::kFloat), k);
    for (int64_t j = 0; j < k; ++j) idx[j] = e.data_ptr<int64_t>()[j];
  }
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += p[idx[j]];
  for (int64_t j = 0; j < k; ++j) {
    eout[j] = idx[j];
    wout[j] = renorm ? p[idx[j]] / total : p[idx[j]];
  }
}

// The router: logits = x W^T in x's dtype (as transformers computes them), softmax in fp32, the top
// k (top_k_row), renormalized where the model says so: one call for what took six in Python, whose
// dispatches cost more than the arithmetic. Up to SMALL rows (decode) the logits come from small_mm,
// which reads W once: oneDNN took ~44 us for one row of a 64 x 1024 router, 5 % of a decode step.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& w, int64_t k, bool renorm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) &&
                  w.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_route: x [T, H] and the router's weight [E, H], contiguous, both bf16 or fp32");
  TORCH_CHECK(k >= 1 && k <= w.size(0), "moe_route: top ", k, " of ", w.size(0), " experts");
  const int64_t t = x.size(0), ne = w.size(0), hid = x.size(1);
  at::Tensor logits;
  if (t <= SMALL) {
    logits = at::empty({t, ne}, x.options());
    auto run = [&](auto tag) {
      using T = decltype(tag);
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        small_mm_bf16(logits.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<T>(), int(t), ne, hid);
        return;
      }
#endif
      std::vector<float> xf(t * hid);
      to_float(xf.data(), x.data_ptr<T>(), t * hid);
      small_mm<T>(logits.data_ptr<T>(), xf.data(), w.data_ptr<T>(), int(t), ne, hid);
    };
    if (x.scalar_type() == at::kFloat)
      run(float());
    else
      run(c10::BFloat16());
  } else {
    logits = at::mm(x, w.t());
  }
  at::Tensor weights = at::empty({t, k}, x.options().dtype(at::kFloat)),
             experts = at::empty({t, k}, x.options().dtype(at::kLong));
  auto rows = [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < t; ++r)
      top_k_row(logits.data_ptr<T>() + r * ne, ne, k, renorm, weights.data_ptr<float>() + r * k,
                experts.data_ptr<int64_t>() + r * k);
  };
  if (x.scalar_type() == at::kFloat)
    rows(float());
  else
    rows(c10::BFloat16());
  return {weights, experts};
}

bool moe_can_w8a8() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

// A mixture's layer on W8A8 experts: w13 / w2 as [q int8 packed [E, N, K], scales fp32 [E, N], column
// sums int32 [E, N]] (models/moe.py set_w8a8).
void moe_experts_w8a8(at::Tensor out, const at::Tensor& x, const std::vector<at::Tensor>& w13,
                      const std::vector<at::Tensor>& w2, const at::Tensor& weights, const at::Tensor& experts,
                      int64_t act_kind, int64_t first, int64_t total) {
  TORCH_CHECK(moe_can_w8a8(), "moe_experts_w8a8: needs a CPU with AVX512-VNNI");
  check_rows("moe_experts_w8a8", out, x);
  TORCH_CHECK(w13.size() == 3 && w2.size() == 3, "moe_experts_w8a8: w13 and w2 are [codes, scales, column sums]");
  const int64_t ne = w13[0].size(0), hid = x.size(1), width = w2[0].size(2);
  auto check = [&](const std::vector<at::Tensor>& w, int64_t n, int64_t k, const char* what) {
    TORCH_CHECK(w[0].dim() == 3 && w[0].scalar_type() == at::kChar && w[0].is_contiguous() && w[0].size(0) == ne &&
                    w[0].size(1) == n && w[0].size(2) == k && n % 16 == 0 && k % 16 == 0,
                "moe_experts_w8a8: ", what, " codes int8 [E, ", n, ", ", k, "], N and K multiples of 16");
    TORCH_CHECK(w[1].scalar_type() == at::kFloat && w[2].scalar_type() == at::kInt && w[1].is_contiguous() &&
                    w[2].is_contiguous() && w[1].numel() == ne * n && w[2].numel() == ne * n,
                "moe_experts_w8a8: ", what, " scales fp32 and column sums int32 [E, ", n, "]");
  };
  check(w13, 2 * width, hid, "w13");
  check(w2, hid, width, "w2");
  check_routing("moe_experts_w8a8", x, weights, experts, ne, first, total);
  const Act act = make_act("moe_experts_w8a8", x, act_kind, ne, width, {}, {}, 0., 0.);
  if (x.size(0) == 0) return;
#ifdef __AVX512VNNI__
  const int64_t places = experts.numel();
  std::vector<uint8_t> xq(places * hid), aq(places * width);
  std::vector<float> sx(places), sa(places);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto part = [&](const std::vector<at::Tensor>& w, int64_t e, int64_t n, int64_t k) {
      return std::make_tuple(w[0].data_ptr<int8_t>() + e * n * k, w[1].data_ptr<float>() + e * n,
                             w[2].data_ptr<int32_t>() + e * n);
    };
    moe<T>(out, x, ne, first, width, weights, experts, [&](Work& w, int64_t e, int64_t start, int64_t n) {
      codes_rows(xq.data() + start * hid, sx.data() + start, w.xs.data_ptr<T>() + start * hid, n, hid);
      auto [q13, s13, c13] = part(w13, e, 2 * width, hid);
      w8_mm(w.h.data_ptr<T>() + start * 2 * width, 2 * width, xq.data() + start * hid, sx.data() + start, n, q13, s13,
            c13, 2 * width, hid);
      act_all<T>(w.a.data_ptr<T>(), w.h.data_ptr<T>(), start, n, width, act, e);
      codes_rows(aq.data() + start * width, sa.data() + start, w.a.data_ptr<T>() + start * width, n, width);
      auto [q2, s2, c2] = part(w2, e, hid, width);
      w8_mm(w.y.data_ptr<T>() + start * hid, hid, aq.data() + start * width, sa.data() + start, n, q2, s2, c2, hid,
            width);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    run(c10::BFloat16());
  else
    run(float());
#endif
}

bool moe_can_pack() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void moe_experts(at::Tensor out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                 const at::Tensor& weights, const at::Tensor& experts, int64_t act_kind, int64_t first, int64_t total,
                 bool packed, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha,
                 double limit) {
  check_rows("moe_experts", out, x);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(1) == 2 * w2.size(2) && w13.scalar_type() == x.scalar_type() &&
                  w2.scalar_type() == x.scalar_type(),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I], contiguous, in x's dtype");
  check_routing("moe_experts", x, weights, experts, w13.size(0), first, total);
  TORCH_CHECK(!packed || (moe_can_pack() && x.scalar_type() == at::kBFloat16 && w13.size(1) % 16 == 0 &&
                          w2.size(1) % 16 == 0 && x.size(1) % 2 == 0 && w2.size(2) % 2 == 0),
              "moe_experts: packed weights need bf16, AVX512-BF16, N a multiple of 16 and K of 2");
  const int64_t width = w2.size(2);
  const Act act = make_act("moe_experts", x, act_kind, w13.size(0), width, b13, b2, alpha, limit);
  if (x.size(0) == 0) return;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    moe<T>(out, x, w13.size(0), first, width, weights, experts, [&](Work& w, int64_t e, int64_t start, int64_t n) {
      run_expert<T>(w.xs, w.h, w.a, w.y, w13, w2, e, start, n, width, act, packed);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(float());
  else
    run(c10::BFloat16());
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  // act: 0 gelu_tanh, 1 silu, 2 swiglu_oai (alpha, limit); b13 / b2: gpt-oss's expert biases
  m.def("moe_experts(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor experts, int act, "
        "int first, int total, bool packed, Tensor? b13=None, Tensor? b2=None, float alpha=1.702, "
        "float limit=7.0) -> ()");
  // no tensor to dispatch on: these two are one kernel for all backends
  m.def("moe_can_pack() -> bool", &pagedllm::moe_can_pack);
  m.def("moe_can_w8a8() -> bool", &pagedllm::moe_can_w8a8);
  m.def("moe_experts_w8a8(Tensor(a!) out, Tensor x, Tensor[] w13, Tensor[] w2, Tensor weights, Tensor experts, "
        "int act, int first, int total) -> ()");
  m.def("moe_route(Tensor x, Tensor w, int k, bool renorm) -> (Tensor, Tensor)");
  m.def("moe_experts_blocks(Tensor(a!) out, Tensor x, int type13, Tensor[] w13, int type2, Tensor[] w2, int width, "
        "Tensor weights, Tensor experts, int act, int first, int total, Tensor? b13=None, Tensor? b2=None, "
        "float alpha=1.702, float limit=7.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("moe_experts", &pagedllm::moe_experts);
  m.impl("moe_experts_blocks", &pagedllm::moe_experts_blocks);
  m.impl("moe_route", &pagedllm::moe_route);
  m.impl("moe_experts_w8a8", &pagedllm::moe_experts_w8a8);
}
