// The two passes around W8A8's int8 matmul (models/w8a8.py; the matmul itself is oneDNN's,
// through torch._int_mm, or on weights reordered once through onednn::qlinear_pointwise):
//   quantize_rows_int8: q[m, :] = rint(x[m, :] / s[m]), s[m] = max|x[m, :]| / 127 (0 rows: s = 0,
//                       q = 0), one read of x where torch's expression makes six passes;
//   quantize_rows_u8:   the same codes plus 128, as uint8: oneDNN's fast int8 kernels on x86
//                       (VNNI's u8 x s8 dot product) take unsigned activations with a zero point;
//   scale_int32:        out[m, n] = acc[m, n] * s[m] * ws[n] (+ bias[n]), one rounding to out's
//                       dtype, one read of the int32 sums;
//   scale_float:        the same from sums oneDNN already converted to float32 (exactly the
//                       float of the int32 sum, as this file's own conversion rounds it).
// Both work row by row, so a row's result never depends on the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int64_t MIN_ELEMS_PER_TASK = 1 << 14;  // a fork costs ~2 us: tasks of a few us at least
constexpr int64_t COL_CHUNK = 1024;              // a row of the LM head splits over the threads

inline vf absv(vf v) { return (vf)((vu)v & 0x7FFFFFFFu); }

// 16 floats (already scaled) to 16 codes, rounding to nearest even and saturating at +-127;
// Offset 128 writes them as uint8 (1..255), 0 as int8.
template <int Offset, typename Q>
inline void store_q(Q* p, vf v) {
#ifdef __AVX512F__
  __m512i i = _mm512_cvtps_epi32((__m512)v);  // MXCSR's mode: nearest even
  i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  i = _mm512_add_epi32(i, _mm512_set1_epi32(Offset));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(i));  // the low byte: exact in range
#else
  for (int i = 0; i < L; ++i) p[i] = static_cast<Q>(std::clamp(std::nearbyint(v[i]), -127.f, 127.f) + Offset);
#endif
}

template <int Offset, typename Q, typename T>
void quantize_impl(Q* q, float* s, const T* x, int64_t rows, int64_t k) {
  const int64_t grain = std::max<int64_t>(1, MIN_ELEMS_PER_TASK / k);
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * k;
      vf m{};
      for (int64_t i = 0; i < k; i += L) {
        const vf a = absv(load16(xr + i));
        m = m > a ? m : a;
      }
      const float scale = hmax(m) / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;  // the same two roundings as models/w8a8.py's torch path
      s[r] = scale;
      for (int64_t i = 0; i < k; i += L) store_q<Offset>(q + r * k + i, load16(xr + i) * inv);
    }
  });
}

inline vf load_acc(const int32_t* a) {
  vi iv;
  std::memcpy(&iv, a, sizeof iv);
  return __builtin_convertvector(iv, vf);
}
inline vf load_acc(const float* a) { return loadf(a); }

template <typename T, typename A>
void scale_impl(T* out, const A* acc, const float* s, const float* ws, const T* bias, int64_t rows, int64_t n) {
  const int64_t chunks = (n + COL_CHUNK - 1) / COL_CHUNK;
  const int64_t grain = std::max<int64_t>(1, MIN_ELEMS_PER_TASK / std::min(n, COL_CHUNK));
  at::parallel_for(0, rows * chunks, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / chunks, c0 = (t % chunks) * COL_CHUNK, c1 = std::min(n, c0 + COL_CHUNK);
      const vf sr = splat(s[r]);
      const A* a = acc + r * n;
      T* o = out + r * n;
      for (int64_t c = c0; c < c1; c += L) {
        vf v = load_acc(a + c) * sr * loadf(ws + c);
        if (bias != nullptr) v += load16(bias + c);
        store16(o + c, v);
      }
    }
  });
}

template <typename F>
void float_dtype(const at::Tensor& t, const char* op, F f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    default: TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " is not supported (float32, bfloat16)");
  }
}

void check_quantize(const at::Tensor& q, const at::Tensor& s, const at::Tensor& x, at::ScalarType qtype,
                    const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % L == 0, op,
              ": x must be contiguous [M, K] with K a multiple of 16");
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == qtype, op, ": q must be ",
              qtype, " like x");
  TORCH_CHECK(s.dim() == 1 && s.size(0) == x.size(0) && s.is_contiguous() && s.scalar_type() == at::kFloat, op,
              ": s must be float32 [M]");
}

void quantize_rows_int8(at::Tensor q, at::Tensor s, const at::Tensor& x) {
  check_quantize(q, s, x, at::kChar, "quantize_rows_int8");
  float_dtype(x, "quantize_rows_int8", [&](auto t) {
    using T = decltype(t);
    quantize_impl<0>(q.data_ptr<int8_t>(), s.data_ptr<float>(), x.data_ptr<T>(), x.size(0), x.size(1));
  });
}

void quantize_rows_u8(at::Tensor q, at::Tensor s, const at::Tensor& x) {
  check_quantize(q, s, x, at::kByte, "quantize_rows_u8");
  float_dtype(x, "quantize_rows_u8", [&](auto t) {
    using T = decltype(t);
    quantize_impl<128>(q.data_ptr<uint8_t>(), s.data_ptr<float>(), x.data_ptr<T>(), x.size(0), x.size(1));
  });
}

void scale_sums(at::Tensor out, const at::Tensor& acc, const at::Tensor& s, const at::Tensor& ws,
                const c10::optional<at::Tensor>& bias, at::ScalarType acc_type, const char* op) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == acc_type && acc.size(1) % L == 0, op,
              ": acc must be contiguous ", acc_type, " [M, N] with N a multiple of 16");
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous(), op, ": out must be contiguous like acc");
  TORCH_CHECK(s.dim() == 1 && s.size(0) == acc.size(0) && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
              ": s must be float32 [M]");
  TORCH_CHECK(ws.dim() == 1 && ws.size(0) == acc.size(1) && ws.scalar_type() == at::kFloat && ws.is_contiguous(), op,
              ": ws must be float32 [N]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == acc.size(1) && bias->is_contiguous() &&
                    bias->scalar_type() == out.scalar_type(),
                op, ": bias must be [N] in out's dtype");
  float_dtype(out, op, [&](auto t) {
    using T = decltype(t);
    const T* b = has_bias ? bias->data_ptr<T>() : nullptr;
    if (acc_type == at::kInt)
      scale_impl<T>(out.data_ptr<T>(), acc.data_ptr<int32_t>(), s.data_ptr<float>(), ws.data_ptr<float>(), b,
                    acc.size(0), acc.size(1));
    else
      scale_impl<T>(out.data_ptr<T>(), acc.data_ptr<float>(), s.data_ptr<float>(), ws.data_ptr<float>(), b,
                    acc.size(0), acc.size(1));
  });
}

void scale_int32(at::Tensor out, const at::Tensor& acc, const at::Tensor& s, const at::Tensor& ws,
                 const c10::optional<at::Tensor>& bias) {
  scale_sums(out, acc, s, ws, bias, at::kInt, "scale_int32");
}

void scale_float(at::Tensor out, const at::Tensor& acc, const at::Tensor& s, const at::Tensor& ws,
                 const c10::optional<at::Tensor>& bias) {
  scale_sums(out, acc, s, ws, bias, at::kFloat, "scale_float");
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quantize_rows_int8(Tensor(a!) q, Tensor(b!) s, Tensor x) -> ()");
  m.def("quantize_rows_u8(Tensor(a!) q, Tensor(b!) s, Tensor x) -> ()");
  m.def("scale_int32(Tensor(a!) out, Tensor acc, Tensor s, Tensor ws, Tensor? bias) -> ()");
  m.def("scale_float(Tensor(a!) out, Tensor acc, Tensor s, Tensor ws, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("quantize_rows_int8", &pagedllm::quantize_rows_int8);
  m.impl("quantize_rows_u8", &pagedllm::quantize_rows_u8);
  m.impl("scale_int32", &pagedllm::scale_int32);
  m.impl("scale_float", &pagedllm::scale_float);
}
