// The float linear layers in bf16 on weights packed once in panels (bf16_panels.h; packed by
// models/prepack.py): out = x . W^T (+ bias), for every row count, in place of oneDNN.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_panels.h"

#ifdef __AVX512BF16__
#define PANELS_BUILT true
#else
#define PANELS_BUILT false
#endif

namespace pagedllm {
namespace {

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
#ifdef __AVX512BF16__
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "panel_linear: bf16 x, panels and out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && panels.dim() == 4 && panels.size(2) == panels::COLS &&
                  panels.size(3) == 2 && panels.is_contiguous(), "panel_linear: x [M, K], out [M, N], panels [P, K/2, 32, 2]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "panel_linear: rows of x and out must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(k == 2 * panels.size(1) && out.size(0) == m && n <= panels.size(0) * panels::COLS &&
                  n > (panels.size(0) - 1) * panels::COLS, "panel_linear: shapes do not match");
  const c10::BFloat16* b = nullptr;   // read where it lies: no fp32 copy of it a call
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                "panel_linear: bias of N bf16 values");
    b = bias->data_ptr<c10::BFloat16>();
  }
  panels::gemm(out.data_ptr<c10::BFloat16>(), out.stride(0), x.data_ptr<c10::BFloat16>(), x.stride(0), m,
               panels.data_ptr<c10::BFloat16>(), n, k, b);
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX512-BF16 (the layers keep oneDNN's reordered weights)");
#endif
}

// The first index of each row's largest value of x . W^T as panel_linear would write it (bf16, no
// bias), without writing it: a greedy step's LM head (96 x 49,152 logits for SmolLM2, 32 x 262,144
// for Gemma 3) goes straight to its tokens.
at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  at::Tensor idx = at::empty({x.size(0)}, x.options().dtype(at::kLong));
#ifdef __AVX512BF16__
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16, "panel_argmax: bf16 x and panels");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 4 && panels.size(2) == panels::COLS && panels.size(3) == 2 &&
                  panels.is_contiguous() && x.stride(1) == 1, "panel_argmax: x [M, K] with contiguous rows, panels [P, K/2, 32, 2]");
  TORCH_CHECK(x.size(1) == 2 * panels.size(1) && n <= panels.size(0) * panels::COLS &&
                  n > (panels.size(0) - 1) * panels::COLS, "panel_argmax: shapes do not match");
  if (x.size(0) > 0)
    panels::gemm_argmax(idx.data_ptr<int64_t>(), x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0),
                        panels.data_ptr<c10::BFloat16>(), n, x.size(1));
#else
  TORCH_CHECK(false, "panel_argmax: this build has no AVX512-BF16");
#endif
  return idx;
}

// Whether this build has the kernel (prepack.py asks once, at load).
bool has_panel_linear() { return PANELS_BUILT; }

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.def("panel_argmax(Tensor x, Tensor panels, int n) -> Tensor");
  m.def("has_panel_linear() -> bool", &pagedllm::has_panel_linear);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("panel_linear", &pagedllm::panel_linear);
  m.impl("panel_argmax", &pagedllm::panel_argmax);
}
