// The per-token parts of the layers that keep a state (LFM2's short convolutions, Mamba-2's and
// Qwen3-Next's DeltaNet mixers), fused: each reads its inputs once and writes its output once,
// where the torch expressions they replace gathered a [T, K, D] copy of the inputs, multiplied,
// summed and activated in as many passes (Granite's and Qwen3-Next's steps spent 15-20 % of their
// time in them). Math in fp32, one rounding to the storage type.
//
// causal_conv: a depthwise causal convolution of kernel K over a step's rows, each row's K inputs
// given as rows of [u; read; zero] (models/state_step.py's taps: the step's own rows, the state its
// sequence's block held, or zero before the sequence starts), its bias and SiLU if asked; then the
// states the step leaves (each the K - 1 inputs before a block or chunk end) written to the pool.
//
// gated_rms_norm: Mamba-2's norm(y * silu(z)) * w, or Qwen3-Next's norm(y) * w * silu(z), over
// groups of n values of each row; w one weight a group's value (every group alike: Qwen3-Next's
// heads) or one a channel (Nemotron-H's groups of Mamba heads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

inline vf silu(vf a) { return a / (1.f + expv(-a)); }

// f(T()) for the storage type T of `dtype`.
template <class F>
void by_storage(at::ScalarType dtype, const char* what, F f) {
  if (dtype == at::kBFloat16)
    f(c10::BFloat16());
  else if (dtype == at::kFloat)
    f(float());
  else if (dtype == at::kHalf)
    f(c10::Half());
  else
    TORCH_CHECK(false, what, " must be bfloat16, float16 or float32");
}

// Rows [u; read; zero] as the taps number them: the step's own inputs u [T, D], then each chunk's
// K - 1 state rows read in place from its block, then zero (before a sequence's first token).
template <class T>
struct TapRows {
  const T* u;
  int64_t ld_u, t;
  const T* states;
  int64_t block_stride, w, d, r;
  const int64_t* read_blocks;
  const T* operator()(int64_t idx) const {
    if (idx < t) return u + idx * ld_u;
    if (idx < t + r) return states + read_blocks[(idx - t) / w] * block_stride + ((idx - t) % w) * d;
    return nullptr;
  }
};

template <class T, class O>
void conv_rows(O* out, const TapRows<T>& rows, const float* w, const float* bias, int64_t k, const int64_t* taps,
               bool act) {
  const int64_t d = rows.d;
  at::parallel_for(0, rows.t, std::max<int64_t>(1, (1 << 14) / d), [&](int64_t lo, int64_t hi) {
    std::vector<const T*> src(k);
    for (int64_t row = lo; row < hi; ++row) {
      for (int64_t j = 0; j < k; ++j) src[j] = rows(taps[row * k + j]);
      O* o = out + row * d;
      for (int64_t c = 0; c < d; c += L) {
        vf acc = bias ? loadf(bias + c) : vf{};
        for (int64_t j = 0; j < k; ++j)
          if (src[j]) acc += loadf(w + j * d + c) * load16(src[j] + c);
        store16(o + c, act ? silu(acc) : acc);
      }
    }
  });
}

// The states the step leaves, once every output is computed, the last written first. A state's
// rows come from its chunk's read block only for the chunk's first K - 2 positions, and the one
// write that can land in the read block (the block the chunk starts in) is its chunk's first:
// written last, each of its rows j takes state row > j of the same block, so row by row in order
// never overwrites a row still to be read. (No gathered copy of the read states: a decode step's
// was most of this kernel's time.)
template <class T>
void write_states(T* states, const TapRows<T>& rows, const int64_t* blocks, const int64_t* write_rows, int64_t n) {
  const int64_t w = rows.w, d = rows.d;
  for (int64_t i = n - 1; i >= 0; --i)
    for (int64_t j = 0; j < w; ++j) {
      const T* src = rows(write_rows[i * w + j]);
      T* dst = states + blocks[i] * rows.block_stride + j * d;
      if (src)
        std::memmove(dst, src, d * sizeof(T));
      else
        std::fill(dst, dst + d, T(0.f));
    }
}

template <class T, class Y>
void gated_norm_rows(T* out, const Y* y, const T* z, int64_t ld_z, const T* w, int64_t w_group, int64_t rows,
                     int64_t groups, int64_t n, float eps, bool gate_first) {
  at::parallel_for(0, rows * groups, std::max<int64_t>(1, (1 << 14) / n), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t row = p / groups, gi = p % groups;
      const Y* yr = y + row * groups * n + gi * n;
      const T* zr = z + row * ld_z + gi * n;
      T* o = out + row * groups * n + gi * n;
      const T* wg = w + gi * w_group;
      vf acc{};
      for (int64_t c = 0; c < n; c += L) {
        vf x = load16(yr + c);
        if (gate_first) x *= silu(load16(zr + c));
        acc += x * x;
      }
      const float inv = 1.f / std::sqrt(hsum(acc) / float(n) + eps);
      // either order ends as y silu(z) w / rms: only what the rms is taken of differs
      for (int64_t c = 0; c < n; c += L) store16(o + c, load16(yr + c) * silu(load16(zr + c)) * (inv * load16(wg + c)));
    }
  });
}

}  // namespace

// out [T, D] (float32, or u's dtype) = act(bias + sum_j weight[j] * rows[taps[:, j]]) with rows =
// [u; read; zero]: u [T, D] of any row stride, read the K - 1 rows of each chunk's state block
// states[read_blocks[i]] (states: a [blocks, K - 1, D] view of the pool, blocks states.stride(0)
// apart, u's dtype), read in place; weight float32 [K, D] (the taps' order), bias float32 [D] or
// None; then states[write_blocks[i]] = rows[write_rows[i]].
void causal_conv(at::Tensor out, const at::Tensor& u, at::Tensor states, const at::Tensor& read_blocks,
                 const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& taps, bool silu_act,
                 const at::Tensor& write_blocks, const at::Tensor& write_rows) {
  const int64_t t = u.size(0), d = u.size(1), w = states.size(1), k = w + 1, s = read_blocks.numel(), r = s * w;
  TORCH_CHECK(u.dim() == 2 && u.stride(1) == 1, "causal_conv: u [T, D], rows of any stride");
  TORCH_CHECK(states.scalar_type() == u.scalar_type() && states.dim() == 3 && states.size(2) == d &&
                  states.stride(2) == 1 && states.stride(1) == d,
              "causal_conv: states [blocks, K - 1, D] in u's dtype, each block's rows contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == k && weight.size(1) == d,
              "causal_conv: weight float32 [K, D] contiguous (K - 1 = states.size(1))");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == d),
              "causal_conv: bias float32 [D]");
  TORCH_CHECK(d % L == 0, "causal_conv: D must be a multiple of ", L, ", got ", d);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == t && out.size(1) == d && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == u.scalar_type()),
              "causal_conv: out [T, D] contiguous, float32 or u's dtype");
  TORCH_CHECK(taps.scalar_type() == at::kLong && taps.is_contiguous() && taps.numel() == t * k,
              "causal_conv: taps int64 [T, K]");
  TORCH_CHECK(read_blocks.scalar_type() == at::kLong && read_blocks.is_contiguous(),
              "causal_conv: read_blocks int64 [S]");
  const int64_t n = write_blocks.numel();
  TORCH_CHECK(write_blocks.scalar_type() == at::kLong && write_rows.scalar_type() == at::kLong &&
                  write_blocks.is_contiguous() && write_rows.is_contiguous() && write_rows.numel() == n * w,
              "causal_conv: write_blocks int64 [W], write_rows int64 [W, K - 1]");
  const int64_t* tp = taps.data_ptr<int64_t>();
  for (int64_t i = 0; i < t * k; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] <= t + r, "causal_conv: tap ", tp[i], " outside [0, ", t + r, "]");
  const int64_t* rb = read_blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < s; ++i)
    TORCH_CHECK(rb[i] >= 0 && rb[i] < states.size(0), "causal_conv: read block ", rb[i]);
  const int64_t* wb = write_blocks.data_ptr<int64_t>();
  const int64_t* wr = write_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(wb[i] >= 0 && wb[i] < states.size(0), "causal_conv: block ", wb[i]);
  for (int64_t i = 0; i < n * w; ++i) TORCH_CHECK(wr[i] >= 0 && wr[i] <= t + r, "causal_conv: write row ", wr[i]);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* st = states.data_ptr<T>();
    const TapRows<T> rows{u.data_ptr<T>(), u.stride(0), t, st, states.stride(0), w, d, r, rb};
    if (out.scalar_type() == at::kFloat)
      conv_rows(out.data_ptr<float>(), rows, weight.data_ptr<float>(), bp, k, tp, silu_act);
    else
      conv_rows(out.data_ptr<T>(), rows, weight.data_ptr<float>(), bp, k, tp, silu_act);
    write_states(st, rows, wb, wr, n);
  };
  by_storage(u.scalar_type(), "causal_conv: u", run);
}

// out [T, G * n] (z's dtype) = per group of n: norm(y * silu(z)) * w (gate_first) or norm(y) * w *
// silu(z); y [T, G * n] contiguous (float32 or z's dtype), z [T, G * n] of any row stride; w [n] (each
// group alike) or [G * n] (a weight a channel); n = group, or w's size where group is 0.
void gated_rms_norm(at::Tensor out, const at::Tensor& y, const at::Tensor& z, const at::Tensor& w, double eps,
                    bool gate_first, int64_t group) {
  const int64_t t = y.size(0), c = y.size(1), n = group > 0 ? group : w.numel();
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && z.dim() == 2 && z.size(0) == t && z.size(1) == c && z.stride(1) == 1 &&
                  out.is_contiguous() && out.sizes() == y.sizes() && out.scalar_type() == z.scalar_type() &&
                  w.scalar_type() == z.scalar_type() && w.is_contiguous() && n > 0 && c % n == 0 && n % L == 0 &&
                  (w.numel() == n || w.numel() == c) &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == z.scalar_type()),
              "gated_rms_norm: y [T, C] contiguous (float32 or z's dtype), z [T, C], out [T, C] and w [n] or [C] in "
              "z's dtype, groups of n (group, or w's size) a multiple of ", L, " dividing C");
  const int64_t w_group = w.numel() == c ? n : 0;   // per channel: each group its own n weights
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (y.scalar_type() == at::kFloat)
      gated_norm_rows(out.data_ptr<T>(), y.data_ptr<float>(), z.data_ptr<T>(), z.stride(0), w.data_ptr<T>(), w_group, t,
                      c / n, n, float(eps), gate_first);
    else
      gated_norm_rows(out.data_ptr<T>(), y.data_ptr<T>(), z.data_ptr<T>(), z.stride(0), w.data_ptr<T>(), w_group, t,
                      c / n, n, float(eps), gate_first);
  };
  by_storage(z.scalar_type(), "gated_rms_norm: z", run);
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("causal_conv(Tensor(a!) out, Tensor u, Tensor(b!) states, Tensor read_blocks, Tensor weight, Tensor? bias, "
        "Tensor taps, bool silu, Tensor write_blocks, Tensor write_rows) -> ()");
  m.def("gated_rms_norm(Tensor(a!) out, Tensor y, Tensor z, Tensor weight, float eps, bool gate_first, int group=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("causal_conv", &pagedllm::causal_conv);
  m.impl("gated_rms_norm", &pagedllm::gated_rms_norm);
}
