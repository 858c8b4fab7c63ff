// Structured outputs: a grammar's allowed tokens as a bitmask (bit t of row r: token t is
// allowed), applied to the logits of the rows it constrains before sampling. One pass of
// word reads per row; a cleared bit writes -inf. The rows that nothing constrains are never
// touched, so an unconstrained request pays nothing.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>

namespace pagedllm {
namespace {

template <typename T>
void mask_row(T* x, const int32_t* bits, int64_t V) {
  const T neg = T(-std::numeric_limits<float>::infinity());
  const int64_t words = (V + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t b = static_cast<uint32_t>(bits[w]);
    if (b == 0xFFFFFFFFu) continue;  // inside a string: all allowed
    const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
    T* p = x + base;
    if (b == 0) {  // between a JSON value's tokens: most words forbid all
      for (int64_t j = 0; j < n; ++j) p[j] = neg;
      continue;
    }
    for (int64_t j = 0; j < n; ++j) p[j] = ((b >> j) & 1u) ? p[j] : neg;  // a select, no branch
  }
}

// logits [R, V] (modified in place); bitmask int32 [K, ceil(V / 32)]; rows int64 [K]: the
// logits row each bitmask row applies to.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "apply_token_bitmask: logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1), K = rows.numel();
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [K, W]");
  TORCH_CHECK(bitmask.size(0) >= K && bitmask.size(1) * 32 >= V, "apply_token_bitmask: bitmask of ",
              bitmask.size(0), " x ", bitmask.size(1), " words cannot cover ", K, " rows of ", V, " tokens");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "apply_token_bitmask: rows must be int64");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < K; ++i) TORCH_CHECK(0 <= r[i] && r[i] < R, "apply_token_bitmask: row ", r[i], " outside [0, ", R, ")");
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t W = bitmask.size(1);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    T* x = logits.data_ptr<T>();
    at::parallel_for(0, K, 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) mask_row(x + r[i] * V, bits + i * W, V);
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "apply_token_bitmask: dtype ", logits.scalar_type(), " is not supported");
  }
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("apply_token_bitmask", &pagedllm::apply_token_bitmask); }
