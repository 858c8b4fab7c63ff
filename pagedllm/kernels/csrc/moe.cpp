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
// The matmuls are ATen's (oneDNN). A decode step gives most experts 0-2 rows: then the experts are
// spread over the threads, each matmul single-threaded; a prefill's experts have many rows each,
// and each matmul takes every thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

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

template <class T>
void to_float(float* out, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = float(x[i]);
}

inline vf silu_v(vf a) { return a / (1.f + expv(-a)); }
inline vf gelu_tanh_v(vf a) { return a / (1.f + expv(-(a + 0.044715f * a * a * a) * 1.5957691216057308f)); }

// a[r] = act(h[r, :n]) * h[r, n:] for rows [r0, r1)
template <class T>
void act_rows(T* a, const T* h, int64_t r0, int64_t r1, int64_t n, bool silu) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = h + r * 2 * n;
    T* o = a + r * n;
    int64_t i = 0;
    for (; i + L <= n; i += L) {
      const vf x = load16(g + i);
      store16(o + i, (silu ? silu_v(x) : gelu_tanh_v(x)) * load16(g + n + i));
    }
    for (; i < n; ++i) {
      const float x = float(g[i]);
      const float act = silu ? x / (1.f + std::exp(-x))
                             : x / (1.f + std::exp(-(x + 0.044715f * x * x * x) * 1.5957691216057308f));
      o[i] = T(act * float(g[n + i]));
    }
  }
}

template <class T>
void run_expert(const at::Tensor& xs, at::Tensor& h, at::Tensor& a, at::Tensor& y, const at::Tensor& w13,
                const at::Tensor& w2, int64_t e, int64_t start, int64_t n, int64_t width, bool silu) {
  if (n <= SMALL) {
    const int64_t hid = xs.size(1);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      T* hp = h.data_ptr<T>() + start * 2 * width;
      small_mm_bf16(hp, xs.data_ptr<T>() + start * hid, w13.data_ptr<T>() + e * 2 * width * hid, int(n), 2 * width,
                    hid);
      act_rows<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, start + n, width, silu);
      small_mm_bf16(y.data_ptr<T>() + start * hid, a.data_ptr<T>() + start * width, w2.data_ptr<T>() + e * hid * width,
                    int(n), hid, width);
      return;
    }
#endif
    std::vector<float> xf(n * std::max(hid, width));
    to_float(xf.data(), xs.data_ptr<T>() + start * hid, n * hid);
    T* hp = h.data_ptr<T>() + start * 2 * width;
    small_mm<T>(hp, xf.data(), w13.data_ptr<T>() + e * 2 * width * hid, int(n), 2 * width, hid);
    act_rows<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, start + n, width, silu);
    to_float(xf.data(), a.data_ptr<T>() + start * width, n * width);
    small_mm<T>(y.data_ptr<T>() + start * hid, xf.data(), w2.data_ptr<T>() + e * hid * width, int(n), hid, width);
    return;
  }
  auto he = h.narrow(0, start, n), ae = a.narrow(0, start, n), ye = y.narrow(0, start, n);
  at::mm_out(he, xs.narrow(0, start, n), w13[e].t());
  act_rows<T>(a.data_ptr<T>(), h.data_ptr<T>(), start, start + n, width, silu);
  at::mm_out(ye, ae, w2[e].t());
}

template <class T>
void moe(at::Tensor& out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
         const at::Tensor& experts, bool silu) {
  const int64_t t = x.size(0), hid = x.size(1), k = experts.size(1), ne = w13.size(0), width = w2.size(2);
  const int64_t* ex = experts.data_ptr<int64_t>();
  std::vector<int64_t> count(ne + 1, 0), place(t * k), order(t * k);
  for (int64_t i = 0; i < t * k; ++i) ++count[ex[i] + 1];
  for (int64_t e = 0; e < ne; ++e) count[e + 1] += count[e];  // count[e]: expert e's first place
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < t * k; ++i) {
    place[i] = next[ex[i]]++;
    order[place[i]] = i / k;  // the row at each place
  }
  auto opts = x.options();
  at::Tensor xs = at::empty({t * k, hid}, opts), h = at::empty({t * k, 2 * width}, opts),
             a = at::empty({t * k, width}, opts), y = at::empty({t * k, hid}, opts);
  const T* xp = x.data_ptr<T>();
  T* xsp = xs.data_ptr<T>();
  at::parallel_for(0, t * k, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) std::memcpy(xsp + p * hid, xp + order[p] * hid, hid * sizeof(T));
  });
  std::vector<int64_t> used;
  for (int64_t e = 0; e < ne; ++e)
    if (count[e + 1] > count[e]) used.push_back(e);
  if (!used.empty() && t * k / int64_t(used.size()) < FEW_ROWS) {
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, int64_t(used.size()), 1, [&](int64_t b, int64_t end) {
      c10::InferenceMode guard(inference);  // a worker thread does not inherit the caller's mode
      for (int64_t i = b; i < end; ++i) {
        const int64_t e = used[i];
        run_expert<T>(xs, h, a, y, w13, w2, e, count[e], count[e + 1] - count[e], width, silu);
      }
    });
  } else {
    for (int64_t e : used) run_expert<T>(xs, h, a, y, w13, w2, e, count[e], count[e + 1] - count[e], width, silu);
  }
  const float* wp = weights.data_ptr<float>();
  const T* yp = y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    std::vector<float> acc(hid);
    for (int64_t r = b; r < e; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wp[r * k + j];
        const T* src = yp + place[r * k + j] * hid;
        int64_t i = 0;
        for (; i + L <= hid; i += L) storef(acc.data() + i, loadf(acc.data() + i) + splat(w) * load16(src + i));
        for (; i < hid; ++i) acc[i] += w * float(src[i]);
      }
      for (int64_t i = 0; i < hid; ++i) op[r * hid + i] = T(acc[i]);
    }
  });
}

}  // namespace

void moe_experts(at::Tensor out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                 const at::Tensor& weights, const at::Tensor& experts, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_experts: x [T, H] and out like it, contiguous, bf16 or fp32");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(1) == 2 * w2.size(2) && w13.scalar_type() == x.scalar_type() &&
                  w2.scalar_type() == x.scalar_type(),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I], contiguous, in x's dtype");
  TORCH_CHECK(experts.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && experts.dim() == 2 &&
                  experts.sizes() == weights.sizes() && experts.size(0) == x.size(0) && experts.is_contiguous() &&
                  weights.is_contiguous(),
              "moe_experts: experts int64 [T, k] and weights float32 [T, k]");
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts.numel(); ++i)
    TORCH_CHECK(ex[i] >= 0 && ex[i] < w13.size(0), "moe_experts: expert ", ex[i], " is outside the ", w13.size(0));
  if (x.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat)
    moe<float>(out, x, w13, w2, weights, experts, silu);
  else
    moe<c10::BFloat16>(out, x, w13, w2, weights, experts, silu);
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("moe_experts(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor experts, bool silu) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("moe_experts", &pagedllm::moe_experts); }
