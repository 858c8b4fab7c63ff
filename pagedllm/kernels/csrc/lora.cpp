// The low-rank passes of a step's LoRA adapters over their rows (lora/batch.py), in one call a
// matmul: out[rows[i], :] += (x[rows[i], :] . A_s^T) . Bt_s, for row i of segment s (the rows of
// one adapter are consecutive in `rows`; seg_starts[s] .. seg_starts[s + 1] - 1 are segment s's).
// A_s [R_s, K] holds the adapter's pieces stacked, Bt_s [R_s, N] their B transposed and scaled
// (block-diagonal: zeros off a piece's columns); R_s = 0 skips the segment (an adapter without
// this matmul). x, out, A, Bt share one dtype, bf16 or fp32; sums in fp32, out rounded once.
// SGMV's shape (Punica, S-LoRA) on a CPU: a row's R dot products of length K, then R rows of Bt
// added into its output row; the adapters' few hundred KB stay in L2 across a segment's rows.
// Torch's matmuls did the same at 36 us a call on a few rows in bf16 (8 adapters: half the step).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int ROWS = 4;        // rows in registers at a time
constexpr int TASK_ROWS = 32;  // rows of one segment a task: its A and Bt read once for all of them
constexpr int JB = 4;          // rows of A a dot-product pass takes (each x vector loaded once for them)
constexpr int CB = 4;          // output vectors an expand pass takes (each factor broadcast once for them)

// xa[q][j] = x row q . A row j, for A rows j0 .. j0 + nj - 1 (nj <= JB) and rows q < m.
template <class T>
void dots(const T* x, const int64_t* off, int m, const T* a, int64_t j0, int nj, int64_t k, float* xa, int64_t r) {
  vf acc[ROWS][JB] = {};
  int64_t i = 0;
  for (; i + L <= k; i += L) {
    vf w[JB];
    for (int b = 0; b < nj; ++b) w[b] = load16(a + (j0 + b) * k + i);
    for (int q = 0; q < m; ++q) {
      const vf xv = load16(x + off[q] * k + i);
      for (int b = 0; b < nj; ++b) acc[q][b] += w[b] * xv;
    }
  }
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nj; ++b) {
      float s = hsum(acc[q][b]);
      for (int64_t t = i; t < k; ++t) s += float(a[(j0 + b) * k + t]) * float(x[off[q] * k + t]);
      xa[q * r + j0 + b] = s;
    }
}

// out row q, columns c .. c + nb * L - 1 (nb <= CB vectors), += sum_j xa[q][j] Bt[j].
template <class T>
void expand(T* out, const int64_t* off, int m, const T* bt, int64_t c, int nb, int64_t r, int64_t n,
            const float* xa) {
  vf acc[ROWS][CB];
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nb; ++b) acc[q][b] = load16(out + off[q] * n + c + b * L);
  for (int64_t j = 0; j < r; ++j) {
    vf w[CB];
    for (int b = 0; b < nb; ++b) w[b] = load16(bt + j * n + c + b * L);
    for (int q = 0; q < m; ++q) {
      const vf f = splat(xa[q * r + j]);
      for (int b = 0; b < nb; ++b) acc[q][b] += f * w[b];
    }
  }
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nb; ++b) store16(out + off[q] * n + c + b * L, acc[q][b]);
}

// Rows rows[0 .. cnt) of one segment: blocks of A (then of Bt's columns) outside, groups of ROWS
// rows inside, so each block is read from memory once for all the task's rows and then from L1.
template <class T>
void task(T* out, const T* x, const int64_t* rows, int64_t cnt, const T* a, const T* bt, int64_t r, int64_t k,
          int64_t n, float* xa) {
  for (int64_t j = 0; j < r; j += JB)
    for (int64_t g = 0; g < cnt; g += ROWS)
      dots(x, rows + g, int(std::min<int64_t>(ROWS, cnt - g)), a, j, int(std::min<int64_t>(JB, r - j)), k,
           xa + g * r, r);
  int64_t c = 0;
  while (c + L <= n) {
    const int nb = int(std::min<int64_t>(CB, (n - c) / L));
    for (int64_t g = 0; g < cnt; g += ROWS)
      expand(out, rows + g, int(std::min<int64_t>(ROWS, cnt - g)), bt, c, nb, r, n, xa + g * r);
    c += nb * L;
  }
  for (; c < n; ++c)   // a tail of N past the last full vector
    for (int64_t q = 0; q < cnt; ++q) {
      float acc = float(out[rows[q] * n + c]);
      for (int64_t j = 0; j < r; ++j) acc += xa[q * r + j] * float(bt[j * n + c]);
      out[rows[q] * n + c] = T(acc);
    }
}

template <class T>
void sgmv(at::Tensor& out, const at::Tensor& x, const int64_t* rows, const std::vector<int64_t>& seg,
          at::TensorList a, at::TensorList bt) {
  const int64_t k = x.size(1), n = out.size(1), total = seg.back();
  int64_t rmax = 0;
  for (const auto& t : a) rmax = std::max(rmax, t.size(0));
  if (rmax == 0 || total == 0) return;
  T* o = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (first row index in `rows`, segment): never two segments
  for (size_t s = 0; s + 1 < seg.size(); ++s)
    if (a[s].size(0) > 0)
      for (int64_t i = seg[s]; i < seg[s + 1]; i += TASK_ROWS) tasks.emplace_back(i, int64_t(s));
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xa(TASK_ROWS * rmax);
    for (int64_t t = t0; t < t1; ++t) {
      const auto [i, s] = tasks[t];
      task(o, xp, rows + i, std::min<int64_t>(TASK_ROWS, seg[s + 1] - i), a[s].data_ptr<T>(), bt[s].data_ptr<T>(),
           a[s].size(0), k, n, xa.data());
    }
  });
}

}  // namespace

void lora_sgmv(at::Tensor out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& seg_starts,
               at::TensorList a, at::TensorList bt) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "lora_sgmv: x [T, K] and out [T, N] must be contiguous, of one dtype, bf16 or fp32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  seg_starts.scalar_type() == at::kLong && seg_starts.dim() == 1 &&
                  seg_starts.size(0) == int64_t(a.size()) + 1 && a.size() == bt.size(),
              "lora_sgmv: rows int64 [n], seg_starts int64 [S + 1] for S pairs of A and Bt");
  std::vector<int64_t> seg(seg_starts.data_ptr<int64_t>(), seg_starts.data_ptr<int64_t>() + seg_starts.size(0));
  TORCH_CHECK(seg.front() == 0 && seg.back() == rows.size(0) && std::is_sorted(seg.begin(), seg.end()),
              "lora_sgmv: seg_starts must rise from 0 to len(rows)");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "lora_sgmv: row ", rp[i], " is outside x's ", x.size(0));
  for (size_t s = 0; s < a.size(); ++s)
    TORCH_CHECK(a[s].dim() == 2 && a[s].is_contiguous() && a[s].size(1) == x.size(1) && bt[s].dim() == 2 &&
                    bt[s].is_contiguous() && bt[s].size(0) == a[s].size(0) && bt[s].size(1) == out.size(1) &&
                    a[s].scalar_type() == x.scalar_type() && bt[s].scalar_type() == x.scalar_type(),
                "lora_sgmv: pair ", s, " must be A [R, K] and Bt [R, N], contiguous, in x's dtype");
  if (x.scalar_type() == at::kFloat)
    sgmv<float>(out, x, rp, seg, a, bt);
  else
    sgmv<c10::BFloat16>(out, x, rp, seg, a, bt);
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("lora_sgmv(Tensor(a!) out, Tensor x, Tensor rows, Tensor seg_starts, Tensor[] a, Tensor[] bt) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("lora_sgmv", &pagedllm::lora_sgmv); }
