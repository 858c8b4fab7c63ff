// The low-rank passes of a step's LoRA adapters over their rows (lora/batch.py), in one call a
// matmul: out[rows[i], :] += (x[rows[i], :] . A_s^T) . Bt_s, for row i of segment s (the rows of
// one adapter are consecutive in `rows`; seg_starts[s] .. seg_starts[s + 1] - 1 are segment s's).
// A_s [R_s, K] and Bt_s [R_s, N] (B transposed, scaled) live in the KV pool's pages (lora/layout.py),
// cut into cells of W elements: a_tab_s [R_s, ceil(K / W)] holds the address of each row's cells,
// bt_tab_s [R_s, ceil(N / W)] too, 0 for a cell that is all zeros (columns of another piece of a
// fused matmul: never stored). R_s = 0 skips the segment (an adapter without this matmul). x, out
// and the cells share one dtype, bf16 or fp32; sums in fp32, out rounded once.
// SGMV's shape (Punica, S-LoRA) on a CPU: a row's R dot products of length K, then R rows of Bt
// added into its output row; the adapter's few hundred KB stay in L2 across a segment's rows.
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

template <class T>
inline const T* cell(const int64_t* tab, int64_t row, int64_t cells, int64_t c) {
  return reinterpret_cast<const T*>(tab[row * cells + c]);
}

// xa[q][j] = x row q . A row j, for A rows j0 .. j0 + nj - 1 (nj <= JB) and rows q < m; A's rows
// in cells of w elements (a_tab [R, ca]).
template <class T>
void dots(const T* x, const int64_t* off, int m, const int64_t* a_tab, int64_t ca, int64_t w, int64_t j0, int nj,
          int64_t k, float* xa, int64_t r) {
  vf acc[ROWS][JB] = {};
  float tail[ROWS][JB] = {};
  for (int64_t c = 0; c < ca; ++c) {
    const int64_t i0 = c * w, len = std::min(w, k - i0);
    const T* ar[JB];
    for (int b = 0; b < nj; ++b) ar[b] = cell<T>(a_tab, j0 + b, ca, c);
    int64_t i = 0;
    for (; i + L <= len; i += L) {
      vf wv[JB];
      for (int b = 0; b < nj; ++b) wv[b] = load16(ar[b] + i);
      for (int q = 0; q < m; ++q) {
        const vf xv = load16(x + off[q] * k + i0 + i);
        for (int b = 0; b < nj; ++b) acc[q][b] += wv[b] * xv;
      }
    }
    for (; i < len; ++i)
      for (int q = 0; q < m; ++q)
        for (int b = 0; b < nj; ++b) tail[q][b] += float(ar[b][i]) * float(x[off[q] * k + i0 + i]);
  }
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nj; ++b) xa[q * r + j0 + b] = hsum(acc[q][b]) + tail[q][b];
}

// out row q, columns c0 + v * L .. (nb <= CB vectors, inside cell c of width w), += sum_j xa[q][j] Bt[j];
// rows whose cell c is not stored (address 0) add nothing.
template <class T>
void expand(T* out, const int64_t* off, int m, const int64_t* bt_tab, int64_t cb, int64_t c, int64_t w,
            int64_t v0, int nb, int64_t r, int64_t n, const float* xa) {
  vf acc[ROWS][CB];
  const int64_t col = c * w + v0;
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nb; ++b) acc[q][b] = load16(out + off[q] * n + col + b * L);
  for (int64_t j = 0; j < r; ++j) {
    const T* row = cell<T>(bt_tab, j, cb, c);
    if (row == nullptr) continue;
    vf wv[CB];
    for (int b = 0; b < nb; ++b) wv[b] = load16(row + v0 + b * L);
    for (int q = 0; q < m; ++q) {
      const vf f = splat(xa[q * r + j]);
      for (int b = 0; b < nb; ++b) acc[q][b] += f * wv[b];
    }
  }
  for (int q = 0; q < m; ++q)
    for (int b = 0; b < nb; ++b) store16(out + off[q] * n + col + b * L, acc[q][b]);
}

// Rows rows[0 .. cnt) of one segment: blocks of A (then of Bt's columns) outside, groups of ROWS
// rows inside, so each block is read from memory once for all the task's rows and then from L1.
template <class T>
void task(T* out, const T* x, const int64_t* rows, int64_t cnt, const int64_t* a_tab, const int64_t* bt_tab,
          int64_t r, int64_t k, int64_t n, int64_t w, float* xa) {
  const int64_t ca = (k + w - 1) / w, cb = (n + w - 1) / w;
  for (int64_t j = 0; j < r; j += JB)
    for (int64_t g = 0; g < cnt; g += ROWS)
      dots(x, rows + g, int(std::min<int64_t>(ROWS, cnt - g)), a_tab, ca, w, j, int(std::min<int64_t>(JB, r - j)),
           k, xa + g * r, r);
  for (int64_t c = 0; c < cb; ++c) {
    const int64_t len = std::min(w, n - c * w);
    int64_t v = 0;
    while (v + L <= len) {
      const int nb = int(std::min<int64_t>(CB, (len - v) / L));
      for (int64_t g = 0; g < cnt; g += ROWS)
        expand(out, rows + g, int(std::min<int64_t>(ROWS, cnt - g)), bt_tab, cb, c, w, v, nb, r, n, xa + g * r);
      v += nb * L;
    }
    for (; v < len; ++v)   // a tail of N past the last full vector
      for (int64_t q = 0; q < cnt; ++q) {
        float acc = float(out[rows[q] * n + c * w + v]);
        for (int64_t j = 0; j < r; ++j)
          if (const T* row = cell<T>(bt_tab, j, cb, c)) acc += xa[q * r + j] * float(row[v]);
        out[rows[q] * n + c * w + v] = T(acc);
      }
  }
}

template <class T>
void sgmv(at::Tensor& out, const at::Tensor& x, const int64_t* rows, const std::vector<int64_t>& seg,
          at::TensorList a, at::TensorList bt, int64_t w) {
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
      task(o, xp, rows + i, std::min<int64_t>(TASK_ROWS, seg[s + 1] - i), a[s].data_ptr<int64_t>(),
           bt[s].data_ptr<int64_t>(), a[s].size(0), k, n, w, xa.data());
    }
  });
}

}  // namespace

void lora_sgmv(at::Tensor out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& seg_starts,
               at::TensorList a_tabs, at::TensorList bt_tabs, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "lora_sgmv: x [T, K] and out [T, N] must be contiguous, of one dtype, bf16 or fp32");
  TORCH_CHECK(width > 0 && width % L == 0, "lora_sgmv: the cell width must be a positive multiple of ", L);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  seg_starts.scalar_type() == at::kLong && seg_starts.dim() == 1 &&
                  seg_starts.size(0) == int64_t(a_tabs.size()) + 1 && a_tabs.size() == bt_tabs.size(),
              "lora_sgmv: rows int64 [n], seg_starts int64 [S + 1] for S pairs of cell tables");
  std::vector<int64_t> seg(seg_starts.data_ptr<int64_t>(), seg_starts.data_ptr<int64_t>() + seg_starts.size(0));
  TORCH_CHECK(seg.front() == 0 && seg.back() == rows.size(0) && std::is_sorted(seg.begin(), seg.end()),
              "lora_sgmv: seg_starts must rise from 0 to len(rows)");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "lora_sgmv: row ", rp[i], " is outside x's ", x.size(0));
  const int64_t ca = (x.size(1) + width - 1) / width, cb = (out.size(1) + width - 1) / width;
  for (size_t s = 0; s < a_tabs.size(); ++s) {
    const auto &a = a_tabs[s], &b = bt_tabs[s];
    TORCH_CHECK(a.scalar_type() == at::kLong && b.scalar_type() == at::kLong && a.dim() == 2 && b.dim() == 2 &&
                    a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                    (a.size(0) == 0 || (a.size(1) == ca && b.size(1) == cb)),
                "lora_sgmv: pair ", s, " must be cell tables int64 A [R, ", ca, "] and Bt [R, ", cb, "]");
    const int64_t* ap = a.data_ptr<int64_t>();
    for (int64_t i = 0; i < a.numel(); ++i) TORCH_CHECK(ap[i] != 0, "lora_sgmv: pair ", s, ": A cell ", i, " is 0");
  }
  if (x.scalar_type() == at::kFloat)
    sgmv<float>(out, x, rp, seg, a_tabs, bt_tabs, width);
  else
    sgmv<c10::BFloat16>(out, x, rp, seg, a_tabs, bt_tabs, width);
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("lora_sgmv(Tensor(a!) out, Tensor x, Tensor rows, Tensor seg_starts, Tensor[] a_tabs, Tensor[] bt_tabs, int width) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("lora_sgmv", &pagedllm::lora_sgmv); }
