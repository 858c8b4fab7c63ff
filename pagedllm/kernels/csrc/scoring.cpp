// Prompt logprobs from logits rows: for each row, the given token's logprob and rank, and the
// top k, in two passes over the row (its max; then the sum of exp(x - max), the count of
// logits above the token's, and the top k) and nothing written but the answers.
//
// Why a kernel: torch needs a float copy of the bf16 row, a logsumexp, a compare-and-sum
// and a topk, each a pass that writes or reduces 49k floats a row: ~90 ms per 256 rows of
// SmolLM2 on 2 cores, more than the LM head's matmul. A row is computed by one thread in a
// fixed order, so its answers do not depend on the rows beside it (the prefix cache keeps
// them, and a recomputation must give the same bits).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The k best (value, index) of a row, best first; equal values keep the lower index first.
struct TopK {
  int k;
  std::vector<float> val;
  std::vector<int32_t> idx;
  float floor = NEG_INF;  // the k-th best so far: a value must beat it to enter (k = 0: none does)

  explicit TopK(int k_) : k(k_) { reset(); }

  void reset() {
    val.clear();
    idx.clear();
    floor = k ? NEG_INF : std::numeric_limits<float>::infinity();
  }

  void offer(float v, int32_t i) {
    if (k == 0 || (int(val.size()) == k && !(v > floor))) return;
    int pos = int(val.size());
    while (pos > 0 && v > val[pos - 1]) --pos;
    val.insert(val.begin() + pos, v);
    idx.insert(idx.begin() + pos, i);
    if (int(val.size()) > k) {
      val.pop_back();
      idx.pop_back();
    }
    if (int(val.size()) == k) floor = val.back();
  }
};

template <typename T>
void score_row(const T* x, int64_t V, int64_t want, TopK& top, float& logprob, int32_t& rank) {
  // Pass 1: the max (lanes past V read as -inf).
  vn m = splatn(NEG_INF);  // the CPU's own width (vec.h)
  alignas(64) float tail[LN];
  const int64_t full = V / LN * LN;
  for (int64_t i = 0; i < full; i += LN) {
    const vn v = loadn(x + i);
    m = v > m ? v : m;
  }
  for (int j = 0; j < LN; ++j) tail[j] = full + j < V ? float(x[full + j]) : NEG_INF;
  const vn vt = loadn(tail);
  m = vt > m ? vt : m;
  const float mx = hmaxn(m);
  const float raw = float(x[want]);
  // Pass 2: sum of exp(x - max), the count above the token's logit, the top k.
  vn sum{};
  vni above{};
  top.reset();
  auto chunk = [&](vn v, int64_t i) {
    sum += expn(v - mx);
    above += (v > raw) & 1;
    const vni in = v > top.floor;
    for (int j = 0; j < LN; ++j)
      if (in[j]) top.offer(v[j], int32_t(i + j));
  };
  for (int64_t i = 0; i < full; i += LN) chunk(loadn(x + i), i);
  chunk(vt, full);  // exp(-inf) = 0, and -inf is never above nor in the top
  const float lse = mx + std::log(hsumn(sum));
  int32_t count = 0;
  for (int j = 0; j < LN; ++j) count += above[j];
  logprob = raw - lse;
  rank = count + 1;
  for (auto& v : top.val) v -= lse;
}

// logits [R, V]; want int64 [R]: the token each row scores; k: how many of the best to return.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_rows(const at::Tensor& logits,
                                                                     const at::Tensor& want, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "score_rows: logits must be contiguous [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(want.scalar_type() == at::kLong && want.numel() == R && want.is_contiguous(),
              "score_rows: want must be int64 [R]");
  TORCH_CHECK(0 <= k && k <= V, "score_rows: k must be in [0, V]");
  const int64_t* w = want.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(0 <= w[r] && w[r] < V, "score_rows: token ", w[r], " outside [0, ", V, ")");
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lp = at::empty({R}, f32), top_lp = at::empty({R, k}, f32);
  at::Tensor rank = at::empty({R}, f32.dtype(at::kInt)), top_ids = at::empty({R, k}, f32.dtype(at::kInt));
  float *o_lp = lp.data_ptr<float>(), *o_top = top_lp.data_ptr<float>();
  int32_t *o_rank = rank.data_ptr<int32_t>(), *o_ids = top_ids.data_ptr<int32_t>();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* x = logits.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      TopK top{int(k)};
      for (int64_t r = b; r < e; ++r) {
        score_row(x + r * V, V, w[r], top, o_lp[r], o_rank[r]);
        for (int64_t j = 0; j < k; ++j) {  // fewer than k only if V < k, excluded above
          o_top[r * k + j] = top.val[j];
          o_ids[r * k + j] = top.idx[j];
        }
      }
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "score_rows: dtype ", logits.scalar_type(), " is not supported");
  }
  return {lp, rank, top_ids, top_lp};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("score_rows(Tensor logits, Tensor want, int k) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("score_rows", &pagedllm::score_rows); }
