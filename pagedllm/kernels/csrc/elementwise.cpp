// The per-token parts of a decoder layer, fused: each reads and writes a row once,
// where the torch expressions they replace make 4-10 passes and as many temporaries
// (a decode step of a small model spent ~20 % of its time in them). Math in fp32,
// one rounding to the storage type, as torch's own kernels do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

namespace pagedllm {
namespace {

// Rows per thread below which one thread does it all (a barrier costs more).
constexpr int64_t MIN_ELEMS_PER_THREAD = 1 << 15;

template <typename F>
void for_rows(int64_t rows, int64_t cols, F f) {
  const int64_t grain = std::max<int64_t>(1, MIN_ELEMS_PER_THREAD / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(r);
  });
}

template <typename T>
inline void norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  vn acc{};
  for (int64_t i = 0; i < n; i += LN) {
    const vn v = loadn(x + i);
    acc += v * v;
  }
  const float inv = 1.f / std::sqrt(hsumn(acc) / float(n) + eps);
  for (int64_t i = 0; i < n; i += LN) storen(out + i, loadn(x + i) * inv * loadn(w + i));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t n = x.size(1);
  T* o = out.data_ptr<T>();
  const T *xs = x.data_ptr<T>(), *ws = w.data_ptr<T>();
  for_rows(x.size(0), n, [&](int64_t r) { norm_row(o + r * n, xs + r * n, ws, n, float(eps)); });
}

// residual += x (rounded to T, as an unfused add would be); x = rms_norm(residual) * w.
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t n = x.size(1);
  T *xs = x.data_ptr<T>(), *rs = residual.data_ptr<T>();
  const T* ws = w.data_ptr<T>();
  for_rows(x.size(0), n, [&](int64_t r) {
    T *xr = xs + r * n, *rr = rs + r * n;
    for (int64_t i = 0; i < n; i += LN) storen(rr + i, loadn(rr + i) + loadn(xr + i));
    norm_row(xr, rr, ws, n, float(eps));
  });
}

// silu(a) = a / (1 + e^-a)
inline vn silu(vn a) { return a / (1.f + expn(-a)); }

// The tanh form of GELU (torch's approximate="tanh", Gemma's gelu_pytorch_tanh):
// 0.5 a (1 + tanh(u)) with u = sqrt(2/pi) (a + 0.044715 a^3), which is a sigmoid(2u).
inline vn gelu_tanh(vn a) {
  const vn u2 = (a + 0.044715f * a * a * a) * 1.5957691216057308f;  // 2 sqrt(2/pi)
  return a / (1.f + expn(-u2));
}

// out = act(x[:, :n]) * x[:, n:]
template <typename T, typename Act>
void act_and_mul_impl(at::Tensor& out, const at::Tensor& x, Act act) {
  const int64_t n = out.size(1);
  T* o = out.data_ptr<T>();
  const T* xs = x.data_ptr<T>();
  for_rows(x.size(0), n, [&](int64_t r) {
    const T* g = xs + r * 2 * n;
    for (int64_t i = 0; i < n; i += LN) storen(o + r * n + i, act(loadn(g + i)) * loadn(g + n + i));
  });
}

// Rotate-half RoPE in place on rows of heads: x[t, h] for the token's position.
template <typename T>
void rope_rows(T* base, int64_t s_tok, int64_t s_head, int64_t heads, int64_t d, const int64_t* pos,
               const float* cos, const float* sin, int64_t t) {
  const int64_t half = d / 2;
  const float* c = cos + pos[t] * half;
  const float* s = sin + pos[t] * half;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + t * s_tok + h * s_head;
    for (int64_t i = 0; i < half; i += LN) {
      const vn x1 = loadn(x + i), x2 = loadn(x + half + i), cv = loadn(c + i), sv = loadn(s + i);
      storen(x + i, x1 * cv - x2 * sv);
      storen(x + half + i, x2 * cv + x1 * sv);
    }
  }
}

template <typename T>
void rope_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = q.size(2);
  T *qs = q.data_ptr<T>(), *ks = k.data_ptr<T>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  for_rows(q.size(0), (q.size(1) + k.size(1)) * d, [&](int64_t t) {
    rope_rows(qs, q.stride(0), q.stride(1), q.size(1), d, p, c, s, t);
    rope_rows(ks, k.stride(0), k.stride(1), k.size(1), d, p, c, s, t);
  });
}

template <typename F>
void by_dtype(const at::Tensor& t, const char* op, F f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " is not supported");
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) &&
                  x.size(1) % L == 0 && w.scalar_type() == x.scalar_type(),
              op, ": x must be contiguous [T, n] with n a multiple of 16, weight [n] of its dtype");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be like x");
  by_dtype(x, "rms_norm", [&](auto t) { rms_norm_impl<decltype(t)>(out, x, w, eps); });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be like x");
  by_dtype(x, "add_rms_norm", [&](auto t) { add_rms_norm_impl<decltype(t)>(x, residual, w, eps); });
}

void check_act(const at::Tensor& out, const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous() &&
                  out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) && out.size(1) % L == 0 &&
                  out.scalar_type() == x.scalar_type(),
              op, ": x [T, 2n] and out [T, n] contiguous, n a multiple of 16");
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_act(out, x, "silu_and_mul");
  by_dtype(x, "silu_and_mul", [&](auto t) { act_and_mul_impl<decltype(t)>(out, x, silu); });
}

void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  check_act(out, x, "gelu_tanh_and_mul");
  by_dtype(x, "gelu_tanh_and_mul", [&](auto t) { act_and_mul_impl<decltype(t)>(out, x, gelu_tanh); });
}

void rope(at::Tensor q, at::Tensor k, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % (2 * L) == 0 &&
                  q.scalar_type() == k.scalar_type(),
              "rope: q [T, H, D] and k [T, KVH, D] with D a multiple of 32, contiguous in D");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == q.size(0) && pos.is_contiguous(),
              "rope: positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && 2 * cos.size(1) == q.size(2),
              "rope: cos and sin must be float32 [max_positions, D / 2]");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rope: position ", p[t], " is outside the table of ", cos.size(0));
  by_dtype(q, "rope", [&](auto t) { rope_impl<decltype(t)>(q, k, pos, cos, sin); });
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &pagedllm::rms_norm);
  m.impl("add_rms_norm", &pagedllm::add_rms_norm);
  m.impl("silu_and_mul", &pagedllm::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &pagedllm::gelu_tanh_and_mul);
  m.impl("rope", &pagedllm::rope);
}
