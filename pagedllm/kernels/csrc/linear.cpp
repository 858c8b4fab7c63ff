// A bf16 matmul whose result for a row does not depend on how many rows share the call
// (batch-invariant mode). oneDNN picks kernels and blocking by the row count M, and some
// of them sum K in another order: a row computed beside 40 others differs in a few
// outputs from the same row beside 10. Here every output is one chain of AMX tile dot
// products over K in ascending 32-wide blocks, whatever M, the row's place in a tile, the
// column blocking or the thread count: the same row gives the same bits in any batch.
//
// Weights are packed once (models/batch_invariant.py) into AMX B tiles: panels of 32
// output columns, each panel [K / 32][2 halves of 16 columns][16 pairs of k][16][2].
// Rows run in blocks of 32 (two A tiles, four C tiles per panel); a short last block is
// copied into zero-padded rows, and rows do not mix, so padding changes nothing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedllm {
namespace {

constexpr int KB = 32;     // k per tile: 16 pairs of bf16
constexpr int PANEL = 32;  // output columns per panel: two B tiles
constexpr int TILE_ELEMS = 16 * KB;

#ifdef PAGEDLLM_AMX
// Linux hands out AMX tile state only on request (once per process).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C 0-3 (fp32), A 4-5 (bf16 rows), B 6-7 (bf16 pairs).
inline void load_tile_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// c[32][PANEL] (fp32) = rows a[0..16*MT) x one panel; a rows lda elements apart.
template <int MT>
inline void panel_block(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* panel, int nkb, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int kb = 0; kb < nkb; ++kb) {
    const c10::BFloat16* b = panel + int64_t(kb) * 2 * TILE_ELEMS;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_loadd(4, a + kb * KB, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, a + 16 * lda + kb * KB, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, PANEL * 4);
  _tile_stored(1, c + 16, PANEL * 4);
  if constexpr (MT == 2) {
    _tile_stored(2, c + 16 * PANEL, PANEL * 4);
    _tile_stored(3, c + 16 * PANEL + 16, PANEL * 4);
  }
}

// Rows [m0, m0 + rows) of out, columns of panel p: plus bias, rounded to bf16 once.
inline void write_rows(c10::BFloat16* out, int64_t ldo, int64_t n, int64_t p, int64_t m0, int rows, const float* c,
                       const c10::BFloat16* bias) {
  const int64_t n0 = p * PANEL, cols = std::min<int64_t>(PANEL, n - n0);
  for (int r = 0; r < rows; ++r) {
    c10::BFloat16* dst = out + (m0 + r) * ldo + n0;
    const float* src = c + r * PANEL;
    if (cols == PANEL) {
      for (int h = 0; h < PANEL; h += L)
        store16(dst + h, loadf(src + h) + (bias ? load16(bias + n0 + h) : vf{}));
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[j] = c10::BFloat16(src[j] + (bias ? float(bias[n0 + j]) : 0.f));
    }
  }
}
#endif

// out [M, N] = x [M, K] . W^T (+ bias), W packed as above. x rows contiguous, K % 32 == 0.
void invariant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && x.size(1) % KB == 0,
              "invariant_linear: x must be bf16 [M, K] with rows contiguous and K a multiple of 32");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(1) * KB == x.size(1) && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 2 * 16,
              "invariant_linear: packed weight must be [ceil(N/32), K/32, 2, 16, 32] bf16 for this K");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.stride(1) == 1 && out.scalar_type() == at::kBFloat16 &&
                  (n + PANEL - 1) / PANEL == packed.size(0),
              "invariant_linear: out must be bf16 [M, N], N matching the packed weight");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16, "invariant_linear: bias must be bf16 [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
#ifdef PAGEDLLM_AMX
  TORCH_CHECK(amx_permitted(), "invariant_linear: the OS did not grant AMX tile state");
  if (m == 0) return;
  const int nkb = int(k / KB);
  const int64_t panels = packed.size(0);
  const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* os = out.data_ptr<c10::BFloat16>();
  const int64_t lda = x.stride(0), ldo = out.stride(0);
  // The last rows (m % 32 of them), zero-padded to a whole block, shared read-only.
  const int64_t full = m / 32 * 32;
  const int tail = int(m - full);
  std::vector<c10::BFloat16> tail_rows(tail ? size_t(32) * k : 0);
  for (int r = 0; r < tail; ++r) std::memcpy(tail_rows.data() + r * k, xs + (full + r) * lda, k * 2);
  // Rows in chunks that stay in L2 while a thread sweeps its panels; each thread's panels
  // (at most 2 KiB x K/32 each) stay in L1/L2 across the chunk's row blocks.
  const int64_t chunk = std::max<int64_t>(32, (256 * 1024 / (k * 2)) / 32 * 32);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    load_tile_config();
    alignas(64) float c[32 * PANEL];
    for (int64_t c0 = 0; c0 < full; c0 += chunk)
      for (int64_t p = p0; p < p1; ++p) {
        const c10::BFloat16* panel = wp + p * nkb * 2 * TILE_ELEMS;
        for (int64_t m0 = c0; m0 < std::min(full, c0 + chunk); m0 += 32) {
          panel_block<2>(xs + m0 * lda, lda, panel, nkb, c);
          write_rows(os, ldo, n, p, m0, 32, c, b);
        }
      }
    if (tail)
      for (int64_t p = p0; p < p1; ++p) {
        const c10::BFloat16* panel = wp + p * nkb * 2 * TILE_ELEMS;
        if (tail <= 16) panel_block<1>(tail_rows.data(), k, panel, nkb, c);
        else panel_block<2>(tail_rows.data(), k, panel, nkb, c);
        write_rows(os, ldo, n, p, full, tail, c, b);
      }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "invariant_linear: this build has no AMX (use tiled matmuls instead)");
#endif
}

bool has_invariant_linear() {
#ifdef PAGEDLLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("invariant_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("has_invariant_linear() -> bool", &pagedllm::has_invariant_linear);  // no tensors: one kernel for all
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("invariant_linear", &pagedllm::invariant_linear);
}
