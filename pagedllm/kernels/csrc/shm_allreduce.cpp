// All-reduce between the tensor-parallel ranks of one machine through shared memory:
// gloo goes through the loopback TCP stack, 0.2-3 ms per call measured here, and a decode
// step makes two per layer. Here each rank copies its partial sum into its own slot of a
// shared region, raises its flag, waits for the others' flags and adds all slots up
// itself, in rank order and in fp32: every rank computes the same bits, so the ranks'
// residual streams never drift apart.
//
// Region: [world flags, one cache line each][2 x world slots of `cap` bytes]. Call `seq`
// uses slot set seq & 1; a rank can only write set (seq & 1) again at seq + 2, after every
// rank raised its flag to seq + 1, i.e. finished reading call seq: two sets are enough.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "vec.h"

namespace pagedllm {
namespace {

constexpr int64_t FLAG_BYTES = 64;  // a cache line per flag: ranks do not false-share

std::atomic<int64_t>* flag(uint8_t* base, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + rank * FLAG_BYTES);
}

struct Region {
  uint8_t* base;
  int64_t world, cap;
  Region(const at::Tensor& region, int64_t world) : base(region.data_ptr<uint8_t>()), world(world) {
    TORCH_CHECK(region.is_contiguous() && region.scalar_type() == at::kByte, "shm region must be contiguous uint8");
    cap = (region.numel() - world * FLAG_BYTES) / (2 * world);
  }
  uint8_t* slot(int64_t seq, int64_t rank) const { return base + world * FLAG_BYTES + ((seq & 1) * world + rank) * cap; }
};

void check(const at::Tensor& x, const Region& r) {
  TORCH_CHECK(x.is_contiguous() && x.nbytes() <= static_cast<size_t>(r.cap),
              "shm all-reduce: x must be contiguous and at most ", r.cap, " bytes (the caller splits larger ones)");
}

template <typename T>
void sum_slots(T* out, const Region& r, int64_t seq, int64_t n) {
  constexpr int64_t CHUNK = 1024;
  at::parallel_for(0, (n + CHUNK - 1) / CHUNK, 16, [&](int64_t b, int64_t e) {
    alignas(64) float acc[CHUNK];
    for (int64_t c = b; c < e; ++c) {
      const int64_t lo = c * CHUNK, len = std::min(CHUNK, n - lo);
      std::fill(acc, acc + len, 0.0f);
      for (int64_t k = 0; k < r.world; ++k) {  // rank order: the same sum on every rank
        const T* src = reinterpret_cast<const T*>(r.slot(seq, k)) + lo;
        int64_t i = 0;
        for (; i + L <= len; i += L) storef(acc + i, loadf(acc + i) + load16(src + i));
        for (; i < len; ++i) acc[i] += static_cast<float>(src[i]);
      }
      int64_t i = 0;
      for (; i + L <= len; i += L) store16(out + lo + i, loadf(acc + i));
      for (; i < len; ++i) out[lo + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

void shm_post(const at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world, int64_t seq) {
  const Region r(region, world);
  check(x, r);
  std::memcpy(r.slot(seq, rank), x.data_ptr(), x.nbytes());
  flag(r.base, rank)->store(seq, std::memory_order_release);  // the copy is visible before the flag
}

// Waits up to timeout_ms for every rank's call `seq`, then writes the sum into x.
// False on timeout (nothing written): the caller checks whether a rank died, and waits again.
bool shm_wait_sum(at::Tensor x, const at::Tensor& region, int64_t world, int64_t seq, int64_t timeout_ms) {
  const Region r(region, world);
  check(x, r);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int64_t k = 0; k < world; ++k) {
    for (int64_t spins = 0; flag(r.base, k)->load(std::memory_order_acquire) < seq; ++spins) {
      // Spin briefly, then yield: the ranks may share fewer cores than there are ranks.
      if (spins > 256) std::this_thread::yield();
      if ((spins & 1023) == 1023 && std::chrono::steady_clock::now() > deadline) return false;
    }
  }
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat: sum_slots(x.data_ptr<float>(), r, seq, n); break;
    case at::kBFloat16: sum_slots(x.data_ptr<c10::BFloat16>(), r, seq, n); break;
    case at::kHalf: sum_slots(x.data_ptr<c10::Half>(), r, seq, n); break;
    default: TORCH_CHECK(false, "shm all-reduce: dtype ", x.scalar_type(), " is not supported");
  }
  return true;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("shm_post(Tensor x, Tensor region, int rank, int world, int seq) -> ()");
  m.def("shm_wait_sum(Tensor(a!) x, Tensor region, int world, int seq, int timeout_ms) -> bool");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("shm_post", &pagedllm::shm_post);
  m.impl("shm_wait_sum", &pagedllm::shm_wait_sum);
}
