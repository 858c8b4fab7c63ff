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

#ifdef __AVX512BF16__
// x [M, K] bf16 with contiguous rows against panels [P, K/2, 32, 2] of n output columns.
void check_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16, op, ": bf16 x and panels");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && panels.dim() == 4 && panels.size(2) == panels::COLS &&
                  panels.size(3) == 2 && panels.is_contiguous(),
              op, ": x [M, K] with contiguous rows, panels [P, K/2, 32, 2]");
  TORCH_CHECK(x.size(1) == 2 * panels.size(1) && n <= panels.size(0) * panels::COLS &&
                  n > (panels.size(0) - 1) * panels::COLS, op, ": shapes do not match");
}
#endif

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
#ifdef __AVX512BF16__
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.stride(1) == 1,
              "panel_linear: out [M, N] bf16 with contiguous rows");
  const int64_t n = out.size(1);
  check_panels(x, panels, n, "panel_linear");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(out.size(0) == m, "panel_linear: out has ", out.size(0), " rows, x ", m);
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
  check_panels(x, panels, n, "panel_argmax");
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
